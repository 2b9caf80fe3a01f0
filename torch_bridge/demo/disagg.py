"""Disaggregated prefill -> decode: the two nodes, the resume after a crash, and the checks.

A *prefill node* prefills every request's prompt in chunks, publishes its position
record and packs the rotated KV for shipping (:class:`~torch_bridge.handoff.Handoff`).
A *decode node* admits each handoff (``admit_retrieve`` of the record's bytes), takes
the shipped KV over and decodes every running request one token a step, publishing each
request's record (and the token ids it decoded) to a
:class:`~torch_bridge.handoff.RecordStore` after every step. Both nodes are the demo's
:class:`~torch_bridge.demo.node.Node` over their own ``RopeManager`` and the same
attention layer (same weights from the same seed), so every step's attention output
is checked against a float64 recompute of each sequence from scratch.

When a decode node dies, a new one resumes every request from the store: it admits the
shipped prompt record, rebuilds the KV of the tokens the old node had decoded (one
re-prefill step, checked like any other) and admits its own last record, which must then
leave the position where the rebuilt KV ends. A step the old node had computed but not
published is decoded again at the same position: none is lost, none repeated.

:func:`run_in_process` plays the whole exchange in one process (the kill is an
exception at the hold point); :mod:`torch_bridge.demo.disagg_processes` runs the same
nodes as two processes over gloo on 127.0.0.1 and kills the decode process with
SIGKILL. :func:`verify` checks either run's log.

Example:
  >>> report = run_in_process(DisaggSpec(requests=((9, 4), (5, 3)), kill_after=2))
  >>> report.failures
  []
  >>> for row in report.rows["decode1"]:
  ...     print(row["kind"], row["positions"])
  recover {'r0': 9, 'r1': 5}
  decode {'r0': 11, 'r1': 6}
  decode {'r0': 12, 'r1': 7}
  >>> report.bytes_per_stream
  13.5
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from jaxrope.config import RopeConfig
from jaxrope.models import HF_CONFIGS
from jaxrope.wire import WireFormatError
from torch_bridge.config import PositionConfig
from torch_bridge.demo.model import MODELS, TOLERANCE, VOCAB, Layer, Stream
from torch_bridge.demo.node import LABELS, Node, StepRow
from torch_bridge.handoff import Handoff, RecordStore
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.rope_manager import RopeManager

__all__ = ["DecodeNode", "DisaggReport", "DisaggSpec", "new_node", "prefill", "run_in_process",
           "verify"]

MAX_SEQ_LEN = 4096
# jaxrope.wire: a 44-byte header and checksum, then 10 + len(label) bytes a stream (and 8
# per writer that rolled it back).
_RECORD_OVERHEAD = 44
Log = Callable[[dict], None]


@dataclasses.dataclass(frozen=True)
class DisaggSpec:
    """What a run does: the model, the requests, where the first decode node dies.

    Attributes:
      model: a key of :data:`torch_bridge.demo.model.MODELS` (the real RoPE config).
      seed: weights, prompts and the scripted decode tokens.
      requests: ``(prompt tokens, tokens to decode)`` per request, ids ``r0, r1, ...``;
        the decode node takes one new request a step.
      prefill_budget: tokens a prefill step takes (chunked prefill, first come first
        served).
      kill_after: the decode step after whose commit the first decode node stops before
        publishing (and is killed); None: it runs to the end.
    """

    model: str = "llama3.1"
    seed: int = 0
    requests: Tuple[Tuple[int, int], ...] = ((19, 10), (33, 8), (7, 3), (24, 6))
    prefill_budget: int = 16
    kill_after: Optional[int] = 5

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model={self.model!r} must be one of {sorted(MODELS)}")
        requests = tuple(tuple(r) for r in self.requests)
        if not requests or not all(len(r) == 2 and r[0] >= 1 and r[1] >= 1 for r in requests):
            raise ValueError(f"requests={self.requests!r} must be (prompt >= 1, decode >= 1) pairs")
        object.__setattr__(self, "requests", requests)
        if self.prefill_budget < 1:
            raise ValueError(f"prefill_budget={self.prefill_budget} must be >= 1")
        if self.kill_after is not None and self.kill_after < 0:
            raise ValueError(f"kill_after={self.kill_after} must be >= 0 or None")

    @property
    def rids(self) -> Tuple[str, ...]:
        return tuple(f"r{i}" for i in range(len(self.requests)))

    def rope(self) -> RopeConfig:
        return RopeConfig.from_hf(HF_CONFIGS[MODELS[self.model]])

    def prompt(self, index: int) -> List[int]:
        return np.random.default_rng([self.seed, 1, index]).integers(
            0, VOCAB, self.requests[index][0]).tolist()

    def token(self, index: int, position: int) -> int:
        """The decode token fed at ``position`` (scripted, so a redone step feeds the same)."""
        return int(np.random.default_rng([self.seed, 2, index, position]).integers(VOCAB))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DisaggSpec":
        return cls(**json.loads(text))


def new_node(spec: DisaggSpec, name: str) -> Node:
    """A node with its own RopeManager and the spec's attention layer (weights from its seed)."""
    rope = spec.rope()
    layer = Layer(rope, torch.device("cpu"), np.random.default_rng(spec.seed))
    mgr = RopeManager(PositionConfig(rope=rope, labels=LABELS), "cpu", max_seq_len=MAX_SEQ_LEN)
    return Node(name, mgr, layer)


def _row(row: StepRow, kind: str, **extra) -> dict:
    return {**dataclasses.asdict(row), "kind": kind, **extra}


def prefill(spec: DisaggSpec, node: Node, log: Log) -> List[Handoff]:
    """Prefill every request in chunks of ``spec.prefill_budget`` tokens, checked at every
    step; each completed prompt is published and its rotated KV packed, in that order."""
    mgr, waiting, handoffs = node.mgr, [], []
    for index, rid in enumerate(spec.rids):
        mgr.ingest_request(rid)
        node.new_stream(rid, "main")
        waiting.append([rid, spec.prompt(index), 0])
    step = 0
    while waiting:
        budget, views, completed = spec.prefill_budget, [], []
        for entry in list(waiting):
            rid, ids, done = entry
            n = min(budget, len(ids) - done)
            views.append((rid, "main", ids[done:done + n]))
            entry[2] += n
            budget -= n
            if entry[2] == len(ids):
                waiting.remove(entry)
                completed.append(rid)
            if budget == 0:
                break
        row = StepRow(step, node.name)
        node.step(row, views)
        for rid in completed:
            stream = node.streams[rid, "main"]
            record = mgr.publish(rid).to_bytes()
            handoffs.append(Handoff(rid, record, list(stream.ids), stream.k.clone(),
                                    stream.v.clone()))
            row.events.append(f"publish {rid} @{mgr.position(rid, 'main')} ({len(record)} bytes)")
        log(_row(row, "prefill"))
        step += 1
    return handoffs


@dataclasses.dataclass
class _Running:
    index: int
    max_new: int
    decoded: List[int]


class DecodeNode:
    """The decode side: admits handoffs, decodes one token a step for every running request,
    publishes each one's record after every step, and resumes from those after a restart.

    Args:
      spec: the run.
      records: where this node publishes (and, restarted, finds) each request's record.
      log: receives one dict per step (a :class:`~torch_bridge.demo.node.StepRow` plus
        ``kind``, ``positions`` ``{rid: position decoded}`` and ``published``).
      hold_after: the decode step after whose commit ``hold`` is called, before the step's
        records are published (where the process is killed); None: never.
      hold: called there; it blocks until the process is killed (or raises, in one
        process).
    """

    def __init__(self, spec: DisaggSpec, records: RecordStore, log: Log, *,
                 hold_after: Optional[int] = None, hold: Callable[[], None] = lambda: None):
        self.spec, self.records, self.log = spec, records, log
        self.node = new_node(spec, "decode")
        self.hold_after, self.hold = hold_after, hold
        self.running: Dict[str, _Running] = {}
        self.steps = 0
        self.failed = False

    def serve(self, receive: Callable[[], Handoff], total: int) -> None:
        """Take ``total`` handoffs from ``receive`` and decode until every request is done.

        A restarted node first takes every request it published a record for (they
        were running), in the first step; then one new request joins a step.
        """
        backlog = sum(self.records.latest(rid) is not None for rid in self.spec.rids)
        received, first = 0, True
        while True:
            want = backlog + 1 if first else 1
            arrivals = []
            while received < total and len(arrivals) < want:
                arrivals.append(receive())
                received += 1
            first = False
            if not self.step(arrivals) and received == total:
                return

    def step(self, arrivals: Sequence[Handoff] = ()) -> bool:
        """Admit ``arrivals`` (rebuilding resumed ones), then one decode step; False if
        nothing was running."""
        row = StepRow(self.steps, self.node.name)
        resumed = [self._take(handoff, row) for handoff in arrivals]
        resumed = [entry for entry in resumed if entry is not None]
        if resumed:
            self._rebuild(row, resumed)
            row = StepRow(self.steps, self.node.name)
        if not self.running:
            if row.events or row.failures:
                self._log(row, "decode", positions={}, published=True)
            return False
        self._decode(row)
        return True

    # ------------------------------------------------------------------ admit and resume

    def _take(self, handoff: Handoff, row: StepRow) -> Optional[Tuple[str, bytes, List[int]]]:
        """Admit a shipped request; ``(rid, record, decoded ids)`` if this node published a
        later record for it before a restart (its KV must be rebuilt), else None."""
        rid, mgr = handoff.rid, self.node.mgr
        index = self.spec.rids.index(rid)
        max_new = self.spec.requests[index][1]
        latest = self.records.latest(rid)
        if latest is not None and len(latest[1]) == max_new:
            row.events.append(f"{rid} finished before the restart")
            return None
        mgr.ingest_request(rid)
        outcome = mgr.admit_retrieve(rid, "prefill", None, handoff.record)
        position = mgr.position(rid, "main")
        if not outcome.ok or position != len(handoff.ids):
            row.failures.append(f"admit {rid}: " + (outcome.reason or f"position {position} != "
                                                    f"{len(handoff.ids)} shipped prompt tokens"))
            mgr.remove_request(rid)   # refused: it does not run here
            return None
        self.node.streams[rid, "main"] = Stream(list(handoff.ids), handoff.k, handoff.v)
        self.running[rid] = _Running(index, max_new, [])
        row.events.append(f"admit {rid} @{position} ({len(handoff.record)} bytes)")
        return None if latest is None else (rid, *latest)

    def _rebuild(self, row: StepRow, resumed: List[Tuple[str, bytes, List[int]]]) -> None:
        """Re-prefill what the dead node had decoded (its KV died with it), then resume
        each request from its last published record."""
        mgr = self.node.mgr
        starts = {rid: mgr.position(rid, "main") for rid, _, _ in resumed}
        self.node.step(row, [(rid, "main", ids) for rid, _, ids in resumed])
        for rid, record, ids in resumed:
            self.running[rid].decoded = list(ids)
            try:
                claimed = PublishedPositionInfo.from_bytes(record).counters.get("main")
            except WireFormatError as e:
                claimed = f"unreadable ({e})"
            outcome = mgr.admit_retrieve(rid, "decode", None, record)
            position, cached = mgr.position(rid, "main"), len(self.node.streams[rid, "main"].ids)
            if not outcome.ok:
                row.failures.append(f"resume {rid}: {outcome.reason}")
            elif not position == claimed == cached:
                row.failures.append(f"resume {rid}: position {position}, its record {claimed}, "
                                    f"KV rebuilt to {cached}")
            row.events.append(f"resume {rid} @{position} ({len(ids)} decoded)")
        self._log(row, "recover", positions=starts, published=False)

    # ------------------------------------------------------------------ decode

    def _decode(self, row: StepRow) -> None:
        mgr = self.node.mgr
        positions = {rid: mgr.position(rid, "main") for rid in self.running}
        views = [(rid, "main", [self.spec.token(state.index, positions[rid])])
                 for rid, state in self.running.items()]
        self.node.step(row, views)
        for rid, _, ids in views:
            self.running[rid].decoded += ids
        if self.steps == self.hold_after:
            row.events.append("held before publishing")
            self._log(row, "decode", positions=positions, published=False)
            self.hold()
        for rid, state in list(self.running.items()):
            self.records.publish(rid, mgr.publish(rid).to_bytes(), state.decoded)
            if len(state.decoded) == state.max_new:
                self.node.drop(rid)
                del self.running[rid]
                row.events.append(f"done {rid}")
        self._log(row, "decode", positions=positions, published=True)
        self.steps += 1

    def _log(self, row: StepRow, kind: str, **extra) -> None:
        self.failed |= bool(row.failures)
        self.log(_row(row, kind, **extra))


# ---------------------------------------------------------------------- a run and its checks


@dataclasses.dataclass
class DisaggReport:
    """A run's log and verdict.

    Attributes:
      spec: the run.
      rows: ``{"prefill": [...], "decode0": [...], "decode1": [...]}``: each node's step
        dicts (``decode1``: the restarted decode node).
      records: each request's last published ``(record bytes, decoded ids)``.
      exit_codes: each process's exit status (``-9``: killed); empty in one process.
      lost: per gloo session whose decode peer died, the error the prefill process saw.
      failures: what :func:`verify` found wrong; empty on a pass.
      bytes_per_stream: bytes a stream takes in the largest final record (beyond its
        44-byte header and checksum).
    """

    spec: DisaggSpec
    rows: Dict[str, List[dict]]
    records: Dict[str, Tuple[bytes, List[int]]]
    exit_codes: Dict[str, Optional[int]] = dataclasses.field(default_factory=dict)
    lost: List[str] = dataclasses.field(default_factory=list)
    failures: List[str] = dataclasses.field(default_factory=list)
    bytes_per_stream: float = 0.0


def verify(report: DisaggReport) -> DisaggReport:
    """Fill ``report.failures`` (and ``bytes_per_stream``): every step's checks passed; each
    request decoded exactly the positions ``prompt .. prompt + max_new - 1``, each once
    in a published step across the decode nodes, with the scripted tokens; a kill landed
    mid-stream (a request was resumed); every record within 64 bytes a stream."""
    spec, failures = report.spec, report.failures
    for name, rows in report.rows.items():
        for row in rows:
            failures += [f"{name} step {row['step']}: {failure}" for failure in row["failures"]]
            if not row["error"] <= TOLERANCE:
                failures.append(f"{name} step {row['step']}: attention error {row['error']:.2e}")
    decodes = [name for name in ("decode0", "decode1") if name in report.rows]
    published = {rid: [] for rid in spec.rids}
    for name in decodes:
        for row in report.rows[name]:
            if row["kind"] == "decode" and row["published"]:
                for rid, position in row["positions"].items():
                    published[rid].append(position)
    sizes = []
    for index, rid in enumerate(spec.rids):
        prompt, max_new = spec.requests[index]
        if published[rid] != list(range(prompt, prompt + max_new)):
            failures.append(f"{rid} decoded positions {published[rid]}, want {prompt}.."
                            f"{prompt + max_new - 1} once each")
        record, ids = report.records.get(rid, (b"", []))
        want = [spec.token(index, p) for p in range(prompt, prompt + max_new)]
        if ids != want:
            failures.append(f"{rid} decoded tokens {ids}, want {want}")
        try:
            final = PublishedPositionInfo.from_bytes(record)
        except WireFormatError as e:
            failures.append(f"{rid} final record unreadable: {e}")
            continue
        if final.counters.get("main") != prompt + max_new:
            failures.append(f"{rid} final record {final.counters}, want main={prompt + max_new}")
        sizes.append((len(record) - _RECORD_OVERHEAD) / len(final.counters))
    report.bytes_per_stream = max(sizes, default=0.0)
    if report.bytes_per_stream > 64:
        failures.append(f"{report.bytes_per_stream} bytes a stream on the wire, over 64")
    if spec.kill_after is not None:
        resumed = [row for row in report.rows.get("decode1", []) if row["kind"] == "recover"]
        if not resumed:
            failures.append("the restarted decode node resumed no request: the kill did not land "
                            "mid-stream")
    return report


class _Killed(Exception):
    """The in-process stand-in for SIGKILL at the hold point."""


def _kill() -> None:
    raise _Killed


def run_in_process(spec: DisaggSpec = DisaggSpec(), *,
                   between: Callable[[RecordStore], None] = lambda records: None) -> DisaggReport:
    """The prefill node, a decode node that dies at ``spec.kill_after`` and its restart, in
    this process: handoffs passed as objects, records in a ``HashStore``; verified.

    ``between`` sees the record store after the death, before the restart (a test
    damages it there). The same nodes run as two processes in
    :func:`torch_bridge.demo.disagg_processes.run`.
    """
    records = RecordStore(dist.HashStore())
    rows: Dict[str, List[dict]] = {"prefill": []}
    handoffs = prefill(spec, new_node(spec, "prefill"), rows["prefill"].append)
    incarnations = 1 if spec.kill_after is None else 2
    for incarnation in range(incarnations):
        rows[f"decode{incarnation}"] = []
        decode = DecodeNode(spec, records, rows[f"decode{incarnation}"].append,
                            hold_after=spec.kill_after if incarnation == 0 else None, hold=_kill)
        queue = iter(handoffs)
        try:
            decode.serve(lambda: next(queue), len(handoffs))
        except _Killed:
            between(records)
    final = {rid: records.latest(rid) for rid in spec.rids}
    return verify(DisaggReport(spec, rows, {rid: r for rid, r in final.items() if r is not None}))
