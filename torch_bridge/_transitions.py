"""The manager's device-side transitions: jitted compositions of :mod:`jaxrope.positions`.

Each call takes the table plus one flat int32 ``meta`` vector (one host-to-device
transfer) and a static layout saying how ``meta`` splits into slots, counts and
forks. Every variable length is padded to a bucket (:func:`bucket`) so that a
steady stream of steps reuses a few compiled functions instead of tracing per step.

Padding entries use slot :data:`PAD`, past any capacity the table can reach: it reads
0 and its writes are dropped (``mode="fill"`` / ``mode="drop"`` in the core), and
unlike ``table.capacity`` it stays out of range when the table grows between a
plan and its commit.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import positions
from jaxrope.positions import PositionTable, Scheme

PAD = int(np.iinfo(np.int32).max)

# A commit layout: (segments, advanced streams, post-forks), each a bucket size; its meta is
# [slots, spans, advanced slots, amounts, fork sources, fork targets].
CommitLayout = Tuple[int, int, int]
# A plan label's layout: (views, tokens, out_index); out_index -1 makes a fresh output,
# i >= 0 writes over the i-th donated buffer. Its meta is [slots, counts].
LabelLayout = Tuple[int, int, int]


def bucket(n: int, minimum: int = 8) -> int:
    """The padded size for ``n`` entries: 0 for 0, else the next power of two ``>= minimum``."""
    if n == 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())


def padded(values: Sequence[int], size: int, fill: int = PAD) -> np.ndarray:
    """int32 ``[size]``: ``values`` then ``fill`` (``PAD`` for slots, 0 for counts)."""
    out = np.full((size,), fill, np.int32)
    out[:len(values)] = values
    return out


def pack(pieces: Sequence[Union[np.ndarray, Tuple[Sequence[int], int, int]]]) -> np.ndarray:
    """One int32 vector from ready arrays and ``(values, size, fill)`` pieces (padded)."""
    sizes = [p.shape[0] if isinstance(p, np.ndarray) else p[1] for p in pieces]
    meta = np.empty((sum(sizes),), np.int32)
    offset = 0
    for piece, size in zip(pieces, sizes):
        if isinstance(piece, np.ndarray):
            meta[offset:offset + size] = piece
        else:
            values, _, fill = piece
            n = len(values)
            meta[offset:offset + n] = values
            meta[offset + n:offset + size] = fill
        offset += size
    return meta


def commit_meta(slots, spans, adv_slots, adv_amounts, fork_src, fork_dst) -> Tuple[CommitLayout, np.ndarray]:
    layout = (bucket(len(slots)), bucket(len(adv_slots)), bucket(len(fork_src)))
    meta = pack([(slots, layout[0], PAD), (spans, layout[0], 0),
                 (adv_slots, layout[1], PAD), (adv_amounts, layout[1], 0),
                 (fork_src, layout[2], PAD), (fork_dst, layout[2], PAD)])
    return layout, meta


def commit_size(layout: CommitLayout) -> int:
    return 2 * sum(layout)


def _commit(table: PositionTable, meta: jax.Array, layout: CommitLayout, scheme: Scheme,
            block_step: int) -> PositionTable:
    segments, advanced, forks = layout
    table = positions.commit(table, meta[:segments], meta[segments:2 * segments], scheme=scheme,
                             block_step=block_step)
    offset = 2 * segments
    if advanced:
        table = positions.advance(table, meta[offset:offset + advanced],
                                  meta[offset + advanced:offset + 2 * advanced])
    offset += 2 * advanced
    if forks:
        table = positions.fork(table, meta[offset:offset + forks],
                               meta[offset + forks:offset + 2 * forks])
    return table


@functools.partial(jax.jit, static_argnames=("layout", "scheme", "block_step"))
def commit_fn(table: PositionTable, meta: jax.Array, *, layout: CommitLayout, scheme: Scheme,
              block_step: int) -> PositionTable:
    """Scheme advance of the segments, explicit advance of named streams, then post-forks."""
    return _commit(table, meta, layout, scheme, block_step)


def plan_fn(*args, real: Optional[CommitLayout], speculative: Optional[CommitLayout], forks: int,
            labels: Tuple[LabelLayout, ...], num_outs: int, preplan: bool, scheme: Scheme,
            block_step: int):
    """A deferred commit, then a step's positions, in one call.

    ``args`` = ``(*outs, table, meta)``; ``meta`` = ``[real commit, speculative commit,
    pre-fork sources, pre-fork targets, (slots, counts) per computed label]``.

    1. ``real``: the last committed step, whose device update was deferred.
    2. ``speculative`` (preplan only): the current plan's commit, which has not
       happened yet; positions are planned on top of it.
    3. the pre-forks, then the positions of each label.

    Returns ``(*written_outs, table, *fresh)``: the positions written over each donated
    buffer (in buffer order), the table to keep (after the real commit, plus the
    pre-forks unless ``preplan``), then the freshly allocated positions in label order.
    """
    outs, (table, meta) = args[:num_outs], args[num_outs:]
    offset = 0
    if real is not None:
        table = _commit(table, meta[:commit_size(real)], real, scheme, block_step)
        offset = commit_size(real)
    kept = table
    if speculative is not None:
        size = commit_size(speculative)
        table = _commit(table, meta[offset:offset + size], speculative, scheme, block_step)
        offset += size
    if forks:
        table = positions.fork(table, meta[offset:offset + forks], meta[offset + forks:offset + 2 * forks])
        offset += 2 * forks
    if not preplan:
        kept = table
    written = [None] * num_outs
    fresh = []
    for views, tokens, out_index in labels:
        slots, counts = meta[offset:offset + views], meta[offset + views:offset + 2 * views]
        offset += 2 * views
        out = outs[out_index] if out_index >= 0 else jnp.zeros((tokens,), jnp.int32)
        pos = positions.plan(table, slots, counts, out, scheme=scheme)
        if out_index >= 0:
            written[out_index] = pos
        else:
            fresh.append(pos)
    return (*written, kept, *fresh)


@jax.jit
def fork_fn(table: PositionTable, meta: jax.Array) -> PositionTable:
    """``meta`` = ``[src (F), dst (F)]``."""
    half = meta.shape[0] // 2
    return positions.fork(table, meta[:half], meta[half:])


@jax.jit
def raise_fn(table: PositionTable, meta: jax.Array) -> PositionTable:
    """``meta`` = ``[slots (S), positions (S)]``: ``counter = max(counter, position)``."""
    half = meta.shape[0] // 2
    return positions.raise_to(table, meta[:half], meta[half:])


@jax.jit
def reset_fn(table: PositionTable, slots: jax.Array) -> PositionTable:
    """Counters at ``slots`` back to 0."""
    return positions.reset(table, slots)
