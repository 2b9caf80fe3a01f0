"""Fast path of ``apply_qk_and_append_kv``: the fused kernel launched on torch's current stream.

The kernel of :func:`jaxrope.apply_rope_and_append_kv` (:mod:`jaxrope.ops.rope_append_kv.triton`)
rotates q in place and writes the rotated k and the v into the paged cache in one
launch. As :mod:`torch_bridge.triton_launch` does for RoPE alone, this module takes its
Triton IR (:func:`jaxrope.ops.rope_append_kv.triton_export.export_append_kv`), compiles it once per
(head layout, cache geometry, config, dtype, launch shape) with the installed Triton and
launches it with raw pointers on torch's current stream (:mod:`torch_bridge.triton_runtime`):
ordered with the surrounding torch work, no host sync, in place on the engine's own
tensors, capturable in a ``torch.cuda.CUDAGraph``.

M-RoPE (``cfg.mrope_section``): the kernel exported with the config's sections reads the
positions as one contiguous ``[3, T]`` block (row ``r`` of token ``t`` at ``r * T + t``),
as the rope launcher does (:func:`torch_bridge.triton_launch.mrope_block`: the plan's
``[3, N]`` buffer itself when ``N == T``, else a copy of its first ``T`` columns).

The token count is read from a device table, so one compiled kernel serves every T; the
cache geometry (pages, page size, layout, dtype) is part of the kernel, which an engine
fixes once. Slots of another integer dtype (vLLM's int64 ``slot_mapping``) are
narrowed to int32 on torch's stream first, a slot outside the cache becoming -1 at its
own width (:func:`torch_bridge.kv_append.int32_slots`: a few small kernels, no host
sync); pass int32 slots to skip them.

CUDA graphs: call once outside capture for every signature (shapes, dtypes, cache,
scales) a graph will hold. That first call exports, compiles and allocates the count,
angle and scale tables; capturing it is not supported. Later calls, captured or not,
only launch.

The protocol a launcher of the manager follows is
:class:`torch_bridge.launchers.KVLauncher`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch

from jaxrope.ops.constants import kernel_options
from jaxrope.config import RopeConfig
from jaxrope.ops.rope_append_kv import triton_export
from jaxrope.ops.rope_append_kv.tuning import AppendTritonTuning, append_triton_tuning
from jaxrope.ops.triton_common import lanes_for
from torch_bridge.dlpack import jax_dtype_name
from torch_bridge.kv_append import CacheGeometry, int32_slots
from torch_bridge.triton_launch import mrope_block
from torch_bridge.triton_runtime import (ALIGN, AngleTables, CountTable, KernelCache,
                                         KernelLaunch, LaunchRecords, check_launchable)

__all__ = ["KVAppendLauncher", "append_record", "append_operands", "bound_append"]

# Launch records kept (one per distinct shape, cache, config, scales and device).
_MAX_LAUNCHES = 4096


class KVAppendLauncher:
    """Compiles and launches the fused RoPE + paged KV append kernel on torch's current stream.

    Declines (raises :class:`jaxrope.BackendUnavailable`, so the manager runs the JAX
    path) without Triton, for tensors that are not on a CUDA device, contiguous and
    32-byte aligned, for an fp8 cache of 2-4 GiB (the Pallas lowering's int32 offsets
    would wrap) and when the kernel's Triton IR cannot be exported from the running JAX.

    Args:
      target: a ``triton.backends.compiler.GPUTarget`` to compile for; None (default)
        compiles for the device the tensors are on. A target compiles without a GPU.

    Example:
      >>> from torch_bridge.rope_manager import RopeManager
      >>> from torch_bridge import PositionConfig
      >>> import jaxrope as jr
      >>> RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu").kv_launcher is None
      True
      >>> launcher = KVAppendLauncher()          # on CUDA, "auto" makes one  # doctest: +SKIP
    """

    def __init__(self, *, target: Any = None):
        self._kernels = KernelCache("rope_append_kv", target)
        self._tables = AngleTables()
        self._counts: Dict[torch.device, CountTable] = {}
        self._scales: Dict[Tuple[float, float, torch.device], torch.Tensor] = {}
        # signature -> (kernel launch, count pointer, tables pointer, scales pointer)
        self._launches = LaunchRecords(_MAX_LAUNCHES)

    def kernel(self, q_heads: int, dtype: torch.dtype, cfg: RopeConfig, geometry: CacheGeometry,
               block: AppendTritonTuning) -> Tuple[Any, triton_export.AppendKernel]:
        """``(compiled, exported)``: the kernel for this layout, exported and compiled once.

        Raises:
          BackendUnavailable: the export failed (for this key it is not tried again).
        """
        return self._kernels.get((q_heads, dtype, cfg, geometry, block), lambda: (
            triton_export.export_append_kv(
                q_heads=q_heads, k_heads=geometry.k_heads, head_dim=cfg.head_dim,
                dtype=jax_dtype_name(dtype), cache_shape=geometry.view_shape,
                cache_dtype=jax_dtype_name(geometry.dtype), layout=geometry.layout,
                components=geometry.components, block=block, **kernel_options(cfg))))

    def rotate_and_append_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              pos_ids: torch.Tensor, caches: Sequence[torch.Tensor],
                              slots: torch.Tensor, cfg: RopeConfig, geometry: CacheGeometry,
                              scales: Tuple[float, float],
                              block: Optional[AppendTritonTuning] = None) -> None:
        """Rotate ``q [T, Hq, D]`` in place at ``pos_ids[:T]``; write k, v into ``caches`` at ``slots``.

        ``k, v [T, Hk, D]``, ``pos_ids`` int32 ``[>= T]`` (M-RoPE: ``[3, N >= T]``, its
        first ``T`` columns copied into one contiguous block when ``N > T``:
        :func:`torch_bridge.triton_launch.mrope_block`), ``caches`` the engine's tensors
        (a ``(k_cache, v_cache)`` pair or the combined tensor alone), ``slots`` ``[T]`` of
        any integer dtype, ``geometry`` and ``scales`` as
        :func:`torch_bridge.kv_append.check_call` returns them: the caller has validated
        shapes, dtypes and devices; this checks only what the compiled kernel assumes.
        ``block`` overrides the launch-shape heuristic (benchmarks sweep it).

        Raises:
          BackendUnavailable: a tensor off CUDA or breaking the kernel's layout
            assumptions (contiguous, 32-byte aligned), or an export that fails.
        """
        if q.shape[0] == 0:
            return
        pos_ids, slots = append_operands(q, k, v, pos_ids, slots, caches, cfg, geometry)
        launch, count_ptr, tables_ptr, scales_ptr = self._launch_for(q, cfg, geometry, scales,
                                                                     block)
        q_ptr, cache_ptrs = q.data_ptr(), tuple(c.data_ptr() for c in caches)
        launch(count_ptr, pos_ids.data_ptr(), slots.data_ptr(), tables_ptr, scales_ptr, q_ptr,
               k.data_ptr(), v.data_ptr(), *cache_ptrs, q_ptr, *cache_ptrs)

    def bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             caches: Sequence[torch.Tensor], slots: torch.Tensor, cfg: RopeConfig,
             geometry: CacheGeometry, scales: Tuple[float, float]) -> Callable[..., bool]:
        """A launch for later calls of this signature: ``run(q, k, v, pos_ids, kv_cache, slots) -> bool``.

        ``run`` takes the caller's arguments as given (q, k, v ``[T, H, D]`` or ``[T, H *
        D]``, ``kv_cache`` the pair or the combined tensor); the caller has validated
        them once for this signature. Per call ``run`` checks only contiguity, 32-byte
        alignment and that a pair's two tensors do not overlap, and returns False
        (launching nothing) when one fails, so the caller takes its full path (which
        refuses an overlapping pair).
        """
        launch, count_ptr, tables_ptr, scales_ptr = self._launch_for(q, cfg, geometry, scales,
                                                                     None)

        def pointers(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs):
            launch(count_ptr, pos_ptr, slot_ptr, tables_ptr, scales_ptr, q_ptr, k_ptr, v_ptr,
                   *cache_ptrs, q_ptr, *cache_ptrs)

        run = bound_append(pointers, geometry, cfg, caches)
        return run

    def _launch_for(self, q: torch.Tensor, cfg: RopeConfig, geometry: CacheGeometry,
                    scales: Tuple[float, float],
                    block: Optional[AppendTritonTuning]) -> Tuple[KernelLaunch, int, int, int]:
        return append_record(self._launches, self._prepare, q, cfg, geometry, scales, block)

    def _prepare(self, tokens: int, q_heads: int, dtype: torch.dtype, device: torch.device,
                 cfg: RopeConfig, geometry: CacheGeometry, scales: Tuple[float, float],
                 block: Optional[AppendTritonTuning]) -> Tuple[KernelLaunch, int, int, int]:
        lanes = lanes_for(cfg.rotary_dim)
        block = block or append_triton_tuning(tokens, q_heads, geometry.k_heads, lanes)
        compiled, exported = self.kernel(q_heads, dtype, cfg, geometry, block)
        counts = self._counts.get(device)
        if counts is None:
            counts = self._counts[device] = CountTable(device)
        scale_key = (*scales, device)
        scale_values = self._scales.get(scale_key)
        if scale_values is None:
            # Kept for good: a captured graph may hold the pointer.
            scale_values = self._scales[scale_key] = torch.tensor(scales, dtype=torch.float32,
                                                                  device=device)
        return (KernelLaunch(compiled, exported.grid(tokens), device), counts.pointer(tokens),
                self._tables.get(cfg, device, lanes).data_ptr(), scale_values.data_ptr())


def bound_append(launch: Callable[..., None], geometry: CacheGeometry, cfg: RopeConfig,
                 caches: Sequence[torch.Tensor]) -> Callable[..., bool]:
    """The ``run(q, k, v, pos_ids, kv_cache, slots) -> bool`` of a fused-append launcher's
    ``bind``: per call it narrows the slots, takes an M-RoPE config's ``[3, T]`` block,
    checks contiguity, 32-byte alignment and that a pair's two tensors do not overlap,
    then calls ``launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs)``; False
    (launching nothing) when a check fails, so the caller takes its full path (which
    refuses an overlapping pair)."""
    combined, num_slots = geometry.combined, geometry.num_slots
    mrope = cfg.mrope_section is not None
    # Two contiguous tensors of this many bytes overlap exactly when their starts are
    # closer than that.
    cache_bytes = caches[0].numel() * caches[0].element_size()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
            kv_cache: Any, slots: torch.Tensor) -> bool:
        if combined:
            cache_ptrs = (kv_cache.data_ptr(),)
            contiguous = kv_cache.is_contiguous()
        else:
            k_cache, v_cache = kv_cache
            cache_ptrs = (k_cache.data_ptr(), v_cache.data_ptr())
            contiguous = (k_cache.is_contiguous() and v_cache.is_contiguous()
                          and abs(cache_ptrs[0] - cache_ptrs[1]) >= cache_bytes)
        slots = int32_slots(slots, num_slots)
        if mrope:
            pos_ids = mrope_block(pos_ids, q.shape[0])
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        pos_ptr, slot_ptr = pos_ids.data_ptr(), slots.data_ptr()
        if ((q_ptr | k_ptr | v_ptr | pos_ptr | slot_ptr | cache_ptrs[0] | cache_ptrs[-1]) % ALIGN
                or not (contiguous and q.is_contiguous() and k.is_contiguous()
                        and v.is_contiguous() and slots.is_contiguous())):
            return False
        launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs)
        return True

    return run


def append_operands(q, k, v, pos_ids, slots, caches, cfg: RopeConfig,
                    geometry: CacheGeometry) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(pos_ids, slots)`` as a compiled fused-append kernel reads them (an M-RoPE
    config's ``[3, T]`` block, int32 slots), after checking what it assumes of every
    tensor.

    Raises:
      BackendUnavailable: a tensor off CUDA, not contiguous or not 32-byte aligned.
    """
    if cfg.mrope_section is not None:
        pos_ids = mrope_block(pos_ids, q.shape[0])
    check_launchable((("q", q), ("k", k), ("v", v), ("pos_ids", pos_ids), ("slots", slots),
                   *zip(("kv_cache",) if geometry.combined else ("k_cache", "v_cache"), caches)))
    return pos_ids, int32_slots(slots, geometry.num_slots)


def append_record(records: LaunchRecords, prepare: Callable[..., Any], q: torch.Tensor,
                  cfg: RopeConfig, geometry: CacheGeometry, scales: Tuple[float, float],
                  shape: Any) -> Any:
    """A fused-append launcher's record for this call: ``records[key]``, built by
    ``prepare(tokens, q_heads, dtype, device, cfg, geometry, scales, shape)`` on a miss;
    everything but the per-call pointers is fixed by the key (``shape``: the launch-shape
    override, or None)."""
    tokens = q.shape[0]
    q_heads = q.numel() // max(1, tokens * cfg.head_dim)
    key = (tokens, q_heads, q.dtype, q.device, cfg, geometry, scales, shape)
    record = records.get(key)
    if record is None:
        record = records.make(key, q.device, lambda: prepare(
            tokens, q_heads, q.dtype, q.device, cfg, geometry, scales, shape))
    return record
