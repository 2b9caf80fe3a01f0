"""Whether two tensors have an element at a common address: the check that keeps a
``(k_cache, v_cache)`` pair (or MLA's ``(ckv_cache, kpe_cache)``) from being one buffer
twice, exact for the interleaved views engines pass (vLLM's ``kv[:, 0]`` and ``kv[:, 1]``).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import torch

__all__ = ["share_memory"]


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """The bytes ``[start, end)`` from ``t``'s first element to past its last one."""
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def _reaches(delta: int, dims: Sequence[Tuple[int, int]], budget: list) -> bool:
    """Whether ``delta == sum(j * stride)`` for some ``|j| < n`` over ``dims`` ((stride, n),
    largest stride first): two views of one layout ``delta`` elements apart then share one.

    At each stride the rest can reach at most ``sum((n - 1) * stride)`` of the smaller
    strides, so only the few ``j`` that leave at most that much are tried (two for a
    layout without internal overlap). ``budget`` caps the search: past it, assume they
    share (refusing is the safe side).
    """
    if not dims:
        return delta == 0
    budget[0] -= 1
    if budget[0] < 0:
        return True
    (stride, n), rest = dims[0], dims[1:]
    reach = sum((m - 1) * s for s, m in rest)
    low, high = max(-(n - 1), -((reach - delta) // stride)), min(n - 1, (delta + reach) // stride)
    return any(_reaches(delta - j * stride, rest, budget) for j in range(low, high + 1))


def share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (one dtype) have an element at a common address.

    Exact for two views of one layout (same shape and strides, e.g. vLLM's ``kv[:, 0]``
    and ``kv[:, 1]`` of a ``[pages, 2, ...]`` cache, which interleave without sharing);
    other pairs share when their byte spans overlap.

    Example:
      >>> kv = torch.zeros(4, 2, 16, 2, 8)
      >>> share_memory(kv[:, 0], kv[:, 1]), share_memory(kv[:, 0], kv[:, 0]), share_memory(kv, kv[1:])
      (False, True, True)
    """
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    delta, misaligned = divmod(abs(b0 - a0), a.element_size())
    if a.shape != b.shape or a.stride() != b.stride() or misaligned:
        return True
    dims = sorted(((s, n) for s, n in zip(a.stride(), a.shape) if n > 1 and s), reverse=True)
    return _reaches(delta, dims, [10_000])
