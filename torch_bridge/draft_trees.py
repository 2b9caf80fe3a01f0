"""Draft trees as an engine sends them (``PositionStep.tree``), read and checked by one rule.

Two record forms, one path: an int array ``[len(step.segments), k]`` (row ``s``: the
depths of segment ``s``'s stream; an engine's batch, read as it is) or
``{(request_id, label): depths}`` (a convenience for some streams of a mixed batch).
Each is converted to rows ``[S, W]`` (the mapping's padded past each row's length),
then :func:`check_trees` checks every row at once, at the depths' own width.

Example:
  >>> from torch_bridge.engine_types import PositionStep, Segment, StepContext
  >>> from torch_bridge.step_arrays import StepReader
  >>> from torch_bridge.streams import StreamTable
  >>> streams = StreamTable(("text",)); _ = streams.ingest("r0"); _ = streams.ingest("r1")
  >>> step = PositionStep([Segment("r0", "text", 3), Segment("r1", "text", 3)],
  ...                     tree=np.array([[0, 1, 1], [0, 1, 2]]))
  >>> reader = StepReader(streams, "kv")
  >>> slots, depths, deepest = read(reader, step, reader.read(step, StepContext()))
  >>> depths["text"].tolist(), deepest.tolist()
  ([0, 1, 1, 0, 1, 2], [1, 2])
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from torch_bridge.engine_types import PositionStep

if TYPE_CHECKING:
    from torch_bridge.step_arrays import StepArrays, StepReader

__all__ = ["check_distinct", "check_keys", "check_trees", "read"]

_STREAM = operator.itemgetter(0, 1)   # (request_id, label) of a view record


def read(reader: "StepReader", step: PositionStep,
         arrays: "StepArrays") -> Tuple[np.ndarray, Dict[str, np.ndarray], np.ndarray]:
    """``(slots [S], {plan_label: int64 depths of its tokens}, int64 deepest [S])`` of
    ``step.tree``, checked: the tree's streams in its row order, every token's depth in
    the plan labels holding one, and each tree's deepest depth.

    Raises:
      TypeError: a tree of the wrong type, non-integer (or bool) depths.
      ValueError: a row naming a stream without a view or of another length than its
        view, a wrong array shape, a stream named twice, or depths that are not a tree
        (:func:`check_trees`).
    """
    if isinstance(step.tree, np.ndarray):
        slots, lengths, rows, where = _array_rows(reader, step, arrays)
    elif isinstance(step.tree, Mapping):
        slots, lengths, rows, where = _mapping_rows(reader, step.tree, arrays)
    else:
        raise TypeError(f"step.tree must be an int array [len(step.segments), k] or "
                        f"{{(request_id, label): depths}}, got {type(step.tree).__name__}")
    rows, deepest = check_trees(rows, lengths, where)
    width = np.full(len(slots), rows.shape[1], np.int64) if lengths is None else lengths
    flat = rows.reshape(-1) if lengths is None else rows[np.arange(rows.shape[1]) < lengths[:, None]]
    return slots, _per_label(arrays, slots, width, flat, where), deepest


def check_trees(rows: np.ndarray, lengths: Optional[np.ndarray],
                where: Callable[[int], str]) -> Tuple[np.ndarray, np.ndarray]:
    """``(int64 rows, int64 deepest [S])`` once each row forms one draft tree, else ValueError.

    Args:
      rows: ``[S, W]`` of any integer dtype: row ``s`` the depths of one stream's tree.
      lengths: int64 ``[S]``, each row's token count (>= 1; entries past it are padding
        and ignored), or None when every row has ``W``.
      where: names row ``s`` in a message (``"step.tree[('r0', 'text')]"``).

    The rule (the twin of :func:`jaxrope.speculative_positions.valid_trees`): a row's token 0 is
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
    check_distinct(slots, segments, "step.tree")
    return slots, None, tree, where


def _mapping_rows(reader: "StepReader", tree: Mapping, arrays: "StepArrays"):
    """``(slots, lengths, rows [S, max length], where)`` of the ``{(rid, label): depths}``
    form (a row padded past its length; ``lengths`` None when every row is full)."""
    keys, values = list(tree), list(tree.values())
    if not keys:
        raise ValueError("step.tree={} names no stream; leave tree None for a step without one")
    # The usual batch names a plan label's views, in order: their slots, already looked up.
    slots = next((label.slots for plan_label, label in arrays.labels.items()
                  if len(label.slots) == len(keys)
                  and keys == list(map(_STREAM, arrays.groups[plan_label]))), None)
    if slots is None:
        check_keys(keys, "step.tree")
        rids, labels = zip(*keys)
        slots = reader.slots(rids, labels)
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
                rows = np.tile(flat, (count, 1))
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
    width = int(lengths.max())
    uniform = int(lengths.min()) == width     # a fixed tree size: no padding
    if uniform and not shared:
        rows = flat.reshape(count, width)
    elif not uniform:
        rows = np.zeros((count, width), flat.dtype)
        rows[np.arange(width) < lengths[:, None]] = flat
    return slots, None if uniform else lengths, rows, lambda s: f"step.tree[{keys[s]!r}]"


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


def check_keys(keys: List[Any], name: str) -> None:
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


def check_distinct(slots: np.ndarray, segments: Sequence[Any], name: str) -> None:
    ordered = np.sort(slots)
    if (ordered[1:] == ordered[:-1]).any():
        _, first = np.unique(slots, return_index=True)
        s = min(set(range(len(slots))) - set(first.tolist()))
        raise ValueError(f"{name} is one row per segment, but stream {tuple(segments[s][:2])!r} "
                         f"has more than one segment (step.segments[{s}]); name the streams in a "
                         "mapping")
