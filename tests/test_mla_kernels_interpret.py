"""The MLA RoPE + cache-append kernels' bodies on CPU against a float64 oracle of the
contract: the Triton one in the Pallas interpreter (``interpret=True``), the Mosaic GPU one
in Mosaic GPU's interpreter (JAX 0.11+, skipped with the reason on 0.10), and both
lowered for CUDA off a GPU.

The oracle (:func:`_oracle`): q_pe ``[T, H, r]`` and k_pe ``[T, r]`` rotated in float64
at each position by ``cfg.serving_frequencies()`` (GPT-J pairs or NeoX halves) times the
attention factor; ckv copied; the cache row ``slot`` of the ``[rows, width]`` view gets
ckv at ``[:L]`` and k_pe at ``[L:]`` (one array) or each in its own array (a pair);
fp8 values are ``e4m3(clip(x * scale))``. Configs: DeepSeek-V3's (``RopeConfig.from_hf``
of its config.json: YaRN, GPT-J pairs), the same with NeoX halves, and a sectioned M-RoPE
one. The tests marked ``gpu`` (run by bench/gpu_suite.sh) compile both kernels on a GPU
against the same oracle.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import mosaic_common
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.ops.mla_rope_append import mosaic as mla_mosaic
from jaxrope.ops.mla_rope_append import triton as mla_triton
from jaxrope.ops.mla_rope_append import tuning as mla_tuning
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_oracle import bits
from jaxrope.testing.lowering import cuda_target, triton_modules

MISSING = mosaic_common.unavailable()
needs_mosaic = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
LOWERING = mosaic_common.lowering_unavailable()
needs_lowering = pytest.mark.skipif(LOWERING is not None, reason=str(LOWERING))

_CONFIG = pathlib.Path(__file__).parent / "data" / "hf_configs" / "deepseek-ai__DeepSeek-V3.json"
DEEPSEEK = jr.RopeConfig.from_hf(json.loads(_CONFIG.read_text())["config"])
NEOX = dataclasses.replace(DEEPSEEK, interleave=False)
# An M-RoPE config with MLA's rotary width (no model ships one): positions [3, T].
MROPE = jr.RopeConfig(head_dim=64, rotary_dim=64, interleave=True, mrope_section=(16, 8, 8))
FP8 = jnp.dtype(jnp.float8_e4m3fn)
Q_SCALE, KV_SCALE = 0.75, 1.5


class MlaCase(NamedTuple):
    name: str
    cfg: jr.RopeConfig
    dtype: object             # q_pe, k_pe, ckv, q_nope
    combined: bool            # one [P, S, L + r] array, else a (ckv, k_pe) pair
    kv_lora_rank: int
    fp8_cache: bool = False
    fp8_q: bool = False
    nope_dim: int = 0         # q_nope's N (0: no q_nope)
    heads: int = 4
    tokens: int = 5
    attention_factor: Optional[float] = None  # overrides the config's


CASES = [
    MlaCase("deepseek_pair_bf16", DEEPSEEK, jnp.bfloat16, False, 512),
    MlaCase("deepseek_combined_fp8_q_nope512", DEEPSEEK, jnp.bfloat16, True, 512, True, True, 512),
    MlaCase("deepseek_combined_bf16_nope_kept", DEEPSEEK, jnp.bfloat16, True, 40, nope_dim=128),
    MlaCase("deepseek_pair_fp8_q_bf16_cache", DEEPSEEK, jnp.bfloat16, False, 40, fp8_q=True,
            heads=8, tokens=5),
    MlaCase("neox_pair_fp8_q_nope128", NEOX, jnp.bfloat16, False, 40, True, True, 128, heads=6),
    MlaCase("neox_combined_f32_factor", NEOX, jnp.float32, True, 48, tokens=9,
            attention_factor=1.25),
    MlaCase("mrope_combined_bf16", MROPE, jnp.bfloat16, True, 40),
]
# DeepSeek-V3's own sizes (H 128, N 512, L 512), lowered only: the interpreters would
# take minutes.
FULL = MlaCase("deepseek_v3_full_fp8", DEEPSEEK, jnp.bfloat16, True, 512, True, True, 512,
               heads=128, tokens=64)
BY_NAME = {c.name: c for c in CASES}
TOLERANCE = oracle.RELATIVE_TOLERANCE


class Inputs(NamedTuple):
    q_pe: np.ndarray
    k_pe: np.ndarray
    ckv: np.ndarray
    q_nope: Optional[np.ndarray]
    pos: np.ndarray
    slots: np.ndarray
    caches: tuple  # [rows, width] matrices


def make_inputs(rng, case: MlaCase, page_size: int = 4) -> Inputs:
    r, t, h, L = case.cfg.rotary_dim, case.tokens, case.heads, case.kv_lora_rank
    dtype = jnp.dtype(case.dtype)

    def normal(*shape):
        return np.asarray(rng.standard_normal(shape), np.float32).astype(dtype)

    ckv = normal(t, L)
    ckv[0, :3] = np.array([600.0, -1000.0, 300.0], np.float32).astype(dtype)  # saturates fp8
    rows = max(6, -(-2 * t // page_size)) * page_size   # whole pages, half of them named
    slots = rng.permutation(rows)[:t].astype(np.int32)
    if t > 2:
        slots[1] = -1                   # padding
        slots[t - 2] = rows + 3         # past the cache (a traced slot): skipped
    pos_shape = (3, t) if case.cfg.mrope_section else (t,)
    widths = (L + r,) if case.combined else (L, r)
    cache_dtype = FP8 if case.fp8_cache else dtype
    caches = tuple(np.asarray(rng.standard_normal((rows, w)), np.float32).astype(cache_dtype)
                   for w in widths)
    return Inputs(normal(t, h, r), normal(t, r), ckv,
                  normal(t, h, case.nope_dim) if case.nope_dim else None,
                  rng.integers(0, case.cfg.max_position, pos_shape).astype(np.int32), slots,
                  caches)


def _attention(case: MlaCase) -> float:
    return case.attention_factor or kernel_constants(case.cfg)[1]


def _rotate64(x, pos, case: MlaCase) -> np.ndarray:
    inv_freq, _ = case.cfg.serving_frequencies()
    slot_pos = pos.astype(np.float64)[:, None]
    if case.cfg.mrope_section:
        # Sectioned M-RoPE: the first s_t frequency slots take the t row, the next s_h
        # the h row, the rest the w row.
        s_t, s_h, _ = case.cfg.mrope_section
        rows = np.repeat([0, 1, 2], [s_t, s_h, len(inv_freq) - s_t - s_h])
        slot_pos = pos[rows].T.astype(np.float64)
    angle = slot_pos * np.asarray(inv_freq, np.float64)[None, :]
    cos, sin = (f(angle) * _attention(case) for f in (np.cos, np.sin))
    x = np.asarray(x, np.float64)
    if x.ndim == 3:
        cos, sin = cos[:, None], sin[:, None]
    half = case.cfg.rotary_dim // 2
    a, b = (x[..., 0::2], x[..., 1::2]) if case.cfg.interleave else (x[..., :half], x[..., half:])
    ra, rb = a * cos - b * sin, b * cos + a * sin
    if case.cfg.interleave:
        return np.stack([ra, rb], axis=-1).reshape(x.shape)
    return np.concatenate([ra, rb], axis=-1)


def _oracle(case: MlaCase, x: Inputs):
    """float64 ``(q_pe_out, q_nope_out, rows written [T] bool, ckv rows [T, L], k_pe rows
    [T, r])``: fp8 outputs as the float64 values rounded to e4m3 once."""
    q_pe = _rotate64(x.q_pe, x.pos, case)
    k_pe = _rotate64(x.k_pe, x.pos, case)
    ckv = np.asarray(x.ckv, np.float64)
    q_nope = None if x.q_nope is None else np.asarray(x.q_nope, np.float64)
    if case.fp8_q:
        q_pe = kv_oracle.e4m3(q_pe * Q_SCALE)
        q_nope = None if q_nope is None else kv_oracle.e4m3(q_nope * Q_SCALE)
    if case.fp8_cache:
        k_pe, ckv = kv_oracle.e4m3(k_pe * KV_SCALE), kv_oracle.e4m3(ckv * KV_SCALE)
    written = (x.slots >= 0) & (x.slots < x.caches[0].shape[0])
    return q_pe, q_nope, written, ckv, k_pe


def _scales(case: MlaCase):
    return jnp.asarray([Q_SCALE if case.fp8_q else 1.0, KV_SCALE if case.fp8_cache else 1.0],
                       jnp.float32)


def _options(case: MlaCase):
    options = kernel_options(case.cfg)
    options["attention_factor"] = _attention(case)
    return dict(options, q_dtype=FP8 if case.fp8_q else None)


def call(impl, case: MlaCase, x: Inputs, **kw):
    tables = jnp.asarray(kernel_constants(case.cfg)[0])
    fn = jax.jit(lambda q_pe, k_pe, ckv, q_nope, pos, slots, caches: impl(
        q_pe, k_pe, ckv, q_nope, pos, slots, tables, _scales(case), caches,
        **_options(case), **kw))
    return fn(x.q_pe, x.k_pe, x.ckv, x.q_nope, x.pos, x.slots, x.caches)


def _close(actual, expected, label: str, dtype) -> None:
    actual = np.asarray(actual)
    if actual.dtype == FP8:
        worst = kv_oracle.ulps(actual, np.asarray(expected, FP8)).max(initial=0)
        assert worst <= 1, f"{label}: {worst} e4m3 ulps from the oracle"
    else:
        error = oracle.relative_error(actual, expected)
        assert error < TOLERANCE[jnp.dtype(dtype).name], f"{label}: relative error {error}"


def check(case: MlaCase, x: Inputs, out) -> None:
    q_pe, q_nope, caches = out
    want_q, want_nope, written, want_ckv, want_kpe = _oracle(case, x)
    assert np.asarray(q_pe).dtype == (FP8 if case.fp8_q else jnp.dtype(case.dtype))
    _close(q_pe, want_q, "q_pe", case.dtype)
    if x.q_nope is None:
        assert q_nope is None
    elif case.fp8_q:
        _close(q_nope, want_nope, "q_nope", case.dtype)
    else:
        np.testing.assert_array_equal(bits(q_nope), bits(x.q_nope), err_msg="q_nope as given")
    L = case.kv_lora_rank
    caches, old = [np.asarray(c) for c in caches], x.caches
    ckv_rows, kpe_rows = ((caches[0][:, :L], caches[0][:, L:]) if case.combined
                          else tuple(caches))
    slots = x.slots[written]
    if case.fp8_cache:
        _close(ckv_rows[slots], want_ckv[written], "ckv rows", case.dtype)
    else:
        np.testing.assert_array_equal(bits(ckv_rows[slots]), bits(x.ckv[written]),
                                      err_msg="ckv copied bit for bit")
    _close(kpe_rows[slots], want_kpe[written], "k_pe rows", case.dtype)
    for new, before in zip(caches, old):
        untouched = np.ones(new.shape[0], bool)
        untouched[slots] = False
        np.testing.assert_array_equal(bits(new[untouched]), bits(before[untouched]),
                                      err_msg="a cache row no token names changed")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_triton_body_matches_the_oracle_in_the_interpreter(case, rng):
    x = make_inputs(rng, case)
    check(case, x, call(mla_triton.mla_rope_append_triton, case, x, interpret=True))


@pytest.mark.parametrize("name, tuning", [
    # Programs walking 4 tokens over 9 (a partial last walk), groups of 1 head, 2 q_nope
    # heads a program.
    ("neox_combined_f32_factor", mla_tuning.MlaTritonTuning(1, 2, 4, token_loop=4)),
    ("neox_pair_fp8_q_nope128", mla_tuning.MlaTritonTuning(2, 1, 4, token_loop=3))])
def test_triton_launch_shapes_cover_every_token_and_head_once(name, tuning, rng):
    case = BY_NAME[name]
    x = make_inputs(rng, case)
    check(case, x, call(mla_triton.mla_rope_append_triton, case, x, interpret=True,
                          tuning=tuning))


@pytest.mark.parametrize("impl", ["triton", pytest.param("mosaic", marks=needs_mosaic)])
def test_no_tokens_returns_the_inputs_and_empty_fp8(impl, rng):
    case = BY_NAME["deepseek_combined_fp8_q_nope512"]
    x = make_inputs(rng, case)
    empty = Inputs(x.q_pe[:0], x.k_pe[:0], x.ckv[:0], x.q_nope[:0], x.pos[:0], x.slots[:0],
                   x.caches)
    fn = (mla_triton.mla_rope_append_triton if impl == "triton"
          else mla_mosaic.mla_rope_append_mosaic)
    q_pe, q_nope, caches = call(fn, case, empty, interpret=True)
    assert q_pe.shape == empty.q_pe.shape and q_pe.dtype == FP8 and q_nope.dtype == FP8
    for a, b in zip(caches, x.caches):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_the_triton_heuristic_splits_deepseek_v3_as_documented():
    # DeepSeek-V3 (H 128, r 64, N 512): q_pe in 8 programs of 16 heads, q_nope in 64 of
    # 2, one row program a token; decode (T 1) shrinks to fill 264 programs.
    prefill = mla_tuning.mla_triton_tuning(4096, 128, 32, 512)
    assert mla_tuning.mla_programs(128, 512, prefill) == (8, 64, 1)
    decode = mla_tuning.mla_triton_tuning(1, 128, 32, 512)
    assert (decode.heads_per_program, decode.groups_per_program) == (1, 1)
    few = mla_tuning.mla_triton_tuning(4096, 4, 32)
    assert few.token_loop == 8 and mla_tuning.mla_programs(4, 0, few) == (1, 0, 1)


def _lower(impl, case: MlaCase, x: Inputs, donate, **kw):
    tables = kernel_constants(case.cfg)[0]  # numpy: no eager JAX op under cuda_target
    fn = jax.jit(lambda q_pe, k_pe, ckv, q_nope, pos, slots, caches: impl(
        q_pe, k_pe, ckv, q_nope, pos, slots, tables, _scales(case), caches,
        **_options(case), **kw), donate_argnums=donate)
    # Shapes only: JAX 0.11 lowers no concrete array under cuda_target's abstract mesh.
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tuple(x))
    return fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", CASES + [FULL], ids=lambda c: c.name)
def test_triton_kernel_lowers_for_cuda_with_q_pe_and_the_caches_aliased(case, rng):
    x = make_inputs(rng, case)
    with cuda_target():
        text = _lower(mla_triton.mla_rope_append_triton, case, x, (0, 6))
    assert "__gpu$xla.gpu.triton" in text and "jaxrope_mla_rope_append" in text
    aliased = len(x.caches) + (0 if case.fp8_q else 1)
    assert len(re.findall(r"tf\.aliasing_output = \d+", text)) == aliased


@needs_mosaic
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_mosaic_body_matches_the_oracle_in_its_interpreter(case, rng):
    x = make_inputs(rng, case)
    check(case, x, call(mla_mosaic.mla_rope_append_mosaic, case, x, interpret=True))


@needs_mosaic
@pytest.mark.parametrize("name, grid, max_count", [("deepseek_pair_bf16", 3, None),
                                                   ("neox_pair_fp8_q_nope128", 5, None),
                                                   ("deepseek_pair_bf16", None, 4)])
def test_mosaic_reads_the_token_count_at_run_time(name, grid, max_count, rng):
    # count=None: a grid of `grid` blocks walks the first n tokens' pieces; q_pe past n
    # and every row not named by those tokens keep their bits. With max_count (the
    # torch launch's shapes) the grid has a block for every piece of max_count tokens and
    # no walk: blocks past the count's items exit.
    case = BY_NAME[name]
    x = make_inputs(rng, case)
    n = case.tokens - 2
    work = mla_tuning.mla_mosaic_tuning(case.heads, case.cfg.rotary_dim, 2,
                                        case.nope_dim if case.fp8_q else 0)
    if max_count is not None:
        grid = max_count * len(work.pieces)
    options = _options(case)
    ilv = case.cfg.interleave
    kernel = mla_mosaic.build_mla(
        heads=case.heads, rotary_dim=case.cfg.rotary_dim, kv_lora_rank=case.kv_lora_rank,
        nope_dim=case.nope_dim if case.fp8_q else 0, itemsize=2,
        interleave=case.cfg.interleave, attention_factor=options["attention_factor"],
        combined=case.combined, quantize_q=case.fp8_q, quantize_kv=case.fp8_cache,
        count=None, grid=grid, max_count=max_count, interpret=True, tuning=work)
    pairs = mla_mosaic._pairs

    def call(q_pe, k_pe, ckv, q_nope, pos, slots, caches):
        outs = ([jax.new_ref(jnp.zeros(pairs(q_pe, ilv).shape, FP8)),
                 jax.new_ref(jnp.zeros(q_nope.shape, FP8))] if case.fp8_q else [])
        q_view = pairs(q_pe, ilv)
        q_in = q_view if case.fp8_q else jax.new_ref(q_view)
        refs = [jax.new_ref(pairs(c[:, None, :], ilv and i == 1)) for i, c in enumerate(caches)]
        kernel(jnp.asarray([n], jnp.int32), pos, slots, kernel_constants(case.cfg)[0],
               mosaic_common.slot_row_table(case.cfg.rotary_dim // 2, None, False),
               _scales(case), q_in, pairs(k_pe[:, None, :], ilv), ckv[:, None, :],
               *((q_nope,) if case.fp8_q else ()), *refs, *outs)
        q = jax.freeze(outs[0] if case.fp8_q else q_in)
        q = q.reshape(q_pe.shape)
        nope = jax.freeze(outs[1]) if case.fp8_q else None
        return q, nope, tuple(jax.freeze(r).reshape(c.shape) for r, c in zip(refs, caches))

    q_pe, q_nope, caches = jax.jit(call)(*(x[:3]), x.q_nope, x.pos, x.slots, x.caches)
    head = Inputs(x.q_pe[:n], x.k_pe[:n], x.ckv[:n], None if x.q_nope is None else x.q_nope[:n],
                  x.pos[:n], x.slots[:n], x.caches)
    check(case, head, (q_pe[:n], None if q_nope is None else q_nope[:n], caches))
    if not case.fp8_q:
        np.testing.assert_array_equal(bits(q_pe[n:]), bits(x.q_pe[n:]))


@needs_mosaic
@needs_lowering
@pytest.mark.parametrize("case", CASES + [FULL], ids=lambda c: c.name)
def test_mosaic_kernel_lowers_for_cuda(case, rng):
    # Off a GPU the Mosaic GPU lowering still runs: a layout it cannot transfer or a
    # broadcast its layouts do not allow fails here.
    x = make_inputs(rng, case)
    text = _lower(mla_mosaic.mla_rope_append_mosaic, case, x, (0, 6), interpret=False)
    assert "mosaic_gpu" in text


@pytest.mark.requires_triton
def test_the_triton_kernel_compiles_to_ptx_for_sm90(tmp_path, rng):
    # Triton's own passes (TTIR -> PTX for sm_90) run on the CPU, at DeepSeek-V3's sizes:
    # the hardware sine/cosine, the saturating e4m3 conversion (fp8 q and cache) and
    # vector stores.
    import triton
    from triton.backends.compiler import GPUTarget
    x = make_inputs(rng, FULL)  # its shapes
    tables = kernel_constants(FULL.cfg)[0]
    block = mla_tuning.mla_triton_tuning(FULL.tokens, FULL.heads, 32, FULL.nope_dim)
    specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tuple(x))
    [ttir] = triton_modules(lambda *a: mla_triton.mla_rope_append_triton(
        *a[:6], tables, _scales(FULL), a[6], **_options(FULL), tuning=block), *specs)
    path = tmp_path / "kernel.ttir"
    path.write_text(ttir)
    ptx = triton.compile(str(path), target=GPUTarget("cuda", 90, 32), options={
        "num_warps": block.num_warps, "num_stages": block.num_stages}).asm["ptx"]
    assert "sin.approx.f32" in ptx and "cos.approx.f32" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert re.search(r"st\.global\.v[24]", ptx), "rows should be stored in vectors"


def test_an_fp8_q_nope_of_2_to_4_gib_is_declined():
    # JAX's Triton lowering would address it with wrapping int32 offsets: the kernel
    # declines (BackendUnavailable), so "auto" takes XLA. Shapes only, nothing allocated.
    sds = jax.ShapeDtypeStruct
    tokens, heads = 3 << 14, 128   # q_nope_out: 3 * 2**30 bytes of fp8
    args = (sds((tokens, heads, 64), jnp.bfloat16), sds((tokens, 64), jnp.bfloat16),
            sds((tokens, 512), jnp.bfloat16), sds((tokens, heads, 512), jnp.bfloat16),
            sds((tokens,), jnp.int32), sds((tokens,), jnp.int32), sds((3, 32), jnp.float32),
            sds((2,), jnp.float32), (sds((64, 576), jnp.bfloat16),))
    with pytest.raises(jr.BackendUnavailable, match="the fp8 q_nope"):
        jax.eval_shape(lambda *a: mla_triton.mla_rope_append_triton(
            *a, **dict(_options(FULL), q_dtype=FP8)), *args)


def _gpu_backend(impl: str):
    # The implementation to compile on this machine's GPU, or a skip saying why not.
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError as e:
        pytest.skip(f"JAX has no GPU backend ({e}); run with JAXROPE_GPU_TESTS=1 and jax[cuda]")
    if impl == "triton":
        return mla_triton.mla_rope_append_triton
    capability = getattr(device, "compute_capability", None) or "0"
    if LOWERING or int(capability.split(".")[0]) < 9:
        pytest.skip(f"Mosaic GPU on {device.device_kind} ({capability}): {LOWERING or 'needs 9.0'}")
    return mla_mosaic.mla_rope_append_mosaic


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
@pytest.mark.parametrize("tokens", [1, 17, 4099])
@pytest.mark.parametrize("case", CASES + [FULL], ids=lambda c: c.name)
def test_the_compiled_kernel_matches_the_oracle_on_the_gpu(case, tokens, impl, rng):
    # The GPU suite (bench/gpu_suite.sh, -m gpu) runs these: the kernels compiled, the
    # hardware sine and cosine, at decode, odd and prefill sizes.
    fn = _gpu_backend(impl)
    case = case._replace(tokens=tokens)
    x = make_inputs(rng, case)
    check(case, x, call(fn, case, x))
