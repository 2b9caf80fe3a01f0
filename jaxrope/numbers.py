"""Python numbers from user input: one rule for every integer and float scalar argument.

An integer argument (a config field, a count, a span, an advance, a step, a row, a
position, a delta, a slot, an epoch) is accepted as a Python ``int``, a numpy integer
scalar of any width, or a 0-d integer array (numpy, a concrete JAX array, a torch
tensor: whatever ``int()`` reads exactly), and normalised to a Python ``int``, so that
equal values hash, compare and fingerprint alike whatever type they came in. ``bool``
(and ``np.bool_``, a bool tensor) and floats are refused with ``TypeError`` even where
they equal an int (``True == 1``, ``1.0 == 1``): a flag or a fraction passed as a count
is a bug at the caller. :func:`as_int` checks the range with the Python int, before any
cast to a fixed width, so ``2**32 + 1`` is refused instead of wrapping to 1. A sum
that could pass a width (``counter + advance``) is checked with :func:`check_sum`
before it is formed. Messages name the argument: ``name=value must be ...``.

Example:
  >>> import numpy as np
  >>> as_int(np.int64(128), "head_dim"), as_float(np.float32(0.5), "factor")
  (128, 0.5)
  >>> as_int(128.0, "head_dim")
  Traceback (most recent call last):
  ...
  TypeError: head_dim=128.0 must be an int (Python or numpy integer), got float
  >>> as_int(2**32 + 1, "drafts", 0, INT32_MAX)
  Traceback (most recent call last):
  ...
  ValueError: drafts=4294967297 must be an int in [0, 2147483647]
  >>> check_sum("advance", 5, "counter", INT32_MAX - 2, INT32_MAX)
  Traceback (most recent call last):
  ...
  ValueError: advance=5 would carry counter from 2147483645 to 2147483650, past 2147483647
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np

__all__ = ["FLOAT32_MAX", "FLOAT32_TINY", "INT32_MAX", "INT64_MAX", "PLAIN_INTS", "UINT32_MAX",
           "as_float", "as_int", "check_float32_positive", "check_sum", "is_plain_int"]

INT32_MAX = 2 ** 31 - 1
INT64_MAX = 2 ** 63 - 1
UINT32_MAX = 2 ** 32 - 1
# Types whose equal values give equal results: a cache keyed by a value may trust these
# (``True == 1`` and ``1.0 == 1`` hash alike, so a cache must not trust every type).
PLAIN_INTS = frozenset({int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                         np.uint32, np.uint64, np.intc, np.uintc, np.longlong, np.ulonglong})


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _dtype_kind(dtype: Any) -> str:
    """numpy's kind letter of a numpy, JAX or torch dtype ('?' for one numpy lacks)."""
    try:
        return np.dtype(str(dtype).removeprefix("torch.")).kind
    except TypeError:
        return "?"


def is_plain_int(value: Any) -> bool:
    """Whether ``value``'s type is a Python or numpy integer (not bool): where equality
    with another plain int means the same argument."""
    return type(value) in PLAIN_INTS


def as_int(value: Any, name: str, low: Optional[int] = None, high: Optional[int] = None,
           why: str = "") -> int:
    """``value`` as a Python int in ``[low, high]`` (None: unbounded on that side).

    Args:
      value: a Python or numpy integer, or a 0-d integer array or tensor.
      name: the argument's name, as the caller spells it (``step.advance``).
      low, high: the inclusive range, compared before any fixed-width cast.
      why: appended to the range message (e.g. ``" (max_seq_len)"``).

    Raises:
      TypeError: a bool, a float, a string, a non-0-d array, an array of another dtype.
      ValueError: outside ``[low, high]``.
    """
    if type(value) is int:
        result = value
    elif isinstance(value, np.integer):
        result = int(value)
    elif (not _is_bool(value) and not isinstance(value, numbers.Number)
          and getattr(value, "ndim", None) == 0 and _dtype_kind(getattr(value, "dtype", None)) in "iu"):
        try:
            result = int(value)
        except Exception as e:  # a traced JAX value: no concrete int to check
            raise TypeError(f"{name}={value!r} must be a concrete int, got {type(value).__name__}"
                            ) from e
    elif isinstance(value, int) and not _is_bool(value):  # an int subclass (an IntEnum)
        result = int(value)
    else:
        raise TypeError(f"{name}={value!r} must be an int (Python or numpy integer), "
                        f"got {type(value).__name__}")
    if (low is not None and result < low) or (high is not None and result > high):
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name}={result!r} must be an int in [{lo}, {hi}]{why}")
    return result


def check_sum(name: str, value: int, base_name: str, base: int, high: int) -> None:
    """Refuse ``base + value`` past ``high`` before anything forms it at a fixed width.

    Raises:
      ValueError: naming ``name``, its value, the base it would carry and the limit.
    """
    if base + value > high:
        raise ValueError(f"{name}={value} would carry {base_name} from {base} to "
                         f"{base + value}, past {high}")


def as_float(value: Any, name: str) -> float:
    """``value`` as a finite Python float; TypeError unless it is a (numpy) real number.

    Raises:
      TypeError: not an int or float (bools and strings included).
      ValueError: NaN or infinite.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number (int or float), "
                        f"got {type(value).__name__}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return result


# The normal float32 range, as Python floats: the check below is plain comparisons, which
# torch.compile traces where a scale is checked inside a compiled layer.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_float32_positive(name: str, value: float, why: str = "") -> None:
    """Refuse a scalar a kernel reads as float32 (an fp8 scale, a norm's eps) unless it is
    finite, > 0 and inside the normal float32 range: checking ``> 0`` alone would pass
    ``1e-46`` (0 as a float32), ``1e39`` (inf) and subnormals (0 where a GPU flushes them).

    Raises:
      ValueError: ``name=value must be finite and > 0 ...``, ``why`` appended.
    """
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be finite and > 0{why}")
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        raise ValueError(f"{name}={value!r} must be finite and > 0 as the float32 the kernels "
                         f"read: in [{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}]{why}")
