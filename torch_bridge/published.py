"""``PublishedPositionInfo``: where each of a request's streams has reached, for another node.

A node that hands a request over (disaggregated prefill -> decode, a CFG branch on its own
GPU) publishes, per stream label, its next position, its M-RoPE delta (0 for 1-D RoPE)
and its publish epoch; the receiving node admits them (``admit_retrieve``).

The order of records (admit and :meth:`PublishedPositionInfo.update` alike) is
:func:`jaxrope.wire.rewind_order` over each stream's *rewinds*, ``((writer, rollbacks),
...)``: a record that includes every rollback the receiver holds and more wins even with
a lower position; with the same rewinds the larger position wins; a record missing some
is stale and loses; and two records each holding a rollback the other lacks (two writers
rolled the stream back without seeing each other's) are a conflict, refused with a
reason, never merged. Why: within an epoch admit is a max-merge, so a stale echo of a node's
own publication never rewinds it; but once a node has published positions that include
draft tokens, a rollback of those drafts could then never reach the node that admitted
them, and a max over two writers' rewinds keeps one node's drafts on top of the other's
KV. A user who never rolls back stays in epoch 0, where the order is exactly a max over
positions. The publish epoch of a stream is the number of its rewinds (the sum).

Between processes the record travels as bytes (:meth:`PublishedPositionInfo.to_bytes`,
:meth:`PublishedPositionInfo.from_bytes`) in the layout of :mod:`jaxrope.wire`: per
stream its label, position, delta and rewinds (``10 + len(label) + 8 * writers``
bytes), under the publisher's fingerprint and a CRC-32.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple, Union

from jaxrope import wire
from jaxrope.wire import Rewinds
from torch_bridge.engine_types import PublishedInfo

__all__ = ["PublishedPositionInfo"]


@dataclasses.dataclass
class PublishedPositionInfo(PublishedInfo):
    """Where each of a request's streams has reached.

    Attributes:
      counters: ``{label: next position}``.
      deltas: ``{label: M-RoPE delta}``; a label left out has delta 0.
      epochs: ``{label: publish epoch}`` (the number of the stream's rollbacks); a label
        left out is in epoch 0.
      fingerprint: the publishing manager's ``fingerprint()`` (how it rotates), or None;
        ``admit_retrieve`` refuses a record whose fingerprint differs from its own.
      rewinds: ``{label: ((writer, rollbacks), ...)}``, writers ascending: whose
        rollbacks the epoch counts (a manager's ``writer`` id). A label with an epoch
        and no rewinds was rolled back by an unnamed writer, 0 (a record built by hand).

    Example:
      >>> a = PublishedPositionInfo({"text": 7})
      >>> a.update(PublishedPositionInfo({"text": 5, "image": 2}))
      >>> a.counters
      {'text': 7, 'image': 2}
      >>> a.update(PublishedPositionInfo({"text": 6}, epochs={"text": 1},
      ...                                rewinds={"text": ((4, 1),)}))  # a rollback won
      >>> a.counters["text"], a.epochs["text"]
      (6, 1)
      >>> a.update(PublishedPositionInfo({"text": 9}, epochs={"text": 1},
      ...                                rewinds={"text": ((5, 1),)}))
      Traceback (most recent call last):
      ...
      ValueError: stream 'text': rewinds ((5, 1),) conflict with ((4, 1),): two writers rolled it back without seeing each other's rollback (only the stream's owner may roll it back)

    On the wire (a record from a manager carries its fingerprint):

      >>> info = PublishedPositionInfo({"text": 1027, "image": 64}, fingerprint=bytes(32))
      >>> data = info.to_bytes()
      >>> len(data)  # 44 + (10 + len("text")) + (10 + len("image"))
      73
      >>> PublishedPositionInfo.from_bytes(data) == info
      True
    """

    counters: Dict[str, int] = dataclasses.field(default_factory=dict)
    deltas: Dict[str, int] = dataclasses.field(default_factory=dict)
    epochs: Dict[str, int] = dataclasses.field(default_factory=dict)
    fingerprint: Optional[bytes] = None
    rewinds: Dict[str, Rewinds] = dataclasses.field(default_factory=dict)

    def clone(self) -> "PublishedPositionInfo":
        """An independent copy (for deferred sending)."""
        return PublishedPositionInfo(dict(self.counters), dict(self.deltas), dict(self.epochs),
                                     self.fingerprint, dict(self.rewinds))

    def rewinds_of(self, label: str) -> Rewinds:
        """The rewinds of one label: its entry of :attr:`rewinds`, else its epoch's rollbacks
        by the unnamed writer 0 (``()`` in epoch 0)."""
        if label in self.rewinds:
            return self.rewinds[label]
        epoch = self.epochs.get(label, 0)
        return ((0, epoch),) if epoch else ()

    def record(self, label: str) -> Tuple[int, int, int]:
        """``(position, delta, epoch)`` of one label (its rewinds: :meth:`rewinds_of`)."""
        return self.counters[label], self.deltas.get(label, 0), self.epochs.get(label, 0)

    def update(self, other: "PublishedPositionInfo") -> None:
        """Merge ``other`` in, per label in the order of :func:`jaxrope.wire.rewind_order`
        (see the module docstring): newer rewinds win, with the same rewinds the larger
        position (positions never go back).

        Raises:
          TypeError: ``other`` is not a PublishedPositionInfo.
          ValueError: a label whose rewinds conflict (two writers rolled it back
            independently); nothing is merged then.
        """
        if not isinstance(other, PublishedPositionInfo):
            raise TypeError(f"other must be a PublishedPositionInfo, got {type(other).__name__}")
        taken = []
        for label in other.counters:
            position, delta, epoch = other.record(label)
            rewinds = other.rewinds_of(label)
            if label in self.counters:
                mine, my_rewinds = self.counters[label], self.rewinds_of(label)
                order = wire.rewind_order(my_rewinds, rewinds)
                if order == "conflict":
                    raise ValueError(conflict_message(repr(label), my_rewinds, rewinds))
                if order == "older" or (order == "same" and position <= mine):
                    continue
            taken.append((label, position, delta, epoch, rewinds))
        for label, position, delta, epoch, rewinds in taken:
            self.counters[label] = position
            if delta or label in self.deltas:
                self.deltas[label] = delta
            if epoch or label in self.epochs:
                self.epochs[label] = epoch
            if rewinds or label in self.rewinds:
                self.rewinds[label] = rewinds
        if other.fingerprint is not None:
            self.fingerprint = other.fingerprint

    def to_bytes(self) -> bytes:
        """The record as bytes, in the layout of :mod:`jaxrope.wire` (version 2).

        Streams follow the order of :attr:`counters`, each with its delta and rewinds;
        the record carries :attr:`fingerprint`. ``44 + sum(10 + len(label in UTF-8) + 8 *
        writers)`` bytes.

        Raises:
          ValueError: :attr:`fingerprint` is None (a manager's :meth:`publish` sets it;
            the receiver could not tell how the positions were rotated), a delta, epoch or
            rewinds entry names a label without a counter, or an epoch differs from the
            sum of its rewinds.
          jaxrope.wire.WireFormatError: a stream the format cannot carry (a ValueError):
            a label longer than 48 bytes in UTF-8 or not a str, a value out of range.
        """
        if self.fingerprint is None:
            raise ValueError("fingerprint=None: a record on the wire needs the publishing "
                             "manager's fingerprint() (publish() sets it)")
        orphans = [label for label in {**self.deltas, **self.epochs, **self.rewinds}
                   if label not in self.counters]
        if orphans:
            raise ValueError(f"deltas/epochs/rewinds name labels {orphans!r} that have no counter")
        streams = []
        for label in self.counters:
            position, delta, epoch = self.record(label)
            rewinds = self.rewinds_of(label)
            problem = epoch_problem(epoch, rewinds)
            if problem is not None:
                raise ValueError(f"stream {label!r}: {problem}")
            streams.append(wire.StreamRecord(label, position, delta, rewinds))
        try:
            return wire.encode(self.fingerprint, streams)
        except wire.WireFormatError as e:
            raise wire.WireFormatError(e.reason, f"this publication cannot go on the wire: "
                                                 f"{e}") from None

    @classmethod
    def from_bytes(cls, data: Union[bytes, bytearray, memoryview], *,
                   expect_fingerprint: Optional[bytes] = None) -> "PublishedPositionInfo":
        """The publication a :meth:`to_bytes` record holds, or a refusal.

        Args:
          data: the record.
          expect_fingerprint: if given, the fingerprint the record must carry (the
            receiving manager's ``fingerprint()``).

        Returns:
          a PublishedPositionInfo whose ``deltas``, ``epochs`` and ``rewinds`` hold the
          non-zero entries only (as :meth:`~torch_bridge.PositionManager.publish` writes
          them).

        Raises:
          jaxrope.wire.WireFormatError: truncated, corrupted, malformed or foreign
            bytes; its ``reason`` names the check (``"fingerprint"`` for a record of
            another RoPE config or scheme).
        """
        fingerprint, streams = wire.decode(data, expect_fingerprint=expect_fingerprint)
        return cls({s.label: s.position for s in streams},
                   {s.label: s.delta for s in streams if s.delta},
                   {s.label: s.epoch for s in streams if s.epoch}, fingerprint,
                   {s.label: s.rewinds for s in streams if s.rewinds})


def epoch_problem(epoch: int, rewinds: Rewinds) -> Optional[str]:
    """Why ``epoch`` is not the publish epoch that ``rewinds`` count, or None."""
    total = sum(count for _, count in rewinds)
    if epoch != total:
        return f"epoch {epoch!r} is not the {total} rollbacks its rewinds {rewinds!r} count"
    return None


def conflict_message(stream: str, mine: Rewinds, theirs: Rewinds) -> str:
    """The reason two streams' rewinds cannot be merged (:func:`jaxrope.wire.rewind_order`)."""
    return (f"stream {stream}: rewinds {theirs!r} conflict with {mine!r}: two writers rolled "
            "it back without seeing each other's rollback (only the stream's owner may roll "
            "it back)")
