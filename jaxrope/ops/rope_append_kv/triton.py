"""The Pallas GPU kernel (Triton lowering) of RoPE fused with the paged KV-cache append.

One launch, one pass over the bytes: q is read and written back rotated (in place
through ``input_output_aliases``), k and v are read once, and the rotated k and the v
are written straight into the paged cache at each token's slot. The unfused pair
(rope in place, then an append kernel) reads k twice and writes it once more.

Grid: one axis of ``token programs x head programs``, head-major (a token's programs
are neighbours, as in :mod:`jaxrope.ops.rope.triton`: programs in flight together
cover whole rows). Per token there are ``q_programs`` programs over q's heads, then
``k_programs`` over k's and as many over v's (:func:`head_programs`). A program walks
``token_loop`` tokens; per token it loads the position and the slot as scalars, forms
cos/sin once (q and k programs, through the shared angle of
:mod:`jaxrope.ops.angle`) and moves ``groups_per_program`` groups of
``heads_per_program`` heads, all loads issued before the first store.

- q programs: dims ``[0, R)`` only (halves, or one contiguous span for interleaved
  pairs); dims past ``R`` are never touched (q is aliased to the output).
- k programs: the rotary dims rotated, dims ``[R, D)`` copied, both to the cache.
- v programs: dims ``[0, D)`` copied to the cache.

Caches arrive as ``[rows, D]`` views of the layout's arrays, addressed by one stride
rule for every layout (:class:`jaxrope.ops.rope_append_kv.cache_layout.CacheRows`): a
token's heads go to rows ``rows.row(slot // page_size, slot % page_size, head)`` (values
in ``rows.value_array``, ``rows.value_offset`` rows further), a program's head group one
block ``[heads_per_program, lanes]`` of those rows. Slots outside ``[0, pages *
page_size)`` (negative: padding) mask the token's cache stores off. An fp8 cache stores
``e4m3(clip(x * scale, -448, 448))``
(:func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype`, the same function as the
XLA backend), scales read from the ``scales`` operand.

M-RoPE (``mrope_section``): positions ``[3, T]`` enter flattened as in the rope kernel
(:mod:`jaxrope.ops.rope.triton`), row ``r`` of token ``t`` at ``r * count + t``,
so the IR stays independent of T; a token's three rows are loaded as scalars and
:func:`jaxrope.ops.angle.cos_sin` picks one per frequency slot. Only ``angle``
changes; a 1-D call traces exactly the 1-D kernel.

For a launch outside JAX (the torch bridge, as :mod:`jaxrope.ops.rope.triton_export` does for
the rope kernel) the operands are, in order, ``(count, pos_ids, slots, tables, scales, q,
k, v, *caches)`` then the outputs ``(q, *caches)`` (an M-RoPE kernel's ``pos_ids`` a
contiguous int32 ``[3, count]``); ``count`` is read at run time, so the
Triton IR depends on T only through the grid (:func:`grid`). It depends on the cache
geometry (pages, page size, layout: ``rows``) and dtype, which an engine fixes once.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.angle import cos_sin
from jaxrope.ops.rope_append_kv.cache_layout import CacheRows
from jaxrope.ops.rope_append_kv.reference import FP8, to_cache_dtype
from jaxrope.ops.rope_append_kv.tuning import (AppendTritonTuning, append_triton_tuning, grid,
                                               head_programs)
from jaxrope.ops.triton_common import lanes_for, next_pow2, sin_cos_approx
from jaxrope.qk_norm import QKNorm, missing

def unsupported(cache) -> str | None:
    """Why the Triton lowering cannot address ``cache``, or None when it can.

    JAX's Pallas Triton lowering (0.10-0.11) indexes an array of at most 2**32 bytes
    with int32 element offsets, which Triton sign-extends: for 1-byte elements (an fp8
    cache) offsets past 2**31 elements, i.e. caches of (2 GiB, 4 GiB], would wrap to
    negative addresses. Larger arrays get int64 offsets and are fine.
    """
    elements = math.prod(cache.shape)
    if jnp.dtype(cache.dtype).itemsize == 1 and 2 ** 31 < elements <= 2 ** 32:
        return (f"a {cache.dtype} cache of {elements} elements (2-4 GiB) would overflow the "
                "int32 offsets of the Pallas Triton lowering; the XLA path handles it")
    return None


def _rope_append_kv_kernel(count_ref, pos_ref, slot_ref, tables_ref, scale_ref, q_ref, k_ref,
                           v_ref, *refs, q_heads: int, k_heads: int, head_dim: int,
                           rotary_dim: int, interleave: bool, attention_factor: float,
                           lanes: int, rows: CacheRows, heads_per_program: int,
                           groups_per_program: int,
                           token_loop: int, q_programs: int, k_programs: int,
                           approx_trig: bool, mrope_section: Optional[Tuple[int, int, int]],
                           mrope_interleaved: bool):
    # refs: the caches as inputs (aliased to the outputs, never read), then the outputs
    # (q, *caches), each cache a [rows, D] view. The keys go to the first cache, the
    # values to cache rows.value_array, rows.value_offset rows further.
    q_out_ref, *cache_refs = refs[len(refs) // 2:]
    pid = pl.program_id(0)
    per_token = q_programs + 2 * k_programs
    group, token_program = pid % per_token, pid // per_token
    traced_zero = 0 * group
    count = count_ref[0]
    hp = heads_per_program
    quantize = cache_refs[0].dtype == FP8

    def piece(start: int, width: int, valid: int):
        # A slice that may run past the last axis gets a traced start: its masked lanes
        # are never dereferenced, but a static out-of-range slice is rejected at trace time.
        begin = traced_zero + start if start + width > head_dim else start
        return pl.ds(begin, width), (jnp.arange(width) < valid)[None, :]

    half = rotary_dim // 2
    if interleave:
        # Pairs are adjacent: one contiguous load of the rotary span, split in registers.
        rotary = (piece(0, 2 * lanes, rotary_dim),)
    else:
        rotary = (piece(0, lanes, half), piece(half, lanes, half))
    passthrough = ((piece(rotary_dim, next_pow2(head_dim - rotary_dim),
                          head_dim - rotary_dim),) if rotary_dim < head_dim else ())
    whole_row = (piece(0, next_pow2(head_dim), head_dim),)

    def heads_of(program, g, num_heads):
        # (the block's head slice, its head-in-range mask [hp, 1], its head ids [hp])
        first = (program * groups_per_program + g) * hp
        ids = first + jnp.arange(hp, dtype=jnp.int32)
        return pl.ds(first, hp), (ids < num_heads)[:, None], ids

    def load(x_ref, t, heads, head_ok, pieces):
        return [plgpu.load(x_ref.at[t, heads, dims], mask=head_ok & lane_ok, other=0)
                .astype(jnp.float32) for dims, lane_ok in pieces]

    def rotate(values, cos, sin):
        if interleave:
            pairs = values[0].reshape(hp, lanes, 2)
            a, b = (p.reshape(hp, lanes) for p in jnp.split(pairs, 2, axis=-1))
            return [jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(hp, 2 * lanes)]
        a, b = values
        return [a * cos - b * sin, b * cos + a * sin]

    def angle(t, turns):
        # The one place a token's angle is formed (M-RoPE changes only this).
        if mrope_section is None:
            pos = plgpu.load(pos_ref.at[t])
        else:
            pos = tuple(plgpu.load(pos_ref.at[row * count + t]) for row in range(3))
        trig = {"sin_cos": sin_cos_approx} if approx_trig else {}
        cos, sin = cos_sin(pos, *turns, attention_factor, mrope_section=mrope_section,
                           mrope_interleaved=mrope_interleaved, **trig)
        return cos[None, :], sin[None, :]

    def cache_slot(t, token_ok):
        slot = plgpu.load(slot_ref.at[t])
        ok = token_ok & (slot >= 0) & (slot < rows.num_slots)
        slot = jnp.where(ok, slot, 0)
        # lax.div/rem: the slot is non-negative here, and jnp's floor division needs a
        # sign op the Triton lowering lacks.
        return ok, jax.lax.div(slot, rows.page_size), jax.lax.rem(slot, rows.page_size)

    def walk(body):
        # body(t, token_ok) for each token of this program; t is clamped to a real token
        # so scalar loads stay in bounds, token_ok masks the stores of the rest.
        def step(i):
            t = token_program * token_loop + i
            body(jnp.minimum(t, count - 1), t < count)

        if token_loop == 1:
            step(traced_zero)
            return
        jax.lax.fori_loop(0, token_loop, lambda i, c: (step(i), c)[1], 0)

    def load_turns():
        return [plgpu.load(tables_ref.at[jnp.int32(i)]) for i in range(3)]

    @pl.when(group < q_programs)
    def _():
        turns = load_turns()

        def body(t, token_ok):
            cos, sin = angle(t, turns)
            groups = [heads_of(group, g, q_heads) for g in range(groups_per_program)]
            loaded = [load(q_ref, t, heads, ok, rotary) for heads, ok, _ in groups]
            for (heads, head_ok, _), values in zip(groups, loaded):
                for (dims, lane_ok), value in zip(rotary, rotate(values, cos, sin)):
                    plgpu.store(q_out_ref.at[t, heads, dims], value.astype(q_out_ref.dtype),
                                mask=token_ok & head_ok & lane_ok)

        walk(body)

    def append(program, rotated: bool, value_ref, cache_ref, offset, scale_index):
        turns = load_turns() if rotated else None
        scale = plgpu.load(scale_ref.at[jnp.int32(scale_index)]) if quantize else None
        pieces = (rotary + passthrough) if rotated else whole_row

        def body(t, token_ok):
            slot_ok, page, entry = cache_slot(t, token_ok)
            groups = [heads_of(program, g, k_heads) for g in range(groups_per_program)]
            loaded = [load(value_ref, t, heads, ok, pieces) for heads, ok, _ in groups]
            if rotated:
                cos, sin = angle(t, turns)
            for (_, head_ok, ids), values in zip(groups, loaded):
                if rotated:
                    values = rotate(values[:len(rotary)], cos, sin) + values[len(rotary):]
                # The group's cache rows (those of heads past the last are masked off),
                # indexed by arrays on both axes: the interpreter's masked store takes
                # either all slices or all index arrays.
                cache_rows = (rows.row(page, entry, ids) + offset)[:, None]
                for (dims, lane_ok), value in zip(pieces, values):
                    lane = dims.start + jnp.arange(dims.size, dtype=jnp.int32)[None, :]
                    plgpu.store(cache_ref.at[cache_rows, lane],
                                to_cache_dtype(value, scale, cache_ref.dtype),
                                mask=slot_ok & head_ok & lane_ok)

        walk(body)

    @pl.when((group >= q_programs) & (group < q_programs + k_programs))
    def _():
        append(group - q_programs, True, k_ref, cache_refs[0], 0, 0)

    @pl.when(group >= q_programs + k_programs)
    def _():
        append(group - q_programs - k_programs, False, v_ref, cache_refs[rows.value_array],
               rows.value_offset, 1)


def rope_append_kv_triton(q, k, v, pos_ids, slots, tables, scales, caches, *, rows: CacheRows,
                          rotary_dim: int, interleave: bool, attention_factor: float,
                          mrope_section: Optional[Tuple[int, int, int]] = None,
                          mrope_interleaved: bool = False, interpret: bool = False,
                          tuning: Optional[AppendTritonTuning] = None,
                          q_norm_weight=None, k_norm_weight=None,
                          qk_norm: Optional[QKNorm] = None):
    """Rotate q in place and write rotated k and v into the paged ``caches``, in one launch.

    Arguments as :func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`
    (the caches ``[rows, D]`` views addressed by ``rows``). Outputs alias q and the caches
    (``input_output_aliases``): in place when they are donated. ``tuning``: the launch
    shape (default: :func:`jaxrope.ops.rope_append_kv.tuning.append_triton_tuning` of the
    shapes; sweeps pass others).

    Raises:
      BackendUnavailable: :func:`unsupported` declines the cache.
      NotImplementedError: a norm weight is given (the kernel has no QK-norm).
    """
    if q_norm_weight is not None or k_norm_weight is not None:
        raise NotImplementedError(missing("interpret" if interpret else "triton"))
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    declined = unsupported(caches[0])
    if declined:
        raise BackendUnavailable(declined)
    if num_tokens == 0:
        return q, tuple(caches)
    lanes = lanes_for(rotary_dim)
    tables = jnp.pad(tables, ((0, 0), (0, lanes - tables.shape[1])))
    block = tuning or append_triton_tuning(num_tokens, q_heads, k_heads, lanes)
    q_programs, k_programs, _ = head_programs(q_heads, k_heads, block)
    kernel = functools.partial(
        _rope_append_kv_kernel, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        rotary_dim=rotary_dim, interleave=interleave, attention_factor=attention_factor,
        lanes=lanes, rows=rows, heads_per_program=block.heads_per_program,
        groups_per_program=block.groups_per_program, token_loop=block.token_loop,
        q_programs=q_programs, k_programs=k_programs,
        approx_trig=not interpret, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved)
    if mrope_section is not None:
        pos_ids = pos_ids.reshape(3 * num_tokens)
    first_cache = 8  # operand index of the first cache: after count .. v
    aliases = {5: 0, **{first_cache + i: 1 + i for i in range(len(caches))}}
    q_out, *caches = pl.pallas_call(
        kernel,
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, *caches)),
        grid=grid(num_tokens, q_heads, k_heads, block),
        input_output_aliases=aliases,
        interpret=interpret,
        name="jaxrope_rope_append_kv",
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps,
                                             num_stages=block.num_stages),
    )(jnp.full((1,), num_tokens, jnp.int32), pos_ids, slots, tables, scales, q, k, v, *caches)
    return q_out, tuple(caches)
