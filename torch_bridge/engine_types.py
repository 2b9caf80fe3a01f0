"""The engine-side records a position manager consumes and produces.

These are the small types a serving engine hands to a resource each step. They are
plain records with no behaviour beyond validation: the engine builds them, the
manager reads them. Records that appear once per request and step (:class:`Segment`,
:class:`KVView`, :class:`Fork`) are ``NamedTuple`` s, because a decode batch builds
hundreds of them per step and tuples are the cheapest record Python has to create,
unpack and compare.

Vocabulary: a *stream* is one ``(request_id, label)`` pair (a request's text stream,
its CFG branch, ...). A *plan label* names one position-id vector of a step, i.e.
one attention call; several stream labels can be packed under one plan label
(batched CFG).

Example:
  >>> from torch_bridge.engine_types import KVPlanOutput, KVView, PositionStep, Segment, StepContext
  >>> step = PositionStep(segments=(Segment("r0", "text", 5), Segment("r1", "text", 1)))
  >>> views = (KVView("r0", "text", 5), KVView("r1", "text", 1))
  >>> ctx = StepContext(request_ids=("r0", "r1"), plan_results={"kv": {"attn": KVPlanOutput(views)}})
  >>> step.num_tokens
  6
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Hashable, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from jaxrope.numbers import INT32_MAX, as_int

__all__ = [
    "AdmitOutcome",
    "Fork",
    "GraphBucket",
    "GraphSlot",
    "KVPlanOutput",
    "KVView",
    "PositionStep",
    "PublishedInfo",
    "Segment",
    "StepContext",
]

_REQUEST = operator.itemgetter(0)
_COUNT = operator.itemgetter(2)
_PYTHON_INT = frozenset({int})


def _counted(records: Any, name: str, field: str, record: Any) -> Tuple[Any, ...]:
    """``records`` as a tuple whose counts (each record's third field) are Python ints.

    The one place a span or ``to_compute`` is converted: a numpy or 0-d tensor integer
    becomes the int it holds (as a ``record``), a bool, float or other type raises
    ``TypeError`` naming ``name[i].field``. The manager trusts these records from here
    on, so a cache hit on an equal step cannot take ``True`` or ``1.0`` for ``1``. The
    range (``[0, 2**31 - 1]``) and the records' shape are checked when a step is read.
    """
    records = records if isinstance(records, tuple) else tuple(records)
    try:
        if _PYTHON_INT.issuperset(map(type, map(_COUNT, records))):
            return records
        counts = list(map(_COUNT, records))
    except (TypeError, IndexError, KeyError):
        return records  # not (request_id, label, count) records: the step's reader names it
    return tuple(r if type(c) is int else record(r[0], r[1], as_int(c, f"{name}[{i}].{field}"))
                 for i, (r, c) in enumerate(zip(records, counts)))


class Segment(NamedTuple):
    """One request's addition to one stream in a step.

    Attributes:
      request_id: the request (``rid``).
      label: the stream label, one of the manager's configured labels.
      span: tokens the step adds to the stream, ``>= 0``; what :meth:`commit` advances
        a SEQUENTIAL counter by.

    Example:
      >>> seg = Segment("r0", "text", 3)
      >>> seg.span, seg == ("r0", "text", 3)
      (3, True)
    """

    request_id: Hashable
    label: str
    span: int


class KVView(NamedTuple):
    """One stream's tokens inside a plan label's layout, as the KV planner ordered them.

    Attributes:
      request_id: the request.
      label: the stream label (which counter numbers these tokens).
      to_compute: tokens of this view in the step, ``>= 0``.

    Example:
      >>> KVPlanOutput([KVView("r0", "text", 4), KVView("r1", "text", 1)]).num_tokens
      5
    """

    request_id: Hashable
    label: str
    to_compute: int


class Fork(NamedTuple):
    """Copy one request's counter from ``from_label`` to ``to_label`` (a CFG branch starts).

    Example (the unconditional branch starts where the conditional one is):
      >>> from torch_bridge import PositionConfig, PositionManager
      >>> mgr = PositionManager(PositionConfig(labels=("cond", "uncond")), "cpu")
      >>> mgr.ingest_request("r0", overrides={"cond": 4})
      >>> views = (KVView("r0", "cond", 1), KVView("r0", "uncond", 1))
      >>> kv = KVPlanOutput(views, pre_forks=[Fork("r0", "cond", "uncond")])
      >>> ctx = StepContext(("r0",), plan_results={"kv": {"attn": kv}})
      >>> step = PositionStep([Segment("r0", "cond", 1), Segment("r0", "uncond", 1)])
      >>> mgr.plan(step, ctx)["attn"].tolist()
      [4, 4]
    """

    request_id: Hashable
    from_label: str
    to_label: str


@dataclasses.dataclass(frozen=True)
class KVPlanOutput:
    """What the KV planner decided for one plan label.

    Attributes:
      views: the ordered views; token ``t`` of the plan label's ``pos_ids`` belongs to
        the view whose cumulative ``to_compute`` range holds ``t``.
      pre_forks: counter copies applied before positions are planned.
      post_forks: counter copies applied after the step is committed.

    Example:
      >>> out = KVPlanOutput(views=[KVView("r0", "cond", 3), KVView("r0", "uncond", 3)])
      >>> out.num_tokens
      6
    """

    views: Tuple[KVView, ...]
    pre_forks: Tuple[Fork, ...] = ()
    post_forks: Tuple[Fork, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "views", _counted(self.views, "views", "to_compute", KVView))
        for name in ("pre_forks", "post_forks"):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    @property
    def num_tokens(self) -> int:
        """Tokens of this plan label: the sum of ``to_compute``."""
        return sum(v[2] for v in self.views)


class GraphBucket(NamedTuple):
    """A CUDA-graph shape bucket: the graph walk, batch size and padded token count.

    Attributes:
      walk: the graph walk name, or None.
      batch_size: requests per step in this bucket.
      num_tokens: the padded token count; position buffers are int32 ``[num_tokens]``.

    Example (planning into a bucket's buffers: see :class:`GraphSlot`):
      >>> GraphBucket(walk=None, batch_size=1, num_tokens=4).num_tokens
      4
    """

    walk: Optional[str]
    batch_size: int
    num_tokens: int


class GraphSlot(NamedTuple):
    """A lease on one of a bucket's graph slots (the runner double-buffers with slots).

    A step planned under a lease writes its position ids into the static buffer of
    ``(bucket, slot, plan_label)``, ``[bucket.num_tokens]`` int32; tokens past the
    live count keep whatever the buffer held (graph padding).

    Example:
      >>> from torch_bridge import PositionConfig, PositionManager
      >>> mgr = PositionManager(PositionConfig(), "cpu"); mgr.ingest_request("r0")
      >>> lease = GraphSlot(GraphBucket(None, batch_size=1, num_tokens=4), slot=0)
      >>> ctx = StepContext(("r0",), graph_slot=lease)
      >>> buf = mgr.plan(PositionStep([Segment("r0", "text", 2)]), ctx)["text"]
      >>> buf.dtype, buf.tolist()  # 2 live tokens, then the buffer's padding
      (torch.int32, [0, 1, 0, 0])
    """

    bucket: GraphBucket
    slot: int


def check_graph_slot(graph: Any) -> Optional[GraphSlot]:
    """``ctx.graph_slot`` checked: None, or a :class:`GraphSlot` of a :class:`GraphBucket`
    whose ``batch_size``, ``num_tokens`` and ``slot`` are ints in ``[0, 2**31 - 1]``, as
    Python ints (the lease keys the graph buffers)
    (:func:`jaxrope.numbers.as_int`: a bool or float is refused even where it equals an
    int, so it never finds the buffer of an equal int lease).

    Example:
      >>> check_graph_slot(GraphSlot(GraphBucket(None, batch_size=1, num_tokens=2.5), slot=0))
      Traceback (most recent call last):
      ...
      TypeError: ctx.graph_slot.bucket.num_tokens=2.5 must be an int (Python or numpy integer), got float
    """
    if graph is None:
        return None
    if not isinstance(graph, GraphSlot):
        raise TypeError(f"ctx.graph_slot must be a GraphSlot or None, got {type(graph).__name__}")
    if not isinstance(graph.bucket, GraphBucket):
        raise TypeError(f"ctx.graph_slot.bucket must be a GraphBucket, got "
                        f"{type(graph.bucket).__name__}")
    bucket = graph.bucket
    if type(bucket.batch_size) is type(bucket.num_tokens) is type(graph.slot) is int:
        if 0 <= min(bucket.batch_size, bucket.num_tokens, graph.slot) and max(
                bucket.batch_size, bucket.num_tokens, graph.slot) <= INT32_MAX:
            return graph
    # The lease keys the graph buffers: rebuilt of Python ints, so that it hashes.
    return GraphSlot(GraphBucket(
        bucket.walk, as_int(bucket.batch_size, "ctx.graph_slot.bucket.batch_size", 0, INT32_MAX),
        as_int(bucket.num_tokens, "ctx.graph_slot.bucket.num_tokens", 0, INT32_MAX)),
        as_int(graph.slot, "ctx.graph_slot.slot", 0, INT32_MAX))


PosIds = Union[None, torch.Tensor, Mapping[str, torch.Tensor]]
Advance = Union[None, int, Mapping[Tuple[Hashable, str], int]]
Tree = Union[None, np.ndarray, Mapping[Tuple[Hashable, str], Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class PositionStep:
    """What a step adds to each stream, plus optional explicit positions and advance.

    Attributes:
      segments: ordered :class:`Segment` s (a list is converted to a tuple; a span that
        is a numpy or 0-d tensor integer becomes the Python int it holds, any other
        non-int span raises ``TypeError`` here).
      pos_ids: explicit positions that win over the counters: ``{plan_label: int
        tensor [n]}``, or one int tensor when the step has a single plan label. ``n``
        is the plan label's live token count. int32 or int64, on the manager's device.
      advance: explicit counter advance replacing the scheme's amount at commit: an
        int for every stream of the step, or ``{(request_id, label): amount}`` for the
        named streams (each must have a segment in the step; the others advance by
        the scheme). Amounts are ``>= 0`` and apply once per stream.
      draft_depth: an EAGLE *draft step* (:mod:`torch_bridge.speculative_steps`; SEQUENTIAL
        scheme): every token of the step at ``counter + draft_depth`` (draft step ``j``
        is ``draft_depth=j - 1`` in vLLM's numbering, ``j`` in SGLang's), a token past
        ``max_seq_len`` planned at 0 and reported by ``live``; its commit moves no
        counter. An int in ``[0, max_seq_len]``, default None.
      tree: a *tree verify* (SEQUENTIAL scheme): token ``i`` of a named stream's view
        at ``counter + depths[i]`` instead of ``counter + i`` (SGLang's ``seq_len +
        depth``); ``commit`` then needs each one's ``accepted`` count. An integer
        array ``[len(segments), k]`` (row ``s``: the depths of segment ``s``'s stream,
        every segment a tree of ``k`` tokens), or ``{(request_id, label): depths}``
        for some of the streams. Each row must be a tree, root first
        (:func:`torch_bridge.speculative_steps.check_trees`). Default None.

    A chain of ``k`` drafts needs neither field: its view of ``k + 1`` tokens is
    numbered as any other.

    Raises:
      ValueError: both ``draft_depth`` and ``tree`` set (a step is one or the other).

    Example:
      >>> step = PositionStep([Segment("r0", "text", 4)], advance={("r0", "text"): 1})
      >>> step.segments
      (Segment(request_id='r0', label='text', span=4),)
      >>> PositionStep([Segment("r0", "text", 4)], tree={("r0", "text"): (0, 1, 1, 2)}).tree
      {('r0', 'text'): (0, 1, 1, 2)}
    """

    segments: Tuple[Segment, ...]
    pos_ids: PosIds = None
    advance: Advance = None
    draft_depth: Optional[int] = None
    tree: Tree = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "segments", _counted(self.segments, "step.segments", "span",
                                                      Segment))
        if self.draft_depth is not None and self.tree is not None:
            raise ValueError(f"draft_depth={self.draft_depth!r} and tree= are both set: a step "
                             "is a draft step or a tree verify, not both")

    @property
    def num_tokens(self) -> int:
        """The sum of the segments' spans."""
        return sum(s[2] for s in self.segments)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Everything about a step that is not the positions' own input.

    Attributes:
      request_ids: the step's requests, in batch order; empty (the default) states none.
        When given, ``plan`` refuses a step whose segments name another request
        (:meth:`check_segments`).
      graph_walk: the engine's graph walk name, or None.
      is_preplan: True when this step is planned while the previous one still runs
        (the plan is staged, see ``RopeManager.plan``).
      plan_results: other resources' plan results keyed by resource name; the
        position manager reads ``{plan_label: KVPlanOutput}`` under its KV resource
        name (``PositionConfig.kv_resource``).
      graph_slot: the CUDA-graph slot lease, or None for an eager step.

    Example:
      >>> ctx = StepContext(request_ids=["r0", "r1"])
      >>> ctx.request_ids, ctx.is_preplan, ctx.graph_slot
      (('r0', 'r1'), False, None)
      >>> ctx.check_segments([Segment("r2", "text", 1)])
      Traceback (most recent call last):
      ...
      ValueError: step.segments[0] names request_id='r2', which is not in ctx.request_ids=('r0', 'r1') (the step's batch)
    """

    request_ids: Tuple[Hashable, ...] = ()
    graph_walk: Optional[str] = None
    is_preplan: bool = False
    plan_results: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    graph_slot: Optional[GraphSlot] = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_ids, tuple):
            object.__setattr__(self, "request_ids", tuple(self.request_ids))

    def check_segments(self, segments: Sequence[Segment]) -> None:
        """Every segment's request is one of :attr:`request_ids` (when any is given).

        Raises:
          ValueError: the first segment naming another request.
        """
        if not self.request_ids:
            return
        batch = set(self.request_ids)
        if batch.issuperset(map(_REQUEST, segments)):
            return
        i, segment = next((i, s) for i, s in enumerate(segments) if s[0] not in batch)
        raise ValueError(f"step.segments[{i}] names request_id={segment[0]!r}, which is not in "
                         f"ctx.request_ids={self.request_ids!r} (the step's batch)")


class BatchCheck:
    """:meth:`StepContext.check_segments` over a manager's steps, keeping the last batch's
    set: a continuous batch sends the same ids step after step, so an unchanged batch
    costs one tuple compare and a superset test, and segments equal to ones this batch
    already passed (``known``, the step reader's cached views they equal) cost nothing."""

    def __init__(self) -> None:
        self._ids: Tuple[Hashable, ...] = ()
        self._batch: set = set()
        self._known: Any = None

    def check(self, ctx: StepContext, segments: Sequence[Segment], known: Any = None) -> None:
        """``ctx.check_segments(segments)``; ``known``: an object that ``segments`` equal,
        the same object each time they do (None: unknown).

        Raises:
          ValueError: a segment naming a request outside a non-empty ``ctx.request_ids``.
        """
        ids = ctx.request_ids
        if not ids:
            return
        if ids != self._ids:
            self._ids, self._batch, self._known = ids, set(ids), None
        elif known is not None and known is self._known:
            return
        if not self._batch.issuperset(map(_REQUEST, segments)):
            ctx.check_segments(segments)
        self._known = known


class AdmitOutcome(NamedTuple):
    """Result of admitting a request's published state.

    Attributes:
      ok: the published state was taken on.
      ready: the request can run now.
      reason: why not, when ``ok`` or ``ready`` is False; else None (default).

    Example:
      >>> from torch_bridge import PositionConfig, PositionManager, PublishedPositionInfo
      >>> mgr = PositionManager(PositionConfig(), "cpu")
      >>> mgr.admit_retrieve("r9", None, None, PublishedPositionInfo({"text": 5})).reason
      "published record refused (request): request_id='r9' was never ingested (call ingest_request first)"
    """

    ok: bool
    ready: bool
    reason: Optional[str] = None


class PublishedInfo:
    """Base of what a resource publishes about a request for another node.

    Subclasses implement :meth:`clone` (an independent copy for deferred sending)
    and :meth:`update` (merge a newer publication into this one).

    Example (the position manager's subclass):
      >>> from torch_bridge import PublishedPositionInfo
      >>> a = PublishedPositionInfo({"text": 3})
      >>> b = a.clone(); b.update(PublishedPositionInfo({"text": 8}))
      >>> a.counters, b.counters
      ({'text': 3}, {'text': 8})
    """

    def clone(self) -> "PublishedInfo":
        """An independent copy, safe to send later while this one keeps changing.

        Raises:
          NotImplementedError: on the base class; subclasses override it.
        """
        raise NotImplementedError(f"{type(self).__name__}.clone")

    def update(self, other: "PublishedInfo") -> None:
        """Merge ``other``, a newer publication of the same request, into this one in place.

        Raises:
          NotImplementedError: on the base class; subclasses override it.
        """
        raise NotImplementedError(f"{type(self).__name__}.update")
