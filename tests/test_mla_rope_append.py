"""``jaxrope.apply_mla_rope_and_append`` (DeepSeek's MLA) against a float64 oracle.

The oracle rotates with DeepSeek-V3's own apply function from transformers
(``apply_rotary_pos_emb_interleave``, in float64, its de-interleaved output put back in
pairs) at the float64 YaRN frequencies of :mod:`jaxrope.testing.oracle`, which a test
here checks against transformers' ``DeepseekV3RotaryEmbedding``; without transformers
(allowed unless JAXROPE_REQUIRE_TRANSFORMERS=1) it is :func:`jaxrope.testing.oracle.rope_of`.
Caches are small (a few pages of ``L + r`` columns) so the suite runs in seconds on CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import json
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import backends as backend_module
from jaxrope.ops.mla_rope_append.reference import mla_rope_append_reference
from jaxrope.testing import kv_oracle, oracle
from jaxrope.testing.kv_oracle import bits

REQUIRE_ENV = "JAXROPE_REQUIRE_TRANSFORMERS"
DATA = os.path.join(os.path.dirname(__file__), "data", "hf_configs")
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def _deepseek_v3(mscale_all_dim: bool = True) -> dict:
    with open(os.path.join(DATA, "deepseek-ai__DeepSeek-V3.json")) as f:
        config = json.load(f)["config"]
    if not mscale_all_dim:
        # Without mscale_all_dim YaRN's mscale reaches the attention factor (1.369 at
        # factor 40), which the published config cancels to 1.
        del config["rope_scaling"]["mscale_all_dim"]
    return config


V3 = _deepseek_v3()
CONFIGS = {"deepseek_v3": jr.RopeConfig.from_hf(V3),
           "deepseek_v3_mscale": jr.RopeConfig.from_hf(_deepseek_v3(mscale_all_dim=False))}


def _deepseek_module():
    if os.environ.get(REQUIRE_ENV) == "1":
        importlib.import_module("torch")
        return importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")
    try:
        return importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")
    except ImportError:
        return None


DEEPSEEK = _deepseek_module()


def rotate64(cfg: jr.RopeConfig, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """float64 ``[T, H, r]``: ``x`` rotated as DeepSeek-V3 rotates q_pe and k_pe, in the
    pair layout (pair ``i`` at ``(2i, 2i + 1)``)."""
    if DEEPSEEK is None or cfg.mrope_section is not None:
        return oracle.rope_of(cfg, x, pos)
    import torch

    inv_freq, attention = oracle.serving_frequencies(cfg)
    freqs = np.asarray(pos, np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)[None]            # [1, T, r], as HF's
    cos, sin = (torch.from_numpy(f(emb) * attention) for f in (np.cos, np.sin))
    x_t = torch.from_numpy(np.asarray(x, np.float64)).permute(1, 0, 2)[None]   # [1, H, T, r]
    out, _ = DEEPSEEK.apply_rotary_pos_emb_interleave(x_t, x_t, cos, sin)
    halves = out[0].permute(1, 0, 2).numpy()
    r = cfg.rotary_dim
    pairs = np.empty_like(halves)
    pairs[..., 0::2], pairs[..., 1::2] = halves[..., :r // 2], halves[..., r // 2:]
    return pairs


@dataclasses.dataclass
class Inputs:
    q_pe: jax.Array
    k_pe: jax.Array
    ckv: jax.Array
    q_nope: Optional[jax.Array]
    pos: np.ndarray
    slots: np.ndarray
    cache: object
    page_size: int


def make_inputs(rng, cfg: jr.RopeConfig, *, tokens: int = 11, heads: int = 3, lora: int = 512,
                nope: Optional[int] = 128, pages: int = 4, page_size: int = 8,
                padding: int = 2, combined: bool = False, dtype=jnp.bfloat16,
                cache_dtype=None) -> Inputs:
    """Random inputs with distinct slots (``padding`` of them -1) and a cache of random
    contents (so a stray write shows)."""
    r = cfg.head_dim

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    rows = [cfg.max_position - 1, 0] + rng.integers(0, cfg.max_position, tokens).tolist()
    pos = np.asarray(rows[:tokens], np.int32)
    if cfg.mrope_section is not None:
        pos = np.stack([pos, rng.integers(0, cfg.max_position, tokens, dtype=np.int32),
                        rng.integers(0, cfg.max_position, tokens, dtype=np.int32)])
    slots = rng.permutation(pages * page_size)[:tokens].astype(np.int64)
    slots[rng.permutation(tokens)[:padding]] = -1
    cache_dtype = cache_dtype or dtype
    widths = (lora + r,) if combined else (lora, r)
    caches = tuple(jnp.asarray(rng.standard_normal((pages, page_size, w)), cache_dtype)
                   for w in widths)
    return Inputs(normal(tokens, heads, r), normal(tokens, r), normal(tokens, lora),
                  None if nope is None else normal(tokens, heads, nope), pos, slots,
                  caches[0] if combined else caches, page_size)


_step = jax.jit(jr.apply_mla_rope_and_append, static_argnames=("cfg", "q_dtype", "backend"))


def run(x: Inputs, cfg: jr.RopeConfig, **kwargs):
    return _step(x.q_pe, x.k_pe, x.ckv, jnp.asarray(x.pos), x.cache, jnp.asarray(x.slots), cfg=cfg,
                 q_nope=x.q_nope, **kwargs)


def _cache_rows(cache) -> Tuple[np.ndarray, ...]:
    """numpy ``[P * S, width]`` matrices of a cache in either structure."""
    arrays = cache if isinstance(cache, tuple) else (cache,)
    return tuple(np.asarray(c).reshape(-1, c.shape[-1]) for c in arrays)


def _within_one_e4m3_ulp(actual, want64, label: str) -> None:
    ulps = kv_oracle.ulps(np.asarray(actual), kv_oracle.e4m3(want64))
    assert ulps.max(initial=0) <= 1, f"{label}: {ulps.max()} e4m3 ulps from the oracle"


def check(x: Inputs, out, cfg: jr.RopeConfig, q_scale: Optional[float] = None,
          kv_scale: Optional[float] = None) -> None:
    """``out = (q_pe, q_nope, cache)`` against the oracle: q (fp8 when ``q_scale``), the
    written rows (fp8 when ``kv_scale``) and every other cache entry unchanged."""
    q_pe, q_nope, cache = out
    assert isinstance(cache, tuple) == isinstance(x.cache, tuple), "the structure given"
    dtype_name = jnp.dtype(x.q_pe.dtype).name
    q_want = rotate64(cfg, x.q_pe, x.pos)
    if q_scale is None:
        assert q_pe.dtype == x.q_pe.dtype
        assert (q_nope is None) == (x.q_nope is None), "q_nope as given"
        if q_nope is not None:
            np.testing.assert_array_equal(bits(q_nope), bits(x.q_nope), err_msg="q_nope as given")
        error = oracle.relative_error(q_pe, q_want)
        assert error < oracle.RELATIVE_TOLERANCE[dtype_name], f"q_pe: relative error {error:.3g}"
    else:
        assert q_pe.dtype == FP8
        _within_one_e4m3_ulp(q_pe, q_want * q_scale, "q_pe")
        if x.q_nope is None:
            assert q_nope is None
        else:
            assert q_nope.dtype == FP8
            _within_one_e4m3_ulp(q_nope, np.asarray(x.q_nope, np.float64) * q_scale, "q_nope")
    written = (x.slots >= 0)
    slots = x.slots[written]
    lora = x.ckv.shape[1]
    new, old = _cache_rows(cache), _cache_rows(x.cache)
    ckv_rows = new[0][slots][:, :lora]
    kpe_rows = (new[0][slots][:, lora:] if len(new) == 1 else new[1][slots])
    k_want = rotate64(cfg, x.k_pe[:, None, :], x.pos)[:, 0][written]
    if kv_scale is None:
        np.testing.assert_array_equal(bits(ckv_rows), bits(np.asarray(x.ckv)[written]),
                                      err_msg="ckv rows are cached as given")
        error = oracle.relative_error(kpe_rows, k_want)
        assert error < oracle.RELATIVE_TOLERANCE[dtype_name], f"k_pe: relative error {error:.3g}"
    else:
        _within_one_e4m3_ulp(ckv_rows, np.asarray(x.ckv, np.float64)[written] * kv_scale, "ckv")
        _within_one_e4m3_ulp(kpe_rows, k_want * kv_scale, "k_pe")
    for label, n, o in zip(("cache", "kpe_cache"), new, old):
        mask = np.zeros(n.shape, bool)
        mask[slots] = True
        kv_oracle.assert_untouched(label, n, o, mask)


# Each cache structure with each of q and the cache in bf16 and fp8, over both configs.
ORACLE_CASES = [("deepseek_v3", False, False, False), ("deepseek_v3", True, True, True),
                ("deepseek_v3", True, False, False), ("deepseek_v3_mscale", False, True, False),
                ("deepseek_v3_mscale", True, False, True), ("deepseek_v3_mscale", False, True, True)]


@pytest.mark.parametrize("name, combined, fp8_cache, fp8_q", ORACLE_CASES, ids=[
    "{}-{}-{}_cache-{}_q".format(n, "one_buffer" if c else "pair", "fp8" if f else "bf16",
                                 "fp8" if q else "bf16") for n, c, f, q in ORACLE_CASES])
def test_deepseek_v3_matches_the_oracle(name, combined, fp8_cache, fp8_q, rng):
    cfg = CONFIGS[name]
    x = make_inputs(rng, cfg, combined=combined, cache_dtype=FP8 if fp8_cache else None)
    q_scale, kv_scale = (0.75 if fp8_q else None), (1.5 if fp8_cache else None)
    out = run(x, cfg, q_dtype=jnp.float8_e4m3fn if fp8_q else None, q_quant_scale=q_scale,
              kv_quant_scale=kv_scale)
    check(x, out, cfg, q_scale, kv_scale)


# The kernels behind the public function: the Triton-lowered body in Pallas's interpreter
# (the bodies' own cases: tests/test_mla_kernels_interpret.py).
KERNEL_CASES = [ORACLE_CASES[0], ORACLE_CASES[1]]


@pytest.mark.parametrize("name, combined, fp8_cache, fp8_q", KERNEL_CASES,
                         ids=["pair-bf16", "one_buffer-fp8"])
def test_the_triton_kernel_through_the_public_function_matches_the_oracle(
        name, combined, fp8_cache, fp8_q, rng):
    cfg = CONFIGS[name]
    x = make_inputs(rng, cfg, tokens=5, heads=2, combined=combined,
                    cache_dtype=FP8 if fp8_cache else None)
    q_scale, kv_scale = (0.75 if fp8_q else None), (1.5 if fp8_cache else None)
    out = run(x, cfg, q_dtype=jnp.float8_e4m3fn if fp8_q else None, q_quant_scale=q_scale,
              kv_quant_scale=kv_scale, backend="interpret")
    check(x, out, cfg, q_scale, kv_scale)


def test_float32_and_no_q_nope(rng):
    cfg = CONFIGS["deepseek_v3_mscale"]
    x = make_inputs(rng, cfg, dtype=jnp.float32, nope=None, padding=0, combined=True)
    check(x, run(x, cfg), cfg)
    out = run(x, cfg, q_dtype="float8_e4m3fn")
    check(x, out, cfg, q_scale=1.0)


def test_the_cache_holds_what_apply_rope_returns(rng):
    cfg = CONFIGS["deepseek_v3"]
    x = make_inputs(rng, cfg, padding=0)
    q_pe, _, (_, kpe_cache) = run(x, cfg)
    want_q, want_k = jax.jit(jr.apply_rope, static_argnames="cfg")(
        x.q_pe, x.k_pe[:, None, :], jnp.asarray(x.pos), cfg=cfg)
    np.testing.assert_array_equal(bits(q_pe), bits(want_q))
    np.testing.assert_array_equal(bits(np.asarray(kpe_cache).reshape(-1, 64)[x.slots]),
                                  bits(want_k[:, 0]))


@pytest.mark.skipif(DEEPSEEK is None, reason=f"transformers absent ({REQUIRE_ENV}=1 requires it)")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_oracle_frequencies_are_deepseek_v3s(name):
    # transformers' YaRN (with mscale) in float32 against the float64 oracle's.
    import transformers

    config = copy.deepcopy(V3 if name == "deepseek_v3" else _deepseek_v3(mscale_all_dim=False))
    config.pop("model_type")
    rotary = DEEPSEEK.DeepseekV3RotaryEmbedding(
        transformers.AutoConfig.for_model("deepseek_v3", **config))
    inv_freq, attention = oracle.serving_frequencies(CONFIGS[name])
    np.testing.assert_allclose(rotary.inv_freq.numpy(), inv_freq, rtol=1e-6)
    assert rotary.attention_scaling == pytest.approx(attention, rel=1e-12)


def test_mrope_config_takes_three_position_rows(rng):
    cfg = jr.RopeConfig(head_dim=64, interleave=True, mrope_section=(8, 12, 12))
    x = make_inputs(rng, cfg, combined=True)
    check(x, run(x, cfg), cfg)
    with pytest.raises(ValueError, match=r"must be \[3, T\]"):
        jr.apply_mla_rope_and_append(x.q_pe, x.k_pe, x.ckv, x.pos[0], x.cache, x.slots, cfg)


@pytest.mark.parametrize("combined", [False, True], ids=["pair", "one_buffer"])
def test_donated_q_pe_and_cache_are_written_in_place(combined, rng):
    cfg = CONFIGS["deepseek_v3"]
    x = make_inputs(rng, cfg, combined=combined)
    want = run(x, cfg)
    in_place = jax.jit(jr.apply_mla_rope_and_append, static_argnames="cfg", donate_argnums=(0, 4))
    donated = (x.q_pe, x.cache)
    pointers = [a.unsafe_buffer_pointer() for a in jax.tree.leaves(donated)]
    out = in_place(x.q_pe, x.k_pe, x.ckv, jnp.asarray(x.pos), x.cache, jnp.asarray(x.slots),
                   cfg=cfg, q_nope=x.q_nope)
    assert all(a.is_deleted() for a in jax.tree.leaves(donated))
    leaves = [out[0], *jax.tree.leaves(out[2])]
    assert [a.unsafe_buffer_pointer() for a in leaves] == pointers, "not in place"
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(bits(a), bits(b))


def test_traced_slots_out_of_range_write_nothing(rng):
    cfg = CONFIGS["deepseek_v3"]
    x = make_inputs(rng, cfg, padding=0)
    x.slots[:3] = [32, 2 ** 31 - 1, -7]      # traced under jit: not checked, skipped
    out = run(x, cfg)
    x.slots[:3] = -1
    check(x, out, cfg)


def test_zero_tokens_change_nothing(rng):
    cfg = CONFIGS["deepseek_v3"]
    x = make_inputs(rng, cfg, tokens=0, padding=0)
    q_pe, q_nope, cache = jr.apply_mla_rope_and_append(x.q_pe, x.k_pe, x.ckv, x.pos, x.cache,
                                                       x.slots, cfg, q_nope=x.q_nope)
    assert q_pe.shape == (0, 3, 64) and q_nope is x.q_nope
    for a, b in zip(cache, x.cache):
        np.testing.assert_array_equal(bits(a), bits(b))


def _call(x: Inputs, **changes):
    args = dict(q_pe=x.q_pe, k_pe=x.k_pe, ckv=x.ckv, pos_ids=x.pos, mla_cache=x.cache,
                slots=x.slots, cfg=CONFIGS["deepseek_v3"], q_nope=x.q_nope)
    args.update(changes)
    return jr.apply_mla_rope_and_append(**args)


BAD = {
    "slot past the cache": (dict(slots=np.array([32] + [-1] * 10)), ValueError,
                            r"slots must be < 32 \(pages \* page_size\)"),
    "repeated slot": (dict(slots=np.array([5, 5] + [-1] * 9)), ValueError,
                      r"must not repeat a slot.*\[5\]"),
    "int64 slot that would wrap": (dict(slots=np.array([2 ** 32 + 3] + [-1] * 10)), ValueError,
                                   "got a maximum of 4294967299"),
    "q scale without fp8 q": (dict(q_quant_scale=2.0), ValueError,
                              "q_quant_scale=2.0 applies only with q_dtype=float8_e4m3fn"),
    "kv scale on a bf16 cache": (dict(kv_quant_scale=2.0), ValueError,
                                 "kv_quant_scale=2.0 applies only to a float8_e4m3fn cache"),
    "negative q scale": (dict(q_dtype=jnp.float8_e4m3fn, q_quant_scale=-1.0), ValueError,
                         r"q_quant_scale=-1.0 must be finite and > 0"),
    "q_dtype int8": (dict(q_dtype=jnp.int8), ValueError, r"q_dtype=.*must be None"),
    "q_dtype float16": (dict(q_dtype="float16"), ValueError, "q_pe's dtype"),
    "q_dtype not a dtype": (dict(q_dtype="fp8"), TypeError,
                            r"q_dtype='fp8' must be None, q_pe's dtype \(bfloat16\)"),
    "k_pe with a head axis": (dict(k_pe=jnp.zeros((11, 1, 64), jnp.bfloat16)), ValueError,
                              r"k_pe.shape=\(11, 1, 64\) must be \[T, r\]"),
    "ckv in float32": (dict(ckv=jnp.zeros((11, 512), jnp.float32)), ValueError,
                       "ckv.dtype=float32 must equal q_pe.dtype=bfloat16"),
    "q_nope heads": (dict(q_nope=jnp.zeros((11, 2, 128), jnp.bfloat16)), ValueError,
                     r"q_nope.shape\[1\]=2 must equal q_pe.shape\[1\]=3"),
    "ckv tokens": (dict(ckv=jnp.zeros((10, 512), jnp.bfloat16)), ValueError,
                   r"ckv.shape\[0\]=10 must equal q_pe.shape\[0\]=11"),
    "ckv_cache width": (dict(mla_cache=(jnp.zeros((4, 8, 256), jnp.bfloat16),
                                        jnp.zeros((4, 8, 64), jnp.bfloat16))), ValueError,
                        r"ckv_cache.shape=\(4, 8, 256\) must be \[pages, page_size, L\] with L=512"),
    "kpe_cache pages": (dict(mla_cache=(jnp.zeros((4, 8, 512), jnp.bfloat16),
                                        jnp.zeros((3, 8, 64), jnp.bfloat16))), ValueError,
                        r"kpe_cache.shape=\(3, 8, 64\) must be \(4, 8, 64\)"),
    "one buffer width": (dict(mla_cache=jnp.zeros((4, 8, 512), jnp.bfloat16)), ValueError,
                         "L \\+ r=576"),
    "cache in float16": (dict(mla_cache=jnp.zeros((4, 8, 576), jnp.float16)), ValueError,
                         "mla_cache.dtype=float16 must be k_pe's dtype"),
    "cache a list of three": (dict(mla_cache=[jnp.zeros((4, 8, 576))] * 3), TypeError,
                              "a list of 3"),
    "one array twice": (dict(mla_cache=(jnp.zeros((4, 8, 512)),) * 2), ValueError,
                        r"mla_cache=\(c, c\)"),
    "position past the config": (dict(pos_ids=np.full(11, 163840, np.int32)), ValueError,
                                 r"pos_ids must lie in \[0, 163840\)"),
    "cfg not a RopeConfig": (dict(cfg="deepseek"), TypeError, "cfg must be a RopeConfig"),
    "partial rotary cfg": (dict(cfg=jr.RopeConfig(head_dim=64, rotary_dim=32)), ValueError,
                           "cfg.rotary_dim=32 must equal cfg.head_dim=64"),
    "q_pe not an array": (dict(q_pe=[[1.0]]), TypeError, "q_pe must be an array, got list"),
}


@pytest.mark.parametrize("label", sorted(BAD))
def test_bad_inputs_are_refused_naming_the_argument(label, rng):
    changes, error, message = BAD[label]
    x = make_inputs(rng, CONFIGS["deepseek_v3"])
    with pytest.raises(error, match=message):
        _call(x, **changes)


def test_kernel_backends_without_an_mla_kernel_are_refused_and_auto_takes_xla(monkeypatch, rng):
    # The row as this op had it with only its XLA form: "auto" falls to XLA everywhere,
    # a named kernel backend says what is missing.
    op = "mla_rope_append"
    monkeypatch.setitem(backend_module.IMPLEMENTATIONS, op, {"xla": mla_rope_append_reference})
    for capability in ("8.0", "9.0"):
        assert backend_module.backend_name("auto", "cuda", op, capability) == "xla"
    with pytest.raises(jr.BackendUnavailable, match="has no mla_rope_append kernel"):
        backend_module.backend_name("interpret", "cpu", op)
    with pytest.raises(jr.BackendUnavailable, match="has no mla_rope_append kernel"):
        backend_module.backend_name("triton", "cuda", op)
    cfg = CONFIGS["deepseek_v3"]
    x = make_inputs(rng, cfg)
    check(x, run(x, cfg, backend="auto"), cfg)
    with pytest.raises(jr.BackendUnavailable):
        run(x, cfg, backend="interpret")


@pytest.mark.parametrize("combined", [False, True], ids=["pair", "one_buffer"])
def test_a_backend_gets_the_contracts_operands(combined, monkeypatch, rng):
    # What every MLA kernel is handed (jaxrope/ops/mla_rope_append/reference.py's docstring):
    # int32 slots, float32 tables [3, r/2] and scales [2] = [q_scale, kv_scale], the cache
    # as [rows, width] matrices told apart by their count, q_dtype static.
    seen = {}

    def spy(q_pe, k_pe, ckv, q_nope, pos_ids, slots, tables, scales, caches, **options):
        seen.update(slots=slots, tables=tables, scales=scales, caches=caches, options=options)
        return mla_rope_append_reference(q_pe, k_pe, ckv, q_nope, pos_ids, slots, tables, scales,
                                         caches, **options)

    op = backend_module.IMPLEMENTATIONS["mla_rope_append"]
    monkeypatch.setitem(backend_module.IMPLEMENTATIONS, "mla_rope_append", {**op, "interpret": spy})
    cfg = CONFIGS["deepseek_v3_mscale"]
    x = make_inputs(rng, cfg, combined=combined, cache_dtype=FP8)
    out = _call(x, cfg=cfg, q_dtype=jnp.float8_e4m3fn, q_quant_scale=0.5, kv_quant_scale=4.0,
                backend="interpret")
    check(x, out, cfg, q_scale=0.5, kv_scale=4.0)
    assert seen["slots"].dtype == jnp.int32 and seen["slots"].shape == (11,)
    assert seen["tables"].dtype == jnp.float32 and seen["tables"].shape == (3, 32)
    assert seen["scales"].dtype == jnp.float32 and seen["scales"].tolist() == [0.5, 4.0]
    widths = [(32, 576)] if combined else [(32, 512), (32, 64)]
    assert [c.shape for c in seen["caches"]] == widths and all(c.dtype == FP8 for c in seen["caches"])
    assert seen["options"] == dict(rotary_dim=64, interleave=True,
                                   attention_factor=pytest.approx(1.3688879454113936),
                                   mrope_section=None, mrope_interleaved=False, q_dtype=FP8)
