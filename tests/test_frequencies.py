"""Inverse frequencies and attention factors against the float64 oracle, per variant."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import jaxrope as jr
from jaxrope.cases import CASES
from jaxrope.frequencies import angle_tables
from jaxrope.models import HF_CONFIGS

from jaxrope.testing import oracle

RTOL = 1e-12

CONFIGS = {**{f"case:{c.name}": c.cfg for c in CASES},
           **{f"hf:{name}": jr.RopeConfig.from_hf(d) for name, d in HF_CONFIGS.items()}}


def _seq_lens(cfg):
    original = getattr(cfg.scaling, "original_max_position", 4096)
    return [None, 0, 1, original // 2, original, original + 1, cfg.max_position]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_frequencies_match_the_oracle_at_every_sequence_length(name):
    cfg = CONFIGS[name]
    for seq_len in _seq_lens(cfg):
        inv_freq, attention = cfg.frequencies(seq_len=seq_len)
        want, want_attention = oracle.frequencies(cfg, seq_len=seq_len)
        assert inv_freq.dtype == np.float64 and inv_freq.shape == (cfg.rotary_dim // 2,)
        np.testing.assert_allclose(inv_freq, want, rtol=RTOL, atol=0, err_msg=f"{seq_len=}")
        assert attention == pytest.approx(want_attention, rel=RTOL)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_serving_frequencies_are_fixed_at_max_position(name):
    cfg = CONFIGS[name]
    inv_freq, attention = cfg.serving_frequencies()
    want, want_attention = oracle.serving_frequencies(cfg)
    np.testing.assert_allclose(inv_freq, want, rtol=RTOL, atol=0)
    assert attention == pytest.approx(want_attention, rel=RTOL)


def test_default_frequencies_are_theta_powers(rng):
    theta = float(rng.uniform(1e3, 1e7))
    cfg = jr.RopeConfig(head_dim=128, rotary_dim=96, theta=theta)
    inv_freq, attention = cfg.frequencies()
    np.testing.assert_allclose(inv_freq, [theta ** (-2 * i / 96) for i in range(48)], rtol=RTOL)
    assert inv_freq[0] == 1.0 and attention == 1.0


def test_linear_divides_every_frequency_by_factor(rng):
    factor = float(rng.uniform(1.5, 16))
    base, _ = jr.RopeConfig(head_dim=64).frequencies()
    scaled, attention = jr.RopeConfig(head_dim=64, scaling=jr.Linear(factor)).frequencies()
    np.testing.assert_allclose(scaled * factor, base, rtol=RTOL)
    assert attention == 1.0


class TestDynamicNTK:
    cfg = jr.RopeConfig(head_dim=128, max_position=65536,
                        scaling=jr.DynamicNTK(factor=4.0, original_max_position=4096))

    def test_at_or_below_the_trained_length_the_base_is_unchanged(self):
        base, _ = jr.RopeConfig(head_dim=128).frequencies()
        for seq_len in (None, 0, 1, 2048, 4096):
            inv_freq, attention = self.cfg.frequencies(seq_len=seq_len)
            np.testing.assert_allclose(inv_freq, base, rtol=RTOL, err_msg=f"{seq_len=}")
            assert attention == 1.0

    def test_past_the_trained_length_the_base_grows_with_seq_len(self):
        previous, _ = self.cfg.frequencies(seq_len=4096)
        for seq_len in (4097, 8192, 32768, 65536):
            inv_freq, _ = self.cfg.frequencies(seq_len=seq_len)
            assert inv_freq[0] == 1.0  # exponent 0 whatever the base
            assert np.all(inv_freq[1:] < previous[1:]), seq_len
            previous = inv_freq

    def test_grown_base_follows_the_ntk_formula(self):
        seq_len = 20000
        inv_freq, _ = self.cfg.frequencies(seq_len=seq_len)
        base = 10000.0 * (4.0 * seq_len / 4096 - 3.0) ** (128 / 126)
        np.testing.assert_allclose(inv_freq, oracle.default_inv_freq(base, 128), rtol=RTOL)

    def test_serving_uses_max_position(self):
        np.testing.assert_array_equal(self.cfg.serving_frequencies()[0],
                                      self.cfg.frequencies(seq_len=65536)[0])


class TestLongRope:
    params = HF_CONFIGS["microsoft/Phi-3-mini-128k-instruct"]["rope_scaling"]
    cfg = jr.RopeConfig.from_hf(HF_CONFIGS["microsoft/Phi-3-mini-128k-instruct"])

    def test_short_factors_up_to_the_original_length_long_factors_past_it(self):
        base = oracle.default_inv_freq(10000.0, 96)
        short = base / np.array(self.params["short_factor"])
        long = base / np.array(self.params["long_factor"])
        for seq_len in (None, 0, 1, 4095, 4096):
            np.testing.assert_allclose(self.cfg.frequencies(seq_len)[0], short, rtol=RTOL,
                                       err_msg=f"{seq_len=}")
        for seq_len in (4097, 131072):
            np.testing.assert_allclose(self.cfg.frequencies(seq_len)[0], long, rtol=RTOL,
                                       err_msg=f"{seq_len=}")

    def test_serving_uses_the_long_factors(self):
        np.testing.assert_array_equal(self.cfg.serving_frequencies()[0],
                                      self.cfg.frequencies(seq_len=4097)[0])

    def test_default_attention_factor_is_phi3s(self):
        # factor = 131072 / 4096 = 32; the GGUF conversion of this model records the
        # same value in float32 as rope.scaling.attn_factor = 1.190238118171692.
        _, attention = self.cfg.frequencies()
        assert attention == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=RTOL)
        # Computed on another machine: equal within one float32 ulp, not bit for bit.
        np.testing.assert_array_max_ulp(np.float32(attention), np.float32(1.190238118171692),
                                        maxulp=1)

    def test_explicit_factor_and_attention_factor_take_precedence(self):
        scaling = dataclasses.replace(self.cfg.scaling, factor=8.0)
        _, attention = dataclasses.replace(self.cfg, scaling=scaling).frequencies()
        assert attention == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)), rel=RTOL)
        scaling = dataclasses.replace(self.cfg.scaling, attention_factor=1.25)
        assert dataclasses.replace(self.cfg, scaling=scaling).frequencies()[1] == 1.25

    def test_no_extension_means_attention_factor_one(self):
        # A hand-built LongRope (factor None) takes its extension from max_position.
        scaling = dataclasses.replace(self.cfg.scaling, factor=None)
        cfg = dataclasses.replace(self.cfg, max_position=4096, scaling=scaling)
        assert cfg.frequencies()[1] == 1.0

    def test_from_hf_takes_the_extension_from_the_config_not_max_position(self):
        # Phi-3: 131072 / 4096, whatever length is served (transformers and vLLM agree).
        assert self.cfg.scaling.factor == 32.0
        cfg = dataclasses.replace(self.cfg, max_position=4096)
        assert cfg.frequencies()[1] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)),
                                                     rel=RTOL)


class TestYarn:
    def test_deepseek_form_with_equal_mscales_gives_attention_one(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS["deepseek-ai/DeepSeek-V2-Lite"])
        assert cfg.frequencies()[1] == 1.0

    def test_unequal_mscales_give_their_ratio(self):
        scaling = jr.Yarn(factor=40.0, original_max_position=4096, mscale=1.0, mscale_all_dim=0.707)
        _, attention = jr.RopeConfig(head_dim=64, scaling=scaling).frequencies()
        want = (0.1 * math.log(40) + 1) / (0.1 * 0.707 * math.log(40) + 1)
        assert attention == pytest.approx(want, rel=RTOL)

    def test_default_attention_factor_is_the_paper_mscale(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS["Qwen/Qwen2.5-7B-Instruct+yarn"])
        assert cfg.frequencies()[1] == pytest.approx(0.1 * math.log(4.0) + 1, rel=RTOL)

    def test_only_one_mscale_falls_back_to_the_default(self):
        scaling = jr.Yarn(factor=16.0, original_max_position=4096, mscale=0.707)
        _, attention = jr.RopeConfig(head_dim=64, scaling=scaling).frequencies()
        assert attention == pytest.approx(0.1 * math.log(16) + 1, rel=RTOL)

    def test_explicit_attention_factor_wins(self):
        scaling = jr.Yarn(factor=16.0, original_max_position=4096, mscale=1.0,
                          mscale_all_dim=0.5, attention_factor=0.9)
        assert jr.RopeConfig(head_dim=64, scaling=scaling).frequencies()[1] == 0.9

    def test_high_frequencies_extrapolate_low_frequencies_interpolate(self):
        cfg = jr.RopeConfig.from_hf(HF_CONFIGS["Qwen/Qwen2.5-7B-Instruct+yarn"])
        inv_freq, _ = cfg.frequencies()
        base = oracle.default_inv_freq(1e6, 128)
        ratio = base / inv_freq
        assert ratio[0] == pytest.approx(1.0, rel=RTOL)
        assert ratio[-1] == pytest.approx(4.0, rel=RTOL)
        assert np.all(np.diff(ratio) >= -1e-12) and np.any((ratio > 1.001) & (ratio < 3.999))

    def test_truncate_false_uses_the_fractional_ramp(self):
        kwargs = dict(factor=8.0, original_max_position=4096)
        truncated = jr.RopeConfig(head_dim=128, scaling=jr.Yarn(**kwargs)).frequencies()[0]
        exact = jr.RopeConfig(head_dim=128, scaling=jr.Yarn(**kwargs, truncate=False)).frequencies()[0]
        assert not np.allclose(truncated, exact, rtol=1e-6)
        want, _ = oracle.yarn(10000.0, 128, **kwargs, truncate=False)
        np.testing.assert_allclose(exact, want, rtol=RTOL)


def test_llama3_bands():
    cfg = jr.RopeConfig.from_hf(HF_CONFIGS["meta-llama/Llama-3.1-8B"])
    inv_freq, attention = cfg.frequencies()
    base = oracle.default_inv_freq(500000.0, 128)
    wavelength = 2 * np.pi / base
    high, low = wavelength < 8192 / 4.0, wavelength > 8192 / 1.0
    middle = ~high & ~low
    assert high.any() and low.any() and middle.any()
    np.testing.assert_allclose(inv_freq[high], base[high], rtol=RTOL)
    np.testing.assert_allclose(inv_freq[low], base[low] / 8.0, rtol=RTOL)
    ratio = base[middle] / inv_freq[middle]
    assert np.all((ratio > 1.0) & (ratio < 8.0))
    assert np.all(np.diff(inv_freq) < 0)
    assert attention == 1.0


def test_proportional_rotates_a_prefix_and_zeroes_the_tail():
    # Gemma 4's full_attention layers: global_head_dim 512, a quarter of the pairs rotate.
    cfg = jr.RopeConfig(head_dim=512, theta=1e6,
                        scaling=jr.Proportional(factor=1.0, partial_rotary_factor=0.25))
    inv_freq, attention = cfg.frequencies()
    assert inv_freq.shape == (256,)
    rotated = int(0.25 * 512 // 2)
    np.testing.assert_array_equal(inv_freq[rotated:], 0.0)
    # The exponent runs over the whole head, not over the rotated prefix.
    np.testing.assert_allclose(inv_freq[:rotated],
                               [1e6 ** (-2 * i / 512) for i in range(rotated)], rtol=RTOL)
    assert np.all(inv_freq[:rotated] > 0) and attention == 1.0


def test_proportional_factor_divides_the_rotated_prefix():
    scaling = jr.Proportional(factor=2.0, partial_rotary_factor=0.5)
    inv_freq, _ = jr.RopeConfig(head_dim=64, scaling=scaling).frequencies()
    plain, _ = jr.RopeConfig(head_dim=64).frequencies()
    np.testing.assert_allclose(inv_freq[:16], plain[:16] / 2, rtol=RTOL)
    np.testing.assert_array_equal(inv_freq[16:], 0.0)


@pytest.mark.parametrize("seq_len, error", [(-1, ValueError), (1.5, TypeError), ("8", TypeError)])
def test_bad_seq_len_is_rejected_by_name(seq_len, error):
    with pytest.raises(error, match="seq_len"):
        jr.RopeConfig(head_dim=64).frequencies(seq_len=seq_len)


class TestAngleTables:
    @pytest.mark.parametrize("name", sorted(CONFIGS))
    def test_parts_reconstruct_the_turn_rate(self, name):
        inv_freq, _ = CONFIGS[name].serving_frequencies()
        tables = angle_tables(inv_freq)
        assert tables.dtype == np.float32 and tables.shape == (3, inv_freq.shape[0])
        turns = inv_freq / (2 * np.pi)
        rebuilt = tables.astype(np.float64).sum(axis=0)
        nonzero = turns != 0
        np.testing.assert_array_equal(rebuilt[~nonzero], 0.0)
        np.testing.assert_allclose(rebuilt[nonzero], turns[nonzero], rtol=1e-14, atol=0)

    def test_hi_and_mid_have_at_most_12_significant_bits(self, rng):
        inv_freq = 10.0 ** rng.uniform(-9, 0.5, size=4096)
        tables = angle_tables(inv_freq)
        for part in tables[:2]:
            mantissa, _ = np.frexp(part.astype(np.float64))
            scaled = np.ldexp(mantissa, 12)
            np.testing.assert_array_equal(scaled, np.round(scaled))
        mantissa, _ = np.frexp(tables[1].astype(np.float64))
        # mid is a correction, so it has bits to carry: not all zero.
        assert np.count_nonzero(mantissa) > 0.9 * mantissa.size

    def test_products_with_12_bit_positions_are_exact_in_float32(self, rng):
        # The reason for 12-bit parts: p_hi * hi needs at most 24 significand bits.
        tables = angle_tables(10.0 ** rng.uniform(-6, 0, size=64))
        p_hi = np.float32(rng.integers(1, 4096) << 12)
        for part in tables[:2]:
            exact = p_hi.astype(np.float64) * part.astype(np.float64)
            np.testing.assert_array_equal((p_hi * part).astype(np.float64), exact)
