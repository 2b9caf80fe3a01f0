"""Speculative steps through RopeManager on the GPU: a tree verify rotated at its depths in
a CUDA-graph bucket's buffer, and a verify / accept / draft loop that never waits for the
device (issue 16: no device sync on the path).

Run on the device machine (``JAXROPE_GPU_TESTS=1``, ``-m gpu``); skips with the reason
when torch has no CUDA device.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionStep,  # noqa: E402
                          RopeManager, Segment, StepContext)

pytestmark = pytest.mark.gpu

HEAD_DIM = 128
# bf16 output rounding (half an ulp at |x| up to ~4) plus the kernels' angle error.
BF16_ATOL = 4 * 2.0 ** -8
TREE = (0, 1, 1, 1, 1, 2, 2, 3)


def make(device, launcher, counters):
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, max_position=1 << 20)
    mgr = RopeManager(PositionConfig(rope=rope), device, max_seq_len=1 << 20, launcher=launcher)
    for i, counter in enumerate(counters):
        mgr.ingest_request(f"r{i}", overrides={"text": int(counter)})
    return mgr, tuple(f"r{i}" for i in range(len(counters)))


def tree_step(rids):
    rows = np.tile(np.asarray(TREE, np.int64), (len(rids), 1))   # [streams, k]: one row a segment
    return PositionStep(tuple(Segment(rid, "text", len(TREE)) for rid in rids), tree=rows)


def rand_qk(device, tokens, seed):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, 32, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, 8, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    return q, k


def test_a_tree_verify_in_a_graph_bucket_rotates_every_token_at_counter_plus_depth(device, launcher):
    counters = np.array([7, 4000, 65_000, 123])
    mgr, rids = make(device, launcher, counters)
    tokens = len(rids) * len(TREE)
    graph = GraphSlot(GraphBucket("verify", len(rids), tokens + 8), 0)
    pos = mgr.plan(tree_step(rids), StepContext(rids, graph_slot=graph))["text"]
    want_pos = (np.repeat(counters, len(TREE)) + np.tile(TREE, len(rids))).tolist()
    assert pos.device == device and pos.shape == (tokens + 8,)
    assert pos[:tokens].tolist() == want_pos
    q, k = rand_qk(device, tokens + 8, seed=20261201)
    want = oracle.rope_of(mgr.rope, q.float().cpu().numpy(), pos.cpu().numpy())
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.float().cpu().numpy(), want, rtol=0, atol=BF16_ATOL)


def test_a_verify_accept_draft_loop_does_not_wait_for_the_device(device, launcher):
    mgr, rids = make(device, launcher, np.arange(64) * 100)
    verify, ctx = tree_step(rids), StepContext(rids)
    drafts = [PositionStep(tuple(Segment(rid, "text", 1) for rid in rids), draft_depth=j)
              for j in (0, 1, 2)]
    accepted = {(rid, "text"): i % 4 for i, rid in enumerate(rids)}
    q, k = rand_qk(device, len(rids) * len(TREE), seed=20261202)
    small_q, small_k = q[:len(rids)].clone(), k[:len(rids)].clone()

    def loop():
        mgr.plan(verify, ctx)
        mgr.apply_qk(q, k, "text")
        mgr.commit(verify, ctx, accepted=accepted)
        for draft in drafts:
            mgr.plan(draft, ctx)
            mgr.apply_qk(small_q, small_k, "text")
            mgr.commit(draft, ctx)

    for _ in range(3):  # compile before timing
        loop()
    torch.cuda.synchronize()
    before = [mgr.position(rid, "text") for rid in rids]
    torch.cuda._sleep(200_000_000)  # ~100 ms of queued GPU work ahead of us
    start = time.perf_counter()
    for _ in range(3):
        loop()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    assert host < 0.05, f"the host waited {host * 1e3:.1f} ms: something synchronised"
    assert [mgr.position(rid, "text") for rid in rids] == [
        p + 3 * (accepted[(rid, "text")] + 1) for p, rid in zip(before, rids)]
