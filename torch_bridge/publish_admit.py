"""A request's records out of a manager and into another: publish, snapshots, admit, rollback.

Two components of :class:`~torch_bridge.PositionManager`, each built from the parts it
needs (as :class:`~torch_bridge.plans.StepPlans` is):

- :class:`RecordArgs`: the ``{label: value}`` arguments of records (ingest overrides and
  deltas, cached prefixes, published records), checked once, before anything changes;
- :class:`PublishAdmit`: publish, snapshots, admit, and the rewinds that change what a
  publication says (:meth:`PublishAdmit.rollback`, :meth:`PublishAdmit.apply_cached_prefix`),
  over the manager's :class:`~torch_bridge.streams.StreamTable`, its
  :class:`~torch_bridge.step_arrays.StepReader` and its plans.

The order in which admitted records win is :func:`jaxrope.wire.rewind_order` (newer
rewinds, then the larger position; two writers' independent rewinds are refused); the
counter transition is :func:`torch_bridge.streams.admit`, the numpy twin of
:func:`jaxrope.positions.admit`; the record and its bytes are
:mod:`torch_bridge.published`'s.

**A planned stream is frozen** (:meth:`torch_bridge.plans.StepPlans.frozen`): a stream
that the current or the staged plan numbers (its views, its commit, its forks and their
sources) is moved neither back nor forward: :meth:`PublishAdmit.rollback` raises, an
admitted record that would take a newer epoch or a larger position is refused (check
``planned``), :meth:`PublishAdmit.apply_cached_prefix` raises when it would raise the
counter. The plan's positions were numbered from that counter, so its commit would
put the counter where no KV ends. A call that moves nothing is not refused.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Callable, Dict, Hashable, Optional, Tuple, Union

import numpy as np

from jaxrope import wire
from jaxrope.numbers import UINT32_MAX, as_int
from jaxrope.wire import MAX_EPOCH, MAX_WRITERS, Rewinds, WireFormatError
from torch_bridge.engine_types import AdmitOutcome
from torch_bridge.plans import StepPlans
from torch_bridge.published import PublishedPositionInfo, conflict_message, epoch_problem
from torch_bridge.step_arrays import StepReader, check_hashable, unknown_request
from torch_bridge.streams import StreamTable

__all__ = ["PublishAdmit", "RecordArgs", "RecordArgumentError", "RecordTypeError", "REFUSED",
           "check_unfrozen",
           "writer_id"]

# How every refusal of admit_retrieve starts: f"{REFUSED} (<check>): <why>".
REFUSED = "published record refused"
Snapshot = Tuple[Tuple[int, int, int, Rewinds], ...]
_MAX_WRITER = UINT32_MAX


class RecordArgumentError(ValueError):
    """A ``{label: value}`` argument refused; ``check`` names the check (``"type"``,
    ``"label"``, ``"position"``, ``"delta"``, ``"epoch"`` or ``"rewinds"``)."""

    def __init__(self, check: str, message: str):
        super().__init__(message)
        self.check = check


class RecordTypeError(RecordArgumentError, TypeError):
    """A ``{label: value}`` value of the wrong type (a bool, a float): a TypeError, and a
    :class:`RecordArgumentError` so that admit reports it as every other refusal."""


class RecordArgs:
    """Checks ``{label: value}`` arguments into ``{label index: value}``.

    Args:
      labels: the manager's stream labels.
      max_seq_len: positions are in ``[0, max_seq_len]`` (a counter may reach it).
      mrope: whether M-RoPE deltas are allowed.

    Every method raises :class:`RecordArgumentError` (a ValueError) naming the argument,
    the label and the range.

    Example:
      >>> args = RecordArgs(("text", "image"), max_seq_len=64, mrope=False)
      >>> args.positions({"image": 5}, "overrides")
      {1: 5}
      >>> args.epochs({"text": 2**31}, "published.epochs")
      Traceback (most recent call last):
      ...
      torch_bridge.publish_admit.RecordArgumentError: published.epochs['text']=2147483648 must be an int in [0, 2147483647] (epochs are int32)
    """

    def __init__(self, labels: Tuple[str, ...], max_seq_len: int, mrope: bool):
        self.labels = labels
        self.max_seq_len = max_seq_len
        self.mrope = mrope
        self._index = {label: i for i, label in enumerate(labels)}

    def positions(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: position}``, each in ``[0, max_seq_len]``."""
        return self._ints(values, name, "position", 0, self.max_seq_len, "(max_seq_len)")

    def deltas(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: M-RoPE delta}``, each in ``[-max_seq_len, max_seq_len]``; non-zero
        deltas only with M-RoPE."""
        if isinstance(values, Mapping) and any(values.values()) and not self.mrope:
            raise RecordArgumentError("delta", f"{name}={dict(values)!r}: M-RoPE deltas need an "
                                               "M-RoPE config (config.rope with mrope_section)")
        return self._ints(values, name, "delta", -self.max_seq_len, self.max_seq_len, "")

    def epochs(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: publish epoch}``, each in ``[0, 2**31 - 1]``."""
        return self._ints(values, name, "epoch", 0, MAX_EPOCH, "(epochs are int32)")

    def rewinds(self, values: Mapping[str, Rewinds], name: str) -> Dict[int, Rewinds]:
        """``{label index: ((writer, rollbacks), ...)}`` (:class:`jaxrope.wire.StreamRecord`'s
        rules)."""
        out = {}
        for index, label, rewinds in self._entries(values, name, "rewinds"):
            problem = wire.rewinds_problem(rewinds)
            if problem is not None:
                raise RecordArgumentError("rewinds", f"{name}[{label!r}]: {problem[1]}")
            out[index] = rewinds
        return out

    def _ints(self, values: Mapping[str, int], name: str, check: str, low: int, high: int,
              why: str) -> Dict[int, int]:
        out = {}
        for index, label, value in self._entries(values, name, check):
            try:
                out[index] = as_int(value, f"{name}[{label!r}]", low, high, f" {why}".rstrip())
            except TypeError as e:
                raise RecordTypeError(check, str(e)) from None
            except ValueError as e:
                raise RecordArgumentError(check, str(e)) from None
        return out

    def _entries(self, values: Mapping, name: str, what: str):
        if not isinstance(values, Mapping):
            raise RecordArgumentError("type", f"{name}={values!r} must be a mapping "
                                              f"{{label: {what}}}")
        for label, value in values.items():
            index = self._index.get(label) if isinstance(label, str) else None
            if index is None:
                raise RecordArgumentError("label", f"{name} names label={label!r}, not one of "
                                                   f"{list(self.labels)}")
            yield index, label, value


def writer_id(writer: Optional[int]) -> int:
    """A manager's writer id: ``writer`` checked, or a random one for None.

    Raises:
      ValueError: not an int in ``[1, 2**32 - 1]`` (u32 on the wire; 0 is the unnamed
        writer of records built by hand).
    """
    if writer is None:
        return 1 + secrets.randbelow(_MAX_WRITER)
    return as_int(writer, "writer", 1, _MAX_WRITER, " (u32 on the wire; 0 is the unnamed writer)")


def _refused(check: str, why: str) -> AdmitOutcome:
    return AdmitOutcome(False, False, f"{REFUSED} ({check}): {why}")


class PublishAdmit:
    """Publish / admit / rollback / cached prefix over one manager's streams.

    Args:
      streams: the manager's :class:`~torch_bridge.streams.StreamTable` (the records this
        reads and changes).
      reader: its :class:`~torch_bridge.step_arrays.StepReader` (stream lookups).
      plans: its :class:`~torch_bridge.plans.StepPlans` (a planned stream is not rewound).
      args: its :class:`RecordArgs`.
      fingerprint: returns the manager's ``fingerprint()`` (records carry it; a record
        of another one is refused).
      writer: the manager's writer id, counted in the rewinds of every rollback it makes.

    The public methods of :class:`~torch_bridge.PositionManager` of the same names
    delegate here; their docstrings are these.
    """

    def __init__(self, streams: StreamTable, reader: StepReader, plans: StepPlans,
                 args: RecordArgs, fingerprint: Callable[[], bytes], writer: int):
        self._streams, self._reader, self._plans, self._args = streams, reader, plans, args
        self._fingerprint = fingerprint
        self.writer = writer

    def publish(self, request_id: Hashable) -> Optional[PublishedPositionInfo]:
        """Where every stream of the request has reached; None for an unknown request.

        Per label: the next position, the M-RoPE delta, the publish epoch and its rewinds
        (see :mod:`torch_bridge.published`), with the manager's fingerprint.
        """
        snapshot = self.publish_snapshot_for_step(request_id, None, None)
        return self.publish_from_snapshot(request_id, snapshot, None, None)

    def publish_snapshot_for_step(self, request_id: Hashable, node_name: Optional[str],
                                  graph_walk: Optional[str]) -> Optional[Snapshot]:
        """A cheap record of what :meth:`publish` returns now: ``(position, delta, epoch,
        rewinds)`` per label, as a tuple.

        Returns None for an unknown request. Later counter changes do not alter it.

        Example:
          >>> from torch_bridge import PositionConfig, PositionManager
          >>> mgr = PositionManager(PositionConfig(), "cpu"); mgr.ingest_request("r0")
          >>> snap = mgr.publish_snapshot_for_step("r0", None, None)
          >>> mgr.apply_cached_prefix("r0", None, None, None, {"text": 9})
          >>> mgr.publish_from_snapshot("r0", snap, None, None).counters
          {'text': 0}
        """
        check_hashable(request_id, "request_id")
        slots = self._streams.slots_of(request_id)
        if slots is None:
            return None
        index = list(slots)
        rewinds = self._streams.rewinds
        return tuple((*values, rewinds.get(slot, ())) for slot, values in zip(
            index, zip(*(column[index].tolist() for column in self._streams.columns))))

    def publish_from_snapshot(self, request_id: Hashable, snapshot: Optional[Snapshot],
                              node_name: Optional[str],
                              graph_walk: Optional[str]) -> Optional[PublishedPositionInfo]:
        """The :class:`PublishedPositionInfo` that :meth:`publish` returned when ``snapshot`` was
        taken.

        Raises:
          TypeError: ``snapshot`` is not a record from :meth:`publish_snapshot_for_step`.
        """
        if snapshot is None:
            return None
        labels = self._args.labels
        if (not isinstance(snapshot, tuple) or len(snapshot) != len(labels)
                or not all(_snapshot_entry(r) for r in snapshot)):
            raise TypeError(f"snapshot={snapshot!r} must be a tuple of {len(labels)} "
                            "(position, delta, epoch, rewinds) entries from "
                            "publish_snapshot_for_step")
        return PublishedPositionInfo(
            {label: r[0] for label, r in zip(labels, snapshot)},
            {label: r[1] for label, r in zip(labels, snapshot) if r[1]},
            {label: r[2] for label, r in zip(labels, snapshot) if r[2]},
            self._fingerprint(),
            {label: r[3] for label, r in zip(labels, snapshot) if r[3]})

    def admit_retrieve(self, rid: Hashable, node_name: Optional[str], graph_walk: Optional[str],
                       published: Union[PublishedPositionInfo, bytes, None]) -> AdmitOutcome:
        """Take on published records, per label in the order of :func:`jaxrope.wire.rewind_order`.

        A record whose rewinds include every rollback this stream holds and more wins even
        with a lower position (the publisher rolled back); with the same rewinds
        ``counter = max(counter, published)``, so a stale echo of this node's own
        publication never rewinds a stream (admit is monotonic: a publisher that
        never rolls back stays in epoch 0); an older record changes nothing. The M-RoPE
        delta comes with the position that wins. ``node_name`` and ``graph_walk`` do not
        change positions (a stream is ``(rid, label)``). ``published`` may be the
        record's bytes (:meth:`PublishedPositionInfo.to_bytes`, as another process sent
        them).

        Returns:
          ``AdmitOutcome(True, True)`` when taken on (or nothing was published); else
          ``ok=False`` and no change, with a reason ``"published record refused
          (<check>): ..."``. The checks: ``request`` (not ingested, or removed),
          ``fingerprint`` (another RoPE config or scheme), ``type`` / ``label`` /
          ``position`` / ``delta`` / ``epoch`` / ``rewinds`` (a value outside its range,
          named with it: positions ``[0, max_seq_len]``, deltas ``[-max_seq_len,
          max_seq_len]`` and M-RoPE only, epochs ``[0, 2**31 - 1]`` and the sum of their
          rewinds), ``conflict`` (two writers rolled the stream back independently:
          docs/handoff.md, "Who may roll a stream back"), ``planned`` (a newer epoch or a larger
          position for a stream that a plan numbers or forks:
          :meth:`~torch_bridge.plans.StepPlans.frozen`), and for bytes every check of
          :mod:`jaxrope.wire` (``truncated``, ``checksum``, ``version``, ...).

        Raises:
          TypeError: ``published`` is not a PublishedPositionInfo, bytes or None.
        """
        if published is None:
            return AdmitOutcome(True, True)
        check_hashable(rid, "rid")
        if isinstance(published, (bytes, bytearray, memoryview)):
            try:
                published = PublishedPositionInfo.from_bytes(
                    published, expect_fingerprint=self._fingerprint())
            except WireFormatError as e:
                return _refused(e.reason, str(e))
        if not isinstance(published, PublishedPositionInfo):
            raise TypeError(f"published must be a PublishedPositionInfo, bytes or None, got "
                            f"{type(published).__name__}")
        if rid not in self._streams:
            return _refused("request", unknown_request(self._streams, rid))
        mine = self._fingerprint()
        if published.fingerprint is not None and published.fingerprint != mine:
            return _refused("fingerprint", "published.fingerprint differs from this manager's: "
                            f"{published.fingerprint.hex()[:16]}... vs {mine.hex()[:16]}... (the "
                            "publisher rotates another way: RoPE config or scheme)")
        args = self._args
        try:
            targets = args.positions(published.counters, "published.counters")
            deltas = args.deltas(published.deltas, "published.deltas")
            epochs = args.epochs(published.epochs, "published.epochs")
            args.rewinds(published.rewinds, "published.rewinds")
        except RecordArgumentError as e:
            return _refused(e.check, str(e))
        slots, positions = self._streams.label_arrays(rid, targets)
        records = []
        for index, slot, target in zip(targets, slots.tolist(), positions.tolist()):
            label = args.labels[index]
            rewinds = published.rewinds_of(label)
            problem = epoch_problem(epochs.get(index, 0), rewinds)
            if problem is not None:
                return _refused("epoch", f"published stream {label!r}: {problem}")
            stream = f"({rid!r}, {label!r})"
            order = wire.rewind_order(self._streams.rewinds.get(slot, ()), rewinds)
            if order == "conflict":
                return _refused("conflict", conflict_message(
                    stream, self._streams.rewinds.get(slot, ()), rewinds))
            counter = int(self._streams.counters[slot])
            if order == "newer" or (order == "same" and target > counter):
                blocked = self._plans.frozen(slot, stream)
                if blocked is not None:
                    move = ("starts a newer epoch" if order == "newer" else
                            f"would move it from {counter} to {target}")
                    return _refused("planned", f"the record {move}, but {blocked}")
            records.append(rewinds)
        self._streams.take(slots, positions,
                           np.asarray([deltas.get(i, 0) for i in targets], np.int64),
                           np.asarray([epochs.get(i, 0) for i in targets], np.int64), records)
        return AdmitOutcome(True, True)

    def rollback(self, rid: Hashable, label: str, to_position: int) -> None:
        """Rewind stream ``(rid, label)`` to ``to_position`` (rejected drafts, an engine's own
        rewind): ``counter = min(counter, to_position)``.

        A counter that moves back starts a new publish epoch, one more rollback by this
        manager's ``writer`` in the stream's rewinds, so the rewind reaches a node that
        admitted this stream's earlier publication (its monotonic admit would keep the
        old, larger position otherwise). Rolling back to where the stream is, or past it,
        changes nothing. Only the stream's owner rolls it back (docs/handoff.md, "Who may roll a
        stream back"); a rewind by another node is refused wherever the two meet.

        Raises:
          ValueError: unknown request or label, ``to_position`` not an int in
            ``[0, max_seq_len]``, the stream numbered or forked by the current or staged
            plan (:meth:`~torch_bridge.plans.StepPlans.frozen`: commit it or clear the
            preplan first; refused even where nothing would move), a stream at
            the last epoch (epochs are in ``[0, 2**31 - 1]``), or one already rolled back
            by 16 other writers (the most a record carries).
          TypeError: ``rid`` or ``label`` is not hashable.
        """
        slot = self._reader.slot(rid, label)
        (target,) = self._args.positions({label: to_position}, "to_position").values()
        stream = f"({rid!r}, {label!r})"
        blocked = self._plans.frozen(slot, stream)
        if blocked is not None:
            raise ValueError(f"rollback refused: {blocked}")
        if target < self._streams.counters[slot]:
            epoch = int(self._streams.columns.epochs[slot])
            if epoch >= MAX_EPOCH:
                raise ValueError(f"rollback of stream {stream} refused: it is at publish epoch "
                                 f"{epoch}, the last (epochs are int32, in [0, {MAX_EPOCH}])")
            writers = dict(self._streams.rewinds.get(slot, ()))
            if self.writer not in writers and len(writers) >= MAX_WRITERS:
                raise ValueError(f"rollback of stream {stream} refused: {len(writers)} writers "
                                 f"have rolled it back, a record carries at most {MAX_WRITERS}")
        self._streams.rewind(slot, target, self.writer)

    def apply_cached_prefix(self, rid: Hashable, node_name: Optional[str],
                            graph_walk: Optional[str], inputs, prefix: Optional[Mapping[str, int]]
                            ) -> None:
        """Move streams past what the prefix cache holds: ``counter = max(counter, cached)``.

        Args:
          prefix: ``{label: cached tokens}`` of this walk (None: nothing cached). The
            value is absolute, so repeating the probe moves nothing.
          inputs, node_name, graph_walk: the walk's context; positions do not use them.

        Raises:
          ValueError: unknown request or label, a length outside ``[0, max_seq_len]``, or
            one that would move a stream the current or staged plan numbers or forks
            (:meth:`~torch_bridge.plans.StepPlans.frozen`).
        """
        self._reader.request_slots(rid)
        targets = self._args.positions(prefix or {}, "prefix")
        check_unfrozen(self._streams, self._plans, rid, targets, "prefix")
        self._streams.raise_to(rid, targets)


def check_unfrozen(streams: StreamTable, plans: StepPlans, rid: Hashable,
                   targets: Dict[int, int], name: str) -> None:
    """Refuse ``counter = max(counter, target)`` (``targets``: ``{label index: position}``
    of ingested ``rid``, the argument ``name``) where it would move a frozen stream.

    Raises:
      ValueError: naming the argument, the move, the stream and the plan.
    """
    if not targets:
        return
    slots, values = streams.label_arrays(rid, targets)
    for index, slot, value in zip(targets, slots.tolist(), values.tolist()):
        counter = int(streams.counters[slot])
        if value > counter:
            label = streams.labels[index]
            blocked = plans.frozen(slot, f"({rid!r}, {label!r})")
            if blocked is not None:
                raise ValueError(f"{name}[{label!r}]={value} would move the counter from "
                                 f"{counter} to {value}, but {blocked}")


def _snapshot_entry(entry) -> bool:
    return (isinstance(entry, tuple) and len(entry) == 4
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[:3])
            and entry[0] >= 0 and entry[2] >= 0 and wire.rewinds_problem(entry[3]) is None)
