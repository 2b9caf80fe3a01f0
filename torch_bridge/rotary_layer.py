"""A rotary layer with vLLM's call shape: ``rotary_emb(positions, query, key) -> (query, key)``.

An engine built around vLLM's ``RotaryEmbedding`` swaps this in where the model builds
its rotary layer: same call, flattened heads ``[T, H * D]`` (often views of one qkv
buffer), in place, positions from the engine's own scheduler (no
:class:`torch_bridge.RopeManager`). The rotation is jaxrope's: frequencies in float64
from the :class:`jaxrope.RopeConfig`, the accurate angle of
:mod:`jaxrope.ops.angle` at any position, float32 math, q and k kept in their
dtype. Under ``torch.compile`` the call is the ``jaxrope::rope_`` custom op
(:mod:`torch_bridge.custom_ops`): no graph break, T dynamic, capturable on CUDA.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from jaxrope.config import RopeConfig
from torch_bridge import custom_ops

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(torch.nn.Module):
    """``forward(positions, query, key) -> (query, key)``, rotated in place.

    Args:
      cfg: the :class:`jaxrope.RopeConfig` (``from_hf`` builds it from a model's
        config); an M-RoPE config (``cfg.mrope_section``) takes ``[3, T]`` positions.

    Attributes:
      cfg: the config.
      head_size, rotary_dim, is_neox_style: vLLM's names for ``cfg.head_dim``,
        ``cfg.rotary_dim`` and ``not cfg.interleave`` (halves rather than pairs).

    Raises:
      TypeError: ``cfg`` is not a RopeConfig.

    Example:
      >>> import torch, jaxrope as jr
      >>> rotary = RotaryEmbedding(jr.RopeConfig(head_dim=8))
      >>> qkv = torch.ones(3, (4 + 2 + 2) * 8)               # Hq=4, Hk=2, one buffer
      >>> q, k, v = qkv.split([4 * 8, 2 * 8, 2 * 8], dim=-1)  # non-contiguous views
      >>> q2, k2 = rotary(torch.tensor([0, 1, 2]), q, k)
      >>> q2 is q, qkv[0, :8].tolist() == [1.0] * 8, bool((qkv[1, :8] != 1).any())
      (True, True, True)
    """

    def __init__(self, cfg: RopeConfig):
        if not isinstance(cfg, RopeConfig):
            raise TypeError(f"cfg must be a RopeConfig, got {type(cfg).__name__}")
        super().__init__()
        self.cfg = cfg
        self.head_size = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.is_neox_style = not cfg.interleave
        self._config = custom_ops.config_key(cfg)

    @classmethod
    def from_hf(cls, config: Any, **kwargs: Any) -> "RotaryEmbedding":
        """The layer of a HF model's config (``config.json`` dict or transformers config);
        keyword arguments as :meth:`jaxrope.RopeConfig.from_hf` (``layer_type``,
        ``max_position``, ``interleave``, ``longrope_factors``).

        Raises:
          TypeError, ValueError: as :meth:`jaxrope.RopeConfig.from_hf`.
        """
        return cls(RopeConfig.from_hf(config, **kwargs))

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` and ``key`` in place at ``positions``.

        Args:
          positions: integer ``[T]`` (vLLM's int64), or ``[3, T]`` (t, h, w rows) for
            an M-RoPE config, on the tensors' device; values in ``[0,
            cfg.max_position)``, not checked (they are on the device).
          query: ``[T, Hq * D]`` or ``[T, Hq, D]``, float32/float16/bfloat16; may be a
            non-contiguous view (a slice of a fused qkv buffer).
          key: ``[T, Hk * D]`` or ``[T, Hk, D]``, query's dtype and ``T``.

        Returns:
          ``(query, key)``: the tensors given, rotated; dims ``[rotary_dim, D)`` untouched.

        Raises:
          NotImplementedError: ``key`` is None (vLLM allows it for cross-layer KV sharing;
            rotate q with the key of its own layer instead).
          TypeError, ValueError: as :func:`torch_bridge.custom_ops.rope_` (the argument
            named).
        """
        if key is None:
            raise NotImplementedError("key=None is not supported: jaxrope rotates q and k "
                                      "together; pass the layer's key")
        custom_ops.rope_(query, key, positions, self._config)
        return query, key

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"is_neox_style={self.is_neox_style}, scaling={self.cfg.scaling!r}")
