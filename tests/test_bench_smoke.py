"""The benchmark runs end to end on CPU in quick mode and writes a complete report."""

import json
import random

import jax
import pytest

from bench import rope_bench
from jaxrope.kernels import mosaic_gpu

CASE = "T8-H8x1-D128-bf16"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    results_md = tmp_path_factory.mktemp("bench_results") / "RESULTS.md"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rope_bench, "RESULTS_MD", results_md)
        rope_bench.main(["--quick", "--out", str(out), "--filter", "main/", CASE, "--iters", "2",
                         "--reps", "2", "--no-progress", "--compile-workers", "0",
                         "--seed", str(random.randrange(2**31))])
    return out, results_md


def test_quick_run_writes_json_with_environment_and_positive_times(quick_run):
    out, _ = quick_run
    report = json.loads((out / "results.json").read_text())
    assert {"run_id", "date", "command", "argv", "env", "plan", "results", "targets", "notes",
            "elapsed_s"} <= set(report)
    assert report["env"]["jax"] == jax.__version__
    assert report["command"].startswith("python -m bench.rope_bench --quick")
    results = report["results"]
    assert {r["impl"] for r in results} >= {"jaxrope", "xla", "xla_ceiling"}
    assert {r["section"] for r in results} == {"main", "ceiling"}
    for r in results:
        assert r["shape"] == CASE and not r.get("error"), r
        assert r["iters"] == 2 and len(r["reps_us"]) == 2
        assert r["median_us"] > 0 and r["tbps"] > 0
        assert r["bytes"] == 2 * 8 * (8 + 1) * 128 * 2 + 8 * 4
    jaxrope = next(r for r in results if r["impl"] == "jaxrope")
    assert 0 < jaxrope["ceiling_fraction"] == jaxrope["ceiling_fractions"][jaxrope["ceiling_impl"]]


def test_quick_cpu_run_leaves_results_md_alone_and_writes_its_section_to_out(quick_run):
    out, results_md = quick_run
    assert not results_md.exists()
    section = (out / "results.md").read_text()
    assert section.startswith("<!-- rope_bench:begin ") and CASE in section


def test_from_json_renders_the_same_section(quick_run, tmp_path):
    out, _ = quick_run
    rope_bench.main(["--from-json", str(out / "results.json"), "--out", str(tmp_path)])
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()


def test_results_md_keeps_earlier_runs_and_replaces_a_rerun(tmp_path):
    path = tmp_path / "RESULTS.md"

    def section(run_id, body):
        return f"<!-- rope_bench:begin {run_id} -->\n{body}\n<!-- rope_bench:end {run_id} -->\n"

    rope_bench.update_results_md(path, section("a", "first"), "a")
    rope_bench.update_results_md(path, section("b", "second"), "b")
    rope_bench.update_results_md(path, section("a", "first again"), "a")
    text = path.read_text()
    assert text.startswith("# jaxrope benchmark results")
    assert "first again" in text and "second" in text and "first\n" not in text
    assert text.index("first again") < text.index("second")


def test_full_plan_covers_84_shapes_and_filters_keep_their_ceilings():
    env = rope_bench.Env(on_gpu=True, torch=True, flashinfer=True, launcher=True)
    tasks = rope_bench.build_tasks(rope_bench.FULL, "bfloat16", False, [], env)
    assert len({t.shape for t in tasks if t.section == "main"}) == 84
    assert {t.section for t in tasks} == {"main", "ceiling", "variants", "wall", "kernel"}
    picked = rope_bench.build_tasks(rope_bench.FULL, "bfloat16", False,
                                    ["main/", "T64-H32x8-D128"], env)
    assert {(t.section, t.impl) for t in picked} == (
        {("main", impl) for impl in rope_bench.MAIN_IMPLS if env.available(impl)}
        | {("ceiling", impl) for impl in rope_bench.CEILING_IMPLS})
    # The Mosaic GPU kernel: measured on a GPU wherever this JAX can build it (0.11 and
    # newer), at the target layout only.
    assert (("main", "jaxrope_mosaic") in {(t.section, t.impl) for t in picked}) == (
        mosaic_gpu.unavailable() is None)
    assert {t.shape.id[t.shape.id.index("-") + 1:] for t in tasks if t.impl == "jaxrope_mosaic"} <= {
        "H32x8-D128-bf16"}
    assert not rope_bench.Env(on_gpu=False).available("jaxrope_mosaic")
    assert {t.shape.id for t in picked} == {"T64-H32x8-D128-bf16"}
