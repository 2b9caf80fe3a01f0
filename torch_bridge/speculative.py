"""Speculative decoding through the engine records: draft trees, draft steps, accepted counts.

The rules are the core's (:mod:`jaxrope.speculative`), executed by their numpy twins in
:mod:`torch_bridge.streams`; this module reads and checks what an engine says about a
speculative step and turns it into slot arrays. An engine's loop:

1. **verify**: ``plan`` a step whose view of each speculating stream holds its root
   (the token sampled last, not yet in the KV cache) and its drafts. A chain of ``k``
   drafts is a view of ``k + 1`` tokens, numbered ``counter + arange(k + 1)`` like any
   view; a tree is numbered by ``PositionStep(depths={(rid, label): depths})``, token
   ``i`` at ``counter + depths[i]``.
2. **accept**: ``commit(step, ctx, accepted={(rid, label): a})`` advances each named
   stream by ``a + 1`` (the root and ``a`` drafts; ``0 <= a <=`` its deepest draft) and
   the step's other streams by their spans. A tree's streams must be named.
3. **draft**: the EAGLE drafter's step 0 reuses the verify step's positions (its
   ``pos_ids``, before the commit); each later step ``j`` is ``plan(PositionStep(
   segments, depths=j - 1), ctx)``: one token per stream (or its ``topk`` branches) at
   ``counter + j - 1``, committing nothing. A token whose position would reach
   ``max_seq_len`` is planned at 0 and ``live(plan_label)`` marks it False: give it a
   padding KV slot (vLLM's clamp, with the bound taken from the stream's index, not
   from an M-RoPE row: vLLM #54498). Under ``ctx.graph_slot`` a draft step writes its
   bucket's static buffer like any step, the tail kept.
4. **rewind outside a step** (an engine that committed its drafts, vLLM's
   ``num_computed_tokens -= num_rejected``): ``rollback(rid, label, to_position)``,
   which starts a new publish epoch so that a node that admitted the drafts takes it.

Why the records look like this: a chain needs nothing new (the drafts are tokens of
the view), and the accepted count is known only after the verify step ran, so it goes
to ``commit``, like the sampled tokens in vLLM's ``update_from_output``. Depths sit on
:class:`~torch_bridge.engine_types.PositionStep` beside ``advance``, per stream, so
:class:`~torch_bridge.engine_types.KVView` stays the 3-tuple an engine builds hundreds
of per step; its int form is the draft step, whose tokens share one offset.

A preplan (step N+1 staged while N runs) is numbered as if N committed every span;
a commit whose ``accepted`` rejects drafts of a stream the staged plan numbers is
refused (``clear_preplan`` and plan again).

Example (a tree at 7, one draft accepted, then a draft step):
  >>> from torch_bridge import PositionConfig, PositionManager, PositionStep, Segment, StepContext
  >>> mgr = PositionManager(PositionConfig(), "cpu", max_seq_len=64)
  >>> mgr.ingest_request("r0", overrides={"text": 7})
  >>> ctx = StepContext(("r0",))
  >>> verify = PositionStep([Segment("r0", "text", 4)], depths={("r0", "text"): (0, 1, 1, 2)})
  >>> mgr.plan(verify, ctx)["text"].tolist()
  [7, 8, 8, 9]
  >>> mgr.commit(verify, ctx, accepted={("r0", "text"): 1})
  >>> mgr.position("r0", "text")
  9
  >>> mgr.plan(PositionStep([Segment("r0", "text", 1)], depths=1), ctx)["text"].tolist()
  [10]
  >>> mgr.live("text").tolist(), mgr.position("r0", "text")
  ([True], 9)
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from jaxrope.positions import Scheme
from torch_bridge import streams as rules
from torch_bridge.engine_types import PositionStep
from torch_bridge.streams import Columns, CommitArrays, StreamTable

if TYPE_CHECKING:
    from torch_bridge.plans import Plan
    from torch_bridge.step_arrays import LabelArrays, StepArrays, StepReader

__all__ = ["Speculation", "accepted_commit", "attach", "live", "positions", "read", "same_depths"]

_EMPTY = np.zeros((0,), np.int64)
_EMPTY.flags.writeable = False
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


class Speculation(NamedTuple):
    """A step's depth numbering, checked (``StepArrays.speculation``).

    Attributes:
      draft: the int depth of a draft step, else None.
      depths: ``{plan_label: int64 [tokens]}``: every token's depth, for the plan labels
        holding a stream numbered by a depths mapping (tree verify).
      tree_slots: int64: the slots of the streams the mapping names.
      tree_depths: their deepest depth (the most drafts a commit may accept), aligned with
        ``tree_slots``.
      live: ``{plan_label: bool [tokens]}`` of a draft step, filled by :func:`positions`.
    """

    draft: Optional[int]
    depths: Dict[str, np.ndarray]
    tree_slots: np.ndarray
    tree_depths: np.ndarray
    live: Dict[str, np.ndarray]


def read(reader: "StepReader", streams: StreamTable, step: PositionStep,
         groups: Mapping[str, Sequence[Any]], labels: Mapping[str, "LabelArrays"],
         scheme: Scheme) -> Optional[Speculation]:
    """``step.depths`` against the step's views, or None when it has none.

    Raises:
      TypeError: depths of the wrong type.
      ValueError: a scheme other than SEQUENTIAL, a negative depth, depths naming a
        stream without a view or of another length than its view, a draft step with
        an explicit advance.
    """
    depths = step.depths
    if depths is None:
        return None
    if scheme is not Scheme.SEQUENTIAL:
        raise ValueError(f"step.depths={depths!r}: speculative steps need the SEQUENTIAL scheme, "
                         f"this manager numbers {scheme.value}")
    if isinstance(depths, (int, np.integer)) and not isinstance(depths, bool):
        if depths < 0:
            raise ValueError(f"step.depths={depths!r} must be >= 0 (a draft step at counter + depths)")
        if step.advance is not None:
            raise ValueError(f"step.advance={step.advance!r}: a draft step (int step.depths) commits "
                             "nothing; leave advance None")
        return Speculation(int(depths), {}, _EMPTY, _EMPTY, {})
    if not isinstance(depths, Mapping):
        raise TypeError(f"step.depths must be None, an int or {{(request_id, label): depths}}, got "
                        f"{type(depths).__name__}")
    return (_trees_at_once(reader, streams, depths, labels)
            or _trees(reader, depths, groups, labels))


def _trees_at_once(reader: "StepReader", streams: StreamTable, depths: Mapping,
                   labels: Mapping[str, "LabelArrays"]) -> Optional[Speculation]:
    """The common layout, vectorised: each plan label's views are the named streams in the
    mapping's order, or none of them, and every depth list holds Python ints (or every one is
    a 1-D int array). None otherwise: :func:`_trees` reads it, and names what is wrong, so
    this accepts only what ``_trees`` accepts, with the same result (its tree slots in the
    mapping's order, not sorted)."""
    keys = tuple(depths)
    if not keys:
        return None
    read = _flat(list(depths.values()))
    if read is None:
        return None
    lengths, flat = read
    slots = _cached_slots(streams, keys)
    if slots is None:
        if not all(isinstance(key, tuple) and len(key) == 2 for key in keys):
            return None
        found = reader.slots([key[0] for key in keys], [key[1] for key in keys])
        # A plan label's own slot array when it lists these streams: the next step's
        # match is then an identity test, and accepted counts find the same array.
        slots = next((arrays.slots for arrays in labels.values()
                      if np.array_equal(arrays.slots, found)), found)
        _remember_slots(streams, keys, slots)
    per_label = {}
    for plan_label, arrays in labels.items():
        if arrays.slots is slots or np.array_equal(arrays.slots, slots):
            if not np.array_equal(arrays.counts, lengths):
                return None
            per_label[plan_label] = flat
        elif np.isin(arrays.slots, slots).any():
            return None
    if not per_label:
        return None
    if lengths.min() == lengths.max():   # one width (a fixed tree size): a row per stream
        deepest = flat.reshape(len(keys), -1).max(axis=1)
    else:
        deepest = np.maximum.reduceat(flat, np.cumsum(lengths) - lengths)
    return Speculation(None, per_label, slots, deepest, {})


def _flat(values: List[Any]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """``(int64 lengths, int64 concatenated depths)`` of depth lists that ``_trees`` would
    accept, for the forms read without a Python int each; None for any other (``_trees``
    decides)."""
    first, count = values[0], len(values)
    try:
        if type(first) in (tuple, list):
            if values.count(first) == count:
                # One tree for every stream (a fixed shape; equal lists count as one).
                if not first or not set(map(type, first)) <= {int}:
                    return None   # bools, floats, numpy scalars: _trees
                flat = np.tile(np.asarray(first, np.int64), count)
                lengths = np.full(count, len(first), np.int64)
            elif set(map(type, values)) <= {tuple, list}:
                items = list(itertools.chain.from_iterable(values))
                if not set(map(type, items)) <= {int}:
                    return None
                flat = np.asarray(items, np.int64)
                lengths = np.fromiter(map(len, values), np.int64, count)
            else:
                return None
        elif type(first) is np.ndarray:
            # An engine's rows of its depth array. Each row's dtype is checked (a
            # concatenation would turn a bool row into ints); a value without one is not
            # an array, and arrays of other ndims do not concatenate with 1-D ones.
            dtypes = list(map(_DTYPE, values))
            one_dtype = dtypes.count(dtypes[0]) == count
            if any(d.kind not in "iu" for d in ({dtypes[0]} if one_dtype else set(dtypes))):
                return None
            shapes = list(map(_SHAPE, values))
            if one_dtype and shapes.count(shapes[0]) == count and len(shapes[0]) == 1:
                # The rows of one [streams, k] array: joining their buffers takes a third of
                # the time of a 256-row concatenate. A strided row has no such buffer.
                try:
                    flat = np.frombuffer(b"".join(values), dtypes[0])
                except TypeError:
                    flat = np.concatenate(values)
                lengths = np.full(count, shapes[0][0], np.int64)
            else:
                flat = np.concatenate(values)
                lengths = np.fromiter(map(len, values), np.int64, count)
            flat = flat.astype(np.int64, copy=False)
        else:
            return None
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
    if flat.ndim != 1 or not lengths.all() or flat.min() < 0:
        return None
    return lengths, flat


def _trees(reader: "StepReader", depths: Mapping, groups: Mapping[str, Sequence[Any]],
           labels: Mapping[str, "LabelArrays"]) -> Speculation:
    """Any layout, one stream at a time; names what is wrong."""
    named: Dict[int, np.ndarray] = {}
    for stream, values in depths.items():
        if not isinstance(stream, tuple) or len(stream) != 2:
            raise ValueError(f"step.depths key {stream!r} must be (request_id, label)")
        array = np.asarray(values)
        if array.ndim != 1 or not len(array) or array.dtype.kind not in "iu":
            raise ValueError(f"step.depths[{stream!r}]={values!r} must be a non-empty sequence of ints")
        if array.min() < 0:
            raise ValueError(f"step.depths[{stream!r}] has depth {int(array.min())}; depths are >= 0")
        named[reader.slot(*stream)] = array.astype(np.int64)
    per_label, seen = {}, set()
    for plan_label, arrays in labels.items():
        slots = arrays.slots.tolist()
        if named.keys().isdisjoint(slots):
            continue
        parts = []
        for i, (slot, count) in enumerate(zip(slots, arrays.counts.tolist())):
            given = named.get(slot)
            if given is None:
                parts.append(np.arange(count))
                continue
            if len(given) != count:
                rid, label = groups[plan_label][i][:2]
                raise ValueError(f"step.depths[{(rid, label)!r}] has {len(given)} entries but the "
                                 f"stream's view in plan label {plan_label!r} has {count} tokens")
            parts.append(given)
            seen.add(slot)
        per_label[plan_label] = np.concatenate(parts)
    missing = [stream for stream in depths if reader.slot(*stream) not in seen]
    if missing:
        raise ValueError(f"step.depths names stream {missing[0]!r}, which has no view in the step")
    order = sorted(named)
    return Speculation(None, per_label, np.asarray(order, np.int64),
                       np.asarray([named[s].max() for s in order], np.int64), {})


def attach(reader: "StepReader", streams: StreamTable, step: PositionStep, arrays: "StepArrays",
           scheme: Scheme) -> "StepArrays":
    """``arrays`` with the step's :class:`Speculation` (a draft step also commits nothing but
    its post-forks); ``arrays`` itself for a step without depths."""
    spec = read(reader, streams, step, arrays.groups, arrays.labels, scheme)
    if spec is None:
        return arrays
    commit = arrays.commit
    if spec.draft is not None:
        commit = CommitArrays(fork_src=commit.fork_src, fork_dst=commit.fork_dst)
    return arrays._replace(speculation=spec, commit=commit)


def positions(base: Columns, arrays: "StepArrays", plan_label: str, max_seq_len: int,
              mrope: bool, out: np.ndarray) -> Optional[np.ndarray]:
    """int32 positions of a plan label numbered by depths (``[n]``, M-RoPE ``[3, n]`` with
    the delta on every row) written into ``out`` (returned), or None when the scheme
    numbers it.

    The bound is on the sequence index (counter + depth), never on an M-RoPE row: vLLM
    #54498 clamped EAGLE drafts by row 0 and wrote KV at the wrong slots.

    Raises:
      ValueError: a tree's token would reach ``max_seq_len`` (a draft step's is clamped).
    """
    spec, label = arrays.speculation, arrays.labels[plan_label]
    if spec.draft is not None:
        _, live = rules.plan_draft(base, label.slots, label.counts, spec.draft, 0, max_seq_len,
                                   mrope, num_tokens=label.num_tokens, out=out)
        if live is not None:
            spec.live[plan_label] = live
        return out
    depths = spec.depths.get(plan_label)
    if depths is None:
        return None
    index = rules.plan(base, label.slots, label.counts, Scheme.SEQUENTIAL, label.num_tokens,
                       depths=depths, out=None if mrope else out)
    if len(index) and index.max() >= max_seq_len:
        token = int(np.argmax(index >= max_seq_len))
        view = int(np.searchsorted(np.cumsum(label.counts), token, side="right"))
        rid, stream_label = arrays.groups[plan_label][view][:2]
        raise ValueError(f"stream ({rid!r}, {stream_label!r}) of plan label {plan_label!r} at "
                         f"position {int(base.counters[label.slots[view]])} with depth "
                         f"{int(depths[token])} passes max_seq_len={max_seq_len}")
    if mrope:
        rules.plan(base, label.slots, label.counts, Scheme.SEQUENTIAL, label.num_tokens,
                   mrope=True, depths=depths, out=out)
    return out


def live(arrays: "StepArrays") -> Dict[str, np.ndarray]:
    """``{plan_label: bool [tokens]}`` of a planned draft step (False: past ``max_seq_len``,
    planned at 0), for the labels with a token not live; empty for any other step."""
    spec = arrays.speculation
    return {} if spec is None else spec.live


def same_depths(a: Any, b: Any) -> bool:
    """Whether two ``PositionStep.depths`` say the same (sequence values compared as tuples)."""
    if a is b:
        return True
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(
            np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)
    return not isinstance(a, Mapping) and not isinstance(b, Mapping) and a == b


def accepted_commit(reader: "StepReader", streams: StreamTable, plan: "Plan",
                    accepted: Optional[Mapping], staged: Optional["Plan"]) -> CommitArrays:
    """The commit of ``plan`` with ``accepted`` counts: named streams advance by ``a + 1``.

    ``staged``: the plan staged behind it (numbered from the full spans), or None.
    Names of requests removed since the plan are ignored, as the plan ignores them.

    Raises:
      TypeError: ``accepted`` is not a mapping.
      ValueError: a draft step; an unknown stream, one without a segment in the plan or
        with an explicit advance; a count outside ``[0, deepest draft]``; a tree stream
        left out; rejected drafts of a stream that the staged plan numbers.
    """
    spec = plan.arrays.speculation
    commit = plan.commit
    if accepted is None:
        if spec is not None and len(spec.tree_slots) and np.isin(spec.tree_slots, commit.slots).any():
            slot = int(spec.tree_slots[np.isin(spec.tree_slots, commit.slots)][0])
            raise ValueError(f"stream {_stream_of(plan, slot)!r} was planned with step.depths (a "
                             "draft tree): commit needs accepted={(request_id, label): count}")
        return commit
    if not isinstance(accepted, Mapping):
        raise TypeError(f"accepted must be a mapping {{(request_id, label): count}}, got "
                        f"{type(accepted).__name__}")
    if spec is not None and spec.draft is not None:
        raise ValueError("accepted: the plan is a draft step (int step.depths), which commits nothing")
    if plan.step.advance is not None and not isinstance(plan.step.advance, Mapping):
        raise ValueError(f"accepted: the step's advance={plan.step.advance!r} already sets every "
                         "stream's advance")
    named, slots, values = _named(reader, streams, plan, accepted)
    # Every segment named, in order (a decode batch): its spans without lookups. The
    # slot arrays of streams named as the step's views are the views' own (one object).
    every = not len(commit.adv_slots) and (slots is commit.slots
                                           or np.array_equal(slots, commit.slots))
    spans = commit.spans if every else _spans(reader, plan, named, slots)
    if spec is not None and spec.tree_slots is slots:
        deepest = spec.tree_depths  # the trees named in the same order: aligned
    else:
        deepest = spans - 1
        if spec is not None and len(spec.tree_slots):
            _tree_depths_into(deepest, slots, spec)
            left_out = _EMPTY if every else np.isin(spec.tree_slots, commit.slots) & ~np.isin(
                spec.tree_slots, slots)
            if left_out.any():
                raise ValueError(f"stream {_stream_of(plan, int(spec.tree_slots[left_out][0]))!r} "
                                 "was planned with step.depths (a draft tree): name it in accepted")
    bad = (values < 0) | (values > deepest)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"accepted[{named[i]!r}]={int(values[i])} must be in [0, {int(deepest[i])}] "
                         "(the drafts of its view)")
    rejected = _EMPTY if staged is None else slots[values + 1 != spans]
    if len(rejected):
        numbered = np.concatenate([label.slots for label in staged.arrays.labels.values()]
                                  + [staged.commit.touched])
        clash = np.isin(rejected, numbered)
        if clash.any():
            raise ValueError(f"accepted rejects drafts of stream {_stream_of(plan, int(rejected[clash][0]))!r}"
                             ", which the staged plan numbers as if they were kept: clear_preplan "
                             "before this commit, then plan that step again")
    if every:
        return CommitArrays(adv_slots=slots, adv_amounts=values + 1, fork_src=commit.fork_src,
                            fork_dst=commit.fork_dst)
    keep = ~np.isin(commit.slots, slots)
    return CommitArrays(commit.slots[keep], commit.spans[keep],
                        np.concatenate([commit.adv_slots, slots]),
                        np.concatenate([commit.adv_amounts, values + 1]),
                        commit.fork_src, commit.fork_dst)


def _tree_depths_into(deepest: np.ndarray, slots: np.ndarray, spec: Speculation) -> None:
    """Set ``deepest`` at each of ``slots`` that has a tree to that tree's deepest depth."""
    order = np.argsort(spec.tree_slots)
    tree_slots = spec.tree_slots[order]
    at = np.minimum(np.searchsorted(tree_slots, slots), len(tree_slots) - 1)
    tree = tree_slots[at] == slots
    deepest[tree] = spec.tree_depths[order][at[tree]]


# (slot version, keys, their slots) of the last streams named, per stream table: a decode
# batch names the same streams step after step (in its depths and in accepted). The version
# changes on every ingest and remove, the only changes of a stream's slot.
_NAMED: "weakref.WeakKeyDictionary[StreamTable, tuple]" = weakref.WeakKeyDictionary()


def _cached_slots(streams: StreamTable, keys: tuple) -> Optional[np.ndarray]:
    """The slots of ``keys`` when they were the last named and no slot changed since."""
    cached = _NAMED.get(streams)
    if cached is not None and cached[0] == streams.slot_version and cached[1] == keys:
        return cached[2]
    return None


def _remember_slots(streams: StreamTable, keys: tuple, slots: np.ndarray) -> np.ndarray:
    slots.flags.writeable = False  # shared by later steps
    _NAMED[streams] = (streams.slot_version, keys, slots)
    return slots


def _named(reader: "StepReader", streams: StreamTable, plan: "Plan", accepted: Mapping):
    """``(streams, int64 slots, int64 counts)`` of ``accepted``, checked, without the entries
    of requests removed since the plan."""
    keys = tuple(accepted)
    slots = _cached_slots(streams, keys)
    if slots is not None:  # the same keys, all known and checked, no slot changed
        named, counts = keys, list(accepted.values())
    else:
        named, counts = _live_entries(plan, accepted)
        slots = reader.slots([s[0] for s in named], [s[1] for s in named]) if named else _EMPTY
        if np.array_equal(slots, plan.commit.slots):
            slots = plan.commit.slots  # see accepted_commit: found by identity next time
        if len(named) == len(keys):
            _remember_slots(streams, keys, slots)
    # Python and signed numpy ints convert exactly; bools and the rest: _counts checks them.
    if all(kind is int or issubclass(kind, np.signedinteger) for kind in set(map(type, counts))):
        return named, slots, np.fromiter(counts, np.int64, len(counts))
    return named, slots, _counts(counts, named)


def _spans(reader: "StepReader", plan: "Plan", named: Sequence[Any], slots: np.ndarray) -> np.ndarray:
    """Each named stream's span in the plan's commit (its segments added up)."""
    commit = plan.commit
    present = np.isin(slots, commit.slots)
    if not present.all():
        stream = named[int(np.argmin(present))]
        why = ("has an explicit step.advance" if np.isin(reader.slot(*stream), commit.adv_slots)
               else "has no segment in the planned step")
        raise ValueError(f"accepted names stream {stream!r}, which {why}")
    unique, inverse = np.unique(commit.slots, return_inverse=True)
    totals = np.bincount(inverse, weights=commit.spans, minlength=len(unique)).astype(np.int64)
    return totals[np.searchsorted(unique, slots)]


def _live_entries(plan: "Plan", accepted: Mapping):
    """``accepted``'s streams and counts, without those of requests removed since the plan
    (ingested again or not: a new request under the same id is not in this plan)."""
    named, counts = list(accepted), list(accepted.values())
    for stream in named:
        if not isinstance(stream, tuple) or len(stream) != 2:
            raise ValueError(f"accepted key {stream!r} must be (request_id, label)")
    if not plan.dropped:
        return named, counts
    kept = [i for i, stream in enumerate(named) if not _dropped(plan, stream[0])]
    return [named[i] for i in kept], [counts[i] for i in kept]


def _dropped(plan: "Plan", rid: Any) -> bool:
    try:
        return rid in plan.dropped
    except TypeError:  # unhashable: the lookup names it
        return False


def _counts(counts: Sequence[Any], streams: Sequence[Any]) -> np.ndarray:
    for stream, value in zip(streams, counts):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"accepted[{stream!r}]={value!r} must be an int")
    return np.asarray(counts, np.int64).reshape(-1)


def _stream_of(plan: "Plan", slot: int) -> Any:
    for plan_label, views in plan.arrays.groups.items():
        for view, s in zip(views, plan.arrays.labels[plan_label].slots.tolist()):
            if s == slot:
                return tuple(view[:2])
    return f"at slot {slot}"
