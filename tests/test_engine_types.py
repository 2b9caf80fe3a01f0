"""The engine records: construction, normalisation, and the base classes' defaults."""

import pytest

torch = pytest.importorskip("torch")

from torch_bridge import (AdmitOutcome, EngineInfo, Fork, GraphBucket, GraphSlot,  # noqa: E402
                          KVPlanOutput, KVView, PositionStep, PublishedInfo, Resource,
                          ResourceSpec, Segment, StepContext)


def test_records_unpack_as_tuples_in_field_order():
    rid, label, span = Segment("r7", "text", 5)
    assert (rid, label, span) == ("r7", "text", 5)
    assert KVView("r7", "cond", 3).to_compute == 3
    assert Fork("r7", "cond", "uncond").to_label == "uncond"


def test_step_converts_segment_lists_to_tuples_and_counts_tokens():
    step = PositionStep([Segment("a", "text", 4), Segment("b", "text", 0), Segment("c", "text", 9)])
    assert isinstance(step.segments, tuple)
    assert step.num_tokens == 13


def test_kv_plan_output_converts_sequences_and_counts_tokens():
    out = KVPlanOutput([KVView("a", "cond", 2), KVView("a", "uncond", 2)],
                       pre_forks=[Fork("a", "cond", "uncond")])
    assert isinstance(out.views, tuple) and isinstance(out.pre_forks, tuple)
    assert out.num_tokens == 4
    assert out.post_forks == ()


def test_step_context_defaults_to_an_eager_step_without_plan_results():
    ctx = StepContext(["a", "b"])
    assert ctx.request_ids == ("a", "b")
    assert not ctx.is_preplan and ctx.graph_slot is None and dict(ctx.plan_results) == {}


def test_graph_slots_are_hashable_keys_that_differ_by_slot():
    bucket = GraphBucket("decode", 8, 8)
    assert len({GraphSlot(bucket, 0), GraphSlot(bucket, 1), GraphSlot(bucket, 0)}) == 2


def test_admit_outcome_reason_defaults_to_none():
    assert AdmitOutcome(True, True) == (True, True, None)


def test_resource_defaults_publish_nothing_and_snapshot_is_the_publication():
    resource = Resource()
    assert resource.depends_on() == ()
    assert not resource.supports_preplan and not resource.force_double_buffer
    assert resource.fingerprint() is None
    snapshot = resource.publish_snapshot_for_step("r", None, None)
    assert resource.publish_from_snapshot("r", snapshot, None, None) is None


def test_published_info_base_requires_subclass_methods():
    with pytest.raises(NotImplementedError):
        PublishedInfo().clone()
    with pytest.raises(NotImplementedError):
        PublishedInfo().update(PublishedInfo())


def test_spec_and_info_carry_options_and_defaults():
    spec = ResourceSpec("position", config=None, options={"max_seq_len": 99})
    info = EngineInfo("cpu")
    assert spec.options["max_seq_len"] == 99
    assert info.head_dim is None and info.max_seq_len is None


def test_a_step_is_a_draft_step_or_a_tree_verify_not_both():
    segments = [Segment("r0", "text", 2)]
    assert PositionStep(segments, draft_depth=1).tree is None
    assert PositionStep(segments, tree={("r0", "text"): (0, 1)}).draft_depth is None
    with pytest.raises(ValueError, match=r"draft_depth=1 and tree= are both set"):
        PositionStep(segments, draft_depth=1, tree={("r0", "text"): (0, 1)})
