"""The RoPE kernel in Pallas's Mosaic GPU dialect (``plgpu.kernel``, Hopper and newer).

JAX 0.11 deprecates Pallas's Triton lowering; Mosaic GPU is its successor, and its
``pallas_call`` is deprecated too, so this is a ``plgpu.kernel`` with a body of its own
(:mod:`jaxrope.ops.rope.triton` is the Triton-lowered twin). Its split is a
:class:`jaxrope.ops.rope.tuning.MosaicTuning`, an argument of :func:`build`.

One block (one warpgroup, 128 threads) rotates ``tokens_per_block`` tokens: warps and
lanes split the tokens and the rotary pairs, each thread holding one vector of ``vec``
pairs per slot and every head of a head group in its registers. The layout is a Mosaic
GPU ``TiledLayout`` whose head dimension is never split across threads, so removing it
(``reduce``) gives the layout of a ``[tokens, R/2]`` array that every head group of q
and of k broadcasts for free: the angle is computed once per (token, pair) and serves
``Hq + Hk`` heads, for any head count. Head groups are loaded ahead of the group
being rotated (``MosaicTuning.in_flight``), so a group's stores overlap later groups' loads,
and a token block's head groups are split among neighbouring blocks
(:func:`jaxrope.ops.rope.tuning.head_splits`: one group each by default, with a few
bytes a thread): many short blocks keep more bytes moving than few blocks walking many
heads.

Layouts: NeoX halves are dims ``[0, R/2)`` and ``[R/2, R)`` of a head; GPT-J pairs are
the even and odd elements of ``[0, R)``, read through a ``[T, H, D/2, 2]`` view of the
same buffer (one element per vector: the two halves interleave in memory). Only rotated
dims are read and written. M-RoPE (``mrope_section``, positions ``[3, T]``) loads the
three rows of a block's tokens and picks one per slot with the rows
:func:`jaxrope.ops.angle.slot_rows` assigns (a ``[R/2]`` int table built outside
the kernel); the angle is :func:`jaxrope.ops.angle.angle_cos_sin`, the accurate
one every backend shares.

Tokens past the last whole block are rotated by the blocks of the last whole block,
after it and behind a barrier, as a whole block shifted to end at T whose first tokens
(already rotated) are stored back as loaded: every block has one layout and one
register budget, and no block touches another block's tokens. Only a T under one
block (a static T, or a launch whose counts may be) takes a path of single tokens, in
a layout where the warps and the lanes that split tokens hold copies: a store of a
copy writes the same value, and a barrier before each head group's stores keeps every
copy's load ahead of them.

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
from jaxrope.ops.mosaic_common import (as_pallas, broadcast, floor, kernel, load, slot_row_table,
                                       store, tiled, unavailable, walk)
from jaxrope.ops.rope.tuning import WARPS, MosaicTuning, head_splits, mosaic_tuning


def data_layout(p: MosaicTuning, tokens: int, group: int, half: int):
    """The layout of a ``[tokens, group, half]`` block: ``tokens`` is the tuning's block,
    or 1 for the tail (its token lanes and warps then hold copies).

    Tiled by ``(tokens, group, P)``, ``(token_lanes, group, P)`` and ``(1, 1, vec)`` with
    ``P = lanes_pairs * vec``, the tiled shape ends ``[4, 1, 1, token_lanes, group,
    lanes_pairs, 1, 1, vec]``: dim -9 is the warp, -6 and -4 the lanes, -1 the vector;
    ``group`` (-5) stays in each thread's registers.
    """
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    pairs = p.lanes_pairs * p.vec
    if tokens == 1:
        copies = (fa.Replicated(p.token_lanes),) if p.token_lanes > 1 else ()
        return tiled(((1, group, pairs), (1, 1, p.vec)), (fa.Replicated(WARPS),),
                      (*copies, -4))
    return tiled(((tokens, group, pairs), (p.token_lanes, group, pairs), (1, 1, p.vec)),
                  (-9,), (-6, -4))


def build(*, q_heads: int, k_heads: int, head_dim: int, itemsize: int, rotary_dim: int,
          interleave: bool, attention_factor: float,
          mrope_section: Optional[Tuple[int, int, int]] = None,
          mrope_interleaved: bool = False, count: Optional[int] = None,
          grid: Optional[int] = None, splits: Optional[int] = None, min_count: int = 1,
          max_count: Optional[int] = None, interpret: bool = False,
          tuning: Optional[MosaicTuning] = None):
    """The ``plgpu.kernel`` for one head layout: ``kernel(*operands)`` over GMEM refs.

    Operands: ``(pos_ids, tables, rows, q, k)`` with ``pos_ids`` flat int32 (M-RoPE: row
    ``r`` of token ``t`` at ``r * count + t``), ``tables`` the ``[3, R/2]`` angle tables,
    ``rows`` :func:`slot_row_table`, ``q``/``k`` mutable ``[T, H, D]`` refs (GPT-J:
    ``[T, H, D/2, 2]`` views). ``count`` is the static T, one block per
    ``tokens_per_block`` tokens (JAX calls). ``count=None`` builds the kernel a launch
    outside JAX uses: an int32 ``count`` operand comes first and is read at run time,
    and ``grid`` blocks walk the blocks of ``count`` tokens in turn, so one compiled
    kernel serves every T its refs hold (the torch bridge); ``min_count`` and
    ``max_count`` bound the counts it will see: a bound of a block or more leaves out the
    single-token path (and its registers), and a grid with a block for every item of
    ``max_count`` tokens leaves out the walk. ``splits`` divides the head groups among
    that many blocks per token block (default: :func:`jaxrope.ops.rope.tuning.head_splits`
    of the static count's blocks, or of one block with a run-time count; launches pass
    theirs). ``tuning``: the split (default: :func:`jaxrope.ops.rope.tuning.mosaic_tuning`
    of the head layout).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    half = rotary_dim // 2
    p = tuning or mosaic_tuning(q_heads, k_heads, half, head_dim, itemsize, interleave)
    mrope = mrope_section is not None
    layouts = {tokens: {g: data_layout(p, tokens, g, half) for g in {p.q_group, p.k_group}}
               for tokens in (p.tokens_per_block, 1)}

    def halves(x_ref, tokens, heads):
        if interleave:  # x_ref is the [T, H, D/2, 2] view
            pairs = pl.ds(0, half)
            return x_ref.at[tokens, heads, pairs, 0], x_ref.at[tokens, heads, pairs, 1]
        return x_ref.at[tokens, heads, pl.ds(0, half)], x_ref.at[tokens, heads, pl.ds(half, half)]

    def rotate(n, pos_ref, tables_ref, rows_ref, q_ref, k_ref, t0, tokens, chunk, keep=None):
        # keep: a run-time count of the block's first tokens to store back as they were
        # loaded (the shifted last block, see body).
        by_group = layouts[tokens]
        spans = pl.ds(t0, tokens)
        work = [((q_ref, k_ref)[x], group, g) for x, group, g in chunk]

        def load_group(item):
            x_ref, group, g = item
            refs = halves(x_ref, spans, pl.ds(g * group, group))
            return refs, [load(r, by_group[group]) for r in refs]

        # The first groups' loads go out before the positions': the angle's arithmetic
        # then overlaps them instead of delaying them.
        in_flight = [load_group(item) for item in work[:p.in_flight]]
        data = by_group[work[0][1]]
        angle, slots, per_token = data.reduce((1,)), data.reduce((0, 1)), data.reduce((1, 2))
        shape = (tokens, half)
        turns = [broadcast(load(tables_ref.at[i], slots), shape, (1,), angle) for i in range(3)]

        def positions(row):
            start = t0 if row == 0 else row * n + t0
            if tokens == 1:
                return broadcast(pos_ref.at[start][...], shape, (), angle)
            return broadcast(load(pos_ref.at[pl.ds(start, tokens)], per_token), shape, (0,),
                             angle)

        if not mrope:
            pos = positions(0)
        else:
            row = broadcast(load(rows_ref, slots), shape, (1,), angle)
            p_t, p_h, p_w = (positions(r) for r in range(3))
            pos = jnp.where(row == 2, p_w, jnp.where(row == 1, p_h, p_t))
        cos, sin = angle_cos_sin(pos, *turns, attention_factor, floor=floor)
        wide, kept = {}, {}
        for group in {group for _, group, _ in work}:
            layout = by_group[group]
            assert layout.reduce((1,)) == angle, (layout, angle)
            full = (tokens, group, half)
            wide[group] = (broadcast(cos, full, (0, 2), layout),
                           broadcast(sin, full, (0, 2), layout))
            if keep is not None:
                index = plgpu.broadcasted_iota(jnp.int32, (tokens,), 0,
                                               layout=as_pallas(per_token))
                kept[group] = broadcast(index, full, (0,), layout) < keep
        for i, (x_ref, group, g) in enumerate(work):
            (first, second), (a, b) = in_flight.pop(0)
            if i + p.in_flight < len(work):
                in_flight.append(load_group(work[i + p.in_flight]))
            if tokens == 1:
                # Every warp (and token lane) holds a copy of the one token: without a
                # barrier a warp ahead of the others could store the group rotated before
                # another loads it, which would then rotate it twice.
                plgpu.commit_smem()
            c, s = wide[group]
            x, y = a.astype(jnp.float32), b.astype(jnp.float32)
            new_a, new_b = (x * c - y * s).astype(first.dtype), (y * c + x * s).astype(second.dtype)
            if keep is not None:
                new_a, new_b = jnp.where(kept[group], a, new_a), jnp.where(kept[group], b, new_b)
            store(first, new_a)
            store(second, new_b)

    tpb = p.tokens_per_block
    # Head groups as (0 for q / 1 for k, heads per group, group index), split into
    # `splits` contiguous chunks: a block rotates one chunk of one token block.
    work = [(x, group, g) for x, heads, group in ((0, q_heads, p.q_group), (1, k_heads, p.k_group))
            for g in range(heads // group)]
    if splits is None:
        splits = head_splits(-(-count // tpb) if count is not None else 1, len(work),
                             p.block_groups, p.min_blocks)
    chunks = [work[len(work) * s // splits:len(work) * (s + 1) // splits] for s in range(splits)]
    # Counts below one block rotate their tokens one at a time; a kernel that never sees
    # one (a static count, or a launch's lower bound, of a block or more) leaves that
    # path out, and with it its registers.
    single_tokens = (count if count is not None else min_count) < tpb

    def body(*operands):
        if count is None:
            count_ref, *refs = operands
            n = count_ref[0]
            full_blocks, tail = jax.lax.div(n, tpb), jax.lax.rem(n, tpb)
        else:
            refs, n = operands, count
            full_blocks, tail = divmod(count, tpb)
        static = isinstance(full_blocks, int)

        def shifted_tail(b, chunk):
            # The tokens past the last whole block are rotated by that block's own blocks,
            # after it, as a block shifted to end at the count: its first tokens (the last
            # block's, already rotated) are stored back unchanged. A barrier keeps every
            # thread's stores of the last block ahead of the shifted block's loads; one
            # block does both, so no other block's stores race them.
            if static and not tail:
                return  # a Python int (a JAX call's static T) leaves out what no block runs

            @pl.when(b == full_blocks - 1 if static
                     else jnp.logical_and(b == full_blocks - 1, tail > 0))
            def _():
                plgpu.commit_smem()
                rotate(n, *refs, n - tpb, tpb, chunk, keep=tpb - tail)

        def single(b, chunk):
            # Under one block: block 0 of each split, one token at a time.
            if single_tokens and (not static or not full_blocks):
                @pl.when(b == 0 if static else jnp.logical_and(b == 0, full_blocks == 0))
                def _():
                    def one(i, carry):
                        rotate(n, *refs, i, 1, chunk)
                        return carry
                    jax.lax.fori_loop(0, n, one, 0)

        def one_block(b, chunk):
            def whole():
                rotate(n, *refs, b * tpb, tpb, chunk)
                shifted_tail(b, chunk)
            if not static or full_blocks:
                pl.when(b < full_blocks)(whole)
            single(b, chunk)

        def one_item(item):
            # Item = token block * splits + chunk: a token block's chunks are neighbours.
            if splits == 1:
                one_block(item, chunks[0])
                return
            b, split = jax.lax.div(item, splits), jax.lax.rem(item, splits)
            for s, chunk in enumerate(chunks):
                pl.when(split == s)(functools.partial(one_block, b, chunk))

        block = jax.lax.axis_index("block")
        if count is not None:
            one_item(block)
            return
        # Whole blocks, or one (of single tokens) below a block.
        blocks = jnp.maximum(full_blocks, jnp.minimum(n, 1)) if single_tokens else full_blocks
        walk(blocks * splits, grid, one_item,
             None if max_count is None else -(-max_count // tpb) * splits)

    if count is not None:
        grid = max(count // tpb, 1) * splits
    return kernel(body, grid, "jaxrope_rope_mosaic", interpret)


def rope_mosaic(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, mrope_section: Optional[Tuple[int, int, int]] = None,
                mrope_interleaved: bool = False, interpret: bool = False,
                tuning: Optional[MosaicTuning] = None):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]`` (M-RoPE:
    ``[3, T]``); same contract as :func:`jaxrope.ops.rope.triton.rope_triton` (in
    place when donated). ``tuning`` as :func:`build`'s.

    Raises:
      BackendUnavailable: a JAX :func:`unavailable` names.
    """
    return run_static(build, q, k, pos_ids, tables, rotary_dim=rotary_dim,
                      interleave=interleave, attention_factor=attention_factor,
                      mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                      interpret=interpret, tuning=tuning)


def run_static(builder, q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
               mrope_section: Optional[Tuple[int, int, int]], mrope_interleaved: bool,
               **build_kwargs):
    """A JAX call of the rope kernel ``builder`` builds (:func:`build`'s keywords, the
    static token count of q): in place on q and k through mutable refs.

    Raises:
      BackendUnavailable: a JAX :func:`unavailable` names.
    """
    reason = unavailable()
    if reason:
        raise BackendUnavailable(reason)
    num_tokens, q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    rope = builder(q_heads=q_heads, k_heads=k.shape[1], head_dim=head_dim,
                   itemsize=np.dtype(q.dtype).itemsize, rotary_dim=rotary_dim,
                   interleave=interleave, mrope_section=mrope_section,
                   mrope_interleaved=mrope_interleaved, count=num_tokens, **build_kwargs)
    rows = slot_row_table(rotary_dim // 2, mrope_section, mrope_interleaved)
    views = [x.reshape(x.shape[0], x.shape[1], head_dim // 2, 2) if interleave else x
             for x in (q, k)]
    q_ref, k_ref = (jax.new_ref(x) for x in views)
    rope(pos_ids.reshape(-1), tables, rows, q_ref, k_ref)
    return tuple(jax.freeze(r).reshape(x.shape) for r, x in zip((q_ref, k_ref), (q, k)))
