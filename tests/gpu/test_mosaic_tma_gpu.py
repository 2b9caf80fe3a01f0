"""The TMA-pipelined Mosaic GPU variant (bench.experiments.mosaic_tma) compiled on the GPU:
the float64 oracle's answer, in place, on every case it takes and awkward token counts,
at the default tuning and at a few other tuning points, and the run-time count.

The CPU suite runs the same body in Mosaic GPU's interpreter
(tests/test_mosaic_tma_interpret.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrope.ops.constants import kernel_constants
from jaxrope.cases import BY_NAME, CASES, MROPE_CASES
from jaxrope.ops import mosaic_common
from jaxrope.testing import oracle

pytestmark = pytest.mark.gpu

LARGE = 1 << 20
TMA_CASES = [c for c in CASES + MROPE_CASES if not c.cfg.interleave]


def _rope(cfg, q, k, pos, tuning=None):
    from bench.experiments import mosaic_tma
    tables, attention = kernel_constants(cfg)
    return mosaic_tma.rope_mosaic_tma(
        q, k, jnp.asarray(pos), jnp.asarray(tables), rotary_dim=cfg.rotary_dim,
        interleave=cfg.interleave, attention_factor=attention,
        mrope_section=cfg.mrope_section, mrope_interleaved=cfg.mrope_interleaved,
        tuning=tuning or mosaic_tma.DEFAULT_TUNING)


def _inputs(rng, case, tokens, dtype, device):
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    q, k = (jax.device_put(jnp.asarray(rng.standard_normal((tokens, h, cfg.head_dim)), dtype),
                           device) for h in (case.q_heads, case.k_heads))
    shape = (tokens,) if cfg.mrope_section is None else (3, tokens)
    return cfg, q, k, rng.integers(0, LARGE, shape).astype(np.int32)


def _check(cfg, q_host, k_host, pos, out, dtype, count=None):
    bound = 2.5e-3 if dtype != jnp.float32 else 1e-5
    for x, y in zip((q_host, k_host), out):
        y = np.asarray(y, np.float64)
        assert y.shape == x.shape
        n = x.shape[0] if count is None else count
        np.testing.assert_array_equal(y[n:], x[n:])
        if n:
            want = oracle.rope_of(cfg, x[:n], pos[..., :n])
            assert oracle.relative_error(y[:n], want) < bound
            np.testing.assert_array_equal(y[:n, :, cfg.rotary_dim:], x[:n, :, cfg.rotary_dim:])


@pytest.mark.parametrize("tokens", [0, 1, 17, 4099])
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_compiled_tma_variant_rotates_every_case_in_place_like_the_oracle(
        hopper, case, tokens, rng):
    # 4099: many token blocks per block of the grid (every stage reused) and a tail.
    cfg, q, k, pos = _inputs(rng, case, tokens, jnp.bfloat16, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    pointers = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
    out = jax.jit(lambda a, b: _rope(cfg, a, b, pos), donate_argnums=(0, 1))(q, k)
    if tokens:
        assert (out[0].unsafe_buffer_pointer(), out[1].unsafe_buffer_pointer()) == pointers
    _check(cfg, q_host, k_host, pos, out, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=str)
@pytest.mark.parametrize("name", ["llama3_8b", "linear_x4", "qwen3_vl_interleaved"])
def test_compiled_tma_variant_takes_other_dtypes(hopper, name, dtype, rng):
    cfg, q, k, pos = _inputs(rng, BY_NAME[name], 4099, dtype, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    _check(cfg, q_host, k_host, pos, jax.jit(lambda a, b: _rope(cfg, a, b, pos))(q, k), dtype)


@pytest.mark.parametrize("tokens_per_block, stages", [(4, 2), (4, 3), (4, 5), (8, 2)])
def test_compiled_tma_variant_is_right_at_other_tuning_points(hopper, tokens_per_block,
                                                              stages, rng):
    # What bench/mosaic_bench.py --tma-sweep times must compute the same rotation.
    from bench.experiments import mosaic_tma
    tuning = mosaic_tma.TmaTuning(tokens_per_block=tokens_per_block, stages=stages)
    cfg, q, k, pos = _inputs(rng, BY_NAME["llama3_8b"], 4099, jnp.bfloat16, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    out = jax.jit(lambda a, b: _rope(cfg, a, b, pos, tuning))(q, k)
    _check(cfg, q_host, k_host, pos, out, jnp.bfloat16)


@pytest.mark.parametrize("name, count, grid", [
    ("llama3_8b", 4099, 8), ("llama3_8b", 1, 264), ("llama3_8b", 0, 4),
    ("qwen2_vl_7b", 1027, 3), ("neox_partial_quarter", 333, 2)])
def test_compiled_tma_variant_reads_the_token_count_at_run_time(hopper, name, count, grid,
                                                                rng):
    # Refs of 4608 tokens, `count` rotated: nothing past the count is read or written.
    from bench.experiments import mosaic_tma
    case = BY_NAME[name]
    cfg, q, k, pos = _inputs(rng, case, 4608, jnp.bfloat16, hopper)
    q_host, k_host = np.asarray(q, np.float64), np.asarray(k, np.float64)
    tables, attention = kernel_constants(cfg)
    kernel = mosaic_tma.build_tma(
        q_heads=case.q_heads, k_heads=case.k_heads, head_dim=cfg.head_dim, itemsize=2,
        rotary_dim=cfg.rotary_dim, interleave=False, attention_factor=attention,
        mrope_section=cfg.mrope_section, mrope_interleaved=cfg.mrope_interleaved,
        count=None, grid=grid)
    rows = mosaic_common.slot_row_table(cfg.rotary_dim // 2, cfg.mrope_section,
                                     cfg.mrope_interleaved)
    flat = np.zeros(pos.size, np.int32)
    flat[:np.size(pos[..., :count])] = pos[..., :count].reshape(-1)

    def call(a, b):
        q_ref, k_ref = jax.new_ref(a), jax.new_ref(b)
        kernel(jnp.asarray([count], jnp.int32), jnp.asarray(flat), jnp.asarray(tables),
               rows, q_ref, k_ref)
        return jax.freeze(q_ref), jax.freeze(k_ref)
    _check(cfg, q_host, k_host, pos, jax.jit(call)(q, k), jnp.bfloat16, count=count)
