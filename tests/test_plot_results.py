"""``python -m bench.plot_results`` draws the plots of docs/benchmarks.md from the tables
recorded in bench/RESULTS.md, and says which table is missing when one is."""

from __future__ import annotations

import pytest

from bench import plot_results


def test_the_tables_it_reads_are_in_results_md_and_parse_as_numbers():
    markdown = (plot_results.BENCH_DIR / "RESULTS.md").read_text()
    fused = plot_results.table(markdown, ("tokens", "Mosaic", "Triton-lowered"))
    assert [plot_results.number(r["tokens"]) for r in fused] == [512, 16384, 65536]
    assert all(plot_results.number(r["Mosaic"]) < plot_results.number(r["FlashInfer pair"])
               for r in fused)
    assert plot_results.number("82.4 (98.4%; 82.3-82.8)") == 82.4
    assert plot_results.number("**1.66e-03**") == pytest.approx(1.66e-3)


def test_a_missing_table_is_named():
    with pytest.raises(ValueError, match="'tokens', 'nothing'"):
        plot_results.table("| a | b |\n|---|---|\n| 1 | 2 |\n", ("tokens", "nothing"))
    with pytest.raises(ValueError, match="no number"):
        plot_results.number("-")


def test_it_writes_the_three_plots(tmp_path):
    pytest.importorskip("matplotlib")
    written = plot_results.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in written) == ["accuracy_position.png", "decode_latency.png",
                                               "fused_append.png"]
    assert all(p.stat().st_size > 10_000 for p in written)
