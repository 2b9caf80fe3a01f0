"""apply_rope_and_append_kv: a slot is range-checked at its own width, and the caches are two.

A slot that an int32 cast would wrap into the cache (int64 ``-2**32 + 5`` is 5 after the
cast) is outside the cache, so it skips its token like any negative slot; a visible one
past the cache raises, a traced one is skipped. ``kv_cache=(c, c)`` is refused. The
bridge's side of both is in tests/test_kv_bridge.py; tests/test_kv_slot_fuzz.py draws
slots of every integer dtype against a model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr

CFG = jr.RopeConfig(head_dim=8)
PAGES, PAGE_SIZE = 2, 4
BACKENDS = ("xla", "interpret")


def _inputs(tokens: int):
    ids = jnp.arange(1, tokens + 1, dtype=jnp.float32)[:, None, None]
    v = jnp.broadcast_to(ids, (tokens, 1, 8))
    cache = tuple(jnp.zeros((PAGES, PAGE_SIZE, 1, 8), jnp.float32) for _ in "kv")
    return jnp.ones((tokens, 2, 8), jnp.float32), v, v, jnp.zeros(tokens, jnp.int32), cache


def _written(v_cache) -> dict:
    """``{slot: token id}`` of every entry a token wrote (ids start at 1; 0 is untouched)."""
    ids = np.asarray(v_cache)[:, :, 0, 0].reshape(-1)
    return {slot: int(i) for slot, i in enumerate(ids) if i}


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_int64_slot_that_would_wrap_into_the_cache_is_skipped(backend):
    q, k, v, pos, cache = _inputs(2)
    slots = np.array([-2 ** 32 + 5, 7], np.int64)   # cast to int32 first: slots 5 and 7
    _, (_, v_cache) = jr.apply_rope_and_append_kv(q, k, v, pos, cache, slots, CFG,
                                                  backend=backend)
    assert _written(v_cache) == {7: 2}


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.uint32])
def test_a_visible_slot_past_the_cache_raises_at_any_width(dtype):
    q, k, v, pos, cache = _inputs(2)
    big = {np.int64: 2 ** 32 + 5, np.uint64: 2 ** 64 - 2 ** 32 + 5, np.uint32: 2 ** 32 - 1}[dtype]
    with pytest.raises(ValueError, match=f"slots must be < 8 .* got a maximum of {big}"):
        jr.apply_rope_and_append_kv(q, k, v, pos, cache, np.array([big, 1], dtype), CFG)


def test_traced_int64_slots_are_range_checked_before_the_cast():
    # 64-bit jax arrays need jax_enable_x64; the Pallas kernel body does not trace with
    # it (tests/test_kv_slot_fuzz.py), and its slots are the same int32 either way.
    with jax.enable_x64(True):
        q, k, v, pos, cache = _inputs(4)
        slots = jnp.array([2 ** 32 + 5, -2 ** 32 + 6, 2 ** 63 - 2 ** 32 + 1, 3], jnp.int64)
        step = jax.jit(functools.partial(jr.apply_rope_and_append_kv, cfg=CFG, backend="xla"))
        _, (_, v_cache) = step(q, k, v, pos, cache, slots)
    assert _written(v_cache) == {3: 4}


@pytest.mark.parametrize("backend", BACKENDS)
def test_narrow_traced_slots_compare_against_the_cache_size_without_wrapping_it(backend):
    # 300 slots: the bound does not fit an int8, whose every value (-1 aside) is a slot.
    q, k, v, pos, _ = _inputs(3)
    cache = tuple(jnp.zeros((75, PAGE_SIZE, 1, 8), jnp.float32) for _ in "kv")
    step = jax.jit(functools.partial(jr.apply_rope_and_append_kv, cfg=CFG, backend=backend))
    _, (_, v_cache) = step(q, k, v, pos, cache, jnp.array([127, -1, -128], jnp.int8))
    assert _written(v_cache) == {127: 1}


def test_one_array_as_both_caches_is_refused():
    q, k, v, pos, (c, _) = _inputs(2)
    slots = jnp.array([0, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"kv_cache=\(c, c\) passes one array as both k_cache "
                                         r"and v_cache"):
        jr.apply_rope_and_append_kv(q, k, v, pos, (c, c), slots, CFG)

    def step(q, c):   # one traced value twice is the same tracer: refused while tracing
        return jr.apply_rope_and_append_kv(q, k, v, pos, (c, c), slots, CFG)

    with pytest.raises(ValueError, match="one array as both k_cache and v_cache"):
        jax.jit(step)(q, c)
