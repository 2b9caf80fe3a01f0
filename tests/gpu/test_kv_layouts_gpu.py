"""JAX's layouts on the GPU: the fused append's Pallas kernel writes, JAX's own ops read.

The Pallas kernel (``backend="triton"``, Triton lowering) appends sequences in two calls
into a ``paged_attention`` pair and a ``ragged_paged_attention`` array; JAX's compiled
Pallas ``paged_attention`` kernel and ``ref_ragged_paged_attention`` then read them,
against a float64 attention (:mod:`jaxrope.testing.paged_attention`); the XLA backend's
cache must be the Pallas kernel's within float32 rounding (the CPU twin of these tests,
``tests/test_kv_layouts.py``, runs the XLA and interpreter backends).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.testing import oracle
from jaxrope.testing import paged_attention as pa

pytestmark = pytest.mark.gpu

CFG = jr.RopeConfig(head_dim=128, max_position=1 << 16)
GEOMETRY = pa.Geometry(CFG, q_heads=32, k_heads=8, page_size=16, pages=64)
# The readers' float32 dots take TF32 inputs on the GPU by default (Pallas' Triton dot and
# XLA's einsum), about 1e-3 off float64; a wrong page or head is off by 1e-1 or more.
TOLERANCE = 1e-2


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_jax_paged_attention_kernel_reads_the_pair_the_gpu_wrote(backend, jax_gpu, rng):
    if pa.available("paged_attention"):
        pytest.skip(pa.available("paged_attention"))
    lengths = (1, 77, 250, 16)
    with jax.default_device(jax_gpu):
        seqs, q_rot, (k_pages, v_pages), tables = pa.append_sequences(
            rng, GEOMETRY, "paged_attention", backend, lengths, 16)
        q_last = jnp.asarray(np.stack([q[-1] for q in q_rot]) * CFG.head_dim ** -0.5)
        got = pa.gpu_paged_attention()(q_last, k_pages, v_pages, jnp.asarray(tables),
                                       jnp.asarray(lengths, jnp.int32), k_splits=4,
                                       pages_per_compute_block=4)
    for b, seq in enumerate(seqs):
        error = oracle.relative_error(np.asarray(got)[b], pa.expected_attention(CFG, seq, 1)[0])
        assert error < TOLERANCE, f"sequence {b}: attention off by {error:.2g}"


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_jax_ragged_reference_reads_the_array_the_gpu_wrote(backend, jax_gpu, rng):
    if pa.available("ragged"):
        pytest.skip(pa.available("ragged"))
    lengths, q_lens = (40, 250, 1, 33), (40, 17, 1, 1)
    with jax.default_device(jax_gpu):
        seqs, q_rot, kv_pages, tables = pa.append_sequences(
            rng, GEOMETRY, "ragged_paged_attention", backend, lengths, 16)
        queries = np.concatenate([q[-n:] for q, n in zip(q_rot, q_lens)])
        attend = pa.ragged_attention(q_lens, lengths, CFG.head_dim ** -0.5)
        got = np.asarray(attend(jnp.asarray(queries), kv_pages, jnp.asarray(tables)))
    for b, (seq, part) in enumerate(zip(seqs, np.split(got, np.cumsum(q_lens)[:-1]))):
        error = oracle.relative_error(part, pa.expected_attention(CFG, seq, q_lens[b]))
        assert error < TOLERANCE, f"sequence {b}: attention off by {error:.2g}"


@pytest.mark.parametrize("layout", ["paged_attention", "ragged_paged_attention"])
def test_pallas_and_xla_write_the_same_cache(layout, jax_gpu, rng):
    seed = int(rng.integers(1 << 30))
    caches = {}
    with jax.default_device(jax_gpu):
        for backend in ("triton", "xla"):
            _, _, cache, _ = pa.append_sequences(np.random.default_rng(seed), GEOMETRY, layout,
                                                 backend, (3, 90, 200), 16)
            caches[backend] = [np.asarray(c) for c in jax.tree.leaves(cache)]
    for a, b in zip(caches["triton"], caches["xla"]):
        assert oracle.relative_error(a, b) < oracle.RELATIVE_TOLERANCE["float32"], layout
