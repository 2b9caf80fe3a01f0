"""The engine loops of ``examples/`` run as a user runs them (``python examples/X.py``, a
fresh interpreter) and pass their float64 check; the check itself fails on a wrong answer."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(name: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", ["jax_engine_loop.py", "torch_engine_loop.py"])
def test_example_runs_and_matches_float64(name):
    if "torch" in name and importlib.util.find_spec("torch") is None:
        pytest.skip("the torch loop needs torch")
    result = _run(name)
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "seed 0" and lines[-1] == "PASS", result.stdout
    assert sum(line.startswith("step ") for line in lines) >= 8, result.stdout


def _oracle():
    spec = importlib.util.spec_from_file_location("float64_oracle", EXAMPLES / "float64_oracle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_oracle_is_attention_over_rotated_keys_and_refuses_a_wrong_answer():
    import jaxrope as jr

    oracle = _oracle()
    cfg = jr.RopeConfig(head_dim=8)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, h, 8)) for h in (2, 1, 1))
    # The first token attends to itself only: its value, whatever q and k are.
    np.testing.assert_allclose(oracle.attention(cfg, q, k, v, 0), np.repeat(v[:1, 0], 2, 0))
    # Position 0 is not rotated; position 1 is, by inv_freq (a rotation keeps the norm).
    rotated = oracle.rotate(cfg, k)
    np.testing.assert_allclose(rotated[0], k[0])
    assert not np.allclose(rotated[1], k[1])
    np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(k, axis=-1))
    with pytest.raises(AssertionError, match="float64"):
        oracle.verdict({"a": 2}, {"a": 2}, worst=1e-2)
    with pytest.raises(AssertionError, match="tokens run"):
        oracle.verdict({"a": 1}, {"a": 2}, worst=0.0)
