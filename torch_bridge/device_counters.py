"""The manager's counters on a CUDA device, changed by Triton launches on torch's stream.

Through JAX, a step's ``plan`` costs a host-to-device transfer, a jitted dispatch and a
DLPack export: 600-950 us of host time on the H200's host against a budget of 100 us.
This module does the same transitions (those of :mod:`jaxrope.positions`, in the order
of :func:`torch_bridge._transitions.plan_fn`) in one single-program Triton kernel:

1. copy the step's int32 *meta* (slots, amounts, forks, views) from pinned host memory
   to the device: the host writes it into a ring buffer and launches, no copy call;
2. *real* ops on the counters: adds (commit spans and explicit advance), forks, maxes
   (admit, cached prefix) and zero-sets (reset), each phase complete before the next;
3. optionally copy the counters to a scratch table and run *speculative* adds and forks
   there (a preplan numbers its tokens as if the current plan had committed, without
   committing it), then the pre-forks;
4. the positions of one plan label: token ``t`` finds its view by binary search over the
   views' start offsets and gets ``counter[slot] + t - start`` (SEQUENTIAL) or
   ``counter[slot]`` (BLOCK); tokens past the label's count keep the output's values.

Padding slots (any value ``>= capacity``, e.g. ``_transitions.PAD``) read as 0 and
their writes are dropped, as in the core. The kernel body is plain Triton, so on CPU it
runs in Triton's interpreter (the tests compare it with :mod:`jaxrope.positions`).

The host never waits for the device: a meta chunk in the ring is reused only after an
event recorded when the ring last moved past it has completed (a full ring lap later).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch


__all__ = ["NO_OPS", "CounterOps", "DeviceCounters", "KernelUnavailable", "label", "view_offsets"]

_BLOCK = 1024
_NUM_WARPS = 4
# Above this many tokens the positions are written by a separate many-program launch:
# one program walks tokens at ~1k per iteration, which would lengthen the step.
_SINGLE_PROGRAM_TOKENS = 8192
_RING_INTS = 1 << 18
_ALIGN_INTS = 8  # 32 bytes: every pointer handed to the kernel stays 16-byte aligned


class KernelUnavailable(RuntimeError):
    """Triton (or its interpreter) cannot run the counter kernel here.

    A ``RuntimeError``, raised by ``RopeManager(counters="triton")`` without Triton;
    ``counters="auto"`` then keeps the JAX counter store instead.

    Example:
      >>> issubclass(KernelUnavailable, RuntimeError)
      True
    """


_EMPTY = np.zeros((0,), np.int32)
_EMPTY.flags.writeable = False


def _empty() -> np.ndarray:
    return _EMPTY


@dataclasses.dataclass(frozen=True)
class CounterOps:
    """One transition's host-side arrays (int32 or int64 numpy, slots may be padding).

    Applied in field order: ``counter[add_slots] += add_amounts`` (repeated slots add
    up), forks ``counter[fork_dst] = counter[fork_src]`` (all sources read first),
    ``counter[max_slots] = max(counter, max_values)``, ``counter[zero_slots] = 0``.
    """

    add_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    add_amounts: np.ndarray = dataclasses.field(default_factory=_empty)
    fork_src: np.ndarray = dataclasses.field(default_factory=_empty)
    fork_dst: np.ndarray = dataclasses.field(default_factory=_empty)
    max_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    max_values: np.ndarray = dataclasses.field(default_factory=_empty)
    zero_slots: np.ndarray = dataclasses.field(default_factory=_empty)

    def __bool__(self) -> bool:
        return bool(len(self.add_slots) or len(self.fork_src) or len(self.max_slots)
                    or len(self.zero_slots))


NO_OPS = CounterOps()


_INT_ARGS = ("n_meta", "capacity", "tmp_offset", "r_add", "r_fork", "r_max", "r_zero",
             "copy_work", "w_add", "w_fork", "p_fork", "views_offset", "n_views", "n_tokens",
             "search_steps")


def _compile(interpret: bool):
    try:
        import triton
        from triton.runtime.interpreter import InterpretedFunction

        from torch_bridge._counter_kernel import step_kernel
    except ImportError as e:
        raise KernelUnavailable(f"Triton is not installed: {e}") from e
    if interpret:
        return InterpretedFunction(step_kernel)
    return triton.jit(step_kernel, do_not_specialize=list(_INT_ARGS))


class _Ring:
    """Pinned int32 host memory handed out in order and reused a lap later.

    When the ring moves to its other half, an event is recorded on every stream that
    launched from the half it leaves; before a half is written again the host waits
    for its events, which in steady state completed long ago.
    """

    def __init__(self, ints: int, pinned: bool, device: Optional[torch.device] = None):
        self.device = device
        self.buffer = torch.empty((ints,), dtype=torch.int32, pin_memory=pinned)
        self.array = self.buffer.numpy()
        self.base = self.buffer.data_ptr()
        self.half = ints // 2
        self.offset = 0
        self.current = 0
        self.pinned = pinned
        self.events: List[List[torch.cuda.Event]] = [[], []]
        self.streams: set = set()  # raw CUDA streams launched from since the last switch

    def take(self, size: int) -> int:
        """Offset (in ints) of ``size`` ints to write, ``size <= half``."""
        size = -(-size // _ALIGN_INTS) * _ALIGN_INTS
        start = self.offset
        if start + size > (self.current + 1) * self.half:
            self._enter(1 - self.current)
            start = self.current * self.half
        self.offset = start + size
        return start

    def _enter(self, half: int) -> None:
        self.current = half
        if not self.pinned:
            return
        events = []
        for raw in self.streams:
            event = torch.cuda.Event()
            event.record(torch.cuda.ExternalStream(raw, device=self.device))
            events.append(event)
        self.events[1 - half], self.streams = events, set()
        for event in self.events[half]:
            event.synchronize()


def view_offsets(counts: np.ndarray) -> Tuple[np.ndarray, int]:
    """``(starts, tokens)``: each view's first token in the label's output, and the total."""
    ends = np.cumsum(counts)
    return ends - counts, int(ends[-1]) if len(ends) else 0


def label(slots: np.ndarray, counts: np.ndarray, out: torch.Tensor
          ) -> Tuple[np.ndarray, np.ndarray, int, torch.Tensor]:
    """A plan label for :meth:`DeviceCounters.step` from its views' slots and token counts."""
    return (slots, *view_offsets(counts), out)


class DeviceCounters:
    """int32 counters ``[capacity]`` on a torch device, and the step kernel that changes them.

    Args:
      device: a CUDA device (compiled kernel), or CPU (Triton's interpreter, for tests).
      capacity: the number of slots (grown with :meth:`grow`).
      sequential: the numbering scheme (True: SEQUENTIAL, False: BLOCK).

    Raises:
      KernelUnavailable: no Triton.

    Example:
      >>> counters = DeviceCounters(torch.device("cpu"), 4)   # doctest: +SKIP
      >>> out = torch.full((5,), -1, dtype=torch.int32)          # doctest: +SKIP
      >>> counters.step(CounterOps(np.array([1]), np.array([7])), labels=[
      ...     label(np.array([1, 0]), np.array([3, 1]), out)])    # doctest: +SKIP
      >>> out.tolist()                                            # doctest: +SKIP
      [7, 8, 9, 0, -1]
    """

    def __init__(self, device: torch.device, capacity: int, sequential: bool = True):
        self.device = device
        self.sequential = sequential
        self._interpret = device.type != "cuda"
        self._kernel = _compile(self._interpret)
        self._compiled: Optional[Any] = None  # the CUDA kernel, compiled at the first launch
        self._lock = threading.Lock()
        self.counters = torch.zeros((capacity,), dtype=torch.int32, device=device)
        self._scratch = torch.zeros((capacity,), dtype=torch.int32, device=device)
        self._dmeta = torch.zeros((_RING_INTS,), dtype=torch.int32, device=device)
        self._rings = [_Ring(_RING_INTS, pinned=not self._interpret, device=device)]
        self._max_programs = 4
        if not self._interpret:
            # torch's C entry points: the public wrappers cost more than the launch's
            # own Python on the decode path.
            self._raw_stream = torch._C._cuda_getCurrentRawStream
            self._capturing = torch._C._cuda_isCurrentStreamCapturing
            self._current_device = torch._C._cuda_getDevice
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
            self._max_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count

    @property
    def capacity(self) -> int:
        return self.counters.shape[0]

    def grow(self, capacity: int) -> None:
        """Keep the counters, add zeroed slots up to ``capacity`` (stream-ordered copy)."""
        if capacity <= self.capacity:
            return
        counters = torch.zeros((capacity,), dtype=torch.int32, device=self.device)
        counters[:self.capacity].copy_(self.counters)
        self.counters = counters
        self._scratch = torch.zeros((capacity,), dtype=torch.int32, device=self.device)

    def step(self, real: CounterOps = NO_OPS, *, speculative: CounterOps = NO_OPS,
             pre_forks: Tuple[np.ndarray, np.ndarray] = (_EMPTY, _EMPTY), preplan: bool = False,
             labels: Sequence[Tuple[np.ndarray, np.ndarray, int, torch.Tensor]] = ()) -> None:
        """Apply ``real`` to the counters, then write each label's positions.

        Args:
          real: ops applied to the counters.
          speculative: adds and forks applied, with the pre-forks, to a scratch copy
            (``preplan``) or to the counters (otherwise, where it must be empty).
          pre_forks: ``(src, dst)`` slots, applied after ``speculative``.
          preplan: plan from the scratch copy; the counters keep only ``real``.
          labels: ``(slots [V], starts [V], tokens, out)`` per plan label (see
            :func:`label`), views in token order, ``starts`` each view's first token;
            ``out[:tokens]`` gets the positions, the rest is untouched.
        """
        # The first launch runs every op; later ones (one per further label) only plan.
        for index, (slots, starts, tokens, out) in enumerate(labels or [(_EMPTY, _EMPTY, 0, None)]):
            if index == 0:
                self._launch(real, speculative, pre_forks, preplan, preplan, slots, starts, tokens,
                             out)
            else:
                self._launch(NO_OPS, NO_OPS, (_EMPTY, _EMPTY), preplan, False, slots, starts,
                             tokens, out)

    def _launch(self, real: CounterOps, spec: CounterOps, pre, preplan: bool, copy_work: bool,
                slots: np.ndarray, starts: np.ndarray, tokens: int,
                out: Optional[torch.Tensor]) -> None:
        if not self._interpret and self._capturing():
            # A replay would read meta of capture time from the ring, long overwritten.
            raise RuntimeError("the counter kernel cannot be captured in a CUDA graph: plan, "
                               "commit, fork, admit and reset outside the capture (graph "
                               "slots keep positions for replay)")
        n_views = len(slots)
        pieces = [real.add_slots, real.add_amounts, real.fork_src, real.fork_dst,
                  real.max_slots, real.max_values, real.zero_slots,
                  spec.add_slots, spec.add_amounts, spec.fork_src, spec.fork_dst,
                  pre[0], pre[1], slots, starts]
        lengths = [len(p) for p in pieces]
        n_meta = sum(lengths)
        forks = max(lengths[2], lengths[9], lengths[11])
        work = self._scratch if preplan else self.counters
        if out is None:
            out = self.counters  # never written: no tokens
        split = tokens > _SINGLE_PROGRAM_TOKENS
        stream = 0 if self._interpret else self._raw_stream(self._device_index)
        meta_offset = self._write_meta(pieces, n_meta, stream)
        ring = self._rings[-1]
        if n_meta + forks > self._dmeta.shape[0]:
            self._dmeta = torch.zeros((1 << (n_meta + forks - 1).bit_length(),),
                                      dtype=torch.int32, device=self.device)
        args = (self.counters, work, ring, self._dmeta, out)
        # In _INT_ARGS order.
        values = [n_meta, self.capacity, n_meta, lengths[0], lengths[2], lengths[4], lengths[6],
                  int(copy_work), lengths[7], lengths[9], lengths[11], n_meta - 2 * n_views,
                  n_views, 0 if split else tokens, (n_views - 1).bit_length() if n_views else 0]
        self._run(1, args, meta_offset, values, stream)
        if split:
            # The first launch copied the meta to the device and ran every op; this one
            # only reads: counters, view slots and starts at the same dmeta offsets.
            values = [0, self.capacity, n_meta, 0, 0, 0, 0, 0, 0, 0, 0, n_meta - 2 * n_views,
                      n_views, tokens, values[-1]]
            programs = min(-(-tokens // _BLOCK), self._max_programs)
            self._run(programs, args, meta_offset, values, stream)

    def _write_meta(self, pieces: Sequence[np.ndarray], n_meta: int, stream: int) -> int:
        ring = self._rings[-1]
        if n_meta > ring.half:
            ring = _Ring(2 * (-(-n_meta // _ALIGN_INTS) * _ALIGN_INTS), pinned=not self._interpret,
                         device=self.device)
            self._rings.append(ring)  # older rings stay alive: in-flight kernels read them
        offset = ring.take(max(n_meta, 1))
        # One C call for every piece (int64 pieces are cast to the ring's int32).
        np.concatenate(pieces, out=ring.array[offset:offset + n_meta], casting="same_kind")
        if not self._interpret:
            ring.streams.add(stream)
        return offset

    def _run(self, programs: int, args: Tuple[Any, ...], meta_offset: int, values: List[int],
             stream: int) -> None:
        counters, work, ring, dmeta, out = args
        if self._interpret:
            meta = ring.buffer[meta_offset:]
            self._kernel[(programs,)](counters, work, meta, dmeta, out, *values,
                                      SEQUENTIAL=self.sequential, BLOCK=_BLOCK)
            return
        if self._current_device() != self._device_index:
            # The kernel's module lives in this device's context; launch from it.
            with torch.cuda.device(self._device_index):
                self._run(programs, args, meta_offset, values, stream)
            return
        compiled = self._compiled
        if compiled is None:
            with self._lock:
                meta = ring.buffer[meta_offset:]
                compiled = self._kernel[(programs,)](counters, work, meta, dmeta, out, *values,
                                                     SEQUENTIAL=self.sequential, BLOCK=_BLOCK,
                                                     num_warps=_NUM_WARPS)
                self._compiled = compiled
            return
        compiled.run(programs, 1, 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None,
                     counters.data_ptr(), work.data_ptr(), ring.base + 4 * meta_offset,
                     dmeta.data_ptr(), out.data_ptr(), *values, self.sequential, _BLOCK)
