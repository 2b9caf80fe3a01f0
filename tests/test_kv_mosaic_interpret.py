"""The Mosaic GPU append kernel's body in Mosaic GPU's interpreter (CPU) against the float64
oracle and the XLA reference, and its CUDA lowering (which runs off a GPU).

- The named append cases (``jaxrope.cases``, every head layout, fp8, M-RoPE, padding) with
  the checks of tests/test_kv_cache.py (:func:`jaxrope.testing.kv_inputs.check_against_oracle`).
- Every layout form of tests/test_kv_layouts.py, read back by each reader's own indexing.
- Blocks of several tokens, a partial last block, a static T of whole blocks, and the
  run-time count (``count=None``: a grid smaller than the blocks, refs longer than the
  count, every token past it and its cache rows untouched).

Skipped with the reason on JAX 0.10 (no mutable refs, no GPU interpreter). The compiled
kernel runs in tests/gpu/test_kv_mosaic_gpu.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import mosaic_common
from jaxrope.ops.rope_append_kv import mosaic as mosaic_append
from jaxrope.ops.rope_append_kv import tuning as append_tuning
from jaxrope.ops.rope_append_kv import api as kv_api
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.cases import APPEND_BY_NAME, APPEND_CASES, MROPE_APPEND_CASES
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_inputs import check_against_oracle, make_inputs, run
from jaxrope.testing.kv_oracle import bits
from test_kv_layouts import CFG, FORMS, K_HEADS, Q_HEADS, _cache, _kv_index

MISSING = mosaic_common.unavailable()
needs_mosaic = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
LOWERING = mosaic_common.lowering_unavailable()
needs_lowering = pytest.mark.skipif(LOWERING is not None, reason=str(LOWERING))
TOLERANCE = oracle.RELATIVE_TOLERANCE


def _mosaic(q, k, v, pos, cache, slots, cfg, layout="NHD", interpret=True, **scales):
    """``apply_rope_and_append_kv``'s call of its kernel (the cache's ``[rows, D]`` views
    and addressing from :mod:`jaxrope.ops.rope_append_kv.api`), the kernel in its interpreter."""
    caches, combined, rows = kv_api._caches(cache, layout, k)
    quantized = jnp.dtype(caches[0].dtype) == jnp.float8_e4m3fn
    s = jnp.stack([jnp.float32(scales.get(name, 1.0) if quantized else 1.0)
                   for name in ("k_quant_scale", "v_quant_scale")])
    tables, _ = kernel_constants(cfg)
    q, views = mosaic_append.rope_append_kv_mosaic(
        q, k, v, jnp.asarray(pos, jnp.int32), jnp.asarray(slots, jnp.int32), jnp.asarray(tables),
        s, tuple(c.reshape(-1, c.shape[-1]) for c in caches), rows=rows,
        interpret=interpret, **kernel_options(cfg))
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return q, written[0] if combined else written


def _run(x, case, cfg=None):
    fn = jax.jit(lambda q, k, v, p, c, s: _mosaic(q, k, v, p, c, s, cfg or case.case.cfg,
                                                  case.layout, **x.scales))
    return fn(x.q, x.k, x.v, jnp.asarray(x.pos), x.kv_cache, jnp.asarray(x.slots))


def _within_rounding(a, b, label):
    # The interpreter's sin/cos are XLA's: the same rotation, rounded the same to an ulp.
    worst = kv_oracle.row_ulps(np.asarray(a), np.asarray(b)).max(initial=0)
    assert worst <= 2, f"{label}: {worst} ulps of the row's scale from the XLA reference"


DTYPE_CASES = [(c, jnp.bfloat16) for c in APPEND_CASES + MROPE_APPEND_CASES] + [
    (APPEND_BY_NAME[name], dtype) for name in ("llama3_hnd_p16", "gptj_fp8_nhd_p1",
                                               "qwen3_vl_interleaved_hnd_combined")
    for dtype in (jnp.float32, jnp.float16)]


@needs_mosaic
@pytest.mark.parametrize("case, dtype", DTYPE_CASES,
                         ids=lambda x: getattr(x, "name", None) or jnp.dtype(x).name)
def test_mosaic_append_matches_the_oracle_and_the_reference_in_its_interpreter(case, dtype, rng):
    x = make_inputs(rng, case, dtype)
    out = _run(x, case)
    check_against_oracle(case, x, out, TOLERANCE[jnp.dtype(dtype).name])
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(run(x, case, "xla"))):
        if a.dtype == jnp.float8_e4m3fn:
            assert kv_oracle.ulps(np.asarray(a), np.asarray(b)).max(initial=0) <= 1
        else:
            _within_rounding(a, b, case.name)


@needs_mosaic
@pytest.mark.parametrize("layout,combined", FORMS, ids=str)
def test_every_layout_form_puts_k_and_v_where_its_reader_looks(layout, combined, rng):
    # tests/test_kv_layouts.py's readers: each token's rows by the reader's own indexing,
    # v bit for bit, every entry no token names unchanged; slots at -1 and past the cache
    # (traced under jit: skipped) write nothing.
    tokens, page_size = 21, 8
    q, k, v = (rng.standard_normal((tokens, h, CFG.head_dim)).astype(np.float32)
               for h in (Q_HEADS, K_HEADS, K_HEADS))
    pos = rng.integers(0, CFG.max_position, tokens).astype(np.int32)
    old = _cache(rng, layout, combined)
    slots = rng.permutation(24 * page_size)[:tokens].astype(np.int32)
    slots[[3, 11]] = -1
    slots[7] = 24 * page_size + 2
    fn = jax.jit(lambda *a: _mosaic(*a, CFG, layout))
    q_out, new = fn(q, k, v, pos, jax.tree.map(jnp.asarray, old), slots)
    assert isinstance(new, tuple) != combined, "the cache comes back in the structure given"
    assert oracle.relative_error(np.asarray(q_out, np.float64), oracle.rope_of(CFG, q, pos)) < 1e-5
    new, old = ((np.asarray(x),) if combined else tuple(map(np.asarray, x)) for x in (new, old))
    written = [np.zeros(a.shape, bool) for a in new]
    k_want = oracle.rope_of(CFG, k, pos)
    for t in np.flatnonzero((slots >= 0) & (slots < 24 * page_size)):
        page, entry = divmod(int(slots[t]), page_size)
        (ka, ki), (va, vi) = (_kv_index(layout, combined, page, entry, 0),
                              _kv_index(layout, combined, page, entry, 1))
        assert oracle.relative_error(new[ka][ki], k_want[t]) < 1e-5, f"token {t}: k rows"
        np.testing.assert_array_equal(bits(new[va][vi]), bits(v[t]), err_msg=f"token {t}: v rows")
        written[ka][ki] = written[va][vi] = True
    for n, o, w in zip(new, old, written):
        np.testing.assert_array_equal(bits(n)[~w], bits(o)[~w], err_msg="an entry no token names")


@needs_mosaic
def test_mosaic_append_takes_no_tokens(rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    empty = jnp.zeros((0, 32, 128), jnp.bfloat16)
    kv = jnp.zeros((0, 8, 128), jnp.bfloat16)
    q, cache = _mosaic(empty, kv, kv, jnp.zeros(0, jnp.int32), x.kv_cache,
                       jnp.zeros(0, jnp.int32), case.case.cfg)
    assert q.shape == empty.shape
    for a, b in zip(cache, x.kv_cache):
        np.testing.assert_array_equal(bits(a), bits(b))


def _blocks(case, x, count, tokens, grid=None, n=None, max_count=None, share_angle=True):
    """The kernel built with ``tokens`` a block: ``count`` static, or None (then ``n`` is
    read at run time and ``grid`` blocks walk the first ``n`` tokens of ``x``, or run a
    token block each when ``max_count`` says the grid covers every count)."""
    cfg, (caches, combined, rows) = case.case.cfg, kv_api._caches(x.kv_cache, case.layout, x.k)
    n = count if count is not None else n
    tables, attention = kernel_constants(cfg)
    tuning = append_tuning.append_mosaic_tuning(
        x.q.shape[1], x.k.shape[1], cfg.head_dim, cfg.rotary_dim, x.q.dtype.itemsize,
        tokens_per_block=tokens, share_angle=share_angle)
    kernel = mosaic_append.build_append(
        q_heads=x.q.shape[1], k_heads=x.k.shape[1], head_dim=cfg.head_dim,
        itemsize=x.q.dtype.itemsize, rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
        attention_factor=attention, rows=rows, quantize=case.fp8,
        mrope_section=cfg.mrope_section, mrope_interleaved=cfg.mrope_interleaved,
        count=count, grid=grid, max_count=max_count, interpret=True, tuning=tuning)
    view = (lambda a: a.reshape(*a.shape[:2], cfg.head_dim // 2, 2)) if cfg.interleave else (
        lambda a: a)
    # M-RoPE rows sit n apart: the [3, n] block first, in one flat buffer.
    flat = np.zeros(np.size(x.pos), np.int32)
    flat[:np.size(x.pos[..., :n])] = np.asarray(x.pos)[..., :n].reshape(-1)
    scales = jnp.asarray([x.scales.get("k_quant_scale", 1.0), x.scales.get("v_quant_scale", 1.0)],
                         jnp.float32)

    def call(q, k, v, *cs):
        q_ref = jax.new_ref(view(q))
        refs = [jax.new_ref(mosaic_append.cache_view(c.reshape(-1, c.shape[-1]), rows, k.shape[1],
                                                 cfg.interleave)) for c in cs]
        counted = () if count is not None else (jnp.asarray([n], jnp.int32),)
        kernel(*counted, jnp.asarray(flat), jnp.asarray(x.slots), jnp.asarray(tables),
               mosaic_common.slot_row_table(cfg.rotary_dim // 2, cfg.mrope_section,
                                         cfg.mrope_interleaved),
               scales, q_ref, view(k), view(v), *refs)
        return (jax.freeze(q_ref).reshape(q.shape),
                tuple(jax.freeze(r).reshape(c.shape) for r, c in zip(refs, cs)))

    q, out = jax.jit(call)(x.q, x.k, x.v, *caches)
    return q, out[0] if combined else out


@needs_mosaic
@pytest.mark.parametrize("name, count, tokens", [
    ("llama3_hnd_p16", 17, 4), ("llama3_hnd_p16", 16, 8), ("gptj_interleave_hnd_combined", 19, 8),
    ("qwen2_vl_nhd_p16", 17, 8), ("dynamic_d192_fp8_hnd", 16, 2)])
def test_blocks_of_several_tokens_and_a_partial_last_block(name, count, tokens, rng):
    # Each block walks `tokens` tokens, the next one's loads before this one's stores; a
    # last block past T clamps its loads and skips its stores; a T of whole blocks (16 of
    # 8, 16 of 2) has neither clamps nor guards.
    case = APPEND_BY_NAME[name]
    x = make_inputs(rng, case, jnp.bfloat16)
    x = dataclasses.replace(x, q=x.q[:count], k=x.k[:count], v=x.v[:count],
                            pos=x.pos[..., :count], slots=x.slots[:count])
    case = dataclasses.replace(case, padding=int((x.slots < 0).sum()))
    check_against_oracle(case, x, _blocks(case, x, count, tokens), TOLERANCE["bfloat16"])


@needs_mosaic
@pytest.mark.parametrize("name, n, tokens, grid, max_count", [
    ("llama3_nhd_p16", 13, 4, 2, None), ("llama3_nhd_p16", 0, 2, 3, None),
    ("llama3_nhd_p16", 1, 1, 1, None), ("qwen3_vl_interleaved_hnd_combined", 11, 2, 2, None),
    # One token a block, a grid short of the items: blocks walk, with no clamp nor guard.
    ("llama3_nhd_p16", 13, 1, 2, None),
    ("gptj_fp8_nhd_p1", 9, 4, 1, None),
    # A block a token block of max_count, no walk: the last block partial, then blocks
    # past the count idle; a grid short of max_count's blocks still walks. grid counts
    # blocks for each of a token's pieces (Llama 3 and Qwen3-VL in bf16 have 3).
    ("llama3_nhd_p16", 13, 4, 4, 16), ("llama3_nhd_p16", 5, 1, 16, 16),
    ("qwen3_vl_interleaved_hnd_combined", 11, 1, 16, 16), ("llama3_nhd_p16", 13, 4, 2, 16)])
def test_mosaic_append_reads_the_token_count_at_run_time(name, n, tokens, grid, max_count, rng):
    # One compiled kernel for every T: tokens [0, n) rotated and appended as the oracle
    # says, whatever the grid (fewer blocks than the count has walk several); q past n
    # and the cache rows of the slots of tokens past n left as they were.
    case = APPEND_BY_NAME[name]
    x = make_inputs(rng, case, jnp.bfloat16)
    assert n < len(x.slots)
    cfg = case.case.cfg
    work = append_tuning.append_mosaic_tuning(x.q.shape[1], x.k.shape[1], cfg.head_dim,
                                              cfg.rotary_dim, x.q.dtype.itemsize).pieces
    q, cache = _blocks(case, x, None, tokens, grid * len(work), n, max_count)
    np.testing.assert_array_equal(bits(q)[n:], bits(x.q)[n:])
    slots = np.where(np.arange(len(x.slots)) < n, x.slots, -1)
    written, page, entry = kv_oracle.entries(slots, case.pages, case.page_size)
    for new, old in zip(kv_oracle.split(cache), kv_oracle.split(x.kv_cache)):
        kv_oracle.assert_untouched("cache", new, old, kv_oracle.written_mask(
            new.shape, case.layout, page[written], entry[written]))
    if not n:
        return
    assert oracle.relative_error(np.asarray(q[:n], np.float64),
                                 oracle.rope_of(cfg, x.q[:n], x.pos[..., :n])) < 2.5e-3
    k_rows, v_rows = (kv_oracle.rows(c, case.layout, page[written], entry[written])
                      for c in kv_oracle.split(cache))
    k_want = oracle.rope_of(cfg, x.k, x.pos)[written]
    v_want = np.asarray(x.v, np.float64)[written]
    if case.fp8:
        k_want = kv_oracle.e4m3(k_want * x.scales["k_quant_scale"])
        v_want = kv_oracle.e4m3(v_want * x.scales["v_quant_scale"])
        assert kv_oracle.ulps(k_rows, k_want).max(initial=0) <= 1
        assert kv_oracle.ulps(v_rows, v_want).max(initial=0) <= 1
    else:
        assert oracle.relative_error(k_rows.astype(np.float64), k_want) < 2.5e-3
        np.testing.assert_array_equal(bits(v_rows), bits(np.asarray(x.v)[written]))


def _lower(q, k, v, pos, cache, slots, cfg, layout, **scales):
    fn = jax.jit(lambda *a: _mosaic(*a, cfg, layout, interpret=False, **scales))
    return fn.trace(q, k, v, pos, cache, slots).lower(lowering_platforms=("cuda",))


@needs_mosaic
@needs_lowering
@pytest.mark.parametrize("case, dtype", DTYPE_CASES,
                         ids=lambda x: getattr(x, "name", None) or jnp.dtype(x).name)
def test_mosaic_append_lowers_for_cuda_on_every_case(case, dtype, rng):
    # Off a GPU the Mosaic GPU lowering still runs: a layout it cannot transfer, a
    # broadcast its layouts do not allow or an fp8 conversion it lacks fails here.
    x = make_inputs(rng, case, dtype)
    _lower(x.q, x.k, x.v, jnp.asarray(x.pos), x.kv_cache, jnp.asarray(x.slots), case.case.cfg,
           case.layout, **x.scales)


@needs_mosaic
@needs_lowering
@pytest.mark.parametrize("layout,combined", FORMS, ids=str)
@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_mosaic_append_lowers_for_cuda_on_every_layout_form(layout, combined, fp8, rng):
    old = _cache(rng, layout, combined)
    cache = jax.tree.map(lambda c: jnp.asarray(c, jnp.float8_e4m3fn if fp8 else jnp.float32), old)
    q, k = (jnp.zeros((257, h, CFG.head_dim)) for h in (Q_HEADS, K_HEADS))
    text = _lower(q, k, k, jnp.zeros(257, jnp.int32), cache, jnp.zeros(257, jnp.int32), CFG,
                  layout).as_text()
    assert "mosaic_gpu" in text


def test_llama3_halves_and_v_fill_the_warpgroup_without_copies():
    # Llama 3 (Hq 32, Hk 8, D 128, bf16): the halves' layout fills the warpgroup with k's
    # 8 heads (8-byte vectors, half a warp along a head's half, no copies), and v's
    # [8, 128] is two 8-byte vectors a thread.
    vector_bytes = append_tuning.append_mosaic_tuning(32, 8, 128, 128, 2).vector_bytes
    halves = mosaic_append.row_split(8, 64, 2, 64, False, vector_bytes)
    assert (halves.vec, halves.width_lanes, halves.head_lanes, halves.head_warps) == (4, 16, 2, 4)
    assert halves.copies == 1
    whole = mosaic_append.row_split(8, 128, 2, 0, False, vector_bytes)
    assert (whole.vec, whole.width_lanes, whole.width_warps, whole.head_warps) == (4, 32, 1, 4)
    # A q piece's 16 heads form each angle element on 8 threads; angle_split's on 2.
    q_piece = mosaic_append.row_split(16, 64, 2, 64, False, vector_bytes)
    assert 128 // (q_piece.width_lanes * q_piece.width_warps) == 8
    own = mosaic_append.angle_split(64)
    assert 128 // (own.width_lanes * own.width_warps) == 2
    assert mosaic_append.shares_angle(q_piece, 64, True)
    assert not mosaic_append.shares_angle(own, 64, True)
    assert not mosaic_append.shares_angle(q_piece, 64, False)
    # GPT-J pairs take single elements; a head count of one leaves copies, never a split head.
    assert mosaic_append.row_split(4, 32, 2, 32, True, vector_bytes).vec == 1
    assert mosaic_append.row_split(1, 40, 2, 40, False, vector_bytes).head_tile == 1


@pytest.mark.parametrize("half", [16, 32, 40, 48, 64, 128, 256])
def test_the_angle_is_formed_on_as_few_threads_an_element_as_its_size_allows(half):
    # One element a thread over the most lanes and warps that divide it (at most 128
    # threads): Llama 3's 64 slots on two warps.
    split = mosaic_append.angle_split(half)
    assert split.vec == 1 and split.head_tile == 1
    threads = split.width_lanes * split.width_warps
    assert half % threads == 0 and threads <= 128
    assert threads == max(t for t in (1, 2, 4, 8, 16, 32, 64, 128)
                          if half % t == 0 and (t <= 32 or t % 32 == 0))


@needs_mosaic
@pytest.mark.parametrize("name, count, tokens, grid", [
    ("llama3_nhd_p16", 17, 1, None), ("qwen2_vl_nhd_p16", 13, 2, None),
    ("dynamic_d192_fp8_hnd", 16, 1, None), ("partial_half_hnd_p1", 9, 1, None),
    ("linear_d80_hnd_one_token", 1, 1, None), ("mrope_interleaved_d80_nhd_combined", 17, 1, None),
    # A grid that walks: a block forms an angle for one item after another.
    ("llama3_nhd_p16", None, 1, 2), ("qwen3_vl_interleaved_hnd_combined", None, 2, 3)])
def test_the_shared_angle_rotates_bit_for_bit_as_the_angle_formed_in_place(
        name, count, tokens, grid, rng):
    # The one angle function in either layout gives the same float32 bits, and SMEM
    # hands them over unchanged: q and the cache agree to the bit with share_angle off.
    case = APPEND_BY_NAME[name]
    x = make_inputs(rng, case, jnp.bfloat16)
    n = count if count is not None else len(x.slots) - 3
    tuning = append_tuning.append_mosaic_tuning(x.q.shape[1], x.k.shape[1],
                                                case.case.cfg.head_dim,
                                                case.case.cfg.rotary_dim, 2)
    work, half = tuning.pieces, case.case.cfg.rotary_dim // 2
    splits = [mosaic_append.rotary_split(p, x.k.shape[1], half, 2, case.case.cfg.interleave,
                                         tuning.vector_bytes) for p in work]
    assert any(mosaic_append.shares_angle(s, half, True) for s in splits), "a case that shares"
    shape = dict(grid=grid and grid * len(work), n=n)
    shared = _blocks(case, x, count, tokens, **shape)
    own = _blocks(case, x, count, tokens, **shape, share_angle=False)
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(own)):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_a_token_of_many_bytes_is_split_into_pieces_that_cover_it_once():
    # Brute force over head layouts: every q head in exactly one piece, k and v in one;
    # q's chunks the largest dividing the head count within the piece budget.
    budget = 4096
    for q_heads, k_heads, head_dim, rotary_dim, itemsize in [
            (q, k, d, r, i) for q, k in ((32, 8), (28, 4), (40, 8), (64, 8), (12, 2), (14, 2),
                                        (16, 16), (8, 1), (5, 1))
            for d in (64, 128, 256, 512) for r in (d, d // 2) for i in (2, 4)]:
        work = append_tuning.pieces(q_heads, k_heads, head_dim, rotary_dim, itemsize, budget)
        assert work == append_tuning.append_mosaic_tuning(q_heads, k_heads, head_dim,
                                                          rotary_dim, itemsize).pieces
        heads = [h for p in work for h in range(p.q_first, p.q_first + p.q_heads)]
        assert sorted(heads) == list(range(q_heads))
        assert sum(p.kv for p in work) == 1
        token_bytes = (q_heads * rotary_dim + 2 * k_heads * head_dim) * itemsize
        assert (len(work) == 1) == (token_bytes <= budget)
        if len(work) == 1:
            continue
        chunk = work[0].q_heads
        assert all(p.q_heads == chunk for p in work[:-1]) and not work[-1].q_heads
        head = rotary_dim * itemsize
        assert chunk == 1 or chunk * head <= budget
        larger = [c for c in range(chunk + 1, q_heads + 1) if q_heads % c == 0]
        assert not larger or larger[0] * head > budget
