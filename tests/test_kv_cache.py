"""apply_rope_and_append_kv on every named append case against the float64 oracle.

The XLA reference and the Pallas kernel body (in its interpreter) run every case of
``jaxrope.cases.APPEND_CASES`` in float32, float16 and bfloat16: q and the cache rows
written against ``jaxrope.testing.oracle`` / ``kv_oracle``, every other cache entry
bit for bit unchanged, and the two backends within one ulp of each other. The Triton
lowering is checked off the GPU: lowered for an H200 (aliasing, T-independent IR) and,
where Triton is installed, compiled to PTX.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import backends as backend_module
from jaxrope.ops.rope_append_kv import triton as triton_append
from jaxrope.ops.rope_append_kv import tuning as append_tuning
from jaxrope.ops.rope_append_kv import reference as kv_reference
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.ops import constants
from jaxrope.cases import APPEND_BY_NAME, APPEND_CASES, BY_NAME, AppendCase
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_inputs import FP8_SCALES, cache_shape, check_against_oracle, make_inputs, run
from jaxrope.testing.kv_oracle import bits, split
from jaxrope.testing.lowering import cuda_target, triton_modules

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
BACKENDS = ("xla", "interpret")

def assert_within_rounding(a, b, label: str) -> None:
    """Two evaluations of one rotation agree to a rounding of its products
    (:func:`jaxrope.testing.kv_oracle.row_ulps`; JAX 0.12's CPU compiler fuses some of
    them into multiply-adds, so bits differ)."""
    worst = kv_oracle.row_ulps(np.asarray(a), np.asarray(b)).max(initial=0)
    assert worst <= 2, f"{label}: two evaluations differ by {worst} ulp of the row's scale"


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", APPEND_CASES, ids=lambda c: c.name)
def test_every_append_case_matches_the_oracle_on_both_backends(case, dtype_name, rng):
    x = make_inputs(rng, case, DTYPES[dtype_name])
    outs = {backend: run(x, case, backend) for backend in BACKENDS}
    for out in outs.values():
        check_against_oracle(case, x, out, TOLERANCE[dtype_name])
    for a, b in zip(jax.tree.leaves(outs["xla"]), jax.tree.leaves(outs["interpret"])):
        assert_within_rounding(a, b, case.name)


@pytest.mark.parametrize("name", ["llama3_fp8_nhd", "gptj_interleave_hnd_combined",
                                  "dynamic_d192_fp8_hnd"])
def test_bf16_stays_at_the_rounding_floor_near_a_million_positions(name, rng):
    case = APPEND_BY_NAME[name]
    cfg = dataclasses.replace(case.case.cfg, max_position=1 << 20)
    x = make_inputs(rng, case, jnp.bfloat16)
    x.pos = rng.integers(1 << 19, 1 << 20, case.case.tokens).astype(np.int32)
    for backend in BACKENDS:
        check_against_oracle(case, x, run(x, case, backend, cfg), TOLERANCE["bfloat16"], cfg)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["llama3_nhd_p1_combined", "interleave_d96_nhd_p1",
                                  "gptj_interleave_hnd_combined"])
def test_the_cache_holds_what_apply_rope_returns_for_k(name, backend, rng):
    # One rotation rule: on one backend, the fused q and the k written into the cache are
    # apply_rope's outputs (within an ulp: XLA may vectorise sin/cos differently in
    # another program).
    case = APPEND_BY_NAME[name]
    x = make_inputs(rng, case, jnp.bfloat16)
    q_out, kv_out = run(x, case, backend)
    q_rope, k_rope = jr.apply_rope(x.q, x.k, jnp.asarray(x.pos), case.case.cfg, backend=backend)
    written, page, entry = kv_oracle.entries(x.slots, case.pages, case.page_size)
    k_rows = kv_oracle.rows(split(kv_out)[0], case.layout, page[written], entry[written])
    assert kv_oracle.ulps(np.asarray(q_out), np.asarray(q_rope)).max() <= 1
    assert kv_oracle.ulps(k_rows, np.asarray(k_rope)[written]).max() <= 1


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_apply_rope_output_scattered_into_a_cache_under_jit(dtype_name, rng):
    # The unfused pair in one jitted step. XLA CPU once fused the partial-rotary update
    # x.at[..., :R].set(rotated) in place into x while reading it, and the scatter then
    # stored half-overwritten pairs (relative error ~0.5).
    cfg = BY_NAME["partial_half_d128"].cfg
    q = jnp.asarray(rng.standard_normal((19, 8, 128)), DTYPES[dtype_name])
    pos = rng.integers(0, 4096, 19).astype(np.int32)
    slots = rng.permutation(40)[:19]

    def step(q, pos, cache):
        return cache.at[slots].set(jr.apply_rope(q, q[:, :1], pos, cfg, backend="xla")[0])

    cache = jax.jit(step)(q, jnp.asarray(pos), jnp.zeros((40, 8, 128), q.dtype))
    error = oracle.relative_error(np.asarray(cache)[slots], oracle.rope_of(cfg, q, pos))
    assert error < TOLERANCE[dtype_name], f"relative error {error:.3g}"


def test_fp8_storage_rounds_to_nearest_even_and_saturates():
    # Every e4m3 value, the midpoints between neighbours (ties go to the even one) and a
    # float32 ulp either side of them, values past 448 (which must saturate, not become
    # NaN: e4m3fn has no infinity) and tiny ones.
    finite = np.arange(256, dtype=np.uint8).view(kv_oracle.E4M3).astype(np.float64)
    finite = np.unique(finite[np.isfinite(finite)])
    mids = (finite[:-1] + finite[1:]) / 2
    x = np.concatenate([finite, mids, np.nextafter(mids.astype(np.float32), np.inf),
                        np.nextafter(mids.astype(np.float32), -np.inf), [464.0, 1e4, -1e30, 3e-5]])
    x = x.astype(np.float32)
    got = np.asarray(kv_reference.to_cache_dtype(jnp.asarray(x), jnp.float32(1.0), jnp.float8_e4m3fn))
    np.testing.assert_array_equal(bits(got), bits(kv_oracle.e4m3(x.astype(np.float64))))
    assert np.isfinite(got.astype(np.float32)).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_scales_multiply_before_saturating(backend, rng):
    case = APPEND_BY_NAME["llama3_fp8_nhd"]
    x = make_inputs(rng, case, jnp.bfloat16)
    x.scales = {"k_quant_scale": 1e4, "v_quant_scale": 1e-3}
    _, kv_out = run(x, case, backend)
    written, page, entry = kv_oracle.entries(x.slots, case.pages, case.page_size)
    k_rows, v_rows = (kv_oracle.rows(c, case.layout, page[written], entry[written])
                      for c in split(kv_out))
    k_want = kv_oracle.e4m3(oracle.rope_of(case.case.cfg, x.k, x.pos)[written] * 1e4)
    v_want = kv_oracle.e4m3(np.asarray(x.v, np.float64)[written] * 1e-3)
    assert kv_oracle.ulps(k_rows, k_want).max() <= 1 and kv_oracle.ulps(v_rows, v_want).max() <= 1
    magnitudes = np.abs(k_rows.astype(np.float64))
    # |k| > 448 / 1e4 for all but ~4% of N(0, 1) values.
    assert np.isfinite(magnitudes).all() and (magnitudes == 448).mean() > 0.9, "k * 1e4 saturates"
    assert np.abs(v_rows.astype(np.float64)).max() < 0.01, "v * 1e-3 shrinks (a divide would grow it)"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("combined", [False, True], ids=["pair", "combined"])
def test_donated_q_and_cache_are_updated_in_place(backend, combined, rng):
    case = dataclasses.replace(APPEND_BY_NAME["llama3_nhd_p16"], combined=combined)
    x = make_inputs(rng, case, jnp.bfloat16)
    want = run(x, case, backend)
    in_place = jax.jit(jr.apply_rope_and_append_kv, static_argnames=("cfg", "layout", "backend"),
                       donate_argnums=(0, 4))
    donated = (x.q, x.kv_cache)
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(donated)]
    out = in_place(x.q, x.k, x.v, jnp.asarray(x.pos), x.kv_cache, jnp.asarray(x.slots),
                   cfg=case.case.cfg, layout=case.layout, backend=backend)
    assert all(a.is_deleted() for a in jax.tree.leaves(donated))
    assert [a.unsafe_buffer_pointer() for a in jax.tree.leaves(out)] == pointers, "not in place"
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_donation_the_inputs_are_untouched(backend, rng):
    case = APPEND_BY_NAME["llama3_hnd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    before = [np.array(a) for a in jax.tree.leaves((x.q, x.kv_cache))]
    run(x, case, backend)
    for a, b in zip(jax.tree.leaves((x.q, x.kv_cache)), before):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_slots_out_of_range_write_nothing(backend, rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.float32)
    num_slots = case.pages * case.page_size
    x.slots[:3] = [num_slots, num_slots + 5, -7]   # traced under jit: not checked, skipped
    _, kv_out = run(x, case, backend)
    written, page, entry = kv_oracle.entries(x.slots, case.pages, case.page_size)
    assert written.sum() == case.case.tokens - 3 - case.padding
    k_cache, v_cache = split(kv_out)
    np.testing.assert_array_equal(
        bits(kv_oracle.rows(v_cache, case.layout, page[written], entry[written])),
        bits(x.v)[written])
    for new, old in zip((k_cache, v_cache), split(x.kv_cache)):
        kv_oracle.assert_untouched("cache", new, old, kv_oracle.written_mask(
            new.shape, case.layout, page[written], entry[written]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_tokens_change_nothing(backend, rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    empty = jnp.zeros((0, case.case.q_heads, 128), jnp.bfloat16)
    kv = jnp.zeros((0, case.case.k_heads, 128), jnp.bfloat16)
    q_out, kv_out = jr.apply_rope_and_append_kv(empty, kv, kv, jnp.zeros(0, jnp.int32),
                                                x.kv_cache, jnp.zeros(0, jnp.int32),
                                                case.case.cfg, backend=backend)
    assert q_out.shape == empty.shape
    for a, b in zip(kv_out, x.kv_cache):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("config", [(4, 1, 1), (2, 3, 1), (1, 2, 4), (8, 1, 3)],
                         ids=lambda c: "hp{}-g{}-loop{}".format(*c))
@pytest.mark.parametrize("name", ["llama3_hnd_p16", "gptj_interleave_hnd_combined",
                                  "interleave_d96_nhd_p1", "dynamic_d192_fp8_hnd"])
def test_every_launch_shape_gives_the_same_result(name, config):
    # Launch shapes only regroup work: head groups past the last head, token walks past
    # the last token and several groups per program must all give the one-group result
    # (to a rounding: the interpreter's XLA program changes with the block shape). The
    # one-group launch runs once per case (cached), its inputs seeded by the case's name.
    launch, want = _one_group_launch(name)
    got = launch(append_tuning.AppendTritonTuning(*config))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_within_rounding(a, b, f"{name} {config}")


@functools.lru_cache(maxsize=None)
def _one_group_launch(name):
    case = APPEND_BY_NAME[name]
    x = make_inputs(np.random.default_rng(zlib.crc32(name.encode())), case, jnp.float32)
    c = case.case
    tables, attention = constants.kernel_constants(c.cfg)
    arrays = (x.kv_cache,) if case.combined else x.kv_cache
    caches = tuple(a.reshape(-1, c.head_dim) for a in arrays)
    rows = cache_layout.cache_rows(case.layout, case.combined, case.pages, case.page_size, c.k_heads)

    def launch(block):
        return triton_append.rope_append_kv_triton(
            x.q, x.k, x.v, jnp.asarray(x.pos), jnp.asarray(x.slots), jnp.asarray(tables),
            jnp.asarray([0.75, 150.0], jnp.float32), caches, rows=rows,
            rotary_dim=c.cfg.rotary_dim, interleave=c.cfg.interleave, attention_factor=attention,
            interpret=True, tuning=block)

    return launch, launch(append_tuning.AppendTritonTuning(1))


def test_launch_shape_heuristic():
    lanes = 64  # rotary_dim 128
    big = append_tuning.append_triton_tuning(16384, 32, 8, lanes)
    assert big == append_tuning.AppendTritonTuning(2, 4, 1)
    assert append_tuning.head_programs(32, 8, big) == (4, 1, 1)
    # 64 tokens of Hq=32 Hk=8: 6 programs a token already fill two per SM.
    assert append_tuning.append_triton_tuning(64, 32, 8, lanes) == big
    # Few heads: a program walks 8 tokens; at 64 tokens that grid is too small, so the
    # walk, then the groups shrink until it has 264 programs (4 + 1 + 1 a token).
    assert append_tuning.append_triton_tuning(1 << 16, 8, 1, lanes) == append_tuning.AppendTritonTuning(2, 4, 8)
    assert append_tuning.append_triton_tuning(64, 8, 1, lanes) == append_tuning.AppendTritonTuning(2, 1, 1)
    assert append_tuning.grid(64, 8, 1, append_tuning.AppendTritonTuning(2, 1, 1)) == (384,)


# -- the Triton lowering, off the GPU -----------------------------------------------------

def _specs(case: AppendCase, tokens: int, dtype=jnp.bfloat16):
    c = case.case
    sds = jax.ShapeDtypeStruct
    cache_dtype = jnp.float8_e4m3fn if case.fp8 else dtype
    shape = cache_shape(case)
    kv = (sds((shape[0], 2, *shape[1:]), cache_dtype) if case.combined
          else (sds(shape, cache_dtype), sds(shape, cache_dtype)))
    return (sds((tokens, c.q_heads, c.head_dim), dtype), sds((tokens, c.k_heads, c.head_dim), dtype),
            sds((tokens, c.k_heads, c.head_dim), dtype), sds((tokens,), jnp.int32), kv,
            sds((tokens,), jnp.int32))


def _on_gpu(monkeypatch):
    # The public op picks its backend from the arrays' platform; pretend it is a GPU.
    monkeypatch.setattr(backend_module, "device_of", lambda x: types.SimpleNamespace(platform="gpu"))


def _pallas_call(case: AppendCase):
    scales = FP8_SCALES if case.fp8 else {}
    return lambda q, k, v, pos, kv, slots: jr.apply_rope_and_append_kv(
        q, k, v, pos, kv, slots, case.case.cfg, layout=case.layout, backend="triton", **scales)


LOWERED = ["llama3_nhd_p16", "llama3_hnd_p16", "llama3_nhd_p1_combined", "partial_half_fp8_hnd_combined",
           "gptj_fp8_nhd_p1", "interleave_d96_nhd_p1", "linear_d80_hnd_one_token"]


@pytest.mark.parametrize("name", LOWERED)
def test_lowers_for_cuda_with_q_and_the_cache_aliased(name, monkeypatch):
    _on_gpu(monkeypatch)
    case = APPEND_BY_NAME[name]
    specs = _specs(case, 64)
    with cuda_target():
        text = jax.jit(_pallas_call(case), donate_argnums=(0, 4)).trace(*specs).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "jaxrope_rope_append_kv" in text
    donated = 1 + len(jax.tree.leaves(specs[4]))
    assert len(re.findall(r"tf\.aliasing_output = \d+", text)) == donated, "q and the cache alias"


def _ptx(ttir: str, path, block: append_tuning.AppendTritonTuning) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    path.write_text(ttir)
    return triton.compile(str(path), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": block.num_warps,
                                   "num_stages": block.num_stages}).asm["ptx"]


@pytest.mark.requires_triton
def test_the_compiled_kernel_does_not_depend_on_the_token_count(monkeypatch, tmp_path):
    # The torch bridge compiles one kernel per head layout and cache and launches it for
    # any T (count read at run time): the PTX for 64 and 4096 tokens must be the same.
    # (The Triton IR differs only in whole-array block starts, 0 * T, that Triton folds.)
    _on_gpu(monkeypatch)
    case = APPEND_BY_NAME["llama3_hnd_p16"]
    block = append_tuning.append_triton_tuning(4096, 32, 8, 64)
    tables, attention = constants.kernel_constants(case.case.cfg)

    rows = cache_layout.cache_rows("HND", False, case.pages, 16, case.case.k_heads)

    def kernel(q, k, v, pos, kv, slots):
        views = tuple(c.reshape(-1, 128) for c in kv)
        return triton_append.rope_append_kv_triton(
            q, k, v, pos, slots, jnp.asarray(tables), jnp.ones(2, jnp.float32), views, rows=rows,
            rotary_dim=128, interleave=False, attention_factor=attention, tuning=block)

    ptx = []
    for tokens in (64, 4096):
        [ttir] = triton_modules(kernel, *_specs(case, tokens))
        ptx.append(_ptx(ttir, tmp_path / "kernel.ttir", block))
    assert _code(ptx[0]) == _code(ptx[1])


def _code(ptx: str) -> str:
    # The instructions, without debug info (file paths from Triton's compile cache).
    code = ptx.split(".section")[0]
    return "\n".join(line for line in code.splitlines()
                     if not re.match(r"\s*\.(file|loc)\b", line))


@pytest.mark.requires_triton
@pytest.mark.parametrize("name", ["llama3_nhd_p16", "partial_half_fp8_hnd_combined",
                                  "gptj_fp8_nhd_p1"])
def test_the_kernel_compiles_to_ptx_for_sm90(name, monkeypatch, tmp_path):
    # Triton's own passes (TTIR -> PTX for sm_90) run on the CPU: the kernel uses the
    # hardware sine/cosine, and an fp8 cache the saturating e4m3 conversion FlashInfer uses.
    _on_gpu(monkeypatch)
    case = APPEND_BY_NAME[name]
    [ttir] = triton_modules(_pallas_call(case), *_specs(case, 64))
    ptx = _ptx(ttir, tmp_path / "kernel.ttir", append_tuning.append_triton_tuning(
        64, case.case.q_heads, case.case.k_heads, case.case.cfg.rotary_dim // 2))
    assert "sin.approx.f32" in ptx and "cos.approx.f32" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == case.fp8
    assert re.search(r"st\.global\.v[24]", ptx), "cache rows should be stored in vectors"


def test_fp8_caches_of_2_to_4_gib_take_the_xla_path(monkeypatch):
    # JAX's Triton lowering would address them with wrapping int32 offsets.
    _on_gpu(monkeypatch)
    case = APPEND_BY_NAME["llama3_fp8_nhd"]
    pages = (3 << 30) // (16 * 8 * 128)  # 3 GiB of fp8 per cache
    specs = list(_specs(case, 64))
    sds = jax.ShapeDtypeStruct
    specs[4] = (sds((pages, 16, 8, 128), jnp.float8_e4m3fn),) * 2
    assert "2-4 GiB" in triton_append.unsupported(specs[4][0])
    assert triton_append.unsupported(sds((2 * pages, 16, 8, 128), jnp.float8_e4m3fn)) is None
    assert triton_append.unsupported(sds((pages, 16, 8, 128), jnp.bfloat16)) is None
    with pytest.raises(jr.BackendUnavailable, match="2-4 GiB"):
        jax.eval_shape(_pallas_call(case), *specs)
    auto = lambda *a: jr.apply_rope_and_append_kv(*a[:6], case.case.cfg, **FP8_SCALES)  # noqa: E731
    jaxpr = str(jax.make_jaxpr(auto)(*specs))
    assert "pallas_call" not in jaxpr and "scatter" in jaxpr


# -- the FlashInfer page-table convention -------------------------------------------------

def test_flashinfer_page_tables_map_to_slots():
    # FlashInfer's append_paged_kv_cache docstring example: 4 requests appending 45, 8,
    # 25 and 22 tokens into pages [0, 8) (3, 1, 2 and 2 pages), page_size 16, the
    # requests' cached lengths equal to what they append.
    from jaxrope.testing import flashinfer_kv
    batch = flashinfer_kv.PagedBatch(
        kv_indices=np.arange(8, dtype=np.int32), kv_indptr=np.array([0, 3, 4, 6, 8], np.int32),
        kv_last_page_len=np.array([13, 8, 9, 6], np.int32), page_size=16,
        batch_indices=np.repeat(np.arange(4), [45, 8, 25, 22]).astype(np.int32),
        positions=np.concatenate([np.arange(n) for n in (45, 8, 25, 22)]).astype(np.int32))
    slots = batch.slots
    assert slots[:45].tolist() == list(range(45))          # pages 0-2
    assert slots[45:53].tolist() == list(range(48, 56))    # page 3
    assert slots[53:78].tolist() == list(range(64, 89))    # pages 4-5
    assert slots[78:].tolist() == list(range(96, 118))     # pages 6-7


def test_paged_batches_give_distinct_slots_on_shuffled_pages(rng):
    from jaxrope.testing import flashinfer_kv
    batch = flashinfer_kv.paged_batch(rng, append_lengths=[1, 19, 204, 4], cached_lengths=[0, 5, 16, 300],
                                      pages=64, page_size=16)
    assert len(np.unique(batch.slots)) == 228 and batch.slots.min() >= 0
    assert batch.slots.max() < 64 * 16
    # Token i of request b sits at KV position cached_b + i.
    assert batch.positions[batch.batch_indices == 3].tolist() == [300, 301, 302, 303]



@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_gpu_parity_inputs_pad_past_flashinfers_tokens_and_mask_exactly_their_rows(rng, layout):
    from jaxrope.testing import flashinfer_kv
    x = flashinfer_kv.append_inputs(rng, layout, 16, np.dtype(np.float16), 64, 4, 2, fp8=True)
    n, pad = x.tokens, flashinfer_kv.PADDING
    assert n == sum(flashinfer_kv.APPEND) and x.q.shape == (n + pad, 4, 64)
    assert x.slots[n:].tolist() == [-1] * pad and x.pos[n:].tolist() == [0] * pad
    for b in range(len(flashinfer_kv.APPEND)):
        mine = x.batch.batch_indices == b
        bases = np.unique(x.pos[:n][mine] - x.batch.positions[mine])
        assert len(bases) == 1 and bases[0] in flashinfer_kv.BASES, f"request {b}: {bases}"
    assert all(c.dtype == kv_oracle.E4M3 for c in x.old)
    page, entry, mask = x.written(layout)
    assert mask.sum() == n * 2 * 64 and kv_oracle.rows(mask, layout, page, entry).all()
    changed = x.old[0].copy()
    if layout == "NHD":
        changed[page, entry] = 0
    else:
        changed[page, :, entry] = 0
    kv_oracle.assert_untouched("rows only", changed, x.old[0], mask)
    changed[~mask] = 0
    with pytest.raises(AssertionError, match="an entry no token names changed"):
        kv_oracle.assert_untouched("outside", changed, x.old[0], mask)

# -- bad inputs ----------------------------------------------------------------------------

class TestBadInputs:
    cfg = jr.RopeConfig(head_dim=64, max_position=4096)

    def _inputs(self, layout="NHD", cache_dtype=jnp.bfloat16):
        q = jnp.zeros((3, 4, 64), jnp.bfloat16)
        k = v = jnp.zeros((3, 2, 64), jnp.bfloat16)
        shape = (4, 16, 2, 64) if layout == "NHD" else (4, 2, 16, 64)
        cache = (jnp.zeros(shape, cache_dtype), jnp.zeros(shape, cache_dtype))
        return dict(q=q, k=k, v=v, pos_ids=jnp.arange(3, dtype=jnp.int32), kv_cache=cache,
                    slots=jnp.array([0, 5, -1], jnp.int32), cfg=self.cfg)

    def _raises(self, exc, text, **changes):
        args = {**self._inputs(), **changes}
        kwargs = {key: args.pop(key) for key in ("layout", "k_quant_scale", "v_quant_scale", "backend")
                  if key in args}
        with pytest.raises(exc, match=re.escape(text)):
            jr.apply_rope_and_append_kv(args["q"], args["k"], args["v"], args["pos_ids"],
                                        args["kv_cache"], args["slots"], args["cfg"],
                                        **{"backend": "xla", **kwargs})

    def test_rope_arguments_are_checked_as_apply_rope_checks_them(self):
        self._raises(ValueError, "k.shape[0]", k=jnp.zeros((4, 2, 64), jnp.bfloat16))
        self._raises(ValueError, "pos_ids must lie in [0, 4096)",
                     pos_ids=jnp.array([0, 4096, 1], jnp.int32))
        self._raises(TypeError, "cfg", cfg={"head_dim": 64})

    def test_v_must_match_k(self):
        self._raises(ValueError, "v ((3, 2, 32), bfloat16) must match k",
                     v=jnp.zeros((3, 2, 32), jnp.bfloat16))
        self._raises(ValueError, "v ((3, 2, 64), float16) must match k",
                     v=jnp.zeros((3, 2, 64), jnp.float16))
        self._raises(TypeError, "v must be an array", v=[[0.0]])

    def test_layout_must_be_a_known_one(self):
        self._raises(ValueError, "layout='NDH' must be one of ('NHD', 'HND', 'paged_attention', "
                     "'ragged_paged_attention')", layout="NDH")

    def test_cache_must_be_a_pair_or_one_combined_array(self):
        cache = self._inputs()["kv_cache"]
        self._raises(TypeError, "kv_cache must be a (k_cache, v_cache) pair", kv_cache=cache[:1])
        self._raises(TypeError, "kv_cache must be a (k_cache, v_cache) pair", kv_cache={"k": 1})
        self._raises(ValueError, "kv_cache.shape=(4, 16, 2, 64) must be [pages, 2, page_size, Hk, D]",
                     kv_cache=cache[0])
        self._raises(ValueError, "k_cache.shape=(4, 16, 128) must be rank 4",
                     kv_cache=(cache[0].reshape(4, 16, 128), cache[1]))
        self._raises(ValueError, "v_cache ((4, 16, 2, 32), bfloat16) must match k_cache",
                     kv_cache=(cache[0], cache[1][..., :32]))

    def test_cache_rows_must_fit_k_in_the_layout(self):
        cache = self._inputs("HND")["kv_cache"]   # [pages, Hk, page_size, D] read as NHD
        self._raises(ValueError, "k_cache.shape=(4, 2, 16, 64) must be [pages, page_size, Hk, D] "
                     "(layout='NHD') with Hk=2 and D=64", kv_cache=cache)
        self._raises(ValueError, "kv_cache.shape=(4, 2, 16, 4, 64) must be [pages, 2, Hk, page_size, D]"
                     " (layout='HND') with Hk=2", kv_cache=jnp.zeros((4, 2, 16, 4, 64), jnp.bfloat16),
                     layout="HND")

    def test_cache_dtype_is_k_dtype_or_fp8(self):
        self._raises(ValueError, "k_cache.dtype=float16 must be k's dtype (bfloat16) or float8_e4m3fn",
                     kv_cache=self._inputs(cache_dtype=jnp.float16)["kv_cache"])

    def test_slots_are_int_one_per_token(self):
        self._raises(ValueError, "slots.shape=(2,) must be [T] with T=3", slots=jnp.zeros(2, jnp.int32))
        self._raises(ValueError, "slots.dtype=float32 must be an integer type",
                     slots=jnp.zeros(3, jnp.float32))
        self._raises(TypeError, "slots must be an integer array", slots=[0, 1, 2])

    def test_visible_slots_stay_in_the_cache_and_do_not_repeat(self):
        self._raises(ValueError, "slots must be < 64 (pages * page_size) or negative (skipped), got a "
                     "maximum of 64", slots=jnp.array([0, 64, -1], jnp.int32))
        self._raises(ValueError, "slots must not repeat a slot", slots=jnp.array([7, 7, -1], jnp.int32))

    def test_scales_only_for_fp8_and_positive(self):
        self._raises(ValueError, "k_quant_scale=0.5 applies only to a float8_e4m3fn cache",
                     k_quant_scale=0.5)
        fp8 = self._inputs(cache_dtype=jnp.float8_e4m3fn)["kv_cache"]
        self._raises(ValueError, "v_quant_scale=0.0 must be finite and > 0", kv_cache=fp8,
                     v_quant_scale=0.0)
        self._raises(ValueError, "k_quant_scale=inf must be finite", kv_cache=fp8,
                     k_quant_scale=float("inf"))
        self._raises(ValueError, "k_quant_scale.shape=(2,) must be ()", kv_cache=fp8,
                     k_quant_scale=jnp.ones(2))
        self._raises(TypeError, "v_quant_scale must be a float", kv_cache=fp8, v_quant_scale="1")

    def test_backends(self):
        self._raises(ValueError, "backend='cuda' must be one of", backend="cuda")
        if jax.default_backend() != "gpu":
            self._raises(jr.BackendUnavailable, "backend='triton' needs a GPU",
                         backend="triton")
        self._raises(ValueError, "the Pallas kernels are 'triton' and 'mosaic'", backend="pallas")
        if jax.default_backend() != "gpu":
            self._raises(jr.BackendUnavailable, "backend='mosaic' needs a CUDA GPU",
                         backend="mosaic")
