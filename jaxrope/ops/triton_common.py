"""What the Triton-lowered kernels share: block extents, the small-T rule of their launch
shapes, the GPU's approximate sine and cosine, one token's angle, and the capture of a kernel's Triton IR
for a launch outside JAX.

The capture relies on private JAX API (``jax._src.pallas.triton``), checked against JAX
0.11.2 and 0.10.2: ``pallas_call_registration`` calls
``lowering.lower_jaxpr_to_triton_module(...)``, whose result has ``.module`` (an MLIR
module) and ``.grid``. Everything private is touched here and nowhere else; any failure
raises :class:`jaxrope.BackendUnavailable` and callers fall back to the JAX path.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, List, Optional, Tuple, TypeVar

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jaxrope.errors import BackendUnavailable
from jaxrope.ops.angle import cos_sin

_Tuning = TypeVar("_Tuning")   # a kernel's launch-shape dataclass (shrink_to_fill)
_CAPTURE_LOCK = threading.Lock()


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``): a Triton block's extent."""
    return 1 << max(0, (n - 1).bit_length())


def lanes_for(rotary_dim: int) -> int:
    """Width of a half-block: ``rotary_dim // 2`` rounded up to a power of two."""
    return next_pow2(rotary_dim // 2)


def lane_tables(tables: jax.Array, rotary_dim: int) -> Tuple[int, jax.Array]:
    """``(lanes, tables)``: :func:`lanes_for` and the angle tables ``[3, rotary_dim // 2]``
    zero-padded to that many columns (the kernels load whole lane blocks)."""
    lanes = lanes_for(rotary_dim)
    return lanes, jnp.pad(tables, ((0, 0), (0, lanes - tables.shape[1])))


def shrink_to_fill(tuning: _Tuning, programs: Callable[[_Tuning], int],
                   min_programs: int) -> _Tuning:
    """``tuning`` with its token walk, then its groups, then its heads per program halved
    until ``programs(tuning)`` reaches ``min_programs`` (small T, decode: a grid too
    small to fill the GPU) or each is 1. The small-T rule of both kernels' launch shapes."""
    for field in ("token_loop", "groups_per_program", "heads_per_program"):
        while getattr(tuning, field) > 1 and programs(tuning) < min_programs:
            tuning = dataclasses.replace(tuning, **{field: getattr(tuning, field) // 2})
    return tuning


def sin_cos_approx(angle):
    """``(sin, cos)`` of float32 ``angle`` by the GPU's approximate instructions
    (``sin.approx.f32``): the angle is already reduced to ``[-pi, pi]``, where their
    absolute error (~1e-6) is below what a bf16 or fp16 output shows and near float32
    rounding of the products. Both Triton-lowered kernels pass it to the angle."""
    return tuple(plgpu.elementwise_inline_asm(
        f"{op}.approx.f32 $0, $1;", args=[angle], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(angle.shape, jnp.float32)])[0]
        for op in ("sin", "cos"))


def token_angle(pos_ref, t, count, turns, attention_factor: float, *,
                mrope_section: Optional[Tuple[int, int, int]], mrope_interleaved: bool,
                approx_trig: bool):
    """``(cos, sin)`` as ``[1, R/2]`` float32 rows for token ``t`` of a kernel that walks one
    token at a time (the fused appends): its position read as a scalar (M-RoPE: its three
    rows of the flattened ``[3, count]`` positions, row ``r`` at ``r * count + t``) and the
    angle every backend shares (:func:`jaxrope.ops.angle.cos_sin`), so M-RoPE changes only
    this function."""
    if mrope_section is None:
        pos = plgpu.load(pos_ref.at[t])
    else:
        pos = tuple(plgpu.load(pos_ref.at[row * count + t]) for row in range(3))
    trig = {"sin_cos": sin_cos_approx} if approx_trig else {}
    cos, sin = cos_sin(pos, *turns, attention_factor, mrope_section=mrope_section,
                       mrope_interleaved=mrope_interleaved, **trig)
    return cos[None, :], sin[None, :]


def capture(fn, *specs) -> List[str]:
    """The Triton IR text of each Pallas kernel in ``jax.jit(fn)`` lowered for CUDA on ``specs``.

    Raises:
      BackendUnavailable: no GPU target (off a GPU, JAX 0.11 needs an abstract one:
        :func:`jaxrope.testing.lowering.cuda_target`), or JAX's private lowering API
        changed.
    """
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
    except ImportError as e:  # pragma: no cover - depends on the installed JAX
        raise BackendUnavailable(f"JAX {jax.__version__} has no Pallas Triton lowering: {e}") from e
    lowering = getattr(registration, "lowering", None)
    original = getattr(lowering, "lower_jaxpr_to_triton_module", None)
    if original is None:
        raise BackendUnavailable(f"JAX {jax.__version__}: Pallas Triton lowering entry point moved")
    captured = []

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    with _CAPTURE_LOCK:
        lowering.lower_jaxpr_to_triton_module = spy
        try:
            # A fresh closure per capture: jit's caches must not skip the lowering.
            jax.jit(lambda *a: fn(*a)).trace(*specs).lower(lowering_platforms=("cuda",))
        except Exception as e:
            raise BackendUnavailable(f"lowering the Pallas kernel failed: {e}") from e
        finally:
            lowering.lower_jaxpr_to_triton_module = original
    return captured


def capture_one(fn, *specs) -> str:
    """The Triton IR of the one Pallas kernel in ``jax.jit(fn)`` (:func:`capture`).

    Raises:
      BackendUnavailable: as :func:`capture`, or not exactly one kernel captured.
    """
    captured = capture(fn, *specs)
    if len(captured) != 1:
        raise BackendUnavailable(f"expected one Triton module, captured {len(captured)}")
    return captured[0]
