"""One manager shared by an engine thread and a KV-transfer thread, against the model.

A disaggregated decode engine: the *transfer* thread takes requests in from prefill
nodes (``ingest_request``, at an override or not, then ``admit_retrieve`` of the first
record as bytes or as an object), raises their counters as the rest of their KV
arrives (a later record, an ingest override, a cached prefix), hands them to the
*engine* thread, answers records for requests it never had, and takes back the ones the
engine finished (a stale echo, ``publish``, a publish snapshot, ``remove_request``);
once it takes in a burst that grows the slot table under the engine. The *engine*
thread ingests requests of its own, plans eager steps and pipelined pairs (a preplan
while the current step runs), rotates q and k at the planned positions on some steps
(``apply_qk``, checked against the float64 oracle), commits, and rolls back rejected
drafts (refused while a staged plan numbers the stream). The two share one
:class:`~torch_bridge.RopeManager` and nothing else but two queues.

Each thread runs the single-threaded model (:class:`jaxrope.testing.stream_model.NodeModel`)
of the streams it owns; a request's model state travels with it through the queue. The
model's streams are independent of one another, so whatever order the two threads'
calls take, every result (positions, rotations, admit outcomes, published records,
refusals) and the final counters must be the model's. Without the manager's lock the
calls interleave inside a method: a commit installs counters it copied before the other
thread's admit or override wrote, so the write is lost, or a plan numbers from them.
The interpreter's switch interval is shortened while the threads run so that such
interleavings are tried often.

Seeded (the ``rng`` fixture: a failure names the seed, ``JAXROPE_SEED=<seed>`` replays
the threads' choices; the interleaving itself is the scheduler's).
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402
from jaxrope.testing.stream_model import NodeModel, Refused  # noqa: E402
from torch_bridge import (PositionConfig, PositionStep, PublishedPositionInfo,  # noqa: E402
                          RopeManager, Segment, StepContext)

HEAD_DIM = 8
MAX_SEQ_LEN = 1 << 16
LABEL = "text"
ENGINE_STEPS = 400
ROTATED = 0.15               # the share of steps rotated with apply_qk
BURST = 300                  # arrivals at once: past the manager's first 256 slots
IN_FLIGHT = 48               # requests handed to the engine and not yet back, at most
WAITING = 8                  # requests whose records are still arriving, otherwise
PREFILL_WRITER = 77          # the prefill node's writer id, in the records it sends
SWITCH_INTERVAL_S = 2e-6
DEADLINE_S = 60.0
# A request's model state between threads: (rid, counter, rewinds {writer: rollbacks}).
Handoff = Tuple[str, int, Dict[int, int]]


def _give(model: NodeModel, rid: str) -> Handoff:
    """Take ``rid``'s stream out of ``model`` (its owner changes)."""
    stream = (rid, LABEL)
    return rid, model.counters.pop(stream), model.rewinds.pop(stream)


def _take(model: NodeModel, handoff: Handoff) -> str:
    rid, counter, rewinds = handoff
    model.counters[(rid, LABEL)], model.rewinds[(rid, LABEL)] = counter, dict(rewinds)
    return rid


def _check_publish(mgr: RopeManager, model: NodeModel, rid: str) -> None:
    info = mgr.publish(rid)
    counter, rewinds = model.publish(rid)[LABEL]
    assert info.counters == {LABEL: counter}, (rid, info, counter)
    assert info.rewinds_of(LABEL) == tuple(sorted(rewinds.items())), (rid, info, rewinds)


class Transfer:
    """Requests in from prefill (ingest, admit its records as its KV arrives, hand it to the
    engine) and out when finished (publish, remove)."""

    def __init__(self, mgr: RopeManager, seed: int, inbox: "queue.Queue[Handoff]",
                 outbox: "queue.Queue[Optional[Handoff]]"):
        self.mgr, self.rng = mgr, np.random.default_rng(seed)
        self.model = NodeModel(PREFILL_WRITER + 1, MAX_SEQ_LEN)
        self.inbox, self.outbox = inbox, outbox
        self.waiting: Dict[str, int] = {}     # rid -> records still to come before handoff
        self.next_id = 0
        self.seen = {"admitted": 0, "records": 0, "handed": 0, "finished": 0, "ghost": 0}

    def run(self) -> None:
        """Busy, as a transfer thread under load is: finish what the engine hands back, else
        answer a record for a request it never had, hand over a request whose KV is in (at
        most IN_FLIGHT at the engine), take a new one in (once, a burst), or admit the next
        record of one still arriving."""
        burst = int(self.rng.integers(20, 60))
        while True:
            try:
                handoff = self.outbox.get_nowait()
            except queue.Empty:
                handoff = ()
            if handoff is None:
                break
            ready = [rid for rid, left in self.waiting.items() if left == 0]
            arriving = [rid for rid, left in self.waiting.items() if left > 0]
            if handoff:
                self.finish(handoff)
            elif self.rng.random() < 0.05:
                self.ghost()
            elif ready and self.seen["handed"] - self.seen["finished"] < IN_FLIGHT:
                del self.waiting[ready[0]]
                self.inbox.put(_give(self.model, ready[0]))
                self.seen["handed"] += 1
            elif self.seen["admitted"] == burst or len(self.waiting) < WAITING:
                for _ in range(BURST if self.seen["admitted"] == burst else 1):
                    self.arrive()
            elif arriving:
                self.record(str(self.rng.choice(arriving)))
        # What the engine never received, or never got: finished unstarted.
        while not self.inbox.empty():
            self.finish(self.inbox.get_nowait())
        for rid in list(self.waiting):
            self.finish(_give(self.model, rid))

    def arrive(self) -> None:
        """A prefill node's request: ingest (maybe at an override) and admit its first
        record, as bytes or as an object."""
        rid, rng, model = f"t{self.next_id}", self.rng, self.model
        self.next_id += 1
        override = int(rng.integers(0, 40)) if rng.random() < 0.5 else 0
        self.mgr.ingest_request(rid, {LABEL: override} if override else None)
        model.ingest(rid, override)
        position, rollbacks = int(rng.integers(0, 60)), int(rng.integers(0, 3))
        rewinds = {PREFILL_WRITER: rollbacks} if rollbacks else {}
        record = PublishedPositionInfo(
            {LABEL: position}, epochs={LABEL: rollbacks} if rollbacks else {},
            fingerprint=self.mgr.fingerprint(),
            rewinds={LABEL: ((PREFILL_WRITER, rollbacks),)} if rollbacks else {})
        outcome = self.mgr.admit_retrieve(rid, None, None,
                                          record.to_bytes() if rng.random() < 0.5 else record)
        model.admit(rid, {LABEL: (position, rewinds)})   # a fresh stream: never refused
        assert outcome.ok, outcome
        self.waiting[rid] = int(rng.integers(0, 6))
        self.seen["admitted"] += 1

    def record(self, rid: str) -> None:
        """The next part of a request's prefill: its counter raised by a record of the same
        rewinds, an ingest override or a cached prefix (three paths of one rule)."""
        counter, rewinds = self.model.publish(rid)[LABEL]
        target = counter + int(self.rng.integers(0, 5))
        path = int(self.rng.integers(0, 3))
        if path == 0:
            record = PublishedPositionInfo(
                {LABEL: target}, epochs={LABEL: sum(rewinds.values())} if rewinds else {},
                rewinds={LABEL: tuple(sorted(rewinds.items()))} if rewinds else {})
            assert self.mgr.admit_retrieve(rid, None, None, record).ok
            self.model.admit(rid, {LABEL: (target, rewinds)})
        else:
            if path == 1:
                self.mgr.ingest_request(rid, {LABEL: target})
            else:
                self.mgr.apply_cached_prefix(rid, None, None, None, {LABEL: target})
            self.model.ingest(rid, target)       # the model's raise_to
        if self.rng.random() < 0.2:
            _check_publish(self.mgr, self.model, rid)
        self.waiting[rid] -= 1
        self.seen["records"] += 1

    def finish(self, handoff: Handoff) -> None:
        """A request the engine finished: a stale echo changes nothing; publish; remove."""
        model, rid = self.model, _take(self.model, handoff)
        counter, rewinds = model.publish(rid)[LABEL]
        echo = PublishedPositionInfo({LABEL: max(0, counter - 3)},
                                     epochs={LABEL: sum(rewinds.values())} if rewinds else {},
                                     rewinds={LABEL: tuple(sorted(rewinds.items()))} if rewinds else {})
        assert self.mgr.admit_retrieve(rid, None, None, echo).ok
        if self.rng.random() < 0.5:
            snapshot = self.mgr.publish_snapshot_for_step(rid, "decode", None)
            assert self.mgr.publish_from_snapshot(rid, snapshot, "decode", None).counters == \
                {LABEL: counter}
        _check_publish(self.mgr, model, rid)
        self.mgr.remove_request(rid)
        model.remove(rid)
        self.seen["finished"] += 1

    def ghost(self) -> None:
        """A record for a request this node never had: refused, as the model says."""
        with pytest.raises(Refused):
            self.model.admit("ghost", {LABEL: (3, {})})
        outcome = self.mgr.admit_retrieve("ghost", None, None, PublishedPositionInfo({LABEL: 3}))
        assert not outcome.ok and "(request)" in outcome.reason, outcome
        assert self.mgr.publish("ghost") is None
        self.seen["ghost"] += 1


class Engine:
    """Steps over the requests it holds: plan, apply_qk, commit, preplan, rollback."""

    def __init__(self, mgr: RopeManager, seed: int, inbox: "queue.Queue[Handoff]",
                 outbox: "queue.Queue[Optional[Handoff]]"):
        self.mgr, self.rng = mgr, np.random.default_rng(seed)
        self.model = NodeModel(mgr.writer, MAX_SEQ_LEN)
        self.inbox, self.outbox = inbox, outbox
        self.left: Dict[str, int] = {}            # rid -> steps before it finishes
        self.next_id = 0
        self.freqs = oracle.serving_frequencies(mgr.rope)
        self.seen = {"steps": 0, "pipelined": 0, "rotated": 0, "rollback": 0,
                     "rollback refused": 0}

    def run(self) -> None:
        while self.seen["steps"] < ENGINE_STEPS:
            self.receive()
            if self.rng.random() < 0.2:           # a request of this node's own
                rid = f"e{self.next_id}"
                self.next_id += 1
                self.mgr.ingest_request(rid)
                self.model.ingest(rid)
                self.left[rid] = int(self.rng.integers(1, 6))
            if self.left:
                self.iteration()
        for rid in list(self.left):
            self.outbox.put(_give(self.model, rid))
        self.outbox.put(None)

    def receive(self) -> None:
        try:
            while True:
                rid = _take(self.model, self.inbox.get_nowait())
                self.left[rid] = int(self.rng.integers(1, 6))
        except queue.Empty:
            pass

    def views(self) -> Dict[Tuple[str, str], Tuple[str, int]]:
        rids = list(self.left)
        chosen = self.rng.choice(rids, size=min(len(rids), int(self.rng.integers(1, 9))),
                                 replace=False)
        return {(str(rid), LABEL): ("span", int(self.rng.integers(1, 4))) for rid in chosen}

    def plan(self, views, preplan: bool) -> Tuple[PositionStep, StepContext]:
        step = PositionStep([Segment(rid, label, n) for (rid, label), (_, n) in views.items()])
        ctx = StepContext(tuple(rid for rid, _ in views), is_preplan=preplan)
        planned = self.model.plan(views, preplan, tag=step)
        got = self.mgr.plan(step, ctx)[LABEL]
        want = [p for stream in views for p in planned.positions[stream]]
        assert got.tolist() == want, (got.tolist(), want)
        return step, ctx

    def rotate_and_commit(self, step: PositionStep, ctx: StepContext) -> None:
        """apply_qk on some steps (the JAX call is most of a step's time; the calls around
        it are what the lock serialises), then commit."""
        positions = self.mgr.pos_ids(LABEL).tolist()
        if self.rng.random() < ROTATED:
            gen = torch.Generator().manual_seed(int(self.rng.integers(0, 2**31)))
            q = torch.randn(len(positions), 2, HEAD_DIM, generator=gen)
            k = torch.randn(len(positions), 1, HEAD_DIM, generator=gen)
            want = oracle.rope_oracle(q.numpy(), np.asarray(positions), *self.freqs, HEAD_DIM,
                                      False)
            self.mgr.apply_qk(q, k, LABEL)
            np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)
            self.seen["rotated"] += 1
        self.mgr.commit(step, ctx)
        self.model.commit({})

    def rollback(self, rid: str) -> None:
        """Rejected drafts: back by one, or refused while a plan numbers the stream."""
        stream = (rid, LABEL)
        to = max(0, self.model.counters[stream] - 1)
        try:
            self.model.rollback(stream, to)
        except Refused as e:
            assert e.check == "planned", e.check
            with pytest.raises(ValueError, match="is in a plan not yet committed"):
                self.mgr.rollback(rid, LABEL, to)
            self.seen["rollback refused"] += 1
            return
        self.mgr.rollback(rid, LABEL, to)
        self.seen["rollback"] += 1

    def iteration(self) -> None:
        first = self.views()
        step, ctx = self.plan(first, preplan=False)
        if self.rng.random() < 0.5:               # pipelined: step N+1 planned while N runs
            second = self.views()
            staged = self.plan(second, preplan=True)
            self.rollback(str(self.rng.choice([rid for rid, _ in second])))
            self.rotate_and_commit(step, ctx)
            self.rotate_and_commit(*staged)
            self.seen["pipelined"] += 1
        else:
            self.rotate_and_commit(step, ctx)
        if self.rng.random() < 0.3:
            self.rollback(str(self.rng.choice(list(self.left))))
        self.seen["steps"] += 1
        for rid in [rid for rid, left in self.left.items() if left <= 1]:
            del self.left[rid]
            self.outbox.put(_give(self.model, rid))
        for rid in self.left:
            self.left[rid] -= 1


def _manager() -> RopeManager:
    rope = jr.RopeConfig(head_dim=HEAD_DIM, max_position=MAX_SEQ_LEN)
    mgr = RopeManager(PositionConfig(rope=rope, labels=(LABEL,)), "cpu", max_seq_len=MAX_SEQ_LEN,
                      launcher="jax")
    # Compile the JAX path's token buckets (16, 32) before the threads start.
    mgr.ingest_request("warm")
    for n in (16, 32):
        step = PositionStep([Segment("warm", LABEL, n)])
        mgr.plan(step, StepContext())
        mgr.apply_qk(torch.zeros(n, 2, HEAD_DIM), torch.zeros(n, 1, HEAD_DIM), LABEL)
        mgr.commit(step, StepContext())
    mgr.remove_request("warm")
    return mgr


def run_threads(seed: int, mgr: Optional[RopeManager] = None) -> Tuple[Engine, Transfer]:
    """The two threads over one manager; raises the first thread's failure."""
    mgr = _manager() if mgr is None else mgr
    inbox: "queue.Queue[Handoff]" = queue.Queue()
    outbox: "queue.Queue[Optional[Handoff]]" = queue.Queue()
    engine = Engine(mgr, seed, inbox, outbox)
    transfer = Transfer(mgr, seed + 1, inbox, outbox)
    errors: List[BaseException] = []

    def guarded(work):
        try:
            work()
        except BaseException as e:   # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
            outbox.put(None)          # let the other thread finish

    threads = [threading.Thread(target=guarded, args=(work,), daemon=True)
               for work in (engine.run, transfer.run)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + DEADLINE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    assert not any(thread.is_alive() for thread in threads), f"threads still running after {DEADLINE_S} s"
    return engine, transfer


def test_an_engine_thread_and_a_transfer_thread_agree_with_the_model(rng):
    seed = int(rng.integers(0, 2**31))
    try:
        engine, transfer = run_threads(seed)
    except AssertionError as e:
        raise AssertionError(f"thread seed {seed}: {e}") from e
    mgr = engine.mgr
    # Every request was handed back, published and removed; nothing is left behind.
    assert mgr.requests() == [] and not engine.model.counters and not transfer.model.counters
    assert mgr.state_snapshot()["row_map"]["live"] == 0
    assert transfer.seen["finished"] == transfer.seen["admitted"] + engine.next_id
    assert min(transfer.seen.values()) > 0, transfer.seen
    # The run did what it is meant to: many steps, pipelined ones, refusals, past 256 slots.
    assert engine.seen["pipelined"] > 0, engine.seen
    assert engine.seen["rollback"] > 0 and engine.seen["rollback refused"] > 0, engine.seen
    assert engine.seen["rotated"] > 0, engine.seen
    print(f"thread seed {seed}: engine {engine.seen}, transfer {transfer.seen}, "
          f"row capacity {mgr.state_snapshot()['row_map']['capacity']}")
