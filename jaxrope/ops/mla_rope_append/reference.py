"""The XLA backend of the MLA RoPE + paged append; also the kernels' oracle on device.

Signature of every backend (:data:`jaxrope.ops.backends.IMPLEMENTATIONS`
``["mla_rope_append"]``): ``(q_pe, k_pe, ckv, q_nope, pos_ids, slots, tables, scales,
caches, *, rotary_dim, interleave, attention_factor, mrope_section=None,
mrope_interleaved=False, q_dtype=None) -> (q_pe_out, q_nope_out, caches)``.

- ``q_pe [T, H, r]``, ``k_pe [T, r]``, ``ckv [T, L]``, ``q_nope [T, H, N]`` or None, one
  float dtype; ``pos_ids`` int32 ``[T]`` (M-RoPE: ``[3, T]``); ``tables`` float32 ``[3,
  r/2]`` (:func:`jaxrope.ops.constants.kernel_constants`).
- ``slots`` int32 ``[T]``: token ``t`` with ``slots[t]`` in ``[0, rows)`` is written to
  row ``slots[t]`` of every cache matrix; any other slot (negative: padding) writes
  nothing.
- ``scales`` float32 ``[2]`` = ``[q_scale, kv_scale]``: ``q_scale`` read only when
  ``q_dtype`` is float8_e4m3fn, ``kv_scale`` only for a float8_e4m3fn cache.
- ``caches``: ``(ckv_rows [rows, L], kpe_rows [rows, r])`` (FlashInfer's
  ``append_paged_mla_kv_cache`` pair) or ``(rows [rows, L + r],)`` (vLLM's one buffer:
  ckv at ``[:, :L]``, the rotated k_pe at ``[:, L:]``), told apart by ``len(caches)``.
- ``q_dtype`` (static): None, q_pe rotated in float32 and rounded once to its dtype,
  q_nope returned as given; or ``float8_e4m3fn``: new arrays ``e4m3(clip(rot(q_pe) *
  q_scale, -448, 448))`` and likewise ``q_nope`` (FlashInfer's ``mla_rope_quantize_fp8``).

The rotation is :func:`jaxrope.ops.rope.reference.rope_reference` itself (k_pe as one
head), so a cache in k_pe's dtype holds exactly what :func:`jaxrope.apply_rope` returns
for k_pe; fp8 stores go through
:func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype`, the GQA op's rule.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp

from jaxrope.ops.rope.reference import rope_reference
from jaxrope.ops.rope_append_kv.reference import FP8, to_cache_dtype


def mla_rope_append_reference(q_pe, k_pe, ckv, q_nope, pos_ids, slots, tables, scales, caches, *,
                              rotary_dim: int, interleave: bool, attention_factor: float,
                              mrope_section: Optional[Tuple[int, int, int]] = None,
                              mrope_interleaved: bool = False, q_dtype=None):
    """Rotate ``q_pe`` and ``k_pe`` at ``pos_ids``; write ``ckv`` and the rotated ``k_pe``
    into ``caches`` at ``slots`` (shapes and rules in the module docstring)."""
    quantize_q = q_dtype is not None and jnp.dtype(q_dtype) == FP8
    # fp8 q: rotate in float32 and round once, to e4m3; else in q_pe's dtype (float32 math).
    q_in = q_pe.astype(jnp.float32) if quantize_q else q_pe
    q_rotated, k_rotated = rope_reference(
        q_in, k_pe.astype(jnp.float32)[:, None, :], pos_ids, tables, rotary_dim=rotary_dim,
        interleave=interleave, attention_factor=attention_factor, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved)
    if quantize_q:
        q_pe_out = to_cache_dtype(q_rotated, scales[0], FP8)
        q_nope_out = (None if q_nope is None
                      else to_cache_dtype(q_nope.astype(jnp.float32), scales[0], FP8))
    else:
        q_pe_out, q_nope_out = q_rotated, q_nope
    rows = caches[0].shape[0]
    valid = (slots >= 0) & (slots < rows)
    # Skipped tokens get a row past the end, which mode="drop" discards.
    target = jnp.where(valid, slots, rows)
    dtype = caches[0].dtype
    parts = (ckv.astype(jnp.float32), k_rotated[:, 0])
    if len(caches) == 1:
        parts = (jnp.concatenate(parts, axis=-1),)
    written = tuple(c.at[target].set(to_cache_dtype(x, scales[1], dtype), mode="drop")
                    for c, x in zip(caches, parts))
    return q_pe_out, q_nope_out, written
