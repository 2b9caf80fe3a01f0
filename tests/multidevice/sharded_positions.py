"""Counters under a mesh: a replicated PositionTable, a step whose tokens are sharded.

Run by tests/test_multidevice.py with 8 CPU devices. The table and the step's views
(rows, counts) are replicated; the step's tokens (q, k and the planned pos_ids) are
split over the devices. plan and commit under jit must give what they give on one
device, with no cross-device op in the compiled step, and the table stays replicated.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import aliased_parameters, collectives, mesh
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxrope as jr
from jaxrope import positions

CAPACITY = 16
TOKENS = 32
CFG = jr.RopeConfig(head_dim=64)


def _views(rng, views=6):
    """A step's padded views: distinct rows (padding PAD), counts summing below TOKENS."""
    rows = np.full(views, positions.PAD, np.int32)
    counts = np.zeros(views, np.int32)
    live = rng.integers(1, views)
    rows[:live] = rng.choice(CAPACITY, live, replace=False)
    counts[:live] = rng.multinomial(TOKENS - rng.integers(0, 8), np.ones(live) / live)
    return rows, counts


def _table(rng):
    return positions.PositionTable(jnp.asarray(rng.integers(0, 1 << 20, CAPACITY), jnp.int32))


# Token layouts of the step: over one mesh axis of 8, or over both axes of a 2 x 4 mesh.
MESHES = {"tokens_8": ((8,), ("data",), P("data")),
          "tokens_2x4": ((2, 4), ("data", "model"), P(("data", "model")))}


@pytest.mark.parametrize("layout", MESHES)
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_plan_into_a_sharded_buffer_numbers_each_slice_without_collectives(rng, axis_type,
                                                                          layout):
    shape, names, tokens_spec = MESHES[layout]
    grid = mesh(axis_type, shape, names)
    replicated = NamedSharding(grid, P())
    table, (rows, counts) = _table(rng), _views(rng)
    out = np.full(TOKENS, -7, np.int32)  # the tail past sum(counts) keeps these
    expected = positions.plan(table, jnp.asarray(rows), jnp.asarray(counts), jnp.asarray(out))
    args = (jax.device_put(table, replicated), jax.device_put(rows, replicated),
            jax.device_put(counts, replicated),
            jax.device_put(out, NamedSharding(grid, tokens_spec)))
    plan = jax.jit(positions.plan)
    assert collectives(plan.lower(*args).compile().as_text()) == []
    got = plan(*args)
    assert got.sharding.is_equivalent_to(NamedSharding(grid, tokens_spec), 1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def _step(table, q, k, rows, counts, out, backend):
    """One serving step: number the views' tokens, rotate them, advance the counters."""
    pos_ids = positions.plan(table, rows, counts, out)
    q, k = jr.apply_rope(q, k, pos_ids, CFG, backend=backend)
    return positions.commit(table, rows, counts), q, k


@functools.lru_cache(maxsize=None)
def _jitted_step(backend):
    return jax.jit(functools.partial(_step, backend=backend), donate_argnums=(0, 1, 2))


# (backend, pos_ids buffer): the buffer sharded like the tokens (a CUDA-graph buffer of
# the step) or replicated (each device then slices the planned positions it needs).
STEPS = [("xla", "sharded_buffer"), ("interpret", "sharded_buffer"),
         ("xla", "replicated_buffer")]


@pytest.mark.parametrize("backend, planned_into", STEPS)
@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_a_step_with_sharded_tokens_equals_the_single_device_step(rng, axis_type, backend,
                                                                  planned_into):
    grid = mesh(axis_type, (8,), ("data",))
    replicated, by_token = NamedSharding(grid, P()), NamedSharding(grid, P("data"))
    table, (rows, counts) = _table(rng), _views(rng)
    q = jnp.asarray(rng.standard_normal((TOKENS, 4, 64)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((TOKENS, 2, 64)), jnp.bfloat16)
    out = np.zeros(TOKENS, np.int32)
    step = _jitted_step(backend)
    expected = step(jax.tree.map(jnp.copy, table), q.copy(), k.copy(), rows, counts, out)
    args = (jax.device_put(table, replicated), jax.device_put(q, by_token),
            jax.device_put(k, by_token), jax.device_put(rows, replicated),
            jax.device_put(counts, replicated),
            jax.device_put(out, by_token if planned_into == "sharded_buffer" else replicated))
    text = step.lower(*args).compile().as_text()
    assert collectives(text) == []
    # Every column of the table, then q and k, updated in place.
    assert aliased_parameters(text) == list(range(len(jax.tree.leaves(table)) + 2))
    new_table, q2, k2 = step(*args)
    assert new_table.counters.sharding.is_fully_replicated
    assert q2.sharding.is_equivalent_to(by_token, 3)
    np.testing.assert_array_equal(np.asarray(new_table.counters),
                                  np.asarray(expected[0].counters))
    np.testing.assert_array_equal(np.asarray(q2), np.asarray(expected[1]))
    np.testing.assert_array_equal(np.asarray(k2), np.asarray(expected[2]))


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_the_table_stays_replicated_through_every_transition(rng, axis_type):
    grid = mesh(axis_type, (8,), ("data",))
    replicated = NamedSharding(grid, P())
    table = jax.device_put(_table(rng), replicated)
    rows = jax.device_put(np.array([3, 5, positions.PAD], np.int32), replicated)
    amounts = jax.device_put(np.array([4, 9, 1], np.int32), replicated)

    def every(table, rows, amounts):
        table = positions.commit(table, rows, amounts)
        table = positions.raise_to(table, rows, amounts * 1000)
        table = positions.fork(table, rows[:1], rows[1:2])
        table = positions.rollback(table, rows, amounts * 500)
        return positions.reset(positions.advance(table, rows, amounts), rows[2:])

    transitions = jax.jit(every)
    assert collectives(transitions.lower(table, rows, amounts).compile().as_text()) == []
    got = transitions(table, rows, amounts)
    assert got.counters.sharding.is_fully_replicated
    expected = every(positions.PositionTable(jnp.asarray(np.asarray(table.counters))),
                     jnp.asarray(np.asarray(rows)), jnp.asarray(np.asarray(amounts)))
    np.testing.assert_array_equal(np.asarray(got.counters), np.asarray(expected.counters))
