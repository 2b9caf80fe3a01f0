"""M-RoPE positions of one prompt, on the host: :func:`rope_index` (numpy).

A prompt is a sequence of parts in token order: :class:`Text` runs, :class:`Image` grids
and :class:`Video` grids (not token ids: the position manager knows the layout, not the
vocabulary). Each part gets int positions on three rows, t, h and w:

- a text run of ``n`` tokens at start ``s`` is ``s, ..., s + n - 1`` on all three rows;
- a grid ``(t, h, w)`` of patches with spatial merge ``m`` is ``t * (h/m) * (w/m)``
  tokens, t-major, then h, then w; token ``(i_t, i_h, i_w)`` is at ``T = s + tau(i_t)``,
  ``H = s + i_h``, ``W = s + i_w``, where ``tau`` is the model family's temporal index:

  ============  ====================================================================
  family        ``tau(i_t)``
  ============  ====================================================================
  qwen2_vl      ``i_t`` (images and videos)
  qwen2_5_vl    images ``i_t``; videos ``floor(i_t * tokens_per_second *
                second_per_grid_t)``, in float32 as transformers forms it
  qwen3_vl      images ``i_t``; a video is ``t`` one-frame grids, each at its own
                start (its frames' timestamps are text between them in the prompt)
  glm4v         as qwen3_vl (GLM-4.1V also puts timestamps between frames)
  ============  ====================================================================

- the next part starts after the grid: ``advance="max"`` (default) at the largest
  position so far plus one (Qwen's reference code, vLLM's
  ``get_mrope_input_positions``, transformers up to 5.2); ``advance="spatial"`` at
  ``s + max(h, w) / m`` (transformers' ``get_rope_index`` from 5.3 on, 5.24 included).
  The two agree for every one-frame grid (all images, Qwen3-VL and GLM-4.1V frames);
  for a Qwen2-VL or Qwen2.5-VL video whose temporal positions run past its spatial
  ones, "spatial" starts the next text inside the video's temporal range;
- ``delta = max + 1 - L`` over the whole prompt of ``L`` tokens (negative when grids
  are present): token ``i >= L`` generated after the prompt is at ``i + delta`` on all
  three rows.

Example:
  >>> from jaxrope.mrope import Image, Text, rope_index
  >>> pos, delta = rope_index([Text(2), Image((1, 4, 6)), Text(1)], family="qwen2_vl",
  ...                         spatial_merge_size=2)
  >>> pos.tolist()
  [[0, 1, 2, 2, 2, 2, 2, 2, 5], [0, 1, 2, 2, 2, 3, 3, 3, 5], [0, 1, 2, 3, 4, 2, 3, 4, 5]]
  >>> delta  # 9 tokens, largest position 5: decoding continues at 9 + delta = 6
  -3
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Optional, Sequence, Tuple, Union

import numpy as np

from jaxrope.numbers import INT32_MAX, as_int

__all__ = ["ADVANCES", "FAMILIES", "Image", "Text", "Video", "rope_index"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v")
ADVANCES = ("max", "spatial")
# Families whose videos are laid out frame by frame, each frame a one-frame grid.
_FRAME_SPLIT = ("qwen3_vl", "glm4v")


def _check_grid(owner: str, grid) -> Tuple[int, int, int]:
    if not isinstance(grid, (tuple, list)) or len(grid) != 3:
        raise TypeError(f"{owner}.grid={grid!r} must be three ints (t, h, w)")
    # Each side is a patch count; the positions it spans are checked against int32 below.
    return tuple(as_int(g, f"{owner}.grid[{i}]", 1, INT32_MAX, " (t, h, w patches)")
                 for i, g in enumerate(grid))


@dataclasses.dataclass(frozen=True)
class Text:
    """A run of ``length`` text tokens (>= 0): one position each, the same on all rows.

    Example:
      >>> from jaxrope.mrope import Text
      >>> Text(3).length
      3
    """

    length: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "length", as_int(self.length, "Text.length", 0, INT32_MAX))


@dataclasses.dataclass(frozen=True)
class Image:
    """One image: ``grid`` ``(t, h, w)`` in patches, as HF's ``image_grid_thw`` row; it
    is ``t * h * w / m**2`` tokens after the spatial merge ``m``.

    Example:
      >>> from jaxrope.mrope import Image
      >>> Image((1, 28, 42)).grid
      (1, 28, 42)
    """

    grid: Tuple[int, int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", _check_grid("Image", self.grid))


@dataclasses.dataclass(frozen=True)
class Video:
    """One video: ``grid`` ``(t, h, w)`` as HF's ``video_grid_thw`` row, and
    ``second_per_grid_t``, the seconds one temporal patch spans (HF
    ``second_per_grid_ts``: ``temporal_patch_size / fps``); only Qwen2.5-VL reads it.

    For Qwen3-VL and GLM-4.1V, whose prompts put a timestamp between frames, give each
    frame as its own ``Video((1, h, w))`` with the timestamp's :class:`Text` between; a
    ``Video`` of ``t`` frames there is ``t`` one-frame grids back to back.

    Example:
      >>> from jaxrope.mrope import Video
      >>> Video((4, 20, 30), second_per_grid_t=1.0).grid
      (4, 20, 30)
    """

    grid: Tuple[int, int, int]
    second_per_grid_t: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", _check_grid("Video", self.grid))
        seconds = self.second_per_grid_t
        if (not isinstance(seconds, (int, float, np.floating)) or isinstance(seconds, bool)
                or not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"Video.second_per_grid_t={seconds!r} must be a finite number >= 0")
        object.__setattr__(self, "second_per_grid_t", float(seconds))


Part = Union[Text, Image, Video]


def _grid(start: int, temporal: np.ndarray, hm: int, wm: int) -> np.ndarray:
    """int64 ``[3, len(temporal) * hm * wm]``: a grid's tokens in t, h, w order."""
    frames = len(temporal)
    t_row = np.repeat(temporal, hm * wm)
    h_row = np.tile(np.repeat(np.arange(hm), wm), frames)
    w_row = np.tile(np.arange(wm), frames * hm)
    return np.stack([t_row, h_row, w_row]) + start


def _temporal(part: Part, family: str, tokens_per_second: Optional[float]) -> np.ndarray:
    """``tau(i_t)`` of one grid (after the frame split): int64 ``[t]``."""
    frames = part.grid[0]
    if isinstance(part, Video) and family == "qwen2_5_vl":
        # transformers: float32 tokens_per_second * second_per_grid_t (its processor hands
        # float32 tensors), times the float32 frame index, truncated.
        step = np.float32(tokens_per_second) * np.float32(part.second_per_grid_t)
        return (np.arange(frames, dtype=np.float32) * step).astype(np.int64)
    return np.arange(frames, dtype=np.int64)


def _pieces(prompt: Sequence[Part], family: str) -> Iterator[Part]:
    """The prompt with videos split into one-frame grids where the family does so."""
    for part in prompt:
        if not isinstance(part, (Text, Image, Video)):
            raise TypeError(f"prompt parts must be Text, Image or Video, got {part!r}")
        if isinstance(part, Video) and family in _FRAME_SPLIT and part.grid[0] > 1:
            frame = dataclasses.replace(part, grid=(1, *part.grid[1:]))
            yield from (frame,) * part.grid[0]
        else:
            yield part


def rope_index(prompt: Sequence[Part], *, family: str, spatial_merge_size: int,
               tokens_per_second: Optional[float] = None,
               advance: str = "max") -> Tuple[np.ndarray, int]:
    """M-RoPE positions ``[3, L]`` and the decode delta of one prompt (see the module doc).

    Args:
      prompt: :class:`Text`, :class:`Image` and :class:`Video` parts in token order.
      family: one of ``FAMILIES``: "qwen2_vl", "qwen2_5_vl", "qwen3_vl" (Qwen3-VL and
        its MoE) or "glm4v" (GLM-4.1V); :func:`jaxrope.mrope.hf_index_args` reads it
        from a HF config.
      spatial_merge_size: ``m``, patches merged per side into one token (HF
        ``vision_config.spatial_merge_size``, 2 in all four families); every grid's
        ``h`` and ``w`` must be multiples of it.
      tokens_per_second: Qwen2.5-VL's ``vision_config.tokens_per_second``; required
        when a qwen2_5_vl prompt has a video, ignored otherwise.
      advance: "max" (default) or "spatial": where the part after a grid starts.

    Returns:
      ``(positions, delta)``: int32 ``[3, L]`` (rows t, h, w; ``L`` the prompt's
      tokens) and the int ``max(positions) + 1 - L`` (0 for an empty prompt).

    Raises:
      TypeError: a part is not Text, Image or Video.
      ValueError: unknown ``family`` or ``advance``, a grid not divisible by ``m``, or
        a Qwen2.5-VL video without ``tokens_per_second``.

    Example:
      >>> from jaxrope.mrope import Text, Video, rope_index
      >>> pos, delta = rope_index([Video((3, 2, 2), second_per_grid_t=1.0), Text(1)],
      ...                         family="qwen2_5_vl", spatial_merge_size=2,
      ...                         tokens_per_second=2)
      >>> pos[0].tolist(), delta  # frames at 0, 2, 4; text after the largest
      ([0, 2, 4, 5], 2)
    """
    if family not in FAMILIES:
        raise ValueError(f"family={family!r} must be one of {FAMILIES}")
    if advance not in ADVANCES:
        raise ValueError(f"advance={advance!r} must be one of {ADVANCES}")
    m = spatial_merge_size
    m = as_int(m, "spatial_merge_size", 1, INT32_MAX)
    blocks = []
    start, top = 0, -1  # the next part's start; the largest position so far
    for part in _pieces(prompt, family):
        if isinstance(part, Text):
            block = np.broadcast_to(np.arange(part.length, dtype=np.int64) + start,
                                    (3, part.length))
            step = part.length
        else:
            _, h, w = part.grid
            if h % m or w % m:
                raise ValueError(f"{part!r}: grid h={h} and w={w} must be multiples of "
                                 f"spatial_merge_size={m}")
            if isinstance(part, Video) and family == "qwen2_5_vl" and tokens_per_second is None:
                raise ValueError("tokens_per_second is required for a qwen2_5_vl video "
                                 "(HF vision_config.tokens_per_second)")
            block = _grid(start, _temporal(part, family, tokens_per_second), h // m, w // m)
            step = max(h, w) // m
        blocks.append(block)
        if block.size:
            top = max(top, int(block.max()))
        start = top + 1 if advance == "max" else start + step
    positions = np.concatenate(blocks, axis=1) if blocks else np.zeros((3, 0), np.int64)
    if top >= INT32_MAX:
        raise ValueError(f"the prompt's largest position {top} does not fit int32")
    return positions.astype(np.int32), top + 1 - positions.shape[1]
