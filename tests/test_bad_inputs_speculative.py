"""Bad input to speculative steps (step.depths, commit's accepted=, live): each refused
naming the argument or the reason, the busy manager's state unchanged (:mod:`bad_input_harness`).

The busy manager's current plan gives a 3 tokens (a chain of 2 drafts), b's uncond 2 and
b's cond 1; the staged plan numbers a's cond.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxrope as jr

from bad_input_harness import (LABELS, Bad, bridge_catalogue_test, busy_manager, finish,
                               needs_torch, plan, seg, torch)

if torch is not None:
    from bad_input_harness import CURRENT, CURRENT_CTX
    from torch_bridge import PositionConfig, PositionManager, PositionStep, Segment, StepContext


def _speculative_cases():
    S = seg
    return [
        Bad("accepted as a list", lambda m: m.commit(CURRENT, CURRENT_CTX, accepted=[1]), TypeError,
            "accepted must be a mapping"),
        Bad("accepted count past the drafts",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): 2}), ValueError,
            "accepted[('b', 'uncond')]=2 must be in [0, 1]"),
        Bad("negative accepted count",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): -1}), ValueError,
            "accepted[('b', 'uncond')]=-1 must be in [0, 1]"),
        Bad("float accepted count",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): 1.0}), TypeError,
            "accepted[('b', 'uncond')]=1.0 must be an int"),
        Bad("bool accepted count",
            lambda m: m.commit(CURRENT, CURRENT_CTX, accepted={("b", "uncond"): True}), TypeError,
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
        Bad("tree as a string", lambda m: plan(m, S(("a", "cond", 1)), tree="0"), TypeError,
            "step.tree must be an int array [len(step.segments), k] or"),
        Bad("negative draft step depth", lambda m: plan(m, S(("a", "cond", 1)), draft_depth=-1),
            ValueError, "step.draft_depth=-1 must be an int in [0, 64] (max_seq_len=64)"),
        Bad("draft step with an advance",
            lambda m: plan(m, S(("a", "cond", 1)), draft_depth=1, advance=1),
            ValueError, "a draft step (step.draft_depth) commits nothing"),
        Bad("tree depths shorter than the view",
            lambda m: plan(m, S(("a", "cond", 3)), tree={("a", "cond"): (0, 1)}), ValueError,
            "step.tree[('a', 'cond')] has 2 entries but"),
        Bad("negative tree depth", lambda m: plan(m, S(("a", "cond", 2)), tree={("a", "cond"): (0, -1)}),
            ValueError, "step.tree[('a', 'cond')]=[0, -1] is not a draft tree: token 1 has depth -1"),
        Bad("float tree depths", lambda m: plan(m, S(("a", "cond", 2)), tree={("a", "cond"): (0, 1.5)}),
            TypeError, "must hold integer depths, got dtype float64"),
        Bad("bool tree depths beside int ones",
            lambda m: plan(m, S(("a", "cond", 2), ("b", "cond", 2)),
                            tree={("a", "cond"): np.array([0, 1]), ("b", "cond"): np.array([True, False])}),
            TypeError, "step.tree[('b', 'cond')]=array([ True, False]) must hold integer depths"),
        Bad("tree depths as a set",
            lambda m: plan(m, S(("a", "cond", 2), ("b", "cond", 2)),
                            tree={("a", "cond"): (0, 1), ("b", "cond"): {0, 1}}),
            ValueError, "step.tree[('b', 'cond')]={0, 1} must be a non-empty sequence"),
        Bad("tree depths of a stream without a view",
            lambda m: plan(m, S(("a", "cond", 1)), tree={("b", "cond"): (0,)}), ValueError,
            "step.tree[('b', 'cond')] names a stream which has no view"),
        Bad("tree depths keyed by a bare rid", lambda m: plan(m, S(("a", "cond", 1)), tree={"a": (0,)}),
            ValueError, "step.tree key 'a'"),
        Bad("tree whose draft skips a depth",
            lambda m: plan(m, S(("a", "cond", 2)), tree={("a", "cond"): (0, 52)}),
            ValueError, "token 1 has depth 52; no token before it has depth 51 (its parent)"),
        Bad("tree depths on a BLOCK manager",
            lambda m: _block_manager().plan(PositionStep(S(("a", "cond", 1)), tree={("a", "cond"): (0,)}),
                                            StepContext()), ValueError,
            "step.tree is set: speculative steps need the SEQUENTIAL scheme"),
        Bad("live of an unknown label", lambda m: m.live("nope"), ValueError, "label='nope'"),
    ]


def _block_manager():
    mgr = PositionManager(PositionConfig(labels=LABELS, scheme=jr.Scheme.BLOCK), "cpu")
    mgr.ingest_request("a")
    return mgr


SPECULATIVE_CASES = _speculative_cases() if torch is not None else []


test_speculative_bad_input_raises_naming_the_argument_and_changes_nothing = bridge_catalogue_test(
    SPECULATIVE_CASES, busy_manager, finish)


if torch is not None:
    DRAFT = PositionStep([Segment("b", "uncond", 1)], draft_depth=0)
    TREE = PositionStep([Segment("b", "uncond", 2)], tree={("b", "uncond"): (0, 1)})

_SPECULATIVE_COMMITS = [
    ("accepted of a draft step", lambda: DRAFT,
     lambda m: m.commit(DRAFT, StepContext(), accepted={("b", "uncond"): 0}), "draft step"),
    ("a draft tree without its accepted count", lambda: TREE,
     lambda m: m.commit(TREE, StepContext()),
     "stream ('b', 'uncond') was planned with step.tree (a draft tree)"),
    ("a tree with other depths than planned", lambda: TREE,
     lambda m: m.commit(PositionStep(TREE.segments, tree={("b", "uncond"): (0, 0)}), StepContext(),
                        accepted={("b", "uncond"): 0}),
     "commit's step.tree={('b', 'uncond'): (0, 0)} differs"),
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
