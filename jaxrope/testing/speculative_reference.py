"""vLLM's and SGLang's speculative-decoding position rules, re-implemented in plain numpy.

Written from what their code does (read in vLLM v1 and SGLang's EAGLE worker; each
function names the file and function it follows), for the differential test of
:mod:`jaxrope.speculative_positions` and :mod:`torch_bridge.speculative_steps`
(tests/test_speculative_reference.py). Nothing here is their code: the loops and
vectorisation are ours, the rules theirs.

vLLM (``vllm/v1``), one request with ``num_computed_tokens = n`` and ``k`` draft tokens:

- ``core/sched/scheduler.py`` ``Scheduler.schedule``: a running request gets
  ``num_tokens_with_spec - num_computed_tokens = 1 + k`` new tokens, at most
  ``max_model_len - 1 - n`` so that the input positions stay below ``max_model_len``
  (the spec tokens are trimmed to fit); ``_update_after_schedule`` then adds them to
  ``num_computed_tokens``.
- ``worker/gpu_model_runner.py`` ``_prepare_inputs``: token ``i`` of a request is at
  ``num_computed_tokens + i``; M-RoPE (``MRotaryEmbedding.get_next_input_positions_tensor``):
  ``mrope_position_delta + context_len + i`` on all three rows.
- ``core/sched/scheduler.py`` ``update_from_output``: ``num_accepted = len(generated) - 1``,
  ``num_rejected = num_draft - num_accepted``, ``num_computed_tokens -= num_rejected``.
- ``spec_decode/eagle.py`` ``EagleProposer.propose``: step 0 runs at the target positions
  with ``input_ids[:-1] = target_token_ids[1:]`` and ``input_ids[last_token_indices] =
  next_token_ids``; then ``positions = target_positions[last_token_indices]`` and each of
  the ``num_speculative_tokens - 1`` later steps does ``positions += 1`` (all three rows
  for M-RoPE), ``exceeds = positions >= max_model_len``, ``clamped = where(exceeds, 0,
  positions)`` and the slot mapping of an exceeding token ``PADDING_SLOT_ID``. With
  rejected drafts left in the batch (``prepare_inputs_padded``) the last token index is
  the last accepted one. For M-RoPE the bound (and the KV slot) comes from the sequence
  index ``seq_lens - 1``, as vLLM #54519 fixed it (#54498: it came from row 0).

SGLang (``python/sglang/srt/speculative``, ``sgl-kernel/csrc/speculative/eagle_utils.cu``),
``seq_len`` committed tokens, ``topk`` branches, ``spec_steps`` draft steps:

- ``eagle_utils.py`` / ``spec_utils.py`` ``select_top_k_tokens``: step 0 keeps the
  ``topk`` first drafts (parents ``arange(-1, topk)``); step ``i >= 1`` scores every child
  ``score(parent) * p``, keeps the ``topk`` best, whose flattened indices plus
  ``topk**2 * (i - 1) + topk`` are the next step's parents.
- ``build_eagle_tree.py`` ``build_tree_kernel_efficient_preprocess``: the
  ``num_draft_tokens - 1`` best scores of all steps, sorted by index, after the
  verified token; ``parent_list`` is every step's parents but the last.
- ``eagle_utils.cu`` ``build_tree_efficient``: a draft's depth is one plus its parent's
  (``selected_index // topk`` indexes ``parent_list``; 0 is the root), its position
  ``seq_len + depth``; the children and siblings lists ``retrive_next_token`` /
  ``retrive_next_sibling``.
- ``eagle_utils.cu`` ``build_tree_efficient`` again: token 0 is the verified root; a
  draft's parent is the root or a draft selected before it (the selection is sorted by
  index, a parent from an earlier step), and a draft without one is "an invalid eagle
  tree". vLLM's tree attention (``v1/attention/backends/tree_attn.py``
  ``_prepare_tree_attn_bias``) lays its ``speculative_token_tree`` out the same way: the
  root at index 0, the paths sorted by depth, each ancestor ``path[:c + 1]`` an earlier
  node. Given only depths, such a tree exists iff :func:`parents_first` finds parents.
- ``eagle_utils.cu`` ``VerifyTreeGreedy``: from the root, accept the child whose draft
  equals the target's prediction at the last accepted token, for at most
  ``spec_steps`` levels; ``accept_length`` counts them.
- ``eagle_info.py`` ``EagleVerifyInput.verify``: ``seq_lens += accept_length + 1``.
- ``eagle_worker.py`` ``_draft_preprocess_decode`` / ``draft_forward``: draft positions
  start at ``seq_lens.repeat_interleave(topk)`` and ``positions.add_(1)`` runs before each
  of the ``spec_steps - 1`` draft forwards.
- ``model_executor/forward_batch_info.py`` ``_compute_spec_mrope_positions``: M-RoPE
  verify / draft positions are ``positions + mrope_position_delta`` on all three rows.

Example (vLLM: 3 drafts at 10, one accepted; SGLang's documented tree):
  >>> import numpy as np
  >>> scheduled, drafts = vllm_schedule(np.array([10]), np.array([3]), max_model_len=100)
  >>> vllm_positions(np.array([10]), scheduled).tolist()
  [10, 11, 12, 13]
  >>> vllm_update_from_output(np.array([10]) + scheduled, drafts, np.array([2])).tolist()
  [12]
  >>> sglang_positions(np.array([7]), np.array([[0, 1, 1, 2]])).tolist()
  [[7, 8, 8, 9]]
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import numpy as np

__all__ = ["PADDING_SLOT_ID", "SglangTree", "parents_first", "sglang_accept", "sglang_build_tree",
           "sglang_draft_positions", "sglang_draft_tree", "sglang_mrope", "sglang_positions",
           "sglang_verify_greedy", "vllm_draft_positions", "vllm_eagle_input_ids",
           "vllm_mrope_positions", "vllm_positions", "vllm_schedule", "vllm_update_from_output"]

PADDING_SLOT_ID = -1


# ------------------------------------------------------------------------------ vLLM


def vllm_schedule(num_computed: np.ndarray, num_spec: np.ndarray,
                  max_model_len: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(num_scheduled, num_scheduled_spec)`` of running decode requests (``Scheduler.schedule``)."""
    scheduled = np.minimum(1 + num_spec, max_model_len - 1 - num_computed)
    return scheduled, scheduled - 1


def vllm_positions(num_computed: np.ndarray, num_scheduled: np.ndarray) -> np.ndarray:
    """The flat input positions of a step (``GPUModelRunner._prepare_inputs``)."""
    starts = np.cumsum(num_scheduled) - num_scheduled
    index = np.arange(int(num_scheduled.sum())) - np.repeat(starts, num_scheduled)
    return np.repeat(num_computed, num_scheduled) + index


def vllm_mrope_positions(num_computed: np.ndarray, num_scheduled: np.ndarray,
                         deltas: np.ndarray) -> np.ndarray:
    """``[3, tokens]``: ``mrope_position_delta + context_len + i`` on every row
    (``MRotaryEmbedding.get_next_input_positions_tensor``)."""
    flat = vllm_positions(num_computed + deltas, num_scheduled)
    return np.stack([flat, flat, flat])


def vllm_update_from_output(num_computed: np.ndarray, num_draft: np.ndarray,
                            num_generated: np.ndarray) -> np.ndarray:
    """``num_computed_tokens -= num_rejected`` (``Scheduler.update_from_output``)."""
    num_accepted = num_generated - 1
    return num_computed - (num_draft - num_accepted)


def vllm_eagle_input_ids(target_token_ids: np.ndarray, next_token_ids: np.ndarray,
                         last_token_indices: np.ndarray) -> np.ndarray:
    """The drafter's step-0 input ids (``EagleProposer.propose``); the final entry, left
    from the buffer there, is the target's last id as in its docstring's example."""
    ids = target_token_ids.copy()
    ids[:-1] = target_token_ids[1:]
    ids[last_token_indices] = next_token_ids
    return ids


def vllm_draft_positions(target_positions: np.ndarray, last_token_indices: np.ndarray,
                         num_speculative_tokens: int, max_model_len: int,
                         deltas: Optional[np.ndarray] = None
                         ) -> List[Tuple[np.ndarray, np.ndarray]]:
    """``[(positions, slot_valid)]`` of draft steps ``1 .. num_speculative_tokens - 1``.

    ``target_positions``: the target step's flat (sequence) positions. Each step moves
    them by one; a token at or past ``max_model_len`` gets position 0 (every row) and
    ``PADDING_SLOT_ID`` (``slot_valid`` False). ``deltas``: per request, the M-RoPE
    delta: positions are then ``[3, B]``, the bound still the sequence index (#54519).
    """
    index = target_positions[last_token_indices].copy()
    rows = None if deltas is None else np.stack([index + deltas] * 3)
    steps = []
    for _ in range(num_speculative_tokens - 1):
        index = index + 1
        exceeds = index >= max_model_len
        if rows is None:
            steps.append((np.where(exceeds, 0, index), ~exceeds))
        else:
            rows = rows + 1
            steps.append((np.where(exceeds[None], 0, rows), ~exceeds))
    return steps


# ------------------------------------------------------------------------------ SGLang


class SglangTree(NamedTuple):
    """One batch's draft trees as SGLang's drafter hands them to ``build_tree_kernel_efficient``.

    ``parent_list`` ``[B, topk * (steps - 1) + 1]``, ``selected_index`` ``[B, draft - 1]``,
    ``draft_tokens`` ``[B, draft]`` (the verified token first).
    """

    parent_list: np.ndarray
    selected_index: np.ndarray
    draft_tokens: np.ndarray
    topk: int
    spec_steps: int


def sglang_draft_tree(rng: np.random.Generator, verified_id: np.ndarray, topk: int,
                      spec_steps: int, num_draft_tokens: int, vocab: int) -> SglangTree:
    """Random draft trees built the way SGLang's drafter builds them.

    The draft model's top-``topk`` probabilities and tokens are random (distinct tokens
    per expansion); the scores, parents and selection follow ``select_top_k_tokens``
    and ``build_tree_kernel_efficient_preprocess``.
    """
    b = len(verified_id)

    def draft_model(rows: int):
        p = np.sort(rng.random((rows, topk)), axis=1)[:, ::-1]
        p = p / (p.sum(axis=1, keepdims=True) + rng.random((rows, 1)))
        tokens = np.argsort(rng.random((rows, vocab)), axis=1)[:, :topk]
        return p, tokens

    topk_p, topk_index = draft_model(b)
    score_list, token_list, parents_list = [], [], []
    scores = None
    for i in range(spec_steps):
        if i == 0:
            scores = topk_p
            score_list.append(topk_p[:, None, :])
            token_list.append(topk_index)
            parents_list.append(np.tile(np.arange(-1, topk), (b, 1)))
        else:
            expand = scores[:, :, None] * topk_p.reshape(b, topk, topk)
            flat = expand.reshape(b, -1)
            best = np.argsort(-flat, axis=1, kind="stable")[:, :topk]
            scores = np.take_along_axis(flat, best, axis=1)
            score_list.append(expand)
            token_list.append(topk_index.reshape(b, topk * topk))
            parents_list.append(best + (topk * topk * (i - 1) + topk))
        if i == spec_steps - 1:
            break
        topk_p, topk_index = draft_model(b * topk)   # one draft forward per branch
    all_scores = np.concatenate([s.reshape(b, -1) for s in score_list], axis=1)
    all_tokens = np.concatenate(token_list, axis=1)
    top = np.sort(np.argsort(-all_scores, axis=1, kind="stable")[:, :num_draft_tokens - 1], axis=1)
    draft_tokens = np.concatenate([verified_id[:, None], np.take_along_axis(all_tokens, top, 1)], 1)
    parent_list = (np.concatenate(parents_list[:-1], axis=1) if len(parents_list) > 1
                   else np.zeros((b, 0), np.int64))
    return SglangTree(parent_list, top, draft_tokens, topk, spec_steps)


def sglang_build_tree(tree: SglangTree, seq_lens: np.ndarray):
    """``(positions [B, draft], next_token, next_sibling, depth)`` (``build_tree_efficient``)."""
    b, draft = tree.draft_tokens.shape
    positions = np.zeros((b, draft), np.int64)
    depth = np.zeros((b, draft), np.int64)
    next_token = np.full((b, draft), -1, np.int64)
    next_sibling = np.full((b, draft), -1, np.int64)
    for bid in range(b):
        selected = tree.selected_index[bid].tolist()
        parents = tree.parent_list[bid].tolist()
        where = {s: i for i, s in enumerate(selected)}
        positions[bid, 0] = seq_lens[bid]
        for i in range(draft - 1, 0, -1):     # thread 0: the children and siblings lists
            parent_tb = selected[i - 1] // tree.topk
            parent = 0 if parent_tb == 0 else where[parents[parent_tb]] + 1
            if next_token[bid, parent] != -1:
                next_sibling[bid, i] = next_token[bid, parent]
            next_token[bid, parent] = i
        for tid in range(1, draft):           # the other threads: walk up to the root
            level, cur = 0, tid - 1
            while True:
                level += 1
                parent_tb = selected[cur] // tree.topk
                if parent_tb == 0:
                    break
                cur = where[parents[parent_tb]]
            depth[bid, tid] = level
            positions[bid, tid] = level + seq_lens[bid]
    return positions, next_token, next_sibling, depth


def parents_first(depths: List[int]) -> Optional[List[int]]:
    """Each token's parent (-1 for the root) in a tree laid out parents first with these
    depths, or None when there is no such tree: token 0 must be the root at depth 0, and
    each later token needs a token one level up before it (here the latest such one).
    A per-token walk, for the differential test of the vectorised checks."""
    if not depths or depths[0] != 0:
        return None
    parents, latest = [-1], {0: 0}
    for t, depth in enumerate(depths[1:], start=1):
        if depth <= 0 or depth - 1 not in latest:
            return None
        parents.append(latest[depth - 1])
        latest[depth] = t
    return parents


def sglang_positions(seq_lens: np.ndarray, depth: np.ndarray) -> np.ndarray:
    """``seq_len + depth`` per token, as ``build_tree_efficient`` writes ``positions``."""
    return seq_lens[:, None] + depth


def sglang_verify_greedy(candidates: np.ndarray, next_token: np.ndarray, next_sibling: np.ndarray,
                         target_predict: np.ndarray, spec_steps: int) -> np.ndarray:
    """``accept_length [B]`` (``VerifyTreeGreedy``: ``num_speculative_tokens = spec_steps + 1``)."""
    b = candidates.shape[0]
    accept_length = np.zeros(b, np.int64)
    for bx in range(b):
        last, cur, accepted = 0, 0, 0
        for _ in range(1, spec_steps + 1):
            cur = next_token[bx, cur]
            while cur != -1:
                if candidates[bx, cur] == target_predict[bx, last]:
                    accepted += 1
                    last = cur
                    break
                cur = next_sibling[bx, cur]
            if cur == -1:
                break
        accept_length[bx] = accepted
    return accept_length


def sglang_accept(seq_lens: np.ndarray, accept_length: np.ndarray) -> np.ndarray:
    """``seq_lens += accept_length + 1`` (``EagleVerifyInput.verify``)."""
    return seq_lens + accept_length + 1


def sglang_draft_positions(seq_lens: np.ndarray, topk: int, spec_steps: int) -> List[np.ndarray]:
    """The positions of draft forwards ``0 .. spec_steps - 2``, ``[B * topk]`` each
    (``_draft_preprocess_decode``, then ``positions.add_(1)`` in ``draft_forward``)."""
    positions = np.repeat(seq_lens, topk)
    out = []
    for _ in range(spec_steps - 1):
        positions = positions + 1
        out.append(positions)
    return out


def sglang_mrope(positions: np.ndarray, deltas: np.ndarray) -> np.ndarray:
    """``[3, B * n]`` from per-request ``positions [B, n]`` (``_compute_spec_mrope_positions``)."""
    flat = (positions + deltas[:, None]).reshape(-1)
    return np.stack([flat, flat, flat])
