"""``python -m bench.accuracy`` runs and its table shows what RESULTS.md claims:
jaxrope at the bf16 floor in every band, a float32 angle far above it near 2**20."""

from __future__ import annotations

import json

from bench import accuracy


def test_accuracy_table_has_every_case_at_the_bf16_floor(capsys, tmp_path):
    accuracy.main(["--tokens", "64", "--seed", "3", "--out", str(tmp_path)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(accuracy.CASES)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ours, plain = [float(c) for c in cells[1:4]], [float(c) for c in cells[4:7]]
        assert max(ours) < 2.5e-3, row
        # Near 2**20 the float32 angle is always worse than ours, by a margin no
        # rounding noise explains.
        assert plain[2] > 1.5 * ours[2], row
    report = json.loads((tmp_path / "accuracy.json").read_text())
    assert report["info"]["command"].startswith("python -m bench.accuracy")
    assert list(report["cases"]) == [case.name for case in accuracy.CASES]
    first = report["cases"][accuracy.CASES[0].name]
    assert f"{first['ours'][0]:.2e}" == rows[0].split("|")[2].strip()
