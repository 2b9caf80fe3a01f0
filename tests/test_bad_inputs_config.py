"""Bad input to RopeConfig, its scaling variants and from_hf: each refused naming the
argument, nothing changed (:mod:`bad_input_harness`)."""

from __future__ import annotations

import pytest

import jaxrope as jr

from bad_input_harness import Bad, core_raises_naming_it_and_changes_nothing

CONFIG_CASES = [
    Bad("config odd head_dim", lambda e: jr.RopeConfig(head_dim=7), ValueError, "head_dim=7"),
    Bad("config rotary_dim > head_dim", lambda e: jr.RopeConfig(head_dim=16, rotary_dim=18),
        ValueError, "rotary_dim=18"),
    Bad("config NaN theta", lambda e: jr.RopeConfig(head_dim=16, theta=float("nan")), ValueError,
        "theta=nan"),
    Bad("config negative theta", lambda e: jr.RopeConfig(head_dim=16, theta=-1.0), ValueError,
        "theta=-1.0"),
    Bad("config zero max_position", lambda e: jr.RopeConfig(head_dim=16, max_position=0),
        ValueError, "max_position=0"),
    Bad("config max_position past the accurate range",
        lambda e: jr.RopeConfig(head_dim=16, max_position=2**25), ValueError, "max_position=33554432"),
    Bad("config scaling given as a string", lambda e: jr.RopeConfig(head_dim=16, scaling="linear"),
        TypeError, "scaling='linear'"),
    Bad("config interleave given as an int", lambda e: jr.RopeConfig(head_dim=16, interleave=1),
        TypeError, "interleave=1"),
    Bad("config head_dim given as a string", lambda e: jr.RopeConfig(head_dim="128"),
        TypeError, "head_dim='128'"),
    Bad("Linear factor negative", lambda e: jr.Linear(factor=-2.0),
        ValueError, "Linear.factor=-2.0"),
    Bad("Llama3 high_freq_factor <= low_freq_factor",
        lambda e: jr.Llama3(low_freq_factor=4.0, high_freq_factor=1.0), ValueError,
        "Llama3.high_freq_factor=1.0"),
    Bad("Yarn zero factor", lambda e: jr.Yarn(factor=0, original_max_position=4096), ValueError,
        "Yarn.factor=0"),
    Bad("LongRope factors of the wrong length",
        lambda e: jr.RopeConfig(head_dim=16, scaling=jr.LongRope((1.0,) * 3, (1.0,) * 3, 4096)),
        ValueError, "LongRope.short_factor"),
    Bad("from_hf unknown rope type",
        lambda e: jr.RopeConfig.from_hf({"model_type": "llama", "head_dim": 64,
                                         "rope_scaling": {"rope_type": "bogus"}}),
        ValueError, "rope_type='bogus'"),
    Bad("from_hf partial_rotary_factor > 1",
        lambda e: jr.RopeConfig.from_hf({"model_type": "phi3", "head_dim": 64,
                                         "partial_rotary_factor": 1.5}),
        ValueError, "partial_rotary_factor=1.5"),
    Bad("from_hf given a list", lambda e: jr.RopeConfig.from_hf([("head_dim", 64)]), TypeError,
        "config must be a dict"),
    Bad("frequencies at a negative seq_len", lambda e: e.cfg.frequencies(seq_len=-1), ValueError,
        "seq_len=-1"),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.name)
def test_config_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    core_raises_naming_it_and_changes_nothing(case)
