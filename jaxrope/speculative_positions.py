"""Speculative decoding: the positions of draft and verify steps, and the accept transition.

A stream has ``n`` committed tokens (its counter). A draft model proposes tokens past
them; the target model then *verifies* them in one step, together with the token it
sampled last (the *root*, at position ``n``, not yet in the KV cache):

- **chain** (``k`` drafts, vLLM's EAGLE / MTP / n-gram): the verify step numbers the
  root and the drafts ``n + arange(k + 1)`` (vLLM v1: ``num_computed_tokens`` plus the
  scheduled tokens' index); :func:`plan_chain`.
- **tree** (SGLang's EAGLE with ``topk > 1``): token ``t`` of the verify step sits at
  ``n + depth[t]``, the root at depth 0 (SGLang's ``build_tree_kernel_efficient``:
  depths ``[0, 1, 1, 2]`` at length 7 give ``[7, 8, 8, 9]``); :func:`plan_tree`, and
  :func:`tree_depths` for a tree given by its parents. A view's depths must form a
  tree laid out parents first (:func:`valid_trees`: token 0 the only root, every other
  depth at most one more than an earlier one), so a path ``0 .. deepest`` exists.
- **accept**: with ``a`` drafts accepted the stream keeps the root and those ``a``
  (positions ``n .. n + a``: a tree's accepted path is one token per depth), so its
  counter becomes ``n + a + 1`` (vLLM: ``num_computed_tokens -= num_rejected`` after
  scheduling ``k + 1``; SGLang: ``seq_lens += accept_length + 1``); :func:`accept`. The
  counter moves forward only, so the publish epoch stays; a stream that had committed
  its drafts rewinds with :func:`jaxrope.positions.rollback`, which starts a new epoch.
- **the EAGLE drafter**: its step 0 runs at the verify step's positions with the token
  ids shifted left by one (:func:`eagle_input_ids`); each later step ``j`` puts every
  stream's token (or its ``topk`` branches) one position further, at
  ``counter + offset + j`` with ``offset=-1`` in vLLM (step 1 continues from the last
  accepted token, ``n + a``) and ``offset=0`` in SGLang (``seq_lens`` then ``+ 1`` per
  step); :func:`plan_draft`.
- **M-RoPE**: with ``out`` of shape ``[3, N]`` every rule above gives the position plus
  the stream's delta on all three rows (text after the prompt), so each draft step
  moves every row by one.

**Past the end.** A draft step can run past ``max_seq_len`` for a stream that is about
to finish; it cannot leave a batch whose shape is fixed (a CUDA graph), so
:func:`plan_draft` plans such a token at position 0 on every row and marks it not
live; the engine writes its KV to a padding slot (a negative slot, which
:func:`jaxrope.apply_rope_and_append_kv` skips) and ignores its output. This is vLLM's
clamp to 0 with ``PADDING_SLOT_ID``, with the bound taken from the stream's sequence
index (``counter + offset + j``) rather than from an M-RoPE row: vLLM #54498 addressed
the drafter's KV slots from row 0 (``counter + delta``, lower than the index once a
prompt has images) and #54519 took them from ``seq_lens - 1``.

Everything here is pure, static-shape and runs under ``jax.jit``; views follow
:func:`jaxrope.positions.plan` (its table rows, padded with ``positions.PAD``; tokens
past the live ones keep ``out``'s values). Called with concrete arrays (outside jit),
:func:`plan_tree`, :func:`tree_depths` and :func:`accept` check their depth, parent and
count arguments and raise ``ValueError`` / ``TypeError``; under jit they are unchecked
(:func:`valid_trees` gives a traced engine the tree check as a mask).

Example (one stream at 7, a tree of depths ``[0, 1, 1, 2]``; one draft accepted):
  >>> import jax.numpy as jnp
  >>> from jaxrope import positions, speculative_positions
  >>> table = positions.PositionTable(jnp.array([7], jnp.int32))
  >>> slots, counts = jnp.array([0], jnp.int32), jnp.array([4], jnp.int32)
  >>> depths = speculative_positions.tree_depths(jnp.array([-1, 0, 0, 1], jnp.int32))
  >>> depths.tolist()
  [0, 1, 1, 2]
  >>> out = jnp.zeros(4, jnp.int32)
  >>> speculative_positions.plan_tree(table, slots, counts, depths, out).tolist()
  [7, 8, 8, 9]
  >>> table = speculative_positions.accept(table, slots, jnp.array([1], jnp.int32))
  >>> table.counters.tolist(), table.epochs.tolist()
  ([9], [0])
"""

from __future__ import annotations

from typing import Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import checks as _checks
from jaxrope import positions
from jaxrope import sharding as _sharding
from jaxrope import int_arrays as _int_arrays
from jaxrope.int_arrays import NO_WRAP as _NO_WRAP
from jaxrope.numbers import INT32_MAX, as_int, check_sum
from jaxrope.positions import PositionTable

__all__ = ["accept", "eagle_input_ids", "plan_chain", "plan_draft", "plan_tree", "tree_depths",
           "valid_trees"]



def _live_slots(table: PositionTable, slots: jax.Array) -> jax.Array:
    return (slots >= 0) & (slots < table.capacity)


def plan_chain(table: PositionTable, slots: jax.Array, drafts: jax.Array,
               out: jax.Array) -> jax.Array:
    """Verify positions of chain drafts: view ``v`` holds its root and ``drafts[v]`` drafts
    at ``counter + arange(drafts[v] + 1)``.

    Args:
      table: the streams.
      slots: int32 ``[V]``, each view's table row (:func:`jaxrope.positions.plan`'s
        ``rows``); a ``positions.PAD`` row is a view of no token.
      drafts: int32 ``[V]``, the drafts ``k >= 0`` of each view (0: a plain decode).
      out: int32 ``[N]``, or ``[3, N]`` for M-RoPE (the delta on every row); tokens past
        the views' keep its values.

    Returns:
      int32, ``out``'s shape.

    Example (3 and 1 drafts; a padding view):
      >>> import jax.numpy as jnp
      >>> from jaxrope import positions
      >>> table = positions.PositionTable(jnp.array([5, 9], jnp.int32))
      >>> slots = jnp.array([1, 0, positions.PAD], jnp.int32)
      >>> plan_chain(table, slots, jnp.array([3, 1, 2], jnp.int32), jnp.full(8, -1, jnp.int32)).tolist()
      [9, 10, 11, 12, 5, 6, -1, -1]
    """
    slots = _int_arrays.ints("slots", slots)
    # At most INT32_MAX - 1 drafts: the view's count, drafts + 1, is int32 too.
    drafts = _int_arrays.values("drafts", drafts, 0, INT32_MAX - 1, slots.shape[0], "slots.shape")
    counts = jnp.where(_live_slots(table, slots), drafts + 1, 0)
    return positions.plan(table, slots, counts, out)


def tree_depths(parents: jax.Array) -> jax.Array:
    """int32 ``[N]``: each token's depth in its draft tree (the root's is 0).

    Args:
      parents: int32 ``[N]``, the index of each token's parent in the same flat token
        layout, or -1 for a root (and for padding). Several trees (one per view) may
        share the layout; the parent links must be acyclic.

    Pointer doubling: ``ceil(log2 N)`` rounds of ``depth += depth[ancestor]``,
    ``ancestor = ancestor[ancestor]``, static in ``N``.

    Raises:
      ValueError: (concrete ``parents`` only) a parent that is not an earlier token
        (``-1 <= parents[t] < t``): both engines lay a tree out parents first
        (:func:`valid_trees`).

    Example (SGLang's tree of topk 2: the root, two children, a grandchild of the first):
      >>> import jax.numpy as jnp
      >>> tree_depths(jnp.array([-1, 0, 0, 1, -1, 4], jnp.int32)).tolist()
      [0, 1, 1, 2, 0, 1]
    """
    if not isinstance(parents, jax.core.Tracer):
        given = np.asarray(parents)
        _check_integer(given, "parents")
        late = (given < -1) | (given >= np.arange(len(given)))
        if late.any():
            t = int(np.argmax(late))
            raise ValueError(f"parents[{t}]={int(given[t])} must be -1 (a root) or an earlier token "
                             f"in [0, {t}): a tree is laid out parents first")
    elif _checks.enabled():
        early = jnp.arange(parents.shape[0])
        _checks.refuse("parents", parents, (parents < -1) | (parents >= early),
                       "must be -1 (a root) or an earlier token: a tree is laid out parents first")
    parents = jnp.asarray(parents).astype(jnp.int32)
    token = jnp.arange(parents.shape[0], dtype=jnp.int32)
    root = parents < 0
    ancestor = jnp.where(root, token, parents)
    depth = jnp.where(root, 0, 1).astype(jnp.int32)
    for _ in range(max(1, (parents.shape[0] - 1).bit_length())):
        depth = depth + depth[ancestor]
        ancestor = ancestor[ancestor]
    return depth


def valid_trees(counts: jax.Array, depths: jax.Array) -> jax.Array:
    """bool ``[V]``: whether each view's depths form a draft tree laid out parents first.

    Args:
      counts: int32 ``[V]``, each view's tokens (0: a padding view, valid).
      depths: int32 ``[N]``, the views' depths one after another; entries past
        ``sum(counts)`` are ignored.

    The rule (the twin of :func:`torch_bridge.draft_trees.check_trees`, whose docstring
    cites vLLM's tree attention and SGLang's ``build_tree_efficient``): a view's token 0
    is its root at depth 0 and no other token is; every other depth is at most one more
    than a depth earlier in the view (a token at ``d > 0`` has a possible parent at
    ``d - 1`` before it). Pure and static-shape: an engine under jit masks with it.

    Example:
      >>> import jax.numpy as jnp
      >>> valid_trees(jnp.array([4, 2, 2], jnp.int32), jnp.array([0, 1, 1, 2, 1, 2, 0, 2])).tolist()
      [True, False, False]
    """
    counts = counts.astype(jnp.int32)
    depth = depths.astype(jnp.int32)
    n = depth.shape[0]
    ends = jnp.cumsum(counts)
    starts = ends - counts
    token = jnp.arange(n, dtype=jnp.int32)
    marks = jnp.zeros_like(token).at[starts].max(jnp.arange(counts.shape[0], dtype=jnp.int32),
                                                 mode="drop")
    view = jax.lax.cummax(marks, axis=0)       # each token's view, as positions.plan finds it
    index = token - starts[view]
    first = index == 0
    # The deepest depth before each token in its view: a max scan that restarts at a root.
    restart = lambda a, b: (a[0] | b[0], jnp.where(b[0], b[1], jnp.maximum(a[1], b[1])))  # noqa: E731
    _, running = jax.lax.associative_scan(restart, (first, depth))
    earlier = jnp.concatenate([jnp.zeros((1,), jnp.int32), running[:-1]])
    ok = jnp.where(first, depth == 0, (depth > 0) & (depth <= earlier + 1))
    bad = ~ok & (token < (ends[-1] if counts.shape[0] else 0))
    return ~jnp.zeros(counts.shape, bool).at[view].max(bad, mode="drop")


def _check_integer(given: np.ndarray, name: str) -> None:
    if given.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, got dtype {given.dtype}")


def plan_tree(table: PositionTable, slots: jax.Array, counts: jax.Array, depths: jax.Array,
              out: jax.Array) -> jax.Array:
    """Verify positions of draft trees: token ``t`` of view ``v`` at ``counter[v] + depths[t]``.

    Args:
      table: the streams.
      slots, counts: int32 ``[V]``, the views (as :func:`jaxrope.positions.plan`): a
        view holds its tree's ``counts[v]`` tokens, root first.
      depths: int32 ``[N]``, each token's depth (:func:`tree_depths`); entries past
        ``sum(counts)`` are ignored.
      out: int32 ``[N]`` or ``[3, N]`` (M-RoPE: the delta on every row); its tail is kept.

    Returns:
      int32, ``out``'s shape.

    Raises:
      TypeError, ValueError: (concrete ``counts`` and ``depths`` only) depths that are not
        integers, or a view's that are not a tree (:func:`valid_trees`); compared at
        their own width before any cast.

    Example (M-RoPE: a stream at 7 with delta -3):
      >>> import jax.numpy as jnp
      >>> table = PositionTable(jnp.array([7], jnp.int32), jnp.array([-3], jnp.int32))
      >>> one = jnp.array([0], jnp.int32)
      >>> plan_tree(table, one, jnp.array([4], jnp.int32), jnp.array([0, 1, 1, 2], jnp.int32),
      ...           jnp.zeros((3, 4), jnp.int32)).tolist()
      [[4, 5, 5, 6], [4, 5, 5, 6], [4, 5, 5, 6]]
    """
    if not isinstance(counts, jax.core.Tracer) and not isinstance(depths, jax.core.Tracer):
        given, n = np.asarray(depths), int(np.sum(counts))
        _check_integer(given, "depths")
        used = given[:n]
        # A valid depth is below its view's length, so below N: checked before the cast.
        if len(used) and (int(used.min()) < 0 or int(used.max()) >= len(used)):
            raise ValueError(f"depths has values in [{int(used.min())}, {int(used.max())}]; a tree "
                             f"of {n} tokens has depths in [0, {n})")
        valid = np.asarray(valid_trees(jnp.asarray(counts), jnp.asarray(used.astype(np.int32))))
        if not valid.all():
            v = int(np.argmin(valid))
            start = int(np.sum(np.asarray(counts)[:v]))
            raise ValueError(f"the depths of view {v}, {used[start:start + int(counts[v])].tolist()}, "
                             "are not a draft tree: token 0 at depth 0 is its only root, every other "
                             "depth at most one more than an earlier one")
        checked = np.zeros(given.shape, np.int32)   # the ignored tail as zeros
        checked[:n] = used
        depths = jnp.asarray(checked)
    elif _checks.enabled():
        valid = valid_trees(jnp.asarray(counts), jnp.asarray(depths).astype(jnp.int32))
        _checks.require(jnp.all(valid), "the depths of view {} are not a draft tree: token 0 "
                        "at depth 0 is its only root, every other depth at most one more "
                        "than an earlier one", jnp.argmin(valid))
    return positions.plan(table, slots, counts, out, depths=depths)


def accept(table: PositionTable, slots: jax.Array, accepted: jax.Array) -> PositionTable:
    """After verifying: ``counter += accepted + 1`` (the root and the accepted drafts).

    ``slots`` are the verified views' streams (padding dropped), ``accepted`` int32
    ``[V]``, each ``0 <= accepted <= drafts`` (a tree: at most its deepest depth, so the
    counter moves by the accepted path's length). The counter only moves forward:
    epochs stay.

    Raises:
      TypeError, ValueError: (concrete ``accepted`` only) counts that are not integers
        or are negative (compared at their own width).

    Example:
      >>> import jax.numpy as jnp
      >>> table = PositionTable(jnp.array([5, 9], jnp.int32))
      >>> accept(table, jnp.array([1, 0], jnp.int32), jnp.array([0, 3], jnp.int32)).counters.tolist()
      [9, 10]
    """
    if not isinstance(accepted, jax.core.Tracer):
        _check_integer(np.asarray(accepted), "accepted")
    # accepted + 1 is the int32 amount: at most INT32_MAX - 1 accepted.
    accepted = _int_arrays.values("accepted", accepted, 0, INT32_MAX - 1)
    return positions.advance(table, slots, accepted + 1)


def _step_fits(table: PositionTable, slots, shift) -> None:
    """``counter + offset + step`` of every live view fits int32 (a concrete step only)."""
    counters, rows = _int_arrays.host(table.counters), _int_arrays.host(slots)
    if shift is None or counters is None or rows is None:
        return
    rows = rows[(rows >= 0) & (rows < table.capacity)]
    if rows.size:
        check_sum("step", shift, "counter", int(counters[rows].max()), INT32_MAX)


def plan_draft(table: PositionTable, slots: jax.Array, counts: jax.Array, out: jax.Array, *,
               step: Union[int, jax.Array], max_seq_len: Union[int, jax.Array],
               offset: int = -1) -> Tuple[jax.Array, jax.Array]:
    """Positions of EAGLE draft step ``step >= 1``, and which tokens are live.

    Args:
      table: the streams, after the verify step's :func:`accept`.
      slots, counts: int32 ``[V]``: view ``v`` holds ``counts[v]`` tokens of its stream
        (1 for a chain; the ``topk`` branches of SGLang's tree drafter), all at
        sequence index ``counter + offset + step``.
      out: int32 ``[N]``, or ``[3, N]`` for M-RoPE (index plus delta on every row);
        tokens past the views' keep its values.
      step: the draft step, a Python or traced int.
      max_seq_len: a token whose index is outside ``[0, max_seq_len)`` is not live.
      offset: -1 (default) numbers like vLLM (step ``j`` at the last accepted token's
        position plus ``j``); 0 like SGLang (``seq_lens`` plus ``j``).

    Returns:
      ``(positions, live)``: int32 of ``out``'s shape, with 0 on every row of a token
      that is not live; bool ``[N]``, True for the views' tokens inside the bound (give
      the others a padding KV slot).

    Example (two streams at 5 and 30, max_seq_len 32; step 3 passes it for the second):
      >>> import jax.numpy as jnp
      >>> table = PositionTable(jnp.array([5, 30], jnp.int32))
      >>> pos, live = plan_draft(table, jnp.array([0, 1], jnp.int32), jnp.array([1, 1], jnp.int32),
      ...                        jnp.full(3, -1, jnp.int32), step=3, max_seq_len=32)
      >>> pos.tolist(), live.tolist()
      ([7, 0, -1], [True, False, False])
    """
    if not isinstance(step, jax.core.Tracer):
        step = as_int(step, "step", 0, INT32_MAX)
    if not isinstance(max_seq_len, jax.core.Tracer):
        max_seq_len = as_int(max_seq_len, "max_seq_len", 1, INT32_MAX)
    if not isinstance(offset, jax.core.Tracer):
        offset = as_int(offset, "offset", -1, 0)
    _step_fits(table, slots, offset + step if isinstance(step, int) and isinstance(offset, int)
               else None)
    n = out.shape[-1]
    # offset + step is in [0, INT32_MAX]; counter + it is checked by positions.plan.
    depth = jnp.full((n,), offset, jnp.int32) + jnp.asarray(step, jnp.int32)
    index = positions.plan(table, slots, counts, jnp.zeros((n,), jnp.int32), depths=depth)
    real = jnp.arange(n, dtype=jnp.int32) < jnp.sum(counts.astype(jnp.int32))
    live = real & (index >= 0) & (index < max_seq_len)
    planned = positions.plan(table, slots, counts, out, depths=depth)
    zero, = _sharding.like(out, jnp.broadcast_to(real & ~live, out.shape))
    return jnp.where(zero, 0, planned), live


def eagle_input_ids(token_ids: jax.Array, next_token_ids: jax.Array,
                    last_token_indices: jax.Array) -> jax.Array:
    """The EAGLE drafter's step-0 input ids: the target step's ids shifted left by one,
    each request's last token replaced by the token just sampled for it.

    At the target step's positions, the drafter reads token ``t + 1`` at token ``t``
    (vLLM ``EagleProposer.propose``: ``[a1, b1, b2, c1, c2, c3]`` with next tokens
    ``a2, b3, c4`` gives ``[a2, b2, b3, c2, c3, c4]``). After a partial accept the last
    token of a request is its last accepted one.

    Args:
      token_ids: int ``[N]``, the target step's input ids.
      next_token_ids: int ``[B]``, each request's sampled token.
      last_token_indices: int32 ``[B]``, where each request's last token is in
        ``token_ids`` (out of range: padding, dropped).

    Returns:
      ``token_ids``' shape and dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> ids = jnp.array([10, 20, 21, 30, 31, 32], jnp.int32)
      >>> eagle_input_ids(ids, jnp.array([11, 22, 33], jnp.int32), jnp.array([0, 2, 5], jnp.int32)).tolist()
      [11, 21, 22, 31, 32, 33]
    """
    shifted = jnp.concatenate([token_ids[1:], token_ids[-1:]])
    return shifted.at[last_token_indices].set(next_token_ids.astype(token_ids.dtype), mode="drop",
                                              **_NO_WRAP)
