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
  pairs); dims past ``R`` are never touched (q is aliased to the output). With a
  QK-norm of q, or an fp8 q output, every dim ``[0, D)``.
- k programs: the rotary dims rotated, dims ``[R, D)`` copied, both to the cache.
- v programs: dims ``[0, D)`` copied to the cache.

QK-norm (``qk_norm.per_head``: Qwen3, Gemma 3): a q or k program holds each of its heads
whole, so it normalises them in registers between the loads and the rotation: the sum
of squares over the head's ``D`` dims (rotary and passthrough) in float32, ``rsqrt(mean
+ eps)``, times the weight (``1 + w`` for "gemma"), loaded once a program; then the
rotation, one rounding at the store (:func:`jaxrope.qk_norm.normalize`'s order of
operations). A per-token norm (``per_head=False``: OLMo 2) spans all of a token's heads,
which several programs share, so this kernel declines it (``NotImplementedError``; "auto"
takes XLA).

fp8 q (``q_dtype=float8_e4m3fn``): q programs store ``e4m3(clip(x * scales[2], -448,
448))`` of every dim into a new fp8 array (FlashInfer's ``quant_scale_q``), through the
same :func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype` as the caches; q is not
aliased then and stays unchanged.

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
k, v, *weights, *caches)`` then the outputs ``(q_out, *caches)`` (``weights``: the
``q_norm_weight`` then the ``k_norm_weight`` of those given; ``q_out`` aliases q unless
q is fp8; an M-RoPE kernel's ``pos_ids`` a contiguous int32 ``[3, count]``); ``count`` is
read at run time, so the
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
from jaxrope.ops.rope_append_kv.cache_layout import CacheRows
from jaxrope.ops.rope_append_kv.reference import FP8, to_cache_dtype
from jaxrope.ops.rope_append_kv.tuning import (AppendTritonTuning, append_triton_tuning, grid,
                                               head_programs)
from jaxrope.ops.triton_common import lane_tables, next_pow2, token_angle
from jaxrope.qk_norm import QKNorm, per_token_norm

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
                           mrope_interleaved: bool, norm_q: bool, norm_k: bool,
                           qk_norm: Optional[QKNorm], num_caches: int):
    # refs: the norm weights given (q's, then k's), the caches as inputs (aliased to the
    # outputs, never read), then the outputs (q_out, *caches), each cache a [rows, D] view.
    # The keys go to the first cache, the values to cache rows.value_array,
    # rows.value_offset rows further.
    weight_refs = refs[:norm_q + norm_k]
    q_out_ref, *cache_refs = refs[norm_q + norm_k + num_caches:]
    pid = pl.program_id(0)
    per_token = q_programs + 2 * k_programs
    group, token_program = pid % per_token, pid // per_token
    traced_zero = 0 * group
    count = count_ref[0]
    hp = heads_per_program
    quantize = cache_refs[0].dtype == FP8
    q_fp8 = q_out_ref.dtype == FP8

    def piece(start: int, width: int, valid: int):
        # (dims, lane mask [1, width], valid lanes). A slice that may run past the last
        # axis gets a traced start: its masked lanes are never dereferenced, but a static
        # out-of-range slice is rejected at trace time.
        begin = traced_zero + start if start + width > head_dim else start
        return pl.ds(begin, width), (jnp.arange(width) < valid)[None, :], valid

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
                .astype(jnp.float32) for dims, lane_ok, _ in pieces]

    def load_weight(w_ref, pieces):
        # The weight's lanes of each piece as float32 [1, width] (1 + w for "gemma"), once a
        # program; masked lanes read 0, and their values are 0 too.
        weights = []
        for dims, _, valid in pieces:
            w = plgpu.load(w_ref.at[dims], mask=jnp.arange(dims.size) < valid,
                           other=0).astype(jnp.float32)
            weights.append((1.0 + w if qk_norm.convention == "gemma" else w)[None, :])
        return weights

    def normalize(values, weights):
        # Each head over its whole D (every piece, masked lanes 0): x * rsqrt(mean(x^2) +
        # eps) * w in float32, in jaxrope.qk_norm.normalize's order.
        squares = sum(jnp.sum(x * x, axis=1) for x in values)[:, None]
        inverse = jax.lax.rsqrt(squares / head_dim + qk_norm.eps)
        return [x * inverse * w for x, w in zip(values, weights)]

    def rotate(values, cos, sin):
        if interleave:
            pairs = values[0].reshape(hp, lanes, 2)
            a, b = (p.reshape(hp, lanes) for p in jnp.split(pairs, 2, axis=-1))
            return [jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(hp, 2 * lanes)]
        a, b = values
        return [a * cos - b * sin, b * cos + a * sin]

    def angle(t, turns):
        return token_angle(pos_ref, t, count, turns, attention_factor,
                           mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                           approx_trig=approx_trig)

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

    def normed_rotation(values, weights, cos, sin):
        # values: the rotary pieces, then any passthrough; all float32, one rounding later.
        if weights is not None:
            values = normalize(values, weights)
        return rotate(values[:len(rotary)], cos, sin) + values[len(rotary):]

    # A normalised q changes its passthrough dims and an fp8 q is a new array: every dim.
    q_pieces = (rotary + passthrough) if (norm_q or q_fp8) else rotary

    @pl.when(group < q_programs)
    def _():
        turns = load_turns()
        weights = load_weight(weight_refs[0], q_pieces) if norm_q else None
        scale = plgpu.load(scale_ref.at[jnp.int32(2)]) if q_fp8 else None

        def body(t, token_ok):
            cos, sin = angle(t, turns)
            groups = [heads_of(group, g, q_heads) for g in range(groups_per_program)]
            loaded = [load(q_ref, t, heads, ok, q_pieces) for heads, ok, _ in groups]
            for (heads, head_ok, _), values in zip(groups, loaded):
                values = normed_rotation(values, weights, cos, sin)
                for (dims, lane_ok, _), value in zip(q_pieces, values):
                    plgpu.store(q_out_ref.at[t, heads, dims],
                                to_cache_dtype(value, scale, q_out_ref.dtype),
                                mask=token_ok & head_ok & lane_ok)

        walk(body)

    def append(program, rotated: bool, value_ref, cache_ref, offset, scale_index):
        turns = load_turns() if rotated else None
        scale = plgpu.load(scale_ref.at[jnp.int32(scale_index)]) if quantize else None
        pieces = (rotary + passthrough) if rotated else whole_row
        weights = load_weight(weight_refs[-1], pieces) if rotated and norm_k else None

        def body(t, token_ok):
            slot_ok, page, entry = cache_slot(t, token_ok)
            groups = [heads_of(program, g, k_heads) for g in range(groups_per_program)]
            loaded = [load(value_ref, t, heads, ok, pieces) for heads, ok, _ in groups]
            if rotated:
                cos, sin = angle(t, turns)
            for (_, head_ok, ids), values in zip(groups, loaded):
                if rotated:
                    values = normed_rotation(values, weights, cos, sin)
                # The group's cache rows (those of heads past the last are masked off),
                # indexed by arrays on both axes: the interpreter's masked store takes
                # either all slices or all index arrays.
                cache_rows = (rows.row(page, entry, ids) + offset)[:, None]
                for (dims, lane_ok, _), value in zip(pieces, values):
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


def wants_fp8_q(q_dtype, q, scales) -> bool:
    """Whether ``q_dtype`` asks for a new float8_e4m3fn q (False: q's own dtype, in place).

    Raises:
      ValueError: a ``q_dtype`` other than None, q's dtype or float8_e4m3fn, or fp8 with
        ``scales`` that hold no q scale (``[3]``: k, v, q).
    """
    if q_dtype is None:
        return False
    try:
        dtype = jnp.dtype(q_dtype)
    except TypeError as e:
        raise ValueError(f"q_dtype={q_dtype!r} must be None, q's dtype ({q.dtype}) or "
                         "float8_e4m3fn") from e
    if dtype == q.dtype:
        return False
    if dtype != FP8:
        raise ValueError(f"q_dtype={dtype} must be None, q's dtype ({q.dtype}) or float8_e4m3fn")
    if tuple(scales.shape) != (3,):
        raise ValueError(f"scales.shape={tuple(scales.shape)} must be (3,) (k, v and q scales) "
                         "for an fp8 q")
    return True


def _norm_weights(q_norm_weight, k_norm_weight, qk_norm: Optional[QKNorm],
                  backend: str) -> Tuple:
    """The weights given, q's then k's; declines a per-token norm."""
    weights = tuple(w for w in (q_norm_weight, k_norm_weight) if w is not None)
    if weights and qk_norm is None:
        raise ValueError("a norm weight is given but qk_norm=None: pass the QKNorm that says "
                         "how to normalise")
    if weights and not qk_norm.per_head:
        raise NotImplementedError(per_token_norm(backend))
    return weights


def rope_append_kv_triton(q, k, v, pos_ids, slots, tables, scales, caches, *, rows: CacheRows,
                          rotary_dim: int, interleave: bool, attention_factor: float,
                          mrope_section: Optional[Tuple[int, int, int]] = None,
                          mrope_interleaved: bool = False, interpret: bool = False,
                          tuning: Optional[AppendTritonTuning] = None,
                          q_norm_weight=None, k_norm_weight=None,
                          qk_norm: Optional[QKNorm] = None, q_dtype=None):
    """Rotate q and write rotated k and v into the paged ``caches``, in one launch.

    Arguments as :func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`
    (the caches ``[rows, D]`` views addressed by ``rows``; ``scales`` float32 ``[3]`` =
    ``[k_scale, v_scale, q_scale]``, or ``[2]`` when q stays in its dtype). Outputs alias
    q and the caches (``input_output_aliases``): in place when they are donated. With
    ``q_dtype`` float8_e4m3fn, ``q_out`` is a new array ``e4m3(clip(rot(q) * scales[2],
    -448, 448))`` of every dim and q is not aliased. ``q_norm_weight`` / ``k_norm_weight``
    ``[D]`` with a per-head ``qk_norm`` normalise q / k in the kernel before the rotation.
    ``tuning``: the launch shape (default:
    :func:`jaxrope.ops.rope_append_kv.tuning.append_triton_tuning` of the shapes; sweeps
    pass others).

    Raises:
      BackendUnavailable: :func:`unsupported` declines the cache.
      NotImplementedError: a per-token norm (``qk_norm.per_head=False``,
        :func:`jaxrope.qk_norm.per_token_norm`).
      ValueError: as :func:`wants_fp8_q`; a weight without ``qk_norm``.
    """
    weights = _norm_weights(q_norm_weight, k_norm_weight, qk_norm,
                            "interpret" if interpret else "triton")
    q_fp8 = wants_fp8_q(q_dtype, q, scales)
    num_tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    declined = unsupported(caches[0])
    if declined:
        raise BackendUnavailable(declined)
    q_out_dtype = FP8 if q_fp8 else q.dtype
    if num_tokens == 0:
        return (jnp.zeros(q.shape, FP8) if q_fp8 else q), tuple(caches)
    lanes, tables = lane_tables(tables, rotary_dim)
    block = tuning or append_triton_tuning(num_tokens, q_heads, k_heads, lanes)
    q_programs, k_programs, _ = head_programs(q_heads, k_heads, block)
    kernel = functools.partial(
        _rope_append_kv_kernel, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        rotary_dim=rotary_dim, interleave=interleave, attention_factor=attention_factor,
        lanes=lanes, rows=rows, heads_per_program=block.heads_per_program,
        groups_per_program=block.groups_per_program, token_loop=block.token_loop,
        q_programs=q_programs, k_programs=k_programs,
        approx_trig=not interpret, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, norm_q=q_norm_weight is not None,
        norm_k=k_norm_weight is not None, qk_norm=qk_norm, num_caches=len(caches))
    if mrope_section is not None:
        pos_ids = pos_ids.reshape(3 * num_tokens)
    first_cache = 8 + len(weights)  # operand index of the first cache: after count .. weights
    # q is written in place unless the output is a new fp8 array.
    aliases = {**({} if q_fp8 else {5: 0}),
               **{first_cache + i: 1 + i for i in range(len(caches))}}
    q_out, *caches = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q_out_dtype),
                   *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches)),
        grid=grid(num_tokens, q_heads, k_heads, block),
        input_output_aliases=aliases,
        interpret=interpret,
        name="jaxrope_rope_append_kv",
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps,
                                             num_stages=block.num_stages),
    )(jnp.full((1,), num_tokens, jnp.int32), pos_ids, slots, tables, scales, q, k, v, *weights,
      *caches)
    return q_out, tuple(caches)
