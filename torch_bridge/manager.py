"""``PositionManager``: the seed engine's position resource, a facade over four parts.

Where each concern lives (one module each):

- :mod:`torch_bridge.streams`: the slot map and the counters, on the host (the source
  of truth), and the counter rules (the numpy twins of :mod:`jaxrope.positions`);
- :mod:`torch_bridge.step_arrays`: engine records -> validated slot arrays;
- :mod:`torch_bridge.plans`: the plan / commit / preplan state machine;
- :mod:`torch_bridge.upload`: a step's positions to the device in one stream-ordered
  copy, CUDA-graph buffers.

``RopeManager`` (:mod:`torch_bridge.rope_manager`) adds ``apply_qk``. Every public
method validates first and changes state only once nothing can fail: a call that
raises leaves every counter, slot, plan and graph buffer as it was.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Dict, Hashable, List, Optional, Tuple

import numpy as np
import torch

from jaxrope.positions import PositionTable
from torch_bridge.config import PositionConfig
from torch_bridge.engine_types import (AdmitOutcome, EngineInfo, GraphSlot, PositionStep, Resource,
                                       ResourceSpec, StepContext)
from torch_bridge.plans import Plan, StepPlans
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.step_arrays import StepReader, check_hashable
from torch_bridge import speculative
from torch_bridge import streams as rules
from torch_bridge.streams import StreamTable
from torch_bridge.upload import PositionUpload

__all__ = ["PositionManager"]

_FINGERPRINT_VERSION = b"jaxrope.positions/1"
_INITIAL_SLOTS = 256
# Positions are int32 on the device.
_MAX_SEQ_LEN = int(np.iinfo(np.int32).max)


class PositionManager(Resource):
    """Per-(request, label) position counters and the position ids of each step.

    Args:
      config: a :class:`~torch_bridge.PositionConfig`.
      device: the torch device position ids are produced on (``"cpu"``, ``"cuda:0"``).
      max_seq_len: positions must stay in ``[0, max_seq_len)``; a counter may reach
        ``max_seq_len`` (the stream is full).

    Attributes:
      name: the resource name ("position", or the spec's name under :meth:`build`).
      config, device, max_seq_len: as given.

    Raises:
      TypeError: ``config`` is not a PositionConfig.
      ValueError: an invalid ``device`` or ``max_seq_len`` (named in the message).

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

    def __init__(self, config: PositionConfig, device: Any, max_seq_len: int = 32768):
        if not isinstance(config, PositionConfig):
            raise TypeError(f"config must be a torch_bridge.PositionConfig, got "
                            f"{type(config).__name__}")
        if (not isinstance(max_seq_len, (int, np.integer)) or isinstance(max_seq_len, bool)
                or not 0 < max_seq_len <= _MAX_SEQ_LEN):
            raise ValueError(f"max_seq_len={max_seq_len!r} must be a positive int <= {_MAX_SEQ_LEN} "
                             "(positions are int32 on the device)")
        self.config = config
        self.device = _torch_device(device)
        self.max_seq_len = int(max_seq_len)
        self._labels = config.labels
        self._label_index = {label: i for i, label in enumerate(config.labels)}
        self._plan_labels_seen = set(config.labels)
        self._streams = StreamTable(config.labels, _INITIAL_SLOTS)
        self._reader = StepReader(self._streams, config.kv_resource)
        self._plans = StepPlans(self._streams, config.scheme, config.block_step, self.max_seq_len)
        self._upload = PositionUpload(self.device)
        self._fingerprint: Optional[bytes] = None
        self._mrope = getattr(config.rope, "mrope_section", None) is not None

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
        """False: no host staging buffer is reused while a copy may still read it.

        Positions reach the device through a pinned ring whose spans are rewritten only
        after an event shows their copies have completed, and each copy is ordered on
        torch's stream after the work already queued there, so planning step N+1 cannot
        overwrite what step N still reads unless the runner leases it the same graph slot.
        """
        return False

    def fingerprint(self) -> bytes:
        """SHA-256 over the scheme (and, for RopeManager, the rotary config).

        Example:
          >>> from torch_bridge import PositionConfig
          >>> len(PositionManager(PositionConfig(), "cpu").fingerprint())
          32
        """
        if self._fingerprint is None:  # the config is frozen: computed once
            self._fingerprint = hashlib.sha256(self._fingerprint_payload()).digest()
        return self._fingerprint

    def _fingerprint_payload(self) -> bytes:
        return b"|".join((_FINGERPRINT_VERSION, self.config.scheme.value.encode(),
                          str(self.config.block_step).encode()))

    # ---------------------------------------------------------------- requests

    def ingest_request(self, rid: Hashable, overrides: Optional[Mapping[str, int]] = None, *,
                       deltas: Optional[Mapping[str, int]] = None) -> None:
        """Give ``rid`` a counter per configured label; idempotent, never resets.

        Args:
          rid: the request id (hashable).
          overrides: optional ``{label: position}`` start positions, taken as
            ``counter = max(counter, position)`` so a repeated ingest moves nothing.
          deltas: optional ``{label: M-RoPE delta}`` of the request's prompt (the ``delta``
            of :func:`jaxrope.mrope.rope_index`): once the prompt is in, a decode token of
            the stream sits at ``counter + delta`` on all three rows. Set, not merged:
            repeating it moves nothing.

        Raises:
          ValueError: an override or delta names an unknown label, a position outside
            ``[0, max_seq_len]``, a delta that is not an int in ``[-max_seq_len,
            max_seq_len]``, or deltas for a manager whose RoPE is not M-RoPE.
          TypeError: ``rid`` is not hashable.

        Example:
          >>> from torch_bridge import PositionConfig
          >>> mgr = PositionManager(PositionConfig(), "cpu")
          >>> mgr.ingest_request("r0", overrides={"text": 4}); mgr.ingest_request("r0")
          >>> mgr.position("r0", "text")
          4
        """
        check_hashable(rid, "rid")
        targets = self._positions_arg(overrides or {}, "overrides")
        delta_targets = self._deltas_arg(deltas or {}, "deltas")
        self._streams.ingest(rid)
        self._raise_to(rid, targets)
        if delta_targets:
            slots, values = self._label_arrays(rid, delta_targets)
            rules.set_deltas(self._streams.columns, slots, values)

    def remove_request(self, rid: Hashable) -> None:
        """Forget ``rid`` and free its slots (their counters go back to 0); unknown ids are ignored.

        A plan made before the removal still commits, without the removed request's
        streams.

        Raises:
          TypeError: ``rid`` is not hashable.
        """
        check_hashable(rid, "rid")
        if rid not in self._streams:
            return
        self._plans.drop(self._streams.slots_of(rid))
        self._streams.release(rid)

    def reset_request(self, rid: Hashable, free: bool = False) -> None:
        """Set ``rid``'s counters to 0 (dummy requests of CUDA-graph capture); ``free`` also removes it.

        Raises:
          ValueError: ``rid`` was never ingested.
          TypeError: ``free`` is not a bool.
        """
        if not isinstance(free, bool):
            raise TypeError(f"free={free!r} must be a bool")
        slots = self._reader.request_slots(rid)
        if free:
            self.remove_request(rid)
        else:
            rules.reset(self._streams.columns, np.asarray(slots))

    def position(self, rid: Hashable, label: str) -> int:
        """The next position of stream ``(rid, label)`` (committed counters, no device read).

        Raises:
          ValueError: unknown request or label.
        """
        return int(self._streams.counters[self._reader.slot(rid, label)])

    # ---------------------------------------------------------------- plan / commit

    def plan(self, step: PositionStep, ctx: StepContext) -> Dict[str, torch.Tensor]:
        """Position ids of a step, one int32 vector per plan label, on the device.

        Plan labels and token order come from the KV plan output
        ``ctx.plan_results[config.kv_resource]`` (``{plan_label: KVPlanOutput}``), or,
        without one, from the segments (each stream label its own plan label).
        The pre-forks are applied first; then view ``v`` with ``n`` tokens gets
        ``counter + arange(n)`` (SEQUENTIAL) or ``n`` copies of ``counter`` (BLOCK).
        Explicit ``step.pos_ids`` win for the labels they name.

        The positions are computed on the host and reach the device in one
        non-blocking copy on torch's current stream (:mod:`torch_bridge.upload`).
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
          RuntimeError: called on CUDA under CUDA-graph capture (nothing changes; plan
            outside the capture into a graph slot, replay reads its buffer).
        """
        arrays = self._reader.read(step, ctx, device=self.device, max_seq_len=self.max_seq_len)
        if step.depths is not None:
            arrays = speculative.attach(self._reader, self._streams, step, arrays,
                                        self.config.scheme)
        graph = ctx.graph_slot
        if graph is not None and not isinstance(graph, GraphSlot):
            raise TypeError(f"ctx.graph_slot must be a GraphSlot or None, got {type(graph).__name__}")
        self._upload.check_not_capturing()
        base = self._plans.base_counters(arrays, ctx.is_preplan)
        computed = self._plans.positions(base, arrays)
        # Nothing below raises on valid input (the bucket check changes nothing first).
        tensors, limits = self._upload.step(computed, arrays.explicit, tuple(arrays.labels), graph)
        self._plans.install(Plan(step, arrays, tensors, limits, live=speculative.live(arrays)),
                            ctx.is_preplan, base)
        self._plan_labels_seen.update(arrays.labels)
        return dict(tensors)

    def commit(self, step: PositionStep, ctx: StepContext, *,
               accepted: Optional[Mapping[Tuple[Hashable, str], int]] = None) -> None:
        """Advance the counters by what the planned step consumed, then apply its post-forks.

        SEQUENTIAL adds each segment's span, BLOCK adds ``block_step`` per non-empty
        segment, and ``step.advance`` replaces either for the streams it covers.
        ``accepted={(rid, label): a}`` (speculative decoding, after a verify step)
        advances each named stream by ``a + 1`` instead: its root and ``a`` accepted
        drafts (:mod:`torch_bridge.speculative`).
        ``step`` must carry the segments (and advance) of the current plan (a staged
        plan becomes current when there is none). A staged plan becomes current
        after the commit.

        Raises:
          TypeError: ``step`` or ``ctx`` has the wrong type.
          ValueError: no plan to commit, segments or advance differing from the
            plan's (the message names the first difference), a counter that would
            pass ``max_seq_len``, or ``accepted`` refused (see
            :func:`torch_bridge.speculative.accepted_commit`).
        """
        if not isinstance(step, PositionStep):
            raise TypeError(f"step must be a PositionStep, got {type(step).__name__}")
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        self._plans.commit(step, lambda plan, staged: speculative.accepted_commit(
            self._reader, self._streams, plan, accepted, staged))

    def clear_preplan(self) -> None:
        """Drop the staged plan. Its forks never reached the counters, so nothing else changes."""
        self._plans.clear_preplan()

    def pos_ids(self, label: str) -> Optional[torch.Tensor]:
        """The current plan's position ids for plan label ``label``, or None if it has none.

        A staged plan becomes current here when there is no current one.

        Raises:
          ValueError: ``label`` is neither a configured label nor a plan label seen
            in any plan.
        """
        self._check_plan_label(label)
        plan = self._plans.active()
        return None if plan is None else plan.tensors.get(label)

    def live(self, label: str) -> Optional[np.ndarray]:
        """bool host ``[n]`` over the current plan's ``n`` tokens of plan label ``label``: True
        for a token inside ``max_seq_len``, everywhere but in a draft step (int
        ``step.depths``), whose tokens past it are planned at 0 and need a padding KV
        slot. None without positions for ``label``.

        Raises:
          ValueError: ``label`` is unknown (as :meth:`pos_ids`).
        """
        if self.pos_ids(label) is None:
            return None
        plan = self._plans.active()
        mask = plan.live.get(label)
        return np.ones(plan.arrays.labels[label].num_tokens, bool) if mask is None else mask

    # ---------------------------------------------------------------- publish / admit

    def publish(self, request_id: Hashable) -> Optional[PublishedPositionInfo]:
        """Where every stream of the request has reached; None for an unknown request.

        Per label: the next position, the M-RoPE delta and the publish epoch (see
        :mod:`torch_bridge.published`), with this manager's :meth:`fingerprint`.
        """
        snapshot = self.publish_snapshot_for_step(request_id, None, None)
        return self.publish_from_snapshot(request_id, snapshot, None, None)

    def publish_snapshot_for_step(self, request_id: Hashable, node_name: Optional[str],
                                  graph_walk: Optional[str]) -> Optional[Tuple[Tuple[int, int, int], ...]]:
        """A cheap record of what :meth:`publish` returns now: ``(position, delta, epoch)`` per
        label, as a tuple.

        Returns None for an unknown request. Later counter changes do not alter it.

        Example:
          >>> from torch_bridge import PositionConfig
          >>> mgr = PositionManager(PositionConfig(), "cpu"); mgr.ingest_request("r0")
          >>> snap = mgr.publish_snapshot_for_step("r0", None, None)
          >>> mgr.apply_cached_prefix("r0", None, None, None, {"text": 9})
          >>> mgr.publish_from_snapshot("r0", snap, None, None).counters
          {'text': 0}
        """
        check_hashable(request_id, "request_id")
        slots = self._streams.slots_of(request_id)
        if slots is None:
            return None
        columns = self._streams.columns
        index = list(slots)
        return tuple(zip(*(column[index].tolist() for column in columns)))

    def publish_from_snapshot(self, request_id: Hashable,
                              snapshot: Optional[Tuple[Tuple[int, int, int], ...]],
                              node_name: Optional[str],
                              graph_walk: Optional[str]) -> Optional[PublishedPositionInfo]:
        """The :class:`PublishedPositionInfo` that :meth:`publish` returned when ``snapshot`` was taken.

        Raises:
          TypeError: ``snapshot`` is not a record from :meth:`publish_snapshot_for_step`.
        """
        if snapshot is None:
            return None
        if (not isinstance(snapshot, tuple) or len(snapshot) != len(self._labels)
                or not all(isinstance(r, tuple) and len(r) == 3 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in r)
                    and r[0] >= 0 and r[2] >= 0 for r in snapshot)):
            raise TypeError(f"snapshot={snapshot!r} must be a tuple of {len(self._labels)} "
                            "(position, delta, epoch) int triples from publish_snapshot_for_step")
        labels = self._labels
        return PublishedPositionInfo(
            {label: r[0] for label, r in zip(labels, snapshot)},
            {label: r[1] for label, r in zip(labels, snapshot) if r[1]},
            {label: r[2] for label, r in zip(labels, snapshot) if r[2]},
            self.fingerprint())

    def admit_retrieve(self, rid: Hashable, node_name: Optional[str], graph_walk: Optional[str],
                       published: Optional[PublishedPositionInfo]) -> AdmitOutcome:
        """Take on published records, per label in epoch order.

        A newer publish epoch wins even with a lower position (the publisher rolled
        back); within an epoch ``counter = max(counter, published)``, so a stale echo of
        this node's own publication never rewinds a stream (the seed's monotonic admit:
        a publisher that never rolls back stays in epoch 0). The M-RoPE delta comes with
        the position that wins. ``node_name`` and ``graph_walk`` do not change positions
        (a stream is ``(rid, label)``).

        Returns:
          ``AdmitOutcome(True, True)`` when taken on (or nothing was published);
          ``ok=False`` with a reason, and no change, for an unknown request or label, a
          position outside ``[0, max_seq_len]``, a bad delta or epoch, or a record whose
          fingerprint is not this manager's (it rotates another way).

        Raises:
          TypeError: ``published`` is not a PublishedPositionInfo (or None).
        """
        if published is None:
            return AdmitOutcome(True, True)
        if not isinstance(published, PublishedPositionInfo):
            raise TypeError(f"published must be a PublishedPositionInfo or None, got "
                            f"{type(published).__name__}")
        check_hashable(rid, "rid")
        if rid not in self._streams:
            return AdmitOutcome(False, False, f"request_id={rid!r} was never ingested")
        if published.fingerprint is not None and published.fingerprint != self.fingerprint():
            return AdmitOutcome(False, False, "published.fingerprint differs from this manager's: "
                                f"{published.fingerprint.hex()[:16]}... vs "
                                f"{self.fingerprint().hex()[:16]}... (the publisher rotates another "
                                "way: RoPE config or scheme)")
        try:
            targets = self._positions_arg(published.counters, "published.counters")
            deltas = self._deltas_arg(published.deltas, "published.deltas")
            epochs = self._epochs_arg(published.epochs)
        except (TypeError, ValueError) as e:
            return AdmitOutcome(False, False, str(e))
        slots, positions = self._label_arrays(rid, targets)
        labels = list(targets)
        rules.admit(self._streams.columns, slots, positions,
                    np.asarray([deltas.get(i, 0) for i in labels], np.int64),
                    np.asarray([epochs.get(i, 0) for i in labels], np.int64))
        return AdmitOutcome(True, True)

    def rollback(self, rid: Hashable, label: str, to_position: int) -> None:
        """Rewind stream ``(rid, label)`` to ``to_position`` (rejected drafts, an engine's own
        rewind): ``counter = min(counter, to_position)``.

        A counter that moves back starts a new publish epoch, so the rewind reaches a node
        that admitted this stream's earlier publication (its monotonic admit would keep
        the old, larger position otherwise). Rolling back to where the stream is, or past
        it, changes nothing.

        Raises:
          ValueError: unknown request or label, ``to_position`` not an int in
            ``[0, max_seq_len]``, or the stream in a plan not yet committed (commit or
            clear it first: its positions were numbered from the old counter).
          TypeError: ``rid`` or ``label`` is not hashable.
        """
        slot = self._reader.slot(rid, label)
        target = self._positions_arg({label: to_position}, "to_position")
        for plan in (self._plans.current, self._plans.staged):
            if plan is not None and slot in plan.commit.touched:
                raise ValueError(f"stream ({rid!r}, {label!r}) is in a plan not yet committed: "
                                 "commit it (or clear_preplan) before a rollback")
        rules.rollback(self._streams.columns, np.asarray([slot]), np.asarray(list(target.values())))

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
        self._reader.request_slots(rid)
        self._raise_to(rid, self._positions_arg(prefix or {}, "prefix"))

    # ---------------------------------------------------------------- inspection

    @property
    def table(self) -> PositionTable:
        """The committed records as a :class:`jaxrope.PositionTable` (counters, M-RoPE deltas
        and publish epochs, int32 ``[capacity]``, on JAX's default device)."""
        import jax.numpy as jnp
        return PositionTable(*(jnp.asarray(column.astype(np.int32)) for column in self._streams.columns))

    @property
    def labels(self) -> Tuple[str, ...]:
        """The configured stream labels."""
        return self._labels

    def requests(self) -> List[Hashable]:
        """The ingested request ids."""
        return self._streams.requests()

    def state_snapshot(self) -> Dict[str, Any]:
        """A deep copy of every piece of mutable state, for tests and debugging; changes nothing.

        Two snapshots compare equal with ``==`` exactly when the manager is in the same
        state: arrays are copied out as tuples of ints, plans are compared by identity
        plus their contents (positions, the commit still to apply, pending pre-forks).

        Returns:
          ``{"counters": {(rid, label): int}``, ``"slots"`` / ``"deltas"`` / ``"epochs"``:
          every slot's counter, M-RoPE delta and publish epoch (free slots included),
          ``"requests"``: ``{rid: slots}``, ``"slot_map"``: capacity,
          live, peak and free list, ``"current"`` / ``"staged"``: the plans (or None),
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
        streams, slot_map = self._streams, self._streams.slot_map
        requests = {rid: streams.slots_of(rid) for rid in streams.requests()}
        return {
            "counters": {(rid, label): int(streams.counters[slot])
                         for rid, slots in requests.items()
                         for label, slot in zip(self._labels, slots)},
            "slots": tuple(streams.counters.tolist()),
            "deltas": tuple(streams.columns.deltas.tolist()),
            "epochs": tuple(streams.columns.epochs.tolist()),
            "requests": requests,
            "slot_map": {"capacity": slot_map.capacity, "live": len(slot_map),
                         "peak": slot_map.peak, "free": slot_map.free_slots()},
            "current": None if self._plans.current is None else self._plans.current.state(),
            "staged": None if self._plans.staged is None else self._plans.staged.state(),
            "graph_buffers": {key: tuple(buffer.tolist())
                              for key, buffer in self._upload.graph_buffers.items()},
            "plan_labels": frozenset(self._plan_labels_seen),
        }

    # ---------------------------------------------------------------- internals

    def _check_plan_label(self, label: Hashable) -> None:
        check_hashable(label, "label")
        if label not in self._plan_labels_seen:
            raise ValueError(f"label={label!r} is unknown: not a configured label "
                             f"{list(self._labels)} nor a plan label of any plan")

    def _positions_arg(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: position}`` of a ``{label: position}`` argument, checked."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{name}={values!r} must be a mapping {{label: position}}")
        out = {}
        for label, position in values.items():
            index = self._label_index.get(label) if isinstance(label, str) else None
            if index is None:
                raise ValueError(f"{name} names label={label!r}, not one of {list(self._labels)}")
            if (not isinstance(position, (int, np.integer)) or isinstance(position, bool)
                    or not 0 <= position <= self.max_seq_len):
                raise ValueError(f"{name}[{label!r}]={position!r} must be an int in "
                                 f"[0, {self.max_seq_len}] (max_seq_len)")
            out[index] = int(position)
        return out

    def _deltas_arg(self, values: Mapping[str, int], name: str) -> Dict[int, int]:
        """``{label index: delta}`` of a ``{label: M-RoPE delta}`` argument, checked."""
        if not isinstance(values, Mapping):
            raise ValueError(f"{name}={values!r} must be a mapping {{label: delta}}")
        if any(values.values()) and not self._mrope:
            raise ValueError(f"{name}={dict(values)!r}: M-RoPE deltas need an M-RoPE config "
                             "(config.rope with mrope_section)")
        out = {}
        for label, delta in values.items():
            index = self._label_index.get(label) if isinstance(label, str) else None
            if index is None:
                raise ValueError(f"{name} names label={label!r}, not one of {list(self._labels)}")
            if (not isinstance(delta, (int, np.integer)) or isinstance(delta, bool)
                    or not -self.max_seq_len <= delta <= self.max_seq_len):
                raise ValueError(f"{name}[{label!r}]={delta!r} must be an int in "
                                 f"[-{self.max_seq_len}, {self.max_seq_len}]")
            out[index] = int(delta)
        return out

    def _epochs_arg(self, values: Mapping[str, int]) -> Dict[int, int]:
        if not isinstance(values, Mapping):
            raise ValueError(f"published.epochs={values!r} must be a mapping {{label: epoch}}")
        out = {}
        for label, epoch in values.items():
            index = self._label_index.get(label) if isinstance(label, str) else None
            if index is None:
                raise ValueError(f"published.epochs names label={label!r}, not one of "
                                 f"{list(self._labels)}")
            if (not isinstance(epoch, (int, np.integer)) or isinstance(epoch, bool)
                    or not 0 <= epoch <= _MAX_SEQ_LEN):
                raise ValueError(f"published.epochs[{label!r}]={epoch!r} must be an int >= 0")
            out[index] = int(epoch)
        return out

    def _label_arrays(self, rid: Hashable, targets: Dict[int, int]) -> Tuple[np.ndarray, np.ndarray]:
        """``(slots, values)`` of a request's ``{label index: value}``."""
        request = self._streams.slots_of(rid)
        return (np.asarray([request[i] for i in targets], np.int64),
                np.asarray(list(targets.values()), np.int64))

    def _raise_to(self, rid: Hashable, targets: Dict[int, int]) -> None:
        if targets:
            rules.raise_to(self._streams.columns, *self._label_arrays(rid, targets))


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
