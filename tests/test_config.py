"""RopeConfig: from_hf on real configs, fingerprints, hashing, bad inputs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope.apply import kernel_constants
from jaxrope.frequencies import angle_tables
from jaxrope.models import HF_CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHI3 = "microsoft/Phi-3-mini-128k-instruct"

# model id -> (head_dim, rotary_dim, interleave, theta, max_position, scaling)
EXPECTED = {
    "meta-llama/Llama-3.1-8B": (
        128, 128, False, 500000.0, 131072,
        jr.Llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position=8192)),
    "meta-llama/Llama-3.1-8B@transformers-v5": (
        128, 128, False, 500000.0, 131072,
        jr.Llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position=8192)),
    # max_position = factor * original: the length YaRN extends Qwen2.5 to.
    "Qwen/Qwen2.5-7B-Instruct+yarn": (
        128, 128, False, 1e6, 131072, jr.Yarn(factor=4.0, original_max_position=32768)),
    PHI3: (
        96, 96, False, 10000.0, 131072,
        jr.LongRope(short_factor=tuple(HF_CONFIGS[PHI3]["rope_scaling"]["short_factor"]),
                    long_factor=tuple(HF_CONFIGS[PHI3]["rope_scaling"]["long_factor"]),
                    original_max_position=4096)),
    # The rotary part of MLA is qk_rope_head_dim, in interleaved pairs.
    "deepseek-ai/DeepSeek-V2-Lite": (
        64, 64, True, 10000.0, 163840,
        jr.Yarn(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                mscale=0.707, mscale_all_dim=0.707)),
    "deepseek-ai/DeepSeek-V2-Lite-Chat@transformers-v5": (
        64, 64, True, 10000.0, 163840,
        jr.Yarn(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                mscale=0.707, mscale_all_dim=0.707)),
    "EleutherAI/gpt-neox-20b": (96, 24, False, 10000.0, 2048, None),
    "EleutherAI/gpt-j-6b": (256, 64, True, 10000.0, 2048, None),
    # Proportional spans the whole head; only its frequencies stop at a quarter.
    "google/gemma-4-E2B:full_attention": (
        256, 256, False, 1e6, 131072, jr.Proportional(factor=1.0, partial_rotary_factor=0.25)),
}


def test_every_hf_config_has_an_expectation():
    assert set(EXPECTED) == set(HF_CONFIGS)


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_from_hf_reads_real_configs(name):
    head_dim, rotary_dim, interleave, theta, max_position, scaling = EXPECTED[name]
    cfg = jr.RopeConfig.from_hf(HF_CONFIGS[name])
    assert (cfg.head_dim, cfg.rotary_dim, cfg.interleave) == (head_dim, rotary_dim, interleave)
    assert cfg.theta == theta and isinstance(cfg.theta, float)
    assert cfg.max_position == max_position
    assert type(cfg.scaling) is type(scaling)
    assert cfg.scaling == scaling
    want = jr.RopeConfig(head_dim=head_dim, rotary_dim=rotary_dim, theta=theta,
                         interleave=interleave, max_position=max_position, scaling=scaling)
    assert cfg == want and hash(cfg) == hash(want)
    assert cfg.fingerprint() == want.fingerprint()


def test_from_hf_does_not_modify_its_input():
    config = HF_CONFIGS[PHI3]
    before = repr(config)
    jr.RopeConfig.from_hf(config)
    assert repr(config) == before


def test_legacy_type_and_rope_type_keys_mean_the_same():
    base = dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
    scaling = dict(base["rope_scaling"])
    legacy = dict(scaling, type=scaling.pop("rope_type"))
    assert jr.RopeConfig.from_hf(dict(base, rope_scaling=legacy)) == jr.RopeConfig.from_hf(base)


def test_legacy_su_type_is_longrope():
    config = dict(HF_CONFIGS[PHI3])
    config["rope_scaling"] = dict(config["rope_scaling"], type="su")
    assert jr.RopeConfig.from_hf(config) == jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])


def test_rope_parameters_layout_matches_rope_scaling_layout():
    pairs = [("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B@transformers-v5"),
             ("deepseek-ai/DeepSeek-V2-Lite", "deepseek-ai/DeepSeek-V2-Lite-Chat@transformers-v5")]
    for old, new in pairs:
        a, b = jr.RopeConfig.from_hf(HF_CONFIGS[old]), jr.RopeConfig.from_hf(HF_CONFIGS[new])
        assert a == b and a.fingerprint() == b.fingerprint(), (old, new)


def test_rope_theta_inside_rope_parameters_wins_over_top_level():
    config = dict(HF_CONFIGS["meta-llama/Llama-3.1-8B@transformers-v5"], rope_theta=10000.0)
    assert jr.RopeConfig.from_hf(config).theta == 500000.0


def test_no_rope_scaling_is_default_rope():
    config = {"hidden_size": 2048, "num_attention_heads": 16, "rope_theta": 10000.0,
              "max_position_embeddings": 4096, "rope_scaling": None}
    cfg = jr.RopeConfig.from_hf(config)
    assert cfg == jr.RopeConfig(head_dim=128, max_position=4096)


@pytest.mark.parametrize("rope_type, params, scaling", [
    ("linear", {"factor": 2.0}, jr.Linear(2.0)),
    ("dynamic", {"factor": 2.0}, jr.DynamicNTK(factor=2.0, original_max_position=4096)),
])
def test_linear_and_dynamic_from_hf(rope_type, params, scaling):
    config = {"hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 4096,
              "rope_scaling": {"rope_type": rope_type, **params}}
    assert jr.RopeConfig.from_hf(config).scaling == scaling


class TestMaxPositionPolicy:
    def test_explicit_max_position_wins(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"], max_position=1 << 20)
        assert cfg.max_position == 1 << 20

    def test_scaled_length_is_capped_at_the_accurate_range(self):
        config = dict(HF_CONFIGS["Qwen/Qwen2.5-7B-Instruct+yarn"])
        config["rope_scaling"] = dict(config["rope_scaling"], factor=1024.0)
        assert jr.RopeConfig.from_hf(config).max_position == 1 << 24

    def test_longrope_serves_max_position_embeddings(self):
        # Phi-3 already states the extended length as max_position_embeddings.
        assert jr.RopeConfig.from_hf(HF_CONFIGS[PHI3]).max_position == 131072

    def test_max_position_past_the_accurate_range_is_rejected(self):
        with pytest.raises(ValueError, match="max_position"):
            jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"], max_position=(1 << 24) + 1)


class TestFingerprint:
    def test_is_32_bytes_and_equal_for_equal_configs(self):
        a = jr.RopeConfig(head_dim=128, theta=500000.0, scaling=jr.Llama3())
        b = jr.RopeConfig(head_dim=128, rotary_dim=128, theta=500000, scaling=jr.Llama3())
        assert a is not b and a == b
        assert isinstance(a.fingerprint(), bytes) and len(a.fingerprint()) == 32
        assert a.fingerprint() == b.fingerprint()

    def test_json_ints_and_floats_give_the_same_bytes(self):
        # from_hf passes DeepSeek's factor 40 as an int; a user writes 40.0.
        from_json = jr.RopeConfig.from_hf(HF_CONFIGS["deepseek-ai/DeepSeek-V2-Lite"])
        by_hand = jr.RopeConfig(head_dim=64, interleave=True, max_position=163840,
                                scaling=jr.Yarn(factor=40.0, original_max_position=4096,
                                                mscale=0.707, mscale_all_dim=0.707))
        assert from_json == by_hand
        assert from_json.fingerprint() == by_hand.fingerprint()

    def test_a_subprocess_computes_the_same_bytes(self):
        names = sorted(HF_CONFIGS)
        script = ("import sys, jaxrope as jr; from jaxrope.models import HF_CONFIGS as H; "
                  "print(' '.join(jr.RopeConfig.from_hf(H[n]).fingerprint().hex() "
                  "for n in sys.argv[1:]))")
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", script, *names], env=env, cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        assert out == [jr.RopeConfig.from_hf(HF_CONFIGS[n]).fingerprint().hex() for n in names]

    @staticmethod
    def _one_field_changes():
        llama = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
        phi = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])
        deepseek = jr.RopeConfig.from_hf(HF_CONFIGS["deepseek-ai/DeepSeek-V2-Lite"])
        long_factor = list(phi.scaling.long_factor)
        long_factor[17] = np.nextafter(long_factor[17], np.inf)
        short_factor = list(phi.scaling.short_factor)
        short_factor[0] = 1.2
        replace = dataclasses.replace
        return [
            ("theta", llama, replace(llama, theta=np.nextafter(500000.0, np.inf))),
            ("head_dim", llama, replace(llama, head_dim=256)),
            ("rotary_dim", llama, replace(llama, rotary_dim=64)),
            ("interleave", llama, replace(llama, interleave=True)),
            ("max_position", llama, replace(llama, max_position=131071)),
            ("scaling None", jr.RopeConfig(head_dim=64), jr.RopeConfig(head_dim=64,
                                                                       scaling=jr.Linear(1.0))),
            ("scaling type", jr.RopeConfig(head_dim=64, scaling=jr.Linear(2.0)),
             jr.RopeConfig(head_dim=64, scaling=jr.Proportional(factor=2.0))),
            ("llama3 factor", llama, replace(llama, scaling=replace(llama.scaling, factor=8.5))),
            ("llama3 low_freq_factor", llama,
             replace(llama, scaling=replace(llama.scaling, low_freq_factor=1.5))),
            ("longrope long_factor[17]", phi,
             replace(phi, scaling=replace(phi.scaling, long_factor=tuple(long_factor)))),
            ("longrope short_factor[0]", phi,
             replace(phi, scaling=replace(phi.scaling, short_factor=tuple(short_factor)))),
            ("longrope original", phi,
             replace(phi, scaling=replace(phi.scaling, original_max_position=8192))),
            ("yarn mscale", deepseek, replace(deepseek, scaling=replace(deepseek.scaling,
                                                                        mscale=0.708))),
            ("yarn mscale_all_dim", deepseek,
             replace(deepseek, scaling=replace(deepseek.scaling, mscale_all_dim=0.7))),
            ("yarn truncate", deepseek,
             replace(deepseek, scaling=replace(deepseek.scaling, truncate=False))),
            ("yarn beta_fast", deepseek,
             replace(deepseek, scaling=replace(deepseek.scaling, beta_fast=16.0))),
            ("yarn attention_factor", deepseek,
             replace(deepseek, scaling=replace(deepseek.scaling, attention_factor=1.0))),
        ]

    def test_changing_any_single_field_changes_the_bytes(self):
        changes = self._one_field_changes()
        for what, a, b in changes:
            assert a != b, what
            assert a.fingerprint() != b.fingerprint(), what
        every = {a.fingerprint() for _, a, _ in changes} | {b.fingerprint() for _, _, b in changes}
        assert len(every) == len({a for _, a, _ in changes} | {b for _, _, b in changes})

    def test_kernel_constants_never_collide_across_one_field_changes(self):
        # Each config, asked right after its neighbour was cached, gets its own values.
        for what, a, b in self._one_field_changes():
            for cfg in (a, b):
                tables, attention = kernel_constants(cfg)
                inv_freq, want_attention = cfg.serving_frequencies()
                np.testing.assert_array_equal(tables, angle_tables(inv_freq), err_msg=what)
                assert attention == want_attention, what
        llama = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
        other = dataclasses.replace(llama, theta=np.nextafter(500000.0, np.inf))
        assert not np.array_equal(kernel_constants(llama)[0], kernel_constants(other)[0])


class TestHashableStatic:
    def test_equal_configs_hash_equal_and_serve_as_dict_keys(self):
        a = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])
        b = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])
        assert a is not b and hash(a) == hash(b) and {a: 1}[b] == 1

    def test_config_is_a_static_jit_argument_traced_once_per_value(self):
        traces = []

        def f(x, cfg):
            traces.append(cfg)
            return x * cfg.theta

        g = jax.jit(f, static_argnums=1)
        x = jnp.arange(3.0)
        a = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
        b = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B@transformers-v5"])
        np.testing.assert_allclose(g(x, a), x * 500000.0)
        np.testing.assert_allclose(g(x, b), x * 500000.0)
        assert len(traces) == 1
        g(x, dataclasses.replace(a, theta=10000.0))
        assert len(traces) == 2

    def test_configs_are_frozen(self):
        cfg = jr.RopeConfig(head_dim=64)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.theta = 1.0
        with pytest.raises(dataclasses.FrozenInstanceError):
            jr.Linear(2.0).factor = 3.0


def _llama(**rope_scaling):
    config = dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
    config["rope_scaling"] = rope_scaling
    return config


class TestBadInputs:
    @pytest.mark.parametrize("kwargs, name", [
        (dict(head_dim=64, rotary_dim=33), "rotary_dim"),
        (dict(head_dim=64, rotary_dim=66), "rotary_dim"),
        (dict(head_dim=64, rotary_dim=0), "rotary_dim"),
        (dict(head_dim=63), "head_dim"),
        (dict(head_dim=0), "head_dim"),
        (dict(head_dim=64.0), "head_dim"),
        (dict(head_dim=64, theta=0.0), "theta"),
        (dict(head_dim=64, theta=-10000.0), "theta"),
        (dict(head_dim=64, theta=float("inf")), "theta"),
        (dict(head_dim=64, interleave=1), "interleave"),
        (dict(head_dim=64, max_position=0), "max_position"),
        (dict(head_dim=64, scaling="llama3"), "scaling"),
        (dict(head_dim=64, rotary_dim=2, scaling=jr.DynamicNTK(2.0, 4096)), "rotary_dim"),
    ])
    def test_rope_config_fields(self, kwargs, name):
        with pytest.raises(ValueError, match=name):
            jr.RopeConfig(**kwargs)

    @pytest.mark.parametrize("make, name", [
        (lambda: jr.Linear(0.0), "factor"),
        (lambda: jr.Linear(-2.0), "factor"),
        (lambda: jr.DynamicNTK(factor=0.0, original_max_position=4096), "factor"),
        (lambda: jr.DynamicNTK(factor=2.0, original_max_position=0), "original_max_position"),
        (lambda: jr.Llama3(factor=0.0), "factor"),
        (lambda: jr.Llama3(low_freq_factor=4.0, high_freq_factor=1.0), "high_freq_factor"),
        (lambda: jr.Yarn(factor=-1.0, original_max_position=4096), "factor"),
        (lambda: jr.Yarn(factor=4.0, original_max_position=4096, mscale=0.0), "mscale"),
        (lambda: jr.Yarn(factor=4.0, original_max_position=4096, truncate="yes"), "truncate"),
        (lambda: jr.LongRope(short_factor=(1.0, 0.0), long_factor=(1.0, 1.0),
                             original_max_position=4096), "short_factor"),
        (lambda: jr.LongRope(short_factor=1.0, long_factor=(1.0,),
                             original_max_position=4096), "short_factor"),
        (lambda: jr.Proportional(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (lambda: jr.Proportional(factor=0.0), "factor"),
    ])
    def test_scaling_fields(self, make, name):
        with pytest.raises(ValueError, match=name):
            make()

    @pytest.mark.parametrize("which", ["short_factor", "long_factor"])
    def test_longrope_factor_lists_of_the_wrong_length(self, which):
        phi = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])
        wrong = dataclasses.replace(phi.scaling, **{which: getattr(phi.scaling, which)[:-1]})
        with pytest.raises(ValueError, match=which):
            dataclasses.replace(phi, scaling=wrong)
        config = dict(HF_CONFIGS[PHI3])
        config["rope_scaling"] = dict(config["rope_scaling"],
                                      **{which: config["rope_scaling"][which] * 2})
        with pytest.raises(ValueError, match=which):
            jr.RopeConfig.from_hf(config)

    @pytest.mark.parametrize("config, name", [
        (_llama(rope_type="ntk-by-parts", factor=2.0), "rope_type"),
        (_llama(type="unknown"), "rope_type"),
        (_llama(rope_type="llama3", factor=8.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192), "low_freq_factor"),
        (_llama(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0),
         "original_max_position_embeddings"),
        (_llama(rope_type="linear"), "factor"),
        (_llama(rope_type="linear", factor=0), "factor"),
        (_llama(rope_type="linear", factor="2"), "factor"),
        (_llama(rope_type="longrope", short_factor=[1.0] * 64, long_factor=[1.0] * 64),
         "original_max_position_embeddings"),
        (_llama(rope_type="longrope", short_factor=[1.0] * 64,
                original_max_position_embeddings=4096), "long_factor"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], rope_theta=0.0), "theta"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], rope_theta="500000"), "rope_theta"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], rope_scaling=[8.0]), "rope_scaling"),
        (dict(HF_CONFIGS["EleutherAI/gpt-neox-20b"], rotary_pct=1.5), "partial_rotary_factor"),
        (dict(HF_CONFIGS["EleutherAI/gpt-neox-20b"], rotary_pct=0.0), "partial_rotary_factor"),
        # 96 * 0.33 = 31.68: an odd rotary_dim, which the pairs cannot cover.
        (dict(HF_CONFIGS["EleutherAI/gpt-neox-20b"], rotary_pct=0.33), "partial_rotary_factor"),
        (dict(HF_CONFIGS["EleutherAI/gpt-j-6b"], rotary_dim=512), "rotary_dim"),
        ({"hidden_size": 100, "num_attention_heads": 3}, "num_attention_heads"),
        ({"rope_theta": 10000.0}, "head_dim"),
        ({"head_dim": 64, "rope_parameters": {
            "full_attention": {"rope_type": "default"},
            "sliding_attention": {"rope_type": "default"}}}, "rope_parameters"),
    ])
    def test_from_hf_names_the_field(self, config, name):
        with pytest.raises(ValueError, match=name):
            jr.RopeConfig.from_hf(config)

    def test_from_hf_needs_a_mapping(self):
        with pytest.raises(ValueError, match="config"):
            jr.RopeConfig.from_hf([("head_dim", 64)])
