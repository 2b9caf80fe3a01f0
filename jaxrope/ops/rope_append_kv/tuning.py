"""How the fused RoPE + KV-append kernels split their work: one frozen tuning per backend,
and the heuristic that picks it from the shapes.

A kernel builder takes its tuning as an argument
(:func:`jaxrope.ops.rope_append_kv.mosaic.build_append`,
:func:`jaxrope.ops.rope_append_kv.triton.rope_append_kv_triton`); a sweep builds other
values, and the torch launch keys its compiled kernels on the value. The measured numbers
behind each rule are in ``bench/RESULTS.md``.

Example:
  >>> t = append_mosaic_tuning(32, 8, 128, 128, 2)   # Llama 3, bf16
  >>> [tuple(p) for p in t.pieces], t.vector_bytes, t.tokens_per_block, t.share_angle
  ([(0, 16, False), (16, 16, False), (0, 0, True)], 8, 1, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional, Tuple

from jaxrope.ops.triton_common import next_pow2, shrink_to_fill


class Piece(NamedTuple):
    """What one block does for each of its tokens (:func:`pieces`)."""

    q_first: int  # q's heads [q_first, q_first + q_heads) are rotated
    q_heads: int
    kv: bool      # k is rotated and written to the cache with v


@dataclasses.dataclass(frozen=True)
class AppendMosaicTuning:
    """How the Mosaic GPU kernel of the fused op splits one call
    (:func:`append_mosaic_tuning` picks it)."""

    pieces: Tuple[Piece, ...]  # a token's work, one block each (:func:`pieces`)
    vector_bytes: int          # the widest GMEM access a thread makes
    tokens_per_block: int      # tokens one block walks, each token's loads ahead of the
    #                            previous token's stores
    share_angle: bool          # form the angle one element a thread and pass it on
    #                            through SMEM where the rotation's layout would repeat it


def pieces(q_heads: int, k_heads: int, head_dim: int, rotary_dim: int, itemsize: int,
           piece_bytes: int, q_width: Optional[int] = None) -> Tuple[Piece, ...]:
    """A token's work, split among blocks.

    One piece when q's ``q_width`` dims a head (default ``rotary_dim``: the dims past it
    stay in place; ``head_dim`` when a norm or an fp8 q reads them all), k and v fit
    ``piece_bytes``; else q's heads in equal chunks (the most heads within
    ``piece_bytes``, dividing the head count, one head at least) and one piece for k and
    v, whatever their size (for Hk near Hq, as in multi-head attention, that piece is
    the larger: k and v are not split).

    Example:
      >>> [tuple(p) for p in pieces(32, 8, 128, 128, 2, 4096)]  # Llama 3, bf16
      [(0, 16, False), (16, 16, False), (0, 0, True)]
      >>> pieces(8, 1, 64, 64, 2, 4096)
      (Piece(q_first=0, q_heads=8, kv=True),)
      >>> len(pieces(16, 2, 128, 64, 2, 4096)), len(pieces(16, 2, 128, 64, 2, 4096, q_width=128))
      (1, 2)
    """
    q_width = q_width or rotary_dim
    if (q_heads * q_width + 2 * k_heads * head_dim) * itemsize <= piece_bytes:
        return (Piece(0, q_heads, True),)
    chunk = max(c for c in range(1, q_heads + 1)
                if q_heads % c == 0 and (c == 1 or c * q_width * itemsize <= piece_bytes))
    return tuple(Piece(h, chunk, False) for h in range(0, q_heads, chunk)) + (Piece(0, 0, True),)


def append_mosaic_tuning(q_heads: int, k_heads: int, head_dim: int, rotary_dim: int,
                         itemsize: int, *, piece_bytes: int = 4096, vector_bytes: int = 8,
                         tokens_per_block: int = 1, share_angle: bool = True,
                         q_width: Optional[int] = None) -> AppendMosaicTuning:
    """The one heuristic for the Mosaic GPU kernel of the fused op; the keywords are its
    rules' sizes (a sweep passes others), and ``q_width`` the dims of a q head the
    kernel reads (:func:`pieces`).

    - Pieces of at most ``piece_bytes`` (4 KB: 32 bytes a thread, where the rope kernel
      moves bytes fastest; larger and smaller pieces ran slower) of q, k and v a token
      (:func:`pieces`).
    - Vectors of at most ``vector_bytes`` (8) a thread.
    - ``tokens_per_block`` (1): many small blocks hide the latency of each token's slot
      -> address -> store chain better than a block walking several.
    - ``share_angle``: the angle formed once, one element a thread, where a piece's
      layout would form each element on several threads.
    """
    return AppendMosaicTuning(pieces(q_heads, k_heads, head_dim, rotary_dim, itemsize,
                                     piece_bytes, q_width), vector_bytes, tokens_per_block,
                              share_angle)


@dataclasses.dataclass(frozen=True)
class AppendTritonTuning:
    """Launch shape of one call of the Triton-lowered fused kernel
    (:func:`append_triton_tuning`)."""

    heads_per_program: int
    # Head groups (of heads_per_program heads) one program moves per token, all loads
    # issued before the first store, cos/sin computed once.
    groups_per_program: int = 1
    # Tokens one program walks in sequence (the angle tables are loaded once).
    token_loop: int = 1
    num_warps: int = 1
    num_stages: int = 1


def head_programs(q_heads: int, k_heads: int,
                  tuning: AppendTritonTuning) -> Tuple[int, int, int]:
    """Programs per token for q, for k and for v (in that order in the grid)."""
    per_program = tuning.heads_per_program * tuning.groups_per_program
    k_programs = -(-k_heads // per_program)
    return -(-q_heads // per_program), k_programs, k_programs


def grid(num_tokens: int, q_heads: int, k_heads: int, tuning: AppendTritonTuning) -> Tuple[int]:
    """The launch grid ``(token programs * head programs,)``, head-major."""
    token_programs = -(-num_tokens // tuning.token_loop)
    return (token_programs * sum(head_programs(q_heads, k_heads, tuning)),)


def append_triton_tuning(num_tokens: int, q_heads: int, k_heads: int, lanes: int, *,
                         group_elements: int = 128, program_elements: int = 512,
                         min_programs: int = 264) -> AppendTritonTuning:
    """The one heuristic for the Triton-lowered fused kernel's launch shape: the rope
    kernel's rules (:func:`jaxrope.ops.rope.tuning.triton_tuning`), three head families.

    - A head group fills ``group_elements`` (128) elements of a rotary half
      (``heads_per_program = 128 // lanes``, at least 1, at most the heads there are):
      one 8-byte bf16 vector per thread of one warp. The same groups serve v, whose rows
      (``D`` wide) are as long as a q or k head's two halves at full rotary.
    - A program moves ``program_elements // (heads_per_program * lanes)`` groups (four
      when the heads fill a group): 2 KB of bf16 per half, every load before the first
      store, cos/sin once.
    - When a token needs at most one program per family (e.g. Hq=8 Hk=1 at D <= 128) a
      program walks 8 tokens, so its setup is not paid per token.
    - One warp per program, one stage (nothing to pipeline: each byte is touched once).
    - Small T (decode): shorter token walks, then fewer groups, then fewer heads per
      program, until the grid has ``min_programs`` (264: two per SM of an H100/H200).
    """
    heads_per_program = max(1, min(next_pow2(max(q_heads, k_heads)), group_elements // lanes))
    groups = max(1, program_elements // (heads_per_program * lanes))
    tuning = AppendTritonTuning(heads_per_program, groups)
    if sum(head_programs(q_heads, k_heads, tuning)) <= 3:
        tuning = dataclasses.replace(tuning, token_loop=8)
    return shrink_to_fill(tuning, lambda t: math.prod(grid(num_tokens, q_heads, k_heads, t)),
                          min_programs)
