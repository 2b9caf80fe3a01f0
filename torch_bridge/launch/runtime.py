"""What every launch of an exported jaxrope kernel from torch shares, Mosaic GPU or Triton.

:mod:`torch_bridge.launch.mosaic` (the Mosaic GPU kernels, Hopper and newer) and
:mod:`torch_bridge.launch.triton` (the Triton-lowered kernels) compile a kernel exported by
the core once and launch it with raw pointers on torch's current stream. What they share
lives here:

- :func:`check_launchable`: what every compiled kernel assumes of its tensors;
- :class:`CountTable`: a device pointer to any token count (the kernels read T from
  memory, so one compiled kernel serves every T);
- :class:`AngleTables`: a config's angle tables on a device, padded to the kernel's lanes;
- :class:`LaunchRecords`: the per-signature launch records, built once (under a lock,
  in the device's context) and bounded;
- :func:`mrope_block` and :func:`int32_slots`: positions and slots as the kernels read them;
- :class:`ScaleTables`, :func:`launch_append`, :func:`bound_append` (over
  :func:`append_operands` and :func:`append_record`): the fused RoPE + KV append's fp8
  scales, its launch and its bound launch, shared by both backends.

Nothing here allocates or compiles inside a launch: the first launch of a signature
builds what it needs, later ones (and CUDA-graph captures of them) only launch. What is
built to be kept (tables, counts, scales) is made by :func:`kept`, outside any CUDA-graph
memory pool.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

from jaxrope.ops.constants import kernel_constants
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable

__all__ = ["ALIGN", "AngleTables", "CountTable", "LaunchRecords", "ScaleTables", "append_operands",
           "append_record", "bound_append", "check_launchable", "int32_slots", "kept",
           "launch_append", "mrope_block"]

# torch implements no comparisons for these (2.13: '"ge_cpu" not implemented for
# 'UInt16''): they are compared in a signed dtype that holds each of their values.
_COMPARED_AS = {torch.uint16: torch.int32, torch.uint32: torch.int64}

# Pallas marks every pointer of the exported kernels tt.divisibility = 32.
ALIGN = 32


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


def kept(make: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``make()``'s CUDA tensor, allocated where it can be kept for good.

    torch.compile's CUDA-graph trees (``mode="reduce-overhead"``) route every allocation
    of the calling thread into the graph's memory pool while they warm a graph up, and
    then refuse to record it (``check_memory_pool``: tensors in the pool not tracked as
    outputs) if a launcher's first call made its tables there. So the tensor is made on a
    thread of its own, whose allocations go to torch's ordinary pool, and that thread's
    stream is synchronised before the caller's stream reads it. Under a CUDA-graph
    capture nothing may synchronise: there ``make()`` runs as called (a capture follows
    a warm-up launch, which made the tables). Not covered: another thread capturing in
    torch's default "global" mode while this one launches first, where the worker's
    allocation or synchronisation is refused; warm a launcher up before capturing
    anywhere. ``make`` names every device it allocates on (the worker does not see the
    caller's ``torch.device`` context).
    """
    if torch.cuda.is_current_stream_capturing():
        return make()
    if device.index is None:  # the caller's current device, not the new thread's
        device = torch.device("cuda", torch.cuda.current_device())

    def made() -> torch.Tensor:
        with torch.cuda.device(device):
            tensor = make()
            torch.cuda.current_stream(device).synchronize()
        return tensor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(made).result()


class CountTable:
    """Device int32 rows ``[n, 8]`` with row ``t`` holding ``t``: a pointer to any count.

    Outgrown tables are kept alive: a captured CUDA graph may still hold their pointers.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.tables = [self._make(1 << 16)]

    def _make(self, size: int) -> torch.Tensor:
        def rows() -> torch.Tensor:
            table = torch.zeros((size, ALIGN // 4), dtype=torch.int32, device=self.device)
            table[:, 0] = torch.arange(size, dtype=torch.int32, device=self.device)
            return table
        return kept(rows, self.device)

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

            def padded() -> torch.Tensor:
                # Staged on the CPU by name: a caller under ``with torch.device("cuda")``
                # (CUDA-graph trees warm up so) would otherwise make it on the GPU, in
                # its own thread's pool, and ``.to(device)`` would return that tensor.
                staged = torch.zeros((3, lanes), dtype=torch.float32, device="cpu")
                staged[:, :host.shape[1]] = torch.from_numpy(host.copy())
                return staged.to(device)
            tables = self._tables[key] = kept(padded, device)
        return tables


class ScaleTables:
    """Per (k scale, v scale, device): the float32 ``[2]`` fp8 scales a fused-append kernel reads.

    Never freed: a captured CUDA graph may hold their pointers.
    """

    def __init__(self):
        self._tables: Dict[Tuple[float, float, torch.device], torch.Tensor] = {}

    def pointer(self, scales: Tuple[float, float], device: torch.device) -> int:
        key = (*scales, device)
        values = self._tables.get(key)
        if values is None:
            values = self._tables[key] = kept(
                lambda: torch.tensor(scales, dtype=torch.float32, device=device), device)
        return values.data_ptr()


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


def mrope_block(pos_ids: torch.Tensor, tokens: int) -> torch.Tensor:
    """The contiguous ``[3, tokens]`` block an M-RoPE kernel of count ``tokens`` reads, from
    ``pos_ids [3, N >= tokens]``: the tensor itself when ``N == tokens``, else a copy of
    its first ``tokens`` columns (never the ``[3, N]`` buffer: its rows sit ``N`` apart)."""
    if pos_ids.shape[-1] == tokens and pos_ids.is_contiguous():
        return pos_ids
    return pos_ids[:, :tokens].contiguous()


def narrowed_in_place(slots: torch.Tensor) -> Optional[torch.Tensor]:
    """``slots`` where :func:`int32_slots` passes them on as they are (int32), else None:
    other widths are narrowed into a new tensor, so their strides never reach a kernel."""
    return slots if slots.dtype == torch.int32 else None


def int32_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """``slots`` as the kernels read them: int32, -1 wherever a slot is outside ``[0, num_slots)``.

    The range is decided at the slots' own width, on the device (torch ops on the current
    stream, no host sync), before the cast: cast first, int64 ``2**32 + 7`` would be
    slot 7. A bound the dtype cannot hold is left out (every uint8 is below 1000). int32
    slots pass as they are: the kernels skip what is outside the cache. The core's twin
    is ``jaxrope.ops.rope_append_kv.api._in_cache``.

    Example:
      >>> int32_slots(torch.tensor([5, -1, 2 ** 32 + 7, -2 ** 32 + 7]), 64).tolist()
      [5, -1, -1, -1]
    """
    if slots.dtype == torch.int32:
        return slots
    if slots.dtype == torch.uint64:
        # Read as int64: values >= 2**63 turn negative, outside the cache as they were.
        slots = slots.view(torch.int64)
    elif slots.dtype in _COMPARED_AS:
        slots = slots.to(_COMPARED_AS[slots.dtype])
    ok = slots >= 0
    if num_slots <= torch.iinfo(slots.dtype).max:
        ok &= slots < num_slots
    return torch.where(ok, torch.where(ok, slots, 0).to(torch.int32), -1)


def append_operands(q, k, v, pos_ids, slots, caches, cfg: RopeConfig,
                    geometry: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(pos_ids, slots)`` as a compiled fused-append kernel reads them (an M-RoPE
    config's ``[3, T]`` block, int32 slots), after checking what it assumes of every
    tensor; ``geometry`` is the call's :class:`torch_bridge.kv_append.CacheGeometry`.

    Raises:
      BackendUnavailable: a tensor off CUDA, not contiguous or not 32-byte aligned.
    """
    if cfg.mrope_section is not None:
        pos_ids = mrope_block(pos_ids, q.shape[0])
    check_launchable((("q", q), ("k", k), ("v", v), ("pos_ids", pos_ids), ("slots", slots),
                   *zip(("kv_cache",) if geometry.combined else ("k_cache", "v_cache"), caches)))
    return pos_ids, int32_slots(slots, geometry.num_slots)


def append_record(records: LaunchRecords, prepare: Callable[..., Any], q: torch.Tensor,
                  cfg: RopeConfig, geometry: Any, scales: Tuple[float, float],
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


def launch_append(records: LaunchRecords, prepare: Callable[..., Any], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                  caches: Sequence[torch.Tensor], slots: torch.Tensor, cfg: RopeConfig,
                  geometry: Any, scales: Tuple[float, float], shape: Any) -> None:
    """A fused-append launcher's ``rotate_and_append_kv_``: check the operands
    (:func:`append_operands`), take the call's record (:func:`append_record`, whose
    ``prepare`` returns ``launch(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cache_ptrs)``)
    and launch it; no tokens, no launch.

    Raises:
      BackendUnavailable: as :func:`append_operands`, or from ``prepare``.
    """
    if q.shape[0] == 0:
        return
    pos_ids, slots = append_operands(q, k, v, pos_ids, slots, caches, cfg, geometry)
    launch = append_record(records, prepare, q, cfg, geometry, scales, shape)
    launch(q.data_ptr(), k.data_ptr(), v.data_ptr(), pos_ids.data_ptr(), slots.data_ptr(),
           tuple(c.data_ptr() for c in caches))


def bound_append(launch: Callable[..., None], geometry: Any, cfg: RopeConfig,
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
