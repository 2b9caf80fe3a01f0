"""FlashInfer parity: the case matrix, the mapping onto FlashInfer's arguments, both calls.

Shared by the GPU suite (``tests/gpu/test_flashinfer_parity.py``), the golden recorder
(``bench/record_goldens.py``) and the CPU tests that replay its recordings
(``tests/test_golden.py``, ``tests/test_conventions.py``). Importing it needs numpy
and jaxrope only; torch and FlashInfer are imported inside the functions that call them.

FlashInfer 0.5.x semantics used here, read from its ``flashinfer/rope.py``,
``csrc/rope.cu`` and ``include/flashinfer/pos_enc.cuh`` (tag v0.5.3):

- ``apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim, interleave, rope_scale,
  rope_theta)``: q ``(nnz, Hq, D)``, k ``(nnz, Hk, D)``, pos_ids int32/int64 ``(nnz)``.
- ``apply_rope_inplace(q, k, indptr, offsets, ...)``: sequence ``b`` is rows
  ``indptr[b]:indptr[b+1]``; its token ``i`` sits at position ``offsets[b] + i``.
  indptr and offsets must share a dtype.
- ``apply_llama31_rope_pos_ids_inplace`` / ``apply_llama31_rope_inplace``: the same plus
  ``low_freq_factor``, ``high_freq_factor``, ``old_context_len``.
- ``apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size,
  cos_sin_cache, is_neox)``: query ``(nnz, Hq * D)``; cache float32 ``(rows, R)``, row
  ``p`` = ``[cos(p f_0) .. cos(p f_{R/2-1}), sin(p f_0) .. sin(p f_{R/2-1})]``;
  ``R = cos_sin_cache.shape[1]``; ``is_neox`` is ``not interleave``.
- Frequencies computed in the kernel: ``f_j = (1/rope_theta) ** (2j / rotary_dim)``,
  then ``f_j / rope_scale`` -- jaxrope's ``Linear(factor=rope_scale)`` with
  ``theta=rope_theta``; for llama31 ``s = clamp(f_j * old / (2 pi (high - low)) -
  low / (high - low), 0, 1)`` and ``(1 - s) f_j / rope_scale + s f_j`` -- exactly
  jaxrope's ``Llama3(factor=rope_scale, low_freq_factor, high_freq_factor,
  original_max_position=old_context_len)`` (checked in ``tests/test_conventions.py``).
- Pairs: ``interleave=False`` rotates ``(x[i], x[i + R/2])`` by ``f_i``,
  ``interleave=True`` rotates ``(x[2i], x[2i+1])`` by ``f_i``; dims ``[R, D)`` are loaded
  and stored back unchanged. ``R/2`` must be a multiple of 8 (16-byte vectors of 8
  halves per thread; ``vec_size = max(8, D/32)``), head_dim one of 64/128/256/512.

The error bounds both sides must meet (per rotated pair, derived, never tuned) and the
check that applies them (:class:`~jaxrope.testing.flashinfer_bounds.Reference`) live in
:mod:`jaxrope.testing.flashinfer_bounds`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Mapping, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

import jaxrope as jr
from jaxrope.cos_sin_cache import cos_sin_rows
from jaxrope.scaling import Linear, Llama3

# -- the matrix of the issue ------------------------------------------------------------

APIS = ("pos_ids", "indptr", "llama31_pos_ids", "llama31_indptr", "cos_sin_cache")
HEAD_DIMS = (64, 128, 256)
ROTARY_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
DTYPES = ("bfloat16", "float16")
BATCH_SIZES = (1, 19, 99)
LENGTHS = (1, 4, 19, 204)
OFFSETS = (0, 15, 99)
MAX_POSITION = 1 << 20
# Sequence bases: near zero, past FlashInfer's float32 "exact" range for angles, and the
# last one puts a 204-token sequence at offset 99 so that it ends exactly at 2**20.
BASES = (0, 1 << 12, 1 << 17, MAX_POSITION - max(OFFSETS) - max(LENGTHS) + 1)

DTYPE = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One FlashInfer call and the jaxrope config that must give the same result."""

    name: str
    api: str
    cfg: jr.RopeConfig
    dtype: str
    batch_size: int
    q_heads: int = 4
    k_heads: int = 2
    seed: int = 0
    # The sequence lengths and bases drawn from; the golden recorder keeps its file
    # small with shorter sequences.
    lengths: Tuple[int, ...] = LENGTHS
    bases: Tuple[int, ...] = BASES
    # cos_sin_cache only: one row per position from 0 (FlashInfer's usual table) rather
    # than one per distinct position.
    dense_cache: bool = False


@dataclasses.dataclass(frozen=True)
class Batch:
    """A ragged batch: ``indptr`` int32 ``[B+1]``, ``offsets`` int32 ``[B]``, ``pos_ids`` int32 ``[T]``."""

    indptr: np.ndarray
    offsets: np.ndarray
    pos_ids: np.ndarray


def rotary_dim_of(head_dim: int, fraction: float) -> int:
    return int(head_dim * fraction)


def _spread(rng: np.random.Generator, values: Sequence[int], n: int) -> np.ndarray:
    # Every value appears once when there is room; the rest are random picks.
    values = np.asarray(values)
    head = rng.permutation(values)[:n]
    return np.concatenate([head, rng.choice(values, n - len(head))]).astype(np.int64)


def ragged_batch(rng: np.random.Generator, batch_size: int,
                 lengths: Sequence[int] = LENGTHS, bases: Sequence[int] = BASES) -> Batch:
    """Sequences of ``lengths`` at ``base + offset`` (``OFFSETS``); positions up to 2**20.

    The first sequence is the longest length at the largest offset on the largest base,
    so every batch reaches its highest position (2**20 with the default sets).
    """
    seq_lengths = _spread(rng, lengths, batch_size)
    offsets = _spread(rng, OFFSETS, batch_size) + _spread(rng, bases, batch_size)
    seq_lengths[0] = max(lengths)
    offsets[0] = max(bases) + max(OFFSETS)
    indptr = np.concatenate([[0], np.cumsum(seq_lengths)])
    pos_ids = np.concatenate([o + np.arange(n) for o, n in zip(offsets, seq_lengths)])
    if pos_ids.max() > MAX_POSITION:
        raise ValueError(f"bases={tuple(bases)} and lengths={tuple(lengths)} pass {MAX_POSITION}")
    return Batch(indptr.astype(np.int32), offsets.astype(np.int32), pos_ids.astype(np.int32))


def random_inputs(rng: np.random.Generator, case: Case, num_tokens: int):
    """q ``[T, Hq, D]``, k ``[T, Hk, D]`` in the case's dtype, N(0, 1) scaled by 2."""
    dtype = DTYPE[case.dtype]
    d = case.cfg.head_dim
    q = (2 * rng.standard_normal((num_tokens, case.q_heads, d))).astype(dtype)
    k = (2 * rng.standard_normal((num_tokens, case.k_heads, d))).astype(dtype)
    return q, k


def parity_config(*, head_dim: int, rotary_dim: int, interleave: bool, theta: float,
                  scaling=None) -> jr.RopeConfig:
    """A config that admits every position of :data:`MAX_POSITION`."""
    return jr.RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta,
                         interleave=interleave, max_position=MAX_POSITION + 1, scaling=scaling)


# -- mapping a jaxrope config onto FlashInfer's arguments --------------------------------

def flashinfer_kwargs(api: str, cfg: jr.RopeConfig) -> Dict[str, object]:
    """FlashInfer keyword arguments that mean ``cfg`` for ``api``.

    Raises:
      ValueError: ``cfg`` has a variant the api cannot express.
    """
    if api not in APIS:
        raise ValueError(f"{api=} must be one of {APIS}")
    if api == "cos_sin_cache":
        return {"head_size": cfg.head_dim, "is_neox": not cfg.interleave}
    common = {"rotary_dim": cfg.rotary_dim, "interleave": cfg.interleave,
              "rope_theta": cfg.theta}
    s = cfg.scaling
    if api.startswith("llama31"):
        if not isinstance(s, Llama3):
            raise ValueError(f"{api=} needs a Llama3 scaling, got {s!r}")
        return {**common, "rope_scale": float(s.factor), "low_freq_factor": float(s.low_freq_factor),
                "high_freq_factor": float(s.high_freq_factor),
                "old_context_len": int(s.original_max_position)}
    if s is not None and not isinstance(s, Linear):
        raise ValueError(f"{api=} expresses only Linear scaling (rope_scale), got {s!r}")
    return {**common, "rope_scale": float(s.factor) if s is not None else 1.0}


def flashinfer_frequencies(kwargs: Mapping[str, object]) -> np.ndarray:
    """float64 ``[R/2]``: the frequencies FlashInfer's kernel computes, in exact arithmetic."""
    r = int(kwargs["rotary_dim"])
    base = (1.0 / float(kwargs["rope_theta"])) ** (np.arange(r // 2) * 2.0 / r)
    scale = float(kwargs["rope_scale"])
    if "old_context_len" not in kwargs:
        return base / scale
    low, high = float(kwargs["low_freq_factor"]), float(kwargs["high_freq_factor"])
    a = float(kwargs["old_context_len"]) / (2 * math.pi * (high - low))
    b = -1.0 / (high / low - 1.0)
    smooth = np.clip(base * a + b, 0.0, 1.0)
    return (1 - smooth) * base / scale + smooth * base


def cos_sin_cache(cfg: jr.RopeConfig, pos_ids: np.ndarray, dense: bool) -> Tuple[np.ndarray, np.ndarray]:
    """FlashInfer's float32 cache ``[rows + 1, R]`` and the row of each token ``[T]``.

    The rows are :func:`jaxrope.cos_sin_cache.cos_sin_rows`' (float64 from ``cfg``'s
    serving frequencies and attention factor, as :meth:`jaxrope.RopeConfig.cos_sin_cache`),
    so the cache path isolates FlashInfer's layout conventions from its angle arithmetic.
    ``dense``: row ``p`` is position ``p`` (FlashInfer's usual table, ``pos_ids`` passed
    as they are); otherwise one row per distinct position, to keep a 2**20-position
    table off the GPU. One zero row is appended: with ``is_neox=False`` the kernel's
    16-byte loads read 4 floats past the last row it uses.
    """
    positions = np.arange(int(pos_ids.max()) + 1) if dense else np.unique(pos_ids)
    rows = pos_ids if dense else np.searchsorted(positions, pos_ids)
    cache = cos_sin_rows(cfg, positions, np.float32)
    cache = np.concatenate([cache, np.zeros((1, cache.shape[1]), np.float32)])
    return cache, rows.astype(np.int32)


# -- running FlashInfer and jaxrope ------------------------------------------------------

REQUIRE_ENV = "JAXROPE_REQUIRE_FLASHINFER"
FLASHINFER_DEVICE = "cuda"


def require_flashinfer():
    """The ``flashinfer`` module, or a pytest skip that says what is missing.

    With ``JAXROPE_REQUIRE_FLASHINFER=1`` (set by ``bench/gpu_suite.sh``) a missing
    piece fails instead: on the GPU machine a skip would hide a broken install.
    """
    import os

    import pytest

    def missing(reason: str):
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason} (and {REQUIRE_ENV}=1)")
        pytest.skip(reason)

    try:
        import torch
    except ImportError as e:
        missing(f"torch is not installed: {e}")
    if not torch.cuda.is_available():
        missing("no CUDA GPU visible to torch")
    try:
        import flashinfer
    except Exception as e:  # a broken install raises more than ImportError
        missing(f"FlashInfer is not importable ({type(e).__name__}: {e}); "
                "bash bench/gpu_suite.sh installs it from the wheels in .whl/")
    if not flashinfer.__version__.startswith("0.5."):
        missing(f"these tests follow FlashInfer 0.5.x semantics, found {flashinfer.__version__}")
    import jax
    if jax.default_backend() != "gpu":
        missing(f"JAX runs on {jax.default_backend()!r}, not the GPU: set JAXROPE_GPU_TESTS=1 "
                "(tests/conftest.py pins JAX to the CPU otherwise)")
    return flashinfer


def _to_torch(x: np.ndarray, device):
    # A copy: FlashInfer writes in place and must never reach the caller's array.
    import torch
    if x.dtype == DTYPE["bfloat16"]:
        return torch.from_numpy(x.copy().view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(x.copy()).to(device)


def _from_torch(t, dtype: np.dtype) -> np.ndarray:
    import torch
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def run_flashinfer(api: str, cfg: jr.RopeConfig, q: np.ndarray, k: np.ndarray, batch: Batch,
                   cache: Optional[Tuple[np.ndarray, np.ndarray]] = None):
    """FlashInfer's in-place call for ``api`` on copies of ``q``, ``k``; returns numpy outputs.

    ``cache``: ``(cos_sin_cache, rows)`` for ``api="cos_sin_cache"``.
    """
    import flashinfer
    import torch

    dev = torch.device(FLASHINFER_DEVICE)
    tq, tk = _to_torch(q, dev), _to_torch(k, dev)
    kwargs = flashinfer_kwargs(api, cfg)
    pos = _to_torch(batch.pos_ids, dev)
    indptr, offsets = _to_torch(batch.indptr, dev), _to_torch(batch.offsets, dev)
    if api == "pos_ids":
        flashinfer.apply_rope_pos_ids_inplace(tq, tk, pos, **kwargs)
    elif api == "indptr":
        flashinfer.apply_rope_inplace(tq, tk, indptr, offsets, **kwargs)
    elif api == "llama31_pos_ids":
        flashinfer.apply_llama31_rope_pos_ids_inplace(tq, tk, pos, **kwargs)
    elif api == "llama31_indptr":
        flashinfer.apply_llama31_rope_inplace(tq, tk, indptr, offsets, **kwargs)
    else:
        table, rows = cache
        flashinfer.apply_rope_with_cos_sin_cache_inplace(
            positions=_to_torch(rows, dev), query=tq.view(tq.shape[0], -1),
            key=tk.view(tk.shape[0], -1), cos_sin_cache=_to_torch(table, dev), **kwargs)
    if tq.is_cuda:
        torch.cuda.synchronize()
    return _from_torch(tq, q.dtype), _from_torch(tk, k.dtype)


_JITTED = {}


def run_jaxrope(cfg: jr.RopeConfig, q: np.ndarray, k: np.ndarray, pos_ids: np.ndarray,
                backend: str):
    """``jaxrope.apply_rope`` under ``jax.jit`` on the default device; numpy outputs."""
    import jax
    import jax.numpy as jnp

    fn = _JITTED.get(backend)
    if fn is None:
        fn = _JITTED[backend] = jax.jit(
            lambda q, k, p, cfg: jr.apply_rope(q, k, p, cfg, backend=backend),
            static_argnums=3)
    q2, k2 = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos_ids, jnp.int32), cfg)
    return np.asarray(q2), np.asarray(k2)


def case_inputs(case: "Case"):
    """``(batch, q, k, cos_sin_cache or None)`` of a case, from its own seed."""
    rng = np.random.default_rng(case.seed)
    batch = ragged_batch(rng, case.batch_size, case.lengths, case.bases)
    q, k = random_inputs(rng, case, len(batch.pos_ids))
    cache = None
    if case.api == "cos_sin_cache":
        cache = cos_sin_cache(case.cfg, batch.pos_ids, dense=case.dense_cache)
    return batch, q, k, cache
