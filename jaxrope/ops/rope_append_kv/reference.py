"""The XLA backend of the fused RoPE + paged KV-cache append; also the kernel's oracle on device.

Same signature as :func:`jaxrope.ops.rope_append_kv.triton.rope_append_kv_triton`:
``(q, k, v, pos_ids, slots, tables, scales, caches, *, rows, rotary_dim, interleave,
attention_factor, mrope_section=None, mrope_interleaved=False, q_norm_weight=None,
k_norm_weight=None, qk_norm=None, q_dtype=None) -> (q_out, caches)``, with
``pos_ids [T]``, or ``[3, T]`` (t, h, w rows) when ``mrope_section`` is given, and
``caches`` the layout's arrays (a ``(k, v)`` pair or one array) each seen as a ``[rows,
D]`` matrix, addressed by ``rows`` (:class:`jaxrope.ops.rope_append_kv.cache_layout.CacheRows`, one
stride rule for every layout).

The slot rule: token ``t`` with ``slot = slots[t]`` in ``[0, pages * page_size)`` goes to
page ``slot // page_size``, entry ``slot % page_size``, i.e. head ``h`` of k to row
``rows.row(page, entry, h)`` of the first array and of v to ``rows.value_offset`` rows
further in array ``rows.value_array``; any other slot (negative: padding) writes nothing.
The rotation is :func:`jaxrope.ops.rope.reference.rope_reference` itself, so a cache in
k's dtype holds exactly what ``apply_rope`` returns for k. A ``float8_e4m3fn`` cache
stores ``e4m3(clip(x * scale, -448, 448))`` with ``x`` the float32 rotated k (or v) and
``scale`` from ``scales = [k_scale, v_scale, q_scale]``, rounded to nearest even:
FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` (multiply, then a saturating
``__NV_SATFINITE`` conversion). With ``q_dtype`` float8_e4m3fn, q_out is a new array
stored the same way from the float32 rotated q and ``q_scale``, every dim (FlashInfer
scales and converts ``q_nope`` alike); otherwise ``scales[2]`` is not read.

QK-norm (``qk_norm`` with ``q_norm_weight`` and/or ``k_norm_weight``): q and k are
normalised in float32 (:func:`jaxrope.qk_norm.normalize`), rotated in float32 and rounded
once, to q's dtype for q and to the cache's for k.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp

from jaxrope.ops.rope_append_kv.cache_layout import CacheRows
from jaxrope.ops.rope.reference import rope_reference
from jaxrope.qk_norm import QKNorm, normalize

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# The largest finite float8_e4m3fn; converting past it would give NaN (the format has no
# infinity), so values saturate here first.
FP8_MAX = 448.0


def to_cache_dtype(x, scale, dtype):
    """float32 ``x`` as stored in a cache of ``dtype``: scaled and saturated for fp8, else cast."""
    if jnp.dtype(dtype) == FP8:
        return jnp.clip(x * scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return x.astype(dtype)


def rope_append_kv_reference(q, k, v, pos_ids, slots, tables, scales, caches, *, rows: CacheRows,
                             rotary_dim: int, interleave: bool, attention_factor: float,
                             mrope_section: Optional[Tuple[int, int, int]] = None,
                             mrope_interleaved: bool = False, q_norm_weight=None,
                             k_norm_weight=None, qk_norm: Optional[QKNorm] = None,
                             q_dtype=None):
    """Rotate ``q`` and ``k`` at ``pos_ids``; write k and v into ``caches`` at ``slots``.

    ``q [T, Hq, D]``, ``k, v [T, Hk, D]``, ``pos_ids`` int32 ``[T]`` (M-RoPE: ``[3,
    T]``), ``slots`` int32 ``[T]``, ``tables`` float32 ``[3, R/2]``, ``scales`` float32
    ``[3]`` (``[k_scale, v_scale, q_scale]``: an fp8 cache reads the first two, an fp8
    q the third), ``caches`` ``[rows, D]`` views; ``q_norm_weight``,
    ``k_norm_weight`` (``[D]``, or ``[H * D]`` when ``qk_norm.per_head`` is False) with
    ``qk_norm``: normalise q, k before the rotation (each weight None: that one as is);
    ``q_dtype``: None (q_out in q's dtype) or float8_e4m3fn (a new fp8 q_out).
    """
    if q_norm_weight is not None:
        q_in = normalize(q, q_norm_weight, qk_norm)
    else:
        # An fp8 q is rotated in float32 and rounded once, to e4m3.
        q_in = q if q_dtype is None else q.astype(jnp.float32)
    k_in = (k.astype(jnp.float32) if k_norm_weight is None
            else normalize(k, k_norm_weight, qk_norm))
    q_rotated, k_rotated = rope_reference(q_in, k_in, pos_ids, tables,
                                  rotary_dim=rotary_dim, interleave=interleave,
                                  attention_factor=attention_factor, mrope_section=mrope_section,
                                  mrope_interleaved=mrope_interleaved)
    q = (q_rotated.astype(q.dtype) if q_dtype is None
         else to_cache_dtype(q_rotated, scales[2], q_dtype))
    valid = (slots >= 0) & (slots < rows.num_slots)
    safe = jnp.where(valid, slots, 0)[:, None]
    key_rows = rows.row(safe // rows.page_size, safe % rows.page_size,
                        jnp.arange(k.shape[1], dtype=jnp.int32)[None, :])
    # Skipped tokens get a row past the end (of both arrays), which mode="drop" discards.
    key_rows = jnp.where(valid[:, None], key_rows, caches[0].shape[0])
    dtype = caches[0].dtype
    out = list(caches)
    out[0] = out[0].at[key_rows].set(to_cache_dtype(k_rotated, scales[0], dtype), mode="drop")
    out[rows.value_array] = out[rows.value_array].at[key_rows + rows.value_offset].set(
        to_cache_dtype(v.astype(jnp.float32), scales[1], dtype), mode="drop")
    return q, tuple(out)
