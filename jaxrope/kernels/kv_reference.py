"""The XLA backend of the fused RoPE + paged KV-cache append; also the kernel's oracle on device.

Same signature as :func:`jaxrope.kernels.kv_pallas.rope_append_kv_pallas`:
``(q, k, v, pos_ids, slots, tables, scales, caches, *, layout, page_size, components,
rotary_dim, interleave, attention_factor, mrope_section=None, mrope_interleaved=False) ->
(q, caches)``, with ``pos_ids [T]``, or ``[3, T]`` (t, h, w rows) when ``mrope_section``
is given, on the canonical cache views of :mod:`jaxrope.kv_cache`:

- ``layout="NHD"``: each cache ``[pages * components, page_size, Hk, D]``;
- ``layout="HND"``: each cache ``[pages * components, Hk, page_size, D]``;
- ``caches`` is ``(k_cache, v_cache)`` with ``components == 1`` or ``(kv_cache,)`` with
  ``components == 2``, where page ``p``'s keys are view page ``2p`` and its values ``2p + 1``.

The slot rule: token ``t`` with ``slot = slots[t]`` in ``[0, pages * page_size)`` goes to
page ``slot // page_size``, entry ``slot % page_size``; any other slot (negative:
padding) writes nothing. The rotation is :func:`jaxrope.kernels.reference.rope_reference`
itself, so a cache in k's dtype holds exactly what ``apply_rope`` returns for k. An
``float8_e4m3fn`` cache stores ``e4m3(clip(x * scale, -448, 448))`` with ``x`` the float32
rotated k (or v) and ``scale`` from ``scales = [k_scale, v_scale]``, rounded to nearest
even: FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache`` (multiply, then a
saturating ``__NV_SATFINITE`` conversion).
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp

from jaxrope.kernels.reference import rope_reference

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# The largest finite float8_e4m3fn; converting past it would give NaN (the format has no
# infinity), so values saturate here first.
FP8_MAX = 448.0


def to_cache_dtype(x, scale, dtype):
    """float32 ``x`` as stored in a cache of ``dtype``: scaled and saturated for fp8, else cast."""
    if jnp.dtype(dtype) == FP8:
        return jnp.clip(x * scale, -FP8_MAX, FP8_MAX).astype(FP8)
    return x.astype(dtype)


def rope_append_kv_reference(q, k, v, pos_ids, slots, tables, scales, caches, *, layout: str,
                             page_size: int, components: int, rotary_dim: int,
                             interleave: bool, attention_factor: float,
                             mrope_section: Optional[Tuple[int, int, int]] = None,
                             mrope_interleaved: bool = False):
    """Rotate ``q`` and ``k`` at ``pos_ids``; write k and v into ``caches`` at ``slots``.

    ``q [T, Hq, D]``, ``k, v [T, Hk, D]``, ``pos_ids`` int32 ``[T]`` (M-RoPE: ``[3,
    T]``), ``slots`` int32 ``[T]``, ``tables`` float32 ``[3, R/2]``, ``scales`` float32
    ``[2]`` (used by fp8 caches only).
    """
    q, k_rotated = rope_reference(q, k.astype(jnp.float32), pos_ids, tables,
                                  rotary_dim=rotary_dim, interleave=interleave,
                                  attention_factor=attention_factor, mrope_section=mrope_section,
                                  mrope_interleaved=mrope_interleaved)
    view_pages = caches[0].shape[0]
    num_slots = view_pages // components * page_size
    valid = (slots >= 0) & (slots < num_slots)
    # Skipped tokens get a page past the end, which mode="drop" discards.
    page = jnp.where(valid, slots // page_size * components, view_pages)
    entry = jnp.where(valid, slots % page_size, 0)
    dtype = caches[0].dtype
    values = (to_cache_dtype(k_rotated, scales[0], dtype),
              to_cache_dtype(v.astype(jnp.float32), scales[1], dtype))
    # (array, component) that k and v go to.
    destinations = ((0, 0), (1, 0)) if components == 1 else ((0, 0), (0, 1))
    out = list(caches)
    for (array, component), value in zip(destinations, values):
        index = ((page + component, entry) if layout == "NHD"
                 else (page + component, slice(None), entry))
        out[array] = out[array].at[index].set(value, mode="drop")
    return q, tuple(out)
