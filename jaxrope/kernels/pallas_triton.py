"""The Pallas GPU kernel lowered through Triton (``backend="triton"``): q and k rotated in
one launch, in place. JAX 0.11 deprecates this lowering (``jax-pallas-triton``); on
Hopper and newer ``backend="auto"`` runs :mod:`jaxrope.kernels.mosaic_gpu` instead.

Grid: token blocks x head programs, flattened head-major by default (the programs of
one token block are neighbours, so programs running together cover whole rows of q and
k rather than one slice of many rows: 2-4% more bandwidth on the H200). A program
computes cos/sin once for its ``block_tokens`` tokens and rotates
``groups_per_program`` groups of ``heads_per_program`` heads of q or of k with them
(programs ``[0, q_programs)`` are q's, the rest k's): one load per half of each
``[block_tokens, heads_per_program, lanes]`` block, all of a program's reads in flight
before its first write. Only the rotated dims are read and written: with q and k
aliased to the outputs, dims past ``rotary_dim`` are never touched.

Layouts:
- NeoX halves: two loads per block, dims ``[0, R/2)`` and ``[R/2, R)``.
- interleaved pairs: one contiguous load of dims ``[0, R)``, split into even and odd
  elements in registers (a reshape to ``[..., R/2, 2]``), joined back for the store.
Blocks are padded to powers of two (Triton needs them) and masked; ``lanes`` is
``R/2`` rounded up. Slices that may run past the last axis get a traced start, since
their masked lanes are never dereferenced but a static out-of-range slice is rejected
at trace time.

The token count is read from a one-element array rather than baked in, so the compiled
kernel depends on T only through the grid: the torch bridge compiles it once per head
layout and launches it for any T (``torch_bridge.triton_launch``).

M-RoPE (``mrope_section``): positions ``[3, T]`` enter flattened, row ``r`` of token
``t`` at ``r * count + t``, so the row stride is the run-time count and the IR stays
independent of T here too; a program loads its tokens' three rows and
:func:`jaxrope.kernels.angle.cos_sin` picks one per frequency slot. The angle is still
computed once per token block, so the extra work is two position loads and two selects
per slot, against reads of every head. A 1-D call traces exactly the 1-D kernel.

On the GPU, sine and cosine use the hardware approximations (``sin.approx.f32``): the
angle is already reduced to ``[-pi, pi]``, where their absolute error (~1e-6) is far
below what a bf16 or fp16 output can show and near float32 rounding of the products.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrope.kernels.angle import cos_sin

# Grid programs wanted before the heuristic stops growing programs: two per SM of an
# H100/H200.
_MIN_PROGRAMS = 264
# Elements of one head group's half: one warp, one 8-byte bf16 vector per thread.
_GROUP_ELEMENTS = 128
# Elements of one program's half-block (2 KB of bf16 read).
_PROGRAM_ELEMENTS = 512

_Block = TypeVar("_Block")   # a kernel's launch-shape dataclass (shrink_to_fill)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): a Triton block's extent."""
    return 1 << max(0, (n - 1).bit_length())


def lanes_for(rotary_dim: int) -> int:
    """Width of a half-block: ``rotary_dim // 2`` rounded up to a power of two."""
    return next_pow2(rotary_dim // 2)


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Launch shape of one call; the only tuning knobs of the kernel."""

    block_tokens: int
    heads_per_program: int
    num_warps: int
    num_stages: int = 1
    # Head groups (of heads_per_program heads) one program rotates with one cos/sin
    # computation, all loads issued before the first store.
    groups_per_program: int = 1
    # Token blocks one program walks in sequence: the angle tables are loaded once.
    token_loop: int = 1
    # Program order: False puts a head group's consecutive token blocks next to each
    # other, True a token block's head groups (neighbouring programs then touch
    # neighbouring bytes of each row).
    heads_major: bool = False


def head_programs(q_heads: int, k_heads: int, block: BlockConfig) -> Tuple[int, int]:
    """Programs along the head axis of the grid for q and for k (q's come first)."""
    per_program = block.heads_per_program * block.groups_per_program
    return -(-q_heads // per_program), -(-k_heads // per_program)


def grid(num_tokens: int, q_heads: int, k_heads: int, block: BlockConfig) -> Tuple[int, ...]:
    """The launch grid: ``(token programs, head programs)``, flattened when ``heads_major``."""
    token_programs = -(-num_tokens // (block.block_tokens * block.token_loop))
    head = sum(head_programs(q_heads, k_heads, block))
    return (token_programs * head,) if block.heads_major else (token_programs, head)


def block_config(num_tokens: int, q_heads: int, k_heads: int, lanes: int) -> BlockConfig:
    """The one heuristic for launch shapes, from sweeps on the H200 (RESULTS.md).

    - A head group fills 128 elements of a half (``heads_per_program = 128 // lanes``,
      at least 1): one load per thread of one warp.
    - A program rotates 512 elements per half (2 KB of bf16) in ``512 // (heads_per_program
      * lanes)`` groups (four when the heads fill a group), their loads all issued before
      the first store and cos/sin computed once. Groups past the last head are masked,
      not shrunk: the sweeps found no head layout where smaller programs won.
    - When a token needs at most two programs (few heads, e.g. Hq=8 Hk=1 at D <= 128)
      a program walks 8 tokens, so per-program setup is not paid per token.
    - Programs head-major (see the module docstring), one warp each.
    - Small T (decode): shorter token walks, then fewer groups, then fewer heads per
      program, until the grid has two programs per SM.

    Of ~20 shape families swept at 16k tokens, bf16, on the H200, this one was the best
    on every layout within the sweep's noise: Hq=32 Hk=8 D=128 84.9 us (98% of the
    ceiling), D=64 45.0 us;
    Hq=64 Hk=8 D=64 77.1 us; Hq=8 Hk=1 D=256 40.1 us, D=128 15.8 us, D=64 10.6 us.
    """
    heads_per_program = max(1, min(next_pow2(max(q_heads, k_heads)), _GROUP_ELEMENTS // lanes))
    groups = max(1, _PROGRAM_ELEMENTS // (heads_per_program * lanes))
    block = BlockConfig(1, heads_per_program, 1, groups_per_program=groups, heads_major=True)
    if sum(head_programs(q_heads, k_heads, block)) <= 2:
        block = dataclasses.replace(block, token_loop=8)
    return shrink_to_fill(block, lambda b: math.prod(grid(num_tokens, q_heads, k_heads, b)),
                          _MIN_PROGRAMS)


def shrink_to_fill(block: _Block, programs: Callable[[_Block], int], min_programs: int) -> _Block:
    """``block`` with its token walk, then its groups, then its heads per program halved
    until ``programs(block)`` reaches ``min_programs`` (small T, decode: a grid too small
    to fill the GPU) or each is 1. The small-T rule of both kernels' launch shapes."""
    for field in ("token_loop", "groups_per_program", "heads_per_program"):
        while getattr(block, field) > 1 and programs(block) < min_programs:
            block = dataclasses.replace(block, **{field: getattr(block, field) // 2})
    return block


def sin_cos_approx(angle):
    """``(sin, cos)`` of float32 ``angle`` by the GPU's approximate instructions
    (``sin.approx.f32``): the angle is already reduced to ``[-pi, pi]``, where their
    absolute error (~1e-6) is below what a bf16 or fp16 output shows. Both Triton-lowered
    kernels (this one and :mod:`jaxrope.kernels.kv_pallas`) pass it to the angle."""
    return tuple(plgpu.elementwise_inline_asm(
        f"{op}.approx.f32 $0, $1;", args=[angle], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(angle.shape, jnp.float32)])[0]
        for op in ("sin", "cos"))


def _index(i: int):
    # An array scalar, not a Python int: the Pallas interpreter of JAX 0.10 indexes
    # only with objects that have a shape.
    return jnp.int32(i)


def _rope_kernel(count_ref, pos_ref, tables_ref, q_ref, k_ref, q_out_ref, k_out_ref, *,
                 q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, interleave: bool,
                 attention_factor: float, lanes: int, block_tokens: int,
                 heads_per_program: int, groups_per_program: int, q_programs: int,
                 k_programs: int, token_loop: int, heads_major: bool, approx_trig: bool,
                 mrope_section: Optional[Tuple[int, int, int]], mrope_interleaved: bool):
    if heads_major:
        pid = pl.program_id(0)
        group, token_program = pid % (q_programs + k_programs), pid // (q_programs + k_programs)
    else:
        token_program, group = pl.program_id(0), pl.program_id(1)
    traced_zero = 0 * group
    count = count_ref[0]
    tables = [plgpu.load(tables_ref.at[_index(i)]) for i in range(3)]
    trig = {"sin_cos": sin_cos_approx} if approx_trig else {}
    half = rotary_dim // 2
    if interleave:
        # Pairs are adjacent: load the rotary span contiguously (16-byte accesses) and
        # split even/odd elements in registers; strided loads were 15x slower.
        span = 2 * lanes
        lane_ok = (jnp.arange(span) < rotary_dim)[None, None, :]
        start = traced_zero if span > head_dim else 0
    else:
        lane_ok = (jnp.arange(lanes) < half)[None, None, :]
        a_start = traced_zero if lanes > head_dim else 0
        b_start = traced_zero + half if half + lanes > head_dim else half

    def rotate_block(x_ref, o_ref, first, num_heads, block):
        t0 = block * block_tokens
        tokens = pl.ds(t0, block_tokens)
        token_ok = t0 + jnp.arange(block_tokens) < count
        if mrope_section is None:
            pos = plgpu.load(pos_ref.at[tokens], mask=token_ok, other=0)
        else:
            pos = tuple(plgpu.load(pos_ref.at[pl.ds(row * count + t0, block_tokens)],
                                   mask=token_ok, other=0) for row in range(3))
        cos, sin = cos_sin(pos, *tables, attention_factor, mrope_section=mrope_section,
                           mrope_interleaved=mrope_interleaved, **trig)
        cos, sin = cos[:, None, :], sin[:, None, :]

        def load(first_head):
            heads = pl.ds(first_head, heads_per_program)
            head_ok = (first_head + jnp.arange(heads_per_program) < num_heads)[None, :, None]
            mask = token_ok[:, None, None] & head_ok & lane_ok
            if interleave:
                at = ((tokens, heads, pl.ds(start, span)),)
            else:
                at = ((tokens, heads, pl.ds(a_start, lanes)),
                      (tokens, heads, pl.ds(b_start, lanes)))
            return at, mask, [plgpu.load(x_ref.at[i], mask=mask, other=0) for i in at]

        # Every group's loads first: more bytes in flight per thread before any store.
        loaded = [load(first + g * heads_per_program) for g in range(groups_per_program)]
        for at, mask, values in loaded:
            if interleave:
                x = values[0].astype(jnp.float32)
                pairs = x.reshape(block_tokens, heads_per_program, lanes, 2)
                a, b = (p.reshape(block_tokens, heads_per_program, lanes)
                        for p in jnp.split(pairs, 2, axis=-1))
                rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
                plgpu.store(o_ref.at[at[0]], rotated.reshape(x.shape).astype(o_ref.dtype),
                            mask=mask)
                continue
            a, b = (v.astype(jnp.float32) for v in values)
            plgpu.store(o_ref.at[at[0]], (a * cos - b * sin).astype(o_ref.dtype), mask=mask)
            plgpu.store(o_ref.at[at[1]], (b * cos + a * sin).astype(o_ref.dtype), mask=mask)

    def rotate(x_ref, o_ref, program, num_heads):
        first = program * (groups_per_program * heads_per_program)
        if token_loop == 1:
            rotate_block(x_ref, o_ref, first, num_heads, token_program)
            return

        def body(i, carry):
            rotate_block(x_ref, o_ref, first, num_heads, token_program * token_loop + i)
            return carry

        jax.lax.fori_loop(0, token_loop, body, 0)

    @pl.when(group < q_programs)
    def _():
        rotate(q_ref, q_out_ref, group, q_heads)

    @pl.when(group >= q_programs)
    def _():
        rotate(k_ref, k_out_ref, group - q_programs, k_heads)


def rope_pallas(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, mrope_section: Optional[Tuple[int, int, int]] = None,
                mrope_interleaved: bool = False, interpret: bool = False,
                config: BlockConfig | None = None):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]``, in one launch.

    With ``mrope_section`` (M-RoPE), ``pos_ids`` is int32 ``[3, T]`` (t, h, w rows).
    ``tables`` float32 ``[3, R/2]`` (:func:`jaxrope.frequencies.angle_tables`). Outputs
    alias q and k (``input_output_aliases``): in place when they are donated.
    ``config`` overrides :func:`block_config` (benchmarks sweep it).
    """
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    lanes = lanes_for(rotary_dim)
    tables = jnp.pad(tables, ((0, 0), (0, lanes - tables.shape[1])))
    block = config or block_config(num_tokens, q_heads, k_heads, lanes)
    q_programs, k_programs = head_programs(q_heads, k_heads, block)
    kernel = functools.partial(
        _rope_kernel, q_heads=q_heads, k_heads=k_heads,
        head_dim=head_dim, rotary_dim=rotary_dim, interleave=interleave,
        attention_factor=attention_factor, lanes=lanes, block_tokens=block.block_tokens,
        heads_per_program=block.heads_per_program, groups_per_program=block.groups_per_program,
        q_programs=q_programs, k_programs=k_programs, token_loop=block.token_loop,
        heads_major=block.heads_major, approx_trig=not interpret, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved)
    if mrope_section is not None:
        pos_ids = pos_ids.reshape(3 * num_tokens)
    q_out, k_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)),
        grid=grid(num_tokens, q_heads, k_heads, block),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        name="jaxrope_rope",
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps,
                                             num_stages=block.num_stages),
    )(jnp.full((1,), num_tokens, jnp.int32), pos_ids, tables, q, k)
    return q_out, k_out
