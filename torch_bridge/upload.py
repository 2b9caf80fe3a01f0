"""Position ids from the host to the device: one copy per step, on torch's current stream.

The counters live on the host (:mod:`torch_bridge.streams`), so a step's positions are
computed there and must reach the device before the kernels that read them. On CUDA
they go through a pinned *ring*: the host writes a step's positions into the next free
span of a page-locked buffer and enqueues one non-blocking copy on torch's current
stream, so the copy is ordered after the work already queued there and before
whatever is queued next (the rotation), with no host sync. This is how vLLM's v1 model
runner feeds positions.

The ring is cut into ``_RING_SLOTS`` equal parts. When the write position leaves a part
an event is recorded on the streams that copied from it; before the host writes into a
part again (a full lap later) it waits for that event, so a copy still in flight is
never overwritten. A lap is 4 MiB of positions, so that wait is normally long
satisfied.

A step's positions are computed straight into their ring span (:meth:`PositionUpload.stage`),
and the copy lands in fresh device memory: consecutive spans of a 4 MiB *chunk*
(:class:`DeviceChunks`), so a step costs no allocation, and a returned tensor keeps its
chunk alive like any view (memory is never reused under a tensor the engine still
holds). The copy is one ``cuMemcpyHtoDAsync`` through the CUDA driver on torch's
current raw stream; where that entry point is missing or refuses (no driver library,
another device current on the thread) it is torch's non-blocking ``copy_``, with the
same ordering. Staging in the pinned span and copying into a chunk saves a step an
allocation and a host copy against a separate ring write, ``torch.empty`` and torch's
``copy_`` (bench/bridge_bench.py times both).

CUDA-graph buffers (static per (graph slot, plan label), ``[bucket.num_tokens]``, or
``[3, bucket.num_tokens]`` for an M-RoPE manager) are written by the same copy; tokens
past the live count keep their old values. A copy from pinned memory cannot be
captured into a CUDA graph (a replay would re-read a span the host has since reused),
so :meth:`PositionUpload.check_not_capturing` refuses a plan under capture: plan
outside the capture into a graph slot's buffer, and the replay reads it.

Off CUDA a step's positions are a fresh numpy array wrapped by ``torch.from_numpy``.

M-RoPE positions (``[3, n]``: t, h, w rows) travel the same way, each plan label's block
contiguous (row ``r`` of token ``t`` at ``r * n + t``, what the kernel reads).

Example:
  >>> import numpy as np, torch
  >>> upload = PositionUpload(torch.device("cpu"))
  >>> upload.to_device(np.array([3, 4, 5], np.int32)).tolist()
  [3, 4, 5]
  >>> buffer = torch.full((5,), -1, dtype=torch.int32)
  >>> upload.to_device(np.array([7, 8], np.int32), into=buffer).tolist()
  [7, 8, -1, -1, -1]
  >>> upload.to_device(np.array([[1, 2], [3, 4], [5, 6]], np.int32)).tolist()
  [[1, 2], [3, 4], [5, 6]]
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from torch_bridge.engine_types import GraphSlot

__all__ = ["DeviceChunks", "PositionUpload", "RingCursor"]

_RING_INTS = 1 << 20
_RING_SLOTS = 8
# A device chunk holds a whole ring (a span is at most a ring part): every span fits one.
_CHUNK_INTS = _RING_INTS
# Every device tensor handed out starts a multiple of 256 bytes into its memory, as a fresh
# allocation would (the exported kernels assume 32, XLA's DLPack import 16).
_ALIGN = 64


class RingCursor:
    """Where the next span of a ring of ``parts`` equal parts goes (the ring's arithmetic).

    A span never straddles two parts. :meth:`take` returns the span's start and, when
    the span opens a new part, that part's index (its previous lap's copies must have
    completed before it is written).

    Example:
      >>> cursor = RingCursor(size=8, parts=2)   # parts [0, 4) and [4, 8)
      >>> [cursor.take(n) for n in (3, 1, 2, 4, 5)]
      [(0, None), (3, None), (4, 1), (0, 0), (None, None)]
    """

    def __init__(self, size: int, parts: int):
        self.part_size, self.parts = size // parts, parts
        self.part, self.offset = 0, 0

    def take(self, n: int) -> Tuple[Optional[int], Optional[int]]:
        """``(start, entered part or None)`` of a span of ``n``; ``(None, None)`` when ``n``
        is larger than a part."""
        if n > self.part_size:
            return None, None
        entered = None
        if self.offset + n > (self.part + 1) * self.part_size:
            self.part = (self.part + 1) % self.parts
            self.offset = self.part * self.part_size
            entered = self.part
        start = self.offset
        self.offset += n
        return start, entered


class DeviceChunks:
    """Fresh memory for small tensors without an allocation each: consecutive spans of one
    ``size``-element chunk, each starting at a multiple of ``align``; a full chunk is let go
    (torch frees it with its last view) and the next span opens a new one.

    ``alloc(size)`` makes a chunk (``torch.empty`` on the device), ``on_stream(chunk)`` is
    called for each stream a chunk's spans are taken on, to tell torch's allocator
    (``record_stream``) before the chunk is freed.

    Example:
      >>> chunks = DeviceChunks(lambda n: torch.zeros(n, dtype=torch.int32), size=8, align=4)
      >>> [(c is chunks.chunk, start) for c, start in (chunks.take(3), chunks.take(2))]
      [(True, 0), (True, 4)]
      >>> first = chunks.chunk
      >>> chunk, start = chunks.take(3); chunk is first, start   # 3 more do not fit
      (False, 0)
      >>> chunks.take(9)   # larger than a chunk
      (None, None)
    """

    def __init__(self, alloc: Callable[[int], torch.Tensor], size: int = _CHUNK_INTS,
                 on_stream: Optional[Callable[[torch.Tensor], None]] = None, align: int = _ALIGN):
        self._alloc, self.size, self._on_stream, self.align = alloc, size, on_stream, align
        self.chunk: Optional[torch.Tensor] = None
        self.pointer = 0  # the chunk's data_ptr()
        self._offset = size
        self._streams: set = set()

    def take(self, n: int, stream: int = 0) -> Tuple[Optional[torch.Tensor], Optional[int]]:
        """``(chunk, start)`` of ``n`` fresh elements on raw stream ``stream``; ``(None, None)``
        when ``n`` is larger than a chunk."""
        if n > self.size:
            return None, None
        start = -(-self._offset // self.align) * self.align
        if start + n > self.size:
            self.chunk, start, self._streams = self._alloc(self.size), 0, set()
            self.pointer = self.chunk.data_ptr()
        if stream not in self._streams:
            self._streams.add(stream)
            if self._on_stream is not None and len(self._streams) > 1:
                self._on_stream(self.chunk)  # another stream than the one it came from
        self._offset = start + n
        return self.chunk, start


def _driver_copy() -> Optional[Callable[..., int]]:
    """``cuMemcpyHtoDAsync(dst, src, bytes, stream) -> CUresult`` of the CUDA driver, or None."""
    try:
        copy = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    except (OSError, AttributeError):
        return None
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = ctypes.c_int
    return copy


class _PinnedRing:
    """A page-locked int32 ring, a part reused only after its earlier copies completed,
    and the device chunks its copies land in."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tensor = torch.empty((_RING_INTS,), dtype=torch.int32, pin_memory=True)
        self.host = self.tensor.numpy()
        self.cursor = RingCursor(_RING_INTS, _RING_SLOTS)
        # Per part: the events recorded when the write position left it last.
        self.done: List[List[torch.cuda.Event]] = [[] for _ in range(_RING_SLOTS)]
        # The streams that copied from the current part, by raw handle. Kept as torch's
        # own stream objects: torch.cuda.ExternalStream(0), the legacy default stream's
        # handle, would be a fresh stream from torch's pool, and an event recorded there
        # completes at once (the first ring reused parts still being copied from).
        self.streams: Dict[int, torch.cuda.Stream] = {}
        self.chunks = DeviceChunks(
            lambda n: torch.empty((n,), dtype=torch.int32, device=device),
            on_stream=lambda chunk: chunk.record_stream(torch.cuda.current_stream(device)))
        self._copy = _driver_copy()
        self._host_ptr, self._index = self.tensor.data_ptr(), device.index

    def span(self, n: int, stream: int) -> Optional[int]:
        """Start of a pinned ``[n]`` span to write and copy from on raw stream ``stream``
        (torch's current stream); None if ``n`` exceeds a part."""
        left = self.cursor.part
        start, entered = self.cursor.take(n)
        if start is None:
            return None
        if entered is not None:
            events = []
            for copied_on in self.streams.values():
                event = torch.cuda.Event()
                event.record(copied_on)
                events.append(event)
            self.done[left], self.streams = events, {}
            for event in self.done[entered]:
                event.synchronize()  # a lap ago: normally complete long since
            self.done[entered] = []
        if stream not in self.streams:
            self.streams[stream] = torch.cuda.current_stream(self.device)
        return start

    def send(self, start: int, n: int, stream: int) -> torch.Tensor:
        """The pinned span ``[start, start + n)`` copied into fresh device memory on raw
        stream ``stream``: the new ``[n]`` tensor."""
        chunk, at = self.chunks.take(n, stream)
        target = chunk[at:at + n]
        # The driver's copy needs this device's context current on the thread (torch
        # makes it current with the device); anything else takes torch's copy.
        if (self._copy is not None and torch._C._cuda_getDevice() == self._index
                and self._copy(self.chunks.pointer + 4 * at, self._host_ptr + 4 * start,
                               4 * n, stream) == 0):
            return target
        target.copy_(self.tensor.narrow(0, start, n), non_blocking=True)
        return target


class PositionUpload:
    """Copies int32 positions to ``device``, stream-ordered, into fresh or static buffers.

    Args:
      device: the manager's torch device.
      mrope: positions are M-RoPE ``[3, n]``: graph buffers are ``[3, bucket.num_tokens]``.
    """

    def __init__(self, device: torch.device, mrope: bool = False):
        self.device = device
        self._ring = _PinnedRing(device) if device.type == "cuda" else None
        self._index = device.index if device.type == "cuda" else None
        self._rows = (3,) if mrope else ()
        self._staged: Optional[Tuple[np.ndarray, Optional[int], int, List[int]]] = None
        self.graph_buffers: Dict[Tuple[GraphSlot, str], torch.Tensor] = {}

    def stage(self, sizes: Sequence[int]) -> List[np.ndarray]:
        """Writable int32 host buffers of ``sizes`` for a step's computed positions, one
        per plan label, which :meth:`step` sends in one copy: on CUDA spans of the pinned
        ring (written where the copy reads), else (or when larger than a ring part)
        fresh. Each starts ``_ALIGN`` ints after the last, so that every label's device
        tensor is as aligned as the kernels and XLA's import need."""
        offsets, end = [], 0
        for n in sizes:
            offsets.append(end)
            end += -(-n // _ALIGN) * _ALIGN
        total = offsets[-1] + sizes[-1]
        buffer, start, stream = None, None, 0
        if self._ring is not None:
            # The raw stream handle: building a torch.cuda.Stream per step costs microseconds.
            stream = torch._C._cuda_getCurrentRawStream(self._index)
            start = self._ring.span(total, stream)
            if start is not None:
                buffer = self._ring.host[start:start + total]
        if buffer is None:
            buffer = np.empty((total,), np.int32)
        self._staged = (buffer, start, stream, offsets)
        return [buffer[at:at + n] for at, n in zip(offsets, sizes)]

    def step(self, computed: Mapping[str, np.ndarray], explicit: Mapping[str, torch.Tensor],
             order: Tuple[str, ...], graph: Optional[GraphSlot]
             ) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
        """A step's positions on the device, per plan label in ``order``.

        ``computed``: host positions in the buffers of the last :meth:`stage`, in its
        order; ``explicit``: device tensors given by the step (``[n]``, M-RoPE ``[3,
        n]``). Without a graph slot, computed labels share one copy (one device tensor, a
        contiguous view per label) and explicit ones are used as given; under ``graph``
        every label is written into its static ``[bucket.num_tokens]`` (M-RoPE ``[3,
        bucket.num_tokens]``) buffer.

        Returns ``({plan_label: tensor}, {plan_label: most tokens apply_qk accepts})``.
        Raises ValueError, changing nothing, when a label has more tokens than the bucket.
        """
        if graph is not None:
            return self._graph_step(computed, explicit, order, graph)
        tensors = dict(explicit)
        if computed:
            buffer, start, stream, offsets = self._staged
            if self._ring is None:
                joined = torch.from_numpy(buffer)
            elif start is not None:
                joined = self._ring.send(start, buffer.size, stream)
            else:
                joined = self.to_device(buffer)  # larger than a ring part
            if len(computed) == 1:
                (plan_label, host), = computed.items()
                tensors[plan_label] = joined if host.ndim == 1 else joined.view(host.shape)
            else:
                for (plan_label, host), at in zip(computed.items(), offsets):
                    tensors[plan_label] = joined.narrow(0, at, host.size).view(host.shape)
        self._staged = None
        return ({plan_label: tensors[plan_label] for plan_label in order},
                {plan_label: tensors[plan_label].shape[-1] for plan_label in order})

    def _graph_step(self, computed: Mapping[str, np.ndarray], explicit: Mapping[str, torch.Tensor],
                    order: Tuple[str, ...], graph: GraphSlot
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, int]]:
        size = graph.bucket.num_tokens
        for plan_label in order:
            tokens = (computed[plan_label] if plan_label in computed
                      else explicit[plan_label]).shape[-1]
            if tokens > size:
                raise ValueError(f"plan label {plan_label!r} has {tokens} tokens, more than "
                                 f"graph bucket num_tokens={size}")
        staged = self._staged_sources(computed)
        tensors = {}
        for plan_label in order:
            buffer = self._graph_buffer(graph, plan_label)
            source = staged[plan_label] if plan_label in computed else explicit[plan_label]
            if source is None:  # staged off the ring (larger than a part)
                self.to_device(computed[plan_label], into=buffer)
            else:
                # M-RoPE: the rows of a [3, N] graph buffer, N apart; torch lands the one
                # host->device copy in a contiguous staging tensor and scatters it on the
                # same stream (the tail past n keeps its values).
                buffer[..., :source.shape[-1]].copy_(source, non_blocking=True)
            tensors[plan_label] = buffer
        self._staged = None
        return tensors, dict.fromkeys(order, size)

    def _staged_sources(self, computed: Mapping[str, np.ndarray]) -> Dict[str, Optional[torch.Tensor]]:
        """Host tensors over the staged positions of each computed label: pinned ring spans
        on CUDA (None where the step was staged off the ring), the arrays themselves else."""
        if not computed:
            return {}
        _, start, _, offsets = self._staged
        if self._ring is None:
            return {plan_label: torch.from_numpy(host) for plan_label, host in computed.items()}
        if start is None:
            return dict.fromkeys(computed)
        return {plan_label: self._ring.tensor[start + at:start + at + host.size].view(host.shape)
                for (plan_label, host), at in zip(computed.items(), offsets)}

    def _graph_buffer(self, graph: GraphSlot, plan_label: str) -> torch.Tensor:
        key = (graph, plan_label)
        buffer = self.graph_buffers.get(key)
        if buffer is None:
            buffer = self.graph_buffers[key] = torch.zeros(
                (*self._rows, graph.bucket.num_tokens), dtype=torch.int32, device=self.device)
        return buffer

    def check_not_capturing(self) -> None:
        """Raise RuntimeError under CUDA-graph capture (see the module docstring)."""
        # torch's C entry point: the public wrapper re-checks lazy initialisation per call.
        if self._ring is not None and torch._C._cuda_isCurrentStreamCapturing():
            raise RuntimeError("plan under CUDA-graph capture: the position copy from pinned "
                               "host memory cannot be captured; plan outside the capture into a "
                               "graph slot (StepContext.graph_slot) and replay reads its buffer")

    def to_device(self, positions: np.ndarray, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``positions`` (int32 ``[n]`` or ``[3, n]``, host) on the device, without the ring: a
        new contiguous tensor, or ``into[..., :n]`` written. What :meth:`stage` could not
        put on the ring (larger than a part) goes this way, and everything off CUDA.

        Returns the new tensor, or ``into`` itself.
        """
        if positions.ndim > 1 or not positions.flags.writeable:
            positions = np.array(positions, order="C")  # a plan's broadcast rows: one block
        source = torch.from_numpy(positions)
        if self._ring is not None:
            # A pinned buffer of its own, which torch's caching host allocator keeps alive
            # until the copy has completed.
            source = source.pin_memory()
        elif into is None:
            return source
        if into is None:
            target = torch.empty(positions.shape, dtype=torch.int32, device=self.device)
            target.copy_(source, non_blocking=True)
            return target
        # M-RoPE: the rows of a [3, N] graph buffer, N apart (see _graph_step).
        into[..., :positions.shape[-1]].copy_(source, non_blocking=True)
        return into
