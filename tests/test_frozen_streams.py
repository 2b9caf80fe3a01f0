"""A planned stream is frozen: every path that could move it is refused, naming the plan.

The manager here holds a current plan and a staged preplan, each in its own CUDA-graph
slot, with a fork of each kind: the current plan numbers b's uncond and forks d's cond
into d's uncond at commit (a post-fork); the staged plan numbers a's uncond from a's
cond (a pre-fork) at [10, 11]. Every stream either plan numbers or forks, sources
included, is frozen; c and b's cond are free. Each refusal runs through the twin-manager
harness (:mod:`bad_input_harness`): it raises (or, for an admit, reports) naming the
plan and the stream, the snapshot is unchanged, and finishing both steps lands the
manager where an untouched twin lands, with every counter where its KV ends.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxrope as jr

from bad_input_harness import (HEAD_DIM, LABELS, MAX_SEQ_LEN, SEEDS, Bad, bridge_catalogue_test,
                               mrope_finish, mrope_manager, needs_torch, plan, prefix,
                               raises_naming_it_and_changes_nothing, seg, torch)
from jaxrope.testing import oracle

if torch is not None:
    from torch_bridge import (Fork, GraphBucket, GraphSlot, KVPlanOutput, KVView, PositionConfig,
                              PositionManager, PositionStep, PublishedPositionInfo, RopeManager,
                              Segment, StepContext)

    BUCKET = GraphBucket("decode", 2, 4)
    SLOT0, SLOT1 = GraphSlot(BUCKET, 0), GraphSlot(BUCKET, 1)
    # b's uncond decodes at 5; after the commit d's uncond takes d's cond (20).
    CURRENT = PositionStep([Segment("b", "uncond", 1)])
    CURRENT_CTX = StepContext(("b",), graph_slot=SLOT0, plan_results={"kv": {"uncond": KVPlanOutput(
        [KVView("b", "uncond", 1)], post_forks=[Fork("d", "cond", "uncond")])}})
    # a's uncond takes a's cond (10) when the plan becomes current, then runs 2 tokens.
    STAGED = PositionStep([Segment("a", "uncond", 2)])
    STAGED_CTX = StepContext(("a",), is_preplan=True, graph_slot=SLOT1, plan_results={
        "kv": {"attn": KVPlanOutput([KVView("a", "uncond", 2)],
                                    pre_forks=[Fork("a", "cond", "uncond")])}})

CURRENT_PLAN = "the current plan numbers it in plan label 'uncond'; a step of 1 segment, planned "
STAGED_PLAN = "the staged plan forks from it before its step (a pre-fork source); a step of 1 segment"


def frozen_manager() -> "RopeManager":
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, max_position=1024)
    mgr = RopeManager(PositionConfig(rope=rope, labels=LABELS), "cpu", max_seq_len=MAX_SEQ_LEN,
                      launcher="jax")
    for rid, start in (("a", {"cond": 10}), ("b", {"uncond": 5}), ("c", {"cond": 7}),
                       ("d", {"cond": 20})):
        mgr.ingest_request(rid, start)
    assert mgr.plan(CURRENT, CURRENT_CTX)["uncond"].tolist() == [5, 0, 0, 0]
    assert mgr.plan(STAGED, STAGED_CTX)["attn"].tolist() == [10, 11, 0, 0]
    return mgr


def finish(mgr):
    """Rotate at each plan's positions (checked against the oracle), commit both; the state."""
    gen = torch.Generator().manual_seed(next(SEEDS))
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    try:
        for label, step, ctx, positions in (("uncond", CURRENT, CURRENT_CTX, [5]),
                                            ("attn", STAGED, STAGED_CTX, [10, 11])):
            q = torch.randn(len(positions), 3, HEAD_DIM, generator=gen)
            k = torch.randn(len(positions), 2, HEAD_DIM, generator=gen)
            want = oracle.rope_oracle(q.numpy(), np.asarray(positions), inv_freq, attention,
                                      HEAD_DIM, False)
            mgr.apply_qk(q, k, label)
            np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)
            mgr.commit(step, ctx)
    except ValueError as e:
        return repr(e), mgr.state_snapshot()["counters"]
    state = mgr.state_snapshot()
    assert state["current"] is None and state["staged"] is None
    # Every counter where its KV ends: b's uncond past 5, d's uncond forked from 20, a's
    # uncond past [10, 11].
    assert {s: state["counters"][s] for s in (("b", "uncond"), ("d", "uncond"), ("a", "uncond"))} \
        == {("b", "uncond"): 6, ("d", "uncond"): 20, ("a", "uncond"): 12}
    return {key: state[key] for key in ("counters", "slots", "epochs", "rewinds", "requests",
                                        "graph_buffers")}


def _cases():
    stream = "is in a plan not yet committed ("
    return [
        Bad("rollback of a staged plan's pre-fork source", lambda m: m.rollback("a", "cond", 3),
            ValueError, f"rollback refused: stream ('a', 'cond') {stream}{STAGED_PLAN}"),
        Bad("rollback of a staged plan's view", lambda m: m.rollback("a", "uncond", 0),
            ValueError, "stream ('a', 'uncond') is in a plan not yet committed (the staged plan "
                        "numbers it in plan label 'attn'; a step of 1 segment, planned into graph "
                        "slot 1 of GraphBucket(walk='decode', batch_size=2, num_tokens=4)): commit "
                        "it or clear_preplan first"),
        Bad("rollback of a current plan's post-fork source", lambda m: m.rollback("d", "cond", 3),
            ValueError, f"stream ('d', 'cond') {stream}the current plan forks from it at commit "
                        "(a post-fork source)"),
        Bad("rollback of a current plan's view", lambda m: m.rollback("b", "uncond", 1),
            ValueError, f"stream ('b', 'uncond') {stream}{CURRENT_PLAN}into graph slot 0"),
        Bad("cached prefix moving a current plan's view forward",
            lambda m: prefix(m, "b", {"uncond": 35}), ValueError,
            f"prefix['uncond']=35 would move the counter from 5 to 35, but stream ('b', 'uncond') "
            f"{stream}{CURRENT_PLAN}"),
        Bad("cached prefix moving a pre-fork source forward", lambda m: prefix(m, "a", {"cond": 30}),
            ValueError, f"prefix['cond']=30 would move the counter from 10 to 30, but stream "
                        f"('a', 'cond') {stream}{STAGED_PLAN}"),
        Bad("cached prefix moving a post-fork destination forward",
            lambda m: prefix(m, "d", {"uncond": 3}), ValueError,
            "the current plan forks into it at commit"),
        Bad("ingest override moving a staged plan's view forward",
            lambda m: m.ingest_request("a", {"uncond": 35}), ValueError,
            "overrides['uncond']=35 would move the counter from 0 to 35, but stream ('a', "
            "'uncond') is in a plan not yet committed (the staged plan numbers it"),
        Bad("ingest override moving a pre-fork source forward",
            lambda m: m.ingest_request("a", {"cond": 11}), ValueError,
            f"overrides['cond']=11 would move the counter from 10 to 11, but stream ('a', 'cond') "
            f"{stream}{STAGED_PLAN}"),
        Bad("reset of a planned request", lambda m: m.reset_request("b"), ValueError,
            f"reset_request('b') would move the stream to 0, but stream ('b', 'uncond') {stream}"
            f"{CURRENT_PLAN}"),
        Bad("preplan into the graph slot the current plan reads",
            lambda m: plan(m, seg(("c", "cond", 1)), preplan=True, graph=SLOT0), ValueError,
            "preplan into ctx.graph_slot: slot 0 of GraphBucket(walk='decode', batch_size=2, "
            "num_tokens=4) holds the current plan's positions (a step of 1 segment, planned into "
            "graph slot 0"),
    ] if torch is not None else []


test_a_move_of_a_frozen_stream_raises_naming_the_plan_and_changes_nothing = bridge_catalogue_test(
    _cases(), frozen_manager, finish)


def _record(**fields) -> "PublishedPositionInfo":
    return PublishedPositionInfo(fingerprint=frozen_manager().fingerprint(), **fields)


@needs_torch
@pytest.mark.parametrize("published,fragment", [
    (lambda: _record(counters={"cond": 30}),
     f"the record would move it from 10 to 30, but stream ('a', 'cond') is in a plan not yet "
     f"committed ({STAGED_PLAN}"),
    (lambda: _record(counters={"cond": 3}, epochs={"cond": 1}, rewinds={"cond": ((9, 1),)}),
     f"the record starts a newer epoch, but stream ('a', 'cond') is in a plan not yet "
     f"committed ({STAGED_PLAN}"),
    (lambda: _record(counters={"cond": 10, "uncond": 40}),
     "the record would move it from 0 to 40, but stream ('a', 'uncond') is in a plan not yet "
     "committed (the staged plan numbers it in plan label 'attn'"),
], ids=["same epoch, forward", "newer epoch", "one label of two"])
@pytest.mark.parametrize("form", ["object", "bytes"])
def test_an_admit_moving_a_frozen_stream_reports_the_plan_and_changes_nothing(published, fragment,
                                                                             form):
    mgr, twin = frozen_manager(), frozen_manager()
    record = published()
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("a", "node", "walk", record.to_bytes() if form == "bytes" else record)
    assert (outcome.ok, outcome.ready) == (False, False), outcome
    assert outcome.reason.startswith("published record refused (planned): " + fragment), outcome
    assert mgr.state_snapshot() == before
    assert finish(mgr) == finish(twin)


@needs_torch
def test_an_mrope_delta_change_of_a_planned_stream_is_refused():
    # a's cond decodes at counter 40 + delta -30 in the current plan: a new delta would
    # change what it was numbered from.
    case = Bad("M-RoPE delta of a planned stream", lambda m: m.ingest_request("a", deltas={"cond": -20}),
               ValueError, "deltas['cond']=-20 would change the M-RoPE delta from -30, but stream "
                           "('a', 'cond') is in a plan not yet committed (the current plan numbers it")
    raises_naming_it_and_changes_nothing(case, mrope_manager, mrope_finish)
    mgr = mrope_manager()
    before = mgr.state_snapshot()
    mgr.ingest_request("a", deltas={"cond": -30})   # the delta it has: nothing moves
    assert mgr.state_snapshot() == before


@needs_torch
def test_moves_that_change_nothing_and_free_streams_are_taken():
    mgr, twin = frozen_manager(), frozen_manager()
    before = mgr.state_snapshot()
    mgr.ingest_request("a", {"cond": 10, "uncond": 0})           # where they are
    prefix(mgr, "b", {"uncond": 5})
    assert mgr.admit_retrieve("a", None, None, _record(counters={"cond": 4})).ok   # a stale echo
    assert mgr.state_snapshot() == before
    # c and b's cond are no plan's: they move, back and forward.
    for m in (mgr, twin):
        prefix(m, "c", {"cond": 9})
        m.rollback("c", "cond", 2)
        m.ingest_request("b", {"cond": 4})
        assert m.admit_retrieve("c", None, None, _record(counters={"uncond": 8})).ok
        m.reset_request("c")
    assert mgr.position("c", "cond") == 0 and mgr.position("b", "cond") == 4
    assert finish(mgr) == finish(twin)


@needs_torch
def test_a_stream_thaws_when_its_plan_commits_or_is_cleared():
    mgr = frozen_manager()
    mgr.clear_preplan()                      # the staged plan's streams are free at once
    mgr.rollback("a", "cond", 3)
    prefix(mgr, "a", {"uncond": 7})
    with pytest.raises(ValueError, match=r"\(the current plan numbers it"):
        prefix(mgr, "b", {"uncond": 9})
    mgr.commit(CURRENT, CURRENT_CTX)         # the current plan's too
    prefix(mgr, "b", {"uncond": 9})
    mgr.rollback("d", "cond", 1)
    mgr.reset_request("b")
    assert [mgr.position(*s) for s in (("a", "cond"), ("a", "uncond"), ("b", "uncond"),
                                       ("d", "cond"), ("d", "uncond"))] == [3, 7, 0, 1, 20]


@needs_torch
def test_a_removed_request_leaves_the_plan_and_a_new_one_on_its_slot_is_free():
    mgr = frozen_manager()
    mgr.remove_request("a")                  # allowed: the staged plan drops a's streams
    mgr.ingest_request("a", {"cond": 3})     # a new request, maybe on a's old slots
    mgr.rollback("a", "cond", 1)
    prefix(mgr, "a", {"uncond": 30})
    mgr.commit(CURRENT, CURRENT_CTX)
    mgr.commit(STAGED, STAGED_CTX)           # commits without a's streams
    assert (mgr.position("a", "cond"), mgr.position("a", "uncond")) == (1, 30)


@needs_torch
def test_a_preplan_takes_the_other_graph_slot_and_leaves_the_current_buffers():
    mgr = frozen_manager()
    current = mgr.pos_ids("uncond").clone()
    # Replacing the staged plan in slot 1 is allowed (it drops the staged plan).
    assert plan(mgr, seg(("c", "cond", 1)), preplan=True, graph=SLOT1)["cond"].tolist()[:1] == [7]
    # Another bucket's slot 0 is other buffers.
    other = GraphSlot(GraphBucket("decode", 1, 2), 0)
    assert plan(mgr, seg(("c", "cond", 1)), preplan=True, graph=other)["cond"].tolist() == [7, 0]
    assert torch.equal(mgr.pos_ids("uncond"), current)
    # A plan that is not a preplan replaces the current one: its slot is free to take.
    mgr.plan(PositionStep([Segment("c", "cond", 2)]), StepContext(("c",), graph_slot=SLOT0))
    assert mgr.pos_ids("cond").tolist() == [7, 8, 0, 0]


@needs_torch
def test_the_issue_scenarios_end_where_the_kv_ends():
    """The two silent outcomes of issue 43: a pre-fork's destination numbered at 10 and
    then counted from 3; a counter raised to 35 over KV written at 5."""
    mgr = frozen_manager()
    with pytest.raises(ValueError, match="pre-fork source"):
        mgr.rollback("a", "cond", 3)
    with pytest.raises(ValueError, match="would move the counter from 5 to 35"):
        prefix(mgr, "b", {"uncond": 35})
    finish(mgr)                                   # asserts b's uncond at 6, a's at 12
    manager = PositionManager(PositionConfig(labels=("text",)), "cpu", max_seq_len=64)
    manager.ingest_request("r0", {"text": 5})
    step = PositionStep([Segment("r0", "text", 1)])
    manager.plan(step, StepContext(("r0",)))
    for move in (lambda: prefix(manager, "r0", {"text": 35}),
                 lambda: manager.ingest_request("r0", {"text": 35})):
        with pytest.raises(ValueError, match="from 5 to 35"):
            move()
    assert not manager.admit_retrieve("r0", None, None, PublishedPositionInfo({"text": 35})).ok
    manager.commit(step, StepContext(("r0",)))
    assert manager.position("r0", "text") == 6
