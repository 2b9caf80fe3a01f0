"""Speculative decoding: the core's rules (jaxrope.speculative) and the bridge's records.

The rules against hand-worked cases and a per-token model here; the two executors
against each other in tests/test_counter_rules.py; both against plain-Python
re-implementations of vLLM's and SGLang's rules in tests/test_speculative_reference.py;
the manager against a core model in tests/test_manager_state_machine.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import positions, speculative
from jaxrope.positions import PAD, PositionTable


def _table(counters, deltas=None):
    counters = jnp.asarray(counters, jnp.int32)
    return PositionTable(counters, None if deltas is None else jnp.asarray(deltas, jnp.int32))


# ---------------------------------------------------------------------------- core


def test_a_chain_of_k_drafts_is_verified_at_n_to_n_plus_k():
    table = _table([5, 9])
    out = speculative.plan_chain(table, jnp.array([1, 0], jnp.int32), jnp.array([3, 0], jnp.int32),
                                 jnp.full(6, -1, jnp.int32))
    assert out.tolist() == [9, 10, 11, 12, 5, -1]


def test_mrope_drafts_move_all_three_rows_together_from_counter_plus_delta():
    table = _table([20, 9], deltas=[-7, 0])
    slots = jnp.array([0, 1], jnp.int32)
    chain = speculative.plan_chain(table, slots, jnp.array([2, 1], jnp.int32),
                                   jnp.zeros((3, 5), jnp.int32))
    assert chain.tolist() == [[13, 14, 15, 9, 10]] * 3
    draft, live = speculative.plan_draft(table, slots, jnp.array([1, 1], jnp.int32),
                                         jnp.zeros((3, 2), jnp.int32), step=2, max_seq_len=21)
    # The bound is the sequence index (20 - 1 + 2 = 21), not the t row (14): vLLM #54498.
    assert live.tolist() == [False, True] and draft.tolist() == [[0, 10]] * 3


def test_draft_steps_number_from_the_last_accepted_token_or_from_seq_len():
    table = _table([10])
    args = (table, jnp.array([0], jnp.int32), jnp.array([4], jnp.int32), jnp.zeros(4, jnp.int32))
    vllm = [speculative.plan_draft(*args, step=j, max_seq_len=100)[0].tolist() for j in (1, 2, 3)]
    sglang = [speculative.plan_draft(*args, step=j, max_seq_len=100, offset=0)[0].tolist()
              for j in (1, 2, 3)]
    assert vllm == [[10] * 4, [11] * 4, [12] * 4]     # topk = 4 branches share the position
    assert sglang == [[11] * 4, [12] * 4, [13] * 4]


def test_a_jitted_draft_loop_never_retraces_for_a_new_step_or_new_counters(rng):
    traces = []

    def draft(table, slots, counts, out, step):
        traces.append(1)
        return speculative.plan_draft(table, slots, counts, out, step=step, max_seq_len=64)

    draft = jax.jit(draft)
    slots, counts = jnp.asarray(positions.pad_slots([0, 2], 4)), jnp.array([1, 1, 0, 0], jnp.int32)
    for step in range(1, 6):
        table = _table(rng.integers(0, 64, 3))
        pos, live = draft(table, slots, counts, jnp.full(3, -1, jnp.int32), step)
        index = np.asarray(table.counters)[[0, 2]] - 1 + step
        assert pos.tolist() == [*np.where(index < 64, index, 0).tolist(), -1]
        assert live.tolist() == [*(index < 64).tolist(), False]
    assert len(traces) == 1


def test_tree_depths_from_sglang_parents_and_the_documented_positions():
    depths = speculative.tree_depths(jnp.array([-1, 0, 0, 1], jnp.int32))
    assert depths.tolist() == [0, 1, 1, 2]
    got = speculative.plan_tree(_table([7]), jnp.array([0], jnp.int32), jnp.array([4], jnp.int32),
                                depths, jnp.zeros(4, jnp.int32))
    assert got.tolist() == [7, 8, 8, 9]     # SGLang build_eagle_tree.py's comment


def test_tree_depths_of_a_deep_chain_need_only_log_rounds():
    n = 1000
    parents = jnp.arange(-1, n - 1, dtype=jnp.int32)
    assert speculative.tree_depths(parents).tolist() == list(range(n))


def test_accept_advances_by_the_accepted_drafts_plus_the_root_and_keeps_the_epoch():
    table = positions.rollback(_table([30, 9]), jnp.array([0], jnp.int32), jnp.array([20], jnp.int32))
    table = speculative.accept(table, jnp.asarray(positions.pad_slots([0, 1], 3)),
                               jnp.array([2, 0, 5], jnp.int32))
    assert table.counters.tolist() == [23, 10] and table.epochs.tolist() == [1, 0]


def test_eagle_input_ids_match_vllms_documented_shift():
    a1, b1, b2, c1, c2, c3 = 11, 21, 22, 31, 32, 33
    a2, b3, c4 = 12, 23, 34
    got = speculative.eagle_input_ids(jnp.array([a1, b1, b2, c1, c2, c3], jnp.int32),
                                      jnp.array([a2, b3, c4, 99], jnp.int32),
                                      jnp.array([0, 2, 5, PAD], jnp.int32))
    assert got.tolist() == [a2, b2, b3, c2, c3, c4]


def test_speculative_rules_lower_for_cuda():
    from jaxrope.testing import lowering

    def step(table, slots, counts, depths):
        tree = speculative.plan_tree(table, slots, counts, depths, jnp.zeros(8, jnp.int32))
        draft, live = speculative.plan_draft(table, slots, counts, jnp.zeros((3, 8), jnp.int32),
                                             step=2, max_seq_len=64)
        return speculative.accept(table, slots, counts - 1), tree, draft, live

    args = (positions.init(8), jnp.asarray(positions.pad_slots([1, 3], 4)),
            jnp.array([3, 3, 0, 0], jnp.int32), jnp.zeros(8, jnp.int32))
    with lowering.cuda_target():
        text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo" in text


# ---------------------------------------------------------------------------- bridge

torch = pytest.importorskip("torch")

from torch_bridge import (GraphBucket, GraphSlot, KVPlanOutput, KVView, PositionConfig,  # noqa: E402
                          PositionStep, PublishedPositionInfo, RopeManager, Segment, StepContext)
from jaxrope.testing import oracle  # noqa: E402

HEAD_DIM = 16


def make(max_seq_len=256, labels=("text",)):
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4, max_position=1024)
    return RopeManager(PositionConfig(rope=rope, labels=labels), "cpu", max_seq_len=max_seq_len,
                       launcher="jax")


def ingest(mgr, **at):
    for rid, position in at.items():
        mgr.ingest_request(rid, overrides={"text": position})


def verify_step(**drafts):
    """A chain verify step: each stream's root and its drafts."""
    return PositionStep(tuple(Segment(rid, "text", k + 1) for rid, k in drafts.items()))


def ctx(*rids, graph=None, preplan=False):
    return StepContext(rids, graph_slot=graph, is_preplan=preplan)


def test_chain_verify_then_accept_advances_by_the_accepted_count_plus_one():
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = verify_step(a=4, b=2)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [10, 11, 12, 13, 14, 3, 4, 5]
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): 2})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (12, 6)
    assert mgr.publish("a").epochs == {}     # accepting moves forward: no new epoch


def test_accept_names_some_streams_and_the_others_commit_their_spans():
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = PositionStep((Segment("a", "text", 4), Segment("b", "text", 7)))   # b: a prefill chunk
    mgr.plan(step, ctx("a", "b"))
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 0})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (11, 10)


def test_tree_verify_numbers_by_depth_and_requires_its_accepted_count():
    mgr = make()
    ingest(mgr, a=7, b=20)
    depths = {("a", "text"): (0, 1, 1, 2, 2, 3)}
    step = PositionStep((Segment("a", "text", 6), Segment("b", "text", 2)), depths=depths)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [7, 8, 8, 9, 9, 10, 20, 21]
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="draft tree"):
        mgr.commit(step, ctx("a", "b"))
    with pytest.raises(ValueError, match=r"must be in \[0, 3\]"):
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 4})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 3})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (11, 22)


def test_a_tree_in_a_packed_plan_label_is_numbered_in_every_view_order():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a", overrides={"cond": 5, "uncond": 30})
    kv = {"kv": {"attn": KVPlanOutput((KVView("a", "uncond", 1), KVView("a", "cond", 3)))}}
    step = PositionStep((Segment("a", "cond", 3), Segment("a", "uncond", 1)),
                        depths={("a", "cond"): (0, 1, 1)})
    assert mgr.plan(step, StepContext(("a",), plan_results=kv))["attn"].tolist() == [30, 5, 6, 6]


def test_a_draft_step_numbers_every_token_at_one_offset_and_commits_nothing():
    mgr = make()
    ingest(mgr, a=12, b=40)
    for j in (1, 2, 3):
        step = PositionStep((Segment("a", "text", 1), Segment("b", "text", 1)), depths=j - 1)
        assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [11 + j, 39 + j]
        mgr.commit(step, ctx("a", "b"))
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (12, 40)
    mgr.rollback("a", "text", 10)   # a draft step holds no stream: a rewind is allowed
    assert mgr.position("a", "text") == 10


def test_a_draft_step_past_max_seq_len_is_planned_at_zero_and_marked_not_live():
    mgr = make(max_seq_len=64)
    ingest(mgr, a=62, b=5)
    step = PositionStep((Segment("a", "text", 2), Segment("b", "text", 2)), depths=2)  # topk 2
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [0, 0, 7, 7]
    assert mgr.live("text").tolist() == [False, False, True, True]
    assert mgr.state_snapshot()["counters"] == {("a", "text"): 62, ("b", "text"): 5}


def test_a_draft_step_in_a_graph_bucket_writes_its_buffer_and_keeps_the_tail():
    mgr = make()
    ingest(mgr, a=12, b=40, c=7)
    lease = GraphSlot(GraphBucket("draft", batch_size=4, num_tokens=4), slot=0)
    full = PositionStep(tuple(Segment(rid, "text", 1) for rid in "abc"), depths=0)
    buffer = mgr.plan(full, ctx("a", "b", "c", graph=lease))["text"]
    assert buffer.tolist() == [12, 40, 7, 0]
    fewer = PositionStep((Segment("b", "text", 1),), depths=3)
    again = mgr.plan(fewer, ctx("b", graph=lease))["text"]
    assert again.data_ptr() == buffer.data_ptr() and again.tolist() == [43, 40, 7, 0]
    assert mgr.live("text").tolist() == [True]


def test_apply_qk_rotates_a_tree_at_its_depths():
    mgr = make()
    ingest(mgr, a=50)
    step = PositionStep((Segment("a", "text", 4),), depths={("a", "text"): (0, 1, 1, 2)})
    mgr.plan(step, ctx("a"))
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(4, 2, HEAD_DIM, generator=gen), torch.randn(4, 1, HEAD_DIM, generator=gen)
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = [oracle.rope_oracle(x.numpy(), np.array([50, 51, 51, 52]), inv_freq, attention,
                               HEAD_DIM, False) for x in (q, k)]
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.numpy(), want[0], rtol=0, atol=2e-5)
    np.testing.assert_allclose(k.numpy(), want[1], rtol=0, atol=2e-5)


def test_a_preplan_that_assumed_every_draft_kept_makes_a_rejecting_commit_refuse():
    mgr = make()
    ingest(mgr, a=10)
    step = verify_step(a=3)
    mgr.plan(step, ctx("a"))
    nxt = verify_step(a=3)
    assert mgr.plan(nxt, ctx("a", preplan=True))["text"].tolist() == [14, 15, 16, 17]
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="clear_preplan"):
        mgr.commit(step, ctx("a"), accepted={("a", "text"): 1})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a"), accepted={("a", "text"): 3})   # every draft kept: the preplan holds
    assert mgr.position("a", "text") == 14 and mgr.pos_ids("text").tolist() == [14, 15, 16, 17]


def test_accepted_counts_of_a_request_removed_since_the_plan_are_ignored():
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = verify_step(a=2, b=2)
    mgr.plan(step, ctx("a", "b"))
    mgr.remove_request("b")
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 2, ("b", "text"): 0})
    assert mgr.position("a", "text") == 13 and mgr.requests() == ["a"]


def test_committing_drafts_then_rolling_back_reaches_the_node_that_admitted_them():
    # vLLM's order: every scheduled token is committed, the rejected ones are taken back.
    prefill, decode = make(), make()
    for mgr in (prefill, decode):
        ingest(mgr, a=10)
    step = verify_step(a=4)
    prefill.plan(step, ctx("a"))
    prefill.commit(step, ctx("a"))
    with_drafts = prefill.publish("a")
    assert decode.admit_retrieve("a", None, None, with_drafts).ok
    prefill.rollback("a", "text", 10 + 1 + 1)   # one draft of four accepted
    assert decode.admit_retrieve("a", None, None, prefill.publish("a")).ok
    assert decode.admit_retrieve("a", None, None, with_drafts).ok     # a late echo
    assert decode.publish("a").record("text") == (12, 0, 1)


def test_snapshots_and_merged_publications_follow_the_epoch_order():
    mgr = make()
    ingest(mgr, a=20)
    before_rollback = mgr.publish_from_snapshot("a", mgr.publish_snapshot_for_step("a", None, None),
                                                None, None)
    mgr.rollback("a", "text", 17)
    after = mgr.publish("a")
    merged = after.clone()
    merged.update(before_rollback)             # older epoch, higher position: loses
    assert merged.record("text") == (17, 0, 1)
    merged = before_rollback.clone()
    merged.update(after)                       # newer epoch, lower position: wins
    assert merged.record("text") == (17, 0, 1)
    other = make()
    ingest(other, a=0)
    for info in (before_rollback, after, before_rollback):
        assert other.admit_retrieve("a", None, None, info).ok
    assert other.publish("a").record("text") == (17, 0, 1)


def test_published_records_without_rollbacks_merge_as_the_seed_max():
    a = PublishedPositionInfo({"text": 7})
    for position in (5, 9, 8):
        a.update(PublishedPositionInfo({"text": position}))
    assert a.counters == {"text": 9} and a.epochs == {}
