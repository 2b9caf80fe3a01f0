"""Inverse frequencies and attention factor per scaling variant, in float64 on the host.

Each variant is one small pure function ``(scaling, rotary_dim, theta, max_position,
seq_len) -> (inv_freq, attention_factor)`` in ``_REGISTRY``; the formulas are HF
transformers' ``ROPE_INIT_FUNCTIONS``, evaluated in float64 (HF evaluates some of
them in float32, which is where small differences to HF come from).

The device never sees these float64 values directly: :func:`angle_tables` splits
``inv_freq / (2*pi)`` into three float32 parts so that kernels can form the angle
``pos * inv_freq`` modulo one turn without float32 rounding of the product.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple

import numpy as np

from jaxrope.scaling import DynamicNTK, Linear, Llama3, LongRope, Proportional, Yarn

Frequencies = Tuple[np.ndarray, float]


def _base_inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _default(_s, rotary_dim, theta, _max_position, _seq_len) -> Frequencies:
    return _base_inv_freq(theta, rotary_dim), 1.0


def _linear(s: Linear, rotary_dim, theta, _max_position, _seq_len) -> Frequencies:
    return _base_inv_freq(theta, rotary_dim) / s.factor, 1.0


def _dynamic(s: DynamicNTK, rotary_dim, theta, _max_position, seq_len) -> Frequencies:
    # HF: seq_len below the trained length leaves the base alone.
    seq_len = max(seq_len or 0, s.original_max_position)
    grown = (s.factor * seq_len / s.original_max_position) - (s.factor - 1)
    base = theta * grown ** (rotary_dim / (rotary_dim - 2))
    return _base_inv_freq(base, rotary_dim), 1.0


def _llama3(s: Llama3, rotary_dim, theta, _max_position, _seq_len) -> Frequencies:
    inv_freq = _base_inv_freq(theta, rotary_dim)
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    if s.high_freq_factor == s.low_freq_factor:
        # No band between (Llama 4 Scout): transformers' band is the single wavelength
        # where both bounds meet, whose 0/0 smoothing it never reaches in practice.
        return scaled, 1.0
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(s: Yarn, rotary_dim, theta, _max_position, _seq_len) -> Frequencies:
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)

    def correction_dim(rotations: float) -> float:
        return (rotary_dim * math.log(s.original_max_position / (rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(rotary_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    inv_freq = (1 / (s.factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention)


def _longrope(s: LongRope, rotary_dim, theta, max_position, seq_len) -> Frequencies:
    factor = s.factor if s.factor is not None else max_position / s.original_max_position
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif factor <= 1.0:
        attention = 1.0
    else:
        attention = math.sqrt(1 + math.log(factor) / math.log(s.original_max_position))
    if s.factors == "auto":
        use_long = bool(seq_len) and seq_len > s.original_max_position
    else:
        use_long = s.factors == "long"
    ext = np.asarray(s.long_factor if use_long else s.short_factor, dtype=np.float64)
    return _base_inv_freq(theta, rotary_dim) / ext, float(attention)


def _proportional(s: Proportional, rotary_dim, theta, _max_position, _seq_len) -> Frequencies:
    rotated = int(s.partial_rotary_factor * rotary_dim // 2)
    inv_freq = np.zeros(rotary_dim // 2, dtype=np.float64)
    inv_freq[:rotated] = 1.0 / theta ** (np.arange(0, 2 * rotated, 2, dtype=np.float64) / rotary_dim)
    return inv_freq / s.factor, 1.0


_REGISTRY: Dict[Optional[type], Callable[..., Frequencies]] = {
    type(None): _default,
    Linear: _linear,
    DynamicNTK: _dynamic,
    Llama3: _llama3,
    Yarn: _yarn,
    LongRope: _longrope,
    Proportional: _proportional,
}


def compute(scaling, rotary_dim: int, theta: float, max_position: int,
            seq_len: Optional[int]) -> Frequencies:
    """Float64 ``inv_freq`` of length ``rotary_dim // 2`` and the attention factor."""
    inv_freq, attention = _REGISTRY[type(scaling)](scaling, rotary_dim, theta, max_position, seq_len)
    return np.ascontiguousarray(inv_freq, dtype=np.float64), float(attention)


def _round_to_bits(x: np.ndarray, bits: int) -> np.ndarray:
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.round(np.ldexp(mantissa, bits)), exponent - bits)


# Positions are split as pos = p_hi + p_lo with p_lo = pos mod 2**12; p_hi then has at
# most 12 significant bits for pos < 2**24, so with 12-bit parts of the turn rate every
# partial product below is exact in float32 (12 + 12 <= 24 bits).
POSITION_LOW_BITS = 12
MAX_ACCURATE_POSITION = 1 << 24


def angle_tables(inv_freq: np.ndarray) -> np.ndarray:
    """float32 ``[3, R/2]``: turns per position ``inv_freq / 2pi`` as hi + mid + lo.

    ``hi`` and ``mid`` carry 12 significant bits each and ``lo`` the float32
    rounding of the remainder, so ``hi + mid + lo`` equals the float64 rate to
    about 2**-48 relative.
    """
    turns = np.asarray(inv_freq, dtype=np.float64) / (2 * math.pi)
    hi = _round_to_bits(turns, POSITION_LOW_BITS)
    mid = _round_to_bits(turns - hi, POSITION_LOW_BITS)
    lo = (turns - hi - mid).astype(np.float32)
    return np.stack([hi.astype(np.float32), mid.astype(np.float32), lo])
