"""``RopeConfig``: everything that decides a rotated value, frozen and hashable.

A config is a static argument of jitted functions: equal configs hash equal, and
:meth:`RopeConfig.fingerprint` gives bytes that are identical across processes and
numpy versions, for prefix-cache roots.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Mapping, Optional, Tuple

import numpy as np

from jaxrope import frequencies as _frequencies
from jaxrope.scaling import (SCALING_TYPES, DynamicNTK, Linear, Llama3, LongRope, Proportional,
                             Scaling, Yarn)

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

    Raises:
      ValueError: naming the field, for any inconsistent value.
      TypeError: ``mrope_section`` is not a sequence of three ints, or
        ``mrope_interleaved`` not a bool.

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
        head_dim = self.head_dim
        if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim={head_dim!r} must be a positive even int")
        rotary_dim = head_dim if self.rotary_dim is None else self.rotary_dim
        if (not isinstance(rotary_dim, int) or isinstance(rotary_dim, bool) or rotary_dim <= 0
                or rotary_dim % 2 or rotary_dim > head_dim):
            raise ValueError(f"rotary_dim={rotary_dim!r} must be even, > 0 and <= {head_dim=}")
        object.__setattr__(self, "rotary_dim", rotary_dim)
        theta = self.theta
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"theta={theta!r} must be a finite number > 0")
        object.__setattr__(self, "theta", float(theta))
        if not isinstance(self.interleave, bool):
            raise ValueError(f"interleave={self.interleave!r} must be a bool")
        max_position = self.max_position
        if (not isinstance(max_position, int) or isinstance(max_position, bool) or max_position <= 0
                or max_position > _frequencies.MAX_ACCURATE_POSITION):
            raise ValueError(f"max_position={max_position!r} must be an int in "
                             f"[1, {_frequencies.MAX_ACCURATE_POSITION}]")
        if self.scaling is not None and not isinstance(self.scaling, SCALING_TYPES):
            raise ValueError(f"scaling={self.scaling!r} must be None or one of "
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
        trained length) and :class:`LongRope` (long factors past
        ``original_max_position``); None is HF's value at initialisation.
        The attention factor multiplies cos and sin, as HF does.
        """
        if seq_len is not None and (not isinstance(seq_len, int) or seq_len < 0):
            raise ValueError(f"seq_len={seq_len!r} must be None or a non-negative int")
        return _frequencies.compute(self.scaling, self.rotary_dim, self.theta, self.max_position,
                                    seq_len)

    def serving_frequencies(self) -> Tuple[np.ndarray, float]:
        """The frequencies every kernel uses: ``frequencies(seq_len=max_position)``.

        Dynamic NTK and LongRoPE change their frequencies with the sequence length.
        Switching mid-sequence would leave keys already in the KV cache rotated with
        the old frequencies, so (like vLLM) the choice is fixed once per config, at
        the longest sequence it will serve.
        """
        return self.frequencies(seq_len=self.max_position)

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

    # -- construction from a HF config.json ------------------------------------------

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], *, max_position: Optional[int] = None) -> "RopeConfig":
        """Build from a HF ``config.json`` dict.

        Reads ``rope_theta`` (or ``rotary_emb_base``), ``rope_scaling`` or
        ``rope_parameters`` (``rope_type`` or legacy ``type``), ``partial_rotary_factor``
        (or ``rotary_pct``, or GPT-J's ``rotary_dim``), ``head_dim`` (else
        ``hidden_size / num_attention_heads``), ``max_position_embeddings``.
        DeepSeek-V2/V3 (``qk_rope_head_dim``) and GPT-J rotate interleaved pairs.

        ``max_position`` defaults to the length the scaled model serves:
        ``max(max_position_embeddings, factor * original_max_position)``.

        Raises:
          ValueError: naming the field for an unknown rope type or inconsistent values.
        """
        return _from_hf(cls, config, max_position)


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


_KNOWN_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
_LEGACY_ROPE_TYPES = {"su": "longrope", "mrope": "default"}


def _number(config: Mapping[str, Any], key: str, where: str, default: Any = None) -> Any:
    value = config.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}{key}={value!r} must be a number")
    return value


def _require(params: Mapping[str, Any], key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope_scaling.{key} is required for rope_type={rope_type!r}")
    return params[key]


def _from_hf(cls, config: Mapping[str, Any], max_position: Optional[int]) -> RopeConfig:
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict (a HF config.json), got {type(config).__name__}")
    params = config.get("rope_parameters")
    if params is None:
        params = config.get("rope_scaling")
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling={params!r} must be a dict or null")
    if "full_attention" in params and isinstance(params["full_attention"], Mapping):
        raise ValueError("rope_parameters is per layer type (keys "
                         f"{sorted(params)}); pass config with rope_parameters=<one layer type's dict>")
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = _LEGACY_ROPE_TYPES.get(rope_type, rope_type)
    if rope_type not in _KNOWN_ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r} is not one of {_KNOWN_ROPE_TYPES}")

    theta = params.get("rope_theta", config.get("rope_theta", config.get("rotary_emb_base", 10000.0)))
    _number({"rope_theta": theta}, "rope_theta", "")

    deepseek = config.get("qk_rope_head_dim") is not None
    if deepseek:
        head_dim = config["qk_rope_head_dim"]
    elif config.get("head_dim") is not None:
        head_dim = config["head_dim"]
    else:
        hidden = config.get("hidden_size", config.get("n_embd"))
        heads = config.get("num_attention_heads", config.get("n_head"))
        if hidden is None or heads is None:
            raise ValueError("config needs head_dim, or hidden_size and num_attention_heads")
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
        head_dim = hidden // heads

    partial = params.get("partial_rotary_factor",
                         config.get("partial_rotary_factor", config.get("rotary_pct")))
    _number({"partial_rotary_factor": partial}, "partial_rotary_factor", "")
    if partial is not None and not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor={partial!r} must be in (0, 1]")
    gptj = config.get("model_type") == "gptj"
    if rope_type == "proportional":
        rotary_dim = head_dim  # the zero-frequency tail spans the rest of the head
    elif gptj and config.get("rotary_dim") is not None:
        rotary_dim = config["rotary_dim"]
    elif partial is not None:
        rotary_dim = int(head_dim * partial)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial!r} gives rotary_dim={rotary_dim} "
                             f"for {head_dim=}; it must give a positive even rotary_dim")
    else:
        rotary_dim = head_dim
    interleave = deepseek or gptj

    max_pos_emb = _number(config, "max_position_embeddings", "", config.get("n_positions", 2048))
    original = params.get("original_max_position_embeddings",
                          config.get("original_max_position_embeddings"))
    factor = _number(params, "factor", "rope_scaling.")

    scaling: Scaling
    if rope_type == "default":
        scaling = None
    elif rope_type == "linear":
        scaling = Linear(factor=_require(params, "factor", rope_type))
    elif rope_type == "dynamic":
        scaling = DynamicNTK(factor=_require(params, "factor", rope_type),
                             original_max_position=int(original or max_pos_emb))
    elif rope_type == "llama3":
        scaling = Llama3(factor=_require(params, "factor", rope_type),
                         low_freq_factor=_require(params, "low_freq_factor", rope_type),
                         high_freq_factor=_require(params, "high_freq_factor", rope_type),
                         original_max_position=int(_require(params, "original_max_position_embeddings",
                                                            rope_type)))
    elif rope_type == "yarn":
        original = int(original or max_pos_emb)
        if factor is None:
            factor = max_pos_emb / original
        scaling = Yarn(factor=factor, original_max_position=original,
                       beta_fast=params.get("beta_fast") or 32.0,
                       beta_slow=params.get("beta_slow") or 1.0,
                       mscale=params.get("mscale"), mscale_all_dim=params.get("mscale_all_dim"),
                       attention_factor=params.get("attention_factor"),
                       truncate=params.get("truncate", True))
    elif rope_type == "longrope":
        if original is None:
            raise ValueError("original_max_position_embeddings is required for rope_type='longrope'")
        scaling = LongRope(short_factor=tuple(_require(params, "short_factor", rope_type)),
                           long_factor=tuple(_require(params, "long_factor", rope_type)),
                           original_max_position=int(original),
                           attention_factor=params.get("attention_factor"), factor=factor)
    else:
        scaling = Proportional(factor=factor or 1.0, partial_rotary_factor=partial or 1.0)

    if max_position is None:
        max_position = int(max_pos_emb)
        scaled_original = getattr(scaling, "original_max_position", None)
        scale = getattr(scaling, "factor", None)
        if scaled_original is not None and scale is not None and not isinstance(scaling, LongRope):
            max_position = max(max_position, int(scaled_original * scale))
        max_position = min(max_position, _frequencies.MAX_ACCURATE_POSITION)
    return cls(head_dim=int(head_dim), rotary_dim=int(rotary_dim), theta=float(theta),
               interleave=interleave, max_position=max_position, scaling=scaling)
