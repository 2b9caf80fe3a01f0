"""The Pallas GPU kernel (hardware sin/cos) with M-RoPE positions [3, T] against the float64
oracle, on every row layout of jaxrope.cases.MROPE_CASES and at a serving shape.

Run on the device machine: ``JAXROPE_GPU_TESTS=1 python -m pytest -m gpu
tests/gpu/test_mrope_gpu.py``. Needs JAX with a GPU only (no torch, no FlashInfer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import MROPE_CASES
from jaxrope.testing import oracle

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("jax_gpu")]

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
POSITIONS = {"uniform": (0, 1 << 20), "near_2_20": ((1 << 20) - 65536, 1 << 20),
             "upper_half": (1 << 19, 1 << 20)}

rope = jax.jit(jr.apply_rope, static_argnames=("cfg", "backend"), donate_argnums=(0, 1))


def _inputs(rng, tokens, q_heads, k_heads, cfg, where):
    q = rng.standard_normal((tokens, q_heads, cfg.head_dim))
    k = rng.standard_normal((tokens, k_heads, cfg.head_dim))
    pos = rng.integers(*POSITIONS[where], (3, tokens)).astype(np.int32)
    return q, k, pos


def _expected(cfg, x, pos):
    inv_freq, attention = oracle.serving_frequencies(cfg)
    return oracle.rope_oracle(x, pos, inv_freq, attention, cfg.rotary_dim, cfg.interleave,
                              cfg.mrope_section, cfg.mrope_interleaved)


def _run(cfg, q, k, pos, dtype, backend="triton"):
    out = rope(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(pos), cfg=cfg,
               backend=backend)
    return [np.asarray(y, np.float64) for y in out]


@pytest.mark.parametrize("where", POSITIONS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_pallas_kernel_matches_the_oracle_on_every_row_layout(case, dtype_name, where, rng):
    cfg, dtype = case.cfg, DTYPES[dtype_name]
    q, k, pos = _inputs(rng, case.tokens, case.q_heads, case.k_heads, cfg, where)
    q_in = np.asarray(jnp.asarray(q, dtype), np.float64)
    k_in = np.asarray(jnp.asarray(k, dtype), np.float64)
    out = _run(cfg, q, k, pos, dtype)
    for x, y in zip((q_in, k_in), out):
        np.testing.assert_array_equal(y[..., cfg.rotary_dim:], x[..., cfg.rotary_dim:])
    error = oracle.relative_error(np.concatenate([y.ravel() for y in out]),
                                  np.concatenate([_expected(cfg, x, pos).ravel()
                                                  for x in (q_in, k_in)]))
    assert error < TOLERANCE[dtype_name], f"relative error {error:.3g}"


@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_bf16_at_the_rounding_floor_at_a_serving_shape(case, rng):
    # 4096 tokens of 32 q and 8 k heads at positions in [2**19, 2**20): the hardware
    # sin/cos on the reduced angle keep the bf16 output at the floor of rounding the
    # float64 result, on every row layout.
    cfg = case.cfg
    q, k, pos = _inputs(rng, 4096, 32, 8, cfg, "upper_half")
    q_in = np.asarray(jnp.asarray(q, jnp.bfloat16), np.float64)
    k_in = np.asarray(jnp.asarray(k, jnp.bfloat16), np.float64)
    expected = np.concatenate([_expected(cfg, x, pos).ravel() for x in (q_in, k_in)])
    floor = oracle.relative_error(np.asarray(jnp.asarray(expected, jnp.bfloat16), np.float64),
                                  expected)
    got = np.concatenate([y.ravel() for y in _run(cfg, q, k, pos, jnp.bfloat16)])
    error = oracle.relative_error(got, expected)
    assert error <= 1.02 * floor and error < TOLERANCE["bfloat16"], (error, floor)


@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_pallas_and_xla_agree_on_the_gpu(case, rng):
    cfg = case.cfg
    q, k, pos = _inputs(rng, 257, 32, 8, cfg, "uniform")
    for a, b in zip(_run(cfg, q, k, pos, jnp.float32), _run(cfg, q, k, pos, jnp.float32, "xla")):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)


def test_the_kernel_rotates_donated_buffers_in_place(rng):
    cfg = MROPE_CASES[0].cfg
    q, k, pos = _inputs(rng, 64, 32, 8, cfg, "uniform")
    q, k = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    pointers = (q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer())
    q2, k2 = rope(q, k, jnp.asarray(pos), cfg=cfg, backend="triton")
    assert (q2.unsafe_buffer_pointer(), k2.unsafe_buffer_pointer()) == pointers
