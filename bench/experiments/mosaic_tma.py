"""An experimental TMA-pipelined twin of :mod:`jaxrope.ops.rope.mosaic` (Hopper and newer).

Same contract and operands as :func:`jaxrope.ops.rope.mosaic.build` /
:func:`~jaxrope.ops.rope.mosaic.rope_mosaic`; only how bytes move differs. Each block
(one warpgroup) walks token blocks ``b, b + grid, ...`` of ``tokens_per_block`` tokens
through ``stages`` SMEM slots:

1. bulk async copies (TMA) bring q ``[tb, Hq, C]`` and k ``[tb, Hk, C]`` of a token block
   into a slot, each signalling its own mbarrier; ``C`` is the rotary dims ``R`` when the
   array allows a strided copy of them (``R * itemsize`` a multiple of 16 bytes, every
   box dim <= 256), else the whole head ``D`` (one contiguous bulk copy);
2. the block's positions are loaded once and its angle computed
   (:func:`jaxrope.ops.angle.angle_cos_sin`) *before* waiting on the slot's barriers,
   so the arithmetic overlaps the copies in flight;
3. head groups are rotated SMEM -> registers -> SMEM, in the register layout of
   :mod:`~jaxrope.ops.rope.mosaic` (warps and lanes split tokens and pairs, a head
   group in each thread's registers, the angle broadcast over heads);
4. ``commit_smem`` (a barrier and an async-proxy fence), then bulk copies SMEM -> GMEM as
   one group; the slot of the *previous* token block is refilled once its store group has
   been read out (``wait_smem_to_gmem(1, wait_read_only=True)``), so the newest store
   never blocks, and ``stages - 2`` token blocks' loads are in flight while one rotates.

No copy reads or writes past ``count`` tokens (the torch bridge's buffers end there): the
``count % tokens_per_block`` tokens past the last whole block are rotated one at a time
from GMEM by the block that would take the next token block, in
:mod:`~jaxrope.ops.rope.mosaic`'s single-token layout (copies in every warp, a barrier
before each group's stores). Layouts TMA cannot move (``head_dim * itemsize`` not a
multiple of 16 bytes, a copy not a multiple of 128 bytes, too much SMEM) raise
``ValueError`` naming the layout: use :mod:`~jaxrope.ops.rope.mosaic` there.

On CPU it runs in Mosaic GPU's interpreter (``interpret=True``), for tests.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxrope.ops.angle import angle_cos_sin
from jaxrope.ops.mosaic_common import as_pallas, floor, load, store, tiled
from jaxrope.ops.rope import mosaic as mosaic_rope
from jaxrope.ops.rope.tuning import MosaicTuning, head_group

_WARPS, _LANES = 4, 32
# SMEM a block may take (Hopper: 227 KiB a block, 228 KiB an SM), leaving room for the
# barriers and Mosaic's own scratch.
_SMEM_LIMIT = 220 * 1024
_SMEM_PER_SM = 228 * 1024
# The most elements a tiled (strided) TMA box takes along one dim.
_BOX_LIMIT = 256
# Bytes of one head group's halves a thread holds (the register kernel's plan before it
# moved to 32 bytes a thread; this variant was measured with it).
_GROUP_BYTES = 128
# The fewest heads one angle should serve (the register kernel's heuristic's).
_ANGLE_HEADS = 4
_MAX_STAGES = 4


@dataclasses.dataclass(frozen=True)
class TmaTuning:
    """The TMA variant's knobs (the defaults are a starting point for the sweep in
    ``bench/mosaic_bench.py --tma-sweep``, not a measured optimum).

    ``tokens_per_block``: tokens per copy; ``None`` takes the most tokens (the smallest
    block the register layout allows, doubled) whose q and k fit ``stage_bytes``.
    ``stages``: SMEM slots (>= 2; ``stages - 2`` loads run ahead of the rotated block);
    ``None`` takes as many as fit the SMEM, at most 4.
    ``sms``: streaming multiprocessors (132 on the H100 / H200 SXM); with a static count
    the grid is ``sms`` x the blocks an SM's SMEM holds, at most one per token block.
    """

    tokens_per_block: Optional[int] = None
    stages: Optional[int] = None
    stage_bytes: int = 32 * 1024
    sms: int = 132


DEFAULT_TUNING = TmaTuning()


@dataclasses.dataclass(frozen=True)
class TmaPlan:
    """How one layout is split (:func:`plan_tma`)."""

    tokens_per_block: int
    stages: int
    vec: int              # pairs per thread vector
    lanes_pairs: int      # lanes of a warp along the pairs
    copy_dims: int        # C: dims [0, C) of each head are copied (R, or D)
    q_group: int          # heads of q rotated at once
    k_group: int
    smem_bytes: int
    blocks_per_sm: int

    @property
    def layout_tokens(self) -> int:
        """Tokens one register tile spans: 4 warps x the lanes along tokens."""
        return _WARPS * (_LANES // self.lanes_pairs)

    def register_tuning(self) -> MosaicTuning:
        """The same split as the register kernel's :class:`MosaicTuning` (for its
        single-token layout)."""
        return MosaicTuning(self.vec, self.lanes_pairs, self.q_group, self.k_group,
                            in_flight=1, block_groups=1, min_blocks=1)


def _layout_tokens(half: int, vec: int) -> int:
    return _WARPS * (_LANES // math.gcd(half // vec, _LANES))


def plan_tma(q_heads: int, k_heads: int, half: int, head_dim: int, itemsize: int,
             interleave: bool, tuning: TmaTuning = DEFAULT_TUNING) -> TmaPlan:
    """The split of one layout, or ``ValueError`` naming why TMA cannot move it.

    - Copied dims: the rotary dims ``[0, R)`` when ``R * itemsize`` is a multiple of 16
      bytes and every box dim fits 256 (strided TMA), else the whole head (contiguous).
    - Vectors: the widest (<= 16 bytes, dividing the half) whose
      register tile (4 warps x ``32 / gcd(half / vec, 32)`` token lanes) divides the token
      block; tokens past one tile repeat in registers.
    - Head groups: as :func:`jaxrope.ops.rope.tuning.mosaic_tuning`, within ``_GROUP_BYTES`` (128) a thread, the
      budget this variant was measured at (the register kernel's is smaller).
    """
    rotary = 2 * half
    layout = f"{q_heads=} {k_heads=} {head_dim=} {rotary=} {itemsize=}"
    if tuning.stages is not None and tuning.stages < 2:
        raise ValueError(f"TMA needs stages >= 2, got {tuning.stages=}")
    if interleave:
        # Even and odd elements need a strided or reshaped view of the SMEM slot: JAX
        # 0.11.2's Mosaic GPU lowering refuses strided slices, its interpreter reshapes.
        raise ValueError(f"the TMA variant takes NeoX halves only, not GPT-J pairs "
                         f"(interleave=True, {layout}); use the register kernel (jaxrope.ops.rope.mosaic)")
    if head_dim * itemsize % 16:
        raise ValueError(f"TMA needs head_dim * itemsize a multiple of 16 bytes ({layout}); "
                         "use the register kernel (jaxrope.ops.rope.mosaic)")
    heads_fit = max(q_heads, k_heads) <= _BOX_LIMIT
    strided = (rotary < head_dim and rotary * itemsize % 16 == 0 and rotary <= _BOX_LIMIT
               and heads_fit)
    copy_dims = rotary if strided else head_dim
    token_bytes = (q_heads + k_heads) * copy_dims * itemsize
    vecs = tuple(v for v in (8, 4, 2, 1) if v * itemsize <= 16 and half % v == 0)
    tb = tuning.tokens_per_block
    if tb is None:
        tb = min(_layout_tokens(half, v) for v in vecs)
        while 2 * tb * token_bytes <= tuning.stage_bytes and 2 * tb <= _BOX_LIMIT:
            tb *= 2
    fitting = [v for v in vecs if tb % _layout_tokens(half, v) == 0]
    if not fitting:
        smallest = min(_layout_tokens(half, v) for v in vecs)
        raise ValueError(f"tokens_per_block={tb} must be a multiple of {smallest} for "
                         f"{layout} (4 warps x the lanes along tokens)")
    vec = fitting[0]
    if strided and tb > _BOX_LIMIT:
        raise ValueError(f"tokens_per_block={tb} exceeds the TMA box limit {_BOX_LIMIT} "
                         f"for a strided copy ({layout})")
    for heads in (q_heads, k_heads):
        if tb * heads * copy_dims * itemsize % 128:
            raise ValueError(f"a TMA copy of [{tb}, {heads}, {copy_dims}] is not a multiple "
                             f"of 128 bytes ({layout}); pick a larger tokens_per_block")
    stages = tuning.stages or max(2, min(_MAX_STAGES, _SMEM_LIMIT // (tb * token_bytes)))
    smem = stages * tb * token_bytes
    if smem > _SMEM_LIMIT:
        raise ValueError(f"{stages} stages of {tb} tokens take {smem} bytes of SMEM, "
                         f"over {_SMEM_LIMIT} ({layout}); lower tokens_per_block or stages")
    lanes_pairs = math.gcd(half // vec, _LANES)
    per_thread = (tb // (_WARPS * _LANES // lanes_pairs)) * half // lanes_pairs
    return TmaPlan(tb, stages, vec, lanes_pairs, copy_dims,
                   head_group(q_heads, per_thread, itemsize, _GROUP_BYTES, _ANGLE_HEADS),
                   head_group(k_heads, per_thread, itemsize, _GROUP_BYTES, _ANGLE_HEADS), smem,
                   max(1, _SMEM_PER_SM // smem))


def _block_layout(p: TmaPlan, group: int, half: int):
    """The register layout of a ``[tb, group, half]`` slab: :func:`jaxrope.ops.rope.mosaic.data_layout`'s
    tiles, with one more level when the block spans several register tiles of tokens
    (those repeat in registers; the tiled shape still ends ``[4, 1, 1, token_lanes,
    group, lanes_pairs, 1, 1, vec]``)."""
    pairs = p.lanes_pairs * p.vec
    token_lanes = _LANES // p.lanes_pairs
    tiles = [(p.tokens_per_block, group, pairs), (token_lanes, group, pairs), (1, 1, p.vec)]
    if p.tokens_per_block > p.layout_tokens:
        tiles.insert(1, (p.layout_tokens, group, pairs))
    return tiled(tuple(tiles), (-9,), (-6, -4))


def build_tma(*, q_heads: int, k_heads: int, head_dim: int, itemsize: int, rotary_dim: int,
              interleave: bool, attention_factor: float,
              mrope_section: Optional[Tuple[int, int, int]] = None,
              mrope_interleaved: bool = False, count: Optional[int] = None,
              grid: Optional[int] = None, interpret: bool = False,
              tuning: TmaTuning = DEFAULT_TUNING):
    """The TMA-pipelined ``plgpu.kernel``: ``kernel(*operands)`` over GMEM refs, the
    operands of :func:`jaxrope.ops.rope.mosaic.build` (NeoX halves only: ``q``/``k`` are ``[T, H, D]``).

    ``count`` static: ``grid`` defaults to ``tuning.sms`` x the blocks an SM holds, at
    most one per token block. ``count=None``: an int32 ``count`` operand comes first,
    read at run time, and ``grid`` (required) blocks walk the token blocks.

    Raises:
      ValueError: a layout TMA cannot move (:func:`plan_tma`), or ``count=None`` without
        ``grid``.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    half = rotary_dim // 2
    p = plan_tma(q_heads, k_heads, half, head_dim, itemsize, interleave, tuning)
    tb, stages, copy_dims = p.tokens_per_block, p.stages, p.copy_dims
    mrope = mrope_section is not None
    groups = {p.q_group, p.k_group}
    layouts = {tb: {g: _block_layout(p, g, half) for g in groups},
               1: {g: mosaic_rope.data_layout(p.register_tuning(), 1, g, half) for g in groups}}
    if count is None and grid is None:
        raise ValueError("count=None (the run-time count) needs a grid")
    if count is not None:
        grid = max(1, min(-(-count // tb), tuning.sms * p.blocks_per_sm))

    def halves(x_ref, tokens, heads):
        # x_ref: a [tokens, H, C] SMEM slot, or the [T, H, D] GMEM array for the tail.
        return x_ref.at[tokens, heads, pl.ds(0, half)], x_ref.at[tokens, heads, pl.ds(half, half)]

    def broadcast(x, shape, dims, layout):
        return plgpu.layout_cast(jax.lax.broadcast_in_dim(x, shape, dims), as_pallas(layout))

    # The angle's [tokens, R/2] layout: the data's without the heads (all in registers).
    angle_layout = {tokens: by[p.q_group].reduce((1,)) for tokens, by in layouts.items()}

    def turn_tables(tables_ref, rows_ref, tokens):
        by = layouts[tokens][p.q_group]
        slots, shape = by.reduce((0, 1)), (tokens, half)
        turns = [broadcast(load(tables_ref.at[i], slots), shape, (1,), angle_layout[tokens])
                 for i in range(3)]
        row = (broadcast(load(rows_ref, slots), shape, (1,), angle_layout[tokens])
               if mrope else None)
        return turns, row

    def cos_sin(pos_ref, n, t0, tokens, turns, row):
        by = layouts[tokens][p.q_group]
        angle, shape = angle_layout[tokens], (tokens, half)

        def positions(r):
            start = t0 if r == 0 else r * n + t0
            if tokens == 1:
                return broadcast(pos_ref.at[start][...], shape, (), angle)
            return broadcast(load(pos_ref.at[pl.ds(start, tokens)], by.reduce((1, 2))),
                             shape, (0,), angle)

        if mrope:
            p_t, p_h, p_w = (positions(r) for r in range(3))
            pos = jnp.where(row == 2, p_w, jnp.where(row == 1, p_h, p_t))
        else:
            pos = positions(0)
        cos, sin = angle_cos_sin(pos, *turns, attention_factor, floor=floor)
        wide = {}
        for group in groups:
            layout = layouts[tokens][group]
            assert layout.reduce((1,)) == angle, (layout, angle)
            full = (tokens, group, half)
            wide[group] = (broadcast(cos, full, (0, 2), layout),
                           broadcast(sin, full, (0, 2), layout))
        return wide

    def rotate(x_ref, heads, group, wide, tokens, span):
        # Head groups of one array in turn, from an SMEM slot or (single tokens) GMEM.
        # Plain transfers: Mosaic's bank-conflict planner (optimized=True) finds no plan
        # for many of these layouts, and where the lanes along the pairs span 128 bytes
        # (the bf16 D 128 target) the plain order is conflict-free already.
        layout = as_pallas(layouts[tokens][group])
        c, s = wide[group]
        for g in range(heads // group):
            first, second = halves(x_ref, span, pl.ds(g * group, group))
            a = plgpu.load(first, layout=layout, optimized=False).astype(jnp.float32)
            b = plgpu.load(second, layout=layout, optimized=False).astype(jnp.float32)
            if tokens == 1:
                # Every warp holds a copy of the one token: a warp ahead must not store
                # the group before another has loaded it (it would rotate twice).
                plgpu.commit_smem()
            store(first, (a * c - b * s).astype(first.dtype))
            store(second, (b * c + a * s).astype(second.dtype))

    def body(*operands):
        if count is None:
            count_ref, pos_ref, tables_ref, rows_ref, q_ref, k_ref, *scratch = operands
            n = count_ref[0]
            full_blocks, tail = jax.lax.div(n, tb), jax.lax.rem(n, tb)
        else:
            pos_ref, tables_ref, rows_ref, q_ref, k_ref, *scratch = operands
            n = count
            full_blocks, tail = divmod(count, tb)
        q_smem, k_smem, q_bar, k_bar = scratch
        block = jax.lax.axis_index("block")
        # This block takes token blocks block, block + grid, ... below full_blocks.
        mine = jax.lax.div(full_blocks - block + (grid - 1), grid)
        pairs = [(q_ref, q_smem, q_bar, q_heads, p.q_group),
                 (k_ref, k_smem, k_bar, k_heads, p.k_group)]

        def tokens_of(j):
            return pl.ds((block + j * grid) * tb, tb)

        def fetch(j, slot):
            for x_ref, smem, bar, _, _ in pairs:
                plgpu.copy_gmem_to_smem(x_ref.at[tokens_of(j), :, pl.ds(0, copy_dims)],
                                        smem.at[slot], bar.at[slot],
                                        oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)

        if not isinstance(full_blocks, int) or full_blocks:
            turns, row = turn_tables(tables_ref, rows_ref, tb)
            for s in range(stages):
                @pl.when(s < mine)
                def _():
                    fetch(s, s)

            def step(j, carry):
                slot = jax.lax.rem(j, stages)
                wide = cos_sin(pos_ref, n, (block + j * grid) * tb, tb, turns, row)
                for x_ref, smem, bar, heads, group in pairs:
                    plgpu.barrier_wait(bar.at[slot])
                    rotate(smem.at[slot], heads, group, wide, tb, slice(None))
                plgpu.commit_smem()
                for i, (x_ref, smem, _, _, _) in enumerate(pairs):
                    plgpu.copy_smem_to_gmem(smem.at[slot],
                                            x_ref.at[tokens_of(j), :, pl.ds(0, copy_dims)],
                                            commit_group=i == len(pairs) - 1)

                # The previous token block's slot, once its stores have read it out.
                @pl.when(jnp.logical_and(j >= 1, j - 1 + stages < mine))
                def _():
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    fetch(j - 1 + stages, jax.lax.rem(j - 1, stages))
                return carry

            jax.lax.fori_loop(0, mine, step, 0)
            plgpu.wait_smem_to_gmem(0)

        if not isinstance(tail, int) or tail:
            last = full_blocks * tb
            turns1, row1 = turn_tables(tables_ref, rows_ref, 1)

            @pl.when(jnp.logical_and(block == jax.lax.rem(full_blocks, grid), tail > 0))
            def _():
                def one(i, carry):
                    wide = cos_sin(pos_ref, n, last + i, 1, turns1, row1)
                    for x_ref, _, _, heads, group in pairs:
                        rotate(x_ref, heads, group, wide, 1, pl.ds(last + i, 1))
                    return carry
                jax.lax.fori_loop(0, tail, one, 0)

    def kernel(*operands):
        # SMEM slots take the dtype of the refs (the layout fixes only its itemsize).
        dtype = operands[-1].dtype
        slot = lambda heads: plgpu.SMEM((stages, tb, heads, copy_dims), dtype)  # noqa: E731
        return plgpu.kernel(
            body, out_type=(), grid=(grid,), grid_names=("block",),
            scratch_types=(slot(q_heads), slot(k_heads), plgpu.Barrier(num_barriers=stages),
                           plgpu.Barrier(num_barriers=stages)),
            kernel_name="jaxrope_rope_mosaic_tma",  # what profilers show
            compiler_params=plgpu.CompilerParams(
                approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
                # Barriers are placed by hand: commit_smem before every TMA store and
                # before each single-token group's stores.
                unsafe_no_auto_barriers=True),
            interpret=plgpu.InterpretGPUParams() if interpret else None)(*operands)
    return kernel


def rope_mosaic_tma(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                    attention_factor: float,
                    mrope_section: Optional[Tuple[int, int, int]] = None,
                    mrope_interleaved: bool = False, interpret: bool = False,
                    tuning: TmaTuning = DEFAULT_TUNING):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]`` (M-RoPE:
    ``[3, T]``); :func:`jaxrope.ops.rope.mosaic.rope_mosaic`'s contract (in place when donated).

    Raises:
      BackendUnavailable: a JAX :func:`jaxrope.ops.mosaic_common.unavailable` names.
      ValueError: a layout TMA cannot move (:func:`plan_tma`).
    """
    return mosaic_rope.run_static(build_tma, q, k, pos_ids, tables, rotary_dim=rotary_dim,
                                 interleave=interleave, attention_factor=attention_factor,
                                 mrope_section=mrope_section,
                                 mrope_interleaved=mrope_interleaved, interpret=interpret,
                                 tuning=tuning)
