"""pyproject.toml builds without setuptools' deprecation warnings, and says its license."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_metadata_builds_without_a_license_deprecation_and_carries_the_spdx_license(tmp_path):
    setuptools = pytest.importorskip("setuptools", reason="builds the metadata as pip would")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings")
    # A copy, so the build's egg-info lands outside the checkout.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for package in ("jaxrope", "torch_bridge"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "out").mkdir()
    script = ("import sys; from setuptools import build_meta; "
              "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-W", "always", "-c", script, str(tmp_path / "out")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Deprecation" not in result.stderr, result.stderr
    metadata = (tmp_path / "out" / result.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
