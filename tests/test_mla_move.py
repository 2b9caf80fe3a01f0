"""bench/mla_move.py, the MLA bound's move kernel, in Triton's interpreter on CPU tensors:
its index math (q_pe parts in place, k_pe and ckv rows to their slots, nothing else
written) and its refusals. The interpreter computes bf16 and e4m3 values wrongly (it
negates bf16's raw bits and misrounds e4m3 casts), so the values here are float32; the
GPU run checks the bf16 and fp8 paths exactly (:func:`bench.mla_move.check`) before it
times them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not os.environ.get("JAXROPE_REQUIRE_TRITON"):
    pytest.importorskip("triton")

from bench import mla_move  # noqa: E402

TOKENS, HEADS, RANK, LATENT, PAGES, PAGE = 3, 32, 64, 512, 4, 4


@pytest.fixture
def interpreted(monkeypatch):
    # Read when the kernel is decorated, which move_step does on each call.
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(seed: int):
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    q_pe, k_pe, ckv = (2 * torch.randn(*shape, generator=g)
                       for shape in ((TOKENS, HEADS, RANK), (TOKENS, RANK), (TOKENS, LATENT)))
    caches = torch.zeros(PAGES, PAGE, LATENT), torch.zeros(PAGES, PAGE, RANK)
    slots = torch.from_numpy(np.random.default_rng(seed).permutation(PAGES * PAGE)[:TOKENS])
    return q_pe, k_pe, ckv, caches, slots


@pytest.mark.parametrize("seed", [0, 1])
def test_the_move_writes_q_in_place_and_each_token_rows_at_its_slot_only(interpreted, seed):
    q_pe, k_pe, ckv, (ckv_cache, kpe_cache), slots = _inputs(seed)
    step = mla_move.move_step(q_pe, k_pe, ckv, ckv_cache, kpe_cache, slots)
    assert step.outputs == (q_pe, None)
    mla_move.check(step, q_pe, k_pe, ckv, ckv_cache, kpe_cache, slots)
    untouched = torch.ones(PAGES * PAGE, dtype=torch.bool)
    untouched[slots.long()] = False
    assert not ckv_cache.view(-1, LATENT)[untouched].any()
    assert not kpe_cache.view(-1, RANK)[untouched].any()


def test_a_wrong_step_fails_the_check(interpreted):
    q_pe, k_pe, ckv, (ckv_cache, kpe_cache), slots = _inputs(2)
    step = mla_move.move_step(q_pe, k_pe, ckv, ckv_cache, kpe_cache, slots)
    with pytest.raises(AssertionError, match="k_pe rows"):
        mla_move.check(step, q_pe, k_pe, ckv, ckv_cache, kpe_cache, slots.flip(0))


@pytest.mark.parametrize("shapes, match", [
    (((TOKENS, 3, RANK), (TOKENS, LATENT)), "q_pe row of 192 elements"),
    (((TOKENS, HEADS, RANK), (TOKENS, 384)), "kv_lora_rank=384 must be a power of two"),
])
def test_shapes_the_kernel_cannot_tile_are_refused(shapes, match):
    (q_shape, ckv_shape) = shapes
    q_pe, ckv = torch.zeros(q_shape), torch.zeros(ckv_shape)
    with pytest.raises(ValueError, match=match):
        mla_move.move_step(q_pe, torch.zeros(TOKENS, RANK), ckv,
                           torch.zeros(PAGES, PAGE, ckv_shape[1]), torch.zeros(PAGES, PAGE, RANK),
                           torch.arange(TOKENS))
