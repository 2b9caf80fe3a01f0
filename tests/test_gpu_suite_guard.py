"""``bench/gpu_suite.sh`` on a machine without a CUDA GPU says it needs one and exits
non-zero before its first step (no log directory, no install, no test run)."""

from __future__ import annotations

import ctypes
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _has_cuda_gpu() -> bool:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


@pytest.mark.skipif(_has_cuda_gpu(), reason="this machine has a CUDA GPU")
def test_without_a_cuda_gpu_the_suite_stops_before_its_steps(tmp_path):
    logdir = tmp_path / "logs"
    result = subprocess.run(["bash", str(ROOT / "bench" / "gpu_suite.sh"), str(logdir)],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "needs a CUDA GPU" in result.stderr
    assert not logdir.exists() and "install" not in result.stdout
