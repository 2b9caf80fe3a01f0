"""How the Mosaic GPU kernel of the fused RoPE + KV append spreads a token's per-head
arrays over a warpgroup: :class:`RowSplit`, the one heuristic that picks it
(:func:`row_split`), the angle's own split, and the ``TiledLayout`` a split gives
(:func:`row_layout`). :mod:`jaxrope.ops.rope_append_kv.mosaic` builds the kernel on them.

A per-token array ``[H, width]`` (a rotary half, the dims past ``R``, v's whole rows)
puts its lanes along a head's dims (coalesced: a head's ``D`` values are contiguous in
every cache layout) and splits the heads over the remaining lanes and warps. Removing
the head axis of such a layout gives the ``[width]`` layout in which a per-dim value
(the angle, a norm weight) is broadcast to the heads for free; removing the width axis
gives the ``[H]`` layout of a per-head value (a norm's mean square).

Example:
  >>> s = row_split(8, 64, 2, 64, False, 8)   # Llama 3's k halves in bf16: no copies
  >>> (s.vec, s.width_lanes, s.head_lanes, s.head_warps, s.copies)
  (4, 16, 2, 4, 1)
"""

from __future__ import annotations

import dataclasses
import math

from jaxrope.ops.mosaic_common import tiled
from jaxrope.ops.rope_append_kv.tuning import Piece

__all__ = ["RowSplit", "angle_split", "pair_layout", "rotary_split", "row_layout", "row_split",
           "shares_angle"]

_THREADS = 128      # a warpgroup


@dataclasses.dataclass(frozen=True)
class RowSplit:
    """How 128 threads split a ``[heads, width]`` array (:func:`row_split`)."""

    vec: int          # elements per thread vector
    width_lanes: int  # lanes along the width (the minor lanes: coalesced)
    width_warps: int
    head_lanes: int
    head_warps: int   # the rest of the lanes and warps hold copies

    @property
    def head_tile(self) -> int:
        return self.head_lanes * self.head_warps

    @property
    def copies(self) -> int:
        """Threads holding each element: the lanes and warps the split leaves over."""
        return (4 // (self.head_warps * self.width_warps)) * (32 // (self.head_lanes *
                                                                     self.width_lanes))


def row_split(heads: int, width: int, itemsize: int, align: int, interleave: bool,
              vector_bytes: int) -> RowSplit:
    """The one heuristic for a per-token array ``[H, width]`` with ``heads`` dividing ``H``.

    - Vectors: the widest (at most ``vector_bytes``) dividing ``width`` and ``align`` (the
      element offset the row's piece starts at) that still give every thread of the
      warpgroup a vector of ``heads`` heads; the widest dividing ones when even single
      elements leave threads over (those then hold copies). GPT-J pairs take single
      elements (even and odd elements are not contiguous).
    - Lanes along the width first (coalesced), then warps (width over 32 vectors), then
      the heads' lanes and warps, all powers of two dividing what they split.
    """
    fits = [v for v in (8, 4, 2, 1) if v * itemsize <= vector_bytes and not width % v
            and not align % v] if not interleave else [1]
    filled = [v for v in fits if heads * (width // v) >= _THREADS]
    vec = max(filled or fits)
    columns = width // vec
    width_lanes = math.gcd(columns, 32)
    width_warps = math.gcd(columns // width_lanes, 4)
    head_lanes = math.gcd(heads, 32 // width_lanes)
    head_warps = math.gcd(heads // head_lanes, 4 // width_warps)
    return RowSplit(vec, width_lanes, width_warps, head_lanes, head_warps)


def angle_split(half: int) -> RowSplit:
    """One float32 element of a ``[half]`` angle a thread, over as many threads as it has
    elements (the rest hold copies): the fewest angle evaluations a thread."""
    lanes = math.gcd(half, 32)
    return RowSplit(1, lanes, math.gcd(half // lanes, 4), 1, 1)


def rotary_split(piece: Piece, k_heads: int, half: int, itemsize: int, interleave: bool,
                 vector_bytes: int) -> RowSplit:
    """How ``piece``'s rotary halves (``[heads, half]``) are split: q's and k's share one
    layout when one block rotates both (its head tile divides both head counts), so the
    angle is formed once for both."""
    heads = math.gcd(piece.q_heads, k_heads) if piece.kv else piece.q_heads
    return row_split(heads, half, itemsize, half, interleave, vector_bytes)


def shares_angle(rotary: RowSplit, half: int, share_angle: bool) -> bool:
    """Whether a piece whose halves ``rotary`` splits forms its angle in
    :func:`angle_split`'s layout and passes it on through SMEM: when ``share_angle``
    (:attr:`AppendMosaicTuning.share_angle`) and ``rotary`` would form each element on
    more threads."""
    own = angle_split(half)
    return share_angle and (own.width_lanes * own.width_warps
                             > rotary.width_lanes * rotary.width_warps)


def row_layout(s: RowSplit):
    """The ``TiledLayout`` of ``[H, width]`` arrays split by ``s``.

    Tiled by ``(head_tile, W)``, ``(head_lanes, L)`` and ``(1, vec)`` with ``L =
    width_lanes * vec`` and ``W = width_warps * L``, the tiled shape ends ``[head_warps,
    width_warps, head_lanes, width_lanes, 1, vec]``; what is left of the lanes and warps
    replicates (a store of a copy writes the same value).
    """
    lanes = s.width_lanes * s.vec
    return tiled(((s.head_tile, s.width_warps * lanes), (s.head_lanes, lanes), (1, s.vec)),
                 *_split_dims(s, (-6, -5), (-4, -3)))


def _split_dims(s: RowSplit, warp_dims, lane_dims):
    """The warp and lane dims of a layout whose tiled dims ``warp_dims`` (heads, width)
    and ``lane_dims`` split as ``s`` says, with what is left of the warps and lanes
    replicating."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    copies_w = 4 // (s.head_warps * s.width_warps)
    copies_l = 32 // (s.head_lanes * s.width_lanes)
    return (warp_dims + ((fa.Replicated(copies_w),) if copies_w > 1 else ()),
            ((fa.Replicated(copies_l),) if copies_l > 1 else ()) + lane_dims)


def pair_layout(s: RowSplit):
    """The ``TiledLayout`` of ``[H, width, 2]`` arrays (GPT-J pairs, the pair axis last)
    whose heads and pairs ``s`` splits as :func:`row_layout` splits ``[H, width]`` with
    ``vec`` pairs a thread, a pair one vector: both elements of a pair in one thread's
    register, so one 2-element access moves it. Removing the pair axis gives
    :func:`row_layout`'s ``[H, width]`` layout of ``s``.
    """
    lanes = s.width_lanes * s.vec
    # Tiled shape [..., head_warps, width_warps, 1, head_lanes, width_lanes, 1, 1, vec, 2].
    return tiled(((s.head_tile, s.width_warps * lanes, 2), (s.head_lanes, lanes, 2),
                  (1, s.vec, 2)), *_split_dims(s, (-9, -8), (-6, -5)))
