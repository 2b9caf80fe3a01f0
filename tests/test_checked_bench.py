"""bench/checked_bench.py runs end to end on CPU in quick mode and reports both sides."""

import json

from bench import checked_bench


def test_quick_run_times_each_step_with_the_checks_off_and_on(tmp_path):
    cases = ["rope_64", "append_64", "plan_commit_256"]
    checked_bench.main(["--quick", "--out", str(tmp_path), "--cases", *cases])
    report = json.loads((tmp_path / "checked_bench.json").read_text())
    assert report["info"]["command"].startswith("python -m bench.checked_bench --quick")
    assert report["backend"] == "auto" and set(report["results"]) == set(cases)
    for name, row in report["results"].items():
        for method in ("call_us", "loop_us"):
            timed = row[method]
            assert timed["identical_outputs"], (name, method)
            assert len(timed["rounds_off_us"]) == len(timed["rounds_on_us"]) == 3
            assert timed["off_us"] > 0 and timed["on_us"] > 0
            assert timed["ratio"] > 0
