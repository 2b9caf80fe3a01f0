"""The float64 check both engine loops use: a sequence's q and k rotated at positions
``0..L-1`` and each token attending causally over its own sequence, recomputed from
scratch in numpy (nothing of the engine's cache or kernels is reused)."""

from __future__ import annotations

import numpy as np

import jaxrope as jr


def rotate(cfg: jr.RopeConfig, x: np.ndarray) -> np.ndarray:
    """``x [L, H, D]`` rotated at positions ``0..L-1`` (NeoX halves), in float64."""
    inv_freq, attention = cfg.serving_frequencies()
    angle = np.arange(x.shape[0], dtype=np.float64)[:, None, None] * inv_freq
    cos, sin = np.cos(angle) * attention, np.sin(angle) * attention
    half = cfg.rotary_dim // 2
    a, b = x[..., :half].astype(np.float64), x[..., half:2 * half].astype(np.float64)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., 2 * half:]], axis=-1)


def attention(cfg: jr.RopeConfig, q: np.ndarray, k: np.ndarray, v: np.ndarray,
              index: int) -> np.ndarray:
    """float64 ``[Hq, D]``: token ``index`` of a sequence (its unrotated ``q, k, v
    [L, H, D]``) attending over the keys ``0..index``; query head ``h`` reads key head
    ``h // (Hq // Hk)``."""
    q, k = rotate(cfg, q)[index], rotate(cfg, k)[:index + 1]
    group = q.shape[0] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v[:index + 1].astype(np.float64), group, axis=1)
    logits = np.einsum("hd,lhd->hl", q, k) / np.sqrt(q.shape[-1])
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hl,lhd->hd", weights, v)


def verdict(done: dict, lengths: dict, worst: float, tolerance: float = 1e-4) -> float:
    """Every request ran to its length and no output is off the float64 recompute by
    more than ``tolerance``; prints PASS and returns ``worst``."""
    assert done == lengths, f"tokens run {done}, expected {lengths}"
    assert worst < tolerance, f"attention off the float64 recompute by {worst:.2e}"
    print("PASS")
    return worst
