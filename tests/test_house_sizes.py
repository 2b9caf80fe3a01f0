"""The size limits issue 44 set for the house: every module of the packages and the
benchmarks at most 500 lines, the README and bench/RESULTS.md (current numbers only) at
most 300. A file past its limit fails here with its name and length."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(p for folder in ("jaxrope", "torch_bridge", "bench")
                 for p in (ROOT / folder).rglob("*.py"))


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines())


def test_every_module_of_the_packages_and_benchmarks_is_at_most_500_lines():
    assert MODULES, "no modules found: the walk is wrong"
    long = {str(p.relative_to(ROOT)): _lines(p) for p in MODULES if _lines(p) > 500}
    assert not long, long


@pytest.mark.parametrize("name", ["README.md", "bench/RESULTS.md"])
def test_the_front_page_and_the_results_are_at_most_300_lines(name):
    assert _lines(ROOT / name) <= 300, (name, _lines(ROOT / name))
