"""``RopeManager``: the seed's position resource over the functional jaxrope core.

State, and where it lives:

- the counters on the device (the source of every position id), in a *store*
  (:mod:`torch_bridge.counter_store`): a :class:`jaxrope.PositionTable` changed by the
  jitted pure functions of :mod:`jaxrope.positions`, or, on CUDA, an int32 tensor
  changed by a Triton kernel with the same transitions on torch's stream (no JAX
  dispatch per step);
- a host *shadow* of the same counters (numpy int64), updated by the same rules, so
  that bounds checks and :meth:`~PositionManager.position` never read the device;
- the slot map ``(request_id, label) -> slot`` (:class:`jaxrope.SlotMap`);
- the current plan (the step being run) and at most one staged plan (the next step,
  planned early: "preplan").

The device side of a commit is deferred: the next ``plan`` applies it in the same
call that computes the new positions, so a step costs one dispatch or launch. Anything
else that reads or changes the device table applies a deferred commit first.

Every public method validates first and changes state only once nothing can fail:
a call that raises leaves every counter, slot and plan as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np
import torch

from jaxrope.config import RopeConfig
from jaxrope.positions import PositionTable, Scheme, SlotMap
from torch_bridge.config import PositionConfig
from torch_bridge.counter_store import CommitArrays, make_store
from torch_bridge.device_counters import view_offsets
from torch_bridge.dlpack import jax_device, to_jax
from torch_bridge.engine_types import (AdmitOutcome, EngineInfo, Fork, GraphSlot, KVPlanOutput,
                                       PositionStep, PublishedInfo, Resource, ResourceSpec,
                                       StepContext)
from torch_bridge.rotate import (SUPPORTED_DTYPES, ConfigCache, JaxRotation, LaunchUnavailable,
                                 resolve_launcher)

__all__ = ["PositionManager", "PublishedPositionInfo", "RopeManager"]

_FINGERPRINT_VERSION = b"jaxrope.positions/1"
_INITIAL_SLOTS = 256
# Bound launches kept by apply_qk (one per call signature) before the cache starts over.
_MAX_BOUND = 1024
# Counters are int32 on the device.
_MAX_SEQ_LEN = int(np.iinfo(np.int32).max)


@dataclasses.dataclass
class PublishedPositionInfo(PublishedInfo):
    """Where each of a request's streams has reached: ``{label: next position}``.

    Example:
      >>> a = PublishedPositionInfo({"text": 7})
      >>> a.update(PublishedPositionInfo({"text": 5, "image": 2}))
      >>> a.counters
      {'text': 7, 'image': 2}
    """

    counters: Dict[str, int] = dataclasses.field(default_factory=dict)

    def clone(self) -> "PublishedPositionInfo":
        """An independent copy (for deferred sending)."""
        return PublishedPositionInfo(dict(self.counters))

    def update(self, other: "PublishedPositionInfo") -> None:
        """Merge ``other`` in: per label, the larger position wins (positions never go back).

        Raises:
          TypeError: ``other`` is not a PublishedPositionInfo.
        """
        if not isinstance(other, PublishedPositionInfo):
            raise TypeError(f"other must be a PublishedPositionInfo, got {type(other).__name__}")
        for label, position in other.counters.items():
            mine = self.counters.get(label)
            self.counters[label] = position if mine is None else max(mine, position)


@dataclasses.dataclass(eq=False)
class _Plan:
    step: PositionStep
    tensors: Dict[str, torch.Tensor]   # what plan() returned, per plan label
    arrays: Dict[str, jax.Array]       # the same values as JAX arrays, filled on first use
    limits: Dict[str, int]             # most q tokens apply_qk accepts, per plan label
    commit: CommitArrays
    pre_forks: Tuple[Fork, ...]
    post_forks: Tuple[Fork, ...]
    groups: Mapping[str, Sequence[Any]]   # plan label -> views
    dropped: set = dataclasses.field(default_factory=set)

    def array(self, plan_label: str) -> jax.Array:
        """The label's positions as a JAX array (for the JAX apply path)."""
        array = self.arrays.get(plan_label)
        if array is None:
            array = self.arrays[plan_label] = to_jax(self.tensors[plan_label])
        return array

    def mentions(self, rid: Hashable) -> bool:
        return any(rid == s[0] for s in self.step.segments) or any(
            rid == v[0] for views in self.groups.values() for v in views) or any(
            rid == f[0] for f in self.pre_forks + self.post_forks)


class PositionManager(Resource):
    """Per-(request, label) position counters and the position ids of each step.

    Args:
      config: a :class:`~torch_bridge.PositionConfig`.
      device: the torch device position ids are produced on (``"cpu"``, ``"cuda:0"``).
      max_seq_len: positions must stay in ``[0, max_seq_len)``; a counter may reach
        ``max_seq_len`` (the stream is full).
      counters: where the device counters live (:mod:`torch_bridge.counter_store`):
        "jax" (a PositionTable, jitted transitions), "triton" (a tensor changed by a
        Triton kernel on torch's stream; on CPU through Triton's interpreter, slow,
        for tests), or "auto" (Triton on CUDA when it loads, else JAX).

    Attributes:
      name: the resource name ("position", or the spec's name under :meth:`build`).
      config, device, max_seq_len: as given.

    Raises:
      ValueError: an invalid argument (named in the message).

    Example:
      >>> from torch_bridge import PositionConfig, PositionStep, Segment, StepContext
      >>> mgr = PositionManager(PositionConfig(labels=("text",)), "cpu", max_seq_len=64)
      >>> mgr.ingest_request("r0")
      >>> step = PositionStep([Segment("r0", "text", 3)])
      >>> mgr.plan(step, StepContext(("r0",)))["text"].tolist()
      [0, 1, 2]
      >>> mgr.commit(step, StepContext(("r0",)))
      >>> mgr.position("r0", "text")
      3
    """

    name: str = "position"
    prefix_skip_safe: bool = True

    def __init__(self, config: PositionConfig, device: Any, max_seq_len: int = 32768, *,
                 counters: str = "auto"):
        if not isinstance(config, PositionConfig):
            raise ValueError(f"config must be a torch_bridge.PositionConfig, got {type(config).__name__}")
        if (not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool)
                or not 0 < max_seq_len <= _MAX_SEQ_LEN):
            raise ValueError(f"max_seq_len={max_seq_len!r} must be a positive int <= {_MAX_SEQ_LEN} "
                             "(counters are int32)")
        self.config = config
        self.device = _torch_device(device)
        self.max_seq_len = max_seq_len
        self._jax_device = jax_device(self.device)
        self._labels = config.labels
        self._label_set = frozenset(config.labels)
        self._plan_labels_seen = set(config.labels)
        self._slot_map = SlotMap(_INITIAL_SLOTS)
        self._store = make_store(counters, self.device, self._jax_device, _INITIAL_SLOTS,
                                 config.scheme, config.block_step)
        self._shadow = np.zeros(_INITIAL_SLOTS, np.int64)
        self._slot_of: Dict[Tuple[Hashable, str], int] = {}
        self._requests: Dict[Hashable, Tuple[int, ...]] = {}
        self._current: Optional[_Plan] = None
        self._staged: Optional[_Plan] = None
        self._graph_buffers: Dict[Tuple[GraphSlot, str], torch.Tensor] = {}
        self._slot_epoch = 0
        self._last_views: Dict[str, Tuple[int, Tuple[Any, ...], np.ndarray, np.ndarray]] = {}

    # ---------------------------------------------------------------- construction

    @classmethod
    def build(cls, spec: ResourceSpec, info: EngineInfo) -> "PositionManager":
        """Construct from the engine's resource spec and engine info.

        ``spec.config`` is the :class:`PositionConfig`, ``spec.options`` extra keyword
        arguments of the constructor; ``info`` gives the device (and, for
        :class:`RopeManager`, ``head_dim`` and ``dtype``); ``info.max_seq_len``
        applies unless ``spec.options`` sets it.

        Example:
          >>> from torch_bridge import EngineInfo, PositionConfig, ResourceSpec
          >>> mgr = PositionManager.build(ResourceSpec("pos", PositionConfig()), EngineInfo("cpu"))
          >>> mgr.name
          'pos'
        """
        if not isinstance(spec, ResourceSpec):
            raise TypeError(f"spec must be a ResourceSpec, got {type(spec).__name__}")
        if not isinstance(info, EngineInfo):
            raise TypeError(f"info must be an EngineInfo, got {type(info).__name__}")
        kwargs = cls._build_kwargs(info)
        kwargs.update(spec.options)
        manager = cls(spec.config, info.device, **kwargs)
        manager.name = spec.name
        return manager

    @classmethod
    def _build_kwargs(cls, info: EngineInfo) -> Dict[str, Any]:
        return {} if info.max_seq_len is None else {"max_seq_len": info.max_seq_len}

    # ---------------------------------------------------------------- resource hooks

    def depends_on(self) -> Tuple[str, ...]:
        """The KV resource whose plan result orders the tokens: ``(config.kv_resource,)``."""
        return (self.config.kv_resource,)

    @property
    def supports_preplan(self) -> bool:
        """True: ``plan`` with ``ctx.is_preplan`` stages step N+1 while step N runs."""
        return True

    @property
    def force_double_buffer(self) -> bool:
        """False: no host staging buffer is reused across steps.

        Each plan uploads a fresh host array, and writes into graph buffers are
        ordered on torch's stream after the work already queued on it (DLPack
        import), so planning step N+1 cannot overwrite what step N still reads
        unless the runner leases it the same graph slot.
        """
        return False

    def fingerprint(self) -> bytes:
        """SHA-256 over the scheme (and, for RopeManager, the rotary config).

        Example:
          >>> from torch_bridge import PositionConfig
          >>> len(PositionManager(PositionConfig(), "cpu").fingerprint())
          32
        """
        return hashlib.sha256(self._fingerprint_payload()).digest()

    def _fingerprint_payload(self) -> bytes:
        return b"|".join((_FINGERPRINT_VERSION, self.config.scheme.value.encode(),
                          str(self.config.block_step).encode()))

    # ---------------------------------------------------------------- requests

    def ingest_request(self, rid: Hashable, overrides: Optional[Mapping[str, int]] = None) -> None:
        """Give ``rid`` a counter per configured label; idempotent, never resets.

        Args:
          rid: the request id (hashable).
          overrides: optional ``{label: position}`` start positions, taken as
            ``counter = max(counter, position)`` so a repeated ingest moves nothing.

        Raises:
          ValueError: an override names an unknown label or a position outside
            ``[0, max_seq_len]``.
          TypeError: ``rid`` is not hashable.

        Example:
          >>> from torch_bridge import PositionConfig
          >>> mgr = PositionManager(PositionConfig(), "cpu")
          >>> mgr.ingest_request("r0", overrides={"text": 4}); mgr.ingest_request("r0")
          >>> mgr.position("r0", "text")
          4
        """
        _check_hashable(rid, "rid")
        targets = self._positions_arg(overrides or {}, "overrides")
        if rid not in self._requests:
            slots = tuple(self._slot_map.acquire(rid, label) for label in self._labels)
            for label, slot in zip(self._labels, slots):
                self._slot_of[rid, label] = slot
            self._requests[rid] = slots
            self._slot_epoch += 1
            self._grow()
        if targets:
            self._raise_to(rid, targets)

    def remove_request(self, rid: Hashable) -> None:
        """Forget ``rid`` and free its slots (their counters go back to 0); unknown ids are ignored.

        A plan made before the removal still commits, without the removed request's
        streams.

        Raises:
          TypeError: ``rid`` is not hashable.
        """
        _check_hashable(rid, "rid")
        slots = self._requests.pop(rid, None)
        if slots is None:
            return
        for label in self._labels:
            del self._slot_of[rid, label]
        for plan in (self._current, self._staged):
            if plan is not None and plan.mentions(rid):
                plan.dropped.add(rid)
        freed = self._slot_map.release(rid)
        self._slot_epoch += 1
        self._reset_slots(freed)

    def reset_request(self, rid: Hashable, free: bool = False) -> None:
        """Set ``rid``'s counters to 0 (dummy requests of CUDA-graph capture); ``free`` also removes it.

        Raises:
          ValueError: ``rid`` was never ingested.
          TypeError: ``free`` is not a bool.
        """
        if not isinstance(free, bool):
            raise TypeError(f"free={free!r} must be a bool")
        slots = self._request_slots(rid)
        if free:
            self.remove_request(rid)
        else:
            self._reset_slots(list(slots))

    def position(self, rid: Hashable, label: str) -> int:
        """The next position of stream ``(rid, label)`` (committed counters, no device read).

        Raises:
          ValueError: unknown request or label.
        """
        return int(self._shadow[self._slot(rid, label)])

    # ---------------------------------------------------------------- plan / commit

    def plan(self, step: PositionStep, ctx: StepContext) -> Dict[str, torch.Tensor]:
        """Position ids of a step, one int32 vector per plan label, built on the device.

        Plan labels and token order come from the KV plan output
        ``ctx.plan_results[config.kv_resource]`` (``{plan_label: KVPlanOutput}``), or,
        without one, from the segments (each stream label its own plan label).
        The pre-forks are applied first; then view ``v`` with ``n`` tokens gets
        ``counter + arange(n)`` (SEQUENTIAL) or ``n`` copies of ``counter`` (BLOCK).
        Explicit ``step.pos_ids`` win for the labels they name.

        Without a graph slot each vector is ``[n]`` for the plan label's ``n`` live
        tokens. Under ``ctx.graph_slot`` it is the static buffer of ``(graph_slot,
        plan_label)``, ``[bucket.num_tokens]``: the first ``n`` entries are written,
        the rest keep their previous values.

        ``ctx.is_preplan`` stages the plan (for step N+1 while step N runs): its
        positions are computed from the counters as they will be once the current
        plan commits (with its post-forks), its pre-forks reach the counters only
        when it becomes current (at the current plan's commit, or at first use when
        there is none), and :meth:`clear_preplan` drops it. A plan that is not a
        preplan replaces the current plan and drops a staged one.

        Returns:
          ``{plan_label: torch.Tensor}`` int32 on ``device``.

        Raises:
          TypeError: ``step`` or ``ctx`` has the wrong type, or a view/segment is
            not a 3-tuple.
          ValueError: a request never ingested, an unknown label, a negative count,
            a stream with two views in one plan label, two forks into one stream from
            different sources, explicit pos_ids of the wrong shape/dtype/device or
            outside ``[0, max_seq_len)`` (checked with one host read), more tokens than
            the graph bucket holds, or positions past ``max_seq_len``.
          RuntimeError: called under CUDA-graph capture with the Triton counter store
            (nothing changes; plan outside the capture, replay reads graph buffers).
        """
        if not isinstance(step, PositionStep):
            raise TypeError(f"step must be a PositionStep, got {type(step).__name__}")
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        groups, pre_forks, post_forks = self._views(step, ctx)
        explicit = self._explicit_pos_ids(step.pos_ids, groups)
        graph = ctx.graph_slot
        if graph is not None and not isinstance(graph, GraphSlot):
            raise TypeError(f"ctx.graph_slot must be a GraphSlot or None, got {type(graph).__name__}")

        labels: List[Tuple[str, np.ndarray, np.ndarray, np.ndarray, int]] = []
        for plan_label, views in groups.items():
            slots, counts, starts, total = self._view_arrays(plan_label, views)
            if graph is not None and total > graph.bucket.num_tokens:
                raise ValueError(f"plan label {plan_label!r} has {total} tokens, more than "
                                 f"graph bucket num_tokens={graph.bucket.num_tokens}")
            given = explicit.get(plan_label)
            if given is not None and given.shape[0] != total:
                raise ValueError(f"step.pos_ids[{plan_label!r}].shape={tuple(given.shape)} must be "
                                 f"[{total}] (the plan label's tokens)")
            labels.append((plan_label, slots, counts, starts, total))
        pre_src, pre_dst = self._fork_arrays(pre_forks, "pre_forks")
        # A decode step's segments usually are its views (same streams, same counts):
        # reuse their arrays instead of looking the streams up twice.
        segments = step.segments
        reuse = None
        if len(groups) == 1:
            (views,) = groups.values()
            if len(views) == len(segments) and tuple(views) == segments:
                reuse = labels[0][1], labels[0][2]
        commit = self._commit_plan(segments, step.advance, post_forks, reuse)

        speculative = (self._effective_commit(self._current)
                       if ctx.is_preplan and self._current is not None else None)
        shadow = self._shadow if speculative is None else self._committed_shadow(speculative)
        if len(pre_src):
            shadow = shadow.copy()
            shadow[pre_dst] = shadow[pre_src]
        # Sufficient first: no counter is high enough for any view to pass max_seq_len.
        peak = int(shadow.max()) if labels else 0
        for plan_label, slots, counts, _, total in labels:
            if plan_label not in explicit and peak + total > self.max_seq_len:
                self._check_plan_bounds(shadow, slots, counts, plan_label, groups[plan_label])

        # Nothing below raises on valid input: state changes start here.
        tensors, arrays, limits = self._run_plan(labels, pre_src, pre_dst, explicit, graph,
                                                 speculative, ctx.is_preplan)
        self._plan_labels_seen.update(groups)
        plan = _Plan(step=step, tensors=tensors, arrays=arrays, limits=limits, commit=commit,
                     pre_forks=pre_forks, post_forks=post_forks, groups=groups)
        if ctx.is_preplan:
            self._staged = plan
        else:
            self._shadow = shadow
            self._current, self._staged = plan, None
        return dict(tensors)

    def commit(self, step: PositionStep, ctx: StepContext) -> None:
        """Advance the counters by what the planned step consumed, then apply its post-forks.

        SEQUENTIAL adds each segment's span, BLOCK adds ``block_step`` per non-empty
        segment, and ``step.advance`` replaces either for the streams it covers.
        ``step`` must carry the segments (and advance) of the current plan (a staged
        plan becomes current when there is none). A staged plan becomes current
        after the commit.

        Raises:
          TypeError: ``step`` or ``ctx`` has the wrong type.
          ValueError: no plan to commit, segments or advance differing from the
            plan's, or a counter that would pass ``max_seq_len``.
        """
        if not isinstance(step, PositionStep):
            raise TypeError(f"step must be a PositionStep, got {type(step).__name__}")
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        plan, staged_first = self._current, False
        if plan is None:
            plan, staged_first = self._staged, True
        if plan is None:
            raise ValueError("commit without a plan: call plan(step, ctx) for this step first")
        planned = plan.step
        if step is not planned and (step.segments != planned.segments or
                                    step.advance != planned.advance):
            raise ValueError(f"commit's segments/advance do not match the plan's "
                             f"({len(step.segments)} segments vs {len(planned.segments)} planned); "
                             "commit the step that was planned")
        commit = self._effective_commit(plan)
        forks = self._promotion_forks(plan) if staged_first else None
        shadow = self._shadow
        if forks is not None:
            shadow = shadow.copy()
            shadow[forks[1]] = shadow[forks[0]]
        shadow = self._committed_shadow(commit, shadow)
        self._check_commit_bounds(shadow, commit)

        if forks is not None:
            self._store.fork(*forks)
        self._store.defer(commit)
        self._shadow = shadow
        self._current = None
        if staged_first:
            self._staged = None
        elif self._staged is not None:
            self._apply_promotion(self._staged)
            self._current, self._staged = self._staged, None

    def clear_preplan(self) -> None:
        """Drop the staged plan. Its forks never reached the counters, so nothing else changes."""
        self._staged = None

    def pos_ids(self, label: str) -> Optional[torch.Tensor]:
        """The current plan's position ids for plan label ``label``, or None if it has none.

        A staged plan becomes current here when there is no current one.

        Raises:
          ValueError: ``label`` is neither a configured label nor a plan label seen
            in any plan.
        """
        _check_hashable(label, "label")
        if label not in self._plan_labels_seen:
            raise ValueError(f"label={label!r} is unknown: not a configured label "
                             f"{list(self._labels)} nor a plan label of any plan")
        plan = self._active_plan()
        return None if plan is None else plan.tensors.get(label)

    # ---------------------------------------------------------------- publish / admit

    def publish(self, request_id: Hashable) -> Optional[PublishedPositionInfo]:
        """``{label: next position}`` of every stream of the request; None for an unknown request."""
        _check_hashable(request_id, "request_id")
        slots = self._requests.get(request_id)
        if slots is None:
            return None
        return PublishedPositionInfo(dict(zip(self._labels, self._shadow[list(slots)].tolist())))

    def publish_snapshot_for_step(self, request_id: Hashable, node_name: Optional[str],
                                  graph_walk: Optional[str]) -> Optional[Tuple[int, ...]]:
        """A cheap record of what :meth:`publish` returns now: the counters as a tuple of ints.

        Returns None for an unknown request. Later counter changes do not alter it.

        Example:
          >>> from torch_bridge import PositionConfig
          >>> mgr = PositionManager(PositionConfig(), "cpu"); mgr.ingest_request("r0")
          >>> snap = mgr.publish_snapshot_for_step("r0", None, None)
          >>> mgr.apply_cached_prefix("r0", None, None, None, {"text": 9})
          >>> mgr.publish_from_snapshot("r0", snap, None, None).counters
          {'text': 0}
        """
        slots = self._requests.get(request_id)
        if slots is None:
            return None
        return tuple(self._shadow[list(slots)].tolist())

    def publish_from_snapshot(self, request_id: Hashable, snapshot: Optional[Tuple[int, ...]],
                              node_name: Optional[str],
                              graph_walk: Optional[str]) -> Optional[PublishedPositionInfo]:
        """The :class:`PublishedPositionInfo` that :meth:`publish` returned when ``snapshot`` was taken.

        Raises:
          TypeError: ``snapshot`` is not a record from :meth:`publish_snapshot_for_step`.
        """
        if snapshot is None:
            return None
        if (not isinstance(snapshot, tuple) or len(snapshot) != len(self._labels)
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in snapshot)):
            raise TypeError(f"snapshot={snapshot!r} must be a tuple of {len(self._labels)} ints "
                            "from publish_snapshot_for_step")
        return PublishedPositionInfo(dict(zip(self._labels, snapshot)))

    def admit_retrieve(self, rid: Hashable, node_name: Optional[str], graph_walk: Optional[str],
                       published: Optional[PublishedPositionInfo]) -> AdmitOutcome:
        """Take on published counters: per label ``counter = max(counter, published)``.

        Monotonic, so a stale echo of this node's own publication never rewinds a
        stream. ``node_name`` and ``graph_walk`` do not change positions (a stream is
        ``(rid, label)``).

        Returns:
          ``AdmitOutcome(True, True)`` when taken on (or nothing was published);
          ``ok=False`` with a reason, and no change, for an unknown request or label or
          a position outside ``[0, max_seq_len]``.

        Raises:
          TypeError: ``published`` is not a PublishedPositionInfo (or None).
        """
        if published is None:
            return AdmitOutcome(True, True)
        if not isinstance(published, PublishedPositionInfo):
            raise TypeError(f"published must be a PublishedPositionInfo or None, got "
                            f"{type(published).__name__}")
        _check_hashable(rid, "rid")
        if rid not in self._requests:
            return AdmitOutcome(False, False, f"request_id={rid!r} was never ingested")
        try:
            targets = self._positions_arg(published.counters, "published.counters")
        except ValueError as e:
            return AdmitOutcome(False, False, str(e))
        self._raise_to(rid, targets)
        return AdmitOutcome(True, True)

    def apply_cached_prefix(self, rid: Hashable, node_name: Optional[str],
                            graph_walk: Optional[str], inputs: Any,
                            prefix: Optional[Mapping[str, int]]) -> None:
        """Move streams past what the prefix cache holds: ``counter = max(counter, cached)``.

        Args:
          prefix: ``{label: cached tokens}`` of this walk (None: nothing cached). The
            value is absolute, so repeating the probe moves nothing.
          inputs, node_name, graph_walk: the walk's context; positions do not use them.

        Raises:
          ValueError: unknown request or label, or a length outside ``[0, max_seq_len]``.
        """
        self._request_slots(rid)
        targets = self._positions_arg(prefix or {}, "prefix")
        if targets:
            self._raise_to(rid, targets)

    # ---------------------------------------------------------------- inspection

    @property
    def table(self) -> PositionTable:
        """The committed counters as a :class:`jaxrope.PositionTable` (int32 ``[capacity]``)."""
        return self._store.table()

    @property
    def labels(self) -> Tuple[str, ...]:
        """The configured stream labels."""
        return self._labels

    def requests(self) -> List[Hashable]:
        """The ingested request ids."""
        return list(self._requests)

    def state_snapshot(self) -> Dict[str, Any]:
        """A deep copy of every piece of mutable state, for tests and debugging; changes nothing.

        Two snapshots compare equal with ``==`` exactly when the manager is in the same
        state: arrays are copied out as tuples of ints, plans are compared by identity
        plus their contents (a plan's positions and the requests dropped from it).

        Returns:
          ``{"counters": {(rid, label): int}`` (host shadow), ``"table"``: device counters
          with any deferred commit applied, ``"shadow"``: all host counters (free slots
          included), ``"requests"``: ``{rid: slots}``, ``"slot_map"``: capacity, live,
          peak and free list, ``"current"`` / ``"staged"``: the plans (or None),
          ``"graph_buffers"``: ``{(graph_slot, plan_label): values}``,
          ``"plan_labels"``: every label ``apply_qk`` / ``pos_ids`` accept``}``.

        Example:
          >>> from torch_bridge import PositionConfig
          >>> mgr = PositionManager(PositionConfig(), "cpu"); mgr.ingest_request("r0")
          >>> before = mgr.state_snapshot()
          >>> mgr.ingest_request("r0")
          >>> mgr.state_snapshot() == before, before["counters"]
          (True, {('r0', 'text'): 0})
        """
        table = self._store.table()
        slot_map = self._slot_map
        return {
            "counters": {stream: int(self._shadow[slot]) for stream, slot in self._slot_of.items()},
            "table": tuple(np.asarray(table.counters).tolist()),
            "shadow": tuple(self._shadow.tolist()),
            "requests": dict(self._requests),
            "slot_map": {"capacity": slot_map.capacity, "live": len(slot_map),
                         "peak": slot_map.peak, "free": tuple(slot_map._free)},
            "current": _plan_state(self._current),
            "staged": _plan_state(self._staged),
            "graph_buffers": {key: tuple(buffer.tolist())
                              for key, buffer in self._graph_buffers.items()},
            "plan_labels": frozenset(self._plan_labels_seen),
        }

    # ---------------------------------------------------------------- internals

    def _grow(self) -> None:
        capacity = self._slot_map.capacity
        if capacity > self._shadow.shape[0]:
            self._store.grow(capacity)
            self._shadow = np.pad(self._shadow, (0, capacity - self._shadow.shape[0]))

    def _request_slots(self, rid: Hashable) -> Tuple[int, ...]:
        _check_hashable(rid, "rid")
        slots = self._requests.get(rid)
        if slots is None:
            raise ValueError(f"request_id={rid!r} was never ingested (call ingest_request first)")
        return slots

    def _slot(self, rid: Hashable, label: str) -> int:
        _check_hashable(rid, "rid")
        _check_hashable(label, "label")
        slot = self._slot_of.get((rid, label))
        if slot is None:
            self._request_slots(rid)
            raise ValueError(f"label={label!r} is not one of the configured labels {list(self._labels)}")
        return slot

    def _slots(self, rids: Sequence[Hashable], labels: Sequence[str]) -> np.ndarray:
        try:
            return np.fromiter(map(self._slot_of.__getitem__, zip(rids, labels)), np.int32,
                               len(rids))
        except (KeyError, TypeError):
            for rid, label in zip(rids, labels):
                self._slot(rid, label)
            raise

    def _positions_arg(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        if not isinstance(values, Mapping):
            raise ValueError(f"{name}={values!r} must be a mapping {{label: position}}")
        out = {}
        for label, position in values.items():
            if label not in self._label_set:
                raise ValueError(f"{name} names label={label!r}, not one of {list(self._labels)}")
            if (not isinstance(position, (int, np.integer)) or isinstance(position, bool)
                    or not 0 <= position <= self.max_seq_len):
                raise ValueError(f"{name}[{label!r}]={position!r} must be an int in "
                                 f"[0, {self.max_seq_len}] (max_seq_len)")
            out[self._labels.index(label)] = int(position)
        return out

    def _raise_to(self, rid: Hashable, targets: Dict[int, int]) -> None:
        request = self._requests[rid]
        slots = [request[i] for i in targets]
        values = list(targets.values())
        self._store.raise_to(slots, values)
        self._shadow[slots] = np.maximum(self._shadow[slots], values)

    def _reset_slots(self, slots: List[int]) -> None:
        if not slots:
            return
        self._store.reset(slots)
        self._shadow[slots] = 0

    def _views(self, step: PositionStep, ctx: StepContext):
        """``({plan_label: views}, pre_forks, post_forks)`` of a step."""
        kv = ctx.plan_results.get(self.config.kv_resource)
        if kv is None:
            lists: Dict[str, List[Any]] = {}
            for segment in step.segments:
                lists.setdefault(_label_of(segment), []).append(segment)
            return {label: tuple(views) for label, views in lists.items()}, (), ()
        if not isinstance(kv, Mapping):
            raise TypeError(f"ctx.plan_results[{self.config.kv_resource!r}] must be a mapping "
                            f"{{plan_label: KVPlanOutput}}, got {type(kv).__name__}")
        groups, pre, post = {}, [], []
        for plan_label, output in kv.items():
            if not isinstance(output, KVPlanOutput):
                raise TypeError(f"ctx.plan_results[{self.config.kv_resource!r}][{plan_label!r}] "
                                f"must be a KVPlanOutput, got {type(output).__name__}")
            groups[plan_label] = output.views
            pre.extend(output.pre_forks)
            post.extend(output.post_forks)
        return groups, tuple(pre), tuple(post)

    def _view_arrays(self, plan_label: str, views: Sequence[Any]
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Slots, counts, token offsets and total of a plan label's views, checked; the
        last step's when they repeat.

        A continuous batch sends the same views step after step until a request joins
        or leaves: comparing the records costs a sixth of looking every stream up.
        ``_slot_epoch`` changes whenever a stream's slot may have.
        """
        cached = self._last_views.get(plan_label)
        # The snapshot holds plain tuples: a record that is a list (mutable) never equals it.
        if cached is not None and cached[0] == self._slot_epoch and cached[1] == views:
            return cached[2]
        slots, counts = self._stream_arrays(views, f"the views of plan label {plan_label!r}")
        if len(set(slots.tolist())) != len(slots):
            _reject_repeated_stream(slots, views, plan_label)
        starts, total = view_offsets(counts)
        for array in (slots, counts, starts):
            array.flags.writeable = False
        arrays = (slots, counts, starts, total)
        if len(self._last_views) > _MAX_BOUND:
            self._last_views.clear()
        self._last_views[plan_label] = (self._slot_epoch, tuple(map(tuple, views)), arrays)
        return arrays

    def _stream_arrays(self, records: Sequence[Any], what: str) -> Tuple[np.ndarray, np.ndarray]:
        """Slots and token counts of ``(request_id, label, count)`` records (views, segments)."""
        if not records:
            return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
        try:
            rids, labels, counts = zip(*records)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{what} must be (request_id, label, count) tuples: {e}") from e
        return self._slots(rids, labels), _counts_array(counts, f"the counts of {what}")

    def _fork_arrays(self, forks: Sequence[Fork], name: str) -> Tuple[np.ndarray, np.ndarray]:
        if not forks:
            return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
        try:
            rids, sources, targets = zip(*forks)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be (request_id, from_label, to_label) tuples: {e}") from e
        src, dst = self._slots(rids, sources), self._slots(rids, targets)
        if len(set(dst.tolist())) != len(dst):
            _reject_conflicting_forks(src, dst, forks, name)
        return src, dst

    def _commit_plan(self, segments: Sequence[Any], advance: Any, post_forks: Sequence[Fork],
                     arrays: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> CommitArrays:
        """A step's commit; ``arrays`` are the segments' (slots, spans) when already known."""
        slots, spans = arrays or self._stream_arrays(segments, "step.segments")
        adv_slots: List[int] = []
        adv_amounts: List[int] = []
        if advance is None:
            pass
        elif isinstance(advance, Mapping):
            present = set(slots.tolist())
            for stream, amount in advance.items():
                if not isinstance(stream, tuple) or len(stream) != 2:
                    raise ValueError(f"step.advance key {stream!r} must be (request_id, label)")
                slot = self._slot(*stream)
                if slot not in present:
                    raise ValueError(f"step.advance names stream {stream!r}, which has no segment "
                                     "in the step")
                adv_slots.append(slot)
                adv_amounts.append(_amount(amount, f"step.advance[{stream!r}]"))
            keep = ~np.isin(slots, adv_slots)
            slots, spans = slots[keep], spans[keep]
        else:
            amount = _amount(advance, "step.advance")
            adv_slots = list(dict.fromkeys(slots.tolist()))
            adv_amounts = [amount] * len(adv_slots)
            slots, spans = np.zeros((0,), np.int64), np.zeros((0,), np.int64)
        fork_src, fork_dst = self._fork_arrays(post_forks, "post_forks")
        # Views were checked for repeated streams; other segments may repeat one.
        return CommitArrays(slots=slots, spans=spans, adv_slots=np.asarray(adv_slots, np.int64),
                            adv_amounts=np.asarray(adv_amounts, np.int64), fork_src=fork_src,
                            fork_dst=fork_dst, distinct=arrays is not None)

    def _effective_commit(self, plan: _Plan) -> CommitArrays:
        """The plan's commit without the streams of requests removed since it was made."""
        if not plan.dropped:
            return plan.commit
        advance = plan.step.advance
        if isinstance(advance, Mapping):
            advance = {s: a for s, a in advance.items() if s[0] not in plan.dropped}
        return self._commit_plan(_without(plan.step.segments, plan.dropped), advance,
                                 _without(plan.post_forks, plan.dropped))

    def _committed_shadow(self, commit: CommitArrays, shadow: Optional[np.ndarray] = None) -> np.ndarray:
        """The host counters after ``commit`` (same rules as :func:`jaxrope.positions.commit`)."""
        new = (self._shadow if shadow is None else shadow).copy()
        amounts = commit.amounts(self.config.scheme, self.config.block_step)
        if commit.distinct:
            new[commit.slots] += amounts
        else:
            np.add.at(new, commit.slots, amounts)
        if len(commit.adv_slots):
            np.add.at(new, commit.adv_slots, commit.adv_amounts)
        if len(commit.fork_src):
            new[commit.fork_dst] = new[commit.fork_src]
        return new

    def _check_plan_bounds(self, shadow: np.ndarray, slots: np.ndarray, counts: np.ndarray,
                           plan_label: str, views: Sequence[Any]) -> None:
        if not len(slots):
            return
        base = shadow[slots]
        if self.config.scheme is Scheme.SEQUENTIAL:
            bad = base + counts > self.max_seq_len
        else:
            bad = (counts > 0) & (base >= self.max_seq_len)
        if bad.any():
            i = int(np.argmax(bad))
            rid, label = views[i][0], views[i][1]
            raise ValueError(f"stream ({rid!r}, {label!r}) of plan label {plan_label!r} at position "
                             f"{int(base[i])} with {int(counts[i])} tokens passes "
                             f"max_seq_len={self.max_seq_len}")

    def _check_commit_bounds(self, shadow: np.ndarray, commit: CommitArrays) -> None:
        # Post-fork targets too: a fork can carry an overflowing counter to a stream
        # whose own advance did not overflow, after the source was overwritten.
        touched = commit.slots
        if len(commit.adv_slots) or len(commit.fork_dst):
            touched = np.concatenate([touched, commit.adv_slots, commit.fork_dst])
        if len(touched) and shadow[touched].max() > self.max_seq_len:
            slot = int(touched[np.argmax(shadow[touched])])
            raise ValueError(f"commit would move slot {slot} to {int(shadow[slot])}, past "
                             f"max_seq_len={self.max_seq_len}")

    def _explicit_pos_ids(self, given: Any, groups: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
        if given is None:
            return {}
        if isinstance(given, torch.Tensor):
            if len(groups) != 1:
                raise ValueError(f"step.pos_ids is one tensor but the step has {len(groups)} plan "
                                 f"labels {list(groups)}; pass {{plan_label: tensor}}")
            given = {next(iter(groups)): given}
        if not isinstance(given, Mapping):
            raise TypeError(f"step.pos_ids must be None, a tensor or {{plan_label: tensor}}, got "
                            f"{type(given).__name__}")
        out = {}
        for plan_label, tensor in given.items():
            where = f"step.pos_ids[{plan_label!r}]"
            if plan_label not in groups:
                raise ValueError(f"{where}: not a plan label of the step ({list(groups)})")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
            if tensor.ndim != 1 or tensor.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{where} has shape={tuple(tensor.shape)} dtype={tensor.dtype}; "
                                 "expected int32 or int64 [n]")
            if tensor.device != self.device:
                raise ValueError(f"{where} is on {tensor.device}, expected {self.device}")
            if tensor.numel():
                # One host read: an out-of-range explicit position would rotate silently.
                low, high = torch.stack(torch.aminmax(tensor)).tolist()
                if low < 0 or high >= self.max_seq_len:
                    raise ValueError(f"{where} has values in [{low}, {high}]; positions must lie in "
                                     f"[0, {self.max_seq_len}) (max_seq_len)")
            out[plan_label] = tensor.to(torch.int32).contiguous()
        return out

    def _graph_buffer(self, graph: GraphSlot, plan_label: str) -> torch.Tensor:
        key = (graph, plan_label)
        buffer = self._graph_buffers.get(key)
        if buffer is None:
            buffer = self._graph_buffers[key] = torch.zeros(
                (graph.bucket.num_tokens,), dtype=torch.int32, device=self.device)
        return buffer

    def _run_plan(self, labels, pre_src, pre_dst, explicit, graph, speculative, preplan):
        """The deferred commit, the speculative one and the positions: one store call."""
        tensors: Dict[str, torch.Tensor] = {}
        arrays: Dict[str, jax.Array] = {}
        limits: Dict[str, int] = {}
        requests, computed = [], []
        for plan_label, slots, counts, starts, total in labels:
            buffer = None if graph is None else self._graph_buffer(graph, plan_label)
            limits[plan_label] = total if buffer is None else buffer.shape[0]
            given = explicit.get(plan_label)
            if given is not None:
                if buffer is None:
                    tensors[plan_label] = given
                else:
                    buffer[:total].copy_(given)
                    tensors[plan_label] = buffer
                continue
            requests.append((slots, counts, starts, total, buffer))
            computed.append(plan_label)
        results = self._store.plan(requests, pre_src, pre_dst, speculative, preplan)
        for plan_label, (tensor, array) in zip(computed, results):
            tensors[plan_label] = tensor
            if array is not None:
                arrays[plan_label] = array
        return tensors, arrays, limits

    def _promotion_forks(self, plan: _Plan) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Slots ``(src, dst)`` of a staged plan's pre-forks, applied when it becomes current."""
        forks = _without(plan.pre_forks, plan.dropped) if plan.dropped else plan.pre_forks
        return self._fork_arrays(forks, "pre_forks") if forks else None

    def _apply_promotion(self, plan: _Plan) -> None:
        # Device first: a store that refuses (e.g. under CUDA-graph capture) changes nothing.
        forks = self._promotion_forks(plan)
        if forks is not None:
            self._store.fork(*forks)
            self._shadow[forks[1]] = self._shadow[forks[0]]

    def _active_plan(self) -> Optional[_Plan]:
        if self._current is None and self._staged is not None:
            self._apply_promotion(self._staged)
            self._current, self._staged = self._staged, None
        return self._current


class RopeManager(PositionManager):
    """Rotary position embedding on top of :class:`PositionManager`: ``apply_qk`` in place.

    Args:
      config: a :class:`~torch_bridge.PositionConfig`; ``config.rope`` None builds
        ``RopeConfig(head_dim=head_dim, max_position=max(max_seq_len, 131072))``.
      device: the torch device of q, k and the position ids.
      max_seq_len: positions stay below it; at most ``config.rope.max_position``.
      head_dim: ``D``; must equal ``config.rope.head_dim`` when both are given.
      dtype: the engine's activation dtype (float32, float16 or bfloat16), kept for
        the seed's signature. q and k are rotated in their own dtype (the seed cast
        to this dtype; float32 inputs here stay float32).
      launcher: the fast path ``apply_qk`` tries first: "auto" (the Triton launcher
        on CUDA when available), "jax" (always the JAX path), or an object with
        ``rotate_(q, k, pos_ids, cfg)`` (see :class:`torch_bridge.rotate.Launcher`).
      backend: the jaxrope backend of the JAX path ("auto", "pallas", "xla", "interpret").
      allow_copy: let the JAX path stage non-contiguous or misaligned q/k through a
        contiguous copy (written back in place); False raises instead.
      counters: where the counters live, as in :class:`PositionManager`.

    Attributes:
      launcher: the resolved launcher, or None; assignable.
      rope: the base :class:`jaxrope.RopeConfig`.

    Raises:
      ValueError: an invalid argument (named in the message).

    Example:
      >>> import torch, jaxrope as jr
      >>> from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
      >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu")
      >>> mgr.ingest_request("r0")
      >>> step, ctx = PositionStep([Segment("r0", "text", 3)]), StepContext(("r0",))
      >>> _ = mgr.plan(step, ctx)
      >>> q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
      >>> q2, k2 = mgr.apply_qk(q, k, "text")
      >>> q2 is q
      True
      >>> mgr.commit(step, ctx)
    """

    def __init__(self, config: PositionConfig, device: Any, max_seq_len: int = 32768,
                 head_dim: Optional[int] = None, dtype: torch.dtype = torch.bfloat16, *,
                 launcher: Any = "auto", backend: str = "auto", allow_copy: bool = True,
                 counters: str = "auto"):
        super().__init__(config, device, max_seq_len, counters=counters)
        rope = config.rope
        if rope is None:
            if head_dim is None:
                raise ValueError("head_dim is required when config.rope is None")
            rope = RopeConfig(head_dim=head_dim, max_position=max(max_seq_len, 131072))
        elif head_dim is not None and head_dim != rope.head_dim:
            raise ValueError(f"{head_dim=} must equal config.rope.head_dim={rope.head_dim}")
        if max_seq_len > rope.max_position:
            raise ValueError(f"{max_seq_len=} must be <= config.rope.max_position={rope.max_position}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{dtype=} must be one of {list(SUPPORTED_DTYPES)}")
        if not isinstance(allow_copy, bool):
            raise ValueError(f"{allow_copy=} must be a bool")
        self.rope = rope
        self.head_dim = rope.head_dim
        self.dtype = dtype
        self.allow_copy = allow_copy
        self._bound: Dict[Tuple, Any] = {}  # call signature -> bound launch (see apply_qk)
        self.launcher = resolve_launcher(launcher, self.device)
        self._configs = ConfigCache(rope)
        self._jax = JaxRotation(self._jax_device, backend)

    @property
    def launcher(self) -> Any:
        """The fast path ``apply_qk`` tries first (None: always JAX); assignable."""
        return self._launcher

    @launcher.setter
    def launcher(self, value: Any) -> None:
        # Launches bound by the previous launcher must not outlive it.
        self._launcher = value
        self._bound = {}

    @classmethod
    def _build_kwargs(cls, info: EngineInfo) -> Dict[str, Any]:
        return {**super()._build_kwargs(info), "head_dim": info.head_dim, "dtype": info.dtype}

    def _fingerprint_payload(self) -> bytes:
        return super()._fingerprint_payload() + b"|" + self.rope.fingerprint()

    def apply_qk(self, q: torch.Tensor, k: torch.Tensor, label: str,
                 rotary_dim: Optional[int] = None, interleave: Optional[bool] = None,
                 rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                 rope_dtype: Optional[torch.dtype] = None,
                 **llama31: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k`` in place at the planned positions of plan label ``label``.

        Args:
          q: ``[T, Hq, D]`` or ``[T, Hq * D]``, float32/float16/bfloat16, on ``device``.
          k: ``[T, Hk, D]`` or ``[T, Hk * D]``, same dtype, device and ``T``.
          label: a plan label of the current plan; token ``t`` gets ``pos_ids(label)[t]``.
            ``T`` may be less than the planned tokens (the first ``T`` are used).
          rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor,
            high_freq_factor, old_context_len: per-call overrides with FlashInfer's
            meaning (see :class:`torch_bridge.rotate.ConfigCache`).
          rope_dtype: accepted for the seed's signature; the math is float32 (from
            float64 frequencies) whatever it says, and q/k keep their dtype.

        Returns:
          ``(q, k)``: the same tensors, rotated. Dims ``[rotary_dim, D)`` are untouched.

        Ordering: on CUDA the rotation runs after the work queued on torch's current
        stream and before whatever is queued next on it; there is no host sync.
        Zero copy: the launcher works on the tensors themselves; the JAX path
        imports them through DLPack and writes into them (see
        :mod:`torch_bridge.dlpack`; on CPU it copies the result back).

        Raises:
          ValueError: no positions planned for ``label`` (or it is unknown), q/k of the
            wrong rank, head size, dtype, device or token count (more tokens than
            planned), or an invalid override.
          TypeError: q or k not a tensor, or an unknown keyword argument.
          RuntimeError: called under CUDA-graph capture without a launcher that
            accepts the call.
        """
        # Peek: a staged plan becomes current (its pre-forks apply) only once the call is valid.
        plan = self._current if self._current is not None else self._staged
        # A call whose signature passed every check below before takes the bound launch:
        # on the host of an H200 each Python-level check costs about a microsecond.
        overrides = (rotary_dim, interleave, rope_scale, rope_theta, rope_dtype)
        if self._bound and not llama31 and plan is not None:
            try:
                bound = self._bound.get(_call_signature(label, q, k, overrides))
            except (AttributeError, TypeError):  # not tensors, or unhashable: checked below
                bound = None
            if bound is not None:
                pos = plan.tensors.get(label)
                if pos is not None and q.shape[0] <= plan.limits[label]:
                    if self._current is None:
                        self._active_plan()
                    if bound(q, k, pos):
                        return q, k
        _check_hashable(label, "label")
        if plan is None or label not in plan.tensors:
            if label not in self._plan_labels_seen:
                raise ValueError(f"label={label!r} is unknown: not a configured label "
                                 f"{list(self._labels)} nor a plan label of any plan")
            raise ValueError(f"no positions planned for label={label!r}: call plan() for this step")
        q3, k3 = self._heads(q, "q"), self._heads(k, "k")
        if q.dtype != k.dtype:
            raise ValueError(f"k.dtype={k.dtype} must equal q.dtype={q.dtype}")
        tokens = q3.shape[0]
        if k3.shape[0] != tokens:
            raise ValueError(f"k.shape[0]={k3.shape[0]} must equal q.shape[0]={tokens} (tokens)")
        if tokens > plan.limits[label]:
            raise ValueError(f"q has {tokens} tokens but plan label {label!r} has "
                             f"{plan.limits[label]} planned positions")
        if rope_dtype is not None and not isinstance(rope_dtype, torch.dtype):
            raise ValueError(f"{rope_dtype=} must be a torch.dtype or None")
        cfg = self._configs.get(rotary_dim, interleave, rope_scale, rope_theta, **llama31)
        self._active_plan()
        if tokens == 0:
            return q, k
        if self.launcher is not None:
            try:
                # The launcher reads the first ``tokens`` positions; no slice (a view per
                # call costs microseconds on the hot path).
                self.launcher.rotate_(q3, k3, plan.tensors[label], cfg)
            except LaunchUnavailable:
                pass
            else:
                bind = getattr(self.launcher, "bind", None)
                if bind is not None and not llama31:
                    if len(self._bound) >= _MAX_BOUND:
                        self._bound.clear()
                    self._bound[_call_signature(label, q, k, overrides)] = bind(q3, k3, cfg)
                return q, k
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("apply_qk under CUDA-graph capture needs the launcher: the JAX path "
                               "runs on JAX's stream, which the capture cannot record, and the "
                               f"launcher is {'off' if self.launcher is None else 'declining'}")
        self._jax(q3, k3, plan.array(label), cfg, allow_copy=self.allow_copy)
        return q, k

    def _heads(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device}, expected {self.device} (the manager's device)")
        if x.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} must be one of {list(SUPPORTED_DTYPES)}")
        if x.requires_grad:
            raise ValueError(f"{name}.requires_grad=True: apply_qk rotates in place; run under "
                             "torch.no_grad() on tensors autograd does not track")
        if x.ndim == 2:
            if x.shape[1] % self.head_dim:
                raise ValueError(f"{name}.shape={tuple(x.shape)}: {x.shape[1]} is not a multiple of "
                                 f"head_dim={self.head_dim}")
            try:
                return x.view(x.shape[0], x.shape[1] // self.head_dim, self.head_dim)
            except RuntimeError as e:
                raise ValueError(f"{name}.shape={tuple(x.shape)} with stride={x.stride()} cannot be "
                                 f"viewed as [T, H, {self.head_dim}]: {e}") from e
        if x.ndim != 3 or x.shape[2] != self.head_dim:
            raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, H, {self.head_dim}] or "
                             f"[T, H * {self.head_dim}]")
        return x


def _call_signature(label: Hashable, q: torch.Tensor, k: torch.Tensor,
                    overrides: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """What ``apply_qk``'s checks depend on, apart from the plan: the key of a bound launch."""
    return (label, q.shape, k.shape, q.dtype, k.dtype, q.device, k.device, q.requires_grad,
            k.requires_grad, overrides)


def _torch_device(device: Any) -> torch.device:
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device={device!r} is not a torch device: {e}") from e
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ValueError(f"device={str(device)!r}: no such CUDA device ({count} visible)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _label_of(segment: Any) -> str:
    try:
        label = segment[1]
    except (TypeError, IndexError) as e:
        raise TypeError(f"step.segments must be (request_id, label, span) tuples, got {segment!r}") from e
    _check_hashable(label, "label")
    return label


def _counts_array(values: Sequence[Any], name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be ints, got {values[:4]!r}...")
    if len(array) and array.min() < 0:
        raise ValueError(f"{name} must be >= 0, got {int(array.min())}")
    return array.astype(np.int64, copy=False)


def _amount(value: Any, name: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    return int(value)


def _check_hashable(value: Any, name: str) -> None:
    try:
        hash(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} must be hashable: {e}") from e


def _reject_repeated_stream(slots: np.ndarray, views: Sequence[Any], plan_label: str) -> None:
    _, first = np.unique(slots, return_index=True)
    i = min(set(range(len(slots))) - set(first.tolist()))
    raise ValueError(f"stream ({views[i][0]!r}, {views[i][1]!r}) has more than one view in plan "
                     f"label {plan_label!r}; its positions would overlap: give each stream one view "
                     "per plan label")


def _reject_conflicting_forks(src: np.ndarray, dst: np.ndarray, forks: Sequence[Any],
                              name: str) -> None:
    # The same fork listed twice (e.g. by two plan labels) is harmless; two sources for
    # one target are not: the device scatter would pick either.
    source_of: Dict[int, int] = {}
    for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
        if source_of.setdefault(d, s) != s:
            rid, _, label = forks[i]
            raise ValueError(f"{name} copy two different counters into stream ({rid!r}, {label!r})")


def _without(records: Sequence[Any], rids: set) -> Tuple[Any, ...]:
    return tuple(r for r in records if r[0] not in rids)


def _plan_state(plan: Optional[_Plan]) -> Optional[Dict[str, Any]]:
    if plan is None:
        return None
    return {"plan": plan, "dropped": frozenset(plan.dropped),
            "positions": {label: tuple(t.tolist()) for label, t in plan.tensors.items()}}
