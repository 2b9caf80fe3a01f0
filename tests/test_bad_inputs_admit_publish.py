"""Bad input to admit_retrieve, apply_cached_prefix and publish: refused naming the
argument, or (an admit that cannot be taken on, a second remove, unusable record bytes)
reported, and either way the busy manager's state unchanged and its pending steps ending as
an untouched twin's (:mod:`bad_input_harness`).
"""

from __future__ import annotations

import pytest

import jaxrope as jr

from bad_input_harness import (HEAD_DIM, LABELS, MAX_SEQ_LEN, Bad, bridge_catalogue_test,
                               busy_manager, finish, needs_torch, prefix, torch)

if torch is not None:
    from torch_bridge import PositionConfig, PublishedPositionInfo, RopeManager


def _admit_publish_cases():
    return [
        Bad("admit a foreign info type", lambda m: m.admit_retrieve("a", None, None, {"cond": 5}),
            TypeError,
            "published must be a PublishedPositionInfo"),
        Bad("admit for an unhashable rid",
            lambda m: m.admit_retrieve(["a"], None, None, PublishedPositionInfo({"cond": 5})), TypeError,
            "rid=['a']"),
        Bad("cached prefix of an unknown request", lambda m: prefix(m, "ghost", {"cond": 3}),
            ValueError,
            "'ghost'"),
        Bad("negative cached prefix", lambda m: prefix(m, "a", {"cond": -1}), ValueError,
            "prefix['cond']=-1"),
        Bad("cached prefix past max_seq_len", lambda m: prefix(m, "a", {"cond": 65}), ValueError,
            "prefix['cond']=65"),
        Bad("cached prefix of an unknown label", lambda m: prefix(m, "a", {"image": 3}),
            ValueError,
            "label='image'"),
        Bad("cached prefix as a list", lambda m: prefix(m, "a", [("cond", 3)]), ValueError,
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
    ]


ADMIT_PUBLISH_CASES = _admit_publish_cases() if torch is not None else []


test_admit_and_publish_bad_input_raises_naming_the_argument_and_changes_nothing = bridge_catalogue_test(
    ADMIT_PUBLISH_CASES, busy_manager, finish)


# ------------------------------------------------------------------------------ reported, not raised


def _admit_reports_and_changes_nothing(published, fragment: str) -> None:
    """Admitting ``published`` on the busy manager reports ``fragment`` (not ok, not
    ready), leaves the snapshot as it was and the manager ending as an untouched twin."""
    mgr, twin = busy_manager(), busy_manager()
    before = mgr.state_snapshot()
    outcome = mgr.admit_retrieve("a", "node", "walk", published)
    assert (outcome.ok, outcome.ready) == (False, False) and fragment in outcome.reason, outcome
    assert mgr.state_snapshot() == before
    assert finish(mgr) == finish(twin)


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
    _admit_reports_and_changes_nothing(published, fragment)


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
    prefix(mgr, "a", None)
    assert mgr.state_snapshot() == before
    assert finish(mgr) == finish(twin)


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
    _admit_reports_and_changes_nothing(data(), fragment)


@needs_torch
def test_admit_of_a_record_as_str_raises_and_changes_nothing():
    mgr = busy_manager()
    before = mgr.state_snapshot()
    with pytest.raises(TypeError, match="PublishedPositionInfo, bytes or None, got str"):
        mgr.admit_retrieve("a", None, None, "JRPR")
    assert mgr.state_snapshot() == before
