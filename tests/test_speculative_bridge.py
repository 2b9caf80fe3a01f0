"""Speculative decoding through the torch bridge (torch_bridge.speculative_steps): verify, accept,
draft steps, rollbacks and the publish epochs; the tree rule and the range of depths and
counts; the array forms against the mapping forms. The core's rules: tests/test_speculative.py."""

from __future__ import annotations

import numpy as np
import pytest

import jaxrope as jr

torch = pytest.importorskip("torch")

from torch_bridge import (GraphBucket, GraphSlot, KVPlanOutput, KVView, PositionConfig,  # noqa: E402
                          PositionStep, PublishedPositionInfo, RopeManager, Segment, StepContext)
from jaxrope.testing import oracle  # noqa: E402

HEAD_DIM = 16


def make(max_seq_len=256, labels=("text",)):
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4, max_position=1024)
    return RopeManager(PositionConfig(rope=rope, labels=labels), "cpu", max_seq_len=max_seq_len,
                       launcher="jax")


def ingest(mgr, **at):
    for rid, position in at.items():
        mgr.ingest_request(rid, overrides={"text": position})


def verify_step(**drafts):
    """A chain verify step: each stream's root and its drafts."""
    return PositionStep(tuple(Segment(rid, "text", k + 1) for rid, k in drafts.items()))


def ctx(*rids, graph=None, preplan=False):
    return StepContext(rids, graph_slot=graph, is_preplan=preplan)


def test_chain_verify_then_accept_advances_by_the_accepted_count_plus_one():
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = verify_step(a=4, b=2)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [10, 11, 12, 13, 14, 3, 4, 5]
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): 2})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (12, 6)
    assert mgr.publish("a").epochs == {}     # accepting moves forward: no new epoch


def test_accept_names_some_streams_and_the_others_commit_their_spans():
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = PositionStep((Segment("a", "text", 4), Segment("b", "text", 7)))   # b: a prefill chunk
    mgr.plan(step, ctx("a", "b"))
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 0})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (11, 10)


def test_tree_verify_numbers_by_depth_and_requires_its_accepted_count():
    mgr = make()
    ingest(mgr, a=7, b=20)
    depths = {("a", "text"): (0, 1, 1, 2, 2, 3)}
    step = PositionStep((Segment("a", "text", 6), Segment("b", "text", 2)), tree=depths)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [7, 8, 8, 9, 9, 10, 20, 21]
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="draft tree"):
        mgr.commit(step, ctx("a", "b"))
    with pytest.raises(ValueError, match=r"must be in \[0, 3\]"):
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 4})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 3})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (11, 22)


def test_a_tree_in_a_packed_plan_label_is_numbered_in_every_view_order():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a", overrides={"cond": 5, "uncond": 30})
    kv = {"kv": {"attn": KVPlanOutput((KVView("a", "uncond", 1), KVView("a", "cond", 3)))}}
    step = PositionStep((Segment("a", "cond", 3), Segment("a", "uncond", 1)),
                        tree={("a", "cond"): (0, 1, 1)})
    assert mgr.plan(step, StepContext(("a",), plan_results=kv))["attn"].tolist() == [30, 5, 6, 6]


def test_a_draft_step_numbers_every_token_at_one_offset_and_commits_nothing():
    mgr = make()
    ingest(mgr, a=12, b=40)
    for j in (1, 2, 3):
        step = PositionStep((Segment("a", "text", 1), Segment("b", "text", 1)), draft_depth=j - 1)
        assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [11 + j, 39 + j]
        mgr.commit(step, ctx("a", "b"))
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (12, 40)
    mgr.rollback("a", "text", 10)   # a draft step holds no stream: a rewind is allowed
    assert mgr.position("a", "text") == 10


def test_a_draft_step_past_max_seq_len_is_planned_at_zero_and_marked_not_live():
    mgr = make(max_seq_len=64)
    ingest(mgr, a=62, b=5)
    step = PositionStep((Segment("a", "text", 2), Segment("b", "text", 2)), draft_depth=2)  # topk 2
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [0, 0, 7, 7]
    assert mgr.live("text").tolist() == [False, False, True, True]
    assert mgr.state_snapshot()["counters"] == {("a", "text"): 62, ("b", "text"): 5}


def test_a_draft_step_in_a_graph_bucket_writes_its_buffer_and_keeps_the_tail():
    mgr = make()
    ingest(mgr, a=12, b=40, c=7)
    lease = GraphSlot(GraphBucket("draft", batch_size=4, num_tokens=4), slot=0)
    full = PositionStep(tuple(Segment(rid, "text", 1) for rid in "abc"), draft_depth=0)
    buffer = mgr.plan(full, ctx("a", "b", "c", graph=lease))["text"]
    assert buffer.tolist() == [12, 40, 7, 0]
    fewer = PositionStep((Segment("b", "text", 1),), draft_depth=3)
    again = mgr.plan(fewer, ctx("b", graph=lease))["text"]
    assert again.data_ptr() == buffer.data_ptr() and again.tolist() == [43, 40, 7, 0]
    assert mgr.live("text").tolist() == [True]


def test_apply_qk_rotates_a_tree_at_its_depths():
    mgr = make()
    ingest(mgr, a=50)
    step = PositionStep((Segment("a", "text", 4),), tree={("a", "text"): (0, 1, 1, 2)})
    mgr.plan(step, ctx("a"))
    gen = torch.Generator().manual_seed(7)
    q, k = torch.randn(4, 2, HEAD_DIM, generator=gen), torch.randn(4, 1, HEAD_DIM, generator=gen)
    inv_freq, attention = oracle.serving_frequencies(mgr.rope)
    want = [oracle.rope_oracle(x.numpy(), np.array([50, 51, 51, 52]), inv_freq, attention,
                               HEAD_DIM, False) for x in (q, k)]
    mgr.apply_qk(q, k, "text")
    np.testing.assert_allclose(q.numpy(), want[0], rtol=0, atol=2e-5)
    np.testing.assert_allclose(k.numpy(), want[1], rtol=0, atol=2e-5)


def test_a_preplan_that_assumed_every_draft_kept_makes_a_rejecting_commit_refuse():
    mgr = make()
    ingest(mgr, a=10)
    step = verify_step(a=3)
    mgr.plan(step, ctx("a"))
    nxt = verify_step(a=3)
    assert mgr.plan(nxt, ctx("a", preplan=True))["text"].tolist() == [14, 15, 16, 17]
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match="clear_preplan"):
        mgr.commit(step, ctx("a"), accepted={("a", "text"): 1})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a"), accepted={("a", "text"): 3})   # every draft kept: the preplan holds
    assert mgr.position("a", "text") == 14 and mgr.pos_ids("text").tolist() == [14, 15, 16, 17]


def test_accepted_counts_of_a_request_removed_since_the_plan_are_ignored():
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = verify_step(a=2, b=2)
    mgr.plan(step, ctx("a", "b"))
    mgr.remove_request("b")
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 2, ("b", "text"): 0})
    assert mgr.position("a", "text") == 13 and mgr.requests() == ["a"]


def test_committing_drafts_then_rolling_back_reaches_the_node_that_admitted_them():
    # vLLM's order: every scheduled token is committed, the rejected ones are taken back.
    prefill, decode = make(), make()
    for mgr in (prefill, decode):
        ingest(mgr, a=10)
    step = verify_step(a=4)
    prefill.plan(step, ctx("a"))
    prefill.commit(step, ctx("a"))
    with_drafts = prefill.publish("a")
    assert decode.admit_retrieve("a", None, None, with_drafts).ok
    prefill.rollback("a", "text", 10 + 1 + 1)   # one draft of four accepted
    assert decode.admit_retrieve("a", None, None, prefill.publish("a")).ok
    assert decode.admit_retrieve("a", None, None, with_drafts).ok     # a late echo
    assert decode.publish("a").record("text") == (12, 0, 1)


def test_snapshots_and_merged_publications_follow_the_epoch_order():
    mgr = make()
    ingest(mgr, a=20)
    before_rollback = mgr.publish_from_snapshot("a", mgr.publish_snapshot_for_step("a", None, None),
                                                None, None)
    mgr.rollback("a", "text", 17)
    after = mgr.publish("a")
    merged = after.clone()
    merged.update(before_rollback)             # older epoch, higher position: loses
    assert merged.record("text") == (17, 0, 1)
    merged = before_rollback.clone()
    merged.update(after)                       # newer epoch, lower position: wins
    assert merged.record("text") == (17, 0, 1)
    other = make()
    ingest(other, a=0)
    for info in (before_rollback, after, before_rollback):
        assert other.admit_retrieve("a", None, None, info).ok
    assert other.publish("a").record("text") == (17, 0, 1)


def test_published_records_without_rollbacks_merge_as_the_seed_max():
    a = PublishedPositionInfo({"text": 7})
    for position in (5, 9, 8):
        a.update(PublishedPositionInfo({"text": position}))
    assert a.counters == {"text": 9} and a.epochs == {}


def test_a_draft_step_with_an_empty_view_numbers_the_other_views_tokens_from_their_own_counter():
    mgr = make()
    ingest(mgr, a=5, b=9)
    step = PositionStep((Segment("a", "text", 0), Segment("b", "text", 2)), draft_depth=1)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [10, 10]


def test_streams_named_again_after_a_remove_and_reingest_use_their_new_slots():
    mgr = make()
    ingest(mgr, a=10, b=20)
    tree = {("a", "text"): (0, 1), ("b", "text"): (0, 1)}
    step = PositionStep((Segment("a", "text", 2), Segment("b", "text", 2)), tree=tree)
    accepted = {("a", "text"): 1, ("b", "text"): 0}
    mgr.plan(step, ctx("a", "b"))
    mgr.commit(step, ctx("a", "b"), accepted=accepted)      # a at 12, b at 21
    mgr.remove_request("a")
    ingest(mgr, x=40)                                       # takes a's slot
    ingest(mgr, a=30)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [30, 31, 21, 22]
    mgr.commit(step, ctx("a", "b"), accepted=accepted)
    assert [mgr.position(r, "text") for r in "abx"] == [32, 22, 40]


@pytest.mark.parametrize("count", [True, 1.0, "1", None])
def test_streams_named_again_with_a_bad_count_are_refused_as_the_first_time(count):
    # Counts committed before with the same streams; each commit checks its own.
    mgr = make()
    ingest(mgr, a=10, b=20)
    step = verify_step(a=2, b=2)
    for _ in range(2):
        mgr.plan(step, ctx("a", "b"))
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): np.int32(0)})
    mgr.plan(step, ctx("a", "b"))
    before = mgr.state_snapshot()
    with pytest.raises(TypeError, match=r"accepted\[\('b', 'text'\)\]=.* must be an int"):
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): count})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): 0})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (16, 23)


# ------------------------------------------------------------------------------ the tree rule


def _refused(mgr, call, error, fragment):
    """``call`` raises ``error`` naming ``fragment`` and leaves the manager as it was."""
    before = mgr.state_snapshot()
    with pytest.raises(error) as raised:
        call()
    assert fragment in str(raised.value), str(raised.value)
    assert mgr.state_snapshot() == before


def _tree_step(depths, rid="a"):
    return PositionStep((Segment(rid, "text", len(depths)),), tree={(rid, "text"): depths})


def test_a_tree_whose_draft_skips_a_depth_is_refused_before_the_counter_can_pass_its_kv():
    # Depths (0, 5) were planned at [10, 15] and accepted=5 moved the counter 10 -> 16
    # after 2 computed tokens.
    mgr = make()
    ingest(mgr, a=10)
    step = _tree_step((0, 5))
    _refused(mgr, lambda: mgr.plan(step, ctx("a")), ValueError,
             "step.tree[('a', 'text')]=[0, 5] is not a draft tree: token 1 has depth 5; no token "
             "before it has depth 4 (its parent)")
    assert mgr.pos_ids("text") is None
    with pytest.raises(ValueError, match="commit without a plan"):
        mgr.commit(step, ctx("a"), accepted={("a", "text"): 5})
    assert mgr.position("a", "text") == 10


@pytest.mark.parametrize("depths,fragment", [
    ((1, 2, 2), "=[1, 2, 2] is not a draft tree: token 0 has depth 1; the root (token 0) has depth 0"),
    ((0, 1, 0), "=[0, 1, 0] is not a draft tree: token 2 has depth 0; a tree has one root, token 0"),
    ((0, 1, 3, 2), "=[0, 1, 3, 2] is not a draft tree: token 2 has depth 3; no token before it has "
                   "depth 2 (its parent)"),
])
def test_a_tree_without_one_root_first_or_a_parent_before_each_draft_is_refused(depths, fragment):
    # (1, 2, 2) with 2 accepted moved the counter 10 -> 13, position 10 never computed.
    mgr = make()
    ingest(mgr, a=10)
    _refused(mgr, lambda: mgr.plan(_tree_step(depths), ctx("a")), ValueError, fragment)
    array = PositionStep((Segment("a", "text", len(depths)),), tree=np.array([depths]))
    _refused(mgr, lambda: mgr.plan(array, ctx("a")), ValueError,
             "step.tree[0] (stream ('a', 'text'))" + fragment[fragment.index("="):])


def test_the_counter_moves_by_the_accepted_path_and_no_further():
    mgr = make()
    ingest(mgr, a=10)
    step = _tree_step((0, 1, 1))     # two drafts at depth 1: the longest path is 2 tokens
    assert mgr.plan(step, ctx("a"))["text"].tolist() == [10, 11, 11]
    _refused(mgr, lambda: mgr.commit(step, ctx("a"), accepted={("a", "text"): 2}), ValueError,
             "accepted[('a', 'text')]=2 must be in [0, 1]")
    mgr.commit(step, ctx("a"), accepted={("a", "text"): 1})
    assert mgr.position("a", "text") == 12


@pytest.mark.parametrize("form", ["mapping", "array"])
def test_unsigned_depths_are_compared_at_their_own_width_and_never_wrap(form):
    # np.uint64 2**64 - 1 was cast to -1: planned [10, 9].
    mgr = make()
    ingest(mgr, a=10)
    segments = (Segment("a", "text", 2),)

    def tree(values):
        return {("a", "text"): values} if form == "mapping" else values[None]

    huge = PositionStep(segments, tree=tree(np.array([0, 2 ** 64 - 1], np.uint64)))
    _refused(mgr, lambda: mgr.plan(huge, ctx("a")), ValueError,
             "token 1 has depth 18446744073709551615; no token before it has depth 18446744073709551614")
    small = PositionStep(segments, tree=tree(np.array([0, 1], np.uint64)))
    assert mgr.plan(small, ctx("a"))["text"].tolist() == [10, 11]


@pytest.mark.parametrize("tree,error,fragment", [
    ({("a", "text"): (0, True)}, TypeError, "step.tree[('a', 'text')]=(0, True) must hold integer depths, not bools"),
    ({("a", "text"): np.array([True, False])}, TypeError, "must hold integer depths, got dtype bool"),
    (np.array([[True, False]]), TypeError, "step.tree must hold integer depths, got dtype bool"),
    ({("a", "text"): (0, 1.0)}, TypeError, "got dtype float64"),
    ({("a", "text"): (0, 2 ** 70)}, TypeError, "got dtype object"),
    ({("a", "text"): {0, 1}}, ValueError, "must be a non-empty sequence of ints"),
    ({("a", "text"): [[0], [1]]}, ValueError, "must be a non-empty sequence of ints"),
    ({("a", "text"): np.array([0, 1], np.int64), ("b", "text"): np.array([0, 1], np.uint64)},
     TypeError, "share no integer dtype"),
    ("0", TypeError, "step.tree must be an int array [len(step.segments), k] or"),
    (np.zeros((2, 2), np.int64), ValueError, "step.tree.shape=(2, 2) must be [len(step.segments), k] = [1, k >= 1]"),
    (np.zeros((1, 3), np.int64), ValueError, "step.tree is [1, 3] but step.segments[0]=('a', 'text', 2) spans 2"),
])
def test_depths_that_are_not_integer_trees_of_the_right_shape_are_refused(tree, error, fragment):
    mgr = make()
    ingest(mgr, a=10, b=20)
    two = isinstance(tree, dict) and ("b", "text") in tree
    segments = (Segment("a", "text", 2),) + ((Segment("b", "text", 2),) if two else ())
    step = PositionStep(segments, tree=tree)
    _refused(mgr, lambda: mgr.plan(step, ctx("a", "b")), error, fragment)


def test_an_array_tree_names_each_stream_once():
    mgr = make()
    ingest(mgr, a=10)
    step = PositionStep((Segment("a", "text", 2), Segment("a", "text", 2)), tree=np.array([[0, 1], [0, 1]]))
    one_view = StepContext(("a",), plan_results={"kv": {"text": KVPlanOutput((KVView("a", "text", 4),))}})
    _refused(mgr, lambda: mgr.plan(step, one_view), ValueError,
             "stream ('a', 'text') has more than one segment (step.segments[1])")


@pytest.mark.parametrize("depth,error,fragment", [
    (np.uint64(2 ** 64 - 1), ValueError,
     "step.draft_depth=18446744073709551615 must be an int in [0, 256] (max_seq_len=256)"),
    (-1, ValueError, "step.draft_depth=-1 must be an int in [0, 256] (max_seq_len=256)"),
    (True, TypeError, "step.draft_depth=True must be an int"),
    (1.0, TypeError, "step.draft_depth=1.0 must be an int"),
])
def test_a_draft_depth_is_an_int_below_max_seq_len(depth, error, fragment):
    mgr = make()
    ingest(mgr, a=10)
    step = PositionStep((Segment("a", "text", 1),), draft_depth=depth)
    _refused(mgr, lambda: mgr.plan(step, ctx("a")), error, fragment)


@pytest.mark.parametrize("accepted,error,fragment", [
    (np.array([2 ** 64 - 1, 0], np.uint64), ValueError,
     "accepted[0] (stream ('a', 'text'))=18446744073709551615 must be in [0"),
    (np.array([3, 0]), ValueError, "accepted[0] (stream ('a', 'text'))=3 must be in [0, 2]"),
    (np.array([0]), ValueError, "accepted.shape=(1,) must be [len(step.segments)] = [2]"),
    (np.array([0.0, 0.0]), TypeError, "accepted must hold integer counts, got dtype float64"),
    ({("a", "text"): 2 ** 64, ("b", "text"): 0}, ValueError, "accepted[('a', 'text')]=18446744073709551616 must be in [0"),
    ({("a", "text"): np.uint64(2 ** 64 - 1)}, ValueError, "accepted[('a', 'text')]=18446744073709551615 must be in [0"),
])
def test_accepted_counts_of_any_width_never_wrap_into_range(accepted, error, fragment):
    mgr = make()
    ingest(mgr, a=10, b=20)
    step = verify_step(a=2, b=2)
    mgr.plan(step, ctx("a", "b"))
    _refused(mgr, lambda: mgr.commit(step, ctx("a", "b"), accepted=accepted), error, fragment)


def _random_trees(rng, streams, k):
    """``[streams, k]`` depths of random trees laid out parents first (each token's parent
    drawn among the tokens before it)."""
    depths = np.zeros((streams, k), np.int64)
    for t in range(1, k):
        parent = rng.integers(0, t, streams)
        depths[:, t] = depths[np.arange(streams), parent] + 1
    return depths


def test_the_array_forms_plan_and_commit_exactly_as_the_mapping_forms(rng):
    by_array, by_mapping = make(max_seq_len=1024), make(max_seq_len=1024)
    rids = [f"r{i}" for i in range(int(rng.integers(5, 40)))]
    start = {rid: int(rng.integers(0, 500)) for rid in rids}
    for mgr in (by_array, by_mapping):
        ingest(mgr, **start)
    for _ in range(30):
        k = int(rng.integers(1, 9))
        batch = [rid for rid in rids if rng.random() < 0.8] or rids[:1]
        trees = _random_trees(rng, len(batch), k)
        segments = tuple(Segment(rid, "text", k) for rid in batch)
        keys = [(rid, "text") for rid in batch]
        accepted = rng.integers(0, trees.max(axis=1) + 1)
        array_step = PositionStep(segments, tree=trees)
        mapping_step = PositionStep(segments, tree=dict(zip(keys, map(tuple, trees.tolist()))))
        got = by_array.plan(array_step, ctx(*batch))["text"].tolist()
        assert got == by_mapping.plan(mapping_step, ctx(*batch))["text"].tolist()
        assert got == (np.repeat([by_array.position(r, "text") for r in batch], k) + trees.reshape(-1)).tolist()
        by_array.commit(array_step, ctx(*batch), accepted=accepted)
        by_mapping.commit(mapping_step, ctx(*batch), accepted=dict(zip(keys, accepted.tolist())))
        assert by_array.state_snapshot()["counters"] == by_mapping.state_snapshot()["counters"]


def test_a_tree_array_numbers_its_streams_views_in_any_kv_plan_order():
    mgr = make(labels=("cond", "uncond"))
    mgr.ingest_request("a", overrides={"cond": 5, "uncond": 30})
    mgr.ingest_request("b", overrides={"cond": 50, "uncond": 70})
    views = (KVView("b", "cond", 3), KVView("a", "uncond", 1), KVView("a", "cond", 3))
    kv = {"kv": {"attn": KVPlanOutput(views)}}
    step = PositionStep((Segment("a", "cond", 3), Segment("b", "cond", 3), Segment("a", "uncond", 1)),
                        tree={("a", "cond"): (0, 1, 1), ("b", "cond"): (0, 1, 2)})
    assert mgr.plan(step, StepContext(("a", "b"), plan_results=kv))["attn"].tolist() == [
        50, 51, 52, 30, 5, 6, 6]


def test_an_ordinary_step_never_calls_into_the_speculative_module(monkeypatch):
    from torch_bridge import speculative_steps as bridge_speculative

    def refuse(*args, **kwargs):
        raise AssertionError("an ordinary step called torch_bridge.speculative_steps")

    for name in bridge_speculative.__all__:
        if callable(getattr(bridge_speculative, name)) and name != "Speculation":
            monkeypatch.setattr(bridge_speculative, name, refuse)
    mgr = make()
    ingest(mgr, a=10, b=3)
    step = verify_step(a=0, b=3)
    q, k = torch.zeros(5, 2, HEAD_DIM), torch.zeros(5, 1, HEAD_DIM)
    for preplan in (False, True, False):
        mgr.plan(step, ctx("a", "b", preplan=preplan))
        mgr.apply_qk(q, k, "text")
        mgr.commit(step, ctx("a", "b"))
    assert mgr.live("text") is None or mgr.live("text").all()
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (13, 15)
    with pytest.raises(AssertionError, match="ordinary step called"):   # the patch bites
        mgr.plan(_tree_step((0, 1)), ctx("a"))


def test_a_tree_past_max_seq_len_is_refused_naming_the_stream_and_its_depth():
    mgr = make(max_seq_len=64)
    ingest(mgr, a=61)
    _refused(mgr, lambda: mgr.plan(_tree_step((0, 1, 1, 2, 3)), ctx("a")), ValueError,
             "stream ('a', 'text') of plan label 'text' at position 61 with depth 3 passes "
             "max_seq_len=64")
    assert mgr.plan(_tree_step((0, 1, 1, 2)), ctx("a"))["text"].tolist() == [61, 62, 62, 63]


def test_accepted_counts_name_the_tree_streams_in_any_order_or_after_a_remove():
    mgr = make()
    ingest(mgr, a=10, b=20, c=30)
    tree = {("b", "text"): (0, 1, 2), ("a", "text"): (0, 1, 1)}     # not the views' order
    step = PositionStep((Segment("a", "text", 3), Segment("b", "text", 3)), tree=tree)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [10, 11, 11, 20, 21, 22]
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): 2})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (12, 23)
    in_order = {("a", "text"): (0, 1, 1), ("b", "text"): (0, 1, 2)}
    step = PositionStep((Segment("a", "text", 3), Segment("b", "text", 3)), tree=in_order)
    mgr.plan(step, ctx("a", "b"))
    mgr.remove_request("a")
    ingest(mgr, a=40)                 # a new request under the old id: outside this plan
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 0, ("b", "text"): 1})
    assert (mgr.position("a", "text"), mgr.position("b", "text"), mgr.position("c", "text")) == (40, 25, 30)


def test_a_tree_count_past_its_depth_is_refused_by_name_after_another_request_left():
    # The plan's tree depths cover both requests; with b removed only a's are compared.
    mgr = make()
    ingest(mgr, a=10, b=20)
    step = PositionStep((Segment("a", "text", 4), Segment("b", "text", 2)),
                        tree={("a", "text"): (0, 1, 1, 2), ("b", "text"): (0, 1)})
    mgr.plan(step, ctx("a", "b"))
    mgr.remove_request("b")
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match=r"accepted\[\('a', 'text'\)\]=3 must be in \[0, 2\]"):
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 3})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 2})
    assert mgr.position("a", "text") == 13
