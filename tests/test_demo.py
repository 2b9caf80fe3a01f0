"""The torch demo (``python -m torch_bridge.demo``) passes on every model, and its checks can fail.

The demo runs in process with the minimum ``--steps`` (every feature of the trace
happens within it) and a fresh seed; the faults are injected either through the
demo's own ``--inject-fault`` or by patching the manager into a buggy one.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def test_importing_jaxrope_and_its_demo_entry_does_not_import_torch():
    result = _python("import sys, jaxrope, jaxrope.demo, jaxrope.models\n"
                     "assert 'torch' not in sys.modules, 'torch imported'\n"
                     "assert 'torch_bridge' not in sys.modules, 'torch_bridge imported'")
    assert result.returncode == 0, result.stderr


try:
    from torch_bridge import AdmitOutcome, RopeManager
    from torch_bridge import demo
    from torch_bridge.demo import cli as entry
except ModuleNotFoundError as e:  # the core's test leg runs without torch
    if e.name != "torch":
        raise
    demo = entry = None

needs_torch = pytest.mark.skipif(demo is None,
                                 reason="torch is not installed (the demo drives torch_bridge)")
# The --model choices, spelled out so that the parametrization exists without torch.
MODEL_CHOICES = ("deepseek-v2", "llama3.1", "phi3-longrope", "qwen2.5-yarn")
VL_MODEL_CHOICES = ("glm-4.1v", "qwen2-vl", "qwen2.5-vl", "qwen3-vl")


# Each run draws its own fixed seed: a run of the suite repeats exactly.
_SEEDS = itertools.count(20261201)


def run_demo(capsys, *args: str):
    status = entry.main(["--device", "cpu", "--seed", str(next(_SEEDS)), *args])
    return status, capsys.readouterr().out


def rows(out: str):
    """``{(step, node): events}`` of the step table."""
    table = {}
    for line in out.splitlines():
        match = re.match(r"\s*(\d+) (main|prefill)\s+\d+\s+\d+\s+\S+\s+\S+  (.*)$", line)
        if match:
            table[int(match[1]), match[2]] = match[3]
    return table


@needs_torch
def test_model_choices_are_the_demos():
    assert sorted(demo.MODELS) == list(MODEL_CHOICES)
    assert sorted(demo.VL_MODELS) == list(VL_MODEL_CHOICES)


@needs_torch
@pytest.mark.parametrize("model", MODEL_CHOICES)
def test_demo_passes_every_feature_of_the_trace_on_each_model(capsys, model):
    status, out = run_demo(capsys, "--model", model, "--steps", str(demo.MIN_STEPS))
    assert status == 0, out
    assert demo.MODELS[model] in out.splitlines()[0]
    verdict = out.splitlines()[-1]
    assert verdict.startswith("verdict: PASS — 9 steps on 2 nodes, 5 requests"), verdict
    error = float(re.search(r"max error (\S+)", verdict)[1])
    assert 0 < error <= demo.TOLERANCE
    table = rows(out)
    scripted = [(s, "main") for s in range(demo.MIN_STEPS)] + [(2, "prefill"), (3, "prefill")]
    assert sorted(table) == sorted(scripted)
    assert "prefix hit r3: 32 cached" in table[3, "main"]
    assert "publish rD @27" in table[3, "prefill"]
    assert "admit rD @27" in table[4, "main"] and "fork r2 main->cfg +6" in table[4, "main"]
    assert "graph slot0 6/8" in table[5, "main"] and "graph slot1 6/8" in table[6, "main"]
    assert "stale admit rD @27: stays 29" in table[6, "main"]
    assert "FAIL" not in out


@needs_torch
def test_the_default_run_passes_and_keeps_admitting_requests(capsys):
    status, out = run_demo(capsys)
    assert status == 0, out
    assert "Llama-3.1-8B" in out.splitlines()[0]
    requests = int(re.search(r"(\d+) requests", out.splitlines()[-1])[1])
    assert requests > len(demo.TRACE)
    assert re.search(r"graph slot\d \d/8 tail=\[[1-9]", out), "no replay with a nonzero old tail"


@needs_torch
def test_an_off_by_one_prefix_probe_fails_the_run(capsys):
    status, out = run_demo(capsys, "--steps", str(demo.MIN_STEPS), "--inject-fault")
    assert status == 1
    table = rows(out)
    assert "FAULT: probe claims 33" in table[3, "main"]
    assert "r3/main attention error" in table[3, "main"]
    assert "r3/main counter 41 != KV length 40" in table[3, "main"]
    assert out.splitlines()[-1].startswith("verdict: FAIL")
    assert "first at step 3 (main): r3/main attention error" in out.splitlines()[-1]


@needs_torch
def test_an_admit_that_rewinds_fails_the_run(capsys, monkeypatch):
    def rewinding_admit(self, rid, node_name, graph_walk, published):
        self.reset_request(rid)
        self.apply_cached_prefix(rid, node_name, graph_walk, None, published.counters)
        return AdmitOutcome(True, True)

    monkeypatch.setattr(RopeManager, "admit_retrieve", rewinding_admit)
    status, out = run_demo(capsys, "--steps", str(demo.MIN_STEPS))
    assert status == 1
    assert "stale admit moved rD from 29 to 27" in rows(out)[6, "main"]


@needs_torch
def test_a_graph_plan_that_overwrites_the_padding_fails_the_run(capsys, monkeypatch):
    plan = RopeManager.plan
    calls = []

    def clobbering_plan(self, step, ctx):
        out = plan(self, step, ctx)
        calls.append(step)
        if ctx.graph_slot is not None:
            for buffer in out.values():
                buffer[step.num_tokens:] = -len(calls)
        return out

    monkeypatch.setattr(RopeManager, "plan", clobbering_plan)
    status, out = run_demo(capsys, "--steps", "9")
    assert status == 1
    assert "graph tail changed" in out


@needs_torch
def test_too_few_steps_are_rejected_with_status_2(capsys):
    assert entry.main(["--steps", str(demo.MIN_STEPS - 1)]) == 2
    assert f"must be >= {demo.MIN_STEPS}" in capsys.readouterr().err


@needs_torch
def test_the_bridge_demo_runs_as_a_module_and_prints_its_usage():
    result = subprocess.run([sys.executable, "-m", "torch_bridge.demo", "--help"], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout and "--model" in result.stdout


# -- the M-RoPE trace: an image and a video, chunked prefill, decode, a handoff -------------


def _vl_min_steps():
    from torch_bridge.demo import multimodal
    assert multimodal.MIN_STEPS <= demo.MIN_STEPS  # the CLI checks --steps against the larger
    return str(demo.MIN_STEPS)


@needs_torch
@pytest.mark.parametrize("model", VL_MODEL_CHOICES)
def test_the_mrope_demo_passes_prefill_handoff_and_decode_on_each_vl_model(capsys, model):
    status, out = run_demo(capsys, "--model", model, "--steps", _vl_min_steps())
    assert status == 0, out
    assert demo.VL_MODELS[model] in out.splitlines()[0] and "M-RoPE mrope_section=" in out
    verdict = out.splitlines()[-1]
    assert verdict.startswith("verdict: PASS — 10 steps on 2 nodes, 2 requests"), verdict
    error = float(re.search(r"max error (\S+)", verdict)[1])
    assert 0 < error <= demo.TOLERANCE
    table = rows(out)
    delta = int(re.search(r"arrive v0 \(191 tokens, delta (-\d+)\)", table[0, "main"])[1])
    assert delta < 0
    assert [table[s, "prefill"].split(",")[0] for s in range(3)] == [
        "prefill v0[0:64]", "prefill v0[64:128]", "prefill v0[128:191]"]
    assert f"publish v0 @191 delta {delta}" in table[2, "prefill"]
    assert f"admit v0 @191 delta {delta}" in table[3, "main"]
    assert "decode 1" in table[3, "main"] and "prefill v1[48:74]" in table[3, "main"]
    assert "graph slot0 2/8" in table[4, "main"] and "graph slot1 2/8" in table[5, "main"]
    assert "stale admit v0 @191: stays 194" in table[6, "main"]
    # Step 3 plans v0's first decode token at 191 + delta on every row, the step's largest
    # position (v1's prompt chunk lies below it).
    assert re.search(rf"^\s*3 main\s+2\s+27\s+\d+\.\.{191 + delta}\s", out, re.M), out
    assert "FAIL" not in out


# ------------------------------------------------------------------------------ --speculative


@needs_torch
def test_the_speculative_demo_drafts_verifies_rolls_back_and_hands_over(capsys):
    status, out = run_demo(capsys, "--speculative", "--steps", str(demo.MIN_ROUNDS))
    assert status == 0, out
    lines = out.splitlines()
    assert lines[-1].startswith("verdict: PASS — "), lines[-1]
    assert "draft and target layers, draft graph bucket 4" in lines[1]
    handoff = next(line for line in lines if "handoff r1 A->B" in line)
    published, rolled, epoch, taken = map(int, re.search(
        r"published @(\d+) \(drafts\), rolled back @(\d+) epoch (\d+), B @(\d+)", handoff).groups())
    assert published > rolled == taken and epoch == 1
    echo = next(line for line in lines if "late echo r1" in line)
    assert re.search(rf"late echo r1 @{published}: stays \d+", echo)
    assert re.search(r"draft step 2 \(draft bucket [123]/4\)", out)
    assert re.search(r"verify k=\d accepted r0:\d\*?", out) and "*" in out   # a committed-all stream
    assert "FAIL" not in out


@needs_torch
def test_the_mrope_demo_fails_when_the_decode_node_loses_the_delta(capsys):
    # SGLang #8094 / Dynamo #5281: the handoff record arrives without its delta, so the
    # decode node rotates at counter + 0.
    status, out = run_demo(capsys, "--model", "qwen2.5-vl", "--steps", _vl_min_steps(),
                           "--inject-fault")
    assert status == 1
    table = rows(out)
    assert "FAULT: admit drops the delta" in table[3, "main"] and "admit v0 @191 delta 0" in table[3, "main"]
    assert "v0 attention error" in table[3, "main"]
    assert re.search(r"v0 delta 0 != the prompt's -\d+", table[3, "main"])
    assert "first at step 3 (main): v0 attention error" in out.splitlines()[-1]
    assert all("FAIL" not in table[s, node] for s, node in table if s < 3)  # prefill was right


@needs_torch
def test_the_mrope_demo_fails_when_a_prefill_rotates_image_tokens_as_text(capsys, monkeypatch):
    # A prompt chunk planned with its t row on all three rows (1-D positions for an image):
    # the recompute at the sequence's [3, L] positions must see it.
    plan = RopeManager.plan

    def one_row_plan(self, step, ctx):
        out = plan(self, step, ctx)
        if "chunk" in out:
            out["chunk"][1:] = out["chunk"][0]
        return out

    monkeypatch.setattr(RopeManager, "plan", one_row_plan)
    status, out = run_demo(capsys, "--model", "qwen2.5-vl", "--steps", _vl_min_steps())
    assert status == 1
    assert "v0 attention error" in rows(out)[0, "prefill"]


@needs_torch
def test_a_rollback_published_without_its_epoch_fails_the_speculative_demo(capsys):
    status, out = run_demo(capsys, "--speculative", "--steps", str(demo.MIN_ROUNDS), "--inject-fault")
    assert status == 1
    assert "FAULT: rollback published without its epoch" in out
    assert re.search(r"FAIL r1 on B at (\d+) != its (\d+) tokens", out)
    assert re.search(r"r1 (drafter|target) attention error", out)
    assert out.splitlines()[-1].startswith("verdict: FAIL")


@needs_torch
def test_the_speculative_demo_needs_its_minimum_rounds(capsys):
    assert entry.main(["--speculative", "--steps", str(demo.MIN_ROUNDS - 1)]) == 2
    assert f"must be >= {demo.MIN_ROUNDS} with --speculative" in capsys.readouterr().err
