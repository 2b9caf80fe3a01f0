"""Position counters as an immutable pytree, and the pure transitions a serving engine needs.

A *stream* is one (request, label) pair; it owns one *row* of a :class:`PositionTable`,
and ``counters[row]`` is its next position. Every transition takes and returns a table,
has static shapes and runs under ``jax.jit``.

The step arrays, one name each:

- ``rows``: int ``[V]``, table rows, the stream each entry is about (:class:`RowMap`
  hands them out). A KV-cache address is a *slot* (vLLM's ``slot_mapping``,
  ``slots`` of :func:`jaxrope.apply_rope_and_append_kv`), never a row.
- ``counts``: int ``[V]``, each view's tokens: what :func:`plan` numbers and what
  :func:`commit` adds, the same array for both.
- ``out``: int32 ``[N]`` (or ``[3, N]`` for M-RoPE), the buffer :func:`plan` fills.

**Padding.** Variable-length inputs (a step's views, the forks, the admitted streams)
are padded to a bucket with the row :data:`PAD`, the largest int32, which stays past
the end however far the table grows: a PAD entry reads 0, its writes are dropped, and a
PAD view has count 0. :func:`pad_rows` pads a list of rows to a bucket.

**What is checked.** Every function checks what its arguments show and raises
``TypeError`` (not a table, not an array or list) or ``ValueError`` (a dtype other
than an integer one, bool and float refused; a shape; a value) naming the argument
and its value. Always, also under ``jax.jit``
(these are static): types, ranks, integer dtypes, matching lengths. Python lists and
tuples of ints are accepted and converted to int32. Concrete values (every value
outside ``jax.jit``; a constant inside it), at their own width before the int32
cast: every row in ``[0, capacity)`` or PAD; counts, amounts, positions and epochs in
``[0, 2**31)``, deltas and depths int32; a PAD view with count 0; :func:`plan`'s
``sum(counts)`` at most ``out``'s length; no counter carried past ``2**31 - 1`` by
:func:`commit` or :func:`advance`; each row once in :func:`admit` and
:func:`rollback`. Traced values (a jitted function's arguments) are not checked, and
then: a row outside ``[0, capacity)`` acts as PAD (a row past a table that was not
grown is silently dropped), tokens past ``out``'s length are not planned while
:func:`commit` still adds the whole count, a negative count or amount moves a counter
back, a counter carried past ``2**31 - 1`` wraps, and for a row repeated in
:func:`admit` or :func:`rollback` one unspecified entry wins.

The map from (request_id, label) to row is host-side state and lives in
:class:`RowMap`, outside the pytree. It doubles its capacity when a new stream finds no
free row; the table follows with :func:`grow` (a no-op while the capacities agree; a
jitted step compiles once per capacity), and :func:`reset` takes what
:meth:`RowMap.release` returns.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxrope import positions
  >>> table = positions.init(4)
  >>> rows = jnp.array([2, 0], jnp.int32)  # two streams, 3 and 2 tokens this step
  >>> counts = jnp.array([3, 2], jnp.int32)
  >>> positions.plan(table, rows, counts, jnp.full((6,), -1, jnp.int32)).tolist()
  [0, 1, 2, 0, 1, -1]
  >>> table = positions.commit(table, rows, counts)
  >>> table.counters.tolist()
  [2, 0, 3, 0]
  >>> padded = positions.pad_rows([2, 0], 4)
  >>> padded.tolist() == [2, 0, positions.PAD, positions.PAD]
  True
  >>> positions.read(table, padded).tolist()
  [3, 2, 0, 0]
  >>> row_map = positions.RowMap(capacity=4)
  >>> [row_map.acquire(rid, "text") for rid in "abcde"]
  [0, 1, 2, 3, 4]
  >>> table = positions.grow(table, row_map.capacity)  # the map doubled: 8 rows
  >>> table = positions.commit(table, [4], [7])
  >>> table = positions.reset(table, row_map.release("c"))  # c's row 2 starts afresh
  >>> table.counters.tolist()
  [2, 0, 0, 0, 7, 0, 0, 0]
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import checks as _checks
from jaxrope import paging as _paging
from jaxrope import sharding as _sharding
from jaxrope import sums as _sums
from jaxrope.int_arrays import INT32 as _INT32
from jaxrope.int_arrays import NO_WRAP as _NO_WRAP
from jaxrope.int_arrays import IntArray
from jaxrope.int_arrays import as_int32 as _int32
from jaxrope.int_arrays import host as _host
from jaxrope.int_arrays import in_range as _in_range
from jaxrope.int_arrays import ints as _ints
from jaxrope.int_arrays import values as _values
from jaxrope.numbers import as_int
from jaxrope.row_map import RowMap

# The padding row: out of range for every table, however far it grows.
PAD = int(_INT32.max)
# Publish epochs are int32 columns, as counters.
MAX_EPOCH = int(_INT32.max)
_COLUMNS = ("counters", "deltas", "epochs")


class Scheme(enum.Enum):
    """How a view's tokens are numbered.

    SEQUENTIAL: ``counter + arange(n)``, and commit adds the count.
    BLOCK: all ``n`` tokens share ``counter``, and commit adds ``block_step`` for a
    non-empty view (block diffusion, parallel decoding of one block).

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
    """Every stream's record, one row each: int32 ``[capacity]`` columns.

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
        """Number of rows, ``counters.shape[0]``."""
        return self.counters.shape[0]


# -- argument checks: static facts always, values when concrete ---------------------


def _table(table) -> None:
    if not isinstance(table, PositionTable):
        raise TypeError(f"table must be a PositionTable, not {type(table).__name__}")


def _rows(name: str, rows, table: PositionTable, *, distinct: bool = False) -> jax.Array:
    """Rows of ``table`` (or PAD), as int32; ``distinct``: each live row once."""
    rows = _ints(name, rows)
    values = _host(rows)
    if values is None:
        _checks.rows(name, rows, table.capacity, PAD, distinct=distinct)
    else:
        bad = np.flatnonzero(((values < 0) | (values >= table.capacity)) & (values != PAD))
        if bad.size:
            row = values[bad[0]]
            grown = ("; after RowMap grew, positions.grow(table, row_map.capacity)"
                     if row >= table.capacity else "")
            raise ValueError(f"{name}[{bad[0]}]={row} is no row of the table (rows "
                             f"[0, {table.capacity}), or PAD={PAD} for padding){grown}")
        live, repeats = np.unique(values[values != PAD], return_counts=True)
        if distinct and (repeats > 1).any():
            raise ValueError(f"{name} holds row {live[repeats > 1][0]} more than once "
                             f"(one entry per stream): {values.tolist()}")
    return _int32(rows)


def _no_overflow(name: str, table: PositionTable, rows: jax.Array, amounts: jax.Array) -> None:
    """Counters plus ``amounts`` at ``rows`` stay within int32 (traced: checked mode)."""
    _checks.no_overflow(name, table.counters, rows, amounts)
    _sums.counters_fit(name, table.counters, rows, amounts, PAD)


# -- the transitions ------------------------------------------------------------------


def init(capacity: int) -> PositionTable:
    """A table of ``capacity`` rows, all at position 0."""
    if as_int(capacity, "capacity") <= 0:
        raise ValueError(f"capacity={capacity!r} must be a positive int")
    return PositionTable(jnp.zeros((capacity,), jnp.int32))


def grow(table: PositionTable, capacity: int) -> PositionTable:
    """The same records in a table of ``capacity`` rows; new rows start at 0.

    ``table`` itself when it already has ``capacity`` rows, so a serving loop calls
    ``grow(table, row_map.capacity)`` after each :meth:`RowMap.acquire` and the table
    changes shape (a jitted step compiles anew) only when the map doubled.
    """
    _table(table)
    if as_int(capacity, "capacity") < table.capacity:
        raise ValueError(f"capacity={capacity} must be >= current capacity {table.capacity}")
    if capacity == table.capacity:
        return table
    return jax.tree.map(lambda column: jnp.pad(column, (0, capacity - table.capacity)), table)


def pad_rows(rows: Sequence[int], size: int) -> np.ndarray:
    """int32 ``[size]``: ``rows`` followed by the padding row :data:`PAD`."""
    if as_int(size, "size") < 0:
        raise ValueError(f"size={size!r} must be >= 0")
    rows = _ints("rows", list(rows))
    if len(rows) > size:
        raise ValueError(f"{len(rows)} entries do not fit the bucket of {size=}")
    _in_range("rows", rows, 0, PAD)
    out = np.full((size,), PAD, np.int32)
    out[:len(rows)] = rows
    return out


def _read(table: PositionTable, rows: jax.Array, column: str = "counters") -> jax.Array:
    return getattr(table, column).at[rows].get(mode="fill", fill_value=0, **_NO_WRAP)


def read(table: PositionTable, rows: IntArray, column: str = "counters") -> jax.Array:
    """int32 values of one column (default the counters) at ``rows``; PAD reads 0."""
    _table(table)
    if column not in _COLUMNS:
        raise ValueError(f"column={column!r} must be one of {_COLUMNS}")
    return _read(table, _rows("rows", rows, table), column)


def _set(column: jax.Array, rows: jax.Array, values) -> jax.Array:
    return column.at[rows].set(values, mode="drop", **_NO_WRAP)


def plan(table: PositionTable, rows: IntArray, counts: IntArray, out: IntArray, *,
         scheme: Scheme = Scheme.SEQUENTIAL, depths: Optional[IntArray] = None) -> jax.Array:
    """Position ids for an ordered list of views, written over ``out``.

    Args:
      table: the streams.
      rows: int ``[V]``, the stream of each view, in token order (PAD for padding).
      counts: int ``[V]``, the number of tokens of each view (0 for padding); the
        same array then goes to :func:`commit`.
      out: int32 ``[N]``, or ``[3, N]`` for M-RoPE positions (rows t, h, w); tokens
        ``[sum(counts), N)`` keep these values (CUDA-graph buffers keep their tail),
        tokens before take the planned positions.
      scheme: SEQUENTIAL numbers view ``v``'s tokens ``counter[v] + arange(counts[v])``;
        BLOCK gives them all ``counter[v]``. M-RoPE adds the stream's delta, the same
        on all three rows (text after the prompt advances every row together).
      depths: int ``[N]`` or None (default): token ``t`` at ``counter + depths[t]``
        instead of the scheme's numbering (a draft tree's tokens sit at the counter
        plus their depth: :mod:`jaxrope.speculative_positions`); entries past ``sum(counts)``
        are ignored.

    Returns:
      int32, ``out``'s shape.

    Raises:
      TypeError, ValueError: as the module docstring lists; outside ``jax.jit`` also
        ``sum(counts)`` past ``N`` and a PAD view with tokens.
    """
    _table(table)
    sequential = _scheme(scheme) is Scheme.SEQUENTIAL
    rows = _rows("rows", rows, table)
    counts = _values("counts", counts, length=rows.shape[0])
    out = _ints("out", out, (1, 2))
    if out.ndim == 2 and out.shape[0] != 3:
        raise ValueError(f"out.shape={tuple(out.shape)} must be [N] or [3, N] (M-RoPE)")
    _in_range("out", out, _INT32.min, _INT32.max)
    out = _int32(out)
    if depths is not None:
        depths = _values("depths", depths, _INT32.min, _INT32.max, out.shape[-1],
                         "out.shape[-1]")
    host_rows, host_counts = _host(rows), _host(counts)
    if host_counts is not None and host_counts.sum() > out.shape[-1]:
        raise ValueError(f"counts={host_counts.tolist()} plan {host_counts.sum()} tokens, "
                         f"more than out's {out.shape[-1]} (out.shape={tuple(out.shape)})")
    if host_rows is not None and host_counts is not None:
        empty = np.flatnonzero((host_rows == PAD) & (host_counts > 0))
        if empty.size:
            raise ValueError(f"counts[{empty[0]}]={host_counts[empty[0]]} for a PAD view: "
                             f"a padding view has 0 tokens")
    _sums.plan_fits(table.counters, table.deltas if out.ndim == 2 else None, rows, counts,
                    depths, sequential, PAD)
    _checks.plan_counts(rows, counts, out.shape[-1], PAD)  # checked mode only
    ends = jnp.cumsum(counts)
    starts = ends - counts
    token = jnp.arange(out.shape[-1], dtype=jnp.int32)
    # Tokens past the views (view -1) read view 0 here; `live` masks them below.
    view = jnp.maximum(_paging.token_views(counts, out.shape[-1]), 0)
    base = _read(table, rows)
    if out.ndim == 2:
        base = base + _read(table, rows, "deltas")
    base = base[view]
    if depths is not None:
        base = base + depths
    elif sequential:
        base = base + token - starts[view]
    live = token < ends[-1] if counts.shape[0] else jnp.zeros_like(token, bool)
    if _checks.enabled():
        offsets = depths if depths is not None else (token - starts[view]) if sequential else None
        _checks.planned("out", _read(table, rows)[view],
                        _read(table, rows, "deltas")[view] if out.ndim == 2 else None,
                        offsets, live)
    base, live = jnp.broadcast_to(base, out.shape), jnp.broadcast_to(live, out.shape)
    # Every device numbers the whole step; a sharded `out` keeps its own slice.
    base, live = _sharding.like(out, base, live)
    return jnp.where(live, base, out)


def commit(table: PositionTable, rows: IntArray, counts: IntArray, *,
           scheme: Scheme = Scheme.SEQUENTIAL, block_step: int = 1) -> PositionTable:
    """Advance each view's stream by what the step consumed: the ``rows`` and ``counts``
    given to :func:`plan`.

    SEQUENTIAL adds the count; BLOCK adds ``block_step`` for each non-empty view.
    Several views of one stream add up.
    """
    _table(table)
    block = _scheme(scheme) is Scheme.BLOCK
    if isinstance(block_step, jax.core.Tracer):
        _checks.in_range("block_step", block_step, 1, int(_INT32.max))
    elif not 1 <= as_int(block_step, "block_step") <= _INT32.max:
        raise ValueError(f"block_step={block_step!r} must lie in [1, {_INT32.max}]")
    rows = _rows("rows", rows, table)
    counts = _values("counts", counts, length=rows.shape[0])
    if block:
        counts = jnp.where(counts > 0, jnp.int32(block_step), 0)
    _no_overflow("block_step" if block else "counts", table, rows, counts)
    return _advance(table, rows, counts)


def _advance(table: PositionTable, rows: jax.Array, amounts: jax.Array) -> PositionTable:
    counters = table.counters.at[rows].add(amounts, mode="drop", **_NO_WRAP)
    return dataclasses.replace(table, counters=counters)


def advance(table: PositionTable, rows: IntArray, amounts: IntArray) -> PositionTable:
    """Add explicit ``amounts`` (int ``[V]``, >= 0) to the counters at ``rows`` (a step's
    explicit advance)."""
    _table(table)
    rows = _rows("rows", rows, table)
    amounts = _values("amounts", amounts, length=rows.shape[0])
    _no_overflow("amounts", table, rows, amounts)
    return _advance(table, rows, amounts)


def fork(table: PositionTable, src_rows: IntArray, dst_rows: IntArray) -> PositionTable:
    """Copy counters and deltas ``src -> dst`` pairwise (a CFG branch starting where its
    parent is, on the parent's M-RoPE layout). Epochs stay: a fork publishes nothing.

    All sources are read before any destination is written.
    """
    _table(table)
    src_rows = _rows("src_rows", src_rows, table)
    dst_rows = _rows("dst_rows", dst_rows, table)
    if src_rows.shape != dst_rows.shape:
        raise ValueError(f"dst_rows.shape={tuple(dst_rows.shape)} must match "
                         f"src_rows.shape={tuple(src_rows.shape)}")
    return dataclasses.replace(
        table, counters=_set(table.counters, dst_rows, _read(table, src_rows)),
        deltas=_set(table.deltas, dst_rows, _read(table, src_rows, "deltas")))


def raise_to(table: PositionTable, rows: IntArray, positions: IntArray) -> PositionTable:
    """``counter = max(counter, position)``: monotonic and idempotent.

    A cached prefix moves a stream past what the cache holds (the position is
    absolute, so a repeated probe moves nothing); a position given when a request is
    ingested takes effect the same way. Published records go through :func:`admit`.
    """
    _table(table)
    rows = _rows("rows", rows, table)
    positions = _values("positions", positions, length=rows.shape[0])
    counters = table.counters.at[rows].max(positions, mode="drop", **_NO_WRAP)
    return dataclasses.replace(table, counters=counters)


def admit(table: PositionTable, rows: IntArray, positions: IntArray, deltas: IntArray,
          epochs: IntArray) -> PositionTable:
    """Take on published records ``(position, delta, epoch)`` in epoch order.

    A newer epoch wins even with a lower position (the publisher rolled back: drafts it
    had published were rejected); within an epoch the larger position wins, so a stale
    echo of this node's own publication never rewinds (admit is monotonic in an epoch); an
    older epoch changes nothing. The delta comes with the position that wins. ``rows``
    must be distinct.

    The table keeps one epoch per stream, not who rolled it back: two writers that each
    rewound a stream once both publish epoch 1, and this transition would take the
    larger position. A JAX stack admitting records of several writers orders each
    decoded :class:`jaxrope.wire.StreamRecord` against the stream's own rewinds with
    :func:`jaxrope.wire.rewind_order` on the host first and admits none that answers
    ``"conflict"`` (the torch bridge does exactly that); only one writer per stream (its
    owner, docs/handoff.md) keeps this max safe without it.

    Raises:
      ValueError: outside ``jit``, an epoch outside ``[0, 2**31 - 1]`` (int32, as the
        table's epochs); under ``jit`` unchecked.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxrope import positions
      >>> table = positions.PositionTable(jnp.array([9, 9, 9], jnp.int32))
      >>> rows = jnp.array([0, 1, 2], jnp.int32)
      >>> out = positions.admit(table, rows, jnp.array([5, 12, 4], jnp.int32),
      ...                       jnp.array([-2, -3, -4], jnp.int32), jnp.array([0, 0, 1], jnp.int32))
      >>> out.counters.tolist(), out.deltas.tolist(), out.epochs.tolist()
      ([9, 12, 4], [0, -3, -4], [0, 0, 1])
    """
    _table(table)
    rows = _rows("rows", rows, table, distinct=True)
    positions = _values("positions", positions, length=rows.shape[0])
    deltas = _values("deltas", deltas, _INT32.min, _INT32.max, rows.shape[0])
    epochs = _values("epochs", epochs, length=rows.shape[0])
    counter, delta, epoch = (_read(table, rows, c) for c in _COLUMNS)
    newer = epochs > epoch
    take = newer | ((epochs == epoch) & (positions > counter))
    return PositionTable(_set(table.counters, rows, jnp.where(take, positions, counter)),
                         _set(table.deltas, rows, jnp.where(take, deltas, delta)),
                         _set(table.epochs, rows, jnp.where(newer, epochs, epoch)))


def set_deltas(table: PositionTable, rows: IntArray, deltas: IntArray) -> PositionTable:
    """Set the M-RoPE deltas at ``rows`` (once a prompt's layout is known)."""
    _table(table)
    rows = _rows("rows", rows, table)
    deltas = _values("deltas", deltas, _INT32.min, _INT32.max, rows.shape[0])
    return dataclasses.replace(table, deltas=_set(table.deltas, rows, deltas))


def rollback(table: PositionTable, rows: IntArray, positions: IntArray) -> PositionTable:
    """``counter = min(counter, position)``: undo tokens past ``position`` (rejected drafts).

    A counter that moves back starts a new publish epoch (see :func:`admit`); one that
    stays keeps its epoch, so a rollback to where a stream already is changes nothing.
    ``rows`` must be distinct.

    Raises:
      ValueError: outside ``jit``, a stream that would move back at the last epoch,
        ``2**31 - 1`` (its next would wrap the int32 epoch); under ``jit`` unchecked.
    """
    _table(table)
    rows = _rows("rows", rows, table, distinct=True)
    positions = _values("positions", positions, length=rows.shape[0])
    counter, epoch = _read(table, rows), _read(table, rows, "epochs")
    target = jnp.minimum(counter, positions)
    moved, epoch_now = _host(target < counter), _host(epoch)
    if _checks.enabled():
        _checks.last_epoch(rows, target < counter, epoch, MAX_EPOCH)
    if moved is not None and epoch_now is not None and (moved & (epoch_now >= MAX_EPOCH)).any():
        i = int(np.argmax(moved & (epoch_now >= MAX_EPOCH)))
        raise ValueError(f"rollback of rows[{i}] at publish epoch {int(epoch_now[i])}, the "
                         f"last: epochs are int32, in [0, {MAX_EPOCH}]")
    return dataclasses.replace(
        table, counters=_set(table.counters, rows, target),
        epochs=_set(table.epochs, rows, epoch + (target < counter).astype(jnp.int32)))


def reset(table: PositionTable, rows: IntArray) -> PositionTable:
    """Every column at ``rows`` to 0: a freed or reset stream starts afresh.

    ``rows`` may be what :meth:`RowMap.release` returns (a list, possibly empty).
    """
    _table(table)
    rows = _rows("rows", rows, table)
    return jax.tree.map(lambda column: _set(column, rows, 0), table)
