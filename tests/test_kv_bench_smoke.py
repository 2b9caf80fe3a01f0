"""bench/kv_append_bench.py runs end to end on CPU in quick mode; its targets read right."""

import importlib.util
import json

import pytest

from bench import kv_append_bench as bench


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv_bench")
    bench.main(["--quick", "--out", str(out)])
    return json.loads((out / "kv_append.json").read_text())


def test_quick_run_times_every_jax_implementation(report):
    assert report["command"].startswith("python -m bench.kv_append_bench --quick")
    rows = {r["impl"]: r for r in report["results"]}
    bridge = {"bridge", "bridge_fp8"} if importlib.util.find_spec("torch") else set()
    assert set(rows) == {"jaxrope", "xla_ceiling", "jaxrope_fp8"} | bridge, report["notes"]
    for r in rows.values():
        assert r["tokens"] == 16 and r["loop_us"] > 0 and len(r["reps_us"]) == 2
        assert r["bytes"] == 16 * ((2 * 32 + 4 * 8) * 128 * 2 + 8)
        assert r["method"], "each row says how it was timed (bench/timing.py)"
    for impl in ("jaxrope", *sorted(bridge - {"bridge_fp8"})):
        assert rows[impl]["ceiling_fraction"] == pytest.approx(
            rows["xla_ceiling"]["loop_us"] / rows[impl]["loop_us"])
    for impl in bridge:
        # Off CUDA the manager runs its JAX path; the rows still time every call.
        assert rows[impl]["path"] == "jax" and rows[impl]["wall_us"] > 0
    assert report["run"]["command"].startswith("python -m bench.kv_append_bench --quick")


def _row(tokens, impl="jaxrope", **values):
    return {"impl": impl, "tokens": tokens, **values}


def test_targets_compare_against_the_issue_limits():
    met = bench.targets([_row(16384, ceiling_fraction=0.96, vs_flashinfer=0.79),
                         _row(64, kernel_vs_flashinfer=0.98)])
    assert [t["met"] for t in met] == [True, True, True]
    missed = bench.targets([_row(65536, ceiling_fraction=0.94, vs_flashinfer=0.81),
                            _row(64, kernel_vs_flashinfer=1.02), _row(64)])
    assert [t["met"] for t in missed] == [False, False, False, False]


def test_the_bridge_rows_are_held_to_the_same_targets():
    met = bench.targets([_row(65536, "bridge", ceiling_fraction=0.97, vs_flashinfer=0.7),
                         _row(64, "bridge", kernel_vs_flashinfer=1.2),
                         _row(65536, "bridge_fp8", ceiling_fraction=0.5)])
    assert [(t["impl"], t["met"]) for t in met] == [("bridge", True), ("bridge", True),
                                                    ("bridge", False)]
