"""``PositionManager``: an engine's position resource, a facade over seven parts.

Where each concern lives (one module each):

- :mod:`torch_bridge.streams`: the slot map and the counters, on the host (the source
  of truth), and the counter rules (the numpy twins of :mod:`jaxrope.positions`);
- :mod:`torch_bridge.step_arrays`: engine records -> validated slot arrays;
- :mod:`torch_bridge.plans`: the plan / commit / preplan state machine;
- :mod:`torch_bridge.upload`: a step's positions to the device in one stream-ordered
  copy, CUDA-graph buffers;
- :mod:`torch_bridge.publish_admit`: a request's records out and in (publish, snapshots,
  admit, rollback, cached prefix) and the checks of ``{label: value}`` arguments, two
  components built from the parts above;
- :mod:`torch_bridge.request_lifecycle`: a request's streams in (ingest), reset and out
  (remove), and each stream's counter and M-RoPE delta read back, a component built
  from the same parts.

``RopeManager`` (:mod:`torch_bridge.rope_manager`) adds ``apply_qk``. Every public
method validates first and changes state only once nothing can fail: a call that
raises leaves every counter, slot, plan and graph buffer as it was. Every public
method and property runs under the manager's one re-entrant lock
(:mod:`torch_bridge.locking`), so threads may share a manager; a planned stream is
frozen until its plan commits (:mod:`torch_bridge.plans`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping
from typing import Any, Dict, Hashable, List, Optional, Tuple, Union

import numpy as np
import torch

from jaxrope.positions import PositionTable
from torch_bridge.config import PositionConfig
from jaxrope.numbers import INT32_MAX, PLAIN_INTS, as_int
from torch_bridge.engine_types import (AdmitOutcome, BatchCheck, PositionStep, StepContext,
                                       check_graph_slot)
from torch_bridge.resource import EngineInfo, Resource, ResourceSpec
from torch_bridge.locking import serialized
from torch_bridge.plans import Plan, StepPlans
from torch_bridge.publish_admit import PublishAdmit, RecordArgs, Snapshot, writer_id
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.request_lifecycle import RequestLifecycle
from torch_bridge.step_arrays import StepReader, check_hashable
from torch_bridge import speculative_steps
from torch_bridge.streams import StreamTable
from torch_bridge.upload import PositionUpload

__all__ = ["PositionManager"]

_FINGERPRINT_VERSION = b"jaxrope.positions/1"
_INITIAL_SLOTS = 256
# Positions are int32 on the device.
_MAX_SEQ_LEN = INT32_MAX


@serialized
class PositionManager(Resource):
    """Per-(request, label) position counters and the position ids of each step.

    Args:
      config: a :class:`~torch_bridge.PositionConfig`.
      device: the torch device position ids are produced on (``"cpu"``, ``"cuda:0"``).
      max_seq_len: positions must stay in ``[0, max_seq_len)``; a counter may reach
        ``max_seq_len`` (the stream is full).
      writer: this manager's writer id in ``[1, 2**32 - 1]``, counted in the rewinds of
        its rollbacks (docs/handoff.md, "Who may roll a stream back"); default a random one. A
        process that takes over another's role (a restarted decode process resuming
        from its published records) passes the same id.

    Attributes:
      name: the resource name ("position", or the spec's name under :meth:`build`).
      config, device, max_seq_len, writer: as given.

    Threads: every public method and property is atomic with respect to the others
    (one re-entrant lock, :mod:`torch_bridge.locking`), so an engine thread and a
    KV-transfer thread may share the manager.

    Raises:
      TypeError: ``config`` is not a PositionConfig.
      ValueError: an invalid ``device``, ``max_seq_len`` or ``writer`` (named in the
        message).

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
                 writer: Optional[int] = None):
        self._lock = threading.RLock()
        if not isinstance(config, PositionConfig):
            raise TypeError(f"config must be a torch_bridge.PositionConfig, got "
                            f"{type(config).__name__}")
        max_seq_len = as_int(max_seq_len, "max_seq_len", 1, _MAX_SEQ_LEN,
                             " (positions are int32 on the device)")
        self.writer = writer_id(writer)
        self.config = config
        self.device = _torch_device(device)
        self.max_seq_len = max_seq_len
        self._labels = config.labels
        self._plan_labels_seen = set(config.labels)
        # M-RoPE (config.rope.mrope_section): every position tensor is [3, n], t, h, w rows.
        self._mrope = getattr(config.rope, "mrope_section", None) is not None
        self._streams = StreamTable(config.labels, _INITIAL_SLOTS)
        self._reader = StepReader(self._streams, config.kv_resource, self._mrope)
        self._plans = StepPlans(self._streams, config.scheme, config.block_step, self.max_seq_len,
                                self._mrope)
        self._upload = PositionUpload(self.device, self._mrope)
        self._args = RecordArgs(config.labels, self.max_seq_len, self._mrope)
        self._records = PublishAdmit(self._streams, self._reader, self._plans, self._args,
                                     self.fingerprint, self.writer)
        self._requests = RequestLifecycle(self._streams, self._reader, self._plans, self._args)
        self._fingerprint: Optional[bytes] = None
        self._batch = BatchCheck()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        serialized(cls)  # a subclass's public methods take the lock too (RopeManager's apply_qk)

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
        overwrite what step N still reads; a preplan into the graph slot the current plan
        holds is refused (ValueError naming the slot), so its static buffers cannot be
        overwritten either. Each plan's positions off a graph slot land in memory of their
        own (:class:`torch_bridge.upload.DeviceChunks`).
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

    # ---------------------------------------------------------------- requests: each method is
    # torch_bridge.request_lifecycle.RequestLifecycle's of the same name (documented there)

    def ingest_request(self, rid: Hashable, overrides: Optional[Mapping[str, int]] = None, *,
                       deltas: Optional[Mapping[str, int]] = None) -> None:
        """Give ``rid`` a counter per configured label; idempotent, never resets."""
        self._requests.ingest_request(rid, overrides, deltas=deltas)

    def remove_request(self, rid: Hashable) -> None:
        """Forget ``rid`` and free its slots; unknown ids are ignored."""
        self._requests.remove_request(rid)

    def reset_request(self, rid: Hashable, free: bool = False) -> None:
        """Set ``rid``'s counters to 0 (dummy requests of CUDA-graph capture); ``free`` also removes it."""
        self._requests.reset_request(rid, free)

    def position(self, rid: Hashable, label: str) -> int:
        """The next position of stream ``(rid, label)`` (committed counters, no device read)."""
        return self._requests.position(rid, label)

    def delta(self, rid: Hashable, label: str) -> int:
        """The M-RoPE delta of stream ``(rid, label)`` (0 for 1-D RoPE)."""
        return self._requests.delta(rid, label)

    # ---------------------------------------------------------------- plan / commit

    def plan(self, step: PositionStep, ctx: StepContext) -> Dict[str, torch.Tensor]:
        """Position ids of a step, one int32 tensor per plan label, on the device.

        Plan labels and token order come from the KV plan output
        ``ctx.plan_results[config.kv_resource]`` (``{plan_label: KVPlanOutput}``), or,
        without one, from the segments (each stream label its own plan label).
        The pre-forks are applied first; then view ``v`` with ``n`` tokens gets
        ``counter + arange(n)`` (SEQUENTIAL) or ``n`` copies of ``counter`` (BLOCK).
        Explicit ``step.pos_ids`` win for the labels they name.

        M-RoPE (``config.rope.mrope_section``): each tensor is ``[3, n]`` (t, h, w rows);
        a computed view gets ``counter + delta`` (+ ``arange(n)``) on all three rows (a
        decode token after an image prompt), and a prompt chunk comes as explicit
        ``[3, n]`` pos_ids (slices of :func:`jaxrope.mrope.rope_index`).

        The positions are computed on the host and reach the device in one
        non-blocking copy on torch's current stream (:mod:`torch_bridge.upload`).
        Without a graph slot each tensor is ``[n]`` (M-RoPE ``[3, n]``, contiguous) for the
        plan label's ``n`` live tokens. Under ``ctx.graph_slot`` it is the static buffer of
        ``(graph_slot, plan_label)``, ``[bucket.num_tokens]`` (M-RoPE ``[3,
        bucket.num_tokens]``): the first ``n`` tokens are written, the rest keep their
        previous values.
        A preplan may not take the graph slot of the current plan, whose launches (or
        replay) read its buffers until it commits: lease the other slot.

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
          ValueError: a request not ingested (never, or removed), a segment whose request
            is not in a non-empty ``ctx.request_ids``, an unknown label, a negative count,
            a stream with two views in one plan label, two forks into one stream from
            different sources, explicit pos_ids of the wrong shape/dtype/device (``[n]``
            for an M-RoPE manager, ``[3, n]`` for a 1-D one) or outside ``[0,
            max_seq_len)`` (checked with one host read), more tokens than the graph
            bucket holds, positions past ``max_seq_len`` (M-RoPE: or a negative
            ``counter + delta``), or a preplan into the current plan's graph slot.
          RuntimeError: called on CUDA under CUDA-graph capture (nothing changes; plan
            outside the capture into a graph slot, replay reads its buffer).
        """
        graph = check_graph_slot(ctx.graph_slot if isinstance(ctx, StepContext) else None)
        arrays = self._reader.read(step, ctx, device=self.device, max_seq_len=self.max_seq_len)
        self._batch.check(ctx, step.segments, self._reader.segments_equal)
        if step.draft_depth is not None or step.tree is not None:
            arrays = speculative_steps.attach(self._reader, step, arrays, self.config.scheme,
                                        self.max_seq_len)
        self._upload.check_not_capturing()
        self._plans.check_graph_slot(graph, ctx.is_preplan)
        base = self._plans.base_counters(arrays, ctx.is_preplan)
        computed = self._plans.positions(base, arrays, self._upload.stage)
        # Nothing below raises on valid input (the bucket check changes nothing first).
        tensors, limits = self._upload.step(computed, arrays.explicit, tuple(arrays.labels), graph)
        self._plans.install(Plan(step, arrays, tensors, limits, graph=graph), ctx.is_preplan,
                           base)
        self._plan_labels_seen.update(arrays.labels)
        return dict(tensors)

    def commit(self, step: PositionStep, ctx: StepContext, *,
               accepted: Union[None, Mapping[Tuple[Hashable, str], int], np.ndarray] = None
               ) -> None:
        """Advance the counters by what the planned step consumed, then apply its post-forks.

        SEQUENTIAL adds each segment's span, BLOCK adds ``block_step`` per non-empty
        segment, and ``step.advance`` replaces either for the streams it covers.
        ``accepted={(rid, label): a}`` (speculative decoding, after a verify step), or an
        int array ``[len(step.segments)]`` of one count per segment, advances each named
        stream by ``a + 1`` instead: its root and ``a`` accepted drafts
        (:mod:`torch_bridge.speculative_steps`).
        ``step`` must carry the segments (and advance) of the current plan (a staged
        plan becomes current when there is none). A staged plan becomes current
        after the commit.

        Raises:
          TypeError: ``step`` or ``ctx`` has the wrong type.
          ValueError: no plan to commit, segments or advance differing from the
            plan's (the message names the first difference), a counter that would
            pass ``max_seq_len``, or ``accepted`` refused (see
            :func:`torch_bridge.speculative_steps.accepted_commit`).
        """
        if not isinstance(step, PositionStep):
            raise TypeError(f"step must be a PositionStep, got {type(step).__name__}")
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        if accepted is None and not self._plans.next_commit_is_speculative():
            self._plans.commit(step)
            return
        if isinstance(accepted, Mapping) and not PLAIN_INTS.issuperset(map(type, accepted.values())):
            for stream, value in accepted.items():   # the type first, as every integer argument
                as_int(value, f"accepted[{stream!r}]")
        self._plans.commit(step, lambda plan, staged: speculative_steps.accepted_commit(
            self._reader, plan, accepted, staged))

    def clear_preplan(self) -> None:
        """Drop the staged plan. Its forks never reached the counters, so nothing else changes."""
        self._plans.clear_preplan()

    def pos_ids(self, label: str) -> Optional[torch.Tensor]:
        """The current plan's position ids for plan label ``label`` (int32 ``[n]``, M-RoPE
        ``[3, n]``; a graph slot's whole buffer), or None if it has none.

        A staged plan becomes current here when there is no current one.

        Raises:
          ValueError: ``label`` is neither a configured label nor a plan label seen
            in any plan.
        """
        self._check_plan_label(label)
        self._plans.promote()
        plan = self._plans.current
        return None if plan is None else plan.tensors.get(label)

    def live(self, label: str) -> Optional[np.ndarray]:
        """bool host ``[n]`` over the current plan's ``n`` tokens of plan label ``label``: True
        for a token inside ``max_seq_len``, everywhere but in a draft step
        (``step.draft_depth``), whose tokens past it are planned at 0 and need a padding KV
        slot. None without positions for ``label``.

        Raises:
          ValueError: ``label`` is unknown (as :meth:`pos_ids`).
        """
        if self.pos_ids(label) is None:
            return None
        plan = self._plans.current
        mask = plan.live.get(label)
        return np.ones(plan.arrays.labels[label].num_tokens, bool) if mask is None else mask

    # ---------------------------------------------------------------- records: each method is
    # torch_bridge.publish_admit.PublishAdmit's of the same name (documented there)

    def publish(self, request_id: Hashable) -> Optional[PublishedPositionInfo]:
        """Where every stream of the request has reached; None for an unknown request."""
        return self._records.publish(request_id)

    def publish_snapshot_for_step(self, request_id: Hashable, node_name: Optional[str],
                                  graph_walk: Optional[str]) -> Optional[Snapshot]:
        """A cheap record of what :meth:`publish` returns now."""
        return self._records.publish_snapshot_for_step(request_id, node_name, graph_walk)

    def publish_from_snapshot(self, request_id: Hashable, snapshot: Optional[Snapshot],
                              node_name: Optional[str],
                              graph_walk: Optional[str]) -> Optional[PublishedPositionInfo]:
        """What :meth:`publish` returned when ``snapshot`` was taken."""
        return self._records.publish_from_snapshot(request_id, snapshot, node_name, graph_walk)

    def admit_retrieve(self, rid: Hashable, node_name: Optional[str], graph_walk: Optional[str],
                       published: Union[PublishedPositionInfo, bytes, None]) -> AdmitOutcome:
        """Take on published records, or refuse them with a reason (nothing changes then)."""
        return self._records.admit_retrieve(rid, node_name, graph_walk, published)

    def rollback(self, rid: Hashable, label: str, to_position: int) -> None:
        """Rewind stream ``(rid, label)`` to ``to_position``, starting a new publish epoch."""
        self._records.rollback(rid, label, to_position)

    def apply_cached_prefix(self, rid: Hashable, node_name: Optional[str],
                            graph_walk: Optional[str], inputs: Any,
                            prefix: Optional[Mapping[str, int]]) -> None:
        """Move streams past what the prefix cache holds: ``counter = max(counter, cached)``."""
        self._records.apply_cached_prefix(rid, node_name, graph_walk, inputs, prefix)

    # ---------------------------------------------------------------- inspection

    @property
    def table(self) -> PositionTable:
        """The committed records as a :class:`jaxrope.PositionTable` (counters, M-RoPE deltas and
        publish epochs, int32 ``[capacity]``, on JAX's default device)."""
        import jax.numpy as jnp
        return PositionTable(*(jnp.asarray(column.astype(np.int32))
                               for column in self._streams.columns))

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
          the streams' records (:meth:`torch_bridge.streams.StreamTable.snapshot`: counters,
          every slot's counter, delta, epoch and rewinds, requests, slot map), and
          ``"current"`` / ``"staged"``: the plans (or None),
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
        return {
            **self._streams.snapshot(),
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
