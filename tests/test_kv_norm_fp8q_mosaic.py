"""The Mosaic GPU append kernel's per-head QK-norm and fp8 q, in Mosaic GPU's interpreter
(CPU) against the float64 oracle and the XLA reference, and its CUDA lowering.

- Per-head norms (Qwen3's "rmsnorm", Gemma 3's "gemma") of q, of k or of both, over
  each head's whole ``D`` (q's and k's dims past ``rotary_dim`` too), then RoPE, one
  rounding: Qwen3-like heads split into pieces, full and partial rotary (whose two
  partial sums meet through SMEM), GPT-J pairs, M-RoPE, a float32 case of odd head
  counts, head_dim 512 (a head's sum across the warps).
- fp8 q (``q_dtype=float8_e4m3fn``): every dim of q scaled by ``scales[2]`` and
  saturated, within an e4m3 ulp of the oracle and of the reference's float32 q
  quantized; with fp8 and bf16 caches; padding slots write nothing.
- Norm weights in another dtype than q's, widened in the kernel.
- ``qk_norm.per_head=False`` is refused with its reason.
- The launch's form (a run-time count, the fp8 q's buffer an operand) writes its tokens
  only; the export for the torch launch takes the weights and the fp8 q's buffer.

Skipped with the reason on JAX 0.10 (no mutable refs, no GPU interpreter).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import APPEND_BY_NAME, AppendCase
from jaxrope.ops import mosaic_common
from jaxrope.ops.constants import kernel_constants, kernel_options
from jaxrope.ops.rope_append_kv import api as kv_api
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.ops.rope_append_kv import mosaic as mosaic_append
from jaxrope.ops.rope_append_kv import mosaic_export as append_mosaic_export
from jaxrope.ops.rope_append_kv import tuning as append_tuning
from jaxrope.ops.rope_append_kv.reference import FP8, rope_append_kv_reference, to_cache_dtype
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_inputs import make_inputs
from jaxrope.testing.kv_oracle import bits
from test_qk_norm import _norm_oracle, _weight

MISSING = mosaic_common.unavailable()
needs_mosaic = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
LOWERING = mosaic_common.lowering_unavailable()
needs_lowering = pytest.mark.skipif(LOWERING is not None, reason=str(LOWERING))
QWEN3 = jr.QKNorm(eps=1e-6)
GEMMA = jr.QKNorm(eps=1e-6, convention="gemma")
# k, v, q: q's scale small enough that q's largest values saturate at 448 only rarely.
SCALES = (0.75, 150.0, 40.0)


class Norm(NamedTuple):
    """Which of q and k a case normalises, by which convention; and whether q is fp8."""

    qk_norm: Optional[jr.QKNorm]
    q: bool
    k: bool
    q_fp8: bool


# Gemma 3's shape (8 q heads over one k head, head_dim 256), proportional RoPE: a k
# head's 128-wide halves spread over the four warps, whose sums meet through SMEM.
GEMMA_3 = AppendCase("gemma_proportional_nhd", "gemma_proportional", padding=2)
# The interpreter takes seconds a case: four cover Qwen3 with fp8 q and cache, Gemma 3,
# partial rotary in GPT-J pairs with M-RoPE, and float32 with odd head counts in CI; the
# rest run with --run-slow (every case lowers in CI).
CASES = [
    (APPEND_BY_NAME["llama3_fp8_nhd"], jnp.bfloat16, Norm(QWEN3, True, True, True)),
    (GEMMA_3, jnp.bfloat16, Norm(GEMMA, True, True, True)),
    (APPEND_BY_NAME["glm41v_pairs_fp8_hnd"], jnp.bfloat16, Norm(GEMMA, True, True, True)),
    (APPEND_BY_NAME["mrope_interleaved_d80_nhd_combined"], jnp.float32,
     Norm(QWEN3, True, True, False)),
]
SLOW_CASES = [
    (APPEND_BY_NAME["llama3_nhd_p16"], jnp.bfloat16, Norm(QWEN3, True, True, False)),
    (APPEND_BY_NAME["head_dim_512_hnd"], jnp.bfloat16, Norm(GEMMA, True, True, False)),
    (APPEND_BY_NAME["partial_half_fp8_hnd_combined"], jnp.bfloat16, Norm(QWEN3, True, True, True)),
    (APPEND_BY_NAME["gptj_interleave_hnd_combined"], jnp.bfloat16, Norm(QWEN3, True, False, False)),
    (APPEND_BY_NAME["qwen3_vl_interleaved_hnd_combined"], jnp.bfloat16,
     Norm(QWEN3, False, True, True)),
    (APPEND_BY_NAME["neox_quarter_nhd_combined"], jnp.float16, Norm(None, False, False, True)),
]


def _ids(x):
    if isinstance(x, Norm):
        convention = x.qk_norm.convention if x.qk_norm else "none"
        return f"{convention}-q{int(x.q)}k{int(x.k)}-{'fp8q' if x.q_fp8 else 'q'}"
    return getattr(x, "name", None) or jnp.dtype(x).name


def _weights(rng, norm: Norm, x):
    """The q and k norm weights ``[D]`` a case asks for (None where it does not), in
    another dtype than q's each where there is one: the kernel widens what it reads."""
    head_dim = x.q.shape[-1]
    others = [d for d in (jnp.float32, jnp.bfloat16, jnp.float16) if d != x.q.dtype]
    return tuple(_weight(rng, norm.qk_norm, 1, head_dim, dtype) if asked else None
                 for asked, dtype in zip((norm.q, norm.k), others))


def _args(x, case, weights, norm: Norm):
    """The kernel's arguments as ``apply_rope_and_append_kv`` builds them (``scales [3]``)."""
    caches, combined, rows = kv_api._caches(x.kv_cache, case.layout, x.k)
    tables, _ = kernel_constants(case.case.cfg)
    args = (x.q, x.k, x.v, jnp.asarray(x.pos), jnp.asarray(x.slots), jnp.asarray(tables),
            jnp.asarray(SCALES, jnp.float32), tuple(c.reshape(-1, c.shape[-1]) for c in caches))
    options = dict(rows=rows, **kernel_options(case.case.cfg), q_norm_weight=weights[0],
                   k_norm_weight=weights[1], qk_norm=norm.qk_norm)
    return args, options, caches, combined


def _mosaic(x, case, weights, norm: Norm, interpret: bool = True):
    args, options, caches, combined = _args(x, case, weights, norm)
    fn = jax.jit(lambda *a: mosaic_append.rope_append_kv_mosaic(
        *a, interpret=interpret, q_dtype=FP8 if norm.q_fp8 else None, **options))
    if not interpret:
        return fn.trace(*args).lower(lowering_platforms=("cuda",))
    q, views = fn(*args)
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return q, written[0] if combined else written


def _reference(x, case, weights, norm: Norm):
    """The XLA reference's (q, kv_cache); an fp8 q is its float32 q (from q widened, so
    the one rounding is the quantization) through ``to_cache_dtype``."""
    args, options, caches, combined = _args(x, case, weights, norm)
    if norm.q_fp8:
        args = (x.q.astype(jnp.float32),) + args[1:]
    q, views = jax.jit(lambda *a: rope_append_kv_reference(*a, **options))(*args)
    if norm.q_fp8:
        q = to_cache_dtype(q, SCALES[2], FP8)
    written = tuple(view.reshape(c.shape) for view, c in zip(views, caches))
    return q, written[0] if combined else written


def _want(x, case, weights, norm: Norm):
    """float64 oracle ``(q, k)``: normalised where asked, then rotated; dims past
    ``rotary_dim`` normalised too (as they are without a norm)."""
    cfg = case.case.cfg
    q, k = (x_in if w is None else _norm_oracle(x_in, w, norm.qk_norm)
            for x_in, w in ((x.q, weights[0]), (x.k, weights[1])))
    return oracle.rope_of(cfg, q, x.pos), oracle.rope_of(cfg, k, x.pos)


def _check_against_oracle(case, x, out, weights, norm: Norm, tolerance: float) -> None:
    q_out, kv_out = out
    assert isinstance(kv_out, tuple) != case.combined
    q_want, k_want = _want(x, case, weights, norm)
    new, old = kv_oracle.split(kv_out), kv_oracle.split(x.kv_cache)
    written, page, entry = kv_oracle.entries(x.slots, len(old[0]), case.page_size)
    assert written.sum() == len(x.slots) - case.padding
    page, entry = page[written], entry[written]
    k_rows, v_rows = (kv_oracle.rows(c, case.layout, page, entry) for c in new)
    actual, expected = [], []
    if norm.q_fp8:
        assert q_out.dtype == FP8 and q_out.shape == x.q.shape
        worst = kv_oracle.ulps(np.asarray(q_out), kv_oracle.e4m3(q_want * SCALES[2]))
        assert worst.max() <= 1, f"fp8 q: {worst.max()} e4m3 ulps from the oracle"
    else:
        assert q_out.dtype == x.q.dtype
        if not norm.q:
            rotary = case.case.cfg.rotary_dim
            np.testing.assert_array_equal(bits(q_out)[..., rotary:], bits(x.q)[..., rotary:])
        actual.append(np.asarray(q_out, np.float64).ravel())
        expected.append(q_want.ravel())
    if case.fp8:
        v_want = kv_oracle.e4m3(np.asarray(x.v, np.float64)[written] * SCALES[1])
        for label, got, want in (("k", k_rows, kv_oracle.e4m3(k_want[written] * SCALES[0])),
                                 ("v", v_rows, v_want)):
            worst = kv_oracle.ulps(got, want).max(initial=0)
            assert worst <= 1, f"{label} rows: {worst} e4m3 ulps from the oracle"
    else:
        np.testing.assert_array_equal(bits(v_rows), bits(x.v)[written], err_msg="v rows")
        actual.append(k_rows.astype(np.float64).ravel())
        expected.append(k_want[written].ravel())
    if actual:
        error = oracle.relative_error(np.concatenate(actual), np.concatenate(expected))
        assert error < tolerance, f"relative error {error:.3g}"
    for name, n, o in zip(("k_cache", "v_cache"), new, old):
        kv_oracle.assert_untouched(name, n, o, kv_oracle.written_mask(n.shape, case.layout, page,
                                                                      entry))


@needs_mosaic
@pytest.mark.parametrize("case, dtype, norm", CASES + [
    pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES], ids=_ids)
def test_norm_and_fp8_q_match_the_oracle_and_the_reference_in_the_interpreter(case, dtype, norm,
                                                                                rng):
    x = make_inputs(rng, case, dtype)
    weights = _weights(rng, norm, x)
    out = _mosaic(x, case, weights, norm)
    _check_against_oracle(case, x, out, weights, norm,
                          oracle.RELATIVE_TOLERANCE[jnp.dtype(dtype).name])
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(_reference(x, case, weights, norm))):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == FP8:
            assert kv_oracle.ulps(a, b).max(initial=0) <= 1
        else:
            # XLA's sum of squares adds in another order than the kernel's, and divides by
            # D where the kernel multiplies by 1 / D: the norm's factor may differ by an ulp
            # or two, then the rotation rounds as tests/test_kv_mosaic_interpret.py allows.
            assert kv_oracle.row_ulps(a, b).max(initial=0) <= 4


@needs_mosaic
def test_a_run_time_count_normalises_and_quantizes_its_tokens_only(rng):
    # The launch's kernel (count=None, the fp8 q's buffer an operand after the caches): a
    # grid of 3 blocks walks the count's blocks of 2 tokens, each forming its angle and
    # exchanging its partial sums again; q_out past the count and the cache rows of the
    # slots past it keep what they held.
    case = APPEND_BY_NAME["partial_half_fp8_hnd_combined"]
    x = make_inputs(rng, case, jnp.bfloat16)
    n, norm = 11, Norm(QWEN3, True, True, True)
    weights = _weights(rng, norm, x)
    cfg = case.case.cfg
    caches, _, rows = kv_api._caches(x.kv_cache, case.layout, x.k)
    tables, attention = kernel_constants(cfg)
    tuning = append_tuning.append_mosaic_tuning(32, 8, 128, 64, 2, tokens_per_block=2,
                                                q_width=128)
    kernel = mosaic_append.build_append(
        q_heads=32, k_heads=8, head_dim=128, itemsize=2, rotary_dim=64, interleave=False,
        attention_factor=attention, rows=rows, quantize=True, grid=3 * len(tuning.pieces),
        interpret=True, tuning=tuning, qk_norm=QWEN3, norm_q=True, norm_k=True, q_dtype=FP8)
    q_old = jnp.asarray(rng.standard_normal(x.q.shape), jnp.float32).astype(FP8)

    def call(q, k, v, q_w, k_w, cache, q_out):
        cache_ref = jax.new_ref(mosaic_append.cache_view(cache.reshape(-1, 128), rows, 8, False))
        q_out_ref = jax.new_ref(q_out)
        kernel(jnp.asarray([n], jnp.int32), jnp.asarray(x.pos), jnp.asarray(x.slots),
               jnp.asarray(tables), mosaic_common.slot_row_table(32, None, False),
               jnp.asarray(SCALES, jnp.float32), q, k, v, q_w, k_w, cache_ref, q_out_ref)
        return jax.freeze(q_out_ref), jax.freeze(cache_ref).reshape(cache.shape)

    q_out, cache = jax.jit(call)(x.q, x.k, x.v, *weights, caches[0], q_old)
    np.testing.assert_array_equal(bits(q_out)[n:], bits(q_old)[n:])
    first = dataclasses.replace(x, q=x.q[:n], k=x.k[:n], v=x.v[:n], pos=x.pos[:n],
                                slots=x.slots[:n])
    case = dataclasses.replace(case, padding=int((first.slots < 0).sum()))
    _check_against_oracle(case, first, (q_out[:n], cache), weights, norm,
                          oracle.RELATIVE_TOLERANCE["bfloat16"])


@needs_mosaic
def test_a_per_token_norm_is_refused_with_its_reason(rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    olmo2 = jr.QKNorm(eps=1e-5, per_head=False)
    weights = (jnp.ones(32 * 128, jnp.float32), None)
    with pytest.raises(NotImplementedError, match="per_head=False .* a subset of a token's heads"):
        _mosaic(x, case, weights, Norm(olmo2, True, False, False))


@needs_mosaic
def test_an_fp8_q_needs_three_scales_and_a_known_q_dtype(rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_inputs(rng, case, jnp.bfloat16)
    args, options, _, _ = _args(x, case, (None, None), Norm(None, False, False, True))
    two = args[:6] + (jnp.ones(2, jnp.float32),) + args[7:]
    with pytest.raises(ValueError, match=r"scales.shape=\(2,\) must be \(3,\)"):
        mosaic_append.rope_append_kv_mosaic(*two, q_dtype=FP8, interpret=True, **options)
    with pytest.raises(ValueError, match="q_dtype=float16 must be None"):
        mosaic_append.rope_append_kv_mosaic(*args, q_dtype=jnp.float16, interpret=True,
                                            **options)


@needs_mosaic
@needs_lowering
@pytest.mark.parametrize("case, dtype, norm", CASES + SLOW_CASES, ids=_ids)
def test_norm_and_fp8_q_lower_for_cuda(case, dtype, norm, rng):
    # Off a GPU the Mosaic GPU lowering still runs: a reduction, broadcast or SMEM
    # transfer its layouts do not allow fails here (the interpreter does not check them).
    x = make_inputs(rng, case, dtype)
    text = _mosaic(x, case, _weights(rng, norm, x), norm, interpret=False).as_text()
    assert "mosaic_gpu" in text


@needs_mosaic
@needs_lowering
@pytest.mark.parametrize("q_fp8", [False, True], ids=["q", "fp8q"])
@pytest.mark.parametrize("combined", [False, True], ids=["pair", "combined"])
def test_the_export_takes_the_norm_weights_and_the_fp8_q_buffer(q_fp8, combined):
    # What torch_bridge.launch.mosaic.MosaicKVLauncher compiles for a normalised call:
    # the weights after v, the caches and (fp8) q_out aliased to the results, q not.
    cfg = jr.RopeConfig(head_dim=128, rotary_dim=64)
    rows = cache_layout.cache_rows("NHD", combined, 8, 16, 8)
    exported = append_mosaic_export.export_append(
        q_heads=32, k_heads=8, head_dim=128, dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16,
        rows=rows, components=1 if combined else 2,
        tuning=append_tuning.append_mosaic_tuning(32, 8, 128, 64, 2), capacity=1 << 16, grid=64,
        qk_norm=GEMMA, q_weight_dtype=jnp.bfloat16, k_weight_dtype=jnp.float32,
        q_dtype=jnp.float8_e4m3fn if q_fp8 else None, **kernel_options(cfg))
    assert exported.module.startswith(b"ML\xefR")
    assert exported.results == 1 + (1 if combined else 2)
