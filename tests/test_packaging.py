"""pyproject.toml builds without setuptools' deprecation warnings, says its license, and the
wheel carries the license text and both packages' ``py.typed``."""

from __future__ import annotations

import hashlib
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# md5 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text the license names.
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"


def _project_copy(tmp_path: pathlib.Path) -> None:
    """What a build reads, copied to ``tmp_path`` (the build's egg-info lands there, not in
    the checkout); skips where setuptools cannot build SPDX license metadata."""
    setuptools = pytest.importorskip("setuptools", reason="builds the project as pip would")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} predates SPDX license strings")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    for package in ("jaxrope", "torch_bridge"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "out").mkdir()


def test_the_license_file_is_the_apache_2_text():
    assert hashlib.md5((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_MD5


def test_the_wheel_carries_the_license_and_both_packages_py_typed(tmp_path):
    _project_copy(tmp_path)
    script = ("import sys; from setuptools import build_meta; "
              "print(build_meta.build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "out")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    with zipfile.ZipFile(tmp_path / "out" / result.stdout.split()[-1]) as wheel:
        names = set(wheel.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        lines = wheel.read(metadata).decode().splitlines()
    assert {"jaxrope/py.typed", "torch_bridge/py.typed"} <= names, sorted(names)
    assert metadata.replace("METADATA", "licenses/LICENSE") in names, sorted(names)
    assert "License-File: LICENSE" in lines


def test_metadata_builds_without_a_license_deprecation_and_carries_the_spdx_license(tmp_path):
    _project_copy(tmp_path)
    script = ("import sys; from setuptools import build_meta; "
              "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))")
    result = subprocess.run([sys.executable, "-W", "always", "-c", script, str(tmp_path / "out")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Deprecation" not in result.stderr, result.stderr
    metadata = (tmp_path / "out" / result.stdout.split()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()
