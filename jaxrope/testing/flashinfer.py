"""FlashInfer parity: cases, the FlashInfer calls, and the error bounds both sides must meet.

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

Error bounds (all per rotated pair, derived below, never tuned): see
:func:`output_bound`, :func:`flashinfer_angle_error` and :data:`OURS_ANGLE_ERROR`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

import jaxrope as jr
from jaxrope.cos_sin_cache import cos_sin_rows
from jaxrope.scaling import Linear, Llama3

from jaxrope.testing import oracle

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
# Below this position no fast-math drift can explain a disagreement (the FlashInfer
# bound there is < 2e-3 rad): a disagreement is a convention difference and fails.
DRIFT_FREE_POSITION = 1 << 12

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




# -- layout helpers ----------------------------------------------------------------------

def pair_index(rotary_dim: int, interleave: bool) -> Tuple[np.ndarray, np.ndarray]:
    """The dims of pair ``i``: ``(first[i], second[i])``, each ``[R/2]``."""
    i = np.arange(rotary_dim // 2)
    if interleave:
        return 2 * i, 2 * i + 1
    return i, i + rotary_dim // 2


def pairs(x: np.ndarray, rotary_dim: int, interleave: bool) -> np.ndarray:
    """float64 ``[T, H, R/2, 2]``: the rotated pairs of ``x [T, H, D]``."""
    first, second = pair_index(rotary_dim, interleave)
    x = np.asarray(x, np.float64)
    return np.stack([x[..., first], x[..., second]], axis=-1)


# -- error bounds ------------------------------------------------------------------------

E = 2.0 ** -24  # unit roundoff of float32 (round to nearest)
LN2 = math.log(2.0)

# Unit roundoff of the output dtype: rounding a float32 result to it moves it by at most
# this much relative (half an ulp; bf16 keeps 8 significant bits, fp16 11).
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": E}
# Half the smallest subnormal: the absolute rounding floor where the relative one fails.
SUBNORMAL_FLOOR = {"bfloat16": 2.0 ** -134, "float16": 2.0 ** -25, "float32": 2.0 ** -150}

# jaxrope's angle (``jaxrope/kernels/angle.py``): the turn count is a float32 sum of four
# partial terms each below one turn, so its <= 4 roundings cost <= 4 * 2**-22 turns =
# 2**-20 turns = 6.0e-6 rad; reducing to [-1/2, 1/2) turns is exact; the float32 product
# by 2 pi and float32 sin/cos add < 5e-7 rad. 2**-17 = 7.6e-6 rad bounds the total.
OURS_ANGLE_ERROR = 2.0 ** -17

# Slack, in units of E relative to the pair's radius, for what both sides do after the
# angle: float32 cos/sin (or the float32 cache) rounded once each (sqrt 2 E) and the
# rotation a cos - b sin, b cos + a sin (two products and a sum: 3 E on |a cos| + |b sin|
# <= sqrt 2 r). 8 E covers both.
ROTATION_SLACK = 8 * E


def flashinfer_angle_error(kwargs: Mapping[str, object], pos_ids: np.ndarray) -> np.ndarray:
    """float64 ``[T, R/2]``: a bound on FlashInfer's angle error, radians, per token and pair.

    FlashInfer computes the angle on the fly in float32 with fast-math intrinsics
    (built with ``-use_fast_math``). Per pair ``j`` at position ``p``, with
    ``theta = p * f_j``, each step's worst case (E = 2**-24):

    1. frequency ``f_j = __powf(1/rope_theta, 2j/R)`` = ``ex2(y * lg2(x))``:
       ``rope_theta`` -> float and ``1/theta``: 2 roundings of x, f ~ x**y: ``2 E y``;
       ``y = 2j/R`` under fast-math division (2 ulp) and ``y * lg2(x)`` rounded: the
       exponent moves by ``(4 E + E) |y lg2 x|``, f by that times ln 2 = ``5 E |ln f|``;
       ``lg2.approx`` (CUDA: 2 ulp outside [0.5, 2]): ``ln2 * y * 2 ulp(|lg2 x|)``;
       ``ex2.approx`` (2 ulp): ``4 E``;
    2. ``rope_scale`` -> float and ``1/rope_scale`` (2 E) and ``f * rcp_scale`` (E);
       llama31 also rounds its smoothing ``s = f a + b`` (a, b rounded on the host) and
       the blend ``(1 - s) f / scale + s f`` (5 E); an error ``ds`` in ``s`` moves the
       frequency by at most ``(scale - 1) ds`` relative, only inside the blend band;
    3. ``fl(float(p) * f)``: ``E theta`` (positions below 2**24 convert exactly);
    4. ``__sincosf``: sm_70+ multiplies by ``fl(1/(2 pi))`` rounding toward zero (FMUL.RZ,
       < 1 ulp of ``theta / 2 pi``: ``2 E theta``; the rounded constant: ``0.68 E
       theta``), then MUFU.SIN/COS reduce exactly and add 2**-21.19 absolute (CUDA's
       bound for ``__cosf`` on [-pi, pi]; ``__sinf``'s is 2**-21.41).

    Total: ``theta * (eps_f + 3.68 E) + 2**-21.19``. At p = 2**20, f = 1 this is
    ~0.5 rad: FlashInfer's drift at large positions is real and this bound is its
    worst case, not a typical value (measured errors are ~20x smaller).
    """
    r = int(kwargs["rotary_dim"])
    j = np.arange(r // 2)
    y = 2.0 * j / r
    theta_base = float(np.float32(kwargs["rope_theta"]))
    lg2x = math.log2(theta_base)  # |lg2(1/theta)|
    ln_f = y * math.log(theta_base)  # |ln f_base|
    ulp_lg2 = float(np.spacing(np.float32(lg2x)))
    eps = 2 * E * y + 5 * E * ln_f + LN2 * y * 2 * ulp_lg2 + 4 * E
    base = np.exp(-ln_f)
    scale = float(kwargs["rope_scale"])
    if "old_context_len" in kwargs:
        low, high = float(kwargs["low_freq_factor"]), float(kwargs["high_freq_factor"])
        a = float(kwargs["old_context_len"]) / (2 * math.pi * (high - low))
        b = -1.0 / (high / low - 1.0)
        s = base * a + b
        ds = np.abs(base * a) * (eps + 3 * E) + abs(b) * (4 * E + E * high / (high - low)) + E
        in_band = (s > -ds) & (s < 1 + ds)
        eps_f = eps + 3 * E + 5 * E + np.where(in_band, (scale - 1) * ds, 0.0)
        freq = (1 - np.clip(s, 0, 1)) * base / scale + np.clip(s, 0, 1) * base
    else:
        eps_f = eps + (3 * E if scale != 1.0 else 0.0)
        freq = base / scale
    theta = np.asarray(pos_ids, np.float64)[:, None] * freq[None, :]
    return theta * (eps_f[None, :] + 3.68 * E) + 2.0 ** -21.19


def output_bound(expected: np.ndarray, radius: np.ndarray, angle_error, attention: float,
                 dtype: str) -> np.ndarray:
    """Bound on ``|got - expected|`` per element of a pair, ``got`` rounded to ``dtype``.

    ``expected`` is the float64 oracle, ``radius`` the input pair's length ``|(a, b)|``.
    Before rounding, an angle error ``d`` moves the pair by at most ``radius * d``
    (rotations are 1-Lipschitz in the angle), plus the float32 arithmetic after the angle
    (:data:`ROTATION_SLACK`), both scaled by the attention factor: ``dev``. Rounding to
    the output dtype then adds at most ``u * (|expected| + dev)``, u the dtype's unit
    roundoff, with an absolute floor for subnormals.
    """
    dev = radius * attention * (np.asarray(angle_error) + ROTATION_SLACK)
    return UNIT_ROUNDOFF[dtype] * (np.abs(expected) + dev) + dev + SUBNORMAL_FLOOR[dtype]


@dataclasses.dataclass
class Comparison:
    """How far ``got`` is from ``expected`` in units of the bound; where it is worst."""

    label: str
    worst_ratio: float
    violations: int
    total: int
    worst_position: int
    worst_error: float

    def __str__(self) -> str:
        return (f"{self.label}: max |err|/bound = {self.worst_ratio:.3g} (|err| {self.worst_error:.3g} "
                f"at position {self.worst_position}), {self.violations}/{self.total} elements over")


def compare(label: str, got: np.ndarray, expected: np.ndarray, bound: np.ndarray,
            pos_ids: np.ndarray) -> Comparison:
    """Elementwise ``|got - expected| <= bound`` on arrays ``[T, ...]``."""
    err = np.abs(np.asarray(got, np.float64) - expected)
    ratio = err / bound
    flat = int(np.argmax(ratio))
    token = np.unravel_index(flat, ratio.shape)[0]
    return Comparison(label, float(ratio.reshape(-1)[flat]), int((ratio > 1).sum()), ratio.size,
                      int(pos_ids[token]), float(err.reshape(-1)[flat]))


@dataclasses.dataclass
class Verdict:
    """The outcome of one parity check (see :class:`Reference`)."""

    ours_vs_oracle: Comparison
    flashinfer_vs_oracle: Comparison
    ours_vs_flashinfer: Comparison
    # Elements beyond the parity bound, and the positions of their tokens.
    disagreements: int
    disagreement_positions: np.ndarray
    failures: List[str]

    def summary(self) -> str:
        return "\n".join([str(self.ours_vs_oracle), str(self.flashinfer_vs_oracle),
                          str(self.ours_vs_flashinfer)])


class Reference:
    """The float64 oracle of ``x [T, H, D]`` under ``cfg`` and both sides' error bounds.

    :meth:`check` compares jaxrope (``ours``) and FlashInfer on the rotated pairs:

    1. jaxrope against the float64 oracle, tight: :data:`OURS_ANGLE_ERROR` and rounding.
    2. jaxrope against FlashInfer within the sum of both bounds (triangle inequality
       through the oracle); FlashInfer's angle bound is :func:`flashinfer_angle_error`
       (zero on the cos/sin cache path, whose table is exact to float32).
    3. Where they disagree beyond that, the oracle decides: with (1) holding,
       FlashInfer is then outside its own bound, i.e. FlashInfer is wrong there. That is
       accepted (and reported) only at positions >= :data:`DRIFT_FREE_POSITION`, where
       its float32 angle drifts, and only when the same call agrees at lower positions;
       otherwise it may be a convention difference: failure.

    The untouched dims ``[R, D)`` are compared byte for byte by the callers
    (:func:`untouched_equal`).
    """

    def __init__(self, cfg: jr.RopeConfig, api: str, dtype: str, x: np.ndarray,
                 pos_ids: np.ndarray):
        self.cfg, self.pos_ids = cfg, np.asarray(pos_ids)
        r = cfg.rotary_dim
        _, attention = oracle.serving_frequencies(cfg)
        px = pairs(x, r, cfg.interleave)
        radius = np.hypot(px[..., 0], px[..., 1])[..., None]
        self.expected = pairs(oracle.rope_of(cfg, x, self.pos_ids), r, cfg.interleave)
        if api == "cos_sin_cache":
            fi_angle = np.zeros((len(self.pos_ids), r // 2))
        else:
            fi_angle = flashinfer_angle_error(flashinfer_kwargs(api, cfg), self.pos_ids)
        self.bound_ours = output_bound(self.expected, radius, OURS_ANGLE_ERROR, attention, dtype)
        self.bound_flashinfer = output_bound(self.expected, radius, fi_angle[:, None, :, None],
                                             attention, dtype)

    def check_ours(self, ours: np.ndarray, label: str) -> Comparison:
        """jaxrope against the float64 oracle (step 1 alone)."""
        return compare(f"{label} jaxrope vs float64", pairs(ours, self.cfg.rotary_dim,
                                                             self.cfg.interleave),
                       self.expected, self.bound_ours, self.pos_ids)

    def check(self, ours: np.ndarray, flashinfer_out: np.ndarray, label: str) -> Verdict:
        got_ours = pairs(ours, self.cfg.rotary_dim, self.cfg.interleave)
        got_fi = pairs(flashinfer_out, self.cfg.rotary_dim, self.cfg.interleave)
        bound = self.bound_ours + self.bound_flashinfer
        c_ours = compare(f"{label} jaxrope vs float64", got_ours, self.expected, self.bound_ours,
                         self.pos_ids)
        c_fi = compare(f"{label} FlashInfer vs float64", got_fi, self.expected,
                       self.bound_flashinfer, self.pos_ids)
        c_par = compare(f"{label} jaxrope vs FlashInfer", got_ours, got_fi, bound, self.pos_ids)
        failures = []
        if c_ours.violations:
            failures.append(f"jaxrope is outside its float64 bound: {c_ours}")
        off = np.abs(got_ours - got_fi) > bound
        tokens = np.nonzero(off.reshape(off.shape[0], -1).any(axis=1))[0]
        positions = np.unique(self.pos_ids[tokens])
        if len(positions) and (positions.min() < DRIFT_FREE_POSITION
                               or self.pos_ids.min() >= DRIFT_FREE_POSITION):
            failures.append(
                f"jaxrope and FlashInfer disagree at positions {positions[:8].tolist()}, which "
                f"FlashInfer's float32 drift above {DRIFT_FREE_POSITION} cannot explain (a "
                f"convention difference?): {c_par}; {c_fi}")
        return Verdict(c_ours, c_fi, c_par, int(off.sum()), positions, failures)


def warn_disagreements(verdict: Verdict, label: str) -> None:
    """Say so when the oracle had to decide (FlashInfer outside its bound, jaxrope inside)."""
    if verdict.disagreements:
        import warnings
        warnings.warn(
            f"{label}: jaxrope and FlashInfer differ beyond the derived bound at "
            f"{verdict.disagreements} elements, positions "
            f"{verdict.disagreement_positions[:8].tolist()}; the float64 oracle sides with "
            f"jaxrope ({verdict.ours_vs_oracle}); FlashInfer is outside its fast-math bound "
            f"({verdict.flashinfer_vs_oracle})")


def untouched_equal(got: np.ndarray, x: np.ndarray, rotary_dim: int) -> np.ndarray:
    """bool ``[T, H, D - R]``: dims ``[R, D)`` of ``got`` and ``x`` bit-identical."""
    width = np.dtype(x.dtype).itemsize
    as_bits = np.dtype(f"u{width}")
    return got[..., rotary_dim:].view(as_bits) == x[..., rotary_dim:].view(as_bits)


def case_inputs(case: "Case"):
    """``(batch, q, k, cos_sin_cache or None)`` of a case, from its own seed."""
    rng = np.random.default_rng(case.seed)
    batch = ragged_batch(rng, case.batch_size, case.lengths, case.bases)
    q, k = random_inputs(rng, case, len(batch.pos_ids))
    cache = None
    if case.api == "cos_sin_cache":
        cache = cos_sin_cache(case.cfg, batch.pos_ids, dense=case.dense_cache)
    return batch, q, k, cache
