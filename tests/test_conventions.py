"""jaxrope rotates the same pairs as FlashInfer and leaves the same dims alone.

Conventions, as FlashInfer 0.5.x defines them (``interleave`` / ``is_neox`` and
``rotary_dim``): NeoX (``interleave=False``) rotates ``(x[i], x[i + R/2])``, interleave
rotates ``(x[2i], x[2i+1])``, pair ``i`` by ``pos * f_i``; dims ``[R, D)`` pass through.

- On CPU (every CI run), from the recorded FlashInfer outputs in
  ``tests/data/flashinfer_golden.npz``: FlashInfer's untouched dims equal its input byte
  for byte (jaxrope's do too: tests/test_golden.py); every pair of jaxrope's layout is, in FlashInfer's
  output, a rotation of the same input pair (same length) by ``pos * f_i``.
- The mapping of FlashInfer's ``rope_scale`` / ``rope_theta`` / llama31 arguments onto
  jaxrope's variants gives the same frequencies.
- On the GPU (``-m gpu``), against live FlashInfer: one-hot inputs show which dims each
  dim is paired with (the output's nonzero dims), identical for FlashInfer's pos_ids,
  indptr and cos/sin-cache kernels and jaxrope's Pallas and XLA backends; special
  values (signed zeros, infinities, extremes, subnormals) in the untouched dims come
  back bit-identical.
"""

from __future__ import annotations

import itertools
import warnings

import ml_dtypes
import numpy as np
import pytest

from jaxrope.scaling import Linear, Llama3

from jaxrope.testing import flashinfer as fp
from jaxrope.testing import flashinfer_bounds as fb
from jaxrope.testing import golden
from jaxrope.testing import oracle


@pytest.mark.parametrize("rotary_dim,theta,factor", [(32, 5e5, 4.0), (96, 1e6, 2.0), (256, 2.5e4, 1.0),
                                                     (48, 1e4, 0.5)])
def test_rope_scale_is_a_linear_factor_and_rope_theta_the_base(rotary_dim, theta, factor):
    cfg = fp.parity_config(head_dim=256, rotary_dim=rotary_dim, interleave=False, theta=theta,
                           scaling=Linear(factor=factor) if factor != 1.0 else None)
    kwargs = fp.flashinfer_kwargs("pos_ids", cfg)
    assert (kwargs["rope_scale"], kwargs["rope_theta"], kwargs["rotary_dim"]) == (factor, theta,
                                                                                  rotary_dim)
    np.testing.assert_allclose(fp.flashinfer_frequencies(kwargs), cfg.serving_frequencies()[0],
                               rtol=1e-13)
    np.testing.assert_allclose(fp.flashinfer_frequencies(kwargs), oracle.serving_frequencies(cfg)[0],
                               rtol=1e-13)


@pytest.mark.parametrize("rotary_dim,theta,scaling", [
    (128, 5e5, Llama3()),
    (64, 1e6, Llama3(factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                     original_max_position=4096)),
    (96, 2e5, Llama3(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position=8192)),
])
def test_llama31_arguments_are_jaxrope_llama3(rotary_dim, theta, scaling):
    cfg = fp.parity_config(head_dim=128, rotary_dim=rotary_dim, interleave=True, theta=theta,
                           scaling=scaling)
    kwargs = fp.flashinfer_kwargs("llama31_pos_ids", cfg)
    assert kwargs["old_context_len"] == scaling.original_max_position
    ours = cfg.serving_frequencies()[0]
    np.testing.assert_allclose(fp.flashinfer_frequencies(kwargs), ours, rtol=1e-13)
    # All three regimes (kept, blended, divided) occur, so the comparison covers each.
    base = oracle.default_inv_freq(theta, rotary_dim)
    assert np.any(np.isclose(ours, base)) and np.any(np.isclose(ours, base / scaling.factor))
    assert np.any(~np.isclose(ours, base) & ~np.isclose(ours, base / scaling.factor))


def test_flashinfer_api_rejects_variants_it_cannot_express():
    cfg = fp.parity_config(head_dim=64, rotary_dim=64, interleave=False, theta=1e4,
                           scaling=Llama3())
    with pytest.raises(ValueError, match="Linear"):
        fp.flashinfer_kwargs("pos_ids", cfg)


# -- recorded FlashInfer outputs (CPU) ---------------------------------------------------

RECORDS = golden.golden_record_names()


@pytest.mark.parametrize("name", RECORDS)
def test_flashinfer_leaves_the_dims_past_rotary_dim_bit_identical(name):
    # jaxrope's side, on the same records and both backends, is asserted by
    # tests/test_golden.py::test_jaxrope_matches_recorded_flashinfer, which runs jaxrope on
    # them anyway; running it again here doubled the cost of the check.
    record = golden.golden_record(name)
    r = record.cfg.rotary_dim
    for x, theirs in ((record.q, record.q_out), (record.k, record.k_out)):
        assert fb.untouched_equal(theirs, x, r).all()
    if r < record.cfg.head_dim:
        # Partial rotary: something is left alone, and it is not the rotated part.
        assert not fb.untouched_equal(record.q_out[..., :r], record.q[..., :r], 0).all()


@pytest.mark.parametrize("name", RECORDS)
def test_flashinfer_rotates_jaxrope_pairs_by_position_times_frequency(name):
    record = golden.golden_record(name)
    cfg = record.cfg
    before = fb.pairs(np.concatenate([record.q, record.k], axis=1), cfg.rotary_dim, cfg.interleave)
    after = fb.pairs(np.concatenate([record.q_out, record.k_out], axis=1), cfg.rotary_dim,
                     cfg.interleave)
    radius_in = np.hypot(before[..., 0], before[..., 1])
    radius_out = np.hypot(after[..., 0], after[..., 1])
    inv_freq, attention = oracle.serving_frequencies(cfg)
    # Pairs of tiny length carry no angle worth measuring.
    usable = radius_in > 0.05
    assert usable.mean() > 0.9
    u = fb.UNIT_ROUNDOFF[record.dtype]
    # Each output component is rounded by at most u of itself: the pair moves by at most
    # u * its length, which changes its length by that and its angle by asin(u) < 1.01 u.
    np.testing.assert_array_less(np.abs(radius_out - attention * radius_in)[usable],
                                 (1.01 * u + 1e-5) * attention * radius_in[usable])
    turned = np.arctan2(before[..., 0] * after[..., 1] - before[..., 1] * after[..., 0],
                        before[..., 0] * after[..., 0] + before[..., 1] * after[..., 1])
    pos = record.batch.pos_ids.astype(np.float64)
    want = np.remainder(pos[:, None] * inv_freq[None, :] + np.pi, 2 * np.pi) - np.pi
    if record.api == "cos_sin_cache":
        angle_error = np.zeros_like(want)
    else:
        angle_error = fb.flashinfer_angle_error(record.kwargs, record.batch.pos_ids)
    miss = np.abs(np.remainder(turned - want[:, None, :] + np.pi, 2 * np.pi) - np.pi)
    bound = angle_error[:, None, :] + 1.01 * u + 1e-5
    assert np.all(miss[usable] <= np.broadcast_to(bound, miss.shape)[usable]), (
        f"max miss {miss[usable].max():.3g} rad")


# -- live FlashInfer (GPU) ---------------------------------------------------------------

CONVENTION_APIS = ("pos_ids", "indptr", "cos_sin_cache")


def _partner(d: np.ndarray, rotary_dim: int, interleave: bool) -> np.ndarray:
    if interleave:
        return d ^ 1
    half = rotary_dim // 2
    return np.where(d < half, d + half, d - half)


def _one_hot_inputs(head_dim: int):
    # Token t carries a single nonzero at dim t in each q head (values 1 and -3) and at
    # dim D-1-t in the k head; positions start at 1024 so every sin(pos * f) is far from
    # zero in bf16 and no rotation is the identity.
    t = np.arange(head_dim)
    q = np.zeros((head_dim, 2, head_dim), np.float32)
    q[t, 0, t], q[t, 1, t] = 1.0, -3.0
    k = np.zeros((head_dim, 1, head_dim), np.float32)
    k[t, 0, head_dim - 1 - t] = 2.0
    pos_ids = (1024 + 37 * t).astype(np.int32)
    return q, k, pos_ids


def _one_row_batches(pos_ids: np.ndarray) -> fp.Batch:
    n = len(pos_ids)
    return fp.Batch(np.arange(n + 1, dtype=np.int32), pos_ids.astype(np.int32), pos_ids)


@pytest.mark.gpu
@pytest.mark.parametrize("interleave,fraction,head_dim", list(itertools.product(
    (False, True), fp.ROTARY_FRACTIONS, fp.HEAD_DIMS)))
def test_live_flashinfer_pairs_and_untouched_dims_match_jaxrope(interleave, fraction, head_dim):
    """pos_ids, indptr and cos/sin-cache kernels of FlashInfer have their own pairing
    code (the llama31 entry points share the first two kernels)."""
    fp.require_flashinfer()
    r = fp.rotary_dim_of(head_dim, fraction)
    cfg = fp.parity_config(head_dim=head_dim, rotary_dim=r, interleave=interleave, theta=5e5,
                           scaling=Linear(factor=2.0))
    q32, k32, pos_ids = _one_hot_inputs(head_dim)
    dtype = fp.DTYPE["bfloat16"]
    q, k = q32.astype(dtype), k32.astype(dtype)
    batch = _one_row_batches(pos_ids)
    cache = fp.cos_sin_cache(cfg, pos_ids, dense=False)
    outputs = {f"flashinfer {api}": fp.run_flashinfer(api, cfg, q, k, batch, cache)
               for api in CONVENTION_APIS}
    outputs.update({f"jaxrope {b}": fp.run_jaxrope(cfg, q, k, pos_ids, b) for b in ("triton", "xla")})

    # The support each one-hot dim must spread to: itself and its partner when rotated.
    for x, index in ((q32, 0), (k32, 1)):
        hot = np.argmax(np.abs(x), axis=-1)  # [T, H]
        want = np.zeros(x.shape, bool)
        tt, hh = np.meshgrid(np.arange(x.shape[0]), np.arange(x.shape[1]), indexing="ij")
        want[tt, hh, hot] = True
        rotated = hot < r
        partner = _partner(hot, r, interleave)
        want[tt[rotated], hh[rotated], partner[rotated]] = True
        expected = oracle.rope_of(cfg, x, pos_ids)
        np.testing.assert_array_equal(expected != 0, want)
        # A sin or cos within ~1e-3 of zero may round to zero on either side (FlashInfer's
        # reduced angle can be exactly 0): those elements only must not be elsewhere.
        clear = want & (np.abs(expected) > 1e-3 * np.abs(x).max(axis=-1, keepdims=True))
        for who, out in outputs.items():
            support = np.asarray(out[index], np.float32) != 0
            wrong = (support & ~want) | (~support & clear)
            assert not wrong.any(), (
                f"{who}: [token, head, dim] {np.argwhere(wrong)[:4].tolist()} break the {r}-dim "
                f"{'interleaved' if interleave else 'NeoX'} pairing")
            kept = ~rotated
            assert np.array_equal(out[index][tt[kept], hh[kept], hot[kept]],
                                  x.astype(dtype)[tt[kept], hh[kept], hot[kept]]), who
        # Same direction of rotation: the signs agree wherever the value is clearly
        # nonzero (near-zero cosines may differ in sign within the angle error).
        reference = np.asarray(outputs["flashinfer pos_ids"][index], np.float32)
        sure = np.abs(expected) > 0.05 * np.abs(x).max(axis=-1, keepdims=True)
        for who, out in outputs.items():
            same_sign = np.sign(np.asarray(out[index], np.float32)) == np.sign(reference)
            assert same_sign[sure].all(), f"{who} and flashinfer pos_ids rotate opposite ways"

    if r == head_dim:
        return
    rng = np.random.default_rng(head_dim + r)
    for dtype_name in fp.DTYPES:
        dtype = fp.DTYPE[dtype_name]
        info = ml_dtypes.finfo(dtype)
        specials = np.array([0.0, -0.0, np.inf, -np.inf, float(info.max), -float(info.max),
                             float(info.tiny), -float(info.tiny), float(info.smallest_subnormal),
                             -float(info.smallest_subnormal), 1.5, -2.25]).astype(dtype)
        inputs = []
        for shape in (q32.shape, k32.shape):
            x = rng.standard_normal(shape).astype(dtype)
            x[..., r:] = specials[rng.integers(0, len(specials), x[..., r:].shape)]
            inputs.append(x)
        q, k = inputs
        results = {f"flashinfer {api}": fp.run_flashinfer(api, cfg, q, k, batch, cache)
                   for api in CONVENTION_APIS}
        results.update({f"jaxrope {b}": fp.run_jaxrope(cfg, q, k, pos_ids, b)
                        for b in ("triton", "xla")})
        for who, outs in results.items():
            for x, out in zip(inputs, outs):
                same = fb.untouched_equal(out, x, r)
                if who.startswith("jaxrope"):
                    assert same.all(), f"{who} changed dims past {r} ({dtype_name})"
                    continue
                # The input is the oracle of an untouched dim. FlashInfer copies it through
                # float32 registers: a flush of subnormals (fast math) is reported, any
                # other change fails.
                tail = np.abs(np.asarray(x[..., r:], np.float32))
                subnormal = (tail > 0) & (tail < float(info.tiny))
                assert same[~subnormal].all(), (
                    f"{who} changed values past dim {r} ({dtype_name}): "
                    f"{x[..., r:][~same][:4]} -> {out[..., r:][~same][:4]}")
                if not same[subnormal].all():
                    warnings.warn(f"{who} flushes {dtype_name} subnormals in the untouched dims "
                                  f"past {r}; jaxrope keeps them (the input is right)")
