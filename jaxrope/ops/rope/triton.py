"""The Pallas GPU kernel lowered through Triton (``backend="triton"``): q and k rotated in
one launch, in place. JAX 0.11 deprecates this lowering (``jax-pallas-triton``); on
Hopper and newer ``backend="auto"`` runs :mod:`jaxrope.ops.rope.mosaic` instead. Its launch
shape is a :class:`jaxrope.ops.rope.tuning.TritonTuning`.

Grid: token blocks x head programs, flattened head-major by default (the programs of
one token block are neighbours, so programs running together cover whole rows of q and
k rather than one slice of many rows). A program
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
layout and launches it for any T (:mod:`jaxrope.ops.rope.triton_export`).

M-RoPE (``mrope_section``): positions ``[3, T]`` enter flattened, row ``r`` of token
``t`` at ``r * count + t``, so the row stride is the run-time count and the IR stays
independent of T here too; a program loads its tokens' three rows and
:func:`jaxrope.ops.angle.cos_sin` picks one per frequency slot. The angle is still
computed once per token block, so the extra work is two position loads and two selects
per slot, against reads of every head. A 1-D call traces exactly the 1-D kernel.

On the GPU, sine and cosine use the hardware approximations (``sin.approx.f32``): the
angle is already reduced to ``[-pi, pi]``, where their absolute error (~1e-6) is far
below what a bf16 or fp16 output can show and near float32 rounding of the products.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrope.ops.angle import cos_sin
from jaxrope.ops.rope.tuning import TritonTuning, grid, head_programs, triton_tuning
from jaxrope.ops.triton_common import lane_tables, sin_cos_approx

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
        # split even/odd elements in registers; strided loads were far slower.
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


def rope_triton(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, mrope_section: Optional[Tuple[int, int, int]] = None,
                mrope_interleaved: bool = False, interpret: bool = False,
                tuning: Optional[TritonTuning] = None):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]``, in one launch.

    With ``mrope_section`` (M-RoPE), ``pos_ids`` is int32 ``[3, T]`` (t, h, w rows).
    ``tables`` float32 ``[3, R/2]`` (:func:`jaxrope.frequencies.angle_tables`). Outputs
    alias q and k (``input_output_aliases``): in place when they are donated.
    ``tuning``: the launch shape (default: :func:`jaxrope.ops.rope.tuning.triton_tuning`
    of the shapes; sweeps pass others).
    """
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    lanes, tables = lane_tables(tables, rotary_dim)
    block = tuning or triton_tuning(num_tokens, q_heads, k_heads, lanes)
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
