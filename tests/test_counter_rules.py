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

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrope import positions as core
from jaxrope.positions import Scheme

rules = pytest.importorskip("torch_bridge.streams", reason="torch_bridge needs torch")

CAPACITY = 6
SLOTS = st.integers(0, CAPACITY - 1)
OPS = ("plan", "commit", "advance", "fork", "raise_to", "rollback", "reset")


@st.composite
def operations(draw):
    op = draw(st.sampled_from(OPS))
    n = draw(st.integers(0, 5))
    slots = draw(st.lists(SLOTS, min_size=n, max_size=n))
    values = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    other = draw(st.lists(SLOTS, min_size=n, max_size=n))
    scheme = draw(st.sampled_from(list(Scheme)))
    return op, np.asarray(slots, np.int64), np.asarray(values, np.int64), np.asarray(other, np.int64), scheme


def _j(array: np.ndarray):
    return jnp.asarray(array.astype(np.int32))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(start=st.lists(st.integers(0, 30), min_size=CAPACITY, max_size=CAPACITY),
       ops=st.lists(operations(), min_size=1, max_size=12), block_step=st.integers(1, 3))
def test_numpy_rules_match_the_core_transitions(start, ops, block_step):
    table = core.PositionTable(jnp.asarray(start, jnp.int32))
    counters = np.asarray(start, np.int64)
    for op, slots, values, other, scheme in ops:
        if op == "plan":
            counts = values % 4
            want = core.plan(table, _j(slots), _j(counts), jnp.zeros((int(counts.sum()),), jnp.int32),
                             scheme=scheme)
            got = rules.plan(counters, slots, counts, scheme)
            assert got.dtype == np.int32 and got.tolist() == want.tolist(), (op, slots, counts)
            continue
        if op == "commit":
            table = core.commit(table, _j(slots), _j(values), scheme=scheme, block_step=block_step)
            rules.commit(counters, slots, values, scheme, block_step)
        elif op == "advance":
            table = core.advance(table, _j(slots), _j(values))
            rules.advance(counters, slots, values)
        elif op == "fork":
            table = core.fork(table, _j(slots), _j(other))
            rules.fork(counters, slots, other)
        elif op == "raise_to":
            table = core.raise_to(table, _j(slots), _j(values))
            rules.raise_to(counters, slots, values)
        elif op == "rollback":
            table = core.rollback(table, _j(slots), _j(values))
            rules.rollback(counters, slots, values)
        else:
            table = core.reset(table, _j(slots))
            rules.reset(counters, slots)
        assert counters.tolist() == np.asarray(table.counters).tolist(), (op, slots, values, other)


def test_fork_reads_every_source_before_writing():
    counters = np.array([1, 2, 3])
    rules.fork(counters, np.array([0, 1]), np.array([1, 0]))  # a swap
    assert counters.tolist() == [2, 1, 3]
    table = core.fork(core.PositionTable(jnp.array([1, 2, 3], jnp.int32)),
                      jnp.array([0, 1], jnp.int32), jnp.array([1, 0], jnp.int32))
    assert table.counters.tolist() == [2, 1, 3]


def test_decode_plan_of_one_token_views_is_the_counters_themselves():
    counters = np.array([7, 0, 3, 9])
    assert rules.plan(counters, np.array([3, 0, 2]), np.array([1, 1, 1]),
                      Scheme.SEQUENTIAL).tolist() == [9, 7, 3]
    # Same token total as views, but not all single tokens: must not take the shortcut.
    assert rules.plan(counters, np.array([3, 0]), np.array([0, 2]),
                      Scheme.SEQUENTIAL).tolist() == [7, 8]
