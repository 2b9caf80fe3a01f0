"""The benchmarks run end to end on a CPU at tiny sizes, and the timing module measures.

What the GPU run depends on: ``bench/gpu_suite.sh`` names benchmark modules that take
``--out``; ``rope_bench`` writes a complete JSON report, its markdown and plot, renders a
saved report identically and replaces only its own section of RESULTS.md; every timer
returns a Timing whose numbers come from real calls.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import rope_bench, rope_report, timing
from jaxrope.cases import CASES

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOKENS = 8


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    results_md = tmp_path_factory.mktemp("bench_results") / "RESULTS.md"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rope_report, "RESULTS_MD", results_md)
        report = rope_bench.main(["--quick", "--out", str(out), "--sections", "sweep", "cases",
                                  "--cases", "default_d128", "qwen25_yarn", "--tokens",
                                  str(TOKENS), "--iters", "2", "--reps", "2", "--seed", "3"])
    return out, results_md, report


def test_quick_run_writes_a_report_with_versions_command_and_positive_times(quick_run):
    out, _, _ = quick_run
    report = json.loads((out / "rope_bench.json").read_text())
    info = report["info"]
    assert info["jax"] == jax.__version__ and info["date"] and info["python"]
    assert info["command"].startswith("python -m bench.rope_bench --quick")
    results = report["results"]
    assert {r["impl"] for r in results if r["section"] == "sweep"} >= {"jaxrope", "xla",
                                                                       "xla_ceiling"}
    assert {(r["section"], r["case"]) for r in results} == {
        ("sweep", "default_d128"), ("cases", "default_d128"), ("cases", "qwen25_yarn")}
    for r in results:
        assert not r.get("error"), r
        assert r["timing"]["iters"] == 2 and r["timing"]["n"] == 2, r
        assert r["median_us"] > 0 and r["tbps"] > 0, r
        case = next(c for c in CASES if c.name == r["case"])
        assert r["bytes"] == 2 * TOKENS * (case.q_heads + case.k_heads) * case.head_dim * 2 + 4 * TOKENS
    ours = next(r for r in results if r["key"] == f"sweep/jaxrope/default_d128/T{TOKENS}")
    assert ours["ceiling_fraction"] > 0 and ours["api"] == "apply_rope backend=interpret"
    yarn = next(r for r in results if r["key"] == f"cases/jaxrope/qwen25_yarn/T{TOKENS}")
    assert yarn["ratio_plain"] > 0 and yarn["scaling"] == "Yarn"


def test_quick_run_leaves_results_md_alone_and_writes_markdown_and_plot_to_out(quick_run):
    out, results_md, _ = quick_run
    assert not results_md.exists()
    markdown = (out / "rope_bench.md").read_text()
    assert markdown.startswith(rope_report.BEGIN) and rope_report.END in markdown
    assert "qwen25_yarn" in markdown and "Command: `python -m bench.rope_bench" in markdown
    pytest.importorskip("matplotlib")
    assert (out / "rope_tbps.png").stat().st_size > 0


def test_from_json_renders_the_same_markdown_and_writes_results_md(quick_run, tmp_path,
                                                                   monkeypatch):
    out, _, _ = quick_run
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text(f"# head\n\n{rope_report.BEGIN}\nold numbers\n{rope_report.END}\n\n## kept\n")
    monkeypatch.setattr(rope_report, "RESULTS_MD", results_md)
    monkeypatch.setattr(rope_report, "RESULTS_PNG", tmp_path / "rope_tbps.png")
    rope_bench.main(["--from-json", str(out / "rope_bench.json"), "--out", str(tmp_path / "o"),
                     "--write-results"])
    markdown = (out / "rope_bench.md").read_text()
    assert (tmp_path / "o" / "rope_bench.md").read_text() == markdown
    text = results_md.read_text()
    assert text.startswith("# head\n") and text.endswith("## kept\n")
    assert "old numbers" not in text and markdown.strip() in text


def test_results_md_gets_a_section_appended_when_it_has_none(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# results\n")
    section = f"{rope_report.BEGIN}\nnew\n{rope_report.END}\n"
    rope_report.update_results_md(path, section)
    rope_report.update_results_md(path, section.replace("new", "newer"))
    assert path.read_text() == f"# results\n\n{rope_report.BEGIN}\nnewer\n{rope_report.END}\n"


def test_full_plan_sweeps_the_target_and_covers_every_named_case():
    env = rope_bench.Env(on_gpu=True, torch=True, flashinfer=True, launcher=True)
    tasks = rope_bench.plan_tasks(list(rope_bench.SECTIONS), None, None, False, env)
    sweep = [t for t in tasks if t.section == "sweep"]
    assert {t.case.name for t in sweep} == {rope_bench.TARGET}
    assert {t.case.tokens for t in sweep} == {1, 8, 64, 512, 4096, 16384, 65536}
    assert {t.case.name for t in tasks if t.section == "cases"} == {c.name for c in CASES}
    assert {t.method for t in tasks if t.section in ("kernel", "cases")} == {"kernel"}
    # XLA's unrolled fusions cannot be counted per application by the profiler.
    assert not any(t.impl.startswith("xla") for t in tasks if t.method == "kernel")
    # Per shape, the ceilings come first: they size the loops after them.
    first = {}
    for t in tasks:
        first.setdefault(t.case, t)
    assert all(t.impl in rope_bench.CEILINGS for t in first.values())
    cpu = rope_bench.plan_tasks(["cases"], ["llama3_8b"], [16], False, rope_bench.Env(on_gpu=False))
    assert {(t.impl, t.method, t.case.tokens) for t in cpu} == {
        ("jaxrope", "loop", 16), ("jaxrope_plain", "loop", 16), ("xla_ceiling", "loop", 16)}


def test_growth_cap_keeps_attention_scaled_loops_finite_and_refuses_too_many_reps():
    yarn = next(c for c in CASES if c.name == "qwen25_yarn").cfg
    plain = next(c for c in CASES if c.name == rope_bench.TARGET).cfg
    assert rope_bench.growth_cap(plain, 5) > 10**6
    cap = rope_bench.growth_cap(yarn, 5)
    assert 1 <= cap < 100
    with pytest.raises(ValueError, match="fewer --reps"):
        rope_bench.growth_cap(yarn, 200)


def _suite_benches():
    script = (ROOT / "bench" / "gpu_suite.sh").read_text()
    block = re.search(r"^BENCHES=\(\n(.*?)^\)", script, re.S | re.M).group(1)
    # shlex drops a line's comment as bash does; a comment line names no entry.
    return [words[0] for words in (shlex.split(line, comments=True) for line in block.splitlines())
            if words]


@pytest.mark.parametrize("entry", _suite_benches())
def test_every_gpu_suite_benchmark_is_a_module_taking_out(entry, capsys):
    try:
        module = importlib.import_module(f"bench.{entry.split()[0]}")
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        pytest.skip(f"bench.{entry} needs torch, absent on this leg")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0 and "--out" in capsys.readouterr().out, entry


def test_jax_loop_times_real_applications_and_reports_its_method():
    t = timing.time_jax_loop(lambda x, s: (x * s,), (jnp.ones(1024),), (jnp.float32(1.0),),
                             iters=16, reps=3)
    assert (t.n, t.iters, len(t.samples_us)) == (3, 16, 3)
    assert 0 < t.p10_us <= t.median_us <= t.p90_us
    assert t.method.startswith("jax fori_loop") and t.detail["compile_s"] > 0
    json.dumps(t.as_dict())
    loop = timing.JaxLoop(lambda x, i: (x + i,), (jnp.zeros(4, jnp.int32),), iters=5,
                          with_index=True)
    loop(2)
    assert loop.carry[0].tolist() == [20] * 4  # 2 calls x (0 + 1 + 2 + 3 + 4)


def test_wall_timer_and_samples_summary():
    t = timing.time_wall(lambda: sum(range(1000)), iters=50, reps=4)
    assert (t.n, t.iters) == (4, 50) and t.median_us > 0 and "50 calls" in t.method
    with pytest.raises(ValueError, match="no samples"):
        timing.Timing.from_seconds([], "empty")


def test_torch_timers_fall_back_to_the_host_clock_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the GPU suite times the CUDA paths")
    x = torch.ones(1024)
    for timer in (timing.time_cuda, timing.time_cuda_graph):
        t = timer(lambda: x.mul_(1.0), iters=20, reps=3)
        assert (t.n, t.iters) == (3, 20) and t.median_us > 0
        assert "host wall clock (no CUDA)" in t.method
    with pytest.raises(RuntimeError, match="no kernels to profile"):
        timing.kernel_durations(lambda: x.mul_(1.0), 1, profiler="torch")


def test_jax_profiler_reads_the_trace_and_finds_no_gpu_kernel_on_a_cpu():
    if jax.default_backend() != "cpu":
        pytest.skip("on a GPU the profiler finds kernels: the GPU suite's rope_bench uses it")
    loop = timing.JaxLoop(lambda x: (x * 1.5,), (jnp.ones(64),), iters=4)
    with pytest.raises(RuntimeError, match="no kernel ran 8 times in the trace"):
        timing.kernel_durations(lambda: loop(2), 8)


def test_kernel_durations_count_only_kernels_that_ran_every_application():
    events = [("rope", 10.0 * i, 100.0 + i) for i in range(6)] + [("counter", 5.0, 7.0)]
    samples, kernels = timing.per_application(events, 3)
    assert samples == [201.0, 205.0, 209.0]
    assert kernels["counter"] == {"count": 1, "total_us": 0.007}
    with pytest.raises(RuntimeError, match="no kernel ran 7 times"):
        timing.per_application(events, 7)
    with pytest.raises(ValueError, match="profiler="):
        timing.kernel_durations(lambda: None, 1, profiler="nsight")


def test_bridge_bench_quick_run_times_every_case_and_writes_json(tmp_path):
    pytest.importorskip("torch")
    from bench import bridge_bench

    report = bridge_bench.main(["--out", str(tmp_path), "--quick", "--device", "cpu",
                                "--iters", "40", "--warmup", "10"])
    written = json.loads((tmp_path / "bridge_bench.json").read_text())
    assert set(written["plan_commit"]) == {"decode[32x1]/eager", "decode[32x1]/preplan",
                                           "prefill[8x128]/eager", "prefill[8x128]/preplan"}
    for key, case in report["plan_commit"].items():
        # 40 // 16 = 2 timed blocks of 16 steps each (after one untimed); a preplan block
        # plans its first step untimed.
        assert case["plan+commit"]["n"] == (30 if key.endswith("preplan") else 32), key
        assert 0 < case["plan"]["median_us"] <= case["plan+commit"]["median_us"] * 2, key
        # Each block records the host's speed beside the block's median; the full-speed
        # median is over the blocks whose reading is near the run's fastest.
        blocks = case["blocks"]
        assert len(blocks) == 2 and all(
            b["host_reference_us"] > 0 and b["plan+commit_median_us"] > 0 for b in blocks), key
        full = case["full_speed"]
        fastest = min(b["host_reference_us"] for c in report["plan_commit"].values()
                      for b in c["blocks"])
        kept = [b["plan+commit_median_us"] for b in blocks
                if b["host_reference_us"] <= bridge_bench.FULL_SPEED * fastest]
        assert full["blocks"] == len(kept), key
        assert full["median_of_block_medians_us"] == (
            pytest.approx(float(np.median(kept))) if kept else None), key
    assert {key.split("/")[1] for key in written["apply_qk"]} == {"jax"}
    assert written["run"]["command"].startswith("python -m bench.bridge_bench")
    # Speculative steps, each beside a decode step of its token count (issue 16's target).
    speculative = written["speculative"]
    assert {key: case["baseline"] for key, case in speculative.items()} == {
        "draft[32x4]/chain": "decode[128x1]/eager", "draft[32x8]/tree": "decode[256x1]/eager",
        "draft[32x8]/tree-shared": "decode[256x1]/eager",
        "drafter[32x1]/step": "decode[32x1]/eager"}
    for key, case in speculative.items():
        assert case["target_ratio"] == 1.2 and case["plan+commit"]["n"] == 32, key
        assert case["ratio"] == pytest.approx(case["plan+commit"]["median_us"]
                                              / case["baseline_plan+commit"]["median_us"]), key
        paired = [o["plan+commit_median_us"] / b["plan+commit_median_us"]
                  for o, b in zip(case["blocks"], case["baseline_blocks"])]
        assert case["paired_ratio"] == pytest.approx(float(np.median(paired))), key
