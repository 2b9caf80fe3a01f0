"""The XLA backend: RoPE in plain jnp, fused by XLA; also the kernels' test oracle on device.

Same signature as every kernel in this package: ``(q, k, pos_ids, tables, *, rotary_dim,
interleave, attention_factor, mrope_section=None, mrope_interleaved=False) -> (q, k)``,
with ``pos_ids [T]``, or ``[3, T]`` (t, h, w rows) when ``mrope_section`` is given.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp

from jaxrope.ops.angle import cos_sin


def _rotate(x, cos, sin, rotary_dim: int, interleave: bool):
    half = rotary_dim // 2
    xr = x[..., :rotary_dim].astype(jnp.float32)
    if interleave:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., :half], xr[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if interleave:
        rotated = jnp.stack([ra, rb], axis=-1).reshape(xr.shape)
    else:
        rotated = jnp.concatenate([ra, rb], axis=-1)
    rotated = rotated.astype(x.dtype)
    if rotary_dim == x.shape[-1]:
        return rotated
    # Not x.at[..., :rotary_dim].set(rotated): XLA CPU (jaxlib 0.10.2, 0.11.2) fuses that
    # update in place into x's buffer while still reading x, and a scatter of the result
    # (a KV-cache write) then stores half-overwritten pairs.
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)


def rope_reference(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                   attention_factor: float, mrope_section: Optional[Tuple[int, int, int]] = None,
                   mrope_interleaved: bool = False):
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` at ``pos_ids [T]`` (M-RoPE: ``[3, T]``);
    tables ``[3, R/2]``."""
    pos = pos_ids.astype(jnp.int32)
    if mrope_section is not None:
        pos = (pos[0], pos[1], pos[2])
    cos, sin = cos_sin(pos, tables[0], tables[1], tables[2], attention_factor,
                       mrope_section=mrope_section, mrope_interleaved=mrope_interleaved)
    return (_rotate(q, cos, sin, rotary_dim, interleave),
            _rotate(k, cos, sin, rotary_dim, interleave))
