"""Speculative decoding through the engine records: draft trees, draft steps, accepted counts.

The rules are the core's (:mod:`jaxrope.speculative_positions`), executed by their numpy twins in
:mod:`torch_bridge.streams` and here; this module reads and checks what an engine says
about a speculative step and turns it into slot arrays. An ordinary step (neither field
set, no ``accepted``) never reaches it. An engine's loop:

1. **verify**: ``plan`` a step whose view of each speculating stream holds its root
   (the token sampled last, not yet in the KV cache) and its drafts. A chain of ``k``
   drafts is a view of ``k + 1`` tokens, numbered ``counter + arange(k + 1)`` like any
   view; a tree is numbered by ``PositionStep(tree=...)``, token ``i`` at
   ``counter + depths[i]``: an int array ``[len(segments), k]`` (row ``s``: segment
   ``s``'s stream; an engine's batch, read without a Python object per row) or
   ``{(rid, label): depths}``. Both forms are converted to one flat array and checked
   by one validator, :func:`torch_bridge.draft_trees.check_trees`.
2. **accept**: ``commit(step, ctx, accepted=...)`` advances each named stream by
   ``a + 1`` (the root and ``a`` drafts; ``0 <= a <=`` its deepest draft: the accepted
   path's length) and the step's other streams by their spans. ``accepted`` is an int
   array ``[len(segments)]`` (one count per segment) or ``{(rid, label): a}``. A
   tree's streams must be named.
3. **draft**: the EAGLE drafter's step 0 reuses the verify step's positions (its
   ``pos_ids``, before the commit); each later step ``j`` is ``plan(PositionStep(
   segments, draft_depth=j - 1), ctx)``: one token per stream (or its ``topk``
   branches) at ``counter + j - 1``, committing nothing. A token whose position would
   reach ``max_seq_len`` is planned at 0 and ``live(plan_label)`` marks it False: give
   it a padding KV slot (vLLM's clamp, with the bound taken from the stream's index,
   not from an M-RoPE row: vLLM #54498). Under ``ctx.graph_slot`` a draft step writes
   its bucket's static buffer like any step, the tail kept.
4. **rewind outside a step** (an engine that committed its drafts, vLLM's
   ``num_computed_tokens -= num_rejected``): ``rollback(rid, label, to_position)``,
   which starts a new publish epoch so that a node that admitted the drafts takes it.

Why the records look like this: a chain needs nothing new (the drafts are tokens of
the view), and the accepted count is known only after the verify step ran, so it goes
to ``commit``, like the sampled tokens in vLLM's ``update_from_output``. The tree sits
on :class:`~torch_bridge.engine_types.PositionStep` beside ``advance``, per stream, so
:class:`~torch_bridge.engine_types.KVView` stays the 3-tuple an engine builds hundreds
of per step.

A preplan (step N+1 staged while N runs) is numbered as if N committed every span;
a commit whose ``accepted`` rejects drafts of a stream the staged plan numbers is
refused (``clear_preplan`` and plan again).

Example (a tree at 7, one draft accepted, then a draft step):
  >>> from torch_bridge import PositionConfig, PositionManager, PositionStep, Segment, StepContext
  >>> mgr = PositionManager(PositionConfig(), "cpu", max_seq_len=64)
  >>> mgr.ingest_request("r0", overrides={"text": 7})
  >>> ctx = StepContext(("r0",))
  >>> verify = PositionStep([Segment("r0", "text", 4)], tree={("r0", "text"): (0, 1, 1, 2)})
  >>> mgr.plan(verify, ctx)["text"].tolist()
  [7, 8, 8, 9]
  >>> mgr.commit(verify, ctx, accepted={("r0", "text"): 1})
  >>> mgr.position("r0", "text")
  9
  >>> mgr.plan(PositionStep([Segment("r0", "text", 1)], draft_depth=1), ctx)["text"].tolist()
  [10]
  >>> mgr.live("text").tolist(), mgr.position("r0", "text")
  ([True], 9)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, NamedTuple, Optional

import numpy as np

from jaxrope.numbers import INT64_MAX, as_int
from jaxrope.positions import Scheme
from torch_bridge import draft_trees
from torch_bridge import streams as rules
from torch_bridge.engine_types import PositionStep
from torch_bridge.streams import EMPTY, Columns, CommitArrays

if TYPE_CHECKING:
    from torch_bridge.step_arrays import StepArrays, StepReader

__all__ = ["Speculation", "accepted_commit", "attach", "positions", "same_tree"]


class Speculation(NamedTuple):
    """A step's depth numbering, checked (``StepArrays.speculation``).

    Attributes:
      draft: ``step.draft_depth`` of a draft step, else None.
      depths: ``{plan_label: int64 [tokens]}``: every token's depth, for the plan labels
        holding a stream of ``step.tree``.
      tree_slots: int64 ``[S]``: the slots of the tree's streams, in its row order.
      tree_depths: int64 ``[S]``: each one's deepest depth (the most drafts a commit may
        accept).
      live: ``{plan_label: bool [tokens]}`` of a draft step, filled by :func:`positions`.
    """

    draft: Optional[int]
    depths: Dict[str, np.ndarray]
    tree_slots: np.ndarray
    tree_depths: np.ndarray
    live: Dict[str, np.ndarray]


# ---------------------------------------------------------------------------- plan


def attach(reader: "StepReader", step: PositionStep, arrays: "StepArrays", scheme: Scheme,
           max_seq_len: int) -> "StepArrays":
    """``arrays`` with the step's :class:`Speculation`, for a step with ``draft_depth`` or
    ``tree`` (a draft step also commits nothing but its post-forks).

    Raises:
      TypeError: a field of the wrong type (bools and non-integer depths included).
      ValueError: a scheme other than SEQUENTIAL, a draft depth outside ``[0,
        max_seq_len]`` or with an explicit advance, a tree naming a stream without a
        view or of another length than its view, or depths that are not a tree
        (:func:`torch_bridge.draft_trees.check_trees`).
    """
    if scheme is not Scheme.SEQUENTIAL:
        field = "draft_depth" if step.draft_depth is not None else "tree"
        raise ValueError(f"step.{field} is set: speculative steps need the SEQUENTIAL scheme, "
                         f"this manager numbers {scheme.value}")
    if step.draft_depth is not None:
        depth = _draft_depth(step, max_seq_len)
        commit = CommitArrays(fork_src=arrays.commit.fork_src, fork_dst=arrays.commit.fork_dst)
        return arrays._replace(speculation=Speculation(depth, {}, EMPTY, EMPTY, {}), commit=commit)
    slots, per_label, deepest = draft_trees.read(reader, step, arrays)
    return arrays._replace(speculation=Speculation(None, per_label, slots, deepest, {}))


def _draft_depth(step: PositionStep, max_seq_len: int) -> int:
    # At max_seq_len every token is past the end.
    depth = as_int(step.draft_depth, "step.draft_depth", 0, max_seq_len,
                   f" (max_seq_len={max_seq_len})")
    if step.advance is not None:
        raise ValueError(f"step.advance={step.advance!r}: a draft step (step.draft_depth) commits "
                         "nothing; leave advance None")
    return depth


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


def same_tree(a: Any, b: Any) -> bool:
    """Whether two ``PositionStep.tree`` say the same (arrays and sequences by value)."""
    if a is b:
        return True
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(
            np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)
    return False


# ---------------------------------------------------------------------------- commit


def accepted_commit(reader: "StepReader", plan: Any, accepted: Any,
                    staged: Optional[Any]) -> CommitArrays:
    """The commit of a speculative ``plan``, or of one given ``accepted`` counts: each
    named stream advances by ``a + 1`` (its accepted path: the root and ``a`` drafts).

    ``plan`` and ``staged`` are :class:`torch_bridge.plans.Plan` records (not imported
    here: plans imports this module to number a step's drafts).

    ``accepted``: None, ``{(rid, label): a}``, or an int array ``[len(step.segments)]``
    (one count per segment, in their order). ``staged``: the plan staged behind it
    (numbered from the full spans), or None. Streams of requests removed since the plan
    are ignored, as the plan ignores them.

    Raises:
      TypeError: ``accepted`` of another type, or an array of non-integer counts.
      ValueError: a draft step; an unknown stream, one without a segment in the plan or
        with an explicit advance; a mapped count that is not an int; a count outside
        ``[0, deepest draft]`` (compared before any cast); an array of another length
        than the segments or beside an advance; a tree stream left out; rejected drafts
        of a stream that the staged plan numbers.
    """
    spec = plan.arrays.speculation
    commit = plan.commit
    trees = EMPTY if spec is None else spec.tree_slots
    if len(trees) and (plan.dropped or len(commit.adv_slots)):   # the trees still committed
        trees = trees[np.isin(trees, commit.slots)]
    if accepted is None:
        if len(trees):
            raise ValueError(f"stream {_stream_of(plan, int(trees[0]))!r} was planned with step.tree "
                             "(a draft tree): commit needs accepted={(request_id, label): count}")
        return commit
    if spec is not None and spec.draft is not None:
        raise ValueError("accepted: the plan is a draft step (step.draft_depth), which commits nothing")
    if plan.step.advance is not None and not isinstance(plan.step.advance, Mapping):
        raise ValueError(f"accepted: the step's advance={plan.step.advance!r} already sets every "
                         "stream's advance")
    if isinstance(accepted, np.ndarray):
        entry, stream, slots, values = _accepted_array(plan, accepted)
    elif isinstance(accepted, Mapping):
        entry, stream, slots, values = _accepted_mapping(reader, plan, accepted)
    else:
        raise TypeError(f"accepted must be a mapping {{(request_id, label): count}} or an int "
                        f"array [len(step.segments)], got {type(accepted).__name__}")
    # Every segment named, in order (a decode batch): its spans without lookups.
    every = not len(commit.adv_slots) and np.array_equal(slots, commit.slots)
    spans = commit.spans if every else _spans(plan, stream, slots)
    deepest = spans - 1
    if len(trees):
        # The tree's streams, in its order (and none dropped: the depths are the plan's).
        if trees is spec.tree_slots and np.array_equal(trees, slots):
            deepest = spec.tree_depths
        else:
            _tree_depths_into(deepest, slots, spec)
            left_out = ~np.isin(trees, slots)
            if left_out.any():
                raise ValueError(f"stream {_stream_of(plan, int(trees[left_out][0]))!r} was planned "
                                 "with step.tree (a draft tree): name it in accepted")
    bad = (values < 0) | (values > deepest)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{entry(i)}={int(values[i])} must be in [0, {int(deepest[i])}] "
                         "(the drafts of its view)")
    rejected = EMPTY if staged is None else slots[values + 1 != spans]
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


# Accepted counts are compared as Python ints before the int64 cast: nothing wraps into range.
_COUNT_BOUND = INT64_MAX


def _accepted_array(plan: Any, accepted: np.ndarray):
    """``(entry, stream, slots, int64 counts)`` of the ``[len(segments)]`` form (``entry(i)``
    and ``stream(i)`` name count ``i``), without the segments of requests removed since
    the plan."""
    segments = plan.step.segments
    if accepted.shape != (len(segments),):
        raise ValueError(f"accepted.shape={accepted.shape} must be [len(step.segments)] = "
                         f"[{len(segments)}]")
    if accepted.dtype.kind not in "iu":
        raise TypeError(f"accepted must hold integer counts, got dtype {accepted.dtype}")
    if plan.step.advance is not None:
        raise ValueError(f"accepted as an array counts every segment, but step.advance="
                         f"{plan.step.advance!r} sets some: pass {{(request_id, label): count}}")
    slots = plan.arrays.commit.slots   # the segments' own, in order (no advance)
    draft_trees.check_distinct(slots, segments, "accepted")
    index = np.arange(len(segments))
    if plan.dropped:
        kept = np.isin(slots, plan.commit.slots)
        slots, accepted, index = slots[kept], accepted[kept], index[kept]
    stream = lambda i: tuple(segments[index[i]][:2])  # noqa: E731
    entry = lambda i: f"accepted[{int(index[i])}] (stream {stream(i)!r})"  # noqa: E731
    if len(accepted) and int(accepted.max()) > _COUNT_BOUND:
        i = int(np.argmax(accepted > _COUNT_BOUND))
        raise ValueError(f"{entry(i)}={int(accepted[i])} must be in [0, the drafts of its view]")
    return entry, stream, slots, accepted.astype(np.int64)


def _accepted_mapping(reader: "StepReader", plan: Any, accepted: Mapping):
    """``(entry, stream, slots, int64 counts)`` of the mapping form, checked, without the
    entries of requests removed since the plan."""
    named, counts = list(accepted), list(accepted.values())
    spec = plan.arrays.speculation
    # The streams of the plan's tree mapping, in its order: checked and looked up at plan.
    tree_keys = (not plan.dropped and spec is not None and isinstance(plan.step.tree, Mapping)
                 and named == list(plan.step.tree))
    if named and not tree_keys:
        draft_trees.check_keys(named, "accepted")
    values = None
    if set(map(type, counts)) <= {int}:
        try:   # Python ints convert exactly or raise: none wraps
            values = np.fromiter(counts, np.int64, len(counts))
        except OverflowError:
            pass
    if values is None:
        checked = [as_int(value, f"accepted[{stream!r}]") for stream, value in zip(named, counts)]
        for stream, value in zip(named, checked):
            if not -_COUNT_BOUND <= value <= _COUNT_BOUND:
                raise ValueError(f"accepted[{stream!r}]={value} must be in [0, the drafts of "
                                 "its view]")
        values = np.asarray(checked, np.int64)
    if plan.dropped:
        kept = [i for i, stream in enumerate(named) if not _dropped(plan, stream[0])]
        named, values = [named[i] for i in kept], values[kept]
    if tree_keys:
        slots = spec.tree_slots
    elif named:
        rids, labels = zip(*named)
        slots = reader.slots(rids, labels)
    else:
        slots = EMPTY
    return lambda i: f"accepted[{named[i]!r}]", named.__getitem__, slots, values


def _tree_depths_into(deepest: np.ndarray, slots: np.ndarray, spec: Speculation) -> None:
    """Set ``deepest`` at each of ``slots`` that has a tree to that tree's deepest depth."""
    order = np.argsort(spec.tree_slots)
    tree_slots = spec.tree_slots[order]
    at = np.minimum(np.searchsorted(tree_slots, slots), len(tree_slots) - 1)
    tree = tree_slots[at] == slots
    deepest[tree] = spec.tree_depths[order][at[tree]]


def _spans(plan: Any, stream: Callable[[int], Any], slots: np.ndarray) -> np.ndarray:
    """Each named stream's span in the plan's commit (its segments added up)."""
    commit = plan.commit
    present = np.isin(slots, commit.slots)
    if not present.all():
        i = int(np.argmin(present))
        why = ("has an explicit step.advance" if np.isin(slots[i], commit.adv_slots)
               else "has no segment in the planned step")
        raise ValueError(f"accepted names stream {stream(i)!r}, which {why}")
    unique, inverse = np.unique(commit.slots, return_inverse=True)
    totals = np.bincount(inverse, weights=commit.spans, minlength=len(unique)).astype(np.int64)
    return totals[np.searchsorted(unique, slots)]


def _dropped(plan: Any, rid: Any) -> bool:
    try:
        return rid in plan.dropped
    except TypeError:  # unhashable: the lookup names it
        return False


def _stream_of(plan: Any, slot: int) -> Any:
    for plan_label, views in plan.arrays.groups.items():
        for view, s in zip(views, plan.arrays.labels[plan_label].slots.tolist()):
            if s == slot:
                return tuple(view[:2])
    return f"at slot {slot}"
