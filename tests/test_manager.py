"""RopeManager / PositionManager on CPU torch: every method's semantics.

Counters are checked through the public ``position`` and ``mgr.table``; bad inputs are
catalogued in tests/test_bad_inputs_*.py, random operation sequences against the core's
transitions in tests/test_manager_state_machine.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.positions import Scheme  # noqa: E402

from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (AdmitOutcome, EngineInfo, Fork, GraphBucket, GraphSlot,  # noqa: E402
                          KVPlanOutput, KVView, PositionConfig, PositionManager, PositionStep,
                          PublishedPositionInfo, ResourceSpec, RopeManager, Segment, StepContext)
from torch_bridge.dlpack import NotZeroCopyError  # noqa: E402

HEAD_DIM = 16


def make(labels=("text",), scheme=Scheme.SEQUENTIAL, block_step=1, max_seq_len=4096,
         rope=None, **kwargs) -> RopeManager:
    rope = rope or jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5)
    cfg = PositionConfig(rope=rope, labels=labels, scheme=scheme, block_step=block_step)
    return RopeManager(cfg, "cpu", max_seq_len=max_seq_len, launcher="jax", **kwargs)


def ctx_for(*rids, kv=None, preplan=False, graph=None) -> StepContext:
    results = {} if kv is None else {"kv": kv}
    return StepContext(rids, is_preplan=preplan, plan_results=results, graph_slot=graph)


def counters(mgr, rid):
    return {label: mgr.position(rid, label) for label in mgr.labels}


def assert_consistent(mgr):
    """``mgr.table`` holds every stream's ``position`` at the stream's slot."""
    table = np.asarray(mgr.table.counters)
    for rid, slots in mgr.state_snapshot()["requests"].items():
        assert [int(table[s]) for s in slots] == [mgr.position(rid, label) for label in mgr.labels]


def run_step(mgr, segments, kv=None):
    step = PositionStep(segments)
    ctx = ctx_for(*{s.request_id for s in segments}, kv=kv)
    pos = mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    return pos


# Every q/k draw has its own fixed seed: a run repeats exactly.
_SEEDS = itertools.count(20261201)


def qk(tokens, q_heads=3, k_heads=2, dtype=torch.float32, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(next(_SEEDS))
    q = torch.randn(tokens, q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, head_dim, generator=gen).to(dtype)
    return q, k


def expected_rotation(x, pos, cfg):
    return oracle.rope_of(cfg, x.float().numpy(), np.asarray(pos))


# ---------------------------------------------------------------------------- ingest


def test_repeated_ingest_after_a_step_keeps_the_counters():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("r")
    run_step(mgr, [Segment("r", "cond", 7), Segment("r", "uncond", 3)])
    mgr.ingest_request("r")
    mgr.ingest_request("r")
    assert counters(mgr, "r") == {"cond": 7, "uncond": 3}
    assert_consistent(mgr)


def test_ingest_overrides_raise_start_positions_monotonically():
    mgr = make()
    mgr.ingest_request("r", overrides={"text": 12})
    mgr.ingest_request("r", overrides={"text": 5})
    assert mgr.position("r", "text") == 12


def test_many_requests_grow_the_table_and_keep_counters():
    mgr = make()
    rids = [f"r{i}" for i in range(300)]
    mgr.ingest_request(rids[0])
    run_step(mgr, [Segment(rids[0], "text", 9)])
    for rid in rids[1:]:
        mgr.ingest_request(rid)
    assert mgr.table.capacity >= 300
    assert mgr.position(rids[0], "text") == 9
    run_step(mgr, [Segment(rid, "text", 1) for rid in rids])
    assert mgr.position(rids[0], "text") == 10 and mgr.position(rids[-1], "text") == 1
    assert_consistent(mgr)


# ---------------------------------------------------------------------------- plan / commit


def test_sequential_plan_numbers_views_from_their_counters():
    mgr = make()
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    run_step(mgr, [Segment("a", "text", 5)])
    pos = run_step(mgr, [Segment("a", "text", 3), Segment("b", "text", 2)])
    assert pos["text"].dtype == torch.int32
    assert pos["text"].tolist() == [5, 6, 7, 0, 1]
    assert counters(mgr, "a") == {"text": 8} and counters(mgr, "b") == {"text": 2}
    assert_consistent(mgr)


def test_block_scheme_repeats_the_counter_and_advances_by_block_step():
    mgr = make(scheme=Scheme.BLOCK, block_step=4)
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    pos = run_step(mgr, [Segment("a", "text", 3), Segment("b", "text", 0)])
    assert pos["text"].tolist() == [0, 0, 0]
    assert counters(mgr, "a") == {"text": 4} and counters(mgr, "b") == {"text": 0}
    pos = run_step(mgr, [Segment("a", "text", 2), Segment("b", "text", 1)])
    assert pos["text"].tolist() == [4, 4, 0]
    assert_consistent(mgr)


def test_packed_cfg_labels_keep_kv_order():
    mgr = make(labels=("cond", "uncond"))
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    mgr.apply_cached_prefix("a", None, None, None, {"cond": 10, "uncond": 20})
    views = (KVView("b", "uncond", 2), KVView("a", "cond", 3), KVView("b", "cond", 1),
             KVView("a", "uncond", 2))
    step = PositionStep([Segment("a", "cond", 3), Segment("a", "uncond", 2),
                         Segment("b", "cond", 1), Segment("b", "uncond", 2)])
    ctx = ctx_for("a", "b", kv={"cfg": KVPlanOutput(views)})
    pos = mgr.plan(step, ctx)
    assert list(pos) == ["cfg"]
    assert pos["cfg"].tolist() == [0, 1, 10, 11, 12, 0, 20, 21]
    mgr.commit(step, ctx)
    assert counters(mgr, "a") == {"cond": 13, "uncond": 22}
    assert counters(mgr, "b") == {"cond": 1, "uncond": 2}


def test_each_plan_label_gets_its_own_vector():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    kv = {"attn_cond": KVPlanOutput([KVView("a", "cond", 2)]),
          "attn_uncond": KVPlanOutput([KVView("a", "uncond", 3)])}
    mgr.apply_cached_prefix("a", None, None, None, {"uncond": 7})
    pos = mgr.plan(PositionStep([Segment("a", "cond", 2)]), ctx_for("a", kv=kv))
    assert pos["attn_cond"].tolist() == [0, 1]
    assert pos["attn_uncond"].tolist() == [7, 8, 9]


def test_pre_forks_apply_before_plan_and_post_forks_after_commit():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    run_step(mgr, [Segment("a", "cond", 6)])
    kv = {"cfg": KVPlanOutput([KVView("a", "cond", 1), KVView("a", "uncond", 1)],
                              pre_forks=[Fork("a", "cond", "uncond")],
                              post_forks=[Fork("a", "uncond", "cond")])}
    step = PositionStep([Segment("a", "cond", 1), Segment("a", "uncond", 2)])
    pos = mgr.plan(step, ctx_for("a", kv=kv))
    assert pos["cfg"].tolist() == [6, 6]
    assert counters(mgr, "a") == {"cond": 6, "uncond": 6}
    mgr.commit(step, ctx_for("a", kv=kv))
    assert counters(mgr, "a") == {"cond": 8, "uncond": 8}
    assert_consistent(mgr)


def test_explicit_pos_ids_win_over_counters():
    mgr = make()
    mgr.ingest_request("a")
    explicit = torch.tensor([40, 41, 7], dtype=torch.int64)
    step = PositionStep([Segment("a", "text", 3)], pos_ids={"text": explicit})
    pos = mgr.plan(step, ctx_for("a"))
    assert pos["text"].dtype == torch.int32 and pos["text"].tolist() == [40, 41, 7]
    assert mgr.pos_ids("text").tolist() == [40, 41, 7]
    mgr.commit(step, ctx_for("a"))
    assert mgr.position("a", "text") == 3


def test_one_explicit_tensor_serves_the_single_plan_label():
    mgr = make()
    mgr.ingest_request("a")
    step = PositionStep([Segment("a", "text", 2)], pos_ids=torch.tensor([9, 3], dtype=torch.int32))
    assert mgr.plan(step, ctx_for("a"))["text"].tolist() == [9, 3]


def test_explicit_advance_replaces_the_scheme_amount():
    mgr = make()
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    step = PositionStep([Segment("a", "text", 4), Segment("b", "text", 4)],
                        advance={("a", "text"): 1})
    mgr.plan(step, ctx_for("a", "b"))
    mgr.commit(step, ctx_for("a", "b"))
    assert counters(mgr, "a") == {"text": 1} and counters(mgr, "b") == {"text": 4}
    step = PositionStep([Segment("a", "text", 4), Segment("b", "text", 4)], advance=2)
    mgr.plan(step, ctx_for("a", "b"))
    mgr.commit(step, ctx_for("a", "b"))
    assert counters(mgr, "a") == {"text": 3} and counters(mgr, "b") == {"text": 6}
    assert_consistent(mgr)


def test_commit_accepts_an_equal_step_object():
    mgr = make()
    mgr.ingest_request("a")
    mgr.plan(PositionStep([Segment("a", "text", 2)]), ctx_for("a"))
    mgr.commit(PositionStep([Segment("a", "text", 2)]), ctx_for("a"))
    assert mgr.position("a", "text") == 2


# ---------------------------------------------------------------------------- preplan


def test_preplan_positions_follow_the_pending_commit():
    mgr = make()
    mgr.ingest_request("a")
    step1 = PositionStep([Segment("a", "text", 4)])
    step2 = PositionStep([Segment("a", "text", 1)])
    mgr.plan(step1, ctx_for("a"))
    staged = mgr.plan(step2, ctx_for("a", preplan=True))
    assert staged["text"].tolist() == [4]
    assert mgr.pos_ids("text").tolist() == [0, 1, 2, 3]
    assert mgr.position("a", "text") == 0
    mgr.commit(step1, ctx_for("a"))
    assert mgr.pos_ids("text").tolist() == [4]
    mgr.commit(step2, ctx_for("a"))
    assert mgr.position("a", "text") == 5
    assert_consistent(mgr)


def test_preplan_then_clear_preplan_leaves_counters_and_forks_as_before():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    run_step(mgr, [Segment("a", "cond", 5), Segment("a", "uncond", 2)])
    before, table_before = counters(mgr, "a"), np.asarray(mgr.table.counters).copy()
    kv = {"cfg": KVPlanOutput([KVView("a", "uncond", 1)], pre_forks=[Fork("a", "cond", "uncond")],
                              post_forks=[Fork("a", "uncond", "cond")])}
    step = PositionStep([Segment("a", "uncond", 1)])
    staged = mgr.plan(step, ctx_for("a", kv=kv, preplan=True))
    assert staged["cfg"].tolist() == [5]
    mgr.clear_preplan()
    assert counters(mgr, "a") == before
    np.testing.assert_array_equal(np.asarray(mgr.table.counters), table_before)
    assert mgr.pos_ids("cfg") is None
    with pytest.raises(ValueError, match="without a plan"):
        mgr.commit(step, ctx_for("a", kv=kv))


def test_staged_plan_without_a_current_one_runs_as_the_next_step():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    run_step(mgr, [Segment("a", "cond", 3)])
    kv = {"cfg": KVPlanOutput([KVView("a", "uncond", 2)], pre_forks=[Fork("a", "cond", "uncond")])}
    step = PositionStep([Segment("a", "uncond", 2)])
    mgr.plan(step, ctx_for("a", kv=kv, preplan=True))
    assert mgr.position("a", "uncond") == 0
    mgr.commit(step, ctx_for("a", kv=kv))
    assert counters(mgr, "a") == {"cond": 3, "uncond": 5}
    assert_consistent(mgr)


def test_a_normal_plan_drops_a_staged_one():
    mgr = make()
    mgr.ingest_request("a")
    first = PositionStep([Segment("a", "text", 2)])
    mgr.plan(first, ctx_for("a"))
    mgr.plan(PositionStep([Segment("a", "text", 1)]), ctx_for("a", preplan=True))
    again = PositionStep([Segment("a", "text", 3)])
    assert mgr.plan(again, ctx_for("a"))["text"].tolist() == [0, 1, 2]
    mgr.commit(again, ctx_for("a"))
    assert mgr.position("a", "text") == 3
    with pytest.raises(ValueError, match="without a plan"):
        mgr.commit(first, ctx_for("a"))


# ---------------------------------------------------------------------------- CUDA-graph slots


def test_graph_slots_write_static_buffers_whose_tail_keeps_old_values():
    mgr = make()
    for rid in ("a", "b", "c"):
        mgr.ingest_request(rid)
    bucket = GraphBucket("decode", 4, 8)
    slot0, slot1 = GraphSlot(bucket, 0), GraphSlot(bucket, 1)
    step = PositionStep([Segment(rid, "text", 2) for rid in ("a", "b", "c")])
    first = mgr.plan(step, ctx_for("a", "b", "c", graph=slot0))["text"]
    mgr.commit(step, ctx_for("a", "b", "c", graph=slot0))
    assert first.shape == (8,) and first[:6].tolist() == [0, 1, 0, 1, 0, 1]
    first[6:] = torch.tensor([77, 78], dtype=torch.int32)
    ptr = first.data_ptr()
    small = PositionStep([Segment("a", "text", 1), Segment("b", "text", 1)])
    again = mgr.plan(small, ctx_for("a", "b", graph=slot0))["text"]
    assert again.data_ptr() == ptr
    assert again.tolist() == [2, 2, 0, 1, 0, 1, 77, 78]
    other = mgr.plan(small, ctx_for("a", "b", graph=slot1, preplan=True))["text"]
    assert other.data_ptr() != ptr and other[:2].tolist() == [3, 3]
    assert mgr.pos_ids("text").data_ptr() == ptr


def test_graph_step_rejects_more_tokens_than_the_bucket():
    mgr = make()
    mgr.ingest_request("a")
    with pytest.raises(ValueError, match="num_tokens=4"):
        mgr.plan(PositionStep([Segment("a", "text", 5)]),
                 ctx_for("a", graph=GraphSlot(GraphBucket(None, 1, 4), 0)))
    assert mgr.pos_ids("text") is None


def test_apply_qk_under_a_graph_slot_rotates_bucket_padded_q():
    mgr = make()
    mgr.ingest_request("a")
    mgr.apply_cached_prefix("a", None, None, None, {"text": 30})
    graph = GraphSlot(GraphBucket("decode", 1, 4), 0)
    pos = mgr.plan(PositionStep([Segment("a", "text", 1)]), ctx_for("a", graph=graph))["text"]
    q, k = qk(4)
    want_q = expected_rotation(q, pos.numpy(), mgr.rope)
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.numpy(), want_q, rtol=0, atol=2e-5)


# ---------------------------------------------------------------------------- admit / prefix / publish


def test_stale_admit_does_not_rewind():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    outcome = mgr.admit_retrieve("a", "node1", "walk", PublishedPositionInfo({"cond": 40, "uncond": 9}))
    assert outcome == AdmitOutcome(True, True, None)
    run_step(mgr, [Segment("a", "cond", 2)])
    stale = mgr.admit_retrieve("a", "node1", "walk", PublishedPositionInfo({"cond": 40, "uncond": 3}))
    assert stale.ok
    assert counters(mgr, "a") == {"cond": 42, "uncond": 9}
    assert_consistent(mgr)


def test_admit_of_nothing_published_is_ok_and_moves_nothing():
    mgr = make()
    mgr.ingest_request("a")
    assert mgr.admit_retrieve("a", None, None, None) == AdmitOutcome(True, True, None)
    assert mgr.position("a", "text") == 0


def test_admit_reports_unknown_requests_labels_and_overlong_positions_without_change():
    mgr = make(max_seq_len=100)
    mgr.ingest_request("a")
    unknown = mgr.admit_retrieve("zz", None, None, PublishedPositionInfo({"text": 3}))
    assert not unknown.ok and "zz" in unknown.reason
    bad_label = mgr.admit_retrieve("a", None, None, PublishedPositionInfo({"text": 5, "image": 3}))
    assert not bad_label.ok and "image" in bad_label.reason
    too_far = mgr.admit_retrieve("a", None, None, PublishedPositionInfo({"text": 101}))
    assert not too_far.ok and "max_seq_len" in too_far.reason
    assert mgr.position("a", "text") == 0


def test_admit_of_the_wrong_published_type_raises_and_moves_nothing():
    mgr = make()
    mgr.ingest_request("a")
    with pytest.raises(TypeError, match="PublishedPositionInfo"):
        mgr.admit_retrieve("a", None, None, {"text": 5})
    assert mgr.position("a", "text") == 0


def test_repeated_prefix_probe_moves_nothing():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    mgr.apply_cached_prefix("a", "n", "walk", None, {"cond": 16})
    mgr.apply_cached_prefix("a", "n", "walk", None, {"cond": 16})
    assert counters(mgr, "a") == {"cond": 16, "uncond": 0}
    run_step(mgr, [Segment("a", "cond", 4)])
    mgr.apply_cached_prefix("a", "n", "walk", None, {"cond": 16})
    assert mgr.position("a", "cond") == 20
    mgr.apply_cached_prefix("a", "n", "walk", None, None)
    assert mgr.position("a", "cond") == 20


def test_snapshot_keeps_the_counters_it_was_taken_at():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a")
    run_step(mgr, [Segment("a", "cond", 3), Segment("a", "uncond", 1)])
    snapshot = mgr.publish_snapshot_for_step("a", "node", "walk")
    run_step(mgr, [Segment("a", "cond", 5)])
    mgr.admit_retrieve("a", None, None, PublishedPositionInfo({"uncond": 50}))
    old = mgr.publish_from_snapshot("a", snapshot, "node", "walk")
    assert old == PublishedPositionInfo({"cond": 3, "uncond": 1}, fingerprint=mgr.fingerprint())
    assert mgr.publish("a").counters == {"cond": 8, "uncond": 50}


def test_snapshot_and_publish_of_an_unknown_request_are_none():
    mgr = make()
    assert mgr.publish("nobody") is None
    assert mgr.publish_snapshot_for_step("nobody", None, None) is None
    assert mgr.publish_from_snapshot("nobody", None, None, None) is None


def test_publish_from_a_foreign_snapshot_raises():
    mgr = make()
    with pytest.raises(TypeError, match="snapshot"):
        mgr.publish_from_snapshot("a", {"text": 3}, None, None)


def test_published_info_clone_is_independent_and_update_takes_the_max():
    info = PublishedPositionInfo({"cond": 5, "uncond": 9})
    copy = info.clone()
    copy.counters["cond"] = 100
    assert info.counters["cond"] == 5
    info.update(PublishedPositionInfo({"cond": 7, "uncond": 2, "image": 1}))
    assert info.counters == {"cond": 7, "uncond": 9, "image": 1}
    with pytest.raises(TypeError):
        info.update({"cond": 3})


# ---------------------------------------------------------------------------- remove / reset


def test_a_rollback_reaches_the_node_that_admitted_the_drafts():
    # A prefill node publishes 12 positions that include drafts; the decode node admits
    # them; the prefill node rolls two back: its new epoch makes the decode node take the
    # lower position, and a late echo of the first publication no longer moves it.
    prefill, decode = make(), make()
    for mgr in (prefill, decode):
        mgr.ingest_request("a")
    run_step(prefill, [Segment("a", "text", 12)])
    first = prefill.publish("a")
    assert decode.admit_retrieve("a", None, None, first).ok
    prefill.rollback("a", "text", 10)
    assert prefill.position("a", "text") == 10 and prefill.publish("a").epochs == {"text": 1}
    assert decode.admit_retrieve("a", None, None, prefill.publish("a")).ok
    assert decode.position("a", "text") == 10
    assert decode.admit_retrieve("a", None, None, first).ok  # stale: epoch 0
    assert decode.position("a", "text") == 10
    run_step(decode, [Segment("a", "text", 1)])
    assert decode.publish("a").record("text") == (11, 0, 1)
    assert decode.publish("a").rewinds == {"text": ((prefill.writer, 1),)}


def test_a_rollback_that_moves_nothing_keeps_the_epoch():
    mgr = make()
    mgr.ingest_request("a")
    run_step(mgr, [Segment("a", "text", 5)])
    mgr.rollback("a", "text", 9)
    assert mgr.publish("a").record("text") == (5, 0, 0) and mgr.publish("a").rewinds == {}


def test_a_rollback_of_a_planned_stream_is_refused_and_changes_nothing():
    mgr = make()
    mgr.ingest_request("a")
    mgr.plan(PositionStep([Segment("a", "text", 4)]), ctx_for("a"))
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match=r"in a plan not yet committed \(the current plan numbers it"):
        mgr.rollback("a", "text", 0)
    assert mgr.state_snapshot() == before


def test_admit_refuses_a_record_of_a_manager_that_rotates_differently():
    mgr = make()
    mgr.ingest_request("a")
    other = make(rope=jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4))
    other.ingest_request("a")
    run_step(other, [Segment("a", "text", 7)])
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("a", None, None, other.publish("a"))
    assert not outcome.ok and "fingerprint differs" in outcome.reason
    assert mgr.state_snapshot() == before


def test_remove_frees_the_request_and_a_new_ingest_starts_at_zero():
    mgr = make()
    mgr.ingest_request("a")
    run_step(mgr, [Segment("a", "text", 6)])
    mgr.remove_request("a")
    mgr.remove_request("a")
    with pytest.raises(ValueError, match=r"request_id='a' was removed \(remove_request\)"):
        mgr.position("a", "text")
    with pytest.raises(ValueError, match="request_id='z' was never ingested"):
        mgr.position("z", "text")
    assert mgr.publish("a") is None
    mgr.ingest_request("a")
    assert mgr.position("a", "text") == 0
    assert_consistent(mgr)


def test_removal_between_plan_and_commit_spares_the_slot_s_next_owner():
    mgr = make()
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    step = PositionStep([Segment("a", "text", 5), Segment("b", "text", 2)])
    mgr.plan(step, ctx_for("a", "b"))
    mgr.remove_request("a")
    mgr.ingest_request("c")  # may reuse a's slot
    mgr.commit(step, ctx_for("a", "b"))
    assert mgr.position("c", "text") == 0 and mgr.position("b", "text") == 2
    assert_consistent(mgr)


def test_reset_request_zeroes_counters_and_free_removes_it():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("dummy")
    run_step(mgr, [Segment("dummy", "cond", 4), Segment("dummy", "uncond", 4)])
    mgr.reset_request("dummy")
    assert counters(mgr, "dummy") == {"cond": 0, "uncond": 0}
    mgr.reset_request("dummy", free=True)
    assert "dummy" not in mgr.requests()
    with pytest.raises(ValueError, match="request_id='dummy' was removed"):
        mgr.reset_request("dummy")


# ---------------------------------------------------------------------------- resource hooks


def test_resource_hooks():
    mgr = make()
    assert mgr.depends_on() == ("kv",)
    assert mgr.supports_preplan is True
    assert mgr.force_double_buffer is False
    assert RopeManager.prefix_skip_safe is True


def test_fingerprint_is_stable_and_changes_with_every_input():
    base = make().fingerprint()
    assert isinstance(base, bytes) and len(base) == 32
    assert make().fingerprint() == base
    assert make(rope=jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, interleave=True)).fingerprint() != base
    assert make(rope=jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5 + 1)).fingerprint() != base
    assert make(scheme=Scheme.BLOCK).fingerprint() != base
    assert make(scheme=Scheme.BLOCK, block_step=2).fingerprint() != make(scheme=Scheme.BLOCK).fingerprint()
    assert make(labels=("cond", "uncond")).fingerprint() == base


def test_build_from_spec_and_engine_info():
    spec = ResourceSpec("position", PositionConfig(labels=("cond", "uncond")),
                        options={"launcher": "jax"})
    mgr = RopeManager.build(spec, EngineInfo("cpu", head_dim=32, max_seq_len=512))
    assert mgr.name == "position" and mgr.head_dim == 32
    assert mgr.max_seq_len == 512 and mgr.labels == ("cond", "uncond")
    plain = PositionManager.build(ResourceSpec("pos", PositionConfig()), EngineInfo("cpu"))
    assert type(plain) is PositionManager and plain.max_seq_len == 32768


def test_constructor_rejects_inconsistent_arguments():
    rope = jr.RopeConfig(head_dim=64, max_position=1024)
    with pytest.raises(ValueError, match="head_dim"):
        RopeManager(PositionConfig(rope=rope), "cpu", max_seq_len=512, head_dim=128)
    with pytest.raises(ValueError, match="max_seq_len"):
        RopeManager(PositionConfig(rope=rope), "cpu", max_seq_len=2048)
    with pytest.raises(ValueError, match="head_dim is required"):
        RopeManager(PositionConfig(), "cpu")
    with pytest.raises(TypeError, match="dtype"):   # q and k keep their dtype: no such argument
        RopeManager(PositionConfig(rope=rope), "cpu", max_seq_len=512, dtype=torch.float32)
    with pytest.raises(ValueError, match="launcher"):
        RopeManager(PositionConfig(rope=rope), "cpu", max_seq_len=512, launcher="fast")
    with pytest.raises(ValueError, match="labels"):
        PositionConfig(labels=("a", "a"))
    with pytest.raises(ValueError, match="block_step"):
        PositionConfig(block_step=0)


# ---------------------------------------------------------------------------- apply_qk


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_apply_qk_matches_the_float64_oracle_in_place(dtype, atol):
    mgr = make()
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    mgr.apply_cached_prefix("b", None, None, None, {"text": 3000})
    pos = mgr.plan(PositionStep([Segment("a", "text", 3), Segment("b", "text", 4)]), ctx_for("a", "b"))
    q, k = qk(7, dtype=dtype)
    want_q, want_k = (expected_rotation(x, pos["text"].numpy(), mgr.rope) for x in (q, k))
    q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
    out_q, out_k = mgr.apply_qk(q, k, "text")
    assert out_q is q and out_k is k
    assert q.data_ptr() == q_ptr and k.data_ptr() == k_ptr and q.dtype == dtype
    np.testing.assert_allclose(q.float().numpy(), want_q, rtol=0, atol=atol)
    np.testing.assert_allclose(k.float().numpy(), want_k, rtol=0, atol=atol)


def test_float32_q_is_rotated_in_float32_not_through_bfloat16():
    mgr = make()
    mgr.ingest_request("a")
    mgr.apply_cached_prefix("a", None, None, None, {"text": 1000})
    pos = mgr.plan(PositionStep([Segment("a", "text", 8)]), ctx_for("a"))["text"]
    q, k = qk(8)
    want = expected_rotation(q, pos.numpy(), mgr.rope)
    mgr.apply_qk(q, k, "text")
    assert oracle.relative_error(q.numpy(), want) < 1e-6


def test_apply_qk_accepts_flattened_heads_and_fewer_tokens_than_planned():
    mgr = make()
    mgr.ingest_request("a")
    pos = mgr.plan(PositionStep([Segment("a", "text", 6)]), ctx_for("a"))["text"]
    q, k = qk(4)
    want = expected_rotation(q, pos[:4].numpy(), mgr.rope)
    flat_q, flat_k = q.reshape(4, -1), k.reshape(4, -1)
    mgr.apply_qk(flat_q, flat_k, "text")
    np.testing.assert_allclose(flat_q.reshape(4, 3, HEAD_DIM).numpy(), want, rtol=0, atol=2e-5)


def test_apply_qk_overrides_map_onto_rope_configs():
    mgr = make()
    mgr.ingest_request("a")
    mgr.apply_cached_prefix("a", None, None, None, {"text": 3900})
    pos = mgr.plan(PositionStep([Segment("a", "text", 5)]), ctx_for("a"))["text"].numpy()
    base = mgr.rope
    cases = [
        (dict(rotary_dim=8), dataclasses.replace(base, rotary_dim=8)),
        (dict(interleave=True), dataclasses.replace(base, interleave=True)),
        (dict(rope_theta=1e4), dataclasses.replace(base, theta=1e4)),
        (dict(rope_scale=4.0), dataclasses.replace(base, scaling=jr.Linear(4.0))),
        (dict(rope_scale=16.0, low_freq_factor=2.0, high_freq_factor=8.0, old_context_len=4096),
         dataclasses.replace(base, scaling=jr.Llama3(16.0, 2.0, 8.0, 4096))),
        (dict(low_freq_factor=1.0), dataclasses.replace(base, scaling=jr.Llama3(8.0, 1.0, 4.0, 8192))),
    ]
    for overrides, cfg in cases:
        q, k = qk(5)
        want = expected_rotation(q, pos, cfg)
        mgr.apply_qk(q, k, "text", **overrides)
        np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5, err_msg=str(overrides))


def test_partial_rotary_dim_leaves_the_tail_bit_identical():
    mgr = make()
    mgr.ingest_request("a")
    mgr.plan(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))
    q, k = qk(3)
    tail = q[..., 8:].clone()
    mgr.apply_qk(q, k, "text", rotary_dim=8)
    assert torch.equal(q[..., 8:], tail)


def test_override_configs_differing_in_one_field_do_not_collide():
    mgr = make()
    seen = {}
    for overrides in (dict(rope_scale=2.0), dict(rope_scale=3.0), dict(rope_theta=2.0e4),
                      dict(rope_theta=3.0e4), dict(rotary_dim=8), dict(rotary_dim=12),
                      dict(low_freq_factor=1.0), dict(low_freq_factor=2.0),
                      dict(old_context_len=4096), dict(high_freq_factor=6.0), {}):
        seen[tuple(sorted(overrides.items()))] = mgr._configs.get(**overrides)
    assert len(set(seen.values())) == len(seen)


def test_non_contiguous_q_is_staged_and_written_back():
    mgr = make()
    mgr.ingest_request("a")
    pos = mgr.plan(PositionStep([Segment("a", "text", 4)]), ctx_for("a"))["text"]
    qkv = torch.randn(4, 3 + 2 + 2, HEAD_DIM)
    q, k = qkv[:, :3], qkv[:, 3:5]
    v = qkv[:, 5:].clone()
    want_q = expected_rotation(q, pos.numpy(), mgr.rope)
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(qkv[:, :3].numpy(), want_q, rtol=0, atol=2e-5)
    assert torch.equal(qkv[:, 5:], v)


def test_non_contiguous_q_raises_when_copies_are_not_allowed():
    mgr = make(allow_copy=False)
    mgr.ingest_request("a")
    mgr.plan(PositionStep([Segment("a", "text", 4)]), ctx_for("a"))
    qkv = torch.randn(4, 5, HEAD_DIM)
    before = qkv.clone()
    with pytest.raises(NotZeroCopyError):
        mgr.apply_qk(qkv[:, :3], qkv[:, 3:], "text")
    assert torch.equal(qkv, before)


class _RecordingLauncher:
    def __init__(self, decline=False):
        self.calls, self.decline = [], decline

    def rotate_(self, q, k, pos_ids, cfg):
        self.calls.append((q.shape, k.shape, pos_ids.tolist(), cfg))
        if self.decline:
            raise jr.BackendUnavailable("declined for the test")
        q.mul_(2)


def test_a_launcher_is_asked_first_with_the_planned_positions():
    mgr = make()
    launcher = _RecordingLauncher()
    mgr.launcher = launcher
    mgr.ingest_request("a")
    mgr.plan(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))
    q, k = qk(2)
    doubled = q * 2
    mgr.apply_qk(q, k, "text", rope_theta=2e4)
    # The launcher gets all planned positions and uses the first q.shape[0] of them.
    assert launcher.calls == [((2, 3, HEAD_DIM), (2, 2, HEAD_DIM), [0, 1, 2],
                               dataclasses.replace(mgr.rope, theta=2e4))]
    assert torch.equal(q, doubled)


def test_a_declining_launcher_falls_back_to_the_jax_path():
    mgr = make()
    mgr.launcher = _RecordingLauncher(decline=True)
    mgr.ingest_request("a")
    pos = mgr.plan(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))["text"]
    q, k = qk(3)
    want = expected_rotation(q, pos.numpy(), mgr.rope)
    mgr.apply_qk(q, k, "text")
    assert len(mgr.launcher.calls) == 1
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)


class _BindingLauncher(_RecordingLauncher):
    """Binds each validated signature; ``run`` counts its calls and doubles q."""

    def __init__(self):
        super().__init__()
        self.bound_calls = 0

    def bind(self, q, k, cfg):
        def run(q, k, pos_ids):
            self.bound_calls += 1
            q.mul_(2)
            return True
        return run


def test_repeated_calls_take_the_bound_launch_and_a_new_launcher_drops_it():
    mgr = make()
    launcher = mgr.launcher = _BindingLauncher()
    mgr.ingest_request("a")
    pos = mgr.plan(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))["text"]
    q, k = qk(3)
    mgr.apply_qk(q, k, "text")
    mgr.apply_qk(q, k, "text")
    assert (len(launcher.calls), launcher.bound_calls) == (1, 1)
    # A call with another signature (fewer tokens) is validated and bound anew.
    mgr.apply_qk(q[:2], k[:2], "text")
    assert (len(launcher.calls), launcher.bound_calls) == (2, 1)
    # Replacing the launcher forgets its bound launches: the JAX path rotates now.
    mgr.launcher = None
    q, k = qk(3)
    want = expected_rotation(q, pos.numpy(), mgr.rope)
    mgr.apply_qk(q, k, "text")
    assert (len(launcher.calls), launcher.bound_calls) == (2, 1)
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)


def test_the_bound_launch_never_skips_the_checks_of_a_different_call():
    mgr = make()
    launcher = mgr.launcher = _BindingLauncher()
    mgr.ingest_request("a")
    mgr.plan(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))
    q, k = qk(3)
    mgr.apply_qk(q, k, "text")
    with pytest.raises(ValueError, match="requires_grad"):
        mgr.apply_qk(q.clone().requires_grad_(), k, "text")
    with pytest.raises(ValueError, match="dtype"):
        mgr.apply_qk(q.double(), k.double(), "text")
    with pytest.raises(ValueError, match="unknown"):
        mgr.apply_qk(q, k, "image")
    # A new plan with fewer positions: the bound launch would rotate all of q; the full
    # path hands the launcher the planned tokens only, the tail untouched, and binds nothing.
    mgr.commit(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))
    mgr.plan(PositionStep([Segment("a", "text", 2)]), ctx_for("a"))
    tail = q[2:].clone()
    mgr.apply_qk(q, k, "text")
    mgr.apply_qk(q, k, "text")
    assert launcher.bound_calls == 0 and [call[0][0] for call in launcher.calls] == [3, 2, 2]
    assert torch.equal(q[2:], tail)


def test_views_given_as_lists_are_read_again_every_step():
    # A record that is a list can change between steps; the cached arrays of the last
    # step's views must not be reused for it.
    mgr = make()
    mgr.ingest_request("a")
    record = ["a", "text", 1]
    kv = {"attn": KVPlanOutput([record])}
    step = PositionStep([Segment("a", "text", 1)])
    assert mgr.plan(step, ctx_for("a", kv=kv))["attn"].tolist() == [0]
    mgr.commit(step, ctx_for("a", kv=kv))
    record[2] = 3
    step = PositionStep([Segment("a", "text", 3)])
    assert mgr.plan(step, ctx_for("a", kv=kv))["attn"].tolist() == [1, 2, 3]


def test_plan_and_commit_move_nothing_through_jax():
    # The counters and positions live on the host; only apply_qk's JAX path uses JAX.
    import jax

    mgr = make(labels=("cond", "uncond"))
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    kv = {"cfg": KVPlanOutput([KVView("a", "cond", 3), KVView("b", "uncond", 2)],
                              pre_forks=[Fork("b", "cond", "uncond")])}
    step = PositionStep([Segment("a", "cond", 3), Segment("b", "uncond", 2)])
    with jax.transfer_guard("disallow"):
        for preplan in (False, True):  # an eager step, then a staged one committed first
            ctx = ctx_for("a", "b", kv=kv, preplan=preplan)
            mgr.plan(step, ctx)
            mgr.commit(step, ctx)
        mgr.admit_retrieve("a", None, None, PublishedPositionInfo({"cond": 40}))
        mgr.remove_request("b")
    assert mgr.position("a", "cond") == 40


@pytest.mark.requires_triton
def test_the_triton_launcher_declines_once_for_a_failing_export_and_caches_it(monkeypatch):
    from jaxrope.ops.rope import triton_export
    from torch_bridge.launch.triton import TritonLauncher

    calls = []

    def failing_export(**kwargs):
        calls.append(kwargs)
        raise jr.BackendUnavailable("export forced to fail by the test")

    monkeypatch.setattr(triton_export, "export", failing_export)
    launcher = TritonLauncher()
    for _ in range(2):
        with pytest.raises(jr.BackendUnavailable, match="forced to fail"):
            launcher._compiled(("key",), {"q_heads": 1})
    assert len(calls) == 1


def test_the_triton_launcher_declines_tensors_off_cuda():
    pytest.importorskip("triton")
    from torch_bridge.launch.triton import TritonLauncher

    q, k = qk(2)
    with pytest.raises(jr.BackendUnavailable, match="needs CUDA"):
        TritonLauncher().rotate_(q, k, torch.arange(2, dtype=torch.int32), jr.RopeConfig(head_dim=HEAD_DIM))


def test_auto_launcher_on_cpu_is_the_jax_path():
    cfg = PositionConfig(rope=jr.RopeConfig(head_dim=HEAD_DIM))
    assert RopeManager(cfg, "cpu").launcher is None


def test_interpret_backend_runs_the_pallas_kernel_body():
    mgr = make(backend="interpret")
    mgr.ingest_request("a")
    mgr.apply_cached_prefix("a", None, None, None, {"text": 77})
    pos = mgr.plan(PositionStep([Segment("a", "text", 3)]), ctx_for("a"))["text"]
    q, k = qk(3)
    want = expected_rotation(k, pos.numpy(), mgr.rope)
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(k.numpy(), want, rtol=0, atol=2e-5)


def test_exactly_max_seq_len_tokens_fit():
    mgr = make(max_seq_len=8)
    mgr.ingest_request("a")
    pos = run_step(mgr, [Segment("a", "text", 8)])
    assert pos["text"].tolist() == list(range(8)) and mgr.position("a", "text") == 8
