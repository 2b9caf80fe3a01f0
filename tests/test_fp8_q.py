"""fp8 q from the fused append: ``apply_rope_and_append_kv(..., q_dtype=jnp.float8_e4m3fn,
q_quant_scale=s)``.

- q_out is a new ``float8_e4m3fn`` array within one e4m3 ulp of ``e4m3(clip(rope(q) * s))``
  of the float64 oracle, every dim (those past ``rotary_dim`` scaled and quantized too),
  the cache exactly what the same call without fp8 q writes, and q itself only read;
- the scale multiplies (FlashInfer's ``quant_scale_q``) and saturates at +-448, may be
  traced, and composes with QK-norm (normalise, rotate, scale, one rounding);
- ``q_dtype=None`` and q's own dtype are today's call, bit for bit;
- refusals at the boundary name the argument, the value and what it must be.

The kernel backends ("interpret" here; the Mosaic GPU kernel in its interpreter on JAX
0.11) run the same checks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import APPEND_BY_NAME, MROPE_APPEND_CASES
from jaxrope.ops import backends, mosaic_common
from jaxrope.ops.rope_append_kv import api as kv_api
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_inputs import make_inputs
from jaxrope.testing.kv_oracle import bits, split
from test_qk_norm import QWEN3, _norm_oracle, _weight

FP8 = jnp.dtype(jnp.float8_e4m3fn)
TOLERANCE = oracle.RELATIVE_TOLERANCE["bfloat16"]
BACKENDS = ("xla", "interpret")
MROPE_BY_NAME = {c.name: c for c in MROPE_APPEND_CASES}
CASES = [APPEND_BY_NAME[name] for name in (
    "llama3_nhd_p16", "partial_half_fp8_hnd_combined", "gptj_fp8_nhd_p1",
    "neox_quarter_nhd_combined", "decode_d64_nhd_one_token", "yarn_all_padding")] + [
    MROPE_BY_NAME["qwen3_vl_interleaved_hnd_combined"]]
# Each combination compiles twice (with and without fp8 q): a few run by default (full
# and partial rotary, an fp8 cache, one kernel), the rest (M-RoPE too) with --run-slow.
DEFAULT = {("llama3_nhd_p16", "bfloat16", "xla"), ("partial_half_fp8_hnd_combined", "bfloat16",
                                                    "xla"),
           ("partial_half_fp8_hnd_combined", "bfloat16", "interpret")}
DTYPE_CASES = [pytest.param(case, dtype, backend, id=f"{case.name}-{dtype}-{backend}",
                            marks=() if (case.name, dtype, backend) in DEFAULT else pytest.mark.slow)
               for case, dtype in [(c, "bfloat16") for c in CASES] + [
                   (APPEND_BY_NAME["partial_half_fp8_hnd_combined"], d) for d in ("float32",
                                                                                  "float16")]
               for backend in BACKENDS]

fused = jax.jit(jr.apply_rope_and_append_kv,
                static_argnames=("cfg", "layout", "backend", "q_dtype"))


def _call(x, case, backend, op=fused, **fp8_q):
    """The jitted ``op`` on ``x``."""
    return op(x.q, x.k, x.v, jnp.asarray(x.pos), x.kv_cache, jnp.asarray(x.slots),
              cfg=case.case.cfg, layout=case.layout, backend=backend, **x.scales, **fp8_q)


def _want(cfg, q, pos, scale) -> np.ndarray:
    """The float64 oracle's rotated q, scaled and stored as e4m3."""
    return kv_oracle.e4m3(oracle.rope_of(cfg, q, pos) * scale)


def _assert_fp8_q(q_out, want, label: str) -> None:
    assert q_out.dtype == FP8 and q_out.shape == want.shape, (q_out.dtype, q_out.shape)
    worst = kv_oracle.ulps(np.asarray(q_out), want).max(initial=0)
    assert worst <= 1, f"{label}: fp8 q {worst} e4m3 ulps from the oracle"


@pytest.mark.parametrize("case, dtype, backend", DTYPE_CASES)
def test_fp8_q_is_the_scaled_rotation_within_an_e4m3_ulp(case, dtype, backend, rng):
    x = make_inputs(rng, case, jnp.dtype(dtype))
    q_before = bits(x.q).copy()
    q_out, kv_out = _call(x, case, backend, q_dtype=FP8, q_quant_scale=0.75)
    _assert_fp8_q(q_out, _want(case.case.cfg, x.q, x.pos, 0.75), case.name)
    # The cache does not depend on q's output dtype; q is only read.
    _, kv_plain = _call(x, case, backend)
    for got, want in zip(split(kv_out), split(kv_plain)):
        np.testing.assert_array_equal(bits(got), bits(want), err_msg="the cache")
    np.testing.assert_array_equal(bits(x.q), q_before, err_msg="q changed")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_q_scale_multiplies_then_saturates(backend, rng):
    case = APPEND_BY_NAME["partial_half_fp8_hnd_combined"]
    x = make_inputs(rng, case, jnp.bfloat16)
    for scale in (1e5, 1e-3):
        q_out, _ = _call(x, case, backend, q_dtype=FP8, q_quant_scale=scale)
        _assert_fp8_q(q_out, _want(case.case.cfg, x.q, x.pos, scale), f"scale {scale}")
        magnitude = np.abs(np.asarray(q_out, np.float64))
        assert np.isfinite(magnitude).all()
        if scale > 1:  # |q| > 448 / 1e5 for all but ~0.4% of N(0, 1) values
            assert (magnitude == 448).mean() > 0.98, "q * 1e5 saturates (not NaN)"
        else:
            assert magnitude.max() < 0.01, "q * 1e-3 shrinks (a divide would grow it)"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_q_after_qk_norm_is_normalised_rotated_scaled_and_rounded_once(backend, rng):
    cfg = jr.RopeConfig(head_dim=128, theta=1e6, max_position=1 << 20)
    tokens, q_heads, k_heads = 9, 4, 2
    q = jnp.asarray(3 * rng.standard_normal((tokens, q_heads, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((tokens, k_heads, 128)), jnp.bfloat16) for _ in "kv")
    q_w, k_w = (_weight(rng, QWEN3, h, 128, jnp.bfloat16) for h in (q_heads, k_heads))
    pos = rng.integers(0, 1 << 20, tokens).astype(np.int32)
    cache = tuple(jnp.zeros((2, 16, k_heads, 128), jnp.bfloat16) for _ in "kv")
    slots = jnp.asarray(rng.permutation(32)[:tokens], jnp.int32)
    step = jax.jit(jr.apply_rope_and_append_kv,
                   static_argnames=("cfg", "qk_norm", "q_dtype", "backend"))
    q_out, _ = step(q, k, v, jnp.asarray(pos), cache, slots, cfg, q_norm_weight=q_w,
                    k_norm_weight=k_w, qk_norm=QWEN3, q_dtype=jnp.float8_e4m3fn,
                    q_quant_scale=40.0, backend=backend)
    _assert_fp8_q(q_out, _want(cfg, _norm_oracle(q, q_w, QWEN3), pos, 40.0), "normalised q")


def test_q_dtype_none_and_qs_own_dtype_are_the_plain_call(rng):
    q = jnp.zeros((2, 1, 8), jnp.float16)
    # Every spelling of "q's dtype" reaches the kernel as None: today's call exactly.
    assert [kv_api._q_dtype(given, q) for given in (None, jnp.float16, "float16",
                                                    np.dtype(np.float16))] == [None] * 4
    assert kv_api._q_dtype("float8_e4m3fn", q) == kv_api._q_dtype(jnp.float8_e4m3fn, q) == FP8
    case = APPEND_BY_NAME["neox_quarter_nhd_combined"]
    x = make_inputs(rng, case, jnp.float16)
    plain, own = (_call(x, case, "xla", **given) for given in ({}, {"q_dtype": "float16"}))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(own)):
        assert a.dtype == b.dtype and np.array_equal(bits(a), bits(b))


def test_a_traced_q_scale_and_a_donated_cache_leave_q_usable(rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    cfg = case.case.cfg
    # The scale as a jit argument (traced: checked by the caller), the cache donated, q not.
    step = jax.jit(functools.partial(jr.apply_rope_and_append_kv, cfg=cfg,
                                     q_dtype="float8_e4m3fn"), donate_argnums=4)
    q_out, (k_cache, _) = step(x.q, x.k, x.v, jnp.asarray(x.pos), x.kv_cache,
                               jnp.asarray(x.slots), q_quant_scale=jnp.float32(2.5))
    _assert_fp8_q(q_out, _want(cfg, x.q, x.pos, 2.5), "traced scale")
    written, page, entry = kv_oracle.entries(x.slots, case.pages, case.page_size)
    k_rows = kv_oracle.rows(np.asarray(k_cache), case.layout, page[written], entry[written])
    assert oracle.relative_error(k_rows, oracle.rope_of(cfg, x.k, x.pos)[written]) < TOLERANCE
    assert np.isfinite(np.asarray(x.q, np.float32)).all()  # q was not donated: still readable


BAD = {
    "another float dtype": (dict(q_dtype=jnp.float16), ValueError,
                            "q_dtype=float16 must be None, q's dtype (bfloat16) or float8_e4m3fn"),
    "e5m2": (dict(q_dtype="float8_e5m2"), ValueError, "q_dtype=float8_e5m2 must be None"),
    "not a dtype": (dict(q_dtype="fp8"), TypeError, "q_dtype='fp8' must be None, q's dtype"),
    "a number": (dict(q_dtype=8), TypeError, "q_dtype=8 must be None"),
    "scale without fp8 q": (dict(q_quant_scale=0.5), ValueError,
                            "q_quant_scale=0.5 applies only to q_dtype=float8_e4m3fn"),
    "scale for q's own dtype": (dict(q_dtype=jnp.bfloat16, q_quant_scale=2.0), ValueError,
                                "q_quant_scale=2.0 applies only to q_dtype=float8_e4m3fn"),
    "zero scale": (dict(q_dtype=FP8, q_quant_scale=0.0), ValueError,
                   "q_quant_scale=0.0 must be finite and > 0"),
    "negative scale": (dict(q_dtype=FP8, q_quant_scale=-1.0), ValueError,
                       "q_quant_scale=-1.0 must be finite and > 0"),
    "NaN scale": (dict(q_dtype=FP8, q_quant_scale=jnp.float32(np.nan)), ValueError,
                  "q_quant_scale=nan must be finite and > 0"),
    "infinite scale": (dict(q_dtype=FP8, q_quant_scale=np.inf), ValueError,
                       "q_quant_scale=inf must be finite and > 0"),
    # > 0 as a float64 but 0 or inf as the float32 the kernels read.
    "scale 0 as a float32": (dict(q_dtype=FP8, q_quant_scale=1e-46), ValueError,
                             "q_quant_scale=1e-46 must be finite and > 0 as the float32"),
    "subnormal float32 scale": (dict(q_dtype=FP8, q_quant_scale=np.float32(1e-40)), ValueError,
                                "must be finite and > 0 as the float32 the kernels read"),
    "scale inf as a float32": (dict(q_dtype=FP8, q_quant_scale=1e39), ValueError,
                               "q_quant_scale=1e+39 must be finite and > 0 as the float32"),
    "a vector of scales": (dict(q_dtype=FP8, q_quant_scale=jnp.ones(2)), ValueError,
                           "q_quant_scale.shape=(2,) must be ()"),
    "a string scale": (dict(q_dtype=FP8, q_quant_scale="2"), TypeError,
                       "q_quant_scale must be a float or a scalar array, got str"),
    "a bool scale": (dict(q_dtype=FP8, q_quant_scale=True), TypeError,
                     "q_quant_scale must be a float or a scalar array, got bool"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_fp8_q_arguments_are_refused_naming_them(name, rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    # numpy inputs: a refusal must leave every one as it was.
    given = [np.asarray(a) for a in (x.q, x.k, x.v, *x.kv_cache)]
    before = [a.copy() for a in given]
    changes, error, fragment = BAD[name]
    with pytest.raises(error) as raised:
        jr.apply_rope_and_append_kv(*given[:3], x.pos, tuple(given[3:]), x.slots, case.case.cfg,
                                    **changes)
    assert fragment in str(raised.value), str(raised.value)
    for now, then in zip(given, before):
        np.testing.assert_array_equal(bits(now), bits(then))


MOSAIC_MISSING = mosaic_common.unavailable()


@pytest.mark.skipif(MOSAIC_MISSING is not None, reason=str(MOSAIC_MISSING))
@pytest.mark.parametrize("name", ["llama3_fp8_nhd", "partial_half_fp8_hnd_combined"])
def test_the_mosaic_kernel_in_its_interpreter_through_the_api(name, monkeypatch, rng):
    # The api's own argument building ([3] scales, the cache views) with the Mosaic GPU
    # kernel body in its interpreter standing in for the XLA backend.
    from jaxrope.ops.rope_append_kv.mosaic import rope_append_kv_mosaic
    monkeypatch.setitem(backends.IMPLEMENTATIONS["rope_append_kv"], "xla",
                        functools.partial(rope_append_kv_mosaic, interpret=True))
    # A jit of its own: the module's would reuse a trace of the XLA backend.
    op = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "layout", "backend",
                                                               "q_dtype"))
    case = APPEND_BY_NAME[name]
    x = make_inputs(rng, case, jnp.bfloat16)
    q_plain, kv_plain = _call(x, case, "xla", op)
    assert oracle.relative_error(q_plain, oracle.rope_of(case.case.cfg, x.q, x.pos)) < TOLERANCE
    q_out, kv_out = _call(x, case, "xla", op, q_dtype=FP8, q_quant_scale=0.75)
    _assert_fp8_q(q_out, _want(case.case.cfg, x.q, x.pos, 0.75), name)
    for got, want in zip(split(kv_out), split(kv_plain)):
        np.testing.assert_array_equal(bits(got), bits(want), err_msg="the cache")
