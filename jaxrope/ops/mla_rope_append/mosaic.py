"""MLA's RoPE fused with the paged cache append in Pallas's Mosaic GPU dialect (Hopper+).

The Mosaic GPU twin of :mod:`jaxrope.ops.mla_rope_append.triton` (same contract): q_pe is
rotated in place (or, with an fp8 q, rotated and quantised into a new array with q_nope
beside it), k_pe is rotated and written with ckv into the cache row of each token's slot,
in one ``plgpu.kernel``. Its split is a
:class:`jaxrope.ops.mla_rope_append.tuning.MlaMosaicTuning`, an argument of
:func:`build_mla`.

As in the GQA kernel (:mod:`jaxrope.ops.rope_append_kv.mosaic`, whose register layouts
:func:`~jaxrope.ops.rope_append_kv.mosaic.row_split` and
:func:`~jaxrope.ops.rope_append_kv.mosaic.row_layout` this one uses), the warpgroup
moves one token at a time, a token's work split into pieces, one block each: chunks of
q_pe's heads (``[h, r/2]`` halves), chunks of q_nope's (``[h, N]``, fp8 q only), and
the cache row (k_pe's halves as ``[1, r/2]``, ckv as ``[1, L]``). Each piece loads all
it reads before its first store; the angle (:func:`jaxrope.ops.angle.angle_cos_sin`) is
formed in the halves' layout with the head axis removed and broadcast to the heads.

GPT-J pairs (DeepSeek's ``interleave=True``): q_pe, the bulk of the bytes, reads and
writes through its ``[T, H, r/2, 2]`` view with a pair in one thread's vector
(:func:`jaxrope.ops.rope_append_kv.mosaic_layout.pair_layout`), its even and odd
elements apart by a sum over the pair axis inside the thread (under JAX and from a
launch through raw pointers alike). k_pe reads and writes its even and odd elements
through the pair view one element a vector, as the GQA kernel does; the one ``[rows, L +
r]`` cache array is then one pair view whose first ``L/2`` pairs hold ckv, which moves
through it as even and odd elements too. Caches are ``[rows, 1, width]``
views, so row ``slot`` is one scalar index and each store one register array; a slot
outside ``[0, rows)`` skips the row's stores. An fp8 cache (or q) stores
:func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype` of the float32 values.

On CPU it runs in Mosaic GPU's interpreter (``interpret=True``), for tests.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.angle import angle_cos_sin
from jaxrope.ops.mla_rope_append.tuning import MlaMosaicTuning, MlaPiece, mla_mosaic_tuning
from jaxrope.ops.mosaic_common import (as_pallas, broadcast, floor, kernel, load,
                                       slot_row_table, store, unavailable, walk)
from jaxrope.ops.rope_append_kv.mosaic import row_layout, row_split
from jaxrope.ops.rope_append_kv.mosaic_layout import pair_layout
from jaxrope.ops.rope_append_kv.reference import FP8, to_cache_dtype


def build_mla(*, heads: int, rotary_dim: int, kv_lora_rank: int, nope_dim: int, itemsize: int,
              interleave: bool, attention_factor: float, combined: bool, quantize_q: bool,
              quantize_kv: bool, mrope_section: Optional[Tuple[int, int, int]] = None,
              mrope_interleaved: bool = False, count: Optional[int] = None,
              grid: Optional[int] = None, max_count: Optional[int] = None,
              interpret: bool = False, tuning: Optional[MlaMosaicTuning] = None):
    """The ``plgpu.kernel`` of the MLA op for one head count and cache form.

    Operands: ``(pos_ids, slots, tables, rows, scales, q_pe, k_pe, ckv, [q_nope],
    *caches, [q_pe_out, [q_nope_out]])``: ``pos_ids`` flat int32 (M-RoPE: row ``r`` of
    token ``t`` at ``r * count + t``), ``slots`` int32 ``[T]``, ``tables`` ``[3, r/2]``,
    ``rows`` :func:`jaxrope.ops.mosaic_common.slot_row_table`, ``scales`` float32 ``[2]``
    = ``[q_scale, kv_scale]``, ``q_pe`` ``[T, H, r]`` (a mutable ref unless
    ``quantize_q``), ``k_pe [T, 1, r]``, ``ckv [T, 1, L]``, ``q_nope [T, H, N]`` when
    ``nope_dim`` (only with ``quantize_q``), ``caches`` mutable ``[rows, 1, width]`` views
    (ckv's then k_pe's, or the one array when ``combined``); with ``quantize_q`` the fp8
    ``q_pe_out`` (and ``q_nope_out`` when ``nope_dim``) are the kernel's results with a
    static ``count``, mutable operands after the caches without one. GPT-J pairs (``interleave``): ``[...,
    r/2, 2]`` views of q_pe, k_pe, q_pe_out and k_pe's cache (and, ``combined``, of ckv
    and the cache). ``count``: the static T, one block per token and piece;
    ``count=None``: an int32 ``count`` operand comes first, read at run time, and
    ``grid`` blocks walk the count's items (launches outside JAX); ``max_count``, the
    most tokens such a launch has, leaves out the walk when ``grid`` has a block for
    every item of it (:func:`jaxrope.ops.mosaic_common.walk`).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    half = rotary_dim // 2
    mrope = mrope_section is not None
    tuning = tuning or mla_mosaic_tuning(heads, rotary_dim, itemsize, nope_dim)
    vector_bytes = tuning.vector_bytes
    # ckv moves through the cache's pair view when it shares its array with GPT-J k_pe.
    latent_pairs = combined and interleave
    latent_width = kv_lora_rank // 2 if latent_pairs else kv_lora_rank
    latent = row_layout(row_split(1, latent_width, itemsize, 0, latent_pairs, vector_bytes))
    kpe_start = (kv_lora_rank // 2 if interleave else kv_lora_rank) if combined else 0

    def halves(x_ref, start: int = 0):
        if interleave:  # [h, r/2, 2], start in pairs
            return [x_ref.at[:, pl.ds(start, half), j] for j in (0, 1)]
        return [x_ref.at[:, pl.ds(start, half)], x_ref.at[:, pl.ds(start + half, half)]]

    def latent_refs(x_ref):
        if latent_pairs:
            return [x_ref.at[:, pl.ds(0, latent_width), j] for j in (0, 1)]
        return [x_ref.at[:, pl.ds(0, latent_width)]]

    def cached(x, scale, quantize: bool, dtype):
        # Unquantised, a value is cast as it is (ckv keeps its bits).
        return to_cache_dtype(x.astype(jnp.float32), scale, dtype) if quantize else x.astype(dtype)

    def block(n, refs, t, piece: MlaPiece):
        (pos_ref, slot_ref, tables_ref, rows_ref, scale_ref, q_pe_ref, k_pe_ref, ckv_ref,
         *rest) = refs
        q_nope_ref = rest.pop(0) if nope_dim else None
        cache_refs, outs = rest[:num_caches], rest[num_caches:]
        ckv_cache, kpe_cache = cache_refs[0], cache_refs[-1]
        q_out_ref = outs[0] if quantize_q else q_pe_ref
        q_nope_out_ref = outs[1] if nope_dim else None
        q_scale = scale_ref.at[0][...] if quantize_q else None
        chunk = pl.ds(piece.first, piece.heads)
        if piece.kind == "q_nope":
            layout = row_layout(row_split(piece.heads, nope_dim, itemsize, 0, False, vector_bytes))
            value = load(q_nope_ref.at[t, chunk], layout)
            store(q_nope_out_ref.at[t, chunk], cached(value, q_scale, True, FP8))
            return
        vectors = interleave and piece.kind == "q_pe"
        if vectors:  # [h, r/2, 2], a pair (2 items) in one thread's vector
            split = row_split(piece.heads, half, 2 * itemsize, half, False, vector_bytes)
        else:
            split = row_split(piece.heads, half, itemsize, half, interleave, vector_bytes)
        pairs3 = pair_layout(split) if vectors else None
        rotary = pairs3.reduce((2,)) if vectors else row_layout(split)
        angle = rotary.reduce((0,))
        source = q_pe_ref.at[t, chunk] if piece.kind == "q_pe" else k_pe_ref.at[t]
        if vectors:
            full = (piece.heads, half, 2)
            second = plgpu.broadcasted_iota(jnp.int32, full, 2, layout=as_pallas(pairs3)) == 1
            value = load(source, pairs3).astype(jnp.float32)
            # The pair's elements come apart by a sum over the pair axis, inside the
            # thread; -0.0 is the sum's exact identity (x + -0.0 is x, signed zeros too).
            pair = [jnp.sum(jnp.where(second, -0.0, value), axis=2),
                    jnp.sum(jnp.where(second, value, -0.0), axis=2)]
        else:
            pair = [load(r, rotary).astype(jnp.float32) for r in halves(source)]
        if piece.kind == "row":
            slot = slot_ref.at[t][...]
            ckv = [load(r, latent) for r in latent_refs(ckv_ref.at[t])]
        turns = [load(tables_ref.at[i], angle) for i in range(3)]
        pos = [broadcast(pos_ref.at[t if r == 0 else r * n + t][...], (half,), (), angle)
               for r in range(3 if mrope else 1)]
        if mrope:
            slot_rows = load(rows_ref, angle)
            pos = [jnp.where(slot_rows == 2, pos[2], jnp.where(slot_rows == 1, pos[1], pos[0]))]
        cos, sin = (broadcast(x, (piece.heads, half), (1,), rotary) for x in angle_cos_sin(
            pos[0], *turns, attention_factor, floor=floor))
        a, b = pair
        rotated = (a * cos - b * sin, b * cos + a * sin)
        if piece.kind == "q_pe":
            if split.copies > 1 and not quantize_q:
                # Several threads hold each element of q_pe, rotated in place: without a
                # barrier a warp ahead of the others could store an element before another
                # loads it, which would then rotate it twice.
                plgpu.commit_smem()
            if vectors:
                a3, b3 = (broadcast(x, full, (0, 1), pairs3) for x in rotated)
                out = q_out_ref.at[t, chunk]
                store(out, cached(jnp.where(second, b3, a3), q_scale, quantize_q, out.dtype))
                return
            for ref, value in zip(halves(q_out_ref.at[t, chunk]), rotated):
                store(ref, cached(value, q_scale, quantize_q, ref.dtype))
            return
        ok = (slot >= 0) & (slot < ckv_cache.shape[0])
        row = jnp.where(ok, slot, 0)
        kv_scale = scale_ref.at[1][...] if quantize_kv else None

        @pl.when(ok)
        def _():
            for ref, value in zip(halves(kpe_cache.at[row], kpe_start), rotated):
                store(ref, cached(value, kv_scale, quantize_kv, ref.dtype))
            for ref, value in zip(latent_refs(ckv_cache.at[row]), ckv):
                store(ref, cached(value, kv_scale, quantize_kv, ref.dtype))

    def one_item(n, refs, item):
        # Item = token * pieces + piece: a token's pieces are neighbours.
        if len(work) == 1:
            block(n, refs, item, work[0])
            return
        t, which = jax.lax.div(item, len(work)), jax.lax.rem(item, len(work))
        for i, piece in enumerate(work):
            pl.when(which == i)(lambda piece=piece: block(n, refs, t, piece))

    def body(*operands):
        if count is None:
            count_ref, *refs = operands
            n = count_ref[0]
            walk(n * len(work), grid, lambda item: one_item(n, refs, item),
                 None if max_count is None else max_count * len(work))
        else:
            one_item(count, operands, jax.lax.axis_index("block"))

    work = tuning.pieces
    num_caches = 1 if combined else 2
    out_type = ()
    if count is not None:
        grid = count * len(work)
        # With a static T the fp8 q outputs are the kernel's results (nothing to clear
        # first); a launch outside JAX passes its buffers as the last operands instead.
        if quantize_q:
            last = (half, 2) if interleave else (rotary_dim,)
            out_type = ((jax.ShapeDtypeStruct((count, heads, *last), FP8),) + (
                (jax.ShapeDtypeStruct((count, heads, nope_dim), FP8),) if nope_dim else ()))
    return kernel(body, grid, "jaxrope_mla_rope_append_mosaic", interpret, out_type=out_type)


def _pairs(x, interleave: bool):
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2) if interleave else x


def mla_rope_append_mosaic(q_pe, k_pe, ckv, q_nope, pos_ids, slots, tables, scales, caches, *,
                           rotary_dim: int, interleave: bool, attention_factor: float,
                           mrope_section: Optional[Tuple[int, int, int]] = None,
                           mrope_interleaved: bool = False, q_dtype=None,
                           interpret: bool = False, tuning: Optional[MlaMosaicTuning] = None):
    """Rotate q_pe (in place) and write ckv with the rotated k_pe into the cache rows of
    ``slots``, in one kernel; with ``q_dtype`` float8_e4m3fn, q_pe's rotation and q_nope
    are quantised into new arrays instead.

    Arguments and result as
    :func:`jaxrope.ops.mla_rope_append.triton.mla_rope_append_triton`'s; q_pe and the
    caches are mutable refs, updated in place when donated. ``tuning`` as
    :func:`build_mla`'s.

    Raises:
      BackendUnavailable: a JAX :func:`jaxrope.ops.mosaic_common.unavailable` names.
      NotImplementedError: ``rotary_dim`` is not q_pe's last dim (MLA rotates all of it).
    """
    reason = unavailable()
    if reason:
        raise BackendUnavailable(reason)
    num_tokens, heads, rope_dim = q_pe.shape
    if rotary_dim != rope_dim:
        raise NotImplementedError(f"rotary_dim={rotary_dim} must be q_pe's last dim "
                                  f"{rope_dim}: the MLA kernel rotates the whole of it")
    quantize_q = q_dtype is not None and jnp.dtype(q_dtype) == FP8
    nope = quantize_q and q_nope is not None
    if num_tokens == 0:
        empty = (lambda x: jnp.zeros(x.shape, FP8)) if quantize_q else (lambda x: x)
        return empty(q_pe), None if q_nope is None else empty(q_nope), tuple(caches)
    kv_lora_rank, combined = ckv.shape[-1], len(caches) == 1
    kernel_fn = build_mla(
        heads=heads, rotary_dim=rotary_dim, kv_lora_rank=kv_lora_rank,
        nope_dim=q_nope.shape[-1] if nope else 0, itemsize=np.dtype(q_pe.dtype).itemsize,
        interleave=interleave, attention_factor=attention_factor, combined=combined,
        quantize_q=quantize_q, quantize_kv=jnp.dtype(caches[0].dtype) == FP8,
        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, count=num_tokens,
        interpret=interpret, tuning=tuning)
    row_table = slot_row_table(rotary_dim // 2, mrope_section, mrope_interleaved)
    q_view = _pairs(q_pe, interleave)
    q_in = q_view if quantize_q else jax.new_ref(q_view)
    cache_refs = [jax.new_ref(_pairs(c[:, None, :], interleave and (combined or i == 1)))
                  for i, c in enumerate(caches)]
    outs = kernel_fn(pos_ids.reshape(-1), slots, tables, row_table, scales, q_in,
                     _pairs(k_pe[:, None, :], interleave),
                     _pairs(ckv[:, None, :], combined and interleave),
                     *((q_nope,) if nope else ()), *cache_refs)
    q_out = (outs[0] if quantize_q else jax.freeze(q_in)).reshape(q_pe.shape)
    q_nope_out = outs[1] if nope else q_nope
    return q_out, q_nope_out, tuple(jax.freeze(r).reshape(c.shape)
                                    for r, c in zip(cache_refs, caches))
