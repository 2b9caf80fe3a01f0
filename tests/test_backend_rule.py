"""The torch bridge's two JAX paths decide "auto" and check a backend by the core's one rule
(:func:`jaxrope.ops.backends.backend_name`), not by a copy of it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.ops import backends as backend_module  # noqa: E402
from torch_bridge.kv_append import JaxAppend  # noqa: E402
from torch_bridge.rotate import JaxRotation, torch_capability  # noqa: E402

CPU = torch.device("cpu")


def test_bridge_paths_refuse_what_the_core_refuses_on_cpu():
    for backend in ("triton", "mosaic"):
        with pytest.raises(jr.BackendUnavailable) as rotation:
            JaxRotation.check_backend(backend, CPU)
        with pytest.raises(jr.BackendUnavailable) as append:
            JaxAppend(CPU, backend)
        with pytest.raises(jr.BackendUnavailable) as core:
            backend_module.backend_name(backend, "cpu", "rope_append_kv")
        assert str(rotation.value) == str(core.value) == str(append.value), backend
    for backend in ("cuda", "pallas"):
        with pytest.raises(ValueError, match=f"backend='{backend}' must be one of"):
            JaxAppend(CPU, backend)
        with pytest.raises(ValueError, match=f"backend='{backend}' must be one of"):
            JaxRotation.check_backend(backend, CPU)


def test_bridge_auto_is_the_cores_auto():
    assert torch_capability(CPU) is None
    JaxRotation.check_backend("auto", CPU)
    assert JaxAppend(CPU, "auto").backend == backend_module.backend_name("auto", "cpu") == "xla"
    assert JaxAppend(CPU, "interpret").backend == "interpret"


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
@pytest.mark.parametrize("lowers", [True, False], ids=["mosaic-lowers", "mosaic-refused"])
def test_bridge_auto_launchers_follow_the_cores_rule_for_both_ops(monkeypatch, capability,
                                                                  lowers):
    # Each op's launcher is the one for the kernel the core's "auto" picks: Mosaic GPU's
    # on Hopper or newer with a JAX that lowers it, the Triton-lowered kernel's elsewhere.
    from jaxrope.ops import mosaic_common
    from torch_bridge.launch.triton import TritonKVLauncher
    from torch_bridge.launch.dispatch import auto_launcher_class
    from torch_bridge.launch.mosaic import MosaicKVLauncher, MosaicLauncher
    from torch_bridge.launch.triton import TritonLauncher

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(mosaic_common, "lowering_unavailable",
                        lambda: None if lowers else "refused by the test")
    cuda = torch.device("cuda")
    want = {"rope": (MosaicLauncher, TritonLauncher),
            "rope_append_kv": (MosaicKVLauncher, TritonKVLauncher)}
    for op, (mosaic, triton) in want.items():
        core = backend_module.backend_name("auto", "cuda", op, "{}.{}".format(*capability))
        assert core == ("mosaic" if lowers and capability >= (9, 0) else "triton"), op
        assert auto_launcher_class(cuda, op) is (mosaic if core == "mosaic" else triton), op
