"""``make demo`` installs what the demo needs and nothing of the test tooling; ``make test``
installs the rest too (read from make's dry run of every recipe, ``make -n -B``)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _recipe(target: str) -> list:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "pip install" in line]


def test_make_demo_installs_torch_and_jaxrope_without_extras():
    installs = _recipe("demo")
    assert any("torch==" in line for line in installs), installs
    assert any(line.endswith("pip install -q --no-compile -e .") for line in installs), installs
    assert not [line for line in installs if "[" in line], installs


def test_make_test_installs_the_extras_the_suite_needs():
    installs = _recipe("test")
    assert any('-e ".[test,triton,hf]"' in line for line in installs), installs


def test_make_docs_installs_the_docs_extra_and_builds_with_warnings_as_errors():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "-B", "docs"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert '-e ".[docs]"' in result.stdout and "sphinx -E -W" in result.stdout, result.stdout
