"""``apply_rope``: the public entry point; validates once, then runs the chosen kernel
(:data:`jaxrope.ops.backends.IMPLEMENTATIONS`, falling through to XLA when "auto"'s
kernel declines)."""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import checks as _checks
from jaxrope import sharding as _sharding
from jaxrope.config import RopeConfig
from jaxrope.ops import backends
from jaxrope.ops.constants import kernel_constants, kernel_options

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _check_pos_shape(shape: Tuple[int, ...], tokens: int, cfg: RopeConfig) -> None:
    if cfg.mrope_section is None:
        if shape == (3, tokens):
            raise ValueError(
                f"pos_ids.shape={shape} is M-RoPE positions [3, T], but cfg is a 1-D config "
                f"(cfg.mrope_section=None); pass pos_ids [T] with T={tokens}, or a cfg with "
                "mrope_section")
        if shape != (tokens,):
            raise ValueError(f"pos_ids.shape={shape} must be [T] with T={tokens}")
    elif shape != (3, tokens):
        raise ValueError(
            f"pos_ids.shape={shape} must be [3, T] (t, h, w rows) with T={tokens} for an M-RoPE "
            f"config (cfg.mrope_section={cfg.mrope_section}, "
            f"cfg.mrope_interleaved={cfg.mrope_interleaved}); text tokens repeat their "
            "position on all three rows")


def validate(q, k, pos_ids, cfg: RopeConfig) -> None:
    """The boundary checks of :func:`apply_rope` (shapes, dtypes, visible positions)."""
    if not isinstance(cfg, RopeConfig):
        raise TypeError(f"cfg must be a RopeConfig, got {type(cfg).__name__}")
    for name, x in (("q", q), ("k", k)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if x.ndim != 3:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, H, D] (rank 3)")
        if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} must be one of float32, float16, bfloat16")
        if x.shape[2] != cfg.head_dim:
            raise ValueError(f"{name}.shape[2]={x.shape[2]} must equal cfg.head_dim={cfg.head_dim}")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k.shape[0]={k.shape[0]} must equal q.shape[0]={q.shape[0]} (tokens)")
    if k.dtype != q.dtype:
        raise ValueError(f"k.dtype={k.dtype} must equal q.dtype={q.dtype}")
    if isinstance(q, jax.Array) and isinstance(k, jax.Array) and not isinstance(
            q, jax.core.Tracer) and not isinstance(k, jax.core.Tracer) and q.devices() != k.devices():
        raise ValueError(f"q is on {q.devices()} but k is on {k.devices()}; put them on one device")
    check_pos_ids(pos_ids, q.shape[0], cfg)


def check_pos_ids(pos_ids, tokens: int, cfg: RopeConfig) -> None:
    """The position checks of :func:`validate`, shared by every op: an integer array
    ``[T]`` (``[3, T]`` for an M-RoPE ``cfg``) whose visible values lie in
    ``[0, cfg.max_position)``; traced values get :func:`jaxrope.checks.in_range`."""
    if not hasattr(pos_ids, "shape") or not hasattr(pos_ids, "dtype"):
        raise TypeError(f"pos_ids must be an integer array, got {type(pos_ids).__name__}")
    _check_pos_shape(tuple(pos_ids.shape), tokens, cfg)
    if not jnp.issubdtype(pos_ids.dtype, jnp.integer):
        raise ValueError(f"pos_ids.dtype={pos_ids.dtype} must be an integer type (int32)")
    if isinstance(pos_ids, jax.core.Tracer):
        _checks.in_range("pos_ids", pos_ids, 0, cfg.max_position - 1)
    elif pos_ids.size:
        values = np.asarray(pos_ids)
        low, high = int(values.min()), int(values.max())
        if low < 0 or high >= cfg.max_position:
            raise ValueError(f"pos_ids must lie in [0, {cfg.max_position}) "
                             f"(cfg.max_position), got values in [{low}, {high}]")


def apply_rope(q, k, pos_ids, cfg: RopeConfig, backend: str = "auto"):
    """Rotate queries and keys by their positions.

    Args:
      q: ``[T, Hq, D]`` float32, float16 or bfloat16, ``D == cfg.head_dim``.
      k: ``[T, Hk, D]``, same dtype and ``T`` as ``q``.
      pos_ids: int ``[T]``, the position of each token, in ``[0, cfg.max_position)``;
        for an M-RoPE config (``cfg.mrope_section``) int ``[3, T]``, the t, h and w
        rows (:func:`jaxrope.mrope.rope_index` gives them for a prompt). Checked when
        the values are visible (not traced under ``jit``); traced positions are not
        checked, and values at or past ``2**24`` lose angle accuracy.
      cfg: the :class:`RopeConfig`; static under ``jit``.
      backend: "auto" (Mosaic GPU on Hopper or newer, the Triton-lowered Pallas kernel
        on other GPUs, XLA elsewhere), "mosaic", "triton", "xla" or "interpret" (the
        Triton-lowered kernel body run by the Pallas interpreter, any platform): see
        :mod:`jaxrope.ops.backends`.

    Returns:
      ``(q, k)`` rotated, same shapes and dtypes. Dims ``[cfg.rotary_dim, D)`` are
      returned unchanged. Math is float32 with frequencies from float64; cos and sin
      are multiplied by the variant's attention factor. Under ``jax.jit`` with ``q`` and
      ``k`` donated the result reuses their buffers (in place); without donation XLA
      first copies them, so the caller's arrays are never modified. On a device mesh
      (q, k sharded over tokens and/or heads) each device rotates its own block, with no
      collective and in place as well (:mod:`jaxrope.sharding`).

    Raises:
      TypeError: ``cfg`` is not a RopeConfig or an input is not an array.
      ValueError: a shape, dtype, device or visible position is invalid, ``pos_ids [T]``
        for an M-RoPE config or ``[3, T]`` for a 1-D one, or a sharding that would need
        communication (head_dim split, q and k tokens split differently, an uneven split:
        :func:`jaxrope.sharding.local_specs`).
      BackendUnavailable: ``backend="triton"`` off GPU, ``backend="mosaic"`` off
        CUDA or on Auto mesh axes (where "auto" falls through to XLA).
      NotImplementedError: q is on a mesh mixing Auto and Explicit axes.

    Example:
      >>> import jax, jax.numpy as jnp, jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=64)
      >>> q = jax.random.normal(jax.random.key(0), (5, 4, 64), jnp.bfloat16)
      >>> k = jax.random.normal(jax.random.key(1), (5, 2, 64), jnp.bfloat16)
      >>> q2, k2 = jr.apply_rope(q, k, jnp.arange(5, dtype=jnp.int32), cfg)
      >>> q2.shape, k2.dtype
      ((5, 4, 64), dtype(bfloat16))
      >>> vl = jr.RopeConfig(head_dim=64, mrope_section=(8, 12, 12))
      >>> q2, k2 = jr.apply_rope(q, k, jnp.zeros((3, 5), jnp.int32), vl)
      >>> bool((q2 == q).all())  # position 0 on every row: no rotation
      True
    """
    validate(q, k, pos_ids, cfg)
    pos_ids = jnp.asarray(pos_ids, jnp.int32)
    tables, _ = kernel_constants(cfg)

    def call(impl):
        return _sharding.per_shard(impl, q, k, pos_ids)(q, k, pos_ids, jnp.asarray(tables),
                                                        **kernel_options(cfg))

    return backends.run(backend, "rope", q, call)
