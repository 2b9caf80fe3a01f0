"""The torch bridge's streams: slot map and counters on the host, and the counter rules.

The counters are host-authoritative (numpy int64, one per slot). Every position id a
step uses is computed here, vectorised, and copied to the device once per step
(:mod:`torch_bridge.upload`); nothing on the device holds state, so a step needs no
device work beyond that copy and no read back.

The functions below are the bridge's executor of the counter rules: each one is the
numpy twin of the transition of the same name in :mod:`jaxrope.positions` (the core's
executor, for JAX stacks under ``jit``). ``tests/test_counter_rules.py`` drives both
with the same random operation sequences and compares every counter and position. The
bridge never pads (its slot arrays come from the slot map, one entry per real stream),
so these take live slots only; the core's padding convention (:data:`PAD`) is for
fixed-shape buckets under ``jit``. They change the array they are given in place; the
caller chooses whether that is a copy.

Example:
  >>> import numpy as np
  >>> from jaxrope.positions import Scheme
  >>> columns = Columns(np.array([5, 0, 2, 0]), np.zeros(4, int), np.zeros(4, int))
  >>> plan(columns, np.array([2, 0]), np.array([3, 1]), Scheme.SEQUENTIAL).tolist()
  [2, 3, 4, 5]
  >>> commit(columns, np.array([2, 0]), np.array([3, 1]), Scheme.SEQUENTIAL, 1)
  >>> columns.counters.tolist()
  [6, 0, 5, 0]
"""

from __future__ import annotations

import collections
from typing import Any, Dict, Hashable, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from jaxrope.positions import RowMap, Scheme
from jaxrope.wire import Rewinds, rewound

__all__ = ["Columns", "CommitArrays", "StreamTable", "accept", "admit", "advance", "apply_commit",
           "commit", "fork", "plan", "plan_draft", "raise_to", "reset", "rollback", "set_deltas",
           "tree_depths"]

# The empty slot array, shared (read-only) by the bridge's modules.
EMPTY = np.zeros((0,), np.int64)
EMPTY.flags.writeable = False
# 0, 1, 2, ...: each SEQUENTIAL view is a slice of it plus the view's start.
_RAMP = np.arange(1 << 17, dtype=np.int32)
_RAMP.flags.writeable = False


class Columns(NamedTuple):
    """Every slot's record, int64 ``[capacity]`` each (the columns of ``jaxrope.PositionTable``):
    the next position, the M-RoPE delta, the publish epoch."""

    counters: np.ndarray
    deltas: np.ndarray
    epochs: np.ndarray

    @classmethod
    def zeros(cls, capacity: int) -> "Columns":
        return cls(*(np.zeros(capacity, np.int64) for _ in cls._fields))

    def copy(self) -> "Columns":
        return Columns(*(column.copy() for column in self))

    def grown(self, capacity: int) -> "Columns":
        return Columns(*(np.pad(column, (0, capacity - len(column))) for column in self))


def plan(columns: Columns, slots: np.ndarray, counts: np.ndarray, scheme: Scheme,
         num_tokens: Optional[int] = None, mrope: bool = False,
         depths: Optional[np.ndarray] = None, out: Optional[np.ndarray] = None) -> np.ndarray:
    """int32 positions of an ordered list of views (twin of ``positions.plan``).

    View ``v`` with ``counts[v]`` tokens gets ``counter + arange(n)`` (SEQUENTIAL) or
    ``n`` copies of its counter (BLOCK), or with ``depths`` (``[sum(counts)]``) token
    ``t`` at ``counter + depths[t]``; the result is ``[sum(counts)]``, or for M-RoPE
    ``[3, sum(counts)]`` with the stream's delta added on every row. ``num_tokens``:
    ``sum(counts)`` when the caller knows it; ``out``: an int32 array of the result's
    shape to write it into (the upload's pinned span), returned.
    """
    base = columns.counters[slots]
    if mrope:
        base = base + columns.deltas[slots]
    if num_tokens is None:
        num_tokens = int(counts.sum())
    row = None if out is None else (out[0] if mrope else out)
    if depths is not None:
        positions = _int32(np.repeat(base, counts) + depths, row)
    elif num_tokens == len(counts) and (num_tokens == 0 or counts.max() == 1):
        positions = _int32(base, row)  # every view one token (decode): nothing to repeat
    elif scheme is Scheme.BLOCK:
        positions = _int32(np.repeat(base, counts), row)
    else:
        # int32 from the start: a prefill step is tens of thousands of tokens, and each
        # pass over them counts.
        starts = np.cumsum(counts) - counts
        offsets = np.repeat((base - starts).astype(np.int32), counts)
        ramp = _RAMP[:num_tokens] if num_tokens <= len(_RAMP) else np.arange(num_tokens,
                                                                             dtype=np.int32)
        positions = np.add(ramp, offsets, out=row)
    if not mrope:
        return positions
    if out is None:
        return np.broadcast_to(positions, (3, num_tokens))
    out[1:] = positions
    return out


def _int32(values: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
    if out is None:
        return values.astype(np.int32)
    np.copyto(out, values, casting="unsafe")
    return out


def advance(columns: Columns, slots: np.ndarray, amounts: np.ndarray) -> None:
    """``counter += amount`` at ``slots``; repeated slots add up (twin of ``positions.advance``)."""
    np.add.at(columns.counters, slots, amounts)


def commit(columns: Columns, slots: np.ndarray, spans: np.ndarray, scheme: Scheme,
           block_step: int) -> None:
    """Advance by a step's segments: the span, or ``block_step`` for a non-empty BLOCK
    segment (twin of ``positions.commit``)."""
    if scheme is Scheme.BLOCK:
        spans = np.where(spans > 0, block_step, 0)
    advance(columns, slots, spans)


def fork(columns: Columns, src: np.ndarray, dst: np.ndarray) -> None:
    """Copy counters and deltas ``src -> dst`` pairwise, every source read first (twin of
    ``positions.fork``); epochs stay."""
    columns.counters[dst] = columns.counters[src]
    columns.deltas[dst] = columns.deltas[src]


def raise_to(columns: Columns, slots: np.ndarray, values: np.ndarray) -> None:
    """``counter = max(counter, value)`` (twin of ``positions.raise_to``: cached prefix,
    ingest overrides)."""
    np.maximum.at(columns.counters, slots, values)


def admit(columns: Columns, slots: np.ndarray, positions: np.ndarray, deltas: np.ndarray,
          epochs: np.ndarray) -> None:
    """Published ``(position, delta, epoch)`` records in epoch order (twin of
    ``positions.admit``): a newer epoch wins, within one the larger position; distinct slots."""
    counter, epoch = columns.counters[slots], columns.epochs[slots]
    newer = epochs > epoch
    take = newer | ((epochs == epoch) & (positions > counter))
    columns.counters[slots] = np.where(take, positions, counter)
    columns.deltas[slots] = np.where(take, deltas, columns.deltas[slots])
    columns.epochs[slots] = np.where(newer, epochs, epoch)


def set_deltas(columns: Columns, slots: np.ndarray, deltas: np.ndarray) -> None:
    """The M-RoPE deltas at ``slots`` (twin of ``positions.set_deltas``)."""
    columns.deltas[slots] = deltas


def rollback(columns: Columns, slots: np.ndarray, positions: np.ndarray) -> None:
    """``counter = min(counter, position)``, a new epoch where it moved back (twin of
    ``positions.rollback``); distinct slots."""
    counter = columns.counters[slots]
    target = np.minimum(counter, positions)
    columns.counters[slots] = target
    columns.epochs[slots] += target < counter


def accept(columns: Columns, slots: np.ndarray, accepted: np.ndarray) -> None:
    """``counter += accepted + 1`` after a verify step (twin of ``speculative_positions.accept``)."""
    advance(columns, slots, accepted + 1)


def tree_depths(parents: np.ndarray) -> np.ndarray:
    """int64 depth of each token from its parent index (-1: a root), by pointer doubling
    (twin of ``speculative_positions.tree_depths``)."""
    root = parents < 0
    ancestor = np.where(root, np.arange(len(parents)), parents)
    depth = (~root).astype(np.int64)
    for _ in range(max(1, (len(parents) - 1).bit_length())):
        depth = depth + depth[ancestor]
        ancestor = ancestor[ancestor]
    return depth


def plan_draft(columns: Columns, slots: np.ndarray, counts: np.ndarray, step: int, offset: int,
               max_seq_len: int, mrope: bool = False, num_tokens: Optional[int] = None,
               out: Optional[np.ndarray] = None) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """``(positions, live)`` of EAGLE draft step ``step`` (twin of ``speculative_positions.plan_draft``):
    every token at sequence index ``counter + offset + step`` (plus the delta on each
    M-RoPE row); a token whose index is outside ``[0, max_seq_len)`` is at 0 and not live.
    ``live`` is None when every token is (the usual case, no mask built). ``num_tokens``:
    ``sum(counts)`` when the caller knows it; ``out``: as for :func:`plan`."""
    if num_tokens is None:
        num_tokens = int(counts.sum())
    # Every view one token (a chain's draft step); a view may hold none, so check the max.
    one_each = num_tokens == len(counts) and (num_tokens == 0 or counts.max() == 1)
    index = columns.counters[slots] + (offset + step)
    if not one_each:
        index = np.repeat(index, counts)
    if mrope:
        deltas = columns.deltas[slots]
        positions = index + (deltas if one_each else np.repeat(deltas, counts))
    else:
        positions = index
    live = None
    if len(index) and (index.min() < 0 or index.max() >= max_seq_len):
        live = (index >= 0) & (index < max_seq_len)
        positions = np.where(live, positions, 0)
    row = None if out is None else (out[0] if mrope else out)
    positions = _int32(positions, row)
    if not mrope:
        return positions, live
    if out is None:
        return np.broadcast_to(positions, (3, len(index))), live
    out[1:] = positions
    return out, live


def reset(columns: Columns, slots: np.ndarray) -> None:
    """Every column at ``slots`` to 0 (twin of ``positions.reset``)."""
    for column in columns:
        column[slots] = 0


class CommitArrays(NamedTuple):
    """What a step's commit does, as int64 slot arrays (a NamedTuple: built every step).

    ``slots``/``spans``: the segments, advanced by the scheme; ``adv_slots``/
    ``adv_amounts``: explicit advances replacing the scheme's amount; ``fork_src``/
    ``fork_dst``: post-forks, applied after both. ``touched``: every slot the commit
    writes (the ones whose bound is checked).
    """

    slots: np.ndarray = EMPTY
    spans: np.ndarray = EMPTY
    adv_slots: np.ndarray = EMPTY
    adv_amounts: np.ndarray = EMPTY
    fork_src: np.ndarray = EMPTY
    fork_dst: np.ndarray = EMPTY

    @property
    def touched(self) -> np.ndarray:
        if not (len(self.adv_slots) or len(self.fork_dst)):
            return self.slots
        return np.concatenate([self.slots, self.adv_slots, self.fork_dst])

    def without(self, removed: Sequence[int]) -> "CommitArrays":
        """The same commit minus every entry naming a slot in ``removed`` (a removed request)."""
        def keep(*arrays: np.ndarray) -> np.ndarray:
            mask = np.ones(len(arrays[0]), bool)
            for array in arrays:
                mask &= ~np.isin(array, removed)
            return mask
        spans_kept, adv_kept, forks_kept = (keep(self.slots), keep(self.adv_slots),
                                            keep(self.fork_src, self.fork_dst))
        return CommitArrays(self.slots[spans_kept], self.spans[spans_kept],
                            self.adv_slots[adv_kept], self.adv_amounts[adv_kept],
                            self.fork_src[forks_kept], self.fork_dst[forks_kept])


def apply_commit(columns: Columns, step: CommitArrays, scheme: Scheme,
                 block_step: int) -> None:
    """A whole step's commit: segments, explicit advances, then post-forks (the
    composition ``positions.commit``, ``positions.advance``, ``positions.fork``)."""
    if len(step.slots):
        commit(columns, step.slots, step.spans, scheme, block_step)
    if len(step.adv_slots):
        advance(columns, step.adv_slots, step.adv_amounts)
    if len(step.fork_src):
        fork(columns, step.fork_src, step.fork_dst)


# How many removed request ids a table remembers, to say "removed" rather than "never
# ingested" about them: the most recent ones, a few kilobytes.
_REMEMBERED_REMOVALS = 4096


class StreamTable:
    """Every stream of the manager: the slot map and the counters, on the host.

    Args:
      labels: the stream labels each request gets (one slot per label).
      capacity: initial number of slots; doubles when full.

    Attributes:
      columns: every slot's record (free slots all 0); ``counters`` is ``columns.counters``.
      rewinds: ``{slot: ((writer, rollbacks), ...)}`` of the slots rolled back (their
        epoch is the sum; :func:`jaxrope.wire.rewind_order`); a slot left out has none.
      row_map: the :class:`jaxrope.RowMap` ``(request_id, label) -> row``.
      slot_version: changes whenever a stream's slot may have (ingest, remove), so cached
        slot arrays can tell they are stale.

    Example:
      >>> streams = StreamTable(("text",), capacity=2)
      >>> streams.ingest("r0"), streams.ingest("r0"), streams.slots_of("r0")
      (True, False, (0,))
      >>> _ = streams.release("r0"); streams.was_removed("r0")
      True
    """

    def __init__(self, labels: Tuple[str, ...], capacity: int = 256):
        self.labels = labels
        self.row_map = RowMap(capacity)
        self.columns = Columns.zeros(capacity)
        self.rewinds: Dict[int, Rewinds] = {}
        self.slot_version = 0
        self._requests: dict = {}
        self._removed: "collections.OrderedDict[Hashable, None]" = collections.OrderedDict()

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._requests

    @property
    def counters(self) -> np.ndarray:
        """Every slot's next position (``columns.counters``)."""
        return self.columns.counters

    def slots_of(self, rid: Hashable) -> Optional[Tuple[int, ...]]:
        """The request's slots, one per label in label order, or None."""
        return self._requests.get(rid)

    def requests(self) -> list:
        """Ingested request ids, in order of ingestion."""
        return list(self._requests)

    def ingest(self, rid: Hashable) -> bool:
        """Give a new request a slot per label; False (nothing changes) if it has them."""
        if rid in self._requests:
            return False
        self._requests[rid] = tuple(self.row_map.acquire(rid, label) for label in self.labels)
        if self.row_map.capacity > len(self.columns.counters):
            self.columns = self.columns.grown(self.row_map.capacity)
        self._removed.pop(rid, None)
        self.slot_version += 1
        return True

    def release(self, rid: Hashable) -> Tuple[int, ...]:
        """Free the request's slots (their records back to 0); returns them."""
        slots = self._requests.pop(rid)
        self.row_map.release(rid)
        self.reset(slots)
        self._removed[rid] = None
        if len(self._removed) > _REMEMBERED_REMOVALS:
            self._removed.popitem(last=False)
        self.slot_version += 1
        return slots

    def snapshot(self) -> Dict[str, Any]:
        """Copies of the records and the slot map (``PositionManager.state_snapshot``'s
        ``counters``, ``slots``, ``deltas``, ``epochs``, ``rewinds``, ``requests`` and
        ``row_map``)."""
        requests = {rid: slots for rid, slots in self._requests.items()}
        counters, row_map = self.counters, self.row_map
        return {
            "counters": {(rid, label): int(counters[slot]) for rid, slots in requests.items()
                         for label, slot in zip(self.labels, slots)},
            "slots": tuple(counters.tolist()),
            "deltas": tuple(self.columns.deltas.tolist()),
            "epochs": tuple(self.columns.epochs.tolist()),
            "rewinds": dict(self.rewinds),
            "requests": requests,
            "row_map": {"capacity": row_map.capacity, "live": len(row_map),
                         "peak": row_map.peak, "free": row_map.free_rows()},
        }

    def was_removed(self, rid: Hashable) -> bool:
        """Whether ``rid`` was removed and not ingested since (among the last 4096 removed)."""
        return rid in self._removed

    def reset(self, slots: Sequence[int]) -> None:
        """Every record at ``slots`` to 0, rewinds included (:func:`reset`)."""
        reset(self.columns, np.asarray(slots, np.int64))
        for slot in slots:
            self.rewinds.pop(int(slot), None)

    def label_arrays(self, rid: Hashable, values: Dict[int, int]) -> Tuple[np.ndarray, np.ndarray]:
        """int64 ``(slots, values)`` of an ingested request's ``{label index: value}``."""
        request = self._requests[rid]
        return (np.asarray([request[i] for i in values], np.int64),
                np.asarray(list(values.values()), np.int64))

    def raise_to(self, rid: Hashable, positions: Dict[int, int]) -> None:
        """``counter = max(counter, position)`` of an ingested request's ``{label index:
        position}`` (:func:`raise_to`)."""
        if positions:
            raise_to(self.columns, *self.label_arrays(rid, positions))

    def set_deltas(self, rid: Hashable, deltas: Dict[int, int]) -> None:
        """The M-RoPE deltas of an ingested request's ``{label index: delta}``."""
        if deltas:
            set_deltas(self.columns, *self.label_arrays(rid, deltas))

    def rewind(self, slot: int, position: int, writer: int) -> None:
        """Roll ``slot`` back to ``position`` (:func:`rollback`); a counter that moves back
        counts a rollback by ``writer`` (its epoch grows by one)."""
        moved = position < self.columns.counters[slot]
        rollback(self.columns, np.asarray([slot]), np.asarray([position]))
        if moved:
            self.rewinds[slot] = rewound(self.rewinds.get(slot, ()), writer)

    def take(self, slots: np.ndarray, positions: np.ndarray, deltas: np.ndarray,
             epochs: np.ndarray, rewinds: Sequence[Rewinds]) -> None:
        """Admit records whose rewinds are not older nor conflicting (the caller checked):
        :func:`admit`, and a stream that takes a newer epoch takes its rewinds."""
        newer = epochs > self.columns.epochs[slots]
        admit(self.columns, slots, positions, deltas, epochs)
        for slot, record, take in zip(slots.tolist(), rewinds, newer.tolist()):
            if take:
                self.rewinds[slot] = record

    def lookup(self, rids: Sequence[Hashable], labels: Sequence[str]) -> np.ndarray:
        """int64 slots of the streams ``zip(rids, labels)``.

        Raises:
          ValueError: a stream is unknown (the caller names it).
        """
        return self.row_map.lookup(rids, labels)
