"""Bad input to an M-RoPE manager (positions [3, n], deltas): each refused naming the
argument, the manager's state unchanged and its pending step ending as an untouched twin's
(:func:`bad_input_harness.mrope_manager`, :mod:`bad_input_harness`).
"""

from __future__ import annotations

from bad_input_harness import (Bad, bridge_catalogue_test, busy_manager, mrope_finish,
                               mrope_manager, needs_torch, plan, qk, seg, torch)

if torch is not None:
    from bad_input_harness import GRAPH
    from torch_bridge import PublishedPositionInfo


def _mrope_cases():
    S = seg
    rows = torch.tensor([[0, 1], [0, 2], [0, 3]])
    return [
        Bad("M-RoPE: explicit 1-D pos_ids",
            lambda m: plan(m, S(("b", "cond", 2)), pos_ids={"cond": torch.arange(2)}), ValueError,
            "step.pos_ids['cond'].shape=(2,) is 1-D positions [n], but this manager rotates with "
            "M-RoPE (config.rope.mrope_section): pass [3, 2]"),
        Bad("M-RoPE: explicit pos_ids of the wrong length",
            lambda m: plan(m, S(("b", "cond", 1)), pos_ids={"cond": rows}), ValueError,
            "step.pos_ids['cond'].shape=(3, 2) must be [3, 1] (the plan label's tokens)"),
        Bad("M-RoPE: explicit pos_ids with two rows",
            lambda m: plan(m, S(("b", "cond", 2)), pos_ids={"cond": rows[:2]}), ValueError,
            "step.pos_ids['cond'].shape=(2, 2) must be [3, 2]"),
        Bad("M-RoPE: explicit pos_ids negative on the w row",
            lambda m: plan(m, S(("b", "cond", 2)), pos_ids={"cond": rows * torch.tensor([[1], [1], [-1]])}),
            ValueError, "step.pos_ids['cond'] has values in [-3, 2]"),
        Bad("M-RoPE: a decode plan at a negative counter + delta",
            lambda m: plan(m, S(("c", "cond", 1))), ValueError,
            "('c', 'cond') of plan label 'cond' at counter 0 + M-RoPE delta -5 is below 0",
            setup=lambda m: m.ingest_request("c", deltas={"cond": -5})),
        Bad("M-RoPE: a delta past max_seq_len", lambda m: m.ingest_request("a", deltas={"cond": 65}),
            ValueError, "deltas['cond']=65 must be an int in [-64, 64]"),
        Bad("M-RoPE: a float delta", lambda m: m.ingest_request("a", deltas={"cond": -2.0}),
            ValueError, "deltas['cond']=-2.0"),
        Bad("M-RoPE: explicit [3, n] past the graph bucket",
            lambda m: plan(m, S(("b", "cond", 5)), graph=GRAPH,
                            pos_ids={"cond": torch.zeros((3, 5), dtype=torch.int32)}),
            ValueError, "plan label 'cond' has 5 tokens, more than graph bucket num_tokens=4"),
        Bad("1-D: explicit M-RoPE pos_ids [3, n]",
            lambda m: plan(busy_manager(), S(("b", "cond", 2)), pos_ids={"cond": rows}),
            ValueError, "step.pos_ids['cond'].shape=(3, 2) is M-RoPE positions [3, n], but this "
                        "manager's RoPE is 1-D (config.rope.mrope_section is None): pass [2]"),
    ]


MROPE_CASES = _mrope_cases() if torch is not None else []


test_mrope_bad_input_raises_naming_the_argument_and_changes_nothing = bridge_catalogue_test(
    MROPE_CASES, mrope_manager, mrope_finish)


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
