"""Export the Mosaic GPU kernel of the fused RoPE + KV append as a Mosaic module, for
launching outside JAX dispatch: the append's twin of :mod:`jaxrope.ops.rope.mosaic_export`
(the same lowering, :func:`jaxrope.ops.mosaic_common.export_module`), which
``torch_bridge.launch.mosaic`` compiles once and launches on torch's current stream.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.ops.mosaic_common import MosaicModule, built_for_launch, export_module
from jaxrope.ops.rope_append_kv import mosaic
from jaxrope.ops.rope_append_kv.reference import FP8
from jaxrope.ops.rope_append_kv.tuning import AppendMosaicTuning
from jaxrope.qk_norm import QKNorm

# Operand order of the exported fused RoPE + KV append: "*weights" are the norm weights
# asked for (q's, then k's), "q_out" the fp8 q's buffer (with an fp8 q only). Results:
# q, then the caches; with an fp8 q the caches, then q_out.
APPEND_OPERANDS = ("count", "pos_ids", "slots", "tables", "rows", "scales", "q", "k", "v",
                   "*weights", "*caches", "q_out")


def export_append(*, q_heads: int, k_heads: int, head_dim: int, dtype, cache_dtype,
                  rows, components: int, rotary_dim: int, interleave: bool,
                  attention_factor: float, tuning: AppendMosaicTuning, capacity: int,
                  grid: int, max_count: Optional[int] = None,
                  mrope_section: Optional[Tuple[int, int, int]] = None,
                  mrope_interleaved: bool = False, qk_norm: Optional[QKNorm] = None,
                  q_weight_dtype=None, k_weight_dtype=None, q_dtype=None) -> MosaicModule:
    """The fused RoPE + paged KV append kernel
    (:func:`jaxrope.ops.rope_append_kv.mosaic.build_append`) for one head layout, cache
    geometry (``rows``, a :class:`jaxrope.ops.rope_append_kv.cache_layout.CacheRows`;
    ``components`` cache arrays: 2 for a ``(k, v)`` pair, 1 for one array holding both),
    split (``tuning``: :func:`jaxrope.ops.rope_append_kv.tuning.append_mosaic_tuning`) and
    launch shape, as a Mosaic module reading the token count at run time; ``max_count``
    bounds the counts it will see (with a block of ``grid`` for every token of it, no
    block walks).

    Operands (:data:`APPEND_OPERANDS`): ``count`` int32 ``[1]``, ``pos_ids`` as
    :func:`jaxrope.ops.rope.mosaic_export.export`'s, ``slots`` int32 ``[capacity]``,
    ``tables``, ``rows`` (:func:`jaxrope.ops.mosaic_common.slot_row_table`), ``scales``
    float32 ``[2]`` (``[3]``, the last q's, with an fp8 q), q, k, v contiguous
    ``[capacity, H, D]``, the norm weights ``[D]`` (``q_weight_dtype`` /
    ``k_weight_dtype``: the dtype of each one the call passes, None for none; per-head
    ``qk_norm``), each cache array (contiguous, any shape holding ``rows``' rows of
    ``D``), then with ``q_dtype`` float8_e4m3fn the fp8 q's ``[capacity, Hq, D]`` (q is
    then only read).

    Raises:
      BackendUnavailable: a JAX without the Mosaic GPU API, or whose lowered form this
        does not recognise.
      NotImplementedError: a norm with ``qk_norm.per_head`` False.
    """
    q_fp8 = mosaic.fp8_q(q_dtype)
    weight_dtypes = [d for d in (q_weight_dtype, k_weight_dtype) if d is not None]
    kernel = built_for_launch(
        mosaic.build_append, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        itemsize=jnp.dtype(dtype).itemsize, rotary_dim=rotary_dim, interleave=interleave,
        attention_factor=attention_factor, rows=rows, quantize=jnp.dtype(cache_dtype) == FP8,
        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, grid=grid,
        max_count=max_count, tuning=tuning, qk_norm=qk_norm,
        norm_q=q_weight_dtype is not None, norm_k=k_weight_dtype is not None,
        q_dtype=FP8 if q_fp8 else None)
    view = (head_dim // 2, 2) if interleave else (head_dim,)
    cache_rows = rows.num_slots * k_heads * (2 if components == 1 else 1)
    head_rows = k_heads * rows.head_stride
    weights = len(weight_dtypes)

    def call(count, pos_ids, slots, tables, row_table, scales, q, k, v, *rest):
        # The refs the kernel writes: q (in place) or q_out (fp8, last), and the caches.
        q_in = q if q_fp8 else jax.new_ref(q)
        written = [jax.new_ref(x) for x in rest[weights:]]
        kernel(count, pos_ids, slots, tables, row_table, scales, q_in, k, v, *rest[:weights],
               *written)
        return (*(() if q_fp8 else (jax.freeze(q_in),)), *(jax.freeze(r) for r in written))

    half = rotary_dim // 2
    rows_of_pos = 1 if mrope_section is None else 3
    cache_spec = jax.ShapeDtypeStruct(
        (cache_rows // head_rows, k_heads, rows.head_stride, *view), cache_dtype)
    q_spec = jax.ShapeDtypeStruct((capacity, q_heads, *view), dtype)
    specs = (jax.ShapeDtypeStruct((1,), jnp.int32),
             jax.ShapeDtypeStruct((rows_of_pos * capacity,), jnp.int32),
             jax.ShapeDtypeStruct((capacity,), jnp.int32),
             jax.ShapeDtypeStruct((3, half), jnp.float32),
             jax.ShapeDtypeStruct((half,), jnp.int32),
             jax.ShapeDtypeStruct((3 if q_fp8 else 2,), jnp.float32),
             q_spec,
             jax.ShapeDtypeStruct((capacity, k_heads, *view), dtype),
             jax.ShapeDtypeStruct((capacity, k_heads, *view), dtype),
             *[jax.ShapeDtypeStruct(view, d) for d in weight_dtypes],
             *[cache_spec] * components,
             *([jax.ShapeDtypeStruct(q_spec.shape, FP8)] if q_fp8 else []))
    first_cache = 9 + weights
    donated = (*(() if q_fp8 else (6,)), *range(first_cache, len(specs)))
    return export_module(call, specs, donated, capacity, grid)
