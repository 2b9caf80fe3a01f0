"""Position counters as an immutable pytree, and the pure transitions a serving engine needs.

A *stream* is one (request, label) pair; each gets a *slot*, an index into
``PositionTable.counters``, whose value is the stream's next position. Every
transition takes and returns a table, has static shapes and runs under ``jax.jit``.

Variable-length inputs (the views of a step, the forks, the admitted streams) are
padded to a bucket. One convention: any slot outside ``[0, capacity)`` is padding; it
reads as zero and its writes are dropped. :data:`PAD` (the largest int32) is the
padding slot to use: it stays padding when the table grows (see :func:`pad_slots`).

The map from (request_id, label) to slot is host-side state and lives in
:class:`SlotMap`, outside the pytree.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxrope import positions
  >>> table = positions.init(4)
  >>> slots = jnp.array([2, 0], jnp.int32)  # two streams, 3 and 2 tokens this step
  >>> counts = jnp.array([3, 2], jnp.int32)
  >>> positions.plan(table, slots, counts, jnp.full((6,), -1, jnp.int32)).tolist()
  [0, 1, 2, 0, 1, -1]
  >>> table = positions.commit(table, slots, counts)
  >>> table.counters.tolist()
  [2, 0, 3, 0]
  >>> padded = positions.pad_slots([2, 0], 4)
  >>> padded.tolist() == [2, 0, positions.PAD, positions.PAD]
  True
  >>> positions.read(table, jnp.asarray(padded)).tolist()
  [3, 2, 0, 0]
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import paging as _paging
from jaxrope import sharding as _sharding

# The padding slot: out of range for every table, however far it grows.
PAD = int(np.iinfo(np.int32).max)
# Negative slots are padding too (numpy-style wrapping would make -1 the last slot).
_NO_WRAP = {"wrap_negative_indices": False}


class Scheme(enum.Enum):
    """How a view's tokens are numbered.

    SEQUENTIAL: ``counter + arange(n)``, and commit adds the span.
    BLOCK: all ``n`` tokens share ``counter``, and commit adds ``block_step`` for a
    non-empty segment (block diffusion, parallel decoding of one block).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrope import positions
      >>> table = positions.PositionTable(jnp.array([5], jnp.int32))
      >>> args = (table, jnp.array([0], jnp.int32), jnp.array([3], jnp.int32),
      ...         jnp.zeros((3,), jnp.int32))
      >>> positions.plan(*args, scheme=positions.Scheme.BLOCK).tolist()
      [5, 5, 5]
      >>> positions.plan(*args, scheme=positions.Scheme("sequential")).tolist()
      [5, 6, 7]
    """

    SEQUENTIAL = "sequential"
    BLOCK = "block"


def _scheme(scheme) -> Scheme:
    """``scheme`` as a :class:`Scheme` (also from its value, e.g. ``"block"``)."""
    try:
        return Scheme(scheme)
    except ValueError:
        raise ValueError(f"scheme={scheme!r} must be one of "
                         f"{[s.value for s in Scheme]} (a Scheme)") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PositionTable:
    """Every stream's record, one slot each: int32 ``[capacity]`` columns.

    - ``counters``: the next position;
    - ``deltas``: the M-RoPE position delta (a decode token of an M-RoPE stream sits at
      ``counter + delta`` on all three rows; 0 for 1-D RoPE);
    - ``epochs``: the publish epoch, bumped when a rollback moves the counter back, so
      that :func:`admit` can tell a rewind from a stale echo.

    A JAX pytree, so it passes through ``jax.jit``; build it with :func:`init` (all
    zeros) and change it only through the pure transitions, which return a new table.
    ``PositionTable(counters)`` gives zero deltas and epochs.

    Example:
      >>> from jaxrope import positions
      >>> table = positions.init(3)
      >>> table.capacity, table.counters.dtype, table.counters.tolist(), table.epochs.tolist()
      (3, dtype('int32'), [0, 0, 0], [0, 0, 0])
    """

    counters: jax.Array
    deltas: Optional[jax.Array] = None
    epochs: Optional[jax.Array] = None

    def __post_init__(self) -> None:
        for name in ("deltas", "epochs"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, jnp.zeros_like(self.counters))

    @property
    def capacity(self) -> int:
        """Number of slots, ``counters.shape[0]``."""
        return self.counters.shape[0]


def init(capacity: int) -> PositionTable:
    """A table of ``capacity`` slots, all at position 0."""
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity={capacity!r} must be a positive int")
    return PositionTable(jnp.zeros((capacity,), jnp.int32))


def grow(table: PositionTable, capacity: int) -> PositionTable:
    """The same records in a larger table; new slots start at 0."""
    if capacity < table.capacity:
        raise ValueError(f"capacity={capacity} must be >= current capacity {table.capacity}")
    return jax.tree.map(lambda column: jnp.pad(column, (0, capacity - table.capacity)), table)


def pad_slots(slots: Sequence[int], size: int) -> np.ndarray:
    """int32 ``[size]``: ``slots`` followed by the padding slot :data:`PAD`."""
    if len(slots) > size:
        raise ValueError(f"{len(slots)} entries do not fit the bucket of {size=}")
    out = np.full((size,), PAD, np.int32)
    out[:len(slots)] = slots
    return out


def read(table: PositionTable, slots: jax.Array, column: str = "counters") -> jax.Array:
    """int32 values of one column (default the counters) at ``slots``; padding reads 0."""
    return getattr(table, column).at[slots].get(mode="fill", fill_value=0, **_NO_WRAP)


def _set(column: jax.Array, slots: jax.Array, values) -> jax.Array:
    return column.at[slots].set(values, mode="drop", **_NO_WRAP)


def plan(table: PositionTable, slots: jax.Array, counts: jax.Array, out: jax.Array, *,
         scheme: Scheme = Scheme.SEQUENTIAL, depths: Optional[jax.Array] = None) -> jax.Array:
    """Position ids for an ordered list of views, written over ``out``.

    Args:
      table: the streams.
      slots: int32 ``[V]``, the stream of each view, in token order (padding slots,
        outside ``[0, capacity)``, read 0).
      counts: int32 ``[V]``, the number of tokens of each view (0 for padding).
      out: int32 ``[N]``, or ``[3, N]`` for M-RoPE positions (rows t, h, w); tokens
        ``[sum(counts), N)`` keep these values (CUDA-graph buffers keep their tail),
        tokens before take the planned positions.
      scheme: SEQUENTIAL numbers view ``v``'s tokens ``counter[v] + arange(counts[v])``;
        BLOCK gives them all ``counter[v]``. M-RoPE adds the stream's delta, the same
        on all three rows (text after the prompt advances every row together).
      depths: int32 ``[N]`` or None (default): token ``t`` at ``counter + depths[t]``
        instead of the scheme's numbering (a draft tree's tokens sit at the counter
        plus their depth: :mod:`jaxrope.speculative`); entries past ``sum(counts)``
        are ignored.

    Returns:
      int32, ``out``'s shape.
    """
    sequential = _scheme(scheme) is Scheme.SEQUENTIAL
    counts = counts.astype(jnp.int32)
    ends = jnp.cumsum(counts)
    starts = ends - counts
    token = jnp.arange(out.shape[-1], dtype=jnp.int32)
    # Tokens past the views (view -1) read view 0 here; `live` masks them below.
    view = jnp.maximum(_paging.token_views(counts, out.shape[-1]), 0)
    base = read(table, slots)
    if out.ndim == 2:
        base = base + read(table, slots, "deltas")
    base = base[view]
    if depths is not None:
        base = base + depths.astype(jnp.int32)
    elif sequential:
        base = base + token - starts[view]
    live = token < ends[-1] if counts.shape[0] else jnp.zeros_like(token, bool)
    base, live = jnp.broadcast_to(base, out.shape), jnp.broadcast_to(live, out.shape)
    # Every device numbers the whole step; a sharded `out` keeps its own slice.
    base, live = _sharding.like(out, base, live)
    return jnp.where(live, base, out.astype(jnp.int32))


def commit(table: PositionTable, slots: jax.Array, spans: jax.Array, *,
           scheme: Scheme = Scheme.SEQUENTIAL, block_step: int = 1) -> PositionTable:
    """Advance each segment's stream by what the step consumed.

    SEQUENTIAL adds the span; BLOCK adds ``block_step`` for each non-empty segment.
    Several segments of one stream add up.
    """
    spans = spans.astype(jnp.int32)
    if _scheme(scheme) is Scheme.BLOCK:
        spans = jnp.where(spans > 0, jnp.int32(block_step), 0)
    return advance(table, slots, spans)


def advance(table: PositionTable, slots: jax.Array, amounts: jax.Array) -> PositionTable:
    """Add explicit ``amounts`` to the counters at ``slots`` (a step's explicit advance)."""
    counters = table.counters.at[slots].add(amounts.astype(jnp.int32), mode="drop", **_NO_WRAP)
    return dataclasses.replace(table, counters=counters)


def fork(table: PositionTable, src_slots: jax.Array, dst_slots: jax.Array) -> PositionTable:
    """Copy counters and deltas ``src -> dst`` pairwise (a CFG branch starting where its
    parent is, on the parent's M-RoPE layout). Epochs stay: a fork publishes nothing.

    All sources are read before any destination is written.
    """
    return dataclasses.replace(
        table, counters=_set(table.counters, dst_slots, read(table, src_slots)),
        deltas=_set(table.deltas, dst_slots, read(table, src_slots, "deltas")))


def raise_to(table: PositionTable, slots: jax.Array, positions: jax.Array) -> PositionTable:
    """``counter = max(counter, position)``: monotonic and idempotent.

    This is both *admit* (take on published counters; a stale echo never rewinds) and
    *cached prefix* (move past what the cache holds; the position is absolute, so a
    repeated probe moves nothing).
    """
    counters = table.counters.at[slots].max(positions.astype(jnp.int32), mode="drop", **_NO_WRAP)
    return dataclasses.replace(table, counters=counters)


def admit(table: PositionTable, slots: jax.Array, positions: jax.Array, deltas: jax.Array,
          epochs: jax.Array) -> PositionTable:
    """Take on published records ``(position, delta, epoch)`` in epoch order.

    A newer epoch wins even with a lower position (the publisher rolled back: drafts it
    had published were rejected); within an epoch the larger position wins, so a stale
    echo of this node's own publication never rewinds (the seed's monotonic admit); an
    older epoch changes nothing. The delta comes with the position that wins. ``slots``
    must be distinct.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrope import positions
      >>> table = positions.PositionTable(jnp.array([9, 9, 9], jnp.int32))
      >>> s = jnp.array([0, 1, 2], jnp.int32)
      >>> out = positions.admit(table, s, jnp.array([5, 12, 4], jnp.int32),
      ...                       jnp.array([-2, -3, -4], jnp.int32), jnp.array([0, 0, 1], jnp.int32))
      >>> out.counters.tolist(), out.deltas.tolist(), out.epochs.tolist()
      ([9, 12, 4], [0, -3, -4], [0, 0, 1])
    """
    positions, deltas, epochs = (x.astype(jnp.int32) for x in (positions, deltas, epochs))
    counter, delta, epoch = (read(table, slots, c) for c in ("counters", "deltas", "epochs"))
    newer = epochs > epoch
    take = newer | ((epochs == epoch) & (positions > counter))
    return PositionTable(_set(table.counters, slots, jnp.where(take, positions, counter)),
                         _set(table.deltas, slots, jnp.where(take, deltas, delta)),
                         _set(table.epochs, slots, jnp.where(newer, epochs, epoch)))


def set_deltas(table: PositionTable, slots: jax.Array, deltas: jax.Array) -> PositionTable:
    """Set the M-RoPE deltas at ``slots`` (once a prompt's layout is known)."""
    return dataclasses.replace(table, deltas=_set(table.deltas, slots, deltas.astype(jnp.int32)))


def rollback(table: PositionTable, slots: jax.Array, positions: jax.Array) -> PositionTable:
    """``counter = min(counter, position)``: undo tokens past ``position`` (rejected drafts).

    A counter that moves back starts a new publish epoch (see :func:`admit`); one that
    stays keeps its epoch, so a rollback to where a stream already is changes nothing.
    ``slots`` must be distinct.
    """
    counter, epoch = read(table, slots), read(table, slots, "epochs")
    target = jnp.minimum(counter, positions.astype(jnp.int32))
    return dataclasses.replace(
        table, counters=_set(table.counters, slots, target),
        epochs=_set(table.epochs, slots, epoch + (target < counter).astype(jnp.int32)))


def reset(table: PositionTable, slots: jax.Array) -> PositionTable:
    """Every column at ``slots`` to 0 (a freed or reset stream starts afresh)."""
    return jax.tree.map(lambda column: _set(column, slots, 0), table)


class SlotMap:
    """Host-side map ``(request_id, label) -> slot`` with a free list.

    Slots are reused after :meth:`release`; when none is free the capacity doubles
    and the caller grows its table to :attr:`capacity` (:func:`grow`). The one map a
    host keeps: :meth:`lookup` turns a step's streams into a slot array in one pass.

    Args:
      capacity: initial number of slots, a positive int (default 64).

    Attributes:
      capacity: current number of slots (doubles when a new stream finds none free).
      peak: the most slots ever in use at once.

    Raises:
      ValueError: ``capacity`` is not a positive int.

    Example:
      >>> slots = SlotMap(capacity=2)
      >>> slots.acquire("r0", "text"), slots.acquire("r0", "image"), slots.acquire("r1", "text")
      (0, 1, 2)
      >>> slots.capacity, slots.find("r1", "text"), slots.requests()
      (4, 2, ['r0', 'r1'])
      >>> slots.lookup(["r1", "r0"], ["text", "image"]).tolist()
      [2, 1]
      >>> slots.release("r0"), len(slots), slots.peak
      ([0, 1], 1, 3)
    """

    def __init__(self, capacity: int = 64):
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity={capacity!r} must be a positive int")
        self._slot_of: Dict[Tuple[Hashable, Hashable], int] = {}
        self._by_rid: Dict[Hashable, Dict[Hashable, int]] = {}
        self._free: List[int] = list(range(capacity - 1, -1, -1))
        self.capacity = capacity
        self.peak = 0

    def __len__(self) -> int:
        """Slots in use."""
        return len(self._slot_of)

    def __contains__(self, rid: Hashable) -> bool:
        """Whether ``rid`` holds a slot."""
        return rid in self._by_rid

    def find(self, rid: Hashable, label: Hashable) -> Optional[int]:
        """The stream's slot, or None."""
        return self._slot_of.get((rid, label))

    def lookup(self, rids: Sequence[Hashable], labels: Sequence[Hashable]) -> np.ndarray:
        """int64 slots of the streams ``zip(rids, labels)``.

        Raises:
          KeyError: a stream holds no slot (the caller names it).
        """
        return np.fromiter(map(self._slot_of.__getitem__, zip(rids, labels)), np.int64,
                           len(rids))

    def acquire(self, rid: Hashable, label: Hashable) -> int:
        """The stream's slot, taking a free one (growing if needed) for a new stream."""
        slot = self._slot_of.get((rid, label))
        if slot is not None:
            return slot
        if not self._free:
            self._free = list(range(2 * self.capacity - 1, self.capacity - 1, -1))
            self.capacity *= 2
        slot = self._slot_of[rid, label] = self._free.pop()
        self._by_rid.setdefault(rid, {})[label] = slot
        self.peak = max(self.peak, len(self._slot_of))
        return slot

    def labels(self, rid: Hashable) -> Dict[Hashable, int]:
        """``{label: slot}`` of one request (a copy)."""
        return dict(self._by_rid.get(rid, {}))

    def requests(self) -> List[Hashable]:
        """Request ids holding at least one slot, in order of their first :meth:`acquire`."""
        return list(self._by_rid)

    def free_slots(self) -> Tuple[int, ...]:
        """The free list, next slot to be taken last."""
        return tuple(self._free)

    def release(self, rid: Hashable) -> List[int]:
        """Free every slot of ``rid``; returns them (the caller resets their counters)."""
        labels = self._by_rid.pop(rid, {})
        for label in labels:
            del self._slot_of[rid, label]
        freed = list(labels.values())
        self._free.extend(sorted(freed, reverse=True))
        return freed
