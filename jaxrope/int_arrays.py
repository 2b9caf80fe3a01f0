"""Integer arrays from user input: one rule for every array argument of the transitions.

What an argument shows is checked where it shows it. Its type, rank and dtype are
static, so they are checked always, under ``jax.jit`` too; its values only where they
are concrete (outside ``jax.jit``), compared at their own width before any cast, so a
value that does not fit int32 is refused instead of wrapping. Python lists and tuples
of ints are accepted (numpy arrays then). Messages name the argument and the value:
``TypeError`` for what is no array, ``ValueError`` for a dtype (bool and float are no
integer dtype), a shape or a value, as :func:`jaxrope.apply_rope` does.

Example:
  >>> import numpy as np
  >>> values("counts", [3, 0, 2]).tolist()
  [3, 0, 2]
  >>> values("counts", np.array([1, 2**32], np.int64))
  Traceback (most recent call last):
  ...
  ValueError: counts[1]=4294967296 must lie in [0, 2147483647]
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import checks

__all__ = ["INT32", "IntArray", "NO_WRAP", "as_int32", "host", "in_range", "ints", "values"]

INT32 = np.iinfo(np.int32)
# Index keywords for `.at[...]`: a negative index is out of range (padding), not counted
# from the end as numpy-style wrapping would (-1 would be the last row).
NO_WRAP = {"wrap_negative_indices": False}
# What a caller may pass as an integer array: a JAX or numpy array, or a list / tuple of ints.
IntArray = Union[jax.Array, np.ndarray, Sequence[int]]


def host(x) -> Optional[np.ndarray]:
    """``x``'s values on the host, or None where they are not known (traced under jit)."""
    if isinstance(x, jax.core.Tracer) or not getattr(x, "is_fully_addressable", True):
        return None
    return np.asarray(x)


def ints(name: str, x, ndims: Tuple[int, ...] = (1,)) -> Union[np.ndarray, jax.Array]:
    """``x`` as a numpy or JAX integer array of ``ndims`` dims (a list becomes numpy)."""
    if isinstance(x, (list, tuple)):
        if any(isinstance(e, jax.core.Tracer) for e in x):  # a list traced under jit
            x = jnp.asarray(x)
        else:
            x = np.asarray(x) if len(x) else np.zeros((0,), np.int32)
    if not isinstance(x, (np.ndarray, jax.Array)):
        raise TypeError(f"{name} must be an integer array or a list of ints, "
                        f"not {type(x).__name__}")
    if not np.issubdtype(x.dtype, np.integer):  # bool is no np.integer
        raise ValueError(f"{name}.dtype={x.dtype} must be an integer dtype (int32)")
    if x.ndim not in ndims:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must have "
                         f"{' or '.join(map(str, ndims))} dims")
    return x


def in_range(name: str, x, low: int, high: int) -> None:
    """Concrete values of ``x`` lie in ``[low, high]``, compared at their own width."""
    if low <= INT32.min and high >= INT32.max and np.can_cast(x.dtype, np.int32):
        return  # every value of the dtype fits: no copy to the host
    found = host(x)
    if found is None:
        checks.in_range(name, x, low, high)  # traced: checked only inside jaxrope.checked
        return
    if not found.size:
        return
    bad = found > high
    if found.dtype.kind == "i":
        bad |= found < low
    if bad.any():
        at = np.unravel_index(np.flatnonzero(bad)[0], found.shape)
        raise ValueError(f"{name}[{', '.join(map(str, at))}]={found[at]} must lie in "
                         f"[{low}, {high}]")


def as_int32(x) -> jax.Array:
    """A checked integer array as int32 (nothing is cut: the range check came first)."""
    if isinstance(x, np.ndarray):
        return jnp.asarray(x.astype(np.int32))
    return x if x.dtype == jnp.int32 else x.astype(jnp.int32)


def values(name: str, x, low: int = 0, high: int = int(INT32.max),
           length: Optional[int] = None, along: str = "rows.shape"):
    """A ``[V]`` integer argument with values in ``[low, high]`` and, given ``length``,
    ``V == length`` (``along`` says whose length that is), as int32."""
    x = ints(name, x)
    if length is not None and x.shape[0] != length:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be ({length},), as {along}")
    in_range(name, x, low, high)
    return as_int32(x)
