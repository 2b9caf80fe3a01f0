"""jaxrope.mrope.rope_index against transformers' own get_rope_index, bit for bit, on
generated prompts of every family; the "max" advance (the models' reference semantics)
grid by grid against transformers' get_vision_position_ids; properties and bad input."""

from __future__ import annotations

import dataclasses
import os
from typing import List, NamedTuple, Optional

import numpy as np
import pytest

from jaxrope.mrope import FAMILIES, Image, Text, Video, rope_index

PROMPTS_PER_FAMILY = 1000
# Sampling rates of the generated videos; HF processors give second_per_grid_t =
# temporal_patch_size / fps, as float32.
FPS = (0.5, 1.0, 2.0, 3.0, 4.0, 24.0, 30000 / 1001)
TEMPORAL_PATCH = 2
MERGES = (1, 2)
# Qwen2.5-VL ships 2 and transformers defaults to 4; with 3 and 5 the float32 rounding of
# tokens_per_second * second_per_grid_t decides some frames' positions.
TOKENS_PER_SECOND = (2, 3, 4, 5, 25)
SPLIT_FAMILIES = ("qwen3_vl", "glm4v")


def _reference():
    if os.environ.get("JAXROPE_REQUIRE_TRANSFORMERS") != "1":
        pytest.importorskip("torch", reason="transformers' models need torch")
        pytest.importorskip("transformers")
    from jaxrope.testing import transformers_mrope
    return transformers_mrope


class Prompt(NamedTuple):
    """One generated prompt, as jaxrope parts and as a HF processor's outputs."""

    parts: List
    types: np.ndarray          # mm_token_type_ids [L]: 0 text, 1 image, 2 video
    image_grids: np.ndarray    # [images, 3]
    video_grids: np.ndarray    # [videos, 3], whole videos (transformers splits them)
    seconds: np.ndarray        # float32 [videos]
    merge: int
    tokens_per_second: int


def generate(rng: np.random.Generator, family: str, like: Optional[Prompt] = None) -> Prompt:
    """0-4 images and 0-2 videos in random order between text runs, odd grids, several fps.

    Every vision grid is wrapped in text (vision start/end tokens, and for Qwen3-VL and
    GLM-4.1V a timestamp before each frame), as real prompts are: transformers reads
    consecutive vision tokens as one grid. ``like``: take its merge and tokens_per_second.
    """
    merge = int(rng.choice(MERGES))
    tokens_per_second = int(rng.choice(TOKENS_PER_SECOND))
    if like is not None:
        merge, tokens_per_second = like.merge, like.tokens_per_second
    items = ["image"] * int(rng.integers(0, 5)) + ["video"] * int(rng.integers(0, 3))
    rng.shuffle(items)
    parts, types, images, videos, seconds = [], [], [], [], []

    def text(n):
        if n:
            parts.append(Text(int(n)))
            types.extend([0] * int(n))

    def side():  # grid sides in patches: 1-9 merged tokens, odd ones included
        return merge * int(rng.integers(1, 10))

    text(rng.integers(0 if items else 1, 8))
    for item in items:
        text(rng.integers(1, 6))
        if item == "image":
            grid = (1 if rng.random() < 0.8 else int(rng.integers(2, 4)), side(), side())
            parts.append(Image(grid))
            images.append(grid)
            types.extend([1] * (np.prod(grid) // merge ** 2))
        else:
            grid = (int(rng.integers(1, 13)), side(), side())
            second = TEMPORAL_PATCH / float(rng.choice(FPS))
            videos.append(grid)
            seconds.append(second)
            frame_tokens = grid[1] * grid[2] // merge ** 2
            if family in SPLIT_FAMILIES:
                for i in range(grid[0]):
                    if i:
                        text(rng.integers(1, 6))  # the frame's timestamp
                    parts.append(Video((1, *grid[1:]), second_per_grid_t=second))
                    types.extend([2] * frame_tokens)
            else:
                parts.append(Video(grid, second_per_grid_t=second))
                types.extend([2] * (grid[0] * frame_tokens))
        text(rng.integers(1, 4))
    text(rng.integers(0, 8))
    return Prompt(parts, np.array(types), np.array(images, np.int64).reshape(-1, 3),
                  np.array(videos, np.int64).reshape(-1, 3), np.array(seconds, np.float32),
                  merge, tokens_per_second)


def _ours(prompt: Prompt, family: str, advance: str):
    return rope_index(prompt.parts, family=family, spatial_merge_size=prompt.merge,
                      tokens_per_second=prompt.tokens_per_second, advance=advance)


def _model(reference, prompt: Prompt, family: str):
    return reference.tiny_model(family, prompt.merge,
                                prompt.tokens_per_second if family == "qwen2_5_vl" else None)


@pytest.mark.parametrize("family", FAMILIES)
def test_spatial_advance_is_transformers_get_rope_index_bit_for_bit(family, rng):
    reference = _reference()
    differs = 0
    for _ in range(PROMPTS_PER_FAMILY):
        prompt = generate(rng, family)
        want, want_delta = reference.get_rope_index(
            _model(reference, prompt, family), prompt.types, prompt.image_grids,
            prompt.video_grids, prompt.seconds if family == "qwen2_5_vl" else None)
        got, delta = _ours(prompt, family, "spatial")
        assert got.dtype == np.int32 and got.shape == want.shape
        np.testing.assert_array_equal(got.astype(np.int64), want, err_msg=repr(prompt.parts))
        assert delta == want_delta, prompt.parts
        differs += not np.array_equal(_ours(prompt, family, "max")[0], got)
    if family in SPLIT_FAMILIES:
        # One-frame grids (images are t=1 mostly): the two advances differ only on the
        # few images generated with t > 1.
        assert differs < PROMPTS_PER_FAMILY // 4
    else:
        # The prompts exercise where transformers' advance departs from the models' own:
        # videos whose temporal positions run past their spatial ones.
        assert differs > PROMPTS_PER_FAMILY // 10, differs


@pytest.mark.parametrize("family", FAMILIES)
def test_max_advance_builds_every_grid_as_transformers_and_starts_after_the_largest(family, rng):
    # Each grid's block is transformers' get_vision_position_ids at a start that is the
    # largest position so far plus one; text runs count on from there.
    reference = _reference()
    for _ in range(PROMPTS_PER_FAMILY // 4):
        prompt = generate(rng, family)
        model = _model(reference, prompt, family)
        expected, top = [], -1
        for part in prompt.parts:
            start = top + 1
            if isinstance(part, Text):
                block = np.broadcast_to(np.arange(part.length) + start, (3, part.length))
            else:
                seconds = (part.second_per_grid_t
                           if isinstance(part, Video) and family == "qwen2_5_vl" else None)
                block = reference.vision_position_ids(model, start, part.grid, seconds)
            expected.append(block)
            top = max(top, int(block.max())) if block.size else top
        expected = np.concatenate(expected, axis=1)
        got, delta = _ours(prompt, family, "max")
        np.testing.assert_array_equal(got.astype(np.int64), expected, err_msg=repr(prompt.parts))
        assert delta == top + 1 - expected.shape[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_after_a_prompt_continues_where_prefilling_would(family, rng):
    # With the max advance, text appended to a prompt sits at L + delta + i on all rows:
    # a token decoded at counter + delta gets the position prefill would have given it.
    for _ in range(200):
        prompt = generate(rng, family)
        positions, delta = _ours(prompt, family, "max")
        longer, longer_delta = rope_index(prompt.parts + [Text(3)], family=family,
                                          spatial_merge_size=prompt.merge,
                                          tokens_per_second=prompt.tokens_per_second)
        length = positions.shape[1]
        np.testing.assert_array_equal(longer[:, :length], positions)
        np.testing.assert_array_equal(longer[:, length:],
                                      np.broadcast_to(np.arange(length, length + 3) + delta, (3, 3)))
        assert longer_delta == delta


@pytest.mark.parametrize("family", FAMILIES)
def test_a_continued_prompt_is_offset_by_where_it_starts_and_deltas_add(family, rng):
    # What the counters rely on: a turn B after A (say a new image in a chat) is B alone
    # shifted to A's next position L_A + delta_A, and the stream's delta becomes
    # delta_A + delta_B; so a stream needs only (counter, delta) to continue.
    for _ in range(100):
        a = generate(rng, family)
        b = generate(rng, family, like=a)
        args = dict(family=family, spatial_merge_size=a.merge,
                    tokens_per_second=a.tokens_per_second)
        pos_a, delta_a = rope_index(a.parts, **args)
        pos_b, delta_b = rope_index(b.parts, **args)
        both, delta = rope_index(a.parts + b.parts, **args)
        length = pos_a.shape[1]
        np.testing.assert_array_equal(both[:, :length], pos_a)
        np.testing.assert_array_equal(both[:, length:], pos_b + length + delta_a)
        assert delta == delta_a + delta_b


def test_the_spatial_advance_does_not_continue_where_decoding_does():
    # transformers >= 5.3 on a Qwen2-VL video of 8 frames of one merged token: text after
    # it restarts at 1 (inside the frames' 0..7), while its delta puts decoding at 8.
    prompt = [Video((8, 2, 2)), Text(2)]
    positions, delta = rope_index(prompt, family="qwen2_vl", spatial_merge_size=2,
                                  advance="spatial")
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 1, 2] and delta == -2
    assert positions.shape[1] + delta == 8 != positions[0, -1] + 1
    positions, delta = rope_index(prompt, family="qwen2_vl", spatial_merge_size=2)
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] and delta == 0


@pytest.mark.parametrize("advance", ["max", "spatial"])
@pytest.mark.parametrize("family", SPLIT_FAMILIES)
def test_a_multi_frame_video_is_its_frames_back_to_back(family, advance):
    whole = [Text(2), Video((3, 4, 6)), Text(1)]
    frames = [Text(2)] + [Video((1, 4, 6))] * 3 + [Text(1)]
    a = rope_index(whole, family=family, spatial_merge_size=2, advance=advance)
    b = rope_index(frames, family=family, spatial_merge_size=2, advance=advance)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1] == b[1]


def test_qwen25_video_time_is_float32_tokens_per_second_times_seconds():
    # As transformers forms it: float32(3) * float32(2/3) rounds to 2.0, so frame 7 is at
    # 14; the float64 product 7 * (2/3) * 3 = 13.999999999999998 would truncate to 13.
    pos, _ = rope_index([Video((8, 2, 2), second_per_grid_t=2 / 3)], family="qwen2_5_vl",
                        spatial_merge_size=2, tokens_per_second=3)
    assert pos[0].tolist() == [0, 2, 4, 6, 8, 10, 12, 14]


def test_only_qwen25_reads_the_video_seconds():
    for family in ("qwen2_vl", "qwen3_vl", "glm4v"):
        slow = rope_index([Video((3, 2, 2), second_per_grid_t=8.0)], family=family,
                          spatial_merge_size=2)
        fast = rope_index([Video((3, 2, 2), second_per_grid_t=0.1)], family=family,
                          spatial_merge_size=2)
        np.testing.assert_array_equal(slow[0], fast[0])


def test_an_empty_prompt_and_a_text_prompt():
    positions, delta = rope_index([], family="qwen2_vl", spatial_merge_size=2)
    assert positions.shape == (3, 0) and positions.dtype == np.int32 and delta == 0
    positions, delta = rope_index([Text(3), Text(0), Text(2)], family="glm4v", spatial_merge_size=2)
    assert positions.tolist() == [list(range(5))] * 3 and delta == 0


class TestBadInput:
    def test_unknown_family_and_advance(self):
        with pytest.raises(ValueError, match="family='llava' must be one of"):
            rope_index([Text(1)], family="llava", spatial_merge_size=2)
        with pytest.raises(ValueError, match="advance='min' must be one of"):
            rope_index([Text(1)], family="qwen2_vl", spatial_merge_size=2, advance="min")

    def test_grid_sides_must_be_multiples_of_the_merge(self):
        with pytest.raises(ValueError, match=r"grid h=3 and w=4 must be multiples of "
                                             r"spatial_merge_size=2"):
            rope_index([Image((1, 3, 4))], family="qwen2_vl", spatial_merge_size=2)

    def test_a_qwen25_video_needs_tokens_per_second(self):
        with pytest.raises(ValueError, match="tokens_per_second is required"):
            rope_index([Video((2, 2, 2))], family="qwen2_5_vl", spatial_merge_size=2)
        # Images do not read it.
        rope_index([Image((1, 2, 2))], family="qwen2_5_vl", spatial_merge_size=2)

    @pytest.mark.parametrize("merge, error", [(0, ValueError), (-2, ValueError), (2 ** 31, ValueError),
                                              (2.0, TypeError), (True, TypeError)])
    def test_the_merge_is_a_positive_int(self, merge, error):
        with pytest.raises(error, match="spatial_merge_size=.* must be an int"):
            rope_index([Text(1)], family="qwen2_vl", spatial_merge_size=merge)

    def test_parts(self):
        with pytest.raises(TypeError, match="prompt parts must be Text, Image or Video"):
            rope_index([3], family="qwen2_vl", spatial_merge_size=2)
        with pytest.raises(ValueError, match=r"Text.length=-1 must be an int in \[0, 2147483647\]"):
            Text(-1)
        with pytest.raises(TypeError, match="Text.length=1.5 must be an int"):
            Text(1.5)
        with pytest.raises(TypeError, match=r"Image.grid=\(1, 2\) must be three ints"):
            Image((1, 2))
        with pytest.raises(ValueError, match=r"Video.grid\[0\]=0 must be an int in \[1, 2147483647\] \(t, h, w patches\)"):
            Video((0, 2, 2))
        with pytest.raises(ValueError, match="Video.second_per_grid_t=nan must be a finite"):
            Video((1, 2, 2), second_per_grid_t=float("nan"))

    def test_parts_are_frozen_and_hashable(self):
        video = Video([2, 4, 4], second_per_grid_t=1)
        assert video.grid == (2, 4, 4) and video.second_per_grid_t == 1.0
        assert hash(video) == hash(Video((2, 4, 4)))
        with pytest.raises(dataclasses.FrozenInstanceError):
            video.grid = (1, 2, 2)
