"""How every paged-cache layout addresses a token's k and v: one stride rule for all of them.

In each layout a head's ``D`` values are contiguous, so a cache array is a matrix of
``[rows, D]`` and a layout is only where the row of (page, entry, head) of k and v lies.
A layout is the order of the array's axes (outermost first, ``D`` last and left out);
``kv`` is the k/v axis of one array holding both (size 2, keys at 0), and a pair of
axes in parentheses is one array axis of their product, the first one major:

============================  ======  =======================  ===================
layout                        arrays  axes                     read by
============================  ======  =======================  ===================
``"NHD"``                     (k, v)  page, entry, head        FlashInfer
``"NHD"``                     one     page, kv, entry, head    FlashInfer, vLLM
``"HND"``                     (k, v)  page, head, entry        FlashInfer
``"HND"``                     one     page, kv, head, entry    FlashInfer
``"paged_attention"``         (k, v)  head, page, entry        JAX's Pallas GPU op
``"ragged_paged_attention"``  one     page, entry, (head, kv)  JAX's Pallas TPU op
============================  ======  =======================  ===================

The strides follow from the axes row-major (:func:`cache_rows`): the row of head ``h``
of the token at entry ``e`` of page ``p`` is ``p * page_stride + e * entry_stride + h *
head_stride`` in the first array for k; v's row is in array ``value_array`` (1 for a
pair, 0 for one array), ``value_offset`` rows further. The ragged layout's ``[pages,
page_size, 2 * Hk, D]`` thus holds keys at even heads and values at odd ones
(``jax.experimental.pallas.ops.tpu.ragged_paged_attention``); ``paged_attention``'s
pages are ``[Hk, pages, page_size, D]`` each
(``jax.experimental.pallas.ops.gpu.paged_attention``).

Example:
  >>> from jaxrope.ops.rope_append_kv import cache_layout
  >>> cache_layout.describe("ragged_paged_attention", combined=True)
  '[pages, page_size, 2 * Hk, D]'
  >>> rows = cache_layout.cache_rows("ragged_paged_attention", True, num_pages=4, page_size=16,
  ...                             k_heads=2)
  >>> rows.row(1, 3, 1), rows.value_array, rows.value_offset   # (1 * 16 + 3) * 4 + 1 * 2
  (78, 0, 1)
  >>> cache_layout.cache_rows("paged_attention", False, 4, 16, 2).row(1, 3, 1)  # 1 * 64 + 16 + 3
  83
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional, Tuple, Union

Axes = Tuple[Union[str, Tuple[str, str]], ...]

# layout -> (axes of each array of a (k, v) pair, axes of one array holding both); None
# where the layout has no such form.
_AXES: Dict[str, Tuple[Optional[Axes], Optional[Axes]]] = {
    "NHD": (("page", "entry", "head"), ("page", "kv", "entry", "head")),
    "HND": (("page", "head", "entry"), ("page", "kv", "head", "entry")),
    "paged_attention": (("head", "page", "entry"), None),
    "ragged_paged_attention": (None, ("page", "entry", ("head", "kv"))),
}
LAYOUTS = tuple(_AXES)
_NAMES = {"page": "pages", "entry": "page_size", "head": "Hk", "kv": "2"}


@dataclasses.dataclass(frozen=True)
class CacheRows:
    """Where slots put k and v in caches seen as ``[rows, D]`` matrices (see the module doc).

    Hashable: a static argument of the kernels, fixed per engine.
    """

    num_pages: int
    page_size: int
    page_stride: int
    entry_stride: int
    head_stride: int
    value_array: int
    value_offset: int

    @property
    def num_slots(self) -> int:
        """``pages * page_size``: the valid slots are ``[0, num_slots)``."""
        return self.num_pages * self.page_size

    def row(self, page, entry, head):
        """The k row of ``head`` at ``entry`` of ``page`` (ints or integer arrays)."""
        return page * self.page_stride + entry * self.entry_stride + head * self.head_stride


def axes(layout: str, combined: bool) -> Optional[Axes]:
    """The axes of one cache array of ``layout`` (one array holding k and v when
    ``combined``), or None where the layout has no such form."""
    return _AXES[layout][1 if combined else 0]


def _flat(layout_axes: Axes):
    for axis in layout_axes:
        yield from (axis,) if isinstance(axis, str) else axis


def describe(layout: str, combined: bool) -> str:
    """The array shape in words, e.g. ``'[pages, 2, page_size, Hk, D]'``."""
    words = [_NAMES[a] if isinstance(a, str) else " * ".join(_NAMES[n] for n in reversed(a))
             for a in axes(layout, combined)]
    return f"[{', '.join(words + ['D'])}]"


def layout_text(layout: str, combined: bool) -> str:
    """The expected shape for a message, e.g. ``"[pages, page_size, Hk, D] (layout='NHD')"``."""
    return f"{describe(layout, combined)} ({layout=})"


def check_pair(k_cache, v_cache, layout: str) -> None:
    """A ``(k_cache, v_cache)`` pair of JAX, numpy or torch arrays: each of rank 4, both of
    one shape and dtype (the one rule of the JAX op and the torch bridge).

    Raises:
      ValueError: naming the cache and the shape expected.
    """
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 4:
            raise ValueError(f"{name}.shape={tuple(c.shape)} must be rank 4: "
                             f"{layout_text(layout, False)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache ({tuple(v_cache.shape)}, {v_cache.dtype}) must match "
                         f"k_cache ({tuple(k_cache.shape)}, {k_cache.dtype})")


def shape(layout: str, combined: bool, num_pages: int, page_size: int, k_heads: int,
          head_dim: int) -> Tuple[int, ...]:
    """The shape of one cache array of this geometry."""
    size = {"page": num_pages, "entry": page_size, "head": k_heads, "kv": 2}
    return tuple(size[a] if isinstance(a, str) else math.prod(size[n] for n in a)
                 for a in axes(layout, combined)) + (head_dim,)


def geometry(layout: str, combined: bool, array_shape: Tuple[int, ...]) -> Tuple[int, int]:
    """``(num_pages, page_size)`` read from an array of the layout's rank."""
    layout_axes = axes(layout, combined)
    return array_shape[layout_axes.index("page")], array_shape[layout_axes.index("entry")]


def cache_rows(layout: str, combined: bool, num_pages: int, page_size: int,
               k_heads: int) -> CacheRows:
    """The strides (in rows of ``D``) of this geometry, row-major over the layout's axes."""
    size = {"page": num_pages, "entry": page_size, "head": k_heads, "kv": 2}
    stride, running = {}, 1
    for name in reversed(list(_flat(axes(layout, combined)))):
        stride[name], running = running, running * size[name]
    value = (0, stride["kv"]) if combined else (1, 0)
    return CacheRows(num_pages, page_size, stride["page"], stride["entry"], stride["head"], *value)
