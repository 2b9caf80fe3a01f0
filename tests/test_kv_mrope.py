"""apply_rope_and_append_kv with M-RoPE positions ``[3, T]``, on every M-RoPE append case.

The XLA reference and the Pallas kernel body (in its interpreter) run each case of
``jaxrope.cases.MROPE_APPEND_CASES`` (sectioned Qwen2-VL, interleaved Qwen3-VL, partial
rotary in halves and in pairs, fp8, odd sizes) against (a) the float64 M-RoPE oracle
(``jaxrope.testing.oracle``) and the KV oracle, and (b) ``apply_rope`` followed by a
plain cache write, within an ulp; the two backends within one ulp of each other. The
fused kernel's Triton export for M-RoPE is checked with the 1-D one, in
tests/test_kv_export.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import MROPE_APPEND_CASES, AppendCase
from jaxrope.kernels import kv_reference
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_oracle import bits, split

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
# Relative error (norm) vs float64, as tests/test_kv_cache.py.
TOLERANCE = {"float32": 1e-5, "float16": 4e-4, "bfloat16": 2.5e-3}
BACKENDS = ("xla", "interpret")
FP8_SCALES = {"k_quant_scale": 0.75, "v_quant_scale": 150.0}

fused = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "layout", "backend"))


def make_inputs(rng, case: AppendCase, dtype_name: str):
    c, dtype = case.case, DTYPES[dtype_name]
    tokens = c.tokens

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    # Rows that differ per token and per row (an image's t, h, w), up to 2**20.
    pos = rng.integers(0, c.cfg.max_position, (3, tokens)).astype(np.int32)
    slots = rng.permutation(case.pages * case.page_size)[:tokens].astype(np.int32)
    slots[tokens - case.padding:] = -1
    rows = (case.page_size, c.k_heads) if case.layout == "NHD" else (c.k_heads, case.page_size)
    cache_dtype = jnp.float8_e4m3fn if case.fp8 else dtype
    old = [jnp.asarray(rng.standard_normal((case.pages, *rows, c.head_dim)),
                       jnp.float32).astype(cache_dtype) for _ in "kv"]
    kv_cache = jnp.stack(old, axis=1) if case.combined else tuple(old)
    return dict(q=normal(tokens, c.q_heads, c.head_dim), k=normal(tokens, c.k_heads, c.head_dim),
                v=normal(tokens, c.k_heads, c.head_dim), pos=pos, slots=slots, kv_cache=kv_cache,
                scales=FP8_SCALES if case.fp8 else {})


def run(x, case: AppendCase, backend: str, pos=None, cfg=None):
    return fused(x["q"], x["k"], x["v"], jnp.asarray(x["pos"] if pos is None else pos),
                 x["kv_cache"], jnp.asarray(x["slots"]), cfg=cfg or case.case.cfg,
                 layout=case.layout, backend=backend, **x["scales"])


def check_against_oracle(case: AppendCase, x, out, dtype_name: str) -> None:
    cfg = case.case.cfg
    q_out, kv_out = out
    new, old = split(kv_out), split(x["kv_cache"])
    written, page, entry = kv_oracle.entries(x["slots"], case.pages, case.page_size)
    page, entry = page[written], entry[written]
    np.testing.assert_array_equal(bits(q_out)[..., cfg.rotary_dim:],
                                  bits(x["q"])[..., cfg.rotary_dim:])
    k_rows, v_rows = (kv_oracle.rows(c, case.layout, page, entry) for c in new)
    k_want = oracle.rope_of(cfg, x["k"], x["pos"])[written]
    actual, expected = [np.asarray(q_out, np.float64).ravel()], [oracle.rope_of(cfg, x["q"], x["pos"]).ravel()]
    if case.fp8:
        k_ulps = kv_oracle.ulps(k_rows, kv_oracle.e4m3(k_want * FP8_SCALES["k_quant_scale"]))
        v_want = kv_oracle.e4m3(np.asarray(x["v"], np.float64)[written] * FP8_SCALES["v_quant_scale"])
        assert k_ulps.max(initial=0) <= 1 and kv_oracle.ulps(v_rows, v_want).max(initial=0) <= 1
    else:
        np.testing.assert_array_equal(bits(k_rows)[..., cfg.rotary_dim:],
                                      bits(x["k"])[written][..., cfg.rotary_dim:])
        np.testing.assert_array_equal(bits(v_rows), bits(x["v"])[written])
        actual.append(k_rows.astype(np.float64).ravel())
        expected.append(k_want.ravel())
    error = oracle.relative_error(np.concatenate(actual), np.concatenate(expected))
    assert error < TOLERANCE[dtype_name], f"relative error {error:.3g}"
    for n, o in zip(new, old):
        untouched = ~kv_oracle.written_mask(n.shape, case.layout, page, entry)
        np.testing.assert_array_equal(bits(n)[untouched], bits(o)[untouched])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_every_mrope_append_case_matches_the_oracle_on_both_backends(case, dtype_name, rng):
    x = make_inputs(rng, case, dtype_name)
    outs = {backend: run(x, case, backend) for backend in BACKENDS}
    for out in outs.values():
        check_against_oracle(case, x, out, dtype_name)
    for a, b in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs["interpret"])):
        worst = kv_oracle.ulps(np.asarray(a), np.asarray(b)).max(initial=0)
        assert worst <= 1, f"{case.name}: xla and interpret differ by {worst} ulp"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_the_fused_op_is_apply_rope_then_a_plain_cache_write(case, backend, rng):
    # One rotation rule: q and the whole cache equal apply_rope's q and k (quantized from
    # float32 for fp8, as the op stores them) written at the slots into the old cache.
    cfg = case.case.cfg
    x = make_inputs(rng, case, "bfloat16")
    q_out, kv_out = run(x, case, backend)
    pos = jnp.asarray(x["pos"])
    q_rope, k_rope = jr.apply_rope(x["q"], x["k"], pos, cfg, backend=backend)
    want_k, want_v = (np.array(c) for c in split(x["kv_cache"]))
    if case.fp8:
        k32 = x["k"].astype(jnp.float32)
        k_rope = kv_reference.to_cache_dtype(jr.apply_rope(k32, k32, pos, cfg, backend=backend)[1],
                                             FP8_SCALES["k_quant_scale"], jnp.float8_e4m3fn)
        v_rows = kv_reference.to_cache_dtype(x["v"].astype(jnp.float32),
                                             FP8_SCALES["v_quant_scale"], jnp.float8_e4m3fn)
    else:
        v_rows = x["v"]
    written, page, entry = kv_oracle.entries(x["slots"], case.pages, case.page_size)
    for want, rows in ((want_k, np.asarray(k_rope)), (want_v, np.asarray(v_rows))):
        if case.layout == "NHD":
            want[page[written], entry[written]] = rows[written]
        else:
            want[page[written], :, entry[written]] = rows[written]
    assert kv_oracle.ulps(np.asarray(q_out), np.asarray(q_rope)).max() <= 1
    for got, want in zip(split(kv_out), (want_k, want_v)):
        assert kv_oracle.ulps(got, want).max() <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_text_tokens_repeating_one_position_rotate_as_the_1d_config(backend, rng):
    # An M-RoPE config on equal rows is the 1-D config on that row: the sections only pick
    # which row a frequency slot reads.
    case = MROPE_APPEND_CASES[0]
    x = make_inputs(rng, case, "float32")
    row = x["pos"][0]
    mrope = run(x, case, backend, pos=np.stack([row] * 3))
    one_d = run(x, case, backend, pos=row,
                cfg=dataclasses.replace(case.case.cfg, mrope_section=None))
    for a, b in zip(jax.tree.leaves(mrope), jax.tree.leaves(one_d)):
        assert kv_oracle.ulps(np.asarray(a), np.asarray(b)).max() <= 1
