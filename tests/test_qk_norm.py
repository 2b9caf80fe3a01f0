"""QK-norm before RoPE in the fused append: :class:`jaxrope.QKNorm` and
``apply_rope_and_append_kv(..., q_norm_weight=, k_norm_weight=, qk_norm=)``.

- accuracy against a float64 oracle written here from the formula (normalise, then
  :func:`jaxrope.testing.oracle.rope_of`), both conventions and both spans, positions up
  to 2**20: bf16 at the rounding floor (2.5e-3 relative), float32 tight;
- parity with transformers' own attention (Qwen3, Gemma 3's two layer types): the q and k
  its ``forward`` hands to the attention function (captured by a registered attention
  interface) against ours, float32 tight, bf16 at least as close to float64 as the model's;
- ``QKNorm.from_hf`` for Qwen3, Qwen3-MoE, Gemma 3 (text and multimodal) and OLMo 2,
  from configs built here, and against the models' own norm modules;
- refusals at the public boundary, each leaving the caches untouched; the Pallas
  kernels decline a norm and "auto" falls through to XLA.

The transformers tests skip without torch and transformers unless
JAXROPE_REQUIRE_TRANSFORMERS=1, where their absence fails.
"""

from __future__ import annotations

import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.ops import backends
from jaxrope.ops.rope_append_kv import triton as triton_append
from jaxrope.qk_norm import normalize
from jaxrope.testing import oracle
from jaxrope.testing.kv_norm import norm_oracle as _norm_oracle

REQUIRE_ENV = "JAXROPE_REQUIRE_TRANSFORMERS"
PAGES, PAGE_SIZE = 4, 16
TOLERANCE = {"float32": 1e-5, "bfloat16": oracle.RELATIVE_TOLERANCE["bfloat16"]}
QWEN3 = jr.QKNorm(eps=1e-6)
GEMMA = jr.QKNorm(eps=1e-6, convention="gemma")
OLMO2 = jr.QKNorm(eps=1e-5, per_head=False)


def _module(name):
    if os.environ.get(REQUIRE_ENV) == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"needs {name} ({REQUIRE_ENV}=1 makes its "
                                            "absence a failure)")


def _caches(dtype, k_heads, head_dim):
    return tuple(jnp.zeros((PAGES, PAGE_SIZE, k_heads, head_dim), dtype) for _ in "kv")


def _slots(rng, tokens):
    return jnp.asarray(rng.permutation(PAGES * PAGE_SIZE)[:tokens], jnp.int32)


def _written_k(kv_cache, slots) -> np.ndarray:
    k_cache = np.asarray(kv_cache[0], np.float32).reshape(PAGES * PAGE_SIZE, *kv_cache[0].shape[2:])
    return k_cache[np.asarray(slots)]


def _weight(rng, qk_norm, heads, head_dim, dtype):
    # Around 1 for x * w, around 0 for x * (1 + w): the values models train to.
    centre = 0.0 if qk_norm.convention == "gemma" else 1.0
    w = centre + 0.5 * rng.standard_normal(qk_norm.weight_length(heads, head_dim))
    return jnp.asarray(w, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("qk_norm, head_dim, rotary_dim, norm_q", [
    (QWEN3, 128, 128, True), (GEMMA, 64, 64, True), (OLMO2, 64, 32, True),
    (QWEN3, 80, 40, False)], ids=["qwen3", "gemma", "olmo2-partial", "k-only"])
def test_norm_then_rope_stays_at_the_rounding_floor_up_to_2_20(qk_norm, head_dim, rotary_dim,
                                                               norm_q, dtype, rng):
    tokens, q_heads, k_heads = 24, 4, 2
    cfg = jr.RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=1e6,
                        max_position=2 ** 20)
    pos = np.sort(rng.integers(0, 2 ** 20, tokens))
    pos[-1] = 2 ** 20 - 1
    q = jnp.asarray(3 * rng.standard_normal((tokens, q_heads, head_dim)), dtype)
    k, v = (jnp.asarray(3 * rng.standard_normal((tokens, k_heads, head_dim)), dtype)
            for _ in "kv")
    q_w = _weight(rng, qk_norm, q_heads, head_dim, dtype) if norm_q else None
    k_w = _weight(rng, qk_norm, k_heads, head_dim, dtype)
    slots = _slots(rng, tokens)
    out_q, kv_cache = jr.apply_rope_and_append_kv(
        q, k, v, jnp.asarray(pos, jnp.int32), _caches(dtype, k_heads, head_dim), slots, cfg,
        q_norm_weight=q_w, k_norm_weight=k_w, qk_norm=qk_norm)
    want_q = oracle.rope_of(cfg, _norm_oracle(q, q_w, qk_norm) if norm_q else q, pos)
    want_k = oracle.rope_of(cfg, _norm_oracle(k, k_w, qk_norm), pos)
    assert out_q.dtype == q.dtype
    assert oracle.relative_error(out_q, want_q) <= TOLERANCE[dtype]
    assert oracle.relative_error(_written_k(kv_cache, slots), want_k) <= TOLERANCE[dtype]
    np.testing.assert_array_equal(np.asarray(kv_cache[1], np.float32).reshape(
        PAGES * PAGE_SIZE, k_heads, head_dim)[np.asarray(slots)], np.asarray(v, np.float32))


def test_qk_norm_is_a_static_jit_argument_and_each_value_compiles_its_own(rng):
    cfg = jr.RopeConfig(head_dim=64)
    step = jax.jit(jr.apply_rope_and_append_kv, static_argnames="cfg", donate_argnums=(0, 4))
    q = rng.standard_normal((5, 2, 64)).astype(np.float32)
    k = rng.standard_normal((5, 2, 64)).astype(np.float32)
    w = jnp.asarray(0.1 * rng.standard_normal(64), jnp.float32)
    pos, slots = jnp.arange(5), _slots(rng, 5)
    results = {}
    for qk_norm in (QWEN3, jr.QKNorm(eps=0.5), GEMMA):
        out_q, _ = step(jnp.asarray(q), k, k, pos, _caches(jnp.float32, 2, 64), slots, cfg=cfg,
                        q_norm_weight=w, k_norm_weight=w, qk_norm=qk_norm)
        want = oracle.rope_of(cfg, _norm_oracle(q, w, qk_norm), np.arange(5))
        assert oracle.relative_error(out_q, want) <= 1e-5, qk_norm
        results[qk_norm] = np.asarray(out_q)
    assert len({r.tobytes() for r in results.values()}) == 3
    assert hash(jr.QKNorm(eps=1e-6)) == hash(QWEN3) and jr.QKNorm(eps=1e-6) == QWEN3


def test_auto_falls_through_to_xla_when_the_kernel_declines_a_norm(monkeypatch, rng):
    # The Triton kernel normalises per head; a per-token norm (OLMo 2) spans heads that
    # several of its programs hold, so it declines that one.
    cfg = jr.RopeConfig(head_dim=64)
    q, k = (jnp.asarray(rng.standard_normal((3, 2, 64)), jnp.float32) for _ in "qk")
    w = jnp.ones(2 * 64, jnp.float32)
    args = (q, k, k, jnp.arange(3), _caches(jnp.float32, 2, 64), _slots(rng, 3), cfg)
    want = jr.apply_rope_and_append_kv(*args, q_norm_weight=w, qk_norm=OLMO2, backend="xla")
    # "auto" as on a GPU: the Triton kernel first (its interpreter here), then XLA.
    monkeypatch.setattr(backends, "candidates", lambda *a: ("interpret", "xla"))
    got = jr.apply_rope_and_append_kv(*args, q_norm_weight=w, qk_norm=OLMO2, backend="auto")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = jr.ops.rope_append_kv.cache_layout.cache_rows("NHD", False, PAGES, PAGE_SIZE, 2)
    with pytest.raises(NotImplementedError, match="backend='interpret' normalises q and k per "
                                                  "head only: qk_norm.per_head=False"):
        triton_append.rope_append_kv_triton(
            q, k, k, jnp.arange(3), args[5], jnp.zeros((3, 32), jnp.float32),
            jnp.ones(2, jnp.float32), tuple(c.reshape(-1, 64) for c in args[4]), rows=rows,
            rotary_dim=64, interleave=False, attention_factor=1.0, interpret=True,
            q_norm_weight=w, qk_norm=OLMO2)


# --- refusals -----------------------------------------------------------------------------

def _refusal_inputs():
    cfg = jr.RopeConfig(head_dim=64)
    q = jnp.ones((3, 4, 64), jnp.bfloat16)
    k = jnp.ones((3, 2, 64), jnp.bfloat16)
    caches = tuple(jnp.full((PAGES, PAGE_SIZE, 2, 64), 7.0, jnp.bfloat16) for _ in "kv")
    return (q, k, k, jnp.arange(3), caches, jnp.array([1, 2, 3], jnp.int32), cfg)


W64 = np.ones(64, np.float32)
W128 = np.ones(128, np.float32)   # OLMo 2's span: Hk * D of the refusal inputs
BAD_CALLS = {
    "weight-length": (dict(q_norm_weight=np.ones(63, np.float32), qk_norm=QWEN3),
                      ValueError, r"q_norm_weight.shape=\(63,\) must be \(64,\)"),
    "weight-rank": (dict(k_norm_weight=np.ones((2, 64), np.float32), qk_norm=QWEN3),
                    ValueError, r"k_norm_weight.shape=\(2, 64\) must be \(64,\)"),
    "olmo-span": (dict(k_norm_weight=W64, qk_norm=OLMO2),
                  ValueError, r"k_norm_weight.shape=\(64,\) must be \(128,\): \[H \* D"),
    "weight-int": (dict(q_norm_weight=np.ones(64, np.int32), qk_norm=QWEN3),
                   ValueError, "q_norm_weight.dtype=int32 must be one of"),
    "weight-float64": (dict(q_norm_weight=np.ones(64, np.float64), qk_norm=QWEN3),
                       ValueError, "q_norm_weight.dtype=float64"),
    "weight-list": (dict(q_norm_weight=[1.0] * 64, qk_norm=QWEN3),
                    TypeError, "q_norm_weight must be an array, got list"),
    "no-qk-norm": (dict(q_norm_weight=W64), ValueError, "q_norm_weight is given but qk_norm=None"),
    "qk-norm-alone": (dict(qk_norm=QWEN3), ValueError, "without q_norm_weight or k_norm_weight"),
    "qk-norm-type": (dict(k_norm_weight=W64, qk_norm=1e-6), TypeError,
                     "qk_norm must be a jaxrope.QKNorm, got float"),
    # The kernels normalise per head; OLMo 2's norm over a token's heads is XLA's (the
    # compiled kernels' own refusals: tests/test_kv_norm_fp8q_{triton,mosaic}.py; here,
    # off a GPU, "mosaic" and "triton" are refused for the device first).
    "interpret-per-token": (dict(k_norm_weight=W128, qk_norm=OLMO2, backend="interpret"),
                            NotImplementedError, "backend='interpret' normalises q and k per head"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_norm_arguments_are_refused_and_the_caches_stay_untouched(name):
    kwargs, error, message = BAD_CALLS[name]
    args = _refusal_inputs()
    before = [np.asarray(c).copy() for c in args[4]]
    with pytest.raises(error, match=message):
        jr.apply_rope_and_append_kv(*args, **kwargs)
    for cache, old in zip(args[4], before):
        np.testing.assert_array_equal(np.asarray(cache), old)


@pytest.mark.parametrize("eps, error", [(0.0, ValueError), (-1e-6, ValueError),
                                        (float("nan"), ValueError), (float("inf"), ValueError),
                                        (True, TypeError), ("1e-6", TypeError),
                                        # > 0 as a float64, not as the float32 the norm adds:
                                        (1e-300, ValueError), (1e-40, ValueError),
                                        (1e39, ValueError)])
def test_eps_must_be_a_finite_positive_number(eps, error):
    with pytest.raises(error, match="eps"):
        jr.QKNorm(eps=eps)


def test_the_smallest_normal_float32_eps_keeps_a_zero_head_finite():
    # The bound eps is checked against: a head of zeros normalises to zeros, not NaN.
    tiny = float(np.finfo(np.float32).tiny)
    with pytest.raises(ValueError, match=r"must be finite and > 0 as the float32 the kernels"):
        jr.QKNorm(eps=tiny / 2)
    out = normalize(jnp.zeros((2, 3, 8), jnp.float32), jnp.ones(8), jr.QKNorm(eps=tiny))
    assert np.array_equal(np.asarray(out), np.zeros((2, 3, 8)))


def test_unknown_convention_and_span_types_are_refused():
    with pytest.raises(ValueError, match="convention='olmo' must be one of"):
        jr.QKNorm(convention="olmo")
    with pytest.raises(TypeError, match="per_head must be a bool"):
        jr.QKNorm(per_head=1)


# --- from_hf --------------------------------------------------------------------------------

@pytest.mark.parametrize("config, want", [
    ({"model_type": "qwen3", "rms_norm_eps": 1e-6, "head_dim": 128}, QWEN3),
    ({"model_type": "qwen3_moe", "rms_norm_eps": 3e-6}, jr.QKNorm(eps=3e-6)),
    ({"model_type": "gemma3_text", "rms_norm_eps": 1e-6}, GEMMA),
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text",
                                              "rms_norm_eps": 2e-6}},
     jr.QKNorm(eps=2e-6, convention="gemma")),
    ({"model_type": "olmo2", "rms_norm_eps": 1e-6}, jr.QKNorm(eps=1e-6, per_head=False)),
    ({"model_type": "olmo2"}, OLMO2),             # the config class's default eps
], ids=["qwen3", "qwen3_moe", "gemma3_text", "gemma3", "olmo2", "olmo2-default"])
def test_from_hf_reads_the_convention_span_and_eps(config, want):
    assert jr.QKNorm.from_hf(config) == want


def test_from_hf_refuses_a_model_without_a_known_qk_norm():
    with pytest.raises(ValueError, match="model_type='llama' has no q_norm / k_norm"):
        jr.QKNorm.from_hf({"model_type": "llama", "rms_norm_eps": 1e-5})
    with pytest.raises(ValueError, match="eps"):
        jr.QKNorm.from_hf({"model_type": "qwen3", "rms_norm_eps": 0.0})


TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            vocab_size=16, intermediate_size=32, max_position_embeddings=2 ** 21)


def _hf_config(transformers, family, **extra):
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            **TINY, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
            **extra)
    cls = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
           "olmo2": transformers.Olmo2Config}[family]
    return cls(**TINY, num_hidden_layers=1, **extra)


def _attention(family, config, layer_idx=0):
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "gemma3": "Gemma3", "olmo2": "Olmo2"}
    return modeling, getattr(modeling, f"{name[family]}Attention")(config, layer_idx)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma3", "olmo2"])
def test_from_hf_normalises_like_the_models_own_q_norm_and_k_norm(family, rng):
    torch, transformers = _module("torch"), _module("transformers")
    config = _hf_config(transformers, family, rms_norm_eps=1e-3)
    qk_norm = jr.QKNorm.from_hf(config)
    assert jr.QKNorm.from_hf(config.to_dict()) == qk_norm
    assert qk_norm.eps == 1e-3
    _, attention = _attention(family, config)
    for module, heads in ((attention.q_norm, 4), (attention.k_norm, 2)):
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(0.5 * rng.standard_normal(module.weight.shape)))
            x = rng.standard_normal((5, heads, 32)).astype(np.float32)
            hf_in = torch.from_numpy(x if qk_norm.per_head else x.reshape(5, heads * 32))
            got_hf = module(hf_in).numpy().reshape(x.shape)
        ours = normalize(jnp.asarray(x), jnp.asarray(module.weight.detach().numpy()), qk_norm)
        np.testing.assert_allclose(np.asarray(ours), got_hf, rtol=1e-5, atol=1e-6)


def _capture_attention(transformers):
    """A registered attention function that keeps the q and k it is handed."""
    seen = {}

    def capture(module, query, key, value, attention_mask, **kwargs):
        seen["q"], seen["k"] = query, key
        return query.new_zeros(query.shape).transpose(1, 2), None

    transformers.AttentionInterface.register("jaxrope_capture", capture)
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family, layer_idx", [("qwen3", 0), ("gemma3", 0), ("gemma3", 1)],
                         ids=["qwen3", "gemma3-sliding", "gemma3-full"])
def test_q_and_cached_k_match_the_models_own_attention(family, layer_idx, dtype, rng):
    torch, transformers = _module("torch"), _module("transformers")
    seen = _capture_attention(transformers)
    config = _hf_config(transformers, family, rms_norm_eps=1e-6)
    config._attn_implementation = "jaxrope_capture"
    modeling, attention = _attention(family, config, layer_idx)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(int(rng.integers(2 ** 31)))
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.5 if p.ndim == 1 else 0.2))
    attention = attention.to(torch_dtype)
    tokens = 12
    # Small positions: transformers' float32 angle (position * inv_freq in float32) is
    # exact to ~1e-6 there; the large positions are the float64 test's above.
    pos = np.sort(rng.choice(64, tokens, replace=False))
    hidden = torch.randn(1, tokens, 64, generator=generator).to(torch_dtype)
    layer_type = config.layer_types[layer_idx] if family == "gemma3" else None
    rotary = getattr(modeling, "Gemma3RotaryEmbedding" if family == "gemma3"
                     else "Qwen3RotaryEmbedding")(config)
    kwargs = {"layer_type": layer_type} if layer_type else {}
    with torch.no_grad():
        cos_sin = rotary(hidden, torch.from_numpy(pos)[None], **kwargs)
        attention(hidden, cos_sin, None)
        q_in = attention.q_proj(hidden).view(tokens, 4, 32)
        k_in = attention.k_proj(hidden).view(tokens, 2, 32)
        v_in = attention.v_proj(hidden).view(tokens, 2, 32)
    hf_q = seen["q"][0].transpose(0, 1).float().numpy()
    hf_k = seen["k"][0].transpose(0, 1).float().numpy()

    def jnp_of(t):
        return jnp.asarray(t.detach().float().numpy(), dtype)

    cfg = jr.RopeConfig.from_hf(config, layer_type=layer_type)
    qk_norm = jr.QKNorm.from_hf(config)
    q_w, k_w = jnp_of(attention.q_norm.weight), jnp_of(attention.k_norm.weight)
    slots = _slots(rng, tokens)
    q, kv_cache = jr.apply_rope_and_append_kv(
        jnp_of(q_in), jnp_of(k_in), jnp_of(v_in), jnp.asarray(pos, jnp.int32),
        _caches(dtype, 2, 32), slots, cfg, q_norm_weight=q_w, k_norm_weight=k_w, qk_norm=qk_norm)
    k = _written_k(kv_cache, slots)
    want_q = oracle.rope_of(cfg, _norm_oracle(jnp_of(q_in), q_w, qk_norm), pos)
    want_k = oracle.rope_of(cfg, _norm_oracle(jnp_of(k_in), k_w, qk_norm), pos)
    for label, ours, theirs, want in (("q", q, hf_q, want_q), ("k", k, hf_k, want_k)):
        error = oracle.relative_error(ours, want)
        assert error <= TOLERANCE[dtype], (label, error)
        if dtype == "float32":
            assert oracle.relative_error(ours, theirs) <= 2e-5, label
        else:
            # transformers rounds to bf16 after the norm and rotates with bf16 cos / sin:
            # ours rounds once, so it is at least as close to float64 as the model's.
            assert error <= oracle.relative_error(theirs, want), label
            assert oracle.relative_error(ours, theirs) <= 1e-2, label
