"""Float64 numpy oracle of the paged KV-cache append, written from the conventions.

Independent of ``jaxrope.ops`` (not imported): slots follow vLLM's ``slot_mapping``
(page ``slot // page_size``, entry ``slot % page_size``, negative slots skipped), the
layouts FlashInfer's NHD ``[pages, page_size, Hk, D]`` and HND ``[pages, Hk, page_size,
D]``, and fp8 storage FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache``:
``e4m3(saturate(x * quant_scale))``, here from float64 through ``ml_dtypes``.
"""

from __future__ import annotations

from typing import Tuple

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)


def e4m3(x) -> np.ndarray:
    """``x`` (float64) saturated to +-448 and rounded to float8_e4m3fn (nearest even)."""
    return np.clip(np.asarray(x, np.float64), -E4M3_MAX, E4M3_MAX).astype(E4M3)


def entries(slots: np.ndarray, pages: int, page_size: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(written [T] bool, page [T], entry [T])`` of each token's slot."""
    slots = np.asarray(slots, np.int64)
    written = (slots >= 0) & (slots < pages * page_size)
    return written, np.where(written, slots // page_size, 0), np.where(written, slots % page_size, 0)


def rows(cache: np.ndarray, layout: str, page: np.ndarray, entry: np.ndarray) -> np.ndarray:
    """``[n, Hk, D]``: the rows of a 4-D ``cache`` at ``(page, entry)`` pairs."""
    if layout == "NHD":
        return cache[page, entry]
    return cache[page, :, entry]


def written_mask(shape: Tuple[int, ...], layout: str, page: np.ndarray,
                 entry: np.ndarray) -> np.ndarray:
    """bool ``shape``: True at every element of a 4-D cache that the rows cover."""
    mask = np.zeros(shape, bool)
    if layout == "NHD":
        mask[page, entry] = True
    else:
        mask[page, :, entry] = True
    return mask


def assert_untouched(label: str, new: np.ndarray, old: np.ndarray, written: np.ndarray) -> None:
    """Every element of cache ``new`` outside the ``written`` mask has ``old``'s bits."""
    np.testing.assert_array_equal(bits(new)[~written], bits(old)[~written],
                                  err_msg=f"{label}: an entry no token names changed")


def bits(x) -> np.ndarray:
    """The raw bits of an array as unsigned ints of its width: equal exactly when the values
    are the same bit patterns (signed zeros and NaNs included)."""
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def split(kv_cache) -> Tuple[np.ndarray, np.ndarray]:
    """numpy ``(k_cache, v_cache)`` of a ``(k, v)`` pair or of a combined array (keys at
    ``[:, 0]``, values at ``[:, 1]``)."""
    if isinstance(kv_cache, tuple):
        return tuple(np.asarray(c) for c in kv_cache)
    both = np.asarray(kv_cache)
    return both[:, 0], both[:, 1]


def ordered(x: np.ndarray) -> np.ndarray:
    """int64 keys of floats, monotonic in value: neighbouring floats differ by 1."""
    width = x.dtype.itemsize
    keys = bits(x).astype(np.int64)
    sign = 1 << (8 * width - 1)
    return np.where(keys & sign, -(keys & (sign - 1)), keys)


def ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance in units in the last place of two arrays of one float dtype."""
    if a.dtype != b.dtype:
        raise ValueError(f"{a.dtype=} must equal {b.dtype=}")
    return np.abs(ordered(a) - ordered(b))


def row_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance of two arrays of one float dtype in units in the last place of
    the largest magnitude in each row (last axis).

    Two evaluations of one rotation that round differently (a fused multiply-add where
    the other multiplies, then adds, as XLA's CPU compiler in JAX 0.12 emits for some
    block shapes) differ by about one rounding of the products, whose scale is the row's,
    not the result's: at an element near zero that is hundreds of its own ulps. Measured
    against the row's scale it is one or two.
    """
    if a.dtype != b.dtype:
        raise ValueError(f"{a.dtype=} must equal {b.dtype=}")
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = np.maximum(np.abs(a64), np.abs(b64)).max(axis=-1, keepdims=True)
    info = ml_dtypes.finfo(a.dtype)  # numpy 2.5 has no finfo of bfloat16
    unit = np.exp2(np.floor(np.log2(np.maximum(scale, float(info.tiny))))) * float(info.eps)
    return np.abs(a64 - b64) / unit
