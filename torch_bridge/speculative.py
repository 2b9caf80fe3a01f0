"""Speculative decoding through the engine records: draft trees, draft steps, accepted counts.

The rules are the core's (:mod:`jaxrope.speculative`), executed by their numpy twins in
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
   by one validator, :func:`check_trees`.
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

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from jaxrope.positions import Scheme
from torch_bridge import streams as rules
from torch_bridge.engine_types import PositionStep
from torch_bridge.streams import Columns, CommitArrays

if TYPE_CHECKING:
    from torch_bridge.plans import Plan
    from torch_bridge.step_arrays import StepArrays, StepReader

__all__ = ["Speculation", "accepted_commit", "attach", "check_trees", "positions", "same_tree"]

_EMPTY = np.zeros((0,), np.int64)
_EMPTY.flags.writeable = False


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


# ---------------------------------------------------------------------------- the tree rule


def check_trees(rows: np.ndarray, lengths: Optional[np.ndarray],
                where: Callable[[int], str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(int64 rows, int64 deepest [S])`` once each row forms one draft tree, else ValueError.

    Args:
      rows: ``[S, W]`` of any integer dtype: row ``s`` the depths of one stream's tree.
      lengths: int64 ``[S]``, each row's token count (>= 1; entries past it are padding
        and ignored), or None when every row has ``W``.
      where: names row ``s`` in a message (``"step.tree[('r0', 'text')]"``).

    The rule (the twin of :func:`jaxrope.speculative.valid_trees`): a row's token 0 is
    its root, at depth 0, and no other token is; every other token's depth is at most
    one more than a depth earlier in its row, so a token at depth ``d > 0`` has a
    possible parent at ``d - 1`` before it. That is how both engines that verify trees
    lay them out, parents first: vLLM's tree attention (``vllm/v1/attention/backends/
    tree_attn.py``, ``_prepare_tree_attn_bias``: the root at index 0, the
    ``speculative_token_tree`` paths sorted by depth, each node's ancestors
    ``path[:c + 1]`` looked up among them) and SGLang's EAGLE tree
    (``sgl-kernel/csrc/speculative/eagle_utils.cu``, ``build_tree_efficient``: token 0
    the verified root at ``seq_len``, each draft one deeper than a parent selected
    before it, a draft with none "an invalid eagle tree"). A depth list of this form
    always has a path ``0, 1, .., deepest``, so accepting ``a <= deepest`` drafts keeps
    ``a + 1`` computed tokens.

    Depths are compared at their own width before the cast (an unsigned 64-bit depth
    never wraps to a small one): a valid depth is at most its token's index in the row.

    Example:
      >>> rows, deepest = check_trees(np.array([[0, 1, 1, 2], [0, 1, 0, 0]]), np.array([4, 2]), str)
      >>> deepest.tolist()
      [2, 1]
      >>> check_trees(np.array([[0, 5]]), None, lambda s: "tree")
      Traceback (most recent call last):
      ...
      ValueError: tree=[0, 5] is not a draft tree: token 1 has depth 5; no token before it has depth 4 (its parent)
    """
    _check_integer(rows.dtype, lambda: where(0))
    index = np.arange(rows.shape[1])
    real = None if lengths is None else index < lengths[:, None]
    # At the depths' own width, nothing cast yet: a valid depth is at most its token's index.
    bad = (rows < 0) | (rows > index)
    if real is not None:
        bad &= real
    if not bad.any():
        rows = rows.astype(np.int64, copy=False)
        if real is not None:
            rows = np.where(real, rows, 0)    # padding: depth 0 moves no running max
        running = np.maximum.accumulate(rows, axis=1)
        rest = rows[:, 1:]
        bad = np.concatenate([rows[:, :1] != 0, (rest == 0) | (rest > running[:, :-1] + 1)], axis=1)
        if real is not None:
            bad &= real
        if not bad.any():
            return rows, running[:, -1]
    s, token = (int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
    value = int(rows[s, token])
    why = ("depths are >= 0" if value < 0 else
           "the root (token 0) has depth 0" if token == 0 else
           "a tree has one root, token 0" if value == 0 else
           f"no token before it has depth {value - 1} (its parent)")
    values = rows[s, :rows.shape[1] if lengths is None else int(lengths[s])].tolist()
    shown = values if len(values) <= 16 else values[:16] + ["..."]
    raise ValueError(f"{where(s)}={shown} is not a draft tree: token {token} has depth {value}; {why}")


def _check_integer(dtype: np.dtype, where: Callable[[], str]) -> None:
    if dtype.kind not in "iu":
        raise TypeError(f"{where()} must hold integer depths, got dtype {dtype}")


# ---------------------------------------------------------------------------- plan


def attach(reader: "StepReader", step: PositionStep, arrays: "StepArrays", scheme: Scheme,
           max_seq_len: int) -> "StepArrays":
    """``arrays`` with the step's :class:`Speculation`, for a step with ``draft_depth`` or
    ``tree`` (a draft step also commits nothing but its post-forks).

    Raises:
      TypeError: a field of the wrong type (bools and non-integer depths included).
      ValueError: a scheme other than SEQUENTIAL, a draft depth outside ``[0,
        max_seq_len)`` or with an explicit advance, a tree naming a stream without a
        view or of another length than its view, or depths that are not a tree
        (:func:`check_trees`).
    """
    if scheme is not Scheme.SEQUENTIAL:
        field = "draft_depth" if step.draft_depth is not None else "tree"
        raise ValueError(f"step.{field} is set: speculative steps need the SEQUENTIAL scheme, "
                         f"this manager numbers {scheme.value}")
    if step.draft_depth is not None:
        depth = _draft_depth(step, max_seq_len)
        commit = CommitArrays(fork_src=arrays.commit.fork_src, fork_dst=arrays.commit.fork_dst)
        return arrays._replace(speculation=Speculation(depth, {}, _EMPTY, _EMPTY, {}), commit=commit)
    if isinstance(step.tree, np.ndarray):
        slots, lengths, rows, where = _array_rows(reader, step, arrays)
    elif isinstance(step.tree, Mapping):
        slots, lengths, rows, where = _mapping_rows(reader, step.tree)
    else:
        raise TypeError(f"step.tree must be an int array [len(step.segments), k] or "
                        f"{{(request_id, label): depths}}, got {type(step.tree).__name__}")
    rows, deepest = check_trees(rows, lengths, where)
    width = np.full(len(slots), rows.shape[1], np.int64) if lengths is None else lengths
    flat = rows.reshape(-1) if lengths is None else rows[np.arange(rows.shape[1]) < lengths[:, None]]
    per_label = _per_label(arrays, slots, width, flat, where)
    return arrays._replace(speculation=Speculation(None, per_label, slots, deepest, {}))


def _draft_depth(step: PositionStep, max_seq_len: int) -> int:
    depth = step.draft_depth
    if not isinstance(depth, (int, np.integer)) or isinstance(depth, (bool, np.bool_)):
        raise TypeError(f"step.draft_depth={depth!r} must be an int (a draft step at counter + "
                        "draft_depth)")
    if not 0 <= int(depth) < max_seq_len:
        raise ValueError(f"step.draft_depth={int(depth)} must be in [0, {max_seq_len}) (max_seq_len)")
    if step.advance is not None:
        raise ValueError(f"step.advance={step.advance!r}: a draft step (step.draft_depth) commits "
                         "nothing; leave advance None")
    return int(depth)


def _array_rows(reader: "StepReader", step: PositionStep, arrays: "StepArrays"):
    """``(slots, None, rows, where)`` of the ``[len(segments), k]`` form (every row full)."""
    tree = step.tree
    segments = step.segments
    if tree.ndim != 2 or tree.shape[0] != len(segments) or not tree.size:
        raise ValueError(f"step.tree.shape={tree.shape} must be [len(step.segments), k] = "
                         f"[{len(segments)}, k >= 1] (a step with segments)")
    where = lambda s: f"step.tree[{s}] (stream {tuple(segments[s][:2])!r})"  # noqa: E731
    _check_integer(tree.dtype, lambda: "step.tree")
    slots, spans = _segment_arrays(reader, step, arrays)
    width = tree.shape[1]
    if (spans != width).any():
        s = int(np.argmax(spans != width))
        raise ValueError(f"step.tree is [{len(segments)}, {width}] but step.segments[{s}]="
                         f"{tuple(segments[s])!r} spans {int(spans[s])} tokens")
    _check_distinct(slots, segments, "step.tree")
    return slots, None, tree, where


def _mapping_rows(reader: "StepReader", tree: Mapping):
    """``(slots, lengths, rows [S, max length], where)`` of the ``{(rid, label): depths}``
    form (a row padded past its length)."""
    keys, values = list(tree), list(tree.values())
    if not keys:
        raise ValueError("step.tree={} names no stream; leave tree None for a step without one")
    _check_keys(keys, "step.tree")
    count = len(values)
    flat, shared = None, False
    if set(map(type, values)) <= {tuple, list}:
        # Python ints (the usual record): read in one pass, without an array per row.
        shared = values.count(values[0]) == count   # one tree shape for every stream
        items = values[0] if shared else list(itertools.chain.from_iterable(values))
        if items and set(map(type, items)) == {int}:
            flat = np.asarray(items)     # int64, or uint64 / object past int64: checked later
            lengths = np.fromiter(map(len, values), np.int64, count)
            if shared:
                rows = np.broadcast_to(flat, (count, len(flat)))
    if flat is None:
        shared = False
        rows = [_row(key, value) for key, value in zip(keys, values)]
        joint = np.result_type(*{row.dtype for row in rows})
        if joint.kind not in "iu":   # uint64 beside a signed dtype: numpy has no common int
            raise TypeError(f"step.tree's rows hold dtypes {sorted({str(r.dtype) for r in rows})}, "
                            "which share no integer dtype: pass one")
        lengths = np.fromiter(map(len, rows), np.int64, count)
        flat = np.concatenate(rows)
    if not lengths.all():
        s = int(np.argmin(lengths))
        raise ValueError(f"step.tree[{keys[s]!r}]={values[s]!r} must be a non-empty sequence of ints")
    if not shared:
        rows = np.zeros((count, int(lengths.max())), flat.dtype)
        rows[np.arange(rows.shape[1]) < lengths[:, None]] = flat
    rids, labels = zip(*keys)
    return reader.slots(rids, labels), lengths, rows, lambda s: f"step.tree[{keys[s]!r}]"


def _row(key: Any, values: Any) -> np.ndarray:
    """One row of the mapping form as an integer array, or the error naming it."""
    # A Python bool in a list would become 1 in the array: refuse it here.
    if isinstance(values, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in values):
        raise TypeError(f"step.tree[{key!r}]={values!r} must hold integer depths, not bools")
    try:
        row = None if isinstance(values, (set, frozenset, Mapping, str)) else np.asarray(values)
    except (TypeError, ValueError, OverflowError):   # ragged, or not numbers
        row = None
    if row is None or row.ndim != 1 or not len(row):
        raise ValueError(f"step.tree[{key!r}]={values!r} must be a non-empty sequence of ints")
    _check_integer(row.dtype, lambda: f"step.tree[{key!r}]={values!r}")
    return row


def _check_keys(keys: List[Any], name: str) -> None:
    if set(map(type, keys)) != {tuple} or set(map(len, keys)) != {2}:
        key = next(k for k in keys if not isinstance(k, tuple) or len(k) != 2)
        raise ValueError(f"{name} key {key!r} must be (request_id, label)")


def _per_label(arrays: "StepArrays", slots: np.ndarray, lengths: np.ndarray, flat: np.ndarray,
               where: Callable[[int], str]) -> Dict[str, np.ndarray]:
    """``{plan_label: int64 depths of its tokens}``: a tree stream's view takes its row, any
    other view its own ``arange``; every row must have a view, each of its length."""
    order = np.argsort(slots, kind="stable")
    ordered = slots[order]
    seen = np.zeros(len(slots), bool)
    per_label = {}
    for plan_label, label in arrays.labels.items():
        if np.array_equal(label.slots, slots) and np.array_equal(label.counts, lengths):
            per_label[plan_label] = flat     # the views are the tree's rows, in order
            seen[:] = True
            continue
        at = np.minimum(np.searchsorted(ordered, label.slots), len(ordered) - 1)
        hit = ordered[at] == label.slots
        if not hit.any():
            continue
        rows = order[at[hit]]
        wrong = label.counts[hit] != lengths[rows]
        if wrong.any():
            r = int(rows[np.argmax(wrong)])
            raise ValueError(f"{where(r)} has {int(lengths[r])} entries but the stream's view in "
                             f"plan label {plan_label!r} has {int(label.counts[hit][np.argmax(wrong)])} "
                             "tokens")
        seen[rows] = True
        starts = np.cumsum(lengths) - lengths
        view_row = np.full(len(label.slots), -1, np.int64)
        view_row[hit] = rows
        view_start = np.cumsum(label.counts) - label.counts
        token_row = np.repeat(view_row, label.counts)
        depths = np.arange(label.num_tokens) - np.repeat(view_start, label.counts)
        tree = token_row >= 0
        depths[tree] = flat[starts[token_row[tree]] + depths[tree]]
        per_label[plan_label] = depths
    if not seen.all():
        raise ValueError(f"{where(int(np.argmin(seen)))} names a stream which has no view in the step")
    return per_label


def _segment_arrays(reader: "StepReader", step: PositionStep,
                    arrays: "StepArrays") -> Tuple[np.ndarray, np.ndarray]:
    """int64 slots and spans of ``step.segments``, in their order."""
    if step.advance is None:   # the commit's segments are the step's, unfiltered
        return arrays.commit.slots, arrays.commit.spans
    return reader.records(step.segments, "step.segments")


def _check_distinct(slots: np.ndarray, segments: Sequence[Any], name: str) -> None:
    ordered = np.sort(slots)
    if (ordered[1:] == ordered[:-1]).any():
        _, first = np.unique(slots, return_index=True)
        s = min(set(range(len(slots))) - set(first.tolist()))
        raise ValueError(f"{name} is one row per segment, but stream {tuple(segments[s][:2])!r} "
                         f"has more than one segment (step.segments[{s}]); name the streams in a "
                         "mapping")


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


def accepted_commit(reader: "StepReader", plan: "Plan", accepted: Any,
                    staged: Optional["Plan"]) -> CommitArrays:
    """The commit of a speculative ``plan``, or of one given ``accepted`` counts: each
    named stream advances by ``a + 1`` (its accepted path: the root and ``a`` drafts).

    ``accepted``: None, ``{(rid, label): a}``, or an int array ``[len(step.segments)]``
    (one count per segment, in their order). ``staged``: the plan staged behind it
    (numbered from the full spans), or None. Streams of requests removed since the plan
    are ignored, as the plan ignores them.

    Raises:
      TypeError: ``accepted`` of another type, a count that is not an int.
      ValueError: a draft step; an unknown stream, one without a segment in the plan or
        with an explicit advance; a count outside ``[0, deepest draft]``; a tree stream
        left out; rejected drafts of a stream that the staged plan numbers.
    """
    spec = plan.arrays.speculation
    commit = plan.commit
    trees = _EMPTY if spec is None else spec.tree_slots
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
        if np.array_equal(trees, slots):   # the tree's streams, in its order
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


# Accepted counts are compared as Python ints before the int64 cast: nothing wraps into range.
_COUNT_BOUND = int(np.iinfo(np.int64).max)


def _accepted_array(plan: "Plan", accepted: np.ndarray):
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
    _check_distinct(slots, segments, "accepted")
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


def _accepted_mapping(reader: "StepReader", plan: "Plan", accepted: Mapping):
    """``(entry, stream, slots, int64 counts)`` of the mapping form, checked, without the
    entries of requests removed since the plan."""
    named, counts = list(accepted), list(accepted.values())
    if named:
        _check_keys(named, "accepted")
    values = None
    if set(map(type, counts)) <= {int}:
        try:   # Python ints convert exactly or raise: none wraps
            values = np.fromiter(counts, np.int64, len(counts))
        except OverflowError:
            pass
    if values is None:
        for stream, value in zip(named, counts):
            if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
                raise ValueError(f"accepted[{stream!r}]={value!r} must be an int")
            if not -_COUNT_BOUND <= int(value) <= _COUNT_BOUND:
                raise ValueError(f"accepted[{stream!r}]={int(value)} must be in [0, the drafts of "
                                 "its view]")
        values = np.fromiter(map(int, counts), np.int64, len(counts))
    if plan.dropped:
        kept = [i for i, stream in enumerate(named) if not _dropped(plan, stream[0])]
        named, values = [named[i] for i in kept], values[kept]
    if not named:
        return (lambda i: f"accepted[{named[i]!r}]", named.__getitem__, _EMPTY, values)
    rids, labels = zip(*named)
    return (lambda i: f"accepted[{named[i]!r}]", named.__getitem__, reader.slots(rids, labels),
            values)


def _tree_depths_into(deepest: np.ndarray, slots: np.ndarray, spec: Speculation) -> None:
    """Set ``deepest`` at each of ``slots`` that has a tree to that tree's deepest depth."""
    order = np.argsort(spec.tree_slots)
    tree_slots = spec.tree_slots[order]
    at = np.minimum(np.searchsorted(tree_slots, slots), len(tree_slots) - 1)
    tree = tree_slots[at] == slots
    deepest[tree] = spec.tree_depths[order][at[tree]]


def _spans(plan: "Plan", stream: Callable[[int], Any], slots: np.ndarray) -> np.ndarray:
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


def _dropped(plan: "Plan", rid: Any) -> bool:
    try:
        return rid in plan.dropped
    except TypeError:  # unhashable: the lookup names it
        return False


def _stream_of(plan: "Plan", slot: int) -> Any:
    for plan_label, views in plan.arrays.groups.items():
        for view, s in zip(views, plan.arrays.labels[plan_label].slots.tolist()):
            if s == slot:
                return tuple(view[:2])
    return f"at slot {slot}"
