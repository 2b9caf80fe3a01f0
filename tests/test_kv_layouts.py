"""The cache layouts of apply_rope_and_append_kv, read back by the code that reads them.

- Every layout form (FlashInfer's NHD / HND pair and combined array, JAX's
  ``paged_attention`` pair and ``ragged_paged_attention`` array) on the XLA backend and the
  Pallas kernel (interpreter): each token's rows read back with that reader's own
  indexing, written here from its documentation (not from ``jaxrope.ops.rope_append_kv.cache_layout``),
  against the float64 rotation; every other element bit for bit unchanged.
- JAX's own ops over the written cache against a float64 attention: the Pallas
  ``paged_attention`` kernel (in the Pallas interpreter here; compiled on the GPU in
  ``tests/gpu/test_kv_layouts_gpu.py``) and ``ref_ragged_paged_attention``.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.testing import oracle
from jaxrope.testing import paged_attention as pa
from jaxrope.testing.kv_oracle import bits

BACKENDS = ("xla", "interpret")
CFG = jr.RopeConfig(head_dim=64, rotary_dim=48, max_position=4096)
Q_HEADS, K_HEADS, PAGE_SIZE, PAGES = 4, 2, 8, 24
GEOMETRY = pa.Geometry(CFG, Q_HEADS, K_HEADS, PAGE_SIZE, PAGES)


def _kv_index(layout: str, combined: bool, page: int, entry: int, kv: int):
    """(array, index) of a token's ``[Hk, D]`` keys (``kv=0``) or values (``kv=1``), from
    each reader's documentation."""
    return {("NHD", False): (kv, (page, entry)), ("HND", False): (kv, (page, slice(None), entry)),
            ("NHD", True): (0, (page, kv, entry)), ("HND", True): (0, (page, kv, slice(None), entry)),
            # paged_attention: k_pages[kv_head, page, entry], v_pages likewise
            ("paged_attention", False): (kv, (slice(None), page, entry)),
            # ragged_paged_attention: kv_pages[page, entry, 0::2] are the keys, 1::2 the values
            ("ragged_paged_attention", True): (0, (page, entry, slice(kv, None, 2))),
            }[layout, combined]


def _shape(layout: str, combined: bool):
    D = CFG.head_dim
    return {("NHD", False): (PAGES, PAGE_SIZE, K_HEADS, D),
            ("HND", False): (PAGES, K_HEADS, PAGE_SIZE, D),
            ("NHD", True): (PAGES, 2, PAGE_SIZE, K_HEADS, D),
            ("HND", True): (PAGES, 2, K_HEADS, PAGE_SIZE, D),
            ("paged_attention", False): (K_HEADS, PAGES, PAGE_SIZE, D),
            ("ragged_paged_attention", True): (PAGES, PAGE_SIZE, 2 * K_HEADS, D)}[layout, combined]


FORMS = [("NHD", False), ("HND", False), ("NHD", True), ("HND", True), ("paged_attention", False),
         ("ragged_paged_attention", True)]

fused = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "layout", "backend"))


def _cache(rng, layout, combined):
    """Random old entries (so an entry written by mistake shows)."""
    arrays = [rng.standard_normal(_shape(layout, combined)).astype(np.float32)
              for _ in range(1 if combined else 2)]
    return arrays[0] if combined else tuple(arrays)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,combined", FORMS, ids=lambda f: str(f))
def test_every_layout_puts_k_and_v_where_its_reader_looks(layout, combined, backend, rng):
    tokens = 21
    q, k, v = (rng.standard_normal((tokens, h, CFG.head_dim)).astype(np.float32)
               for h in (Q_HEADS, K_HEADS, K_HEADS))
    pos = rng.integers(0, CFG.max_position, tokens).astype(np.int32)
    slots = rng.permutation(PAGES * PAGE_SIZE)[:tokens].astype(np.int32)
    slots[[3, 11]] = -1
    old = _cache(rng, layout, combined)
    _, new = fused(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(pos),
                   jax.tree.map(jnp.asarray, old), jnp.asarray(slots), cfg=CFG, layout=layout,
                   backend=backend)
    assert isinstance(new, tuple) != combined, "the cache comes back in the structure given"
    new, old = ((np.asarray(x),) if combined else tuple(map(np.asarray, x)) for x in (new, old))
    written = [np.zeros(a.shape, bool) for a in new]
    k_want = oracle.rope_of(CFG, k, pos)
    for t in np.flatnonzero(slots >= 0):
        page, entry = divmod(int(slots[t]), PAGE_SIZE)
        (ka, ki), (va, vi) = (_kv_index(layout, combined, page, entry, kv) for kv in (0, 1))
        error = oracle.relative_error(new[ka][ki], k_want[t])
        assert error < 1e-5, f"token {t} (slot {slots[t]}): k rows off by {error:.2g}"
        np.testing.assert_array_equal(bits(new[va][vi]), bits(v[t]), err_msg=f"token {t}: v rows")
        written[ka][ki] = written[va][vi] = True
    for n, o, w in zip(new, old, written):
        np.testing.assert_array_equal(bits(n)[~w], bits(o)[~w], err_msg="an entry no token names")


@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_paged_attention_kernel_reads_the_written_pair(backend, rng):
    if pa.available("paged_attention"):
        pytest.skip(pa.available("paged_attention"))
    lengths = (5, 19, 33)
    seqs, q_rot, (k_pages, v_pages), tables = pa.append_sequences(rng, GEOMETRY, "paged_attention",
                                                                  backend, lengths, 8)
    # One query per sequence: its last token, over all its keys (decode).
    q_last = jnp.asarray(np.stack([q[-1] for q in q_rot]) * CFG.head_dim ** -0.5)
    got = pa.gpu_paged_attention()(q_last, k_pages, v_pages, jnp.asarray(tables),
                                   jnp.asarray(lengths, jnp.int32), k_splits=2,
                                   pages_per_compute_block=2, interpret=True)
    for b, seq in enumerate(seqs):
        error = oracle.relative_error(np.asarray(got)[b], pa.expected_attention(CFG, seq, 1)[0])
        assert error < 1e-4, f"sequence {b}: attention off by {error:.2g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_ragged_paged_attention_reference_reads_the_written_array(backend, rng):
    if pa.available("ragged"):
        pytest.skip(pa.available("ragged"))
    lengths = (7, 26, 1, 16)
    q_lens = (7, 4, 1, 1)   # a whole prefill, a chunk, decodes
    seqs, q_rot, kv_pages, tables = pa.append_sequences(rng, GEOMETRY, "ragged_paged_attention",
                                                        backend, lengths, 4)
    queries = np.concatenate([q[-n:] for q, n in zip(q_rot, q_lens)])
    attend = pa.ragged_attention(q_lens, lengths, CFG.head_dim ** -0.5)
    got = np.split(np.asarray(attend(jnp.asarray(queries), kv_pages, jnp.asarray(tables))),
                   np.cumsum(q_lens)[:-1])
    for b, (seq, n) in enumerate(zip(seqs, q_lens)):
        error = oracle.relative_error(got[b], pa.expected_attention(CFG, seq, n))
        assert error < 1e-4, f"sequence {b}: attention off by {error:.2g}"


def test_a_layout_refuses_the_other_cache_structure():
    q = jnp.zeros((2, Q_HEADS, CFG.head_dim))
    k = jnp.zeros((2, K_HEADS, CFG.head_dim))
    args = (q, k, k, jnp.arange(2))
    pair = tuple(jnp.zeros(_shape("paged_attention", False)) for _ in "kv")
    one = jnp.zeros(_shape("ragged_paged_attention", True))
    slots = jnp.array([0, 1])
    with pytest.raises(ValueError, match=r"layout='ragged_paged_attention' takes one "
                       r"\[pages, page_size, 2 \* Hk, D\] array"):
        jr.apply_rope_and_append_kv(*args, pair, slots, CFG, layout="ragged_paged_attention")
    with pytest.raises(ValueError, match=r"layout='paged_attention' takes a \(k_cache, v_cache\) "
                       r"pair of \[Hk, pages, page_size, D\]"):
        jr.apply_rope_and_append_kv(*args, one, slots, CFG, layout="paged_attention")
    with pytest.raises(ValueError, match=r"kv_cache.shape=\(24, 8, 2, 64\) must be \[pages, "
                       r"page_size, 2 \* Hk, D\] \(layout='ragged_paged_attention'\) with Hk=2"):
        jr.apply_rope_and_append_kv(*args, one[:, :, :2], slots, CFG,
                                    layout="ragged_paged_attention")


# The arguments this project passes to JAX's ops, by name (tests, engine demo).
CALLED = {"paged_attention": ("q", "k_pages", "v_pages", "block_tables", "lengths", "k_splits",
                              "pages_per_compute_block", "interpret"),
          "ragged": ("queries", "kv_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs",
                     "sm_scale")}


@pytest.mark.parametrize("name", CALLED)
def test_this_jax_has_the_ops_with_the_arguments_we_pass(name):
    if pa.available(name):
        pytest.skip(pa.available(name))
    op = pa.gpu_paged_attention() if name == "paged_attention" else pa.ragged_reference()
    assert set(CALLED[name]) <= set(inspect.signature(op).parameters), jax.__version__


def test_a_cache_of_2_to_the_31_rows_is_refused_before_int32_row_numbers_wrap():
    # Slots fit int32 (2**30 of them) but the rows of D values they reach do not.
    sds = jax.ShapeDtypeStruct
    pages = sds((K_HEADS, 2 ** 30, 1, CFG.head_dim), jnp.float32)
    q = sds((2, Q_HEADS, CFG.head_dim), jnp.float32)
    k = sds((2, K_HEADS, CFG.head_dim), jnp.float32)
    with pytest.raises(ValueError, match=r"has 2147483648 rows of D values; the kernels address "
                       r"at most 2\*\*31 - 1"):
        jax.eval_shape(lambda q, k, cache, slots: jr.apply_rope_and_append_kv(
            q, k, k, jnp.arange(2), cache, slots, CFG, layout="paged_attention"),
            q, k, (pages, pages), sds((2,), jnp.int32))
    smaller = sds((K_HEADS, 2 ** 30 - 1, 1, CFG.head_dim), jnp.float32)
    jax.eval_shape(lambda q, k, cache, slots: jr.apply_rope_and_append_kv(
        q, k, k, jnp.arange(2), cache, slots, CFG, layout="paged_attention", backend="xla"),
        q, k, (smaller, smaller), sds((2,), jnp.int32))
