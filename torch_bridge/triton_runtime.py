"""What every launch of an exported Pallas kernel from torch shares.

:mod:`torch_bridge.triton_launch` (RoPE) and :mod:`torch_bridge.kv_launch` (RoPE fused
with the paged KV append) both take a kernel's Triton IR from
:mod:`jaxrope.ops.rope.triton_export`, compile it once, and launch it with raw pointers on
torch's current stream. The pieces they share live here:

- :class:`KernelCache`: IR exported and compiled once per key (a declined export is
  remembered, so it is not retried on every call);
- :class:`CountTable`: a device pointer to any token count (the kernels read T from
  memory, so one compiled kernel serves every T);
- :class:`AngleTables`: a config's angle tables on a device, padded to the kernel's lanes;
- :class:`KernelLaunch`: one compiled kernel bound to a grid, launched through Triton's
  C entry point on torch's current raw stream;
- :class:`LaunchRecords`: the per-signature launch records, built once (under a lock,
  in the device's context) and bounded.

Nothing here allocates or compiles inside a launch: the first launch of a signature
builds what it needs, later ones (and CUDA-graph captures of them) only launch.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable, Dict, Hashable, Tuple

import torch

from jaxrope.ops.constants import kernel_constants
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable

__all__ = ["ALIGN", "AngleTables", "CountTable", "KernelCache", "KernelLaunch", "LaunchRecords",
           "check_launchable", "import_triton"]

# Pallas marks every pointer of the exported kernels tt.divisibility = 32.
ALIGN = 32


def import_triton():
    """The ``triton`` module.

    Raises:
      BackendUnavailable: Triton is not installed.
    """
    try:
        import triton
    except ImportError as e:
        raise BackendUnavailable(f"Triton is not installed: {e}") from e
    return triton


def check_launchable(named) -> None:
    """What every compiled kernel assumes of its ``(name, tensor)`` pairs: on CUDA,
    contiguous, ``ALIGN``-byte aligned.

    Raises:
      BackendUnavailable: the first tensor that is not, named.
    """
    for name, t in named:
        if not t.is_cuda:
            raise BackendUnavailable(f"{name} is on {t.device}: the launcher needs CUDA")
        if not t.is_contiguous() or t.data_ptr() % ALIGN:
            raise BackendUnavailable(f"{name} must be contiguous and {ALIGN}-byte aligned")


class CountTable:
    """Device int32 rows ``[n, 8]`` with row ``t`` holding ``t``: a pointer to any count.

    Outgrown tables are kept alive: a captured CUDA graph may still hold their pointers.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.tables = [self._make(1 << 16)]

    def _make(self, size: int) -> torch.Tensor:
        rows = torch.zeros((size, ALIGN // 4), dtype=torch.int32, device=self.device)
        rows[:, 0] = torch.arange(size, dtype=torch.int32, device=self.device)
        return rows

    def pointer(self, count: int) -> int:
        rows = self.tables[-1]
        if count >= rows.shape[0]:
            rows = self._make(1 << count.bit_length())
            self.tables.append(rows)
        return rows.data_ptr() + count * ALIGN


class AngleTables:
    """Per (config, device): the float32 angle tables ``[3, lanes]`` the kernels read.

    :func:`jaxrope.ops.constants.kernel_constants`' tables, zero-padded to ``lanes`` columns (the
    exported kernels load whole lane blocks). Never freed: a captured CUDA graph may
    hold their pointers.
    """

    def __init__(self):
        self._tables: Dict[Tuple[RopeConfig, torch.device], torch.Tensor] = {}

    def get(self, cfg: RopeConfig, device: torch.device, lanes: int) -> torch.Tensor:
        key = (cfg, device)
        tables = self._tables.get(key)
        if tables is None:
            host, _ = kernel_constants(cfg)
            tables = torch.zeros((3, lanes), dtype=torch.float32)
            tables[:, :host.shape[1]] = torch.from_numpy(host.copy())
            tables = self._tables[key] = tables.to(device)
        return tables


class KernelCache:
    """Kernels compiled from exported Triton IR, once per key.

    Args:
      name: names the IR files (``<name>_<n>.ttir``, in a temporary directory removed after
        each compile).
      target: a ``triton.backends.compiler.GPUTarget`` to compile for; None (default)
        compiles for the active device. Compiling for a target needs no GPU.

    ``get(key, export)`` calls ``export()`` at most once per key; its result has
    ``ttir``, ``num_warps`` and ``num_stages`` (Triton's default stages differ from
    JAX's, so they are passed explicitly). A :class:`jaxrope.BackendUnavailable` from
    ``export`` is cached and raised again for the key without exporting again.

    Raises:
      BackendUnavailable: Triton is not installed.
    """

    def __init__(self, name: str, target: Any = None):
        self._triton = import_triton()
        self._name = name
        self._target = target
        self._kernels: Dict[Hashable, Any] = {}

    def get(self, key: Hashable, export: Callable[[], Any]) -> Tuple[Any, Any]:
        """``(compiled, exported)`` for ``key``, exporting and compiling on first use."""
        kernel = self._kernels.get(key)
        if isinstance(kernel, BackendUnavailable):
            raise kernel  # declined before: do not export again on every call
        if kernel is None:
            try:
                exported = export()
            except BackendUnavailable as e:
                self._kernels[key] = e
                raise
            # Triton compiles IR from a file; the compiled kernel needs it no longer, so the
            # directory goes with the compile (one left per cache piled up in /tmp).
            with tempfile.TemporaryDirectory(prefix=f"jaxrope_{self._name}_ttir_") as workdir:
                path = os.path.join(workdir, f"{self._name}_{len(self._kernels)}.ttir")
                with open(path, "w") as f:
                    f.write(exported.ttir)
                compiled = self._triton.compile(path, target=self._target,
                                                options={"num_warps": exported.num_warps,
                                                         "num_stages": exported.num_stages})
            kernel = self._kernels[key] = (compiled, exported)
        return kernel


class LaunchRecords(dict):
    """Launch records by call signature: a dict whose misses go through :meth:`make`.

    The hot path is a plain ``records.get(key)``; past ``limit`` records the cache
    starts over rather than grow with every token count an engine ever uses (what a
    record points to stays alive elsewhere, so a captured graph keeps working).
    """

    def __init__(self, limit: int):
        super().__init__()
        self._limit = limit
        self._lock = threading.Lock()

    def make(self, key: Hashable, device: torch.device, build: Callable[[], Any]) -> Any:
        """``build()`` in ``device``'s context (where its kernel is compiled and loaded), stored."""
        with self._lock:
            if len(self) >= self._limit:
                self.clear()
            with torch.cuda.device(device):
                record = self[key] = build()
        return record


class KernelLaunch:
    """One compiled kernel bound to a grid: ``launch(*pointers)`` on torch's current stream.

    ``pointers`` are every operand of the kernel in its order (inputs, then outputs).
    Calls Triton's C launcher directly (``CompiledKernel.run``) with torch's current
    raw stream, skipping the per-call closure and metadata of ``compiled[grid](...)``;
    a Triton without those attributes gets the public ``compiled[grid]`` runner.
    """

    def __init__(self, compiled, grid: Tuple[int, int, int], device: torch.device):
        self._runner = compiled[grid]  # also loads the module onto the device
        self._grid = grid
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            self._run = compiled.run
            self._function = compiled.function
            self._packed = compiled.packed_metadata
            self._raw_stream = torch._C._cuda_getCurrentRawStream
        except AttributeError:
            self._run = None
        # torch's C entry point, as DeviceCounters uses: the public wrapper re-checks lazy
        # initialisation on every call of this hot path (compiled[grid] above did it).
        self._current_device = torch._C._cuda_getDevice

    def __call__(self, *pointers: int) -> None:
        if self._current_device() != self._device_index:
            # The module lives in this device's context; launch from it.
            with torch.cuda.device(self._device_index):
                self(*pointers)
            return
        if self._run is None:
            self._runner(*pointers)
            return
        gx, gy, gz = self._grid
        self._run(gx, gy, gz, self._raw_stream(self._device_index), self._function, self._packed,
                  None, None, None, *pointers)
