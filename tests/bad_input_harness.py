"""The bad-input catalogue's harness, shared by the ``tests/test_bad_inputs_*.py`` files
(and, for a core call over one table, by ``tests/test_positions.py`` and
``tests/test_guarantees.py``).

Each case (:class:`Bad`) is one bad input, the exception it must raise and a fragment of
the message that names the offending argument (or its value). Core cases (``jaxrope``,
no torch) run on a :class:`CoreEnv` and check that the objects they were given are as
before (:func:`core_raises_naming_it_and_changes_nothing`; a call over a fixed
:class:`~jaxrope.PositionTable`: :func:`raises_naming_it_and_leaves_the_table`). Bridge
cases run against a manager in a busy state (:func:`busy_manager`: two requests with
non-zero counters, a CUDA-graph buffer, a current plan and a staged preplan with a
pre-fork), through :func:`raises_naming_it_and_changes_nothing` (each catalogue's test is
:func:`bridge_catalogue_test`'s): after the failed call

1. ``state_snapshot()`` equals the one taken before (counters, slots, plans and their
   positions, graph buffers, known labels);
2. finishing the pending steps (:func:`finish`: apply_qk on the current plan, both
   commits) lands it exactly where a twin manager that never saw the bad call lands.

A few inputs are documented as reported rather than raised (an admit that cannot be
taken on, a second remove); they get their own tests with the same state checks.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import positions
from jaxrope.positions import RowMap

try:
    import torch
except ImportError:  # the core leg (Python 3.12, no torch) runs the core cases only
    torch = None

from jaxrope.testing import oracle

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (core-only leg)")

HEAD_DIM = 16
# Every random draw has its own fixed seed: a run repeats exactly.
SEEDS = itertools.count(20261201)
LABELS = ("cond", "uncond")
MAX_SEQ_LEN = 64


@dataclasses.dataclass(frozen=True)
class Bad:
    """One catalogue entry: ``call`` must raise ``error`` with ``fragment`` in its message.

    ``setup`` (bridge cases) runs on the manager and its twin before the snapshot.
    """

    name: str
    call: Callable[[Any], Any]
    error: type
    fragment: str
    setup: Optional[Callable[[Any], Any]] = None


# ------------------------------------------------------------------------------ core


class CoreEnv:
    """Fresh random inputs for the core entry points, and the state they hold."""

    def __init__(self):
        rng = np.random.default_rng(next(SEEDS))
        self.cfg = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)
        self.q = jnp.asarray(rng.standard_normal((5, 3, HEAD_DIM)), jnp.float32)
        self.k = jnp.asarray(rng.standard_normal((5, 2, HEAD_DIM)), jnp.float32)
        self.pos_ids = jnp.asarray(rng.integers(0, 1024, 5), jnp.int32)
        self.table = positions.raise_to(positions.init(8), jnp.arange(3, dtype=jnp.int32),
                                        jnp.asarray(rng.integers(1, 100, 3), jnp.int32))
        self.row_map = RowMap(4)
        for rid in ("a", "b"):
            self.row_map.acquire(rid, "text")

    def state(self):
        sm = self.row_map
        return ([np.asarray(x).tolist() for x in (self.q, self.k, self.pos_ids, self.table.counters)],
                (sm.capacity, sm.peak, len(sm), sm.free_rows(),
                 {r: sm.labels(r) for r in sm.requests()}),
                self.cfg)


def core_raises_naming_it_and_changes_nothing(case: Bad) -> None:
    """The core harness: ``case.call`` on a fresh :class:`CoreEnv` raises its error naming
    the argument, and the env's inputs and state are as before."""
    env = CoreEnv()
    before = env.state()
    with pytest.raises(case.error) as raised:
        case.call(env)
    assert case.fragment in str(raised.value), str(raised.value)
    assert env.state() == before


def raises_naming_it_and_leaves_the_table(table: Any, call: Callable[[], Any], error: type,
                                          fragment: str) -> None:
    """A core call over ``table`` (a pytree of arrays: a :class:`~jaxrope.PositionTable`)
    raises ``error`` with ``fragment`` in its message, and every leaf of ``table`` holds
    the values it held before."""
    before = [leaf.tolist() for leaf in jax.tree.leaves(table)]
    with pytest.raises(error) as raised:
        call()
    assert fragment in str(raised.value), str(raised.value)
    assert [leaf.tolist() for leaf in jax.tree.leaves(table)] == before


# ------------------------------------------------------------------------------ bridge

if torch is not None:
    from torch_bridge import (Fork, GraphBucket, GraphSlot, KVPlanOutput, KVView, PositionConfig,
                              PositionStep, PublishedPositionInfo, RopeManager, Segment,
                              StepContext)

    GRAPH = GraphSlot(GraphBucket("decode", 2, 4), 0)
    # The current plan: cond = a at 12 (3 tokens) then b at 0; uncond = b at 5 (2 tokens).
    CURRENT = PositionStep([Segment("a", "cond", 3), Segment("b", "uncond", 2),
                            Segment("b", "cond", 1)])
    CURRENT_CTX = StepContext(("a", "b"))
    CURRENT_POSITIONS = {"cond": [12, 13, 14, 0], "uncond": [5, 6]}
    # The staged plan: a's cond token, with a pre-fork cond -> uncond when it becomes current.
    STAGED = PositionStep([Segment("a", "cond", 1)])
    STAGED_CTX = StepContext(("a",), is_preplan=True, plan_results={"kv": {"attn": KVPlanOutput(
        [KVView("a", "cond", 1)], pre_forks=[Fork("a", "cond", "uncond")])}})


def busy_manager() -> "RopeManager":
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, max_position=1024)
    mgr = RopeManager(PositionConfig(rope=rope, labels=LABELS), "cpu", max_seq_len=MAX_SEQ_LEN,
                      launcher="jax")
    for rid in ("a", "b"):
        mgr.ingest_request(rid)
    mgr.apply_cached_prefix("a", None, None, None, {"cond": 10})
    mgr.admit_retrieve("b", None, None, PublishedPositionInfo({"uncond": 5}))
    graph_step = PositionStep([Segment("a", "cond", 2)])
    mgr.plan(graph_step, StepContext(("a",), graph_slot=GRAPH))
    mgr.commit(graph_step, StepContext(("a",), graph_slot=GRAPH))
    assert {k: v.tolist() for k, v in mgr.plan(CURRENT, CURRENT_CTX).items()} == CURRENT_POSITIONS
    assert mgr.plan(STAGED, STAGED_CTX)["attn"].tolist() == [15]
    return mgr


def finish(mgr):
    """Rotate with the current plan, commit it and the staged one; the resulting state."""
    gen = torch.Generator().manual_seed(next(SEEDS))
    q = torch.randn(4, 3, HEAD_DIM, generator=gen)
    k = torch.randn(4, 2, HEAD_DIM, generator=gen)
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = [oracle.rope_oracle(x.numpy(), np.asarray(CURRENT_POSITIONS["cond"]), inv_freq,
                               attention, HEAD_DIM, False) for x in (q, k)]
    mgr.apply_qk(q, k, "cond")
    np.testing.assert_allclose(q.numpy(), want[0], rtol=0, atol=2e-5)
    np.testing.assert_allclose(k.numpy(), want[1], rtol=0, atol=2e-5)
    try:
        mgr.commit(CURRENT, CURRENT_CTX)
        mgr.commit(STAGED, STAGED_CTX)
    except ValueError as e:
        return repr(e), mgr.state_snapshot()["counters"]
    state = mgr.state_snapshot()
    assert state["current"] is None and state["staged"] is None
    return {key: state[key] for key in ("counters", "slots", "requests", "row_map",
                                        "graph_buffers", "plan_labels")}


def qk(tokens=4, q_heads=3, k_heads=2, dtype=None, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(next(SEEDS))
    q = torch.randn(tokens, q_heads, head_dim, generator=gen)
    k = torch.randn(tokens, k_heads, head_dim, generator=gen)
    return (q, k) if dtype is None else (q.to(dtype), k.to(dtype))


def apply(mgr, label="cond", q=None, k=None, **kwargs):
    dq, dk = qk()
    return mgr.apply_qk(dq if q is None else q, dk if k is None else k, label, **kwargs)


def plan(mgr, segments, preplan=False, kv=None, graph=None, **step):
    results = {} if kv is None else {"kv": kv}
    return mgr.plan(PositionStep(segments, **step),
                    StepContext((), is_preplan=preplan, plan_results=results, graph_slot=graph))


def prefix(mgr, rid, prefix):
    return mgr.apply_cached_prefix(rid, None, None, None, prefix)


def rope_manager(**kwargs):
    args = dict(config=PositionConfig(rope=jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)),
                device="cpu", max_seq_len=MAX_SEQ_LEN)
    args.update(kwargs)
    return RopeManager(**args)


def seg(*records):
    return [Segment(*r) for r in records]


def raises_naming_it_and_changes_nothing(case: Bad, make: Callable[[], Any],
                                         finish_with: Callable[[Any], Any]) -> None:
    """The bridge harness: ``case.call`` on a manager from ``make`` raises its error naming
    the argument, the snapshot is unchanged, and the manager then ends (``finish_with``)
    exactly as an untouched twin does."""
    mgr, twin = make(), make()
    if case.setup is not None:
        case.setup(mgr)
        case.setup(twin)
    before = mgr.state_snapshot()
    with pytest.raises(case.error) as raised:
        case.call(mgr)
    assert case.fragment in str(raised.value), str(raised.value)
    assert mgr.state_snapshot() == before
    assert finish_with(mgr) == finish_with(twin)


def bridge_catalogue_test(cases: list, make: Callable[[], Any],
                          finish_with: Callable[[Any], Any]) -> Callable[[Bad], None]:
    """The test of one bridge catalogue: each of ``cases`` (its id ``Bad.name``) through
    :func:`raises_naming_it_and_changes_nothing` on managers from ``make``, skipped without
    torch. The catalogue's module binds it to a ``test_*`` name, which pytest collects."""

    @needs_torch
    @pytest.mark.parametrize("case", cases, ids=lambda c: c.name)
    def test(case: Bad) -> None:
        raises_naming_it_and_changes_nothing(case, make, finish_with)

    return test


# ------------------------------------------------------------------------------ M-RoPE manager

# An M-RoPE manager with a current plan: "a" decodes at counter 40 + delta -30 and "b" takes
# a 2-token prompt chunk as explicit [3, 2] positions (t, h, w rows).
MROPE_CURRENT_POSITIONS = {"cond": [[10, 0, 1], [10, 0, 2], [10, 0, 3]]}


def mrope_manager() -> "RopeManager":
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=5e5, max_position=1024, mrope_section=(4, 2, 2))
    mgr = RopeManager(PositionConfig(rope=rope, labels=LABELS), "cpu", max_seq_len=MAX_SEQ_LEN,
                      launcher="jax")
    mgr.ingest_request("a", {"cond": 40}, deltas={"cond": -30})
    mgr.ingest_request("b", deltas={"cond": -1})
    explicit = torch.tensor([[0, 1], [0, 2], [0, 3]])
    planned = plan(mgr, seg(("a", "cond", 1), ("b", "cond", 2)),
                    pos_ids=torch.cat([torch.full((3, 1), 10), explicit], dim=1))
    assert planned["cond"].tolist() == MROPE_CURRENT_POSITIONS["cond"]
    return mgr


def mrope_finish(mgr):
    gen = torch.Generator().manual_seed(next(SEEDS))
    q, k = torch.randn(3, 3, HEAD_DIM, generator=gen), torch.randn(3, 2, HEAD_DIM, generator=gen)
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = oracle.rope_oracle(q.numpy(), np.asarray(MROPE_CURRENT_POSITIONS["cond"]), inv_freq,
                              attention, HEAD_DIM, False, mgr.rope.mrope_section, False)
    mgr.apply_qk(q, k, "cond")
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)
    mgr.commit(PositionStep(seg(("a", "cond", 1), ("b", "cond", 2))), StepContext())
    state = mgr.state_snapshot()
    return {key: state[key] for key in ("counters", "slots", "deltas", "epochs", "requests")}
