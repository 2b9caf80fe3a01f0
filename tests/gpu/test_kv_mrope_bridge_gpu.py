"""RopeManager.apply_qk_and_append_kv on an M-RoPE manager on the GPU: "auto"'s launcher.

FlashInfer has no M-RoPE, so the launcher ("auto", which must then have run: no JAX path
built) and the JAX DLPack path ("jax") are each held to the float64 oracle on the same
tensors, for every case of ``jaxrope.cases.MROPE_APPEND_CASES`` at 517 tokens:

- a plan of ``[3, N]`` positions with ``N == T`` (the plan's buffer read as is) and
  ``N > T`` (the first T columns copied into one ``[3, T]`` block, as ``apply_qk``
  does); the second call of a signature runs the bound launch and gives the same result;
- q and the k rows within the bf16 oracle tolerance (fp8 rows within one e4m3 ulp), v
  rows bit-identical, every entry no slot names unchanged, k and v only read;
- a decode step captured in a CUDA graph on the ``[3, N]`` graph buffer, for ``T < N``
  and ``T == N``, replayed after each step's plan: the eager call's results.

Run on the device machine: ``JAXROPE_GPU_TESTS=1 python -m pytest -m gpu
tests/gpu/test_kv_mrope_bridge_gpu.py``.
"""

from __future__ import annotations

import dataclasses
import itertools

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxrope.cases import MROPE_APPEND_CASES, AppendCase  # noqa: E402
from jaxrope.testing import flashinfer_kv, kv_inputs, kv_oracle, oracle  # noqa: E402
from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionStep,  # noqa: E402
                          RopeManager, Segment, StepContext)

pytestmark = pytest.mark.gpu

LABEL = "text"
BF16 = np.dtype(ml_dtypes.bfloat16)
TOKENS = 517
BF16_TOLERANCE = oracle.RELATIVE_TOLERANCE["bfloat16"]
_SEEDS = itertools.count(20261217)


def _manager(device, launcher, cfg) -> RopeManager:
    return RopeManager(PositionConfig(rope=cfg), device, max_seq_len=cfg.max_position,
                       launcher=launcher)


@pytest.fixture
def fast(device):
    if _manager(device, "auto", MROPE_APPEND_CASES[0].case.cfg).kv_launcher is None:
        pytest.skip("no fast launcher here (\"auto\" built none)")


def _inputs(device, case: AppendCase, tokens: int, planned: int):
    rng = np.random.default_rng(next(_SEEDS))
    c = case.case
    pages = 2 * -(-tokens // case.page_size) + 1
    pos = rng.integers(0, 1 << 20, (3, planned)).astype(np.int32)
    slots = rng.permutation(pages * case.page_size)[:tokens]
    slots[tokens - case.padding:] = -1

    def normal(*shape, to=torch.bfloat16):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device).to(to)

    rows = (case.page_size, c.k_heads) if case.layout == "NHD" else (c.k_heads, case.page_size)
    cache_dtype = torch.float8_e4m3fn if case.fp8 else torch.bfloat16
    pair = tuple(normal(pages, *rows, c.head_dim, to=cache_dtype) for _ in "kv")
    return dict(q=normal(tokens, c.q_heads, c.head_dim), k=normal(tokens, c.k_heads, c.head_dim),
                v=normal(tokens, c.k_heads, c.head_dim), pos=pos, pages=pages,
                slots=torch.from_numpy(slots).to(device),
                cache=torch.stack(pair, dim=1) if case.combined else pair,
                scales=kv_inputs.FP8_SCALES if case.fp8 else {})


def _clone(cache):
    return cache.clone() if isinstance(cache, torch.Tensor) else tuple(c.clone() for c in cache)


def _numpy(case: AppendCase, q, cache):
    """numpy ``(q, k_cache, v_cache)``, bf16 and fp8 bit for bit."""
    k_cache, v_cache = (cache[:, 0], cache[:, 1]) if case.combined else cache
    return tuple(flashinfer_kv.from_torch(t, BF16) for t in (q, k_cache, v_cache))


def _call(mgr, case: AppendCase, x, q, cache):
    mgr.apply_qk_and_append_kv(q, x["k"], x["v"], LABEL, cache, x["slots"], layout=case.layout,
                               **x["scales"])



def _check_against_oracle(case: AppendCase, x, got, before, pos):
    """:func:`kv_inputs.check_against_oracle` on numpy ``(q, k_cache, v_cache)`` after
    (``got``) and before the call; the caches come split (:func:`_numpy`), so the case is
    checked as a pair."""
    q_in, k_old, v_old = before
    k_in, v_in = (flashinfer_kv.from_torch(t, BF16) for t in (x["k"], x["v"]))
    inputs = kv_inputs.Inputs(q_in, k_in, v_in, pos, x["slots"].cpu().numpy(), (k_old, v_old),
                              x["scales"])
    kv_inputs.check_against_oracle(dataclasses.replace(case, combined=False), inputs,
                                   (got[0], got[1:]), BF16_TOLERANCE)


@pytest.mark.parametrize("extra", [0, 5], ids=["T=N", "T<N"])
@pytest.mark.parametrize("case", MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_the_launcher_matches_the_oracle_and_the_jax_path(case, extra, device, fast):
    x = _inputs(device, case, TOKENS, TOKENS + extra)
    results = {}
    for launcher in ("auto", "jax"):
        mgr = _manager(device, launcher, case.case.cfg)
        mgr.ingest_request("r")
        mgr.plan(PositionStep([Segment("r", LABEL, TOKENS + extra)],
                              pos_ids=torch.from_numpy(x["pos"]).to(device)), StepContext(("r",)))
        k_in, v_in = x["k"].clone(), x["v"].clone()
        runs = []
        for _ in range(2):  # the second call of a signature runs the bound launch
            q, cache = x["q"].clone(), _clone(x["cache"])
            _call(mgr, case, x, q, cache)
            torch.cuda.synchronize()
            runs.append(_numpy(case, q, cache))
        assert torch.equal(x["k"], k_in) and torch.equal(x["v"], v_in), "k and v are only read"
        if launcher == "auto":
            assert mgr._kv_jax is None, "the launcher should have run, not the JAX path"
        for a, b in zip(*runs):
            np.testing.assert_array_equal(kv_oracle.bits(a), kv_oracle.bits(b), err_msg=f"{launcher}: bound call")
        results[launcher] = runs[0]
    before = _numpy(case, x["q"], x["cache"])
    # Each path against the float64 oracle: the launcher's kernel and the JAX path's
    # differed by up to 7 bf16 ulps on near-zero outputs on the H200 (2026-12-01 13:49 UTC).
    for launcher in ("auto", "jax"):
        _check_against_oracle(case, x, results[launcher], before, x["pos"][:, :TOKENS])


@pytest.mark.parametrize("live", [3, 8], ids=["T<N", "T=N"])
def test_a_captured_decode_step_replays_at_each_steps_3_by_n_buffer(live, device, fast):
    case = MROPE_APPEND_CASES[0]
    cfg = case.case.cfg
    mgr = _manager(device, "auto", cfg)
    rids = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(rids):
        mgr.ingest_request(rid, {LABEL: 1000 + 97 * i}, deltas={LABEL: -182 - 31 * i})
    step = PositionStep([Segment(rid, LABEL, 1) for rid in rids])
    lease = GraphSlot(GraphBucket("decode", batch_size=8, num_tokens=8), 0)
    ctx = StepContext(tuple(rids), graph_slot=lease)
    buffer = mgr.plan(step, ctx)[LABEL]
    assert buffer.shape == (3, 8)
    buffer[:, 3:] = torch.arange(5, dtype=torch.int32, device=device) + 7  # padding columns
    x = _inputs(device, case, 8, 8)
    q, k, v = (x[name][:live] for name in "qkv")
    cache = x["cache"]
    slots = torch.full((live,), -1, dtype=torch.int64, device=device)
    slots[:3] = torch.tensor([3, 40, 17], device=device)  # of 3 pages of 16
    mgr.apply_qk_and_append_kv(q, k, v, LABEL, cache, slots)  # once outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        mgr.apply_qk_and_append_kv(q, k, v, LABEL, cache, slots)
    gen = torch.Generator(device=device).manual_seed(next(_SEEDS))
    for i in range(2):
        mgr.commit(step, ctx)
        assert mgr.plan(step, ctx)[LABEL].data_ptr() == buffer.data_ptr(), "the graph's buffer"
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, device=device, generator=gen).to(t.dtype))
        slots[:3] = torch.tensor([5 + i, 30, 44 - i], device=device)
        q_in, want_q, want_cache = q.clone(), q.clone(), _clone(cache)
        mgr.apply_qk_and_append_kv(want_q, k, v, LABEL, want_cache, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert mgr._kv_jax is None
        assert torch.equal(q, want_q) and all(map(torch.equal, cache, want_cache)), f"replay {i}"
        positions = buffer[:, :live].cpu().numpy()
        assert positions[:, :3].tolist() == [[1000 + 97 * r - 182 - 31 * r + 1 + i
                                              for r in range(3)]] * 3
        got = flashinfer_kv.from_torch(q, BF16).astype(np.float64)
        want = oracle.rope_of(cfg, flashinfer_kv.from_torch(q_in, BF16), positions)
        assert oracle.relative_error(got, want) < BF16_TOLERANCE
