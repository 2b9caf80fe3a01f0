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
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Dict, Optional, Tuple

import torch

from jaxrope.apply import kernel_constants
from jaxrope.config import RopeConfig
from jaxrope.kernels import pallas_triton, triton_ir

_ALIGN = 32
_TORCH_TO_JAX_DTYPE = {torch.float32: "float32", torch.float16: "float16",
                       torch.bfloat16: "bfloat16"}


class LaunchUnavailable(RuntimeError):
    """The fast path cannot run here (no CUDA, no Triton, or an unexpected JAX); use JAX."""


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

    Example:
      >>> launcher = TritonLauncher()              # doctest: +SKIP
      >>> launcher.rotate_(q, k, pos_ids, cfg)     # doctest: +SKIP  (q, k rotated in place)
    """

    def __init__(self):
        try:
            import triton
        except ImportError as e:
            raise LaunchUnavailable(f"Triton is not installed: {e}") from e
        if not torch.cuda.is_available():
            raise LaunchUnavailable("no CUDA device")
        self._triton = triton
        self._lock = threading.Lock()
        self._kernels: Dict[Tuple, object] = {}
        self._tables: Dict[Tuple[RopeConfig, torch.device], torch.Tensor] = {}
        self._counts: Dict[torch.device, _CountTable] = {}
        self._workdir = tempfile.mkdtemp(prefix="jaxrope_ttir_")

    def _compiled(self, key: Tuple, export_kwargs: dict):
        kernel = self._kernels.get(key)
        if kernel is None:
            exported = triton_ir.export(**export_kwargs)
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

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                cfg: RopeConfig, block: Optional[pallas_triton.BlockConfig] = None) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place at ``pos_ids[:T]``.

        The caller has validated shapes, dtypes and devices; this checks only what the
        compiled kernel assumes (contiguity and 32-byte alignment). ``block`` overrides
        the launch-shape heuristic (benchmarks sweep it).

        Raises:
          LaunchUnavailable: a tensor breaks the kernel's layout assumptions.
        """
        num_tokens, q_heads, head_dim = q.shape
        if num_tokens == 0:
            return
        for name, t in (("q", q), ("k", k), ("pos_ids", pos_ids)):
            if not t.is_contiguous() or t.data_ptr() % _ALIGN:
                raise LaunchUnavailable(f"{name} must be contiguous and {_ALIGN}-byte aligned")
        k_heads = k.shape[1]
        lanes = 1 << max(0, (cfg.rotary_dim // 2 - 1).bit_length())
        block = block or pallas_triton.block_config(num_tokens, q_heads, k_heads, lanes)
        _, attention = kernel_constants(cfg)
        key = (q_heads, k_heads, head_dim, cfg, q.dtype, block)
        with self._lock:
            compiled, exported = self._compiled(key, dict(
                q_heads=q_heads, k_heads=k_heads, head_dim=head_dim, rotary_dim=cfg.rotary_dim,
                interleave=cfg.interleave, attention_factor=attention,
                dtype=_TORCH_TO_JAX_DTYPE[q.dtype], block=block))
            tables = self._device_tables(cfg, q.device, lanes)
            counts = self._counts.get(q.device)
            if counts is None:
                counts = self._counts[q.device] = _CountTable(q.device)
            count_ptr = counts.pointer(num_tokens)
        compiled[exported.grid(num_tokens)](
            count_ptr, pos_ids.data_ptr(), tables.data_ptr(), q.data_ptr(), k.data_ptr(),
            q.data_ptr(), k.data_ptr())
