"""The vLLM-shaped :class:`torch_bridge.RotaryEmbedding` rotates as the models' own code (CPU).

q and k are non-contiguous views of one fused qkv buffer ``[T, (Hq + 2 Hk) * D]``, as
vLLM's attention splits its projection; the layer rotates them in place and must leave
v untouched. References, as in tests/test_hf_parity.py (whose helpers this reuses):
transformers 5.24's rotary class and apply function within the float32 tolerance
derived there, and the float64 oracle within 2**-18 of a pair's magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest

import test_hf_parity as hp  # noqa: E402  (skips without torch and transformers 5.24)

import jaxrope as jr  # noqa: E402
from jaxrope.models import MODEL_TYPES  # noqa: E402
from jaxrope.testing import oracle, transformers_mrope  # noqa: E402
from torch_bridge import RotaryEmbedding  # noqa: E402

torch = hp.torch
HQ, HK = 2, 1
# The four families: Llama 3.1 (llama3 scaling), Qwen2.5 YaRN, DeepSeek-V2
# (interleaved pairs, YaRN) and Qwen2-VL (M-RoPE).
MODELS = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B-Instruct+yarn",
          "deepseek-ai/DeepSeek-V2-Lite", "Qwen/Qwen2-VL-7B-Instruct"]


def _fused_views(q, k, rng):
    """A qkv buffer holding q, k and a random v; its q and k views ``[T, H * D]``."""
    tokens, d = q.shape[0], q.shape[2]
    v = rng.uniform(-1, 1, (tokens, HK * d)).astype(np.float32)
    qkv = torch.from_numpy(np.concatenate([q.reshape(tokens, -1), k.reshape(tokens, -1), v], -1))
    q_view, k_view, v_view = qkv.split([HQ * d, HK * d, HK * d], dim=-1)
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    return q_view, k_view, v_view, v


@pytest.mark.parametrize("model_id", MODELS)
def test_layer_on_qkv_views_matches_transformers_and_the_oracle(model_id, rng):
    config = hp.ENTRIES[model_id]["config"]
    row = MODEL_TYPES[hp._model_type(config)]
    layer = RotaryEmbedding.from_hf(config)
    cfg = layer.cfg
    if row.mrope:
        pos = hp._mrope_positions(rng, cfg)
        q = rng.uniform(-1, 1, (pos.shape[1], HQ, cfg.head_dim)).astype(np.float32)
        k = rng.uniform(-1, 1, (pos.shape[1], HK, cfg.head_dim)).astype(np.float32)
        hf_q, hf_k = transformers_mrope.rotate(config, q, k, pos)
        tolerance = hp._mrope_tolerance
    else:
        pos = hp._positions(rng, cfg)
        q, k = hp._inputs(rng, cfg, len(pos))
        q, k = q[:, :HQ], k[:, :HK]
        hf_q, hf_k, _, _ = hp._reference(row, hp._hf_config(config), None, q, k, pos)
        tolerance = hp._hf_tolerance
    q_view, k_view, v_view, v = _fused_views(q, k, rng)
    out_q, out_k = layer(torch.from_numpy(pos.astype(np.int64)), q_view, k_view)
    assert out_q is q_view and out_k is k_view
    assert np.array_equal(v_view.numpy(), v), "v changed"
    want_freq, want_attention = oracle.serving_frequencies(cfg)
    for x, out, hf_out in ((q, out_q, hf_q), (k, out_k, hf_k)):
        got = out.reshape(x.shape).numpy()
        hp._assert_close(hp._as_hf(row, cfg, got), hf_out,
                         hp._as_hf(row, cfg, tolerance(cfg, pos, x)),
                         f"{model_id}: vs transformers")
        want = oracle.rope_oracle(x, pos, want_freq, want_attention, cfg.rotary_dim,
                                  cfg.interleave, cfg.mrope_section, cfg.mrope_interleaved)
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -18 * max(want_attention, 1.0) * 2,
                                   err_msg=f"{model_id}: vs the float64 oracle")


def test_layer_names_match_vllm_and_refuse_a_missing_key():
    layer = RotaryEmbedding(jr.RopeConfig(head_dim=64, rotary_dim=32, interleave=True))
    assert (layer.head_size, layer.rotary_dim, layer.is_neox_style) == (64, 32, False)
    with pytest.raises(NotImplementedError, match="key=None is not supported"):
        layer(torch.arange(2), torch.zeros(2, 64))
    with pytest.raises(TypeError, match="cfg must be a RopeConfig, got dict"):
        RotaryEmbedding({"head_dim": 64})
