"""How the MLA RoPE + cache-append kernels split their work: one frozen tuning per backend,
and the heuristic that picks it from the shapes.

A token's work has three families (:mod:`jaxrope.ops.mla_rope_append.triton`): q_pe's
``H`` heads of ``r`` rotary dims (rotated; DeepSeek-V3: 128 heads of 64, the bulk of the
bytes), q_nope's ``H`` heads of ``N`` dims (quantised to fp8, only with an fp8 q) and the
cache row (k_pe's ``r`` dims rotated, ckv's ``L`` copied). The GQA kernels' rules
(:mod:`jaxrope.ops.rope_append_kv.tuning`) size the q_pe groups; the q_nope groups and
the cache row take the same bytes a program.

Example:
  >>> t = mla_triton_tuning(4096, 128, 32, 512)   # DeepSeek-V3 prefill, fp8 q
  >>> t.heads_per_program, t.groups_per_program, t.nope_heads_per_program, t.token_loop
  (4, 4, 2, 1)
  >>> [tuple(p) for p in mla_mosaic_tuning(128, 64, 2, nope_dim=512).pieces][:2]
  [(0, 32, 'q_pe'), (32, 32, 'q_pe')]
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Tuple

from jaxrope.ops.triton_common import next_pow2, shrink_to_fill


@dataclasses.dataclass(frozen=True)
class MlaTritonTuning:
    """Launch shape of one call of the Triton-lowered MLA kernel (:func:`mla_triton_tuning`)."""

    heads_per_program: int
    # q_pe head groups (of heads_per_program heads) one program moves per token, all
    # loads before the first store, cos/sin once.
    groups_per_program: int = 1
    # q_nope heads one program quantises per token (fp8 q only).
    nope_heads_per_program: int = 1
    # Tokens one program walks in sequence (the angle tables are loaded once).
    token_loop: int = 1
    num_warps: int = 1
    num_stages: int = 1


def mla_programs(heads: int, nope_dim: int, tuning: MlaTritonTuning) -> Tuple[int, int, int]:
    """Programs per token for q_pe, for q_nope (0 when ``nope_dim`` is 0: nothing to
    quantise) and for the cache row (1), in that order in the grid."""
    q_programs = -(-heads // (tuning.heads_per_program * tuning.groups_per_program))
    nope_programs = -(-heads // tuning.nope_heads_per_program) if nope_dim else 0
    return q_programs, nope_programs, 1


def mla_grid(num_tokens: int, heads: int, nope_dim: int, tuning: MlaTritonTuning) -> Tuple[int]:
    """The launch grid ``(token programs * programs per token,)``, a token's programs
    neighbours."""
    token_programs = -(-num_tokens // tuning.token_loop)
    return (token_programs * sum(mla_programs(heads, nope_dim, tuning)),)


def mla_triton_tuning(num_tokens: int, heads: int, lanes: int, nope_dim: int = 0, *,
                      group_elements: int = 128, program_elements: int = 512,
                      min_programs: int = 264) -> MlaTritonTuning:
    """The one heuristic for the Triton-lowered MLA kernel's launch shape; ``nope_dim``
    is q_nope's ``N`` when it is quantised (fp8 q), else 0.

    - q_pe: the GQA kernel's rule (:func:`jaxrope.ops.rope_append_kv.tuning.
      append_triton_tuning`): a head group fills ``group_elements`` (128) elements of a
      rotary half, a program moves ``program_elements // (heads_per_program * lanes)``
      groups (DeepSeek's ``r`` = 64: 4 groups of 4 heads, 2 KB of bf16 per half).
    - q_nope: as many heads as fill the same ``2 * program_elements`` elements of a
      program (``N`` = 512: 2 heads, 128: 8), one head at least.
    - When a token needs at most one program per family (a few heads) a program walks 8
      tokens, so its setup is not paid per token.
    - One warp per program, one stage (each byte is touched once).
    - Small T (decode): shorter token walks, then fewer groups, then fewer heads per
      program, until the grid has ``min_programs`` (264: two per SM of an H100/H200).
    """
    heads_per_program = max(1, min(next_pow2(heads), group_elements // lanes))
    groups = max(1, program_elements // (heads_per_program * lanes))
    nope_heads = max(1, min(next_pow2(heads), 2 * program_elements // next_pow2(max(nope_dim, 1))))
    tuning = MlaTritonTuning(heads_per_program, groups, nope_heads)
    if max(mla_programs(heads, nope_dim, tuning)) <= 1:
        tuning = dataclasses.replace(tuning, token_loop=8)
    return shrink_to_fill(tuning, lambda t: math.prod(mla_grid(num_tokens, heads, nope_dim, t)),
                          min_programs)


class MlaPiece(NamedTuple):
    """What one Mosaic GPU block does for each of its tokens (:func:`mla_pieces`)."""

    first: int   # heads [first, first + heads) of q_pe or q_nope (0 for the cache row)
    heads: int
    kind: str    # "q_pe" (rotate), "q_nope" (quantise) or "row" (k_pe rotated, ckv copied)


@dataclasses.dataclass(frozen=True)
class MlaMosaicTuning:
    """How the Mosaic GPU MLA kernel splits one call (:func:`mla_mosaic_tuning`)."""

    pieces: Tuple[MlaPiece, ...]  # a token's work, one block each
    vector_bytes: int             # the widest GMEM access a thread makes


def _chunks(heads: int, width: int, itemsize: int, piece_bytes: int, kind: str):
    # Equal chunks of heads: the most heads within piece_bytes that divide the head count.
    chunk = max(c for c in range(1, heads + 1)
                if heads % c == 0 and (c == 1 or c * width * itemsize <= piece_bytes))
    return tuple(MlaPiece(h, chunk, kind) for h in range(0, heads, chunk))


def mla_pieces(heads: int, rotary_dim: int, itemsize: int, nope_dim: int = 0,
               piece_bytes: int = 4096) -> Tuple[MlaPiece, ...]:
    """A token's work, split among blocks: q_pe's heads in equal chunks of at most
    ``piece_bytes`` (one head at least), then q_nope's likewise when ``nope_dim`` (fp8
    q), then the cache row, whatever its size (``L + r`` elements: 1152 bytes of bf16
    for DeepSeek).

    Example:
      >>> [tuple(p) for p in mla_pieces(4, 64, 2, nope_dim=128)]
      [(0, 4, 'q_pe'), (0, 4, 'q_nope'), (0, 1, 'row')]
    """
    work = _chunks(heads, rotary_dim, itemsize, piece_bytes, "q_pe")
    if nope_dim:
        work += _chunks(heads, nope_dim, itemsize, piece_bytes, "q_nope")
    return work + (MlaPiece(0, 1, "row"),)


def mla_mosaic_tuning(heads: int, rotary_dim: int, itemsize: int, nope_dim: int = 0, *,
                      piece_bytes: int = 4096, vector_bytes: int = 8) -> MlaMosaicTuning:
    """The one heuristic for the Mosaic GPU MLA kernel: the GQA kernel's rules
    (:func:`jaxrope.ops.rope_append_kv.tuning.append_mosaic_tuning`): pieces of at most
    ``piece_bytes`` (4 KB, 32 bytes a thread) a token, vectors of at most
    ``vector_bytes`` (8) a thread, one token a block."""
    return MlaMosaicTuning(mla_pieces(heads, rotary_dim, itemsize, nope_dim, piece_bytes),
                           vector_bytes)
