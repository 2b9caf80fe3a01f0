"""The RoPE kernel in Pallas's Mosaic GPU dialect (``plgpu.kernel``, Hopper and newer).

JAX 0.11 deprecates Pallas's Triton lowering; Mosaic GPU is its successor, and its
``pallas_call`` is deprecated too, so this is a ``plgpu.kernel`` with a body of its own
(:mod:`jaxrope.kernels.pallas_triton` is the Triton-lowered twin).

One block (one warpgroup, 128 threads) rotates ``tokens_per_block`` tokens: warps and
lanes split the tokens and the rotary pairs, each thread holding one vector of ``vec``
pairs per slot and every head of a head group in its registers. The layout is a Mosaic
GPU ``TiledLayout`` whose head dimension is never split across threads, so removing it
(``reduce``) gives the layout of a ``[tokens, R/2]`` array that every head group of q
and of k broadcasts for free: the angle is computed once per (token, pair) and serves
``Hq + Hk`` heads, for any head count. Head groups are loaded ahead of the group
being rotated (``Plan.in_flight``), so a group's stores overlap later groups' loads,
and a token block's head groups are split among neighbouring blocks
(:func:`head_splits`: one group each by default, with a few bytes a thread): many short
blocks kept more bytes moving than few blocks walking many heads.

Layouts: NeoX halves are dims ``[0, R/2)`` and ``[R/2, R)`` of a head; GPT-J pairs are
the even and odd elements of ``[0, R)``, read through a ``[T, H, D/2, 2]`` view of the
same buffer (one element per vector: the two halves interleave in memory). Only rotated
dims are read and written. M-RoPE (``mrope_section``, positions ``[3, T]``) loads the
three rows of a block's tokens and picks one per slot with the rows
:func:`jaxrope.kernels.angle.slot_rows` assigns (a ``[R/2]`` int table built outside
the kernel); the angle is :func:`jaxrope.kernels.angle.angle_cos_sin`, the accurate
one every backend shares.

Tokens past the last whole block are rotated by the blocks of the last whole block,
after it and behind a barrier, as a whole block shifted to end at T whose first tokens
(already rotated) are stored back as loaded: every block has one layout and one
register budget, and no block touches another block's tokens. Only a T under one
block (a static T, or a launch whose counts may be) takes a path of single tokens, in
a layout where the warps and the lanes that split tokens hold copies: a store of a
copy writes the same value, and a barrier before each head group's stores keeps every
copy's load ahead of them. ``floor`` has no Mosaic GPU lowering, so it is built from a truncating
int conversion (the values floored stay below ``2**31`` in magnitude).

On CPU it runs in Mosaic GPU's interpreter (``interpret=True``), for tests.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrope.errors import BackendUnavailable
from jaxrope.kernels.angle import angle_cos_sin, slot_rows

_WARPS = 4          # warps of a warpgroup
_LANES = 32         # threads of a warp
# Bytes of q and k one thread moves a block, and the widest vector it moves them in.
# Bytes a thread, not what it computes, set this kernel's speed on the H200 (bf16 Hq 32 /
# Hk 8 / D 128, bench/RESULTS.md): a Mosaic GPU kernel that only negates q and k in place
# ran at 98.4% of torch's in-place ceiling with 32 bytes a thread a block and at 93.1%
# with 128; the rope kernel at 32 bytes (one group of 4 heads x 2 pairs a thread, 4-byte
# vectors, one group a block) ran within 1% of the Triton-lowered kernel, at 256 bytes
# (16-byte vectors, two 128-byte groups a block) 3-4% behind it.
_GROUP_BYTES = 32
_VEC_BYTES = 4
_BLOCK_BYTES = 32
# The fewest heads one angle should serve: at 2 heads an angle (32 bytes a thread, 4
# pairs of each) the angle's arithmetic showed again, 15% slower than at 4. A group grows
# to reach it only while it stays within _ANGLE_HEADS x _GROUP_BYTES a thread.
_ANGLE_HEADS = 4
# Head groups a block has loaded at a time, the one being rotated included. With one
# group a block (the default) it matters only where a block rotates several: small
# groups of few-byte heads. 2-8 groups in flight were within 2% of each other at 32-128
# bytes a group and several groups a block (bench/RESULTS.md's git history, 2026-12-02).
_IN_FLIGHT = 2
# Blocks a launch should have before it splits heads further: two per SM of an H100/H200.
_MIN_BLOCKS = 264


def unavailable() -> Optional[str]:
    """Why this JAX cannot build the kernel (it needs 0.11's Mosaic GPU API), or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # JAX 0.10 imports absl there
        return f"Mosaic GPU Pallas does not import with jax {jax.__version__}: {e}"
    # 0.10 has neither; its plgpu.load also takes a different signature.
    if not (hasattr(plgpu, "InterpretGPUParams") and hasattr(jax, "new_ref")):
        return (f"jax {jax.__version__} lacks the Mosaic GPU API this kernel uses "
                "(mutable refs, the GPU interpreter): JAX 0.11 or newer")
    return None


# The newest JAX minor version whose Mosaic GPU is known to lower every layout of this
# kernel (tests/test_mosaic_interpret.py lowers every case on the CI's JAX versions; the
# compiled kernel has run on the H200 with 0.11.2, not yet with 0.12). A newer minor may
# refuse layouts, as 0.12 refused the stores of many until :func:`store`.
LOWERS_UP_TO = (0, 12)


def lowering_unavailable() -> Optional[str]:
    """Why "auto" must not pick this kernel with this JAX (:func:`unavailable`, or a JAX
    newer than :data:`LOWERS_UP_TO`), or None."""
    reason = unavailable()
    if reason is None and tuple(int(p) for p in jax.__version__.split(".")[:2]) > LOWERS_UP_TO:
        reason = (f"jax {jax.__version__} is newer than the JAX versions this kernel's Mosaic "
                  f"GPU lowering is tested on (up to {'.'.join(map(str, LOWERS_UP_TO))}), "
                  "so 'auto' runs the Triton-lowered kernel here")
    return reason


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call splits its work; a pure function of the layout (:func:`plan`)."""

    vec: int               # pairs per thread vector
    lanes_pairs: int       # lanes of a warp along the pairs; the rest split tokens
    tokens_per_block: int  # warps x token lanes
    q_group: int           # heads of q per load
    k_group: int
    in_flight: int         # head groups loaded at a time, the one being rotated included
    block_groups: int      # head groups one block rotates at most (:func:`head_splits`)

    @property
    def token_lanes(self) -> int:
        return _LANES // self.lanes_pairs


def _head_group(heads: int, pairs_per_thread: int, itemsize: int,
                group_bytes: int = _GROUP_BYTES) -> int:
    # The most heads, dividing the head count, whose two halves fit group_bytes a thread;
    # when that is under _ANGLE_HEADS, the fewest dividing heads that reach it, if they
    # fit _ANGLE_HEADS x group_bytes (a prime head count would otherwise take every head).
    head_bytes = 2 * pairs_per_thread * itemsize
    divisors = [g for g in range(1, heads + 1) if heads % g == 0]
    group = max((g for g in divisors if g * head_bytes <= group_bytes), default=1)
    least = min(heads, _ANGLE_HEADS)
    raised = [g for g in divisors
              if g >= least and g * head_bytes <= _ANGLE_HEADS * group_bytes]
    return group if group >= least or not raised else min(raised)


def plan(q_heads: int, k_heads: int, half: int, head_dim: int, itemsize: int,
         interleave: bool) -> Plan:
    """The one heuristic for the kernel's split.

    - Vectors as wide as ``_VEC_BYTES`` that divide the half and the head stride,
      narrower while a thread would hold more than 16 pairs of the angle; GPT-J pairs
      take one element (even and odd elements are not contiguous).
    - Lanes along the pairs: as many as the half's vectors allow (at most a warp), the
      rest of the warp and the four warps along tokens.
    - Head groups: the most heads that divide the head count within ``_GROUP_BYTES`` a
      thread, or, when those are fewer than ``_ANGLE_HEADS``, the fewest that serve that
      many heads an angle within ``_ANGLE_HEADS x _GROUP_BYTES``; ``_IN_FLIGHT`` of them
      loaded at a time, as many to a block as fit ``_BLOCK_BYTES`` a thread.
    """
    candidates = (1,) if interleave else (8, 4, 2, 1)
    for vec in candidates:
        if vec * itemsize > _VEC_BYTES or half % vec or head_dim % vec:
            continue
        lanes_pairs = math.gcd(half // vec, _LANES)
        if half // lanes_pairs <= 16 or vec == 1:
            break
    per_thread = half // lanes_pairs
    q_group, k_group = (_head_group(h, per_thread, itemsize) for h in (q_heads, k_heads))
    group_bytes = 2 * per_thread * itemsize * max(q_group, k_group)
    return Plan(vec, lanes_pairs, _WARPS * (_LANES // lanes_pairs), q_group, k_group,
                _IN_FLIGHT, max(1, _BLOCK_BYTES // group_bytes))


def head_splits(token_blocks: int, groups: int, block_groups: int) -> int:
    """Blocks sharing one token block's ``groups`` head groups: enough that none rotates
    more than ``block_groups`` (:attr:`Plan.block_groups`), and enough for
    :data:`_MIN_BLOCKS` blocks in all when the tokens alone make fewer (few tokens would
    otherwise leave most SMs idle), at most one group each.

    Example:
      >>> head_splits(1024, 10, 2), head_splits(4, 10, 2), head_splits(1, 3, 2)
      (5, 10, 3)
    """
    return max(1, -(-groups // block_groups), min(groups, -(-_MIN_BLOCKS // token_blocks)))


def tiled(tiles, warp_dims, lane_dims):
    # Mosaic GPU accepts only canonical layouts (size-1 tiled dims dropped): build the
    # readable form, then canonicalize it.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    return fa.TiledLayout(fa.Tiling(tiles), warp_dims=warp_dims, lane_dims=lane_dims,
                          vector_dim=-1, _check_canonical=False).canonicalize()


def as_pallas(layout):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.Layout.TILED(layout.tiling, warp_dims=layout.warp_dims,
                              lane_dims=layout.lane_dims, vector_dim=layout.vector_dim)


def _data_layout(p: Plan, tokens: int, group: int, half: int):
    """The layout of a ``[tokens, group, half]`` block: ``tokens`` is the plan's block,
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
        return tiled(((1, group, pairs), (1, 1, p.vec)), (fa.Replicated(_WARPS),),
                      (*copies, -4))
    return tiled(((tokens, group, pairs), (p.token_lanes, group, pairs), (1, 1, p.vec)),
                  (-9,), (-6, -4))


def load(ref, layout):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    # "optimized" transfers plan SMEM bank conflicts; these read GMEM, or (the fused
    # append's shared angle) a few hundred bytes of SMEM whose conflicts cost nothing
    # measurable.
    return plgpu.load(ref, layout=as_pallas(layout), optimized=False)


def store(ref, value) -> None:
    """``ref[...] = value`` as a plain transfer, like :func:`load`'s.

    JAX 0.12's ``ref[...] =`` plans an "optimized" transfer and refuses, on GMEM, vectors
    under 4 bytes a thread or not covering whole 32-byte sectors and 128-byte lines, and on
    SMEM (:mod:`jaxrope.kernels.mosaic_tma`) layouts it finds no bank-conflict-free order
    for, which the head groups of many layouts make; its ``plgpu.store(optimized=False)``
    skips that plan. JAX 0.11 has no ``plgpu.store`` and does not check.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def floor(x):
    t = x.astype(jnp.int32).astype(jnp.float32)  # truncates toward zero
    return jnp.where(t > x, t - 1.0, t)


def slot_row_table(half: int, mrope_section: Optional[Tuple[int, int, int]],
                   mrope_interleaved: bool) -> np.ndarray:
    """int32 ``[half]``: the positions row (0 t, 1 h, 2 w) each frequency slot reads; all
    zeros for 1-D RoPE (:func:`jaxrope.kernels.angle.slot_rows`)."""
    if mrope_section is None:
        return np.zeros((half,), np.int32)
    with jax.ensure_compile_time_eval():
        is_h, is_w = slot_rows(half, mrope_section, mrope_interleaved)
        return np.asarray(jnp.where(is_w, 2, jnp.where(is_h, 1, 0)), np.int32)


def build(*, q_heads: int, k_heads: int, head_dim: int, itemsize: int, rotary_dim: int,
          interleave: bool, attention_factor: float,
          mrope_section: Optional[Tuple[int, int, int]] = None,
          mrope_interleaved: bool = False, count: Optional[int] = None,
          grid: Optional[int] = None, splits: Optional[int] = None, min_count: int = 1,
          max_count: Optional[int] = None, interpret: bool = False):
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
    that many blocks per token block (default: :func:`head_splits` of the static count's
    blocks, or of one block with a run-time count; launches pass theirs).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    half = rotary_dim // 2
    p = plan(q_heads, k_heads, half, head_dim, itemsize, interleave)
    mrope = mrope_section is not None
    layouts = {tokens: {g: _data_layout(p, tokens, g, half) for g in {p.q_group, p.k_group}}
               for tokens in (p.tokens_per_block, 1)}

    def halves(x_ref, tokens, heads):
        if interleave:  # x_ref is the [T, H, D/2, 2] view
            pairs = pl.ds(0, half)
            return x_ref.at[tokens, heads, pairs, 0], x_ref.at[tokens, heads, pairs, 1]
        return x_ref.at[tokens, heads, pl.ds(0, half)], x_ref.at[tokens, heads, pl.ds(half, half)]

    def broadcast(x, shape, dims, layout):
        return plgpu.layout_cast(jax.lax.broadcast_in_dim(x, shape, dims), as_pallas(layout))

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
                             p.block_groups)
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


def walks(grid: int, most_items: Optional[int]) -> bool:
    """Whether :func:`walk` loops a block over several items: unless ``most_items`` (the
    most items a launch has) is known and the grid covers them."""
    return most_items is None or most_items > grid


def walk(items, grid: int, one_item, most_items: Optional[int] = None) -> None:
    """Inside a kernel of ``grid`` blocks: block ``b`` calls ``one_item`` on items ``b, b +
    grid, ...`` below ``items`` (a run-time count: one compiled grid for any count).

    ``most_items``, the most items a launch has: when the grid covers them, block ``b``
    runs item ``b`` or exits, with no loop (nor its registers). Walking was slower than a
    block an item in both kernels here: 2-9% for the rope launch at 264-2640 blocks,
    13-16% for the fused append at 8 blocks a SM (bench/RESULTS.md).
    """
    block = jax.lax.axis_index("block")
    if not walks(grid, most_items):
        pl.when(block < items)(functools.partial(one_item, block))
        return
    turns = jax.lax.div(items - block + (grid - 1), grid)

    def step(i, carry):
        one_item(block + i * grid)
        return carry
    jax.lax.fori_loop(0, turns, step, 0)


def kernel(body, grid: int, name: str, interpret: bool, warpgroups: int = 1,
           scratch=()):
    """The ``plgpu.kernel`` of a body over GMEM refs (then the ``scratch`` types' refs),
    with the compiler parameters every kernel here uses; ``name`` is what profilers show.
    ``warpgroups`` > 1 runs that many warpgroups a block, ``jax.lax.axis_index
    ("warpgroup")`` telling them apart (on the H200 both kernels here ran slower so,
    bench/RESULTS.md); not with ``scratch``, which the warpgroups would share while
    ``commit_smem`` orders one warpgroup's threads only."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if warpgroups > 1 and scratch:
        raise ValueError(f"warpgroups={warpgroups} with scratch {scratch}: one warpgroup a "
                         "block shares SMEM scratch safely, several do not")
    threads = dict(num_threads=warpgroups, thread_name="warpgroup") if warpgroups > 1 else {}
    return plgpu.kernel(
        body, out_type=(), scratch_types=scratch, grid=(grid,), grid_names=("block",),
        kernel_name=name, **threads,
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
            # The few reads of what another thread wrote (q's copies, the shared angle)
            # place their own commit_smem: a barrier after every store buys nothing.
            unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)


def rope_mosaic(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, mrope_section: Optional[Tuple[int, int, int]] = None,
                mrope_interleaved: bool = False, interpret: bool = False):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]`` (M-RoPE:
    ``[3, T]``); same contract as :func:`jaxrope.kernels.pallas_triton.rope_pallas` (in
    place when donated).

    Raises:
      BackendUnavailable: a JAX :func:`unavailable` names.
    """
    return run_static(build, q, k, pos_ids, tables, rotary_dim=rotary_dim,
                      interleave=interleave, attention_factor=attention_factor,
                      mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                      interpret=interpret)


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
