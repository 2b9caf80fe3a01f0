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
from jaxrope.cases import MROPE_APPEND_CASES
from jaxrope.ops.rope_append_kv import reference as kv_reference
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_inputs import FP8_SCALES, check_against_oracle, make_inputs, run
from jaxrope.testing.kv_oracle import split

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
BACKENDS = ("xla", "interpret")

@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_every_mrope_append_case_matches_the_oracle_on_both_backends(case, dtype_name, rng):
    x = make_inputs(rng, case, DTYPES[dtype_name])
    outs = {backend: run(x, case, backend) for backend in BACKENDS}
    for out in outs.values():
        check_against_oracle(case, x, out, TOLERANCE[dtype_name])
    for a, b in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs["interpret"])):
        # To a rounding of the products: kv_oracle.row_ulps says why not bit for bit.
        worst = kv_oracle.row_ulps(np.asarray(a), np.asarray(b)).max(initial=0)
        assert worst <= 2, f"{case.name}: xla and interpret differ by {worst} ulp of the row's scale"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_the_fused_op_is_apply_rope_then_a_plain_cache_write(case, backend, rng):
    # One rotation rule: q and the whole cache equal apply_rope's q and k (quantized from
    # float32 for fp8, as the op stores them) written at the slots into the old cache.
    cfg = case.case.cfg
    x = make_inputs(rng, case, jnp.bfloat16)
    q_out, kv_out = run(x, case, backend)
    pos = jnp.asarray(x.pos)
    q_rope, k_rope = jr.apply_rope(x.q, x.k, pos, cfg, backend=backend)
    want_k, want_v = (np.array(c) for c in split(x.kv_cache))
    if case.fp8:
        k32 = x.k.astype(jnp.float32)
        k_rope = kv_reference.to_cache_dtype(jr.apply_rope(k32, k32, pos, cfg, backend=backend)[1],
                                             FP8_SCALES["k_quant_scale"], jnp.float8_e4m3fn)
        v_rows = kv_reference.to_cache_dtype(x.v.astype(jnp.float32),
                                             FP8_SCALES["v_quant_scale"], jnp.float8_e4m3fn)
    else:
        v_rows = x.v
    written, page, entry = kv_oracle.entries(x.slots, case.pages, case.page_size)
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
    x = make_inputs(rng, case, jnp.float32)
    row = x.pos[0]
    mrope = run(x, case, backend, pos=np.stack([row] * 3))
    one_d = run(x, case, backend, pos=row,
                cfg=dataclasses.replace(case.case.cfg, mrope_section=None))
    for a, b in zip(jax.tree.leaves(mrope), jax.tree.leaves(one_d)):
        assert kv_oracle.ulps(np.asarray(a), np.asarray(b)).max() <= 1
