"""apply_rope_and_append_kv on the H200 against FlashInfer 0.5.x on the same inputs.

A ragged batch of requests (1 to 204 tokens appended to 0 to 1023 cached ones, pages
drawn at random) goes through FlashInfer's unfused pair, ``apply_rope_pos_ids_inplace``
then ``append_paged_kv_cache`` (bf16 / fp16), or its fused
``rope_quantize_fp8_append_paged_kv_cache`` (fp8 e4m3 cache), and through
``jaxrope.apply_rope_and_append_kv`` (Pallas kernel and XLA, jitted with q and the cache
donated) with the same page tables as slots (``jaxrope.testing.flashinfer_kv``) plus
padding tokens at slot -1 that FlashInfer never sees.

- q and the k rows written: FlashInfer's position-dependent parity bound
  (``jaxrope.testing.flashinfer_bounds.Reference``, positions up to ~2**20), dims past
  ``rotary_dim`` bit-identical to the input.
- v rows: bit-identical on both sides (a copy, or the same scale-and-saturate
  conversion for fp8).
- fp8 k rows: within one e4m3 ulp of FlashInfer's (it rotates with a float32 cos/sin
  table, we with the accurate angle; they round the same float32 product).
- fp8 q (``q_dtype=float8_e4m3fn``, ``q_quant_scale``): within one e4m3 ulp of the q
  FlashInfer's fused op quantizes (``quant_scale_q``), as for the k rows.
- Every cache entry no token names (padding included): bit-identical to before.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.scaling import Linear
from jaxrope.testing import flashinfer as fp
from jaxrope.testing import flashinfer_bounds as fb
from jaxrope.testing import flashinfer_kv, kv_oracle

pytestmark = pytest.mark.gpu

BACKENDS = ("triton", "xla")
# (head_dim, rotary_dim, interleave, q_heads, k_heads)
ROPES = ((128, 128, False, 32, 8), (128, 64, False, 8, 2), (64, 64, True, 5, 1),
         (256, 128, True, 4, 4))
FP8_ROPES = ((128, 128, False, 32, 8), (128, 64, False, 8, 2), (64, 64, True, 5, 1))


def _cases(ropes, dtypes):
    for i, (layout, page_size, dtype) in enumerate(itertools.product(("NHD", "HND"), (1, 16),
                                                                     dtypes)):
        yield (layout, page_size, dtype, *ropes[i % len(ropes)])


CASES = list(_cases(ROPES, fp.DTYPES))
FP8_CASES = list(_cases(FP8_ROPES, fp.DTYPES))


def _id(case):
    layout, page_size, dtype, d, r, interleave, hq, hk = case
    return f"{layout}-p{page_size}-{dtype}-d{d}-r{r}-{'gptj' if interleave else 'neox'}-h{hq}x{hk}"


def _setup(case, seed: int, fp8: bool):
    layout, page_size, dtype, head_dim, rotary_dim, interleave, q_heads, k_heads = case
    cfg = fp.parity_config(head_dim=head_dim, rotary_dim=rotary_dim, interleave=interleave,
                           theta=5e5, scaling=Linear(factor=2.0))
    x = flashinfer_kv.append_inputs(np.random.default_rng(seed), layout, page_size,
                                    fp.DTYPE[dtype], head_dim, q_heads, k_heads, fp8)
    return cfg, x.batch, x.q, x.k, x.v, x.pos, x.slots, x.old, x.tokens, x.written(layout)


_JITTED = {}


def _ours(cfg, q, k, v, pos_ids, slots, cache, layout, backend, scales):
    key = (backend, tuple(scales))
    if key not in _JITTED:
        _JITTED[key] = jax.jit(
            lambda q, k, v, p, c, s, cfg, layout: jr.apply_rope_and_append_kv(
                q, k, v, p, c, s, cfg, layout=layout, backend=backend, **scales),
            # An fp8 q is a new array: q is only read then, and only the cache donated.
            static_argnums=(6, 7), donate_argnums=(4,) if "q_dtype" in scales else (0, 4))
    q_out, (k_cache, v_cache) = _JITTED[key](
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos_ids),
        tuple(jnp.asarray(c) for c in cache), jnp.asarray(slots), cfg, layout)
    return np.asarray(q_out), np.asarray(k_cache), np.asarray(v_cache)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_fused_append_matches_flashinfer_rope_then_append(case, device, flashinfer,
                                                          record_property):
    layout, _, dtype = case[:3]
    cfg, batch, q, k, v, pos, slots, old, t, (page, entry, mask) = _setup(
        case, CASES.index(case), fp8=False)
    r = cfg.rotary_dim
    fi_q, fi_k, fi_v = flashinfer_kv.run_rope_then_append(
        cfg, q[:t], k[:t], v[:t], pos[:t], batch, *old, layout)
    q_ref = fb.Reference(cfg, "pos_ids", dtype, q[:t], pos[:t])
    k_ref = fb.Reference(cfg, "pos_ids", dtype, k[:t], pos[:t])
    fi_rows = kv_oracle.rows(fi_k, layout, page, entry)
    assert fb.untouched_equal(fi_rows, k[:t], r).all(), "FlashInfer changed k[..., R:]"
    for backend in BACKENDS:
        ours_q, ours_k, ours_v = _ours(cfg, q, k, v, pos, slots, old, layout, backend, {})
        rows = kv_oracle.rows(ours_k, layout, page, entry)
        for label, ref, got, theirs, x in (("q", q_ref, ours_q[:t], fi_q, q[:t]),
                                           ("k cache", k_ref, rows, fi_rows, k[:t])):
            verdict = ref.check(got, theirs, f"{label} {backend}")
            record_property(f"{label} {backend} jaxrope_err_over_bound",
                            round(verdict.ours_vs_oracle.worst_ratio, 4))
            assert not verdict.failures, "\n".join(verdict.failures + [verdict.summary()])
            assert fb.untouched_equal(got, x, r).all(), f"{backend} changed {label}[..., {r}:]"
            fb.warn_disagreements(verdict, f"{_id(case)} {label} {backend}")
        np.testing.assert_array_equal(kv_oracle.bits(kv_oracle.rows(ours_v, layout, page, entry)),
                                      kv_oracle.bits(v[:t]), err_msg=f"{backend}: v rows")
        np.testing.assert_array_equal(kv_oracle.bits(ours_v), kv_oracle.bits(fi_v), err_msg=f"{backend}: v cache")
        for label, new, prev in (("k cache", ours_k, old[0]), ("v cache", ours_v, old[1]),
                                 ("FlashInfer k cache", fi_k, old[0])):
            kv_oracle.assert_untouched(f"{backend} {label}", new, prev, mask)


@pytest.mark.parametrize("case", FP8_CASES, ids=_id)
def test_fp8_append_matches_flashinfers_fused_fp8_op(case, device, flashinfer, record_property):
    layout = case[0]
    scale_q, scale_kv = 0.8, 0.37
    cfg, batch, q, k, v, pos, slots, old, t, (page, entry, mask) = _setup(
        case, 100 + FP8_CASES.index(case), fp8=True)
    fi_q, fi_k, fi_v = flashinfer_kv.run_fp8_fused(cfg, q[:t], k[:t], v[:t], pos[:t], batch, *old,
                                                   layout, scale_q, scale_kv)
    fi_rows = kv_oracle.rows(fi_k, layout, page, entry)
    assert (np.abs(fi_rows.astype(np.float32)) == 448).any(), "the case should saturate"
    scales = {"k_quant_scale": scale_kv, "v_quant_scale": scale_kv}
    for backend in BACKENDS:
        ours_q, ours_k, ours_v = _ours(cfg, q, k, v, pos, slots, old, layout, backend, scales)
        rows = kv_oracle.rows(ours_k, layout, page, entry)
        distance = kv_oracle.ulps(rows, fi_rows)
        record_property(f"{backend} k rows identical to FlashInfer", float((distance == 0).mean()))
        assert distance.max() <= 1, f"{backend}: k rows {distance.max()} e4m3 ulps from FlashInfer"
        assert (distance == 0).mean() > 0.99
        np.testing.assert_array_equal(kv_oracle.bits(ours_v), kv_oracle.bits(fi_v), err_msg=f"{backend}: v cache")
        # FlashInfer also quantizes q; ours stays in q's dtype: quantized here, the two
        # differ by at most the double rounding (bf16, then e4m3).
        q_fp8 = kv_oracle.e4m3(ours_q[:t].astype(np.float64) * scale_q)
        assert kv_oracle.ulps(q_fp8, fi_q).max() <= 1, f"{backend}: q"
        for label, new, prev in (("k cache", ours_k, old[0]), ("v cache", ours_v, old[1]),
                                 ("FlashInfer k cache", fi_k, old[0])):
            kv_oracle.assert_untouched(f"{backend} {label}", new, prev, mask)


@pytest.mark.parametrize("case", FP8_CASES, ids=_id)
def test_fp8_q_matches_the_q_flashinfers_fused_fp8_op_quantizes(case, device, flashinfer,
                                                                 record_property):
    layout = case[0]
    scale_q, scale_kv = 0.8, 0.37
    cfg, batch, q, k, v, pos, slots, old, t, _ = _setup(case, 100 + FP8_CASES.index(case),
                                                        fp8=True)
    fi_q, _, _ = flashinfer_kv.run_fp8_fused(cfg, q[:t], k[:t], v[:t], pos[:t], batch, *old,
                                             layout, scale_q, scale_kv)
    scales = {"k_quant_scale": scale_kv, "v_quant_scale": scale_kv,
              "q_dtype": jnp.float8_e4m3fn, "q_quant_scale": scale_q}
    for backend in BACKENDS:
        ours_q, _, _ = _ours(cfg, q, k, v, pos, slots, old, layout, backend, scales)
        assert ours_q.dtype == kv_oracle.E4M3, f"{backend}: q_out is {ours_q.dtype}"
        distance = kv_oracle.ulps(ours_q[:t], fi_q)
        record_property(f"{backend} fp8 q identical to FlashInfer", float((distance == 0).mean()))
        assert distance.max() <= 1, f"{backend}: fp8 q {distance.max()} e4m3 ulps from FlashInfer"
        assert (distance == 0).mean() > 0.99
