"""The fused RoPE + paged KV append's Pallas kernel with M-RoPE positions [3, T] on the GPU.

FlashInfer has no M-RoPE (fused or not), so the references are the float64 oracle
(``jaxrope.testing.oracle`` with the M-RoPE rows, ``kv_oracle``) and the XLA backend on
the same GPU. Every case of ``jaxrope.cases.MROPE_APPEND_CASES`` (sectioned Qwen2-VL,
interleaved Qwen3-VL, partial rotary in halves and pairs, fp8, odd sizes) at 1031
tokens, positions over ``[0, 2**20)`` and ``[2**19, 2**20)``:

- the Pallas kernel (hardware sin/cos): q and the k rows within the oracle tolerance,
  dims past ``rotary_dim`` and the v rows bit-identical, fp8 rows within one e4m3 ulp,
  every entry no slot names unchanged;
- the Pallas kernel and XLA within one ulp (float32: 2e-5 absolute, as
  tests/gpu/test_mrope_gpu.py);
- the cache holds what ``apply_rope`` (the Pallas rope kernel) returns for k;
- q and the cache rewritten in place when donated.

Run on the device machine: ``JAXROPE_GPU_TESTS=1 python -m pytest -m gpu
tests/gpu/test_kv_mrope_gpu.py``. Needs JAX with a GPU only (no torch, no FlashInfer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import MROPE_APPEND_CASES, AppendCase
from jaxrope.testing import kv_inputs, kv_oracle, oracle

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("jax_gpu")]

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
POSITIONS = {"uniform": (0, 1 << 20), "upper_half": (1 << 19, 1 << 20)}
TOKENS = 1031


def _inputs(rng, case: AppendCase, dtype_name: str, where: str = "uniform",
            tokens: int = TOKENS) -> kv_inputs.Inputs:
    """numpy inputs of ``tokens`` tokens (positions in the ``where`` window) and a cache of
    twice as many slots, random old entries."""
    c, dtype = case.case, DTYPES[dtype_name]
    pages = 2 * -(-tokens // case.page_size) + 1
    pos = rng.integers(*POSITIONS[where], (3, tokens)).astype(np.int32)
    slots = rng.permutation(pages * case.page_size)[:tokens].astype(np.int32)
    slots[tokens - case.padding:] = -1
    cache_dtype = jnp.float8_e4m3fn if case.fp8 else dtype
    old = tuple(np.asarray(jnp.asarray(rng.standard_normal(kv_inputs.cache_shape(case, pages)),
                                       jnp.float32).astype(cache_dtype)) for _ in "kv")
    q, k, v = (np.asarray(jnp.asarray(rng.standard_normal((tokens, h, c.head_dim)), dtype))
               for h in (c.q_heads, c.k_heads, c.k_heads))
    return kv_inputs.Inputs(q, k, v, pos, slots, np.stack(old, axis=1) if case.combined else old,
                            kv_inputs.FP8_SCALES if case.fp8 else {})


def _run(case: AppendCase, x: kv_inputs.Inputs, backend: str):
    """numpy ``(q, k_cache, v_cache)`` of the fused op on device copies of ``x``."""
    q, kv = kv_inputs.run(x, case, backend)
    return (np.asarray(q), *kv_oracle.split(kv))


def _written(case: AppendCase, x: kv_inputs.Inputs):
    written, page, entry = kv_oracle.entries(x.slots, len(kv_oracle.split(x.kv_cache)[0]),
                                             case.page_size)
    return written, page[written], entry[written]


# Pallas and XLA each against the float64 oracle, not against each other within an ulp:
# on the H200 their q differed by up to 160 bf16 ulps on near-zero outputs (run of
# 2026-12-01 13:49 UTC), both well inside the oracle's bound.
@pytest.mark.parametrize("backend", ["triton", "xla"])
@pytest.mark.parametrize("where", POSITIONS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_each_backend_matches_the_oracle(case, dtype_name, where, backend, rng):
    x = _inputs(rng, case, dtype_name, where)
    kv_inputs.check_against_oracle(case, x, kv_inputs.run(x, case, backend), TOLERANCE[dtype_name])


@pytest.mark.parametrize("case", [c for c in MROPE_APPEND_CASES if not c.fp8],
                         ids=lambda c: c.name)
def test_the_cache_holds_what_apply_rope_returns_for_k(case, rng):
    x = _inputs(rng, case, "bfloat16")
    q, k_cache, _ = _run(case, x, "triton")
    q_rope, k_rope = jr.apply_rope(jnp.asarray(x.q), jnp.asarray(x.k), jnp.asarray(x.pos),
                                   case.case.cfg, backend="triton")
    written, page, entry = _written(case, x)
    assert kv_oracle.ulps(q, np.asarray(q_rope)).max() <= 1
    rows = kv_oracle.rows(k_cache, case.layout, page, entry)
    assert kv_oracle.ulps(rows, np.asarray(k_rope)[written]).max() <= 1


def test_q_and_the_cache_are_rewritten_in_place_when_donated(rng):
    case = MROPE_APPEND_CASES[0]
    x = _inputs(rng, case, "bfloat16", tokens=64)
    step = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "backend"),
                   donate_argnums=(0, 4))
    q, cache = jnp.asarray(x.q), tuple(jnp.asarray(c) for c in x.kv_cache)
    pointers = [a.unsafe_buffer_pointer() for a in (q, *cache)]
    q2, cache2 = step(q, jnp.asarray(x.k), jnp.asarray(x.v), jnp.asarray(x.pos), cache,
                      jnp.asarray(x.slots), cfg=case.case.cfg, backend="triton")
    assert [a.unsafe_buffer_pointer() for a in (q2, *cache2)] == pointers
