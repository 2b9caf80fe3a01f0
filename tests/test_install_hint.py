"""``import torch_bridge`` without torch says what to install, not only that torch is missing."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ``None`` in sys.modules makes ``import torch`` fail as it does where torch is not installed.
_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None
try:
    import torch_bridge
except ModuleNotFoundError as e:
    print(e.name)
    print(e)
"""


def test_import_torch_bridge_without_torch_names_the_install_commands():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    name, message = result.stdout.split("\n", 1)
    assert name == "torch", result.stdout
    assert "jaxrope[torch]" not in message, message  # the extra alone pulls a CUDA build
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in message


def test_the_hint_pins_the_torch_the_makefile_installs():
    makefile = (ROOT / "Makefile").read_text()
    source = (ROOT / "torch_bridge" / "__init__.py").read_text()
    (pin,) = [line.split("?=")[1].strip() for line in makefile.splitlines()
              if line.startswith("TORCH ")]
    assert f"pip install {pin} --index-url" in source, pin
