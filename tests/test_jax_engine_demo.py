"""``python -m jaxrope.demo``: the JAX engine demo passes without torch and can fail.

Each run is a fresh process on the CPU at the smallest ``--steps`` (the whole trace, its
requests scaled down): the PASS run must not import torch, join and leave every stream,
hit the prefix cache, prefill the M-RoPE prompt and compile the step once per token
bucket; ``--inject-fault`` (one counter advanced twice) must fail with exit status 1,
naming the first mismatch.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _demo(*args: str) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom jaxrope.demo import main\n"
            f"status = main([{', '.join(map(repr, args))}])\n"
            "print('torch imported:', 'torch' in sys.modules)\nsys.exit(status)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_jax_trace_passes_every_check_without_importing_torch():
    result = _demo("--steps", "40", "--seed", "3")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "verdict: PASS" in out and "torch imported: False" in out, out
    assert len(re.findall(r": \w+ joins", out)) == len(re.findall(r": \w+ leaves", out)) >= 6, out
    assert "prefix hit" in out and "M-RoPE prompt" in out, out
    compiles, buckets = map(int, re.search(r"\((\d+) for (\d+) buckets\)", out).groups())
    assert compiles <= buckets <= 3, out


def test_an_injected_fault_fails_naming_the_first_mismatch():
    result = _demo("--steps", "40", "--inject-fault")
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"verdict: FAIL — first mismatch: step 13: request '\w+' token \d+: "
                     r"position \(\d+, \d+, \d+\), expected", result.stdout), result.stdout


def test_too_few_steps_are_refused_with_the_reason(capsys):
    from jaxrope import demo
    with pytest.raises(SystemExit) as exit_:
        demo.main(["--steps", "5"])
    assert exit_.value.code == 2
    assert "--steps=5 must be >= 40" in capsys.readouterr().err
