"""The Triton-lowered append kernel's per-head QK-norm and fp8 q, its body in the Pallas
interpreter (CPU), against the float64 oracle and the XLA reference.

- Cases (:data:`jaxrope.testing.kv_norm.SPECS`): Qwen3-like (Hq 4, Hk 2, D 128) in bf16 with bf16 weights,
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

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops.rope_append_kv import triton as triton_append
from jaxrope.testing.kv_norm import (FP8, SPECS, Inputs, Spec, check_against_oracle,
                                     check_against_xla, make_inputs, operands, run_kernel, xla)
from jaxrope.testing.kv_oracle import bits


@pytest.mark.parametrize("name", SPECS)
def test_norm_and_fp8_q_match_the_oracle_and_the_xla_reference(name, rng):
    spec = SPECS[name]
    x = make_inputs(rng, spec)
    got = run_kernel(spec, x, triton_append.rope_append_kv_triton, interpret=True)
    check_against_oracle(spec, x, got)
    check_against_xla(name, spec, got, xla(spec, x))


def _aliases(spec: Spec, x: Inputs, q_dtype) -> tuple:
    args, kwargs = operands(spec, x)
    jaxpr = jax.make_jaxpr(lambda *a: triton_append.rope_append_kv_triton(
        *a, interpret=True, q_dtype=q_dtype, **kwargs))(*args)
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    return tuple(call.params["input_output_aliases"]), tuple(v.aval.dtype for v in call.outvars)


def test_an_fp8_q_is_a_new_output_and_the_caches_alias_past_the_weights(rng):
    spec = SPECS["gemma_partial_fp8_cache_fp8_q"]
    x = make_inputs(rng, spec)
    # Operands: count, pos, slots, tables, scales, q, k, v, q's weight, k's weight, cache pair.
    aliases, dtypes = _aliases(spec, x, FP8)
    assert aliases == ((10, 1), (11, 2)) and dtypes == (FP8, FP8, FP8)
    aliases, dtypes = _aliases(spec, x, None)
    assert aliases == ((5, 0), (10, 1), (11, 2)) and dtypes[0] == x.q.dtype
    # q's own dtype is today's call: q in place.
    assert _aliases(spec, x, x.q.dtype) == (aliases, dtypes)


def test_an_fp8_q_of_no_tokens_is_an_empty_fp8_array(rng):
    spec = SPECS["interleave_k_only_f16_fp8_q"]
    x = make_inputs(rng, spec)
    args, kwargs = operands(spec, x)
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
    x = make_inputs(rng, spec)
    args, kwargs = operands(spec, x)
    if changes.get("qk_norm") is not None and not changes["qk_norm"].per_head:
        weight = jnp.ones(spec.q_heads * spec.cfg.head_dim, jnp.float32)
        kwargs.update(q_norm_weight=weight, k_norm_weight=None)
    with pytest.raises(error, match=message):
        triton_append.rope_append_kv_triton(*args, interpret=True, **{**kwargs, **changes})
