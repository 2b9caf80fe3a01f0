"""How ``RopeManager.apply_qk`` rotates torch tensors: per-call configs, a fast launcher, JAX.

``apply_qk`` takes FlashInfer's per-call overrides (its parameters' names); :class:`ConfigCache`
maps them onto a :class:`jaxrope.RopeConfig`. The rotation itself first asks an optional
*launcher* (:class:`torch_bridge.launch.dispatch.Launcher`, e.g.
:class:`torch_bridge.launch.mosaic.MosaicLauncher`) and, when there is
none or it declines by raising :class:`jaxrope.BackendUnavailable`, runs
:class:`JaxRotation`: the jaxrope kernel through DLPack (see :mod:`torch_bridge.dlpack`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import jax
import torch

from jaxrope.ops import backends as _backend
from jaxrope.ops.rope.api import SUPPORTED_DTYPES
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.config import RopeConfig
from jaxrope.scaling import Linear, Llama3
from torch_bridge.dlpack import InPlace, pad_tokens, read_only, token_bucket, write_back

__all__ = ["ConfigCache", "JaxRotation", "TORCH_DTYPES"]

# The torch dtypes of jaxrope's SUPPORTED_DTYPES (defined there once).
TORCH_DTYPES = tuple(getattr(torch, dtype.name) for dtype in SUPPORTED_DTYPES)

# FlashInfer's llama31 defaults, used for the llama31 parameters a call leaves out.
_LLAMA31_DEFAULTS = {"rope_scale": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "old_context_len": 8192}
LLAMA31_PARAMS = ("low_freq_factor", "high_freq_factor", "old_context_len")


class ConfigCache:
    """Per-call overrides -> :class:`RopeConfig`, cached by every override value.

    Mapping (FlashInfer's meaning of each parameter):

    - ``rotary_dim``, ``interleave``, ``rope_theta`` replace the base config's
      ``rotary_dim``, ``interleave``, ``theta``.
    - ``rope_scale`` alone replaces the scaling with ``Linear(rope_scale)`` (FlashInfer
      divides positions by it); ``rope_scale=1`` means no scaling.
    - any llama31 parameter (``low_freq_factor``, ``high_freq_factor``,
      ``old_context_len``) replaces the scaling with
      ``Llama3(factor=rope_scale, low_freq_factor, high_freq_factor,
      original_max_position=old_context_len)``, FlashInfer's defaults (8, 1, 4, 8192)
      for the ones left out.
    - no override keeps the base config as is.

    Example:
      >>> cache = ConfigCache(RopeConfig(head_dim=64))
      >>> cache.get(rope_scale=4.0).scaling
      Linear(factor=4.0)
    """

    def __init__(self, base: RopeConfig):
        self.base = base
        self._configs: Dict[Tuple, RopeConfig] = {}

    def get(self, rotary_dim: Optional[int] = None, interleave: Optional[bool] = None,
            rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
            **llama31: Any) -> RopeConfig:
        """The config for these overrides.

        Raises:
          TypeError: an unknown keyword argument.
          ValueError: an override the config rejects (naming the field).
        """
        key = (rotary_dim, interleave, rope_scale, rope_theta, tuple(sorted(llama31.items())))
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._configs[key] = self._build(rotary_dim, interleave, rope_scale, rope_theta,
                                                   llama31)
        return cfg

    def _build(self, rotary_dim, interleave, rope_scale, rope_theta, llama31) -> RopeConfig:
        unknown = sorted(set(llama31) - set(LLAMA31_PARAMS))
        if unknown:
            raise TypeError(f"apply_qk got unexpected keyword arguments {unknown}; the llama31 "
                            f"parameters are {list(LLAMA31_PARAMS)}")
        changes: Dict[str, Any] = {}
        if rotary_dim is not None:
            changes["rotary_dim"] = rotary_dim
        if interleave is not None:
            changes["interleave"] = interleave
        if rope_theta is not None:
            changes["theta"] = rope_theta
        if llama31:
            params = {**_LLAMA31_DEFAULTS, **llama31}
            if rope_scale is not None:
                params["rope_scale"] = rope_scale
            changes["scaling"] = Llama3(factor=params["rope_scale"],
                                        low_freq_factor=params["low_freq_factor"],
                                        high_freq_factor=params["high_freq_factor"],
                                        original_max_position=params["old_context_len"])
        elif rope_scale is not None:
            if isinstance(rope_scale, bool) or not isinstance(rope_scale, (int, float)) or rope_scale <= 0:
                raise ValueError(f"{rope_scale=} must be a number > 0")
            changes["scaling"] = None if rope_scale == 1 else Linear(factor=float(rope_scale))
        if not changes:
            return self.base
        return dataclasses.replace(self.base, **changes)


def _rotate(q, k, pos_ids, tables, *, impl, rotary_dim: int, interleave: bool,
            attention_factor: float, mrope_section, mrope_interleaved: bool):
    return impl(q, k, pos_ids, tables, rotary_dim=rotary_dim, interleave=interleave,
                attention_factor=attention_factor, mrope_section=mrope_section,
                mrope_interleaved=mrope_interleaved)


def torch_capability(device: torch.device) -> Optional[str]:
    """A CUDA torch device's compute capability ("9.0"), else None."""
    if device.type != "cuda":
        return None
    return "{}.{}".format(*torch.cuda.get_device_capability(device))


class JaxRotation:
    """The JAX path: the jaxrope kernel on DLPack imports of q and k, written in place.

    The jitted call sees ``T`` rounded up to a token bucket
    (:func:`torch_bridge.dlpack.token_bucket`: powers of two, at least 16), so it compiles
    once per bucket, not once per token count: q and k are staged into bucket-sized copies
    (padding tokens at position 0) and only their first ``T`` rows are written back. A
    ``T`` that is a bucket already runs on the tensors themselves, and with
    ``allow_copy=False`` q and k are never staged (one compile per token count).

    Args:
      device: the JAX device the tensors live on.
      backend: the jaxrope backend ("auto": :func:`jaxrope.ops.backends.backend_name`'s rule).

    Example:
      >>> rot = JaxRotation(jax.devices("cpu")[0])
      >>> q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
      >>> rot(q, k, torch.arange(3, dtype=torch.int32), RopeConfig(head_dim=8))
    """

    def __init__(self, device: jax.Device, backend: str = "auto"):
        self.device = device
        self.impl = _backend.resolve(backend, device.platform,
                                     compute_capability=_backend.device_capability(device))
        self.call = InPlace(_rotate, 2, static_argnames=("impl", "rotary_dim", "interleave",
                                                         "attention_factor", "mrope_section",
                                                         "mrope_interleaved"))
        self._tables: Dict[RopeConfig, Tuple[jax.Array, float]] = {}

    @staticmethod
    def check_backend(backend: str, device: torch.device) -> None:
        """Raise as :func:`jaxrope.ops.backends.resolve` would for ``backend`` on ``device``,
        without creating a JAX device (JAX's GPU client is costly to start)."""
        _backend.backend_name(backend, device.type, compute_capability=torch_capability(device))

    def constants(self, cfg: RopeConfig) -> Tuple[jax.Array, float]:
        """Angle tables on the device and the attention factor, cached per config."""
        entry = self._tables.get(cfg)
        if entry is None:
            tables, attention = kernel_constants(cfg)
            entry = self._tables[cfg] = (jax.device_put(tables, self.device), attention)
        return entry

    def __call__(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, cfg: RopeConfig,
                 allow_copy: bool = True) -> None:
        """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` in place at ``pos_ids[..., :T]`` (int32
        ``[N >= T]``; M-RoPE ``[3, N]``) on q's device."""
        tokens = q.shape[0]
        size = token_bucket(tokens) if allow_copy else tokens
        staged = [pad_tokens(x, size) for x in (q, k)]
        tables, _ = self.constants(cfg)
        self.call(staged, read_only(pad_tokens(pos_ids, size, dim=-1), True), tables,
                  allow_copy=allow_copy, impl=self.impl, **kernel_options(cfg))
        for x, padded in zip((q, k), staged):
            write_back(x, padded)
