"""The accurate rotation angle, shared by every backend's kernel body.

``pos * inv_freq`` formed in float32 loses the angle at large positions (the float32
ulp of 2**20 rad is 0.06 rad). Instead the angle is counted in turns,
``pos * inv_freq / (2*pi)``, with the turn rate given as three float32 parts
(:func:`jaxrope.frequencies.angle_tables`) and the position split in two 12-bit parts:
each partial product is then exact, its fractional part is exact, and only the sum of
fractions (magnitude < 4) is rounded. The reduced angle lies in [-pi, pi] where float32
sin/cos are accurate, so the error stays near 1e-6 rad at any position below 2**24.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxrope.frequencies import POSITION_LOW_BITS

_LOW_MASK = (1 << POSITION_LOW_BITS) - 1


def _sin_cos_exact(angle):
    return jnp.sin(angle), jnp.cos(angle)


def cos_sin(pos, turns_hi, turns_mid, turns_lo, attention_factor: float,
            sin_cos=_sin_cos_exact, floor=jnp.floor):
    """float32 ``cos, sin`` of shape ``pos.shape + turns.shape``, times ``attention_factor``.

    ``pos``: int32 positions in ``[0, 2**24)``, any shape ``[...]`` (a scalar broadcasts
    as is); ``turns_*``: float32 ``[R/2]`` (or broadcastable), the hi/mid/lo parts of
    ``inv_freq / (2*pi)``. ``sin_cos``: the float32 sine and cosine of an angle in
    ``[-pi, pi]``; a GPU kernel passes the hardware approximations (absolute error ~1e-6
    there). ``floor``: for a kernel language without ``jnp.floor``; it sees values of
    either sign, all of magnitude below ``2**31``.
    """
    if jnp.ndim(pos):
        pos = pos[..., None]
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
