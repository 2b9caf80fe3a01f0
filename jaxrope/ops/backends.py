"""Which kernel runs an op: the backend names, the one implementations table, and the rule
that picks a backend for a device.

Every RoPE implementation has the signature of
:func:`jaxrope.ops.rope.reference.rope_reference`, every fused RoPE + KV-append one that
of :func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`, every MLA
one that of :func:`jaxrope.ops.mla_rope_append.reference.mla_rope_append_reference`. Adding a
backend means one entry per op it implements in :data:`IMPLEMENTATIONS` and, if it should
win somewhere, one line in :func:`backend_name`; adding an op, one row.

``BACKENDS`` is the tuple of names ``backend=`` accepts:

- "auto": Mosaic GPU on a CUDA GPU of compute capability 9.0 or newer (Hopper) with a JAX
  whose Mosaic GPU lowers every layout
  (:func:`jaxrope.ops.mosaic_common.lowering_unavailable`), for every op; the
  Triton-lowered Pallas kernel on other GPUs; XLA elsewhere. When the kernel it picks
  declines a call (:class:`jaxrope.BackendUnavailable` or ``NotImplementedError``, e.g.
  an fp8 cache the Triton lowering cannot address), the call falls through to XLA
  (:func:`candidates`);
- "mosaic": the Mosaic GPU kernels (:mod:`jaxrope.ops.rope.mosaic`,
  :mod:`jaxrope.ops.rope_append_kv.mosaic`; CUDA, Hopper+);
- "triton": the Pallas kernels lowered through Triton (:mod:`jaxrope.ops.rope.triton`,
  :mod:`jaxrope.ops.rope_append_kv.triton`), on any GPU Pallas's Triton backend runs on.
  JAX 0.11 deprecated that backend (``jax-pallas-triton``): its compile warns, and it
  stops when JAX removes it, so "auto" takes it only where Mosaic GPU cannot run;
- "xla": the reference implementation, any platform;
- "interpret": the Triton-lowered kernel body run by the Pallas interpreter (CPU tests).

Example:
  >>> import jaxrope as jr
  >>> jr.BACKENDS
  ('auto', 'mosaic', 'triton', 'xla', 'interpret')
  >>> resolve("auto", "cpu") is resolve("xla", "cpu")
  True
  >>> backend_name("auto", "cuda", compute_capability="8.0"), candidates("auto", "rocm")
  ('triton', ('triton', 'xla'))
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import jax

from jaxrope.errors import BackendUnavailable
from jaxrope.ops import mosaic_common
from jaxrope.ops.mla_rope_append.mosaic import mla_rope_append_mosaic
from jaxrope.ops.mla_rope_append.reference import mla_rope_append_reference
from jaxrope.ops.mla_rope_append.triton import mla_rope_append_triton
from jaxrope.ops.rope.mosaic import rope_mosaic
from jaxrope.ops.rope.reference import rope_reference
from jaxrope.ops.rope.triton import rope_triton
from jaxrope.ops.rope_append_kv.mosaic import rope_append_kv_mosaic
from jaxrope.ops.rope_append_kv.reference import rope_append_kv_reference
from jaxrope.ops.rope_append_kv.triton import rope_append_kv_triton

BACKENDS = ("auto", "mosaic", "triton", "xla", "interpret")

# The first compute capability with the instructions Mosaic GPU emits (sm_90, Hopper).
MOSAIC_MIN_CAPABILITY = 9

# op -> backend -> implementation.
IMPLEMENTATIONS = {
    "rope": {
        "xla": rope_reference,
        "triton": rope_triton,
        "interpret": functools.partial(rope_triton, interpret=True),
        "mosaic": rope_mosaic,
    },
    "rope_append_kv": {
        "xla": rope_append_kv_reference,
        "triton": rope_append_kv_triton,
        "interpret": functools.partial(rope_append_kv_triton, interpret=True),
        "mosaic": rope_append_kv_mosaic,
    },
    "mla_rope_append": {
        "xla": mla_rope_append_reference,
        "triton": mla_rope_append_triton,
        "interpret": functools.partial(mla_rope_append_triton, interpret=True),
        "mosaic": mla_rope_append_mosaic,
    },
}

_GPU = ("gpu", "cuda", "rocm")


def device_capability(device) -> Optional[str]:
    """A JAX device's CUDA compute capability ("9.0"), or None where it has none."""
    return getattr(device, "compute_capability", None)


def device_of(x) -> jax.Device:
    """The device array ``x`` lives on; under ``jit`` (a tracer) the default device, where
    the call runs."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return jax.devices()[0]
    return next(iter(x.devices()))


def _mosaic_runs(platform: str, compute_capability: Optional[str]) -> bool:
    if platform not in ("gpu", "cuda") or compute_capability is None:
        return False
    return (int(str(compute_capability).split(".")[0]) >= MOSAIC_MIN_CAPABILITY
            and mosaic_common.lowering_unavailable() is None)


def backend_name(backend: str, platform: str, op: str = "rope",
                 compute_capability: Optional[str] = None) -> str:
    """The backend ``backend`` means for ``op`` on ``platform``: "auto" decided, and checked
    to run there.

    ``platform``: "cpu", "gpu", "cuda", "rocm", ...; ``compute_capability``: the CUDA
    device's ("9.0"; :func:`device_capability`), None when unknown (then "auto" does not
    take Mosaic GPU).

    Raises:
      ValueError: unknown backend name.
      BackendUnavailable: "triton" off GPU, "mosaic" off CUDA, or a backend without a
        kernel for ``op``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS} (the Pallas kernels "
                         "are 'triton' and 'mosaic')")
    implementations = IMPLEMENTATIONS[op]
    if backend == "auto":
        if platform not in _GPU:
            return "xla"
        if "mosaic" in implementations and _mosaic_runs(platform, compute_capability):
            return "mosaic"
        # An op without a Triton-lowered kernel runs on XLA there.
        return "triton" if "triton" in implementations else "xla"
    if backend == "triton" and platform not in _GPU:
        raise BackendUnavailable(
            f"backend='triton' needs a GPU, the arrays are on {platform!r}; use "
            "'interpret' to run the same kernel body on CPU, or 'xla'")
    if backend == "mosaic" and platform not in ("gpu", "cuda"):
        raise BackendUnavailable(
            f"backend='mosaic' needs a CUDA GPU (Hopper or newer), the arrays are on "
            f"{platform!r}")
    if backend not in implementations:
        raise BackendUnavailable(f"backend={backend!r} has no {op} kernel; use one of "
                                 f"{('auto', *implementations)}")
    return backend


def candidates(backend: str, platform: str, op: str = "rope",
               compute_capability: Optional[str] = None) -> Tuple[str, ...]:
    """The backends a call of ``op`` tries, in order: :func:`backend_name`'s, then for
    "auto" XLA when that one declines.

    Raises:
      ValueError, BackendUnavailable: as :func:`backend_name`.
    """
    name = backend_name(backend, platform, op, compute_capability)
    return (name, "xla") if backend == "auto" and name != "xla" else (name,)


def resolve(backend: str, platform: str, op: str = "rope",
            compute_capability: Optional[str] = None) -> Callable:
    """The implementation of ``op`` for ``backend`` on ``platform`` (:func:`backend_name`).

    ``op`` is "rope" (:func:`jaxrope.apply_rope`), "rope_append_kv"
    (:func:`jaxrope.apply_rope_and_append_kv`) or "mla_rope_append"
    (:func:`jaxrope.apply_mla_rope_and_append`).

    Raises:
      ValueError, BackendUnavailable: as :func:`backend_name`.

    Example:
      >>> resolve("xla", "cpu").__name__
      'rope_reference'
    """
    return IMPLEMENTATIONS[op][backend_name(backend, platform, op, compute_capability)]


def run(backend: str, op: str, x, call: Callable[[Callable], object]):
    """``call(implementation)`` for the first of :func:`candidates` (for the device of
    array ``x``) that does not decline with :class:`jaxrope.BackendUnavailable` or
    ``NotImplementedError``; the last one's refusal is raised.

    Raises:
      ValueError, BackendUnavailable: as :func:`backend_name`, or as the last candidate.
      NotImplementedError: as the last candidate.
    """
    device = device_of(x)
    names = candidates(backend, device.platform, op, device_capability(device))
    for name in names[:-1]:
        try:
            return call(IMPLEMENTATIONS[op][name])
        except (BackendUnavailable, NotImplementedError):
            continue
    return call(IMPLEMENTATIONS[op][names[-1]])
