"""Position counters: every transition under jax.jit against a plain-Python model.

The model is a list of ints, one per row; the padding row (PAD) reads 0 and drops
writes. Inputs come in bucketed static shapes, as a serving loop would pad them, and
a trace counter checks that new values in a bucket never retrace. Outside jit the
transitions check their arguments' values too (rows on the table, counts that fit the
buffer, ...); the last part of this file drives those checks and what happens instead
under jit.
"""

from __future__ import annotations

import collections
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrope import positions
from jaxrope.positions import PositionTable, Scheme, RowMap

from bad_input_harness import raises_naming_it_and_leaves_the_table

CAPACITIES = (8, 16)
VIEW_BUCKETS = (4, 8)
TOKEN_BUCKETS = (16, 32)
MAX_COUNTER = 1 << 20
FAST = settings(max_examples=40, deadline=None)

TRACES: collections.Counter = collections.Counter()


def _counted(name, fn):
    def traced(*args, **kwargs):
        TRACES[name] += 1
        return fn(*args, **kwargs)
    return traced


jit = {name: jax.jit(_counted(name, getattr(positions, name)), static_argnames=static)
       for name, static in [("read", ()), ("plan", ("scheme",)),
                            ("commit", ("scheme", "block_step")), ("advance", ()), ("fork", ()),
                            ("raise_to", ()), ("rollback", ()), ("reset", ())]}


def _table(counters: List[int]) -> PositionTable:
    return PositionTable(jnp.asarray(counters, jnp.int32))


def _model_read(counters, row):
    return counters[row] if row < len(counters) else 0


@st.composite
def counters(draw):
    capacity = draw(st.sampled_from(CAPACITIES))
    return draw(st.lists(st.integers(0, MAX_COUNTER), min_size=capacity, max_size=capacity))


@st.composite
def padded_rows(draw, capacity, *, unique=False):
    """(padded int32 [bucket], live rows) with live ones drawn from [0, capacity)."""
    bucket = draw(st.sampled_from(VIEW_BUCKETS))
    live = draw(st.lists(st.integers(0, capacity - 1), max_size=bucket, unique=unique))
    return positions.pad_rows(live, bucket), live


def _padded_values(values, size, fill=0):
    out = np.full((size,), fill, np.int32)
    out[:len(values)] = values
    return out


@FAST
@given(data=st.data())
def test_read_returns_counters_and_zero_for_padding(data):
    state = data.draw(counters())
    rows, live = data.draw(padded_rows(len(state)))
    got = np.asarray(jit["read"](_table(state), jnp.asarray(rows)))
    assert got.dtype == np.int32
    assert list(got) == [_model_read(state, s) for s in rows]
    assert list(got[len(live):]) == [0] * (len(rows) - len(live))


@FAST
@given(data=st.data(), scheme=st.sampled_from(list(Scheme)))
def test_plan_numbers_views_in_order_and_keeps_the_padding_tail(data, scheme):
    state = data.draw(counters())
    rows, live = data.draw(padded_rows(len(state)))
    counts = data.draw(st.lists(st.integers(0, 6), min_size=len(live), max_size=len(live)))
    size = data.draw(st.sampled_from(TOKEN_BUCKETS))
    old = data.draw(st.lists(st.integers(-5, MAX_COUNTER), min_size=size, max_size=size))
    got = jit["plan"](_table(state), jnp.asarray(rows), jnp.asarray(_padded_values(counts, len(rows))),
                      jnp.asarray(old, jnp.int32), scheme=scheme)
    want = list(old)
    token = 0
    for row, count in zip(live, counts):
        for i in range(count):
            if token < size:
                want[token] = state[row] + (i if scheme is Scheme.SEQUENTIAL else 0)
            token += 1
    assert list(np.asarray(got)) == want


def test_plan_sequential_example():
    table = _table([10, 20, 30, 0])
    rows = jnp.asarray(positions.pad_rows([2, 0, 2], 4))
    counts = jnp.asarray([2, 3, 1, 0], jnp.int32)
    out = jnp.full((8,), -1, jnp.int32)
    got = jit["plan"](table, rows, counts, out, scheme=Scheme.SEQUENTIAL)
    assert list(np.asarray(got)) == [30, 31, 10, 11, 12, 30, -1, -1]
    got = jit["plan"](table, rows, counts, out, scheme=Scheme.BLOCK)
    assert list(np.asarray(got)) == [30, 30, 10, 10, 10, 30, -1, -1]


@FAST
@given(data=st.data(), scheme=st.sampled_from(list(Scheme)), block_step=st.integers(1, 4))
def test_commit_adds_counts_or_block_steps(data, scheme, block_step):
    state = data.draw(counters())
    rows, live = data.draw(padded_rows(len(state)))
    counts = data.draw(st.lists(st.integers(0, 9), min_size=len(rows), max_size=len(rows)))
    got = jit["commit"](_table(state), jnp.asarray(rows), jnp.asarray(counts, jnp.int32),
                        scheme=scheme, block_step=block_step)
    want = list(state)
    for row, count in zip(live, counts):
        if scheme is Scheme.SEQUENTIAL:
            want[row] += count
        elif count > 0:
            want[row] += block_step
    assert list(np.asarray(got.counters)) == want


@FAST
@given(data=st.data())
def test_advance_adds_explicit_amounts_and_drops_padding(data):
    state = data.draw(counters())
    rows, live = data.draw(padded_rows(len(state)))
    amounts = data.draw(st.lists(st.integers(0, 1000), min_size=len(rows), max_size=len(rows)))
    got = jit["advance"](_table(state), jnp.asarray(rows), jnp.asarray(amounts, jnp.int32))
    want = list(state)
    for row, amount in zip(live, amounts):
        want[row] += amount
    assert list(np.asarray(got.counters)) == want


@FAST
@given(data=st.data())
def test_fork_reads_every_source_before_writing(data):
    state = data.draw(counters())
    capacity = len(state)
    dst, live_dst = data.draw(padded_rows(capacity, unique=True))
    live_src = data.draw(st.lists(st.integers(0, capacity - 1), min_size=len(live_dst),
                                  max_size=len(live_dst)))
    src = positions.pad_rows(live_src, len(dst))
    got = jit["fork"](_table(state), jnp.asarray(src), jnp.asarray(dst))
    want = list(state)
    for s, d in zip(live_src, live_dst):
        want[d] = state[s]
    assert list(np.asarray(got.counters)) == want


def test_fork_swaps_with_old_values():
    table = _table([5, 9, 0, 0])
    got = jit["fork"](table, jnp.asarray([0, 1], jnp.int32), jnp.asarray([1, 0], jnp.int32))
    assert list(np.asarray(got.counters)) == [9, 5, 0, 0]


@FAST
@given(data=st.data(), op=st.sampled_from(["raise_to", "rollback"]))
def test_raise_to_and_rollback_are_monotonic_and_idempotent(data, op):
    state = data.draw(counters())
    # A rollback takes one entry per stream; raise_to combines repeated ones.
    rows, live = data.draw(padded_rows(len(state), unique=op == "rollback"))
    values = data.draw(st.lists(st.integers(0, MAX_COUNTER), min_size=len(rows),
                                max_size=len(rows)))
    pick = max if op == "raise_to" else min
    want = list(state)
    for row, value in zip(live, values):
        want[row] = pick(want[row], value)
    table = jit[op](_table(state), jnp.asarray(rows), jnp.asarray(values, jnp.int32))
    assert list(np.asarray(table.counters)) == want
    again = jit[op](table, jnp.asarray(rows), jnp.asarray(values, jnp.int32))
    assert list(np.asarray(again.counters)) == want


def test_raise_to_never_rewinds_on_a_stale_echo():
    table = _table([100, 7, 0, 0])
    table = jit["raise_to"](table, jnp.asarray([0, 1], jnp.int32), jnp.asarray([40, 50], jnp.int32))
    assert list(np.asarray(table.counters)) == [100, 50, 0, 0]


@FAST
@given(data=st.data())
def test_reset_zeroes_live_rows_only(data):
    state = data.draw(counters())
    rows, live = data.draw(padded_rows(len(state)))
    got = jit["reset"](_table(state), jnp.asarray(rows))
    want = [0 if i in live else c for i, c in enumerate(state)]
    assert list(np.asarray(got.counters)) == want


@FAST
@given(state=counters(), extra=st.integers(0, 24))
def test_grow_keeps_counters_and_starts_new_rows_at_zero(state, extra):
    table = positions.grow(_table(state), len(state) + extra)
    assert table.capacity == len(state) + extra
    assert list(np.asarray(table.counters)) == state + [0] * extra


def test_init_and_grow_reject_bad_capacities():
    assert list(np.asarray(positions.init(3).counters)) == [0, 0, 0]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"capacity={bad}"):
            positions.init(bad)
    for bad in (2.0, True, "8"):
        with pytest.raises(TypeError, match=f"capacity={bad!r}"):
            positions.init(bad)
        with pytest.raises(TypeError, match=f"capacity={bad!r}"):
            positions.grow(positions.init(1), bad)
    with pytest.raises(ValueError, match="capacity=4 must be >= current capacity 8"):
        positions.grow(positions.init(8), 4)


def test_pad_rows_rejects_overflowing_buckets_and_rows_outside_int32():
    assert list(positions.pad_rows([3, 1], 4)) == [3, 1, positions.PAD, positions.PAD]
    with pytest.raises(ValueError, match="bucket"):
        positions.pad_rows([0, 1, 2], 2)
    with pytest.raises(ValueError, match=r"rows\[1\]=4294967296 must lie in \[0, 2147483647\]"):
        positions.pad_rows([0, 2**32], 4)
    with pytest.raises(TypeError, match="size=2.0"):
        positions.pad_rows([0], 2.0)


def _transitions_at(rows):
    """Every transition that writes, applied at ``rows`` (three entries)."""
    three = jnp.array([1, 1, 1], jnp.int32)
    return {"advance": lambda t: positions.advance(t, rows, three),
            "commit": lambda t: positions.commit(t, rows, three),
            "raise_to": lambda t: positions.raise_to(t, rows, three * 9),
            "rollback": lambda t: positions.rollback(t, rows, three * 0),
            "admit": lambda t: positions.admit(t, rows, three * 0, three, three),
            "set_deltas": lambda t: positions.set_deltas(t, rows, three),
            "reset": lambda t: positions.reset(t, rows),
            "fork": lambda t: positions.fork(t, jnp.array([0, 1, 2], jnp.int32), rows)}


def test_pad_reads_zero_and_drops_writes():
    table = PositionTable(jnp.array([5, 6, 7], jnp.int32))
    pad = jnp.full((3,), positions.PAD, jnp.int32)
    assert positions.read(table, pad).tolist() == [0, 0, 0]
    for name, transition in _transitions_at(pad).items():
        changed = transition(table)
        assert [c.tolist() for c in jax.tree.leaves(changed)] == [[5, 6, 7], [0, 0, 0],
                                                                  [0, 0, 0]], name


def test_under_jit_every_row_off_the_table_acts_as_pad():
    # One past the end and negative rows alike: -1 must not wrap to the last row.
    table = PositionTable(jnp.array([5, 6, 7], jnp.int32))
    off = jnp.array([positions.PAD, 3, -1], jnp.int32)
    assert jax.jit(positions.read)(table, off).tolist() == [0, 0, 0]
    for name in _transitions_at(off):
        changed = jax.jit(lambda t, r: _transitions_at(r)[name](t))(table, off)
        assert changed.counters.tolist() == [5, 6, 7], name


def test_a_table_is_a_pytree():
    table = positions.init(4)
    leaves, treedef = jax.tree_util.tree_flatten(table)
    assert len(leaves) == 3 and all(leaf.dtype == jnp.int32 for leaf in leaves)
    assert jax.tree_util.tree_unflatten(treedef, leaves).capacity == 4


def test_new_values_in_a_bucket_never_retrace(rng):
    capacity, views, tokens = 8, 4, 16

    def step(seed):
        r = np.random.default_rng(seed)
        table = _table(list(r.integers(0, 1000, capacity)))
        rows = jnp.asarray(positions.pad_rows(list(r.integers(0, capacity, 3)), views))
        counts = jnp.asarray(list(r.integers(0, 4, 3)) + [0], jnp.int32)
        amounts = jnp.asarray(r.integers(0, 9, views), jnp.int32)
        jit["read"](table, rows)
        jit["plan"](table, rows, counts, jnp.zeros((tokens,), jnp.int32), scheme=Scheme.BLOCK)
        table = jit["commit"](table, rows, counts, scheme=Scheme.BLOCK, block_step=3)
        table = jit["advance"](table, rows, amounts)
        table = jit["fork"](table, rows, rows[::-1])
        table = jit["raise_to"](table, rows, amounts * 100)
        table = jit["rollback"](table, rows, amounts * 10)
        return jit["reset"](table, rows)

    step(int(rng.integers(1 << 30)))
    before = TRACES.copy()
    for _ in range(5):
        step(int(rng.integers(1 << 30)))
    assert TRACES == before
    # A different static argument is a new program: the counter does see traces.
    jit["commit"](_table([0] * capacity), jnp.zeros((views,), jnp.int32),
                  jnp.zeros((views,), jnp.int32), scheme=Scheme.BLOCK, block_step=5)
    assert TRACES["commit"] == before["commit"] + 1


# -- RowMap ----------------------------------------------------------------------

RIDS = ["r0", "r1", "r2", "r3", "r4"]
LABELS = ["cond", "uncond", "draft"]
operations = st.lists(
    st.one_of(st.tuples(st.just("acquire"), st.sampled_from(RIDS), st.sampled_from(LABELS)),
              st.tuples(st.just("release"), st.sampled_from(RIDS), st.none())),
    max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=operations, capacity=st.integers(1, 4))
def test_slot_map_against_a_dict_model(ops, capacity):
    row_map = RowMap(capacity)
    model = {}
    peak = 0
    for op, rid, label in ops:
        if op == "acquire":
            before_capacity, before_live = row_map.capacity, len(row_map)
            row = row_map.acquire(rid, label)
            if (rid, label) in model:
                assert row == model[(rid, label)]
                assert row_map.capacity == before_capacity
                continue
            # A new stream: a row nobody holds; growth only when every row is taken.
            assert row not in model.values()
            if before_live < before_capacity:
                assert row_map.capacity == before_capacity
            else:
                assert row_map.capacity == 2 * before_capacity
            assert 0 <= row < row_map.capacity
            model[(rid, label)] = row
        else:
            freed = row_map.release(rid)
            mine = {key: s for key, s in model.items() if key[0] == rid}
            assert sorted(freed) == sorted(mine.values())
            for key in mine:
                del model[key]
        peak = max(peak, len(model))
        assert len(row_map) == len(model)
        assert row_map.peak == peak
        for r in RIDS:
            assert row_map.labels(r) == {l: s for (rr, l), s in model.items() if rr == r}
            for label_ in LABELS:
                assert row_map.find(r, label_) == model.get((r, label_))
        assert set(row_map.requests()) == {rid for rid, _ in model}


def test_slot_map_reuses_released_slots_before_growing():
    row_map = RowMap(2)
    a, b = row_map.acquire("r0", "x"), row_map.acquire("r1", "x")
    assert {a, b} == {0, 1} and row_map.capacity == 2
    assert row_map.release("r0") == [a]
    assert row_map.acquire("r2", "x") == a and row_map.capacity == 2
    c = row_map.acquire("r3", "x")
    assert row_map.capacity == 4 and c in (2, 3)
    assert row_map.peak == 3 and len(row_map) == 3
    assert row_map.release("unknown") == []


def test_labels_is_a_copy_and_find_creates_nothing():
    row_map = RowMap(4)
    row_map.acquire("r0", "a")
    labels = row_map.labels("r0")
    labels["b"] = 3
    assert row_map.find("r0", "b") is None and row_map.find("r9", "a") is None
    assert "r9" not in row_map.requests() and len(row_map) == 1


def test_slot_map_rejects_bad_capacity():
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"capacity={bad}"):
            RowMap(bad)
    with pytest.raises(TypeError, match="capacity=1.5"):
        RowMap(1.5)


@settings(max_examples=25, deadline=None)
@given(ops=operations)
def test_a_growing_slot_map_and_its_table_stay_in_step(ops):
    # The serving pattern: acquire, grow the table to the map's capacity (a no-op unless
    # it doubled), count, reset what release returns.
    row_map = RowMap(2)
    table = positions.init(row_map.capacity)
    model = {}
    for op, rid, label in ops:
        if op == "acquire":
            row = row_map.acquire(rid, label)
            table = positions.grow(table, row_map.capacity)
            table = jit["advance"](table, jnp.asarray([row], jnp.int32), jnp.asarray([1], jnp.int32))
            model[(rid, label)] = model.get((rid, label), 0) + 1
        else:
            table = positions.reset(table, row_map.release(rid))
            model = {key: v for key, v in model.items() if key[0] != rid}
    for (rid, label), count in model.items():
        row = row_map.find(rid, label)
        assert int(jit["read"](table, jnp.asarray([row], jnp.int32))[0]) == count
    held = {row_map.find(rid, label) for rid, label in model}
    free = [i for i in range(table.capacity) if i not in held]
    assert not np.asarray(table.counters)[free].any()


def test_scheme_by_value_matches_the_enum_and_an_unknown_scheme_is_refused():
    table = positions.raise_to(positions.init(4), jnp.array([0], jnp.int32),
                               jnp.array([7], jnp.int32))
    rows, counts = jnp.array([0], jnp.int32), jnp.array([3], jnp.int32)
    out = jnp.full((4,), -1, jnp.int32)
    for scheme in Scheme:
        assert (positions.plan(table, rows, counts, out, scheme=scheme.value).tolist()
                == positions.plan(table, rows, counts, out, scheme=scheme).tolist())
        assert (positions.commit(table, rows, counts, scheme=scheme.value, block_step=2)
                .counters.tolist() == positions.commit(table, rows, counts, scheme=scheme,
                                                       block_step=2).counters.tolist())
    with pytest.raises(ValueError, match="scheme='seq'"):
        positions.plan(table, rows, counts, out, scheme="seq")
    with pytest.raises(ValueError, match="scheme='blocks'"):
        positions.commit(table, rows, counts, scheme="blocks")


# -- argument checks: values outside jit, static facts always ---------------------------


def test_plan_refuses_counts_past_its_buffer_outside_jit_and_truncates_under_jit():
    # 20 tokens into a 16-token buffer: numbering 16 of them and committing 20 would
    # leave the counter past any KV the step computed.
    table, rows, counts = positions.init(4), jnp.array([1], jnp.int32), jnp.array([20], jnp.int32)
    out = jnp.zeros((16,), jnp.int32)
    with pytest.raises(ValueError, match=r"counts=\[20\] plan 20 tokens, more than out's 16"):
        positions.plan(table, rows, counts, out)
    assert jax.jit(positions.plan)(table, rows, counts, out).tolist() == list(range(16))
    assert jax.jit(positions.commit)(table, rows, counts).counters.tolist() == [0, 20, 0, 0]


def test_a_row_past_a_table_that_was_not_grown_is_refused_outside_jit_and_dropped_under_jit():
    row_map = RowMap(2)
    table = positions.init(row_map.capacity)
    rows = [row_map.acquire(rid, "text") for rid in "abc"]  # the map doubled to 4
    assert rows == [0, 1, 2] and row_map.capacity == 4
    with pytest.raises(ValueError, match=r"rows\[2\]=2 is no row of the table .*positions\.grow"):
        positions.commit(table, rows, [1, 1, 1])
    # Under jit nothing can look at the values: the write to row 2 is lost.
    assert jax.jit(positions.commit)(table, jnp.asarray(rows), jnp.ones(3, jnp.int32)
                                     ).counters.tolist() == [1, 1]
    table = positions.commit(positions.grow(table, row_map.capacity), rows, [1, 1, 1])
    assert table.counters.tolist() == [1, 1, 1, 0]


def test_python_lists_give_what_int32_arrays_give():
    table = PositionTable(jnp.array([3, 0, 9, 4], jnp.int32), jnp.array([0, -2, 0, 0], jnp.int32))
    rows, counts, values = [2, 0, positions.PAD], [2, 1, 0], [7, 1, 5]
    as_arrays = [jnp.asarray(x, jnp.int32) for x in (rows, counts, values)]
    calls = [
        lambda r, c, v: positions.read(table, r),
        lambda r, c, v: positions.plan(table, r, c, [-1] * 5),
        lambda r, c, v: positions.plan(table, r, c, [[-1] * 4] * 3, depths=[0, 1, 0, 0]),
        lambda r, c, v: positions.commit(table, r, c).counters,
        lambda r, c, v: positions.advance(table, r, v).counters,
        lambda r, c, v: positions.raise_to(table, r, v).counters,
        lambda r, c, v: positions.rollback(table, r, v).epochs,
        lambda r, c, v: positions.admit(table, r, v, c, c).deltas,
        lambda r, c, v: positions.set_deltas(table, r, v).deltas,
        lambda r, c, v: positions.fork(table, r, r[::-1]).counters,
        lambda r, c, v: positions.reset(table, r).counters,
    ]
    for call in calls:
        assert np.asarray(call(rows, counts, values)).tolist() == \
            np.asarray(call(*as_arrays)).tolist()


def test_reset_takes_what_slot_map_release_returns():
    row_map = RowMap(4)
    table = positions.init(row_map.capacity)
    rows = [row_map.acquire("a", label) for label in ("text", "image")]
    rows.append(row_map.acquire("b", "text"))
    table = positions.admit(table, rows, [5, 6, 7], [0, -3, 0], [1, 1, 1])
    table = positions.reset(table, row_map.release("a"))  # a list of a's two rows
    assert [c.tolist() for c in jax.tree.leaves(table)] == [[0, 0, 7, 0], [0] * 4, [0, 0, 1, 0]]
    assert positions.reset(table, row_map.release("gone")) is not None  # [] frees nothing
    assert positions.reset(table, row_map.release("gone")).counters.tolist() == [0, 0, 7, 0]


def test_growing_with_the_slot_map_compiles_a_step_once_per_capacity(rng):
    traces = collections.Counter()

    @jax.jit
    def step(table, rows, counts):
        traces[table.capacity] += 1
        out = positions.plan(table, rows, counts, jnp.zeros((8,), jnp.int32))
        return positions.commit(table, rows, counts), out

    row_map = RowMap(2)
    table = positions.init(row_map.capacity)
    live = {}
    for i in range(40):
        rid = f"r{i}"
        row_map.acquire(rid, "text")
        live[rid] = 0
        if rng.random() < 0.3:
            gone = str(rng.choice(sorted(live)))
            table = positions.reset(table, row_map.release(gone))
            del live[gone]
        table = positions.grow(table, row_map.capacity)
        batch = sorted(live)[:4]
        counts = [int(n) for n in rng.integers(0, 3, len(batch))]
        rows = positions.pad_rows(row_map.lookup(batch, ["text"] * len(batch)), 4)
        table, _ = step(table, jnp.asarray(rows), jnp.asarray(counts + [0] * (4 - len(batch)),
                                                               jnp.int32))
        for rid, n in zip(batch, counts):
            live[rid] += n
    assert set(traces) == {2, 4, 8, 16, 32} and set(traces.values()) == {1}
    for rid, count in live.items():
        assert int(positions.read(table, [row_map.find(rid, "text")])[0]) == count


def test_grow_to_the_same_capacity_is_the_table_itself():
    table = positions.init(4)
    assert positions.grow(table, 4) is table


_T = PositionTable(jnp.array([3, 0, 2**31 - 2, 0], jnp.int32))
_R = jnp.array([0, 1], jnp.int32)
_V = jnp.array([1, 2], jnp.int32)
_OUT = jnp.zeros((4,), jnp.int32)

# (name, call, error, fragment of the message naming the argument and its value).
BAD_ARGUMENTS = [
    ("table of the wrong type", lambda: positions.read({"counters": _V}, _R), TypeError,
     "table must be a PositionTable, not dict"),
    ("float rows", lambda: positions.read(_T, _R.astype(jnp.float32)), ValueError,
     "rows.dtype=float32 must be an integer dtype"),
    ("bool counts", lambda: positions.plan(_T, _R, jnp.array([True, False]), _OUT), ValueError,
     "counts.dtype=bool"),
    ("rows as a string", lambda: positions.reset(_T, "0"), TypeError,
     "rows must be an integer array or a list of ints, not str"),
    ("2-D rows", lambda: positions.reset(_T, _R[None]), ValueError,
     "rows.shape=(1, 2) must have 1 dims"),
    ("counts of another length", lambda: positions.commit(_T, _R, _V[:1]), ValueError,
     "counts.shape=(1,) must be (2,), as rows.shape"),
    ("negative count", lambda: positions.plan(_T, _R, [1, -1], _OUT), ValueError,
     "counts[1]=-1 must lie in [0, 2147483647]"),
    ("negative row", lambda: positions.read(_T, [-1]), ValueError,
     "rows[0]=-1 is no row of the table (rows [0, 4), or PAD=2147483647 for padding)"),
    ("an int64 row that int32 would wrap onto row 1",
     lambda: positions.advance(_T, np.array([2**32 + 1]), [1]), ValueError, "rows[0]=4294967297"),
    ("uint64 depths that int32 would wrap to -1",
     lambda: positions.plan(_T, _R, [1, 1], _OUT, depths=np.array([0, 2**64 - 1, 0, 0], np.uint64)),
     ValueError, "depths[1]=18446744073709551615 must lie in [-2147483648, 2147483647]"),
    ("depths shorter than out", lambda: positions.plan(_T, _R, _V, _OUT, depths=[0, 1]),
     ValueError, "depths.shape=(2,) must be (4,), as out.shape[-1]"),
    ("out of 2 rows", lambda: positions.plan(_T, _R, _V, jnp.zeros((2, 4), jnp.int32)), ValueError,
     "out.shape=(2, 4) must be [N] or [3, N]"),
    ("a PAD view with tokens", lambda: positions.plan(_T, [0, positions.PAD], _V, _OUT), ValueError,
     "counts[1]=2 for a PAD view"),
    ("a commit carrying a counter past int32", lambda: positions.commit(_T, [2], [3]), ValueError,
     "counts would carry row 2 from 2147483646 to 2147483649"),
    ("a negative advance", lambda: positions.advance(_T, _R, [1, -1]), ValueError,
     "amounts[1]=-1"),
    ("block_step 0", lambda: positions.commit(_T, _R, _V, scheme="block", block_step=0),
     ValueError, "block_step=0 must lie in [1, 2147483647]"),
    ("block_step as a float", lambda: positions.commit(_T, _R, _V, block_step=1.0), TypeError,
     "block_step=1.0"),
    ("rollback of one row twice", lambda: positions.rollback(_T, [1, 1], _V), ValueError,
     "rows holds row 1 more than once"),
    ("admit of one row twice", lambda: positions.admit(_T, [0, 0], _V, _V, _V), ValueError,
     "rows holds row 0 more than once"),
    ("admit of a negative epoch", lambda: positions.admit(_T, _R, _V, _V, [0, -1]), ValueError,
     "epochs[1]=-1"),
    ("raise_to a negative position", lambda: positions.raise_to(_T, _R, [-5, 0]), ValueError,
     "positions[0]=-5"),
    ("fork of unequal lengths", lambda: positions.fork(_T, _R, _R[:1]), ValueError,
     "dst_rows.shape=(1,) must match src_rows.shape=(2,)"),
    ("fork to a row off the table", lambda: positions.fork(_T, _R, [0, 4]), ValueError,
     "dst_rows[1]=4 is no row"),
    ("read of an unknown column", lambda: positions.read(_T, _R, "positions"), ValueError,
     "column='positions' must be one of"),
]


@pytest.mark.parametrize("case", BAD_ARGUMENTS, ids=lambda c: c[0])
def test_a_bad_argument_raises_naming_it_and_its_value(case):
    _, call, error, fragment = case
    raises_naming_it_and_leaves_the_table(_T, call, error, fragment)


def test_under_jit_static_facts_are_checked_and_values_are_not():
    with pytest.raises(ValueError, match="counts.dtype=float32"):
        jax.jit(positions.commit)(_T, _R, _V.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"counts.shape=\(1,\) must be \(2,\)"):
        jax.jit(positions.commit)(_T, _R, _V[:1])
    # A negative count is not seen: it moves the counter back.
    assert jax.jit(positions.commit)(_T, _R, jnp.array([-3, 0], jnp.int32)).counters[0] == 0
    # A counter carried past int32 wraps.
    assert jax.jit(positions.advance)(_T, jnp.array([2], jnp.int32), jnp.array([3], jnp.int32)
                                      ).counters[2] == -2**31 + 1
