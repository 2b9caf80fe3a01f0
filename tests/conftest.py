import os

os.environ.setdefault("JAX_PLATFORMS", "cpu" if not os.environ.get("JAXROPE_GPU_TESTS") else "")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# Set (as `make test` and CI do) to make a missing optional dependency a failure.
REQUIRE_TRITON_ENV = "JAXROPE_REQUIRE_TRITON"
SEED_ENV = "JAXROPE_SEED"


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run the tests marked slow (long soak runs)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"requires_triton: needs the triton package; skips without it unless "
                   f"{REQUIRE_TRITON_ENV}=1, where its absence fails")


def _triton_missing() -> str:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return str(e)
    return ""


def pytest_collection_modifyitems(config, items):
    missing = None
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow: opt in with --run-slow"))
        if "requires_triton" in item.keywords:
            if missing is None:
                missing = _triton_missing()
            if missing and os.environ.get(REQUIRE_TRITON_ENV) != "1":
                item.add_marker(pytest.mark.skip(reason=f"triton is not installed ({missing})"))


def pytest_runtest_setup(item):
    if "requires_triton" in item.keywords and os.environ.get(REQUIRE_TRITON_ENV) == "1":
        missing = _triton_missing()
        if missing:
            pytest.fail(f"{REQUIRE_TRITON_ENV}=1 but triton does not import: {missing}")


@pytest.fixture
def rng(request):
    """A seeded ``np.random.Generator``; a failing test's report names its seed.

    The seed is fixed per test (derived from its node id) so a failure reproduces;
    ``JAXROPE_SEED=<int>`` overrides it for every test.
    """
    seed = os.environ.get(SEED_ENV)
    seed = int(seed) if seed is not None else _stable_seed(request.node.nodeid)
    request.node.user_properties.append(("seed", seed))
    return np.random.default_rng(seed)


def _stable_seed(text: str) -> int:
    import zlib
    return zlib.crc32(text.encode())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(
                    ("seed", f"rng seed {value}: rerun with {SEED_ENV}={value} to reproduce"))
