"""An M-RoPE RopeManager on the GPU: apply_qk in place at [3, n] positions, CUDA graphs.

Run on the device machine (``JAXROPE_GPU_TESTS=1 python -m pytest -m gpu
tests/gpu/test_mrope_bridge_gpu.py``); each test skips with the reason when torch has no
CUDA device or JAX no GPU backend. Both apply paths run: the Triton launcher (the Pallas
kernel exported with the config's sections, launched on torch's stream) and the JAX
DLPack path. Positions come from :func:`jaxrope.mrope.rope_index` on a real image and
video prompt (prefill, explicit ``[3, n]``) and from the counters (decode, ``counter +
delta`` on all rows); every result is checked against the float64 M-RoPE oracle.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope import models, mrope  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionStep,  # noqa: E402
                          RopeManager, Segment, StepContext)

pytestmark = pytest.mark.gpu
_SEEDS = itertools.count(20261215)
# bf16 output rounding (half an ulp at |x| up to ~4) plus the kernels' angle error.
BF16_ATOL = 4 * 2.0 ** -8
# An image and a video: 392 x 392 at patch 14 (196 tokens over 14 positions) and 4 frames
# of 20 x 30 patches (150 tokens each).
PROMPT = [mrope.Text(9), mrope.Image((1, 28, 28)), mrope.Text(5),
          mrope.Video((4, 20, 30), second_per_grid_t=1.0), mrope.Text(12)]


def make(device, launcher, name="Qwen/Qwen2.5-VL-7B-Instruct"):
    rope = jr.RopeConfig.from_hf(models.HF_VL_CONFIGS[name])
    return RopeManager(PositionConfig(rope=rope), device, max_seq_len=32768, launcher=launcher)


def rand_qk(device, tokens, head_dim, q_heads=32, k_heads=8):
    gen = torch.Generator(device=device).manual_seed(next(_SEEDS))
    q = torch.randn(tokens, q_heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
    k = torch.randn(tokens, k_heads, head_dim, device=device, generator=gen).to(torch.bfloat16)
    return q, k


def expected(x, pos, cfg):
    return oracle.rope_of(cfg, x.float().cpu().numpy(), np.asarray(pos, np.int64))


def prefill(mgr, rid, config):
    pos, delta = mrope.rope_index(PROMPT, **mrope.hf_index_args(config))
    mgr.ingest_request(rid, deltas={"text": delta})
    step = PositionStep([Segment(rid, "text", pos.shape[1])],
                        pos_ids=torch.from_numpy(pos.copy()).to(mgr.device))
    ctx = StepContext((rid,))
    planned = mgr.plan(step, ctx)["text"]
    return step, ctx, planned, pos, delta


@pytest.mark.parametrize("name", sorted(models.HF_VL_CONFIGS))
def test_prefill_rotates_in_place_at_the_prompts_rows(device, launcher, name):
    mgr = make(device, launcher, name)
    step, ctx, planned, pos, _ = prefill(mgr, "r0", models.HF_VL_CONFIGS[name])
    assert planned.shape == pos.shape and planned.device == device
    q, k = rand_qk(device, pos.shape[1], mgr.rope.head_dim)
    want_q, want_k = expected(q, pos, mgr.rope), expected(k, pos, mgr.rope)
    pointers = (q.data_ptr(), k.data_ptr())
    out_q, out_k = mgr.apply_qk(q, k, "text")
    torch.cuda.synchronize()
    assert out_q is q and (q.data_ptr(), k.data_ptr()) == pointers
    np.testing.assert_allclose(q.float().cpu().numpy(), want_q, rtol=0, atol=BF16_ATOL)
    np.testing.assert_allclose(k.float().cpu().numpy(), want_k, rtol=0, atol=BF16_ATOL)
    if launcher == "auto":
        assert mgr._jax is None, "the launcher declined: the JAX path rotated"
    mgr.commit(step, ctx)


def test_fewer_q_tokens_than_planned_read_the_first_columns(device, launcher):
    mgr = make(device, launcher)
    _, _, planned, pos, _ = prefill(mgr, "r0", models.HF_VL_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"])
    tokens = 100  # inside the image: the rows differ
    q, k = rand_qk(device, tokens, mgr.rope.head_dim)
    want = expected(q, pos[:, :tokens], mgr.rope)
    mgr.apply_qk(q, k, "text")
    torch.cuda.synchronize()
    np.testing.assert_allclose(q.float().cpu().numpy(), want, rtol=0, atol=BF16_ATOL)


def test_decode_after_a_handoff_rotates_at_counter_plus_delta(device, launcher):
    config = models.HF_VL_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"]
    prefill_node, decode_node = make(device, launcher), make(device, launcher)
    step, ctx, _, pos, delta = prefill(prefill_node, "r0", config)
    prefill_node.commit(step, ctx)
    decode_node.ingest_request("r0")
    assert decode_node.admit_retrieve("r0", "prefill", None, prefill_node.publish("r0")).ok
    length = pos.shape[1]
    for i in range(3):
        step = PositionStep([Segment("r0", "text", 1)])
        planned = decode_node.plan(step, StepContext(("r0",)))["text"]
        want_pos = [[length + i + delta]] * 3
        assert planned.tolist() == want_pos and want_pos[0][0] == int(pos.max()) + 1 + i
        q, k = rand_qk(device, 1, decode_node.rope.head_dim)
        want = expected(q, want_pos, decode_node.rope)
        decode_node.apply_qk(q, k, "text")
        torch.cuda.synchronize()
        np.testing.assert_allclose(q.float().cpu().numpy(), want, rtol=0, atol=BF16_ATOL)
        decode_node.commit(step, StepContext(("r0",)))


@pytest.mark.parametrize("live", [3, 8], ids=["T<N", "T=N"])
def test_a_captured_decode_step_replays_at_each_steps_3_by_n_buffer(device, live):
    """CUDA-graph capture of apply_qk on a [3, N] graph buffer: q of ``live`` rows (T < N:
    the kernel reads a contiguous [3, T] copy made inside the graph; T = N: the buffer),
    replayed after each step's plan wrote new counter + delta positions into the buffer."""
    mgr = make(device, "auto")
    if mgr.launcher is None:
        pytest.skip("no fast launcher here (\"auto\" built none)")
    bucket = GraphBucket("decode", batch_size=8, num_tokens=8)
    graph_slot = GraphSlot(bucket, 0)
    rids = [f"r{i}" for i in range(3)]
    for i, rid in enumerate(rids):
        mgr.ingest_request(rid, {"text": 1000 + 97 * i}, deltas={"text": -182 - 31 * i})
    step = PositionStep([Segment(rid, "text", 1) for rid in rids])
    ctx = StepContext(tuple(rids), graph_slot=graph_slot)
    buffer = mgr.plan(step, ctx)["text"]
    assert buffer.shape == (3, 8)
    buffer[:, 3:] = torch.arange(5, dtype=torch.int32, device=device) + 7  # padding rows
    head_dim = mgr.rope.head_dim
    q_static, k_static = rand_qk(device, 8, head_dim)
    q_live, k_live = q_static[:live], k_static[:live]
    mgr.apply_qk(q_live, k_live, "text")  # compile and bind outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mgr.apply_qk(q_live, k_live, "text")
    mgr.commit(step, ctx)
    for i in range(3):
        planned = mgr.plan(step, ctx)["text"]
        assert planned.data_ptr() == buffer.data_ptr()
        new_q, new_k = rand_qk(device, 8, head_dim)
        q_static.copy_(new_q)
        k_static.copy_(new_k)
        positions = buffer[:, :live].cpu().numpy()
        want_q, want_k = expected(new_q[:live], positions, mgr.rope), expected(new_k[:live], positions,
                                                                              mgr.rope)
        graph.replay()
        torch.cuda.synchronize()
        assert buffer[:, :3].tolist() == [[1000 + 97 * r - 182 - 31 * r + 1 + i for r in range(3)]] * 3
        np.testing.assert_allclose(q_static[:live].float().cpu().numpy(), want_q, rtol=0,
                                   atol=BF16_ATOL)
        np.testing.assert_allclose(k_static[:live].float().cpu().numpy(), want_k, rtol=0,
                                   atol=BF16_ATOL)
        assert torch.equal(q_static[live:], new_q[live:])  # rows past q untouched
        mgr.commit(step, ctx)
