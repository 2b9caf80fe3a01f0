"""Float64 numpy oracles for the tests, written from the formulas.

Independent of ``jaxrope.frequencies`` on purpose (it is not imported): the
inverse frequencies are evaluated one pair at a time with :mod:`math`, following
the semantics of HF transformers' ``ROPE_INIT_FUNCTIONS``, and the rotation is a
float64 loop-free numpy transcription of the two layouts:

- NeoX halves (``interleave=False``): pair ``i`` is ``(x[i], x[i + R/2])``;
- GPT-J pairs (``interleave=True``): pair ``i`` is ``(x[2i], x[2i + 1])``;

each rotated by ``pos * inv_freq[i]``, then scaled by the attention factor;
dims ``[R, D)`` are copied.

M-RoPE (``mrope_section``): positions ``[3, T]`` and pair ``i`` takes its position from
the row :func:`jaxrope.mrope.sections.mrope_rows` gives it, a numpy transcription of the
definitions (sections laid end to end, or Qwen3-VL's interleaving) independent of the
kernels' masks.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import numpy as np

from jaxrope.mrope.sections import mrope_rows
from jaxrope.scaling import DynamicNTK, Linear, Llama3, LongRope, Proportional, Yarn


def default_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    """``theta ** (-2i / R)`` for ``i < R/2``."""
    return np.array([theta ** (-(2 * i) / rotary_dim) for i in range(rotary_dim // 2)])


def linear(theta: float, rotary_dim: int, *, factor: float) -> Tuple[np.ndarray, float]:
    return default_inv_freq(theta, rotary_dim) / factor, 1.0


def dynamic(theta: float, rotary_dim: int, *, factor: float, original_max_position: int,
            seq_len: Optional[int]) -> Tuple[np.ndarray, float]:
    """HF ``dynamic``: below the trained length (or None) the base is unchanged."""
    length = original_max_position if seq_len is None else max(seq_len, original_max_position)
    ratio = factor * length / original_max_position - (factor - 1)
    base = theta * ratio ** (rotary_dim / (rotary_dim - 2))
    return default_inv_freq(base, rotary_dim), 1.0


def llama3(theta: float, rotary_dim: int, *, factor: float, low_freq_factor: float,
           high_freq_factor: float, original_max_position: int) -> Tuple[np.ndarray, float]:
    """Llama 3.1: wavelengths past ``original/low`` divided by factor, below ``original/high``
    kept, a linear blend in ``original / wavelength`` between."""
    out = []
    for f in default_inv_freq(theta, rotary_dim):
        wavelength = 2 * math.pi / f
        if wavelength < original_max_position / high_freq_factor:
            out.append(f)
        elif wavelength > original_max_position / low_freq_factor:
            out.append(f / factor)
        else:
            smooth = (original_max_position / wavelength - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(theta: float, rotary_dim: int, *, factor: float, original_max_position: int,
         beta_fast: float = 32.0, beta_slow: float = 1.0, mscale: Optional[float] = None,
         mscale_all_dim: Optional[float] = None, attention_factor: Optional[float] = None,
         truncate: bool = True) -> Tuple[np.ndarray, float]:
    """YaRN: pair ``i`` blends interpolation (``/factor``) and extrapolation with a ramp
    over the dims whose rotation count over the trained length lies between
    ``beta_slow`` and ``beta_fast``."""
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def dim_of(rotations: float) -> float:
        # The dim at which a frequency turns `rotations` times over the trained length.
        return rotary_dim * math.log(original_max_position / (2 * math.pi * rotations)) / (
            2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if high == low:
        high = high + 0.001
    out = []
    for i, f in enumerate(default_inv_freq(theta, rotary_dim)):
        interpolated = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * interpolated + f * (1 - interpolated))
    return np.array(out), float(attention_factor)


def longrope(theta: float, rotary_dim: int, *, short_factor: Sequence[float],
             long_factor: Sequence[float], original_max_position: int, max_position: int,
             seq_len: Optional[int], factor: Optional[float] = None,
             attention_factor: Optional[float] = None,
             factors: str = "auto") -> Tuple[np.ndarray, float]:
    """Phi-3 LongRoPE: under ``factors="auto"`` long factors once ``seq_len > original``,
    else the named set; attention factor ``sqrt(1 + ln(factor) / ln(original))`` with
    ``factor = max / original`` by default."""
    if factor is None:
        factor = max_position / original_max_position
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(
            1 + math.log(factor) / math.log(original_max_position))
    if factors == "auto":
        use_long = seq_len is not None and seq_len > original_max_position
    else:
        use_long = factors == "long"
    divisors = long_factor if use_long else short_factor
    return default_inv_freq(theta, rotary_dim) / np.array(divisors, np.float64), float(attention_factor)


def proportional(theta: float, rotary_dim: int, *, factor: float = 1.0,
                 partial_rotary_factor: float = 1.0) -> Tuple[np.ndarray, float]:
    """Gemma proportional: exponents over the whole ``R``, only the first
    ``int(partial * R // 2)`` pairs nonzero, all divided by factor."""
    rotated = int(partial_rotary_factor * rotary_dim // 2)
    out = [theta ** (-(2 * i) / rotary_dim) if i < rotated else 0.0 for i in range(rotary_dim // 2)]
    return np.array(out) / factor, 1.0


def frequencies(cfg, seq_len: Optional[int] = None) -> Tuple[np.ndarray, float]:
    """The oracle's ``(inv_freq, attention)`` for a :class:`jaxrope.RopeConfig`."""
    s, theta, r = cfg.scaling, cfg.theta, cfg.rotary_dim
    if s is None:
        return default_inv_freq(theta, r), 1.0
    if isinstance(s, Linear):
        return linear(theta, r, factor=s.factor)
    if isinstance(s, DynamicNTK):
        return dynamic(theta, r, factor=s.factor, original_max_position=s.original_max_position,
                       seq_len=seq_len)
    if isinstance(s, Llama3):
        return llama3(theta, r, factor=s.factor, low_freq_factor=s.low_freq_factor,
                      high_freq_factor=s.high_freq_factor,
                      original_max_position=s.original_max_position)
    if isinstance(s, Yarn):
        return yarn(theta, r, factor=s.factor, original_max_position=s.original_max_position,
                    beta_fast=s.beta_fast, beta_slow=s.beta_slow, mscale=s.mscale,
                    mscale_all_dim=s.mscale_all_dim, attention_factor=s.attention_factor,
                    truncate=s.truncate)
    if isinstance(s, LongRope):
        return longrope(theta, r, short_factor=s.short_factor, long_factor=s.long_factor,
                        original_max_position=s.original_max_position,
                        max_position=cfg.max_position, seq_len=seq_len, factor=s.factor,
                        attention_factor=s.attention_factor, factors=s.factors)
    if isinstance(s, Proportional):
        return proportional(theta, r, factor=s.factor, partial_rotary_factor=s.partial_rotary_factor)
    raise TypeError(f"no oracle for {s!r}")


def serving_frequencies(cfg) -> Tuple[np.ndarray, float]:
    """What kernels must use: the oracle at ``seq_len = cfg.max_position``."""
    return frequencies(cfg, seq_len=cfg.max_position)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int,
            interleave: bool) -> np.ndarray:
    # x [T, H, D]; cos, sin [T, R/2]; arithmetic in x's dtype.
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x.copy()
    if interleave:
        first, second = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    else:
        first, second = slice(0, rotary_dim // 2), slice(rotary_dim // 2, rotary_dim)
    a, b = x[..., first], x[..., second]
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def _slot_positions(pos: np.ndarray, mrope_section, mrope_interleaved) -> np.ndarray:
    # [T, 1] for 1-D positions [T]; [T, R/2] for M-RoPE positions [3, T].
    if mrope_section is None:
        return pos[:, None]
    return pos[mrope_rows(mrope_section, mrope_interleaved)].T


def rope_oracle(x, pos, inv_freq, attention: float, rotary_dim: int, interleave: bool,
                mrope_section: Optional[Sequence[int]] = None,
                mrope_interleaved: bool = False) -> np.ndarray:
    """float64 ``[T, H, D]``: ``x`` rotated at ``pos`` ``[T]`` (M-RoPE: ``[3, T]``, see
    :func:`mrope_rows`); dims past ``rotary_dim`` copied."""
    slot_pos = _slot_positions(np.asarray(pos, np.float64), mrope_section, mrope_interleaved)
    angle = slot_pos * np.asarray(inv_freq, np.float64)[None, :]
    return _rotate(np.asarray(x, np.float64), np.cos(angle) * attention, np.sin(angle) * attention,
                   rotary_dim, interleave)


def rope_of(cfg, x, pos) -> np.ndarray:
    """float64 ``[T, H, D]``: :func:`rope_oracle` with ``cfg``'s serving frequencies,
    attention factor, rotary dims, layout and M-RoPE sections (``pos`` ``[T]``, or
    ``[3, T]`` for an M-RoPE config)."""
    inv_freq, attention = serving_frequencies(cfg)
    return rope_oracle(x, pos, inv_freq, attention, cfg.rotary_dim, cfg.interleave,
                       cfg.mrope_section, cfg.mrope_interleaved)


def rope_naive_float32(x, pos, inv_freq, attention: float, rotary_dim: int,
                       interleave: bool, mrope_section: Optional[Sequence[int]] = None,
                       mrope_interleaved: bool = False) -> np.ndarray:
    """float32 ``[T, H, D]`` the textbook way: ``cos(float32(pos) * float32(inv_freq))``
    (``pos`` and the M-RoPE arguments as for :func:`rope_oracle`).

    What the accurate angle of the kernels avoids: the float32 product loses the angle
    at large positions (its ulp is 0.06 rad at 2**20).
    """
    slot_pos = _slot_positions(np.asarray(pos, np.float32), mrope_section, mrope_interleaved)
    angle = slot_pos * np.asarray(inv_freq, np.float32)[None, :]
    factor = np.float32(attention)
    return _rotate(np.asarray(x, np.float32), np.cos(angle) * factor, np.sin(angle) * factor,
                   rotary_dim, interleave)


# What a rotation's relative_error against this oracle stays within, by output dtype, for
# a kernel doing float32 math on float64-derived frequencies: the float32 math, then the
# output dtype's rounding (bf16 rounding alone gives ~1.7e-3 at full rotary; 2.5e-3 is the
# bf16 target up to position 2**20).
RELATIVE_TOLERANCE = {"float32": 1e-5, "float16": 4e-4, "bfloat16": 2.5e-3}


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))
