"""How the RoPE kernels split their work: one frozen tuning per backend, and the heuristic
that picks it from the shapes.

A kernel builder takes its tuning as an argument (:func:`jaxrope.ops.rope.mosaic.build`,
:func:`jaxrope.ops.rope.triton.rope_triton`); a sweep builds other values with
:func:`dataclasses.replace` or the heuristic's keyword arguments, and the torch launch
keys its compiled kernels on the value. The measured numbers behind each rule are in
``bench/RESULTS.md``.

Example:
  >>> t = mosaic_tuning(32, 8, 64, 128, 2, False)   # Llama 3, bf16
  >>> (t.vec, t.lanes_pairs, t.tokens_per_block, t.q_group, t.k_group, t.block_groups)
  (2, 32, 4, 4, 4, 1)
  >>> t = triton_tuning(16384, 32, 8, 64)
  >>> (t.heads_per_program, t.groups_per_program, t.token_loop, t.heads_major)
  (2, 4, 1, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple

from jaxrope.ops.triton_common import next_pow2, shrink_to_fill

WARPS = 4           # warps of a warpgroup
LANES = 32          # threads of a warp
# Blocks a launch should have before it splits heads further: two per SM of an H100/H200.
MIN_BLOCKS = 264


@dataclasses.dataclass(frozen=True)
class MosaicTuning:
    """How the Mosaic GPU kernel splits one call (:func:`mosaic_tuning` picks it)."""

    vec: int               # pairs per thread vector
    lanes_pairs: int       # lanes of a warp along the pairs; the rest split tokens
    q_group: int           # heads of q per load
    k_group: int
    in_flight: int         # head groups loaded at a time, the one being rotated included
    block_groups: int      # head groups one block rotates at most (:func:`head_splits`)
    min_blocks: int        # blocks a launch should have before it splits heads further

    @property
    def token_lanes(self) -> int:
        return LANES // self.lanes_pairs

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block rotates: the warps x the lanes along tokens."""
        return WARPS * self.token_lanes


def head_group(heads: int, pairs_per_thread: int, itemsize: int, group_bytes: int,
               angle_heads: int) -> int:
    """The most heads, dividing ``heads``, whose two halves fit ``group_bytes`` a thread;
    when that is under ``angle_heads``, the fewest dividing heads that reach it, if they
    fit ``angle_heads x group_bytes`` (a prime head count would otherwise take every
    head)."""
    head_bytes = 2 * pairs_per_thread * itemsize
    divisors = [g for g in range(1, heads + 1) if heads % g == 0]
    group = max((g for g in divisors if g * head_bytes <= group_bytes), default=1)
    least = min(heads, angle_heads)
    raised = [g for g in divisors
              if g >= least and g * head_bytes <= angle_heads * group_bytes]
    return group if group >= least or not raised else min(raised)


def mosaic_tuning(q_heads: int, k_heads: int, half: int, head_dim: int, itemsize: int,
                  interleave: bool, *, group_bytes: int = 32, vec_bytes: int = 4,
                  block_bytes: int = 32, angle_heads: int = 4, in_flight: int = 2,
                  min_blocks: int = MIN_BLOCKS) -> MosaicTuning:
    """The one heuristic for the Mosaic GPU kernel's split; the keywords are its rules'
    sizes (a sweep passes others).

    - Bytes a thread moves, not what it computes, set this kernel's speed: a block moves
      ``group_bytes`` (32) of q and k a thread, in vectors of at most ``vec_bytes`` (4)
      that divide the half and the head stride, narrower while a thread would hold more
      than 16 pairs of the angle; GPT-J pairs take one element (even and odd elements
      are not contiguous).
    - Lanes along the pairs: as many as the half's vectors allow (at most a warp), the
      rest of the warp and the four warps along tokens.
    - Head groups: the most heads that divide the head count within ``group_bytes`` a
      thread, or, when those are fewer than ``angle_heads`` (4: at 2 heads an angle its
      arithmetic shows), the fewest that serve that many heads an angle within
      ``angle_heads x group_bytes``.
    - ``in_flight`` (2) groups loaded at a time (it matters only where a block rotates
      several), as many groups to a block as fit ``block_bytes`` (32) a thread, and
      heads split further until a launch has ``min_blocks`` (:data:`MIN_BLOCKS`) blocks
      (:func:`head_splits`).
    """
    candidates = (1,) if interleave else (8, 4, 2, 1)
    for vec in candidates:
        if vec * itemsize > vec_bytes or half % vec or head_dim % vec:
            continue
        lanes_pairs = math.gcd(half // vec, LANES)
        if half // lanes_pairs <= 16 or vec == 1:
            break
    per_thread = half // lanes_pairs
    q_group, k_group = (head_group(h, per_thread, itemsize, group_bytes, angle_heads)
                        for h in (q_heads, k_heads))
    group_size = 2 * per_thread * itemsize * max(q_group, k_group)
    return MosaicTuning(vec, lanes_pairs, q_group, k_group, in_flight,
                        max(1, block_bytes // group_size), min_blocks)


def head_splits(token_blocks: int, groups: int, block_groups: int,
                min_blocks: int = MIN_BLOCKS) -> int:
    """Blocks sharing one token block's ``groups`` head groups: enough that none rotates
    more than ``block_groups`` (:attr:`MosaicTuning.block_groups`), and enough for
    ``min_blocks`` blocks in all when the tokens alone make fewer (few tokens would
    otherwise leave most SMs idle), at most one group each.

    Example:
      >>> head_splits(1024, 10, 2), head_splits(4, 10, 2), head_splits(1, 3, 2)
      (5, 10, 3)
    """
    return max(1, -(-groups // block_groups), min(groups, -(-min_blocks // token_blocks)))


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    """Launch shape of one call of the Triton-lowered kernel (:func:`triton_tuning`)."""

    block_tokens: int
    heads_per_program: int
    num_warps: int
    num_stages: int = 1
    # Head groups (of heads_per_program heads) one program rotates with one cos/sin
    # computation, all loads issued before the first store.
    groups_per_program: int = 1
    # Token blocks one program walks in sequence: the angle tables are loaded once.
    token_loop: int = 1
    # Program order: False puts a head group's consecutive token blocks next to each
    # other, True a token block's head groups (neighbouring programs then touch
    # neighbouring bytes of each row).
    heads_major: bool = False


def head_programs(q_heads: int, k_heads: int, tuning: TritonTuning) -> Tuple[int, int]:
    """Programs along the head axis of the grid for q and for k (q's come first)."""
    per_program = tuning.heads_per_program * tuning.groups_per_program
    return -(-q_heads // per_program), -(-k_heads // per_program)


def grid(num_tokens: int, q_heads: int, k_heads: int, tuning: TritonTuning) -> Tuple[int, ...]:
    """The launch grid: ``(token programs, head programs)``, flattened when ``heads_major``."""
    token_programs = -(-num_tokens // (tuning.block_tokens * tuning.token_loop))
    head = sum(head_programs(q_heads, k_heads, tuning))
    return (token_programs * head,) if tuning.heads_major else (token_programs, head)


def triton_tuning(num_tokens: int, q_heads: int, k_heads: int, lanes: int, *,
                  group_elements: int = 128, program_elements: int = 512,
                  min_programs: int = 264) -> TritonTuning:
    """The one heuristic for the Triton-lowered kernel's launch shape; the keywords are
    its rules' sizes.

    - A head group fills ``group_elements`` (128) elements of a half
      (``heads_per_program = 128 // lanes``, at least 1): one 8-byte bf16 vector per
      thread of one warp.
    - A program rotates ``program_elements`` (512) elements per half (2 KB of bf16) in
      ``512 // (heads_per_program * lanes)`` groups (four when the heads fill a group),
      their loads all issued before the first store and cos/sin computed once. Groups
      past the last head are masked, not shrunk: no head layout swept ran faster with
      smaller programs.
    - When a token needs at most two programs (few heads, e.g. Hq=8 Hk=1 at D <= 128)
      a program walks 8 tokens, so per-program setup is not paid per token.
    - Programs head-major (neighbouring programs cover whole rows of q and k), one warp
      each.
    - Small T (decode): shorter token walks, then fewer groups, then fewer heads per
      program, until the grid has ``min_programs`` (264: two per SM of an H100/H200).
    """
    heads_per_program = max(1, min(next_pow2(max(q_heads, k_heads)), group_elements // lanes))
    groups = max(1, program_elements // (heads_per_program * lanes))
    tuning = TritonTuning(1, heads_per_program, 1, groups_per_program=groups, heads_major=True)
    if sum(head_programs(q_heads, k_heads, tuning)) <= 2:
        tuning = dataclasses.replace(tuning, token_loop=8)
    return shrink_to_fill(tuning, lambda t: math.prod(grid(num_tokens, q_heads, k_heads, t)),
                          min_programs)
