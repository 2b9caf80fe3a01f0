"""Real HF ``config.json`` files' RoPE fields, keyed by model id; public as
:data:`jaxrope.models.HF_CONFIGS` (text models, the demo's) and
:data:`jaxrope.models.HF_VL_CONFIGS` (vision-language models).

Each entry keeps only what decides rotary embeddings (``model_type``, head
geometry, ``max_position_embeddings``, ``rope_theta`` / ``rotary_emb_base``,
``rope_scaling`` / ``rope_parameters``, partial-rotary fields; for a VL model also
the ``vision_config`` merge and timing fields), with the values, spellings and
nesting the published file uses, so that :meth:`RopeConfig.from_hf` is tested
against what users actually load. The comment above each entry names the model
and the public copy its numbers were checked against. Tests build transformers'
own config classes from the VL entries and compare jaxrope's rotation with
transformers' rotary classes. The parity suite's wider set (30+ models, every
family of :mod:`jaxrope.models`) is data in ``tests/data/hf_configs/``.

Example:
  >>> import jaxrope as jr
  >>> from jaxrope.models import HF_CONFIGS, HF_VL_CONFIGS
  >>> cfg = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
  >>> cfg.head_dim, cfg.rotary_dim, type(cfg.scaling).__name__
  (128, 128, 'Llama3')
  >>> HF_VL_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]["rope_scaling"]["mrope_section"]
  [16, 24, 24]
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["HF_CONFIGS", "HF_VL_CONFIGS"]

# meta-llama/Llama-3.1-8B config.json; geometry and rope_scaling checked against
# copies of the 8B config (32 heads, 8 KV heads, hidden 4096, 131072 positions).
_LLAMA_3_1_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}

# Qwen/Qwen2.5-7B-Instruct config.json (hidden 3584, 28 heads, 4 KV heads, 32768
# positions, theta 1e6) plus the rope_scaling block its model card ("Processing Long
# Texts") tells users to add for contexts past 32768, with the legacy "type" key.
_QWEN_2_5_7B_INSTRUCT_YARN = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": {
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "type": "yarn",
    },
}

# microsoft/Phi-3-mini-128k-instruct config.json (the June 2024 update, rope type
# "longrope"). Factor lists checked against two public copies: Microsoft's LongRoPE
# evaluation script (full lists) and llama.cpp-related notes quoting this config
# (head and tail of both lists, GGUF attn_factor 1.190238118171692).
_PHI_3_MINI_128K_INSTRUCT = {
    "model_type": "phi3",
    "hidden_size": 3072,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "long_factor": [
            1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558,
            1.5699999332427979, 1.7999999523162842, 2.129999876022339, 2.129999876022339,
            3.009999990463257, 5.910000324249268, 6.950000286102295, 9.070000648498535,
            9.930000305175781, 10.710000038146973, 11.130000114440918, 14.609999656677246,
            15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
            38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516,
            53.66000747680664, 54.9373893737793, 56.89738845825195, 57.28738784790039,
            59.98738479614258, 60.86738586425781, 60.887386322021484, 61.71739196777344,
            62.91739273071289, 62.957393646240234, 63.41739273071289, 63.8173942565918,
            63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
            64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906,
            64.24435424804688, 64.57435607910156, 64.69000244140625, 64.76000213623047,
        ],
        "short_factor": [
            1.1, 1.1, 1.1, 1.3000000000000003,
            1.3500000000000003, 1.3500000000000003, 1.4000000000000004, 1.5500000000000005,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.000000000000001, 2.000000000000001, 2.000000000000001,
            2.000000000000001, 2.0500000000000007, 2.0500000000000007, 2.0500000000000007,
            2.0500000000000007, 2.0500000000000007, 2.0500000000000007, 2.1000000000000005,
            2.1000000000000005, 2.1500000000000004, 2.25, 2.25,
            2.25, 2.25, 2.25, 2.3999999999999995,
            2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984,
            2.7499999999999982, 2.799999999999998, 2.8999999999999977, 3.049999999999997,
        ],
        "type": "longrope",
    },
}

# deepseek-ai/DeepSeek-V2-Lite config.json: MLA with a 64-dim rotary part, YaRN
# factor 40 over 4096 trained positions. Checked against a dump of the Lite(-Chat)
# config and several repositories reproducing its rope_scaling block.
_DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 163840,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}

# deepseek-ai/DeepSeek-V2-Lite-Chat as transformers 5.7 serialises it: rope_theta
# moved inside "rope_parameters", which carries both "rope_type" and "type".
_DEEPSEEK_V2_LITE_CHAT_V5 = {
    "model_type": "deepseek_v2",
    "head_dim": 64,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 163840,
    "rope_parameters": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "rope_theta": 10000,
        "rope_type": "yarn",
        "type": "yarn",
    },
}

# meta-llama/Llama-3.1-8B in the transformers v5 layout: the same values as above,
# with rope_scaling renamed rope_parameters and rope_theta moved into it (the layout
# of the DeepSeek-V2-Lite-Chat v5.7 dump above).
_LLAMA_3_1_8B_V5 = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_parameters": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_type": "llama3",
    },
}

# EleutherAI/gpt-neox-20b config.json: a quarter of each 96-dim head rotates, NeoX
# halves, base given as rotary_emb_base.
_GPT_NEOX_20B = {
    "model_type": "gpt_neox",
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "max_position_embeddings": 2048,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
}

# EleutherAI/gpt-j-6b config.json: GPT-2 field names, 64 of 256 dims rotate in
# interleaved pairs; no base field (10000).
_GPT_J_6B = {
    "model_type": "gptj",
    "n_embd": 4096,
    "n_head": 16,
    "n_positions": 2048,
    "rotary_dim": 64,
}

HF_CONFIGS: Dict[str, Dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B": _LLAMA_3_1_8B,
    "meta-llama/Llama-3.1-8B@transformers-v5": _LLAMA_3_1_8B_V5,
    "Qwen/Qwen2.5-7B-Instruct+yarn": _QWEN_2_5_7B_INSTRUCT_YARN,
    "microsoft/Phi-3-mini-128k-instruct": _PHI_3_MINI_128K_INSTRUCT,
    "deepseek-ai/DeepSeek-V2-Lite": _DEEPSEEK_V2_LITE,
    "deepseek-ai/DeepSeek-V2-Lite-Chat@transformers-v5": _DEEPSEEK_V2_LITE_CHAT_V5,
    "EleutherAI/gpt-neox-20b": _GPT_NEOX_20B,
    "EleutherAI/gpt-j-6b": _GPT_J_6B,
}

# Qwen/Qwen2-VL-7B-Instruct config.json (flat, transformers 4.41 layout): hidden 3584, 28
# heads, 4 KV heads, 32768 positions, theta 1e6, "type": "mrope"; checked against a
# verbatim copy in a public Qwen2-VL loading test.
_QWEN2_VL_7B = {
    "model_type": "qwen2_vl",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 14},
}

# Qwen/Qwen2.5-VL-7B-Instruct config.json: as Qwen2-VL-7B with 128000 positions and the
# vision tower's tokens_per_second 2; checked against a verbatim copy in a public
# Qwen2.5-VL modeling test.
_QWEN2_5_VL_7B = {
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128000,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 14,
                      "tokens_per_second": 2},
}

# Qwen/Qwen3-VL-4B-Instruct config.json (nested text_config, explicit head_dim 128 with
# hidden 2560 and 32 heads, 262144 positions, theta 5e6, interleaved [24, 20, 20]);
# checked against a verbatim copy in a public Qwen3-VL loader test.
_QWEN3_VL_4B = {
    "model_type": "qwen3_vl",
    "text_config": {
        "model_type": "qwen3_vl_text",
        "head_dim": 128,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 262144,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"},
        "rope_theta": 5000000,
    },
    "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 16},
}

# Qwen/Qwen3-VL-30B-A3B-Instruct config.json (the MoE: nested qwen3_vl_moe_text, head_dim
# 128, hidden 2048, 32 heads, 4 KV heads, theta 5e6, interleaved [24, 20, 20]); checked
# against a public loader test that copies the released file.
_QWEN3_VL_30B_A3B = {
    "model_type": "qwen3_vl_moe",
    "text_config": {
        "model_type": "qwen3_vl_moe_text",
        "head_dim": 128,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 262144,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"},
        "rope_theta": 5000000,
    },
    "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 16},
}

# zai-org/GLM-4.1V-9B-Thinking config.json (nested text_config: hidden 4096, 32 heads,
# 2 KV heads, partial_rotary_factor 0.5, theta 10000, 65536 positions, [8, 12, 12]);
# checked against public GLM-4V loader tests that copy its text config.
_GLM_4_1V_9B = {
    "model_type": "glm4v",
    "text_config": {
        "model_type": "glm4v_text",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 65536,
        "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]},
    },
    "vision_config": {"spatial_merge_size": 2, "temporal_patch_size": 2, "patch_size": 14},
}

HF_VL_CONFIGS: Dict[str, Dict[str, Any]] = {
    "Qwen/Qwen2-VL-7B-Instruct": _QWEN2_VL_7B,
    "Qwen/Qwen2.5-VL-7B-Instruct": _QWEN2_5_VL_7B,
    "Qwen/Qwen3-VL-4B-Instruct": _QWEN3_VL_4B,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _QWEN3_VL_30B_A3B,
    "zai-org/GLM-4.1V-9B-Thinking": _GLM_4_1V_9B,
}
