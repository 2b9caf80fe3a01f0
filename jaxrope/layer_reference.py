"""A float64 reference of one attention layer over a paged cache: the rotation from a
config's own frequencies, causal attention, the relative error between two sides, and JAX's
own ``paged_attention`` op (the reader of the ``"paged_attention"`` cache layout).

What the demos (``python -m jaxrope.demo``, ``python -m torch_bridge.demo``) and the tests'
cache readers (:mod:`jaxrope.testing.paged_attention`) check against; it imports neither.
The tests' independent float64 oracle (:mod:`jaxrope.testing.oracle`) recomputes the
frequencies from the variants' formulas, while this module takes them from
:meth:`jaxrope.RopeConfig.serving_frequencies`.

Example:
  >>> import numpy as np, jaxrope as jr
  >>> x = np.ones((2, 1, 4))
  >>> rotate(jr.RopeConfig(head_dim=4), x, np.array([0, 0]))[0, 0].tolist()
  [1.0, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

import warnings

import numpy as np

from jaxrope.config import RopeConfig
from jaxrope.mrope.sections import mrope_rows

__all__ = ["causal_attention", "gpu_paged_attention", "relative_error", "rotate"]


def rotate(cfg: RopeConfig, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """float64 ``[T, H, D]``: ``x [T, H, D]`` rotated at ``pos`` (``[T]``, or ``[3, T]``
    for an M-RoPE ``cfg``: frequency slot ``j`` at row ``mrope_rows[j]``'s position)."""
    inv_freq, attention = cfg.serving_frequencies()
    pos = np.asarray(pos, np.float64)
    if pos.ndim == 2:
        pos = pos[mrope_rows(cfg.mrope_section, cfg.mrope_interleaved)].T   # [T, R/2]
    else:
        pos = pos[:, None]
    angle = (pos * inv_freq[None, :])[:, None, :]
    cos, sin = np.cos(angle) * attention, np.sin(angle) * attention
    x = np.asarray(x, np.float64)
    out = x.copy()
    r = cfg.rotary_dim
    first, second = ((slice(0, r, 2), slice(1, r, 2)) if cfg.interleave
                     else (slice(0, r // 2), slice(r // 2, r)))
    a, b = x[..., first], x[..., second]
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, sm_scale: float) -> np.ndarray:
    """float64 ``[n, Hq, D]``: queries ``q [n, Hq, D]``, the last ``n`` of the ``L``
    tokens of ``k, v [L, Hk, D]``, each over the keys up to its own; query head ``h``
    reads key head ``h // (Hq // Hk)`` (grouped-query attention)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, q_heads, _ = q.shape
    length, k_heads, _ = k.shape
    group = q_heads // k_heads
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    logits = np.einsum("qhd,khd->hqk", q, k) * sm_scale
    visible = np.arange(length)[None, :] <= (length - n + np.arange(n))[:, None]
    logits = np.where(visible[None], logits, -np.inf)
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", weights, v)


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def gpu_paged_attention():
    """JAX's ``paged_attention`` op (``jax.experimental.pallas.ops.gpu.paged_attention``,
    a Pallas kernel; JAX 0.11 deprecates the module with a warning on import, silenced
    here: it is still JAX's op for this layout).

    Raises:
      ImportError: this JAX has no ``jax.experimental.pallas.ops.gpu.paged_attention``.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import paged_attention as module
    return module.paged_attention
