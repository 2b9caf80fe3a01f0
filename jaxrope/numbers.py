"""Python numbers from user input: one rule for every config field.

Config fields accept Python ``int`` / ``float`` and numpy integer / floating scalars
(what ``np.int64(128)`` or a value read from an array gives), normalised to Python
``int`` / ``float`` so that equal configs hash equal and fingerprint alike whatever
type the number came in. A value of the wrong type (a string, a bool, a float where
a count is expected) raises ``TypeError``; a number out of range raises
``ValueError``. Messages name the field as ``owner.name``.

Example:
  >>> import numpy as np
  >>> as_int(np.int64(128), "head_dim"), as_float(np.float32(0.5), "factor")
  (128, 0.5)
  >>> as_int(128.0, "head_dim")
  Traceback (most recent call last):
  ...
  TypeError: head_dim=128.0 must be an int (Python or numpy integer), got float
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["as_float", "as_int"]


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_int(value: Any, name: str) -> int:
    """``value`` as a Python int; TypeError unless it is a (numpy) integer, not a bool."""
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int (Python or numpy integer), "
                        f"got {type(value).__name__}")
    return int(value)


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
