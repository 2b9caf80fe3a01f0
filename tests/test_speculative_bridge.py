"""Speculative decoding through the torch bridge (torch_bridge.speculative): verify, accept,
draft steps, rollbacks and the publish epochs, and the vectorised readers against the
per-stream ones. The core's rules: tests/test_speculative.py."""

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
    step = PositionStep((Segment("a", "text", 6), Segment("b", "text", 2)), depths=depths)
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
                        depths={("a", "cond"): (0, 1, 1)})
    assert mgr.plan(step, StepContext(("a",), plan_results=kv))["attn"].tolist() == [30, 5, 6, 6]


def test_a_draft_step_numbers_every_token_at_one_offset_and_commits_nothing():
    mgr = make()
    ingest(mgr, a=12, b=40)
    for j in (1, 2, 3):
        step = PositionStep((Segment("a", "text", 1), Segment("b", "text", 1)), depths=j - 1)
        assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [11 + j, 39 + j]
        mgr.commit(step, ctx("a", "b"))
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (12, 40)
    mgr.rollback("a", "text", 10)   # a draft step holds no stream: a rewind is allowed
    assert mgr.position("a", "text") == 10


def test_a_draft_step_past_max_seq_len_is_planned_at_zero_and_marked_not_live():
    mgr = make(max_seq_len=64)
    ingest(mgr, a=62, b=5)
    step = PositionStep((Segment("a", "text", 2), Segment("b", "text", 2)), depths=2)  # topk 2
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [0, 0, 7, 7]
    assert mgr.live("text").tolist() == [False, False, True, True]
    assert mgr.state_snapshot()["counters"] == {("a", "text"): 62, ("b", "text"): 5}


def test_a_draft_step_in_a_graph_bucket_writes_its_buffer_and_keeps_the_tail():
    mgr = make()
    ingest(mgr, a=12, b=40, c=7)
    lease = GraphSlot(GraphBucket("draft", batch_size=4, num_tokens=4), slot=0)
    full = PositionStep(tuple(Segment(rid, "text", 1) for rid in "abc"), depths=0)
    buffer = mgr.plan(full, ctx("a", "b", "c", graph=lease))["text"]
    assert buffer.tolist() == [12, 40, 7, 0]
    fewer = PositionStep((Segment("b", "text", 1),), depths=3)
    again = mgr.plan(fewer, ctx("b", graph=lease))["text"]
    assert again.data_ptr() == buffer.data_ptr() and again.tolist() == [43, 40, 7, 0]
    assert mgr.live("text").tolist() == [True]


def test_apply_qk_rotates_a_tree_at_its_depths():
    mgr = make()
    ingest(mgr, a=50)
    step = PositionStep((Segment("a", "text", 4),), depths={("a", "text"): (0, 1, 1, 2)})
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
    step = PositionStep((Segment("a", "text", 0), Segment("b", "text", 2)), depths=1)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [10, 10]


def test_streams_named_again_after_a_remove_and_reingest_use_their_new_slots():
    # The bridge remembers the last named streams' slots; a new slot must not reuse them.
    mgr = make()
    ingest(mgr, a=10, b=20)
    tree = {("a", "text"): (0, 1), ("b", "text"): (0, 1)}
    step = PositionStep((Segment("a", "text", 2), Segment("b", "text", 2)), depths=tree)
    accepted = {("a", "text"): 1, ("b", "text"): 0}
    mgr.plan(step, ctx("a", "b"))
    mgr.commit(step, ctx("a", "b"), accepted=accepted)      # a at 12, b at 21
    mgr.remove_request("a")
    ingest(mgr, x=40)                                       # takes a's slot
    ingest(mgr, a=30)
    assert mgr.plan(step, ctx("a", "b"))["text"].tolist() == [30, 31, 21, 22]
    mgr.commit(step, ctx("a", "b"), accepted=accepted)
    assert [mgr.position(r, "text") for r in "abx"] == [32, 22, 40]


def _tree_records(rng, rids):
    """A random verify step (streams in random order) and depths in the forms an engine may
    send, well formed or not."""
    fixed = int(rng.integers(1, 4)) if rng.random() < 0.3 else None     # one tree shape
    views = [(rid, label, fixed or int(rng.integers(0, 4))) for rid in rids
             for label in ("cond", "uncond") if rng.random() < 0.6]
    rng.shuffle(views)
    if rng.random() < 0.5:      # every view of one label, in order: the common layout
        named = [v for v in views if v[1] == "cond"]
    else:
        named = [v for v in views if rng.random() < 0.8]
    if rng.random() < 0.1:
        named.append(("r9", "cond", 1) if rng.random() < 0.5 else (rids[0], "image", 1))
    forms = ["tuple", "list", "int64", "int32", "uint8", "bool", "float", "set", "2d", "column",
             "strided", "big-endian"]
    depths = {}
    for rid, label, count in named:
        count += int(rng.random() < 0.1)                    # sometimes the wrong length
        values = rng.integers(-1 if rng.random() < 0.05 else 0, 4, count)
        form = forms[int(rng.integers(0, len(forms)))] if rng.random() < 0.3 else "int64"
        depths[(rid, label)] = {
            "tuple": lambda: tuple(values.tolist()), "list": lambda: values.tolist(),
            "int64": lambda: values, "int32": lambda: values.astype(np.int32),
            "uint8": lambda: np.abs(values).astype(np.uint8), "bool": lambda: values > 1,
            "float": lambda: values.astype(float).tolist(), "set": lambda: set(values.tolist()),
            "2d": lambda: values[None], "column": lambda: values[:, None],
            "strided": lambda: np.repeat(values, 2)[::2], "big-endian": lambda: values.astype(">i8")}[form]()
    if fixed and depths and rng.random() < 0.7:     # one tree object shared by every stream
        shared = next(iter(depths.values()))
        depths = dict.fromkeys(depths, shared)
    return PositionStep(tuple(Segment(*v) for v in views), depths=depths)


def _outcome(call):
    try:
        return call()
    except (TypeError, ValueError) as e:
        return type(e), str(e)


def test_the_vectorised_tree_reader_accepts_only_what_the_per_stream_reader_accepts(rng):
    from torch_bridge import speculative as bridge_speculative
    from torch_bridge.step_arrays import StepReader
    from torch_bridge.streams import StreamTable

    streams = StreamTable(("cond", "uncond"))
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        streams.ingest(rid)
    reader, fast_hits, shared_hits = StepReader(streams, "kv"), 0, 0
    for _ in range(3000):
        step = _tree_records(rng, rids)
        try:
            arrays = reader.read(step, StepContext())
        except ValueError:
            continue
        if rng.random() < 0.05:                       # a slot change between two steps
            streams.release(rids[-1])
            streams.ingest(rids[-1])
            arrays = reader.read(step, StepContext())
        args = (step.depths, arrays.labels)
        fast = _outcome(lambda: bridge_speculative._trees_at_once(reader, streams, *args))
        slow = _outcome(lambda: bridge_speculative._trees(reader, step.depths, arrays.groups,
                                                          arrays.labels))
        if fast is None:
            continue
        fast_hits += 1
        shared_hits += len(set(map(id, step.depths.values()))) == 1 < len(step.depths)
        if isinstance(fast, tuple) and isinstance(fast[0], type):
            assert fast == slow, step
            continue
        assert isinstance(slow, bridge_speculative.Speculation), (step, slow)
        assert fast.depths.keys() == slow.depths.keys(), step
        for label, depths in fast.depths.items():
            assert depths.dtype == np.int64 and depths.tolist() == slow.depths[label].tolist()
        # The fast reader keeps the mapping's order, the per-stream one sorts.
        assert (dict(zip(fast.tree_slots.tolist(), fast.tree_depths.tolist()))
                == dict(zip(slow.tree_slots.tolist(), slow.tree_depths.tolist())))
        assert len(fast.tree_slots) == len(slow.tree_slots)
    assert fast_hits > 300 and shared_hits > 50


@pytest.mark.parametrize("count", [True, 1.0, "1", None])
def test_streams_named_again_with_a_bad_count_are_refused_as_the_first_time(count):
    # The second commit finds the streams' slots remembered; its counts are still checked.
    mgr = make()
    ingest(mgr, a=10, b=20)
    step = verify_step(a=2, b=2)
    for _ in range(2):
        mgr.plan(step, ctx("a", "b"))
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): np.int32(0)})
    mgr.plan(step, ctx("a", "b"))
    before = mgr.state_snapshot()
    with pytest.raises(ValueError, match=r"accepted\[\('b', 'text'\)\]=.* must be an int"):
        mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): count})
    assert mgr.state_snapshot() == before
    mgr.commit(step, ctx("a", "b"), accepted={("a", "text"): 1, ("b", "text"): 0})
    assert (mgr.position("a", "text"), mgr.position("b", "text")) == (16, 23)
