"""GPU suite fixtures: FlashInfer or a skip that names what is missing.

These tests run on the device machine with ``bash bench/gpu_suite.sh <logdir>``, which
installs FlashInfer from the wheels in ``.whl/`` and sets ``JAXROPE_GPU_TESTS=1``;
elsewhere (CI, laptops) the ``gpu`` marker deselects them, and run by hand without a GPU
or FlashInfer they skip with the reason.
"""

import os

import pytest

# JAX and torch share the GPU: JAX must not take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from jaxrope.ops import backends as backend_module  # noqa: E402
from jaxrope.testing import flashinfer as fp  # noqa: E402


@pytest.fixture(scope="module")
def jax_gpu():
    """JAX's first GPU device; else a skip that says how to get one."""
    import jax
    try:
        return jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend ({e}); run with JAXROPE_GPU_TESTS=1 and jax[cuda]")


@pytest.fixture(scope="module")
def hopper(jax_gpu):
    """JAX's first GPU when Mosaic GPU runs on it, else a skip saying why not."""
    from jaxrope.ops import mosaic_common
    missing = mosaic_common.unavailable()
    if missing:
        pytest.skip(missing)
    capability = backend_module.device_capability(jax_gpu)
    if capability is None or int(capability.split(".")[0]) < backend_module.MOSAIC_MIN_CAPABILITY:
        pytest.skip(f"{jax_gpu.device_kind} has compute capability {capability}, Mosaic GPU "
                    "needs 9.0")
    return jax_gpu


@pytest.fixture(scope="module")
def device(request):
    """torch's current CUDA device, once both torch and JAX see a GPU; else a skip."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    request.getfixturevalue("jax_gpu")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def flashinfer():
    """The ``flashinfer`` module (0.5.x) with torch on a CUDA GPU and JAX on the GPU."""
    return fp.require_flashinfer()


@pytest.fixture(params=["jax", "auto"])
def launcher(request, device):
    """Each bridge launcher by its ``launcher=`` name; "auto" skips where it builds none
    (the KV files override this to check their own launcher)."""
    if request.param == "auto":
        import jaxrope as jr
        from torch_bridge import PositionConfig, RopeManager
        probe = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=128)), device)
        if probe.launcher is None:
            pytest.skip("no fast launcher here (\"auto\" built none)")
    return request.param
