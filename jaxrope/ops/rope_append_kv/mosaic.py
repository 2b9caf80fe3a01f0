"""RoPE fused with the paged KV-cache append in Pallas's Mosaic GPU dialect (Hopper+).

The Mosaic GPU twin of :mod:`jaxrope.ops.rope_append_kv.triton` (same contract: read
:func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`): q is rotated in
place (or, quantized, into a new float8_e4m3fn q), the rotated k and the v are written
into the paged cache at each token's slot, in one ``plgpu.kernel``, q and k optionally
RMS-normalised per head first. Its split is a
:class:`jaxrope.ops.rope_append_kv.tuning.AppendMosaicTuning`, an argument of
:func:`build_append`.

A Mosaic GPU store writes a register array to a ref slice at one scalar offset, so
tokens with different slots need separate stores: the whole warpgroup (128 threads)
moves one token at a time. A token's work is one piece, or several for blocks of their
own when its bytes are many (:func:`jaxrope.ops.rope_append_kv.tuning.pieces`: chunks
of q's heads, and k with v). A piece holds q's and k's rotary halves as ``[H, R/2]``
arrays, k's dims past ``R`` as ``[Hk, D - R]`` and v as ``[Hk, D]``, each in a Mosaic
GPU ``TiledLayout`` (:func:`jaxrope.ops.rope_append_kv.mosaic_layout.row_layout`) whose
lanes run along a head's dims
(coalesced: a head's ``D`` values are contiguous in every cache layout) and whose
remaining lanes and warps split the heads. Removing the head axis of a piece's halves'
layout gives one ``[R/2]`` layout, where the angle
(:func:`jaxrope.ops.angle.angle_cos_sin`, the accurate one every backend shares) is
broadcast to the heads for free; it is formed once per token and piece, one element a
thread (:func:`jaxrope.ops.rope_append_kv.mosaic_layout.angle_split`), and passed to
that layout through SMEM when that layout would form each element on more threads. A
token of one piece shares one layout between q's and k's halves (its head tile divides
both head counts), so it forms the angle once for both. A block walks
``tokens_per_block`` tokens unrolled, each token's loads issued before the previous
token's stores.

A per-head QK-norm (:class:`jaxrope.QKNorm`, Qwen3's ``x_hat * w`` or Gemma 3's ``x_hat
* (1 + w)``) needs the mean square over each head's whole ``D`` in float32: the squares
of its halves summed along the lanes (``jnp.sum`` over the width axis: warp shuffles,
and Mosaic GPU's SMEM reduction scratch where a head spans warps) give an ``[H]`` array
in the halves' layout less its width axis, which is broadcast back to the halves; the
weight's halves are read in the angle's layout and broadcast like it. With partial
rotary the dims past ``R`` (q's too: read only when normalised or quantized) have a
layout of their own, so the two partial sums of each head meet through a small SMEM
buffer and each side adds the other's (the same float32 sum on both). Then the rotation
in float32 and one rounding at the store. A norm over a token's heads together
(``per_head=False``) is declined: a block holds a piece of a token's heads.

An fp8 q (``q_dtype=float8_e4m3fn``) stores every dim of q (rotated, normalised where
asked) as ``to_cache_dtype(x, scales[2], float8_e4m3fn)`` into a new array; q itself
is then only read.

Caches arrive as ``[rows // (Hk * hs), Hk, hs, D]`` views of the ``[rows, D]`` matrices
(``hs`` = :attr:`CacheRows.head_stride`): every layout's head axis is one axis of
row-major rows, so a token's k rows ``base + h * hs`` (``base`` =
:meth:`CacheRows.row` at head 0, plus ``value_offset`` for v) are ``view[base // (Hk *
hs), :, base % (Hk * hs)]``, one store per token for every layout. GPT-J pairs read and
write through ``[..., D/2, 2]`` views (even and odd elements, one element per vector), as
the rope kernel does. Slots outside ``[0, pages * page_size)`` skip the token's cache
stores (q is still rotated); an fp8 cache stores
:func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype` of the float32 values, the
function every backend uses.

On CPU it runs in Mosaic GPU's interpreter (``interpret=True``), for tests.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.angle import angle_cos_sin
from jaxrope.ops.mosaic_common import (broadcast, floor, kernel, load, slot_row_table, store,
                                       unavailable, walk, walks)
from jaxrope.ops.rope_append_kv.cache_layout import CacheRows
# The layout helpers are this kernel's vocabulary: re-exported for its tests and sweeps.
from jaxrope.ops.rope_append_kv.mosaic_layout import (RowSplit, angle_split,  # noqa: F401
                                                      rotary_split, row_layout, row_split,
                                                      shares_angle)
from jaxrope.ops.rope_append_kv.reference import FP8, to_cache_dtype
from jaxrope.ops.rope_append_kv.tuning import AppendMosaicTuning, Piece, append_mosaic_tuning
from jaxrope.qk_norm import QKNorm, per_token_norm


def _dim_refs(x_ref, start: int, width: int, interleave: bool, heads: bool = True):
    # The refs of dims [start, start + width) of a token's [H, D] (GPT-J: its [H, D/2, 2]
    # view, start and width in pairs, one ref for the even and one for the odd elements);
    # heads=False: of a weight [D] (GPT-J: [D/2, 2]).
    lead = (slice(None),) if heads else ()
    if interleave:
        return [x_ref.at[(*lead, pl.ds(start, width), j)] for j in (0, 1)]
    return [x_ref.at[(*lead, pl.ds(start, width))]]


def fp8_q(q_dtype) -> bool:
    """Whether ``q_dtype`` (None, q's own dtype or float8_e4m3fn) asks for an fp8 q."""
    return q_dtype is not None and jnp.dtype(q_dtype) == FP8


def build_append(*, q_heads: int, k_heads: int, head_dim: int, itemsize: int,
                 rotary_dim: int, interleave: bool, attention_factor: float, rows: CacheRows,
                 quantize: bool,
                 mrope_section: Optional[Tuple[int, int, int]] = None,
                 mrope_interleaved: bool = False, count: Optional[int] = None,
                 grid: Optional[int] = None, max_count: Optional[int] = None,
                 interpret: bool = False, tuning: Optional[AppendMosaicTuning] = None,
                 qk_norm: Optional[QKNorm] = None, norm_q: bool = False, norm_k: bool = False,
                 q_dtype=None):
    """The ``plgpu.kernel`` of the fused op for one head layout and cache geometry.

    Operands: ``(pos_ids, slots, tables, rows, scales, q, k, v, *weights, *caches)``:
    ``pos_ids`` flat int32 (M-RoPE: row ``r`` of token ``t`` at ``r * count + t``),
    ``slots`` int32 ``[T]``, ``tables`` the ``[3, R/2]`` angle tables, ``rows``
    :func:`jaxrope.ops.mosaic_common.slot_row_table`, ``scales`` float32 ``[3]`` (``[k,
    v, q]``; ``[2]`` without an fp8 q), ``q`` ``[T, Hq, D]`` (a mutable ref rotated in
    place, or read only with an fp8 q), ``k``/``v`` ``[T, Hk, D]`` (GPT-J: ``[..., D/2,
    2]`` views of all of these), ``weights`` q's then k's norm weight ``[D]`` (GPT-J:
    ``[D/2, 2]``) for ``norm_q`` and ``norm_k``, ``caches`` mutable ``[rows // (Hk *
    hs), Hk, hs, D]`` views (k's and v's, or the one array of a combined layout).

    ``qk_norm`` (per head) with ``norm_q`` / ``norm_k``: q / k normalised over each
    head's ``D`` in float32 before the rotation, rounded once. ``q_dtype``
    float8_e4m3fn: q is read only and every dim of it goes, scaled by ``scales[2]`` and
    saturated (:func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype`), into a new
    float8_e4m3fn ``[T, Hq, D]``: the kernel's result when ``count`` is static, else a
    mutable ref operand after the caches.

    ``tuning``: the split (default:
    :func:`jaxrope.ops.rope_append_kv.tuning.append_mosaic_tuning` of the shapes).
    ``count`` is the static T, one block per piece of ``tuning.tokens_per_block`` tokens
    (JAX calls). ``count=None``: an int32 ``count`` operand comes first and is read at
    run time, and ``grid`` blocks walk the count's blocks in turn (launches outside JAX;
    refs may hold more than ``count`` tokens); when ``max_count`` (the largest count a
    launch passes) has a block of the grid for each of its blocks, block ``b`` runs
    token block ``b`` or exits, with no walk.

    Raises:
      NotImplementedError: ``qk_norm.per_head`` is False (:func:`jaxrope.qk_norm.per_token_norm`).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if (norm_q or norm_k) and not qk_norm.per_head:
        raise NotImplementedError(per_token_norm("mosaic"))
    half = rotary_dim // 2
    mrope = mrope_section is not None
    q_fp8 = fp8_q(q_dtype)
    width = (lambda w: w // 2) if interleave else (lambda w: w)
    passing = head_dim - rotary_dim
    # q's dims past R are read when they change: normalised, or quantized into q_out.
    q_rest_read = bool(passing) and (norm_q or q_fp8)
    tuning = tuning or append_mosaic_tuning(q_heads, k_heads, head_dim, rotary_dim, itemsize,
                                            q_width=head_dim if q_rest_read else None)
    work, tokens, vector_bytes = tuning.pieces, tuning.tokens_per_block, tuning.vector_bytes

    def rest_split(heads: int) -> RowSplit:  # [heads, D - R] from dim R
        return row_split(heads, width(passing), itemsize, width(rotary_dim), interleave,
                         vector_bytes)

    rest = passing and row_layout(rest_split(k_heads))
    whole = row_layout(row_split(k_heads, width(head_dim), itemsize, 0, interleave,
                                 vector_bytes))
    head_rows = k_heads * rows.head_stride
    # A static T of whole blocks has no token past the last, and neither has a block of
    # one token (every item a block runs or walks is below the count's): no clamps, no
    # guards.
    whole_blocks = tokens == 1 or (count is not None and count % tokens == 0)
    # A head's mean square over its rotary dims and its dims past R, two layouts: each
    # part's sum goes through SMEM to the other's layout.
    exchange = bool(passing) and (norm_q or norm_k)
    exchange_heads = max([p.q_heads for p in work] + [k_heads])

    def halves(x_ref, heads: bool = True):
        if interleave:  # [H, D/2, 2]: even and odd elements
            return _dim_refs(x_ref, 0, half, True, heads)
        return _dim_refs(x_ref, 0, half, False, heads) + _dim_refs(x_ref, half, half, False,
                                                                   heads)

    def past_rotary(x_ref, heads: bool = True):  # dims [R, D)
        return _dim_refs(x_ref, width(rotary_dim), width(passing), interleave,
                         heads) if passing else []

    def split_of(piece: Piece) -> RowSplit:
        return rotary_split(piece, k_heads, half, itemsize, interleave, vector_bytes)

    sharing = any(shares_angle(split_of(p), half, tuning.share_angle) for p in work)
    most_items = None if max_count is None else -(-max_count // tokens) * len(work)
    # A block that has formed an angle before waits for every thread's reads of it
    # before it writes the next: within a walk of tokens, and in a launch whose blocks
    # walk items (tests/gpu/test_mosaic_launch_gpu.py's one-block walk runs this on a
    # GPU; the interpreter cannot show a race within a warpgroup).
    walking = count is None and walks(grid, most_items)

    def block(n, refs, first: int | jax.Array, walk: int, piece: Piece):
        refs = list(refs)
        norm_smem = refs.pop() if exchange else None
        angle_smem = refs.pop() if sharing else None
        q_out_ref = refs.pop() if q_fp8 else None
        pos_ref, slot_ref, tables_ref, rows_ref, scale_ref, q_ref, k_ref, v_ref, *refs = refs
        q_weight_ref = refs.pop(0) if norm_q else None
        k_weight_ref = refs.pop(0) if norm_k else None
        cache_refs = refs
        k_cache, v_cache = cache_refs[0], cache_refs[rows.value_array]
        split = split_of(piece)
        rotary = row_layout(split)
        angle, per_head = rotary.reduce((0,)), rotary.reduce((1,))
        q_rest_layout, q_rest_copies = None, 1
        if q_rest_read and piece.q_heads:
            q_rest_layout = row_layout(rest_split(piece.q_heads))
            q_rest_copies = rest_split(piece.q_heads).copies
        share = shares_angle(split, half, tuning.share_angle)
        formed = row_layout(angle_split(half)).reduce((0,)) if share else angle
        turns = [load(tables_ref.at[i], formed) for i in range(3)]
        slot_rows = load(rows_ref, formed) if mrope else None
        scales = (scale_ref.at[0][...], scale_ref.at[1][...]) if quantize and piece.kv else (
            None, None)
        q_scale = scale_ref.at[2][...] if q_fp8 and piece.q_heads else None

        def weights(w_ref, rest_layout):
            # A norm weight's rotary halves (in the layout of a head's halves) and its dims
            # past R, float32, 1 + w for Gemma.
            def one(ref, layout):
                w = load(ref, layout).astype(jnp.float32)
                return 1.0 + w if qk_norm.convention == "gemma" else w
            return ([one(r, angle) for r in halves(w_ref, False)],
                    [one(r, rest_layout.reduce((0,))) for r in past_rotary(w_ref, False)])

        # (name, heads, layout of its dims past R, weights) of each x normalised here.
        normed = []
        if norm_q and piece.q_heads:
            normed.append(("q", piece.q_heads, q_rest_layout,
                           weights(q_weight_ref, q_rest_layout)))
        if norm_k and piece.kv:
            normed.append(("k", k_heads, rest, weights(k_weight_ref, rest)))

        def q_of(x_ref, t):
            return x_ref.at[t, pl.ds(piece.q_first, piece.q_heads)]

        def fetch(i):
            # Token first + i, clamped to the last one (its stores are then skipped):
            # scalars and every array it reads, as a dict.
            t = first + i
            if whole_blocks:
                real = True
            else:
                real, t = t < n, jnp.minimum(t, n - 1)
            pos = [pos_ref.at[t if r == 0 else r * n + t][...] for r in range(3 if mrope else 1)]
            x = dict(t=t, real=real, pos=pos,
                     q=[load(r, rotary) for r in halves(q_of(q_ref, t))] if piece.q_heads else [],
                     q_rest=[load(r, q_rest_layout) for r in past_rotary(q_of(q_ref, t))]
                     if q_rest_layout else [])
            if piece.kv:
                x.update(
                    slot=slot_ref.at[t][...],
                    k=[load(r, rotary) for r in halves(k_ref.at[t])],
                    k_rest=[load(r, rest) for r in past_rotary(k_ref.at[t])],
                    v=[load(r, whole) for r in _dim_refs(v_ref.at[t], 0, width(head_dim),
                                                       interleave)])
            return x

        def cos_sin(pos, again: bool):
            shape = (half,)
            wide = [broadcast(p, shape, (), formed) for p in pos]
            if mrope:
                p_t, p_h, p_w = wide
                position = jnp.where(slot_rows == 2, p_w, jnp.where(slot_rows == 1, p_h, p_t))
            else:
                position = wide[0]
            cos, sin = angle_cos_sin(position, *turns, attention_factor, floor=floor)
            if not share:
                return cos, sin
            if again:
                plgpu.commit_smem()  # every thread has read the previous angle
            store(angle_smem.at[0], cos)
            store(angle_smem.at[1], sin)
            plgpu.commit_smem()
            return load(angle_smem.at[0], angle), load(angle_smem.at[1], angle)

        def squares(parts):  # [H]: the sum of squares over the last axis of the parts
            return jnp.sum(functools.reduce(jnp.add, [p * p for p in parts]), axis=1)

        def normalise(x, again: bool):
            # x's q and k (and their dims past R) normalised, float32: the mean square
            # over each head's D, its rsqrt times the weight, as jaxrope.qk_norm.normalize.
            values = {name: ([a.astype(jnp.float32) for a in x[name]],
                             [a.astype(jnp.float32) for a in x[name + "_rest"]])
                      for name, *_ in normed}
            sums = [(squares(pair), squares(past) if past else None)
                    for pair, past in (values[name] for name, *_ in normed)]
            if exchange:
                if again:
                    plgpu.commit_smem()  # every thread has read the previous token's sums
                for i, ((own, past), (_, heads, *_)) in enumerate(zip(sums, normed)):
                    store(norm_smem.at[2 * i, pl.ds(0, heads)], own)
                    store(norm_smem.at[2 * i + 1, pl.ds(0, heads)], past)
                plgpu.commit_smem()
                # One sum in each layout, the same bits (a + b == b + a).
                sums = [(own + load(norm_smem.at[2 * i + 1, pl.ds(0, heads)], per_head),
                         load(norm_smem.at[2 * i, pl.ds(0, heads)], past_layout.reduce((1,)))
                         + past)
                        for i, ((own, past), (_, heads, past_layout, _)) in enumerate(
                            zip(sums, normed))]
            out = dict(x)
            for (name, heads, past_layout, (w, w_past)), (total, total_past) in zip(normed, sums):
                pair, past = values[name]
                out[name] = [scaled(a, total, wa, heads, half, rotary)
                             for a, wa in zip(pair, w)]
                out[name + "_rest"] = [scaled(a, total_past, wa, heads, width(passing),
                                              past_layout) for a, wa in zip(past, w_past)]
            return out

        def scaled(a, total, w, heads, columns, layout):
            full = (heads, columns)
            inverse = jax.lax.rsqrt(total * (1.0 / head_dim) + qk_norm.eps)
            return a * broadcast(inverse, full, (0,), layout) * broadcast(w, full, (1,), layout)

        def rotate(pair, cos, sin, heads):
            full = (heads, half)
            c, s = (broadcast(x, full, (1,), rotary) for x in (cos, sin))
            a, b = (x.astype(jnp.float32) for x in pair)
            return a * c - b * s, b * c + a * s

        def cached(x, scale, dtype):
            # A cache in the input's dtype holds the value as is: to_cache_dtype of its
            # float32 widening, bit for bit.
            if not quantize:
                return x.astype(dtype)
            return to_cache_dtype(x.astype(jnp.float32), scale, dtype)

        def finish(x, again: bool):
            t, real = x["t"], x["real"]
            cos, sin = cos_sin(x["pos"], again)
            if normed:
                x = normalise(x, again)
            if piece.q_heads:
                q_out = rotate(x["q"], cos, sin, piece.q_heads)
                q_past = x["q_rest"] if norm_q or q_fp8 else []
                if q_fp8:
                    out_ref = q_of(q_out_ref, t)
                    to_q = lambda value, ref: to_cache_dtype(value.astype(jnp.float32), q_scale,
                                                             FP8)
                else:
                    out_ref = q_of(q_ref, t)
                    to_q = lambda value, ref: value.astype(ref.dtype)
                    if split.copies > 1 or (q_past and q_rest_copies > 1):
                        # Several threads hold each element of q, which is rotated in
                        # place: without a barrier a warp ahead of the others could store
                        # q rotated before another loads it, which would then rotate it
                        # twice.
                        plgpu.commit_smem()
                # q is rotated whatever the slot; only a clamped repeat of the last token
                # skips it.
                guard = (lambda stores: stores()) if real is True else pl.when(real)

                out_refs = halves(out_ref) + (past_rotary(out_ref) if q_past else [])

                @guard
                def _():
                    for ref, value in zip(out_refs, list(q_out) + q_past):
                        store(ref, to_q(value, ref))
            if not piece.kv:
                return
            k_out = rotate(x["k"], cos, sin, k_heads)
            slot = x["slot"]
            ok = (slot >= 0) & (slot < rows.num_slots)
            if real is not True:
                ok = ok & real
            safe = jnp.where(ok, slot, 0)
            page, entry = jax.lax.div(safe, rows.page_size), jax.lax.rem(safe, rows.page_size)
            base = page * rows.page_stride + entry * rows.entry_stride

            def at(cache_ref, offset):
                row = base + offset
                return cache_ref.at[jax.lax.div(row, head_rows), :, jax.lax.rem(row, head_rows)]

            @pl.when(ok)
            def _():
                k_row, v_row = at(k_cache, 0), at(v_cache, rows.value_offset)
                for ref, value in zip(halves(k_row), k_out):
                    store(ref, cached(value, scales[0], ref.dtype))
                for ref, value in zip(past_rotary(k_row), x["k_rest"]):
                    store(ref, cached(value, scales[0], ref.dtype))
                for ref, value in zip(_dim_refs(v_row, 0, width(head_dim), interleave), x["v"]):
                    store(ref, cached(value, scales[1], ref.dtype))

        # Token i + 1's loads go out before token i's stores.
        ahead = fetch(0)
        for i in range(walk):
            current, ahead = ahead, fetch(i + 1) if i + 1 < walk else None
            finish(current, walking or i > 0)

    def one_item(n, refs, item):
        # Item = token block * pieces + piece: a token's pieces are neighbours.
        if len(work) == 1:
            block(n, refs, item * tokens, tokens, work[0])
            return
        b, which = jax.lax.div(item, len(work)), jax.lax.rem(item, len(work))
        for i, piece in enumerate(work):
            pl.when(which == i)(lambda piece=piece: block(n, refs, b * tokens, tokens, piece))

    def body(*operands):
        if count is None:
            count_ref, *refs = operands
            n = count_ref[0]
        else:
            refs, n = operands, count
        one = functools.partial(one_item, n, refs)
        if count is not None:
            one(jax.lax.axis_index("block"))
        else:
            walk(jax.lax.div(n + (tokens - 1), tokens) * len(work), grid, one, most_items)

    if count is not None:
        grid = -(-count // tokens) * len(work)
    scratch = ((plgpu.SMEM((2, half), jnp.float32),) if sharing else ()) + (
        (plgpu.SMEM((4, exchange_heads), jnp.float32),) if exchange else ())
    # With a static T the fp8 q is the kernel's result (nothing to clear first); a launch
    # outside JAX passes its buffer as the last operand instead.
    last = (head_dim // 2, 2) if interleave else (head_dim,)
    out_type = ((jax.ShapeDtypeStruct((count, q_heads, *last), FP8),)
                if q_fp8 and count is not None else ())
    return kernel(body, grid, "jaxrope_rope_append_kv_mosaic", interpret, scratch=scratch,
                  out_type=out_type)


def cache_view(cache, rows: CacheRows, k_heads: int, interleave: bool):
    """The ``[rows, D]`` matrix ``cache`` as the kernel's ``[rows // (Hk * hs), Hk, hs,
    D]`` (GPT-J: ``[..., D/2, 2]``)."""
    head_rows = k_heads * rows.head_stride
    last = (cache.shape[-1] // 2, 2) if interleave else (cache.shape[-1],)
    return cache.reshape(cache.shape[0] // head_rows, k_heads, rows.head_stride, *last)


def rope_append_kv_mosaic(q, k, v, pos_ids, slots, tables, scales, caches, *, rows: CacheRows,
                          rotary_dim: int, interleave: bool, attention_factor: float,
                          mrope_section: Optional[Tuple[int, int, int]] = None,
                          mrope_interleaved: bool = False, interpret: bool = False,
                          tuning: Optional[AppendMosaicTuning] = None,
                          q_norm_weight=None, k_norm_weight=None,
                          qk_norm: Optional[QKNorm] = None, q_dtype=None):
    """Rotate q and write rotated k and v into the paged ``caches``, in one kernel.

    Arguments as :func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`
    (the caches ``[rows, D]`` views addressed by ``rows``, ``scales`` float32 ``[3]`` =
    ``[k, v, q]``); returns ``(q_out, caches)``: q rotated in place when q and the caches
    are donated (mutable refs), or with ``q_dtype`` float8_e4m3fn a new float8_e4m3fn
    ``[T, Hq, D]`` holding ``e4m3(clip(x * scales[2], -448, 448))`` of every dim of the
    rotated (and normalised) q, q itself unchanged. Per-head norms (``qk_norm.per_head``)
    are computed in the kernel. ``tuning`` as :func:`build_append`'s.

    Raises:
      BackendUnavailable: a JAX :func:`jaxrope.ops.mosaic_common.unavailable` names.
      NotImplementedError: a norm weight with ``qk_norm.per_head`` False
        (:func:`jaxrope.qk_norm.per_token_norm`).
      ValueError: ``q_dtype`` neither None, q's dtype nor float8_e4m3fn; an fp8 q with
        ``scales`` not ``[3]``.
    """
    norm_q, norm_k = q_norm_weight is not None, k_norm_weight is not None
    if (norm_q or norm_k) and not qk_norm.per_head:
        raise NotImplementedError(per_token_norm("mosaic"))
    if q_dtype is not None and jnp.dtype(q_dtype) not in (jnp.dtype(q.dtype), FP8):
        raise ValueError(f"q_dtype={jnp.dtype(q_dtype)} must be None, q's dtype ({q.dtype}) or "
                         "float8_e4m3fn")
    q_fp8 = fp8_q(q_dtype)
    if q_fp8 and tuple(scales.shape) != (3,):
        raise ValueError(f"scales.shape={tuple(scales.shape)} must be (3,) ([k, v, q]) for an "
                         "fp8 q: the kernel reads q's scale at scales[2]")
    reason = unavailable()
    if reason:
        raise BackendUnavailable(reason)
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if num_tokens == 0:
        return (jnp.zeros(q.shape, FP8) if q_fp8 else q), tuple(caches)
    kernel = build_append(
        q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        itemsize=np.dtype(q.dtype).itemsize, rotary_dim=rotary_dim, interleave=interleave,
        attention_factor=attention_factor, rows=rows,
        quantize=jnp.dtype(caches[0].dtype) == FP8,
        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, count=num_tokens,
        interpret=interpret, tuning=tuning, qk_norm=qk_norm, norm_q=norm_q, norm_k=norm_k,
        q_dtype=FP8 if q_fp8 else None)
    row_table = slot_row_table(rotary_dim // 2, mrope_section, mrope_interleaved)
    pairs = (lambda x: x.reshape(*x.shape[:-1], head_dim // 2, 2)) if interleave else (
        lambda x: x)
    q_view, k_view, v_view = (pairs(x) for x in (q, k, v))
    weights = [pairs(w) for w in (q_norm_weight, k_norm_weight) if w is not None]
    q_in = q_view if q_fp8 else jax.new_ref(q_view)
    cache_refs = [jax.new_ref(cache_view(c, rows, k_heads, interleave)) for c in caches]
    results = kernel(pos_ids.reshape(-1), slots, tables, row_table, scales, q_in, k_view, v_view,
                     *weights, *cache_refs)
    q_out = results[0] if q_fp8 else jax.freeze(q_in)
    return (q_out.reshape(q.shape),
            tuple(jax.freeze(r).reshape(c.shape) for r, c in zip(cache_refs, caches)))
