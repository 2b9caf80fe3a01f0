"""``PublishedPositionInfo``: where each of a request's streams has reached, for another node.

A node that hands a request over (disaggregated prefill -> decode, a CFG branch on its own
GPU) publishes, per stream label, its next position, its M-RoPE delta (0 for 1-D RoPE)
and its publish epoch; the receiving node admits them (``admit_retrieve``).

The order of records (admit and :meth:`PublishedPositionInfo.update` alike): a newer epoch
wins even with a lower position, within an epoch the larger position wins, an older epoch
loses. Why: the seed's admit is a max-merge, so a stale echo of a node's own publication
never rewinds it; but once a node has published positions that include draft tokens, a
rollback of those drafts could then never reach the node that admitted them. A rollback
that moves a counter back starts a new epoch; a user who never rolls back stays in epoch
0, where the order is exactly the seed's max.

Between processes the record travels as bytes (:meth:`PublishedPositionInfo.to_bytes`,
:meth:`PublishedPositionInfo.from_bytes`) in the layout of :mod:`jaxrope.wire`: per
stream its label, position, delta and epoch (``13 + len(label)`` bytes, at most 61),
under the publisher's fingerprint and a CRC-32.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Union

from jaxrope import wire
from torch_bridge.engine_types import PublishedInfo

__all__ = ["PublishedPositionInfo"]


@dataclasses.dataclass
class PublishedPositionInfo(PublishedInfo):
    """Where each of a request's streams has reached.

    Attributes:
      counters: ``{label: next position}`` (the seed's field).
      deltas: ``{label: M-RoPE delta}``; a label left out has delta 0.
      epochs: ``{label: publish epoch}``; a label left out is in epoch 0.
      fingerprint: the publishing manager's ``fingerprint()`` (how it rotates), or None;
        ``admit_retrieve`` refuses a record whose fingerprint differs from its own.

    Example:
      >>> a = PublishedPositionInfo({"text": 7})
      >>> a.update(PublishedPositionInfo({"text": 5, "image": 2}))
      >>> a.counters
      {'text': 7, 'image': 2}
      >>> a.update(PublishedPositionInfo({"text": 6}, epochs={"text": 1}))  # a rollback won
      >>> a.counters["text"], a.epochs["text"]
      (6, 1)

    On the wire (a record from a manager carries its fingerprint):

      >>> info = PublishedPositionInfo({"text": 1027, "image": 64}, fingerprint=bytes(32))
      >>> data = info.to_bytes()
      >>> len(data)  # 44 + (13 + len("text")) + (13 + len("image"))
      79
      >>> PublishedPositionInfo.from_bytes(data) == info
      True
    """

    counters: Dict[str, int] = dataclasses.field(default_factory=dict)
    deltas: Dict[str, int] = dataclasses.field(default_factory=dict)
    epochs: Dict[str, int] = dataclasses.field(default_factory=dict)
    fingerprint: Optional[bytes] = None

    def clone(self) -> "PublishedPositionInfo":
        """An independent copy (for deferred sending)."""
        return PublishedPositionInfo(dict(self.counters), dict(self.deltas), dict(self.epochs),
                                     self.fingerprint)

    def record(self, label: str):
        """``(position, delta, epoch)`` of one label."""
        return self.counters[label], self.deltas.get(label, 0), self.epochs.get(label, 0)

    def update(self, other: "PublishedPositionInfo") -> None:
        """Merge ``other`` in, per label in epoch order (see the module docstring): a newer
        epoch wins, within one epoch the larger position (positions never go back).

        Raises:
          TypeError: ``other`` is not a PublishedPositionInfo.
        """
        if not isinstance(other, PublishedPositionInfo):
            raise TypeError(f"other must be a PublishedPositionInfo, got {type(other).__name__}")
        for label in other.counters:
            position, delta, epoch = other.record(label)
            if label in self.counters:
                mine, _, my_epoch = self.record(label)
                if epoch < my_epoch or (epoch == my_epoch and position <= mine):
                    continue
            self.counters[label] = position
            if delta or label in self.deltas:
                self.deltas[label] = delta
            if epoch or label in self.epochs:
                self.epochs[label] = epoch
        if other.fingerprint is not None:
            self.fingerprint = other.fingerprint

    def to_bytes(self) -> bytes:
        """The record as bytes, in the layout of :mod:`jaxrope.wire` (version 1).

        Streams follow the order of :attr:`counters`, each with its delta and epoch;
        the record carries :attr:`fingerprint`. ``44 + sum(13 + len(label in UTF-8))``
        bytes: at most 61 per stream.

        Raises:
          ValueError: :attr:`fingerprint` is None (a manager's :meth:`publish` sets it;
            the receiver could not tell how the positions were rotated), or a delta or
            epoch names a label without a counter.
          jaxrope.wire.WireFormatError: a stream the format cannot carry (a ValueError):
            a label longer than 48 bytes in UTF-8 or not a str, a value out of range.
        """
        if self.fingerprint is None:
            raise ValueError("fingerprint=None: a record on the wire needs the publishing "
                             "manager's fingerprint() (publish() sets it)")
        orphans = [label for label in {**self.deltas, **self.epochs} if label not in self.counters]
        if orphans:
            raise ValueError(f"deltas/epochs name labels {orphans!r} that have no counter")
        streams = [wire.StreamRecord(label, *self.record(label)) for label in self.counters]
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
          a PublishedPositionInfo whose ``deltas`` and ``epochs`` hold the non-zero
          entries only (as :meth:`~torch_bridge.PositionManager.publish` writes them).

        Raises:
          jaxrope.wire.WireFormatError: truncated, corrupted, malformed or foreign
            bytes; its ``reason`` names the check (``"fingerprint"`` for a record of
            another RoPE config or scheme).
        """
        fingerprint, streams = wire.decode(data, expect_fingerprint=expect_fingerprint)
        return cls({s.label: s.position for s in streams},
                   {s.label: s.delta for s in streams if s.delta},
                   {s.label: s.epoch for s in streams if s.epoch}, fingerprint)
