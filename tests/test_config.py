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
from jaxrope.ops.constants import kernel_constants
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
                    original_max_position=4096, factor=32.0)),
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
    config = {"model_type": "llama", "hidden_size": 2048, "num_attention_heads": 16,
              "rope_theta": 10000.0, "max_position_embeddings": 4096, "rope_scaling": None}
    cfg = jr.RopeConfig.from_hf(config)
    assert cfg == jr.RopeConfig(head_dim=128, max_position=4096)


@pytest.mark.parametrize("rope_type, params, scaling", [
    ("linear", {"factor": 2.0}, jr.Linear(2.0)),
    ("dynamic", {"factor": 2.0}, jr.DynamicNTK(factor=2.0, original_max_position=4096)),
])
def test_linear_and_dynamic_from_hf(rope_type, params, scaling):
    config = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
              "max_position_embeddings": 4096, "rope_scaling": {"rope_type": rope_type, **params}}
    assert jr.RopeConfig.from_hf(config).scaling == scaling


class TestMaxPositionPolicy:
    def test_explicit_max_position_wins(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"], max_position=1 << 20)
        assert cfg.max_position == 1 << 20

    def test_a_served_length_past_the_accurate_range_is_refused_not_clamped(self):
        # 2**25 positions must raise, not become 2**24 without a word.
        config = dict(HF_CONFIGS["Qwen/Qwen2.5-7B-Instruct+yarn"])
        config["rope_scaling"] = dict(config["rope_scaling"], factor=1024.0)
        with pytest.raises(ValueError, match="max_position_embeddings=32768.*33554432"):
            jr.RopeConfig.from_hf(config)
        llama = dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], max_position_embeddings=1 << 25)
        with pytest.raises(ValueError, match="max_position_embeddings=33554432"):
            jr.RopeConfig.from_hf(llama)
        assert jr.RopeConfig.from_hf(llama, max_position=1 << 24).max_position == 1 << 24

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
        (dict(head_dim=64, theta=0.0), "theta"),
        (dict(head_dim=64, theta=-10000.0), "theta"),
        (dict(head_dim=64, theta=float("inf")), "theta"),
        (dict(head_dim=64, max_position=0), "max_position"),
        (dict(head_dim=64, max_position=(1 << 24) + 1), "max_position"),
        (dict(head_dim=64, rotary_dim=2, scaling=jr.DynamicNTK(2.0, 4096)), "rotary_dim"),
    ])
    def test_rope_config_bad_values(self, kwargs, name):
        with pytest.raises(ValueError, match=name):
            jr.RopeConfig(**kwargs)

    @pytest.mark.parametrize("kwargs, name", [
        (dict(head_dim="128"), "head_dim='128'"),
        (dict(head_dim=64.0), "head_dim=64.0"),
        (dict(head_dim=True), "head_dim=True"),
        (dict(head_dim=np.float64(64)), "head_dim"),
        (dict(head_dim=64, rotary_dim="32"), "rotary_dim"),
        (dict(head_dim=64, theta="1e4"), "theta"),
        (dict(head_dim=64, theta=None), "theta"),
        (dict(head_dim=64, interleave=1), "interleave"),
        (dict(head_dim=64, max_position=4096.0), "max_position"),
        (dict(head_dim=64, scaling="llama3"), "scaling='llama3'"),
        (dict(head_dim=64, scaling={"rope_type": "linear"}), "scaling"),
    ])
    def test_rope_config_wrong_types(self, kwargs, name):
        with pytest.raises(TypeError, match=name):
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
        (lambda: jr.LongRope(short_factor=(1.0, 0.0), long_factor=(1.0, 1.0),
                             original_max_position=4096), "short_factor"),
        (lambda: jr.LongRope((1.0,), (1.0,), 4096, factors="medium"), "factors"),
        (lambda: jr.Llama3(low_freq_factor=4.0, high_freq_factor=1.0), "high_freq_factor"),
        (lambda: jr.Proportional(partial_rotary_factor=1.5), "partial_rotary_factor"),
        (lambda: jr.Proportional(factor=0.0), "factor"),
    ])
    def test_scaling_bad_values(self, make, name):
        with pytest.raises(ValueError, match=name):
            make()

    @pytest.mark.parametrize("make, name", [
        (lambda: jr.Linear("2"), "Linear.factor='2'"),
        (lambda: jr.Linear(True), "Linear.factor=True"),
        (lambda: jr.DynamicNTK(factor=2.0, original_max_position=4096.0), "original_max_position"),
        (lambda: jr.Yarn(factor=4.0, original_max_position=4096, truncate="yes"), "truncate"),
        (lambda: jr.LongRope(short_factor=1.0, long_factor=(1.0,),
                             original_max_position=4096), "short_factor"),
        (lambda: jr.LongRope(short_factor=("1",), long_factor=(1.0,),
                             original_max_position=4096), r"short_factor\[0\]"),
        (lambda: jr.LongRope((1.0,), (1.0,), 4096, factors=None), "factors"),
    ])
    def test_scaling_wrong_types(self, make, name):
        with pytest.raises(TypeError, match=name):
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
        (_llama(rope_type="linear", factor="2"), "factor='2'"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], rope_theta="500000"), "rope_theta"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], rope_scaling=[8.0]), "rope_scaling"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], hidden_size=4096.0), "hidden_size"),
        (_llama(rope_type=8), "rope_type"),
    ])
    def test_from_hf_wrong_types_name_the_field(self, config, name):
        with pytest.raises(TypeError, match=name):
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
        (_llama(rope_type="longrope", short_factor=[1.0] * 64, long_factor=[1.0] * 64),
         "original_max_position_embeddings"),
        (_llama(rope_type="longrope", short_factor=[1.0] * 64,
                original_max_position_embeddings=4096), "long_factor"),
        (dict(HF_CONFIGS["meta-llama/Llama-3.1-8B"], rope_theta=0.0), "theta"),
        (dict(HF_CONFIGS["EleutherAI/gpt-neox-20b"], rotary_pct=1.5), "partial_rotary_factor"),
        (dict(HF_CONFIGS["EleutherAI/gpt-neox-20b"], rotary_pct=0.0), "partial_rotary_factor"),
        # 96 * 0.33 = 31.68: an odd rotary_dim, which the pairs cannot cover.
        (dict(HF_CONFIGS["EleutherAI/gpt-neox-20b"], rotary_pct=0.33), "partial_rotary_factor"),
        (dict(HF_CONFIGS["EleutherAI/gpt-j-6b"], rotary_dim=512), "rotary_dim"),
        ({"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3},
         "num_attention_heads"),
        ({"model_type": "llama", "rope_theta": 10000.0}, "head_dim"),
        ({"model_type": "llama", "head_dim": 64, "max_position_embeddings": 4096,
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
         "layer_type"),
    ])
    def test_from_hf_names_the_field(self, config, name):
        with pytest.raises(ValueError, match=name):
            jr.RopeConfig.from_hf(config)

    @pytest.mark.parametrize("config", [[("head_dim", 64)], 64, None])
    def test_from_hf_needs_a_dict_a_path_or_a_config_object(self, config):
        with pytest.raises(TypeError, match="config must be a dict"):
            jr.RopeConfig.from_hf(config)


class TestNumpyScalars:
    def test_numpy_integers_and_floats_are_accepted_and_stored_as_python_numbers(self):
        cfg = jr.RopeConfig(head_dim=np.int64(128), rotary_dim=np.int32(64),
                            theta=np.float32(500000.0), interleave=np.bool_(True),
                            max_position=np.int64(8192), scaling=jr.Linear(np.float64(2.0)))
        plain = jr.RopeConfig(head_dim=128, rotary_dim=64, theta=500000.0, interleave=True,
                              max_position=8192, scaling=jr.Linear(2.0))
        for name in ("head_dim", "rotary_dim", "max_position"):
            assert type(getattr(cfg, name)) is int, name
        assert type(cfg.theta) is float and type(cfg.interleave) is bool
        assert type(cfg.scaling.factor) is float
        assert cfg == plain and hash(cfg) == hash(plain) and cfg.fingerprint() == plain.fingerprint()

    def test_every_variant_normalises_numpy_fields(self):
        variants = [
            (jr.DynamicNTK(np.float32(2.0), np.int64(4096)), jr.DynamicNTK(2.0, 4096)),
            (jr.Llama3(np.float64(8.0), np.int8(1), np.float32(4.0), np.int64(8192)), jr.Llama3()),
            (jr.Yarn(np.float64(40.0), np.int32(4096), mscale=np.float64(0.707)),
             jr.Yarn(40.0, 4096, mscale=0.707)),
            (jr.LongRope(np.array([1.0, 2.0]), np.array([3.0, 4.0], np.float32), np.int64(4096),
                         factor=np.float64(32.0)),
             jr.LongRope((1.0, 2.0), (3.0, 4.0), 4096, factor=32.0)),
            (jr.Proportional(np.float32(1.0), np.float64(0.25)), jr.Proportional(1.0, 0.25)),
        ]
        for numpy_made, plain in variants:
            assert numpy_made == plain and hash(numpy_made) == hash(plain), plain
            cfg = jr.RopeConfig(head_dim=4, scaling=numpy_made)
            assert cfg.fingerprint() == jr.RopeConfig(head_dim=4, scaling=plain).fingerprint()

    def test_frequencies_accepts_a_numpy_seq_len(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])
        np.testing.assert_array_equal(cfg.frequencies(seq_len=np.int64(4097))[0],
                                      cfg.frequencies(seq_len=4097)[0])


def test_llama3_with_equal_freq_factors_is_a_step():
    # Llama 4 Scout: high_freq_factor == low_freq_factor == 1, which transformers accepts.
    cfg = jr.RopeConfig(head_dim=128, theta=500000.0, max_position=1 << 20,
                        scaling=jr.Llama3(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0))
    inv_freq, attention = cfg.frequencies()
    base, _ = jr.RopeConfig(head_dim=128, theta=500000.0).frequencies()
    long = 2 * np.pi / base > 8192
    assert long.any() and (~long).any() and attention == 1.0
    np.testing.assert_allclose(inv_freq[long], base[long] / 16.0, rtol=1e-15)
    np.testing.assert_array_equal(inv_freq[~long], base[~long])


class TestLongRopeFactors:
    cfg = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3])

    def _with(self, factors, **changes):
        scaling = dataclasses.replace(self.cfg.scaling, factors=factors)
        return dataclasses.replace(self.cfg, scaling=scaling, **changes)

    def test_auto_is_vllms_rule_long_factors_when_serving_past_the_original_length(self):
        base, _ = jr.RopeConfig(head_dim=96).frequencies()
        long = base / np.array(self.cfg.scaling.long_factor)
        short = base / np.array(self.cfg.scaling.short_factor)
        np.testing.assert_allclose(self.cfg.serving_frequencies()[0], long, rtol=1e-15)
        within = dataclasses.replace(self.cfg, max_position=4096)
        np.testing.assert_allclose(within.serving_frequencies()[0], short, rtol=1e-15)

    def test_short_and_long_are_fixed_whatever_the_length(self):
        for factors, want in (("short", self.cfg.scaling.short_factor),
                              ("long", self.cfg.scaling.long_factor)):
            for max_position in (4096, 131072):
                cfg = self._with(factors, max_position=max_position)
                for seq_len in (None, 1, 4097):
                    inv_freq, _ = cfg.frequencies(seq_len=seq_len)
                    base, _ = jr.RopeConfig(head_dim=96).frequencies()
                    np.testing.assert_allclose(inv_freq, base / np.array(want), rtol=1e-15)

    def test_the_attention_factor_does_not_depend_on_the_choice(self):
        attentions = {self._with(f).serving_frequencies()[1] for f in ("auto", "short", "long")}
        assert len(attentions) == 1

    def test_from_hf_takes_the_choice(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS[PHI3], longrope_factors="short")
        assert cfg.scaling.factors == "short"
        with pytest.raises(ValueError, match="longrope_factors"):
            jr.RopeConfig.from_hf(HF_CONFIGS[PHI3], longrope_factors="mid")

    def test_configs_that_differ_in_the_choice_differ_and_do_not_share_kernel_constants(self):
        short, long = self._with("short"), self._with("long")
        assert short != long and short.fingerprint() != long.fingerprint()
        assert not np.array_equal(kernel_constants(short)[0], kernel_constants(long)[0])


class TestCosSinCache:
    def test_layout_is_cos_of_every_frequency_then_sin_times_the_attention_factor(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS["Qwen/Qwen2.5-7B-Instruct+yarn"])
        cache = cfg.cos_sin_cache(300)
        inv_freq, attention = cfg.serving_frequencies()
        assert cache.shape == (300, 128) and cache.dtype == np.float32 and attention > 1
        angle = np.arange(300)[:, None] * inv_freq[None, :]
        np.testing.assert_allclose(cache[:, :64], np.cos(angle) * attention, rtol=0, atol=1e-6)
        np.testing.assert_allclose(cache[:, 64:], np.sin(angle) * attention, rtol=0, atol=1e-6)

    def test_flashinfer_adapter_uses_the_public_cache(self):
        from jaxrope.testing import flashinfer as fp

        cfg = jr.RopeConfig(head_dim=64, rotary_dim=32, scaling=jr.Llama3(), interleave=True)
        pos = np.array([5, 0, 9, 5], np.int32)
        table, rows = fp.cos_sin_cache(cfg, pos, dense=True)
        np.testing.assert_array_equal(table[:10], cfg.cos_sin_cache(10))
        np.testing.assert_array_equal(table[10], 0.0)  # the padding row FlashInfer over-reads
        sparse, sparse_rows = fp.cos_sin_cache(cfg, pos, dense=False)
        np.testing.assert_array_equal(sparse[sparse_rows], cfg.cos_sin_cache(10)[pos])

    @pytest.mark.parametrize("dtype, want", [(np.float16, np.float16), ("float64", np.float64),
                                             ("bfloat16", jnp.bfloat16)])
    def test_other_dtypes_round_the_float64_values(self, dtype, want):
        cfg = jr.RopeConfig(head_dim=16)
        cache = cfg.cos_sin_cache(7, dtype)
        assert cache.dtype == np.dtype(want)
        exact = cfg.cos_sin_cache(7, np.float64)
        np.testing.assert_array_equal(cache, exact.astype(want))

    @pytest.mark.parametrize("args, error", [((0,), ValueError), ((131073,), ValueError),
                                             ((7.0,), TypeError), ((7, np.int32), ValueError)])
    def test_bad_arguments_are_refused_by_name(self, args, error):
        with pytest.raises(error, match="max_position|dtype"):
            jr.RopeConfig(head_dim=16).cos_sin_cache(*args)
