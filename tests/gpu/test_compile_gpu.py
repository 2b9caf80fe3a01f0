"""``torch.compile`` of layers calling the bridge on the GPU, CUDA graphs included.

Run on the device machine (``-m gpu``). The vLLM-shaped layer compiled with
``mode="reduce-overhead"`` replays its CUDA graph with new positions and new inputs
each step and rotates bit for bit as eager does; the manager's fused RoPE + KV append
layer compiles whole (default mode: every T, eager's cache bit for bit) and under
``reduce-overhead`` replays with positions planned into a graph slot's static buffer
(:class:`torch_bridge.GraphSlot`), as an engine's CUDA-graph runner plans them.
"""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

import torch._dynamo.testing  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import jaxrope as jr  # noqa: E402
from bench.compile_layers import FusedQKVAttention, PagedAttention  # noqa: E402
from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionStep,  # noqa: E402
                          RopeManager, RotaryEmbedding, Segment, StepContext)

pytestmark = pytest.mark.gpu
_SEEDS = itertools.count(20261205)  # every draw its own fixed seed: a run repeats exactly

HIDDEN, HQ, HK, D = 512, 8, 2, 128
CFG = jr.RopeConfig(head_dim=D, theta=5e5, max_position=1 << 17)
# bf16 attention outputs: compiled and eager matmul/softmax may round differently.
BF16_ATOL = 2.0 ** -6


def _gen(device):
    return torch.Generator(device=device).manual_seed(next(_SEEDS))


def _x(device, tokens):
    return torch.randn(tokens, HIDDEN, device=device, generator=_gen(device)).to(torch.bfloat16)


def _twins(make, device):
    torch.manual_seed(next(_SEEDS))
    eager = make()
    twin = make()
    twin.load_state_dict(eager.state_dict())
    return eager.to(device), twin.to(device)


def test_vllm_layer_under_cuda_graphs_replays_with_new_positions(device):
    rotary = RotaryEmbedding(CFG)
    eager, twin = _twins(lambda: FusedQKVAttention(rotary, HIDDEN, HQ, HK, D,
                                                   dtype=torch.bfloat16), device)

    def rotated(positions, qkv_in):  # the rotation alone: the same kernel, bit for bit
        qkv = qkv_in * 1
        q, k, _ = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
        rotary(positions, q, k)
        return qkv

    counters.clear()
    graphed = torch.compile(rotated, mode="reduce-overhead", fullgraph=True)
    graphed_layer = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    for _ in range(6):  # warm-up, record, then replays
        torch.compiler.cudagraph_mark_step_begin()
        positions = torch.randint(0, CFG.max_position, (64,), device=device, generator=_gen(device))
        x = _x(device, 64)
        with torch.no_grad():
            qkv = eager.qkv_proj(x)
            assert torch.equal(graphed(positions, qkv).clone(), rotated(positions, qkv))
            torch.testing.assert_close(graphed_layer(positions, x).clone(), eager(positions, x),
                                       rtol=0, atol=BF16_ATOL)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def _paged(manager):
    return PagedAttention(manager, HIDDEN, HQ, HK, pages=16, page_size=16, dtype=torch.bfloat16,
                          device=manager.device)


def _managers(device):
    managers = [RopeManager(PositionConfig(rope=CFG), device, max_seq_len=256) for _ in range(2)]
    for mgr in managers:
        mgr.ingest_request("r0")
    return managers


def _run(mgr, tokens, fn, graph=None):
    step = PositionStep([Segment("r0", "text", tokens)])
    ctx = StepContext(("r0",), graph_slot=graph)
    mgr.plan(step, ctx)
    with torch.no_grad():
        out = fn().clone()
    mgr.commit(step, ctx)
    return out


def test_paged_layer_compiles_whole_and_writes_eager_cache(device):
    eager_mgr, compiled_mgr = _managers(device)
    eager, twin = _paged(eager_mgr), _paged(compiled_mgr)
    twin.load_state_dict(eager.state_dict())
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(twin, backend=counter, fullgraph=True, dynamic=True)
    start = 0
    for tokens in (24, 7, 33, 12):
        x = _x(device, tokens)
        slots = torch.arange(start, start + tokens, device=device)
        context = torch.arange(start + tokens, device=device)
        want = _run(eager_mgr, tokens, lambda: eager(x, slots, context))
        got = _run(compiled_mgr, tokens, lambda: compiled(x, slots, context))
        torch.testing.assert_close(got, want, rtol=0, atol=BF16_ATOL)
        assert torch.equal(twin.kv_cache, eager.kv_cache)
        start += tokens
    assert counter.frame_count <= 2, counter.frame_count  # the first call may duck-size S == T


def test_paged_layer_under_cuda_graphs_replays_positions_of_a_graph_slot(device):
    eager_mgr, compiled_mgr = _managers(device)
    eager, twin = _paged(eager_mgr), _paged(compiled_mgr)
    twin.load_state_dict(eager.state_dict())
    tokens, lease = 16, GraphSlot(GraphBucket("decode", 1, 16), 0)
    context = torch.arange(16 * 16, device=device)  # the whole cache, masked by position
    counters.clear()
    graphed = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    for step in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        x = _x(device, tokens)
        slots = torch.arange(step * tokens, (step + 1) * tokens, device=device)
        want = _run(eager_mgr, tokens, lambda: eager(x, slots, context), lease)
        got = _run(compiled_mgr, tokens, lambda: graphed(x, slots, context), lease)
        torch.testing.assert_close(got, want, rtol=0, atol=BF16_ATOL)
        assert torch.equal(twin.kv_cache, eager.kv_cache), f"step {step}: caches differ"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
