"""apply_rope with M-RoPE positions [3, T]: every row layout on the XLA path and the Pallas
kernel (interpreter) against the float64 oracle, large positions, transformers' own rotary
classes on real configs, the pos_ids contract, and the CUDA lowering (no GPU needed)."""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops.constants import kernel_constants
from jaxrope.cases import BY_NAME, MROPE_CASES
from jaxrope.ops.rope import triton as triton_rope
from jaxrope.ops.rope import tuning as rope_tuning
from jaxrope.ops.rope import triton_export
from jaxrope.models import HF_VL_CONFIGS
from jaxrope.mrope import hf_mrope_args
from jaxrope.testing import kv_oracle, oracle
from test_apply import _launch, _one_group_launch

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
POSITIONS = {"small": (0, 4096), "uniform": (0, 1 << 20), "near_2_20": ((1 << 20) - 65536, 1 << 20)}

rope = jax.jit(jr.apply_rope, static_argnames=("cfg", "backend"))


def _qk(rng, tokens, q_heads, k_heads, head_dim, dtype):
    q = rng.standard_normal((tokens, q_heads, head_dim))
    k = rng.standard_normal((tokens, k_heads, head_dim))
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype)



def _flat(outputs):
    return np.concatenate([np.asarray(y, np.float64).ravel() for y in outputs])


def _error(cfg, q, k, pos, out):
    return oracle.relative_error(_flat(out), _flat([oracle.rope_of(cfg, x, pos) for x in (q, k)]))


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("where", POSITIONS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_every_row_layout_matches_the_oracle_on_both_backends(case, dtype_name, where, rng):
    cfg = case.cfg
    q, k = _qk(rng, case.tokens, case.q_heads, case.k_heads, cfg.head_dim, DTYPES[dtype_name])
    # Rows drawn independently: a slot reading the wrong row shows at any position.
    pos = rng.integers(*POSITIONS[where], (3, case.tokens)).astype(np.int32)
    outs = {backend: rope(q, k, jnp.asarray(pos), cfg=cfg, backend=backend)
            for backend in ("xla", "interpret")}
    for backend, out in outs.items():
        for x, y in zip((q, k), out):
            assert y.shape == x.shape and y.dtype == x.dtype
            np.testing.assert_array_equal(_bits(y)[..., cfg.rotary_dim:], _bits(x)[..., cfg.rotary_dim:],
                                          err_msg=f"{backend}: dims past rotary_dim changed")
        error = _error(cfg, q, k, pos, out)
        assert error < TOLERANCE[dtype_name], f"{backend}: relative error {error:.3g}"
    eps = float(jnp.finfo(DTYPES[dtype_name]).eps)
    for a, b in zip(outs["xla"], outs["interpret"]):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=eps, atol=eps, err_msg="xla and interpret disagree")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_bf16_stays_at_the_rounding_floor_near_2_20(case, backend, rng):
    # The float64 result rounded to bf16 is the floor; the accurate angle reaches it on
    # every row layout (measured ratio 1.000), where a float32 angle pos * inv_freq does not.
    cfg = case.cfg
    q, k = _qk(rng, 64, 8, 2, cfg.head_dim, jnp.bfloat16)
    pos = rng.integers(1 << 19, 1 << 20, (3, 64)).astype(np.int32)
    expected = _flat([oracle.rope_of(cfg, x, pos) for x in (q, k)])
    floor = oracle.relative_error(np.asarray(jnp.asarray(expected, jnp.bfloat16), np.float64), expected)
    error = oracle.relative_error(_flat(rope(q, k, jnp.asarray(pos), cfg=cfg, backend=backend)),
                                  expected)
    assert error <= 1.01 * floor, f"error {error:.4g}, bf16 floor {floor:.4g}"
    naive = _flat(jnp.asarray(oracle.rope_naive_float32(
        np.asarray(x, np.float32), pos, *oracle.serving_frequencies(cfg), cfg.rotary_dim,
        cfg.interleave, cfg.mrope_section, cfg.mrope_interleaved), jnp.bfloat16) for x in (q, k))
    assert oracle.relative_error(naive, expected) > 1.5 * floor


@pytest.mark.parametrize("block", [(2, 4, 2, 2, 1, 0), (4, 2, 1, 4, 1, 0), (1, 2, 1, 2, 3, 0),
                                   (1, 4, 1, 1, 4, 1)],
                         ids=lambda b: "bt{}-hp{}-w{}-g{}-loop{}-hm{}".format(*b))
@pytest.mark.parametrize("name", ["qwen3_vl_interleaved", "glm41v_partial_pairs"])
def test_every_launch_shape_reads_the_same_rows(name, block):
    # Row r of token t is read at r * T + t: token blocks that straddle the end of a row,
    # token loops past the last token and heads-major order must not shift a row. The
    # one-group launch runs once per case (cached), its inputs seeded by the case's name.
    cfg = BY_NAME[name].cfg
    q, k, pos, *want = _one_group_launch(name)
    got = _launch(name, q, k, pos, block)
    for a, b in zip(want, got):   # to a rounding of the products: kv_oracle.row_ulps
        assert kv_oracle.row_ulps(np.asarray(b), np.asarray(a)).max() <= 2
    assert _error(cfg, q, k, pos, want) < TOLERANCE["float32"]


def test_each_slot_follows_its_row(rng):
    # Moving one row moves exactly the slots the layout gives it.
    cfg = BY_NAME["qwen3_vl_interleaved"].cfg
    q, k = _qk(rng, 4, 2, 1, cfg.head_dim, jnp.float32)
    pos = rng.integers(0, 1000, (3, 4)).astype(np.int32)
    base = np.asarray(rope(q, k, jnp.asarray(pos), cfg=cfg, backend="xla")[0])
    rows = oracle.mrope_rows(cfg.mrope_section, cfg.mrope_interleaved)
    half = cfg.rotary_dim // 2
    for row in range(3):
        moved = pos.copy()
        moved[row] += 7
        out = np.asarray(rope(q, k, jnp.asarray(moved), cfg=cfg, backend="xla")[0])
        changed = ~np.isclose(out, base, rtol=0, atol=1e-6).all(axis=(0, 1))
        slots = np.flatnonzero(rows == row)
        assert set(np.flatnonzero(changed)) == set(slots) | set(slots + half), row


# model id -> the RopeConfig geometry its transformers classes use (head_dim, rotary_dim,
# theta); the M-RoPE fields come from hf_mrope_args.
GEOMETRY = {
    "Qwen/Qwen2-VL-7B-Instruct": (128, 128, 1e6),
    "Qwen/Qwen2.5-VL-7B-Instruct": (128, 128, 1e6),
    "Qwen/Qwen3-VL-4B-Instruct": (128, 128, 5e6),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (128, 128, 5e6),
    "zai-org/GLM-4.1V-9B-Thinking": (128, 64, 1e4),
}


def _transformers_mrope():
    if os.environ.get("JAXROPE_REQUIRE_TRANSFORMERS") != "1":
        pytest.importorskip("torch", reason="transformers' rotary classes need torch")
        pytest.importorskip("transformers")
    from jaxrope.testing import transformers_mrope
    return transformers_mrope


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("name", sorted(HF_VL_CONFIGS))
def test_real_configs_rotate_as_transformers_does(name, backend, rng):
    # transformers' rotary class (sections recomposed, interleaved for Qwen3-VL, GPT-J
    # pairs and a half-rotated head for GLM-4.1V) and its apply_rotary_pos_emb, in
    # float32 at small positions, where its float32 angle is still accurate.
    transformers_mrope = _transformers_mrope()
    config = HF_VL_CONFIGS[name]
    head_dim, rotary_dim, theta = GEOMETRY[name]
    cfg = jr.RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta,
                        **hf_mrope_args(config))
    q, k = (rng.standard_normal((9, heads, head_dim)).astype(np.float32) for heads in (4, 2))
    pos = rng.integers(0, 128, (3, 9))
    want = transformers_mrope.rotate(config, q, k, pos)
    got = rope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos, jnp.int32), cfg=cfg, backend=backend)
    for a, b in zip(got, want):
        assert oracle.relative_error(a, b) < 1e-5
    # The comparison sees the layout: another pair layout or section order is far off.
    s_t, s_h, s_w = cfg.mrope_section
    other_rows = (dataclasses.replace(cfg, mrope_interleaved=False) if cfg.mrope_interleaved
                  else dataclasses.replace(cfg, mrope_section=(s_h, s_w, s_t)))
    for wrong in (dataclasses.replace(cfg, interleave=not cfg.interleave), other_rows):
        out = rope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos, jnp.int32), cfg=wrong,
                   backend=backend)
        assert oracle.relative_error(out[0], want[0]) > 0.1


class TestPosIdsContract:
    CFG = BY_NAME["qwen2_vl_7b"].cfg

    def _qk(self, tokens=4):
        return _qk(np.random.default_rng(0), tokens, 2, 1, 128, jnp.bfloat16)

    def test_1d_positions_for_an_mrope_config_are_refused(self):
        q, k = self._qk()
        with pytest.raises(ValueError, match=re.escape(
                "pos_ids.shape=(4,) must be [3, T] (t, h, w rows) with T=4 for an M-RoPE config "
                "(cfg.mrope_section=(16, 24, 24), cfg.mrope_interleaved=False)")):
            jr.apply_rope(q, k, jnp.arange(4, dtype=jnp.int32), self.CFG)

    def test_mrope_positions_for_a_1d_config_are_refused(self):
        q, k = self._qk()
        with pytest.raises(ValueError, match=re.escape(
                "pos_ids.shape=(3, 4) is M-RoPE positions [3, T], but cfg is a 1-D config "
                "(cfg.mrope_section=None)")):
            jr.apply_rope(q, k, jnp.zeros((3, 4), jnp.int32), jr.RopeConfig(head_dim=128))

    @pytest.mark.parametrize("shape", [(3, 5), (2, 4), (4, 3), (4, 4), (3, 4, 1), (1, 3, 4)])
    def test_other_shapes_are_refused_naming_the_shape(self, shape):
        q, k = self._qk()
        with pytest.raises(ValueError, match=re.escape(f"pos_ids.shape={shape} must be [3, T]")):
            jr.apply_rope(q, k, jnp.zeros(shape, jnp.int32), self.CFG)

    def test_the_check_holds_under_jit(self):
        q, k = self._qk()
        with pytest.raises(ValueError, match="must be \\[3, T\\]"):
            rope(q, k, jnp.arange(4, dtype=jnp.int32), cfg=self.CFG)

    @pytest.mark.parametrize("row", [0, 1, 2])
    def test_a_position_out_of_range_on_any_row_is_refused(self, row):
        q, k = self._qk()
        pos = np.zeros((3, 4), np.int32)
        pos[row, 2] = self.CFG.max_position
        with pytest.raises(ValueError, match=f"got values in \\[0, {self.CFG.max_position}\\]"):
            jr.apply_rope(q, k, jnp.asarray(pos), self.CFG)

    @pytest.mark.parametrize("backend", ["xla", "interpret"])
    def test_no_tokens(self, backend):
        q, k = self._qk(0)
        out = jr.apply_rope(q, k, jnp.zeros((3, 0), jnp.int32), self.CFG, backend=backend)
        assert out[0].shape == (0, 2, 128) and out[1].shape == (0, 1, 128)

    def test_text_positions_on_all_rows_are_1d_rope(self, rng):
        # A text run is the same position on the three rows: M-RoPE reduces to RoPE.
        q, k = _qk(rng, 6, 4, 2, 128, jnp.float32)
        pos = rng.integers(0, 1 << 16, 6).astype(np.int32)
        one_d = dataclasses.replace(self.CFG, mrope_section=None)
        for backend in ("xla", "interpret"):
            a = rope(q, k, jnp.asarray(np.stack([pos] * 3)), cfg=self.CFG, backend=backend)
            b = rope(q, k, jnp.asarray(pos), cfg=one_d, backend=backend)
            for x, y in zip(a, b):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))



def _h200():
    """Pallas's Triton lowering targets an H200 without one present (JAX 0.11 needs the
    device named; 0.10 accepts it too)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                    abstract_device=device))


@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_the_kernel_lowers_for_cuda_in_place(case):
    cfg = case.cfg
    tables, attention = kernel_constants(cfg)

    def kernel(q, k, pos):
        return triton_rope.rope_triton(q, k, pos, jnp.asarray(tables), rotary_dim=cfg.rotary_dim,
                                         interleave=cfg.interleave, attention_factor=attention,
                                         mrope_section=cfg.mrope_section,
                                         mrope_interleaved=cfg.mrope_interleaved)

    args = (jax.ShapeDtypeStruct((64, 32, cfg.head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 8, cfg.head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((3, 64), jnp.int32))
    with _h200():
        text = jax.jit(kernel, donate_argnums=(0, 1)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and 'name = "jaxrope_rope"' in text
    assert len(re.findall(r"tensor<64x(?:32|8)x\d+xbf16> \{tf\.aliasing_output = [01]", text)) == 2


@pytest.mark.parametrize("name", ["qwen2_vl_7b", "qwen3_vl_interleaved"])
def test_triton_export_of_an_mrope_kernel_reads_three_rows(name):
    # The torch-side launch compiles this IR: positions enter as one int32 pointer, the
    # kernel reads three rows where the 1-D kernel reads one.
    cfg = BY_NAME[name].cfg
    common = dict(q_heads=32, k_heads=8, head_dim=128, rotary_dim=128, interleave=False,
                  attention_factor=1.0, dtype=jnp.bfloat16,
                  block=rope_tuning.triton_tuning(16384, 32, 8, 64))
    with _h200():
        mrope = triton_export.export(**common, mrope_section=cfg.mrope_section,
                                 mrope_interleaved=cfg.mrope_interleaved).ttir
        one_d = triton_export.export(**common).ttir
    loads = [len(re.findall(r"tt\.load %\S+, %\S+, %\S+ : tensor<\d+x!tt\.ptr<i32>>", t))
             for t in (one_d, mrope)]
    assert loads[1] == 3 * loads[0] > 0, loads
