"""The one error that means "this path cannot run here; try the next one".

Backends are tried in order (the Pallas kernel, the torch-side launch of its Triton IR,
the JAX path): each raises :class:`BackendUnavailable` to decline, and whoever picks
between them catches exactly this type. Any other exception is a real failure and
propagates.
"""

from __future__ import annotations

__all__ = ["BackendUnavailable"]


class BackendUnavailable(NotImplementedError):
    """This backend cannot run this call here (no GPU, no Triton, an unsupported layout,
    a JAX whose private lowering API moved); the caller falls back to the next one.

    A ``NotImplementedError``: valid input that this path does not cover.

    Example:
      >>> import jaxrope as jr
      >>> issubclass(jr.BackendUnavailable, NotImplementedError)
      True
    """
