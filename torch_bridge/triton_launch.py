"""Fast path: launch the compiled Pallas RoPE kernel directly on torch's current stream.

Going through JAX for each layer costs a DLPack import and a jitted dispatch (together
~130 us on the H200 against a ~10 us kernel). The kernel is a Triton kernel, so this
module takes its Triton IR (:mod:`jaxrope.ops.rope.triton_export`), compiles it with the
installed Triton once per (head layout, config, dtype, launch shape) and launches it
with raw pointers on torch's current stream: stream-ordered with the surrounding torch
work, no host sync, capturable in a ``torch.cuda.CUDAGraph``.

The token count is read by the kernel from a device array, so one compiled kernel
serves every T; a :class:`~torch_bridge.triton_runtime.CountTable` keeps one
32-byte-aligned int32 per possible T (the IR promises 32-byte-aligned pointers). The
compile cache and the raw launch are :mod:`torch_bridge.triton_runtime`'s, shared with
the fused KV-append launcher (:mod:`torch_bridge.kv_launch`).

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

from typing import Callable, Dict, Optional, Tuple

import torch

from jaxrope.ops.constants import kernel_options
from jaxrope.config import RopeConfig
from jaxrope.ops.rope import triton_export
from jaxrope.ops.rope.tuning import TritonTuning, triton_tuning
from jaxrope.ops.triton_common import lanes_for
from torch_bridge.dlpack import jax_dtype_name
from torch_bridge.triton_runtime import ALIGN as _ALIGN
from torch_bridge.triton_runtime import (AngleTables, CountTable, KernelCache, KernelLaunch,
                                         LaunchRecords, check_launchable)

# Launch records kept (one per distinct shape, config and device); past this the cache
# starts over rather than grow with every token count an engine ever uses.
_MAX_LAUNCHES = 4096


class TritonLauncher:
    """Compiles and launches the Pallas RoPE kernel on torch's current CUDA stream.

    Declines (raises :class:`jaxrope.BackendUnavailable`, so the manager runs the JAX path)
    without Triton, for tensors that are not on a CUDA device, contiguous and 32-byte
    aligned, and when the kernel's Triton IR cannot be exported from the running JAX.

    Example:
      >>> from torch_bridge.launchers import resolve_launchers
      >>> resolve_launchers("auto", torch.device("cpu"))  # no fast path on CPU
      (None, None)
      >>> launcher = TritonLauncher()              # doctest: +SKIP
      >>> launcher.rotate_(q, k, pos_ids, cfg)     # q, k rotated in place  # doctest: +SKIP
    """

    def __init__(self):
        self._kernels = KernelCache("rope")
        self._tables = AngleTables()
        self._counts: Dict[torch.device, CountTable] = {}
        # signature -> (kernel launch, count pointer, tables pointer)
        self._launches = LaunchRecords(_MAX_LAUNCHES)

    def _compiled(self, key: Tuple, export_kwargs: dict):
        return self._kernels.get(key, lambda: triton_export.export(**export_kwargs))

    def _prepare(self, q_shape: Tuple[int, int, int], k_heads: int, dtype: torch.dtype,
                 device: torch.device, cfg: RopeConfig,
                 block: Optional[TritonTuning]) -> Tuple[KernelLaunch, int, int]:
        num_tokens, q_heads, head_dim = q_shape
        lanes = lanes_for(cfg.rotary_dim)
        block = block or triton_tuning(num_tokens, q_heads, k_heads, lanes)
        export_kwargs = dict(
            q_heads=q_heads, k_heads=k_heads, head_dim=head_dim,
            dtype=jax_dtype_name(dtype), block=block, **kernel_options(cfg))
        # Keyed by everything the IR is exported from (the M-RoPE sections and their
        # interleaving included); the frequencies are a run-time table, keyed by cfg.
        compiled, exported = self._compiled(tuple(export_kwargs.items()), export_kwargs)
        tables = self._tables.get(cfg, device, lanes)
        counts = self._counts.get(device)
        if counts is None:
            counts = self._counts[device] = CountTable(device)
        return (KernelLaunch(compiled, exported.grid(num_tokens), device),
                counts.pointer(num_tokens), tables.data_ptr())

    def bind(self, q: torch.Tensor, k: torch.Tensor, cfg: RopeConfig) -> Callable[..., bool]:
        """A launch for every later call with q and k shaped as these: ``run(q, k, pos_ids) -> bool``.

        ``q``/``k`` may be ``[T, H, D]`` or ``[T, H * D]`` (same memory layout); the
        caller has validated shapes, dtypes and devices once for this signature. Per
        call ``run`` checks only contiguity and 32-byte alignment and returns False
        (launching nothing) when they fail, so the caller can take its slow path.
        """
        launch, count_ptr, tables_ptr = self._launch_for(q, k, cfg, None)

        def run(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> bool:
            q_ptr, k_ptr, pos_ptr = q.data_ptr(), k.data_ptr(), pos_ids.data_ptr()
            if (q_ptr | k_ptr | pos_ptr) % _ALIGN or not (q.is_contiguous() and k.is_contiguous()):
                return False
            launch(count_ptr, pos_ptr, tables_ptr, q_ptr, k_ptr, q_ptr, k_ptr)
            return True

        if cfg.mrope_section is None:
            return run

        def run_mrope(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> bool:
            return run(q, k, mrope_block(pos_ids, q.shape[0]))

        return run_mrope

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                cfg: RopeConfig, block: Optional[TritonTuning] = None) -> None:
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
        check_launchable((("q", q), ("k", k), ("pos_ids", pos_ids)))
        launch, count_ptr, tables_ptr = self._launch_for(q, k, cfg, block)
        q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
        launch(count_ptr, pos_ids.data_ptr(), tables_ptr, q_ptr, k_ptr, q_ptr, k_ptr)

    def _launch_for(self, q: torch.Tensor, k: torch.Tensor, cfg: RopeConfig,
                    block: Optional[TritonTuning]) -> Tuple[KernelLaunch, int, int]:
        head_dim = cfg.head_dim
        q_shape = (q.shape[0], q.numel() // max(1, q.shape[0] * head_dim), head_dim)
        k_heads = k.numel() // max(1, k.shape[0] * head_dim)
        # Everything but the three pointers is fixed by this key, so a repeated shape
        # costs one dict lookup before the launch.
        key = (q_shape, k_heads, q.dtype, q.device, cfg, block)
        launch = self._launches.get(key)
        if launch is None:
            launch = self._launches.make(key, q.device, lambda: self._prepare(
                q_shape, k_heads, q.dtype, q.device, cfg, block))
        return launch


def mrope_block(pos_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The contiguous ``[3, tokens]`` block an M-RoPE kernel of count ``tokens`` reads, from
    ``pos_ids [3, N >= tokens]``: the tensor itself when ``N == tokens``, else a copy of
    its first ``tokens`` columns (never the ``[3, N]`` buffer: its rows sit ``N`` apart)."""
    if pos_ids.shape[-1] == tokens and pos_ids.is_contiguous():
        return pos_ids
    return pos_ids[:, :tokens].contiguous()

