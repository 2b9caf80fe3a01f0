"""The manager's device-side transitions: jitted compositions of :mod:`jaxrope.positions`.

Each call takes the table plus one flat int32 ``meta`` vector (one host-to-device
transfer) and a static ``layout`` saying how ``meta`` splits into slots, counts and
forks. Every variable length is padded to a bucket (:func:`bucket`) so that a
steady stream of steps reuses a few compiled functions instead of tracing per step.

Padding entries use slot :data:`PAD`, past any capacity the table can reach: it reads
0 and its writes are dropped (``mode="fill"`` / ``mode="drop"`` in the core), and
unlike ``table.capacity`` it stays out of range when the table grows between a
plan and its commit.
"""

from __future__ import annotations

import functools
from typing import List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import positions
from jaxrope.positions import PositionTable, Scheme

PAD = int(np.iinfo(np.int32).max)


def bucket(n: int, minimum: int = 8) -> int:
    """The padded size for ``n`` entries: 0 for 0, else the next power of two ``>= minimum``."""
    if n == 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())


def pad_into(meta: List[int], values: Sequence[int], size: int) -> None:
    """Append ``values`` then ``PAD`` up to ``size`` entries (slots)."""
    meta.extend(values)
    meta.extend([PAD] * (size - len(values)))


def zero_into(meta: List[int], values: Sequence[int], size: int) -> None:
    """Append ``values`` then zeros up to ``size`` entries (counts, amounts)."""
    meta.extend(values)
    meta.extend([0] * (size - len(values)))


# A plan layout: (forks, ((views, tokens, out_index), ...)); out_index -1 makes a fresh
# output, i >= 0 writes over the i-th donated buffer.
PlanLayout = Tuple[int, Tuple[Tuple[int, int, int], ...]]


def plan_fn(*args, layout: PlanLayout, num_outs: int, scheme: Scheme):
    """Pre-forks, then the positions of every computed plan label.

    ``args`` = ``(*outs, table, meta)``. Returns ``(*written_outs, table, *fresh)``:
    the positions written over each donated buffer (in buffer order), the table
    after the forks, then the freshly allocated positions (in label order).
    """
    outs, (table, meta) = args[:num_outs], args[num_outs:]
    forks, labels = layout
    if forks:
        table = positions.fork(table, meta[:forks], meta[forks:2 * forks])
    offset = 2 * forks
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
    return (*written, table, *fresh)


# A commit layout: (segments, advanced streams, post-forks).
CommitLayout = Tuple[int, int, int]


@functools.partial(jax.jit, static_argnames=("layout", "scheme", "block_step"))
def commit_fn(table: PositionTable, meta: jax.Array, *, layout: CommitLayout, scheme: Scheme,
              block_step: int) -> PositionTable:
    """Scheme advance of the segments, explicit advance of named streams, then post-forks."""
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


def as_meta(values: List[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)
