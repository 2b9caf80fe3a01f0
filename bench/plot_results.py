"""The plots of ``docs/benchmarks.md``, drawn from the tables recorded in ``bench/RESULTS.md``.

``python -m bench.plot_results [--results bench/RESULTS.md] [--out bench]`` writes

- ``fused_append.png``: the fused RoPE + paged KV append against FlashInfer's rope +
  append pair and the byte ceiling, time relative to the pair (table "Mosaic GPU fused");
- ``decode_latency.png``: median time per call against tokens, both axes logarithmic, so
  the decode sizes (1-512 tokens) read as clearly as the prefill ones (the rope_bench
  table "Median us");
- ``accuracy_position.png``: bf16 relative error against float64 as positions grow, the
  accurate angle against a float32 one and FlashInfer (tables "Accuracy vs float64").

Each table is found by the first cells of its header row, so a refreshed RESULTS.md
replots with no edit here; a table that is missing raises ``ValueError`` naming it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Dict, List, Sequence

BENCH_DIR = Path(__file__).resolve().parent
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def table(markdown: str, header_start: Sequence[str]) -> List[Dict[str, str]]:
    """The first markdown table whose header row begins with ``header_start``, as dicts."""
    lines = markdown.splitlines()
    for i, line in enumerate(lines):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[:len(header_start)] == list(header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cells, (c.strip() for c in row.strip().strip("|").split("|")))))
            return rows
    raise ValueError(f"no table whose header starts with {list(header_start)} in RESULTS.md")


def number(cell: str) -> float:
    """The first number of a cell: ``"82.4 (98.4%; 82.3-82.8)"`` -> 82.4."""
    match = _NUMBER.search(cell.replace("**", ""))
    if match is None:
        raise ValueError(f"cell {cell!r} holds no number")
    return float(match.group())


def _figure(title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3, which="both")
    return plt, fig, ax


def _save(plt, fig, ax, path: Path) -> Path:
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_fused_append(markdown: str, path: Path) -> Path:
    rows = table(markdown, ("tokens", "Mosaic", "Triton-lowered"))
    tokens = [int(number(r["tokens"])) for r in rows]
    columns = {"Mosaic GPU kernel": "Mosaic", "Triton-lowered kernel": "Triton-lowered",
               "torch bridge (auto)": next(k for k in rows[0] if k.startswith("bridge (")),
               "byte ceiling": "ceiling"}
    plt, fig, ax = _figure("RoPE + paged KV append, bf16 Hq 32 / Hk 8 / D 128, pages of 16 "
                           "at random (H200):\ntime relative to FlashInfer's rope + append pair")
    width = 0.8 / len(columns)
    for j, (label, key) in enumerate(columns.items()):
        ratios = [number(r[key]) / number(r["FlashInfer pair"]) for r in rows]
        ax.bar([i + (j - (len(columns) - 1) / 2) * width for i in range(len(rows))], ratios,
               width, label=label, hatch="//" if key == "ceiling" else None)
    ax.axhline(1.0, color="black", linewidth=1, label="FlashInfer pair")
    ax.set_xticks(range(len(rows)), [f"{t} tokens" for t in tokens])
    ax.set_ylabel("time / FlashInfer's pair (lower is faster)")
    ax.set_ylim(0, 1.1)
    return _save(plt, fig, ax, path)


def plot_decode_latency(markdown: str, path: Path) -> Path:
    rows = table(markdown, ("tokens", "jaxrope", "jaxrope_torch"))
    tokens = [int(number(r["tokens"])) for r in rows]
    plt, fig, ax = _figure("RoPE in place, bf16 Hq 32 / Hk 8 / D 128 (H200):\nmedian time per "
                           "application, back to back")
    for impl, label in (("jaxrope", "jaxrope, Triton-lowered"), ("jaxrope_mosaic", "jaxrope, Mosaic GPU"),
                        ("flashinfer", "FlashInfer"), ("xla", "XLA"), ("ceiling", "in-place copy ceiling")):
        ax.plot(tokens, [number(r[impl]) for r in rows], marker="o", label=label,
                linestyle="--" if impl == "ceiling" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens (decode: one a request)")
    ax.set_ylabel("us per application (log)")
    return _save(plt, fig, ax, path)


def plot_accuracy(markdown: str, path: Path) -> Path:
    rows = {r["case (R/D)"].split()[0]: r
            for r in table(markdown, ("case (R/D)", "< 2^12", "< 2^17", "< 2^20"))}
    case = rows["llama3_8b"]
    bounds = (12, 17, 20)
    plt, fig, ax = _figure("bf16 relative error vs float64, positions in the 4096 below each "
                           "bound (H200)")
    ax.plot([2 ** b for b in bounds], [number(case[f"< 2^{b}"]) for b in bounds], marker="o",
            label="jaxrope, Llama 3.1 (accurate angle)")
    ax.plot([2 ** b for b in bounds], [number(case[f"f32 angle < 2^{b}"]) for b in bounds],
            marker="o", label="a float32 angle, Llama 3.1")
    flashinfer = table(markdown, ("positions", "FlashInfer"))
    ax.plot([2 ** b for b in bounds], [number(r["FlashInfer"]) for r in flashinfer], marker="o",
            label="FlashInfer 0.5.3 (its parity test's inputs)")
    ax.axhline(1.66e-3, color="gray", linestyle=":", label="bf16 rounding floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("largest position")
    ax.set_ylabel("relative error (log)")
    return _save(plt, fig, ax, path)


def main(argv: Sequence[str] | None = None) -> List[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=BENCH_DIR / "RESULTS.md")
    parser.add_argument("--out", type=Path, default=BENCH_DIR)
    args = parser.parse_args(argv)
    markdown = args.results.read_text()
    args.out.mkdir(parents=True, exist_ok=True)
    written = [plot_fused_append(markdown, args.out / "fused_append.png"),
               plot_decode_latency(markdown, args.out / "decode_latency.png"),
               plot_accuracy(markdown, args.out / "accuracy_position.png")]
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
