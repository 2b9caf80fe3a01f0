"""The Mosaic GPU MLA kernel (RoPE + paged cache append) launched from torch on Hopper.

:mod:`jaxrope.ops.mla_rope_append.mosaic` exported as a Mosaic module
(:mod:`jaxrope.ops.mla_rope_append.mosaic_export`) and launched as
:mod:`torch_bridge.launch.mosaic` launches the GQA append: compiled once per (head count,
cache form, config, dtypes, launch shape) by the CUDA plugin's ``MosaicGpuCompile``, the
token count read from device memory, so one compiled kernel serves every T of its
launch shape (:func:`torch_bridge.launch.mosaic.launch_shape`, one token a block split
by piece), launched on torch's current raw stream with raw pointers: no host sync,
capturable in a ``torch.cuda.CUDAGraph`` once the shape has launched outside capture.
``bind`` gives the manager a launch for a repeated call signature that checks only
contiguity, alignment and a pair's overlap (as the GQA launchers' bound runs).

The Triton-lowered MLA kernel has no launch here: its IR depends on T only through its
one-axis grid, but Pallas's Triton lowering emits other IR once that grid passes 65,535
programs (it folds the axis, CUDA's y/z limit), so such a launch would need T in its
compile key past that; on a GPU before Hopper the manager runs the JAX path.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch

from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.ops.constants import kernel_options
from jaxrope.ops.mla_rope_append import mosaic_export as mla_export
from jaxrope.ops.mla_rope_append.tuning import mla_mosaic_tuning
from torch_bridge.dlpack import jax_dtype_name
from torch_bridge.launch.mosaic import MosaicLauncher, _hopper_capability, launch_shape
from torch_bridge.launch.runtime import (ALIGN, LaunchRecords, ScaleTables, check_launchable,
                                         int32_slots, mrope_block)

__all__ = ["MlaShape", "MosaicMlaLauncher", "launch_pointers"]

_MAX_LAUNCHES = 4096
FP8 = torch.float8_e4m3fn


class MlaShape(NamedTuple):
    """What one MLA launch record is compiled for, beyond the config and the scales."""

    tokens: int
    heads: int
    nope_dim: int            # q_nope's N when it is quantised (fp8 q), else 0
    kv_lora_rank: int
    num_slots: int           # cache rows (pages * page_size)
    combined: bool           # one [.., L + r] cache, else a (ckv, k_pe) pair
    dtype: torch.dtype
    cache_dtype: torch.dtype
    q_fp8: bool
    device: torch.device
    grid: Optional[int]      # the launch's block count override (None: launch_shape's)


def _check(q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
           caches: Sequence[torch.Tensor], cfg: RopeConfig, q_nope: Optional[torch.Tensor],
           q_pe_out: Optional[torch.Tensor], q_nope_out: Optional[torch.Tensor]) -> None:
    # What the kernel reads and writes past the manager's checks: a wrong size here would
    # read or write past a buffer.
    if q_pe.ndim != 3 or q_pe.shape[-1] != cfg.head_dim:
        raise ValueError(f"q_pe.shape={tuple(q_pe.shape)} must be [T, H, {cfg.head_dim}]")
    tokens, heads, rope = q_pe.shape
    if tuple(k_pe.shape) != (tokens, rope) or ckv.ndim != 2 or ckv.shape[0] != tokens:
        raise ValueError(f"k_pe {tuple(k_pe.shape)} and ckv {tuple(ckv.shape)} must be "
                         f"[{tokens}, {rope}] and [{tokens}, L]")
    lora = ckv.shape[1]
    widths = (lora + rope,) if len(caches) == 1 else (lora, rope)
    if (len(caches) not in (1, 2) or any(c.ndim != 3 or c.shape[2] != w or c.shape[:2] !=
                                         caches[0].shape[:2] for c, w in zip(caches, widths))):
        raise ValueError(f"caches {[tuple(c.shape) for c in caches]} must be one [pages, "
                         f"page_size, {lora + rope}] tensor or [pages, page_size, {lora}] "
                         f"and [pages, page_size, {rope}]")
    if any(c.dtype != caches[0].dtype for c in caches) or caches[0].dtype not in (q_pe.dtype, FP8):
        raise ValueError(f"caches {[c.dtype for c in caches]} must all be {q_pe.dtype} or {FP8}")
    if len({x.dtype for x in (q_pe, k_pe, ckv) + ((q_nope,) if q_nope is not None else ())}) != 1:
        raise ValueError("q_pe, k_pe, ckv and q_nope must share one dtype")
    if q_nope is not None and (q_pe_out is None or q_nope_out is None):
        raise ValueError("q_nope is only read to quantise it: pass q_pe_out and q_nope_out")
    for name, out, like in (("q_pe_out", q_pe_out, q_pe), ("q_nope_out", q_nope_out, q_nope)):
        if out is not None and (like is None or out.dtype != FP8 or out.shape != like.shape):
            raise ValueError(f"{name} ({out.dtype}, {tuple(out.shape)}) must be {FP8} shaped "
                             f"like {name[:-4]} "
                             f"{None if like is None else tuple(like.shape)}")


def launch_pointers(q_fp8: bool, fixed: Tuple[int, ...], q_ptr: int, k_ptr: int, ckv_ptr: int,
                    nope_ptrs: Tuple[int, ...], cache_ptrs: Tuple[int, ...],
                    out_ptrs: Tuple[int, ...]) -> Tuple[int, ...]:
    """A launch's pointers: the operands (:data:`jaxrope.ops.mla_rope_append.mosaic_export.
    MLA_OPERANDS`, ``fixed`` the six before q_pe), then the results': what the kernel
    writes, in operand order (q_pe or the fp8 outputs, and the caches).

    Example:
      >>> launch_pointers(False, (0, 1, 2, 3, 4, 5), 6, 7, 8, (), (9,), ())
      (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 6, 9)
    """
    written = (*cache_ptrs, *out_ptrs) if q_fp8 else (q_ptr, *cache_ptrs)
    return (*fixed, q_ptr, k_ptr, ckv_ptr, *nope_ptrs, *cache_ptrs, *out_ptrs, *written)


class MosaicMlaLauncher:
    """Compiles and launches the Mosaic GPU MLA kernel on torch's current CUDA stream.

    The launcher of ``RopeManager.apply_mla_and_append_kv`` (``rotate_and_append_mla_``).
    Declines (raises :class:`jaxrope.BackendUnavailable`, so the manager runs the JAX
    path) where :class:`torch_bridge.launch.mosaic.MosaicKVLauncher` does: a JAX whose
    Mosaic GPU cannot build or lower the kernel, no CUDA plugin, tensors off CUDA, not
    contiguous or not 32-byte aligned, a GPU before Hopper, a failed export.

    Example:
      >>> launcher = MosaicMlaLauncher()                                  # doctest: +SKIP
      >>> launcher.rotate_and_append_mla_(q_pe, k_pe, ckv, pos_ids, (cache,), slots, cfg,
      ...                                 (1.0, 1.0))                     # doctest: +SKIP
    """

    def __init__(self):
        # A rope launcher of its own (declining as this one does: a JAX that cannot lower
        # Mosaic GPU, no CUDA plugin): its compile cache, angle tables and count table.
        self._rope = MosaicLauncher()
        self._scales = ScaleTables()
        self._launches = LaunchRecords(_MAX_LAUNCHES)

    def _prepare(self, shape: MlaShape, cfg: RopeConfig, scales: Tuple[float, float]):
        rope = self._rope
        capability = _hopper_capability(shape.device)
        tuning = mla_mosaic_tuning(shape.heads, cfg.rotary_dim, shape.dtype.itemsize,
                                   shape.nope_dim)
        # One token a block, a block for each piece of each token of the count's next power
        # of two (a grid override smaller than that walks).
        launch = launch_shape(shape.tokens, 1, len(tuning.pieces), 1)
        export_kwargs = dict(
            heads=shape.heads, kv_lora_rank=shape.kv_lora_rank, dtype=jax_dtype_name(shape.dtype),
            cache_dtype=jax_dtype_name(shape.cache_dtype), num_slots=shape.num_slots,
            combined=shape.combined, tuning=tuning, capacity=launch.capacity,
            grid=shape.grid or launch.grid, nope_dim=shape.nope_dim, q_fp8=shape.q_fp8,
            max_count=launch.max_count, **kernel_options(cfg))
        module = rope.compiled(("mla", capability, *export_kwargs.items()),
                               lambda: mla_export.export_mla(**export_kwargs))
        index = shape.device.index
        if index is None:
            index = torch.cuda.current_device()
        stream = rope._raw_stream
        count_ptr = rope.count_pointer(shape.device, shape.tokens)
        tables_ptr, rows_ptr = rope.table_pointers(cfg, shape.device)
        scales_ptr = self._scales.pointer(scales, shape.device)
        q_fp8 = shape.q_fp8

        def run(q_ptr, k_ptr, ckv_ptr, pos_ptr, slot_ptr, nope_ptrs, cache_ptrs, out_ptrs):
            module(stream(index), *launch_pointers(
                q_fp8, (count_ptr, pos_ptr, slot_ptr, tables_ptr, rows_ptr, scales_ptr),
                q_ptr, k_ptr, ckv_ptr, nope_ptrs, cache_ptrs, out_ptrs))
        return run

    def _record(self, q_pe: torch.Tensor, ckv: torch.Tensor, caches: Sequence[torch.Tensor],
                cfg: RopeConfig, scales: Tuple[float, float], q_nope: Optional[torch.Tensor],
                q_fp8: bool, grid: Optional[int]):
        # The launch of this call's shape: compiled (outside any capture) on its first call.
        pages, page_size = caches[0].shape[:2]
        shape = MlaShape(q_pe.shape[0], q_pe.shape[1], 0 if q_nope is None else q_nope.shape[2],
                         ckv.shape[1], pages * page_size, len(caches) == 1, q_pe.dtype,
                         caches[0].dtype, q_fp8, q_pe.device, grid)
        scales = (float(scales[0]), float(scales[1]))
        key = (shape, cfg, scales)
        record = self._launches.get(key)
        if record is None:
            record = self._launches.make(key, shape.device,
                                         lambda: self._prepare(shape, cfg, scales))
        return record

    def rotate_and_append_mla_(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
                               pos_ids: torch.Tensor, caches: Sequence[torch.Tensor],
                               slots: torch.Tensor, cfg: RopeConfig, scales: Tuple[float, float],
                               q_nope: Optional[torch.Tensor] = None,
                               q_pe_out: Optional[torch.Tensor] = None,
                               q_nope_out: Optional[torch.Tensor] = None,
                               grid: Optional[int] = None) -> None:
        """:func:`jaxrope.apply_mla_rope_and_append` on torch tensors, in one launch.

        ``q_pe [T, H, r]`` rotated in place at ``pos_ids[..., :T]`` (int32 ``[N >= T]``,
        M-RoPE ``[3, N]``), or with ``q_pe_out`` (float8_e4m3fn, q_pe's shape) quantised
        into it by ``scales[0]`` and ``q_nope [T, H, N]`` likewise into ``q_nope_out``,
        q_pe then only read; ``k_pe [T, r]`` rotated and ``ckv [T, L]`` written at
        ``slots`` (``[T]``, any integer dtype; outside ``[0, pages * page_size)``
        skipped) of ``caches``: ``(ckv_cache [P, S, L], kpe_cache [P, S, r])`` or
        ``(cache [P, S, L + r],)``, q_pe's dtype or float8_e4m3fn (scaled by
        ``scales[1]``). ``scales``: ``(q_scale, kv_scale)`` floats. ``grid`` overrides the
        launch's block count (benchmarks sweep it). The caller (the manager) has checked
        devices, the pair's overlap and the scales.

        Raises:
          BackendUnavailable: a tensor off CUDA or not contiguous and 32-byte aligned, a
            GPU before Hopper, a config whose rotary_dim is not its head_dim, or a kernel
            this JAX cannot export.
          ValueError: shapes or dtypes that do not fit together (above).
        """
        if cfg.rotary_dim != cfg.head_dim:
            raise BackendUnavailable(f"the MLA kernel rotates all of q_pe: rotary_dim="
                                     f"{cfg.rotary_dim} must be head_dim={cfg.head_dim}")
        _check(q_pe, k_pe, ckv, caches, cfg, q_nope, q_pe_out, q_nope_out)
        tokens = q_pe.shape[0]
        if tokens == 0:
            return
        if cfg.mrope_section is not None:
            pos_ids = mrope_block(pos_ids, tokens)
        outs = [x for x in (q_pe_out, q_nope_out) if x is not None]
        check_launchable((("q_pe", q_pe), ("k_pe", k_pe), ("ckv", ckv), ("pos_ids", pos_ids),
                          ("slots", slots), *(("q_nope", x) for x in (q_nope,) if x is not None),
                          *zip(("mla_cache",) if len(caches) == 1 else ("ckv_cache", "kpe_cache"),
                               caches), *zip(("q_pe_out", "q_nope_out"), outs)))
        run = self._record(q_pe, ckv, caches, cfg, scales, q_nope, q_pe_out is not None, grid)
        slots = int32_slots(slots, caches[0].shape[0] * caches[0].shape[1])
        run(q_pe.data_ptr(), k_pe.data_ptr(), ckv.data_ptr(), pos_ids.data_ptr(),
            slots.data_ptr(), tuple(x.data_ptr() for x in (q_nope,) if x is not None),
            tuple(c.data_ptr() for c in caches), tuple(x.data_ptr() for x in outs))

    def bind(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
             caches: Sequence[torch.Tensor], slots: torch.Tensor, cfg: RopeConfig,
             scales: Tuple[float, float], q_nope: Optional[torch.Tensor] = None,
             q_pe_out: Optional[torch.Tensor] = None,
             q_nope_out: Optional[torch.Tensor] = None) -> Callable[..., bool]:
        """A launch for every later call shaped as this one (after it launched):
        ``run(q_pe, k_pe, ckv, pos_ids, mla_cache, slots, q_nope, q_pe_out, q_nope_out) ->
        bool`` with the manager's arguments as given (``mla_cache`` the pair or the one
        tensor; q_pe may be ``[T, H * r]``). Per call ``run`` narrows the slots, takes an
        M-RoPE config's ``[3, T]`` block and checks only contiguity, 32-byte alignment and
        that a pair's two caches do not overlap; False (launching nothing) when a check
        fails, so the manager takes its full path."""
        run = self._record(q_pe, ckv, caches, cfg, scales, q_nope, q_pe_out is not None, None)
        combined, num_slots = len(caches) == 1, caches[0].shape[0] * caches[0].shape[1]
        mrope, tokens = cfg.mrope_section is not None, q_pe.shape[0]
        sizes = [c.numel() * c.element_size() for c in caches]

        def bound(q_pe, k_pe, ckv, pos_ids, mla_cache, slots, q_nope, q_pe_out, q_nope_out):
            caches = (mla_cache,) if combined else tuple(mla_cache)
            optional = [x for x in (q_nope, q_pe_out, q_nope_out) if x is not None]
            if mrope:
                pos_ids = mrope_block(pos_ids, tokens)
            slots = int32_slots(slots, num_slots)
            tensors = (q_pe, k_pe, ckv, pos_ids, slots, *caches, *optional)
            pointers = [x.data_ptr() for x in tensors]
            if any(p % ALIGN for p in pointers) or not all(x.is_contiguous() for x in tensors):
                return False
            if not combined:
                (a, b), (size_a, size_b) = pointers[5:7], sizes
                if a < b + size_b and b < a + size_a:
                    return False   # overlapping: the full path refuses the pair
            first = 5 + len(caches)   # q_pe, k_pe, ckv, pos_ids, slots, then the caches
            nopes = tuple(pointers[first:first + 1]) if q_nope is not None else ()
            run(*pointers[:5], nopes, tuple(pointers[5:first]),
                tuple(pointers[first + len(nopes):]))
            return True

        return bound
