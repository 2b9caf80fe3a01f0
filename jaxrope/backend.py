"""Which kernel runs an op: the one place that maps a backend name to an implementation.

Every RoPE implementation has the signature of
:func:`jaxrope.kernels.reference.rope_reference`, every fused RoPE + KV-append one that
of :func:`jaxrope.kernels.kv_reference.rope_append_kv_reference`. Adding a backend means
one entry per op it implements and, if it should win somewhere, one line in
:func:`backend_name`.

``BACKENDS`` is the tuple of names ``backend=`` accepts:

- "auto": Mosaic GPU on a CUDA GPU of compute capability 9.0 or newer (Hopper) with a JAX
  whose Mosaic GPU lowers every layout (:func:`jaxrope.kernels.mosaic_gpu.lowering_unavailable`),
  for every op; the Triton-lowered Pallas kernel on other GPUs; XLA elsewhere;
- "mosaic": the Mosaic GPU kernels (:mod:`jaxrope.kernels.mosaic_gpu`,
  :mod:`jaxrope.kernels.kv_mosaic`; CUDA, Hopper+);
- "triton": the Pallas kernels lowered through Triton (:mod:`jaxrope.kernels.pallas_triton`,
  :mod:`jaxrope.kernels.kv_pallas`), on any GPU Pallas's Triton backend runs on. JAX 0.11
  deprecated that backend (``jax-pallas-triton``): its compile warns, and it stops when
  JAX removes it, so "auto" takes it only where Mosaic GPU cannot run;
- "pallas": another name for "triton", kept for the callers that chose it by that name;
- "xla": the reference implementation, any platform;
- "interpret": the Triton-lowered kernel body run by the Pallas interpreter (CPU tests).

Example:
  >>> import jaxrope as jr
  >>> jr.BACKENDS
  ('auto', 'mosaic', 'triton', 'pallas', 'xla', 'interpret')
  >>> resolve("auto", "cpu") is resolve("xla", "cpu")
  True
  >>> backend_name("auto", "cuda", compute_capability="8.0"), backend_name("pallas", "cuda")
  ('triton', 'triton')
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

from jaxrope.errors import BackendUnavailable
from jaxrope.kernels import kv_mosaic, kv_pallas, kv_reference, mosaic_gpu, pallas_triton, reference

BACKENDS = ("auto", "mosaic", "triton", "pallas", "xla", "interpret")

_ALIASES = {"pallas": "triton"}

# The first compute capability with the instructions Mosaic GPU emits (sm_90, Hopper).
MOSAIC_MIN_CAPABILITY = 9

_IMPLEMENTATIONS = {
    "xla": reference.rope_reference,
    "triton": pallas_triton.rope_pallas,
    "interpret": functools.partial(pallas_triton.rope_pallas, interpret=True),
    "mosaic": mosaic_gpu.rope_mosaic,
}

_APPEND_KV_IMPLEMENTATIONS = {
    "xla": kv_reference.rope_append_kv_reference,
    "triton": kv_pallas.rope_append_kv_pallas,
    "interpret": functools.partial(kv_pallas.rope_append_kv_pallas, interpret=True),
    "mosaic": kv_mosaic.rope_append_kv_mosaic,
}

_OPS = {"rope": _IMPLEMENTATIONS, "rope_append_kv": _APPEND_KV_IMPLEMENTATIONS}

_GPU = ("gpu", "cuda", "rocm")


def device_capability(device) -> Optional[str]:
    """A JAX device's CUDA compute capability ("9.0"), or None where it has none."""
    return getattr(device, "compute_capability", None)


def _mosaic_runs(platform: str, compute_capability: Optional[str]) -> bool:
    if platform not in ("gpu", "cuda") or compute_capability is None:
        return False
    return (int(str(compute_capability).split(".")[0]) >= MOSAIC_MIN_CAPABILITY
            and mosaic_gpu.lowering_unavailable() is None)


def backend_name(backend: str, platform: str, op: str = "rope",
                 compute_capability: Optional[str] = None) -> str:
    """The backend ``backend`` means for ``op`` on ``platform``: "auto" decided, aliases
    replaced, and checked to run there.

    ``platform``: "cpu", "gpu", "cuda", "rocm", ...; ``compute_capability``: the CUDA
    device's ("9.0"; :func:`device_capability`), None when unknown (then "auto" does not
    take Mosaic GPU).

    Raises:
      ValueError: unknown backend name.
      BackendUnavailable: "triton" / "pallas" off GPU, "mosaic" off CUDA, or a backend
        without a kernel for ``op``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    implementations = _OPS[op]
    if backend == "auto":
        if platform not in _GPU:
            return "xla"
        mosaic = "mosaic" in implementations and _mosaic_runs(platform, compute_capability)
        return "mosaic" if mosaic else "triton"
    backend = _ALIASES.get(backend, backend)
    if backend == "triton" and platform not in _GPU:
        raise BackendUnavailable(
            f"backend='triton' (or 'pallas') needs a GPU, the arrays are on {platform!r}; use "
            "'interpret' to run the same kernel body on CPU, or 'xla'")
    if backend == "mosaic" and platform not in ("gpu", "cuda"):
        raise BackendUnavailable(
            f"backend='mosaic' needs a CUDA GPU (Hopper or newer), the arrays are on "
            f"{platform!r}")
    if backend not in implementations:
        raise BackendUnavailable(f"backend={backend!r} has no {op} kernel; use one of "
                                 f"{('auto', *implementations)}")
    return backend


def resolve(backend: str, platform: str, op: str = "rope",
            compute_capability: Optional[str] = None) -> Callable:
    """The implementation of ``op`` for ``backend`` on ``platform`` (:func:`backend_name`).

    ``op`` is "rope" (:func:`jaxrope.apply_rope`) or "rope_append_kv"
    (:func:`jaxrope.apply_rope_and_append_kv`).

    Raises:
      ValueError, BackendUnavailable: as :func:`backend_name`.

    Example:
      >>> resolve("xla", "cpu").__name__
      'rope_reference'
    """
    return _OPS[op][backend_name(backend, platform, op, compute_capability)]
