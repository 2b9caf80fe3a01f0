"""The Pallas GPU kernel (Triton lowering) of MLA's RoPE fused with the paged cache append.

MLA (DeepSeek-V2/V3) caches one latent row a token: ``ckv [L]`` (the compressed kv,
``kv_lora_rank``) beside the rotated ``k_pe [r]``. One launch, one pass over the bytes:
q_pe ``[T, H, r]`` is read and written back rotated (in place through
``input_output_aliases``), k_pe is rotated and written with ckv into the cache row of
each token's slot; with an fp8 q, q_pe's rotation and q_nope ``[T, H, N]`` are quantised
into new fp8 arrays instead (FlashInfer's ``mla_rope_quantize_fp8``). q_pe's rotation is
most of the bytes (DeepSeek-V3: 128 heads of 64 dims against one row of 512 + 64).

Grid: one axis of ``token programs x programs per token``, a token's programs
neighbours (as in :mod:`jaxrope.ops.rope_append_kv.triton`). Per token there are
``q_programs`` programs over q_pe's heads, ``nope_programs`` over q_nope's (fp8 q only)
and one for the cache row (:func:`jaxrope.ops.mla_rope_append.tuning.mla_programs`). A
program walks ``token_loop`` tokens; per token it loads the position (and the slot) as
scalars, forms cos/sin once through the shared angle (:mod:`jaxrope.ops.angle`) and
issues every load before the first store.

- q_pe programs: ``groups_per_program`` groups of ``heads_per_program`` heads, rotated:
  GPT-J pairs (DeepSeek's ``interleave=True``) as one contiguous load of the rotary span
  split in registers, NeoX halves as two loads.
- q_nope programs: ``nope_heads_per_program`` heads, ``e4m3(clip(x * q_scale))``.
- the row program: k_pe rotated to columns ``[c, c + r)`` and ckv copied to ``[0, L)`` of
  the cache row ``slot`` (the pair's ``kpe_rows`` with ``c = 0``, or the one ``[rows, L +
  r]`` array with ``c = L``); a slot outside ``[0, rows)`` (negative: padding) masks the
  row's stores off. An fp8 cache stores ``e4m3(clip(x * kv_scale))``
  (:func:`jaxrope.ops.rope_append_kv.reference.to_cache_dtype`, the XLA backend's).

M-RoPE positions ``[3, T]`` enter flattened, row ``r`` of token ``t`` at ``r * count +
t``, as in the GQA kernel. For a launch outside JAX the operands are, in order,
``(count, pos_ids, slots, tables, scales, q_pe, k_pe, ckv, [q_nope], *caches)`` then the
outputs ``(q_pe, [q_nope], *caches)`` (q_nope only with an fp8 q and a q_nope; k_pe and
ckv as ``[T, 1, r]`` and ``[T, 1, L]``); ``count`` is read at run time, so the Triton
IR depends on T only through the grid.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.mla_rope_append.tuning import MlaTritonTuning, mla_grid, mla_programs, \
    mla_triton_tuning
from jaxrope.ops.rope_append_kv.reference import FP8, to_cache_dtype
from jaxrope.ops.rope_append_kv.triton import unsupported
from jaxrope.ops.triton_common import lane_tables, next_pow2, token_angle


def _mla_rope_append_kernel(count_ref, pos_ref, slot_ref, tables_ref, scale_ref, q_pe_ref,
                            k_pe_ref, ckv_ref, *refs, heads: int, rotary_dim: int,
                            nope_dim: int, kv_lora_rank: int, kpe_column: int,
                            interleave: bool, attention_factor: float, lanes: int,
                            tuning: MlaTritonTuning, q_programs: int, nope_programs: int,
                            quantize_q: bool, approx_trig: bool,
                            mrope_section: Optional[Tuple[int, int, int]],
                            mrope_interleaved: bool):
    # q_pe_ref [T, H, r], k_pe_ref [T, 1, r], ckv_ref [T, 1, L]; refs: q_nope [T, H, N]
    # when it is quantised, the caches as inputs (aliased to the outputs, never read),
    # then the outputs: q_pe [T, H, r], q_nope (fp8) when quantised, the caches, each a
    # [rows, width] matrix (ckv's then k_pe's, or the one array holding both).
    q_nope_ref = refs[0] if nope_programs else None
    outputs = refs[(len(refs) - 1) // 2:]
    q_out_ref, *outputs = outputs
    q_nope_out_ref = outputs.pop(0) if nope_programs else None
    ckv_cache_ref, kpe_cache_ref = outputs[0], outputs[-1]
    pid = pl.program_id(0)
    per_token = q_programs + nope_programs + 1
    program, token_program = pid % per_token, pid // per_token
    traced_zero = 0 * program
    count = count_ref[0]

    def piece(start: int, width: int, valid: int, extent: int):
        # A slice that may run past the last axis gets a traced start: its masked lanes
        # are never dereferenced, but a static out-of-range slice is rejected at trace time.
        begin = traced_zero + start if start + width > extent else start
        return pl.ds(begin, width), (jnp.arange(width) < valid)[None, :]

    if interleave:
        # Pairs are adjacent: one contiguous load of the rotary span, split in registers.
        rotary = (piece(0, 2 * lanes, rotary_dim, rotary_dim),)
    else:
        half = rotary_dim // 2
        rotary = (piece(0, lanes, half, rotary_dim), piece(half, lanes, half, rotary_dim))

    def head_block(first, num):
        # (the block's head slice, its head-in-range mask [num, 1])
        ids = first + jnp.arange(num, dtype=jnp.int32)
        return pl.ds(first, num), (ids < heads)[:, None]

    def load(x_ref, t, rows, row_ok, pieces):
        return [plgpu.load(x_ref.at[t, rows, dims], mask=row_ok & lane_ok, other=0)
                .astype(jnp.float32) for dims, lane_ok in pieces]

    def rotate(values, cos, sin):
        if interleave:
            rows = values[0].shape[0]
            pairs = values[0].reshape(rows, lanes, 2)
            a, b = (p.reshape(rows, lanes) for p in jnp.split(pairs, 2, axis=-1))
            return [jnp.stack([a * cos - b * sin, b * cos + a * sin],
                              axis=-1).reshape(rows, 2 * lanes)]
        a, b = values
        return [a * cos - b * sin, b * cos + a * sin]

    def load_turns():
        return [plgpu.load(tables_ref.at[jnp.int32(i)]) for i in range(3)]

    def angle(t, turns):
        return token_angle(pos_ref, t, count, turns, attention_factor,
                           mrope_section=mrope_section, mrope_interleaved=mrope_interleaved,
                           approx_trig=approx_trig)

    def each_token(body):
        # body(t, token_ok) for this program's tokens; t is clamped to a real token so its
        # scalar loads stay in bounds, token_ok masks the stores of the rest.
        def step(i):
            t = token_program * tuning.token_loop + i
            body(jnp.minimum(t, count - 1), t < count)

        if tuning.token_loop == 1:
            step(traced_zero)
        else:
            jax.lax.fori_loop(0, tuning.token_loop, lambda i, c: (step(i), c)[1], 0)

    def scale(index: int):
        return plgpu.load(scale_ref.at[jnp.int32(index)])

    def q_value(value, q_scale):
        return to_cache_dtype(value, q_scale, FP8) if quantize_q else value.astype(
            q_out_ref.dtype)

    @pl.when(program < q_programs)
    def _():
        turns = load_turns()
        q_scale = scale(0) if quantize_q else None
        hp = tuning.heads_per_program

        def body(t, token_ok):
            cos, sin = angle(t, turns)
            first = program * tuning.groups_per_program * hp
            groups = [head_block(first + g * hp, hp) for g in range(tuning.groups_per_program)]
            loaded = [load(q_pe_ref, t, block, ok, rotary) for block, ok in groups]
            for (block, head_ok), values in zip(groups, loaded):
                for (dims, lane_ok), value in zip(rotary, rotate(values, cos, sin)):
                    plgpu.store(q_out_ref.at[t, block, dims], q_value(value, q_scale),
                                mask=token_ok & head_ok & lane_ok)

        each_token(body)

    if nope_programs:
        @pl.when((program >= q_programs) & (program < q_programs + nope_programs))
        def _():
            q_scale = scale(0)
            hp = tuning.nope_heads_per_program
            block, head_ok = head_block((program - q_programs) * hp, hp)
            whole = (piece(0, next_pow2(nope_dim), nope_dim, nope_dim),)

            def body(t, token_ok):
                [value] = load(q_nope_ref, t, block, head_ok, whole)
                [(dims, lane_ok)] = whole
                plgpu.store(q_nope_out_ref.at[t, block, dims],
                            to_cache_dtype(value, q_scale, FP8),
                            mask=token_ok & head_ok & lane_ok)

            each_token(body)

    @pl.when(program == q_programs + nope_programs)
    def _():
        turns = load_turns()
        kv_scale = scale(1) if ckv_cache_ref.dtype == FP8 else None
        latent = (piece(0, next_pow2(kv_lora_rank), kv_lora_rank, kv_lora_rank),)
        one_row = (pl.ds(0, 1), jnp.ones((1, 1), bool))

        def body(t, token_ok):
            slot = plgpu.load(slot_ref.at[t])
            slot_ok = token_ok & (slot >= 0) & (slot < ckv_cache_ref.shape[0])
            # Index arrays on both axes: the interpreter's masked store takes either all
            # slices or all index arrays.
            row = jnp.where(slot_ok, slot, 0) + jnp.zeros((1, 1), jnp.int32)
            k_values = load(k_pe_ref, t, *one_row, rotary)
            [ckv] = load(ckv_ref, t, *one_row, latent)
            cos, sin = angle(t, turns)
            stores = [(ckv_cache_ref, 0, dims, lane_ok, value)
                      for (dims, lane_ok), value in zip(latent, [ckv])]
            stores += [(kpe_cache_ref, kpe_column, dims, lane_ok, value)
                       for (dims, lane_ok), value in zip(rotary, rotate(k_values, cos, sin))]
            for cache_ref, column, dims, lane_ok, value in stores:
                lane = column + dims.start + jnp.arange(dims.size, dtype=jnp.int32)[None, :]
                plgpu.store(cache_ref.at[row, lane],
                            to_cache_dtype(value, kv_scale, cache_ref.dtype),
                            mask=slot_ok & lane_ok)

        each_token(body)


def mla_rope_append_triton(q_pe, k_pe, ckv, q_nope, pos_ids, slots, tables, scales, caches, *,
                           rotary_dim: int, interleave: bool, attention_factor: float,
                           mrope_section: Optional[Tuple[int, int, int]] = None,
                           mrope_interleaved: bool = False, q_dtype=None,
                           interpret: bool = False,
                           tuning: Optional[MlaTritonTuning] = None):
    """Rotate q_pe (in place) and write ckv with the rotated k_pe into the cache rows of
    ``slots``, in one launch; with ``q_dtype`` float8_e4m3fn, q_pe's rotation and q_nope
    are quantised into new arrays instead.

    ``q_pe [T, H, r]``, ``k_pe [T, r]``, ``ckv [T, L]``, ``q_nope [T, H, N]`` or None,
    ``pos_ids`` int32 ``[T]`` (M-RoPE: ``[3, T]``), ``slots`` int32 ``[T]`` (outside
    ``[0, rows)``: skipped), ``tables`` float32 ``[3, r/2]``, ``scales`` float32 ``[2]`` =
    ``[q_scale, kv_scale]``, ``caches`` ``(ckv_rows [rows, L], kpe_rows [rows, r])`` or
    ``(rows [rows, L + r],)``. Returns ``(q_pe_out, q_nope_out, caches)``: q_pe rotated in
    its dtype and q_nope as given, or both fp8 (q_nope_out None when q_nope is). Outputs
    alias q_pe (unless fp8) and the caches (``input_output_aliases``). ``tuning``: the
    launch shape (default :func:`jaxrope.ops.mla_rope_append.tuning.mla_triton_tuning`).

    Raises:
      BackendUnavailable: :func:`jaxrope.ops.rope_append_kv.triton.unsupported` declines
        a 1-byte array it writes (an fp8 cache, or fp8 q_pe or q_nope, of 2-4 GiB).
      NotImplementedError: ``rotary_dim`` is not q_pe's last dim (MLA rotates all of it).
    """
    num_tokens, heads, rope_dim = q_pe.shape
    if rotary_dim != rope_dim:
        raise NotImplementedError(f"rotary_dim={rotary_dim} must be q_pe's last dim "
                                  f"{rope_dim}: the MLA kernel rotates the whole of it")
    quantize_q = q_dtype is not None and jnp.dtype(q_dtype) == FP8
    # Every 1-byte array the kernel writes: an fp8 cache, and with an fp8 q its new
    # outputs (q_nope's reaches 2 GiB at 32768 DeepSeek-V3 tokens).
    written = [("a cache", c) for c in caches]
    if quantize_q:
        written += [(f"the fp8 {name}", jax.ShapeDtypeStruct(x.shape, FP8))
                    for name, x in (("q_pe", q_pe), ("q_nope", q_nope)) if x is not None]
    for name, x in written:
        declined = unsupported(x)
        if declined:
            raise BackendUnavailable(f"{name} {tuple(x.shape)}: {declined}")
    kv_lora_rank = ckv.shape[-1]
    if num_tokens == 0:
        empty = (lambda x: jnp.zeros(x.shape, FP8)) if quantize_q else (lambda x: x)
        return empty(q_pe), None if q_nope is None else empty(q_nope), tuple(caches)
    nope = quantize_q and q_nope is not None
    nope_dim = q_nope.shape[-1] if nope else 0
    lanes, tables = lane_tables(tables, rotary_dim)
    block = tuning or mla_triton_tuning(num_tokens, heads, lanes, nope_dim)
    q_programs, nope_programs, _ = mla_programs(heads, nope_dim, block)
    kernel = functools.partial(
        _mla_rope_append_kernel, heads=heads, rotary_dim=rotary_dim, nope_dim=nope_dim,
        kv_lora_rank=kv_lora_rank, kpe_column=kv_lora_rank if len(caches) == 1 else 0,
        interleave=interleave, attention_factor=attention_factor, lanes=lanes, tuning=block,
        q_programs=q_programs, nope_programs=nope_programs, quantize_q=quantize_q,
        approx_trig=not interpret, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved)
    if mrope_section is not None:
        pos_ids = pos_ids.reshape(3 * num_tokens)
    q_out = jax.ShapeDtypeStruct(q_pe.shape, FP8 if quantize_q else q_pe.dtype)
    nopes = (q_nope,) if nope else ()
    outputs = (q_out, *(jax.ShapeDtypeStruct(q_nope.shape, FP8) for _ in nopes),
               *(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in caches))
    first_cache = 8 + len(nopes)  # operand index of the first cache: after count .. ckv
    first_cache_out = 1 + len(nopes)
    aliases = {first_cache + i: first_cache_out + i for i in range(len(caches))}
    if not quantize_q:
        aliases[5] = 0
    q_pe_out, *rest = pl.pallas_call(
        kernel,
        out_shape=outputs,
        grid=mla_grid(num_tokens, heads, nope_dim, block),
        input_output_aliases=aliases,
        interpret=interpret,
        name="jaxrope_mla_rope_append",
        compiler_params=plgpu.CompilerParams(num_warps=block.num_warps,
                                             num_stages=block.num_stages),
    )(jnp.full((1,), num_tokens, jnp.int32), pos_ids, slots, tables, scales, q_pe,
      k_pe[:, None, :], ckv[:, None, :], *nopes, *caches)
    q_nope_out = rest.pop(0) if nope else q_nope
    return q_pe_out, q_nope_out, tuple(rest)
