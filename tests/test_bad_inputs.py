"""Bad input, catalogued: every public entry point refuses it loudly and changes nothing.

Each case is one bad input, the exception it must raise and a fragment of the message
that names the offending argument (or its value). Core cases (``jaxrope``, no torch)
check that the objects they were given are as before. Bridge cases run against a
manager in a busy state: two requests with non-zero counters, a CUDA-graph buffer, a
current plan and a staged preplan with a pre-fork. After the failed call:

1. ``state_snapshot()`` equals the one taken before (counters, slots, plans and their
   positions, graph buffers, known labels);
2. finishing the pending steps (apply_qk on the current plan, both commits) lands it
   exactly where a twin manager that never saw the bad call lands.

A few inputs are documented as reported rather than raised (an admit that cannot be
taken on, a second remove); they get their own test with the same state checks.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import positions
from jaxrope.positions import SlotMap

try:
    import torch
except ImportError:  # the core leg (Python 3.12, no torch) runs the core cases only
    torch = None

from jaxrope.testing import oracle

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (core-only leg)")

HEAD_DIM = 16
# Every random draw has its own fixed seed: a run repeats exactly.
_SEEDS = itertools.count(20261201)
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
        rng = np.random.default_rng(next(_SEEDS))
        self.cfg = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)
        self.q = jnp.asarray(rng.standard_normal((5, 3, HEAD_DIM)), jnp.float32)
        self.k = jnp.asarray(rng.standard_normal((5, 2, HEAD_DIM)), jnp.float32)
        self.pos_ids = jnp.asarray(rng.integers(0, 1024, 5), jnp.int32)
        self.table = positions.raise_to(positions.init(8), jnp.arange(3, dtype=jnp.int32),
                                        jnp.asarray(rng.integers(1, 100, 3), jnp.int32))
        self.slot_map = SlotMap(4)
        for rid in ("a", "b"):
            self.slot_map.acquire(rid, "text")

    def state(self):
        sm = self.slot_map
        return ([np.asarray(x).tolist() for x in (self.q, self.k, self.pos_ids, self.table.counters)],
                (sm.capacity, sm.peak, len(sm), sm.free_slots(),
                 {r: sm.labels(r) for r in sm.requests()}),
                self.cfg)


def _rope(env, **changes):
    args = dict(q=env.q, k=env.k, pos_ids=env.pos_ids, cfg=env.cfg)
    args.update(changes)
    backend = args.pop("backend", "auto")
    return jr.apply_rope(args["q"], args["k"], args["pos_ids"], args["cfg"], backend=backend)


CORE_CASES = [
    Bad("config odd head_dim", lambda e: jr.RopeConfig(head_dim=7), ValueError, "head_dim=7"),
    Bad("config rotary_dim > head_dim", lambda e: jr.RopeConfig(head_dim=16, rotary_dim=18),
        ValueError, "rotary_dim=18"),
    Bad("config NaN theta", lambda e: jr.RopeConfig(head_dim=16, theta=float("nan")), ValueError,
        "theta=nan"),
    Bad("config negative theta", lambda e: jr.RopeConfig(head_dim=16, theta=-1.0), ValueError,
        "theta=-1.0"),
    Bad("config zero max_position", lambda e: jr.RopeConfig(head_dim=16, max_position=0),
        ValueError, "max_position=0"),
    Bad("config max_position past the accurate range",
        lambda e: jr.RopeConfig(head_dim=16, max_position=2**25), ValueError, "max_position=33554432"),
    Bad("config scaling given as a string", lambda e: jr.RopeConfig(head_dim=16, scaling="linear"),
        TypeError, "scaling='linear'"),
    Bad("config interleave given as an int", lambda e: jr.RopeConfig(head_dim=16, interleave=1),
        TypeError, "interleave=1"),
    Bad("config head_dim given as a string", lambda e: jr.RopeConfig(head_dim="128"),
        TypeError, "head_dim='128'"),
    Bad("Linear factor negative", lambda e: jr.Linear(factor=-2.0),
        ValueError, "Linear.factor=-2.0"),
    Bad("Llama3 high_freq_factor <= low_freq_factor",
        lambda e: jr.Llama3(low_freq_factor=4.0, high_freq_factor=1.0), ValueError,
        "Llama3.high_freq_factor=1.0"),
    Bad("Yarn zero factor", lambda e: jr.Yarn(factor=0, original_max_position=4096), ValueError,
        "Yarn.factor=0"),
    Bad("LongRope factors of the wrong length",
        lambda e: jr.RopeConfig(head_dim=16, scaling=jr.LongRope((1.0,) * 3, (1.0,) * 3, 4096)),
        ValueError, "LongRope.short_factor"),
    Bad("from_hf unknown rope type",
        lambda e: jr.RopeConfig.from_hf({"model_type": "llama", "head_dim": 64,
                                         "rope_scaling": {"rope_type": "bogus"}}),
        ValueError, "rope_type='bogus'"),
    Bad("from_hf partial_rotary_factor > 1",
        lambda e: jr.RopeConfig.from_hf({"model_type": "phi3", "head_dim": 64,
                                         "partial_rotary_factor": 1.5}),
        ValueError, "partial_rotary_factor=1.5"),
    Bad("from_hf given a list", lambda e: jr.RopeConfig.from_hf([("head_dim", 64)]), TypeError,
        "config must be a dict"),
    Bad("frequencies at a negative seq_len", lambda e: e.cfg.frequencies(seq_len=-1), ValueError,
        "seq_len=-1"),
    Bad("apply_rope q of rank 2", lambda e: _rope(e, q=e.q[:, 0]), ValueError, "q.shape=(5, 16)"),
    Bad("apply_rope integer q", lambda e: _rope(e, q=e.q.astype(jnp.int32)),
        ValueError, "q.dtype=int32"),
    Bad("apply_rope k head_dim differs from cfg", lambda e: _rope(e, k=e.k[..., :8]), ValueError,
        "k.shape[2]=8"),
    Bad("apply_rope k with fewer tokens", lambda e: _rope(e, k=e.k[:4]),
        ValueError, "k.shape[0]=4"),
    Bad("apply_rope k dtype differs from q", lambda e: _rope(e, k=e.k.astype(jnp.bfloat16)),
        ValueError, "k.dtype=bfloat16"),
    Bad("apply_rope pos_ids of the wrong length", lambda e: _rope(e, pos_ids=e.pos_ids[:3]),
        ValueError, "pos_ids.shape=(3,)"),
    Bad("apply_rope float pos_ids", lambda e: _rope(e, pos_ids=e.pos_ids.astype(jnp.float32)),
        ValueError, "pos_ids.dtype=float32"),
    Bad("apply_rope negative position", lambda e: _rope(e, pos_ids=e.pos_ids.at[2].set(-1)),
        ValueError, "pos_ids must lie in [0, 1024)"),
    Bad("apply_rope position at max_position", lambda e: _rope(e, pos_ids=e.pos_ids.at[0].set(1024)),
        ValueError, "pos_ids must lie in [0, 1024)"),
    Bad("apply_rope cfg of the wrong type", lambda e: _rope(e, cfg={"head_dim": 16}), TypeError,
        "cfg must be a RopeConfig"),
    Bad("apply_rope q as a list", lambda e: _rope(e, q=[[[0.5] * 16]]),
        TypeError, "q must be an array"),
    Bad("apply_rope unknown backend", lambda e: _rope(e, backend="cuda"),
        ValueError, "backend='cuda'"),
    Bad("apply_rope pallas backend off GPU", lambda e: _rope(e, backend="pallas"),
        NotImplementedError,
        "backend='pallas'"),
    Bad("positions.init zero capacity", lambda e: positions.init(0), ValueError, "capacity=0"),
    Bad("positions.grow to a smaller capacity", lambda e: positions.grow(e.table, 4), ValueError,
        "capacity=4"),
    Bad("SlotMap zero capacity", lambda e: SlotMap(0), ValueError, "capacity=0"),
    Bad("pad_slots past its bucket", lambda e: positions.pad_slots([1, 2, 3], 2), ValueError,
        "bucket of size=2"),
]


@pytest.mark.parametrize("case", CORE_CASES, ids=lambda c: c.name)
def test_core_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    env = CoreEnv()
    if case.name.startswith("apply_rope pallas") and jnp.zeros(()).devices().pop().platform == "gpu":
        pytest.skip("the Pallas backend is available on this GPU")
    before = env.state()
    with pytest.raises(case.error) as raised:
        case.call(env)
    assert case.fragment in str(raised.value), str(raised.value)
    assert env.state() == before


# ------------------------------------------------------------------------------ bridge

if torch is not None:
    from torch_bridge import (EngineInfo, Fork, GraphBucket, GraphSlot, KVPlanOutput, KVView,
                              PositionConfig, PositionManager, PositionStep, PublishedPositionInfo,
                              ResourceSpec, RopeManager, Segment, StepContext)

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
    gen = torch.Generator().manual_seed(next(_SEEDS))
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
    return {key: state[key] for key in ("counters", "slots", "requests", "slot_map",
                                        "graph_buffers", "plan_labels")}


def _qk(tokens=4, q_heads=3, k_heads=2, dtype=None, head_dim=HEAD_DIM):
    gen = torch.Generator().manual_seed(next(_SEEDS))
    q = torch.randn(tokens, q_heads, head_dim, generator=gen)
    k = torch.randn(tokens, k_heads, head_dim, generator=gen)
    return (q, k) if dtype is None else (q.to(dtype), k.to(dtype))


def _apply(mgr, label="cond", q=None, k=None, **kwargs):
    dq, dk = _qk()
    return mgr.apply_qk(dq if q is None else q, dk if k is None else k, label, **kwargs)


def _plan(mgr, segments, preplan=False, kv=None, graph=None, **step):
    results = {} if kv is None else {"kv": kv}
    return mgr.plan(PositionStep(segments, **step),
                    StepContext((), is_preplan=preplan, plan_results=results, graph_slot=graph))


def _prefix(mgr, rid, prefix):
    return mgr.apply_cached_prefix(rid, None, None, None, prefix)


def _rope_manager(**kwargs):
    args = dict(config=PositionConfig(rope=jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)),
                device="cpu", max_seq_len=MAX_SEQ_LEN)
    args.update(kwargs)
    return RopeManager(**args)


def _seg(*records):
    return [Segment(*r) for r in records]


def _bridge_cases():
    S = _seg
    cases = [
        # construction
        Bad("PositionConfig with no labels", lambda m: PositionConfig(labels=()),
            ValueError, "labels=()"),
        Bad("PositionConfig with a repeated label", lambda m: PositionConfig(labels=("a", "a")),
            ValueError, "labels=('a', 'a')"),
        Bad("PositionConfig block_step 0", lambda m: PositionConfig(block_step=0), ValueError,
            "block_step=0"),
        Bad("PositionConfig labels given as one string", lambda m: PositionConfig(labels="text"),
            TypeError, "labels='text' must be a sequence of strings"),
        Bad("PositionConfig block_step as a float", lambda m: PositionConfig(block_step=2.0),
            TypeError, "block_step=2.0"),
        Bad("PositionConfig rope given as a dict", lambda m: PositionConfig(rope={"head_dim": 64}),
            TypeError, "rope={'head_dim': 64}"),
        Bad("PositionConfig scheme as a string", lambda m: PositionConfig(scheme="block"),
            TypeError,
            "scheme='block'"),
        Bad("PositionConfig empty kv_resource", lambda m: PositionConfig(kv_resource=""),
            ValueError,
            "kv_resource=''"),
        Bad("manager config of the wrong type", lambda m: _rope_manager(config={"labels": ("a",)}),
            TypeError, "config must be"),
        Bad("manager max_seq_len 0", lambda m: _rope_manager(max_seq_len=0),
            ValueError, "max_seq_len=0"),
        Bad("manager max_seq_len past rope.max_position", lambda m: _rope_manager(max_seq_len=2048),
            ValueError, "max_seq_len=2048"),
        Bad("manager max_seq_len past int32 counters",
            lambda m: PositionManager(PositionConfig(), "cpu", max_seq_len=2**40), ValueError,
            "max_seq_len=1099511627776"),
        Bad("manager head_dim differs from rope.head_dim", lambda m: _rope_manager(head_dim=32),
            ValueError, "head_dim=32"),
        Bad("manager integer dtype", lambda m: _rope_manager(dtype=torch.int8),
            ValueError, "dtype=torch.int8"),
        Bad("manager unknown device", lambda m: _rope_manager(device="banana"),
            ValueError, "device='banana'"),
        Bad("manager CUDA device that does not exist", lambda m: _rope_manager(device="cuda:99"),
            ValueError, "device='cuda:99'"),
        Bad("manager unknown launcher", lambda m: _rope_manager(launcher="fast"), ValueError,
            "launcher='fast'"),
        Bad("manager unknown backend", lambda m: _rope_manager(backend="cuda"),
            ValueError, "backend='cuda'"),
        Bad("manager allow_copy as a string", lambda m: _rope_manager(allow_copy="no"), TypeError,
            "allow_copy='no'"),
        Bad("build from a spec of the wrong type", lambda m: RopeManager.build("position", EngineInfo("cpu")),
            TypeError, "spec must be a ResourceSpec"),
        Bad("build with engine info of the wrong type",
            lambda m: RopeManager.build(ResourceSpec("p", PositionConfig()), {"device": "cpu"}),
            TypeError, "info must be an EngineInfo"),
        # requests
        Bad("ingest an unhashable rid", lambda m: m.ingest_request(["c"]), TypeError, "rid=['c']"),
        Bad("ingest overrides naming an unknown label", lambda m: m.ingest_request("c", {"image": 1}),
            ValueError, "label='image'"),
        Bad("ingest a negative override", lambda m: m.ingest_request("c", {"cond": -1}), ValueError,
            "overrides['cond']=-1"),
        Bad("ingest an override past max_seq_len", lambda m: m.ingest_request("a", {"cond": 65}),
            ValueError, "overrides['cond']=65"),
        Bad("ingest a float override", lambda m: m.ingest_request("c", {"cond": 2.0}), ValueError,
            "overrides['cond']=2.0"),
        Bad("ingest overrides as a list of pairs", lambda m: m.ingest_request("c", [("cond", 3)]),
            ValueError, "overrides=[('cond', 3)]"),
        Bad("position of an unknown request", lambda m: m.position("ghost", "cond"),
            ValueError, "'ghost'"),
        Bad("position of an unknown label", lambda m: m.position("a", "image"),
            ValueError, "label='image'"),
        Bad("position of an unhashable rid", lambda m: m.position(["a"], "cond"),
            TypeError, "rid=['a']"),
        Bad("reset an unknown request", lambda m: m.reset_request("ghost"), ValueError, "'ghost'"),
        Bad("reset with free given as a string", lambda m: m.reset_request("a", free="yes"),
            TypeError,
            "free='yes'"),
        Bad("remove an unhashable rid", lambda m: m.remove_request(["a"]), TypeError, "rid=['a']"),
        Bad("ingest M-RoPE deltas into a 1-D manager", lambda m: m.ingest_request("c", deltas={"cond": -4}),
            ValueError, "M-RoPE deltas need an M-RoPE config"),
        Bad("rollback of an unknown request", lambda m: m.rollback("ghost", "cond", 1), ValueError,
            "'ghost'"),
        Bad("rollback of an unknown label", lambda m: m.rollback("b", "image", 1), ValueError,
            "label='image'"),
        Bad("rollback to a negative position", lambda m: m.rollback("b", "uncond", -1), ValueError,
            "to_position['uncond']=-1"),
        Bad("rollback to past max_seq_len", lambda m: m.rollback("b", "uncond", 65), ValueError,
            "to_position['uncond']=65"),
        Bad("rollback of a stream in the current plan", lambda m: m.rollback("a", "cond", 3),
            ValueError, "in a plan not yet committed"),
        # plan
        Bad("plan a request never ingested", lambda m: _plan(m, S(("a", "cond", 1), ("ghost", "cond", 1))),
            ValueError, "'ghost'"),
        Bad("plan an unknown label", lambda m: _plan(m, S(("a", "image", 1))),
            ValueError, "label='image'"),
        Bad("plan an unhashable label", lambda m: _plan(m, S(("a", ["cond"], 1))), TypeError,
            "label=['cond']"),
        Bad("plan a negative span", lambda m: _plan(m, S(("a", "cond", -1))), ValueError,
            "plan label 'cond' must be >= 0"),
        Bad("plan a float span", lambda m: _plan(m, S(("a", "cond", 1.5))), ValueError,
            "plan label 'cond' must be ints"),
        Bad("plan a bool span", lambda m: _plan(m, S(("a", "cond", True))), ValueError,
            "plan label 'cond' must be ints"),
        Bad("plan a segment that is not a triple", lambda m: _plan(m, [("a", "cond")]), TypeError,
            "(request_id, label, count)"),
        Bad("plan a step of the wrong type", lambda m: m.plan([Segment("a", "cond", 1)], StepContext()),
            TypeError, "step must be a PositionStep"),
        Bad("plan a context of the wrong type", lambda m: m.plan(PositionStep(S(("a", "cond", 1))), {}),
            TypeError, "ctx must be a StepContext"),
        Bad("plan positions past max_seq_len", lambda m: _plan(m, S(("a", "cond", 53))), ValueError,
            "('a', 'cond') of plan label 'cond' at position 12 with 53 tokens passes max_seq_len=64"),
        Bad("preplan past max_seq_len once the current step commits",
            lambda m: _plan(m, S(("a", "cond", 50)), preplan=True), ValueError,
            "('a', 'cond') of plan label 'cond' at position 15 with 50 tokens"),
        Bad("plan the same stream twice in one plan label",
            lambda m: _plan(m, S(("a", "cond", 2), ("b", "cond", 1), ("a", "cond", 3))), ValueError,
            "stream ('a', 'cond') has more than one view in plan label 'cond'"),
        Bad("explicit pos_ids of the wrong length",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.arange(3)}), ValueError,
            "step.pos_ids['cond'].shape=(3,)"),
        Bad("explicit float pos_ids",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.arange(2.0)}), ValueError,
            "step.pos_ids['cond'] has shape=(2,) dtype=torch.float32"),
        Bad("explicit pos_ids on another device",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.arange(2, device="meta")}),
            ValueError, "step.pos_ids['cond'] is on meta"),
        Bad("explicit pos_ids for a plan label the step lacks",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"image": torch.arange(2)}), ValueError,
            "step.pos_ids['image']"),
        Bad("explicit negative pos_ids",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.tensor([3, -1])}), ValueError,
            "step.pos_ids['cond'] has values in [-1, 3]"),
        Bad("explicit pos_ids at max_seq_len",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.tensor([63, 64])}), ValueError,
            "step.pos_ids['cond'] has values in [63, 64]"),
        Bad("explicit int64 pos_ids past int32",
            lambda m: _plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.tensor([2**40, 1])}),
            ValueError, "step.pos_ids['cond'] has values in [1, 1099511627776]"),
        Bad("one explicit tensor for two plan labels",
            lambda m: _plan(m, S(("a", "cond", 1), ("b", "uncond", 1)), pos_ids=torch.arange(1)),
            ValueError, "step.pos_ids is one tensor but the step has 2 plan labels"),
        Bad("explicit pos_ids as a list", lambda m: _plan(m, S(("a", "cond", 2)), pos_ids=[1, 2]),
            TypeError, "step.pos_ids must be"),
        Bad("negative advance", lambda m: _plan(m, S(("a", "cond", 1)), advance=-1), ValueError,
            "step.advance=-1"),
        Bad("bool advance", lambda m: _plan(m, S(("a", "cond", 1)), advance=True), ValueError,
            "step.advance=True"),
        Bad("advance of a stream without a segment",
            lambda m: _plan(m, S(("a", "cond", 1)), advance={("b", "cond"): 1}), ValueError,
            "step.advance names stream ('b', 'cond')"),
        Bad("advance keyed by a bare rid", lambda m: _plan(m, S(("a", "cond", 1)), advance={"a": 1}),
            ValueError, "step.advance key 'a'"),
        Bad("negative advance of one stream",
            lambda m: _plan(m, S(("a", "cond", 1)), advance={("a", "cond"): -2}), ValueError,
            "step.advance[('a', 'cond')]=-2"),
        Bad("KV plan output of the wrong type", lambda m: _plan(m, S(("a", "cond", 1)), kv={"attn": [1]}),
            TypeError, "ctx.plan_results['kv']['attn']"),
        Bad("KV plan results not a mapping", lambda m: _plan(m, S(("a", "cond", 1)), kv=[1]),
            TypeError,
            "ctx.plan_results['kv'] must be a mapping"),
        Bad("pre-fork to an unknown label",
            lambda m: _plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], pre_forks=[Fork("a", "cond", "zz")])}), ValueError, "label='zz'"),
        Bad("post-fork of an unknown request",
            lambda m: _plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], post_forks=[Fork("ghost", "cond", "uncond")])}), ValueError,
            "'ghost'"),
        Bad("two pre-forks into one stream from different sources",
            lambda m: _plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], pre_forks=[Fork("a", "cond", "uncond")]),
                "other": KVPlanOutput([], pre_forks=[Fork("a", "uncond", "uncond")])}), ValueError,
            "pre_forks copy two different counters into stream ('a', 'uncond')"),
        Bad("pre-fork that is not a triple",
            lambda m: _plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], pre_forks=[("a", "cond")])}), TypeError, "pre_forks must be"),
        Bad("KV view with a negative count",
            lambda m: _plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput([KVView("a", "cond", -2)])}),
            ValueError, "plan label 'attn' must be >= 0"),
        Bad("more tokens than the graph bucket",
            lambda m: _plan(m, S(("a", "cond", 5)), graph=GRAPH), ValueError, "num_tokens=4"),
        Bad("graph slot of the wrong type", lambda m: _plan(m, S(("a", "cond", 1)), graph=("decode", 0)),
            TypeError, "ctx.graph_slot"),
        # commit
        Bad("commit a step the plan did not make",
            lambda m: m.commit(PositionStep(S(("a", "cond", 4))), CURRENT_CTX), ValueError,
            "commit's step has 1 segments but the plan has 3"),
        Bad("commit a step whose segment differs from the plan's",
            lambda m: m.commit(PositionStep(S(("a", "cond", 3), ("b", "uncond", 1), ("b", "cond", 1))),
                               CURRENT_CTX), ValueError,
            "commit's step.segments[1]=('b', 'uncond', 1) differs from the planned "
            "('b', 'uncond', 2)"),
        Bad("commit the planned segments with another advance",
            lambda m: m.commit(PositionStep(CURRENT.segments, advance=1), CURRENT_CTX), ValueError,
            "commit's step.advance=1 differs from the planned None"),
        Bad("commit a step of the wrong type", lambda m: m.commit(CURRENT.segments, CURRENT_CTX),
            TypeError,
            "step must be a PositionStep"),
        Bad("commit with a context of the wrong type", lambda m: m.commit(CURRENT, "ctx"),
            TypeError,
            "ctx must be a StepContext"),
        Bad("commit that would pass max_seq_len", lambda m: m.commit(CURRENT, CURRENT_CTX),
            ValueError,
            "past max_seq_len=64",
            setup=lambda m: m.admit_retrieve("b", None, None, PublishedPositionInfo({"uncond": 63}))),
        # apply_qk / pos_ids
        Bad("apply_qk on an unknown label", lambda m: _apply(m, "nope"), ValueError,
            "label='nope' is unknown"),
        Bad("apply_qk on a label the current plan lacks", lambda m: _apply(m, "attn"), ValueError,
            "no positions planned for label='attn'"),
        Bad("apply_qk on an unhashable label", lambda m: _apply(m, ["cond"]),
            TypeError, "label=['cond']"),
        Bad("apply_qk with q not a tensor", lambda m: _apply(m, q=np.ones((4, 3, HEAD_DIM), np.float32)),
            TypeError, "q must be a torch.Tensor"),
        Bad("apply_qk with float64 q and k",
            lambda m: _apply(m, q=_qk(dtype=torch.float64)[0], k=_qk(dtype=torch.float64)[1]),
            ValueError, "q.dtype=torch.float64"),
        Bad("apply_qk with k in another dtype", lambda m: _apply(m, k=_qk(dtype=torch.float16)[1]),
            ValueError, "k.dtype=torch.float16 must equal q.dtype"),
        Bad("apply_qk with the wrong head size", lambda m: _apply(m, q=_qk(head_dim=8)[0]),
            ValueError,
            "q.shape=(4, 3, 8)"),
        Bad("apply_qk with flattened heads not a multiple of head_dim",
            lambda m: _apply(m, q=torch.randn(4, 40)), ValueError, "q.shape=(4, 40)"),
        Bad("apply_qk with k of fewer tokens", lambda m: _apply(m, k=_qk(tokens=3)[1]), ValueError,
            "k.shape[0]=3"),
        Bad("apply_qk with more tokens than planned", lambda m: _apply(m, q=_qk(5)[0], k=_qk(5)[1]),
            ValueError, "q has 5 tokens but plan label 'cond' has 4 planned positions"),
        Bad("apply_qk with q on another device",
            lambda m: _apply(m, q=torch.empty(4, 3, HEAD_DIM, device="meta")), ValueError, "q is on meta"),
        Bad("apply_qk with q tracked by autograd",
            lambda m: _apply(m, q=torch.randn(4, 3, HEAD_DIM, requires_grad=True)), ValueError,
            "q.requires_grad=True"),
        Bad("apply_qk with an unknown keyword", lambda m: _apply(m, rope_factor=2.0), TypeError,
            "rope_factor"),
        Bad("apply_qk with an odd rotary_dim", lambda m: _apply(m, rotary_dim=7),
            ValueError, "rotary_dim=7"),
        Bad("apply_qk with a negative rope_scale", lambda m: _apply(m, rope_scale=-1.0), ValueError,
            "rope_scale=-1.0"),
        Bad("apply_qk with rope_theta 0", lambda m: _apply(m, rope_theta=0.0),
            ValueError, "theta=0.0"),
        Bad("apply_qk with interleave as a string", lambda m: _apply(m, interleave="yes"),
            TypeError,  # RopeConfig's rule: a wrong type is a TypeError (README)
            "interleave='yes'"),
        Bad("apply_qk with rope_dtype as a string", lambda m: _apply(m, rope_dtype="f32"),
            ValueError,
            "rope_dtype='f32'"),
        Bad("pos_ids of an unknown label", lambda m: m.pos_ids("nope"), ValueError, "label='nope'"),
        # admit / prefix / publish
        Bad("admit a foreign info type", lambda m: m.admit_retrieve("a", None, None, {"cond": 5}),
            TypeError,
            "published must be a PublishedPositionInfo"),
        Bad("admit for an unhashable rid",
            lambda m: m.admit_retrieve(["a"], None, None, PublishedPositionInfo({"cond": 5})), TypeError,
            "rid=['a']"),
        Bad("cached prefix of an unknown request", lambda m: _prefix(m, "ghost", {"cond": 3}),
            ValueError,
            "'ghost'"),
        Bad("negative cached prefix", lambda m: _prefix(m, "a", {"cond": -1}), ValueError,
            "prefix['cond']=-1"),
        Bad("cached prefix past max_seq_len", lambda m: _prefix(m, "a", {"cond": 65}), ValueError,
            "prefix['cond']=65"),
        Bad("cached prefix of an unknown label", lambda m: _prefix(m, "a", {"image": 3}),
            ValueError,
            "label='image'"),
        Bad("cached prefix as a list", lambda m: _prefix(m, "a", [("cond", 3)]), ValueError,
            "prefix=[('cond', 3)]"),
        Bad("publish of an unhashable request_id", lambda m: m.publish(["a"]), TypeError,
            "request_id=['a']"),
        Bad("publish from a snapshot of the wrong length",
            lambda m: m.publish_from_snapshot("a", (1,), None, None), TypeError, "snapshot=(1,)"),
        Bad("publish from a snapshot holding strings",
            lambda m: m.publish_from_snapshot("a", ("x", "y"), None, None), TypeError, "snapshot=('x', 'y')"),
        Bad("publish from a snapshot holding a negative position",
            lambda m: m.publish_from_snapshot("a", (-1, 5), None, None), TypeError, "snapshot=(-1, 5)"),
        Bad("merge a foreign publication", lambda m: PublishedPositionInfo({"cond": 1}).update({"cond": 3}),
            TypeError, "other must be a PublishedPositionInfo"),
        # speculative decoding (torch_bridge.speculative): the current plan gives a 3 tokens
        # (a chain of 2 drafts), b's uncond 2 and b's cond 1; the staged plan numbers a's cond.
        Bad("accepted as a list", lambda m: m.commit(CURRENT, CURRENT_CTX, accepted=[1]), TypeError,
            "accepted must be a mapping"),
        Bad("accepted count past the drafts",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): 2}), ValueError,
            "accepted[('b', 'uncond')]=2 must be in [0, 1]"),
        Bad("negative accepted count",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): -1}), ValueError,
            "accepted[('b', 'uncond')]=-1 must be in [0, 1]"),
        Bad("float accepted count",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): 1.0}), ValueError,
            "accepted[('b', 'uncond')]=1.0 must be an int"),
        Bad("bool accepted count",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): True}), ValueError,
            "accepted[('b', 'uncond')]=True must be an int"),
        Bad("accepted keyed by a bare rid", lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={"b": 0}),
            ValueError, "accepted key 'b'"),
        Bad("accepted of a stream without a segment",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("a", "uncond"): 0}), ValueError,
            "accepted names stream ('a', 'uncond'), which has no segment"),
        Bad("accepted of an unknown request",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("ghost", "cond"): 0}), ValueError,
            "'ghost'"),
        Bad("accepted rejecting drafts the staged plan kept",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("a", "cond"): 0}), ValueError,
            "stream ('a', 'cond'), which the staged plan numbers"),
        Bad("depths as a string", lambda m: _plan(m, S(("a", "cond", 1)), depths="0"), TypeError,
            "step.depths must be None, an int or"),
        Bad("negative draft step depth", lambda m: _plan(m, S(("a", "cond", 1)), depths=-1), ValueError,
            "step.depths=-1 must be >= 0"),
        Bad("draft step with an advance", lambda m: _plan(m, S(("a", "cond", 1)), depths=1, advance=1),
            ValueError, "a draft step (int step.depths) commits nothing"),
        Bad("tree depths shorter than the view",
            lambda m: _plan(m, S(("a", "cond", 3)), depths={("a", "cond"): (0, 1)}), ValueError,
            "step.depths[('a', 'cond')] has 2 entries but the stream's view in plan label 'cond' "
            "has 3 tokens"),
        Bad("negative tree depth", lambda m: _plan(m, S(("a", "cond", 2)), depths={("a", "cond"): (0, -1)}),
            ValueError, "has depth -1"),
        Bad("float tree depths", lambda m: _plan(m, S(("a", "cond", 2)), depths={("a", "cond"): (0, 1.5)}),
            ValueError, "must be a non-empty sequence of ints"),
        Bad("bool tree depths beside int ones",
            lambda m: _plan(m, S(("a", "cond", 2), ("b", "cond", 2)),
                            depths={("a", "cond"): np.array([0, 1]), ("b", "cond"): np.array([True, False])}),
            ValueError, "step.depths[('b', 'cond')]=array([ True, False]) must be a non-empty sequence"),
        Bad("tree depths as a set",
            lambda m: _plan(m, S(("a", "cond", 2), ("b", "cond", 2)),
                            depths={("a", "cond"): (0, 1), ("b", "cond"): {0, 1}}),
            ValueError, "step.depths[('b', 'cond')]={0, 1} must be a non-empty sequence"),
        Bad("tree depths of a stream without a view",
            lambda m: _plan(m, S(("a", "cond", 1)), depths={("b", "cond"): (0,)}), ValueError,
            "step.depths names stream ('b', 'cond'), which has no view"),
        Bad("tree depths keyed by a bare rid", lambda m: _plan(m, S(("a", "cond", 1)), depths={"a": (0,)}),
            ValueError, "step.depths key 'a'"),
        Bad("tree past max_seq_len", lambda m: _plan(m, S(("a", "cond", 2)), depths={("a", "cond"): (0, 52)}),
            ValueError, "('a', 'cond') of plan label 'cond' at position 12 with depth 52 passes "
            "max_seq_len=64"),
        Bad("tree depths on a BLOCK manager",
            lambda m: _block_manager().plan(PositionStep(S(("a", "cond", 1)), depths={("a", "cond"): (0,)}),
                                            StepContext()), ValueError,
            "speculative steps need the SEQUENTIAL scheme"),
        Bad("live of an unknown label", lambda m: m.live("nope"), ValueError, "label='nope'"),
    ]
    return cases


def _block_manager():
    mgr = PositionManager(PositionConfig(labels=LABELS, scheme=jr.Scheme.BLOCK), "cpu")
    mgr.ingest_request("a")
    return mgr


BRIDGE_CASES = _bridge_cases() if torch is not None else []


@needs_torch
@pytest.mark.parametrize("case", BRIDGE_CASES, ids=lambda c: c.name)
def test_bridge_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    raises_naming_it_and_changes_nothing(case, busy_manager, finish)


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


def test_the_catalogue_is_large_and_its_names_distinct():
    names = [c.name for c in CORE_CASES + BRIDGE_CASES + MROPE_CASES + KV_CASES
             + KV_MROPE_CORE_CASES + MROPE_KV_CASES]
    assert len(names) == len(set(names))
    assert len(CORE_CASES) >= 25 and (torch is None or len(BRIDGE_CASES) >= 25)


@needs_torch
def test_the_busy_state_is_what_the_cases_assume():
    state = busy_manager().state_snapshot()
    assert state["counters"] == {("a", "cond"): 12, ("a", "uncond"): 0, ("b", "cond"): 0,
                                 ("b", "uncond"): 5}
    assert state["current"]["positions"] == {k: tuple(v) for k, v in CURRENT_POSITIONS.items()}
    assert state["staged"]["positions"] == {"attn": (15,)}
    assert list(state["graph_buffers"].values()) == [(10, 11, 0, 0)]
    assert finish(busy_manager())["counters"] == {("a", "cond"): 16, ("a", "uncond"): 15,
                                                  ("b", "cond"): 1, ("b", "uncond"): 7}


@needs_torch
def test_a_failed_apply_qk_leaves_a_staged_plan_staged():
    """With no current plan, a valid call makes the staged one current (its pre-fork
    applies); a failed call must not."""
    mgr = busy_manager()
    mgr.commit(CURRENT, CURRENT_CTX)
    mgr.commit(STAGED, STAGED_CTX)
    step = PositionStep([Segment("b", "uncond", 2)])
    kv = {"attn": KVPlanOutput([KVView("b", "uncond", 2)], pre_forks=[Fork("b", "cond", "uncond")])}
    ctx = StepContext(("b",), is_preplan=True, plan_results={"kv": kv})
    assert mgr.plan(step, ctx)["attn"].tolist() == [1, 2]
    before = mgr.state_snapshot()
    assert before["current"] is None and before["counters"][("b", "uncond")] == 7
    q, k = _qk(2)
    for bad in (lambda: mgr.apply_qk(q[..., :8], k, "attn"), lambda: mgr.apply_qk(q, k, "cond"),
                lambda: mgr.apply_qk(q, k, "attn", rope_scale=0.0)):
        with pytest.raises(ValueError):
            bad()
        assert mgr.state_snapshot() == before
    mgr.apply_qk(q, k, "attn")
    after = mgr.state_snapshot()
    assert after["staged"] is None and after["current"]["positions"] == {"attn": (1, 2)}
    assert after["counters"][("b", "uncond")] == 1


# ------------------------------------------------------------------------------ reported, not raised


@needs_torch
@pytest.mark.parametrize("published,fragment", [
    (PublishedPositionInfo({"image": 3}) if torch else None, "label='image'"),
    (PublishedPositionInfo({"cond": -3}) if torch else None, "published.counters['cond']=-3"),
    (PublishedPositionInfo({"cond": 65}) if torch else None, "published.counters['cond']=65"),
    (PublishedPositionInfo({"cond": 2.5}) if torch else None, "published.counters['cond']=2.5"),
    (PublishedPositionInfo({"cond": 3}, fingerprint=b"\x00" * 32) if torch else None,
     "published.fingerprint differs"),
    (PublishedPositionInfo({"cond": 3}, deltas={"cond": -7}) if torch else None,
     "M-RoPE deltas need an M-RoPE config"),
    (PublishedPositionInfo({"cond": 3}, epochs={"cond": -1}) if torch else None,
     "published.epochs['cond']=-1"),
], ids=["unknown label", "negative", "past max_seq_len", "float", "foreign fingerprint",
        "deltas into 1-D", "negative epoch"])
def test_admit_of_unusable_published_counters_reports_and_changes_nothing(published, fragment):
    mgr, twin = busy_manager(), busy_manager()
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("a", "node", "walk", published)
    assert (outcome.ok, outcome.ready) == (False, False) and fragment in outcome.reason
    assert mgr.state_snapshot() == before
    assert finish(mgr) == finish(twin)


@needs_torch
def test_admit_for_an_unknown_request_reports_and_changes_nothing():
    mgr = busy_manager()
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("ghost", None, None, PublishedPositionInfo({"cond": 3}))
    assert not outcome.ok and "'ghost'" in outcome.reason
    assert mgr.state_snapshot() == before


@needs_torch
def test_second_remove_publish_of_unknown_and_repeated_ingest_change_nothing():
    mgr, twin = busy_manager(), busy_manager()
    for m in (mgr, twin):
        m.remove_request("b")
    before = mgr.state_snapshot()
    mgr.remove_request("b")
    mgr.remove_request("never-seen")
    assert mgr.publish("b") is None and mgr.publish_snapshot_for_step("b", None, None) is None
    mgr.ingest_request("a")
    mgr.ingest_request("a", overrides={"cond": 3})  # below the counter: max() keeps it
    mgr.admit_retrieve("a", None, None, None)
    _prefix(mgr, "a", None)
    assert mgr.state_snapshot() == before
    assert finish(mgr) == finish(twin)


@needs_torch
def test_state_snapshot_sees_every_kind_of_change():
    """The hook the catalogue relies on is not blind: each mutation changes its snapshot."""
    mutations = [
        lambda m: m.ingest_request("c"),
        lambda m: _prefix(m, "b", {"cond": 7}),
        lambda m: m.reset_request("a"),
        lambda m: m.remove_request("b"),
        lambda m: m.clear_preplan(),
        lambda m: m.commit(CURRENT, CURRENT_CTX),
        lambda m: _plan(m, _seg(("b", "cond", 1)), graph=GraphSlot(GRAPH.bucket, 1)),
        lambda m: _plan(m, _seg(("a", "cond", 1)), kv={"other": KVPlanOutput([KVView("a", "cond", 1)])},
                        preplan=True),
    ]
    for mutate in mutations:
        mgr = busy_manager()
        before = mgr.state_snapshot()
        mutate(mgr)
        assert mgr.state_snapshot() != before


# ------------------------------------------------------------------------------ records as bytes


def _record_bytes(mutate=lambda data: data, rope=None):
    sender = busy_manager() if rope is None else RopeManager(
        PositionConfig(rope=rope, labels=LABELS), "cpu", max_seq_len=MAX_SEQ_LEN, launcher="jax")
    if rope is not None:
        sender.ingest_request("a")
    return mutate(sender.publish("a").to_bytes())


@needs_torch
@pytest.mark.parametrize("data,fragment", [
    (lambda: _record_bytes(lambda d: d[:-1]), "(truncated): truncated at byte"),
    (lambda: _record_bytes(lambda d: d[:50] + bytes((d[50] ^ 4,)) + d[51:]),
     "(checksum): checksum mismatch"),
    (lambda: _record_bytes(lambda d: d + b"\x00"), "(length): 1 bytes between"),
    (lambda: _record_bytes(rope=jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4, max_position=1024)),
     "(fingerprint): fingerprint mismatch"),
    (lambda: b"", "(truncated)"),
    (lambda: b"{'cond': 5}", "(magic): bad magic"),
], ids=["truncated", "bit flip", "trailing byte", "foreign fingerprint", "empty", "not a record"])
def test_admit_of_unusable_record_bytes_reports_and_changes_nothing(data, fragment):
    data = data()
    mgr, twin = busy_manager(), busy_manager()
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("a", "node", "walk", data)
    assert (outcome.ok, outcome.ready) == (False, False) and fragment in outcome.reason, outcome
    assert mgr.state_snapshot() == before
    assert finish(mgr) == finish(twin)


@needs_torch
def test_admit_of_a_record_as_str_raises_and_changes_nothing():
    mgr = busy_manager()
    before = mgr.state_snapshot()
    with pytest.raises(TypeError, match="PublishedPositionInfo, bytes or None, got str"):
        mgr.admit_retrieve("a", None, None, "JRPR")
    assert mgr.state_snapshot() == before


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
    planned = _plan(mgr, _seg(("a", "cond", 1), ("b", "cond", 2)),
                    pos_ids=torch.cat([torch.full((3, 1), 10), explicit], dim=1))
    assert planned["cond"].tolist() == MROPE_CURRENT_POSITIONS["cond"]
    return mgr


def mrope_finish(mgr):
    gen = torch.Generator().manual_seed(next(_SEEDS))
    q, k = torch.randn(3, 3, HEAD_DIM, generator=gen), torch.randn(3, 2, HEAD_DIM, generator=gen)
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = oracle.rope_oracle(q.numpy(), np.asarray(MROPE_CURRENT_POSITIONS["cond"]), inv_freq,
                              attention, HEAD_DIM, False, mgr.rope.mrope_section, False)
    mgr.apply_qk(q, k, "cond")
    np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)
    mgr.commit(PositionStep(_seg(("a", "cond", 1), ("b", "cond", 2))), StepContext())
    state = mgr.state_snapshot()
    return {key: state[key] for key in ("counters", "slots", "deltas", "epochs", "requests")}


def _mrope_cases():
    S = _seg
    rows = torch.tensor([[0, 1], [0, 2], [0, 3]])
    return [
        Bad("M-RoPE: explicit 1-D pos_ids",
            lambda m: _plan(m, S(("b", "cond", 2)), pos_ids={"cond": torch.arange(2)}), ValueError,
            "step.pos_ids['cond'].shape=(2,) is 1-D positions [n], but this manager rotates with "
            "M-RoPE (config.rope.mrope_section): pass [3, 2]"),
        Bad("M-RoPE: explicit pos_ids of the wrong length",
            lambda m: _plan(m, S(("b", "cond", 1)), pos_ids={"cond": rows}), ValueError,
            "step.pos_ids['cond'].shape=(3, 2) must be [3, 1] (the plan label's tokens)"),
        Bad("M-RoPE: explicit pos_ids with two rows",
            lambda m: _plan(m, S(("b", "cond", 2)), pos_ids={"cond": rows[:2]}), ValueError,
            "step.pos_ids['cond'].shape=(2, 2) must be [3, 2]"),
        Bad("M-RoPE: explicit pos_ids negative on the w row",
            lambda m: _plan(m, S(("b", "cond", 2)), pos_ids={"cond": rows * torch.tensor([[1], [1], [-1]])}),
            ValueError, "step.pos_ids['cond'] has values in [-3, 2]"),
        Bad("M-RoPE: a decode plan at a negative counter + delta",
            lambda m: _plan(m, S(("c", "cond", 1))), ValueError,
            "('c', 'cond') of plan label 'cond' at counter 0 + M-RoPE delta -5 is below 0",
            setup=lambda m: m.ingest_request("c", deltas={"cond": -5})),
        Bad("M-RoPE: a delta past max_seq_len", lambda m: m.ingest_request("a", deltas={"cond": 65}),
            ValueError, "deltas['cond']=65 must be an int in [-64, 64]"),
        Bad("M-RoPE: a float delta", lambda m: m.ingest_request("a", deltas={"cond": -2.0}),
            ValueError, "deltas['cond']=-2.0"),
        Bad("M-RoPE: more q tokens than the [3, n] plan holds",
            lambda m: m.apply_qk(*_qk(4), "cond"), ValueError,
            "q has 4 tokens but plan label 'cond' has 3 planned positions"),
        Bad("M-RoPE: explicit [3, n] past the graph bucket",
            lambda m: _plan(m, S(("b", "cond", 5)), graph=GRAPH,
                            pos_ids={"cond": torch.zeros((3, 5), dtype=torch.int32)}),
            ValueError, "plan label 'cond' has 5 tokens, more than graph bucket num_tokens=4"),
        Bad("1-D: explicit M-RoPE pos_ids [3, n]",
            lambda m: _plan(busy_manager(), S(("b", "cond", 2)), pos_ids={"cond": rows}),
            ValueError, "step.pos_ids['cond'].shape=(3, 2) is M-RoPE positions [3, n], but this "
                        "manager's RoPE is 1-D (config.rope.mrope_section is None): pass [2]"),
    ]


MROPE_CASES = _mrope_cases() if torch is not None else []


@needs_torch
@pytest.mark.parametrize("case", MROPE_CASES, ids=lambda c: c.name)
def test_mrope_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    raises_naming_it_and_changes_nothing(case, mrope_manager, mrope_finish)


@needs_torch
def test_the_mrope_busy_state_is_what_the_cases_assume():
    state = mrope_finish(mrope_manager())
    assert state["counters"] == {("a", "cond"): 41, ("a", "uncond"): 0, ("b", "cond"): 2,
                                 ("b", "uncond"): 0}
    slots = state["requests"]
    assert [state["deltas"][s] for s in slots["a"] + slots["b"]] == [-30, 0, -1, 0]


@needs_torch
def test_admit_of_a_bad_delta_into_an_mrope_manager_reports_and_changes_nothing():
    mgr = mrope_manager()
    before = mgr.state_snapshot()
    for deltas, fragment in (({"cond": 99}, "published.deltas['cond']=99"),
                             ({"image": -3}, "published.deltas names label='image'")):
        outcome = mgr.admit_retrieve("a", None, None, PublishedPositionInfo({"cond": 50}, deltas=deltas))
        assert not outcome.ok and fragment in outcome.reason, outcome
        assert mgr.state_snapshot() == before


# ------------------------------------------------------------------------------ fused KV append
# apply_qk_and_append_kv on the busy manager: each case changes one argument of a valid call
# (KvCall: q, k, v of the current plan's 4 "cond" tokens, a (k_cache, v_cache) pair of 3
# NHD pages of 4, slots with a padding token). Beyond the state checks, every tensor of
# the valid call (q, k, v, the cache, the slots) must be bit for bit as before.


class KvCall:
    """A valid ``apply_qk_and_append_kv`` call on the busy manager; ``run(**changes)`` varies it."""

    def __init__(self, mgr):
        gen = torch.Generator().manual_seed(next(_SEEDS))
        self.mgr = mgr
        self.args = dict(q=torch.randn(4, 3, HEAD_DIM, generator=gen),
                         k=torch.randn(4, 2, HEAD_DIM, generator=gen),
                         v=torch.randn(4, 2, HEAD_DIM, generator=gen), label="cond",
                         kv_cache=tuple(torch.randn(3, 4, 2, HEAD_DIM, generator=gen)
                                        for _ in "kv"),
                         slots=torch.tensor([0, 5, 9, -1], dtype=torch.int32))

    def tensors(self):
        a = self.args
        return [a["q"], a["k"], a["v"], *a["kv_cache"], a["slots"]]

    def run(self, **changes):
        a = {**self.args, **changes}
        kwargs = {key: a.pop(key) for key in list(a) if key not in ("q", "k", "v", "label",
                                                                    "kv_cache", "slots")}
        return self.mgr.apply_qk_and_append_kv(a["q"], a["k"], a["v"], a["label"], a["kv_cache"],
                                               a["slots"], **kwargs)


def _cache(shape=(3, 4, 2, HEAD_DIM), dtype=None, **kwargs):
    return torch.zeros(shape, dtype=dtype or torch.float32, **kwargs)


def _pair(shape=(3, 4, 2, HEAD_DIM), dtype=None):
    return (_cache(shape, dtype), _cache(shape, dtype))


def _kv_cases():
    fp8 = _pair(dtype=torch.float8_e4m3fn)
    return [
        Bad("append on an unknown label", lambda c: c.run(label="nope"), ValueError,
            "label='nope' is unknown"),
        Bad("append on a label the current plan lacks", lambda c: c.run(label="attn"), ValueError,
            "no positions planned for label='attn'"),
        Bad("append on an unhashable label", lambda c: c.run(label=["cond"]), TypeError,
            "label=['cond']"),
        Bad("append with q not a tensor", lambda c: c.run(q=np.ones((4, 3, HEAD_DIM), np.float32)),
            TypeError, "q must be a torch.Tensor"),
        Bad("append with v not a tensor", lambda c: c.run(v=np.ones((4, 2, HEAD_DIM), np.float32)),
            TypeError, "v must be a torch.Tensor"),
        Bad("append with k in another dtype", lambda c: c.run(k=_qk(dtype=torch.float16)[1]),
            ValueError, "k.dtype=torch.float16 must equal q.dtype"),
        Bad("append with v in another dtype",
            lambda c: c.run(v=torch.zeros(4, 2, HEAD_DIM, dtype=torch.float16)), ValueError,
            "v ((4, 2, 16), torch.float16) must match k ((4, 2, 16), torch.float32)"),
        Bad("append with v of other heads", lambda c: c.run(v=torch.zeros(4, 1, HEAD_DIM)),
            ValueError, "v ((4, 1, 16), torch.float32) must match k"),
        Bad("append with v of fewer tokens", lambda c: c.run(v=torch.zeros(3, 2, HEAD_DIM)),
            ValueError, "v ((3, 2, 16), torch.float32) must match k"),
        Bad("append with v of the wrong head size", lambda c: c.run(v=torch.zeros(4, 2, 8)),
            ValueError, "v.shape=(4, 2, 8) must be [T, H, 16]"),
        Bad("append with v on another device",
            lambda c: c.run(v=torch.empty(4, 2, HEAD_DIM, device="meta")), ValueError,
            "v is on meta"),
        Bad("append with v tracked by autograd",
            lambda c: c.run(v=torch.zeros(4, 2, HEAD_DIM, requires_grad=True)), ValueError,
            "v.requires_grad=True"),
        Bad("append with more tokens than planned",
            lambda c: c.run(q=_qk(5)[0], k=_qk(5)[1], v=_qk(5)[1]), ValueError,
            "q has 5 tokens but plan label 'cond' has 4 planned positions"),
        Bad("append with an unknown layout", lambda c: c.run(layout="NDH"), ValueError,
            "layout='NDH' must be one of ('NHD', 'HND')"),
        Bad("append with an unknown keyword", lambda c: c.run(rope_theta=1e4), TypeError,
            "rope_theta"),
        Bad("append with the cache a list of one tensor", lambda c: c.run(kv_cache=[_cache()]),
            TypeError, "kv_cache must be a (k_cache, v_cache) pair of tensors or one tensor, got a "
            "list of ['Tensor']"),
        Bad("append with the cache a dict", lambda c: c.run(kv_cache={"k": _cache()}), TypeError,
            "kv_cache must be a (k_cache, v_cache) pair of tensors or one tensor, got dict"),
        Bad("append with the cache a pair of numpy arrays",
            lambda c: c.run(kv_cache=(np.zeros((3, 4, 2, HEAD_DIM)),) * 2), TypeError,
            "got a tuple of ['ndarray', 'ndarray']"),
        Bad("append with one 4-D cache tensor", lambda c: c.run(kv_cache=_cache()), ValueError,
            "kv_cache.shape=(3, 4, 2, 16) must be [pages, 2, page_size, Hk, D] (layout='NHD') "
            "(or pass a (k_cache, v_cache) pair)"),
        Bad("append with a combined cache of 3 components",
            lambda c: c.run(kv_cache=_cache((3, 3, 4, 2, HEAD_DIM))), ValueError,
            "kv_cache.shape=(3, 3, 4, 2, 16) must be [pages, 2, page_size, Hk, D]"),
        Bad("append with a rank-3 k_cache",
            lambda c: c.run(kv_cache=(_cache((3, 4, 32)), _cache((3, 4, 32)))), ValueError,
            "k_cache.shape=(3, 4, 32) must be rank 4: [pages, page_size, Hk, D] (layout='NHD')"),
        Bad("append with v_cache unlike k_cache",
            lambda c: c.run(kv_cache=(_cache(), _cache((3, 4, 2, 8)))), ValueError,
            "v_cache ((3, 4, 2, 8), torch.float32) must match k_cache ((3, 4, 2, 16), torch.float32)"),
        Bad("append with an HND cache read as NHD",
            lambda c: c.run(kv_cache=_pair((3, 2, 4, HEAD_DIM))), ValueError,
            "k_cache.shape=(3, 2, 4, 16) must be [pages, page_size, Hk, D] (layout='NHD') with Hk=2 "
            "and D=16 (k's heads and head_dim)"),
        Bad("append with a combined cache of the wrong head size in HND",
            lambda c: c.run(kv_cache=_cache((3, 2, 2, 4, 8)), layout="HND"), ValueError,
            "kv_cache.shape=(3, 2, 2, 4, 8) must be [pages, 2, Hk, page_size, D] (layout='HND') with "
            "Hk=2 and D=16"),
        Bad("append with a float16 cache for float32 k",
            lambda c: c.run(kv_cache=_pair(dtype=torch.float16)), ValueError,
            "k_cache.dtype=torch.float16 must be k's dtype (torch.float32) or torch.float8_e4m3fn"),
        Bad("append with the cache on another device",
            lambda c: c.run(kv_cache=(_cache(device="meta"), _cache(device="meta"))), ValueError,
            "k_cache is on meta, expected cpu"),
        Bad("append with a combined cache tracked by autograd",
            lambda c: c.run(kv_cache=_cache((3, 2, 4, 2, HEAD_DIM), requires_grad=True)), ValueError,
            "kv_cache.requires_grad=True"),
        Bad("append with slots as a list", lambda c: c.run(slots=[0, 5, 9, -1]), TypeError,
            "slots must be an int32 or int64 torch.Tensor [T]"),
        Bad("append with float slots", lambda c: c.run(slots=torch.zeros(4)), ValueError,
            "slots.dtype=torch.float32 must be torch.int32 or torch.int64"),
        Bad("append with int16 slots", lambda c: c.run(slots=torch.zeros(4, dtype=torch.int16)),
            ValueError, "slots.dtype=torch.int16"),
        Bad("append with slots for fewer tokens",
            lambda c: c.run(slots=torch.tensor([0, 5, 9], dtype=torch.int32)), ValueError,
            "slots.shape=(3,) must be [T] with T=4"),
        Bad("append with 2-D slots", lambda c: c.run(slots=torch.zeros(4, 1, dtype=torch.int32)),
            ValueError, "slots.shape=(4, 1) must be [T] with T=4"),
        Bad("append with slots on another device",
            lambda c: c.run(slots=torch.empty(4, dtype=torch.int64, device="meta")), ValueError,
            "slots is on meta"),
        Bad("append with a scale for a float32 cache", lambda c: c.run(k_quant_scale=0.5),
            ValueError, "k_quant_scale=0.5 applies only to a float8_e4m3fn cache"),
        Bad("append with an fp8 scale of 0", lambda c: c.run(kv_cache=fp8, v_quant_scale=0.0),
            ValueError, "v_quant_scale=0.0 must be finite and > 0"),
        Bad("append with an infinite fp8 scale",
            lambda c: c.run(kv_cache=fp8, k_quant_scale=float("inf")), ValueError,
            "k_quant_scale=inf must be finite and > 0"),
        Bad("append with an fp8 scale as a tensor",
            lambda c: c.run(kv_cache=fp8, k_quant_scale=torch.tensor(0.5)), TypeError,
            "k_quant_scale must be a float"),
        Bad("append with an fp8 scale as a bool", lambda c: c.run(kv_cache=fp8, v_quant_scale=True),
            TypeError, "v_quant_scale must be a float"),
    ]


KV_CASES = _kv_cases() if torch is not None else []


@needs_torch
def test_the_append_call_the_kv_cases_vary_is_valid():
    mgr = busy_manager()
    call = KvCall(mgr)
    cache = [c.clone() for c in call.args["kv_cache"]]
    call.run()
    # Slots 0, 5 and 9 are written; the padding token writes nothing.
    changed = [torch.nonzero((new != old).any(-1).any(-1)).tolist()
               for new, old in zip(call.args["kv_cache"], cache)]
    assert changed == [[[0, 0], [1, 1], [2, 1]]] * 2


@needs_torch
@pytest.mark.parametrize("case", KV_CASES, ids=lambda c: c.name)
def test_append_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    mgr, twin = busy_manager(), busy_manager()
    call = KvCall(mgr)
    before, tensors = mgr.state_snapshot(), [t.clone() for t in call.tensors()]
    with pytest.raises(case.error) as raised:
        case.call(call)
    assert case.fragment in str(raised.value), str(raised.value)
    assert mgr.state_snapshot() == before
    for now, then in zip(call.tensors(), tensors):
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))
    assert finish(mgr) == finish(twin)


# ------------------------------------------------------------------------------ speculative commits

if torch is not None:
    DRAFT = PositionStep([Segment("b", "uncond", 1)], depths=0)
    TREE = PositionStep([Segment("b", "uncond", 2)], depths={("b", "uncond"): (0, 1)})

_SPECULATIVE_COMMITS = [
    ("accepted of a draft step", lambda: DRAFT,
     lambda m: m.commit(DRAFT, StepContext(), accepted={("b", "uncond"): 0}), "draft step"),
    ("a draft tree without its accepted count", lambda: TREE,
     lambda m: m.commit(TREE, StepContext()),
     "stream ('b', 'uncond') was planned with step.depths (a draft tree)"),
    ("a tree with other depths than planned", lambda: TREE,
     lambda m: m.commit(PositionStep(TREE.segments, depths={("b", "uncond"): (0, 0)}), StepContext(),
                        accepted={("b", "uncond"): 0}),
     "commit's step.depths={('b', 'uncond'): (0, 0)} differs"),
    ("a tree whose accepted count passes its depth", lambda: TREE,
     lambda m: m.commit(TREE, StepContext(), accepted={("b", "uncond"): 2}),
     "accepted[('b', 'uncond')]=2 must be in [0, 1]"),
]


@needs_torch
@pytest.mark.parametrize("name,planned,call,fragment", _SPECULATIVE_COMMITS,
                         ids=[c[0] for c in _SPECULATIVE_COMMITS])
def test_a_refused_speculative_commit_names_the_reason_and_changes_nothing(name, planned, call,
                                                                           fragment):
    mgr = busy_manager()
    mgr.plan(planned(), StepContext())
    before = mgr.state_snapshot()
    with pytest.raises(ValueError) as raised:
        call(mgr)
    assert fragment in str(raised.value), str(raised.value)
    assert mgr.state_snapshot() == before


# ------------------------------------------------------------------------------ fused KV append, M-RoPE
# apply_rope_and_append_kv takes apply_rope's positions: [3, T] for an M-RoPE config, [T]
# for a 1-D one, refused with apply_rope's own message (one validator). Each case runs on
# both ops; q, k, v, the cache and the slots must be as before.


class KvMropeEnv:
    """Inputs of a valid fused call; ``op`` is "append" or "rope" (apply_rope, the twin on
    the same inputs when given the same ``seed``)."""

    def __init__(self, op: str, seed: int):
        rng = np.random.default_rng(seed)
        self.op = op
        self.mrope = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024, mrope_section=(4, 2, 2))
        self.one_d = jr.RopeConfig(head_dim=HEAD_DIM, max_position=1024)
        self.q = jnp.asarray(rng.standard_normal((5, 3, HEAD_DIM)), jnp.float32)
        self.k, self.v = (jnp.asarray(rng.standard_normal((5, 2, HEAD_DIM)), jnp.float32)
                          for _ in "kv")
        self.pos = jnp.asarray(rng.integers(0, 1024, (3, 5)), jnp.int32)
        self.kv_cache = tuple(jnp.asarray(rng.standard_normal((2, 4, 2, HEAD_DIM)), jnp.float32)
                              for _ in "kv")
        self.slots = jnp.array([0, 3, -1, 7, 4], jnp.int32)

    def run(self, pos_ids, cfg):
        if self.op == "rope":
            return jr.apply_rope(self.q, self.k, pos_ids, cfg)
        return jr.apply_rope_and_append_kv(self.q, self.k, self.v, pos_ids, self.kv_cache,
                                           self.slots, cfg)

    def state(self):
        return [np.asarray(x).tolist() for x in (self.q, self.k, self.v, self.pos, *self.kv_cache,
                                                 self.slots)]


KV_MROPE_CORE_CASES = [
    Bad("append M-RoPE config with 1-D pos_ids", lambda e: e.run(e.pos[0], e.mrope), ValueError,
        "pos_ids.shape=(5,) must be [3, T] (t, h, w rows) with T=5 for an M-RoPE config "
        "(cfg.mrope_section=(4, 2, 2)"),
    Bad("append 1-D config with M-RoPE pos_ids", lambda e: e.run(e.pos, e.one_d), ValueError,
        "pos_ids.shape=(3, 5) is M-RoPE positions [3, T], but cfg is a 1-D config"),
    Bad("append M-RoPE pos_ids of the wrong length", lambda e: e.run(e.pos[:, :4], e.mrope),
        ValueError, "pos_ids.shape=(3, 4) must be [3, T]"),
    Bad("append M-RoPE pos_ids with two rows", lambda e: e.run(e.pos[:2], e.mrope), ValueError,
        "pos_ids.shape=(2, 5) must be [3, T]"),
    Bad("append M-RoPE pos_ids negative on the w row",
        lambda e: e.run(e.pos.at[2, 1].set(-1), e.mrope), ValueError,
        "pos_ids must lie in [0, 1024) (cfg.max_position)"),
    Bad("append M-RoPE float pos_ids", lambda e: e.run(e.pos.astype(jnp.float32), e.mrope),
        ValueError, "pos_ids.dtype=float32 must be an integer type"),
]


@pytest.mark.parametrize("case", KV_MROPE_CORE_CASES, ids=lambda c: c.name)
def test_append_mrope_positions_are_refused_as_apply_rope_refuses_them(case):
    messages, seed = [], next(_SEEDS)
    for op in ("append", "rope"):
        env = KvMropeEnv(op, seed)
        before = env.state()
        with pytest.raises(case.error) as raised:
            case.call(env)
        assert case.fragment in str(raised.value), str(raised.value)
        assert env.state() == before
        messages.append(str(raised.value))
    assert messages[0] == messages[1], "the fused op and apply_rope give one message"


def test_the_mrope_append_call_the_cases_vary_is_valid():
    env = KvMropeEnv("append", next(_SEEDS))
    q, (k_cache, v_cache) = env.run(env.pos, env.mrope)
    assert np.asarray(q).shape == (5, 3, HEAD_DIM)
    np.testing.assert_array_equal(np.asarray(v_cache).reshape(8, 2, HEAD_DIM)[[0, 3, 7, 4]],
                                  np.asarray(env.v)[[0, 1, 3, 4]])


if torch is not None:
    def _mrope_kv(tokens=3, slots=(0, 5, -1)):
        gen = torch.Generator().manual_seed(next(_SEEDS))
        q, k = _qk(tokens)
        return dict(q=q, k=k, v=torch.randn(tokens, 2, HEAD_DIM, generator=gen),
                    cache=_pair(), slots=torch.tensor(slots, dtype=torch.int32))

    def _mrope_append(m, **changes):
        a = {**_mrope_kv(), **changes}
        return m.apply_qk_and_append_kv(a["q"], a["k"], a["v"], "cond", a["cache"], a["slots"],
                                         **a.get("kwargs", {}))

MROPE_KV_CASES = [
    Bad("M-RoPE append: more q tokens than the [3, n] plan holds",
        lambda m: _mrope_append(m, **_mrope_kv(4, (0, 5, 9, -1))), ValueError,
        "q has 4 tokens but plan label 'cond' has 3 planned positions"),
    Bad("M-RoPE append: slots for fewer tokens",
        lambda m: _mrope_append(m, slots=torch.tensor([0, 5], dtype=torch.int32)), ValueError,
        "slots.shape=(2,) must be [T] with T=3"),
    Bad("M-RoPE append: an unknown layout", lambda m: _mrope_append(m, kwargs={"layout": "NDH"}),
        ValueError, "layout='NDH' must be one of"),
] if torch is not None else []


@needs_torch
def test_the_mrope_append_call_the_kv_cases_vary_is_valid():
    mgr, a = mrope_manager(), _mrope_kv()
    q_in = a["q"].numpy().copy()
    mgr.apply_qk_and_append_kv(a["q"], a["k"], a["v"], "cond", a["cache"], a["slots"])
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = oracle.rope_oracle(q_in, np.asarray(MROPE_CURRENT_POSITIONS["cond"]), inv_freq,
                              attention, HEAD_DIM, False, mgr.rope.mrope_section, False)
    np.testing.assert_allclose(a["q"].numpy(), want, rtol=0, atol=2e-5)
    # Slots 0 and 5: page 0 entry 0, page 1 entry 1; the padding token writes nothing.
    assert torch.equal(a["cache"][1][0, 0], a["v"][0]) and torch.equal(a["cache"][1][1, 1], a["v"][1])
    assert int((a["cache"][1] != 0).any(-1).any(-1).sum()) == 2


@needs_torch
@pytest.mark.parametrize("case", MROPE_KV_CASES, ids=lambda c: c.name)
def test_mrope_append_bad_input_raises_and_changes_nothing(case):
    raises_naming_it_and_changes_nothing(case, mrope_manager, mrope_finish)
