"""apply_rope on every named case and backend against the float64 oracle.

Calls go through one ``jax.jit`` (config and backend static) so that each shape
compiles once; the boundary checks that need visible values run eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import backends as backend_module
from jaxrope.ops.constants import kernel_constants
from jaxrope.ops.rope import triton as triton_rope
from jaxrope.ops.rope import tuning as rope_tuning
from jaxrope.cases import BY_NAME, CASES
from jaxrope.ops.rope.reference import rope_reference

from jaxrope.testing import kv_oracle, oracle

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
BACKENDS = ("xla", "interpret")
LARGE = (1 << 19, 1 << 20)

rope = jax.jit(jr.apply_rope, static_argnames=("cfg", "backend"))


def _qk(rng, tokens, q_heads, k_heads, head_dim, dtype):
    q = rng.standard_normal((tokens, q_heads, head_dim))
    k = rng.standard_normal((tokens, k_heads, head_dim))
    return jnp.asarray(q, dtype), jnp.asarray(k, dtype)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _check(cfg, q, k, pos, out, dtype_name):
    for x, y, name in ((q, out[0], "q"), (k, out[1], "k")):
        assert y.shape == x.shape and y.dtype == x.dtype, name
        np.testing.assert_array_equal(_bits(y)[..., cfg.rotary_dim:], _bits(x)[..., cfg.rotary_dim:],
                                      err_msg=f"{name}: dims past rotary_dim changed")
    # One error over q and k together: a 1-token, 1-head k alone is too few values
    # for a stable estimate of the rounding floor.
    actual = np.concatenate([np.asarray(y, np.float64).ravel() for y in out])
    expected = np.concatenate([oracle.rope_of(cfg, x, pos).ravel() for x in (q, k)])
    error = oracle.relative_error(actual, expected)
    assert error < TOLERANCE[dtype_name], f"relative error {error:.3g}"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_case_matches_the_oracle_on_both_backends(case, dtype_name, rng):
    q, k = _qk(rng, case.tokens, case.q_heads, case.k_heads, case.head_dim, DTYPES[dtype_name])
    pos = rng.integers(0, case.cfg.max_position, case.tokens).astype(np.int32)
    outs = {}
    for backend in BACKENDS:
        outs[backend] = rope(q, k, jnp.asarray(pos), cfg=case.cfg, backend=backend)
        _check(case.cfg, q, k, pos, outs[backend], dtype_name)
    eps = float(jnp.finfo(DTYPES[dtype_name]).eps)
    for a, b in zip(outs["xla"], outs["interpret"]):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=eps, atol=eps, err_msg="xla and interpret disagree")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_bf16_stays_at_the_rounding_floor_near_a_million_positions(case, rng):
    cfg = dataclasses.replace(case.cfg, max_position=LARGE[1])
    q, k = _qk(rng, case.tokens, case.q_heads, case.k_heads, case.head_dim, jnp.bfloat16)
    pos = rng.integers(*LARGE, case.tokens).astype(np.int32)
    for backend in BACKENDS:
        _check(cfg, q, k, pos, rope(q, k, jnp.asarray(pos), cfg=cfg, backend=backend), "bfloat16")


@pytest.mark.parametrize("name", ["llama3_8b", "qwen25_yarn", "deepseek_v2_rope", "dynamic_ntk",
                                  "head_dim_512"])
def test_a_float32_angle_would_fail_the_large_position_bound(name, rng):
    # The bound above can fail: the same check applied to cos(float32(pos * inv_freq))
    # exceeds it, while apply_rope on the same inputs stays under it.
    case = BY_NAME[name]
    cfg = dataclasses.replace(case.cfg, max_position=LARGE[1])
    tokens = 64
    q, k = _qk(rng, tokens, 2, 1, case.head_dim, jnp.bfloat16)
    pos = rng.integers(*LARGE, tokens).astype(np.int32)
    inv_freq, attention = oracle.serving_frequencies(cfg)
    naive = oracle.rope_naive_float32(np.asarray(q, np.float32), pos, inv_freq, attention,
                                      cfg.rotary_dim, cfg.interleave)
    expected = oracle.rope_of(cfg, q, pos)
    naive_error = oracle.relative_error(jnp.asarray(naive, jnp.bfloat16), expected)
    ours = oracle.relative_error(rope(q, k, jnp.asarray(pos), cfg=cfg, backend="xla")[0], expected)
    assert naive_error > TOLERANCE["bfloat16"] > ours, (naive_error, ours)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_and_one_token(backend, rng):
    cfg = BY_NAME["llama3_8b"].cfg
    q, k = _qk(rng, 0, 4, 2, 128, jnp.bfloat16)
    out = jr.apply_rope(q, k, jnp.zeros((0,), jnp.int32), cfg, backend=backend)
    assert out[0].shape == (0, 4, 128) and out[1].shape == (0, 2, 128)
    q, k = _qk(rng, 1, 4, 2, 128, jnp.bfloat16)
    pos = np.array([77777], np.int32)
    _check(cfg, q, k, pos, jr.apply_rope(q, k, jnp.asarray(pos), cfg, backend=backend), "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_position_zero_is_the_identity_times_the_attention_factor(backend, rng):
    for name in ("default_d64", "qwen25_yarn"):
        cfg = BY_NAME[name].cfg
        _, attention = oracle.serving_frequencies(cfg)
        q, k = _qk(rng, 3, 2, 1, cfg.head_dim, jnp.float32)
        out_q, _ = rope(q, k, jnp.zeros((3,), jnp.int32), cfg=cfg, backend=backend)
        want = np.asarray(q, np.float64)
        want[..., :cfg.rotary_dim] *= attention
        np.testing.assert_allclose(np.asarray(out_q), want, rtol=1e-6, atol=0)


def test_position_one_rotates_by_inv_freq():
    cfg = jr.RopeConfig(head_dim=8, theta=100.0)
    q = jnp.asarray([[[1.0, 0, 0, 0, 0, 0, 0, 0]]], jnp.float32)
    out_q, _ = jr.apply_rope(q, q, jnp.asarray([1], jnp.int32), cfg, backend="xla")
    # NeoX halves: x[0] pairs with x[4]; a unit x[0] goes to (cos 1, sin 1).
    np.testing.assert_allclose(np.asarray(out_q)[0, 0], [np.cos(1), 0, 0, 0, np.sin(1), 0, 0, 0],
                               rtol=1e-6, atol=1e-7)


def test_interleave_pairs_adjacent_dims():
    cfg = jr.RopeConfig(head_dim=8, theta=100.0, interleave=True)
    q = jnp.asarray([[[1.0, 0, 0, 0, 0, 0, 0, 0]]], jnp.float32)
    out_q, _ = jr.apply_rope(q, q, jnp.asarray([1], jnp.int32), cfg, backend="xla")
    np.testing.assert_allclose(np.asarray(out_q)[0, 0], [np.cos(1), np.sin(1), 0, 0, 0, 0, 0, 0],
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_works_under_vmap_over_a_batch_axis(backend, rng):
    case = BY_NAME["interleave_d96_partial"]
    batch = 3
    q, k = _qk(rng, batch * case.tokens, case.q_heads, case.k_heads, case.head_dim, jnp.bfloat16)
    q = q.reshape(batch, case.tokens, case.q_heads, case.head_dim)
    k = k.reshape(batch, case.tokens, case.k_heads, case.head_dim)
    pos = rng.integers(0, case.cfg.max_position, (batch, case.tokens)).astype(np.int32)
    out = jax.vmap(lambda q, k, p: jr.apply_rope(q, k, p, case.cfg, backend=backend))(
        q, k, jnp.asarray(pos))
    for i in range(batch):
        _check(case.cfg, q[i], k[i], pos[i], (out[0][i], out[1][i]), "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_inputs_give_the_right_result(backend, rng):
    case = BY_NAME["gptj_interleave"]
    q, k = _qk(rng, case.tokens, case.q_heads, case.k_heads, case.head_dim, jnp.float16)
    q_host, k_host = np.asarray(q), np.asarray(k)
    pos = rng.integers(0, case.cfg.max_position, case.tokens).astype(np.int32)
    in_place = jax.jit(lambda q, k, p: jr.apply_rope(q, k, p, case.cfg, backend=backend),
                       donate_argnums=(0, 1))
    out = in_place(q, k, jnp.asarray(pos))
    _check(case.cfg, q_host, k_host, pos, out, "float16")


def test_without_donation_the_inputs_are_untouched(rng):
    case = BY_NAME["llama3_8b"]
    q, k = _qk(rng, case.tokens, case.q_heads, case.k_heads, case.head_dim, jnp.bfloat16)
    q_before, k_before = np.array(q), np.array(k)
    pos = jnp.asarray(rng.integers(1, 4096, case.tokens), jnp.int32)
    for backend in BACKENDS:
        rope(q, k, pos, cfg=case.cfg, backend=backend)
        np.testing.assert_array_equal(_bits(q), _bits(q_before))
        np.testing.assert_array_equal(_bits(k), _bits(k_before))


def test_auto_picks_xla_on_cpu(rng):
    assert backend_module.resolve("auto", "cpu") is rope_reference
    case = BY_NAME["phi3_longrope"]
    q, k = _qk(rng, case.tokens, case.q_heads, case.k_heads, case.head_dim, jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 9000, case.tokens), jnp.int32)
    auto = rope(q, k, pos, cfg=case.cfg, backend="auto")
    xla = rope(q, k, pos, cfg=case.cfg, backend="xla")
    for a, b in zip(auto, xla):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_triton_on_cpu_raises_not_implemented(rng):
    q, k = _qk(rng, 2, 1, 1, 64, jnp.float32)
    with pytest.raises(NotImplementedError, match="backend='triton' needs a GPU"):
        jr.apply_rope(q, k, jnp.arange(2, dtype=jnp.int32), jr.RopeConfig(head_dim=64),
                      backend="triton")


def test_pallas_is_no_backend_name_and_the_refusal_names_the_two_pallas_kernels(rng):
    q, k = _qk(rng, 2, 1, 1, 64, jnp.float32)
    with pytest.raises(ValueError, match="backend='pallas' must be one of .*'triton' and "
                                         "'mosaic'"):
        jr.apply_rope(q, k, jnp.arange(2, dtype=jnp.int32), jr.RopeConfig(head_dim=64),
                      backend="pallas")


def test_traced_positions_are_not_checked_but_still_rotate(rng):
    cfg = jr.RopeConfig(head_dim=64, max_position=1024)
    q, k = _qk(rng, 4, 2, 1, 64, jnp.float32)
    pos = rng.integers(0, 1024, 4).astype(np.int32)
    out = jax.jit(lambda q, k, p: jr.apply_rope(q, k, p, cfg))(q, k, jnp.asarray(pos))
    _check(cfg, q, k, pos, out, "float32")


class TestBadInputs:
    cfg = jr.RopeConfig(head_dim=64, max_position=4096)

    def _inputs(self, tokens=3, dtype=jnp.float32):
        # Values do not matter here: every call is refused before it computes.
        return _qk(np.random.default_rng(0), tokens, 4, 2, 64, dtype)

    def _raises(self, exc, text, q, k, pos, cfg=None, backend="xla"):
        with pytest.raises(exc, match=re.escape(text)):
            jr.apply_rope(q, k, pos, cfg or self.cfg, backend=backend)

    def test_q_and_k_must_be_rank_3(self):
        q, k = self._inputs()
        pos = jnp.arange(3, dtype=jnp.int32)
        self._raises(ValueError, "q.shape", q.reshape(3, 256), k, pos)
        self._raises(ValueError, "k.shape", q, k[None], pos)

    def test_token_counts_must_match(self):
        q, _ = self._inputs(3)
        _, k = self._inputs(4)
        self._raises(ValueError, "k.shape[0]", q, k, jnp.arange(3, dtype=jnp.int32))

    def test_last_dim_must_be_head_dim(self):
        q, k = self._inputs()
        pos = jnp.arange(3, dtype=jnp.int32)
        self._raises(ValueError, "q.shape[2]", q[..., :32], k, pos)
        self._raises(ValueError, "k.shape[2]", q, jnp.pad(k, ((0, 0), (0, 0), (0, 2))), pos)

    @pytest.mark.parametrize("dtype", [np.int32, np.float64, np.int8])
    def test_unsupported_dtypes(self, dtype):
        q, k = self._inputs()
        pos = jnp.arange(3, dtype=jnp.int32)
        self._raises(ValueError, "q.dtype", np.asarray(q).astype(dtype), k, pos)
        self._raises(ValueError, "k.dtype", q, np.asarray(k).astype(dtype), pos)

    def test_k_dtype_must_equal_q_dtype(self):
        q, k = self._inputs()
        self._raises(ValueError, "k.dtype", q, k.astype(jnp.bfloat16), jnp.arange(3, dtype=jnp.int32))

    def test_pos_ids_must_be_integers(self):
        q, k = self._inputs()
        self._raises(ValueError, "pos_ids.dtype", q, k, jnp.arange(3, dtype=jnp.float32))
        self._raises(TypeError, "pos_ids", q, k, [0, 1, 2])

    def test_pos_ids_must_have_one_entry_per_token(self):
        q, k = self._inputs()
        self._raises(ValueError, "pos_ids.shape", q, k, jnp.arange(4, dtype=jnp.int32))
        self._raises(ValueError, "pos_ids.shape", q, k, jnp.zeros((3, 1), jnp.int32))

    @pytest.mark.parametrize("bad", [-1, 4096, 1 << 30])
    def test_visible_positions_must_lie_in_range(self, bad):
        q, k = self._inputs()
        self._raises(ValueError, "pos_ids", q, k, jnp.asarray([0, bad, 5], jnp.int32))
        with pytest.raises(ValueError, match="max_position"):
            jr.apply_rope(q, k, jnp.asarray([0, bad, 5], jnp.int32), self.cfg)

    def test_unknown_backend(self):
        q, k = self._inputs()
        self._raises(ValueError, "backend='cuda' must be one of", q, k,
                     jnp.arange(3, dtype=jnp.int32), backend="cuda")

    def test_cfg_must_be_a_rope_config(self):
        q, k = self._inputs()
        with pytest.raises(TypeError, match="cfg"):
            jr.apply_rope(q, k, jnp.arange(3, dtype=jnp.int32), {"head_dim": 64})


@pytest.mark.parametrize("block", [(1, 1, 1, 3, 1, 0), (2, 4, 2, 2, 1, 0), (4, 2, 1, 4, 1, 0),
                                   (2, 8, 2, 2, 1, 0), (1, 2, 1, 2, 3, 0), (2, 2, 1, 1, 1, 1),
                                   (1, 4, 1, 1, 4, 1)],
                         ids=lambda b: "bt{}-hp{}-w{}-g{}-loop{}-hm{}".format(*b))
@pytest.mark.parametrize("name", ["llama3_8b", "gptj_interleave", "interleave_d96_partial"])
def test_every_launch_shape_gives_the_same_rotation(name, block):
    # Launch shapes only regroup work: head counts that do not divide the groups, token
    # counts that do not divide the blocks, several head groups per program, token loops
    # that run past the last token and heads-major program order must all give the
    # one-group shape's results, to a rounding of the products (kv_oracle.row_ulps: the
    # interpreter's XLA program changes with the block shape; on the GPU,
    # tests/gpu/test_launch_shapes_gpu.py holds the kernel to bits).
    # The one-group shape's result depends on the case only: it runs once per case (cached),
    # not once per block.
    cfg = BY_NAME[name].cfg
    q, k, pos, want_q, want_k = _one_group_launch(name)
    got = _launch(name, q, k, pos, block)
    for a, b in ((got[0], want_q), (got[1], want_k)):
        assert kv_oracle.row_ulps(np.asarray(a), b).max() <= 2
    expected = oracle.rope_oracle(np.asarray(q), pos.astype(np.int64),
                                  *oracle.serving_frequencies(cfg), cfg.rotary_dim, cfg.interleave)
    np.testing.assert_allclose(want_q, expected, rtol=0, atol=1e-4)


def _launch(name, q, k, pos, block):
    """The Pallas Triton kernel body in its interpreter at one launch shape (a 1-D or an
    M-RoPE case: tests/test_mrope_apply.py uses it too)."""
    cfg = BY_NAME[name].cfg
    tables, attention = kernel_constants(cfg)
    bt, hp, warps, groups, loop, major = block
    return triton_rope.rope_triton(
        q, k, jnp.asarray(pos), jnp.asarray(tables), rotary_dim=cfg.rotary_dim,
        interleave=cfg.interleave, attention_factor=attention, mrope_section=cfg.mrope_section,
        mrope_interleaved=cfg.mrope_interleaved, interpret=True,
        tuning=rope_tuning.TritonTuning(bt, hp, warps, 1, groups, loop, bool(major)))


@functools.lru_cache(maxsize=None)
def _one_group_launch(name):
    """Inputs of a launch-shape case (seeded by its name; numpy positions, ``[3, T]`` for
    M-RoPE) and the one-group shape's q, k."""
    cfg = BY_NAME[name].cfg
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    tokens, q_heads, k_heads = 7, 5, 3
    q = jnp.asarray(rng.standard_normal((tokens, q_heads, cfg.head_dim)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((tokens, k_heads, cfg.head_dim)), jnp.float32)
    rows = (3, tokens) if cfg.mrope_section else (tokens,)
    pos = rng.integers(0, cfg.max_position, rows).astype(np.int32)
    want = _launch(name, q, k, pos, (1, 1, 1, 1, 1, 0))
    return (q, k, pos, *(np.asarray(x) for x in want))


def test_auto_falls_through_to_xla_when_its_kernel_declines(monkeypatch, rng):
    # "auto" on a GPU takes its kernel first and XLA when that declines; a backend named
    # explicitly raises the kernel's refusal.
    q, k = _qk(rng, 5, 4, 2, 64, jnp.float32)
    pos, cfg = jnp.arange(5, dtype=jnp.int32), jr.RopeConfig(head_dim=64)
    want = jr.apply_rope(q, k, pos, cfg, backend="xla")

    def declining(*args, **kwargs):
        raise jr.BackendUnavailable("declined by the test")

    gpu = types.SimpleNamespace(platform="gpu", compute_capability="8.0")
    monkeypatch.setattr(backend_module, "device_of", lambda x: gpu)
    monkeypatch.setitem(backend_module.IMPLEMENTATIONS["rope"], "triton", declining)
    assert backend_module.candidates("auto", "gpu", "rope", "8.0") == ("triton", "xla")
    for a, b in zip(jr.apply_rope(q, k, pos, cfg), want):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    with pytest.raises(jr.BackendUnavailable, match="declined by the test"):
        jr.apply_rope(q, k, pos, cfg, backend="triton")
