"""Bad input to the bridge manager's construction, requests, plan, commit and apply_qk:
each refused naming the argument, the busy manager's state unchanged and its pending
steps ending as an untouched twin's (:func:`bad_input_harness.raises_naming_it_and_changes_nothing`).
"""

from __future__ import annotations

import numpy as np
import pytest

from bad_input_harness import (HEAD_DIM, Bad, apply, bridge_catalogue_test, busy_manager, finish,
                               needs_torch, plan, prefix, qk, rope_manager, seg, torch)

if torch is not None:
    from bad_input_harness import (CURRENT, CURRENT_CTX, CURRENT_POSITIONS, GRAPH, STAGED,
                                   STAGED_CTX)
    from torch_bridge import (EngineInfo, Fork, GraphSlot, KVPlanOutput, KVView, PositionConfig,
                              PositionManager, PositionStep, ResourceSpec,
                              RopeManager, Segment, StepContext)


def _manager_cases():
    S = seg
    return [
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
        Bad("manager config of the wrong type", lambda m: rope_manager(config={"labels": ("a",)}),
            TypeError, "config must be"),
        Bad("manager max_seq_len 0", lambda m: rope_manager(max_seq_len=0),
            ValueError, "max_seq_len=0"),
        Bad("manager max_seq_len past rope.max_position", lambda m: rope_manager(max_seq_len=2048),
            ValueError, "max_seq_len=2048"),
        Bad("manager max_seq_len past int32 counters",
            lambda m: PositionManager(PositionConfig(), "cpu", max_seq_len=2**40), ValueError,
            "max_seq_len=1099511627776"),
        Bad("manager head_dim differs from rope.head_dim", lambda m: rope_manager(head_dim=32),
            ValueError, "head_dim=32"),
        Bad("manager dtype (not an argument: q and k keep theirs)",
            lambda m: rope_manager(dtype=torch.float32), TypeError, "dtype"),
        Bad("manager unknown device", lambda m: rope_manager(device="banana"),
            ValueError, "device='banana'"),
        Bad("manager CUDA device that does not exist", lambda m: rope_manager(device="cuda:99"),
            ValueError, "device='cuda:99'"),
        Bad("manager unknown launcher", lambda m: rope_manager(launcher="fast"), ValueError,
            "launcher='fast'"),
        Bad("manager unknown backend", lambda m: rope_manager(backend="cuda"),
            ValueError, "backend='cuda'"),
        Bad("manager allow_copy as a string", lambda m: rope_manager(allow_copy="no"), TypeError,
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
        Bad("plan a request never ingested", lambda m: plan(m, S(("a", "cond", 1), ("ghost", "cond", 1))),
            ValueError, "'ghost'"),
        Bad("plan an unknown label", lambda m: plan(m, S(("a", "image", 1))),
            ValueError, "label='image'"),
        Bad("plan an unhashable label", lambda m: plan(m, S(("a", ["cond"], 1))), TypeError,
            "label=['cond']"),
        Bad("plan a negative span", lambda m: plan(m, S(("a", "cond", -1))), ValueError,
            "plan label 'cond'[0].span=-1 must be an int in [0, 2147483647]"),
        Bad("plan a float span", lambda m: plan(m, S(("a", "cond", 1.5))), TypeError,
            "step.segments[0].span=1.5 must be an int"),
        Bad("plan a bool span", lambda m: plan(m, S(("a", "cond", True))), TypeError,
            "step.segments[0].span=True must be an int"),
        Bad("plan a segment that is not a triple", lambda m: plan(m, [("a", "cond")]), TypeError,
            "(request_id, label, count)"),
        Bad("plan a step of the wrong type", lambda m: m.plan([Segment("a", "cond", 1)], StepContext()),
            TypeError, "step must be a PositionStep"),
        Bad("plan a context of the wrong type", lambda m: m.plan(PositionStep(S(("a", "cond", 1))), {}),
            TypeError, "ctx must be a StepContext"),
        Bad("plan positions past max_seq_len", lambda m: plan(m, S(("a", "cond", 53))), ValueError,
            "('a', 'cond') of plan label 'cond' at position 12 with 53 tokens passes max_seq_len=64"),
        Bad("preplan past max_seq_len once the current step commits",
            lambda m: plan(m, S(("a", "cond", 50)), preplan=True), ValueError,
            "('a', 'cond') of plan label 'cond' at position 15 with 50 tokens"),
        Bad("plan the same stream twice in one plan label",
            lambda m: plan(m, S(("a", "cond", 2), ("b", "cond", 1), ("a", "cond", 3))), ValueError,
            "stream ('a', 'cond') has more than one view in plan label 'cond'"),
        Bad("explicit pos_ids of the wrong length",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.arange(3)}), ValueError,
            "step.pos_ids['cond'].shape=(3,)"),
        Bad("explicit float pos_ids",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.arange(2.0)}), ValueError,
            "step.pos_ids['cond'] has shape=(2,) dtype=torch.float32"),
        Bad("explicit pos_ids on another device",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.arange(2, device="meta")}),
            ValueError, "step.pos_ids['cond'] is on meta"),
        Bad("explicit pos_ids for a plan label the step lacks",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"image": torch.arange(2)}), ValueError,
            "step.pos_ids['image']"),
        Bad("explicit negative pos_ids",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.tensor([3, -1])}), ValueError,
            "step.pos_ids['cond'] has values in [-1, 3]"),
        Bad("explicit pos_ids at max_seq_len",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.tensor([63, 64])}), ValueError,
            "step.pos_ids['cond'] has values in [63, 64]"),
        Bad("explicit int64 pos_ids past int32",
            lambda m: plan(m, S(("a", "cond", 2)), pos_ids={"cond": torch.tensor([2**40, 1])}),
            ValueError, "step.pos_ids['cond'] has values in [1, 1099511627776]"),
        Bad("one explicit tensor for two plan labels",
            lambda m: plan(m, S(("a", "cond", 1), ("b", "uncond", 1)), pos_ids=torch.arange(1)),
            ValueError, "step.pos_ids is one tensor but the step has 2 plan labels"),
        Bad("explicit pos_ids as a list", lambda m: plan(m, S(("a", "cond", 2)), pos_ids=[1, 2]),
            TypeError, "step.pos_ids must be"),
        Bad("negative advance", lambda m: plan(m, S(("a", "cond", 1)), advance=-1), ValueError,
            "step.advance=-1"),
        Bad("bool advance", lambda m: plan(m, S(("a", "cond", 1)), advance=True), TypeError,
            "step.advance=True"),
        Bad("advance of a stream without a segment",
            lambda m: plan(m, S(("a", "cond", 1)), advance={("b", "cond"): 1}), ValueError,
            "step.advance names stream ('b', 'cond')"),
        Bad("advance keyed by a bare rid", lambda m: plan(m, S(("a", "cond", 1)), advance={"a": 1}),
            ValueError, "step.advance key 'a'"),
        Bad("negative advance of one stream",
            lambda m: plan(m, S(("a", "cond", 1)), advance={("a", "cond"): -2}), ValueError,
            "step.advance[('a', 'cond')]=-2"),
        Bad("KV plan output of the wrong type", lambda m: plan(m, S(("a", "cond", 1)), kv={"attn": [1]}),
            TypeError, "ctx.plan_results['kv']['attn']"),
        Bad("KV plan results not a mapping", lambda m: plan(m, S(("a", "cond", 1)), kv=[1]),
            TypeError,
            "ctx.plan_results['kv'] must be a mapping"),
        Bad("pre-fork to an unknown label",
            lambda m: plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], pre_forks=[Fork("a", "cond", "zz")])}), ValueError, "label='zz'"),
        Bad("post-fork of an unknown request",
            lambda m: plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], post_forks=[Fork("ghost", "cond", "uncond")])}), ValueError,
            "'ghost'"),
        Bad("two pre-forks into one stream from different sources",
            lambda m: plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], pre_forks=[Fork("a", "cond", "uncond")]),
                "other": KVPlanOutput([], pre_forks=[Fork("a", "uncond", "uncond")])}), ValueError,
            "pre_forks copy two different counters into stream ('a', 'uncond')"),
        Bad("pre-fork that is not a triple",
            lambda m: plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput(
                [KVView("a", "cond", 1)], pre_forks=[("a", "cond")])}), TypeError, "pre_forks must be"),
        Bad("KV view with a negative count",
            lambda m: plan(m, S(("a", "cond", 1)), kv={"attn": KVPlanOutput([KVView("a", "cond", -2)])}),
            ValueError, "plan label 'attn'[0].to_compute=-2 must be an int in [0, 2147483647]"),
        Bad("more tokens than the graph bucket",
            lambda m: plan(m, S(("a", "cond", 5)), graph=GRAPH), ValueError, "num_tokens=4"),
        Bad("graph slot of the wrong type", lambda m: plan(m, S(("a", "cond", 1)), graph=("decode", 0)),
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
        # A planned stream is frozen: what would have carried this commit past max_seq_len
        # (a record moving b's planned uncond to 63) is refused first.
        Bad("cached prefix moving a stream the current plan numbers",
            lambda m: prefix(m, "b", {"uncond": 63}), ValueError,
            "prefix['uncond']=63 would move the counter from 5 to 63, but stream ('b', 'uncond') "
            "is in a plan not yet committed (the current plan numbers it in plan label 'uncond'"),
        # apply_qk / pos_ids
        Bad("apply_qk on an unknown label", lambda m: apply(m, "nope"), ValueError,
            "label='nope' is unknown"),
        Bad("apply_qk on a label the current plan lacks", lambda m: apply(m, "attn"), ValueError,
            "no positions planned for label='attn'"),
        Bad("apply_qk on an unhashable label", lambda m: apply(m, ["cond"]),
            TypeError, "label=['cond']"),
        Bad("apply_qk with q not a tensor", lambda m: apply(m, q=np.ones((4, 3, HEAD_DIM), np.float32)),
            TypeError, "q must be a torch.Tensor"),
        Bad("apply_qk with float64 q and k",
            lambda m: apply(m, q=qk(dtype=torch.float64)[0], k=qk(dtype=torch.float64)[1]),
            ValueError, "q.dtype=torch.float64"),
        Bad("apply_qk with k in another dtype", lambda m: apply(m, k=qk(dtype=torch.float16)[1]),
            ValueError, "k.dtype=torch.float16 must equal q.dtype"),
        Bad("apply_qk with the wrong head size", lambda m: apply(m, q=qk(head_dim=8)[0]),
            ValueError,
            "q.shape=(4, 3, 8)"),
        Bad("apply_qk with flattened heads not a multiple of head_dim",
            lambda m: apply(m, q=torch.randn(4, 40)), ValueError, "q.shape=(4, 40)"),
        Bad("apply_qk with k of fewer tokens", lambda m: apply(m, k=qk(tokens=3)[1]), ValueError,
            "k.shape[0]=3"),
        Bad("apply_qk with q on another device",
            lambda m: apply(m, q=torch.empty(4, 3, HEAD_DIM, device="meta")), ValueError, "q is on meta"),
        Bad("apply_qk with q tracked by autograd",
            lambda m: apply(m, q=torch.randn(4, 3, HEAD_DIM, requires_grad=True)), ValueError,
            "q.requires_grad=True"),
        Bad("apply_qk with an unknown keyword", lambda m: apply(m, rope_factor=2.0), TypeError,
            "rope_factor"),
        Bad("apply_qk with an odd rotary_dim", lambda m: apply(m, rotary_dim=7),
            ValueError, "rotary_dim=7"),
        Bad("apply_qk with a negative rope_scale", lambda m: apply(m, rope_scale=-1.0), ValueError,
            "rope_scale=-1.0"),
        Bad("apply_qk with rope_theta 0", lambda m: apply(m, rope_theta=0.0),
            ValueError, "theta=0.0"),
        Bad("apply_qk with interleave as a string", lambda m: apply(m, interleave="yes"),
            TypeError,  # RopeConfig's rule: a wrong type is a TypeError (README)
            "interleave='yes'"),
        Bad("apply_qk with rope_dtype (not an argument)", lambda m: apply(m, rope_dtype="f32"),
            TypeError, "rope_dtype"),
        Bad("pos_ids of an unknown label", lambda m: m.pos_ids("nope"), ValueError, "label='nope'"),
    ]


MANAGER_CASES = _manager_cases() if torch is not None else []


test_manager_bad_input_raises_naming_the_argument_and_changes_nothing = bridge_catalogue_test(
    MANAGER_CASES, busy_manager, finish)


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
    q, k = qk(2)
    for bad in (lambda: mgr.apply_qk(q[..., :8], k, "attn"), lambda: mgr.apply_qk(q, k, "cond"),
                lambda: mgr.apply_qk(q, k, "attn", rope_scale=0.0)):
        with pytest.raises(ValueError):
            bad()
        assert mgr.state_snapshot() == before
    mgr.apply_qk(q, k, "attn")
    after = mgr.state_snapshot()
    assert after["staged"] is None and after["current"]["positions"] == {"attn": (1, 2)}
    assert after["counters"][("b", "uncond")] == 1


@needs_torch
def test_state_snapshot_sees_every_kind_of_change():
    """The hook the catalogue relies on is not blind: each mutation changes its snapshot."""
    mutations = [
        lambda m: m.ingest_request("d"),
        lambda m: prefix(m, "c", {"cond": 7}),
        lambda m: m.reset_request("c"),
        lambda m: m.remove_request("b"),
        lambda m: m.clear_preplan(),
        lambda m: m.commit(CURRENT, CURRENT_CTX),
        lambda m: plan(m, seg(("b", "cond", 1)), graph=GraphSlot(GRAPH.bucket, 1)),
        lambda m: plan(m, seg(("a", "cond", 1)), kv={"other": KVPlanOutput([KVView("a", "cond", 1)])},
                        preplan=True),
    ]
    for mutate in mutations:
        mgr = busy_manager()
        mgr.ingest_request("c", {"cond": 3})   # no plan numbers c: it may move
        before = mgr.state_snapshot()
        mutate(mgr)
        assert mgr.state_snapshot() != before
