"""Position counters: every transition under jax.jit against a plain-Python model.

The model is a list of ints, one per slot; the padding slot (``capacity``) reads 0
and drops writes. Inputs come in bucketed static shapes, as a serving loop would
pad them, and a trace counter checks that new values in a bucket never retrace.
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
from jaxrope.positions import PositionTable, Scheme, SlotMap

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


def _model_read(counters, slot):
    return counters[slot] if slot < len(counters) else 0


@st.composite
def counters(draw):
    capacity = draw(st.sampled_from(CAPACITIES))
    return draw(st.lists(st.integers(0, MAX_COUNTER), min_size=capacity, max_size=capacity))


@st.composite
def padded_slots(draw, capacity, *, unique=False):
    """(padded int32 [bucket], live slots) with live ones drawn from [0, capacity)."""
    bucket = draw(st.sampled_from(VIEW_BUCKETS))
    live = draw(st.lists(st.integers(0, capacity - 1), max_size=bucket, unique=unique))
    return positions.pad_slots(live, bucket), live


def _padded_values(values, size, fill=0):
    out = np.full((size,), fill, np.int32)
    out[:len(values)] = values
    return out


@FAST
@given(data=st.data())
def test_read_returns_counters_and_zero_for_padding(data):
    state = data.draw(counters())
    slots, live = data.draw(padded_slots(len(state)))
    got = np.asarray(jit["read"](_table(state), jnp.asarray(slots)))
    assert got.dtype == np.int32
    assert list(got) == [_model_read(state, s) for s in slots]
    assert list(got[len(live):]) == [0] * (len(slots) - len(live))


@FAST
@given(data=st.data(), scheme=st.sampled_from(list(Scheme)))
def test_plan_numbers_views_in_order_and_keeps_the_padding_tail(data, scheme):
    state = data.draw(counters())
    slots, live = data.draw(padded_slots(len(state)))
    counts = data.draw(st.lists(st.integers(0, 6), min_size=len(live), max_size=len(live)))
    size = data.draw(st.sampled_from(TOKEN_BUCKETS))
    old = data.draw(st.lists(st.integers(-5, MAX_COUNTER), min_size=size, max_size=size))
    got = jit["plan"](_table(state), jnp.asarray(slots), jnp.asarray(_padded_values(counts, len(slots))),
                      jnp.asarray(old, jnp.int32), scheme=scheme)
    want = list(old)
    token = 0
    for slot, count in zip(live, counts):
        for i in range(count):
            if token < size:
                want[token] = state[slot] + (i if scheme is Scheme.SEQUENTIAL else 0)
            token += 1
    assert list(np.asarray(got)) == want


def test_plan_sequential_example():
    table = _table([10, 20, 30, 0])
    slots = jnp.asarray(positions.pad_slots([2, 0, 2], 4))
    counts = jnp.asarray([2, 3, 1, 0], jnp.int32)
    out = jnp.full((8,), -1, jnp.int32)
    got = jit["plan"](table, slots, counts, out, scheme=Scheme.SEQUENTIAL)
    assert list(np.asarray(got)) == [30, 31, 10, 11, 12, 30, -1, -1]
    got = jit["plan"](table, slots, counts, out, scheme=Scheme.BLOCK)
    assert list(np.asarray(got)) == [30, 30, 10, 10, 10, 30, -1, -1]


@FAST
@given(data=st.data(), scheme=st.sampled_from(list(Scheme)), block_step=st.integers(1, 4))
def test_commit_adds_spans_or_block_steps(data, scheme, block_step):
    state = data.draw(counters())
    slots, live = data.draw(padded_slots(len(state)))
    spans = data.draw(st.lists(st.integers(0, 9), min_size=len(slots), max_size=len(slots)))
    got = jit["commit"](_table(state), jnp.asarray(slots), jnp.asarray(spans, jnp.int32),
                        scheme=scheme, block_step=block_step)
    want = list(state)
    for slot, span in zip(live, spans):
        if scheme is Scheme.SEQUENTIAL:
            want[slot] += span
        elif span > 0:
            want[slot] += block_step
    assert list(np.asarray(got.counters)) == want


@FAST
@given(data=st.data())
def test_advance_adds_explicit_amounts_and_drops_padding(data):
    state = data.draw(counters())
    slots, live = data.draw(padded_slots(len(state)))
    amounts = data.draw(st.lists(st.integers(0, 1000), min_size=len(slots), max_size=len(slots)))
    got = jit["advance"](_table(state), jnp.asarray(slots), jnp.asarray(amounts, jnp.int32))
    want = list(state)
    for slot, amount in zip(live, amounts):
        want[slot] += amount
    assert list(np.asarray(got.counters)) == want


@FAST
@given(data=st.data())
def test_fork_reads_every_source_before_writing(data):
    state = data.draw(counters())
    capacity = len(state)
    dst, live_dst = data.draw(padded_slots(capacity, unique=True))
    live_src = data.draw(st.lists(st.integers(0, capacity - 1), min_size=len(live_dst),
                                  max_size=len(live_dst)))
    src = positions.pad_slots(live_src, len(dst))
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
    slots, live = data.draw(padded_slots(len(state), unique=op == "rollback"))
    values = data.draw(st.lists(st.integers(0, MAX_COUNTER), min_size=len(slots),
                                max_size=len(slots)))
    pick = max if op == "raise_to" else min
    want = list(state)
    for slot, value in zip(live, values):
        want[slot] = pick(want[slot], value)
    table = jit[op](_table(state), jnp.asarray(slots), jnp.asarray(values, jnp.int32))
    assert list(np.asarray(table.counters)) == want
    again = jit[op](table, jnp.asarray(slots), jnp.asarray(values, jnp.int32))
    assert list(np.asarray(again.counters)) == want


def test_raise_to_never_rewinds_on_a_stale_echo():
    table = _table([100, 7, 0, 0])
    table = jit["raise_to"](table, jnp.asarray([0, 1], jnp.int32), jnp.asarray([40, 50], jnp.int32))
    assert list(np.asarray(table.counters)) == [100, 50, 0, 0]


@FAST
@given(data=st.data())
def test_reset_zeroes_live_slots_only(data):
    state = data.draw(counters())
    slots, live = data.draw(padded_slots(len(state)))
    got = jit["reset"](_table(state), jnp.asarray(slots))
    want = [0 if i in live else c for i, c in enumerate(state)]
    assert list(np.asarray(got.counters)) == want


@FAST
@given(state=counters(), extra=st.integers(0, 24))
def test_grow_keeps_counters_and_starts_new_slots_at_zero(state, extra):
    table = positions.grow(_table(state), len(state) + extra)
    assert table.capacity == len(state) + extra
    assert list(np.asarray(table.counters)) == state + [0] * extra


def test_init_and_grow_reject_bad_capacities():
    assert list(np.asarray(positions.init(3).counters)) == [0, 0, 0]
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="capacity"):
            positions.init(bad)
    with pytest.raises(ValueError, match="capacity"):
        positions.grow(positions.init(8), 4)


def test_pad_slots_rejects_overflowing_buckets():
    assert list(positions.pad_slots([3, 1], 4)) == [3, 1, positions.PAD, positions.PAD]
    with pytest.raises(ValueError, match="bucket"):
        positions.pad_slots([0, 1, 2], 2)


def test_padding_slots_of_any_kind_read_zero_and_drop_writes():
    # PAD, one past the end and negative slots alike: -1 must not wrap to the last slot.
    table = positions.PositionTable(jnp.array([5, 6, 7], jnp.int32))
    pad = jnp.array([positions.PAD, 3, -1], jnp.int32)
    assert positions.read(table, pad).tolist() == [0, 0, 0]
    for changed in (positions.advance(table, pad, jnp.array([1, 1, 1], jnp.int32)),
                    positions.raise_to(table, pad, jnp.array([9, 9, 9], jnp.int32)),
                    positions.rollback(table, pad, jnp.array([0, 0, 0], jnp.int32)),
                    positions.reset(table, pad),
                    positions.fork(table, jnp.array([0, 1, 2], jnp.int32), pad)):
        assert changed.counters.tolist() == [5, 6, 7]


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
        slots = jnp.asarray(positions.pad_slots(list(r.integers(0, capacity, 3)), views))
        counts = jnp.asarray(list(r.integers(0, 4, 3)) + [0], jnp.int32)
        amounts = jnp.asarray(r.integers(0, 9, views), jnp.int32)
        jit["read"](table, slots)
        jit["plan"](table, slots, counts, jnp.zeros((tokens,), jnp.int32), scheme=Scheme.BLOCK)
        table = jit["commit"](table, slots, counts, scheme=Scheme.BLOCK, block_step=3)
        table = jit["advance"](table, slots, amounts)
        table = jit["fork"](table, slots, slots[::-1])
        table = jit["raise_to"](table, slots, amounts * 100)
        table = jit["rollback"](table, slots, amounts * 10)
        return jit["reset"](table, slots)

    step(int(rng.integers(1 << 30)))
    before = TRACES.copy()
    for _ in range(5):
        step(int(rng.integers(1 << 30)))
    assert TRACES == before
    # A different static argument is a new program: the counter does see traces.
    jit["commit"](_table([0] * capacity), jnp.zeros((views,), jnp.int32),
                  jnp.zeros((views,), jnp.int32), scheme=Scheme.BLOCK, block_step=5)
    assert TRACES["commit"] == before["commit"] + 1


# -- SlotMap ----------------------------------------------------------------------

RIDS = ["r0", "r1", "r2", "r3", "r4"]
LABELS = ["cond", "uncond", "draft"]
operations = st.lists(
    st.one_of(st.tuples(st.just("acquire"), st.sampled_from(RIDS), st.sampled_from(LABELS)),
              st.tuples(st.just("release"), st.sampled_from(RIDS), st.none())),
    max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops=operations, capacity=st.integers(1, 4))
def test_slot_map_against_a_dict_model(ops, capacity):
    slot_map = SlotMap(capacity)
    model = {}
    peak = 0
    for op, rid, label in ops:
        if op == "acquire":
            before_capacity, before_live = slot_map.capacity, len(slot_map)
            slot = slot_map.acquire(rid, label)
            if (rid, label) in model:
                assert slot == model[(rid, label)]
                assert slot_map.capacity == before_capacity
                continue
            # A new stream: a slot nobody holds; growth only when every slot is taken.
            assert slot not in model.values()
            if before_live < before_capacity:
                assert slot_map.capacity == before_capacity
            else:
                assert slot_map.capacity == 2 * before_capacity
            assert 0 <= slot < slot_map.capacity
            model[(rid, label)] = slot
        else:
            freed = slot_map.release(rid)
            mine = {key: s for key, s in model.items() if key[0] == rid}
            assert sorted(freed) == sorted(mine.values())
            for key in mine:
                del model[key]
        peak = max(peak, len(model))
        assert len(slot_map) == len(model)
        assert slot_map.peak == peak
        for r in RIDS:
            assert slot_map.labels(r) == {l: s for (rr, l), s in model.items() if rr == r}
            for label_ in LABELS:
                assert slot_map.find(r, label_) == model.get((r, label_))
        assert set(slot_map.requests()) == {rid for rid, _ in model}


def test_slot_map_reuses_released_slots_before_growing():
    slot_map = SlotMap(2)
    a, b = slot_map.acquire("r0", "x"), slot_map.acquire("r1", "x")
    assert {a, b} == {0, 1} and slot_map.capacity == 2
    assert slot_map.release("r0") == [a]
    assert slot_map.acquire("r2", "x") == a and slot_map.capacity == 2
    c = slot_map.acquire("r3", "x")
    assert slot_map.capacity == 4 and c in (2, 3)
    assert slot_map.peak == 3 and len(slot_map) == 3
    assert slot_map.release("unknown") == []


def test_labels_is_a_copy_and_find_creates_nothing():
    slot_map = SlotMap(4)
    slot_map.acquire("r0", "a")
    labels = slot_map.labels("r0")
    labels["b"] = 3
    assert slot_map.find("r0", "b") is None and slot_map.find("r9", "a") is None
    assert "r9" not in slot_map.requests() and len(slot_map) == 1


def test_slot_map_rejects_bad_capacity():
    for bad in (0, -3, 1.5):
        with pytest.raises(ValueError, match="capacity"):
            SlotMap(bad)


@settings(max_examples=25, deadline=None)
@given(ops=operations)
def test_a_growing_slot_map_and_its_table_stay_in_step(ops):
    # The serving pattern: acquire, grow the table when the map grew, count, release+reset.
    slot_map = SlotMap(2)
    table = positions.init(slot_map.capacity)
    model = {}
    for op, rid, label in ops:
        if op == "acquire":
            slot = slot_map.acquire(rid, label)
            if slot_map.capacity > table.capacity:
                table = positions.grow(table, slot_map.capacity)
            table = jit["advance"](table, jnp.asarray([slot], jnp.int32), jnp.asarray([1], jnp.int32))
            model[(rid, label)] = model.get((rid, label), 0) + 1
        else:
            freed = slot_map.release(rid)
            if freed:
                table = positions.reset(table, jnp.asarray(freed, jnp.int32))
            model = {key: v for key, v in model.items() if key[0] != rid}
    for (rid, label), count in model.items():
        slot = slot_map.find(rid, label)
        assert int(jit["read"](table, jnp.asarray([slot], jnp.int32))[0]) == count
    held = {slot_map.find(rid, label) for rid, label in model}
    free = [i for i in range(table.capacity) if i not in held]
    assert not np.asarray(table.counters)[free].any()


def test_scheme_by_value_matches_the_enum_and_an_unknown_scheme_is_refused():
    table = positions.raise_to(positions.init(4), jnp.array([0], jnp.int32),
                               jnp.array([7], jnp.int32))
    slots, counts = jnp.array([0], jnp.int32), jnp.array([3], jnp.int32)
    out = jnp.full((4,), -1, jnp.int32)
    for scheme in Scheme:
        assert (positions.plan(table, slots, counts, out, scheme=scheme.value).tolist()
                == positions.plan(table, slots, counts, out, scheme=scheme).tolist())
        assert (positions.commit(table, slots, counts, scheme=scheme.value, block_step=2)
                .counters.tolist() == positions.commit(table, slots, counts, scheme=scheme,
                                                       block_step=2).counters.tolist())
    with pytest.raises(ValueError, match="scheme='seq'"):
        positions.plan(table, slots, counts, out, scheme="seq")
    with pytest.raises(ValueError, match="scheme='blocks'"):
        positions.commit(table, slots, counts, scheme="blocks")
