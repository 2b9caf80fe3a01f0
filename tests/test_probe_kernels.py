"""The probes' bare kernels do the data movement they are timed as (bench/RESULTS.md quotes
them as bounds): :func:`bench.kv_bound_probe.move_kernel` in Triton's interpreter, the
Mosaic GPU streams of :mod:`bench.mosaic_stream_probe` in Mosaic GPU's interpreter.

float32 in Triton's interpreter: it negates bf16 through the wrong bits (the probe checks
its bf16 results on the GPU before timing them).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrope.kernels import mosaic_gpu

MISSING = mosaic_gpu.unavailable()


@pytest.mark.requires_triton
def test_move_kernel_negates_q_in_place_and_writes_negated_k_and_v_to_their_slots(
        rng, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bench.kv_bound_probe import move_kernel

    move = move_kernel()
    tokens, q_row, kv_row, rows = 5, 256, 64, 32
    q, k, v = (torch.from_numpy(rng.standard_normal((tokens, n)).astype(np.float32))
               for n in (q_row, kv_row, kv_row))
    slots = torch.from_numpy(rng.permutation(rows)[:tokens].astype(np.int64))
    hints = dict(EVICT="evict_first", STORE=".cs")
    for width, hinted in ((64, {}), (128, hints), (256, {})):
        parts = q_row // width
        caches = [torch.zeros((rows, kv_row)) for _ in "kv"]
        before = q.clone()
        move[(tokens * (parts + 1),)](q, k, v, *caches, slots, Q_PARTS=parts, W=width,
                                      ROW=kv_row, STREAM=False, **hinted)
        assert torch.equal(q, -before), width
        for cache, src in zip(caches, (k, v)):
            assert torch.equal(cache[slots], -src), width
            untouched = torch.ones(rows, dtype=torch.bool)
            untouched[slots] = False
            assert not cache[untouched].any(), width
        flat = torch.from_numpy(rng.standard_normal(4 * width).astype(np.float32))
        before = flat.clone()
        move[(4,)](flat, flat, flat, flat, flat, slots, Q_PARTS=1, W=width, ROW=kv_row,
                   STREAM=True, **hinted)
        assert torch.equal(flat, -before), width


@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_mosaic_streams_negate_every_element_once(rng):
    from bench.mosaic_stream_probe import stream, stream_two

    q = jnp.asarray(rng.standard_normal((8, 8, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((8, 2, 128)), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 1 << 16, 3), jnp.int32)
    flat = q.reshape(-1)
    for vec in (8, 2):
        np.testing.assert_array_equal(stream(flat, 1024, vec, interpret=True), -flat)
        np.testing.assert_array_equal(stream(flat, 1024, vec, pos=pos, interpret=True), -flat)
        new_q, new_k = stream_two(q, k, 1024, vec, interpret=True)
        np.testing.assert_array_equal(new_q, -q)
        np.testing.assert_array_equal(new_k, -k)
