"""``StepContext.request_ids``: the step's batch. When given, ``plan`` refuses a step whose
segments name a request outside it (and changes nothing); empty (the default) states no
batch and checks nothing."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch_bridge import (PositionConfig, PositionManager, PositionStep, Segment,  # noqa: E402
                          StepContext)


def manager() -> PositionManager:
    mgr = PositionManager(PositionConfig(), "cpu", max_seq_len=64)
    for rid in ("r0", "r1"):
        mgr.ingest_request(rid)
    return mgr


def test_a_step_naming_a_request_outside_the_batch_is_refused():
    mgr = manager()
    before = mgr.state_snapshot()
    step = PositionStep([Segment("r0", "text", 2), Segment("r1", "text", 1)])
    for ctx in (StepContext(("zzz",)), StepContext(("r0",)),
                StepContext(("r0",), is_preplan=True)):
        with pytest.raises(ValueError, match=r"step.segments\[\d\] names request_id='r[01]', "
                                             r"which is not in ctx.request_ids="):
            mgr.plan(step, ctx)
        assert mgr.state_snapshot() == before


def test_the_batch_may_hold_more_requests_than_the_step_and_an_empty_one_checks_nothing():
    mgr = manager()
    step = PositionStep([Segment("r1", "text", 2)])
    assert mgr.plan(step, StepContext(("r0", "r1", "r2"))).keys() == {"text"}
    assert StepContext().request_ids == ()
    assert mgr.plan(step, StepContext())["text"].tolist() == [0, 1]
    assert StepContext(["r0"]).request_ids == ("r0",)
