"""Fast path: launch the compiled Pallas RoPE kernel directly on torch's current stream.

Going through JAX for each layer costs a DLPack import and a jitted dispatch (together
~130 us on the H200 against a ~10 us kernel). The kernel is a Triton kernel, so this
module takes its Triton IR (:mod:`jaxrope.kernels.triton_ir`), compiles it with the
installed Triton once per (head layout, config, dtype, launch shape) and launches it
with raw pointers on torch's current stream: stream-ordered with the surrounding torch
work, no host sync, capturable in a ``torch.cuda.CUDAGraph``.

The token count is read by the kernel from a device array, so one compiled kernel
serves every T; ``_CountTable`` keeps one 32-byte-aligned int32 per possible T (the
IR promises 32-byte-aligned pointers).

Launch before capturing a CUDA graph at least once per shape bucket: compiling and
allocating the tables inside a capture is not supported.

M-RoPE (``cfg.mrope_section``): the kernel exported with the config's sections reads row
``r`` of token ``t`` at ``r * count + t`` with ``count = T``, so its positions must be one
contiguous ``[3, T]`` block. A ``[3, N]`` buffer with ``N > T`` (a plan with more tokens
than q, a graph slot's buffer) is launched on ``pos_ids[:, :T]`` made contiguous (one
small device copy on the same stream, capturable); with ``N == T`` (a graph replay over
the whole bucket) the buffer itself.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Callable, Dict, Optional, Tuple

import torch

from jaxrope.apply import kernel_constants
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.kernels import pallas_triton, triton_ir

_ALIGN = 32
# Launch records kept (one per distinct shape, config and device); past this the cache
# starts over rather than grow with every token count an engine ever uses.
_MAX_LAUNCHES = 4096


class _CountTable:
    """Device int32 rows ``[n, 8]`` with row ``t`` holding ``t``: a pointer to any count.

    Outgrown tables are kept alive: a captured CUDA graph may still hold their pointers.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.tables = [self._make(1 << 16)]

    def _make(self, size: int) -> torch.Tensor:
        rows = torch.zeros((size, _ALIGN // 4), dtype=torch.int32, device=self.device)
        rows[:, 0] = torch.arange(size, dtype=torch.int32, device=self.device)
        return rows

    def pointer(self, count: int) -> int:
        rows = self.tables[-1]
        if count >= rows.shape[0]:
            rows = self._make(1 << count.bit_length())
            self.tables.append(rows)
        return rows.data_ptr() + count * _ALIGN


class TritonLauncher:
    """Compiles and launches the Pallas RoPE kernel on torch's current CUDA stream.

    Declines (raises :class:`jaxrope.BackendUnavailable`, so the manager runs the JAX path)
    without Triton, for tensors that are not on a CUDA device, contiguous and 32-byte
    aligned, and when the kernel's Triton IR cannot be exported from the running JAX.

    Example:
      >>> from torch_bridge.rotate import resolve_launcher
      >>> resolve_launcher("auto", torch.device("cpu")) is None  # no fast path on CPU
      True
      >>> launcher = TritonLauncher()              # doctest: +SKIP
      >>> launcher.rotate_(q, k, pos_ids, cfg)     # q, k rotated in place  # doctest: +SKIP
    """

    def __init__(self):
        try:
            import triton
        except ImportError as e:
            raise BackendUnavailable(f"Triton is not installed: {e}") from e
        self._triton = triton
        self._lock = threading.Lock()
        self._kernels: Dict[Tuple, object] = {}
        self._tables: Dict[Tuple[RopeConfig, torch.device], torch.Tensor] = {}
        self._counts: Dict[torch.device, _CountTable] = {}
        self._launches: Dict[Tuple, _Launch] = {}
        self._workdir = tempfile.mkdtemp(prefix="jaxrope_ttir_")

    def _compiled(self, key: Tuple, export_kwargs: dict):
        kernel = self._kernels.get(key)
        if isinstance(kernel, BackendUnavailable):
            raise kernel  # declined before: do not export again on every call
        if kernel is None:
            try:
                exported = triton_ir.export(**export_kwargs)
            except BackendUnavailable as e:
                self._kernels[key] = e
                raise
            path = os.path.join(self._workdir, f"rope_{len(self._kernels)}.ttir")
            with open(path, "w") as f:
                f.write(exported.ttir)
            compiled = self._triton.compile(path, options={"num_warps": exported.num_warps,
                                                           "num_stages": exported.num_stages})
            kernel = self._kernels[key] = (compiled, exported)
        return kernel

    def _device_tables(self, cfg: RopeConfig, device: torch.device, lanes: int) -> torch.Tensor:
        key = (cfg, device)
        tables = self._tables.get(key)
        if tables is None:
            host, _ = kernel_constants(cfg)
            tables = torch.zeros((3, lanes), dtype=torch.float32)
            tables[:, :host.shape[1]] = torch.from_numpy(host.copy())
            tables = self._tables[key] = tables.to(device)
        return tables

    def _prepare(self, q_shape: Tuple[int, int, int], k_heads: int, dtype: torch.dtype,
                 device: torch.device, cfg: RopeConfig,
                 block: Optional[pallas_triton.BlockConfig]) -> "_Launch":
        num_tokens, q_heads, head_dim = q_shape
        lanes = pallas_triton.lanes_for(cfg.rotary_dim)
        block = block or pallas_triton.block_config(num_tokens, q_heads, k_heads, lanes)
        _, attention = kernel_constants(cfg)
        export_kwargs = dict(
            q_heads=q_heads, k_heads=k_heads, head_dim=head_dim, rotary_dim=cfg.rotary_dim,
            interleave=cfg.interleave, attention_factor=attention,
            dtype=str(dtype).removeprefix("torch."), block=block,
            mrope_section=cfg.mrope_section, mrope_interleaved=cfg.mrope_interleaved)
        # Keyed by everything the IR is exported from (the M-RoPE sections and their
        # interleaving included); the frequencies are a run-time table, keyed by cfg.
        compiled, exported = self._compiled(tuple(export_kwargs.items()), export_kwargs)
        tables = self._device_tables(cfg, device, lanes)
        counts = self._counts.get(device)
        if counts is None:
            counts = self._counts[device] = _CountTable(device)
        return _Launch(compiled, exported.grid(num_tokens), device,
                       (counts.pointer(num_tokens), tables.data_ptr()))

    def bind(self, q: torch.Tensor, k: torch.Tensor, cfg: RopeConfig) -> Callable[..., bool]:
        """A launch for every later call with q and k shaped as these: ``run(q, k, pos_ids) -> bool``.

        ``q``/``k`` may be ``[T, H, D]`` or ``[T, H * D]`` (same memory layout); the
        caller has validated shapes, dtypes and devices once for this signature. Per
        call ``run`` checks only contiguity and 32-byte alignment and returns False
        (launching nothing) when they fail, so the caller can take its slow path.
        """
        launch = self._launch_for(q, k, cfg, None)

        def run(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> bool:
            q_ptr, k_ptr, pos_ptr = q.data_ptr(), k.data_ptr(), pos_ids.data_ptr()
            if (q_ptr | k_ptr | pos_ptr) % _ALIGN or not (q.is_contiguous() and k.is_contiguous()):
                return False
            launch(pos_ptr, q_ptr, k_ptr)
            return True

        if cfg.mrope_section is None:
            return run

        def run_mrope(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> bool:
            return run(q, k, mrope_block(pos_ids, q.shape[0]))

        return run_mrope

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                cfg: RopeConfig, block: Optional[pallas_triton.BlockConfig] = None) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place at ``pos_ids[:T]``.

        The caller has validated shapes, dtypes and devices; this checks only what the
        compiled kernel assumes (contiguity and 32-byte alignment). ``block`` overrides
        the launch-shape heuristic (benchmarks sweep it).

        Raises:
          BackendUnavailable: a tensor off CUDA or breaking the kernel's layout
            assumptions, or a JAX whose Triton IR export fails.
        """
        if q.shape[0] == 0:
            return
        if cfg.mrope_section is not None:
            pos_ids = mrope_block(pos_ids, q.shape[0])
        for name, t in (("q", q), ("k", k), ("pos_ids", pos_ids)):
            if not t.is_cuda:
                raise BackendUnavailable(f"{name} is on {t.device}: the launcher needs CUDA")
            if not t.is_contiguous() or t.data_ptr() % _ALIGN:
                raise BackendUnavailable(f"{name} must be contiguous and {_ALIGN}-byte aligned")
        self._launch_for(q, k, cfg, block)(pos_ids.data_ptr(), q.data_ptr(), k.data_ptr())

    def _launch_for(self, q: torch.Tensor, k: torch.Tensor, cfg: RopeConfig,
                    block: Optional[pallas_triton.BlockConfig]) -> "_Launch":
        head_dim = cfg.head_dim
        q_shape = (q.shape[0], q.numel() // max(1, q.shape[0] * head_dim), head_dim)
        k_heads = k.numel() // max(1, k.shape[0] * head_dim)
        # Everything but the three pointers is fixed by this key, so a repeated shape
        # costs one dict lookup before the launch.
        key = (q_shape, k_heads, q.dtype, q.device, cfg, block)
        launch = self._launches.get(key)
        if launch is None:
            with self._lock:
                if len(self._launches) >= _MAX_LAUNCHES:
                    self._launches.clear()
                with torch.cuda.device(q.device):  # compile and load in q's context
                    launch = self._launches[key] = self._prepare(q_shape, k_heads, q.dtype,
                                                                 q.device, cfg, block)
        return launch


def mrope_block(pos_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The contiguous ``[3, tokens]`` block an M-RoPE kernel of count ``tokens`` reads, from
    ``pos_ids [3, N >= tokens]``: the tensor itself when ``N == tokens``, else a copy of
    its first ``tokens`` columns (never the ``[3, N]`` buffer: its rows sit ``N`` apart)."""
    if pos_ids.shape[-1] == tokens and pos_ids.is_contiguous():
        return pos_ids
    return pos_ids[:, :tokens].contiguous()


class _Launch:
    """One compiled kernel bound to a grid, a count pointer and a tables pointer.

    Calls Triton's C launcher directly (``CompiledKernel.run``) with torch's current
    raw stream, skipping the per-call closure and metadata of ``compiled[grid](...)``;
    a Triton without those attributes gets the public ``compiled[grid]`` runner.
    """

    def __init__(self, compiled, grid: Tuple[int, int, int], device: torch.device,
                 constant_pointers: Tuple[int, int]):
        self._runner = compiled[grid]  # also loads the module onto the device
        self._grid = grid
        self._device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._count_ptr, self._tables_ptr = constant_pointers
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

    def __call__(self, pos_ptr: int, q_ptr: int, k_ptr: int) -> None:
        if self._current_device() != self._device_index:
            # The module lives in this device's context; launch from it.
            with torch.cuda.device(self._device_index):
                self(pos_ptr, q_ptr, k_ptr)
            return
        args = (self._count_ptr, pos_ptr, self._tables_ptr, q_ptr, k_ptr, q_ptr, k_ptr)
        if self._run is None:
            self._runner(*args)
            return
        gx, gy, gz = self._grid
        self._run(gx, gy, gz, self._raw_stream(self._device_index), self._function, self._packed,
                  None, None, None, *args)
