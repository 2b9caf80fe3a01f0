"""FlashInfer parity on every CI run, from outputs recorded on the GPU.

``tests/data/flashinfer_golden.npz`` (written by ``bench/record_goldens.py`` on an H200
with FlashInfer 0.5.x) holds inputs and FlashInfer's outputs for cases across every
FlashInfer rope API, both layouts, rotary fractions 0.25-1, head_dim 64/128/256, fp16
and bf16, ragged batches and positions up to 2**20. jaxrope's XLA and interpret
(Pallas kernel body) backends replay the inputs here, on CPU, and must agree with
FlashInfer within the position-dependent bound of ``jaxrope/testing/flashinfer_bounds.py`` and
with the float64 oracle within the tight one. A missing file fails: CI must check parity.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxrope.testing import flashinfer as fp
from jaxrope.testing import flashinfer_bounds as fb
from jaxrope.testing import golden

RECORDS = golden.golden_record_names()


def test_golden_file_says_which_flashinfer_and_gpu_recorded_it():
    meta = golden.golden_meta()
    if not meta["fake"]:
        assert meta["flashinfer_version"].startswith("0.5."), meta
        assert meta["gpu"] and meta["torch"] and meta["cuda"], meta
    assert meta["jax"] and meta["date_utc"], meta
    assert golden.golden_path().stat().st_size < 3 * 2 ** 20


def test_golden_cases_cover_apis_layouts_fractions_and_positions():
    golden.golden_meta()
    records = [golden.golden_record(name) for name in RECORDS]
    assert {r.api for r in records} == set(fp.APIS)
    assert {r.cfg.interleave for r in records} == {False, True}
    assert {r.dtype for r in records} == set(fp.DTYPES)
    assert {r.cfg.head_dim for r in records} == set(fp.HEAD_DIMS)
    assert {r.cfg.rotary_dim / r.cfg.head_dim for r in records} == set(fp.ROTARY_FRACTIONS)
    assert max(int(r.batch.pos_ids.max()) for r in records) == fp.MAX_POSITION
    assert any(len(r.batch.offsets) > 1 for r in records)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("name", RECORDS)
def test_jaxrope_matches_recorded_flashinfer(name, backend):
    record = golden.golden_record(name)
    if record.api == "cos_sin_cache":
        # The recorded table is what FlashInfer read: it must be the config's values. It
        # was built on another CPU, whose float64 cos may differ in the last bit: the
        # float32 tables agree within one ulp, never bit for bit.
        table, rows = fp.cos_sin_cache(record.cfg, record.batch.pos_ids, dense=record.dense_cache)
        np.testing.assert_array_max_ulp(table, record.cache[0], maxulp=1)
        np.testing.assert_array_equal(rows, record.cache[1])
    assert fp.flashinfer_kwargs(record.api, record.cfg) == record.kwargs
    ours = fp.run_jaxrope(record.cfg, record.q, record.k, record.batch.pos_ids, backend)
    for x, mine, theirs, tensor in ((record.q, ours[0], record.q_out, "q"),
                                    (record.k, ours[1], record.k_out, "k")):
        reference = fb.Reference(record.cfg, record.api, record.dtype, x, record.batch.pos_ids)
        verdict = reference.check(mine, theirs, f"{name} {tensor} {backend}")
        assert not verdict.failures, "\n".join(verdict.failures + [verdict.summary()])
        fb.warn_disagreements(verdict, f"{name} {tensor} {backend}")
        assert fb.untouched_equal(mine, x, record.cfg.rotary_dim).all()
        assert fb.untouched_equal(theirs, x, record.cfg.rotary_dim).all()
