"""Engine records -> slot arrays: what a step asks of the counters, validated once.

The engine describes a step with records (:mod:`torch_bridge.engine_types`): segments,
KV plan views per plan label, forks, explicit positions and advances. Everything the
manager does with them goes through the arrays built here, so this is the one place
that checks them (unknown requests or labels, negative counts, a stream with two
views in one plan label, two sources forked into one stream, explicit positions of the
wrong shape, dtype, device or range) and names what is wrong.

Vocabulary: a *stream label* (``Segment.label``, ``KVView.label``) names one of a
request's counters; a *plan label* names one position-id vector of a step (one
attention call) and may pack several streams (batched CFG). Without a KV plan, each
stream label is its own plan label.

A continuous batch sends the same views step after step until a request joins or
leaves, so a plan label's arrays are cached: an equal tuple of views under the same
slot version costs one comparison instead of a lookup per stream. Equal is not the
same argument (``True == 1``, ``1.0 == 1``, and numpy compares ``np.uint8(255) ==
2**64 - 1`` at its own width), so the comparison is safe only because every count
is a Python int by then: ``PositionStep`` and ``KVPlanOutput`` convert or refuse each
span and ``to_compute`` when they are built.

Example:
  >>> from torch_bridge.engine_types import PositionStep, Segment, StepContext
  >>> from torch_bridge.streams import StreamTable
  >>> streams = StreamTable(("text",)); _ = streams.ingest("r0"); _ = streams.ingest("r1")
  >>> arrays = StepReader(streams, "kv").read(
  ...     PositionStep([Segment("r0", "text", 3), Segment("r1", "text", 1)]), StepContext())
  >>> views = arrays.labels["text"]
  >>> views.slots.tolist(), views.counts.tolist(), views.num_tokens
  ([0, 1], [3, 1], 4)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Hashable, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from jaxrope.numbers import INT32_MAX, as_int
from torch_bridge.engine_types import Fork, KVPlanOutput, PositionStep, StepContext
from torch_bridge.streams import EMPTY, CommitArrays, StreamTable

__all__ = ["LabelArrays", "StepArrays", "StepReader", "check_hashable"]

# Plan labels whose last views are remembered before the cache starts over.
_MAX_CACHED_LABELS = 1024
_PYTHON_INT = frozenset({int})


class LabelArrays(NamedTuple):
    """One plan label's views: int64 ``slots [V]`` and ``counts [V]``, ``num_tokens`` in all."""

    slots: np.ndarray
    counts: np.ndarray
    num_tokens: int


class StepArrays(NamedTuple):
    """A validated step (a NamedTuple: built every step).

    Attributes:
      groups: ``{plan_label: views}`` as the engine gave them (records).
      labels: ``{plan_label: LabelArrays}`` in the same order.
      pre_forks, post_forks: the fork records; ``pre_src``/``pre_dst`` the pre-forks' slots.
      commit: the commit's arrays (segments, explicit advances, post-forks).
      explicit: ``{plan_label: int32 tensor}`` of explicit positions, checked.
      speculation: the step's depth numbering (:class:`torch_bridge.speculative_steps.Speculation`),
        or None.
    """

    groups: Mapping[str, Tuple[Any, ...]]
    labels: Dict[str, LabelArrays]
    pre_forks: Tuple[Fork, ...]
    post_forks: Tuple[Fork, ...]
    pre_src: np.ndarray
    pre_dst: np.ndarray
    commit: CommitArrays
    explicit: Dict[str, torch.Tensor]
    speculation: Any = None


def unknown_request(streams: StreamTable, rid: Hashable) -> str:
    """Why ``rid`` has no streams: removed (by ``remove_request``) or never ingested."""
    if streams.was_removed(rid):
        return (f"request_id={rid!r} was removed (remove_request); ingest_request it again "
                "to reuse the id")
    return f"request_id={rid!r} was never ingested (call ingest_request first)"


def check_hashable(value: Any, name: str) -> None:
    """Raise TypeError naming ``name`` when ``value`` cannot be a dict key."""
    try:
        hash(value)
    except TypeError as e:
        raise TypeError(f"{name}={value!r} must be hashable: {e}") from e


class StepReader:
    """Builds :class:`StepArrays` from a step's records against a :class:`StreamTable`.

    Args:
      streams: the manager's streams (slot lookups).
      kv_resource: the name of the KV planner's entry in ``StepContext.plan_results``.
      mrope: the manager rotates with M-RoPE: explicit positions are ``[3, n]`` (t, h, w
        rows), not ``[n]``.
    """

    def __init__(self, streams: StreamTable, kv_resource: str, mrope: bool = False):
        self._streams = streams
        self._kv_resource = kv_resource
        self._mrope = mrope
        self._last_views: Dict[str, Tuple[int, Tuple[Any, ...], LabelArrays]] = {}
        # After read(): the cached views tuple the step's segments equal (the same object
        # while the cache keeps hitting), or None; BatchCheck skips segments it has passed.
        self.segments_equal: Optional[Tuple[Any, ...]] = None

    # -- slots of records ----------------------------------------------------------

    def slots(self, rids: Sequence[Hashable], labels: Sequence[str]) -> np.ndarray:
        """int64 slots of streams ``zip(rids, labels)``; ValueError naming an unknown one."""
        try:
            return self._streams.lookup(rids, labels)
        except (ValueError, TypeError):
            for rid, label in zip(rids, labels):
                self.slot(rid, label)
            raise

    def slot(self, rid: Hashable, label: str) -> int:
        """The slot of stream ``(rid, label)``; ValueError for an unknown request or label."""
        check_hashable(rid, "rid")
        check_hashable(label, "label")
        slot = self._streams.row_map.find(rid, label)
        if slot is None:
            self.request_slots(rid)
            raise ValueError(f"label={label!r} is not one of the configured labels "
                             f"{list(self._streams.labels)}")
        return slot

    def request_slots(self, rid: Hashable) -> Tuple[int, ...]:
        """The request's slots; ValueError if it is not ingested (removed, or never ingested)."""
        check_hashable(rid, "rid")
        slots = self._streams.slots_of(rid)
        if slots is None:
            raise ValueError(unknown_request(self._streams, rid))
        return slots

    def records(self, records: Sequence[Any], what: str, field: str = "span"
                ) -> Tuple[np.ndarray, np.ndarray]:
        """Slots and counts of ``(request_id, label, count)`` records (segments, views);
        ``field``: the count's name in a record, for messages."""
        if not records:
            return EMPTY, EMPTY
        try:
            rids, labels, counts = zip(*records)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{what} must be (request_id, label, count) tuples: {e}") from e
        return self.slots(rids, labels), _counts(counts, what, field)

    def forks(self, forks: Sequence[Any], name: str) -> Tuple[np.ndarray, np.ndarray]:
        """``(src, dst)`` slots of fork records; one source per target."""
        if not forks:
            return EMPTY, EMPTY
        try:
            rids, sources, targets = zip(*forks)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name} must be (request_id, from_label, to_label) tuples: {e}") from e
        src, dst = self.slots(rids, sources), self.slots(rids, targets)
        if len(set(dst.tolist())) != len(dst):
            _reject_conflicting_forks(src, dst, forks, name)
        return src, dst

    # -- a whole step --------------------------------------------------------------

    def read(self, step: PositionStep, ctx: StepContext, *, device: Optional[torch.device] = None,
             max_seq_len: Optional[int] = None) -> StepArrays:
        """The step's arrays, every record checked.

        ``device`` and ``max_seq_len`` check explicit positions (None: the step must have none).

        Raises:
          TypeError: wrong record types.
          ValueError: unknown requests or labels, negative counts, repeated streams in a
            plan label, conflicting forks, bad explicit positions or advance.
        """
        if not isinstance(step, PositionStep):
            raise TypeError(f"step must be a PositionStep, got {type(step).__name__}")
        if not isinstance(ctx, StepContext):
            raise TypeError(f"ctx must be a StepContext, got {type(ctx).__name__}")
        groups, pre_forks, post_forks = self._groups(step, ctx)
        labels = {plan_label: self._label_arrays(plan_label, views)
                  for plan_label, views in groups.items()}
        explicit = self._explicit(step.pos_ids, labels, device, max_seq_len)
        pre_src, pre_dst = self.forks(pre_forks, "pre_forks")
        # A decode step's segments usually are its views: reuse their arrays. Compared
        # with the cached plain tuples that equal the views (faster than record vs record).
        reuse = self.segments_equal = None
        if len(groups) == 1:
            (plan_label, views), = groups.items()
            plain = self._last_views.get(plan_label, (None, None))[1]
            if plain is not None and len(views) == len(step.segments) and (
                    views is step.segments or plain == step.segments):
                reuse, self.segments_equal = labels[plan_label], plain
        commit = self.commit(step.segments, step.advance, post_forks, reuse)
        return StepArrays(groups, labels, pre_forks, post_forks, pre_src, pre_dst, commit, explicit)

    def commit(self, segments: Sequence[Any], advance: Any, post_forks: Sequence[Any],
               reuse: Optional[LabelArrays] = None) -> CommitArrays:
        """A step's commit arrays; ``reuse``: the segments' own arrays when already built."""
        if reuse is not None:
            slots, spans = reuse.slots, reuse.counts
        else:
            slots, spans = self.records(segments, "step.segments")
        adv_slots, adv_amounts = EMPTY, EMPTY
        if isinstance(advance, Mapping):
            present = set(slots.tolist())
            named, amounts = [], []
            for stream, amount in advance.items():
                if not isinstance(stream, tuple) or len(stream) != 2:
                    raise ValueError(f"step.advance key {stream!r} must be (request_id, label)")
                slot = self.slot(*stream)
                if slot not in present:
                    raise ValueError(f"step.advance names stream {stream!r}, which has no segment "
                                     "in the step")
                named.append(slot)
                amounts.append(_amount(amount, f"step.advance[{stream!r}]"))
            keep = ~np.isin(slots, named)
            slots, spans = slots[keep], spans[keep]
            adv_slots, adv_amounts = np.asarray(named, np.int64), np.asarray(amounts, np.int64)
        elif advance is not None:
            amount = _amount(advance, "step.advance")
            adv_slots = np.asarray(list(dict.fromkeys(slots.tolist())), np.int64)
            adv_amounts = np.full(len(adv_slots), amount, np.int64)
            slots, spans = EMPTY, EMPTY
        fork_src, fork_dst = self.forks(post_forks, "post_forks")
        return CommitArrays(slots, spans, adv_slots, adv_amounts, fork_src, fork_dst)

    def _groups(self, step: PositionStep, ctx: StepContext):
        """``({plan_label: views}, pre_forks, post_forks)``."""
        kv = ctx.plan_results.get(self._kv_resource)
        if kv is None:
            segments = step.segments
            if not segments:
                return {}, (), ()
            try:
                labels = [s[1] for s in segments]
            except (TypeError, IndexError) as e:
                raise TypeError(f"step.segments must be (request_id, label, span) tuples: {e}") from e
            if labels.count(labels[0]) == len(labels):
                check_hashable(labels[0], "label")
                return {labels[0]: segments}, (), ()
            lists: Dict[str, list] = {}
            for label, segment in zip(labels, segments):
                check_hashable(label, "label")
                lists.setdefault(label, []).append(segment)
            return {label: tuple(views) for label, views in lists.items()}, (), ()
        if not isinstance(kv, Mapping):
            raise TypeError(f"ctx.plan_results[{self._kv_resource!r}] must be a mapping "
                            f"{{plan_label: KVPlanOutput}}, got {type(kv).__name__}")
        groups, pre, post = {}, [], []
        for plan_label, output in kv.items():
            if not isinstance(output, KVPlanOutput):
                raise TypeError(f"ctx.plan_results[{self._kv_resource!r}][{plan_label!r}] "
                                f"must be a KVPlanOutput, got {type(output).__name__}")
            groups[plan_label] = output.views
            pre.extend(output.pre_forks)
            post.extend(output.post_forks)
        return groups, tuple(pre), tuple(post)

    def _label_arrays(self, plan_label: str, views: Tuple[Any, ...]) -> LabelArrays:
        cached = self._last_views.get(plan_label)
        # The cache holds plain tuples: a record that is a list (mutable) never equals it.
        if cached is not None and cached[0] == self._streams.slot_version and cached[1] == views:
            return cached[2]
        field = getattr(views[0], "_fields", ("", "", "count"))[2] if views else "count"
        slots, counts = self.records(views, f"the views of plan label {plan_label!r}", field)
        if len(set(slots.tolist())) != len(slots):
            _reject_repeated_stream(slots, views, plan_label)
        for array in (slots, counts):
            array.flags.writeable = False
        arrays = LabelArrays(slots, counts, int(counts.sum()))
        if len(self._last_views) >= _MAX_CACHED_LABELS:
            self._last_views.clear()
        self._last_views[plan_label] = (self._streams.slot_version, tuple(map(tuple, views)),
                                        arrays)
        return arrays

    def _explicit(self, given: Any, labels: Mapping[str, LabelArrays],
                  device: Optional[torch.device], max_seq_len: Optional[int]
                  ) -> Dict[str, torch.Tensor]:
        if given is None:
            return {}
        if isinstance(given, torch.Tensor):
            if len(labels) != 1:
                raise ValueError(f"step.pos_ids is one tensor but the step has {len(labels)} plan "
                                 f"labels {list(labels)}; pass {{plan_label: tensor}}")
            given = {next(iter(labels)): given}
        if not isinstance(given, Mapping):
            raise TypeError(f"step.pos_ids must be None, a tensor or {{plan_label: tensor}}, got "
                            f"{type(given).__name__}")
        out = {}
        for plan_label, tensor in given.items():
            where = f"step.pos_ids[{plan_label!r}]"
            if plan_label not in labels:
                raise ValueError(f"{where}: not a plan label of the step ({list(labels)})")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where} must be a torch.Tensor, got {type(tensor).__name__}")
            num_tokens = labels[plan_label].num_tokens
            self._check_explicit_shape(where, tensor, num_tokens)
            if tensor.device != device:
                raise ValueError(f"{where} is on {tensor.device}, expected {device}")
            if tensor.numel():
                # One host read: an out-of-range explicit position would rotate silently.
                low, high = torch.stack(torch.aminmax(tensor)).tolist()
                if low < 0 or high >= max_seq_len:
                    raise ValueError(f"{where} has values in [{low}, {high}]; positions must lie in "
                                     f"[0, {max_seq_len}) (max_seq_len)")
            out[plan_label] = tensor.to(torch.int32).contiguous()
        return out

    def _check_explicit_shape(self, where: str, tensor: torch.Tensor, num_tokens: int) -> None:
        want = f"[3, {num_tokens}]" if self._mrope else f"[{num_tokens}]"
        shape = tuple(tensor.shape)
        if tensor.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{where} has shape={shape} dtype={tensor.dtype}; expected int32 or "
                             f"int64 {want}")
        if self._mrope and tensor.ndim == 1:
            raise ValueError(f"{where}.shape={shape} is 1-D positions [n], but this manager "
                             f"rotates with M-RoPE (config.rope.mrope_section): pass {want}, the "
                             "t, h and w rows (a text token repeats its position on all three)")
        if not self._mrope and tensor.ndim == 2 and tensor.shape[0] == 3:
            raise ValueError(f"{where}.shape={shape} is M-RoPE positions [3, n], but this "
                             f"manager's RoPE is 1-D (config.rope.mrope_section is None): pass "
                             f"{want}")
        if shape != ((3, num_tokens) if self._mrope else (num_tokens,)):
            raise ValueError(f"{where}.shape={shape} must be {want} (the plan label's tokens)")


def _counts(values: Sequence[Any], what: str, field: str) -> np.ndarray:
    """int64 counts in ``[0, 2**31 - 1]``: Python ints in one vectorised pass, anything
    else (a numpy integer, a 0-d tensor, a bool, a float) one by one through
    :func:`as_int`, which names ``what[i].field``."""
    if _PYTHON_INT.issuperset(map(type, values)):
        array = np.asarray(values)
        if array.dtype == np.int64 and not (len(array) and (array.min() < 0
                                                            or array.max() > INT32_MAX)):
            return array
    return np.asarray([as_int(v, f"{what}[{i}].{field}", 0, INT32_MAX)
                       for i, v in enumerate(values)], np.int64)


def _amount(value: Any, name: str) -> int:
    # An amount is int32, as a counter: counter + amount (int64) cannot wrap, and the
    # commit compares it with max_seq_len before storing it.
    return as_int(value, name, 0, INT32_MAX)


def _reject_repeated_stream(slots: np.ndarray, views: Sequence[Any], plan_label: str) -> None:
    _, first = np.unique(slots, return_index=True)
    i = min(set(range(len(slots))) - set(first.tolist()))
    raise ValueError(f"stream ({views[i][0]!r}, {views[i][1]!r}) has more than one view in plan "
                     f"label {plan_label!r}; its positions would overlap: give each stream one view "
                     "per plan label")


def _reject_conflicting_forks(src: np.ndarray, dst: np.ndarray, forks: Sequence[Any],
                              name: str) -> None:
    # The same fork listed twice (e.g. by two plan labels) is harmless; two sources for
    # one target are not: which one wins would depend on the order of the scatter.
    source_of: Dict[int, int] = {}
    for i, (s, d) in enumerate(zip(src.tolist(), dst.tolist())):
        if source_of.setdefault(d, s) != s:
            rid, _, label = forks[i]
            raise ValueError(f"{name} copy two different counters into stream ({rid!r}, {label!r})")
