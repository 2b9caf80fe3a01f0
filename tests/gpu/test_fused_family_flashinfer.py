"""Issue 46's fused family on the GPU against FlashInfer 0.5.3, on the same inputs.

Each case of ``jaxrope.cases.FUSED_CASES`` (Qwen3-8B's and DeepSeek-V3's shapes) runs
on a ragged batch (1 to 204 tokens appended to 0 to 1023 cached ones, rope positions on
bases up to ~2**20, pages of 16 drawn at random, plus padding tokens at slot -1 that
FlashInfer never sees) through our op on every backend (jitted, q and the caches
donated) and through FlashInfer's calls for the same step
(``jaxrope.testing.fused_family.flashinfer_step``). What "equal" means, per part:

- (a) QK-norm + RoPE + append, bf16 (``qwen3_8b_norm_bf16`` against ``rmsnorm(q)`` +
  ``rmsnorm(k)`` + ``apply_rope_pos_ids_inplace`` + ``append_paged_kv_cache``): NOT
  bit-exact. FlashInfer rounds the norm's output to bf16 before rotating it and takes its
  angle from fast-math intrinsics; we round once. Each side is held to its own float64
  bound (``jaxrope.testing.flashinfer_bounds``: ours from the exact norm, with a float32
  norm term; FlashInfer's from its own bf16 norm output), the two to the sum of both
  bounds plus the exact gap between the two oracles (triangle inequality). A
  disagreement is a failure below position 2**12 and a warning above, where FlashInfer's
  angle drifts (as in ``test_flashinfer_parity.py``). v rows: bit-exact (a copy).
- (b) fp8 q, k, v (``qwen3_8b_fp8`` against ``rope_quantize_fp8_append_paged_kv_cache``):
  q and the k rows within one e4m3 ulp of FlashInfer's and identical on > 99% of
  elements (both round a float32 rotation once; FlashInfer's cos/sin table and our
  angle differ in the last float32 bits), and within one e4m3 ulp of the float64 value
  quantised; v rows bit-exact (the same float32 product ``v * scale``, rounded once).
- (c) MLA bf16 (``deepseek_v3_mla_bf16``, its YaRN replaced by linear scaling, which
  ``apply_rope_pos_ids_inplace`` can express, against that + ``append_paged_mla_kv_cache``):
  q_pe and the k_pe rows within FlashInfer's position-dependent parity bound
  (``flashinfer_bounds.Reference``); ckv rows bit-exact (a copy).
- (d) MLA fp8 (``deepseek_v3_mla_fp8``, DeepSeek-V3's own YaRN, against the fused fp8 op
  in MLA mode with a float32 table from the same frequencies): q_pe and the k_pe rows as
  (b); q_nope and the ckv rows bit-exact (one rounding of the same float32 product).

Every cache entry no token names (padding included) keeps its bits on both sides.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrope import cases
from jaxrope.scaling import Linear
from jaxrope.testing import flashinfer as fp
from jaxrope.testing import flashinfer_bounds as fb
from jaxrope.testing import flashinfer_kv, kv_oracle, oracle
from jaxrope.testing import fused_family as ff

pytestmark = pytest.mark.gpu

BACKENDS = ("xla", "triton", "mosaic")
BF16 = fp.DTYPE["bfloat16"]
# The float32 norm before the rotation, relative to the pair's radius: the sum of D
# squares (D roundings), rsqrt and the two products (4 more). D = 128 here.
NORM_SLACK = (128 + 4) * fb.E


@dataclasses.dataclass
class Setup:
    case: cases.FusedCase
    batch: flashinfer_kv.PagedBatch
    x: dict          # numpy inputs, PADDING rows past the first `tokens`
    pos: np.ndarray  # int32 [tokens + PADDING]
    slots: np.ndarray
    old: tuple       # the caches before the append
    tokens: int


def _setup(case: cases.FusedCase, seed: int) -> Setup:
    rng = np.random.default_rng(seed)
    s = case.page_size
    pages = 2 * sum(-(-(c + a) // s) for c, a in zip(flashinfer_kv.CACHED,
                                                      flashinfer_kv.APPEND)) + 3
    batch = flashinfer_kv.paged_batch(rng, flashinfer_kv.APPEND, flashinfer_kv.CACHED, pages, s)
    bases = rng.choice(flashinfer_kv.BASES, len(flashinfer_kv.APPEND))
    pos = (bases[batch.batch_indices] + batch.positions).astype(np.int32)
    t, pad = len(pos), flashinfer_kv.PADDING
    x = ff.random_inputs(rng, case, t + pad, BF16)
    if case.fp8:  # every fifth token saturates once scaled
        x["k"][::5] *= 400
        x["v"][::5] *= 400
    dtype = kv_oracle.E4M3 if case.fp8 else BF16
    old = tuple(rng.standard_normal(shape).astype(dtype)
                for shape in ff.cache_shapes(case, pages))
    return Setup(case, batch, x, np.concatenate([pos, np.zeros(pad, np.int32)]),
                 np.concatenate([batch.slots, np.full(pad, -1, np.int32)]), old, t)


def _ours(s: Setup, backend: str):
    """Our op on ``backend``, jitted, q (when rotated in place) and the caches donated."""
    call = ff.ours(s.case, backend)
    donate = (8,) if s.case.fp8 else (0, 8)
    x = {name: jnp.asarray(a) for name, a in s.x.items()}
    q_out, nope_out, caches = jax.jit(call, donate_argnums=donate)(
        x["q"], x["k"], x["v"], x.get("q_nope"), x.get("wq"), x.get("wk"), jnp.asarray(s.pos),
        jnp.asarray(s.slots), tuple(jnp.asarray(c) for c in s.old))
    nope = None if nope_out is None else np.asarray(nope_out)[:s.tokens]
    return np.asarray(q_out)[:s.tokens], nope, tuple(np.asarray(c) for c in caches)


def _flashinfer(s: Setup):
    """FlashInfer's step on copies of the first ``tokens`` rows: numpy outputs."""
    import torch
    dev = torch.device(fp.FLASHINFER_DEVICE)
    t = s.tokens
    tensors = {name: flashinfer_kv.to_torch(a if name in ("wq", "wk") else a[:t], dev)
               for name, a in s.x.items()}
    tensors["caches"] = tuple(flashinfer_kv.to_torch(c, dev) for c in s.old)
    tensors["pos"] = flashinfer_kv.to_torch(s.pos[:t], dev)
    step, out = ff.flashinfer_step(s.case, tensors, s.pos[:t], s.batch)
    step()
    torch.cuda.synchronize()
    q = flashinfer_kv.from_torch(out["q"], BF16)
    nope = flashinfer_kv.from_torch(out["q_nope"], None) if "q_nope" in out else None
    return q, nope, tuple(flashinfer_kv.from_torch(c, c_old.dtype)
                          for c, c_old in zip(out["caches"], s.old))


def _rows(s: Setup, cache: np.ndarray) -> np.ndarray:
    """The cache rows the real tokens went to: ``[T, Hk, D]`` (GQA) or ``[T, width]``."""
    written, page, entry = kv_oracle.entries(s.batch.slots, cache.shape[0], s.case.page_size)
    assert written.all(), "every real token has a slot"
    return cache[page, entry]


def _assert_untouched(s: Setup, label: str, new: tuple) -> None:
    for i, (cache, prev) in enumerate(zip(new, s.old)):
        _, page, entry = kv_oracle.entries(s.batch.slots, prev.shape[0], s.case.page_size)
        mask = np.zeros(prev.shape, bool)
        mask[page, entry] = True
        kv_oracle.assert_untouched(f"{label} cache {i}", cache, prev, mask)


def _backend(backend: str, request) -> str:
    if backend == "mosaic":
        request.getfixturevalue("hopper")
    return backend


def _case(name: str) -> cases.FusedCase:
    case = cases.FUSED_BY_NAME[name]
    missing = ff.unavailable(case)
    if missing:
        pytest.skip(missing)
    return case


# -- (a) QK-norm + RoPE + append, bf16 --------------------------------------------------

def _norm64(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def _flashinfer_norm(s: Setup, name: str, weight: str) -> np.ndarray:
    """FlashInfer's rmsnorm output (bf16) of input ``name``'s real tokens."""
    import flashinfer
    import torch
    dev = torch.device(fp.FLASHINFER_DEVICE)
    out = flashinfer.rmsnorm(flashinfer_kv.to_torch(s.x[name][:s.tokens], dev),
                             flashinfer_kv.to_torch(s.x[weight], dev), s.case.qk_norm.eps)
    torch.cuda.synchronize()
    return flashinfer_kv.from_torch(out, BF16)


def _check_normed(label: str, s: Setup, ours: np.ndarray, theirs: np.ndarray,
                  exact_in: np.ndarray, their_in: np.ndarray, record) -> None:
    """(a)'s comparison: each side against its own float64 oracle, then each other."""
    cfg, pos = s.case.cfg, s.pos[:s.tokens]
    r, inter = cfg.rotary_dim, cfg.interleave
    ref_ours = fb.Reference(cfg, "pos_ids", "bfloat16", exact_in, pos)
    ref_fi = fb.Reference(cfg, "pos_ids", "bfloat16", their_in, pos)
    radius = np.hypot(*np.moveaxis(fb.pairs(exact_in, r, inter), -1, 0))[..., None]
    bound_ours = ref_ours.bound_ours + radius * NORM_SLACK
    got_ours, got_fi = fb.pairs(ours, r, inter), fb.pairs(theirs, r, inter)
    c_ours = fb.compare(f"{label} jaxrope vs float64", got_ours, ref_ours.expected, bound_ours, pos)
    c_fi = fb.compare(f"{label} FlashInfer vs float64", got_fi, ref_fi.expected,
                      ref_fi.bound_flashinfer, pos)
    gap = np.abs(ref_ours.expected - ref_fi.expected)
    c_par = fb.compare(f"{label} jaxrope vs FlashInfer", got_ours, got_fi,
                       bound_ours + ref_fi.bound_flashinfer + gap, pos)
    record(f"{label} jaxrope_err_over_bound", round(c_ours.worst_ratio, 4))
    record(f"{label} flashinfer_err_over_bound", round(c_fi.worst_ratio, 4))
    record(f"{label} within one bf16 ulp of FlashInfer",
           float((kv_oracle.ulps(ours, theirs) <= 1).mean()))
    assert not c_ours.violations, str(c_ours)
    assert oracle.relative_error(ours, oracle.rope_of(cfg, exact_in, pos)) <= \
        oracle.RELATIVE_TOLERANCE["bfloat16"]
    if c_par.violations:
        off = np.abs(got_ours - got_fi) > bound_ours + ref_fi.bound_flashinfer + gap
        tokens = np.nonzero(off.reshape(off.shape[0], -1).any(axis=1))[0]
        low = pos[tokens].min()
        assert low >= fb.DRIFT_FREE_POSITION, (
            f"jaxrope and FlashInfer disagree at position {low}, below FlashInfer's drift: "
            f"{c_par}; {c_fi}")
        warnings.warn(f"{label}: FlashInfer outside its fast-math bound at high positions "
                      f"({c_fi}); ours within its own ({c_ours})")


@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_rope_append_matches_flashinfers_chain(backend, request, device, flashinfer,
                                                    record_property):
    case = _case("qwen3_8b_norm_bf16")
    s = _setup(case, 4600)
    t = s.tokens
    ours_q, _, (ours_k, ours_v) = _ours(s, _backend(backend, request))
    fi_q, _, (fi_k, fi_v) = _flashinfer(s)
    eps = case.qk_norm.eps
    for label, got, theirs, name, weight in (("q", ours_q, fi_q, "q", "wq"),
                                             ("k rows", _rows(s, ours_k), _rows(s, fi_k), "k",
                                              "wk")):
        _check_normed(f"{label} {backend}", s, got, theirs,
                      _norm64(s.x[name][:t], s.x[weight], eps),
                      _flashinfer_norm(s, name, weight), record_property)
    np.testing.assert_array_equal(kv_oracle.bits(_rows(s, ours_v)), kv_oracle.bits(s.x["v"][:t]))
    np.testing.assert_array_equal(kv_oracle.bits(ours_v), kv_oracle.bits(fi_v))
    for label, new in (("jaxrope", (ours_k, ours_v)), ("FlashInfer", (fi_k, fi_v))):
        _assert_untouched(s, f"{backend} {label}", new)


# -- (b), (d) fp8 -----------------------------------------------------------------------

def _check_fp8(label: str, ours: np.ndarray, theirs: np.ndarray, exact: np.ndarray,
               scale: float, record) -> None:
    """Within one e4m3 ulp of FlashInfer's, identical on > 99%, and within one ulp of
    the float64 value ``exact * scale`` quantised."""
    distance = kv_oracle.ulps(ours, theirs)
    record(f"{label} identical to FlashInfer", float((distance == 0).mean()))
    assert distance.max() <= 1, f"{label}: {distance.max()} e4m3 ulps from FlashInfer"
    assert (distance == 0).mean() > 0.99, f"{label}: {(distance == 0).mean():.4f} identical"
    to_oracle = kv_oracle.ulps(ours, kv_oracle.e4m3(exact * scale))
    assert to_oracle.max() <= 1, f"{label}: {to_oracle.max()} e4m3 ulps from float64"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["qwen3_8b_fp8", "deepseek_v3_mla_fp8"])
def test_fp8_matches_flashinfers_fused_fp8_op(name, backend, request, device, flashinfer,
                                              record_property):
    """(b) GQA and (d) MLA: the caches are (k, v) and (ckv, kpe); the rotated k's is
    ``rotated``, the copied one's (v, ckv) the other."""
    case = _case(name)
    s = _setup(case, 4601 if name == "qwen3_8b_fp8" else 4602)
    t, pos = s.tokens, s.pos[:s.tokens]
    ours_q, ours_nope, ours_caches = _ours(s, _backend(backend, request))
    fi_q, fi_nope, fi_caches = _flashinfer(s)
    rotated, copied = (1, 0) if case.mla else (0, 1)
    assert (np.abs(_rows(s, fi_caches[rotated]).astype(np.float32)) == 448).any(), \
        "the case should saturate"
    _check_fp8(f"q {backend}", ours_q, fi_q, oracle.rope_of(case.cfg, s.x["q"][:t], pos),
               ff.Q_SCALE, record_property)
    # MLA's k_pe [T, r] as one head for the oracle.
    k_exact = (oracle.rope_of(case.cfg, s.x["k"][:t, None, :], pos)[:, 0] if case.mla
               else oracle.rope_of(case.cfg, s.x["k"][:t], pos))
    _check_fp8(f"k-rows {backend}", _rows(s, ours_caches[rotated]), _rows(s, fi_caches[rotated]),
               k_exact, ff.KV_SCALE, record_property)
    np.testing.assert_array_equal(kv_oracle.bits(ours_caches[copied]),
                                  kv_oracle.bits(fi_caches[copied]))
    if case.mla:
        np.testing.assert_array_equal(kv_oracle.bits(ours_nope), kv_oracle.bits(fi_nope))
    for label, new in (("jaxrope", ours_caches), ("FlashInfer", fi_caches)):
        _assert_untouched(s, f"{backend} {label}", new)


# -- (c) MLA bf16 -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_bf16_matches_flashinfers_rope_then_mla_append(backend, request, device, flashinfer,
                                                           record_property):
    real = _case("deepseek_v3_mla_bf16")
    # apply_rope_pos_ids_inplace has rope_scale and rope_theta only: linear scaling.
    case = dataclasses.replace(real, cfg=dataclasses.replace(real.cfg, scaling=Linear(2.0)))
    s = _setup(case, 4603)
    t, pos = s.tokens, s.pos[:s.tokens]
    ours_q, ours_nope, (ours_ckv, ours_kpe) = _ours(s, _backend(backend, request))
    assert ours_nope is None
    fi_q, _, (fi_ckv, fi_kpe) = _flashinfer(s)
    for label, x, got, theirs in (
            ("q_pe", s.x["q"][:t], ours_q, fi_q),
            ("k_pe rows", s.x["k"][:t, None, :], _rows(s, ours_kpe)[:, None, :],
             _rows(s, fi_kpe)[:, None, :])):
        ref = fb.Reference(case.cfg, "pos_ids", "bfloat16", x, pos)
        verdict = ref.check(got, theirs, f"{label} {backend}")
        record_property(f"{label} {backend} jaxrope_err_over_bound",
                        round(verdict.ours_vs_oracle.worst_ratio, 4))
        assert not verdict.failures, "\n".join(verdict.failures + [verdict.summary()])
        fb.warn_disagreements(verdict, f"{case.name} {label} {backend}")
    np.testing.assert_array_equal(kv_oracle.bits(_rows(s, ours_ckv)), kv_oracle.bits(s.x["v"][:t]))
    np.testing.assert_array_equal(kv_oracle.bits(ours_ckv), kv_oracle.bits(fi_ckv))
    for label, new in (("jaxrope", (ours_ckv, ours_kpe)), ("FlashInfer", (fi_ckv, fi_kpe))):
        _assert_untouched(s, f"{backend} {label}", new)
