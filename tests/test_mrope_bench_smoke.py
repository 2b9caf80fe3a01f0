"""bench/mrope_bench.py runs end to end on CPU (the Pallas interpreter) and writes its report."""

import json

from bench import mrope_bench


def test_quick_run_writes_timings_accuracy_and_targets(tmp_path):
    report = mrope_bench.main(["--quick", "--out", str(tmp_path), "--cases", "qwen2_vl_7b",
                               "--liger", str(tmp_path / "no-such-liger")])
    assert json.loads((tmp_path / "results.json").read_text()) == json.loads(json.dumps(report))
    assert (tmp_path / "table.txt").read_text().startswith("kernel (us per application")
    timed = {(r["layout"], r["impl"]): r for r in report["kernel"]}
    assert set(timed) == {("qwen2_vl_7b", "jaxrope_1d"), ("qwen2_vl_7b", "jaxrope_mrope"),
                          ("qwen2_vl_7b", "liger")}
    liger = timed[("qwen2_vl_7b", "liger")]
    assert "us" not in liger and ("liger-kernel not found" in liger["skipped"]  # with torch
                                  or "liger needs torch and triton" in liger["skipped"])
    for impl in ("jaxrope_1d", "jaxrope_mrope"):
        assert timed[("qwen2_vl_7b", impl)]["us"] > 0
    # 2 (q + k) bf16 plus the positions: 4 bytes a token in 1-D, 12 with three rows.
    qk = 2 * 8 * (32 + 8) * 128 * 2
    assert timed[("qwen2_vl_7b", "jaxrope_1d")]["bytes"] == qk + 8 * 4
    assert timed[("qwen2_vl_7b", "jaxrope_mrope")]["bytes"] == qk + 3 * 8 * 4
    assert [(r["case"], r["positions"]) for r in report["accuracy"]] == [
        ("qwen2_vl_7b", "uniform_2_20"), ("qwen2_vl_7b", "upper_half_2_20")]
    for r in report["accuracy"]:
        assert r["ok"] and r["floor"] <= r["error"] < mrope_bench.TARGET_BF16 < r["naive_float32_angle"]
    summary = report["summary"]
    assert [r["layout"] for r in summary["mrope_over_1d"]] == ["qwen2_vl_7b"]
    assert summary["versus_liger"] == [] and summary["all_ok"] is False  # liger was not run
