"""jaxrope.paging against the engines' own definitions, eagerly and under jit.

- token_views: the ``jnp.repeat(jnp.arange(V), counts)`` a user wrote, padded with -1;
- block_table_slots: a numpy transcription of vLLM's ``_compute_slot_mapping_kernel``
  (``vllm/v1/worker/block_table.py``: one program per request over its
  ``query_start_loc`` range, tokens past ``num_tokens`` at ``PAD_SLOT_ID = -1``);
- append_positions / page_table_slots: the numbers in FlashInfer's own docstrings
  (``get_batch_indices_positions``, ``append_paged_kv_cache``) and the numpy batches of
  ``jaxrope.testing.flashinfer_kv.paged_batch``; the GPU suite compares them with
  FlashInfer itself (``tests/gpu/test_paging_gpu.py``).

And what engines leave undefined: addresses outside a request's pages are -1 (skipped),
never clamped into another request's page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrope import paging, positions
from jaxrope.testing import flashinfer_kv

PAD_SLOT_ID = -1  # vLLM's


def _vllm_slot_mapping(block_table, query_start_loc, kv_positions, block_size, max_num_tokens):
    # vLLM's kernel, one request at a time (no context parallelism).
    out = np.full(max_num_tokens, PAD_SLOT_ID, np.int64)
    for req in range(len(query_start_loc) - 1):
        for i in range(query_start_loc[req], query_start_loc[req + 1]):
            pos = int(kv_positions[i])
            out[i] = int(block_table[req, pos // block_size]) * block_size + pos % block_size
    return out


def _random_counts(rng, views, tokens):
    counts = rng.integers(0, 9, views)
    counts[rng.random(views) < 0.3] = 0
    while counts.sum() > tokens:
        counts[np.argmax(counts)] -= 1
    return counts.astype(np.int32)


@pytest.mark.parametrize("jit", [False, True])
def test_token_views_are_the_repeat_of_each_view_padded_with_minus_one(jit, rng):
    token_views = jax.jit(paging.token_views, static_argnums=1) if jit else paging.token_views
    for _ in range(20):
        views, tokens = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        counts = _random_counts(rng, views, tokens)
        want = np.full(tokens, -1)
        want[:counts.sum()] = np.repeat(np.arange(views), counts)
        np.testing.assert_array_equal(token_views(jnp.asarray(counts), tokens), want,
                                      err_msg=f"{counts=}")
    assert paging.token_views(jnp.zeros((0,), jnp.int32), 3).tolist() == [-1, -1, -1]


def test_token_views_number_the_tokens_as_plan_does():
    # The view of a token is the one positions.plan numbers it with.
    counts = jnp.array([2, 0, 3], jnp.int32)
    table = positions.PositionTable(jnp.array([10, 20, 30], jnp.int32))
    planned = positions.plan(table, jnp.arange(3, dtype=jnp.int32), counts,
                             jnp.full((6,), -1, jnp.int32))
    views = paging.token_views(counts, 6)
    assert planned.tolist() == [10, 11, 30, 31, 32, -1]
    assert (np.asarray(planned) // 10 - 1)[:5].tolist() == views[:5].tolist()


@pytest.mark.parametrize("jit", [False, True])
def test_block_table_slots_are_vllms_slot_mapping(jit, rng):
    fn = jax.jit(paging.block_table_slots, static_argnames="page_size") if jit else \
        paging.block_table_slots
    for _ in range(10):
        requests, block_size, max_blocks, tokens = 5, int(rng.choice([1, 8, 16])), 6, 48
        table = rng.permutation(requests * max_blocks * 2)[:requests * max_blocks]
        table = table.reshape(requests, max_blocks).astype(np.int32)
        counts = np.minimum(_random_counts(rng, requests, tokens), max_blocks * block_size)
        qsl = np.concatenate([[0], np.cumsum(counts)])
        # Each request continues from a cached length; its tokens stay in its blocks.
        kv_positions = np.zeros(tokens, np.int64)
        for req in range(requests):
            cached = rng.integers(0, max_blocks * block_size - counts[req] + 1)
            kv_positions[qsl[req]:qsl[req + 1]] = cached + np.arange(counts[req])
        want = _vllm_slot_mapping(table, qsl, kv_positions, block_size, tokens)
        views = paging.token_views(jnp.asarray(counts), tokens)
        got = fn(jnp.asarray(table), views, jnp.asarray(kv_positions, jnp.int32),
                 page_size=block_size)
        np.testing.assert_array_equal(got, want, err_msg=f"{counts=} {block_size=}")


def test_block_table_slots_skip_what_has_no_page_instead_of_wrapping():
    table = jnp.array([[3, 9], [5, -1]], jnp.int32)
    rows = jnp.array([0, 0, 0, 1, 1, 2, -1], jnp.int32)
    kv_pos = jnp.array([7, 8, -1, 3, 4, 0, 0], jnp.int32)
    got = paging.block_table_slots(table, rows, kv_pos, page_size=4)
    # past the row's blocks, a negative position, a negative block id, a row past the
    # table, padding: all -1, none read from a neighbouring row.
    assert got.tolist() == [39, -1, -1, 23, -1, -1, -1]
    # Pages 2**29 - 1 and 2**29 of 4 slots: the last slot fits int32, the next would wrap.
    big = jnp.array([[2 ** 29 - 1, 2 ** 29]], jnp.int32)
    got = paging.block_table_slots(big, jnp.array([0, 0]), jnp.array([3, 4]), page_size=4)
    assert got.tolist() == [2 ** 31 - 1, -1], "a slot past int32 must not wrap"


def test_host_integers_wider_than_int32_are_checked_before_the_cast():
    with pytest.raises(ValueError, match=r"kv_positions must fit int32, got values in "
                       r"\[0, 4294967296\]"):
        paging.block_table_slots(np.zeros((1, 2), np.int32), np.zeros(2, np.int64),
                                 np.array([0, 2 ** 32], np.int64), page_size=4)
    with pytest.raises(TypeError, match="counts.dtype=float32 must be an integer type"):
        paging.token_views(np.zeros(2, np.float32), 4)
    with pytest.raises(ValueError, match=r"page_size=0 must be an int in \[1, 2147483647\] \(static\)"):
        paging.block_table_slots(np.zeros((1, 2), np.int32), np.zeros(1, np.int32),
                                 np.zeros(1, np.int32), page_size=0)


def test_flashinfer_docstring_examples():
    # get_batch_indices_positions: append_indptr [0, 1, 3, 6, 10], seq_lens [5, 5, 5, 5];
    # a page of 16 per request gives those lengths (one page each, 5 in the last).
    b, p = paging.append_positions(jnp.array([1, 2, 3, 4]), jnp.array([0, 1, 2, 3, 4]),
                                   jnp.array([5, 5, 5, 5]), page_size=16, num_tokens=10)
    assert b.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert p.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    # append_paged_kv_cache: 45, 8, 25, 22 tokens on pages [0, 8) (3, 1, 2, 2 a request),
    # last pages holding 13, 8, 9, 6: every request appends all it holds.
    indptr, last = jnp.array([0, 3, 4, 6, 8]), jnp.array([13, 8, 9, 6])
    b, p = paging.append_positions(jnp.array([45, 8, 25, 22]), indptr, last, page_size=16,
                                   num_tokens=100)
    assert b.tolist() == np.repeat(np.arange(4), [45, 8, 25, 22]).tolist()
    assert p.tolist() == [*range(45), *range(8), *range(25), *range(22)]
    slots = paging.page_table_slots(indptr, jnp.arange(8), b, p, page_size=16)
    assert slots.tolist() == [*range(45), *range(48, 56), *range(64, 89), *range(96, 118)]


def _flashinfer_slots(batch):
    # FlashInfer's append address, written from its docs (page.cuh).
    p = batch.positions.astype(np.int64)
    page = batch.kv_indices[batch.kv_indptr[batch.batch_indices] + p // batch.page_size]
    return page.astype(np.int64) * batch.page_size + p % batch.page_size


@pytest.mark.parametrize("page_size", [1, 16])
def test_append_positions_and_slots_match_the_numpy_batches(page_size, rng):
    append, cached = [1, 19, 204, 4, 0, 33], [0, 5, 16, 300, 7, 1023]
    batch = flashinfer_kv.paged_batch(rng, append, cached, pages=4096, page_size=page_size)
    tokens = sum(append) + 5   # and a padded tail
    positions_fn = jax.jit(paging.append_positions, static_argnames=("page_size", "num_tokens"))
    b, p = positions_fn(jnp.asarray(append), batch.kv_indptr, batch.kv_last_page_len,
                        page_size=page_size, num_tokens=tokens)
    n = sum(append)
    np.testing.assert_array_equal(b[:n], batch.batch_indices)
    np.testing.assert_array_equal(p[:n], batch.positions)
    assert b[n:].tolist() == p[n:].tolist() == [-1] * 5
    slots = paging.page_table_slots(batch.kv_indptr, batch.kv_indices, b, p, page_size=page_size)
    np.testing.assert_array_equal(slots[:n], _flashinfer_slots(batch))
    assert slots[n:].tolist() == [-1] * 5
    np.testing.assert_array_equal(batch.slots, _flashinfer_slots(batch))


def test_page_table_slots_skip_positions_past_the_requests_pages():
    # FlashInfer would read kv_indices of the next request for position 32 of request 0.
    indptr, indices = jnp.array([0, 2, 3]), jnp.array([5, 6, 7])
    b = jnp.array([0, 0, 1, 1, 2, 0])
    p = jnp.array([31, 32, 15, 16, 0, -3])
    assert paging.page_table_slots(indptr, indices, b, p, page_size=16).tolist() == \
        [6 * 16 + 15, -1, 7 * 16 + 15, -1, -1, -1]
