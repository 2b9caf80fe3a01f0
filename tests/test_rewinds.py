"""Rewinds (rollbacks, and admitted records of newer epochs) that cannot be lost.

- A stream that the current or the staged plan numbers is rewound neither by
  ``rollback`` nor by an admitted record of a newer epoch: one rule for both
  (``StepPlans.frozen``; issue 26 S2, S3; every other move: ``test_frozen_streams.py``).
- Epochs are int32 everywhere: the bridge, the core's ``positions.rollback`` / ``admit``
  and the wire refuse, with the range, what would wrap (S4).
- Two writers: a record says whose rollbacks it includes; rewinds by two managers that
  did not see each other's are refused wherever they meet, never merged by a max; the
  handoff (publish -> admit, the sender stops) moves the right to roll back.

Each manager here is a real ``PositionManager`` (two or three of them exchanging real
records, objects and bytes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxrope import positions as core  # noqa: E402
from jaxrope import wire  # noqa: E402
from torch_bridge import (PositionConfig, PositionManager, PositionStep,  # noqa: E402
                          PublishedPositionInfo, Segment, StepContext)

REFUSED = "published record refused"
MAX_EPOCH = 2**31 - 1
CTX = StepContext(("r0",))


def make(writer: int, max_seq_len: int = 4096) -> PositionManager:
    return PositionManager(PositionConfig(labels=("text",)), "cpu", max_seq_len=max_seq_len,
                           writer=writer)


def at(mgr: PositionManager, position: int, rid: str = "r0") -> PositionManager:
    mgr.ingest_request(rid, {"text": position})
    return mgr


def step(n: int, **kwargs) -> PositionStep:
    return PositionStep([Segment("r0", "text", n)], **kwargs)


# ------------------------------------------------------------------ S2, S3: a plan numbers it


def test_a_rollback_is_refused_while_a_staged_draft_step_numbers_the_stream():
    # S2: plan a verify, preplan a draft step (numbered as if the verify committed every
    # span: [23]), commit the verify with 2 accepted (counter 23); the draft step is now
    # the current plan and still holds 23, so a rollback to 21 would leave it numbered
    # past the counter.
    mgr = at(make(1), 20)
    verify = step(3, tree={("r0", "text"): (0, 1, 2)})
    assert mgr.plan(verify, CTX)["text"].tolist() == [20, 21, 22]
    draft = step(1, draft_depth=0)
    assert mgr.plan(draft, StepContext(("r0",), is_preplan=True))["text"].tolist() == [23]
    mgr.commit(verify, CTX, accepted={("r0", "text"): 2})
    assert mgr.position("r0", "text") == 23 and mgr.pos_ids("text").tolist() == [23]
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match=r"rollback refused: stream \('r0', 'text'\) is in a "
                                         r"plan not yet committed \(the current plan"):
        mgr.rollback("r0", "text", 21)
    assert mgr.state_snapshot() == before
    mgr.commit(draft, CTX)                       # a draft step commits nothing
    mgr.rollback("r0", "text", 21)
    assert mgr.position("r0", "text") == 21


def test_a_rollback_is_refused_while_a_staged_plan_numbers_the_stream():
    mgr = at(make(1), 5)
    mgr.plan(step(1, draft_depth=0), StepContext(("r0",), is_preplan=True))
    with pytest.raises(ValueError, match=r"\(the staged plan numbers it"):
        mgr.rollback("r0", "text", 2)
    mgr.clear_preplan()
    mgr.rollback("r0", "text", 2)
    assert mgr.position("r0", "text") == 2


def test_an_admit_of_a_newer_epoch_is_refused_while_a_plan_numbers_the_stream():
    # S3: b plans [10, 11, 12]; a's record (epoch 1, position 5) would move b's counter to
    # 5 under that plan, and committing 2 accepted would then put it at 8.
    a, b = at(make(1), 12), at(make(2), 10)
    a.rollback("r0", "text", 5)
    record = a.publish("r0")
    verify = step(3, tree={("r0", "text"): (0, 1, 2)})
    assert b.plan(verify, CTX)["text"].tolist() == [10, 11, 12]
    before = b.state_snapshot()
    for form in (record, record.to_bytes()):
        outcome = b.admit_retrieve("r0", None, None, form)
        assert not outcome.ok and outcome.reason.startswith(f"{REFUSED} (planned): the record "
                                                            "starts a newer epoch, but stream")
        assert "in a plan not yet committed (the current plan numbers it" in outcome.reason
        assert b.state_snapshot() == before
    b.commit(verify, CTX, accepted={("r0", "text"): 2})
    assert b.position("r0", "text") == 13
    assert b.admit_retrieve("r0", None, None, record).ok
    assert b.position("r0", "text") == 5


def test_an_admit_within_the_epoch_waits_for_the_plan_too():
    # The seed's monotonic admit (epoch 0, a larger position) moves a counter forward,
    # which a planned stream refuses as well (b's plan numbered [10, 11]: its commit would
    # leave the counter at 32 over KV ending at 12); a stale echo moving nothing is taken.
    a, b = at(make(1), 30), at(make(2), 10)
    b.plan(step(2), CTX)
    before = b.state_snapshot()
    outcome = b.admit_retrieve("r0", None, None, a.publish("r0"))
    assert not outcome.ok and outcome.reason.startswith(
        f"{REFUSED} (planned): the record would move it from 10 to 30, but stream ('r0', "
        "'text') is in a plan not yet committed (the current plan numbers it")
    assert b.state_snapshot() == before
    assert b.admit_retrieve("r0", None, None, at(make(3), 4).publish("r0")).ok
    b.commit(step(2), CTX)
    assert b.admit_retrieve("r0", None, None, a.publish("r0")).ok
    assert b.position("r0", "text") == 30


def test_a_removed_request_leaves_no_plan_numbering_its_slot():
    mgr = at(make(1), 9)
    mgr.plan(step(2), CTX)
    mgr.remove_request("r0")
    at(mgr, 9)                                   # a new request, maybe on the same slot
    mgr.rollback("r0", "text", 4)
    assert mgr.position("r0", "text") == 4


# ------------------------------------------------------------------ S4: epochs are int32


def _at_epoch(mgr: PositionManager, epoch: int, position: int = 9) -> PositionManager:
    record = PublishedPositionInfo({"text": position}, epochs={"text": epoch},
                                   rewinds={"text": ((mgr.writer, epoch),)})
    assert mgr.admit_retrieve("r0", None, None, record).ok
    return mgr


def test_a_rollback_at_the_last_epoch_is_refused_before_it_wraps():
    mgr = _at_epoch(at(make(1), 0), MAX_EPOCH)
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match=r"at publish epoch 2147483647, the last \(epochs are "
                                         r"int32, in \[0, 2147483647\]\)"):
        mgr.rollback("r0", "text", 3)
    assert mgr.state_snapshot() == before
    assert int(mgr.table.epochs[mgr.state_snapshot()["requests"]["r0"][0]]) == MAX_EPOCH
    mgr.rollback("r0", "text", 9)                # moves nothing: no new epoch needed
    _at_epoch(at(make(2), 0), MAX_EPOCH - 1).rollback("r0", "text", 3)


@pytest.mark.parametrize("epoch", [2**31, 2**32 - 1, -1])
def test_an_admitted_epoch_outside_int32_is_refused_with_the_range(epoch):
    mgr = at(make(1), 0)
    outcome = mgr.admit_retrieve("r0", None, None, PublishedPositionInfo(
        {"text": 3}, epochs={"text": epoch}))
    assert not outcome.ok
    assert outcome.reason == (f"{REFUSED} (epoch): published.epochs['text']={epoch} must be an "
                              "int in [0, 2147483647] (epochs are int32)")


def test_the_wire_refuses_an_epoch_past_int32_with_the_range():
    with pytest.raises(wire.WireFormatError, match=r"epoch=2147483648 .* outside "
                                                   r"\[0, 2147483647\]") as info:
        wire.encode(bytes(32), [wire.StreamRecord("text", 1, 0, ((1, MAX_EPOCH), (2, 1)))])
    assert info.value.reason == "value"


def test_the_core_refuses_what_would_wrap_outside_jit():
    table = core.PositionTable(jnp.array([9, 9], jnp.int32), None,
                               jnp.array([MAX_EPOCH, 5], jnp.int32))
    slots = jnp.array([0], jnp.int32)
    with pytest.raises(ValueError, match=r"rollback of rows\[0\] at publish epoch 2147483647, "
                                         r"the last: epochs are int32, in \[0, 2147483647\]"):
        core.rollback(table, slots, jnp.array([3], jnp.int32))
    assert core.rollback(table, slots, jnp.array([9], jnp.int32)).epochs.tolist() == [MAX_EPOCH, 5]
    assert core.rollback(table, jnp.array([1], jnp.int32),
                         jnp.array([3], jnp.int32)).epochs.tolist() == [MAX_EPOCH, 6]
    with pytest.raises(ValueError, match=r"epochs\[0\]=2147483648 must lie in \[0, 2147483647\]"):
        core.admit(table, slots, jnp.array([1]), jnp.array([0]), np.array([2**31], np.int64))
    out = jax.jit(core.admit)(table, slots, jnp.array([1], jnp.int32), jnp.array([0], jnp.int32),
                              jnp.array([3], jnp.int32))
    assert out.counters.tolist() == [9, 9]       # older epoch under jit: unchanged


# ------------------------------------------------------------------ two writers


def test_two_writers_rewinding_the_same_stream_are_refused_not_merged():
    # Both nodes at 12 roll the stream back once without seeing each other's rewind:
    # A to 5, B to 9. Both records are epoch 1; a max would keep B at 9 and A's rewind
    # would be lost. Each side refuses the other's, with both writers named.
    a, b = at(make(7), 12), at(make(9), 12)
    a.rollback("r0", "text", 5)
    b.rollback("r0", "text", 9)
    assert a.publish("r0").epochs == b.publish("r0").epochs == {"text": 1}
    for receiver, sender in ((b, a), (a, b)):
        before = receiver.state_snapshot()
        for form in (sender.publish("r0"), sender.publish("r0").to_bytes()):
            outcome = receiver.admit_retrieve("r0", None, None, form)
            assert not outcome.ok
            assert outcome.reason.startswith(f"{REFUSED} (conflict): stream ('r0', 'text'): "
                                             f"rewinds (({sender.writer}, 1),) conflict with "
                                             f"(({receiver.writer}, 1),): two writers")
            assert receiver.state_snapshot() == before
    assert (a.position("r0", "text"), b.position("r0", "text")) == (5, 9)


def test_a_third_node_takes_the_first_rewind_and_refuses_the_conflicting_one():
    a, b, c = at(make(1), 12), at(make(2), 12), at(make(3), 12)
    a.rollback("r0", "text", 5)
    b.rollback("r0", "text", 9)
    assert c.admit_retrieve("r0", None, None, a.publish("r0").to_bytes()).ok
    assert c.position("r0", "text") == 5
    outcome = c.admit_retrieve("r0", None, None, b.publish("r0").to_bytes())
    assert not outcome.ok and outcome.reason.startswith(f"{REFUSED} (conflict)")
    assert c.position("r0", "text") == 5


def test_the_conflict_is_found_whatever_the_number_of_rewinds_on_each_side():
    # A rolled back twice (epoch 2), B once (epoch 1): an epoch order would take A's at B
    # and drop A's stale-looking record... B's rewind lost either way. Not here.
    a, b = at(make(1), 20), at(make(2), 20)
    a.rollback("r0", "text", 15)
    a.rollback("r0", "text", 10)
    b.rollback("r0", "text", 18)
    for receiver, sender in ((b, a), (a, b)):
        outcome = receiver.admit_retrieve("r0", None, None, sender.publish("r0"))
        assert not outcome.ok and outcome.reason.startswith(f"{REFUSED} (conflict)")


def test_a_handoff_moves_the_right_to_roll_back():
    # Prefill A rolls back, hands the request to B (publish -> admit) and stops; B rolls
    # back twice more; B's records include A's rewind, so a third node that saw only A's
    # record, and A itself (an echo), take them.
    a, b, c = at(make(1), 30), at(make(2), 0), at(make(3), 0)
    a.rollback("r0", "text", 20)
    handed = a.publish("r0")
    assert b.admit_retrieve("r0", None, None, handed).ok
    assert c.admit_retrieve("r0", None, None, handed).ok
    b.rollback("r0", "text", 17)
    b.rollback("r0", "text", 15)
    assert b.publish("r0").rewinds == {"text": ((1, 1), (2, 2))}
    for node in (c, a):
        assert node.admit_retrieve("r0", None, None, b.publish("r0").to_bytes()).ok
        assert node.position("r0", "text") == 15
        assert node.admit_retrieve("r0", None, None, handed).ok   # stale: changes nothing
        assert node.position("r0", "text") == 15
    # Handed back (A admitted B's latest): A's next rewind includes B's, B takes it.
    a.rollback("r0", "text", 11)
    assert b.admit_retrieve("r0", None, None, a.publish("r0")).ok
    assert b.position("r0", "text") == 11


def test_a_sender_rewinding_after_the_handoff_is_refused_by_the_receiver():
    a, b = at(make(1), 30), at(make(2), 0)
    a.rollback("r0", "text", 20)
    assert b.admit_retrieve("r0", None, None, a.publish("r0")).ok
    b.rollback("r0", "text", 17)
    a.rollback("r0", "text", 12)                 # A did not see B's rewind: two owners
    for receiver, sender in ((b, a), (a, b)):
        outcome = receiver.admit_retrieve("r0", None, None, sender.publish("r0"))
        assert not outcome.ok and outcome.reason.startswith(f"{REFUSED} (conflict)")
    assert (a.position("r0", "text"), b.position("r0", "text")) == (12, 17)


def test_merging_publications_refuses_conflicting_rewinds():
    a, b = at(make(1), 12), at(make(2), 12)
    a.rollback("r0", "text", 5)
    b.rollback("r0", "text", 9)
    merged = a.publish("r0").clone()
    with pytest.raises(ValueError, match=r"stream 'text': rewinds \(\(2, 1\),\) conflict with "
                                         r"\(\(1, 1\),\)"):
        merged.update(b.publish("r0"))
    assert merged == a.publish("r0")


def test_writer_ids_are_checked_and_default_to_distinct_random_ones():
    for bad in (0, 2**32, -1):
        with pytest.raises(ValueError, match=r"writer=.* must be an int in \[1, 4294967295\]"):
            make(bad)
    for bad in (True, 1.5, np.bool_(True)):
        with pytest.raises(TypeError, match=r"writer=.* must be an int"):
            make(bad)
    writers = {PositionManager(PositionConfig(), "cpu").writer for _ in range(8)}
    assert len(writers) == 8 and all(1 <= w < 2**32 for w in writers)
