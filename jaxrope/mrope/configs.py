"""RoPE and vision-layout fields of real vision-language ``config.json`` files, by model id.

Each entry keeps what decides M-RoPE (``model_type``, head geometry,
``max_position_embeddings``, ``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``,
the ``vision_config`` merge and timing fields) with the values, spellings and nesting
of the published file; the comment above each names the public copies its numbers
were checked against. Tests build transformers' own config classes from them and
compare jaxrope's rotation with transformers' rotary classes.

Example:
  >>> from jaxrope.mrope import HF_VL_CONFIGS
  >>> HF_VL_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]["rope_scaling"]["mrope_section"]
  [16, 24, 24]
"""

from __future__ import annotations

from typing import Any, Dict

__all__ = ["HF_VL_CONFIGS"]

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
