"""Export the Mosaic GPU RoPE kernel as a Mosaic module, for launching outside JAX dispatch.

A PyTorch engine calling RoPE through JAX pays for a DLPack import and a jitted call per
layer (~130 us on the H200 against a ~10 us kernel). JAX lowers a ``plgpu.kernel`` to
one ``mosaic_gpu_v2`` custom call whose backend config carries the kernel's Mosaic
module as MLIR bytecode; the CUDA plugin's ``MosaicGpuCompile`` turns that into a host
launch function (what ``jax.experimental.pallas.mosaic_gpu.as_torch_kernel`` does once
per call, on torch's default stream). :func:`export` lowers the kernel built with a
run-time token count (:func:`jaxrope.kernels.mosaic_gpu.build` with ``count=None``) for
CUDA, which needs no GPU, and returns that module; ``torch_bridge.mosaic_launch``
compiles it once and launches it on torch's current stream.

This reads JAX's lowered StableHLO (the custom call's name and its ``mhlo.backend_config``
``module`` entry), checked against JAX 0.11.2 (on the H200) and 0.12.0.1 (the export, on
CPU). Everything of that is touched here; any failure raises
:class:`jaxrope.BackendUnavailable` and callers fall back to the JAX path.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.errors import BackendUnavailable
from jaxrope.kernels import mosaic_gpu

# Operand order of the exported kernel; the launch passes one pointer per operand, then
# one per result (the in-place q and k again).
OPERANDS = ("count", "pos_ids", "tables", "rows", "q", "k")


@dataclasses.dataclass(frozen=True)
class MosaicModule:
    """One exported kernel: ``module`` (MLIR bytecode for ``MosaicGpuCompile``) and what a
    launch needs to know. The kernel reads ``count`` (int32) at run time and rotates
    tokens ``[0, count)`` of refs that hold ``capacity`` tokens, with ``grid`` blocks."""

    module: bytes
    capacity: int
    grid: int
    results: int  # result pointers after the operands' (q and k, or q and the caches, aliased)


def _module_bytes(lowered) -> Tuple[bytes, int]:
    # The one mosaic_gpu_v2 call of @main, whose operands are @main's arguments in order.
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import func, hlo
    module = lowered.compiler_ir("stablehlo")
    calls = []
    with module.context:
        mains = [op for op in module.body.operations
                 if isinstance(op, func.FuncOp) and op.name.value == "main"]
        if len(mains) != 1:
            raise BackendUnavailable(f"expected one @main in the lowered kernel, found {len(mains)}")
        [block] = mains[0].body.blocks
        for op in block.operations:
            if isinstance(op, hlo.CustomCallOp) and op.call_target_name.value == "mosaic_gpu_v2":
                calls.append(op)
        if len(calls) != 1:
            raise BackendUnavailable(f"expected one Mosaic GPU call, found {len(calls)}")
        [call] = calls
        if list(call.operands) != list(block.arguments):
            raise BackendUnavailable("the Mosaic GPU call's operands are not the kernel's "
                                     "arguments in order")
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        return bytes(config["module"].value_bytes), len(call.results)


def _built(builder, **kwargs):
    # The kernel with a run-time count, on a JAX that has the API.
    reason = mosaic_gpu.unavailable()
    if reason:
        raise BackendUnavailable(reason)
    return builder(count=None, **kwargs)


def _lower(call, specs, donate) -> Tuple[bytes, int]:
    try:
        lowered = jax.jit(call, donate_argnums=donate).trace(*specs).lower(
            lowering_platforms=("cuda",))
        return _module_bytes(lowered)
    except BackendUnavailable:
        raise
    except Exception as e:  # JAX's lowering or its IR API changed
        raise BackendUnavailable(f"exporting the Mosaic GPU kernel failed: "
                                 f"{type(e).__name__}: {e}") from e


def export(*, q_heads: int, k_heads: int, head_dim: int, dtype, rotary_dim: int,
           interleave: bool, attention_factor: float, capacity: int, grid: int,
           splits: int = 1, min_count: int = 1, max_count: Optional[int] = None,
           mrope_section: Optional[Tuple[int, int, int]] = None,
           mrope_interleaved: bool = False) -> MosaicModule:
    """The kernel for one head layout, dtype and launch shape (``capacity`` tokens, ``grid``
    blocks) as a Mosaic module; the token count is read at run time, so one export serves
    every T up to ``capacity``, within ``[min_count, max_count]`` when they are given
    (:func:`jaxrope.kernels.mosaic_gpu.build`: the bounds leave out the path for counts
    under a block and, when ``grid`` has a block for every item, the walk). ``splits``:
    blocks sharing a token block's heads (:func:`jaxrope.kernels.mosaic_gpu.head_splits`).

    Operands (:data:`OPERANDS`): ``count`` int32 ``[1]``, ``pos_ids`` int32 ``[capacity]``
    (M-RoPE: ``[3 * capacity]``, row ``r`` of token ``t`` at ``r * count + t``),
    ``tables`` float32 ``[3, R/2]``, ``rows`` int32 ``[R/2]``
    (:func:`jaxrope.kernels.mosaic_gpu.slot_row_table`), then q and k, contiguous
    ``[capacity, H, D]``.

    Raises:
      BackendUnavailable: a JAX without the Mosaic GPU API, or whose lowered form this
        does not recognise.
    """
    kernel = _built(mosaic_gpu.build, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
                    itemsize=jnp.dtype(dtype).itemsize, rotary_dim=rotary_dim, interleave=interleave,
                    attention_factor=attention_factor, mrope_section=mrope_section,
                    mrope_interleaved=mrope_interleaved, grid=grid, splits=splits,
                    min_count=min_count, max_count=max_count)
    view = (head_dim // 2, 2) if interleave else (head_dim,)

    def call(count, pos_ids, tables, rows, q, k):
        q_ref, k_ref = jax.new_ref(q), jax.new_ref(k)
        kernel(count, pos_ids, tables, rows, q_ref, k_ref)
        return jax.freeze(q_ref), jax.freeze(k_ref)

    half = rotary_dim // 2
    rows_of_pos = 1 if mrope_section is None else 3
    specs = (jax.ShapeDtypeStruct((1,), jnp.int32),
             jax.ShapeDtypeStruct((rows_of_pos * capacity,), jnp.int32),
             jax.ShapeDtypeStruct((3, half), jnp.float32),
             jax.ShapeDtypeStruct((half,), jnp.int32),
             jax.ShapeDtypeStruct((capacity, q_heads, *view), dtype),
             jax.ShapeDtypeStruct((capacity, k_heads, *view), dtype))
    module, results = _lower(call, specs, (4, 5))
    return MosaicModule(module, capacity, grid, results)


# Operand order of the exported fused RoPE + KV append; results: q, then the caches.
APPEND_OPERANDS = ("count", "pos_ids", "slots", "tables", "rows", "scales", "q", "k", "v",
                   "*caches")


def export_append(*, q_heads: int, k_heads: int, head_dim: int, dtype, cache_dtype,
                  rows, components: int, rotary_dim: int, interleave: bool,
                  attention_factor: float, capacity: int, grid: int,
                  max_count: Optional[int] = None,
                  mrope_section: Optional[Tuple[int, int, int]] = None,
                  mrope_interleaved: bool = False) -> MosaicModule:
    """The fused RoPE + paged KV append kernel (:func:`jaxrope.kernels.kv_mosaic.build_append`)
    for one head layout, cache geometry (``rows``, a
    :class:`jaxrope.kernels.kv_layout.CacheRows`; ``components`` cache arrays: 2 for a
    ``(k, v)`` pair, 1 for one array holding both) and launch shape, as a Mosaic module
    reading the token count at run time; ``max_count`` bounds the counts it will see
    (with a block of ``grid`` for every token of it, no block walks).

    Operands (:data:`APPEND_OPERANDS`): ``count`` int32 ``[1]``, ``pos_ids`` as
    :func:`export`'s, ``slots`` int32 ``[capacity]``, ``tables``, ``rows``
    (:func:`jaxrope.kernels.mosaic_gpu.slot_row_table`), ``scales`` float32 ``[2]``, q,
    k, v contiguous ``[capacity, H, D]``, then each cache array (contiguous, any shape
    holding ``rows``' rows of ``D``).

    Raises:
      BackendUnavailable: as :func:`export`.
    """
    from jaxrope.kernels import kv_mosaic
    from jaxrope.kernels.kv_reference import FP8
    kernel = _built(kv_mosaic.build_append, q_heads=q_heads, k_heads=k_heads,
                    head_dim=head_dim, itemsize=jnp.dtype(dtype).itemsize,
                    rotary_dim=rotary_dim, interleave=interleave,
                    attention_factor=attention_factor, rows=rows,
                    quantize=jnp.dtype(cache_dtype) == FP8, mrope_section=mrope_section,
                    mrope_interleaved=mrope_interleaved, grid=grid, max_count=max_count)
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
    module, results = _lower(call, specs, (6, *range(9, 9 + components)))
    return MosaicModule(module, capacity, grid, results)
