"""Parity with transformers 5.24 (CPU): every real config rotates like the model's own code.

For each config of ``tests/data/hf_configs/`` (the public config.json RoPE fields of
real models) and each of its layer types, the model's own rotary class and apply
function, named by its :data:`jaxrope.models.MODEL_TYPES` row, are the reference:
``frequencies()`` and the attention factor against the rotary class's ``inv_freq`` and
``attention_scaling``, and ``apply_rope`` (XLA; the Pallas interpreter on a few)
against the apply function, at positions up to the model's maximum. M-RoPE configs
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), GLM-4.1V) the same way at M-RoPE positions
``[3, T]`` whose rows differ, through the VL model's text rotary class
(:mod:`jaxrope.testing.transformers_mrope`). One layer's rotary only, a dozen tokens,
no weights.

The suite skips without torch and transformers unless JAXROPE_REQUIRE_TRANSFORMERS=1
(``make test`` sets it), where their absence, or another transformers version, fails.
"""

from __future__ import annotations

import dataclasses
import copy
import glob
import importlib
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import hf
from jaxrope.models import MODEL_TYPES
from jaxrope.models import HF_VL_CONFIGS
from jaxrope.mrope import HF_MODEL_TYPES
from jaxrope.testing import oracle

REQUIRE_ENV = "JAXROPE_REQUIRE_TRANSFORMERS"
PINNED = "5.24.0"


def _require(name):
    if os.environ.get(REQUIRE_ENV) == "1":
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"the parity suite needs {name} ({REQUIRE_ENV}=1 "
                                            "makes its absence a failure)")


torch = _require("torch")
transformers = _require("transformers")
if transformers.__version__ != PINNED:
    if os.environ.get(REQUIRE_ENV) == "1":
        raise RuntimeError(f"the parity suite is pinned to transformers {PINNED}, found "
                           f"{transformers.__version__}")
    pytest.skip(f"the parity suite is pinned to transformers {PINNED}", allow_module_level=True)
transformers.logging.set_verbosity_error()
from jaxrope.testing import transformers_mrope  # noqa: E402  (needs torch and transformers)

TOKENS = 16  # one shape per head size: jit compiles once per config, not per call

# jitted: one XLA compile per config instead of one per primitive and shape.
_rope = jax.jit(jr.apply_rope, static_argnames=("cfg", "backend"))


def _apply(q, k, pos, cfg, backend="xla"):
    out_q, out_k = _rope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(pos), cfg=cfg, backend=backend)
    return np.asarray(out_q), np.asarray(out_k)


DATA = os.path.join(os.path.dirname(__file__), "data", "hf_configs")
ENTRIES = {e["model_id"]: e for e in (json.load(open(p)) for p in sorted(glob.glob(
    os.path.join(DATA, "*.json"))))}


def _model_type(config):
    text = config.get("text_config") or {}
    return text.get("model_type") or config["model_type"]


def _cases():
    for model_id, entry in ENTRIES.items():
        config = entry["config"]
        row = MODEL_TYPES[_model_type(config)]
        if row.mrope:
            continue  # MROPE_CASES
        for layer_type in entry.get("layer_types", [None]):
            cfg = jr.RopeConfig.from_hf(config, layer_type=layer_type)
            extended = (isinstance(cfg.scaling, jr.LongRope)
                        and cfg.max_position > cfg.scaling.original_max_position)
            for factors in (("short", "long") if extended else ("auto",)):
                name = f"{model_id}:{layer_type or 'all'}:{factors}"
                yield pytest.param(model_id, layer_type, factors, row, id=name)


CASES = list(_cases())


def _vl_configs():
    """The M-RoPE configs: the real ones of both tables, and Qwen2.5-VL's long-context
    YaRN block (its model card's, the sections inside it)."""
    configs = {model_id: e["config"] for model_id, e in ENTRIES.items()
               if MODEL_TYPES[_model_type(e["config"])].mrope}
    configs.update(HF_VL_CONFIGS)
    yarn = json.loads(json.dumps(configs["Qwen/Qwen2.5-VL-7B-Instruct"]))
    yarn["rope_scaling"] = {"type": "yarn", "mrope_section": [16, 24, 24], "factor": 4,
                            "original_max_position_embeddings": 32768}
    configs["Qwen/Qwen2.5-VL-7B-Instruct+yarn"] = yarn
    return configs


VL_CONFIGS = _vl_configs()


# -- the reference: the model's own code ------------------------------------------------


def _hf_config(config):
    """The transformers config the model would load; remote-code families as the
    transformers port whose rotation their code matches (see their table rows)."""
    # A deep copy: transformers' config classes rewrite the nested rope dicts in place, and
    # these are shared tables (jaxrope.models.HF_VL_CONFIGS) that later tests read.
    config = copy.deepcopy(dict(config))
    model_type = config.pop("model_type")
    if model_type == "chatglm":  # modeling_chatglm.py: RotaryEmbedding(kv_channels // 2, ...)
        model_type = "glm"
        config = {"hidden_size": config["hidden_size"],
                  "num_attention_heads": config["num_attention_heads"],
                  "head_dim": config["kv_channels"], "partial_rotary_factor": 0.5,
                  "rope_theta": 10000.0 * config.get("rope_ratio", 1),
                  "max_position_embeddings": config["seq_length"]}
    elif model_type == "minicpm":  # modeling_minicpm.py: Llama's rotation
        model_type = "llama"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_config = transformers.AutoConfig.for_model(model_type, **config)
    return hf_config.get_text_config()


def _reference(row, hf_config, layer_type, q, k, pos):
    """transformers' rotated q, k (float32, ours' layout ``[T, H, D]``), inv_freq, attention."""
    module = importlib.import_module(f"transformers.models.{row.source[0]}.modeling_"
                                     f"{row.source[0]}")
    rotary = getattr(module, row.source[1])(hf_config)
    apply = getattr(module, row.source[2])
    q_t = torch.from_numpy(np.asarray(q)).permute(1, 0, 2)[None]  # [1, H, T, D]
    k_t = torch.from_numpy(np.asarray(k)).permute(1, 0, 2)[None]
    position_ids = torch.from_numpy(np.asarray(pos, np.int64))[None]
    kwargs = {"layer_type": layer_type} if row.source[0] in ("gemma3", "gemma4") else {}
    with torch.no_grad():
        out = rotary(q_t, position_ids, **kwargs)
        if row.source[0] in ("gptj", "codegen"):
            sin, cos = out
            rot = 2 * sin.shape[-1]  # sin, cos: [B, T, R/2]

            def one(x):  # GPT-J's attention: [B, T, H, D], rotary_dim leading dims
                x = x.permute(0, 2, 1, 3)
                x = torch.cat([apply(x[..., :rot], sin, cos), x[..., rot:]], dim=-1)
                return x.permute(0, 2, 1, 3)

            q_out, k_out = one(q_t), one(k_t)
        elif row.source[2] == "apply_rotary_emb":  # complex freqs_cis: Llama 4, DeepSeek-V2
            if row.source[0] == "llama4":
                q_out, k_out = apply(q_t.transpose(1, 2), k_t.transpose(1, 2), out)
                q_out, k_out = q_out.transpose(1, 2), k_out.transpose(1, 2)
            else:
                q_out, k_out = apply(q_t, k_t, out)
        else:
            cos, sin = out
            # gpt-oss's cos/sin hold R/2 angles (it chunks x into halves), the others R.
            rot = cos.shape[-1] * (2 if row.source[0] == "gpt_oss" else 1)
            if row.source[0] == "gemma4":
                q_rot, k_rot = apply(q_t[..., :rot], cos, sin), apply(k_t[..., :rot], cos, sin)
            else:
                q_rot, k_rot = apply(q_t[..., :rot], k_t[..., :rot], cos, sin)
            q_out = torch.cat([q_rot, q_t[..., rot:]], dim=-1)
            k_out = torch.cat([k_rot, k_t[..., rot:]], dim=-1)
    prefix = f"{layer_type}_" if kwargs else ""
    inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
    attention = getattr(rotary, f"{prefix}attention_scaling", None)
    return (q_out[0].permute(1, 0, 2).numpy(), k_out[0].permute(1, 0, 2).numpy(),
            None if inv_freq is None else inv_freq.numpy(), attention)


def _as_hf(row, cfg, x):
    """``x`` in the layout the model's apply function writes: DeepSeek-V3's
    apply_rotary_pos_emb_interleave writes pair i to (i, i + R/2)."""
    if row.source[2] != "apply_rotary_pos_emb_interleave" or not cfg.interleave:
        return x
    r = cfg.rotary_dim
    return np.concatenate([x[..., 0:r:2], x[..., 1:r:2], x[..., r:]], axis=-1)


# -- tolerances ---------------------------------------------------------------------------


def _float32_rate_error(theta):
    # transformers forms inv_freq = 1 / base ** (2j / d) in float32: the exponent's
    # rounding (2**-24 relative, |exponent| <= 1) becomes ln(base) * 2**-24 relative
    # error after the power, plus a few roundings of the power, the reciprocal and any
    # scaling blend: (ln(base) + 8) * 2**-24 bounds all of them.
    return (math.log(theta) + 8) * 2.0 ** -24


def _hf_tolerance(cfg, pos, q):
    """Per element of the rotated dims: how far transformers' float32 result may be.

    Its angle float32(pos) * float32(f_j) carries the rate's relative error plus the
    product's rounding (2**-24): |d angle| <= pos * f_j * (rate error + 2**-24), twice
    that as margin. A pair (a, b) rotated by an angle off by d moves by at most
    d * (|a| + |b|) * attention; float32 cos/sin and the rotation's multiply-adds add a
    few ulps of (|a| + |b|) * attention: 2**-20; jaxrope's own angle is accurate to about
    1e-6 rad at any position (:mod:`jaxrope.ops.angle`), one more 2**-20 (seen at a
    YaRN slot of angle 0.03 rad: 9.7e-7 of a pair of magnitude 0.8).
    """
    inv_freq64, attention = cfg.serving_frequencies()
    rate = _float32_rate_error(cfg.theta) + 2.0 ** -24
    angle_err = 2 * np.asarray(pos, np.float64)[:, None] * inv_freq64[None, :] * rate  # [T, R/2]
    r = cfg.rotary_dim
    first, second = (slice(0, r, 2), slice(1, r, 2)) if cfg.interleave else (
        slice(0, r // 2), slice(r // 2, r))
    mag = np.abs(q[..., first]) + np.abs(q[..., second])  # [T, H, R/2]
    pair_tol = (angle_err[:, None, :] + 2.0 ** -19) * mag * max(attention, 1.0)
    tol = np.zeros(q.shape, np.float64)
    tol[..., first] = pair_tol
    tol[..., second] = pair_tol
    return tol + 1e-30


def _assert_close(actual, expected, tol, what):
    err = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    bad = err > tol
    if bad.any():
        idx = np.unravel_index(np.argmax(err - tol), err.shape)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} elements off, worst at {idx}: "
                             f"{actual[idx]!r} vs {expected[idx]!r} (tolerance {tol[idx]:.3g})")


def _positions(rng, cfg, factors="auto"):
    """TOKENS positions: small ones, the LongRoPE boundary, random ones, the last."""
    top = cfg.max_position
    if factors == "short":
        top = cfg.scaling.original_max_position
    picks = [0, 1, 2, 3, 17, min(100, top - 1), top - 1]
    if factors == "long":
        picks += [cfg.scaling.original_max_position - 1, cfg.scaling.original_max_position]
    picks += rng.integers(0, top, TOKENS - len(picks)).tolist()
    return np.array(sorted(picks), np.int32)


def _inputs(rng, cfg, tokens):
    q = rng.uniform(-1, 1, (tokens, 2, cfg.head_dim)).astype(np.float32)
    k = rng.uniform(-1, 1, (tokens, 1, cfg.head_dim)).astype(np.float32)
    return q, k


# -- the suite ------------------------------------------------------------------------------


def test_there_are_at_least_30_real_configs_covering_every_family_in_the_issue():
    model_types = {_model_type(e["config"]) for e in ENTRIES.values()}
    real = {m.split("@")[0].split("+")[0] for m in ENTRIES}
    assert len(real) >= 30, sorted(real)
    for family in ("cohere", "cohere2", "glm", "glm4", "chatglm", "llama4_text", "deepseek_v2",
                   "deepseek_v3", "minicpm3", "minicpm", "gptj", "qwen2_vl", "qwen2_5_vl",
                   "qwen3_vl_text", "glm4v_text", "gemma2", "gemma3_text", "gemma4_text", "phi3",
                   "llama", "qwen2", "qwen3", "mistral", "mixtral", "gpt_oss", "falcon",
                   "gpt_neox"):
        assert family in model_types, family


@pytest.mark.parametrize("model_id, layer_type, factors, row", CASES)
def test_rotation_matches_the_models_own_code(model_id, layer_type, factors, row, rng):
    config = ENTRIES[model_id]["config"]
    cfg = jr.RopeConfig.from_hf(config, layer_type=layer_type, longrope_factors=factors)
    pos = _positions(rng, cfg, factors)
    q, k = _inputs(rng, cfg, len(pos))
    hf_q, hf_k, hf_inv_freq, hf_attention = _reference(row, _hf_config(config), layer_type,
                                                       q, k, pos)
    inv_freq, attention = cfg.serving_frequencies()
    if hf_inv_freq is not None:  # GPT-J and CodeGen keep only a sin/cos table
        np.testing.assert_allclose(inv_freq, hf_inv_freq, rtol=_float32_rate_error(cfg.theta),
                                   atol=0, err_msg=f"{model_id}: frequencies")
        assert attention == pytest.approx(hf_attention, rel=1e-12), f"{model_id}: attention factor"
    out_q, out_k = _apply(q, k, pos, cfg)
    _assert_close(_as_hf(row, cfg, out_q), hf_q, _as_hf(row, cfg, _hf_tolerance(cfg, pos, q)),
                  f"{model_id}: q vs transformers")
    _assert_close(_as_hf(row, cfg, out_k), hf_k, _as_hf(row, cfg, _hf_tolerance(cfg, pos, k)),
                  f"{model_id}: k vs transformers")
    # Against the float64 oracle (its own frequencies) the bound is float32 output rounding
    # and jaxrope's ~1e-6 rad angle: 2**-18 of the pair's magnitude.
    want_freq, want_attention = oracle.serving_frequencies(cfg)
    for x, out in ((q, out_q), (k, out_k)):
        want = oracle.rope_oracle(x, pos, want_freq, want_attention, cfg.rotary_dim, cfg.interleave)
        np.testing.assert_allclose(out, want, rtol=0, atol=2.0 ** -18 * max(want_attention, 1.0) * 2,
                                   err_msg=f"{model_id}: vs the float64 oracle")


@pytest.mark.parametrize("model_id", ["microsoft/Phi-4-mini-instruct", "THUDM/chatglm3-6b-32k"])
def test_the_pallas_kernel_body_matches_xla_on_real_configs(model_id, rng):
    entry = ENTRIES[model_id]
    layer_type = entry.get("layer_types", [None])[0]
    cfg = jr.RopeConfig.from_hf(entry["config"], layer_type=layer_type)
    pos = _positions(rng, cfg, "auto")
    q, k = _inputs(rng, cfg, len(pos))
    for x, y in zip(_apply(q, k, pos, cfg, "interpret"), _apply(q, k, pos, cfg)):
        np.testing.assert_allclose(x, y, rtol=0, atol=2.0 ** -20)


def _mrope_positions(rng, cfg, tokens=TOKENS):
    """int32 ``[3, T]``: text columns (one position on all rows), image-like columns
    (h, w a little past t) and rows drawn independently, up to ``cfg.max_position - 1``."""
    top = cfg.max_position
    t = _positions(rng, cfg)[:tokens]
    pos = np.stack([t, t, t])
    pos[1, 4:8] = np.minimum(t[4:8] + rng.integers(0, 40, 4), top - 1)
    pos[2, 4:8] = np.minimum(t[4:8] + rng.integers(0, 40, 4), top - 1)
    pos[1:, 8:] = rng.integers(0, top, (2, tokens - 8))
    return pos.astype(np.int32)


def _mrope_tolerance(cfg, pos, x):
    # Each slot reads one row; the largest row bounds its angle's float32 error.
    return _hf_tolerance(cfg, pos.max(axis=0), x)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("model_id", sorted(VL_CONFIGS))
def test_mrope_rotation_matches_the_models_own_code(model_id, backend, rng):
    config = VL_CONFIGS[model_id]
    cfg = jr.RopeConfig.from_hf(config)
    assert cfg.mrope_section is not None
    hf_inv_freq, hf_attention = transformers_mrope.frequencies(config)
    inv_freq, attention = cfg.serving_frequencies()
    np.testing.assert_allclose(inv_freq, hf_inv_freq, rtol=_float32_rate_error(cfg.theta), atol=0,
                               err_msg=f"{model_id}: frequencies")
    assert attention == pytest.approx(hf_attention, rel=1e-6), f"{model_id}: attention factor"
    pos = _mrope_positions(rng, cfg)
    q, k = _inputs(rng, cfg, pos.shape[1])
    hf_q, hf_k = transformers_mrope.rotate(config, q, k, pos)
    out_q, out_k = _apply(q, k, pos, cfg, backend)
    _assert_close(out_q, hf_q, _mrope_tolerance(cfg, pos, q), f"{model_id}: q vs transformers")
    _assert_close(out_k, hf_k, _mrope_tolerance(cfg, pos, k), f"{model_id}: k vs transformers")
    want_freq, want_attention = oracle.serving_frequencies(cfg)
    for x, out in ((q, out_q), (k, out_k)):
        want = oracle.rope_oracle(x, pos, want_freq, want_attention, cfg.rotary_dim, cfg.interleave,
                                  cfg.mrope_section, cfg.mrope_interleaved)
        np.testing.assert_allclose(out, want, rtol=0, atol=2.0 ** -18 * max(want_attention, 1.0) * 2,
                                   err_msg=f"{model_id}: vs the float64 oracle")


def test_glm4v_moe_is_refused_because_its_code_rotates_unlike_glm41v(rng):
    # GLM-4.5V's text rotary recomposes the sections like GLM-4.1V but rotates NeoX
    # halves: read with GLM-4.1V's layout (the nearest one in the table) it is far off.
    text = dict(VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"]["text_config"], model_type="glm4v_moe_text")
    config = {"model_type": "glm4v_moe", "text_config": text}
    assert "glm4v_moe" not in HF_MODEL_TYPES
    with pytest.raises(NotImplementedError, match="not of model_type='glm4v_moe_text'"):
        jr.RopeConfig.from_hf(config)
    guess = jr.RopeConfig.from_hf(VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"])
    pos = _mrope_positions(rng, guess)
    q, k = _inputs(rng, guess, pos.shape[1])
    hf_q, _ = transformers_mrope.rotate(config, q, k, pos)
    out_q, _ = _apply(q, k, pos, guess)
    assert oracle.relative_error(out_q, hf_q) > 0.1


@pytest.mark.parametrize("model_id", sorted(
    m for m, e in ENTRIES.items() if _model_type(e["config"]) not in ("chatglm", "minicpm")))
def test_a_transformers_config_object_reads_like_its_dict(model_id):
    entry = ENTRIES[model_id]
    for layer_type in entry.get("layer_types", [None]):
        want = jr.RopeConfig.from_hf(entry["config"], layer_type=layer_type)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            obj = transformers.AutoConfig.for_model(**entry["config"])
        assert jr.RopeConfig.from_hf(obj, layer_type=layer_type) == want, layer_type


# -- each row against its code, and its defaults against the config class ------------------

_SYNTHETIC_GEOMETRY = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "num_hidden_layers": 4, "max_position_embeddings": 4096}
_MLA = {"qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32, "kv_lora_rank": 64,
        "q_lora_rank": 64}
_ROWS = sorted(name for name, row in MODEL_TYPES.items()
               if not row.mrope and name not in ("chatglm", "minicpm", "gemma3", "gemma4", "llama4"))


def _synthetic(name):
    config = {"model_type": name, **_SYNTHETIC_GEOMETRY, "head_dim": 64}
    row = MODEL_TYPES[name]
    if row.head_dim_key == "qk_rope_head_dim":
        config.pop("head_dim")
        config.update(_MLA)
    if row.rotary_dim_key:
        config[row.rotary_dim_key] = 32
    if row.partial_rotary is not None:
        config[row.partial_key] = 0.5
    if row.local_theta_key or row.full_head_dim_key:
        config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    if row.refuse:  # Falcon: head_dim is a property of FalconConfig, not a field
        config = {k: v for k, v in config.items() if k not in ("num_key_value_heads", "head_dim")}
    return config


@pytest.mark.parametrize("name", _ROWS)
def test_every_table_row_rotates_like_the_code_it_cites(name, rng):
    config = _synthetic(name)
    row = MODEL_TYPES[name]
    for layer_type in (["sliding_attention", "full_attention"] if "layer_types" in config
                       else [None]):
        cfg = jr.RopeConfig.from_hf(config, layer_type=layer_type)
        pos = _positions(rng, cfg)
        q, k = _inputs(rng, cfg, len(pos))
        hf_q, _, hf_inv_freq, _ = _reference(row, _hf_config(config), layer_type, q, k, pos)
        out_q, _ = _apply(q, k, pos, cfg)
        _assert_close(_as_hf(row, cfg, out_q), hf_q,
                      _as_hf(row, cfg, _hf_tolerance(cfg, pos, q)), f"{name}:{layer_type}")


# Sections of rotary_dim / 2 = 32 slots (head_dim 64), interleaved ones that fit Qwen3-VL's
# runs, and GLM-4V's half-rotated head (16 slots).
_SYNTHETIC_SECTIONS = {"qwen2_vl": [8, 12, 12], "qwen2_5_vl": [8, 12, 12],
                       "qwen3_vl": [12, 10, 10], "qwen3_vl_moe": [12, 10, 10], "glm4v": [4, 6, 6]}


@pytest.mark.parametrize("name", sorted(HF_MODEL_TYPES))
def test_every_mrope_row_rotates_like_the_code_it_cites(name, rng):
    text = {"model_type": f"{name}_text", **_SYNTHETIC_GEOMETRY, "head_dim": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": _SYNTHETIC_SECTIONS[name]}}
    if MODEL_TYPES[name].partial_rotary is not None:
        text["rope_parameters"]["partial_rotary_factor"] = 0.5
    config = {"model_type": name, "text_config": text}
    cfg = jr.RopeConfig.from_hf(config)
    assert cfg.mrope_section == tuple(_SYNTHETIC_SECTIONS[name])
    pos = _mrope_positions(rng, cfg)
    q, k = _inputs(rng, cfg, pos.shape[1])
    hf_q, _ = transformers_mrope.rotate(config, q, k, pos)
    out_q, _ = _apply(q, k, pos, cfg)
    _assert_close(out_q, hf_q, _mrope_tolerance(cfg, pos, q), name)


@pytest.mark.parametrize("name", sorted(n for n in MODEL_TYPES if n not in ("chatglm", "minicpm")))
def test_every_table_row_has_its_config_class_defaults(name):
    row = MODEL_TYPES[name]
    module = importlib.import_module(f"transformers.models.{row.source[0]}.modeling_{row.source[0]}")
    assert hasattr(module, row.source[1]) and hasattr(module, row.source[2]), row.source
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = transformers.AutoConfig.for_model(name).get_text_config()
    if row.max_position_default is not None:
        assert getattr(default, "max_position_embeddings") == row.max_position_default
    if row.head_dim_default is not None and row.full_head_dim_key is None:
        assert getattr(default, "head_dim") == row.head_dim_default
    if not row.scaling:  # GPT-J, CodeGen: a fixed sinusoidal table, no rope parameters
        return
    params = default.rope_parameters or {}
    if row.local_theta_key is not None:
        assert params["full_attention"]["rope_theta"] == row.theta_default
        assert params["sliding_attention"]["rope_theta"] == row.local_theta_default
    elif "full_attention" not in params:
        assert params.get("rope_theta", 10000.0) == row.theta_default
        assert params.get("partial_rotary_factor", 1.0) == (row.partial_rotary or 1.0)


# -- regressions: each case issue 14 names -------------------------------------------------


def _rotate(model_id, rng, **kw):
    entry = ENTRIES[model_id]
    cfg = jr.RopeConfig.from_hf(entry["config"], **kw)
    pos = _positions(rng, cfg)
    q, k = _inputs(rng, cfg, len(pos))
    row = MODEL_TYPES[_model_type(entry["config"])]
    hf_q, _, _, _ = _reference(row, _hf_config(entry["config"]), kw.get("layer_type"), q, k, pos)
    out_q, _ = _apply(q, k, pos, cfg)
    return cfg, pos, q, out_q, hf_q


@pytest.mark.parametrize("model_id", ["CohereForAI/c4ai-command-r-v01", "THUDM/glm-4-9b-chat-hf"])
def test_cohere_command_r_and_glm4_9b_chat_hf_rotate_interleaved_pairs(model_id, rng):
    cfg, pos, q, out_q, hf_q = _rotate(model_id, rng)
    assert cfg.interleave
    _assert_close(out_q, hf_q, _hf_tolerance(cfg, pos, q), model_id)
    halves = dataclasses.replace(cfg, interleave=False)
    wrong, _ = _apply(q, q[:, :1], pos, halves)
    assert np.abs(wrong - hf_q).max() > 0.5  # the layout the old table picked is far off


@pytest.mark.parametrize("model_id", sorted(m for m, c in VL_CONFIGS.items() if "+" not in m))
def test_vl_configs_rotate_with_their_sections_not_as_1d_rope(model_id, rng):
    # Read as 1-D (rope_type "mrope" taken for "default", the sections ignored), a config
    # is right for text tokens only. Read right, image tokens rotate as transformers
    # rotates them; a 1-D reading (every slot at the t row) is far off.
    config = VL_CONFIGS[model_id]
    cfg = jr.RopeConfig.from_hf(config)
    pos = _mrope_positions(rng, cfg)
    q, k = _inputs(rng, cfg, pos.shape[1])
    hf_q, _ = transformers_mrope.rotate(config, q, k, pos)
    out_q, _ = _apply(q, k, pos, cfg)
    _assert_close(out_q, hf_q, _mrope_tolerance(cfg, pos, q), model_id)
    one_d = dataclasses.replace(cfg, mrope_section=None, mrope_interleaved=False)
    as_1d, _ = _apply(q, k, pos[0], one_d)
    image = slice(4, None)  # the columns whose rows differ
    assert oracle.relative_error(as_1d[image], hf_q[image]) > 0.1
    text = slice(0, 4)      # text columns: one position on all rows, M-RoPE is 1-D RoPE
    _assert_close(as_1d[text], hf_q[text], _mrope_tolerance(cfg, pos, q)[text], model_id)


def test_chatglm3_6b_32k_reads_rope_ratio_seq_length_and_half_of_kv_channels(rng):
    cfg, pos, q, out_q, hf_q = _rotate("THUDM/chatglm3-6b-32k", rng)
    assert (cfg.head_dim, cfg.rotary_dim, cfg.interleave) == (128, 64, True)
    assert cfg.theta == 500000.0 and cfg.max_position == 32768
    _assert_close(out_q, hf_q, _hf_tolerance(cfg, pos, q), "chatglm")


def test_minicpm3_rotates_halves_despite_qk_rope_head_dim(rng):
    cfg, pos, q, out_q, hf_q = _rotate("openbmb/MiniCPM3-4B", rng)
    assert not cfg.interleave and cfg.head_dim == 32
    _assert_close(out_q, hf_q, _hf_tolerance(cfg, pos, q), "minicpm3")


def test_llama4_nested_config_equal_freq_factors_and_interleaved_pairs(rng):
    cfg, pos, q, out_q, hf_q = _rotate("meta-llama/Llama-4-Scout-17B-16E-Instruct", rng)
    assert cfg.interleave and cfg.scaling.high_freq_factor == cfg.scaling.low_freq_factor
    _assert_close(out_q, hf_q, _hf_tolerance(cfg, pos, q), "llama4")
    config = ENTRIES["meta-llama/Llama-4-Scout-17B-16E-Instruct"]["config"]
    assert hf.nope_layers(config) == tuple(range(3, 48, 4))


def test_gemma3_sliding_layers_use_rope_local_base_freq(rng):
    with pytest.raises(ValueError, match="sliding_attention.*full_attention|full_attention.*sliding"):
        jr.RopeConfig.from_hf(ENTRIES["google/gemma-3-1b-it"]["config"])
    cfg, pos, q, out_q, hf_q = _rotate("google/gemma-3-1b-it", rng, layer_type="sliding_attention")
    assert cfg.theta == 10000.0
    _assert_close(out_q, hf_q, _hf_tolerance(cfg, pos, q), "gemma3")


def test_gemma4_full_attention_uses_global_head_dim(rng):
    cfg, pos, q, out_q, hf_q = _rotate("google/gemma-4-E2B-it", rng, layer_type="full_attention")
    assert cfg.head_dim == cfg.rotary_dim == 512
    _assert_close(out_q, hf_q, _hf_tolerance(cfg, pos, q), "gemma4")


@pytest.mark.parametrize("model_id", ["microsoft/Phi-3.5-mini-instruct",
                                      "microsoft/Phi-4-mini-instruct"])
def test_longrope_short_factors_match_transformers_within_the_original_length(model_id, rng):
    entry = ENTRIES[model_id]
    cfg = jr.RopeConfig.from_hf(entry["config"], longrope_factors="short")
    pos = _positions(rng, cfg, "short")
    q, k = _inputs(rng, cfg, len(pos))
    hf_q, _, _, _ = _reference(MODEL_TYPES["phi3"], _hf_config(entry["config"]), None, q, k, pos)
    out, _ = _apply(q, k, pos, cfg)
    _assert_close(out, hf_q, _hf_tolerance(cfg, pos, q), model_id)
    # The default ("auto", vLLM's rule) serves 131072 positions with the long factors:
    # within the original length that is not what transformers computes.
    auto = jr.RopeConfig.from_hf(entry["config"])
    far, _ = _apply(q, k, pos, auto)
    assert np.abs(far - hf_q).max() > 0.1


def test_longrope_attention_factor_follows_the_config_not_max_position():
    config = ENTRIES["microsoft/Phi-3.5-mini-instruct"]["config"]
    capped = jr.RopeConfig.from_hf(config, max_position=32768)
    hf_config = _hf_config(config)
    rotary = importlib.import_module("transformers.models.phi3.modeling_phi3").Phi3RotaryEmbedding(
        hf_config)
    assert capped.frequencies()[1] == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert round(capped.frequencies()[1], 4) == 1.1902
