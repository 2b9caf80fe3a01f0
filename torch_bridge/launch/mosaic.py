"""The Mosaic GPU kernels launched from torch on Hopper: RoPE, and RoPE fused with the KV append.

The Mosaic GPU kernel (:mod:`jaxrope.ops.rope.mosaic`) is exported as a Mosaic module
(:mod:`jaxrope.ops.rope.mosaic_export`: lowered for CUDA, no JAX dispatch), compiled
once per (head layout, config, dtype, launch shape) by the CUDA plugin's
``MosaicGpuCompile`` (what ``plgpu.as_torch_kernel`` uses), and launched through the host
function that returns, with torch's current raw stream and raw pointers: stream-ordered
with the surrounding torch work, no host sync, capturable in a ``torch.cuda.CUDAGraph``.

The kernel reads the token count from device memory (a
:class:`~torch_bridge.launch.runtime.CountTable` pointer) and its fixed grid covers the
launch shape's largest count, so one compiled kernel serves every T of its launch shape:
token blocks up to a power of two, each split among blocks by head group, one block a
split (blocks past the count exit), ``capacity`` the tokens its refs are declared with
(:func:`launch_shape`). The fused append's shape is the same with one token a block,
split among blocks by piece (:func:`jaxrope.ops.rope_append_kv.tuning.pieces`).

Launch before capturing a CUDA graph at least once per shape: compiling inside a
capture is not supported. M-RoPE positions are one contiguous ``[3, T]`` block, as for
the Triton launcher (:func:`torch_bridge.launch.runtime.mrope_block`).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from jaxrope.ops.constants import kernel_options
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.qk_norm import QKNorm, per_token_norm
from jaxrope.ops import mosaic_common
from jaxrope.ops.mosaic_common import MosaicModule, slot_row_table
from jaxrope.ops.rope import mosaic_export
from jaxrope.ops.rope.tuning import head_splits, mosaic_tuning
from jaxrope.ops.rope_append_kv import mosaic as append_mosaic
from jaxrope.ops.rope_append_kv import mosaic_export as append_export
from jaxrope.ops.rope_append_kv.cache_layout import cache_rows
from jaxrope.ops.rope_append_kv.tuning import append_mosaic_tuning
from torch_bridge.dlpack import jax_dtype_name
from torch_bridge.kv_append import CacheGeometry, Norm
from torch_bridge.launch.runtime import (ALIGN, AngleTables, CountTable, LaunchRecords,
                                         ScaleTables, append_operands, append_record,
                                         bound_append, check_launchable, kept, launch_append,
                                         mrope_block)

__all__ = ["AppendOptions", "LaunchShape", "MosaicKVLauncher", "MosaicLauncher", "launch_shape"]

# Tokens the refs are declared with at least (the kernel never reads past the count).
_MIN_CAPACITY = 1 << 16
_MAX_LAUNCHES = 4096
# The host function MosaicGpuCompile returns: (kernel, stream, void** buffers). The
# buffers go as the bytes of their packed 64-bit pointers (c_char_p passes the bytes
# object's own storage, read during the call): cheaper than filling a ctypes array of
# c_void_p, which every launch would pay (bench.bridge_paired --measure apply_qk_host).
_LAUNCH = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)


class LaunchShape(NamedTuple):
    """What one compiled launch serves (:func:`launch_shape`)."""

    grid: int       # blocks
    splits: int     # blocks sharing a token block's head groups
    capacity: int   # tokens the kernel's refs are declared with
    min_count: int  # the fewest and most tokens a count of this shape has
    max_count: int


def launch_shape(tokens: int, tokens_per_block: int, groups: int,
                 block_groups: int) -> LaunchShape:
    """The launch serving ``tokens``: the token blocks' next power of two (``max_count``
    tokens; ``min_count`` is one past half of them, or 1), each split among ``splits``
    blocks by head group (:func:`jaxrope.ops.rope.tuning.head_splits`: at most
    ``block_groups`` of the ``groups`` a block, more splits when few tokens would leave
    SMs idle), a block for each; refs of the tokens' next power of two, at least 2**16.
    Every T of one launch shape runs the same compiled kernel; the bounds let it leave
    out the path for counts under a block.

    Example:
      >>> tuple(launch_shape(64, 16, 10, 2)), tuple(launch_shape(16384, 16, 10, 2))
      ((40, 10, 65536, 33, 64), (5120, 5, 65536, 8193, 16384))
    """
    blocks = 1 << (max(1, -(-tokens // tokens_per_block)) - 1).bit_length()
    splits = head_splits(blocks, groups, block_groups)
    return LaunchShape(blocks * splits, splits,
                       max(_MIN_CAPACITY, 1 << max(0, tokens - 1).bit_length()),
                       blocks // 2 * tokens_per_block + 1, blocks * tokens_per_block)


def _mosaic_compiler():
    # MosaicGpuCompile / MosaicGpuUnload live in the JAX CUDA plugin's library.
    try:
        try:
            import jax_plugins.xla_cuda13 as plugin
        except ImportError:
            import jax_plugins.xla_cuda12 as plugin
        dll = ctypes.CDLL(plugin._get_library_path())
        compile_fn = dll.MosaicGpuCompile
    except (ImportError, OSError, AttributeError) as e:
        raise BackendUnavailable(f"the JAX CUDA plugin with MosaicGpuCompile is not "
                                 f"importable: {e}") from e
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    return compile_fn


def _hopper_capability(device: torch.device) -> Tuple[int, int]:
    capability = torch.cuda.get_device_capability(device)
    if capability[0] < 9:
        raise BackendUnavailable(f"Mosaic GPU needs compute capability 9.0 (Hopper) or "
                                 f"newer, {device} has {capability[0]}.{capability[1]}")
    return capability


class CompiledModule:
    """One Mosaic module compiled for the current device: ``launch(stream, pointers)``.

    Never unloaded: a captured CUDA graph may still launch it.
    """

    def __init__(self, exported: MosaicModule, compile_fn):
        compiled = compile_fn(exported.module, len(exported.module))
        if not compiled:
            raise BackendUnavailable("MosaicGpuCompile failed on the exported kernel")
        self._compiled = compiled  # the pair below lives as long as this pointer
        self._function = compiled[0]
        self._launch = _LAUNCH(compiled[1])

    def __call__(self, stream: int, *pointers: int) -> None:
        self._launch(self._function, stream, _pointers(len(pointers)).pack(*pointers))


@functools.lru_cache(maxsize=None)
def _pointers(count: int) -> struct.Struct:
    # ``count`` native 64-bit pointers, as the host function reads its buffers.
    return struct.Struct(f"={count}Q")


class MosaicLauncher:
    """Compiles and launches the Mosaic GPU RoPE kernel on torch's current CUDA stream.

    A :class:`torch_bridge.launch.dispatch.Launcher` (``rotate_`` and ``bind``). Declines
    (raises :class:`jaxrope.BackendUnavailable`, so the manager runs the JAX path) off CUDA, before Hopper, with a JAX whose Mosaic GPU cannot build or
    lower the kernel, and for tensors that are not contiguous and 32-byte aligned.

    Example:
      >>> launcher = MosaicLauncher()               # doctest: +SKIP
      >>> launcher.rotate_(q, k, pos_ids, cfg)      # q, k rotated in place  # doctest: +SKIP
    """

    def __init__(self):
        reason = mosaic_common.lowering_unavailable()
        if reason:
            raise BackendUnavailable(reason)
        self._compile_fn = _mosaic_compiler()
        self._modules: Dict[Tuple, Any] = {}
        self._lock = threading.Lock()
        self._tables = AngleTables()
        self._rows: Dict[Tuple[RopeConfig, torch.device], torch.Tensor] = {}
        self._counts: Dict[torch.device, CountTable] = {}
        # signature -> (compiled module, count table, tables pointer, rows pointer)
        self._launches = LaunchRecords(_MAX_LAUNCHES)
        self._raw_stream = torch._C._cuda_getCurrentRawStream

    def compiled(self, key: Tuple, export: Callable[[], MosaicModule]):
        """The module ``export()`` returns, compiled once per ``key`` (a declined export is
        remembered)."""
        with self._lock:
            module = self._modules.get(key)
            if isinstance(module, BackendUnavailable):
                raise module  # declined before: do not export again on every call
            if module is None:
                try:
                    module = CompiledModule(export(), self._compile_fn)
                except BackendUnavailable as e:
                    self._modules[key] = e
                    raise
                self._modules[key] = module
            return module

    def _prepare(self, tokens: int, q_heads: int, k_heads: int, dtype: torch.dtype,
                 device: torch.device, cfg: RopeConfig, grid: Optional[int]):
        capability = _hopper_capability(device)
        half = cfg.rotary_dim // 2
        itemsize = dtype.itemsize
        tuning = mosaic_tuning(q_heads, k_heads, half, cfg.head_dim, itemsize, cfg.interleave)
        groups = q_heads // tuning.q_group + k_heads // tuning.k_group
        shape = launch_shape(tokens, tuning.tokens_per_block, groups, tuning.block_groups)
        export_kwargs = dict(q_heads=q_heads, k_heads=k_heads, head_dim=cfg.head_dim,
                             dtype=jax_dtype_name(dtype), tuning=tuning, capacity=shape.capacity,
                             grid=grid or shape.grid, splits=shape.splits,
                             min_count=shape.min_count, max_count=shape.max_count,
                             **kernel_options(cfg))
        # Keyed by everything the module is exported from and the device's architecture
        # (the module targets it); the frequencies are run-time tables, keyed by cfg.
        module = self.compiled((capability, *export_kwargs.items()),
                               lambda: mosaic_export.export(**export_kwargs))
        tables_ptr, rows_ptr = self.table_pointers(cfg, device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        return module, self.count_pointer(device, tokens), tables_ptr, rows_ptr, index

    def table_pointers(self, cfg: RopeConfig, device: torch.device) -> Tuple[int, int]:
        """Device pointers of ``cfg``'s angle tables ``[3, R/2]`` and slot rows ``[R/2]``
        (:func:`jaxrope.ops.mosaic_common.slot_row_table`), made once, kept for good (a
        captured graph may hold them)."""
        half = cfg.rotary_dim // 2
        rows = self._rows.get((cfg, device))
        if rows is None:
            host = slot_row_table(half, cfg.mrope_section, cfg.mrope_interleaved)
            rows = self._rows[(cfg, device)] = kept(
                lambda: torch.from_numpy(host.copy()).to(device), device)
        return self._tables.get(cfg, device, half).data_ptr(), rows.data_ptr()

    def count_pointer(self, device: torch.device, tokens: int) -> int:
        """A device pointer to the int32 ``tokens`` (:class:`CountTable`)."""
        counts = self._counts.get(device)
        if counts is None:
            counts = self._counts[device] = CountTable(device)
        return counts.pointer(tokens)

    def _launch_for(self, q: torch.Tensor, k: torch.Tensor, cfg: RopeConfig,
                    grid: Optional[int]):
        head_dim = cfg.head_dim
        tokens = q.shape[0]
        q_heads = q.numel() // max(1, tokens * head_dim)
        k_heads = k.numel() // max(1, k.shape[0] * head_dim)
        # Everything but the pointers of q, k and the positions is fixed by this key, so a
        # repeated shape costs one dict lookup before the launch.
        key = (tokens, q_heads, k_heads, q.dtype, q.device, cfg, grid)
        record = self._launches.get(key)
        if record is None:
            record = self._launches.make(key, q.device, lambda: self._prepare(
                tokens, q_heads, k_heads, q.dtype, q.device, cfg, grid))
        return record

    def _run(self, record, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> None:
        module, count_ptr, tables_ptr, rows_ptr, index = record
        q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
        module(self._raw_stream(index), count_ptr, pos_ids.data_ptr(), tables_ptr, rows_ptr,
               q_ptr, k_ptr, q_ptr, k_ptr)

    def bind(self, q: torch.Tensor, k: torch.Tensor, cfg: RopeConfig) -> Callable[..., bool]:
        """A launch for every later call with q and k shaped as these: ``run(q, k, pos_ids) -> bool``.

        ``q``/``k`` may be ``[T, H, D]`` or ``[T, H * D]``; per call ``run`` checks only
        contiguity and 32-byte alignment and returns False (launching nothing) when they
        fail.
        """
        record = self._launch_for(q, k, cfg, None)
        mrope = cfg.mrope_section is not None

        def run(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor) -> bool:
            if mrope:
                pos_ids = mrope_block(pos_ids, q.shape[0])
            if ((q.data_ptr() | k.data_ptr() | pos_ids.data_ptr()) % ALIGN
                    or not (q.is_contiguous() and k.is_contiguous())):
                return False
            self._run(record, q, k, pos_ids)
            return True

        return run

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                cfg: RopeConfig, grid: Optional[int] = None) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place at ``pos_ids[:T]``.

        The caller has validated shapes, dtypes and devices; this checks only what the
        compiled kernel assumes (contiguity and 32-byte alignment). ``grid`` overrides
        :func:`launch_shape`'s block count (benchmarks sweep it).

        Raises:
          BackendUnavailable: a tensor off CUDA or breaking the kernel's layout
            assumptions, a GPU before Hopper, or a kernel this JAX cannot export.
        """
        if q.shape[0] == 0:
            return
        if cfg.mrope_section is not None:
            pos_ids = mrope_block(pos_ids, q.shape[0])
        check_launchable((("q", q), ("k", k), ("pos_ids", pos_ids)))
        self._run(self._launch_for(q, k, cfg, grid), q, k, pos_ids)


class AppendOptions(NamedTuple):
    """What a fused-append launch compiles beyond its shapes: the launch's block count
    override (None: :func:`launch_shape`'s), the per-head norm (its :class:`jaxrope.QKNorm`
    and the dtype name of each weight passed, None for none) and whether q goes to an fp8
    ``q_out``; part of the launch record's key."""

    grid: Optional[int] = None
    qk_norm: Optional[QKNorm] = None
    q_weight_dtype: Optional[str] = None
    k_weight_dtype: Optional[str] = None
    q_fp8: bool = False


def _append_options(grid: Optional[int], norm: Optional[Norm],
                    q_out: Optional[torch.Tensor]) -> AppendOptions:
    q_w, k_w, qk_norm = norm or (None, None, None)
    return AppendOptions(grid, qk_norm, *(None if w is None else jax_dtype_name(w.dtype)
                                          for w in (q_w, k_w)), q_out is not None)


class MosaicKVLauncher:
    """Compiles and launches the Mosaic GPU fused RoPE + paged KV append
    (:mod:`jaxrope.ops.rope_append_kv.mosaic`) on torch's current CUDA stream.

    A :class:`torch_bridge.launch.dispatch.KVLauncher` (``rotate_and_append_kv_`` and
    ``bind``): one compile per (head layout, cache
    geometry, config, dtype, launch shape), the token count read at run time, slots
    narrowed to int32 on torch's stream. Declines as :class:`MosaicLauncher` does, and
    for tensors off CUDA, not contiguous or not 32-byte aligned.
    """

    def __init__(self):
        reason = mosaic_common.lowering_unavailable()
        if reason:
            raise BackendUnavailable(reason)
        # A rope launcher of its own: its compile cache, angle tables and count table.
        self._rope = MosaicLauncher()
        self._scales = ScaleTables()
        # signature -> launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs)
        self._launches = LaunchRecords(_MAX_LAUNCHES)

    def _prepare(self, tokens: int, q_heads: int, dtype: torch.dtype, device: torch.device,
                 cfg: RopeConfig, geometry: CacheGeometry, scales: Tuple[float, ...],
                 options: AppendOptions):
        grid = options.grid
        rope = self._rope
        capability = _hopper_capability(device)
        # One token a block, a block for each piece of each token of the count's next
        # power of two (a grid override smaller than that walks).
        # A norm or an fp8 q reads every dim of q (build_append's default tuning).
        reads_q = options.q_fp8 or options.q_weight_dtype is not None
        tuning = append_mosaic_tuning(q_heads, geometry.k_heads, cfg.head_dim, cfg.rotary_dim,
                                      dtype.itemsize, q_width=cfg.head_dim if reads_q else None)
        shape = launch_shape(tokens, tuning.tokens_per_block, len(tuning.pieces), 1)
        rows = cache_rows(geometry.layout, geometry.combined,
                          geometry.view_shape[0] // geometry.components,
                          geometry.page_size, geometry.k_heads)
        export_kwargs = dict(q_heads=q_heads, k_heads=geometry.k_heads, head_dim=cfg.head_dim,
                             dtype=jax_dtype_name(dtype), tuning=tuning,
                             cache_dtype=jax_dtype_name(geometry.dtype), rows=rows,
                             components=1 if geometry.combined else 2, capacity=shape.capacity,
                             grid=grid or shape.grid, max_count=shape.max_count,
                             qk_norm=options.qk_norm, q_weight_dtype=options.q_weight_dtype,
                             k_weight_dtype=options.k_weight_dtype,
                             q_dtype="float8_e4m3fn" if options.q_fp8 else None,
                             **kernel_options(cfg))
        module = rope.compiled(("append", capability, *export_kwargs.items()),
                               lambda: append_export.export_append(**export_kwargs))
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = rope._raw_stream
        count_ptr = rope.count_pointer(device, tokens)
        tables_ptr, rows_ptr = rope.table_pointers(cfg, device)
        scales_ptr = self._scales.pointer(scales, device)

        q_fp8 = options.q_fp8

        def launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs, weight_ptrs=(),
                   q_out_ptr=None):
            # The operands (append_export.APPEND_OPERANDS), then the results' pointers:
            # what the kernel writes, in operand order (q or q_out, and the caches).
            written = (*cache_ptrs, q_out_ptr) if q_fp8 else (*cache_ptrs,)
            module(stream(index), count_ptr, pos_ptr, slot_ptr, tables_ptr, rows_ptr, scales_ptr,
                   q_ptr, k_ptr, v_ptr, *weight_ptrs, *written,
                   *(written if q_fp8 else (q_ptr, *cache_ptrs)))
        return launch

    def rotate_and_append_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              pos_ids: torch.Tensor, caches: Sequence[torch.Tensor],
                              slots: torch.Tensor, cfg: RopeConfig, geometry: CacheGeometry,
                              scales: Tuple[float, ...], grid: Optional[int] = None, *,
                              norm: Optional[Norm] = None,
                              q_out: Optional[torch.Tensor] = None) -> None:
        """:class:`torch_bridge.launch.dispatch.KVLauncher`'s method, launching this kernel;
        ``grid`` overrides the launch's block count (benchmarks sweep it).

        ``norm``: ``(q_norm_weight, k_norm_weight, qk_norm)`` as
        :func:`torch_bridge.kv_append.check_norm` returns it (per head; weights ``[D]``),
        normalised in the kernel. ``q_out``: a float8_e4m3fn ``[T, Hq, D]`` tensor that
        receives q rotated (normalised) and quantized by ``scales[2]`` (``scales`` then
        ``(k_scale, v_scale, q_scale)``), q left as it is.

        Raises:
          BackendUnavailable: a tensor off CUDA or breaking the kernel's layout
            assumptions, a GPU before Hopper, a kernel this JAX cannot export, or a norm
            with ``qk_norm.per_head`` False (the JAX path normalises those).
          ValueError: a norm weight not ``[D]``, a ``q_out`` not float8_e4m3fn shaped
            like q, or ``q_out`` without three scales.
        """
        if norm is None and q_out is None:
            launch_append(self._launches, self._prepare, q, k, v, pos_ids, caches, slots, cfg,
                          geometry, scales, AppendOptions(grid))
            return
        if norm is not None and not norm[2].per_head:
            raise BackendUnavailable(per_token_norm("mosaic"))
        weights = [w for w in (norm or (None, None))[:2] if w is not None]
        # What the kernel reads and writes past the checks the manager made: a wrong size
        # here would read or write past a buffer.
        if any(w.numel() != cfg.head_dim for w in weights):
            raise ValueError(f"norm weights must be [{cfg.head_dim}] (per head), got "
                             f"{[tuple(w.shape) for w in weights]}")
        if q_out is not None and (q_out.dtype != torch.float8_e4m3fn or q_out.shape != q.shape
                                  or len(scales) != 3):
            raise ValueError(f"q_out ({q_out.dtype}, {tuple(q_out.shape)}) must be "
                             f"float8_e4m3fn shaped like q {tuple(q.shape)}, with scales "
                             f"(k, v, q), got {scales}")
        if q.shape[0] == 0:
            return
        check_launchable([*(("norm weight", w) for w in weights),
                          *([("q_out", q_out)] if q_out is not None else [])])
        pos_ids, slots = append_operands(q, k, v, pos_ids, slots, caches, cfg, geometry)
        launch = append_record(self._launches, self._prepare, q, cfg, geometry, tuple(scales),
                               _append_options(grid, norm, q_out))
        launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), pos_ids.data_ptr(), slots.data_ptr(),
               tuple(c.data_ptr() for c in caches), tuple(w.data_ptr() for w in weights),
               None if q_out is None else q_out.data_ptr())

    def bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             caches: Sequence[torch.Tensor], slots: torch.Tensor, cfg: RopeConfig,
             geometry: CacheGeometry, scales: Tuple[float, float]) -> Callable[..., bool]:
        """:class:`torch_bridge.launch.dispatch.KVLauncher`'s ``bind``: per call ``run`` checks
        only contiguity, 32-byte alignment and that a pair's two tensors do not overlap
        (:func:`torch_bridge.launch.runtime.bound_append`). For calls without a norm or a
        ``q_out`` (a bound ``run`` takes neither)."""
        return bound_append(append_record(self._launches, self._prepare, q, cfg, geometry,
                                          scales, AppendOptions()), geometry, cfg, caches)
