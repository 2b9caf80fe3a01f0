"""The Triton-lowered kernels launched from torch: RoPE and RoPE fused with the paged KV append.

Going through JAX for each layer costs a DLPack import and a jitted dispatch, many times a
kernel of a few microseconds. These kernels are Triton kernels, so this module takes their
Triton IR (:mod:`jaxrope.ops.rope.triton_export`, :mod:`jaxrope.ops.rope_append_kv.triton_export`), compiles it with the installed Triton once per
(head layout, cache geometry, config, dtype, launch shape) and launches it with raw
pointers on torch's current stream: stream-ordered with the surrounding torch work, no
host sync, in place on the engine's tensors, capturable in a ``torch.cuda.CUDAGraph``.

- :class:`TritonLauncher`: ``rotate_`` and ``bind`` of ``RopeManager.apply_qk``;
- :class:`TritonKVLauncher`: ``rotate_and_append_kv_`` and ``bind`` of
  ``RopeManager.apply_qk_and_append_kv`` (the protocols:
  :mod:`torch_bridge.launch.dispatch`);
- :class:`KernelCache` (IR exported and compiled once per key, a declined export
  remembered) and :class:`KernelLaunch` (one compiled kernel bound to a grid, launched
  through Triton's C entry point).

QK-norm and fp8 q: ``rotate_and_append_kv_(..., norm=, q_out=)`` launches the kernel
exported with the norm weights (per head) and an fp8 q output
(:class:`jaxrope.ops.rope_append_kv.triton_export.NormOperands`, part of the kernel's key);
a per-token norm is declined (the JAX path serves it). ``bind`` serves the plain call.

The token count is read by the kernel from a device array, so one compiled kernel serves
every T (:class:`torch_bridge.launch.runtime.CountTable`); the cache geometry (pages, page
size, layout, dtype) is part of the fused kernel, which an engine fixes once. Slots of
another integer dtype (vLLM's int64 ``slot_mapping``) are narrowed to int32 on torch's
stream first (:func:`torch_bridge.launch.runtime.int32_slots`); pass int32 slots to skip
that.

M-RoPE (``cfg.mrope_section``): a kernel exported with the config's sections reads row
``r`` of token ``t`` at ``r * T + t``, so its positions must be one contiguous ``[3, T]``
block (:func:`torch_bridge.launch.runtime.mrope_block`: the plan's ``[3, N]`` buffer itself
when ``N == T``, else a copy of its first ``T`` columns, one small device copy on the same
stream).

CUDA graphs: call once outside capture for every signature (shapes, dtypes, cache,
scales) a graph will hold. That first call exports, compiles and allocates the count,
angle and scale tables; capturing it is not supported. Later calls, captured or not,
only launch.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

from jaxrope.ops.constants import kernel_options
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.ops.rope import triton_export
from jaxrope.ops.rope.tuning import TritonTuning, triton_tuning
from jaxrope.ops.rope_append_kv import triton_export as append_triton_export
from jaxrope.ops.rope_append_kv.triton_export import NormOperands
from jaxrope.ops.rope_append_kv.tuning import AppendTritonTuning, append_triton_tuning
from jaxrope.ops.triton_common import lanes_for
from torch_bridge.dlpack import jax_dtype_name
from torch_bridge.kv_append import CacheGeometry
from torch_bridge.launch.runtime import (ALIGN, AngleTables, CountTable, LaunchRecords,
                                         ScaleTables, append_operands, append_record,
                                         bound_append, check_launchable, launch_append,
                                         mrope_block)

__all__ = ["KernelCache", "KernelLaunch", "TritonKVLauncher", "TritonLauncher", "import_triton"]

# Launch records kept (one per distinct shape, cache, config, scales and device); past this
# the cache starts over rather than grow with every token count an engine ever uses.
_MAX_LAUNCHES = 4096


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


class TritonLauncher:
    """Compiles and launches the Pallas RoPE kernel on torch's current CUDA stream.

    Declines (raises :class:`jaxrope.BackendUnavailable`, so the manager runs the JAX path)
    without Triton, for tensors that are not on a CUDA device, contiguous and 32-byte
    aligned, and when the kernel's Triton IR cannot be exported from the running JAX.

    Example:
      >>> from torch_bridge.launch.dispatch import resolve_launchers
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
            if (q_ptr | k_ptr | pos_ptr) % ALIGN or not (q.is_contiguous() and k.is_contiguous()):
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


class TritonKVLauncher:
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
      >>> launcher = TritonKVLauncher()          # on CUDA, "auto" makes one  # doctest: +SKIP
    """

    # The keywords rotate_and_append_kv_ takes beyond the plain call: a caller offers a
    # normalised or fp8-q call only to a launcher that lists them (others lack them).
    accepts = frozenset({"norm", "q_out"})

    def __init__(self, *, target: Any = None):
        self._kernels = KernelCache("rope_append_kv", target)
        self._tables = AngleTables()
        self._counts: Dict[torch.device, CountTable] = {}
        self._scales = ScaleTables()
        # signature -> launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs)
        self._launches = LaunchRecords(_MAX_LAUNCHES)

    def kernel(self, q_heads: int, dtype: torch.dtype, cfg: RopeConfig, geometry: CacheGeometry,
               block: AppendTritonTuning, norm: NormOperands = NormOperands()
               ) -> Tuple[Any, append_triton_export.AppendKernel]:
        """``(compiled, exported)``: the kernel for this layout (and ``norm``: QK-norm
        weights, fp8 q), exported and compiled once.

        Raises:
          BackendUnavailable: the export failed (for this key it is not tried again).
        """
        return self._kernels.get((q_heads, dtype, cfg, geometry, block, norm), lambda: (
            append_triton_export.export_append_kv(
                q_heads=q_heads, k_heads=geometry.k_heads, head_dim=cfg.head_dim,
                dtype=jax_dtype_name(dtype), cache_shape=geometry.view_shape,
                cache_dtype=jax_dtype_name(geometry.dtype), layout=geometry.layout,
                components=geometry.components, block=block, norm=norm,
                **kernel_options(cfg))))

    def rotate_and_append_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              pos_ids: torch.Tensor, caches: Sequence[torch.Tensor],
                              slots: torch.Tensor, cfg: RopeConfig, geometry: CacheGeometry,
                              scales: Tuple[float, ...],
                              block: Optional[AppendTritonTuning] = None, *,
                              norm: Optional[Tuple[Any, Any, Any]] = None,
                              q_out: Optional[torch.Tensor] = None) -> None:
        """Rotate ``q [T, Hq, D]`` in place at ``pos_ids[:T]``; write k, v into ``caches`` at ``slots``.

        ``k, v [T, Hk, D]``, ``pos_ids`` int32 ``[>= T]`` (M-RoPE: ``[3, N >= T]``, its
        first ``T`` columns copied into one contiguous block when ``N > T``:
        :func:`torch_bridge.launch.runtime.mrope_block`), ``caches`` the engine's tensors
        (a ``(k_cache, v_cache)`` pair or the combined tensor alone), ``slots`` ``[T]`` of
        any integer dtype, ``geometry`` and ``scales`` as
        :func:`torch_bridge.kv_append.check_call` returns them: the caller has validated
        shapes, dtypes and devices; this checks only what the compiled kernel assumes.
        ``block`` overrides the launch-shape heuristic (benchmarks sweep it).

        ``norm``: ``(q_norm_weight, k_norm_weight, qk_norm)`` as
        :func:`torch_bridge.kv_append.check_norm` returns it (weights ``[D]``, either
        None), q and k normalised per head in the kernel before the rotation. ``q_out``: a
        float8_e4m3fn tensor shaped like q, written with ``e4m3(clip(rot(q) * scales[2],
        -448, 448))`` of every dim, q then left unchanged; ``scales`` is ``(k_scale,
        v_scale, q_scale)`` with it.

        Raises:
          BackendUnavailable: a tensor off CUDA or breaking the kernel's layout
            assumptions (contiguous, 32-byte aligned), a per-token norm (the kernel
            normalises per head), or an export that fails.
          ValueError: ``q_out`` not float8_e4m3fn shaped like q, or without a q scale.
        """
        extras = _norm_operands(q, norm, q_out, scales)
        if extras == NormOperands():
            launch_append(self._launches, self._prepare, q, k, v, pos_ids, caches, slots, cfg,
                          geometry, scales, (block, extras))
            return
        if q.shape[0] == 0:
            return
        pos_ids, slots = append_operands(q, k, v, pos_ids, slots, caches, cfg, geometry)
        weights = tuple(w for w in norm[:2] if w is not None) if norm else ()
        outputs = () if q_out is None else (("q_out", q_out),)
        check_launchable((*(("norm weight", w) for w in weights), *outputs))
        launch = append_record(self._launches, self._prepare, q, cfg, geometry, scales,
                               (block, extras))
        launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), pos_ids.data_ptr(), slots.data_ptr(),
               tuple(c.data_ptr() for c in caches), tuple(w.data_ptr() for w in weights),
               None if q_out is None else q_out.data_ptr())

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
        return bound_append(append_record(self._launches, self._prepare, q, cfg, geometry,
                                          scales, (None, NormOperands())), geometry, cfg, caches)

    def _prepare(self, tokens: int, q_heads: int, dtype: torch.dtype, device: torch.device,
                 cfg: RopeConfig, geometry: CacheGeometry, scales: Tuple[float, ...],
                 shape: Tuple[Optional[AppendTritonTuning], NormOperands]) -> Callable[..., None]:
        # shape: the launch-shape override (or None) and the kernel's norm and q operands.
        block, norm = shape
        lanes = lanes_for(cfg.rotary_dim)
        block = block or append_triton_tuning(tokens, q_heads, geometry.k_heads, lanes)
        compiled, exported = self.kernel(q_heads, dtype, cfg, geometry, block, norm)
        kernel = KernelLaunch(compiled, exported.grid(tokens), device)
        counts = self._counts.get(device)
        if counts is None:
            counts = self._counts[device] = CountTable(device)
        count_ptr = counts.pointer(tokens)
        tables_ptr = self._tables.get(cfg, device, lanes).data_ptr()
        scales_ptr = self._scales.pointer(scales, device)

        def launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs, weight_ptrs=(),
                   q_out_ptr=None):
            # q_out aliases q unless the kernel writes a new fp8 q.
            kernel(count_ptr, pos_ptr, slot_ptr, tables_ptr, scales_ptr, q_ptr, k_ptr, v_ptr,
                   *weight_ptrs, *cache_ptrs, q_ptr if q_out_ptr is None else q_out_ptr,
                   *cache_ptrs)
        return launch


def _norm_operands(q: torch.Tensor, norm: Optional[Tuple[Any, Any, Any]],
                   q_out: Optional[torch.Tensor], scales: Tuple[float, ...]) -> NormOperands:
    """The kernel's norm and q operands for a call (:class:`NormOperands`).

    Raises:
      BackendUnavailable: a per-token norm (a program holds a subset of a token's heads).
      ValueError: ``q_out`` not float8_e4m3fn shaped like q, or ``scales`` without a q scale.
    """
    if q_out is not None:
        if q_out.dtype != torch.float8_e4m3fn or q_out.numel() != q.numel() or (
                q_out.shape[0] != q.shape[0]):
            raise ValueError(f"q_out ({tuple(q_out.shape)}, {q_out.dtype}) must be "
                             f"torch.float8_e4m3fn shaped like q ({tuple(q.shape)})")
        if len(scales) != 3:
            raise ValueError(f"scales={scales!r} must be (k_scale, v_scale, q_scale) with q_out")
    if norm is None:
        return NormOperands(fp8_q=q_out is not None)
    q_w, k_w, qk_norm = norm
    if not qk_norm.per_head:
        raise BackendUnavailable("the Triton append kernel normalises per head only: a "
                                 "per-token norm (qk_norm.per_head=False) takes the JAX path")
    return NormOperands(*(None if w is None else jax_dtype_name(w.dtype) for w in (q_w, k_w)),
                        qk_norm=qk_norm, fp8_q=q_out is not None)
