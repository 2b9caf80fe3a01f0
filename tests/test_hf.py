"""from_hf without transformers: what each family reads, refusals, layer types, NoPE layers.

The same real configs as the parity suite (``tests/data/hf_configs/``), checked here
against the facts the parity suite established, so the torch-less leg guards them too.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import warnings

import numpy as np
import pytest

import jaxrope as jr
from jaxrope import hf
from jaxrope.models import MODEL_TYPES
from jaxrope.models import HF_VL_CONFIGS
from jaxrope.mrope import hf_mrope_args, hf_text_config

DATA = os.path.join(os.path.dirname(__file__), "data", "hf_configs")
ENTRIES = {e["model_id"]: e for e in (json.load(open(p)) for p in sorted(glob.glob(
    os.path.join(DATA, "*.json"))))}


def _config(model_id):
    return json.loads(json.dumps(ENTRIES[model_id]["config"]))  # a private copy


# model id -> (head_dim, rotary_dim, interleave, theta, max_position, scaling type)
EXPECTED = {
    "CohereForAI/c4ai-command-r-v01": (128, 128, True, 8e6, 131072, None),
    "CohereForAI/c4ai-command-r7b-12-2024": (128, 128, True, 50000.0, 8192, None),
    "THUDM/glm-4-9b-chat-hf": (128, 64, True, 10000.0, 131072, None),
    "THUDM/GLM-4-9B-0414": (128, 64, True, 10000.0, 32768, None),
    "zai-org/GLM-4.5-Air": (128, 64, False, 1e6, 131072, None),
    "THUDM/chatglm3-6b-32k": (128, 64, True, 500000.0, 32768, None),
    "THUDM/chatglm3-6b": (128, 64, True, 10000.0, 8192, None),
    "THUDM/glm-4-9b-chat": (128, 64, True, 5e6, 131072, None),
    "openbmb/MiniCPM3-4B": (32, 32, False, 10000.0, 32768, jr.LongRope),
    "openbmb/MiniCPM-2B-sft-bf16": (64, 64, False, 10000.0, 4096, None),
    "meta-llama/Llama-4-Scout-17B-16E-Instruct": (128, 128, True, 500000.0, 10485760, jr.Llama3),
    "deepseek-ai/DeepSeek-V3": (64, 64, True, 10000.0, 163840, jr.Yarn),
    "deepseek-ai/DeepSeek-V2-Lite": (64, 64, True, 10000.0, 163840, jr.Yarn),
    "EleutherAI/gpt-j-6b": (256, 64, True, 10000.0, 2048, None),
    "EleutherAI/pythia-1b": (256, 64, False, 10000.0, 2048, None),
    "microsoft/Phi-3.5-mini-instruct": (96, 96, False, 10000.0, 131072, jr.LongRope),
    "microsoft/Phi-4-mini-instruct": (128, 96, False, 10000.0, 131072, jr.LongRope),
    "microsoft/phi-2": (80, 32, False, 10000.0, 2048, None),
    "openai/gpt-oss-20b": (64, 64, False, 150000.0, 131072, jr.Yarn),
    "tiiuae/falcon-7b": (64, 64, False, 10000.0, 2048, None),
    "meta-llama/Llama-3.2-1B": (64, 64, False, 500000.0, 131072, jr.Llama3),
    "google/gemma-2-9b": (256, 256, False, 10000.0, 8192, None),
    "Qwen/Qwen2-VL-7B-Instruct": (128, 128, False, 1e6, 32768, None),
    "Qwen/Qwen2.5-VL-7B-Instruct": (128, 128, False, 1e6, 128000, None),
    "Qwen/Qwen3-VL-8B-Instruct": (128, 128, False, 5e6, 262144, None),
    "THUDM/GLM-4.1V-9B-Thinking": (128, 64, True, 10000.0, 65536, None),
}
# model id -> (mrope_section, mrope_interleaved) of the M-RoPE configs; every other is 1-D.
MROPE = {
    "Qwen/Qwen2-VL-7B-Instruct": ((16, 24, 24), False),
    "Qwen/Qwen2.5-VL-7B-Instruct": ((16, 24, 24), False),
    "Qwen/Qwen3-VL-8B-Instruct": ((24, 20, 20), True),
    "THUDM/GLM-4.1V-9B-Thinking": ((8, 12, 12), False),
}


@pytest.mark.parametrize("model_id", sorted(EXPECTED))
def test_each_family_reads_its_own_fields(model_id):
    head_dim, rotary_dim, interleave, theta, max_position, scaling = EXPECTED[model_id]
    cfg = jr.RopeConfig.from_hf(_config(model_id))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.interleave) == (head_dim, rotary_dim, interleave)
    assert (cfg.theta, cfg.max_position) == (theta, max_position)
    assert type(cfg.scaling) is (type(None) if scaling is None else scaling)
    assert (cfg.mrope_section, cfg.mrope_interleaved) == MROPE.get(model_id, (None, False))


def test_every_real_config_is_read_without_a_warning():
    for model_id, entry in ENTRIES.items():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for layer_type in entry.get("layer_types", [None]):
                assert isinstance(jr.RopeConfig.from_hf(entry["config"], layer_type=layer_type),
                                  jr.RopeConfig), model_id


# -- the cases issue 14 names -----------------------------------------------------------


@pytest.mark.parametrize("model_id", ["CohereForAI/c4ai-command-r-v01", "THUDM/glm-4-9b-chat-hf"])
def test_cohere_and_glm4_9b_chat_hf_are_interleaved(model_id):
    assert jr.RopeConfig.from_hf(_config(model_id)).interleave


def test_chatglm3_6b_32k_rotates_half_of_kv_channels_at_rope_ratio_times_1e4_up_to_seq_length():
    cfg = jr.RopeConfig.from_hf(_config("THUDM/chatglm3-6b-32k"))
    assert (cfg.rotary_dim, cfg.theta, cfg.max_position) == (64, 500000.0, 32768)


def test_minicpm3_rotates_halves_although_it_has_qk_rope_head_dim():
    assert not jr.RopeConfig.from_hf(_config("openbmb/MiniCPM3-4B")).interleave


def test_llama4_reads_the_nested_text_config_and_equal_freq_factors():
    cfg = jr.RopeConfig.from_hf(_config("meta-llama/Llama-4-Scout-17B-16E-Instruct"))
    assert cfg.interleave and cfg.scaling == jr.Llama3(16.0, 1.0, 1.0, 8192)


@pytest.mark.parametrize("model_id", sorted(MROPE))
def test_mrope_models_are_read_with_their_sections_never_as_1d(model_id):
    # Read as 1-D (rope_type "mrope" taken for "default", the sections dropped), a config
    # rotates text tokens right and image tokens wrong. The layouts are the model table's.
    cfg = jr.RopeConfig.from_hf(_config(model_id))
    assert cfg.mrope_section is not None and sum(cfg.mrope_section) == cfg.rotary_dim // 2
    assert hf_mrope_args(_config(model_id)) == {
        "mrope_section": cfg.mrope_section, "mrope_interleaved": cfg.mrope_interleaved,
        "interleave": cfg.interleave}
    assert hf.nope_layers(_config(model_id)) == ()


@pytest.mark.parametrize("name", sorted(HF_VL_CONFIGS))
def test_the_vl_configs_of_jaxrope_mrope_read_as_their_mapping_says(name):
    config = HF_VL_CONFIGS[name]
    cfg = jr.RopeConfig.from_hf(config)
    args = hf_mrope_args(config)
    assert (cfg.mrope_section, cfg.mrope_interleaved, cfg.interleave) == (
        args["mrope_section"], args["mrope_interleaved"], args["interleave"])
    assert cfg.max_position == hf_text_config(config)["max_position_embeddings"]


def test_glm41v_rotates_the_half_its_partial_rotary_factor_names():
    config = _config("THUDM/GLM-4.1V-9B-Thinking")
    text = config["text_config"]
    assert jr.RopeConfig.from_hf(config).rotary_dim == 64
    # The transformers v5 layout: the fraction inside rope_parameters.
    nested = {k: v for k, v in text.items() if k not in ("partial_rotary_factor", "rope_scaling")}
    nested["rope_parameters"] = dict(text["rope_scaling"], partial_rotary_factor=0.5)
    assert jr.RopeConfig.from_hf(nested) == jr.RopeConfig.from_hf(config)
    # Without one the rotary class rotates the whole head (default 1.0): its 64 slots
    # do not fit the [8, 12, 12] sections, which transformers would fail on too.
    with pytest.raises(ValueError, match=r"mrope_section=\(8, 12, 12\) must be ints >= 0 summing "
                                         "to rotary_dim // 2 = 64"):
        jr.RopeConfig.from_hf({k: v for k, v in text.items() if k != "partial_rotary_factor"})


def test_qwen_vl_rotary_classes_rotate_the_whole_head_so_a_fraction_is_refused():
    config = dict(_config("Qwen/Qwen2-VL-7B-Instruct"), partial_rotary_factor=0.5)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 is not read by "
                                         "model_type='qwen2_vl'"):
        jr.RopeConfig.from_hf(config)


def test_qwen2_5_vl_long_context_yarn_keeps_its_sections():
    # Qwen2.5-VL's model card: YaRN past 32768 tokens, the sections inside the same block.
    config = _config("Qwen/Qwen2.5-VL-7B-Instruct")
    config["rope_scaling"] = {"type": "yarn", "mrope_section": [16, 24, 24], "factor": 4,
                              "original_max_position_embeddings": 32768}
    cfg = jr.RopeConfig.from_hf(config)
    assert cfg.mrope_section == (16, 24, 24) and cfg.scaling.factor == 4.0
    assert cfg.scaling.original_max_position == 32768 and cfg.max_position == 131072


@pytest.mark.parametrize("config, match", [
    ({"model_type": "glm4v_moe", "text_config": {
        "model_type": "glm4v_moe_text", "hidden_size": 4096, "num_attention_heads": 32,
        "max_position_embeddings": 65536, "partial_rotary_factor": 0.5,
        "rope_scaling": {"rope_type": "default", "mrope_section": [8, 12, 12]}}},
     r"^rope_scaling\.mrope_section=\[8, 12, 12\]: jaxrope implements the M-RoPE layouts"),
    ({"model_type": "glm4v_moe", "hidden_size": 4096, "num_attention_heads": 32},
     r"^model_type='glm4v_moe' \(its code rotates with M-RoPE\)"),
    ({"model_type": "ernie4_5_vl", "hidden_size": 4096, "num_attention_heads": 32,
      "max_position_embeddings": 4096, "rope_scaling": {"mrope_section": [22, 22, 20]}},
     r"not of model_type='ernie4_5_vl'"),
])
def test_mrope_layouts_jaxrope_mrope_does_not_know_are_refused(config, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ernie4_5_vl is not in the table either
        with pytest.raises(NotImplementedError, match=match):
            jr.RopeConfig.from_hf(config)


@pytest.mark.parametrize("params, field", [
    ({"rope_type": "mrope"}, "rope_scaling.rope_type"), ({"type": "mrope"}, "rope_scaling.type"),
    ({"rope_type": "default", "mrope_section": [16, 24, 24]}, "mrope_section"),
    ({"rope_type": "default", "mrope_interleaved": True}, "mrope_interleaved"),
])
def test_mrope_fields_on_a_1d_model_are_refused_by_name(params, field):
    config = dict(_config("Qwen/Qwen2.5-7B-Instruct"), rope_scaling=params)
    with pytest.raises(NotImplementedError, match=f"{field}.*not of model_type='qwen2'"):
        jr.RopeConfig.from_hf(config)
    with pytest.raises(NotImplementedError, match="mrope_section"):
        jr.RopeConfig.from_hf(dict(_config("Qwen/Qwen2.5-7B-Instruct"), mrope_section=[16, 24, 24]))


def test_mrope_keys_where_the_model_code_does_not_read_them_are_refused():
    config = _config("Qwen/Qwen2-VL-7B-Instruct")
    with pytest.raises(ValueError, match="mrope_section=.* at the top level is not read"):
        jr.RopeConfig.from_hf(dict(config, mrope_section=[16, 24, 24]))
    qwen3 = _config("Qwen/Qwen3-VL-8B-Instruct")
    qwen3["text_config"]["rope_scaling"]["mrope_interleaved"] = False
    with pytest.raises(ValueError, match="mrope_interleaved=False contradicts"):
        jr.RopeConfig.from_hf(qwen3)


def test_an_interleave_override_changes_the_pairs_not_the_sections():
    cfg = jr.RopeConfig.from_hf(_config("THUDM/GLM-4.1V-9B-Thinking"), interleave=False)
    assert not cfg.interleave and cfg.mrope_section == (8, 12, 12)


def test_gemma3_layer_types_differ_in_base_and_scaling():
    config = _config("google/gemma-3-27b-it")
    with pytest.raises(ValueError, match=r"full_attention: .*Linear.*sliding_attention: .*theta=10000"):
        jr.RopeConfig.from_hf(config)
    full = jr.RopeConfig.from_hf(config, layer_type="full_attention")
    sliding = jr.RopeConfig.from_hf(config, layer_type="sliding_attention")
    assert (full.theta, full.scaling) == (1e6, jr.Linear(8.0))
    assert (sliding.theta, sliding.scaling) == (10000.0, None)


def test_gemma3_v5_nested_rope_parameters_read_like_the_legacy_fields():
    legacy = _config("google/gemma-3-1b-it")
    nested = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_local_base_freq",
                                                          "rope_scaling")}
    nested["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    for layer_type in ("full_attention", "sliding_attention"):
        assert (jr.RopeConfig.from_hf(nested, layer_type=layer_type)
                == jr.RopeConfig.from_hf(legacy, layer_type=layer_type))


def test_gemma4_full_attention_layers_run_at_global_head_dim():
    config = _config("google/gemma-4-E2B-it")
    full = jr.RopeConfig.from_hf(config, layer_type="full_attention")
    assert (full.head_dim, full.rotary_dim, full.theta) == (512, 512, 1e6)
    assert full.scaling == jr.Proportional(1.0, 0.25)
    sliding = jr.RopeConfig.from_hf(config, layer_type="sliding_attention")
    assert (sliding.head_dim, sliding.scaling) == (256, None)
    default = dict(config["text_config"])
    del default["global_head_dim"]  # the config class's default is 512 too
    assert jr.RopeConfig.from_hf(default, layer_type="full_attention") == full


def test_gemma2_layer_types_rotate_alike_so_no_layer_type_is_needed():
    config = _config("google/gemma-2-9b")
    cfg = jr.RopeConfig.from_hf(config)
    assert all(jr.RopeConfig.from_hf(config, layer_type=t) == cfg
               for t in ("sliding_attention", "full_attention"))


def test_an_unknown_layer_type_lists_the_models_types():
    with pytest.raises(ValueError, match=r"\['full_attention', 'sliding_attention'\]"):
        jr.RopeConfig.from_hf(_config("google/gemma-2-9b"), layer_type="chunked_attention")


@pytest.mark.parametrize("model_id, nope", [
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", tuple(range(3, 48, 4))),
    ("HuggingFaceTB/SmolLM3-3B", tuple(range(3, 36, 4))),
    ("CohereForAI/c4ai-command-r7b-12-2024", tuple(range(3, 32, 4))),
    ("meta-llama/Llama-3.1-8B", ()),
    ("google/gemma-3-1b-it", ()),
])
def test_nope_layers(model_id, nope):
    assert hf.nope_layers(_config(model_id)) == nope


def test_llama4_no_rope_layers_list_and_interval_are_read():
    text = _config("meta-llama/Llama-4-Scout-17B-16E-Instruct")["text_config"]
    assert hf.nope_layers(dict(text, no_rope_layers=[1, 0, 1, 0])) == (1, 3)
    assert hf.nope_layers(dict(text, num_hidden_layers=6, no_rope_layer_interval=2)) == (1, 3, 5)


def test_a_nope_layer_type_is_refused():
    with pytest.raises(ValueError, match="apply no RoPE"):
        jr.RopeConfig.from_hf(_config("CohereForAI/c4ai-command-r7b-12-2024"),
                              layer_type="full_attention")


def test_nope_fields_on_a_model_that_does_not_read_them_are_refused():
    config = dict(_config("meta-llama/Llama-3.1-8B"), no_rope_layers=[1, 0])
    for call in (jr.RopeConfig.from_hf, hf.nope_layers):
        with pytest.raises(ValueError, match="no_rope_layers"):
            call(config)


# -- sources: a dict, a path, a config object, text_config -----------------------------


def test_a_path_to_a_config_json_or_its_directory_reads_like_the_dict(tmp_path):
    config = _config("microsoft/Phi-4-mini-instruct")
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = jr.RopeConfig.from_hf(config)
    assert jr.RopeConfig.from_hf(str(tmp_path / "config.json")) == want
    assert jr.RopeConfig.from_hf(tmp_path) == want


def test_an_object_with_to_dict_reads_like_its_dict():
    class Config:
        def to_dict(self):
            return _config("THUDM/chatglm3-6b-32k")

    assert jr.RopeConfig.from_hf(Config()) == jr.RopeConfig.from_hf(_config("THUDM/chatglm3-6b-32k"))


def test_text_config_wins_and_a_conflicting_top_level_rope_field_is_refused():
    config = _config("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert jr.RopeConfig.from_hf(config) == jr.RopeConfig.from_hf(config["text_config"])
    with pytest.raises(ValueError, match="rope_theta differs"):
        jr.RopeConfig.from_hf(dict(config, rope_theta=10000.0))


def test_from_hf_does_not_modify_its_input():
    config = _config("google/gemma-3-27b-it")
    before = json.dumps(config, sort_keys=True)
    jr.RopeConfig.from_hf(config, layer_type="full_attention")
    assert json.dumps(config, sort_keys=True) == before


# -- no silent drops --------------------------------------------------------------------


@pytest.mark.parametrize("model_id, field, value", [
    ("meta-llama/Llama-3.1-8B", "partial_rotary_factor", 0.5),   # llama rotates the whole head
    ("meta-llama/Llama-3.1-8B", "rope_local_base_freq", 10000.0),
    ("meta-llama/Llama-3.1-8B", "rotary_dim", 64),
    ("meta-llama/Llama-3.1-8B", "kv_channels", 64),
    ("EleutherAI/gpt-j-6b", "rope_theta", 500000.0),            # GPT-J's table is fixed at 1e4
    ("EleutherAI/gpt-neox-20b", "rope_theta", 500000.0),        # GPTNeoXConfig reads rotary_emb_base
    ("THUDM/chatglm3-6b-32k", "rope_scaling", {"rope_type": "linear", "factor": 2.0}),
    ("meta-llama/Llama-3.1-8B", "position_embedding_type", "alibi"),
])
def test_a_rope_field_the_model_does_not_read_is_refused_by_name(model_id, field, value):
    with pytest.raises(ValueError, match=field):
        jr.RopeConfig.from_hf(dict(_config(model_id), **{field: value}))


def test_neutral_values_of_unread_fields_pass():
    config = dict(_config("meta-llama/Llama-3.1-8B"), partial_rotary_factor=1.0, alibi=False,
                  position_embedding_type="rope")
    assert jr.RopeConfig.from_hf(config) == jr.RopeConfig.from_hf(_config("meta-llama/Llama-3.1-8B"))


def test_an_unknown_key_in_the_rope_parameters_is_refused_by_name():
    config = _config("meta-llama/Llama-3.1-8B")
    config["rope_scaling"]["beta_fast"] = 32.0  # a YaRN key in a llama3 block
    with pytest.raises(ValueError, match=r"rope_scaling\.beta_fast"):
        jr.RopeConfig.from_hf(config)


def test_dynamic_ntk_refuses_original_max_position_which_transformers_ignores_for_it():
    config = dict(_config("meta-llama/Llama-2-7b-hf"),
                  rope_scaling={"type": "dynamic", "factor": 2.0,
                                "original_max_position_embeddings": 2048})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        jr.RopeConfig.from_hf(config)


def test_a_key_known_not_to_affect_the_rotation_warns():
    config = _config("mistralai/Mistral-7B-Instruct-v0.3")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                 "llama_4_scaling_beta": 0.1}
    with pytest.warns(UserWarning, match="llama_4_scaling_beta"):
        cfg = jr.RopeConfig.from_hf(config)
    assert cfg == jr.RopeConfig.from_hf(_config("mistralai/Mistral-7B-Instruct-v0.3"))


def test_rope_scaling_and_rope_parameters_that_disagree_are_refused():
    config = dict(_config("meta-llama/Llama-3.1-8B"),
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="rope_scaling and rope_parameters"):
        jr.RopeConfig.from_hf(config)


def test_falcon_with_alibi_is_refused():
    with pytest.raises(ValueError, match="ALiBi"):
        jr.RopeConfig.from_hf(dict(_config("tiiuae/falcon-7b"), alibi=True))


# -- layout: the table, an override, unknown models --------------------------------------


def test_interleave_overrides_the_table():
    config = _config("CohereForAI/c4ai-command-r-v01")
    assert not jr.RopeConfig.from_hf(config, interleave=False).interleave
    with pytest.raises(TypeError, match="interleave"):
        jr.RopeConfig.from_hf(config, interleave=1)


def test_deepseek_v3_reads_rope_interleave():
    config = dict(_config("deepseek-ai/DeepSeek-V3"), rope_interleave=False)
    assert not jr.RopeConfig.from_hf(config).interleave


def test_an_unknown_model_type_is_read_as_halves_with_a_warning_unless_interleave_is_given():
    config = dict(_config("meta-llama/Llama-3.1-8B"), model_type="my_new_llama")
    with pytest.warns(UserWarning, match="my_new_llama.*interleave="):
        cfg = jr.RopeConfig.from_hf(config)
    assert not cfg.interleave
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jr.RopeConfig.from_hf(config, interleave=True).interleave


def test_every_row_cites_a_transformers_module_class_and_function():
    for name, row in MODEL_TYPES.items():
        module, cls, fn = row.source
        assert module and cls.endswith("RotaryEmbedding") and fn.startswith("apply_rotary"), name


# -- LongRoPE: attention factor from the config's lengths --------------------------------


@pytest.mark.parametrize("max_position", [4096, 32768, 131072])
def test_longrope_attention_factor_follows_the_config_not_the_served_length(max_position):
    cfg = jr.RopeConfig.from_hf(_config("microsoft/Phi-3.5-mini-instruct"), max_position=max_position)
    assert round(cfg.frequencies()[1], 4) == 1.1902  # transformers and vLLM: 131072 / 4096


def test_phi3_top_level_original_max_position_wins_over_the_nested_one():
    config = _config("microsoft/Phi-3.5-mini-instruct")
    config["rope_scaling"]["original_max_position_embeddings"] = 8192
    assert jr.RopeConfig.from_hf(config).scaling.original_max_position == 4096


def test_longrope_default_is_long_factors_when_serving_past_the_original_length():
    cfg = jr.RopeConfig.from_hf(_config("microsoft/Phi-3.5-mini-instruct"))
    short = dataclasses.replace(cfg.scaling, factors="short")
    assert cfg.scaling.factors == "auto"
    assert not np.array_equal(cfg.serving_frequencies()[0],
                              dataclasses.replace(cfg, scaling=short).serving_frequencies()[0])
    np.testing.assert_array_equal(cfg.serving_frequencies()[0], cfg.frequencies(seq_len=4097)[0])
