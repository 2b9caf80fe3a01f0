"""``python -m jaxrope.demo`` says why it stops: a refusal is printed, never only an exit code."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_device_cuda_without_a_gpu_exits_2_and_says_why():
    torch = pytest.importorskip("torch", reason="the demo drives torch_bridge")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: --device cuda runs the demo")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": ""}
    result = subprocess.run([sys.executable, "-m", "jaxrope.demo", "--device", "cuda"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result
    assert "--device cuda: JAX has no GPU backend here" in result.stderr, result.stderr


def test_an_argument_error_keeps_argparse_status_and_message(capsys):
    pytest.importorskip("torch", reason="the demo drives torch_bridge")
    from jaxrope import demo

    assert demo.main(["--model", "no-such-model"]) == 2
    assert "invalid choice: 'no-such-model'" in capsys.readouterr().err
    assert demo.main(["--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m jaxrope.demo")
