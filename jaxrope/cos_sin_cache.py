"""The cos/sin table that table-driven RoPE kernels (FlashInfer, vLLM) read.

One layout serves both: row ``p`` is ``cos(p * f)`` for the ``R/2`` frequencies, then
``sin(p * f)``, each times the attention factor, ``[rows, R]``. FlashInfer's
``apply_rope_with_cos_sin_cache_inplace`` reads it in float32 (``R`` is
``cos_sin_cache.shape[1]``, ``is_neox = not interleave``); vLLM's ``RotaryEmbedding``
keeps the same ``[max_position, rotary_dim]`` table (``_compute_cos_sin_cache``) in the
model dtype. Values come from the float64 frequencies the jaxrope kernels use
(:meth:`jaxrope.RopeConfig.serving_frequencies`), so a table-driven kernel fed this
table rotates like jaxrope up to its own arithmetic.

Example:
  >>> import numpy as np, jaxrope as jr
  >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0)
  >>> rows = cos_sin_rows(cfg, np.array([0, 5]), np.float32)
  >>> rows[0].tolist()
  [1.0, 1.0, 0.0, 0.0]
  >>> np.allclose(rows[1], [np.cos(5), np.cos(0.5), np.sin(5), np.sin(0.5)])
  True
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["cos_sin_rows"]


def _dtype(dtype: Any) -> np.dtype:
    import ml_dtypes  # jax's own dependency: numpy's name for bfloat16

    names = {"float32": np.float32, "float64": np.float64, "float16": np.float16,
             "bfloat16": ml_dtypes.bfloat16}
    try:
        resolved = np.dtype(names.get(str(dtype), dtype))
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in names:
        raise ValueError(f"dtype={dtype!r} must be one of {sorted(names)}")
    return resolved


def cos_sin_rows(cfg, positions, dtype: Any = np.float32) -> np.ndarray:
    """``[len(positions), R]``: the cos-then-sin row of each position, times the attention factor.

    ``cfg``: a :class:`jaxrope.RopeConfig`; ``positions``: integers ``[N]`` (any order,
    repeats allowed); ``dtype``: float32 (default), float64, float16 or bfloat16.

    Raises:
      ValueError: ``dtype`` is not one of the above.
    """
    dtype = _dtype(dtype)
    inv_freq, attention = cfg.serving_frequencies()
    angle = np.asarray(positions).astype(np.float64)[:, None] * inv_freq[None, :]
    cache = np.concatenate([np.cos(angle), np.sin(angle)], axis=1) * attention
    return cache.astype(dtype)
