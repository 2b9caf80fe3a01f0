"""The Triton step kernel (run by Triton's interpreter on CPU) against jaxrope.positions."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if os.environ.get("JAXROPE_REQUIRE_TRITON"):
    import triton  # noqa: F401  (make test: a missing Triton fails instead of skipping)
else:
    pytest.importorskip("triton")

import jax.numpy as jnp  # noqa: E402

from jaxrope import positions  # noqa: E402
from jaxrope.positions import PositionTable, Scheme  # noqa: E402
from torch_bridge._transitions import PAD  # noqa: E402
from torch_bridge.device_counters import CounterOps, DeviceCounters, label  # noqa: E402

CAPACITY = 24


def _slots(rng, n, pad_fraction=0.2):
    """Slots with repeats and some padding entries (PAD reads 0, writes are dropped)."""
    slots = rng.integers(0, CAPACITY, n).astype(np.int32)
    slots[rng.random(n) < pad_fraction] = PAD
    return slots


def _distinct(rng, n):
    return rng.permutation(CAPACITY)[:n].astype(np.int32)


def _core_ops(table: PositionTable, ops: CounterOps) -> PositionTable:
    table = positions.advance(table, jnp.asarray(ops.add_slots, jnp.int32),
                              jnp.asarray(ops.add_amounts, jnp.int32))
    table = positions.fork(table, jnp.asarray(ops.fork_src, jnp.int32),
                           jnp.asarray(ops.fork_dst, jnp.int32))
    table = positions.raise_to(table, jnp.asarray(ops.max_slots, jnp.int32),
                               jnp.asarray(ops.max_values, jnp.int32))
    return positions.reset(table, jnp.asarray(ops.zero_slots, jnp.int32))


def _random_ops(rng, forks=True) -> CounterOps:
    n_add, n_fork, n_max, n_zero = rng.integers(0, 9, 4)
    src, dst = _slots(rng, n_fork), _distinct(rng, n_fork)  # targets distinct, as validated
    if not forks:
        src = dst = src[:0]
    return CounterOps(_slots(rng, n_add), rng.integers(0, 50, n_add).astype(np.int32),
                      src, dst, _slots(rng, n_max), rng.integers(0, 400, n_max).astype(np.int32),
                      _slots(rng, n_zero))


@pytest.mark.parametrize("scheme", [Scheme.SEQUENTIAL, Scheme.BLOCK])
@pytest.mark.parametrize("seed", range(6))
def test_step_kernel_matches_the_core_transitions(scheme, seed):
    rng = np.random.default_rng(seed)
    device = torch.device("cpu")
    counters = DeviceCounters(device, CAPACITY, sequential=scheme is Scheme.SEQUENTIAL)
    start = rng.integers(0, 1000, CAPACITY).astype(np.int32)
    counters.counters.copy_(torch.from_numpy(start))
    table = PositionTable(jnp.asarray(start))
    for _ in range(4):
        real = _random_ops(rng)
        preplan = bool(rng.integers(0, 2))
        # Speculative ops only exist for a preplan (the current plan's commit).
        spec = _random_ops(rng) if preplan else CounterOps()
        spec = CounterOps(spec.add_slots, spec.add_amounts, spec.fork_src, spec.fork_dst)
        n_pre = int(rng.integers(0, 5))
        pre = (_slots(rng, n_pre), _distinct(rng, n_pre))
        labels, expected = [], []
        table = _core_ops(table, real)
        work = _core_ops(table, spec) if preplan else table
        work = positions.fork(work, jnp.asarray(pre[0]), jnp.asarray(pre[1]))
        if not preplan:
            table = work
        for _ in range(int(rng.integers(0, 3))):
            n_views = int(rng.integers(1, 7))
            slots = _distinct(rng, n_views)
            counts = rng.integers(0, 5, n_views).astype(np.int32)  # empty views included
            tail = int(rng.integers(0, 3))
            fill = rng.integers(-9, -1, int(counts.sum()) + tail).astype(np.int32)
            out = torch.from_numpy(fill.copy())
            labels.append(label(slots, counts, out))
            expected.append(positions.plan(work, jnp.asarray(slots), jnp.asarray(counts),
                                           jnp.asarray(fill), scheme=scheme))
        counters.step(real, speculative=spec, pre_forks=pre, preplan=preplan, labels=labels)
        assert counters.counters.tolist() == np.asarray(table.counters).tolist()
        for (_, _, _, out), want in zip(labels, expected):
            assert out.tolist() == np.asarray(want).tolist()


def test_a_long_prefill_is_written_by_a_second_many_program_launch():
    # Past 8192 tokens the positions come from a separate launch with several programs,
    # which must read the views the first launch copied to the device.
    counters = DeviceCounters(torch.device("cpu"), CAPACITY)
    counts = np.array([3000, 0, 7000, 2500], np.int32)
    slots = np.array([5, 6, 7, 8], np.int32)
    out = torch.full((int(counts.sum()) + 5,), -3, dtype=torch.int32)
    real = CounterOps(np.array([7, 8], np.int32), np.array([11, 40], np.int32))
    counters.step(real, labels=[label(slots, counts, out)])
    want = np.concatenate([np.arange(3000), 11 + np.arange(7000), 40 + np.arange(2500),
                           np.full(5, -3)])
    assert out.tolist() == want.tolist()
    assert counters.counters[[7, 8]].tolist() == [11, 40]


def test_grow_keeps_the_counters_and_zeroes_new_slots():
    counters = DeviceCounters(torch.device("cpu"), 4)
    counters.step(CounterOps(np.arange(4, dtype=np.int32), np.array([1, 2, 3, 4], np.int32)))
    counters.grow(9)
    assert counters.counters.tolist() == [1, 2, 3, 4, 0, 0, 0, 0, 0]
    out = torch.zeros((2,), dtype=torch.int32)
    counters.step(CounterOps(np.array([8], np.int32), np.array([6], np.int32)),
                  labels=[label(np.array([8], np.int32), np.array([2], np.int32), out)])
    assert out.tolist() == [6, 7]


def test_the_meta_ring_wraps_without_losing_steps():
    # Many small steps walk the pinned (here: plain) ring past both halves.
    counters = DeviceCounters(torch.device("cpu"), 4)
    ring = counters._rings[0]
    steps = ring.half // 512 * 2 + 3
    big = np.zeros((500,), np.int32) + PAD  # padding adds: they only take ring space
    for _ in range(steps):
        counters.step(CounterOps(np.concatenate([big, [1]]).astype(np.int32),
                                 np.concatenate([big * 0, [1]]).astype(np.int32)))
    assert counters.counters.tolist() == [0, steps, 0, 0]
