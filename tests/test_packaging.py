"""Packaging and the public surface: pyproject.toml builds without setuptools' deprecation
warnings and says its license; the wheel carries the license text and both packages'
``py.typed``; what jaxrope and torch_bridge export is what their docstrings state, and no
shipped module imports the tests' support code."""

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


# -- the public surface -----------------------------------------------------------------
# jaxrope's and torch_bridge's docstrings state it: what __all__ lists is public, every
# other module private, and no shipped module leans on the tests' support code.

# Support for the tests and benchmarks, shipped inside jaxrope but imported by nothing
# else in the two packages.
TEST_SUPPORT = ("jaxrope.testing", "jaxrope.cases")


def _modules(package: str):
    """``(dotted name, path)`` of every module file of ``package``."""
    root = ROOT / package
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def _imported(path: pathlib.Path):
    """Every module ``path`` imports, at any depth of its code (lazy imports too)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_no_shipped_module_imports_the_tests_support_code():
    offenders = [f"{name} imports {target}"
                 for package in ("jaxrope", "torch_bridge")
                 for name, path in _modules(package)
                 if not any(_is_under(name, support) for support in TEST_SUPPORT)
                 for target in _imported(path)
                 if any(_is_under(target, support) for support in TEST_SUPPORT)]
    assert not offenders, offenders


def test_the_support_check_sees_an_import_of_jaxrope_testing_inside_a_function(tmp_path):
    # The check above must catch the lazy form too, not only a top-level import.
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from jaxrope.testing import oracle\n    return oracle\n")
    assert "jaxrope.testing" in set(_imported(path))


def test_every_jaxrope_module_is_public_or_named_private_in_the_package_docstring():
    import jaxrope

    doc = jaxrope.__doc__
    unnamed = sorted(
        top for top in {name.split(".")[1] for name, _ in _modules("jaxrope") if "." in name}
        if top not in jaxrope.__all__ and f"``{top}``" not in doc)
    assert not unnamed, (f"jaxrope modules neither in __all__ nor named private in "
                         f"jaxrope/__init__.py's docstring: {unnamed}")


@pytest.mark.parametrize("package", ["jaxrope", "torch_bridge"])
def test_every_name_in_all_is_importable_and_named_in_the_package_docstring(package):
    if package == "torch_bridge":
        pytest.importorskip("torch", reason="torch_bridge needs torch (absent on this leg)")
    module = __import__(package)
    assert len(set(module.__all__)) == len(module.__all__), "a name listed twice"
    for name in module.__all__:
        assert hasattr(module, name), f"{package}.{name} is listed in __all__ but missing"
    if package == "jaxrope":  # torch_bridge's docstring names its groups, not each class
        unnamed = [name for name in module.__all__ if name not in module.__doc__]
        assert not unnamed, f"{package}.__all__ names missing from its docstring: {unnamed}"
    modules = [name for name in module.__all__
               if isinstance(getattr(module, name), type(module))]
    unnamed = [name for name in modules if f"{package}.{name}" not in module.__doc__]
    assert not unnamed, f"public modules missing from {package}'s docstring: {unnamed}"
