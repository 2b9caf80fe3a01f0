"""The Mosaic GPU kernel's body in Mosaic GPU's interpreter (CPU) against the float64 oracle,
and its CUDA lowering (which runs off a GPU): every named case, layout and token count.

Skipped with the reason on JAX 0.10 (no mutable refs, no GPU interpreter). The compiled
kernel runs in tests/gpu/test_mosaic_gpu.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import backends as backend_module
from jaxrope.ops import mosaic_common
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.ops.rope import mosaic as mosaic_rope
from jaxrope.ops.rope import mosaic_export
from jaxrope.ops.rope import triton as triton_rope
from jaxrope.ops.rope import tuning as rope_tuning
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.ops.rope_append_kv import mosaic as mosaic_append
from jaxrope.ops.rope_append_kv import mosaic_export as append_mosaic_export
from jaxrope.ops.rope_append_kv import tuning as append_tuning
from jaxrope.cases import BY_NAME, CASES, MROPE_CASES
from jaxrope.testing import oracle

MISSING = mosaic_common.unavailable()
needs_mosaic = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
LARGE = 1 << 20
BOUND = {jnp.bfloat16: 2.5e-3, jnp.float16: 2.5e-3, jnp.float32: 1e-5}


def _mosaic(cfg, q, k, pos, interpret=True, tuning=None):
    tables, _ = kernel_constants(cfg)
    return mosaic_rope.rope_mosaic(q, k, jnp.asarray(pos), jnp.asarray(tables),
                                   interpret=interpret, tuning=tuning, **kernel_options(cfg))


def _draw(rng, cfg, tokens, q_heads, k_heads, dtype):
    q, k = (jnp.asarray(rng.standard_normal((tokens, h, cfg.head_dim)), dtype)
            for h in (q_heads, k_heads))
    shape = (tokens,) if cfg.mrope_section is None else (3, tokens)
    return q, k, rng.integers(0, LARGE, shape).astype(np.int32)


def _check(cfg, q, k, pos, out, dtype):
    for x, y in zip((q, k), out):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert oracle.relative_error(y, oracle.rope_of(cfg, x, pos)) < BOUND[dtype]
        np.testing.assert_array_equal(y[..., cfg.rotary_dim:], x[..., cfg.rotary_dim:])


# Every case in bf16; fp32 and fp16 on a few (the interpreter is slow on CPU).
DTYPE_CASES = [(c, jnp.bfloat16) for c in CASES + MROPE_CASES] + [
    (BY_NAME[name], dtype) for name in ("linear_x4", "gptj_interleave", "qwen3_vl_interleaved")
    for dtype in (jnp.float32, jnp.float16)]


@needs_mosaic
@pytest.mark.parametrize("case, dtype", DTYPE_CASES,
                         ids=lambda x: getattr(x, "name", None) or jnp.dtype(x).name)
def test_mosaic_body_matches_the_oracle_in_its_interpreter(case, dtype, rng):
    # The case's own heads and odd token count (a tail of single tokens, often no whole
    # block); positions near a million, where only the accurate angle stays at the floor.
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    q, k, pos = _draw(rng, cfg, case.tokens, case.q_heads, case.k_heads, dtype)
    _check(cfg, q, k, pos, jax.jit(lambda a, b: _mosaic(cfg, a, b, pos))(q, k), dtype)


@needs_mosaic
@pytest.mark.parametrize("name, tokens", [("llama3_8b", 37), ("qwen2_vl_7b", 33),
                                          ("gptj_interleave", 130), ("head_dim_512", 9)])
def test_mosaic_body_rotates_whole_blocks_and_the_tail(name, tokens, rng):
    # Token counts past one block of the plan: whole blocks, each head group of q and k
    # by the one angle, then single tokens. A group skipped or rotated by another block's
    # angle shows against the oracle.
    case = BY_NAME[name]
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    p = rope_tuning.mosaic_tuning(case.q_heads, case.k_heads, cfg.rotary_dim // 2, cfg.head_dim, 2,
                        cfg.interleave)
    assert tokens > p.tokens_per_block and tokens % p.tokens_per_block
    q, k, pos = _draw(rng, cfg, tokens, case.q_heads, case.k_heads, jnp.bfloat16)
    _check(cfg, q, k, pos, jax.jit(lambda a, b: _mosaic(cfg, a, b, pos))(q, k), jnp.bfloat16)


@needs_mosaic
def test_mosaic_body_takes_no_tokens():
    cfg = BY_NAME["llama3_8b"].cfg
    q, k = jnp.zeros((0, 32, 128), jnp.bfloat16), jnp.zeros((0, 8, 128), jnp.bfloat16)
    out = _mosaic(cfg, q, k, np.zeros(0, np.int32))
    assert out[0].shape == q.shape and out[1].shape == k.shape


def _lowered(cfg, tokens, q_heads, k_heads, dtype=jnp.bfloat16, **jit_kwargs):
    q, k = (jax.ShapeDtypeStruct((tokens, h, cfg.head_dim), dtype) for h in (q_heads, k_heads))
    shape = (tokens,) if cfg.mrope_section is None else (3, tokens)
    pos = np.zeros(shape, np.int32)
    return jax.jit(lambda a, b: _mosaic(cfg, a, b, pos, interpret=False), **jit_kwargs).trace(
        q, k)


@needs_mosaic
@pytest.mark.skipif(mosaic_common.lowering_unavailable() is not None,
                    reason=str(mosaic_common.lowering_unavailable()))
@pytest.mark.parametrize("case, dtype", DTYPE_CASES,
                         ids=lambda x: getattr(x, "name", None) or jnp.dtype(x).name)
def test_mosaic_kernel_lowers_for_cuda_on_every_case(case, dtype):
    # Off a GPU the Mosaic GPU lowering still runs: layouts it cannot transfer, vectors
    # that straddle a head or a broadcast its layouts do not allow fail here.
    _lowered(case.cfg, 257, case.q_heads, case.k_heads, dtype).lower(lowering_platforms=("cuda",))


@needs_mosaic
def test_mosaic_kernel_lowers_in_place():
    # Donated q and k must alias the outputs: nothing copied, dims past rotary_dim untouched.
    text = _lowered(BY_NAME["llama3_8b"].cfg, 16, 32, 8, donate_argnums=(0, 1)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert len(re.findall(r"tensor<16x(?:32|8)x128xbf16> \{tf\.aliasing_output = [01]", text)) == 2


@needs_mosaic
@pytest.mark.parametrize("name", ["llama3_8b", "qwen2_vl_7b", "linear_x4"])
def test_mosaic_kernel_computes_the_angle_once_per_block(name):
    # One sine and one cosine of [tokens, R/2] per block, whatever the head count: every
    # head group of the block broadcasts them. One block and a token: the block, then the
    # block shifted to end at the count (no single tokens); under a block, [1, R/2] in
    # the loop over its tokens. Two token blocks are too few for the GPU: the head groups split among
    # blocks, each split's blocks with their own angle.
    case = BY_NAME[name]
    p = rope_tuning.mosaic_tuning(case.q_heads, case.k_heads, case.cfg.rotary_dim // 2,
                                  case.cfg.head_dim, 2, case.cfg.interleave)
    groups = case.q_heads // p.q_group + case.k_heads // p.k_group
    half = case.cfg.rotary_dim // 2
    for tokens, shape, per_split in ((p.tokens_per_block + 1, p.tokens_per_block, 2),
                                     (p.tokens_per_block - 1, 1, 1)):
        splits = rope_tuning.head_splits(-(-tokens // p.tokens_per_block), groups, p.block_groups)
        assert splits > 1
        text = str(_lowered(case.cfg, tokens, case.q_heads, case.k_heads).jaxpr)
        assert sorted(re.findall(r":f32\[([\d,]*)\] = (sin|cos) ", text)) == sorted(
            [(f"{shape},{half}", "sin"), (f"{shape},{half}", "cos")] * per_split * splits)


@pytest.mark.parametrize("rules", [{}, dict(vec_bytes=16, group_bytes=128, block_bytes=256)],
                         ids=["default", "wide"])
def test_mosaic_tuning_splits_every_layout_into_whole_warps(rules):
    # Brute force, at the heuristic's default rule sizes and at wider ones (a sweep's): lanes
    # along the pairs divide a warp and the half's vectors, a vector fits vec_bytes and
    # divides the half and the head stride (GPT-J: one element), head groups divide the
    # head count and serve enough heads an angle.
    sizes = dict(dict(vec_bytes=4, group_bytes=32, block_bytes=32, angle_heads=4), **rules)
    for half, extra, itemsize, interleave, heads in [
            (h, e, i, il, hs) for h in (4, 8, 16, 20, 24, 32, 40, 48, 64, 96, 128, 256)
            for e in (0, 2, 36) for i in (2, 4) for il in (False, True)
            for hs in ((32, 8), (28, 4), (5, 1), (3, 3), (64, 8), (17, 1), (19, 1))]:
        head_dim = 2 * half + extra
        p = rope_tuning.mosaic_tuning(*heads, half, head_dim, itemsize, interleave, **rules)
        if not rules:
            assert p == rope_tuning.mosaic_tuning(*heads, half, head_dim, itemsize, interleave,
                                                  **sizes)
        assert 32 % p.lanes_pairs == 0 and (half // p.vec) % p.lanes_pairs == 0
        assert p.vec * itemsize <= sizes["vec_bytes"]
        assert half % p.vec == 0 and head_dim % p.vec == 0
        assert not interleave or p.vec == 1
        assert p.tokens_per_block == 4 * 32 // p.lanes_pairs
        assert heads[0] % p.q_group == 0 and heads[1] % p.k_group == 0
        head_bytes = 2 * (half // p.lanes_pairs) * itemsize
        cap = sizes["angle_heads"] * sizes["group_bytes"]
        for h, group in zip(heads, (p.q_group, p.k_group)):
            # angle_heads heads an angle where a dividing group of them fits the cap; a
            # group over the cap only as a single head.
            reachable = [g for g in range(min(h, sizes["angle_heads"]), h + 1)
                         if h % g == 0 and g * head_bytes <= cap]
            assert group >= min(h, sizes["angle_heads"]) or not reachable
            assert group == 1 or group * head_bytes <= cap
        # A block rotates at most block_bytes a thread (one group when a group is more).
        group_bytes = 2 * (half // p.lanes_pairs) * itemsize * max(p.q_group, p.k_group)
        assert p.block_groups >= 1
        assert p.block_groups == 1 or p.block_groups * group_bytes <= sizes["block_bytes"]


def test_mosaic_tuning_of_known_layouts():
    # Llama's 40 heads in bf16: 4-byte vectors, 10 groups of 4 heads x 2 pairs a thread
    # (32 bytes), one group a block, so 10 blocks per token block of 4 tokens at any T.
    llama = rope_tuning.mosaic_tuning(32, 8, 64, 128, 2, False)
    assert (llama.vec, llama.q_group, llama.k_group, llama.tokens_per_block) == (2, 4, 4, 4)
    assert (llama.block_groups, rope_tuning.head_splits(4096, 10, llama.block_groups)) == (1, 10)
    # 14 heads have no divisor from 3 to 6: groups of 7, not 2 heads an angle; 17 heads of
    # 2 pairs (8 bytes) a thread would be 136 bytes, over 4 x 32: one head a group.
    qwen2 = rope_tuning.mosaic_tuning(14, 2, 64, 128, 2, False)
    assert (qwen2.q_group, qwen2.k_group) == (7, 2)
    assert rope_tuning.mosaic_tuning(17, 1, 64, 128, 2, False).q_group == 1


@needs_mosaic
@pytest.mark.parametrize("name", ["llama3_8b", "qwen2_vl_7b"])
def test_a_tuning_passed_to_the_kernel_changes_the_split_not_the_rotation(name, rng):
    # A sweep's tuning (wider groups and vectors, more groups a block, fewer blocks) is a
    # value the kernel takes: another split of the same work, the same bits out.
    case = BY_NAME[name]
    cfg = case.cfg
    q, k, pos = _draw(rng, cfg, 37, case.q_heads, case.k_heads, jnp.bfloat16)
    default = rope_tuning.mosaic_tuning(case.q_heads, case.k_heads, cfg.rotary_dim // 2,
                                        cfg.head_dim, 2, cfg.interleave)
    wide = rope_tuning.mosaic_tuning(case.q_heads, case.k_heads, cfg.rotary_dim // 2,
                                     cfg.head_dim, 2, cfg.interleave, group_bytes=128,
                                     vec_bytes=16, block_bytes=256, in_flight=3, min_blocks=1)
    assert wide != default
    for a, b in zip(_mosaic(cfg, q, k, pos), _mosaic(cfg, q, k, pos, tuning=wide)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_mosaic_floor_is_a_floor_for_either_sign(rng):
    # The turn tables' mid and lo parts are signed: the kernel floors negative values too.
    x = rng.uniform(-3e6, 3e6, 4096).astype(np.float32)
    x[:4] = [-2.5, -2.0, -0.25, 0.0]
    np.testing.assert_array_equal(np.asarray(mosaic_common.floor(jnp.asarray(x))), np.floor(x))


def test_auto_takes_mosaic_only_on_hopper_or_newer():
    # One rule for every caller and both ops (each has a Mosaic GPU kernel): compute
    # capability 9.0+ CUDA runs Mosaic GPU, older GPUs the Triton-lowered kernel, CPU XLA.
    want = "mosaic" if mosaic_common.lowering_unavailable() is None else "triton"
    assert backend_module.backend_name("auto", "cuda", compute_capability="9.0") == want
    assert backend_module.backend_name("auto", "gpu", compute_capability="10.0") == want
    assert backend_module.backend_name("auto", "cuda", compute_capability="8.9") == "triton"
    assert backend_module.backend_name("auto", "rocm") == "triton"
    assert backend_module.backend_name("auto", "cpu") == "xla"
    assert backend_module.backend_name("auto", "cuda", "rope_append_kv", "9.0") == want
    assert backend_module.backend_name("auto", "cuda", "rope_append_kv", "8.0") == "triton"
    assert backend_module.resolve("triton", "cuda") is triton_rope.rope_triton
    with pytest.raises(ValueError, match="backend='pallas' must be one of"):
        backend_module.resolve("pallas", "cuda")
    with pytest.raises(jr.BackendUnavailable, match="backend='mosaic' needs a CUDA GPU"):
        backend_module.resolve("mosaic", "cpu")
    with pytest.raises(jr.BackendUnavailable, match="backend='triton' needs a GPU"):
        backend_module.resolve("triton", "cpu")
    assert backend_module.resolve("mosaic", "cuda", "rope_append_kv") is (
        mosaic_append.rope_append_kv_mosaic)


@needs_mosaic
def test_auto_leaves_mosaic_to_the_jax_versions_known_to_lower_it(monkeypatch):
    # A JAX minor past mosaic_common.LOWERS_UP_TO may refuse layouts (0.12 refused many
    # stores until mosaic_common.store): "auto" runs the Triton-lowered kernel there.
    monkeypatch.setattr(jax, "__version__", "0.13.0")
    assert "jax 0.13.0 is newer than the JAX versions" in mosaic_common.lowering_unavailable()
    assert backend_module.backend_name("auto", "cuda", compute_capability="9.0") == "triton"
    for version in ("0.11.2", "0.12.0.1"):
        monkeypatch.setattr(jax, "__version__", version)
        assert mosaic_common.lowering_unavailable() is None
        assert backend_module.backend_name("auto", "cuda", compute_capability="9.0") == "mosaic"
        assert backend_module.backend_name("auto", "cuda", "rope_append_kv", "9.0") == "mosaic"


def _run_time_count(cfg, q, k, pos, count, grid, splits, min_count=1, max_count=None):
    return run_with_count(mosaic_rope.build, cfg, q, k, pos, count, grid=grid, splits=splits,
                          min_count=min_count, max_count=max_count)


def run_with_count(builder, cfg, q, k, pos, count, **build_kwargs):
    """The kernel a launch outside JAX compiles (``builder`` with a run-time count: T read
    from an operand, the grid's blocks taking the count's blocks in turn) over q and k at
    ``pos``, ``count`` tokens of refs that hold more."""
    tables, attention = kernel_constants(cfg)
    kernel = builder(
        q_heads=q.shape[1], k_heads=k.shape[1], head_dim=cfg.head_dim,
        itemsize=q.dtype.itemsize, rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
        attention_factor=attention, mrope_section=cfg.mrope_section,
        mrope_interleaved=cfg.mrope_interleaved, count=None, interpret=True, **build_kwargs)
    rows = mosaic_common.slot_row_table(cfg.rotary_dim // 2, cfg.mrope_section,
                                     cfg.mrope_interleaved)
    view = lambda x: x.reshape(*x.shape[:2], cfg.head_dim // 2, 2) if cfg.interleave else x
    # M-RoPE rows sit `count` apart: the [3, count] block first, in one flat buffer.
    flat = np.zeros(np.size(pos) if cfg.mrope_section is None else 3 * q.shape[0], np.int32)
    flat[:np.size(pos[..., :count])] = np.asarray(pos)[..., :count].reshape(-1)

    def call(a, b):
        q_ref, k_ref = jax.new_ref(view(a)), jax.new_ref(view(b))
        kernel(jnp.asarray([count], jnp.int32), jnp.asarray(flat), jnp.asarray(tables),
               rows, q_ref, k_ref)
        return jax.freeze(q_ref).reshape(a.shape), jax.freeze(k_ref).reshape(b.shape)
    return jax.jit(call)(q, k)


@needs_mosaic
@pytest.mark.parametrize("name, count, grid, splits, min_count, max_count", [
    ("llama3_8b", 37, 2, 1, 1, None), ("llama3_8b", 0, 3, 1, 1, None),
    ("llama3_8b", 1, 1, 1, 1, None), ("qwen2_vl_7b", 21, 1, 1, 1, None),
    ("gptj_interleave", 9, 4, 1, 1, None), ("neox_partial_quarter", 40, 3, 1, 1, None),
    ("qwen3_vl_interleaved", 30, 2, 1, 1, None), ("llama3_8b", 37, 5, 3, 1, None),
    ("qwen2_vl_7b", 21, 16, 8, 1, None),
    # A lower bound of a block or more: no single-token path, the tail as a block
    # shifted to end at the count, on every split and with the count a whole block.
    ("llama3_8b", 37, 2, 1, 17, None), ("llama3_8b", 47, 5, 3, 33, None),
    ("llama3_8b", 32, 3, 2, 17, None), ("qwen2_vl_7b", 21, 16, 8, 17, None),
    ("gptj_interleave", 43, 4, 1, 5, None), ("qwen3_vl_interleaved", 30, 2, 1, 17, None),
    # A block for every item up to an upper bound: no walk, blocks past the count idle.
    ("llama3_8b", 47, 9, 3, 33, 48), ("llama3_8b", 40, 12, 3, 33, 64),
    ("llama3_8b", 9, 2, 2, 1, 16), ("gptj_interleave", 43, 12, 1, 5, 48)])
def test_mosaic_kernel_reads_the_token_count_at_run_time(name, count, grid, splits, min_count,
                                                         max_count, rng):
    # One compiled kernel for every T: tokens [0, count) rotated as by the oracle at
    # their positions, whatever the grid (fewer blocks than the count has walk several)
    # and however the heads split among blocks, and every token past the count left as
    # it was.
    case = BY_NAME[name]
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    capacity = 48
    q, k, pos = _draw(rng, cfg, capacity, case.q_heads, case.k_heads, jnp.bfloat16)
    check_count_run(cfg, q, k, pos, count,
                    _run_time_count(cfg, q, k, pos, count, grid, splits, min_count, max_count))


def check_count_run(cfg, q, k, pos, count, out):
    """Tokens ``[0, count)`` of ``out`` rotated as by the oracle, the rest as they were."""
    for x, y in zip((q, k), out):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        np.testing.assert_array_equal(y[count:], x[count:])
        if count:
            want = oracle.rope_of(cfg, x[:count], pos[..., :count])
            assert oracle.relative_error(y[:count], want) < BOUND[jnp.bfloat16]


@needs_mosaic
@pytest.mark.skipif(mosaic_common.lowering_unavailable() is not None,
                    reason=str(mosaic_common.lowering_unavailable()))
@pytest.mark.parametrize("name", ["llama3_8b", "gptj_interleave", "qwen2_vl_7b"])
def test_mosaic_export_is_one_module_over_the_launch_operands(name):
    # What torch_bridge.launch.mosaic compiles: MLIR bytecode of one kernel whose operands
    # are the launch's pointers in order, q and k aliased to the two results.
    case = BY_NAME[name]
    tuning = rope_tuning.mosaic_tuning(case.q_heads, case.k_heads, case.cfg.rotary_dim // 2,
                                       case.cfg.head_dim, 2, case.cfg.interleave)
    exported = mosaic_export.export(
        q_heads=case.q_heads, k_heads=case.k_heads, head_dim=case.cfg.head_dim,
        dtype=jnp.bfloat16, tuning=tuning, capacity=1 << 16, grid=8,
        **kernel_options(case.cfg))
    assert exported.module.startswith(b"ML\xefR") and exported.results == 2
    assert exported.grid == 8 and exported.capacity == 1 << 16


@needs_mosaic
@pytest.mark.skipif(mosaic_common.lowering_unavailable() is not None,
                    reason=str(mosaic_common.lowering_unavailable()))
@pytest.mark.parametrize("layout, combined", [("NHD", False), ("HND", True)])
def test_mosaic_append_export_is_one_module_over_the_launch_operands(layout, combined):
    # What torch_bridge.launch.mosaic.MosaicKVLauncher compiles: q and every cache array
    # aliased to the results, in operand order.
    cfg = BY_NAME["llama3_8b"].cfg
    rows = cache_layout.cache_rows(layout, combined, 8, 16, 8)
    exported = append_mosaic_export.export_append(
        q_heads=32, k_heads=8, head_dim=cfg.head_dim, dtype=jnp.bfloat16,
        cache_dtype=jnp.float8_e4m3fn, rows=rows, components=1 if combined else 2,
        tuning=append_tuning.append_mosaic_tuning(32, 8, cfg.head_dim, cfg.rotary_dim, 2),
        capacity=1 << 16, grid=64, **kernel_options(cfg))
    assert exported.module.startswith(b"ML\xefR")
    assert exported.results == (2 if combined else 3)
