"""The bad-input catalogue as a whole: large, and every case named once across its files."""

from __future__ import annotations

from bad_input_harness import torch
from test_bad_inputs_admit_publish import ADMIT_PUBLISH_CASES
from test_bad_inputs_apply_rope import APPLY_ROPE_CASES
from test_bad_inputs_config import CONFIG_CASES
from test_bad_inputs_kv_append import KV_CASES, KV_MROPE_CORE_CASES, MROPE_KV_CASES
from test_bad_inputs_manager import MANAGER_CASES
from test_bad_inputs_mrope import MROPE_CASES
from test_bad_inputs_speculative import SPECULATIVE_CASES


def test_the_catalogue_is_large_and_its_names_distinct():
    core_cases = CONFIG_CASES + APPLY_ROPE_CASES
    bridge_cases = MANAGER_CASES + ADMIT_PUBLISH_CASES + SPECULATIVE_CASES
    names = [c.name for c in core_cases + bridge_cases + MROPE_CASES + KV_CASES
             + KV_MROPE_CORE_CASES + MROPE_KV_CASES]
    assert len(names) == len(set(names))
    assert len(core_cases) >= 25 and (torch is None or len(bridge_cases) >= 25)
