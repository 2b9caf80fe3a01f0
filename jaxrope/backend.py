"""Which kernel runs RoPE: the one place that maps a backend name to an implementation.

Every implementation has the signature of
:func:`jaxrope.kernels.reference.rope_reference`. Adding a backend (e.g. Mosaic GPU)
means one entry in ``_IMPLEMENTATIONS`` and, if it should win on some platform, one
line in :func:`resolve`. In JAX 0.11.2 a Mosaic GPU kernel cannot reuse the Pallas
kernel body: ``pallas_call`` registers a lowering only for Triton's compiler params
(``pallas_core.register_lowering_rule(triton_core.CompilerParams, ...)``), so Mosaic GPU
means a ``plgpu.kernel`` of its own (:mod:`jaxrope.kernels.mosaic_gpu`).

``BACKENDS`` is the tuple of names ``apply_rope(..., backend=...)`` accepts: "auto"
(Pallas on GPU, XLA elsewhere), "pallas" (the Pallas kernel, GPU only), "xla" (the
reference implementation), "interpret" (the Pallas kernel body run by the Pallas
interpreter, for CPU tests) and "mosaic" (the Mosaic GPU kernel of
:mod:`jaxrope.kernels.mosaic_gpu`, CUDA only and not every layout, kept for measuring
against the Triton-lowered one).

Example:
  >>> import jaxrope as jr
  >>> jr.BACKENDS
  ('auto', 'pallas', 'xla', 'interpret', 'mosaic')
  >>> resolve("auto", "cpu") is resolve("xla", "cpu")
  True
"""

from __future__ import annotations

import functools
from typing import Callable

from jaxrope.errors import BackendUnavailable
from jaxrope.kernels import kv_pallas, kv_reference, mosaic_gpu, pallas_triton, reference

BACKENDS = ("auto", "pallas", "xla", "interpret", "mosaic")

_IMPLEMENTATIONS = {
    "xla": reference.rope_reference,
    "pallas": pallas_triton.rope_pallas,
    "interpret": functools.partial(pallas_triton.rope_pallas, interpret=True),
    "mosaic": mosaic_gpu.rope_mosaic,
}

# The fused RoPE + paged KV-cache append (jaxrope.kv_cache); signature of
# kv_reference.rope_append_kv_reference. No Mosaic GPU kernel yet.
_APPEND_KV_IMPLEMENTATIONS = {
    "xla": kv_reference.rope_append_kv_reference,
    "pallas": kv_pallas.rope_append_kv_pallas,
    "interpret": functools.partial(kv_pallas.rope_append_kv_pallas, interpret=True),
}

_OPS = {"rope": _IMPLEMENTATIONS, "rope_append_kv": _APPEND_KV_IMPLEMENTATIONS}


def resolve(backend: str, platform: str, op: str = "rope") -> Callable:
    """The implementation of ``op`` for ``backend`` on ``platform`` ("cpu", "gpu", "cuda", ...).

    "auto" is the Pallas kernel on GPU and XLA elsewhere. ``op`` is "rope"
    (:func:`jaxrope.apply_rope`) or "rope_append_kv"
    (:func:`jaxrope.apply_rope_and_append_kv`).

    Raises:
      ValueError: unknown backend name.
      BackendUnavailable: "pallas" on a platform without a Pallas GPU lowering,
        "mosaic" off CUDA, or a backend without a kernel for ``op``.

    Example:
      >>> resolve("xla", "cpu").__name__
      'rope_reference'
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")
    on_gpu = platform in ("gpu", "cuda", "rocm")
    if backend == "auto":
        backend = "pallas" if platform in ("gpu", "cuda") else "xla"
    if backend == "pallas" and not on_gpu:
        raise BackendUnavailable(
            f"backend='pallas' needs a GPU, the arrays are on {platform!r}; use 'interpret' to "
            "run the same kernel body on CPU, or 'xla'")
    if backend == "mosaic" and platform not in ("gpu", "cuda"):
        raise BackendUnavailable(
            f"backend='mosaic' needs a CUDA GPU (Hopper or newer), the arrays are on "
            f"{platform!r}")
    implementations = _OPS[op]
    if backend not in implementations:
        raise BackendUnavailable(f"backend={backend!r} has no {op} kernel; use one of "
                                 f"{('auto', *implementations)}")
    return implementations[backend]
