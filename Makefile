# Two commands on a fresh machine: `make demo` (the main job) and `make test`.
# Each creates its virtual environment on first use.

PYTHON   ?= python3
# A real 3.12 interpreter: pyenv's shim for python3.12 exists but fails when 3.12 is not
# the active version, so look for an installed 3.12 first.
PY312    ?= $(firstword $(wildcard /root/.pyenv/versions/3.12*/bin/python3) $(shell command -v python3.12))
VENV     ?= .venv
VENV312  ?= .venv312
VENV012  ?= .venv312-jax012
# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
TORCH    ?= torch==2.13.0
JAX011   ?= jax==0.11.2
JAX012   ?= jax==0.12.0.1
# pytest-xdist workers (the test extra installs it): one per core of CI's 2-core machine.
# worksteal: each worker starts on its own half of the collection (a file's cases stay
# together, sharing their compiled steps) and takes queued tests from the other when it runs
# out, so a run of slow kernel cases at the end is split instead of left on one worker.
WORKERS  ?= auto
DIST     ?= worksteal
PYTEST_ARGS ?=
# Arguments of the demo, e.g. `make demo DEMO_ARGS="--model qwen2.5-vl"` (the M-RoPE trace).
DEMO_ARGS ?=

.PHONY: demo test test-core-jax011 test-core-jax012 docs bench gpu clean

# What the demo needs (torch and jaxrope's own dependencies), then what the tests and
# benchmarks add; `make demo` installs only the first, `make test` both. --no-compile:
# byte-compiling every module of torch and jaxlib takes longer than the demo runs, and
# Python compiles the modules it imports on first use.
$(VENV)/.demo-installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-compile "$(TORCH)"
	$(VENV)/bin/pip install -q --no-compile -e .
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(VENV)/bin/pip install -q -e ".[test,triton,hf]"
	touch $@

# Sphinx and MyST on top of the demo's environment: autodoc imports jaxrope and torch_bridge.
$(VENV)/.docs-installed: $(VENV)/.demo-installed
	$(VENV)/bin/pip install -q --no-compile -e ".[docs]"
	touch $@

$(VENV312)/.installed: pyproject.toml
	$(PY312) -m venv $(VENV312)
	$(VENV312)/bin/pip install -q --no-compile "$(JAX011)" -e ".[test]"
	touch $@

$(VENV012)/.installed: pyproject.toml
	$(PY312) -m venv $(VENV012)
	$(VENV012)/bin/pip install -q --no-compile "$(JAX012)" -e ".[test]"
	touch $@

# The JAX engine trace first (no torch), then the torch bridge's.
demo: $(VENV)/.demo-installed
	$(VENV)/bin/python -m jaxrope.demo
	$(VENV)/bin/python -m torch_bridge.demo $(DEMO_ARGS)

# The full CPU suite: core + torch bridge (its Triton kernel through Triton's interpreter)
# + the parity suite against transformers, on the default JAX of this Python. The
# REQUIRE variables turn a missing triton or transformers into failures, not skips.
test: $(VENV)/.installed
	JAXROPE_REQUIRE_TRITON=1 JAXROPE_REQUIRE_TRANSFORMERS=1 $(VENV)/bin/python -m pytest -q -n $(WORKERS) --dist $(DIST) $(PYTEST_ARGS)

# The core suite on the JAX version the GPU machine runs (torch tests skip there).
test-core-jax011: $(VENV312)/.installed
	$(VENV312)/bin/python -m pytest -q -n $(WORKERS) --dist $(DIST) $(PYTEST_ARGS)

# The core suite on the newest JAX on the index (its Pallas Triton backend still ships,
# deprecated; the Mosaic GPU interpreter tests run here too).
test-core-jax012: $(VENV012)/.installed
	$(VENV012)/bin/python -m pytest -q -n $(WORKERS) --dist $(DIST) $(PYTEST_ARGS)

# The guides of docs/ and the API reference generated from the docstrings, warnings as
# errors; the site lands in docs/_build/html.
docs: $(VENV)/.docs-installed
	JAX_PLATFORMS=cpu $(VENV)/bin/python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

bench: $(VENV)/.installed
	$(VENV)/bin/python -m bench.rope_bench --quick

clean:
	rm -rf $(VENV) $(VENV312) $(VENV012) .pytest_cache .hypothesis docs/_build
