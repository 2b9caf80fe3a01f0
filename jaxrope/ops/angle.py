"""The accurate rotation angle, shared by every backend's kernel body.

``pos * inv_freq`` formed in float32 loses the angle at large positions (the float32
ulp of 2**20 rad is 0.06 rad). Instead the angle is counted in turns,
``pos * inv_freq / (2*pi)``, with the turn rate given as three float32 parts
(:func:`jaxrope.frequencies.angle_tables`) and the position split in two 12-bit parts:
each partial product is then exact, its fractional part is exact, and only the sum of
fractions (magnitude < 4) is rounded. The reduced angle lies in [-pi, pi] where float32
sin/cos are accurate, so the error stays near 1e-6 rad at any position below 2**24.

M-RoPE (``mrope_section``) changes only which position each frequency slot sees: slot
``j`` takes row ``t``, ``h`` or ``w`` of the positions (:func:`slot_rows`), chosen per
slot before the split, so every M-RoPE layout gets the same accurate angle. The rows
are picked with masks built from an iota, which every kernel language lowers; a 1-D
call traces no mask at all. A kernel that lays out positions and turns itself (Mosaic
GPU, where an array's register layout must match its operands') calls
:func:`angle_cos_sin` on element-wise operands.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp

from jaxrope.frequencies import POSITION_LOW_BITS

_LOW_MASK = (1 << POSITION_LOW_BITS) - 1


def _sin_cos_exact(angle):
    return jnp.sin(angle), jnp.cos(angle)


def slot_rows(slots: int, mrope_section: Tuple[int, int, int], mrope_interleaved: bool):
    """Boolean ``[slots]`` masks ``(is_h, is_w)``: the frequency slots fed by M-RoPE's h
    and w rows; every other slot takes the t row.

    Sectioned (``mrope_interleaved=False``, sections ``(s_t, s_h, s_w)``): t below
    ``s_t``, h below ``s_t + s_h``, w from there on (slots past ``R/2``, a kernel's
    padding lanes, fall to w). Interleaved: h where ``j % 3 == 1 and j < 3 * s_h``, w
    where ``j % 3 == 2 and j < 3 * s_w``.
    """
    j = jnp.arange(slots)
    s_t, s_h, s_w = mrope_section
    if mrope_interleaved:
        phase = jax.lax.rem(j, 3)
        return (phase == 1) & (j < 3 * s_h), (phase == 2) & (j < 3 * s_w)
    return (j >= s_t) & (j < s_t + s_h), j >= s_t + s_h


def _slot_positions(pos: Sequence, slots: int, mrope_section, mrope_interleaved):
    # [..., slots] positions: row t, h or w per slot.
    is_h, is_w = slot_rows(slots, mrope_section, mrope_interleaved)
    p_t, p_h, p_w = (p[..., None] if jnp.ndim(p) else p for p in pos)
    return jnp.where(is_w, p_w, jnp.where(is_h, p_h, p_t))


def cos_sin(pos, turns_hi, turns_mid, turns_lo, attention_factor: float,
            sin_cos=_sin_cos_exact, floor=jnp.floor, *,
            mrope_section: Optional[Tuple[int, int, int]] = None,
            mrope_interleaved: bool = False):
    """float32 ``cos, sin`` of shape ``pos.shape + turns.shape``, times ``attention_factor``.

    ``pos``: int32 positions in ``[0, 2**24)``, any shape ``[...]`` (a scalar broadcasts
    as is); with ``mrope_section`` (M-RoPE) a ``(t, h, w)`` triple of such arrays, all
    of one shape ``[...]``, and slot ``j`` of the result uses the row
    :func:`slot_rows` gives it. ``turns_*``: float32 ``[R/2]`` (or broadcastable, the
    last axis being the frequency slots), the hi/mid/lo parts of ``inv_freq / (2*pi)``.
    ``sin_cos``: the float32 sine and cosine of an angle in ``[-pi, pi]``; a GPU kernel
    passes the hardware approximations (absolute error ~1e-6 there). ``floor``: for a
    kernel language without ``jnp.floor``; it sees values of either sign, all of
    magnitude below ``2**31``.
    """
    if mrope_section is not None:
        pos = _slot_positions(pos, jnp.shape(turns_hi)[-1], mrope_section, mrope_interleaved)
    elif jnp.ndim(pos):
        pos = pos[..., None]
    return angle_cos_sin(pos, turns_hi, turns_mid, turns_lo, attention_factor, sin_cos, floor)


def angle_cos_sin(pos, turns_hi, turns_mid, turns_lo, attention_factor: float,
                  sin_cos=_sin_cos_exact, floor=jnp.floor):
    """:func:`cos_sin` on element-wise operands: int32 ``pos`` in ``[0, 2**24)`` of the
    turn tables' shape (or broadcasting against them as is), one position per slot."""
    p_lo = pos & _LOW_MASK
    p_hi = (pos - p_lo).astype(jnp.float32)
    p_lo = p_lo.astype(jnp.float32)

    def frac(x):
        # Exact for float32: x - floor(x) keeps a subset of x's significand bits.
        return x - floor(x)

    turns = (frac(p_hi * turns_hi) + frac(p_hi * turns_mid) + frac(p_lo * turns_hi)
             + (p_lo * turns_mid + (p_hi + p_lo) * turns_lo))
    angle = (turns - floor(turns + 0.5)) * jnp.float32(2 * math.pi)
    sin, cos = sin_cos(angle)
    return cos * attention_factor, sin * attention_factor
