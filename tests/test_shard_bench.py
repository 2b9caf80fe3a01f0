"""bench.shard_bench runs end to end on CPU in quick mode and writes its report.

On a CPU the times check the plumbing only; the GPU run is the measurement.
"""

import json
import math

import jax

from bench import shard_bench


def test_quick_run_reports_every_variant_against_the_plain_call(tmp_path):
    assert shard_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "shard_bench.json").read_text())
    assert report["env"]["jax"] == jax.__version__
    rows = report["results"]
    assert [(r["variant"], r["tokens"]) for r in rows] == [
        ("plain", 64), ("explicit", 64), ("auto", 64)]
    for row in rows:
        assert row["iters"] == 4 and len(row["loop_us_reps"]) == 3
        assert math.isfinite(row["loop_us"]) and math.isfinite(row["ratio"]["loop"])
        assert row["kernel"] is None  # no GPU profiler trace on a CPU
        # The wrapper adds nothing to the compiled loop over a 1-device mesh.
        assert row["same_program"], (row["hlo"], rows[0]["hlo"])
        assert isinstance(row["within_target"], bool)
    assert rows[0]["ratio"] == {"loop": 1.0}
