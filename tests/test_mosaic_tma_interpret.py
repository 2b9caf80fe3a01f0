"""The TMA-pipelined Mosaic GPU variant (bench.experiments.mosaic_tma) in Mosaic GPU's
interpreter (CPU) against the float64 oracle, and its CUDA lowering (which runs off a GPU):
every named case TMA takes, whole token blocks walked through the SMEM stages and the
single-token tail, the run-time count.

Skipped with the reason on JAX 0.10 (no mutable refs, no GPU interpreter). The compiled
kernel runs in tests/gpu/test_mosaic_tma_gpu.py.
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
from test_mosaic_interpret import (LARGE, _check, _draw, check_count_run,  # noqa: E402
                                   run_with_count)

MISSING = mosaic_common.unavailable()
pytestmark = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
needs_lowering = pytest.mark.skipif(mosaic_common.lowering_unavailable() is not None,
                                    reason=str(mosaic_common.lowering_unavailable()))
# One SM: the static-count grid is then a few blocks, each walking many token blocks
# through every stage (the default grid gives each block one token block on CPU sizes).
ONE_SM = dict(sms=1)


def _tma():
    from bench.experiments import mosaic_tma
    return mosaic_tma


def _rope(cfg, q, k, pos, interpret=True, **tuning):
    mosaic_tma = _tma()
    tables, attention = kernel_constants(cfg)
    return mosaic_tma.rope_mosaic_tma(
        q, k, jnp.asarray(pos), jnp.asarray(tables), rotary_dim=cfg.rotary_dim,
        interleave=cfg.interleave, attention_factor=attention,
        mrope_section=cfg.mrope_section, mrope_interleaved=cfg.mrope_interleaved,
        interpret=interpret, tuning=mosaic_tma.TmaTuning(**tuning))


def _plan(case, itemsize=2, **tuning):
    mosaic_tma = _tma()
    return mosaic_tma.plan_tma(case.q_heads, case.k_heads, case.cfg.rotary_dim // 2,
                               case.cfg.head_dim, itemsize, case.cfg.interleave,
                               mosaic_tma.TmaTuning(**tuning))


# The layouts TMA takes: NeoX halves (GPT-J pairs raise, see the test below).
TMA_CASES = [c for c in CASES + MROPE_CASES if not c.cfg.interleave]
GPTJ_CASES = [c for c in CASES + MROPE_CASES if c.cfg.interleave]
DTYPE_CASES = [(c, jnp.bfloat16) for c in TMA_CASES] + [
    (BY_NAME[name], dtype) for name in ("linear_x4", "qwen3_vl_interleaved")
    for dtype in (jnp.float32, jnp.float16)]
_ids = lambda x: getattr(x, "name", None) or jnp.dtype(x).name  # noqa: E731


@pytest.mark.parametrize("case, dtype", DTYPE_CASES, ids=_ids)
def test_tma_variant_matches_the_oracle_in_its_interpreter(case, dtype, rng):
    # A token block and a tail: the block through an SMEM stage, the tail token by token
    # from GMEM; positions near a million, where only the accurate angle holds.
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    p = _plan(case, np.dtype(dtype).itemsize)
    tokens = p.tokens_per_block + 1
    q, k, pos = _draw(rng, cfg, tokens, case.q_heads, case.k_heads, dtype)
    _check(cfg, q, k, pos, jax.jit(lambda a, b: _rope(cfg, a, b, pos))(q, k), dtype)


@pytest.mark.parametrize("name, tokens_per_block, stages, blocks", [
    ("llama3_8b", 4, 2, 5), ("llama3_8b", 8, 2, 4), ("qwen2_vl_7b", 4, 4, 7),
    ("head_dim_512", 16, 2, 4), ("neox_partial_quarter", 8, 3, 5)])
def test_tma_variant_walks_token_blocks_through_every_stage(name, tokens_per_block, stages,
                                                            blocks, rng):
    # One SM's grid (a block or two): each block walks several token blocks, slots reused
    # after their stores read them out; a slot refilled too early, a token block skipped
    # or rotated twice shows against the oracle. Plus a tail of single tokens.
    case = BY_NAME[name]
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    tokens = blocks * tokens_per_block + 1
    q, k, pos = _draw(rng, cfg, tokens, case.q_heads, case.k_heads, jnp.bfloat16)
    out = jax.jit(lambda a, b: _rope(cfg, a, b, pos, tokens_per_block=tokens_per_block,
                                     stages=stages, **ONE_SM))(q, k)
    _check(cfg, q, k, pos, out, jnp.bfloat16)


@pytest.mark.parametrize("tokens", [0, 1])
def test_tma_variant_takes_zero_and_one_token(tokens, rng):
    cfg = dataclasses.replace(BY_NAME["llama3_8b"].cfg, max_position=LARGE)
    q, k, pos = _draw(rng, cfg, tokens, 32, 8, jnp.bfloat16)
    out = _rope(cfg, q, k, pos)
    assert out[0].shape == q.shape and out[1].shape == k.shape
    if tokens:
        _check(cfg, q, k, pos, out, jnp.bfloat16)


def _run_time_count(cfg, q, k, pos, count, grid, **tuning):
    mosaic_tma = _tma()
    return run_with_count(mosaic_tma.build_tma, cfg, q, k, pos, count, grid=grid,
                          tuning=mosaic_tma.TmaTuning(**tuning))


@pytest.mark.parametrize("name, count, grid, tokens_per_block", [
    ("llama3_8b", 37, 2, 4), ("llama3_8b", 0, 3, 4), ("llama3_8b", 1, 1, 4),
    ("llama3_8b", 40, 3, 4), ("qwen2_vl_7b", 21, 1, 4), ("neox_partial_quarter", 45, 2, 8),
    ("qwen3_vl_interleaved", 30, 2, 4)])
def test_tma_variant_reads_the_token_count_at_run_time(name, count, grid, tokens_per_block,
                                                       rng):
    # One compiled kernel for every T: tokens [0, count) rotated as by the oracle, whatever
    # the grid (fewer blocks than token blocks walk several), and every token past the
    # count (whole blocks of them, and the rest of the tail's block) left as it was.
    case = BY_NAME[name]
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    capacity = 48
    q, k, pos = _draw(rng, cfg, capacity, case.q_heads, case.k_heads, jnp.bfloat16)
    check_count_run(cfg, q, k, pos, count, _run_time_count(
        cfg, q, k, pos, count, grid, tokens_per_block=tokens_per_block, stages=3))


def test_tma_plan_fits_the_copy_rules_of_every_case():
    # Each copy a multiple of 128 bytes, the stages within SMEM, the token block a whole
    # number of register tiles; only the rotary dims copied when TMA can stride over the
    # rest of the head.
    for case, dtype in DTYPE_CASES:
        itemsize = np.dtype(dtype).itemsize
        p = _plan(case, itemsize)
        for heads in (case.q_heads, case.k_heads):
            assert p.tokens_per_block * heads * p.copy_dims * itemsize % 128 == 0
        assert p.tokens_per_block % p.layout_tokens == 0
        assert 2 <= p.stages <= 4 and p.smem_bytes <= 220 * 1024
        r = case.cfg.rotary_dim
        assert p.copy_dims == (r if r * itemsize % 16 == 0 else case.cfg.head_dim)
    assert _plan(BY_NAME["llama3_8b"]).tokens_per_block == 4  # 40 KiB of bf16 a stage


@pytest.mark.parametrize("case", GPTJ_CASES, ids=_ids)
def test_tma_variant_refuses_gptj_pairs_by_name(case):
    with pytest.raises(ValueError, match="NeoX halves only, not GPT-J pairs"):
        _plan(case)


def test_tma_plan_names_what_it_cannot_take():
    mosaic_tma = _tma()
    with pytest.raises(ValueError, match="must be a multiple of 4"):
        _plan(BY_NAME["llama3_8b"], tokens_per_block=6)
    with pytest.raises(ValueError, match="stages >= 2"):
        _plan(BY_NAME["llama3_8b"], stages=1)
    with pytest.raises(ValueError, match="over 225280"):
        _plan(BY_NAME["llama3_8b"], tokens_per_block=32)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        mosaic_tma.plan_tma(4, 4, 4, 10, 2, False)  # head_dim 10 in bf16: 20-byte rows
    with pytest.raises(ValueError, match="needs a grid"):
        mosaic_tma.build_tma(q_heads=32, k_heads=8, head_dim=128, itemsize=2, rotary_dim=128,
                             interleave=False, attention_factor=1.0, count=None)


def _lowered(cfg, tokens, q_heads, k_heads, dtype=jnp.bfloat16):
    q, k = (jax.ShapeDtypeStruct((tokens, h, cfg.head_dim), dtype) for h in (q_heads, k_heads))
    shape = (tokens,) if cfg.mrope_section is None else (3, tokens)
    pos = np.zeros(shape, np.int32)
    return jax.jit(lambda a, b: _rope(cfg, a, b, pos, interpret=False)).trace(q, k)


@needs_lowering
@pytest.mark.parametrize("case, dtype", DTYPE_CASES, ids=_ids)
def test_tma_variant_lowers_for_cuda_on_every_case(case, dtype):
    # Off a GPU the Mosaic GPU lowering still runs: TMA boxes it refuses, SMEM transfers
    # with no optimized plan, or a broadcast its layouts do not allow fail here.
    text = _lowered(case.cfg, 4099, case.q_heads, case.k_heads, dtype).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@needs_lowering
def test_tma_run_time_count_kernel_lowers_for_cuda():
    mosaic_tma = _tma()
    cfg = BY_NAME["qwen2_vl_7b"].cfg
    tables, attention = kernel_constants(cfg)
    kernel = mosaic_tma.build_tma(
        q_heads=28, k_heads=4, head_dim=128, itemsize=2, rotary_dim=128, interleave=False,
        attention_factor=attention, mrope_section=cfg.mrope_section, count=None, grid=264)
    rows = mosaic_common.slot_row_table(64, cfg.mrope_section, False)

    def call(n, pos, q, k):
        q_ref, k_ref = jax.new_ref(q), jax.new_ref(k)
        kernel(n, pos, jnp.asarray(tables), rows, q_ref, k_ref)
        return jax.freeze(q_ref), jax.freeze(k_ref)
    shapes = (jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((3 << 16,), jnp.int32),
              jax.ShapeDtypeStruct((1 << 16, 28, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((1 << 16, 4, 128), jnp.bfloat16))
    jax.jit(call).trace(*shapes).lower(lowering_platforms=("cuda",))
