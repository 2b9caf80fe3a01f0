"""The two executors of the counter rules agree: ``jaxrope.positions`` and ``torch_bridge.streams``.

Hypothesis draws random operation sequences (plan, commit in both schemes, advance,
fork, raise_to, rollback, reset) over a small table, with repeated slots among the
operands, and applies each operation to a core :class:`jaxrope.PositionTable` and to a
numpy counter array. Every planned position and every counter must match after every
operation. The bridge never pads (its slots come from its slot map), so the operands are
live slots; the core's padding is tested in tests/test_positions.py. The manager-level
differential test (tests/test_manager_state_machine.py) runs the same comparison through
the whole ``RopeManager``.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrope import positions as core
from jaxrope import speculative_positions
from jaxrope.positions import Scheme



def _bridge_rules():
    """``torch_bridge/streams.py`` loaded from its file: it needs only numpy and jaxrope, but
    importing it through its package imports torch, which the JAX 0.11 leg (the GPU
    machine's JAX) does not install; this way both legs compare the two executors."""
    path = pathlib.Path(__file__).resolve().parents[1] / "torch_bridge" / "streams.py"
    spec = importlib.util.spec_from_file_location("torch_bridge_streams_alone", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rules = _bridge_rules()

CAPACITY = 6
SLOTS = st.integers(0, CAPACITY - 1)
OPS = ("plan", "commit", "advance", "fork", "raise_to", "admit", "set_deltas", "rollback", "reset",
       "plan_chain", "plan_tree", "plan_draft", "accept")
MAX_SEQ_LEN = 48


@st.composite
def operations(draw):
    op = draw(st.sampled_from(OPS))
    n = draw(st.integers(0, 5))
    # admit and rollback take distinct slots (one record per stream); the rest may repeat.
    unique = op in ("admit", "rollback")
    slots = draw(st.lists(SLOTS, min_size=n, max_size=n, unique=unique))
    n = len(slots)
    values = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    other = draw(st.lists(SLOTS, min_size=n, max_size=n))
    deltas = draw(st.lists(st.integers(-300, 30), min_size=n, max_size=n))
    epochs = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    scheme = draw(st.sampled_from(list(Scheme)))
    return (op, *(np.asarray(x, np.int64) for x in (slots, values, other, deltas, epochs)),
            scheme, draw(st.booleans()))


def _j(array: np.ndarray):
    return jnp.asarray(array.astype(np.int32))


def _columns(table) -> list:
    return [np.asarray(getattr(table, name)).tolist() for name in rules.Columns._fields]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.lists(st.integers(0, 30), min_size=CAPACITY, max_size=CAPACITY),
       ops=st.lists(operations(), min_size=1, max_size=12), block_step=st.integers(1, 3))
def test_numpy_rules_match_the_core_transitions(start, ops, block_step):
    table = core.PositionTable(jnp.asarray(start, jnp.int32))
    columns = rules.Columns(np.asarray(start, np.int64), np.zeros(CAPACITY, np.int64),
                            np.zeros(CAPACITY, np.int64))
    for op, slots, values, other, deltas, epochs, scheme, mrope in ops:
        if op.startswith("plan"):
            counts = values % 4
            shape = lambda n: (3, n) if mrope else (n,)  # noqa: E731
            out = jnp.zeros(shape(int(counts.sum())), jnp.int32)
            if op == "plan":
                want = core.plan(table, _j(slots), _j(counts), out, scheme=scheme)
                got = rules.plan(columns, slots, counts, scheme, mrope=mrope)
            elif op == "plan_chain":  # a chain of k drafts is a SEQUENTIAL view of k + 1
                want = speculative_positions.plan_chain(table, _j(slots), _j(counts), jnp.zeros(
                    shape(int(counts.sum()) + len(counts)), jnp.int32))
                got = rules.plan(columns, slots, counts + 1, Scheme.SEQUENTIAL, mrope=mrope)
            elif op == "plan_tree":
                depths = np.concatenate([np.zeros(0, np.int64)] + [
                    np.minimum(np.arange(c), e + 1) for c, e in zip(counts, epochs)])
                want = speculative_positions.plan_tree(table, _j(slots), _j(counts), _j(depths), out)
                got = rules.plan(columns, slots, counts, scheme, mrope=mrope, depths=depths)
            else:  # the EAGLE drafter's step 1..4, vLLM's or SGLang's numbering
                step, offset = int(epochs.sum() % 4) + 1, -int(block_step % 2)
                want, want_live = speculative_positions.plan_draft(
                    table, _j(slots), _j(counts), out, step=step, max_seq_len=MAX_SEQ_LEN,
                    offset=offset)
                got, live = rules.plan_draft(columns, slots, counts, step, offset, MAX_SEQ_LEN,
                                             mrope=mrope)
                if live is None:  # every token live
                    live = np.ones(got.shape[-1], bool)
                assert live.tolist() == want_live.tolist(), (op, slots, counts)
            assert got.dtype == np.int32 and got.tolist() == want.tolist(), (op, slots, counts)
            continue
        if op == "accept":
            table = speculative_positions.accept(table, _j(slots), _j(values))
            rules.accept(columns, slots, values)
        elif op == "commit":
            table = core.commit(table, _j(slots), _j(values), scheme=scheme, block_step=block_step)
            rules.commit(columns, slots, values, scheme, block_step)
        elif op == "advance":
            table = core.advance(table, _j(slots), _j(values))
            rules.advance(columns, slots, values)
        elif op == "fork":
            table = core.fork(table, _j(slots), _j(other))
            rules.fork(columns, slots, other)
        elif op == "raise_to":
            table = core.raise_to(table, _j(slots), _j(values))
            rules.raise_to(columns, slots, values)
        elif op == "admit":
            table = core.admit(table, _j(slots), _j(values), _j(deltas), _j(epochs))
            rules.admit(columns, slots, values, deltas, epochs)
        elif op == "set_deltas":
            table = core.set_deltas(table, _j(slots), _j(deltas))
            rules.set_deltas(columns, slots, deltas)
        elif op == "rollback":
            table = core.rollback(table, _j(slots), _j(values))
            rules.rollback(columns, slots, values)
        else:
            table = core.reset(table, _j(slots))
            rules.reset(columns, slots)
        assert [c.tolist() for c in columns] == _columns(table), (op, slots, values, other)


def test_fork_reads_every_source_before_writing():
    columns = rules.Columns(np.array([1, 2, 3]), np.array([0, -5, 0]), np.zeros(3, int))
    rules.fork(columns, np.array([0, 1]), np.array([1, 0]))  # a swap
    assert columns.counters.tolist() == [2, 1, 3] and columns.deltas.tolist() == [-5, 0, 0]
    table = core.fork(core.PositionTable(jnp.array([1, 2, 3], jnp.int32)),
                      jnp.array([0, 1], jnp.int32), jnp.array([1, 0], jnp.int32))
    assert table.counters.tolist() == [2, 1, 3]


def test_decode_plan_of_one_token_views_is_the_counters_themselves():
    columns = rules.Columns(np.array([7, 0, 3, 9]), np.array([0, 0, -2, 0]), np.zeros(4, int))
    assert rules.plan(columns, np.array([3, 0, 2]), np.array([1, 1, 1]),
                      Scheme.SEQUENTIAL).tolist() == [9, 7, 3]
    # Same token total as views, but not all single tokens: must not take the shortcut.
    assert rules.plan(columns, np.array([3, 0]), np.array([0, 2]),
                      Scheme.SEQUENTIAL).tolist() == [7, 8]
    # M-RoPE decode: counter + delta on all three rows.
    assert rules.plan(columns, np.array([2]), np.array([1]), Scheme.SEQUENTIAL,
                      mrope=True).tolist() == [[1], [1], [1]]


def test_a_rollback_starts_a_new_epoch_that_admit_takes_over_a_higher_position():
    # Node A published 20 (epoch 0) to B; A rolls back to 17 (epoch 1); B admits A's new
    # record although it is lower; A's stale record of epoch 0 then changes nothing.
    a = core.PositionTable(jnp.array([20], jnp.int32))
    b = core.admit(core.init(1), jnp.array([0], jnp.int32), a.counters, a.deltas, a.epochs)
    stale = (b.counters, b.deltas, b.epochs)
    a = core.rollback(a, jnp.array([0], jnp.int32), jnp.array([17], jnp.int32))
    assert (a.counters.tolist(), a.epochs.tolist()) == ([17], [1])
    b = core.admit(b, jnp.array([0], jnp.int32), a.counters, a.deltas, a.epochs)
    assert (b.counters.tolist(), b.epochs.tolist()) == ([17], [1])
    b = core.admit(b, jnp.array([0], jnp.int32), *stale)
    assert (b.counters.tolist(), b.epochs.tolist()) == ([17], [1])
    # A rollback that does not move the counter keeps the epoch.
    same = core.rollback(a, jnp.array([0], jnp.int32), jnp.array([30], jnp.int32))
    assert (same.counters.tolist(), same.epochs.tolist()) == ([17], [1])


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 9), min_size=0, max_size=4), data=st.data())
def test_tree_depths_of_both_executors_agree_with_a_walk_to_the_root(sizes, data):
    # Several trees in one flat layout, each token's parent earlier in its own tree.
    parents, start = [], 0
    for size in sizes:
        parents.append(-1)
        parents += [start + data.draw(st.integers(0, i - 1)) for i in range(1, size)]
        start += size
    parents = np.asarray(parents, np.int64)
    walk = []
    for t in range(len(parents)):
        depth = 0
        while parents[t] >= 0:
            t, depth = parents[t], depth + 1
        walk.append(depth)
    assert rules.tree_depths(parents).tolist() == walk
    assert speculative_positions.tree_depths(_j(parents)).tolist() == walk
