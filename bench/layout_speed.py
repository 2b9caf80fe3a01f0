"""This tree's rope and fused-append kernels against another checkout's (main before a
change), timed in one run: the check that a restructure left the speed where it was.

    python -m bench.layout_speed --before /path/to/main-checkout [--out DIR]
        [--rounds 4] [--tokens 16384 65536] [--backends mosaic triton] [--reps 7]
        [--tolerance 0.01] [--max-iters N]

Each round runs :mod:`bench.layout_speed_worker` twice, in separate processes, first with
this tree's ``jaxrope`` on ``PYTHONPATH``, then with ``--before``'s (ABAB...): the same
worker code times both, through the public API only (``apply_rope`` and
``apply_rope_and_append_kv`` on bf16 q ``[T, 32, 128]``, k and v ``[T, 8, 128]``, an NHD
cache of pages of 16, a jitted loop with q and the cache donated). Per case the median
over rounds of each tree, their ratio (this tree's time / the other's) and the spread of
each tree's rounds (max / min - 1: the noise) are printed and written to
``DIR/layout_speed.json`` (``DIR`` defaults to ``$OUT``). The exit status is 1 when a
ratio is outside ``1 +- tolerance``. Needs a CUDA GPU (a CPU run times the XLA path:
``--backends xla``, for a dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
WORKER = HERE / "layout_speed_worker.py"


def run_worker(tree: Path, args) -> Dict[str, Any]:
    """One worker process timing ``tree``'s jaxrope; its JSON report."""
    env = dict(os.environ, PYTHONPATH=str(tree), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    command = [sys.executable, str(WORKER), "--tree", str(tree), "--reps", str(args.reps),
               "--seed", str(args.seed), "--max-iters", str(args.max_iters),
               "--tokens", *map(str, args.tokens),
               "--backends", *args.backends]
    done = subprocess.run(command, env=env, cwd=str(tree), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the worker for {tree} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: Dict[str, List[Dict[str, Any]]], tolerance: float) -> List[Dict[str, Any]]:
    """Per (op, backend, tokens): each tree's median and spread over rounds, and the ratio."""
    by_case: Dict[tuple, Dict[str, List[float]]] = {}
    for name, reports in runs.items():
        for report in reports:
            for row in report["rows"]:
                key = (row["op"], row["backend"], row["tokens"])
                by_case.setdefault(key, {}).setdefault(name, []).append(row["us"])
    table = []
    for (op, backend, tokens), times in sorted(by_case.items()):
        new, before = statistics.median(times["this"]), statistics.median(times["before"])
        ratio = new / before
        table.append(dict(op=op, backend=backend, tokens=tokens, this_us=new, before_us=before,
                          ratio=ratio, within=abs(ratio - 1) <= tolerance,
                          this_spread=max(times["this"]) / min(times["this"]) - 1,
                          before_spread=max(times["before"]) / min(times["before"]) - 1))
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path,
                        help="the other checkout (its root, holding jaxrope/)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--backends", nargs="+", default=["mosaic", "triton"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--max-iters", type=int, default=1 << 20,
                        help="cap on a loop's calls (a CPU dry run passes a few)")
    args = parser.parse_args(argv)
    before = args.before.resolve()
    if not (before / "jaxrope" / "__init__.py").is_file():
        parser.error(f"--before {before} holds no jaxrope/ package")
    print(f"seed {args.seed}; this tree {TREE}, before {before}", flush=True)
    runs: Dict[str, List[Dict[str, Any]]] = {"this": [], "before": []}
    for round_index in range(args.rounds):
        for name, tree in (("this", TREE), ("before", before)):
            runs[name].append(run_worker(tree, args))
            print(f"round {round_index + 1}/{args.rounds} {name} done", flush=True)
    table = summarize(runs, args.tolerance)
    report = dict(seed=args.seed, rounds=args.rounds, tolerance=args.tolerance,
                  jax=runs["this"][0]["jax"], device=runs["this"][0]["device"],
                  this=str(TREE), before=str(before), table=table, runs=runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "layout_speed.json").write_text(json.dumps(report, indent=1))
    print(f"{'op':16} {'backend':8} {'tokens':>7} {'this us':>9} {'before us':>10} "
          f"{'ratio':>7} {'spread':>13}")
    for r in table:
        print(f"{r['op']:16} {r['backend']:8} {r['tokens']:7d} {r['this_us']:9.1f} "
              f"{r['before_us']:10.1f} {r['ratio']:7.4f} "
              f"{r['this_spread']:6.2%}/{r['before_spread']:6.2%}"
              f"{'' if r['within'] else '  OUTSIDE'}")
    return 0 if all(r["within"] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())
