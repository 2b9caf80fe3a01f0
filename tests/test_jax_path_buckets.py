"""The bridge's JAX path pads to token buckets: compiles grow with log2 of the largest token
count, results equal the unpadded computation bit for bit, and an engine's padded batch (q
longer than its plan) leaves the tail untouched."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402

import jaxrope as jr  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext  # noqa: E402
from torch_bridge import kv_append  # noqa: E402
from torch_bridge.dlpack import token_bucket  # noqa: E402
from torch_bridge.rotate import JaxRotation  # noqa: E402

# A head_dim and head counts no other test compiles for, so the jit cache entries counted
# here are this file's own (jax.jit shares one cache per function across instances).
HEAD_DIM, Q_HEADS, K_HEADS = 24, 3, 1
CFG = jr.RopeConfig(head_dim=HEAD_DIM)
# 15 distinct token counts over four buckets (16, 32, 64, 128).
TOKENS = (1, 2, 3, 5, 9, 16, 17, 20, 31, 32, 33, 50, 64, 65, 100)


def _compiles(fn) -> int:
    return fn._cache_size()


def _randn(rng, *shape) -> torch.Tensor:
    # A torch allocation (numpy's are not aligned as XLA needs for a zero-copy import).
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).clone()


def _manager() -> RopeManager:
    mgr = RopeManager(PositionConfig(rope=CFG), "cpu", max_seq_len=8192, launcher="jax")
    mgr.ingest_request("a")
    return mgr


def _step(tokens: int):
    return PositionStep([Segment("a", "text", tokens)]), StepContext(("a",))


def test_apply_qk_compiles_once_per_token_bucket_and_matches_the_unpadded_call_bit_for_bit(rng):
    mgr = _manager()
    unpadded = JaxRotation(jax.devices("cpu")[0])
    expected = []
    for tokens in TOKENS:
        step, ctx = _step(tokens)
        pos = mgr.plan(step, ctx)["text"]
        q, k = _randn(rng, tokens, Q_HEADS, HEAD_DIM), _randn(rng, tokens, K_HEADS, HEAD_DIM)
        expected.append((q.clone(), k.clone(), pos.clone(), q, k))
        mgr.apply_qk(q, k, "text")
        mgr.commit(step, ctx)
        if tokens == TOKENS[0]:
            before = _compiles(mgr._jax.call._jitted) - 1
    buckets = {token_bucket(t) for t in TOKENS}
    assert _compiles(mgr._jax.call._jitted) - before == len(buckets) == 4
    # The unpadded computation: the same kernel on exactly T tokens (no staging).
    for q_want, k_want, pos, q, k in expected:
        unpadded(q_want, k_want, pos, CFG, allow_copy=False)
        assert torch.equal(q, q_want) and torch.equal(k, k_want), q.shape


def _cache():
    return tuple(torch.zeros(16, 16, K_HEADS, HEAD_DIM) for _ in "kv")   # 16 pages of 16


def test_append_compiles_once_per_token_bucket_and_never_writes_a_padding_slot(rng):
    mgr = _manager()
    calls = []
    for tokens in TOKENS:
        step, ctx = _step(tokens)
        pos = mgr.plan(step, ctx)["text"].clone()
        q = _randn(rng, tokens, Q_HEADS, HEAD_DIM)
        k, v = _randn(rng, tokens, K_HEADS, HEAD_DIM), _randn(rng, tokens, K_HEADS, HEAD_DIM)
        slots = torch.from_numpy(rng.permutation(256)[:tokens].astype(np.int32)).clone()
        q_in, cache = q.clone(), _cache()
        mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots)
        mgr.commit(step, ctx)
        (call,) = mgr._kv_jax._calls.values()
        if tokens == TOKENS[0]:
            before = _compiles(call._jitted) - 1
        calls.append((q_in, k, v, pos, slots, q, cache))
    assert _compiles(call._jitted) - before == len({token_bucket(t) for t in TOKENS}) == 4
    unpadded = kv_append.JaxAppend(torch.device("cpu"))
    for q_want, k, v, pos, slots, q, cache in calls:
        cache_want = _cache()
        _, geometry, scales = kv_append.check_call(k, v, cache_want, slots, "NHD", None, None,
                                                   q.device)
        unpadded(q_want, k, v, cache_want, geometry, pos, slots, CFG, scales, allow_copy=False)
        assert torch.equal(q, q_want), q.shape
        for got, want in zip(cache, cache_want):
            assert torch.equal(got, want), q.shape
        # Only the T real tokens' slots hold anything (a padding token at slot -1 writes nothing).
        written = cache[1].flatten(0, 1).abs().sum((1, 2)).nonzero().flatten()
        assert sorted(written.tolist()) == sorted(slots.tolist()), q.shape


def test_apply_qk_with_q_longer_than_the_plan_rotates_the_planned_tokens_only(rng):
    mgr = _manager()
    step, ctx = _step(5)
    pos = mgr.plan(step, ctx)["text"]
    q, k = _randn(rng, 8, Q_HEADS, HEAD_DIM), _randn(rng, 8, K_HEADS, HEAD_DIM)
    q_want, k_want = q[:5].clone(), k[:5].clone()
    q_tail, k_tail = q[5:].clone(), k[5:].clone()
    assert mgr.apply_qk(q, k, "text")[0] is q
    JaxRotation(jax.devices("cpu")[0])(q_want, k_want, pos, CFG, allow_copy=False)
    assert torch.equal(q[:5], q_want) and torch.equal(k[:5], k_want)
    assert torch.equal(q[5:], q_tail) and torch.equal(k[5:], k_tail)
    mgr.commit(step, ctx)
    assert mgr.position("a", "text") == 5


def test_append_with_q_longer_than_the_plan_neither_rotates_nor_caches_the_tail(rng):
    mgr = _manager()
    step, ctx = _step(5)
    mgr.plan(step, ctx)
    q = _randn(rng, 8, Q_HEADS, HEAD_DIM)
    k, v = _randn(rng, 8, K_HEADS, HEAD_DIM), _randn(rng, 8, K_HEADS, HEAD_DIM)
    # The engine's padded batch names real slots for its tail too: they must stay empty.
    slots = torch.arange(8, dtype=torch.int32) * 3
    q_tail, cache = q[5:].clone(), _cache()
    mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots)
    assert torch.equal(q[5:], q_tail)
    flat_k, flat_v = (c.flatten(0, 1) for c in cache)
    assert torch.equal(flat_v[slots[:5].long()], v[:5])
    assert not flat_k[slots[5:].long()].any() and not flat_v[slots[5:].long()].any()
    assert int(flat_v.abs().sum((1, 2)).count_nonzero()) == 5


def test_mrope_positions_are_padded_along_their_token_axis(rng):
    cfg = jr.RopeConfig(head_dim=HEAD_DIM, mrope_section=(4, 4, 4))
    rows = torch.from_numpy(rng.integers(0, 500, (3, 7)).astype(np.int32))
    q, k = _randn(rng, 7, Q_HEADS, HEAD_DIM), _randn(rng, 7, K_HEADS, HEAD_DIM)
    q_want, k_want = q.clone(), k.clone()
    q64 = oracle.rope_of(cfg, q.numpy().astype(np.float64), rows.numpy())
    rotation = JaxRotation(jax.devices("cpu")[0])
    rotation(q, k, rows, cfg)
    rotation(q_want, k_want, rows, cfg, allow_copy=False)
    assert torch.equal(q, q_want) and torch.equal(k, k_want)
    np.testing.assert_allclose(q.numpy(), q64, rtol=0, atol=2e-5)
