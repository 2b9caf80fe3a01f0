"""Export the Mosaic GPU kernel of MLA's RoPE + cache append as a Mosaic module, for
launching outside JAX dispatch: the MLA twin of
:mod:`jaxrope.ops.rope_append_kv.mosaic_export` (the same lowering,
:func:`jaxrope.ops.mosaic_common.export_module`), which ``torch_bridge.launch.mla``
compiles once per launch shape and launches on torch's current stream.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.ops.mla_rope_append import mosaic
from jaxrope.ops.mla_rope_append.tuning import MlaMosaicTuning
from jaxrope.ops.mosaic_common import MosaicModule, built_for_launch, export_module
from jaxrope.ops.rope_append_kv.reference import FP8

# Operand order of the exported kernel ("?" only with an fp8 q: q_nope only when it is
# quantised too). Results: q_pe, then the caches; with an fp8 q the caches, then the
# fp8 outputs. A launch passes one pointer per operand, then one per result.
MLA_OPERANDS = ("count", "pos_ids", "slots", "tables", "rows", "scales", "q_pe", "k_pe", "ckv",
                "q_nope?", "*caches", "q_pe_out?", "q_nope_out?")


def _pairs(shape: Tuple[int, ...], paired: bool) -> Tuple[int, ...]:
    # GPT-J pairs: the kernel reads a [..., w] row as its [..., w/2, 2] view.
    return (*shape[:-1], shape[-1] // 2, 2) if paired else shape


def export_mla(*, heads: int, rotary_dim: int, kv_lora_rank: int, dtype, cache_dtype,
               num_slots: int, combined: bool, interleave: bool, attention_factor: float,
               tuning: MlaMosaicTuning, capacity: int, grid: int, nope_dim: int = 0,
               q_fp8: bool = False, max_count: Optional[int] = None,
               mrope_section: Optional[Tuple[int, int, int]] = None,
               mrope_interleaved: bool = False) -> MosaicModule:
    """The MLA kernel (:func:`jaxrope.ops.mla_rope_append.mosaic.build_mla`) for one head
    count, cache form and launch shape, as a Mosaic module reading the token count at run
    time: one export serves every T up to ``capacity`` (up to ``max_count`` when given,
    ``grid`` then a block for each piece of each of its tokens, no walk).

    Operands (:data:`MLA_OPERANDS`): ``count`` int32 ``[1]``; ``pos_ids`` int32
    ``[capacity]`` (M-RoPE ``[3 * capacity]``, row ``r`` of token ``t`` at ``r * count +
    t``); ``slots`` int32 ``[capacity]`` (outside ``[0, num_slots)``: skipped);
    ``tables`` float32 ``[3, r/2]``; ``rows`` int32 ``[r/2]``
    (:func:`jaxrope.ops.mosaic_common.slot_row_table`); ``scales`` float32 ``[2]`` =
    ``[q_scale, kv_scale]``; contiguous ``q_pe [capacity, H, r]``, ``k_pe [capacity,
    r]``, ``ckv [capacity, L]``; with ``nope_dim`` (fp8 q only) ``q_nope [capacity, H,
    N]``; the caches, contiguous ``[num_slots, L + r]`` (``combined``) or ``[num_slots,
    L]`` and ``[num_slots, r]`` in ``cache_dtype``; with ``q_fp8`` the float8_e4m3fn
    ``q_pe_out`` (and ``q_nope_out``) shaped like q_pe (q_nope), q_pe then only read.

    Raises:
      BackendUnavailable: a JAX without the Mosaic GPU API, or whose lowered form this
        does not recognise.
      ValueError: ``nope_dim`` without ``q_fp8`` (q_nope is only read to quantise it).
    """
    if nope_dim and not q_fp8:
        raise ValueError(f"nope_dim={nope_dim} needs q_fp8=True: the kernel reads q_nope only "
                         "to quantise it")
    quantize_kv = jnp.dtype(cache_dtype) == FP8
    kernel = built_for_launch(
        mosaic.build_mla, heads=heads, rotary_dim=rotary_dim, kv_lora_rank=kv_lora_rank,
        nope_dim=nope_dim, itemsize=jnp.dtype(dtype).itemsize, interleave=interleave,
        attention_factor=attention_factor, combined=combined, quantize_q=q_fp8,
        quantize_kv=quantize_kv, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, grid=grid, max_count=max_count, tuning=tuning)
    widths = (kv_lora_rank + rotary_dim,) if combined else (kv_lora_rank, rotary_dim)
    sds = jax.ShapeDtypeStruct
    q_shape = _pairs((capacity, heads, rotary_dim), interleave)
    nope = [sds((capacity, heads, nope_dim), dtype)] if nope_dim else []
    half = rotary_dim // 2
    specs = (sds((1,), jnp.int32),
             sds(((1 if mrope_section is None else 3) * capacity,), jnp.int32),
             sds((capacity,), jnp.int32),
             sds((3, half), jnp.float32),
             sds((half,), jnp.int32),
             sds((2,), jnp.float32),
             sds(q_shape, dtype),
             sds(_pairs((capacity, 1, rotary_dim), interleave), dtype),
             sds(_pairs((capacity, 1, kv_lora_rank), combined and interleave), dtype),
             *nope,
             # k_pe's cache (the second of a pair, or the one array) holds GPT-J pairs.
             *[sds(_pairs((num_slots, 1, w), interleave and (combined or i == 1)), cache_dtype)
               for i, w in enumerate(widths)],
             *([sds(q_shape, FP8), *[sds(x.shape, FP8) for x in nope]] if q_fp8 else []))
    first_cache = 9 + len(nope)

    def call(count, pos_ids, slots, tables, row_table, scales, q_pe, k_pe, ckv, *rest):
        # The refs the kernel writes: q_pe (in place) or the fp8 outputs (last), and the caches.
        q_in = q_pe if q_fp8 else jax.new_ref(q_pe)
        written = [jax.new_ref(x) for x in rest[len(nope):]]
        kernel(count, pos_ids, slots, tables, row_table, scales, q_in, k_pe, ckv,
               *rest[:len(nope)], *written)
        return (*(() if q_fp8 else (jax.freeze(q_in),)), *(jax.freeze(r) for r in written))

    donated = (*(() if q_fp8 else (6,)), *range(first_cache, len(specs)))
    return export_module(call, specs, donated, capacity, grid)
