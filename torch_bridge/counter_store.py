"""Where the manager's device counters live and how a step changes them.

The manager validates, keeps the host shadow and decides *what* changes; a store
carries it out on the device. Two stores implement the same transitions (those of
:mod:`jaxrope.positions`):

- :class:`JaxCounters`: a :class:`jaxrope.PositionTable` changed by the jitted
  compositions of :mod:`torch_bridge._transitions` (one dispatch per step, outputs
  exported to torch through DLPack). Works wherever JAX runs.
- :class:`TritonCounters`: an int32 torch tensor changed by the Triton step kernel of
  :mod:`torch_bridge.device_counters`, launched on torch's current stream. No JAX on
  the per-step path; on CPU it runs in Triton's interpreter (for tests only). Steps
  must reach the device in order on one stream at a time (they share a scratch table
  and a device copy of the meta), and no transition can be captured in a CUDA graph
  (graph slots exist for that: plan outside, replay reads the slot's buffer); under
  capture they raise ``RuntimeError`` before changing anything.

Both defer a commit's device work to the next call (a step costs one launch), and
both return positions as torch tensors on the manager's device.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np
import torch

from jaxrope import positions
from jaxrope.positions import PositionTable, Scheme
from torch_bridge import _transitions as tr
from torch_bridge.device_counters import NO_OPS, CounterOps, DeviceCounters, KernelUnavailable
from torch_bridge.dlpack import InPlace, to_jax, to_torch

__all__ = ["CommitArrays", "JaxCounters", "KernelUnavailable", "TritonCounters", "make_store"]

COUNTER_STORES = ("auto", "jax", "triton")

# (slots [V], counts [V], token offsets [V], tokens, graph buffer or None) of one computed
# plan label.
LabelRequest = Tuple[np.ndarray, np.ndarray, np.ndarray, int, Optional[torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class CommitArrays:
    """A step's commit as host arrays (slots unpadded, int64 or int32).

    ``slots``/``spans``: the segments advanced by the scheme; ``adv_slots``/
    ``adv_amounts``: explicit advances; ``fork_src``/``fork_dst``: post-forks.
    ``distinct``: no slot repeats in ``slots`` (so a plain indexed add is exact).
    """

    slots: np.ndarray
    spans: np.ndarray
    adv_slots: np.ndarray
    adv_amounts: np.ndarray
    fork_src: np.ndarray
    fork_dst: np.ndarray
    distinct: bool = False

    def amounts(self, scheme: Scheme, block_step: int) -> np.ndarray:
        """What each segment adds: its span (SEQUENTIAL) or ``block_step`` if non-empty (BLOCK)."""
        if scheme is Scheme.BLOCK:
            return np.where(self.spans > 0, block_step, 0)
        return self.spans


class JaxCounters:
    """The counters as a :class:`jaxrope.PositionTable` on the JAX device of ``device``."""

    def __init__(self, jax_device: jax.Device, capacity: int, scheme: Scheme, block_step: int):
        self._table = jax.device_put(positions.init(capacity), jax_device)
        self._scheme, self._block_step = scheme, block_step
        self._pending: Optional[Tuple[tr.CommitLayout, np.ndarray]] = None
        self._plan_calls: Dict[int, InPlace] = {}

    def _meta(self, commit: CommitArrays) -> Tuple[tr.CommitLayout, np.ndarray]:
        return tr.commit_meta(commit.slots, commit.spans, commit.adv_slots, commit.adv_amounts,
                              commit.fork_src, commit.fork_dst)

    def table(self) -> PositionTable:
        """The counters with a deferred commit applied."""
        if self._pending is not None:
            layout, meta = self._pending
            self._table = tr.commit_fn(self._table, meta, layout=layout, scheme=self._scheme,
                                       block_step=self._block_step)
            self._pending = None
        return self._table

    def defer(self, commit: CommitArrays) -> None:
        self.table()
        self._pending = self._meta(commit)

    def grow(self, capacity: int) -> None:
        if capacity > self._table.capacity:
            self._table = positions.grow(self.table(), capacity)

    def fork(self, src: np.ndarray, dst: np.ndarray) -> None:
        size = tr.bucket(len(src))
        self._table = tr.fork_fn(self.table(), np.concatenate([tr.padded(src, size),
                                                               tr.padded(dst, size)]))

    def raise_to(self, slots: Sequence[int], values: Sequence[int]) -> None:
        size = tr.bucket(len(slots))
        meta = np.concatenate([tr.padded(slots, size), tr.padded(values, size, 0)])
        self._table = tr.raise_fn(self.table(), meta)

    def reset(self, slots: Sequence[int]) -> None:
        self._table = tr.reset_fn(self.table(), tr.padded(slots, tr.bucket(len(slots))))

    def _plan_call(self, num_outs: int) -> InPlace:
        call = self._plan_calls.get(num_outs)
        if call is None:
            call = self._plan_calls[num_outs] = InPlace(
                tr.plan_fn, num_outs, static_argnames=("real", "speculative", "forks", "labels",
                                                       "num_outs", "preplan", "scheme",
                                                       "block_step"))
        return call

    def compiled_plans(self) -> int:
        """Compiled variants of the step function (tests check that buckets bound them)."""
        return sum(call._jitted._cache_size() for call in self._plan_calls.values())

    def plan(self, labels: Sequence[LabelRequest], pre_src: np.ndarray, pre_dst: np.ndarray,
             speculative: Optional[CommitArrays], preplan: bool
             ) -> List[Tuple[torch.Tensor, Optional[jax.Array]]]:
        """The deferred commit, then (on top of ``speculative`` and the pre-forks) the positions.

        Returns ``(tensor, array)`` per label: ``[tokens]`` fresh or the graph buffer.
        """
        pending = self._pending
        forks = tr.bucket(len(pre_src))
        meta: List[Any] = [pending[1]] if pending is not None else []
        spec_layout = None
        if speculative is not None:
            spec_layout, spec_meta = self._meta(speculative)
            meta.append(spec_meta)
        meta += [(pre_src, forks, tr.PAD), (pre_dst, forks, tr.PAD)]
        layout_labels, outs = [], []
        for slots, counts, _, tokens, buffer in labels:
            views = tr.bucket(len(slots))
            meta += [(slots, views, tr.PAD), (counts, views, 0)]
            if buffer is None:
                layout_labels.append((views, tr.bucket(tokens), -1))
            else:
                layout_labels.append((views, buffer.shape[0], len(outs)))
                outs.append(buffer)
        if not (labels or forks or pending is not None):
            return []
        results = self._plan_call(len(outs))(
            outs, self._table, tr.pack(meta), real=None if pending is None else pending[0],
            speculative=spec_layout, forks=forks, labels=tuple(layout_labels), num_outs=len(outs),
            preplan=preplan, scheme=self._scheme, block_step=self._block_step)
        self._table, self._pending = results[len(outs)], None
        fresh = iter(results[len(outs) + 1:])
        written = iter(results[:len(outs)])
        out = []
        for _, _, _, tokens, buffer in labels:
            if buffer is None:
                array = next(fresh)
                out.append((to_torch(array)[:tokens], array))
            else:
                out.append((buffer, next(written)))
        return out


class TritonCounters:
    """The counters as an int32 torch tensor, changed by the Triton step kernel."""

    def __init__(self, device: torch.device, capacity: int, scheme: Scheme, block_step: int):
        self._counters = DeviceCounters(device, capacity, sequential=scheme is Scheme.SEQUENTIAL)
        self._device = device
        self._scheme, self._block_step = scheme, block_step
        self._pending: Optional[CounterOps] = None

    def _ops(self, commit: CommitArrays) -> CounterOps:
        slots, amounts = commit.slots, commit.amounts(self._scheme, self._block_step)
        if len(commit.adv_slots):
            slots = np.concatenate([slots, commit.adv_slots])
            amounts = np.concatenate([amounts, commit.adv_amounts])
        return CounterOps(slots, amounts, commit.fork_src, commit.fork_dst)

    def _flush(self, then: Optional[CounterOps] = None) -> None:
        # Dropped only once launched: a launch that raises leaves the commit pending.
        if self._pending is not None:
            self._counters.step(self._pending)
            self._pending = None
        if then is not None:
            self._counters.step(then)

    def table(self) -> PositionTable:
        """A snapshot of the counters (deferred commit applied) as a JAX table."""
        self._flush()
        return PositionTable(to_jax(self._counters.counters.clone()))

    def defer(self, commit: CommitArrays) -> None:
        self._flush()
        self._pending = self._ops(commit)

    def grow(self, capacity: int) -> None:
        self._counters.grow(capacity)

    def fork(self, src: np.ndarray, dst: np.ndarray) -> None:
        self._flush(CounterOps(fork_src=src, fork_dst=dst))

    def raise_to(self, slots: Sequence[int], values: Sequence[int]) -> None:
        self._flush(CounterOps(max_slots=np.asarray(slots, np.int64),
                               max_values=np.asarray(values, np.int64)))

    def reset(self, slots: Sequence[int]) -> None:
        self._flush(CounterOps(zero_slots=np.asarray(slots, np.int64)))

    def compiled_plans(self) -> int:
        return int(self._counters._compiled is not None)

    def plan(self, labels: Sequence[LabelRequest], pre_src: np.ndarray, pre_dst: np.ndarray,
             speculative: Optional[CommitArrays], preplan: bool
             ) -> List[Tuple[torch.Tensor, Optional[jax.Array]]]:
        pending = self._pending
        if not (labels or len(pre_src) or pending is not None):
            return []
        outs = [buffer if buffer is not None else
                torch.empty((tokens,), dtype=torch.int32, device=self._device)
                for _, _, _, tokens, buffer in labels]
        self._counters.step(
            pending if pending is not None else NO_OPS,
            speculative=self._ops(speculative) if speculative is not None else NO_OPS,
            pre_forks=(pre_src, pre_dst), preplan=preplan,
            labels=[(slots, starts, tokens, out)
                    for (slots, _, starts, tokens, _), out in zip(labels, outs)])
        self._pending = None
        return [(out, None) for out in outs]


def make_store(kind: str, device: torch.device, jax_device: jax.Device, capacity: int,
               scheme: Scheme, block_step: int):
    """The store ``kind`` names: "jax", "triton", or "auto" (Triton on CUDA when it loads)."""
    if kind not in COUNTER_STORES:
        raise ValueError(f"counters={kind!r} must be one of {list(COUNTER_STORES)}")
    if kind == "triton" or (kind == "auto" and device.type == "cuda"):
        try:
            return TritonCounters(device, capacity, scheme, block_step)
        except KernelUnavailable:
            if kind == "triton":
                raise
    return JaxCounters(jax_device, capacity, scheme, block_step)
