"""What every Mosaic GPU kernel here shares: the JAX it needs, tiled register layouts,
plain loads and stores, the walk of a fixed grid over a run-time count of items, the
``plgpu.kernel`` with its compiler parameters, and the export of a built kernel as a
Mosaic module for a launch outside JAX.

The export reads JAX's lowered StableHLO (the ``mosaic_gpu_v2`` custom call and its
``mhlo.backend_config`` ``module`` entry, MLIR bytecode that the CUDA plugin's
``MosaicGpuCompile`` turns into a host launch function), checked against JAX 0.11.2 and
0.12. Everything of that is touched here; any failure raises
:class:`jaxrope.BackendUnavailable` and callers fall back to the JAX path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.angle import slot_rows


def unavailable() -> Optional[str]:
    """Why this JAX cannot build the kernel (it needs 0.11's Mosaic GPU API), or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # JAX 0.10 imports absl there
        return f"Mosaic GPU Pallas does not import with jax {jax.__version__}: {e}"
    # 0.10 has neither; its plgpu.load also takes a different signature.
    if not (hasattr(plgpu, "InterpretGPUParams") and hasattr(jax, "new_ref")):
        return (f"jax {jax.__version__} lacks the Mosaic GPU API this kernel uses "
                "(mutable refs, the GPU interpreter): JAX 0.11 or newer")
    return None


# The newest JAX minor version whose Mosaic GPU is known to lower every layout of the
# kernels here (tests/test_mosaic_interpret.py lowers every case on the CI's JAX
# versions). A newer minor may refuse layouts, as 0.12 refused the stores of many until
# :func:`store`.
LOWERS_UP_TO = (0, 12)


def lowering_unavailable() -> Optional[str]:
    """Why "auto" must not pick this kernel with this JAX (:func:`unavailable`, or a JAX
    newer than :data:`LOWERS_UP_TO`), or None."""
    reason = unavailable()
    if reason is None and tuple(int(p) for p in jax.__version__.split(".")[:2]) > LOWERS_UP_TO:
        reason = (f"jax {jax.__version__} is newer than the JAX versions this kernel's Mosaic "
                  f"GPU lowering is tested on (up to {'.'.join(map(str, LOWERS_UP_TO))}), "
                  "so 'auto' runs the Triton-lowered kernel here")
    return reason


def tiled(tiles, warp_dims, lane_dims):
    # Mosaic GPU accepts only canonical layouts (size-1 tiled dims dropped): build the
    # readable form, then canonicalize it.
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    return fa.TiledLayout(fa.Tiling(tiles), warp_dims=warp_dims, lane_dims=lane_dims,
                          vector_dim=-1, _check_canonical=False).canonicalize()


def as_pallas(layout):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.Layout.TILED(layout.tiling, warp_dims=layout.warp_dims,
                              lane_dims=layout.lane_dims, vector_dim=layout.vector_dim)


def broadcast(x, shape, dims, layout):
    """``x`` broadcast to ``shape`` (``dims`` as :func:`jax.lax.broadcast_in_dim`), cast
    to the register ``layout``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.layout_cast(jax.lax.broadcast_in_dim(x, shape, dims), as_pallas(layout))


def load(ref, layout):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    # "optimized" transfers plan SMEM bank conflicts; these read GMEM, or (the fused
    # append's shared angle) a few hundred bytes of SMEM whose conflicts cost nothing
    # measurable.
    return plgpu.load(ref, layout=as_pallas(layout), optimized=False)


def store(ref, value) -> None:
    """``ref[...] = value`` as a plain transfer, like :func:`load`'s.

    JAX 0.12's ``ref[...] =`` plans an "optimized" transfer and refuses, on GMEM, vectors
    under 4 bytes a thread or not covering whole 32-byte sectors and 128-byte lines, and on
    SMEM layouts it finds no bank-conflict-free order
    for, which the head groups of many layouts make; its ``plgpu.store(optimized=False)``
    skips that plan. JAX 0.11 has no ``plgpu.store`` and does not check.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=False)
    else:
        ref[...] = value


def floor(x):
    """``floor`` of float32 ``x``, which Mosaic GPU does not lower: a truncating int
    conversion, corrected below zero (the values floored stay below ``2**31``)."""
    t = x.astype(jnp.int32).astype(jnp.float32)  # truncates toward zero
    return jnp.where(t > x, t - 1.0, t)


def slot_row_table(half: int, mrope_section: Optional[Tuple[int, int, int]],
                   mrope_interleaved: bool) -> np.ndarray:
    """int32 ``[half]``: the positions row (0 t, 1 h, 2 w) each frequency slot reads; all
    zeros for 1-D RoPE (:func:`jaxrope.ops.angle.slot_rows`)."""
    if mrope_section is None:
        return np.zeros((half,), np.int32)
    with jax.ensure_compile_time_eval():
        is_h, is_w = slot_rows(half, mrope_section, mrope_interleaved)
        return np.asarray(jnp.where(is_w, 2, jnp.where(is_h, 1, 0)), np.int32)


def walks(grid: int, most_items: Optional[int]) -> bool:
    """Whether :func:`walk` loops a block over several items: unless ``most_items`` (the
    most items a launch has) is known and the grid covers them."""
    return most_items is None or most_items > grid


def walk(items, grid: int, one_item, most_items: Optional[int] = None) -> None:
    """Inside a kernel of ``grid`` blocks: block ``b`` calls ``one_item`` on items ``b, b +
    grid, ...`` below ``items`` (a run-time count: one compiled grid for any count).

    ``most_items``, the most items a launch has: when the grid covers them, block ``b``
    runs item ``b`` or exits, with no loop (nor its registers): walking was slower than a
    block an item in both kernels here (bench/RESULTS.md).
    """
    block = jax.lax.axis_index("block")
    if not walks(grid, most_items):
        pl.when(block < items)(functools.partial(one_item, block))
        return
    turns = jax.lax.div(items - block + (grid - 1), grid)

    def step(i, carry):
        one_item(block + i * grid)
        return carry
    jax.lax.fori_loop(0, turns, step, 0)


def kernel(body, grid: int, name: str, interpret: bool, warpgroups: int = 1,
           scratch=(), out_type=()):
    """The ``plgpu.kernel`` of a body over GMEM refs (the operands', then ``out_type``'s
    results', then the ``scratch`` types' refs), with the compiler parameters every
    kernel here uses; ``name`` is what profilers show.
    ``warpgroups`` > 1 runs that many warpgroups a block, ``jax.lax.axis_index
    ("warpgroup")`` telling them apart (both kernels here ran slower so, bench/RESULTS.md);
    not with ``scratch``, which the warpgroups would share while
    ``commit_smem`` orders one warpgroup's threads only."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if warpgroups > 1 and scratch:
        raise ValueError(f"warpgroups={warpgroups} with scratch {scratch}: one warpgroup a "
                         "block shares SMEM scratch safely, several do not")
    threads = dict(num_threads=warpgroups, thread_name="warpgroup") if warpgroups > 1 else {}
    return plgpu.kernel(
        body, out_type=out_type, scratch_types=scratch, grid=(grid,), grid_names=("block",),
        kernel_name=name, **threads,
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane,
            # The few reads of what another thread wrote (q's copies, the shared angle)
            # place their own commit_smem: a barrier after every store buys nothing.
            unsafe_no_auto_barriers=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None)


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


def built_for_launch(builder, **kwargs):
    """``builder(count=None, **kwargs)``: the kernel with a run-time count.

    Raises:
      BackendUnavailable: a JAX :func:`unavailable` names.
    """
    reason = unavailable()
    if reason:
        raise BackendUnavailable(reason)
    return builder(count=None, **kwargs)


def export_module(call, specs, donate, capacity: int, grid: int) -> MosaicModule:
    """``jax.jit(call)`` lowered for CUDA on ``specs`` (no GPU needed), ``donate`` the
    donated operands, as the :class:`MosaicModule` of its one Mosaic GPU call.

    Raises:
      BackendUnavailable: JAX's lowering or its IR API changed.
    """
    try:
        lowered = jax.jit(call, donate_argnums=donate).trace(*specs).lower(
            lowering_platforms=("cuda",))
        module, results = _module_bytes(lowered)
    except BackendUnavailable:
        raise
    except Exception as e:  # JAX's lowering or its IR API changed
        raise BackendUnavailable(f"exporting the Mosaic GPU kernel failed: "
                                 f"{type(e).__name__}: {e}") from e
    return MosaicModule(module, capacity, grid, results)
