"""A request's records out of a manager and into another: publish, snapshots, admit.

The publish / admit half of :class:`~torch_bridge.PositionManager` (a mixin it inherits),
with the rewinds that change what a publication says: :meth:`PublishAdmit.rollback` (a
new publish epoch) and :meth:`PublishAdmit.apply_cached_prefix`. The order in which
admitted records win (epoch, then position) is :func:`torch_bridge.streams.admit`'s, the
numpy twin of :func:`jaxrope.positions.admit`; the record and its bytes are
:mod:`torch_bridge.published`'s. Every ``{label: value}`` argument of a record is checked
here, once, before anything changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Hashable, Optional, Tuple, Union

import numpy as np

from jaxrope.wire import WireFormatError
from torch_bridge import streams as rules
from torch_bridge.engine_types import AdmitOutcome
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.step_arrays import check_hashable

__all__ = ["PublishAdmit"]

# Epochs are int32 on the device, as positions.
_MAX_EPOCH = int(np.iinfo(np.int32).max)


class PublishAdmit:
    """Publish / admit / rollback of a :class:`~torch_bridge.PositionManager`.

    Uses the manager's ``_streams`` (StreamTable), ``_reader`` (StepReader), ``_plans``
    (StepPlans), ``_labels``, ``_label_index``, ``_mrope``, ``max_seq_len`` and
    ``fingerprint()``.
    """

    def publish(self, request_id: Hashable) -> Optional[PublishedPositionInfo]:
        """Where every stream of the request has reached; None for an unknown request.

        Per label: the next position, the M-RoPE delta and the publish epoch (see
        :mod:`torch_bridge.published`), with this manager's :meth:`fingerprint`.
        """
        snapshot = self.publish_snapshot_for_step(request_id, None, None)
        return self.publish_from_snapshot(request_id, snapshot, None, None)

    def publish_snapshot_for_step(self, request_id: Hashable, node_name: Optional[str],
                                  graph_walk: Optional[str]) -> Optional[Tuple[Tuple[int, int, int], ...]]:
        """A cheap record of what :meth:`publish` returns now: ``(position, delta, epoch)`` per
        label, as a tuple.

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
        columns = self._streams.columns
        index = list(slots)
        return tuple(zip(*(column[index].tolist() for column in columns)))

    def publish_from_snapshot(self, request_id: Hashable,
                              snapshot: Optional[Tuple[Tuple[int, int, int], ...]],
                              node_name: Optional[str],
                              graph_walk: Optional[str]) -> Optional[PublishedPositionInfo]:
        """The :class:`PublishedPositionInfo` that :meth:`publish` returned when ``snapshot`` was taken.

        Raises:
          TypeError: ``snapshot`` is not a record from :meth:`publish_snapshot_for_step`.
        """
        if snapshot is None:
            return None
        if (not isinstance(snapshot, tuple) or len(snapshot) != len(self._labels)
                or not all(isinstance(r, tuple) and len(r) == 3 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in r)
                    and r[0] >= 0 and r[2] >= 0 for r in snapshot)):
            raise TypeError(f"snapshot={snapshot!r} must be a tuple of {len(self._labels)} "
                            "(position, delta, epoch) int triples from publish_snapshot_for_step")
        labels = self._labels
        return PublishedPositionInfo(
            {label: r[0] for label, r in zip(labels, snapshot)},
            {label: r[1] for label, r in zip(labels, snapshot) if r[1]},
            {label: r[2] for label, r in zip(labels, snapshot) if r[2]},
            self.fingerprint())

    def admit_retrieve(self, rid: Hashable, node_name: Optional[str], graph_walk: Optional[str],
                       published: Union[PublishedPositionInfo, bytes, None]) -> AdmitOutcome:
        """Take on published records, per label in epoch order.

        A newer publish epoch wins even with a lower position (the publisher rolled
        back); within an epoch ``counter = max(counter, published)``, so a stale echo of
        this node's own publication never rewinds a stream (the seed's monotonic admit:
        a publisher that never rolls back stays in epoch 0). The M-RoPE delta comes with
        the position that wins. ``node_name`` and ``graph_walk`` do not change positions
        (a stream is ``(rid, label)``). ``published`` may be the record's bytes
        (:meth:`PublishedPositionInfo.to_bytes`, as another process sent them).

        Returns:
          ``AdmitOutcome(True, True)`` when taken on (or nothing was published);
          ``ok=False`` with a reason, and no change, for an unknown request or label, a
          position outside ``[0, max_seq_len]``, a bad delta or epoch, a record whose
          fingerprint is not this manager's (it rotates another way), or bytes that are
          not an intact record (truncated, corrupted: :mod:`jaxrope.wire` says why).

        Raises:
          TypeError: ``published`` is not a PublishedPositionInfo, bytes or None.
        """
        if published is None:
            return AdmitOutcome(True, True)
        check_hashable(rid, "rid")
        if isinstance(published, (bytes, bytearray, memoryview)):
            try:
                published = PublishedPositionInfo.from_bytes(
                    published, expect_fingerprint=self.fingerprint())
            except WireFormatError as e:
                return AdmitOutcome(False, False, f"published record refused ({e.reason}): {e}")
        if not isinstance(published, PublishedPositionInfo):
            raise TypeError(f"published must be a PublishedPositionInfo, bytes or None, got "
                            f"{type(published).__name__}")
        if rid not in self._streams:
            return AdmitOutcome(False, False, f"request_id={rid!r} was never ingested")
        if published.fingerprint is not None and published.fingerprint != self.fingerprint():
            return AdmitOutcome(False, False, "published.fingerprint differs from this manager's: "
                                f"{published.fingerprint.hex()[:16]}... vs "
                                f"{self.fingerprint().hex()[:16]}... (the publisher rotates another "
                                "way: RoPE config or scheme)")
        try:
            targets = self._positions_arg(published.counters, "published.counters")
            deltas = self._deltas_arg(published.deltas, "published.deltas")
            epochs = self._epochs_arg(published.epochs)
        except (TypeError, ValueError) as e:
            return AdmitOutcome(False, False, str(e))
        slots, positions = self._label_arrays(rid, targets)
        labels = list(targets)
        rules.admit(self._streams.columns, slots, positions,
                    np.asarray([deltas.get(i, 0) for i in labels], np.int64),
                    np.asarray([epochs.get(i, 0) for i in labels], np.int64))
        return AdmitOutcome(True, True)

    def rollback(self, rid: Hashable, label: str, to_position: int) -> None:
        """Rewind stream ``(rid, label)`` to ``to_position`` (rejected drafts, an engine's own
        rewind): ``counter = min(counter, to_position)``.

        A counter that moves back starts a new publish epoch, so the rewind reaches a node
        that admitted this stream's earlier publication (its monotonic admit would keep
        the old, larger position otherwise). Rolling back to where the stream is, or past
        it, changes nothing.

        Raises:
          ValueError: unknown request or label, ``to_position`` not an int in
            ``[0, max_seq_len]``, or the stream in a plan not yet committed (commit or
            clear it first: its positions were numbered from the old counter).
          TypeError: ``rid`` or ``label`` is not hashable.
        """
        slot = self._reader.slot(rid, label)
        target = self._positions_arg({label: to_position}, "to_position")
        for plan in (self._plans.current, self._plans.staged):
            if plan is not None and slot in plan.commit.touched:
                raise ValueError(f"stream ({rid!r}, {label!r}) is in a plan not yet committed: "
                                 "commit it (or clear_preplan) before a rollback")
        rules.rollback(self._streams.columns, np.asarray([slot]), np.asarray(list(target.values())))

    def apply_cached_prefix(self, rid: Hashable, node_name: Optional[str],
                            graph_walk: Optional[str], inputs: Any,
                            prefix: Optional[Mapping[str, int]]) -> None:
        """Move streams past what the prefix cache holds: ``counter = max(counter, cached)``.

        Args:
          prefix: ``{label: cached tokens}`` of this walk (None: nothing cached). The
            value is absolute, so repeating the probe moves nothing.
          inputs, node_name, graph_walk: the walk's context; positions do not use them.

        Raises:
          ValueError: unknown request or label, or a length outside ``[0, max_seq_len]``.
        """
        self._reader.request_slots(rid)
        self._raise_to(rid, self._positions_arg(prefix or {}, "prefix"))

    # ---------------------------------------------------------------- record arguments

    def _positions_arg(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: position}`` of a ``{label: position}`` argument, checked."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{name}={values!r} must be a mapping {{label: position}}")
        out = {}
        for label, position in values.items():
            index = self._label_index.get(label) if isinstance(label, str) else None
            if index is None:
                raise ValueError(f"{name} names label={label!r}, not one of {list(self._labels)}")
            if (not isinstance(position, (int, np.integer)) or isinstance(position, bool)
                    or not 0 <= position <= self.max_seq_len):
                raise ValueError(f"{name}[{label!r}]={position!r} must be an int in "
                                 f"[0, {self.max_seq_len}] (max_seq_len)")
            out[index] = int(position)
        return out

    def _deltas_arg(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: delta}`` of a ``{label: M-RoPE delta}`` argument, checked."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{name}={values!r} must be a mapping {{label: delta}}")
        if any(values.values()) and not self._mrope:
            raise ValueError(f"{name}={dict(values)!r}: M-RoPE deltas need an M-RoPE config "
                             "(config.rope with mrope_section)")
        out = {}
        for label, delta in values.items():
            index = self._label_index.get(label) if isinstance(label, str) else None
            if index is None:
                raise ValueError(f"{name} names label={label!r}, not one of {list(self._labels)}")
            if (not isinstance(delta, (int, np.integer)) or isinstance(delta, bool)
                    or not -self.max_seq_len <= delta <= self.max_seq_len):
                raise ValueError(f"{name}[{label!r}]={delta!r} must be an int in "
                                 f"[-{self.max_seq_len}, {self.max_seq_len}]")
            out[index] = int(delta)
        return out

    def _epochs_arg(self, values: Mapping[str, int]) -> Dict[int, int]:
        if not isinstance(values, Mapping):
            raise ValueError(f"published.epochs={values!r} must be a mapping {{label: epoch}}")
        out = {}
        for label, epoch in values.items():
            index = self._label_index.get(label) if isinstance(label, str) else None
            if index is None:
                raise ValueError(f"published.epochs names label={label!r}, not one of "
                                 f"{list(self._labels)}")
            if (not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool)
                    or not 0 <= epoch <= _MAX_EPOCH):
                raise ValueError(f"published.epochs[{label!r}]={epoch!r} must be an int >= 0")
            out[index] = int(epoch)
        return out

    def _label_arrays(self, rid: Hashable, targets: Dict[int, int]) -> Tuple[np.ndarray, np.ndarray]:
        """``(slots, values)`` of a request's ``{label index: value}``."""
        request = self._streams.slots_of(rid)
        return (np.asarray([request[i] for i in targets], np.int64),
                np.asarray(list(targets.values()), np.int64))

    def _raise_to(self, rid: Hashable, targets: Dict[int, int]) -> None:
        if targets:
            rules.raise_to(self._streams.columns, *self._label_arrays(rid, targets))
