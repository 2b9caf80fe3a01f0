"""The one place doctests run: every module of jaxrope, torch_bridge and bench.

Each module found by walking the packages (``pkgutil``, so a new module is picked up
without being listed) runs its docstring examples; examples that need a GPU say
``# doctest: +SKIP``. torch_bridge (and a bench module importing torch) skips where
torch is not installed; a module needing triton skips without it unless
``JAXROPE_REQUIRE_TRITON=1``. The public API (``jaxrope.__all__``,
``torch_bridge.__all__``) must also be documented: every public name with an example,
every public method and property with a docstring.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import inspect
import os
import pkgutil
import types

import pytest

PACKAGES = ("jaxrope", "torch_bridge")
WALKED = PACKAGES + ("bench",)
# Missing optional dependencies that make a module skip instead of fail.
OPTIONAL = ("torch", "triton", "flashinfer", "matplotlib")
# tests/conftest.py's switch (CI sets it): a missing triton fails instead of skipping.
REQUIRE_TRITON_ENV = "JAXROPE_REQUIRE_TRITON"

# Public names that are neither classes, functions nor modules: the module whose
# docstring documents them (with an example).
CONSTANT_HOMES = {("jaxrope", "BACKENDS"): "jaxrope.ops.backends"}


def _module_names(package: str):
    """``package`` and every module below it, found without importing torch."""
    locations = importlib.util.find_spec(package).submodule_search_locations
    yield package
    for info in pkgutil.walk_packages(locations, prefix=f"{package}."):
        yield info.name


# A package's __main__ runs its program on import: its code lives in modules walked anyway.
MODULES = [name for package in WALKED for name in _module_names(package)
           if not name.endswith(".__main__")]


def _import(name: str) -> types.ModuleType:
    if name.split(".")[0] == "torch_bridge":
        pytest.importorskip("torch", reason="torch_bridge needs torch (absent on this leg)")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if missing not in OPTIONAL or (missing == "triton"
                                       and os.environ.get(REQUIRE_TRITON_ENV) == "1"):
            raise
        pytest.skip(f"{name} needs {missing}, which is not installed")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = _import(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, raise_on_error=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples fail in {name}"


def test_the_walk_finds_modules_below_the_top_level():
    assert {"jaxrope.positions", "jaxrope.ops.rope.reference", "jaxrope.testing.oracle",
            "torch_bridge.manager", "bench.timing"} <= set(MODULES)


def _home(package: str, name: str, obj: object) -> types.ModuleType:
    """The module whose doctests exercise ``obj``."""
    if isinstance(obj, types.ModuleType):
        return obj
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return importlib.import_module(obj.__module__)
    return importlib.import_module(CONSTANT_HOMES[(package, name)])


def _public_members(cls: type):
    for name, member in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        if inspect.isfunction(member) or inspect.ismethod(member) or isinstance(member, property):
            yield name, member


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_has_a_docstring_with_an_example(package):
    module = _import(package)
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            doc = obj.__doc__
        elif inspect.isclass(obj) or inspect.isfunction(obj):
            doc = inspect.getdoc(obj)
        else:
            assert (package, name) in CONSTANT_HOMES, (
                f"{package}.{name} is a constant: name the module documenting it in CONSTANT_HOMES")
            home = _home(package, name, obj)
            assert getattr(home, name) is obj, f"{home.__name__} does not define {name}"
            doc = home.__doc__ if name in (home.__doc__ or "") else None
        if not doc or ">>>" not in doc:
            missing.append(name)
    assert not missing, f"{package} public names without a docstring example: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_method_and_property_has_a_docstring(package):
    module = _import(package)
    missing = [f"{name}.{member_name}"
               for name in module.__all__ if inspect.isclass(getattr(module, name))
               for member_name, member in _public_members(getattr(module, name))
               if not inspect.getdoc(member)]
    assert not missing, f"{package} public methods/properties without a docstring: {missing}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_defining_a_public_name_is_walked_and_has_examples(package):
    module = _import(package)
    homes = {_home(package, name, getattr(module, name)).__name__ for name in module.__all__}
    assert homes <= set(MODULES), f"public names defined outside the walk: {homes - set(MODULES)}"
    finder = doctest.DocTestFinder()
    bare = sorted(home for home in homes
                  if not any(test.examples for test in finder.find(importlib.import_module(home))))
    assert not bare, f"modules defining public names without a docstring example: {bare}"
