"""Export the Mosaic GPU RoPE kernel as a Mosaic module, for launching outside JAX dispatch.

A PyTorch engine calling RoPE through JAX pays for a DLPack import and a jitted call per
layer, many times the kernel's own time. JAX lowers a ``plgpu.kernel`` to one
``mosaic_gpu_v2`` custom call whose backend config carries the kernel's Mosaic module as
MLIR bytecode; the CUDA plugin's ``MosaicGpuCompile`` turns that into a host launch
function (what ``jax.experimental.pallas.mosaic_gpu.as_torch_kernel`` does once per call,
on torch's default stream). :func:`export` lowers the kernel built with a run-time token
count (:func:`jaxrope.ops.rope.mosaic.build` with ``count=None``) for CUDA, which needs no
GPU, and returns that module (:func:`jaxrope.ops.mosaic_common.export_module`);
``torch_bridge.launch.mosaic`` compiles it once and launches it on torch's current stream.
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from jaxrope.ops.mosaic_common import MosaicModule, built_for_launch, export_module
from jaxrope.ops.rope import mosaic
from jaxrope.ops.rope.tuning import MosaicTuning

# Operand order of the exported kernel; the launch passes one pointer per operand, then
# one per result (the in-place q and k again).
OPERANDS = ("count", "pos_ids", "tables", "rows", "q", "k")


def export(*, q_heads: int, k_heads: int, head_dim: int, dtype, rotary_dim: int,
           interleave: bool, attention_factor: float, tuning: MosaicTuning, capacity: int,
           grid: int, splits: int = 1, min_count: int = 1, max_count: Optional[int] = None,
           mrope_section: Optional[Tuple[int, int, int]] = None,
           mrope_interleaved: bool = False) -> MosaicModule:
    """The kernel for one head layout, dtype and launch shape (``capacity`` tokens, ``grid``
    blocks) as a Mosaic module; the token count is read at run time, so one export serves
    every T up to ``capacity``, within ``[min_count, max_count]`` when they are given
    (:func:`jaxrope.ops.rope.mosaic.build`: the bounds leave out the path for counts
    under a block and, when ``grid`` has a block for every item, the walk). ``tuning``:
    the kernel's split (:func:`jaxrope.ops.rope.tuning.mosaic_tuning`); ``splits``: blocks
    sharing a token block's heads (:func:`jaxrope.ops.rope.tuning.head_splits`).

    Operands (:data:`OPERANDS`): ``count`` int32 ``[1]``, ``pos_ids`` int32 ``[capacity]``
    (M-RoPE: ``[3 * capacity]``, row ``r`` of token ``t`` at ``r * count + t``),
    ``tables`` float32 ``[3, R/2]``, ``rows`` int32 ``[R/2]``
    (:func:`jaxrope.ops.mosaic_common.slot_row_table`), then q and k, contiguous
    ``[capacity, H, D]``.

    Raises:
      BackendUnavailable: a JAX without the Mosaic GPU API, or whose lowered form this
        does not recognise.
    """
    kernel = built_for_launch(
        mosaic.build, q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
        itemsize=jnp.dtype(dtype).itemsize, rotary_dim=rotary_dim, interleave=interleave,
        attention_factor=attention_factor, mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved, grid=grid, splits=splits, min_count=min_count,
        max_count=max_count, tuning=tuning)
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
    return export_module(call, specs, (4, 5), capacity, grid)
