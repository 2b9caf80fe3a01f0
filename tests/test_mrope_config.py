"""M-RoPE fields of RopeConfig (validation, hashing, fingerprints) and the HF VL config
mapping of jaxrope.mrope.hf, on real configs."""

from __future__ import annotations

import dataclasses
import os

import pytest

import jaxrope as jr
from jaxrope.ops.constants import kernel_constants
from jaxrope.models import HF_CONFIGS
from jaxrope.models import HF_VL_CONFIGS
from jaxrope.mrope import hf_index_args, hf_mrope_args, hf_text_config

REQUIRE_TRANSFORMERS = os.environ.get("JAXROPE_REQUIRE_TRANSFORMERS") == "1"

# Fingerprints recorded before M-RoPE existed (commit 5c55bbb): 1-D configs must keep
# their bytes, since prefix caches are keyed by them.
ONE_D_FINGERPRINTS = [
    (jr.RopeConfig(head_dim=64), "aef79be698b3ba8f3f689a94141869d55fac912be93eb3280df661549ae6ff5f"),
    (jr.RopeConfig(head_dim=128, rotary_dim=64, interleave=True, theta=1e6, max_position=32768),
     "4aacd48c7191bec595b38019e3e38df85c2a3136276aef5be8e46bab7e0d4cee"),
    (jr.RopeConfig(head_dim=128, theta=500000.0, max_position=131072,
                   scaling=jr.Llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position=8192)),
     "e330fcb0b8173bef234653469ca51f5416076b09532243238c1314333176f2f6"),
]

QWEN2_VL = jr.RopeConfig(head_dim=128, theta=1e6, mrope_section=(16, 24, 24))


def _transformers():
    if REQUIRE_TRANSFORMERS:
        import transformers
        return transformers
    pytest.importorskip("torch", reason="transformers' configs need torch")
    return pytest.importorskip("transformers")


class TestFields:
    def test_a_1d_config_has_no_section_and_is_not_interleaved(self):
        cfg = jr.RopeConfig(head_dim=128)
        assert cfg.mrope_section is None and cfg.mrope_interleaved is False

    def test_a_list_section_is_stored_as_a_tuple_and_hashes(self):
        cfg = jr.RopeConfig(head_dim=128, theta=1e6, mrope_section=[16, 24, 24])
        assert cfg.mrope_section == (16, 24, 24) and cfg == QWEN2_VL
        assert hash(cfg) == hash(QWEN2_VL) and {cfg: 1}[QWEN2_VL] == 1

    @pytest.mark.parametrize("section, interleaved, rotary_dim", [
        ((16, 24, 24), False, 128), ((24, 20, 20), True, 128), ((8, 12, 12), False, 64),
        ((64, 0, 0), False, 128), ((0, 0, 64), False, 128), ((0, 32, 32), False, 128),
        # Qwen3.5's [11, 11, 10] over 32 slots: the h run ends at slot 31, the last.
        ((11, 11, 10), True, 64), ((22, 21, 21), True, 128), ((64, 0, 0), True, 128)])
    def test_valid_sections(self, section, interleaved, rotary_dim):
        cfg = jr.RopeConfig(head_dim=128, rotary_dim=rotary_dim, mrope_section=section,
                            mrope_interleaved=interleaved)
        assert cfg.mrope_section == section

    @pytest.mark.parametrize("section, interleaved, match", [
        ((16, 24, 23), False, r"summing to rotary_dim // 2 = 64"),
        ((16, 24, 25), False, r"summing to rotary_dim // 2 = 64"),
        ((-1, 33, 32), False, r"ints >= 0"),
        # h slots 1, 4, ..., 64 and w slots 2, ..., 65 would run past slot 63.
        ((20, 22, 22), True, r"3 \* s_h <= 65, 3 \* s_w <= 64"),
        ((0, 32, 32), True, r"both runs must end inside rotary_dim // 2 = 64 slots"),
        ((20, 21, 23), True, r"mrope_interleaved=True places h at slots"),
    ])
    def test_inconsistent_sections_are_refused(self, section, interleaved, match):
        with pytest.raises(ValueError, match=match):
            jr.RopeConfig(head_dim=128, mrope_section=section, mrope_interleaved=interleaved)

    @pytest.mark.parametrize("section", [(16, 24), (16, 24, 24, 0), (16.0, 24, 24), (True, 31, 32),
                                         "16,24,24", 64])
    def test_a_section_that_is_not_three_ints_is_a_type_error(self, section):
        with pytest.raises(TypeError, match="mrope_section=.* must be three ints"):
            jr.RopeConfig(head_dim=128, mrope_section=section)

    def test_interleaved_needs_a_section_and_a_bool(self):
        with pytest.raises(ValueError, match="mrope_interleaved=True needs an mrope_section"):
            jr.RopeConfig(head_dim=128, mrope_interleaved=True)
        with pytest.raises(TypeError, match="mrope_interleaved=1 must be a bool"):
            jr.RopeConfig(head_dim=128, mrope_section=(24, 20, 20), mrope_interleaved=1)

    def test_the_section_counts_the_rotated_pairs_of_partial_rotary(self):
        with pytest.raises(ValueError, match="rotary_dim // 2 = 32"):
            jr.RopeConfig(head_dim=128, rotary_dim=64, mrope_section=(16, 24, 24))


class TestFingerprint:
    @pytest.mark.parametrize("cfg, digest", ONE_D_FINGERPRINTS)
    def test_1d_configs_keep_their_pinned_fingerprints(self, cfg, digest):
        assert cfg.fingerprint().hex() == digest

    def test_an_mrope_config_is_pinned_too(self):
        # Pinned like the 1-D ones: a change here invalidates caches keyed by it.
        assert QWEN2_VL.fingerprint().hex() == (
            "89b74f80a6555617d0775d84e57552f4487d3d50f838b01965795f5f62ee839b")

    def test_configs_differing_only_in_mrope_fields_never_collide(self):
        base = jr.RopeConfig(head_dim=128, theta=1e6)
        replace = dataclasses.replace
        configs = [base, replace(base, mrope_section=(16, 24, 24)),
                   replace(base, mrope_section=(24, 16, 24)),
                   replace(base, mrope_section=(24, 20, 20)),
                   replace(base, mrope_section=(24, 20, 20), mrope_interleaved=True),
                   replace(base, mrope_section=(64, 0, 0)),
                   replace(base, mrope_section=(64, 0, 0), mrope_interleaved=True)]
        assert len(set(configs)) == len(configs)
        assert len({c.fingerprint() for c in configs}) == len(configs)
        # The frequencies do not depend on the rows: one table serves every layout.
        assert all((kernel_constants(c)[0] == kernel_constants(base)[0]).all() for c in configs)


# model id -> (head_dim, rotary_dim, theta, mrope_section, mrope_interleaved, interleave),
# the RopeConfig geometry each model's transformers classes use.
EXPECTED = {
    "Qwen/Qwen2-VL-7B-Instruct": (128, 128, 1e6, (16, 24, 24), False, False),
    "Qwen/Qwen2.5-VL-7B-Instruct": (128, 128, 1e6, (16, 24, 24), False, False),
    "Qwen/Qwen3-VL-4B-Instruct": (128, 128, 5e6, (24, 20, 20), True, False),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (128, 128, 5e6, (24, 20, 20), True, False),
    "zai-org/GLM-4.1V-9B-Thinking": (128, 64, 1e4, (8, 12, 12), False, True),
}
INDEX_ARGS = {
    "Qwen/Qwen2-VL-7B-Instruct": ("qwen2_vl", 2, None),
    "Qwen/Qwen2.5-VL-7B-Instruct": ("qwen2_5_vl", 2, 2),
    "Qwen/Qwen3-VL-4B-Instruct": ("qwen3_vl", 2, None),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ("qwen3_vl", 2, None),
    "zai-org/GLM-4.1V-9B-Thinking": ("glm4v", 2, None),
}


def expected_config(name: str) -> jr.RopeConfig:
    head_dim, rotary_dim, theta, section, interleaved, pairs = EXPECTED[name]
    return jr.RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta, interleave=pairs,
                         mrope_section=section, mrope_interleaved=interleaved)


class TestHfMapping:
    def test_every_vl_config_has_an_expectation(self):
        assert set(EXPECTED) == set(HF_VL_CONFIGS) == set(INDEX_ARGS)

    @pytest.mark.parametrize("name", sorted(HF_VL_CONFIGS))
    def test_mrope_args_of_real_configs(self, name):
        *_, section, interleaved, pairs = EXPECTED[name]
        assert hf_mrope_args(HF_VL_CONFIGS[name]) == {
            "mrope_section": section, "mrope_interleaved": interleaved, "interleave": pairs}

    @pytest.mark.parametrize("name", sorted(HF_VL_CONFIGS))
    def test_index_args_of_real_configs(self, name):
        family, merge, tokens_per_second = INDEX_ARGS[name]
        assert hf_index_args(HF_VL_CONFIGS[name]) == {
            "family": family, "spatial_merge_size": merge, "tokens_per_second": tokens_per_second}

    @pytest.mark.parametrize("name", sorted(HF_VL_CONFIGS))
    def test_transformers_v5_serialisation_maps_the_same(self, name):
        # transformers' config class nests the text fields under text_config with
        # rope_parameters: the layout transformers 5 writes back to config.json.
        _transformers()
        from jaxrope.testing import transformers_mrope
        config = HF_VL_CONFIGS[name]
        written = transformers_mrope.vl_config(config).to_dict()
        assert "text_config" in written
        assert hf_mrope_args(written) == hf_mrope_args(config)
        assert hf_index_args(written) == hf_index_args(config)

    def test_the_text_config_of_a_nested_config_and_of_a_flat_one(self):
        glm = HF_VL_CONFIGS["zai-org/GLM-4.1V-9B-Thinking"]
        assert hf_text_config(glm) is glm["text_config"]
        flat = HF_VL_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"]
        assert hf_text_config(flat) is flat

    def test_a_standalone_text_config_maps_like_its_vl_config(self):
        text = HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"]["text_config"]
        assert hf_mrope_args(text) == hf_mrope_args(HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"])

    @pytest.mark.parametrize("name", sorted(HF_CONFIGS))
    def test_1d_configs_have_no_mrope_args(self, name):
        assert hf_mrope_args(HF_CONFIGS[name]) is None

    def test_a_missing_section_takes_transformers_default(self):
        config = dict(HF_VL_CONFIGS["Qwen/Qwen2-VL-7B-Instruct"], rope_scaling={"type": "mrope"})
        assert hf_mrope_args(config)["mrope_section"] == (16, 24, 24)

    def test_a_section_on_an_unknown_model_type_is_refused(self):
        config = {"model_type": "ernie4_5_vl", "rope_scaling": {"mrope_section": [22, 22, 20]}}
        with pytest.raises(ValueError, match="model_type='ernie4_5_vl' .* layout is not known"):
            hf_mrope_args(config)
        with pytest.raises(ValueError, match="not an M-RoPE model known here"):
            hf_index_args(config)

    def test_a_flag_the_model_code_contradicts_is_refused(self):
        config = HF_VL_CONFIGS["Qwen/Qwen3-VL-4B-Instruct"]
        text = dict(config["text_config"], rope_scaling=dict(config["text_config"]["rope_scaling"],
                                                             mrope_interleaved=False))
        with pytest.raises(ValueError, match="mrope_interleaved=False contradicts "
                                             "model_type='qwen3_vl'"):
            hf_mrope_args(dict(config, text_config=text))

    def test_a_config_must_be_a_dict(self):
        with pytest.raises(TypeError, match="config must be a dict"):
            hf_mrope_args([("model_type", "qwen2_vl")])

    @pytest.mark.parametrize("name", sorted(HF_VL_CONFIGS))
    def test_the_mapped_config_is_the_expected_rope_config(self, name):
        head_dim, rotary_dim, theta, *_ = EXPECTED[name]
        cfg = jr.RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta,
                            **hf_mrope_args(HF_VL_CONFIGS[name]))
        assert cfg == expected_config(name)
