"""FlashInfer parity: the error bounds both sides must meet, and the check that applies them.

Every bound is per rotated pair (the layout of :func:`pairs`), derived in the comments
and docstrings below from each side's float32 arithmetic, never tuned:

- jaxrope's angle: :data:`OURS_ANGLE_ERROR`, one constant (``jaxrope/ops/angle.py``);
- FlashInfer's angle: :func:`flashinfer_angle_error`, a function of position and pair
  (fast-math intrinsics: the bound grows with the angle);
- what both do after the angle, and the rounding to the output dtype:
  :data:`ROTATION_SLACK`, :data:`UNIT_ROUNDOFF`, :func:`output_bound`.

:class:`Reference` holds the float64 oracle (:mod:`jaxrope.testing.oracle`) of one input
and both bounds; its :meth:`Reference.check` gives a :class:`Verdict`. The cases, the
mapping onto FlashInfer's arguments and the calls are :mod:`jaxrope.testing.flashinfer`'s.
Needs numpy and jaxrope only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Mapping, Tuple

import numpy as np

import jaxrope as jr
from jaxrope.testing import oracle
from jaxrope.testing.flashinfer import flashinfer_kwargs


# Below this position no fast-math drift can explain a disagreement (the FlashInfer
# bound there is < 2e-3 rad): a disagreement is a convention difference and fails.
DRIFT_FREE_POSITION = 1 << 12


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

# jaxrope's angle (``jaxrope/ops/angle.py``): the turn count is a float32 sum of four
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
