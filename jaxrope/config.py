"""``RopeConfig``: everything that decides a rotated value, frozen and hashable.

A config is a static argument of jitted functions: equal configs hash equal, and
:meth:`RopeConfig.fingerprint` gives bytes that are identical across processes and
numpy versions, for prefix-cache roots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Optional, Tuple

import numpy as np

from jaxrope import cos_sin_cache as _cos_sin
from jaxrope import frequencies as _frequencies
from jaxrope import hf as _hf
from jaxrope.numbers import as_float, as_int
from jaxrope.scaling import SCALING_TYPES, DynamicNTK, LongRope, Scaling

# Bumped whenever the arithmetic changes what a given config produces.
_FINGERPRINT_VERSION = "jaxrope.rope/1"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one attention layer.

    Args:
      head_dim: ``D``, the last dimension of q and k; even.
      rotary_dim: ``R``, the leading dims that rotate (default ``head_dim``); even,
        ``<= head_dim``. Dims ``[R, D)`` pass through untouched.
      theta: the RoPE base (HF ``rope_theta``), > 0.
      interleave: False (default) rotates NeoX halves, pairs ``(x[i], x[i + R/2])``,
        i.e. ``x[..., :R//2]`` with ``x[..., R//2:R]``; True rotates GPT-J pairs
        ``(x[2i], x[2i+1])``, i.e. ``x[..., 0:R:2]`` with ``x[..., 1:R:2]``.
      max_position: positions must be in ``[0, max_position)``; also the sequence
        length at which dynamic NTK and LongRoPE fix their frequencies (a serving
        policy: see :meth:`frequencies`). At most ``2**24``.
      scaling: None or one of :class:`Linear`, :class:`DynamicNTK`, :class:`Llama3`,
        :class:`Yarn`, :class:`LongRope`, :class:`Proportional`.
      mrope_section: None (default: 1-D RoPE, ``pos_ids [T]``) or M-RoPE's
        ``(s_t, s_h, s_w)``: ints >= 0 summing to ``R/2``, how many of the ``R/2``
        frequency slots take their position from the t, h and w rows of
        ``pos_ids [3, T]`` (Qwen2-VL ``(16, 24, 24)``). A list is stored as a tuple.
      mrope_interleaved: False (default) gives slot ``j`` row t for ``j < s_t``, h for
        ``j < s_t + s_h``, w otherwise (Qwen2-VL, Qwen2.5-VL, GLM-4.1V); True
        interleaves them (Qwen3-VL): h where ``j % 3 == 1 and j < 3 * s_h``, w where
        ``j % 3 == 2 and j < 3 * s_w``, t elsewhere. Either way both elements of a
        pair (NeoX halves or GPT-J pairs, per ``interleave``) share the slot's position.

    Numbers may be Python or numpy scalars (``np.int64(128)``); they are stored as
    Python ``int`` / ``float``, so the config hashes and fingerprints the same either way.

    Raises:
      TypeError: naming the field, for a value of the wrong type (``head_dim="128"``,
        ``head_dim=128.0``, ``interleave=1``, ``scaling="llama3"``, ``mrope_section`` not a
        sequence of three ints, ``mrope_interleaved`` not a bool).
      ValueError: naming the field, for a value out of range or inconsistent with
        another field.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=128, theta=500000.0, scaling=jr.Llama3())
      >>> inv_freq, attention = cfg.frequencies()
      >>> inv_freq.shape, attention
      ((64,), 1.0)
      >>> jr.RopeConfig(head_dim=128, theta=1e6, mrope_section=[16, 24, 24]).mrope_section
      (16, 24, 24)
    """

    head_dim: int
    rotary_dim: Optional[int] = None
    theta: float = 10000.0
    interleave: bool = False
    max_position: int = 131072
    scaling: Scaling = None
    mrope_section: Optional[Tuple[int, int, int]] = None
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        # One check per field, in field order; each stores the normalised value.
        head_dim = as_int(self.head_dim, "head_dim")
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive even int")
        object.__setattr__(self, "head_dim", head_dim)
        rotary_dim = head_dim if self.rotary_dim is None else as_int(self.rotary_dim, "rotary_dim")
        if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim={rotary_dim!r} must be even, > 0 and <= {head_dim=}")
        object.__setattr__(self, "rotary_dim", rotary_dim)
        theta = as_float(self.theta, "theta")
        if theta <= 0:
            raise ValueError(f"theta={self.theta!r} must be a finite number > 0")
        object.__setattr__(self, "theta", theta)
        if not isinstance(self.interleave, (bool, np.bool_)):
            raise TypeError(f"interleave={self.interleave!r} must be a bool")
        object.__setattr__(self, "interleave", bool(self.interleave))
        max_position = as_int(self.max_position, "max_position")
        if not 0 < max_position <= _frequencies.MAX_ACCURATE_POSITION:
            raise ValueError(f"max_position={self.max_position!r} must be an int in "
                             f"[1, {_frequencies.MAX_ACCURATE_POSITION}]")
        object.__setattr__(self, "max_position", max_position)
        if self.scaling is not None and not isinstance(self.scaling, SCALING_TYPES):
            raise TypeError(f"scaling={self.scaling!r} must be None or one of "
                            f"{[t.__name__ for t in SCALING_TYPES]}")
        if isinstance(self.scaling, LongRope):
            for name in ("short_factor", "long_factor"):
                n = len(getattr(self.scaling, name))
                if n != rotary_dim // 2:
                    raise ValueError(f"LongRope.{name} has {n} entries; expected rotary_dim // 2 = "
                                     f"{rotary_dim // 2}")
        if isinstance(self.scaling, DynamicNTK) and rotary_dim <= 2:
            raise ValueError(f"rotary_dim={rotary_dim} must be > 2 for DynamicNTK")
        self._check_mrope(rotary_dim // 2)

    def _check_mrope(self, slots: int) -> None:
        section, interleaved = self.mrope_section, self.mrope_interleaved
        if not isinstance(interleaved, bool):
            raise TypeError(f"mrope_interleaved={interleaved!r} must be a bool")
        if section is None:
            if interleaved:
                raise ValueError("mrope_interleaved=True needs an mrope_section")
            return
        if (not isinstance(section, (tuple, list)) or len(section) != 3
                or any(not isinstance(s, int) or isinstance(s, bool) for s in section)):
            raise TypeError(f"mrope_section={section!r} must be three ints (t, h, w slots)")
        section = tuple(section)
        object.__setattr__(self, "mrope_section", section)
        if min(section) < 0 or sum(section) != slots:
            raise ValueError(f"mrope_section={section} must be ints >= 0 summing to "
                             f"rotary_dim // 2 = {slots}")
        _, s_h, s_w = section
        # Interleaved slots: h at 1, 4, ..., 3*s_h - 2 and w at 2, 5, ..., 3*s_w - 1; a
        # run past the last slot would give its row fewer slots than its section says.
        if interleaved and (3 * s_h > slots + 1 or 3 * s_w > slots):
            raise ValueError(
                f"mrope_section={section} with mrope_interleaved=True places h at slots "
                f"j % 3 == 1, j < {3 * s_h} and w at j % 3 == 2, j < {3 * s_w}: both runs must "
                f"end inside rotary_dim // 2 = {slots} slots (3 * s_h <= {slots + 1}, "
                f"3 * s_w <= {slots})")

    # -- values -----------------------------------------------------------------------

    def frequencies(self, seq_len: Optional[int] = None) -> Tuple[np.ndarray, float]:
        """Float64 ``inv_freq`` ``[R/2]`` and the attention factor, HF semantics.

        ``seq_len`` matters only for :class:`DynamicNTK` (the base grows past the
        trained length) and :class:`LongRope` with ``factors="auto"`` (long factors past
        ``original_max_position``); None is HF's value at initialisation.
        The attention factor multiplies cos and sin, as HF does.

        Raises:
          TypeError: ``seq_len`` is not None or an int.
          ValueError: ``seq_len`` is negative.
        """
        if seq_len is not None:
            seq_len = as_int(seq_len, "seq_len")
            if seq_len < 0:
                raise ValueError(f"seq_len={seq_len!r} must be None or a non-negative int")
        return _frequencies.compute(self.scaling, self.rotary_dim, self.theta, self.max_position,
                                    seq_len)

    def serving_frequencies(self) -> Tuple[np.ndarray, float]:
        """The frequencies every kernel uses: ``frequencies(seq_len=max_position)``.

        Dynamic NTK and LongRoPE change their frequencies with the sequence length.
        Switching mid-sequence would leave keys already in the KV cache rotated with
        the old frequencies, so (like vLLM) the choice is fixed once per config, at
        the longest sequence it will serve (LongRoPE: see :class:`LongRope` ``factors``).
        """
        return self.frequencies(seq_len=self.max_position)

    def cos_sin_cache(self, max_position: int, dtype: Any = np.float32) -> np.ndarray:
        """The cos/sin table other RoPE kernels read, ``[max_position, R]``.

        Row ``p`` is ``cos(p f)`` for the ``R/2`` :meth:`serving_frequencies` ``f``, then
        ``sin(p f)``, times the attention factor, in float64 cast to ``dtype``: rows ``0 ..
        max_position - 1`` of :func:`jaxrope.cos_sin_cache.cos_sin_rows`, the one
        implementation (whose module says which FlashInfer and vLLM calls read it).

        Args:
          max_position: rows ``[0, max_position)``, at most ``self.max_position``.
          dtype: float32 (default), float64, float16 or bfloat16.

        Raises:
          TypeError: ``max_position`` is not an int.
          ValueError: ``max_position`` is outside ``[1, self.max_position]`` or
            ``dtype`` is not one of the above.

        Example:
          >>> import numpy as np, jaxrope as jr
          >>> cache = jr.RopeConfig(head_dim=8, rotary_dim=4, theta=100.0).cos_sin_cache(3)
          >>> cache.shape, cache.dtype
          ((3, 4), dtype('float32'))
          >>> np.allclose(cache[2], [np.cos(2), np.cos(0.2), np.sin(2), np.sin(0.2)])
          True
        """
        max_position = as_int(max_position, "max_position")
        if not 0 < max_position <= self.max_position:
            raise ValueError(f"max_position={max_position} must be in [1, "
                             f"{self.max_position}] (cfg.max_position)")
        return _cos_sin.cos_sin_rows(self, np.arange(max_position), dtype)

    def fingerprint(self) -> bytes:
        """SHA-256 of a canonical description; equal configs give equal bytes everywhere.

        Numbers are written by value with ``float.hex`` (40 and 40.0 alike), so no
        printing or numpy version can change the bytes.
        """
        description = _canonical(self)
        if self.mrope_section is None:
            # A 1-D config keeps the bytes it had before M-RoPE existed: prefix caches
            # keyed by them stay valid.
            del description["mrope_section"], description["mrope_interleaved"]
        payload = json.dumps([_FINGERPRINT_VERSION, description], sort_keys=True,
                             separators=(",", ":"))
        return hashlib.sha256(payload.encode()).digest()

    # -- construction from a HF config ------------------------------------------------

    @classmethod
    def from_hf(cls, config: Any, *, layer_type: Optional[str] = None,
                max_position: Optional[int] = None, interleave: Optional[bool] = None,
                longrope_factors: str = "auto") -> "RopeConfig":
        """Build the rotation of a HF transformers model from its config.

        See :mod:`jaxrope.hf` for what is read from each model family, the
        sub-config used (a nested ``text_config`` when present), per-layer-type
        configs and what is refused.

        Args:
          config: a ``config.json`` as a dict, a path to one (or to its directory),
            or an object with ``to_dict()`` (a transformers ``PretrainedConfig``).
          layer_type: the layer type to build (``"sliding_attention"``,
            ``"full_attention"``, ...) for models whose layer types rotate differently.
          max_position: positions to serve; default the length the model serves.
          interleave: overrides the model table's layout (True: GPT-J pairs).
          longrope_factors: :class:`LongRope` ``factors`` ("auto", "short", "long").

        Raises:
          TypeError: ``config`` or a field has the wrong type.
          ValueError: naming the field, for a value that cannot be honoured or is
            inconsistent.
          NotImplementedError: the model rotates in a way jaxrope does not implement
            (an M-RoPE layout :mod:`jaxrope.mrope.hf` does not know, e.g. GLM-4.5V's).

        Example:
          >>> import jaxrope as jr
          >>> cfg = jr.RopeConfig.from_hf({"model_type": "cohere", "hidden_size": 8192,
          ...                              "num_attention_heads": 64, "rope_theta": 8e6,
          ...                              "max_position_embeddings": 131072})
          >>> cfg.head_dim, cfg.interleave, cfg.theta
          (128, True, 8000000.0)
        """
        return _hf.config_from_hf(cls, config, layer_type=layer_type, max_position=max_position,
                                  interleave=interleave, longrope_factors=longrope_factors)


def _canonical(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        # By value: from_hf passes JSON ints (Yarn factor 40) where a user writes 40.0,
        # and the two configs compare equal, so their bytes must too.
        return float.hex(float(value))
    if isinstance(value, tuple):
        return [_canonical(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {"type": type(value).__name__,
                **{f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    raise TypeError(f"cannot fingerprint {value!r}")
