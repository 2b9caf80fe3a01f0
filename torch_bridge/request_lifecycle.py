"""A request's streams in a manager: ingest, remove, reset, and each stream's counter read back.

A component of :class:`~torch_bridge.PositionManager`, built from the parts it needs (as
:class:`~torch_bridge.publish_admit.PublishAdmit` is): the manager's
:class:`~torch_bridge.streams.StreamTable` (the slots and counters this changes), its
:class:`~torch_bridge.step_arrays.StepReader` (stream lookups with the messages that
say why a request is unknown), its :class:`~torch_bridge.plans.StepPlans` (a removed
request leaves the plans made before) and its
:class:`~torch_bridge.publish_admit.RecordArgs` (the ``{label: value}`` checks).

Every method checks its arguments before it changes anything. A stream that the current
or the staged plan numbers or forks is frozen (:meth:`torch_bridge.plans.StepPlans.frozen`):
an ingest override or delta, or a reset, that would change its record is refused;
removing its request is not (the plans drop its streams).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, Hashable, Optional

from torch_bridge.plans import StepPlans
from torch_bridge.publish_admit import RecordArgs, check_unfrozen
from torch_bridge.step_arrays import StepReader, check_hashable
from torch_bridge.streams import StreamTable

__all__ = ["RequestLifecycle"]


class RequestLifecycle:
    """Ingest / remove / reset a request, and read its streams' counters and deltas.

    Args:
      streams: the manager's :class:`~torch_bridge.streams.StreamTable`.
      reader: its :class:`~torch_bridge.step_arrays.StepReader`.
      plans: its :class:`~torch_bridge.plans.StepPlans`.
      args: its :class:`~torch_bridge.publish_admit.RecordArgs`.

    The public methods of :class:`~torch_bridge.PositionManager` of the same names
    delegate here; their docstrings are these.
    """

    def __init__(self, streams: StreamTable, reader: StepReader, plans: StepPlans,
                 args: RecordArgs):
        self._streams, self._reader, self._plans, self._args = streams, reader, plans, args

    def ingest_request(self, rid: Hashable, overrides: Optional[Mapping[str, int]] = None, *,
                       deltas: Optional[Mapping[str, int]] = None) -> None:
        """Give ``rid`` a counter per configured label; idempotent, never resets.

        Args:
          rid: the request id (hashable).
          overrides: optional ``{label: position}`` start positions, taken as
            ``counter = max(counter, position)`` so a repeated ingest moves nothing.
          deltas: optional ``{label: M-RoPE delta}`` of the request's prompt (the ``delta``
            of :func:`jaxrope.mrope.rope_index`): once the prompt is in, a decode token of
            the stream sits at ``counter + delta`` on all three rows. Set, not merged:
            repeating it moves nothing.

        Raises:
          ValueError: an override or delta names an unknown label, a position outside
            ``[0, max_seq_len]``, a delta that is not an int in ``[-max_seq_len,
            max_seq_len]``, deltas for a manager whose RoPE is not M-RoPE, or an override
            or delta that would change a stream the current or staged plan numbers or
            forks (a repeated ingest that changes nothing is never refused).
          TypeError: ``rid`` is not hashable.

        Example:
          >>> from torch_bridge import PositionConfig, PositionManager
          >>> mgr = PositionManager(PositionConfig(), "cpu")
          >>> mgr.ingest_request("r0", overrides={"text": 4}); mgr.ingest_request("r0")
          >>> mgr.position("r0", "text")
          4
        """
        check_hashable(rid, "rid")
        targets = self._args.positions(overrides or {}, "overrides")
        delta_targets = self._args.deltas(deltas or {}, "deltas")
        if rid in self._streams:
            check_unfrozen(self._streams, self._plans, rid, targets, "overrides")
            self._check_deltas(rid, delta_targets)
        self._streams.ingest(rid)
        self._streams.raise_to(rid, targets)
        self._streams.set_deltas(rid, delta_targets)

    def _check_deltas(self, rid: Hashable, deltas: Dict[int, int]) -> None:
        """Refuse M-RoPE deltas that would change a frozen stream's (a plan numbers its
        positions from ``counter + delta``)."""
        for index, delta in deltas.items():
            slot = self._streams.slots_of(rid)[index]
            now = int(self._streams.columns.deltas[slot])
            if delta != now:
                label = self._streams.labels[index]
                blocked = self._plans.frozen(slot, f"({rid!r}, {label!r})")
                if blocked is not None:
                    raise ValueError(f"deltas[{label!r}]={delta} would change the M-RoPE delta "
                                     f"from {now}, but {blocked}")

    def remove_request(self, rid: Hashable) -> None:
        """Forget ``rid`` and free its slots (their counters go back to 0); unknown ids are ignored.

        A plan made before the removal still commits, without the removed request's
        streams.

        Raises:
          TypeError: ``rid`` is not hashable.
        """
        check_hashable(rid, "rid")
        if rid not in self._streams:
            return
        self._plans.drop(rid, self._streams.slots_of(rid))
        self._streams.release(rid)

    def reset_request(self, rid: Hashable, free: bool = False) -> None:
        """Set ``rid``'s counters to 0 (dummy requests of CUDA-graph capture); ``free`` also removes it.

        Raises:
          ValueError: ``rid`` is not ingested (never, or removed), or (``free`` False) one
            of its streams is not at 0 and the current or staged plan numbers or forks it
            (``free=True`` removes it from the plans instead).
          TypeError: ``free`` is not a bool.
        """
        if not isinstance(free, bool):
            raise TypeError(f"free={free!r} must be a bool")
        slots = self._reader.request_slots(rid)
        if free:
            self.remove_request(rid)
            return
        columns = self._streams.columns
        for label, slot in zip(self._streams.labels, slots):
            if any(column[slot] for column in columns) or slot in self._streams.rewinds:
                blocked = self._plans.frozen(slot, f"({rid!r}, {label!r})")
                if blocked is not None:
                    raise ValueError(f"reset_request({rid!r}) would move the stream to 0, "
                                     f"but {blocked}")
        self._streams.reset(slots)

    def position(self, rid: Hashable, label: str) -> int:
        """The next position of stream ``(rid, label)`` (committed counters, no device read).

        For M-RoPE this stays the counter, the stream's length in tokens (what commits
        advance and the KV cache holds); the rotation position of its next token is
        ``position + delta`` (:meth:`delta`).

        Raises:
          ValueError: unknown label, or a request not ingested (the message says whether
            it was removed or never ingested).
        """
        return int(self._streams.counters[self._reader.slot(rid, label)])

    def delta(self, rid: Hashable, label: str) -> int:
        """The M-RoPE delta of stream ``(rid, label)``: its next computed token rotates at
        ``position(rid, label) + delta`` on all three rows (0 for 1-D RoPE).

        Raises:
          ValueError: unknown request or label.

        Example:
          >>> import jaxrope as jr
          >>> from torch_bridge import PositionConfig, PositionManager
          >>> rope = jr.RopeConfig(head_dim=8, mrope_section=(2, 1, 1))
          >>> mgr = PositionManager(PositionConfig(rope=rope), "cpu")
          >>> mgr.ingest_request("r0", {"text": 200}, deltas={"text": -182})
          >>> mgr.position("r0", "text"), mgr.delta("r0", "text")
          (200, -182)
        """
        return int(self._streams.columns.deltas[self._reader.slot(rid, label)])
