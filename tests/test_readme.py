"""Every code block of README.md and docs/*.md is executed or checked, so they cannot rot.

- ``python`` blocks run as pasted: each in a fresh interpreter started in the checkout,
  without ``XLA_FLAGS`` (a block that needs a flag sets it itself, before importing jax),
  so a block that depends on an earlier one or on import order fails here (the PyTorch
  ones skip when torch is missing). The interpreters start together, as many at a time
  as there are CPUs, and each test waits for its own.
- ``bash`` blocks: ``make X`` must be a real target (``make -n X``), ``bash S`` must be a
  syntactically valid script (``bash -n S``), and the ``pip download`` line must name
  the wheels ``bench/gpu_suite.sh`` installs (it needs the network, so it only runs
  with ``JAXROPE_NETWORK_TESTS=1``).
- the README's ``text`` layout block must name files that exist.
- ``{directive}`` blocks are MyST directives for Sphinx (``make docs`` builds them with
  warnings as errors); any other language fails here, so no block is left unchecked
  without saying so.
"""

from __future__ import annotations

import inspect
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
# (page, language, code) of every fenced block, in page order.
BLOCKS = [(page, lang, code) for page in PAGES
          for lang, code in re.findall(r"```(\{?[\w-]+\}?)\n(.*?)```", (ROOT / page).read_text(), re.S)]
CHECKED = ("python", "bash", "text")


def _blocks(lang, page=None):
    return [code for block_page, block_lang, code in BLOCKS
            if block_lang == lang and page in (None, block_page)]


def _python_ids():
    seen = {}
    for page, lang, _ in BLOCKS:
        if lang == "python":
            seen[page] = seen.get(page, 0) + 1
            yield f"{page}:{seen[page]}"


def test_every_block_is_run_or_checked():
    unchecked = [(page, lang) for page, lang, _ in BLOCKS
                 if lang not in CHECKED and not lang.startswith("{")]
    assert not unchecked, unchecked
    assert len(_blocks("python")) >= 15 and set(PAGES) > {"README.md", "docs/guarantees.md"}


def test_readme_names_the_extras_the_makefile_installs():
    makefile = (ROOT / "Makefile").read_text()
    installed = re.findall(r'pip install -q -e "\.\[([\w,]+)\]"', makefile)
    described = re.findall(r"pip install -e \.\[([\w,]+)\]", README)
    assert installed and described == installed[:1], (described, installed)


def test_readme_has_the_two_setup_commands_first():
    first_bash = _blocks("bash", "README.md")[0].split()
    assert first_bash == ["make", "demo", "make", "test"]


class _Runs:
    """The python blocks' interpreters, started on first use, as many at once as CPUs."""

    def __init__(self, blocks):
        self._blocks, self._procs, self._results = blocks, {}, {}
        self._env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}

    def _start(self, index):
        self._procs[index] = subprocess.Popen(
            [sys.executable, "-c", self._blocks[index]], cwd=ROOT, env=self._env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, index):
        """``(returncode, stderr)`` of block ``index``, starting later blocks meanwhile."""
        if index not in self._results:
            todo = [i for i in range(index, len(self._blocks))
                    if i not in self._procs and i not in self._results and _runnable(i)]
            while len(self._procs) < (os.cpu_count() or 1) and todo:
                self._start(todo.pop(0))
            if index not in self._procs:
                self._start(index)
            proc = self._procs.pop(index)
            _, err = proc.communicate(timeout=600)
            self._results[index] = (proc.returncode, err)
        return self._results[index]


def _runnable(index) -> bool:
    code = _blocks("python")[index]
    needs_torch = "import torch" in code or "torch_bridge" in code  # the bridge imports torch
    return not needs_torch or importlib.util.find_spec("torch") is not None


_RUNS = _Runs(_blocks("python"))


@pytest.mark.parametrize("index", range(len(_blocks("python"))), ids=list(_python_ids()))
def test_python_block_runs_as_pasted_in_a_fresh_interpreter(index):
    if not _runnable(index):
        pytest.skip("the block needs torch")
    returncode, stderr = _RUNS.result(index)
    assert returncode == 0, stderr[-6000:]


def _bash_lines():
    for code in _blocks("bash"):
        for line in code.splitlines():
            if line.strip():
                yield line.strip()


@pytest.mark.parametrize("line", list(_bash_lines()))
def test_bash_line_is_valid(line, tmp_path):
    words = shlex.split(line)
    if words[0] == "make":
        result = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stderr
    elif words[0] == "bash":
        script = ROOT / words[1]
        assert script.is_file(), script
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    elif words[:4] == ["python3", "-m", "pip", "download"]:
        suite = (ROOT / "bench" / "gpu_suite.sh").read_text()
        assert "flashinfer-python==0.5.3" in words and "apache-tvm-ffi<0.2" in words
        assert ".whl" in suite
        if os.environ.get("JAXROPE_NETWORK_TESTS") != "1":
            pytest.skip("downloads wheels; set JAXROPE_NETWORK_TESTS=1 to run it")
        dest = words.index("-d") + 1
        words[dest] = str(tmp_path)
        result = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        names = sorted(p.name for p in tmp_path.iterdir())
        assert any(n.startswith("flashinfer_python-0.5.3") for n in names), names
    else:
        pytest.fail(f"bash line not covered by this test: {line!r}")


def test_layout_block_names_existing_paths():
    (layout,) = _blocks("text", "README.md")
    top, paths = "", []
    for line in layout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name and not line.startswith(" "):
            top = name
            paths.append(name)
        elif "/" in name or name.endswith(".py"):
            paths.append(top + name)
    assert {"jaxrope/", "torch_bridge/", "examples/", "docs/", "bench/"} <= set(paths), paths
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert not missing, missing


def test_the_jax_guide_lists_every_public_positions_function_with_its_arguments():
    from jaxrope import positions

    guide = (ROOT / "docs" / "jax_engine.md").read_text()
    listed = guide.split("`jaxrope.positions` (pure transitions")[1].split("```")[0]
    listed = " ".join(listed.split())  # the prose wraps lines inside a signature
    functions = {name: obj for name, obj in vars(positions).items()
                 if not name.startswith("_") and inspect.isfunction(obj)
                 and obj.__module__ == positions.__name__}
    assert {"init", "read", "plan", "commit", "admit", "set_deltas", "pad_rows"} <= set(functions)
    for name, function in functions.items():
        arguments = [p.name for p in inspect.signature(function).parameters.values()
                     if p.default is inspect.Parameter.empty]
        assert f"`{name}({', '.join(arguments)}" in listed, name
    for name in ("PAD", "Scheme", "PositionTable", "RowMap"):
        assert f"`{name}`" in listed, name
