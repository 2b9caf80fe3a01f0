"""The tests of tests/multidevice/ on 8 CPU devices, each file in a child pytest process.

XLA fixes the number of CPU devices when its client starts
(``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``), and this process's client
has one. Setting the flag for the whole suite would run every other test on 8 devices
too, so each file of tests/multidevice/ (named ``sharded_*.py``, which the suite's own
collection skips) runs here in a child pytest with the flag set, on this interpreter,
so on both CI legs. Its output is reported when it fails.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "tests" / "multidevice").glob("sharded_*.py"))
DEVICES = 8


def test_there_are_multidevice_files():
    assert [f.name for f in FILES] == ["sharded_apply.py", "sharded_positions.py"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_passes_on_eight_host_devices(path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} "
                        f"--xla_force_host_platform_device_count={DEVICES}").strip()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    output = result.stdout[-12000:] + result.stderr[-4000:]
    assert result.returncode == 0, output
    assert f"needs {DEVICES} devices" not in output, output  # the flag took effect
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) > 0, output
