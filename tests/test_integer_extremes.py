"""Integer extremes into every integer scalar argument of the public entries: one rule.

Each entry names an argument, the range it documents and a call taking the value. For
every extreme (0, 1, ``2**31 - 1``, ``2**31``, ``2**32 + 1``, ``2**63 - 1``, ``2**64 - 1``,
negatives, floats, NaN, bools, ``np.bool_``, numpy scalars and 0-d arrays of every integer
width, torch 0-d tensors of every integer dtype, bool and float tensors) the expected
answer comes from :func:`jaxrope.testing.stream_model.integer_argument` (written without
the package's code): a type it refuses raises ``TypeError``, a value outside the range
``ValueError``, both naming the argument, and the object called keeps its state; any
other value gives exactly what the same call with the Python int gives. Values an entry
accepts above ``cheap`` (a buffer of that many tokens) are checked for refusal only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrope import positions
from jaxrope import speculative_positions as speculative
from jaxrope.mrope import Text
from jaxrope.testing.stream_model import Refused, integer_argument

torch = pytest.importorskip("torch")

from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionManager,  # noqa: E402
                          PositionStep, PublishedPositionInfo, Segment, StepContext)

INT32_MAX, MAX_SEQ_LEN = 2**31 - 1, 64


def extremes() -> list:
    values = [0, 1, 3, 2**31 - 1, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64 - 1, -1, -2**31 - 1,
              -2**63, 1.0, 2.5, float("nan"), True, False, np.bool_(True), np.bool_(False),
              np.float64(1.0), np.array(3), np.array(True), np.array(1.5), "1",
              torch.tensor(True), torch.tensor(1.0), torch.tensor([1])]
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64):
        info = np.iinfo(dtype)
        values += [dtype(1), dtype(3), dtype(info.max), dtype(info.min), np.array(2, dtype)]
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        values += [torch.tensor(3, dtype=dtype), torch.tensor(torch.iinfo(dtype).max, dtype=dtype),
                   torch.tensor(torch.iinfo(dtype).min, dtype=dtype)]
    return values


EXTREMES = extremes()


@dataclasses.dataclass(frozen=True)
class Entry:
    """``call(obj, value)`` on a fresh ``make()``; ``value`` is ``name``, in ``[low, high]``;
    ``state(obj, returned)``: what must match the Python-int call; ``cheap``: the largest
    accepted value actually run."""

    name: str
    make: Callable[[], Any]
    call: Callable[[Any, Any], Any]
    low: int
    high: int
    state: Callable[[Any, Any], Any]
    cheap: Optional[int] = None


def table():
    return positions.PositionTable(jnp.array([5, 9], jnp.int32))


def manager():
    mgr = PositionManager(PositionConfig(labels=("text",)), "cpu", max_seq_len=MAX_SEQ_LEN,
                          writer=1)
    mgr.ingest_request("r", {"text": 4})
    return mgr


def planned(**step):
    mgr = manager()
    s = PositionStep([Segment("r", "text", 2)], **step)
    mgr.plan(s, StepContext(("r",)))
    return mgr, s


def snapshot(mgr, _returned=None):
    return comparable(mgr.state_snapshot())


def returned(_obj, value):
    if isinstance(value, dict):
        return {k: v.tolist() for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(np.asarray(v).tolist() for v in value)
    return value.counters.tolist() if isinstance(value, positions.PositionTable) else value


def plan_and_commit(mgr, step, ctx=None):
    ctx = ctx or StepContext(("r",))
    out = {k: v.tolist() for k, v in mgr.plan(step, ctx).items()}
    mgr.commit(step, ctx)
    return out


def admitted(mgr, published):
    """admit_retrieve reports a refusal as its outcome: raised here as every other entry's
    (TypeError where the reason says the type is wrong)."""
    outcome = mgr.admit_retrieve("r", None, None, published)
    if not outcome.ok:
        raise (TypeError if "must be an int (" in outcome.reason else ValueError)(outcome.reason)
    return outcome


def commit_accepted(obj, value):
    mgr, step = obj
    mgr.commit(step, StepContext(("r",)), accepted={("r", "text"): value})


ENTRIES = [
    # core
    Entry("block_step", table, lambda t, v: positions.commit(
        t, [0], [1], scheme="block", block_step=v), 1, INT32_MAX - 5, returned),
    Entry("step", table, lambda t, v: speculative.plan_draft(
        t, jnp.array([0], jnp.int32), jnp.array([1], jnp.int32), jnp.zeros(2, jnp.int32),
        step=v, max_seq_len=64), 0, INT32_MAX - 4, returned),
    Entry("max_seq_len", table, lambda t, v: speculative.plan_draft(
        t, jnp.array([0], jnp.int32), jnp.array([1], jnp.int32), jnp.zeros(2, jnp.int32),
        step=1, max_seq_len=v), 1, INT32_MAX, returned),
    Entry("Text.length", lambda: None, lambda _, v: Text(v), 0, INT32_MAX, returned),
    # bridge
    Entry("max_seq_len", lambda: None, lambda _, v: PositionManager(
        PositionConfig(), "cpu", max_seq_len=v).max_seq_len, 1, INT32_MAX, returned),
    Entry("writer", lambda: None, lambda _, v: PositionManager(
        PositionConfig(), "cpu", writer=v).writer, 1, 2**32 - 1, returned),
    Entry("overrides['text']", manager, lambda m, v: m.ingest_request("q", {"text": v}),
          0, MAX_SEQ_LEN, snapshot),
    Entry("to_position['text']", manager, lambda m, v: m.rollback("r", "text", v),
          0, MAX_SEQ_LEN, snapshot),
    Entry("prefix['text']", manager, lambda m, v: m.apply_cached_prefix(
        "r", None, None, None, {"text": v}), 0, MAX_SEQ_LEN, snapshot),
    Entry("published.counters['text']", manager, lambda m, v: admitted(
        m, PublishedPositionInfo({"text": v})), 0, MAX_SEQ_LEN, snapshot),
    Entry(".span", manager, lambda m, v: plan_and_commit(
        m, PositionStep([Segment("r", "text", v)])), 0, INT32_MAX, snapshot, MAX_SEQ_LEN),
    Entry("step.advance", manager, lambda m, v: plan_and_commit(
        m, PositionStep([Segment("r", "text", 1)], advance=v)), 0, INT32_MAX, snapshot),
    Entry("step.draft_depth", manager, lambda m, v: plan_and_commit(
        m, PositionStep([Segment("r", "text", 1)], draft_depth=v)), 0, MAX_SEQ_LEN, snapshot),
    Entry("ctx.graph_slot.bucket.num_tokens", manager, lambda m, v: plan_and_commit(
        m, PositionStep([Segment("r", "text", 1)]),
        StepContext(("r",), graph_slot=GraphSlot(GraphBucket(None, 1, v), 0))),
        0, INT32_MAX, snapshot, 4096),
    Entry("ctx.graph_slot.slot", manager, lambda m, v: plan_and_commit(
        m, PositionStep([Segment("r", "text", 1)]),
        StepContext(("r",), graph_slot=GraphSlot(GraphBucket(None, 1, 4), v))),
        0, INT32_MAX, snapshot),
    Entry("accepted[('r', 'text')]", lambda: planned(), commit_accepted, 0, 1,
          lambda obj, _: comparable(obj[0].state_snapshot())),
]

def expected(entry: Entry, value: Any):
    """``"type"``, ``"range"`` or the Python int the call must act as."""
    try:
        return integer_argument(value, entry.low, entry.high)
    except Refused as e:
        return e.check


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_extreme_is_refused_naming_the_argument_or_acts_as_its_python_int(entry):
    for value in EXTREMES:
        want = expected(entry, value)
        obj = entry.make()
        before = snapshot_of(obj)
        if want in ("type", "range"):
            error = TypeError if want == "type" else ValueError
            with pytest.raises(error) as raised:
                entry.call(obj, value)
                pytest.fail(f"{entry.name}={value!r} was accepted")
            assert entry.name in str(raised.value), (entry.name, value, str(raised.value))
            assert snapshot_of(obj) == before, (entry.name, value)
            continue
        if entry.cheap is not None and want > entry.cheap:
            continue
        twin = entry.make()
        got = _outcome(entry, obj, value)
        assert got == _outcome(entry, twin, want), (entry.name, value)


def comparable(state: dict) -> dict:
    """``state_snapshot()`` without the plan objects (equal only to themselves): what a twin
    manager's snapshot can equal."""
    return {key: ({k: v for k, v in value.items() if k != "plan"}
                  if isinstance(value, dict) and "plan" in value else value)
            for key, value in state.items()}


def snapshot_of(obj):
    if isinstance(obj, PositionManager):
        return comparable(obj.state_snapshot())
    if isinstance(obj, tuple) and obj and isinstance(obj[0], PositionManager):
        return comparable(obj[0].state_snapshot())
    if isinstance(obj, positions.PositionTable):
        return [c.tolist() for c in (obj.counters, obj.deltas, obj.epochs)]
    return obj


def _outcome(entry: Entry, obj, value):
    """What the call gives: its state, or the refusal a later bound raised (a counter past
    max_seq_len, a sum past int32): the Python int must meet the same one."""
    try:
        result = entry.call(obj, value)
    except ValueError as e:
        return ("ValueError", str(e), snapshot_of(obj))
    return entry.state(obj, result)


def test_the_table_covers_every_width_and_both_answers():
    kinds = {type(v).__name__ for v in EXTREMES}
    assert {"int", "float", "bool", "int8", "uint64", "ndarray", "Tensor"} <= kinds
    answers = {expected(e, v) if isinstance(expected(e, v), str) else "accepted"
               for e in ENTRIES for v in EXTREMES}
    assert answers == {"type", "range", "accepted"}


def test_a_cached_step_never_takes_an_equal_bool_float_or_wide_count_for_an_int():
    # The view cache compares records by value, where True == 1, 1.0 == 1 and numpy's
    # np.uint8(255) == 2**64 - 1: every count is a Python int before a step reaches it.
    from torch_bridge import KVPlanOutput, KVView

    mgr = PositionManager(PositionConfig(), "cpu", max_seq_len=MAX_SEQ_LEN)
    mgr.ingest_request("a")
    for _ in range(2):   # the second plan is a cache hit
        step = PositionStep([Segment("a", "text", 1)])
        mgr.plan(step, StepContext(("a",)))
        mgr.commit(step, StepContext(("a",)))
    before = mgr.state_snapshot()
    for bad in (True, 1.0, np.bool_(True), torch.tensor(True)):
        with pytest.raises(TypeError, match=r"step\.segments\[0\]\.span"):
            PositionStep([Segment("a", "text", bad)])
        with pytest.raises(TypeError, match=r"views\[0\]\.to_compute"):
            KVPlanOutput([KVView("a", "text", bad)])
    wide = PositionStep([Segment("a", "text", np.uint64(2**64 - 1))])
    assert type(wide.segments[0].span) is int and wide.segments[0].span == 2**64 - 1
    with pytest.raises(ValueError, match=r"2147483647"):
        mgr.plan(wide, StepContext(("a",)))
    narrow = PositionStep([("a", "text", np.int8(1))])
    assert narrow.segments[0] == ("a", "text", 1) and type(narrow.segments[0][2]) is int
    assert mgr.state_snapshot() == before
