"""Fuzz of the fused append's slots against a plain model in Python integers.

Every integer dtype numpy has (and every torch has, through the bridge's JAX path)
carries slots drawn from the values that break narrowing casts: the cache's edges (0,
``N - 1``, ``N``, -1 with ``N = pages * page_size``), +-2**31, +-2**32 + k and 2**64 -
2**32 + k (each of which an int32 cast wraps onto slot k), the dtype's min and max, random
slots in the cache, and repeats. The model (:func:`expected`) is the documented rule,
with Python's unbounded integers: a token whose slot is in ``[0, N)`` writes its k and v
there, any other token writes nothing; visible (numpy) slots at or past ``N``, or a slot
named twice, raise ``ValueError`` instead, and so do the bridge's CPU tensors (their
values are on the host: one rule for every eager call). Under ``jit`` (values traced,
unchecked) a slot named twice holds one of its tokens' rows, element by element (on CPU
both backends let the last token win; the GPU kernel's programs run concurrently, in no
defined order).

Token ``t`` carries k = t + 1 and v = -(t + 1) in every element at position 0, where the
rotation is exact, so a cache entry names the token that wrote it.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Set, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr

PAGES, PAGE_SIZE, HEADS, HEAD_DIM, TOKENS = 3, 4, 2, 8, 6
NUM_SLOTS = PAGES * PAGE_SIZE
CFG = jr.RopeConfig(head_dim=HEAD_DIM)
NUMPY_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64)
TRIALS = 24
# Outside jit the Pallas interpreter lowers the kernel again on every call (about a
# second), and visible slots are converted on the host before a backend is picked: the
# XLA backend runs every dtype, the interpreter the two that JAX itself would cut to 32
# bits (two calls each).
VISIBLE_CASES = ([("xla", d, TRIALS) for d in NUMPY_DTYPES]
                 + [("interpret", d, 2) for d in (np.int64, np.uint64)])
BACKENDS = ("xla", "interpret")


def edge_values(low: int, high: int) -> List[int]:
    """The slots worth trying in a dtype of range ``[low, high]``."""
    wraps = [base + k for base in (2 ** 32, -2 ** 32, 2 ** 33, 2 ** 64 - 2 ** 32)
             for k in (0, 1, NUM_SLOTS - 1)]
    edges = [0, NUM_SLOTS - 1, NUM_SLOTS, NUM_SLOTS + 1, -1, -2, 2 ** 31, -2 ** 31,
             2 ** 31 - 1, 2 ** 31 + 5, -2 ** 31 + 5, low, high, low + 1, high - 1, *wraps]
    return sorted({v for v in edges if low <= v <= high})


def draw(rng: np.random.Generator, low: int, high: int, inside_only: bool = False) -> List[int]:
    """``TOKENS`` slots as Python ints: random slots in the cache, edges, repeats."""
    edges = [v for v in edge_values(low, high) if not inside_only or v < NUM_SLOTS]
    slots = [int(rng.integers(0, NUM_SLOTS)) if rng.random() < 0.4
             else edges[rng.integers(len(edges))] for _ in range(TOKENS)]
    if rng.random() < 0.3:
        a, b = rng.choice(TOKENS, 2, replace=False)
        slots[b] = slots[a]
    return slots


def expected(slots: List[int]) -> Tuple[np.ndarray, np.ndarray, Dict[int, Set[int]]]:
    """The model: ``(k_cache, v_cache)`` and, per slot named by several tokens, their ids.

    A slot several tokens name holds one of their rows; its entries here are NaN.
    """
    k_cache = np.zeros((PAGES, PAGE_SIZE, HEADS, HEAD_DIM), np.float32)
    v_cache = np.zeros_like(k_cache)
    writers: Dict[int, Set[int]] = {}
    for t, slot in enumerate(slots):
        if 0 <= slot < NUM_SLOTS:
            writers.setdefault(slot, set()).add(t + 1)
    for slot, ids in writers.items():
        value = ids.copy().pop() if len(ids) == 1 else np.nan
        k_cache[slot // PAGE_SIZE, slot % PAGE_SIZE] = value
        v_cache[slot // PAGE_SIZE, slot % PAGE_SIZE] = -value
    return k_cache, v_cache, {s: ids for s, ids in writers.items() if len(ids) > 1}


def refused(slots: List[int]) -> Optional[str]:
    """The error a visible call raises for ``slots``, or None."""
    if any(s >= NUM_SLOTS for s in slots):
        return f"slots must be < {NUM_SLOTS}"
    inside = [s for s in slots if s >= 0]
    return "slots must not repeat a slot" if len(set(inside)) < len(inside) else None


def check(k_cache, v_cache, slots: List[int], label: str) -> None:
    want_k, want_v, contested = expected(slots)
    k_cache, v_cache = np.asarray(k_cache, np.float32), np.asarray(v_cache, np.float32)
    for slot, ids in contested.items():
        where = slot // PAGE_SIZE, slot % PAGE_SIZE
        assert set(np.unique(k_cache[where]).tolist()) <= ids, (label, slots, slot)
        assert set((-np.unique(v_cache[where])).tolist()) <= ids, (label, slots, slot)
        want_k[where], want_v[where] = k_cache[where], v_cache[where]
    np.testing.assert_array_equal(k_cache, want_k, err_msg=f"{label}: slots {slots}")
    np.testing.assert_array_equal(v_cache, want_v, err_msg=f"{label}: slots {slots}")


def inputs():
    ids = np.arange(1, TOKENS + 1, dtype=np.float32)[:, None, None]
    k = np.broadcast_to(ids, (TOKENS, HEADS, HEAD_DIM))
    q = np.ones((TOKENS, 4, HEAD_DIM), np.float32)
    cache = np.zeros((PAGES, PAGE_SIZE, HEADS, HEAD_DIM), np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(-k), (jnp.asarray(cache), jnp.asarray(cache))


def x64_for(dtype) -> bool:
    # 64-bit jax arrays exist only with x64 on; without it jnp.asarray cuts them to 32 bits.
    return np.dtype(dtype).itemsize == 8


@functools.lru_cache(maxsize=None)
def traced_call(backend: str):
    return jax.jit(functools.partial(jr.apply_rope_and_append_kv, cfg=CFG, backend=backend))


@pytest.mark.parametrize("backend, dtype, trials", VISIBLE_CASES,
                         ids=[f"{b}-{np.dtype(d).name}" for b, d, _ in VISIBLE_CASES])
def test_visible_numpy_slots_follow_the_model(backend, dtype, trials, rng):
    info = np.iinfo(dtype)
    q, k, v, cache = inputs()
    pos = jnp.zeros(TOKENS, jnp.int32)
    for trial in range(trials):
        # Half the trials keep every slot below N, so the call runs and skips the rest.
        slots = draw(rng, int(info.min), int(info.max), inside_only=trial % 2 == 0)
        error = refused(slots)
        call = functools.partial(jr.apply_rope_and_append_kv, q, k, v, pos, cache,
                                 np.array(slots, dtype), CFG, backend=backend)
        if error:
            with pytest.raises(ValueError, match=error):
                call()
            continue
        _, (k_cache, v_cache) = call()
        check(k_cache, v_cache, slots, f"visible {backend}")


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_slots_follow_the_model(backend, dtype, rng):
    if backend == "interpret" and x64_for(dtype):
        pytest.skip("the Pallas kernel body does not trace with jax_enable_x64 (its Python "
                    "int indices become int64); 64-bit jax slots exist only with it")
    info = np.iinfo(dtype)
    with jax.enable_x64(x64_for(dtype)):
        q, k, v, cache = inputs()
        pos = jnp.zeros(TOKENS, jnp.int32)
        for _ in range(TRIALS):
            slots = draw(rng, int(info.min), int(info.max))
            traced = jnp.asarray(np.array(slots, dtype))
            assert traced.dtype == dtype
            _, (k_cache, v_cache) = traced_call(backend)(q, k, v, pos, cache, traced)
            check(k_cache, v_cache, slots, f"traced {backend}")


TORCH_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")


def test_the_bridge_fuzz_covers_every_torch_integer_dtype():
    torch = pytest.importorskip("torch")

    def has_range(dtype) -> bool:
        # Sub-byte int1..int7 / uint1..uint7 are storage-only, without an iinfo.
        try:
            torch.iinfo(dtype)
        except TypeError:
            return False
        return True

    # Quantized qint8 / quint8 ... are not plain integers (their names start with "q").
    found = {str(d).removeprefix("torch.") for d in list(vars(torch).values())
             if isinstance(d, torch.dtype) and str(d).startswith(("torch.int", "torch.uint"))
             and has_range(d)}
    assert found == set(TORCH_DTYPES)


@pytest.mark.parametrize("name", TORCH_DTYPES)
def test_bridge_slots_of_every_torch_integer_dtype_follow_the_model(name, rng):
    torch = pytest.importorskip("torch")
    from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext

    dtype = getattr(torch, name)
    info = torch.iinfo(dtype)
    mgr = RopeManager(PositionConfig(rope=CFG), "cpu", launcher="jax")
    mgr.ingest_request("r")
    step = PositionStep([Segment("r", "text", TOKENS)], pos_ids=torch.zeros(TOKENS, dtype=torch.int32))
    ids = torch.arange(1, TOKENS + 1, dtype=torch.float32)[:, None, None]
    k = ids.expand(TOKENS, HEADS, HEAD_DIM).contiguous()
    for trial in range(TRIALS):
        mgr.plan(step, StepContext(("r",)))
        slots = draw(rng, int(info.min), int(info.max), inside_only=trial % 2 == 0)
        cache = tuple(torch.zeros(PAGES, PAGE_SIZE, HEADS, HEAD_DIM) for _ in "kv")
        q = torch.ones(TOKENS, 4, HEAD_DIM)
        call = functools.partial(mgr.apply_qk_and_append_kv, q, k, -k, "text", cache,
                                 torch.tensor(slots, dtype=dtype))
        error = refused(slots)
        if error:   # a CPU tensor's values are on the host: refused as the eager JAX op does
            with pytest.raises(ValueError, match=error):
                call()
            assert not any(c.any() for c in cache)
        else:
            call()
            check(cache[0].numpy(), cache[1].numpy(), slots, f"bridge {name}")
        mgr.commit(step, StepContext(("r",)))
