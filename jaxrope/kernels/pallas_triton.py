"""The Pallas GPU kernel (Triton lowering): q and k rotated in one launch, in place.

Grid: ``(token blocks, head groups)``. A program computes cos/sin once for its
``block_tokens`` tokens and reuses them for ``heads_per_program`` heads of q or of k
(head groups ``[0, q_groups)`` are q's, the rest k's). Only the rotated dims are read
and written: with q and k aliased to the outputs, dims past ``rotary_dim`` are never
touched.

Layouts, chosen so every load is a plain (or last-axis integer-indexed) slice that
both Triton and the Pallas interpreter support, with masks covering any size:
- NeoX halves: q viewed as ``[T, Hq*D]``; a head's halves start at ``h*D`` and
  ``h*D + R/2``.
- interleaved pairs: q viewed as ``[T, Hq*D/2, 2]``; element 0 / 1 of the last axis
  are the pair.
Every block is padded to powers of two (Triton needs them) and masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrope.kernels.angle import cos_sin


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Launch shape of one call; the only tuning knobs of the kernel."""

    block_tokens: int
    heads_per_program: int
    num_warps: int
    num_stages: int = 1


def block_config(num_tokens: int, q_heads: int, k_heads: int, lanes: int) -> BlockConfig:
    """The one heuristic for launch shapes (measured on H200, see bench/RESULTS.md).

    - A program's tile is ``block_tokens x lanes`` per half; about 2k elements keeps
      16-byte accesses per thread with 4 warps and few registers.
    - Fewer tokens than that per program at small T, so that the grid still spans the
      132 SMs: decode batches need parallelism across heads, not tokens.
    - Up to 8 heads per program amortise the cos/sin of a token block.
    """
    block_tokens = max(1, min(_next_pow2(num_tokens), 2048 // lanes, 32))
    heads = max(q_heads, k_heads)
    heads_per_program = min(8, _next_pow2(heads))
    token_blocks = -(-num_tokens // block_tokens)
    while heads_per_program > 1 and token_blocks * (
            -(-q_heads // heads_per_program) + -(-k_heads // heads_per_program)) < 264:
        heads_per_program //= 2
    num_warps = 4 if block_tokens * lanes >= 512 else 2 if block_tokens * lanes >= 128 else 1
    return BlockConfig(block_tokens, heads_per_program, num_warps)


def _index(i: int):
    # An array scalar, not a Python int: the Pallas interpreter of JAX 0.10 indexes
    # only with objects that have a shape.
    return jnp.int32(i)


def _rope_kernel(pos_ref, tables_ref, q_ref, k_ref, q_out_ref, k_out_ref, *, num_tokens: int,
                 q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, interleave: bool,
                 attention_factor: float, lanes: int, block_tokens: int,
                 heads_per_program: int, q_groups: int):
    t0 = pl.program_id(0) * block_tokens
    group = pl.program_id(1)
    tokens = pl.ds(t0, block_tokens)
    token_ok = t0 + jnp.arange(block_tokens) < num_tokens
    pos = plgpu.load(pos_ref.at[tokens], mask=token_ok, other=0)
    cos, sin = cos_sin(pos, *(plgpu.load(tables_ref.at[_index(i)]) for i in range(3)),
                       attention_factor)
    mask = token_ok[:, None] & (jnp.arange(lanes) < rotary_dim // 2)[None, :]

    def rotate(x_ref, o_ref, first_head, num_heads):
        for i in range(heads_per_program):
            head = first_head + i
            head_mask = mask & (head < num_heads)
            if interleave:
                cols = pl.ds(head * (head_dim // 2), lanes)
                a_at, b_at = (tokens, cols, _index(0)), (tokens, cols, _index(1))
            else:
                a_at = (tokens, pl.ds(head * head_dim, lanes))
                b_at = (tokens, pl.ds(head * head_dim + rotary_dim // 2, lanes))
            a = plgpu.load(x_ref.at[a_at], mask=head_mask, other=0).astype(jnp.float32)
            b = plgpu.load(x_ref.at[b_at], mask=head_mask, other=0).astype(jnp.float32)
            plgpu.store(o_ref.at[a_at], (a * cos - b * sin).astype(o_ref.dtype), mask=head_mask)
            plgpu.store(o_ref.at[b_at], (b * cos + a * sin).astype(o_ref.dtype), mask=head_mask)

    @pl.when(group < q_groups)
    def _():
        rotate(q_ref, q_out_ref, group * heads_per_program, q_heads)

    @pl.when(group >= q_groups)
    def _():
        rotate(k_ref, k_out_ref, (group - q_groups) * heads_per_program, k_heads)


def _view(x, interleave: bool):
    t, h, d = x.shape
    return x.reshape(t, h * d // 2, 2) if interleave else x.reshape(t, h * d)


def rope_pallas(q, k, pos_ids, tables, *, rotary_dim: int, interleave: bool,
                attention_factor: float, interpret: bool = False,
                config: BlockConfig | None = None):
    """Rotate ``q [T, Hq, D]``, ``k [T, Hk, D]`` at ``pos_ids`` int32 ``[T]``, in one launch.

    ``tables`` float32 ``[3, R/2]`` (:func:`jaxrope.frequencies.angle_tables`). Outputs
    alias q and k (``input_output_aliases``): in place when they are donated.
    ``config`` overrides :func:`block_config` (benchmarks sweep it).
    """
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    if num_tokens == 0:
        return q, k
    lanes = _next_pow2(rotary_dim // 2)
    tables = jnp.pad(tables, ((0, 0), (0, lanes - tables.shape[1])))
    cfg = config or block_config(num_tokens, q_heads, k_heads, lanes)
    q_groups = -(-q_heads // cfg.heads_per_program)
    grid = (-(-num_tokens // cfg.block_tokens), q_groups + -(-k_heads // cfg.heads_per_program))
    kernel = functools.partial(
        _rope_kernel, num_tokens=num_tokens, q_heads=q_heads, k_heads=k_heads,
        head_dim=head_dim, rotary_dim=rotary_dim, interleave=interleave,
        attention_factor=attention_factor, lanes=lanes, block_tokens=cfg.block_tokens,
        heads_per_program=cfg.heads_per_program, q_groups=q_groups)
    qv, kv = _view(q, interleave), _view(k, interleave)
    q_out, k_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(qv.shape, qv.dtype), jax.ShapeDtypeStruct(kv.shape, kv.dtype)),
        grid=grid,
        input_output_aliases={2: 0, 3: 1},
        interpret=interpret,
        name="jaxrope_rope",
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )(pos_ids, tables, qv, kv)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)
