"""RopeManager on the GPU over a long run and under load: no memory growth, no stream race.

Run on the device machine (``JAXROPE_GPU_TESTS=1 python3 -m pytest -m gpu tests/gpu``);
each test skips with the reason when torch has no CUDA device or JAX no GPU backend.
Both apply paths run: the launcher (Triton on torch's stream, when available) and the
JAX DLPack path. ``-s`` prints the measured figures.
"""

from __future__ import annotations

import gc
import itertools
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")


import jaxrope as jr  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext  # noqa: E402
from torch_bridge.dlpack import jax_device  # noqa: E402

pytestmark = pytest.mark.gpu
# Every random draw has its own fixed seed: a run repeats exactly.
_SEEDS = itertools.count(20261201)

HEAD_DIM = 128
# bf16 output rounding (half an ulp at |x| up to ~4) plus the kernels' angle error.
BF16_ATOL = 4 * 2.0 ** -8
CALLS = 10_000
WARMUP = 200
MEMORY_TOLERANCE = 1 << 20     # bytes of device memory growth allowed over the CALLS
RACE_ITERATIONS = 40
LOAD_SIZE = 4096               # each float32 [4096, 4096] matmul keeps the GPU busy for ms


def make(device, launcher):
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, max_position=1 << 20)
    return RopeManager(PositionConfig(rope=rope), device, max_seq_len=1 << 20, launcher=launcher)


def ingest(mgr, count, base):
    """Ingest ``count`` requests ``r0``, ``r1``, ...; request ``i`` starts at ``base + 977 * i``."""
    rids = [f"r{i}" for i in range(count)]
    for i, rid in enumerate(rids):
        mgr.ingest_request(rid)
        mgr.apply_cached_prefix(rid, None, None, None, {"text": base + 977 * i})
    return rids


def rand_qk(device, tokens, q_heads=32, k_heads=8):
    gen = torch.Generator(device=device).manual_seed(next(_SEEDS))
    q = torch.randn(tokens, q_heads, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, k_heads, HEAD_DIM, device=device, generator=gen).to(torch.bfloat16)
    return q, k


def expected(x, pos, cfg):
    return oracle.rope_of(cfg, x.float().cpu().numpy(), np.asarray(pos))


def jax_bytes_in_use(device) -> int:
    stats = jax_device(device).memory_stats()
    if not stats or "bytes_in_use" not in stats:
        pytest.skip("this JAX backend reports no memory_stats()")
    return stats["bytes_in_use"]


def test_10k_apply_qk_calls_grow_no_device_memory_and_stay_correct(device, launcher):
    mgr = make(device, launcher)
    base = 1 << 19
    rids = ingest(mgr, 8, base)
    step, ctx = PositionStep([Segment(rid, "text", 1) for rid in rids]), StepContext(tuple(rids))
    src_q, src_k = rand_qk(device, len(rids))
    q, k = torch.empty_like(src_q), torch.empty_like(src_k)

    def decode(calls):
        for _ in range(calls):
            pos = mgr.plan(step, ctx)["text"]
            q.copy_(src_q)
            k.copy_(src_k)
            mgr.apply_qk(q, k, "text")
            mgr.commit(step, ctx)
        return pos

    decode(WARMUP)
    torch.cuda.synchronize(device)
    gc.collect()
    torch_before, jax_before = torch.cuda.memory_allocated(device), jax_bytes_in_use(device)
    start = time.perf_counter()
    pos = decode(CALLS)
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    gc.collect()
    torch_after, jax_after = torch.cuda.memory_allocated(device), jax_bytes_in_use(device)
    print(f"\n{CALLS} plan+apply_qk+commit steps ({launcher}, path "
          f"{type(mgr.launcher).__name__ if mgr.launcher else 'JAX DLPack'}): {elapsed:.2f} s, "
          f"{elapsed / CALLS * 1e6:.0f} us/step; torch allocated {torch_before} -> {torch_after} B "
          f"({torch_after - torch_before:+d}), JAX bytes_in_use {jax_before} -> {jax_after} B "
          f"({jax_after - jax_before:+d})")
    last = [base + 977 * i + WARMUP + CALLS - 1 for i in range(len(rids))]
    assert pos.tolist() == last
    assert [mgr.position(rid, "text") for rid in rids] == [p + 1 for p in last]
    np.testing.assert_allclose(q.float().cpu().numpy(), expected(src_q, last, mgr.rope), rtol=0,
                               atol=BF16_ATOL)
    np.testing.assert_allclose(k.float().cpu().numpy(), expected(src_k, last, mgr.rope), rtol=0,
                               atol=BF16_ATOL)
    assert torch_after - torch_before <= MEMORY_TOLERANCE
    assert jax_after - jax_before <= MEMORY_TOLERANCE


@pytest.mark.parametrize("stream", ["current", "side"])
def test_apply_qk_is_stream_ordered_between_large_kernels(device, launcher, stream):
    """Each call sits between two ~ms matmuls; its input is written right before it and read
    right after it on the same stream, and q holds NaN until the writer runs.

    A rotation that ran before the writer reads NaN (or the old q); one that torch's next
    read did not wait for leaves that read unrotated. Nothing on the host synchronises
    inside the loop, so every iteration is queued while the GPU is still busy.
    """
    mgr = make(device, launcher)
    rids = ingest(mgr, 4, 1 << 18)
    step = PositionStep([Segment(rid, "text", 16) for rid in rids])
    ctx = StepContext(tuple(rids))
    tokens = 16 * len(rids)
    a = torch.randn(LOAD_SIZE, LOAD_SIZE, device=device)
    b = torch.randn(LOAD_SIZE, LOAD_SIZE, device=device)
    load = torch.empty_like(a)
    sources = [rand_qk(device, tokens) for _ in range(RACE_ITERATIONS)]
    q, k = torch.empty_like(sources[0][0]), torch.empty_like(sources[0][1])
    warm_q, warm_k = sources[0][0].clone(), sources[0][1].clone()
    mgr.plan(step, ctx)
    mgr.apply_qk(warm_q, warm_k, "text")  # compile outside the race
    torch.cuda.synchronize(device)

    side = torch.cuda.Stream(device) if stream == "side" else torch.cuda.current_stream(device)
    seen, planned = [], []
    start = time.perf_counter()
    with torch.cuda.stream(side):
        for src_q, src_k in sources:
            pos = mgr.plan(step, ctx)["text"]
            q.fill_(float("nan"))
            k.fill_(float("nan"))
            torch.mm(a, b, out=load)          # the producer is late
            q.copy_(src_q)
            k.copy_(src_k)
            mgr.apply_qk(q, k, "text")
            seen.append((q.clone(), k.clone()))  # the consumer reads at once
            torch.mm(b, a, out=load)          # and more work queues behind it
            planned.append(pos)
            mgr.commit(step, ctx)
        host = time.perf_counter() - start
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    print(f"\n{RACE_ITERATIONS} calls between [{LOAD_SIZE}]^2 matmuls ({launcher}, {stream} stream): "
          f"host queued them in {host * 1e3:.1f} ms, the GPU finished after {elapsed * 1e3:.1f} ms")
    for i, ((got_q, got_k), pos, (src_q, src_k)) in enumerate(zip(seen, planned, sources)):
        positions = pos.cpu().numpy()
        assert positions.tolist() == [p + 16 * i + t for p in
                                      [(1 << 18) + 977 * r for r in range(len(rids))]
                                      for t in range(16)], i
        np.testing.assert_allclose(got_q.float().cpu().numpy(), expected(src_q, positions, mgr.rope),
                                   rtol=0, atol=BF16_ATOL, err_msg=f"q of call {i}")
        np.testing.assert_allclose(got_k.float().cpu().numpy(), expected(src_k, positions, mgr.rope),
                                   rtol=0, atol=BF16_ATOL, err_msg=f"k of call {i}")


@pytest.mark.parametrize("dtype_name", ["int64", "uint64", "uint32", "int16", "uint8"])
def test_fused_append_skips_slots_outside_the_cache_at_their_own_width(device, launcher,
                                                                        dtype_name):
    """Slots that an int32 cast would wrap onto slot 3 (2**32 + 3, -2**32 + 3, ...) skip their
    token on both launcher calls (the first, then the bound one) and in a CUDA graph replay."""
    dtype = getattr(torch, dtype_name)
    info = torch.iinfo(dtype)
    mgr = make(device, launcher)
    (rid,) = ingest(mgr, 1, 1000)
    tokens = 4
    step, ctx = PositionStep([Segment(rid, "text", tokens)]), StepContext((rid,))
    wraps = [v for v in (2 ** 32 + 3, -2 ** 32 + 3, 2 ** 64 - 2 ** 32 + 3, 2 ** 31 + 3, 259,
                         info.max, info.min) if info.min <= v <= info.max and not 0 <= v < 64]
    chosen = (wraps * tokens)[:tokens - 1]
    slots = torch.tensor([*chosen, 5], dtype=dtype, device=device)
    ids = torch.arange(1, tokens + 1, device=device, dtype=torch.bfloat16)[:, None, None]
    v = ids.expand(tokens, 8, HEAD_DIM).contiguous()
    q = torch.zeros(tokens, 32, HEAD_DIM, device=device, dtype=torch.bfloat16)
    cache = torch.zeros(4, 2, 16, 8, HEAD_DIM, device=device, dtype=torch.bfloat16)  # 64 slots

    def written():
        torch.cuda.synchronize(device)
        values = cache[:, 1, :, 0, 0].reshape(-1)
        return {i: float(x) for i, x in enumerate(values.tolist()) if x}

    for _ in range(3):   # the launcher's first call, then its bound launch
        mgr.plan(step, ctx)
        cache.zero_()
        mgr.apply_qk_and_append_kv(q, v, v, "text", cache, slots)
        assert written() == {5: float(tokens)}, (dtype_name, slots.tolist())
        mgr.commit(step, ctx)
    if launcher == "auto":
        mgr.plan(step, ctx)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            mgr.apply_qk_and_append_kv(q, v, v, "text", cache, slots)
        cache.zero_()
        slots[-1] = 6
        graph.replay()
        assert written() == {6: float(tokens)}, (dtype_name, slots.tolist())
        mgr.commit(step, ctx)


def test_a_cache_pair_sharing_memory_is_refused_after_a_bound_launch(device, launcher):
    """A signature bound with two caches does not let one tensor passed twice through."""
    mgr = make(device, launcher)
    (rid,) = ingest(mgr, 1, 1000)
    step, ctx = PositionStep([Segment(rid, "text", 2)]), StepContext((rid,))
    q = torch.zeros(2, 32, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v = torch.ones(2, 8, HEAD_DIM, device=device, dtype=torch.bfloat16)
    k_cache, v_cache = (torch.zeros(4, 16, 8, HEAD_DIM, device=device, dtype=torch.bfloat16)
                        for _ in "kv")
    slots = torch.tensor([0, 5], device=device)
    for pair in ((k_cache, v_cache), (k_cache, v_cache), (k_cache, k_cache)):
        mgr.plan(step, ctx)
        if pair[1] is k_cache:
            k_cache.zero_()
            with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
                mgr.apply_qk_and_append_kv(q, v, v, "text", pair, slots)
            torch.cuda.synchronize(device)
            assert not k_cache.any()
        else:
            mgr.apply_qk_and_append_kv(q, v, v, "text", pair, slots)
        mgr.commit(step, ctx)
