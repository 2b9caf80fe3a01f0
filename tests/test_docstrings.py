"""Every public name is documented with an example, and the examples run.

The public API is ``jaxrope.__all__`` and ``torch_bridge.__all__``. Doctests of
jaxrope.config/apply/models run in tests/test_config.py and those of the
torch_bridge config/dlpack/engine_types/manager/rotate modules in
tests/test_manager.py; this file runs the rest and checks that together they cover
every module that defines a public name.
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import types

import pytest

PACKAGES = ("jaxrope", "torch_bridge")

# Public names that are neither classes, functions nor modules: the module whose
# docstring documents them (with an example).
CONSTANT_HOMES = {("jaxrope", "BACKENDS"): "jaxrope.backend"}

DOCTESTED_HERE = ("jaxrope.scaling", "jaxrope.positions", "jaxrope.backend", "jaxrope.cases",
                  "jaxrope.errors", "jaxrope.kv_cache",
                  "torch_bridge.triton_launch", "torch_bridge.device_counters")
DOCTESTED_ELSEWHERE = ("jaxrope.config", "jaxrope.apply", "jaxrope.models",  # test_config.py
                       "torch_bridge.config", "torch_bridge.dlpack",  # test_manager.py
                       "torch_bridge.engine_types", "torch_bridge.manager",
                       "torch_bridge.rotate")


def _import(package: str) -> types.ModuleType:
    if package == "torch_bridge":
        pytest.importorskip("torch", reason="torch_bridge needs torch (absent on this leg)")
    return importlib.import_module(package)


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
def test_every_module_defining_a_public_name_runs_its_doctests(package):
    module = _import(package)
    homes = {_home(package, name, getattr(module, name)).__name__ for name in module.__all__}
    untested = sorted(homes - set(DOCTESTED_HERE) - set(DOCTESTED_ELSEWHERE))
    assert not untested, f"modules defining public names whose doctests no test runs: {untested}"


@pytest.mark.parametrize("module_name", DOCTESTED_HERE)
def test_docstring_examples_run(module_name):
    _import(module_name.split(".")[0])
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, raise_on_error=False)
    assert result.attempted > 0, f"{module_name} has no example"
    assert result.failed == 0, f"{result.failed} failing examples in {module_name}"
