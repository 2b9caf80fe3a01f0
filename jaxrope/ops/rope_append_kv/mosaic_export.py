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

# Operand order of the exported fused RoPE + KV append; results: q, then the caches.
APPEND_OPERANDS = ("count", "pos_ids", "slots", "tables", "rows", "scales", "q", "k", "v",
                   "*caches")


def export_append(*, q_heads: int, k_heads: int, head_dim: int, dtype, cache_dtype,
                  rows, components: int, rotary_dim: int, interleave: bool,
                  attention_factor: float, tuning: AppendMosaicTuning, capacity: int,
                  grid: int, max_count: Optional[int] = None,
                  mrope_section: Optional[Tuple[int, int, int]] = None,
                  mrope_interleaved: bool = False) -> MosaicModule:
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
    float32 ``[2]``, q, k, v contiguous ``[capacity, H, D]``, then each cache array
    (contiguous, any shape holding ``rows``' rows of ``D``).

    Raises:
      BackendUnavailable: a JAX without the Mosaic GPU API, or whose lowered form this
        does not recognise.
    """
    kernel = built_for_launch(
        mosaic.build_append, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        itemsize=jnp.dtype(dtype).itemsize, rotary_dim=rotary_dim, interleave=interleave,
        attention_factor=attention_factor, rows=rows, quantize=jnp.dtype(cache_dtype) == FP8,
        mrope_section=mrope_section, mrope_interleaved=mrope_interleaved, grid=grid,
        max_count=max_count, tuning=tuning)
    view = (head_dim // 2, 2) if interleave else (head_dim,)
    cache_rows = rows.num_slots * k_heads * (2 if components == 1 else 1)
    head_rows = k_heads * rows.head_stride

    def call(count, pos_ids, slots, tables, row_table, scales, q, k, v, *caches):
        q_ref = jax.new_ref(q)
        cache_refs = [jax.new_ref(c) for c in caches]
        kernel(count, pos_ids, slots, tables, row_table, scales, q_ref, k, v, *cache_refs)
        return (jax.freeze(q_ref), *(jax.freeze(r) for r in cache_refs))

    half = rotary_dim // 2
    rows_of_pos = 1 if mrope_section is None else 3
    cache_spec = jax.ShapeDtypeStruct(
        (cache_rows // head_rows, k_heads, rows.head_stride, *view), cache_dtype)
    specs = (jax.ShapeDtypeStruct((1,), jnp.int32),
             jax.ShapeDtypeStruct((rows_of_pos * capacity,), jnp.int32),
             jax.ShapeDtypeStruct((capacity,), jnp.int32),
             jax.ShapeDtypeStruct((3, half), jnp.float32),
             jax.ShapeDtypeStruct((half,), jnp.int32),
             jax.ShapeDtypeStruct((2,), jnp.float32),
             jax.ShapeDtypeStruct((capacity, q_heads, *view), dtype),
             jax.ShapeDtypeStruct((capacity, k_heads, *view), dtype),
             jax.ShapeDtypeStruct((capacity, k_heads, *view), dtype),
             *[cache_spec] * components)
    return export_module(call, specs, (6, *range(9, 9 + components)), capacity, grid)
