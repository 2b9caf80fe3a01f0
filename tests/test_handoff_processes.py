"""Prefill -> publish -> send -> admit -> decode across two processes, with a crash.

The module-scoped run starts a prefill process and a decode process (gloo on
127.0.0.1, a TCPStore this test process owns), SIGKILLs the decode process after the
commit of its step 5 (before it publishes), restarts it and lets it finish; 46-90 s
on two CPU cores (quiet to shared). Each check below reads that one run's log independently of
:func:`~torch_bridge.demo.disagg.verify`. The in-process twin
(:func:`~torch_bridge.demo.disagg.run_in_process`, the same nodes) shows the checks
fail when the resume is wrong: a record claiming a position its KV lacks, tokens the
record does not cover, a damaged or foreign record.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import jaxrope as jr  # noqa: E402
from jaxrope import wire  # noqa: E402
from torch_bridge import PositionConfig, PublishedPositionInfo, RopeManager  # noqa: E402
from torch_bridge.demo.disagg import (DecodeNode, DisaggReport, DisaggSpec,  # noqa: E402
                                      new_node, prefill, run_in_process, verify)
from torch_bridge.demo.disagg_processes import report_lines, run  # noqa: E402
from torch_bridge.demo.model import TOLERANCE  # noqa: E402
from torch_bridge.handoff import Handoff, RecordStore  # noqa: E402

SPEC = DisaggSpec()  # 4 requests (prompts 19, 33, 7, 24), killed after decode step 5
SMALL = DisaggSpec(requests=((9, 4), (5, 3)), kill_after=2)


@pytest.fixture(scope="module")
def report() -> DisaggReport:
    return run(SPEC, timeout=150)


def _decode_rows(report, name, published=None):
    return [row for row in report.rows[name] if row["kind"] == "decode"
            and (published is None or row["published"] == published)]


# ------------------------------------------------------------------ the two-process run


def test_the_two_process_run_passes_its_checks(report):
    assert report.failures == []
    assert report.exit_codes == {"prefill": 0, "decode0": -signal.SIGKILL, "decode1": 0}
    assert len(report.lost) == 1   # the prefill process saw the first decode process die


def test_a_passing_run_prints_the_kill_it_planned_and_no_gloo_error(report):
    lines = report_lines(report, 0.0)
    assert lines[-1].startswith("verdict: PASS"), lines[-1]
    assert not [line for line in lines if "gloo" in line or "Connection closed" in line], lines
    assert ("prefill: session 0's decode peer (decode0, killed by this run) went away; "
            "session 1 served its restart") in lines


def test_a_failing_run_prints_the_error_the_prefill_process_saw():
    failed = DisaggReport(SPEC, {}, {}, lost=["Connection closed by peer [127.0.0.1]:1"],
                          failures=["decode1 exited with 1, want 0"])
    lines = report_lines(failed, 0.0)
    assert "prefill: session 0's decode peer died: Connection closed by peer [127.0.0.1]:1" in lines
    assert lines[-1].startswith("verdict: FAIL") and lines[-1].endswith(
        "first: decode1 exited with 1, want 0")


def test_every_prefill_and_decode_step_matches_the_float64_recompute(report):
    rows = [row for rows in report.rows.values() for row in rows]
    assert {row["kind"] for row in rows} == {"prefill", "decode", "recover"}
    assert len(_decode_rows(report, "decode0")) == SPEC.kill_after + 1
    assert all(row["error"] <= TOLERANCE and not row["failures"] for row in rows), rows


def test_the_decode_process_died_mid_stream_and_its_restart_resumed_the_running_requests(report):
    held = report.rows["decode0"][-1]
    assert (held["kind"], held["published"], held["step"]) == ("decode", False, SPEC.kill_after)
    recover, first = report.rows["decode1"][:2]
    assert recover["kind"] == "recover" and set(recover["positions"]) == set(held["positions"])
    assert "r2 finished before the restart" in recover["events"]   # done at step 4, not resumed
    # The step computed but never published is decoded again, at the same positions.
    assert first["positions"] == held["positions"]


def test_each_request_decodes_every_position_once_across_the_kill(report):
    for index, rid in enumerate(SPEC.rids):
        prompt, max_new = SPEC.requests[index]
        positions = [row["positions"][rid] for name in ("decode0", "decode1")
                     for row in _decode_rows(report, name, published=True)
                     if rid in row["positions"]]
        assert positions == list(range(prompt, prompt + max_new)), rid


def test_final_records_are_within_64_bytes_a_stream_and_admitted_by_a_fresh_manager(report):
    fingerprint = new_node(SPEC, "check").mgr.fingerprint()
    for index, rid in enumerate(SPEC.rids):
        prompt, max_new = SPEC.requests[index]
        record, ids = report.records[rid]
        assert len(record) == 44 + (10 + len("main")) + (10 + len("cfg")) == 71
        final = PublishedPositionInfo.from_bytes(record, expect_fingerprint=fingerprint)
        assert final.counters == {"main": prompt + max_new, "cfg": 0}
        assert ids == [SPEC.token(index, p) for p in range(prompt, prompt + max_new)]
    assert report.bytes_per_stream == 13.5


def test_the_in_process_twin_logs_the_same_positions_and_events(report):
    twin = run_in_process(SPEC)
    assert twin.failures == []
    for name in report.rows:
        assert [(r["kind"], r["positions"], r["events"]) for r in twin.rows[name]] == \
            [(r["kind"], r["positions"], r["events"]) for r in report.rows[name]], name


def test_a_run_past_its_deadline_raises_and_leaves_no_child_behind():
    spec = DisaggSpec(seed=918273, kill_after=None)
    with pytest.raises(TimeoutError, match="deadline"):
        run(spec, timeout=1.0)
    marker = spec.to_json().encode()
    alive = []
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                alive.append(entry.name)
        except OSError:
            continue
    assert alive == [], f"children still running: {alive} (this test's own pid {os.getpid()})"


# ------------------------------------------------------------------ a wrong resume is caught


def _rewrite(rid, records, *, position_shift=0, ids=lambda ids: ids, record=lambda data: data):
    data, decoded = records.latest(rid)
    info = PublishedPositionInfo.from_bytes(data)
    info.counters["main"] += position_shift
    records.publish(rid, record(info.to_bytes()), ids(decoded))


def test_the_small_in_process_run_resumes_both_requests():
    report = run_in_process(SMALL)
    assert report.failures == []
    assert [row["kind"] for row in report.rows["decode1"]] == ["recover", "decode", "decode"]


@pytest.mark.parametrize("damage,fragment", [
    (dict(position_shift=1), "resume r0: position 12, its record 12, KV rebuilt to 11"),
    (dict(ids=lambda ids: ids + [7]), "resume r0: position 12, its record 11, KV rebuilt to 12"),
    (dict(record=lambda d: d[:30] + bytes((d[30] ^ 1,)) + d[31:]),
     "resume r0: published record refused (checksum)"),
    (dict(record=lambda d: d[:-2]), "resume r0: published record refused (truncated)"),
], ids=["record claims a lost position", "tokens repeat a position", "bit flip", "truncated"])
def test_a_damaged_record_store_fails_the_resumed_run(damage, fragment):
    report = run_in_process(SMALL, between=lambda records: _rewrite("r0", records, **damage))
    assert any(fragment in failure for failure in report.failures), report.failures


def test_a_record_of_another_rope_config_is_refused_at_admit():
    other = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=128), labels=("main", "cfg")),
                        "cpu")

    def foreign(records):
        data, ids = records.latest("r0")
        info = PublishedPositionInfo.from_bytes(data)
        info.fingerprint = other.fingerprint()
        records.publish("r0", info.to_bytes(), ids)

    report = run_in_process(SMALL, between=foreign)
    assert any("resume r0: published record refused (fingerprint)" in f for f in report.failures)


def test_a_shipped_record_of_another_rope_config_is_refused_and_not_decoded():
    handoffs = prefill(SMALL, new_node(SMALL, "prefill"), lambda row: None)
    info = PublishedPositionInfo.from_bytes(handoffs[0].record)
    other = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=128)), "cpu")
    info.fingerprint = other.fingerprint()
    rows = []
    node = DecodeNode(SMALL, RecordStore(dist.HashStore()), rows.append)
    assert node.step([dataclasses.replace(handoffs[0], record=info.to_bytes())]) is False
    assert rows[0]["failures"][0].startswith("admit r0: published record refused (fingerprint)")
    assert node.node.mgr.requests() == [] and node.failed


def test_verify_catches_a_repeated_or_missing_decode_position():
    good = run_in_process(SMALL)
    for change in ({"r0": 10}, {}):   # r0 decoded 10 twice / not at all in one step
        rows = {name: [dict(row) for row in rows] for name, rows in good.rows.items()}
        step = next(row for row in rows["decode1"] if row["kind"] == "decode")
        step["positions"] = {**{k: v for k, v in step["positions"].items() if k != "r0"}, **change}
        report = verify(DisaggReport(SMALL, rows, good.records))
        assert any(failure.startswith("r0 decoded positions") for failure in report.failures)


# ------------------------------------------------------------------ the transport's pieces


def test_a_handoff_refuses_mismatched_kv():
    k = torch.zeros(3, 2, 8)
    with pytest.raises(ValueError, match=r"must both be \[n, Hk, D\]"):
        Handoff("r0", b"", [1, 2, 3], k, torch.zeros(3, 2, 4))
    with pytest.raises(ValueError, match="must be equal"):
        Handoff("r0", b"", [1, 2, 3], k, k.half())
    with pytest.raises(TypeError, match="rid=0 must be a str"):
        Handoff(0, b"", [1, 2, 3], k, k)


def test_the_record_store_keeps_the_last_entry_and_refuses_a_foreign_one():
    store = dist.HashStore()
    records = RecordStore(store)
    records.publish("r0", wire.encode(bytes(32), []), [])
    records.publish("r0", b"x" * 5, [3, 4])
    assert records.latest("r0") == (b"xxxxx", [3, 4])
    store.set("records/r1", b"\x09\x00\x00\x00abc")
    with pytest.raises(ValueError, match="'records/r1': a 9-byte record"):
        records.latest("r1")
