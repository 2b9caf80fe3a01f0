"""jaxrope (Pallas and XLA backends, on the GPU) against FlashInfer 0.5.x on the same inputs.

Every case calls one FlashInfer in-place API on a ragged batch (1, 19 or 99 sequences of
1/4/19/204 tokens at offsets 0/15/99 on bases up to 2**20 - 302, so positions reach
2**20), then jaxrope with the equivalent :class:`jaxrope.RopeConfig`
(``rope_scale`` -> ``Linear(factor=rope_scale)``, llama31 -> ``Llama3(...)``, see
``jaxrope/testing/flashinfer.py``). ``rope_scale`` and ``rope_theta`` are never FlashInfer's
defaults (1, 1e4).

Tolerances are functions of position, derived in ``jaxrope/testing/flashinfer_bounds.py``:

- jaxrope vs the float64 oracle: the output dtype's half ulp plus a 2**-17 rad angle
  error (jaxrope's exact-turn angle), at every position: tight;
- FlashInfer vs the float64 oracle: the same rounding plus FlashInfer's fast-math angle
  error bound, ``theta * (eps_f + 3.68 * 2**-24) + 2**-21.19`` with ``theta = pos * f``
  (float32 product, ``__powf`` frequency, ``__sincosf`` range reduction), which grows
  with position;
- jaxrope vs FlashInfer: the sum of the two (triangle inequality through the oracle).

Where jaxrope and FlashInfer differ by more, the float64 oracle decides who is right and
the test says so: a warning naming the positions and both errors when FlashInfer is the
one off (allowed only where its drift can explain it, above 2**12), a failure when
jaxrope is, or when they differ at low positions (a convention difference).
The dims past ``rotary_dim`` must be bit-identical to the input on both sides.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxrope.scaling import Linear, Llama3, Yarn

from jaxrope.testing import flashinfer as fp
from jaxrope.testing import flashinfer_bounds as fb
from jaxrope.testing import oracle

pytestmark = pytest.mark.gpu

# (rope_scale, rope_theta): never FlashInfer's defaults (1, 1e4).
SCALES = ((4.0, 5e5), (2.0, 1e6), (1.5, 2.5e4))
# Llama 3.1-style settings away from FlashInfer's defaults (8, 5e5, 1, 4, 8192).
LLAMA = ((Llama3(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                 original_max_position=4096), 1e6),
         (Llama3(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position=8192), 2e5))
# The cos/sin cache carries any variant, attention factor included.
CACHE_SCALINGS = (None, Linear(factor=4.0),
                  Llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position=8192),
                  Yarn(factor=4.0, original_max_position=32768))
HEADS = ((4, 2), (5, 1), (2, 2))
BACKENDS = ("triton", "xla")


def _layout(interleave: bool) -> str:
    return "interleave" if interleave else "neox"


def _case(i: int, api: str, interleave: bool, fraction: float, head_dim: int, dtype: str,
          scaling, theta: float, **extra) -> fp.Case:
    rotary_dim = fp.rotary_dim_of(head_dim, fraction)
    cfg = fp.parity_config(head_dim=head_dim, rotary_dim=rotary_dim, interleave=interleave,
                           theta=theta, scaling=scaling)
    batch_size = extra.pop("batch_size", fp.BATCH_SIZES[i % len(fp.BATCH_SIZES)])
    q_heads, k_heads = HEADS[i % len(HEADS)]
    name = (f"{api}-{_layout(interleave)}-d{head_dim}-r{rotary_dim}-{dtype}-b{batch_size}"
            f"-{type(scaling).__name__ if scaling is not None else 'default'}")
    return fp.Case(name=name, api=api, cfg=cfg, dtype=dtype, batch_size=batch_size,
                   q_heads=q_heads, k_heads=k_heads, seed=1000 + i, **extra)


def _pos_ids_cases():
    # The full convention matrix: layout x rotary fraction x head_dim x dtype.
    for i, (interleave, fraction, head_dim, dtype) in enumerate(itertools.product(
            (False, True), fp.ROTARY_FRACTIONS, fp.HEAD_DIMS, fp.DTYPES)):
        scale, theta = SCALES[i % len(SCALES)]
        yield _case(i, "pos_ids", interleave, fraction, head_dim, dtype, Linear(factor=scale),
                    theta)


def _indptr_cases():
    for i, (interleave, head_dim, dtype) in enumerate(itertools.product(
            (False, True), fp.HEAD_DIMS, fp.DTYPES)):
        scale, theta = SCALES[i % len(SCALES)]
        yield _case(i, "indptr", interleave, fp.ROTARY_FRACTIONS[i % 4], head_dim, dtype,
                    Linear(factor=scale), theta)


def _llama_cases():
    for i, (interleave, head_dim, dtype) in enumerate(itertools.product(
            (False, True), fp.HEAD_DIMS, fp.DTYPES)):
        scaling, theta = LLAMA[i % len(LLAMA)]
        yield _case(i, "llama31_pos_ids", interleave, fp.ROTARY_FRACTIONS[(i + 1) % 4], head_dim,
                    dtype, scaling, theta)
    for i, (interleave, dtype) in enumerate(itertools.product((False, True), fp.DTYPES)):
        scaling, theta = LLAMA[i % len(LLAMA)]
        yield _case(i, "llama31_indptr", interleave, fp.ROTARY_FRACTIONS[(i + 2) % 4],
                    fp.HEAD_DIMS[i % 3], dtype, scaling, theta)


def _cache_cases():
    for i, (interleave, head_dim, dtype) in enumerate(itertools.product(
            (False, True), fp.HEAD_DIMS, fp.DTYPES)):
        # Every other case uses FlashInfer's usual dense table over positions from 0
        # (bases kept at 0 so the table stays small), the others a row per position.
        dense = i % 2 == 0
        yield _case(i, "cos_sin_cache", interleave, fp.ROTARY_FRACTIONS[(i + 3) % 4], head_dim,
                    dtype, CACHE_SCALINGS[i % len(CACHE_SCALINGS)], SCALES[i % 3][1],
                    dense_cache=dense, bases=(0,) if dense else fp.BASES)


CASES = [*_pos_ids_cases(), *_indptr_cases(), *_llama_cases(), *_cache_cases()]


def test_the_cases_cover_the_issue_matrix():
    assert {c.api for c in CASES} == set(fp.APIS)
    assert {c.batch_size for c in CASES} == set(fp.BATCH_SIZES)
    for api in fp.APIS:
        cases = [c for c in CASES if c.api == api]
        assert {c.cfg.interleave for c in cases} == {False, True}, api
        assert {c.dtype for c in cases} == set(fp.DTYPES), api
        assert {c.cfg.rotary_dim / c.cfg.head_dim for c in cases} == set(fp.ROTARY_FRACTIONS), api
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_jaxrope_matches_flashinfer(case, flashinfer, record_property):
    batch, q, k, cache = fp.case_inputs(case)
    flashinfer_out = fp.run_flashinfer(case.api, case.cfg, q, k, batch, cache)
    ours = {b: fp.run_jaxrope(case.cfg, q, k, batch.pos_ids, b) for b in BACKENDS}
    r = case.cfg.rotary_dim
    for i, (x, tensor) in enumerate(((q, "q"), (k, "k"))):
        theirs = flashinfer_out[i]
        assert fb.untouched_equal(theirs, x, r).all(), f"FlashInfer changed {tensor}[..., {r}:]"
        reference = fb.Reference(case.cfg, case.api, case.dtype, x, batch.pos_ids)
        for backend, out in ours.items():
            label = f"{tensor} {backend}"
            verdict = reference.check(out[i], theirs, label)
            record_property(f"{label} flashinfer_err_over_bound",
                            round(verdict.flashinfer_vs_oracle.worst_ratio, 4))
            record_property(f"{label} jaxrope_err_over_bound",
                            round(verdict.ours_vs_oracle.worst_ratio, 4))
            assert not verdict.failures, "\n".join(verdict.failures + [verdict.summary()])
            assert fb.untouched_equal(out[i], x, r).all(), f"jaxrope {backend} changed {tensor}[..., {r}:]"
            fb.warn_disagreements(verdict, f"{case.name} {label}")


def test_flashinfer_drifts_with_position_and_jaxrope_does_not(flashinfer, record_property):
    """The reason for position-dependent tolerances, measured: relative error vs float64
    of FlashInfer grows with position, jaxrope's stays at the bf16 rounding floor."""
    cfg = fp.parity_config(head_dim=128, rotary_dim=128, interleave=False, theta=1e4)
    rng = np.random.default_rng(7)
    bands = ((0, 1 << 12), (1 << 16, 1 << 17), ((1 << 20) - 4096, 1 << 20))
    rel = {}
    for low, high in bands:
        pos_ids = rng.integers(low, high, 2048).astype(np.int32)
        batch = fp.Batch(np.array([0, 2048], np.int32), np.zeros(1, np.int32), pos_ids)
        case = fp.Case("drift", "pos_ids", cfg, "bfloat16", 1, q_heads=8, k_heads=1)
        q, k = fp.random_inputs(rng, case, 2048)
        expected = oracle.rope_of(cfg, q, pos_ids)
        theirs = fp.run_flashinfer("pos_ids", cfg, q, k, batch)[0]
        ours = fp.run_jaxrope(cfg, q, k, pos_ids, "triton")[0]
        rel[high] = tuple(float(np.linalg.norm(np.asarray(got, np.float64) - expected)
                                / np.linalg.norm(expected)) for got in (theirs, ours))
        record_property(f"relative error below {high}: flashinfer, jaxrope", rel[high])
    # bf16 rounding alone gives ~1.5e-3 relative (half-ulp 2**-8, uniform): both sides
    # meet it near position 0; at 2**20 FlashInfer's float32 angle has drifted past it.
    (fi_low, ours_low), (fi_high, ours_high) = rel[1 << 12], rel[1 << 20]
    assert ours_low < 2.5e-3 and fi_low < 2.5e-3, rel
    assert ours_high < 2.5e-3, rel
    assert fi_high > 2 * ours_high, rel
