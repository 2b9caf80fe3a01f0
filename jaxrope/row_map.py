"""The host-side map from streams to table rows: :class:`RowMap`.

A stream, one (request_id, label) pair, owns one row of a
:class:`jaxrope.PositionTable` while it lives; the map hands rows out, takes them back
and reuses them, and doubles its capacity when none is free. It is plain Python state,
kept outside the pytree the jitted transitions of :mod:`jaxrope.positions` take.
"""

from __future__ import annotations

from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from jaxrope.numbers import as_int

__all__ = ["RowMap"]


class RowMap:
    """Host-side map ``(request_id, label) -> row`` of a :class:`jaxrope.PositionTable`, with a
    free list: the ``rows`` the transitions take (a KV-cache address is a *slot*, never a row).

    Rows are reused after :meth:`release`, whose list :func:`jaxrope.positions.reset` takes; when none is
    free the capacity doubles, and the table follows with
    ``table = positions.grow(table, row_map.capacity)`` (a no-op unless the map grew). The one
    map a host keeps: :meth:`lookup` turns a step's streams into a row array in one pass.

    Args:
      capacity: initial number of rows, a positive int (default 64).

    Attributes:
      capacity: current number of rows (doubles when a new stream finds none free).
      peak: the most rows ever in use at once.

    Raises:
      ValueError: ``capacity`` is not a positive int.

    Example:
      >>> rows = RowMap(capacity=2)
      >>> rows.acquire("r0", "text"), rows.acquire("r0", "image"), rows.acquire("r1", "text")
      (0, 1, 2)
      >>> rows.capacity, rows.find("r1", "text"), rows.requests()
      (4, 2, ['r0', 'r1'])
      >>> rows.lookup(["r1", "r0"], ["text", "image"]).tolist()
      [2, 1]
      >>> rows.release("r0"), len(rows), rows.peak
      ([0, 1], 1, 3)
    """

    def __init__(self, capacity: int = 64):
        if as_int(capacity, "capacity") <= 0:
            raise ValueError(f"capacity={capacity!r} must be a positive int")
        self._row_of: Dict[Tuple[Hashable, Hashable], int] = {}
        self._by_rid: Dict[Hashable, Dict[Hashable, int]] = {}
        self._free: List[int] = list(range(capacity - 1, -1, -1))
        self.capacity = capacity
        self.peak = 0

    def __len__(self) -> int:
        """Rows in use."""
        return len(self._row_of)

    def __contains__(self, rid: Hashable) -> bool:
        """Whether ``rid`` holds a row."""
        return rid in self._by_rid

    def find(self, rid: Hashable, label: Hashable) -> Optional[int]:
        """The stream's row, or None."""
        return self._row_of.get((rid, label))

    def lookup(self, rids: Sequence[Hashable], labels: Sequence[Hashable]) -> np.ndarray:
        """int64 rows of the streams ``zip(rids, labels)``.

        Raises:
          ValueError: a stream holds no row, named.
        """
        try:
            return np.fromiter(map(self._row_of.__getitem__, zip(rids, labels)), np.int64,
                               len(rids))
        except KeyError as e:
            rid, label = e.args[0]
            raise ValueError(f"stream (rid={rid!r}, label={label!r}) holds no row of this "
                             "RowMap (acquire it first)") from None

    def acquire(self, rid: Hashable, label: Hashable) -> int:
        """The stream's row, taking a free one (doubling the capacity if none is) for a
        new stream."""
        row = self._row_of.get((rid, label))
        if row is not None:
            return row
        if not self._free:
            self._free = list(range(2 * self.capacity - 1, self.capacity - 1, -1))
            self.capacity *= 2
        row = self._row_of[rid, label] = self._free.pop()
        self._by_rid.setdefault(rid, {})[label] = row
        self.peak = max(self.peak, len(self._row_of))
        return row

    def labels(self, rid: Hashable) -> Dict[Hashable, int]:
        """``{label: row}`` of one request (a copy)."""
        return dict(self._by_rid.get(rid, {}))

    def requests(self) -> List[Hashable]:
        """Request ids holding at least one row, in order of their first :meth:`acquire`."""
        return list(self._by_rid)

    def free_rows(self) -> Tuple[int, ...]:
        """The free list, next row to be taken last."""
        return tuple(self._free)

    def release(self, rid: Hashable) -> List[int]:
        """Free every row of ``rid``; returns them, for :func:`jaxrope.positions.reset` (``[]`` if none)."""
        labels = self._by_rid.pop(rid, {})
        for label in labels:
            del self._row_of[rid, label]
        freed = list(labels.values())
        self._free.extend(sorted(freed, reverse=True))
        return freed
