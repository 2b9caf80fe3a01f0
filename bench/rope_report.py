"""rope_bench's report: derived ratios, the markdown tables, the plot, ``bench/RESULTS.md``.

Everything here reads a ``rope_bench.json`` report (:mod:`bench.rope_bench` writes it);
``python -m bench.rope_bench --from-json`` renders a saved one without measuring.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bench import timing

__all__ = ["BEGIN", "END", "PLOT_IMPLS", "TARGET", "derive", "plot_tbps", "render_markdown",
           "tables", "update_results_md", "write_outputs"]

NAME = "rope_bench"
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
RESULTS_PNG = BENCH_DIR / "rope_tbps.png"
BEGIN, END = "<!-- rope_bench:begin -->", "<!-- rope_bench:end -->"
TARGET = "default_d128"
PLOT_IMPLS = ("jaxrope", "jaxrope_torch", "jaxrope_mosaic", "xla", "flashinfer",
              "flashinfer_cache", "torch_eager", "ceiling", "ceiling_2pass", "xla_ceiling")


def _ok(r: Dict[str, Any]) -> bool:
    return (r.get("median_us") or 0) > 0 and not r.get("error")


def derive(report: Dict[str, Any]) -> None:
    """Adds ``ceiling_fraction``, ``ratio_flashinfer`` and ``ratio_plain`` to every result."""
    by = {(r["section"], r["impl"], r["case"], r["tokens"]): r for r in report["results"] if _ok(r)}
    for (section, impl, case, tokens), r in by.items():
        ceiling = by.get((section, "ceiling", case, tokens)) or by.get(
            (section, "xla_ceiling", case, tokens))
        fi = by.get((section, "flashinfer", case, tokens))
        plain = by.get((section, "jaxrope_plain", case, tokens))
        r["ceiling_fraction"] = r["tbps"] / ceiling["tbps"] if ceiling else None
        r["ratio_flashinfer"] = r["median_us"] / fi["median_us"] if fi else None
        r["ratio_plain"] = r["median_us"] / plain["median_us"] if plain and impl == "jaxrope" else None


def _us(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _tbps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> List[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]


def _section(report: Dict[str, Any], name: str) -> List[Dict[str, Any]]:
    return [r for r in report["results"] if r["section"] == name and _ok(r)]


def tables(report: Dict[str, Any]) -> List[Tuple[str, List[str], List[List[Any]]]]:
    """(title, headers, rows) of the tables RESULTS.md keeps: the back-to-back sweep and
    every named case (the kernel-method and wall-time sections stay in the JSON; the
    torch sections of RESULTS.md give the per-call times)."""
    out = []
    sweep = _section(report, "sweep")
    impls = [i for i in PLOT_IMPLS if any(r["impl"] == i for r in sweep)]
    cell = {(r["tokens"], r["impl"]): r for r in sweep}
    rows = [[t] + [f"{_us(cell[t, i]['median_us'])} ({_tbps(cell[t, i]['tbps'])})"
                   if (t, i) in cell else "-" for i in impls]
            + [_pct(cell.get((t, "jaxrope"), {}).get("ceiling_fraction")),
               _ratio(cell.get((t, "jaxrope"), {}).get("ratio_flashinfer"))]
            for t in sorted({r["tokens"] for r in sweep})]
    out.append((f"Median us (TB/s), {TARGET} (Hq=32 Hk=8 D=128), back to back",
                ["tokens"] + impls + ["jaxrope %ceil", "jaxrope t/FI"], rows))
    found = _section(report, "cases")
    fi = {(r["case"], r["tokens"]): r for r in found if r["impl"] == "flashinfer"}
    rows = [[r["case"], f"{r['q_heads']}x{r['k_heads']}", f"{r['rotary_dim']}/{r['head_dim']}",
             r["tokens"], _us(r["median_us"]), _tbps(r["tbps"]), _pct(r["ceiling_fraction"]),
             _ratio(r["ratio_plain"]), fi.get((r["case"], r["tokens"]), {}).get("api", "-"),
             _us(fi.get((r["case"], r["tokens"]), {}).get("median_us")),
             _ratio(r["ratio_flashinfer"])] for r in found if r["impl"] == "jaxrope"]
    method = found[0]["method"] if found else "kernel"
    out.append((f"Every named case, jaxrope vs its plain config and FlashInfer ({method})",
                ["case", "heads", "R/D", "tokens", "us", "TB/s", "%ceil", "vs plain",
                 "FlashInfer API", "FI us", "t/FI"], rows))
    return [t for t in out if t[2]]


def render_markdown(report: Dict[str, Any]) -> str:
    info = report["info"]
    versions = ", ".join(f"{name} {info[name]}" for name in (
        "python", "jax", "jaxlib", "torch", "triton", "flashinfer") if info.get(name))
    lines = [BEGIN, f"## rope_bench, {info['date']}, {report['device']}", "",
             f"Command: `{info['command']}` (git {info.get('git_commit') or '?'})  ",
             f"Versions: {versions}  ",
             f"{len(report['results'])} measurements in {report.get('elapsed_s', 0):.0f} s; "
             f"{report['dtype']}; method per section in `bench/rope_bench.py`; `%ceil` against "
             "one in-place `mul_` over the same bytes; `t/FI` = time / FlashInfer's.", ""]
    lines += [f"- {note}" for note in report.get("notes", [])]
    failed = [r for r in report["results"] if r.get("error")]
    if failed:
        lines.append(f"- {len(failed)} failed or skipped, e.g. {failed[0]['key']}: "
                     f"{failed[0]['error'][:200]}")
    for title, headers, rows in tables(report):
        lines += ["", f"### {title}", ""] + _table(headers, rows)
    return "\n".join(lines + [END, ""])


def update_results_md(path: Path, section: str) -> None:
    """Replaces the rope_bench section of ``path`` (or appends one): only current numbers."""
    text = path.read_text() if path.exists() else "# jaxrope benchmark results\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def plot_tbps(report: Dict[str, Any], path: Path) -> Optional[str]:
    """TB/s vs tokens of the sweep, one line per implementation; None once written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (render it later with --from-json)"
    sweep = _section(report, "sweep")
    if not sweep:
        return "no sweep results: no plot"
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in PLOT_IMPLS:
        points = sorted((r["tokens"], r["tbps"]) for r in sweep if r["impl"] == impl)
        if points:
            ax.plot(*zip(*points), marker="o", label=impl,
                    linestyle="--" if "ceiling" in impl else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("effective TB/s  (2*(q+k) + pos bytes / median time)")
    ax.set_title(f"RoPE in place, Hq=32 Hk=8 D=128 {report['dtype']}, {report['device']}, "
                 f"{report['info']['date']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_outputs(report: Dict[str, Any], out_dir: Path, write_results: bool) -> List[Path]:
    derive(report)
    written = [timing.write_json(out_dir, NAME, report), out_dir / f"{NAME}.md"]
    markdown = render_markdown(report)
    written[1].write_text(markdown)
    png = out_dir / "rope_tbps.png"
    why_not = plot_tbps(report, png)
    if why_not:
        print(f"note: {why_not}")
    else:
        written.append(png)
    if write_results:
        update_results_md(RESULTS_MD, markdown)
        written.append(RESULTS_MD)
        if not why_not:
            shutil.copyfile(png, RESULTS_PNG)
            written.append(RESULTS_PNG)
    return written
