"""An M-RoPE RopeManager on CPU torch: [3, n] positions, counters that carry the delta.

A manager whose ``config.rope`` has ``mrope_section`` plans ``[3, n]`` int32 positions
per plan label (t, h, w rows): a computed view at ``counter + delta`` (+ ``arange``) on
all three rows, a prompt chunk as explicit ``[3, n]`` pos_ids. The delta is part of each
stream's record, so publish / admit / snapshots / forks carry it: the regression test of
the lost-delta bug of disaggregated serving (SGLang #8094, Dynamo #5281) is here.
``apply_qk`` runs the JAX path (DLPack) against the float64 M-RoPE oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope import models, mrope  # noqa: E402
from jaxrope.positions import Scheme  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (Fork, GraphBucket, GraphSlot, KVPlanOutput, KVView,  # noqa: E402
                          PositionConfig, PositionStep, PublishedPositionInfo, RopeManager,
                          Segment, StepContext)

VL = models.HF_VL_CONFIGS["Qwen/Qwen2.5-VL-7B-Instruct"]
ROPE = jr.RopeConfig.from_hf(VL)
# A 392 x 392 image at patch 14 is a 28 x 28 grid: 196 tokens after the 2 x 2 merge,
# spanning 14 positions, so its prompt's delta is 14 - 196 = -182 (the decode offset
# the engines of SGLang #8094 / Dynamo #5281 lost in the prefill -> decode handoff).
PROMPT = [mrope.Text(11), mrope.Image((1, 28, 28)), mrope.Text(20)]


def prompt_positions():
    return mrope.rope_index(PROMPT, **mrope.hf_index_args(VL))


def make(labels=("text",), scheme=Scheme.SEQUENTIAL, rope=ROPE, max_seq_len=4096, **kwargs):
    config = PositionConfig(rope=rope, labels=labels, scheme=scheme, block_step=2)
    return RopeManager(config, "cpu", max_seq_len=max_seq_len, launcher="jax", **kwargs)


def step_of(*segments, pos_ids=None):
    step = PositionStep([Segment(*s) for s in segments], pos_ids=pos_ids)
    return step, StepContext(tuple(dict.fromkeys(s[0] for s in segments)))


def prefill(mgr, rid, chunk=64, label="text"):
    """The prompt in chunks of explicit [3, n] pos_ids sliced from rope_index."""
    pos, delta = prompt_positions()
    mgr.ingest_request(rid, deltas={label: delta})
    for start in range(0, pos.shape[1], chunk):
        block = torch.from_numpy(pos[:, start:start + chunk].copy())
        step, ctx = step_of((rid, label, block.shape[1]), pos_ids=block)
        assert torch.equal(mgr.plan(step, ctx)[label], block.to(torch.int32))
        mgr.commit(step, ctx)
    return pos, delta


def decode(mgr, rid, label="text"):
    step, ctx = step_of((rid, label, 1))
    pos = mgr.plan(step, ctx)[label]
    mgr.commit(step, ctx)
    return pos


def test_the_real_image_prompt_has_delta_minus_182():
    pos, delta = prompt_positions()
    assert pos.shape == (3, 227) and delta == -182 and int(pos.max()) + 1 == 227 + delta


# -- planning ----------------------------------------------------------------------------


def test_decode_plans_counter_plus_delta_on_all_three_rows():
    mgr = make()
    pos, delta = prefill(mgr, "r0")
    assert mgr.position("r0", "text") == 227 and mgr.delta("r0", "text") == -182
    for i in range(3):
        planned = decode(mgr, "r0")
        assert planned.shape == (3, 1) and planned.dtype == torch.int32
        assert planned[:, 0].tolist() == [227 + i - 182] * 3
    assert int(pos.max()) + 1 == 227 - 182  # the first decode token follows the prompt


@pytest.mark.parametrize("scheme, want", [(Scheme.SEQUENTIAL, [45, 46, 47, 48]),
                                          (Scheme.BLOCK, [45, 45, 45, 45])])
def test_a_computed_view_is_counter_plus_delta_plus_its_scheme_on_every_row(scheme, want):
    mgr = make(scheme=scheme)
    mgr.ingest_request("r0", {"text": 227}, deltas={"text": -182})
    step, ctx = step_of(("r0", "text", 4))
    planned = mgr.plan(step, ctx)["text"]
    assert planned.tolist() == [want] * 3 and planned.is_contiguous()


def test_several_plan_labels_share_one_copy_each_block_contiguous():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("r0", {"cond": 50, "uncond": 60}, deltas={"cond": -10, "uncond": -20})
    step = PositionStep([Segment("r0", "cond", 2), Segment("r0", "uncond", 3)])
    planned = mgr.plan(step, StepContext(("r0",)))
    assert planned["cond"].tolist() == [[40, 41]] * 3
    assert planned["uncond"].tolist() == [[40, 41, 42]] * 3
    for tensor in planned.values():  # the kernel reads row r of token t at r * n + t
        assert tensor.is_contiguous() and tensor.shape[0] == 3
    assert planned["cond"].untyped_storage().data_ptr() == planned["uncond"].untyped_storage().data_ptr()


def test_explicit_positions_win_and_pos_ids_returns_the_3_by_n_tensor():
    mgr = make()
    mgr.ingest_request("r0", deltas={"text": -3})
    block = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 2], [0, 1, 2, 1]])
    step, ctx = step_of(("r0", "text", 4), pos_ids=block)
    mgr.plan(step, ctx)
    assert mgr.pos_ids("text").tolist() == block.tolist()
    mgr.commit(step, ctx)
    assert mgr.position("r0", "text") == 4  # the counter: the stream's length
    assert decode(mgr, "r0").tolist() == [[1], [1], [1]]


def test_graph_buffers_are_3_by_bucket_and_keep_their_tail():
    mgr = make()
    graph = GraphSlot(GraphBucket("decode", 4, 8), 0)
    for rid in ("a", "b"):
        mgr.ingest_request(rid, {"text": 100}, deltas={"text": -40})
    step = PositionStep([Segment("a", "text", 1), Segment("b", "text", 1)])
    ctx = StepContext(("a", "b"), graph_slot=graph)
    buffer = mgr.plan(step, ctx)["text"]
    assert buffer.shape == (3, 8) and buffer[:, :2].tolist() == [[60, 60]] * 3
    buffer[:, 2:] = torch.arange(6, dtype=torch.int32) + 7
    tail = buffer[:, 2:].clone()
    mgr.commit(step, ctx)
    again = mgr.plan(PositionStep([Segment("a", "text", 1)]),
                     StepContext(("a",), graph_slot=graph))["text"]
    assert again.data_ptr() == buffer.data_ptr() and again[:, 0].tolist() == [61] * 3
    assert again[:, 1].tolist() == [60] * 3 and torch.equal(again[:, 2:], tail)


def test_a_decode_plan_before_the_prompt_is_in_is_refused():
    # counter 0 + delta -182 would rotate at -182: the prompt must come as explicit pos_ids.
    mgr = make()
    mgr.ingest_request("r0", deltas={"text": -182})
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match=r"at counter 0 \+ M-RoPE delta -182 is below 0"):
        mgr.plan(*step_of(("r0", "text", 1)))
    assert mgr.state_snapshot() == before


# -- the delta travels: publish, admit, snapshots, forks ---------------------------------


def test_prefill_to_decode_handoff_keeps_the_delta():
    # The lost-delta bug (SGLang #8094, Dynamo #5281): the decode node planned counter + 0
    # (positions 227, 228, ...) where the model expects counter - 182 (45, 46, ...).
    prefill_node, decode_node = make(), make()
    prefill(prefill_node, "r0")
    info = prefill_node.publish("r0")
    assert info.counters == {"text": 227} and info.deltas == {"text": -182}
    decode_node.ingest_request("r0")
    assert decode_node.admit_retrieve("r0", "prefill", None, info).ok
    assert (decode_node.position("r0", "text"), decode_node.delta("r0", "text")) == (227, -182)
    assert decode(decode_node, "r0").tolist() == [[45]] * 3
    assert decode(decode_node, "r0").tolist() == [[46]] * 3
    assert int(np.asarray(decode_node.table.deltas)[decode_node.state_snapshot()["requests"]["r0"][0]]) == -182


def test_the_delta_survives_clone_update_and_the_snapshot_path():
    prefill_node = make()
    prefill(prefill_node, "r0")
    snapshot = prefill_node.publish_snapshot_for_step("r0", "prefill", None)
    decode(prefill_node, "r0")  # later changes do not alter the snapshot
    from_snapshot = prefill_node.publish_from_snapshot("r0", snapshot, "prefill", None)
    assert (from_snapshot.counters, from_snapshot.deltas) == ({"text": 227}, {"text": -182})
    merged = PublishedPositionInfo({"text": 100})  # an older, smaller record without a delta
    merged.update(from_snapshot.clone())
    assert (merged.counters, merged.deltas) == ({"text": 227}, {"text": -182})
    stale = PublishedPositionInfo({"text": 200}, deltas={"text": 0})
    merged.update(stale)  # within the epoch the larger position wins, and its delta with it
    assert merged.record("text") == (227, -182, 0)
    decode_node = make()
    decode_node.ingest_request("r0")
    assert decode_node.admit_retrieve("r0", "prefill", None, merged.clone()).ok
    assert decode(decode_node, "r0").tolist() == [[45]] * 3


def test_admit_takes_the_delta_with_the_winning_position_only():
    mgr = make()
    mgr.ingest_request("r0", {"text": 227}, deltas={"text": -182})
    echo = PublishedPositionInfo({"text": 200}, deltas={"text": 0}, fingerprint=mgr.fingerprint())
    assert mgr.admit_retrieve("r0", None, None, echo).ok  # a stale echo: nothing moves
    assert (mgr.position("r0", "text"), mgr.delta("r0", "text")) == (227, -182)
    rewind = PublishedPositionInfo({"text": 220}, deltas={"text": -175}, epochs={"text": 1})
    assert mgr.admit_retrieve("r0", None, None, rewind).ok  # a newer epoch wins, lower
    assert (mgr.position("r0", "text"), mgr.delta("r0", "text")) == (220, -175)


def test_a_cfg_fork_copies_the_delta_to_the_branch():
    mgr = make(labels=("cond", "uncond"))
    pos, delta = prompt_positions()
    mgr.ingest_request("r0", {"cond": 227}, deltas={"cond": delta})
    kv = {"cfg": KVPlanOutput([KVView("r0", "cond", 1), KVView("r0", "uncond", 1)],
                              pre_forks=[Fork("r0", "cond", "uncond")])}
    step = PositionStep([Segment("r0", "cond", 1), Segment("r0", "uncond", 1)])
    planned = mgr.plan(step, StepContext(("r0",), plan_results={"kv": kv}))["cfg"]
    assert planned.tolist() == [[45, 45]] * 3
    assert mgr.delta("r0", "uncond") == -182


def test_deltas_are_set_not_merged_and_reset_with_the_request():
    mgr = make()
    mgr.ingest_request("r0", deltas={"text": -5})
    mgr.ingest_request("r0", deltas={"text": -5})
    assert mgr.delta("r0", "text") == -5
    mgr.reset_request("r0")
    assert (mgr.position("r0", "text"), mgr.delta("r0", "text")) == (0, 0)


# -- apply_qk: the JAX path against the float64 M-RoPE oracle -----------------------------


def _expected(x, pos, cfg):
    inv_freq, attention = oracle.serving_frequencies(cfg)
    return oracle.rope_oracle(x.double().numpy(), np.asarray(pos, np.int64), inv_freq, attention,
                              cfg.rotary_dim, cfg.interleave, cfg.mrope_section,
                              cfg.mrope_interleaved)


@pytest.mark.parametrize("name", sorted(models.HF_VL_CONFIGS))
def test_apply_qk_rotates_in_place_at_the_3_by_n_positions(name, rng):
    cfg = jr.RopeConfig.from_hf(models.HF_VL_CONFIGS[name])
    mgr = make(rope=cfg)
    pos, delta = mrope.rope_index(PROMPT, **mrope.hf_index_args(models.HF_VL_CONFIGS[name]))
    mgr.ingest_request("r0", deltas={"text": delta})
    step, ctx = step_of(("r0", "text", pos.shape[1]), pos_ids=torch.from_numpy(pos.copy()))
    mgr.plan(step, ctx)
    q = torch.from_numpy(rng.standard_normal((pos.shape[1], 4, cfg.head_dim)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((pos.shape[1], 2, cfg.head_dim)).astype(np.float32))
    want_q, want_k = _expected(q, pos, cfg), _expected(k, pos, cfg)
    q_ptr = q.data_ptr()
    out_q, out_k = mgr.apply_qk(q, k, "text")
    assert out_q is q and q.data_ptr() == q_ptr
    np.testing.assert_allclose(q.numpy(), want_q, rtol=0, atol=2e-5)
    np.testing.assert_allclose(k.numpy(), want_k, rtol=0, atol=2e-5)


def test_apply_qk_on_fewer_tokens_than_planned_reads_the_first_of_each_row(rng):
    # A [3, N] plan rotating q of T < N tokens takes columns [0, T) of every row, not the
    # first T entries of the flattened rows.
    mgr = make()
    pos = np.stack([np.arange(8) * 3, np.arange(8) * 5 + 1, np.arange(8) * 7 + 2]).astype(np.int32)
    mgr.ingest_request("r0")
    mgr.plan(*step_of(("r0", "text", 8), pos_ids=torch.from_numpy(pos)))
    q = torch.from_numpy(rng.standard_normal((5, 2, 128)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((5, 1, 128)).astype(np.float32))
    want = _expected(q, pos[:, :5], ROPE)
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)


def test_apply_qk_after_a_handoff_rotates_the_decode_token_at_counter_minus_182(rng):
    prefill_node, decode_node = make(), make()
    prefill(prefill_node, "r0")
    decode_node.ingest_request("r0")
    decode_node.admit_retrieve("r0", "prefill", None, prefill_node.publish("r0"))
    step, ctx = step_of(("r0", "text", 1))
    decode_node.plan(step, ctx)
    q = torch.from_numpy(rng.standard_normal((1, 4, 128)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((1, 2, 128)).astype(np.float32))
    want = _expected(q, [[45], [45], [45]], ROPE)
    lost = _expected(q, [[227], [227], [227]], ROPE)  # what a lost delta would rotate to
    assert np.abs(want - lost).max() > 0.1
    decode_node.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)


# -- the Triton launcher's M-RoPE rules, on CPU (the launch itself: tests/gpu) -------------


def test_the_kernel_block_is_the_tensor_itself_or_a_contiguous_copy_of_its_first_columns():
    from torch_bridge.launch.runtime import mrope_block

    buffer = torch.arange(24, dtype=torch.int32).view(3, 8)  # a graph slot's [3, N] buffer
    assert mrope_block(buffer, 8) is buffer  # a replay over the whole bucket
    block = mrope_block(buffer, 5)
    assert block.is_contiguous() and block.tolist() == buffer[:, :5].tolist()
    # The kernel of count 5 reads row r of token t at r * 5 + t.
    flat = block.flatten().tolist()
    assert [flat[r * 5 + t] for r in range(3) for t in range(5)] == buffer[:, :5].flatten().tolist()


@pytest.mark.requires_triton
def test_the_launcher_exports_each_mrope_layout_as_its_own_kernel(monkeypatch):
    from jaxrope.ops.rope import triton_export
    from torch_bridge.launch.triton import TritonLauncher

    calls = []

    def recording_export(**kwargs):
        calls.append(kwargs)
        raise jr.BackendUnavailable("recorded by the test")

    monkeypatch.setattr(triton_export, "export", recording_export)
    launcher = TritonLauncher()
    sectioned = jr.RopeConfig(head_dim=128, theta=5e6, mrope_section=(24, 20, 20))
    configs = [sectioned, jr.RopeConfig(head_dim=128, theta=5e6, mrope_section=(24, 20, 20),
                                        mrope_interleaved=True),
               jr.RopeConfig(head_dim=128, theta=5e6, mrope_section=(16, 24, 24)),
               jr.RopeConfig(head_dim=128, theta=5e6)]
    for cfg in configs + [sectioned]:
        with pytest.raises(jr.BackendUnavailable, match="recorded"):
            launcher._prepare((64, 4, 128), 2, torch.bfloat16, torch.device("cpu"), cfg, None)
    # One export per layout (the repeated config's failure is cached under its key).
    assert [(c["mrope_section"], c["mrope_interleaved"]) for c in calls] == [
        ((24, 20, 20), False), ((24, 20, 20), True), ((16, 24, 24), False), (None, False)]
