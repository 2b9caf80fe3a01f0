"""The torch bridge's wire format: a publication as bytes, and ``admit_retrieve`` of bytes.

A record that round-trips is the publication it was made from, at ``10 + len(label)``
bytes a stream plus 8 per writer that rolled it back, plus 44; a label that cannot fit is
refused when the record is made. ``admit_retrieve`` of bytes does exactly what admitting the object
does; of anything else (a truncated, corrupted, foreign or random byte string) it
returns ``AdmitOutcome(ok=False, ready=False, reason)`` and the manager's
``state_snapshot()`` is unchanged.

The fuzz, through ``admit_retrieve`` on a busy M-RoPE manager, feeds more than 1.8 * 10^4
inputs: every truncation and every single-bit flip of 16 records plus 180 drawn byte
substitutions, insertions and deletions each (at least 693 inputs a record: the
smallest, one stream without rewinds, is 57 bytes), 5000
random byte strings (half behind a valid magic and version), and 400 well-formed
records under the right fingerprint with drawn labels and values, each of which must
be refused or land exactly where the rewind order (written out here) says.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jaxrope as jr  # noqa: E402
from jaxrope import wire  # noqa: E402
from torch_bridge import (AdmitOutcome, PositionConfig, PositionStep,  # noqa: E402
                          PublishedPositionInfo, RopeManager, Segment, StepContext)

LABELS = ("text", "image", "video", "cfg")
MAX_SEQ_LEN = 4096
ROPE = jr.RopeConfig(head_dim=16, theta=1e6, mrope_section=[2, 3, 3], max_position=MAX_SEQ_LEN)
REFUSED = "published record refused"
FUZZ = settings(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# The writer ids of the receiver (busy_receiver) and of the senders.
RECEIVER, SENDER = 1, 2


def manager(labels=LABELS, rope=ROPE, writer=SENDER) -> RopeManager:
    return RopeManager(PositionConfig(rope=rope, labels=labels), "cpu", max_seq_len=MAX_SEQ_LEN,
                       launcher="jax", writer=writer)


def run_step(mgr, segments):
    step = PositionStep([Segment(*s) for s in segments])
    ctx = StepContext(tuple(dict.fromkeys(s[0] for s in segments)))
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)


def busy_receiver() -> RopeManager:
    """Two requests with non-zero positions, deltas and epochs, a plan in flight."""
    mgr = manager(writer=RECEIVER)
    mgr.ingest_request("a", {"text": 10}, deltas={"text": -7, "image": 3})
    mgr.ingest_request("b")
    run_step(mgr, [("a", "text", 20), ("a", "image", 9), ("b", "cfg", 4)])
    mgr.rollback("a", "text", 15)
    mgr.plan(PositionStep([Segment("b", "video", 2)]), StepContext(("b",)))
    return mgr


def streams_of(mgr):
    """The stream part of a snapshot (plans compare by identity, so differ across managers)."""
    state = mgr.state_snapshot()
    return {key: state[key] for key in ("counters", "slots", "deltas", "epochs", "rewinds",
                                        "requests")}


def refuse(mgr, before, data):
    outcome = mgr.admit_retrieve("a", "prefill", None, data)
    assert isinstance(outcome, AdmitOutcome), outcome
    assert (outcome.ok, outcome.ready) == (False, False), (bytes(data).hex(), outcome)
    assert isinstance(outcome.reason, str) and outcome.reason.startswith(REFUSED), outcome
    assert mgr.state_snapshot() == before
    return outcome.reason


# ------------------------------------------------------------------ records of real publications


def test_a_real_publication_round_trips_at_10_bytes_a_stream_plus_its_label_and_rewinds():
    long_label = "ä" * 24  # 48 bytes in UTF-8: the longest label the format carries
    labels = LABELS + (long_label,)
    sender = manager(labels)
    sender.ingest_request("r", {"text": 20}, deltas={"text": -12, "video": 5})
    run_step(sender, [("r", "text", 30), ("r", "image", 64), ("r", long_label, 3)])
    run_step(sender, [("r", "text", 1), ("r", "video", 2)])
    sender.rollback("r", "image", 60)          # a new epoch on one stream
    published = sender.publish("r")
    assert published.deltas == {"text": -12, "video": 5} and published.epochs == {"image": 1}
    assert published.rewinds == {"image": ((SENDER, 1),)}

    data = published.to_bytes()
    per_stream = {label: 10 + len(label.encode()) + 8 * (label == "image") for label in labels}
    assert len(data) == 44 + sum(per_stream.values())
    assert max(per_stream.values()) == 58
    decoded = PublishedPositionInfo.from_bytes(data, expect_fingerprint=sender.fingerprint())
    assert decoded == published

    receiver = manager(labels)
    receiver.ingest_request("r")
    assert receiver.admit_retrieve("r", "prefill", None, data) == AdmitOutcome(True, True)
    assert receiver.publish("r") == published


def test_the_two_stream_record_of_the_demo_labels_is_71_bytes():
    sender = manager(("main", "cfg"), jr.RopeConfig(head_dim=64, theta=5e5))
    sender.ingest_request("r")
    run_step(sender, [("r", "main", 27)])
    assert len(sender.publish("r").to_bytes()) == 44 + (10 + 4) + (10 + 3)


@pytest.mark.parametrize("label,size", [("x" * 49, 49), ("é" * 25, 50), ("\U0001f600" * 13, 52)])
def test_a_label_that_cannot_fit_is_refused_when_the_record_is_made(label, size):
    sender = manager(("text", label))
    sender.ingest_request("r")
    published = sender.publish("r")  # the object still works in process
    with pytest.raises(wire.WireFormatError, match=f"cannot go on the wire.*{size} bytes in UTF-8, "
                                                   "the format carries 1 to 48") as info:
        published.to_bytes()
    assert info.value.reason == "label" and isinstance(info.value, ValueError)


def test_a_record_without_a_fingerprint_or_with_orphan_deltas_is_refused():
    with pytest.raises(ValueError, match="fingerprint=None"):
        PublishedPositionInfo({"text": 3}).to_bytes()
    with pytest.raises(ValueError, match=r"labels \['image'\] that have no counter"):
        PublishedPositionInfo({"text": 3}, deltas={"image": 2}, fingerprint=bytes(32)).to_bytes()
    with pytest.raises(wire.WireFormatError, match="position=-1"):
        PublishedPositionInfo({"text": -1}, fingerprint=bytes(32)).to_bytes()


def test_admit_takes_bytes_bytearray_and_memoryview_as_it_takes_the_object():
    sender = manager()   # text: further on in an older epoch (stale); image: rolled back
    sender.ingest_request("a", {"text": 10}, deltas={"text": -7, "image": 3})
    run_step(sender, [("a", "text", 40), ("a", "image", 2)])
    sender.rollback("a", "image", 1)
    data = sender.publish("a").to_bytes()
    reference = busy_receiver()
    reference.admit_retrieve("a", None, None, sender.publish("a"))
    assert reference.publish("a").counters == {"text": 15, "image": 1, "video": 0, "cfg": 0}
    for form in (data, bytearray(data), memoryview(data)):
        mgr = busy_receiver()
        assert mgr.admit_retrieve("a", None, None, form) == AdmitOutcome(True, True)
        assert streams_of(mgr) == streams_of(reference)


@pytest.mark.parametrize("other", [
    jr.RopeConfig(head_dim=16, theta=1e4, mrope_section=[2, 3, 3], max_position=MAX_SEQ_LEN),
    jr.RopeConfig(head_dim=16, theta=1e6, mrope_section=[4, 2, 2], max_position=MAX_SEQ_LEN),
], ids=["theta", "mrope_section"])
def test_admit_refuses_the_bytes_of_a_manager_that_rotates_differently(other):
    sender = manager(rope=other)
    sender.ingest_request("a")
    run_step(sender, [("a", "text", 5)])
    mgr = busy_receiver()
    reason = refuse(mgr, mgr.state_snapshot(), sender.publish("a").to_bytes())
    assert "(fingerprint)" in reason and "another RoPE config or scheme" in reason


def test_admit_of_bytes_for_an_unknown_request_reports_it():
    data = busy_receiver().publish("a").to_bytes()
    mgr = busy_receiver()
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("ghost", None, None, data)
    assert not outcome.ok and outcome.reason == (
        f"{REFUSED} (request): request_id='ghost' was never ingested (call ingest_request first)")
    assert mgr.state_snapshot() == before


# ------------------------------------------------------------------ fuzz through admit_retrieve


@st.composite
def publications(draw):
    """A publication of the receiver's labels under its fingerprint, values in range."""
    labels = draw(st.lists(st.sampled_from(LABELS), min_size=1, max_size=4, unique=True))
    counters = {label: draw(st.integers(0, MAX_SEQ_LEN)) for label in labels}
    deltas = {label: draw(st.integers(-MAX_SEQ_LEN, MAX_SEQ_LEN)) for label in labels}
    epochs = {label: draw(st.integers(0, 3)) for label in labels}
    return PublishedPositionInfo(counters, {k: v for k, v in deltas.items() if v},
                                 {k: v for k, v in epochs.items() if v}, manager().fingerprint(),
                                 {k: ((SENDER, v),) for k, v in epochs.items() if v})


@settings(FUZZ, max_examples=16)
@given(publications(), st.data())
def test_every_truncation_bit_flip_and_byte_edit_of_a_record_is_refused(published, data):
    mgr = busy_receiver()
    before = mgr.state_snapshot()
    record = published.to_bytes()
    n = len(record)
    inputs = [record[:i] for i in range(n)]
    inputs += [record[:i // 8] + bytes((record[i // 8] ^ (1 << i % 8),)) + record[i // 8 + 1:]
               for i in range(8 * n)]
    for _ in range(60):
        at = data.draw(st.integers(0, n - 1))
        byte = data.draw(st.integers(0, 255).filter(lambda b: b != record[at]))
        inputs.append(record[:at] + bytes((byte,)) + record[at + 1:])      # substitution
        inputs.append(record[:at] + bytes((byte,)) + record[at:])          # insertion
        inputs.append(record[:at] + record[at + 1:])                       # deletion
    assert len(inputs) >= 9 * 57 + 180   # the smallest record: 57 bytes
    for corrupted in inputs:
        refuse(mgr, before, corrupted)


@settings(FUZZ, max_examples=50)
@given(st.lists(st.binary(max_size=160), min_size=50, max_size=50),
       st.lists(st.binary(max_size=160), min_size=50, max_size=50))
def test_random_bytes_are_refused(anything, behind_a_header):
    mgr = busy_receiver()
    before = mgr.state_snapshot()
    for data in anything + [wire.MAGIC + bytes((wire.VERSION,)) + b for b in behind_a_header]:
        refuse(mgr, before, data)


def _includes(a, b) -> bool:
    """Whether rewinds ``a`` hold every rollback of ``b``: per writer at least as many."""
    counts = dict(a)
    return all(counts.get(writer, 0) >= n for writer, n in b)


def _model_admit(state, rid, published):
    """The rewind order, written out: ``{label: (position, delta, epoch, rewinds)}`` after
    admit, or None when a stream's rewinds conflict (the record is refused)."""
    slots = dict(zip(LABELS, state["requests"][rid]))
    out = {}
    for label in LABELS:
        slot = slots[label]
        mine = (state["slots"][slot], state["deltas"][slot], state["epochs"][slot],
                state["rewinds"].get(slot, ()))
        if label in published.counters:
            theirs = (*published.record(label), published.rewinds_of(label))
            newer, older = _includes(theirs[3], mine[3]), _includes(mine[3], theirs[3])
            if not (newer or older):
                return None
            if (newer and not older) or (newer and older and theirs[0] > mine[0]):
                mine = theirs
        out[label] = mine
    return out


@st.composite
def well_formed_records(draw):
    """Records that decode: any labels (the receiver's and others), any int32 values."""
    names = st.sampled_from(LABELS) | st.text(min_size=1, max_size=6)
    labels = draw(st.lists(names, min_size=1, max_size=5, unique=True))
    position = st.integers(0, MAX_SEQ_LEN + 2) | st.integers(0, 2**31 - 1)
    delta = st.integers(-MAX_SEQ_LEN - 2, MAX_SEQ_LEN + 2) | st.integers(-2**31, 2**31 - 1)
    writer = st.sampled_from((0, RECEIVER, SENDER, 3)) | st.integers(0, 2**32 - 1)
    count = st.integers(1, 3) | st.integers(1, 2**31 - 1)
    streams = []
    for label in labels:
        rewinds = dict(draw(st.lists(st.tuples(writer, count), max_size=3)))
        while sum(rewinds.values()) > wire.MAX_EPOCH:
            rewinds.popitem()
        streams.append(wire.StreamRecord(label, draw(position), draw(delta),
                                         tuple(sorted(rewinds.items()))))
    return wire.encode(manager().fingerprint(), streams)


@settings(FUZZ, max_examples=400)
@given(well_formed_records())
def test_a_well_formed_record_is_refused_or_lands_where_the_rewind_order_says(data):
    mgr = busy_receiver()
    before = mgr.state_snapshot()
    published = PublishedPositionInfo.from_bytes(data)
    outcome = mgr.admit_retrieve("a", None, None, data)
    after = mgr.state_snapshot()
    known = set(published.counters) <= set(LABELS)
    expected = _model_admit(before, "a", published) if known else None
    if not outcome.ok:
        assert not outcome.ready and outcome.reason.startswith(REFUSED) and after == before
        return
    assert known and expected is not None
    slots = dict(zip(LABELS, after["requests"]["a"]))
    landed = {label: (after["slots"][s], after["deltas"][s], after["epochs"][s],
                      after["rewinds"].get(s, ())) for label, s in slots.items()}
    assert landed == expected
    records = ("counters", "slots", "deltas", "epochs", "rewinds")
    assert {k: v for k, v in after.items() if k not in records} \
        == {k: v for k, v in before.items() if k not in records}


def test_the_fuzz_sees_both_outcomes_of_well_formed_records():
    """The property above is not vacuous: drawn records are both taken on and refused."""
    fingerprint = manager().fingerprint()
    taken = wire.encode(fingerprint, [wire.StreamRecord("text", 99, 4, ((RECEIVER, 2),))])
    refused = wire.encode(fingerprint, [wire.StreamRecord("text", MAX_SEQ_LEN + 1)])
    conflict = wire.encode(fingerprint, [wire.StreamRecord("text", 99, 4, ((SENDER, 2),))])
    mgr = busy_receiver()
    assert mgr.admit_retrieve("a", None, None, taken).ok
    assert mgr.publish("a").record("text") == (99, 4, 2)
    assert mgr.publish("a").rewinds_of("text") == ((RECEIVER, 2),)
    outcome = mgr.admit_retrieve("a", None, None, refused)
    assert not outcome.ok and f"published.counters['text']={MAX_SEQ_LEN + 1}" in outcome.reason
    outcome = mgr.admit_retrieve("a", None, None, conflict)
    assert not outcome.ok and outcome.reason.startswith(f"{REFUSED} (conflict)")
