"""The Triton-lowered append kernel's per-head QK-norm and fp8 q, its body in the Pallas
interpreter (CPU), against the float64 oracle and the XLA reference.

- Cases (:data:`SPECS`): Qwen3-like (Hq 4, Hk 2, D 128) in bf16 with bf16 weights,
  Gemma's ``1 + w`` with partial rotary, interleaved pairs with only k normalised and an
  fp8 q, M-RoPE with only q normalised, an fp8 cache with an fp8 q; padding
  slots (-1, and one past the cache) in every case; both cache forms and layouts.
- The oracle: the norm written from its formula in float64, then
  :func:`jaxrope.testing.oracle.rope_of`; fp8 outputs within one e4m3 ulp of its value
  quantised, the others within the dtype's tolerance.
- The XLA reference (:func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`;
  an fp8 q quantised from its float32 rotation by the same ``to_cache_dtype``).
- The call's structure: q aliased to the output unless fp8, the caches aliased after
  the weights; ``scales [2]`` still serving a q kept in its dtype.
- Refusals: a per-token norm (stated why), an fp8 q without its scale, another q dtype.

The compiled kernel runs in tests/gpu/; the CUDA lowering and the export with the new
operands in tests/test_kv_export_norm.py.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.ops.rope.reference import rope_reference
from jaxrope.ops.rope_append_kv import api as kv_api
from jaxrope.ops.rope_append_kv import triton as triton_append
from jaxrope.ops.rope_append_kv.reference import rope_append_kv_reference, to_cache_dtype
from jaxrope.qk_norm import normalize
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_oracle import bits, split
from test_qk_norm import _norm_oracle

FP8 = jnp.dtype(jnp.float8_e4m3fn)
PAGES, PAGE_SIZE = 3, 4
QWEN3 = jr.QKNorm(eps=1e-6)
GEMMA = jr.QKNorm(eps=1e-6, convention="gemma")
# k, v, q: v saturates past |v| ~ 3, q past |x| ~ 11 (an unnormalised q of N(0, 9) does).
SCALES = (0.75, 150.0, 40.0)


@dataclasses.dataclass(frozen=True)
class Spec:
    cfg: jr.RopeConfig
    dtype: object
    qk_norm: Optional[jr.QKNorm] = None
    norm_q: bool = False
    norm_k: bool = False
    weight_dtype: object = jnp.float32
    layout: str = "NHD"
    combined: bool = False
    fp8_cache: bool = False
    fp8_q: bool = False
    num_scales: int = 3  # 2: the scales of today's callers, for a q kept in its dtype
    tokens: int = 5
    q_heads: int = 4
    k_heads: int = 2


SPECS = {
    "qwen3_bf16": Spec(jr.RopeConfig(head_dim=128, theta=1e6), jnp.bfloat16, QWEN3, True, True,
                       jnp.bfloat16, num_scales=2),
    "gemma_partial_hnd_combined": Spec(jr.RopeConfig(head_dim=64, rotary_dim=32), jnp.float32,
                                       GEMMA, True, True, layout="HND", combined=True),
    # q not normalised but quantised: its passthrough dims scaled and stored too.
    "interleave_k_only_f16_fp8_q": Spec(jr.RopeConfig(head_dim=64, rotary_dim=32, interleave=True),
                                        jnp.float16, QWEN3, False, True, jnp.bfloat16,
                                        layout="HND", fp8_q=True),
    "mrope_q_only_combined": Spec(jr.RopeConfig(head_dim=128, mrope_section=(16, 24, 24)),
                                  jnp.bfloat16, QWEN3, True, False, combined=True),
    "gemma_partial_fp8_cache_fp8_q": Spec(jr.RopeConfig(head_dim=64, rotary_dim=32),
                                          jnp.bfloat16, GEMMA, True, True, jnp.bfloat16,
                                          fp8_cache=True, fp8_q=True),
}


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    k: jax.Array
    v: jax.Array
    pos: np.ndarray
    slots: np.ndarray
    kv_cache: object
    q_w: Optional[jax.Array]
    k_w: Optional[jax.Array]


def _inputs(rng: np.random.Generator, spec: Spec) -> Inputs:
    """Values of RMS 3 (so the norm shows), random positions, distinct slots with one at
    -1 and one past the cache, and a cache of random old entries."""
    cfg, tokens = spec.cfg, spec.tokens

    def normal(*shape, dtype=spec.dtype, centre=0.0, spread=3.0):
        return jnp.asarray(centre + spread * rng.standard_normal(shape), dtype)

    def weight(asked):
        if not asked:
            return None
        # Around 1 for x * w, around 0 for x * (1 + w): the values models train to.
        centre = 0.0 if spec.qk_norm.convention == "gemma" else 1.0
        return normal(cfg.head_dim, dtype=spec.weight_dtype, centre=centre, spread=0.5)

    rows = () if cfg.mrope_section is None else (3,)
    pos = rng.integers(0, cfg.max_position, (*rows, tokens)).astype(np.int32)
    slots = rng.permutation(PAGES * PAGE_SIZE)[:tokens].astype(np.int32)
    slots[1], slots[3] = -1, PAGES * PAGE_SIZE + 5
    shape = ((PAGE_SIZE, spec.k_heads) if spec.layout == "NHD" else (spec.k_heads, PAGE_SIZE))
    cache_dtype = FP8 if spec.fp8_cache else spec.dtype
    old = [normal(PAGES, *shape, cfg.head_dim, dtype=jnp.float32).astype(cache_dtype)
           for _ in "kv"]
    return Inputs(normal(tokens, spec.q_heads, cfg.head_dim),
                  normal(tokens, spec.k_heads, cfg.head_dim),
                  normal(tokens, spec.k_heads, cfg.head_dim), pos, slots,
                  jnp.stack(old, axis=1) if spec.combined else tuple(old),
                  weight(spec.norm_q), weight(spec.norm_k))


def _operands(spec: Spec, x: Inputs):
    """``apply_rope_and_append_kv``'s call of a kernel: its operands and keywords."""
    caches, _, rows = kv_api._caches(x.kv_cache, spec.layout, x.k)
    tables, _ = kernel_constants(spec.cfg)
    scales = jnp.asarray(SCALES[:spec.num_scales], jnp.float32)
    norm = (dict(q_norm_weight=x.q_w, k_norm_weight=x.k_w, qk_norm=spec.qk_norm)
            if spec.qk_norm else {})
    args = (x.q, x.k, x.v, jnp.asarray(x.pos), jnp.asarray(x.slots), jnp.asarray(tables),
            scales, tuple(c.reshape(-1, c.shape[-1]) for c in caches))
    return args, dict(rows=rows, **kernel_options(spec.cfg), **norm)


def _cache_back(spec: Spec, x: Inputs, views):
    caches = x.kv_cache if isinstance(x.kv_cache, tuple) else (x.kv_cache,)
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return written[0] if spec.combined else written


def _triton(spec: Spec, x: Inputs):
    args, kwargs = _operands(spec, x)
    q_dtype = FP8 if spec.fp8_q else None
    q, views = jax.jit(lambda *a: triton_append.rope_append_kv_triton(
        *a, interpret=True, q_dtype=q_dtype, **kwargs))(*args)
    return q, _cache_back(spec, x, views)


def _xla(spec: Spec, x: Inputs):
    """The XLA reference; an fp8 q quantised from the float32 rotation it rounds."""
    args, kwargs = _operands(spec, x)
    q, views = jax.jit(lambda *a: rope_append_kv_reference(*a, **kwargs))(*args)
    if spec.fp8_q:
        q_in = (normalize(x.q, x.q_w, spec.qk_norm) if spec.norm_q
                else x.q.astype(jnp.float32))
        rotated, _ = rope_reference(q_in, x.k.astype(jnp.float32), args[3], args[5],
                                    rotary_dim=kwargs["rotary_dim"],
                                    interleave=kwargs["interleave"],
                                    attention_factor=kwargs["attention_factor"],
                                    mrope_section=kwargs.get("mrope_section"),
                                    mrope_interleaved=kwargs.get("mrope_interleaved", False))
        q = to_cache_dtype(rotated, jnp.float32(SCALES[2]), FP8)
    return q, _cache_back(spec, x, views)


def _within_one_e4m3_ulp(got, want, label: str) -> None:
    worst = kv_oracle.ulps(np.asarray(got), np.asarray(want)).max(initial=0)
    assert worst <= 1, f"{label}: {worst} e4m3 ulps"


def _check_oracle(spec: Spec, x: Inputs, out) -> None:
    """q and the written k rows against the float64 norm + rotation, v rows as given
    (quantised for fp8), and every entry no slot names unchanged."""
    cfg, tolerance = spec.cfg, oracle.RELATIVE_TOLERANCE[jnp.dtype(spec.dtype).name]
    q_out, kv_out = out
    assert isinstance(kv_out, tuple) != spec.combined, "the cache comes back in the structure given"
    q_in = _norm_oracle(x.q, x.q_w, spec.qk_norm) if spec.norm_q else x.q
    k_in = _norm_oracle(x.k, x.k_w, spec.qk_norm) if spec.norm_k else x.k
    q_want, k_want = oracle.rope_of(cfg, q_in, x.pos), oracle.rope_of(cfg, k_in, x.pos)
    if spec.fp8_q:
        assert q_out.dtype == FP8 and q_out.shape == x.q.shape
        _within_one_e4m3_ulp(q_out, kv_oracle.e4m3(q_want * SCALES[2]), "q")
    else:
        assert q_out.dtype == x.q.dtype
        error = oracle.relative_error(q_out, q_want)
        assert error < tolerance, f"q: relative error {error:.3g}"
    new, old = split(kv_out), split(x.kv_cache)
    written, page, entry = kv_oracle.entries(x.slots, PAGES, PAGE_SIZE)
    assert written.sum() == spec.tokens - 2
    page, entry = page[written], entry[written]
    k_rows, v_rows = (kv_oracle.rows(c, spec.layout, page, entry) for c in new)
    if spec.fp8_cache:
        _within_one_e4m3_ulp(k_rows, kv_oracle.e4m3(k_want[written] * SCALES[0]), "k rows")
        v_want = kv_oracle.e4m3(np.asarray(x.v, np.float64)[written] * SCALES[1])
        _within_one_e4m3_ulp(v_rows, v_want, "v rows")
    else:
        error = oracle.relative_error(k_rows, k_want[written])
        assert error < tolerance, f"k rows: relative error {error:.3g}"
        np.testing.assert_array_equal(bits(v_rows), bits(x.v)[written], err_msg="v rows")
    for name, n, o in zip(("k_cache", "v_cache"), new, old):
        kv_oracle.assert_untouched(name, n, o, kv_oracle.written_mask(n.shape, spec.layout,
                                                                      page, entry))


@pytest.mark.parametrize("name", SPECS)
def test_norm_and_fp8_q_match_the_oracle_and_the_xla_reference(name, rng):
    spec = SPECS[name]
    x = _inputs(rng, spec)
    got = _triton(spec, x)
    _check_oracle(spec, x, got)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(_xla(spec, x))):
        if a.dtype == FP8:
            _within_one_e4m3_ulp(a, b, f"{name} vs XLA")
        else:
            # The norm's sums run in another order than XLA's: a rounding of the row's
            # scale apart (kv_oracle.row_ulps), as the rotation alone is.
            worst = kv_oracle.row_ulps(np.asarray(a), np.asarray(b)).max(initial=0)
            assert worst <= 2, f"{name}: {worst} ulps of the row's scale from XLA"


def _aliases(spec: Spec, x: Inputs, q_dtype) -> tuple:
    args, kwargs = _operands(spec, x)
    jaxpr = jax.make_jaxpr(lambda *a: triton_append.rope_append_kv_triton(
        *a, interpret=True, q_dtype=q_dtype, **kwargs))(*args)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    return tuple(call.params["input_output_aliases"]), tuple(v.aval.dtype for v in call.outvars)


def test_an_fp8_q_is_a_new_output_and_the_caches_alias_past_the_weights(rng):
    spec = SPECS["gemma_partial_fp8_cache_fp8_q"]
    x = _inputs(rng, spec)
    # Operands: count, pos, slots, tables, scales, q, k, v, q's weight, k's weight, cache pair.
    aliases, dtypes = _aliases(spec, x, FP8)
    assert aliases == ((10, 1), (11, 2)) and dtypes == (FP8, FP8, FP8)
    aliases, dtypes = _aliases(spec, x, None)
    assert aliases == ((5, 0), (10, 1), (11, 2)) and dtypes[0] == x.q.dtype
    # q's own dtype is today's call: q in place.
    assert _aliases(spec, x, x.q.dtype) == (aliases, dtypes)


def test_an_fp8_q_of_no_tokens_is_an_empty_fp8_array(rng):
    spec = SPECS["interleave_k_only_f16_fp8_q"]
    x = _inputs(rng, spec)
    args, kwargs = _operands(spec, x)
    empty = tuple(a[:0] for a in args[:3]) + (args[3][..., :0], args[4][:0])
    q, views = triton_append.rope_append_kv_triton(*empty, *args[5:], interpret=True,
                                                   q_dtype="float8_e4m3fn", **kwargs)
    assert q.shape == (0, spec.q_heads, spec.cfg.head_dim) and q.dtype == FP8
    for a, b in zip(views, args[7]):
        np.testing.assert_array_equal(bits(np.asarray(a)), bits(np.asarray(b)))


REFUSALS = {
    "per-token norm": (dict(qk_norm=jr.QKNorm(eps=1e-5, per_head=False)), NotImplementedError,
                       "backend='interpret' normalises q and k per head only: .* a program of "
                       "this kernel holds a subset of a token's heads"),
    "fp8 q without its scale": (dict(q_dtype=FP8), ValueError,
                                r"scales.shape=\(2,\) must be \(3,\)"),
    "another q dtype": (dict(q_dtype=jnp.float16), ValueError,
                        "q_dtype=float16 must be None, q's dtype .bfloat16. or float8_e4m3fn"),
    "not a dtype": (dict(q_dtype="fp8"), ValueError, "q_dtype='fp8' must be None"),
    "weight without qk_norm": (dict(qk_norm=None), ValueError,
                               "a norm weight is given but qk_norm=None"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_calls_the_kernel_cannot_serve_are_refused_with_the_reason(name, rng):
    changes, error, message = REFUSALS[name]
    spec = SPECS["qwen3_bf16"]  # its scales are [2], as today's callers pass
    x = _inputs(rng, spec)
    args, kwargs = _operands(spec, x)
    if changes.get("qk_norm") is not None and not changes["qk_norm"].per_head:
        weight = jnp.ones(spec.q_heads * spec.cfg.head_dim, jnp.float32)
        kwargs.update(q_norm_weight=weight, k_norm_weight=None)
    with pytest.raises(error, match=message):
        triton_append.rope_append_kv_triton(*args, interpret=True, **{**kwargs, **changes})
