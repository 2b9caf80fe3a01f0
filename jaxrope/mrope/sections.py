"""Which row of M-RoPE positions ``[3, T]`` each frequency pair reads, on the host.

A float64 rotation outside the kernels (the demo's recomputation, the tests' oracle)
gathers each pair's position with :func:`mrope_rows`; the kernels build the same
choice as masks (:func:`jaxrope.ops.angle.slot_rows`), a separate implementation
the tests compare with this one.

Example:
  >>> mrope_rows((2, 1, 1), mrope_interleaved=False).tolist()
  [0, 0, 1, 2]
  >>> mrope_rows((2, 1, 1), mrope_interleaved=True).tolist()
  [0, 1, 2, 0]
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["mrope_rows"]


def mrope_rows(mrope_section: Sequence[int], mrope_interleaved: bool) -> np.ndarray:
    """int ``[R/2]``: the row (0 = t, 1 = h, 2 = w) each frequency pair takes its position from.

    Sectioned: ``s_t`` zeros, ``s_h`` ones, ``s_w`` twos. Interleaved (Qwen3-VL): pair ``j``
    is h when ``j % 3 == 1`` and ``j < 3 s_h``, w when ``j % 3 == 2`` and ``j < 3 s_w``, else t.
    """
    s_t, s_h, s_w = mrope_section
    if not mrope_interleaved:
        return np.repeat([0, 1, 2], [s_t, s_h, s_w])
    j = np.arange(s_t + s_h + s_w)
    rows = np.zeros_like(j)
    rows[(j % 3 == 1) & (j < 3 * s_h)] = 1
    rows[(j % 3 == 2) & (j < 3 * s_w)] = 2
    return rows
