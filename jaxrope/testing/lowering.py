"""Lowering Pallas Triton kernels for a CUDA GPU on a machine without one (CPU tests).

``jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))`` runs the Pallas Triton
lowering, which needs the target GPU's compute capability. JAX 0.10 falls back to sm_90
when no GPU is present; JAX 0.11 asks for an abstract device instead
(``jax.sharding.use_abstract_mesh`` with an ``AbstractDevice``), which 0.10 accepts and
ignores. :func:`cuda_target` gives both an H200.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List

import jax

from jaxrope.ops.triton_common import capture


@contextlib.contextmanager
def cuda_target(device_kind: str = "NVIDIA H200", num_cores: int = 132):
    """Lowerings inside target ``device_kind`` (Pallas reads its compute capability)."""
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                         platform="gpu")
    with jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)):
        yield


def triton_modules(fn: Callable, *specs) -> List[str]:
    """The Triton IR text of every Pallas kernel in ``jax.jit(fn)``, lowered for an H200."""
    with cuda_target():
        return capture(fn, *specs)
