"""The Mosaic GPU kernel compiled on the GPU: the float64 oracle's answer, in place, on
every named case, dtype and awkward token count; and "auto" choosing it on Hopper with
Pallas's Triton backend turned into an error.

The CPU suite runs the same body in Mosaic GPU's interpreter (tests/test_mosaic_interpret.py).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import backends as backend_module
from jaxrope.cases import BY_NAME, CASES, MROPE_CASES
from jaxrope.testing import oracle

pytestmark = pytest.mark.gpu

LARGE = 1 << 20


def _inputs(rng, case, tokens, dtype, device):
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    q, k = (jax.device_put(jnp.asarray(rng.standard_normal((tokens, h, cfg.head_dim)), dtype),
                           device) for h in (case.q_heads, case.k_heads))
    shape = (tokens,) if cfg.mrope_section is None else (3, tokens)
    pos = rng.integers(0, LARGE, shape).astype(np.int32)
    return cfg, q, k, pos


def _check(cfg, q_host, k_host, pos, q2, k2, dtype):
    bound = 2.5e-3 if dtype != jnp.float32 else 1e-5
    for x, y in ((q_host, q2), (k_host, k2)):
        y = np.asarray(y, np.float64)
        if not x.size:
            assert y.shape == x.shape
            continue
        assert oracle.relative_error(y, oracle.rope_of(cfg, x, pos)) < bound
        np.testing.assert_array_equal(y[..., cfg.rotary_dim:], x[..., cfg.rotary_dim:])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("case", CASES + MROPE_CASES, ids=lambda c: c.name)
def test_compiled_mosaic_kernel_rotates_every_case_in_place_like_the_oracle(
        hopper, case, dtype, rng):
    # 257 tokens: whole blocks and a tail of single tokens; positions near a million,
    # where only the accurate angle stays at the rounding floor.
    cfg, q, k, pos = _inputs(rng, case, 257, dtype, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    pointers = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
    rope = jax.jit(lambda a, b: jr.apply_rope(a, b, jnp.asarray(pos), cfg, backend="mosaic"),
                   donate_argnums=(0, 1))
    q2, k2 = rope(q, k)
    assert (q2.unsafe_buffer_pointer(), k2.unsafe_buffer_pointer()) == pointers
    _check(cfg, q_host, k_host, pos, q2, k2, dtype)


@pytest.mark.parametrize("tokens", [0, 1, 15, 16, 17, 4099])
@pytest.mark.parametrize("name", ["llama3_8b", "head_dim_512", "interleave_d96_partial",
                                  "qwen2_vl_7b"])
def test_compiled_mosaic_kernel_covers_any_token_count(hopper, name, tokens, rng):
    cfg, q, k, pos = _inputs(rng, BY_NAME[name], tokens, jnp.bfloat16, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    q2, k2 = jax.jit(lambda a, b: jr.apply_rope(a, b, jnp.asarray(pos), cfg, backend="mosaic"))(
        q, k)
    _check(cfg, q_host, k_host, pos, q2, k2, jnp.bfloat16)


def test_auto_runs_mosaic_on_hopper_with_pallas_triton_an_error(hopper, rng):
    # jax._src.deprecations.accelerate turns the Triton backend's deprecation into the
    # error it becomes when JAX removes it: the default path must not touch it, nor warn.
    from jax._src import deprecations
    assert backend_module.backend_name("auto", hopper.platform,
                                       compute_capability=hopper.compute_capability) == "mosaic"
    case = BY_NAME["qwen3_vl_interleaved"]
    cfg, q, k, pos = _inputs(rng, case, 33, jnp.bfloat16, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        deprecations.accelerate("jax-pallas-triton")
        try:
            q2, k2 = jax.jit(lambda a, b: jr.apply_rope(a, b, jnp.asarray(pos), cfg))(q, k)
            with pytest.raises(ValueError, match="Triton"):
                jax.jit(lambda a, b: jr.apply_rope(a, b, jnp.asarray(pos), cfg,
                                                   backend="triton"))(q, k)
        finally:
            deprecations._registered_deprecations["jax-pallas-triton"].accelerated = False
    _check(cfg, q_host, k_host, pos, q2, k2, jnp.bfloat16)
