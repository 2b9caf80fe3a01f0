"""RopeManager on the GPU: in place, zero copy, stream-ordered, no host sync.

Run on the device machine (``JAXROPE_GPU_TESTS=1``, ``-m gpu``); each test skips with
the reason when torch has no CUDA device or JAX no GPU backend. Every test runs both
apply paths: the launcher (Triton on torch's stream, when available) and the JAX
DLPack path. The position copy (host counters, pinned ring, one non-blocking copy on
torch's stream) is checked under a late device, a lapped ring and CUDA-graph capture.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")


import jaxrope as jr  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionStep,  # noqa: E402
                          RopeManager, Segment, StepContext)

pytestmark = pytest.mark.gpu
# Every random draw has its own fixed seed: a run repeats exactly.
_SEEDS = itertools.count(20261201)

HEAD_DIM = 128
# bf16 output rounding (half an ulp at |x| up to ~4) plus the kernels' angle error.
BF16_ATOL = 4 * 2.0 ** -8


def make(device, launcher, **kwargs):
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, max_position=1 << 20)
    return RopeManager(PositionConfig(rope=rope), device, max_seq_len=1 << 20, launcher=launcher,
                       **kwargs)


def planned(mgr, spans, offset=0, graph=None):
    rids = [f"r{i}" for i in range(len(spans))]
    for rid in rids:
        mgr.ingest_request(rid)
        mgr.apply_cached_prefix(rid, None, None, None, {"text": offset + next(_SEEDS) % (1 << 16)})
    step = PositionStep([Segment(rid, "text", n) for rid, n in zip(rids, spans)])
    ctx = StepContext(tuple(rids), graph_slot=graph)
    pos = mgr.plan(step, ctx)["text"]
    return step, ctx, pos


def rand_qk(device, tokens, dtype=torch.bfloat16, q_heads=32, k_heads=8):
    gen = torch.Generator(device=device).manual_seed(next(_SEEDS))
    q = torch.randn(tokens, q_heads, HEAD_DIM, device=device, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, HEAD_DIM, device=device, generator=gen).to(dtype)
    return q, k


def expected(x, pos, cfg):
    return oracle.rope_of(cfg, x.float().cpu().numpy(), pos.cpu().numpy())


def test_apply_qk_is_in_place_and_zero_copy(device, launcher):
    mgr = make(device, launcher)
    step, ctx, pos = planned(mgr, [1, 7, 33, 64])
    q, k = rand_qk(device, pos.shape[0])
    want_q, want_k = expected(q, pos, mgr.rope), expected(k, pos, mgr.rope)
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    out_q, out_k = mgr.apply_qk(q, k, "text")
    torch.cuda.synchronize()
    assert out_q is q and q.data_ptr() == q_ptr and k.data_ptr() == k_ptr
    np.testing.assert_allclose(q.float().cpu().numpy(), want_q, rtol=0, atol=BF16_ATOL)
    np.testing.assert_allclose(k.float().cpu().numpy(), want_k, rtol=0, atol=BF16_ATOL)
    if launcher == "jax":
        # XLA wrote into the imported buffers: no copy back.
        assert mgr._jax.call.aliased and all(mgr._jax.call.aliased.values()), mgr._jax.call.aliased
    mgr.commit(step, ctx)


def test_float32_is_rotated_in_float32(device, launcher):
    mgr = make(device, launcher)
    _, _, pos = planned(mgr, [19, 5], offset=1 << 19)
    q, k = rand_qk(device, pos.shape[0], dtype=torch.float32)
    want = expected(q, pos, mgr.rope)
    mgr.apply_qk(q, k, "text")
    assert q.dtype == torch.float32
    assert oracle.relative_error(q.cpu().numpy(), want) < 1e-5


def test_side_stream_producer_and_consumer_are_ordered(device, launcher):
    mgr = make(device, launcher)
    _, _, pos = planned(mgr, [256, 256])
    q, k = rand_qk(device, pos.shape[0])
    new_q, new_k = rand_qk(device, pos.shape[0])
    want_q, want_k = expected(new_q, pos, mgr.rope), expected(new_k, pos, mgr.rope)
    mgr.apply_qk(q.clone(), k.clone(), "text")  # compile outside the race
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # the producer is late: ~50 ms of spinning first
        q.copy_(new_q)
        k.copy_(new_k)
        mgr.apply_qk(q, k, "text")
        seen_q, seen_k = q.clone(), k.clone()  # the consumer reads right after
    torch.cuda.synchronize()
    np.testing.assert_allclose(seen_q.float().cpu().numpy(), want_q, rtol=0, atol=BF16_ATOL)
    np.testing.assert_allclose(seen_k.float().cpu().numpy(), want_k, rtol=0, atol=BF16_ATOL)


def test_plan_apply_commit_do_not_wait_for_the_device(device, launcher):
    mgr = make(device, launcher)
    step, ctx, pos = planned(mgr, [3] * 64)
    q, k = rand_qk(device, pos.shape[0])
    for _ in range(3):  # compile and check aliasing before timing
        mgr.apply_qk(q, k, "text")
        mgr.commit(step, ctx)
        mgr.plan(step, ctx)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms of queued GPU work ahead of us
    start = time.perf_counter()
    for _ in range(3):
        mgr.apply_qk(q, k, "text")
        mgr.commit(step, ctx)
        mgr.plan(step, ctx)
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    assert host < 0.04, f"the host waited {host * 1e3:.1f} ms: something synchronised"


def test_graph_buffers_are_static_and_keep_their_tail(device, launcher):
    mgr = make(device, launcher)
    graph = GraphSlot(GraphBucket("decode", 4, 8), 0)
    step, ctx, pos = planned(mgr, [2, 2, 2], graph=graph)
    assert pos.device == device and pos.shape == (8,)
    pos[6:] = torch.tensor([11, 12], dtype=torch.int32, device=device)
    live = pos[:6].clone()
    mgr.commit(step, ctx)
    again = mgr.plan(PositionStep(step.segments[:1]),
                     StepContext(ctx.request_ids[:1], graph_slot=graph))["text"]
    torch.cuda.synchronize()
    buf = mgr.pos_ids("text")
    assert again.data_ptr() == pos.data_ptr() and buf.data_ptr() == pos.data_ptr()
    assert buf[:2].tolist() == (live[:2] + 2).tolist()
    assert buf[2:6].tolist() == live[2:6].tolist() and buf[6:].tolist() == [11, 12]
    q, k = rand_qk(device, 8)
    want = expected(q, buf, mgr.rope)
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.float().cpu().numpy(), want, rtol=0, atol=BF16_ATOL)


def test_non_contiguous_q_takes_the_documented_copy_path(device, launcher):
    mgr = make(device, launcher)
    _, _, pos = planned(mgr, [17])
    qkv = torch.randn(17, 32 + 8 + 8, HEAD_DIM, device=device).to(torch.bfloat16)
    q, k = qkv[:, :32], qkv[:, 32:40]
    v = qkv[:, 40:].clone()
    want = expected(q, pos, mgr.rope)
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(qkv[:, :32].float().cpu().numpy(), want, rtol=0, atol=BF16_ATOL)
    assert torch.equal(qkv[:, 40:], v)


def test_positions_stay_right_when_the_host_laps_the_pinned_ring(device, launcher):
    """The host runs far ahead of a late device and rewrites every ring part: each step's
    positions must still be its own (a part is reused only once its copies completed).

    Steps of 16384 tokens fill a ring part (131072 ints) exactly every 8 steps, the case
    the first ring got wrong; one step of 200k tokens takes the path for spans larger
    than a part."""
    mgr = make(device, launcher)
    rids = [f"r{i}" for i in range(4)]
    for rid in rids:
        mgr.ingest_request(rid)
    outputs, wanted = [], []
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the device is ~50 ms late
    plans = [[4096] * 4] * 40 + [[40_000, 90_000, 1, 70_000]] + [[4096, 8192, 2048, 2048]] * 40
    for spans in plans:  # 1.5M positions, more than the 1M of the ring
        step = PositionStep([Segment(rid, "text", n) for rid, n in zip(rids, spans)])
        ctx = StepContext(tuple(rids))
        starts = [mgr.position(rid, "text") for rid in rids]
        outputs.append(mgr.plan(step, ctx)["text"])
        wanted.append(np.concatenate([np.arange(s, s + n) for s, n in zip(starts, spans)]))
        mgr.commit(step, ctx)
    torch.cuda.synchronize()
    for got, want in zip(outputs, wanted):
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_positions_reach_the_device_through_the_driver_on_the_current_stream(device, launcher):
    """The copy is the driver's cuMemcpyHtoDAsync on torch's current stream: on a late side
    stream, what a kernel queued after the plan on that stream reads is the step's own
    positions, across chunks and both streams."""
    mgr = make(device, launcher)
    assert mgr._upload._ring._copy is not None, "libcuda.so.1 has no cuMemcpyHtoDAsync_v2"
    rids = [f"r{i}" for i in range(8)]
    for rid in rids:
        mgr.ingest_request(rid)
    side, seen, wanted = torch.cuda.Stream(device), [], []
    torch.cuda.synchronize()
    for i in range(80):  # 80 x 16384 positions: the copies fill two device chunks
        stream = side if i % 2 else torch.cuda.current_stream(device)
        with torch.cuda.stream(stream):
            if i % 20 == 0:
                torch.cuda._sleep(20_000_000)  # the device falls behind the host
            step = PositionStep([Segment(rid, "text", 2048) for rid in rids])
            ctx = StepContext(tuple(rids))
            starts = [mgr.position(rid, "text") for rid in rids]
            seen.append(mgr.plan(step, ctx)["text"].clone())  # queued after the copy
            wanted.append(np.concatenate([np.arange(s, s + 2048) for s in starts]))
            mgr.commit(step, ctx)
            if i % 16 == 15:
                for rid in rids:
                    mgr.reset_request(rid)
    torch.cuda.synchronize()
    for got, want in zip(seen, wanted):
        np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_a_plan_from_a_thread_that_never_touched_cuda_gets_its_positions(device, launcher):
    import threading

    mgr = make(device, launcher)
    step, ctx, _ = planned(mgr, [5, 3])
    mgr.commit(step, ctx)
    want = [mgr.position(rid, "text") for rid in ctx.request_ids]
    result = {}

    def plan_here():
        try:
            result["pos"] = mgr.plan(step, ctx)["text"].cpu().tolist()
        except Exception as e:  # reported below, not lost in the thread
            result["error"] = e

    worker = threading.Thread(target=plan_here)
    worker.start()
    worker.join()
    assert "error" not in result, result.get("error")
    assert result["pos"] == list(range(want[0], want[0] + 5)) + list(range(want[1], want[1] + 3))


def test_plan_under_cuda_graph_capture_raises_and_changes_nothing(device, launcher):
    mgr = make(device, launcher)
    step, ctx, _ = planned(mgr, [2, 3])
    mgr.commit(step, ctx)
    before = mgr.state_snapshot()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="CUDA-graph capture"):
        with torch.cuda.graph(graph):
            mgr.plan(step, ctx)
    assert mgr.state_snapshot() == before


@pytest.mark.parametrize("exporter", ["triton", "mosaic"])
def test_a_failing_kernel_export_falls_back_to_the_jax_path(device, monkeypatch, exporter):
    # Each launcher, given explicitly ("auto" picks one of them per GPU), whose kernel
    # export fails: the call still rotates, on the JAX path.
    from jaxrope.ops.rope import mosaic_export, triton_export
    from torch_bridge.launch.mosaic import MosaicLauncher
    from torch_bridge.launch.triton import TritonLauncher

    def failing_export(**kwargs):
        raise jr.BackendUnavailable("export forced to fail by the test")

    module, launcher = {"triton": (triton_export, TritonLauncher),
                        "mosaic": (mosaic_export, MosaicLauncher)}[exporter]
    monkeypatch.setattr(module, "export", failing_export)
    try:
        mgr = make(device, launcher())
    except jr.BackendUnavailable as e:
        pytest.skip(f"no {exporter} launcher here: {e}")
    _, _, pos = planned(mgr, [5, 9])
    q, k = rand_qk(device, pos.shape[0])
    want_q, want_k = expected(q, pos, mgr.rope), expected(k, pos, mgr.rope)
    mgr.apply_qk(q, k, "text")
    torch.cuda.synchronize()
    assert mgr._jax is not None  # the JAX path rotated
    np.testing.assert_allclose(q.float().cpu().numpy(), want_q, rtol=0, atol=BF16_ATOL)
    np.testing.assert_allclose(k.float().cpu().numpy(), want_k, rtol=0, atol=BF16_ATOL)
