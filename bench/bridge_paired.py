"""plan + commit host time of two checkouts, paired: the check that a change to the
manager kept its speed.

    python -m bench.bridge_paired --before /path/to/other-checkout [--rounds 6] [--blocks 60]

Each round runs one process per tree (this one, then ``--before``), each importing its own
``jaxrope`` / ``torch_bridge`` / ``bench`` (``PYTHONPATH``), building 256 decode requests
through a KV plan output and timing :func:`bench.bridge_bench.timed_blocks` on the CPU,
eager and preplan, ``--blocks`` blocks of 16 steps (the first 10 dropped). Prints each
round's medians and the median of the paired ratios (this tree / before).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

TREE = Path(__file__).resolve().parents[1]
_WORKER = """
import json, statistics, sys, torch
from bench import bridge_bench as bb
blocks_n = int(sys.argv[1])
rids = [f"r{i}" for i in range(256)]
mgr = bb._manager(torch.device("cpu"))
for rid in rids:
    mgr.ingest_request(rid)
steps = bb._steps(rids, 1, 8)
out = {}
for preplan in (False, True):
    blocks, times = bb.timed_blocks(mgr, steps, preplan, torch.device("cpu")), []
    for _ in range(blocks_n):
        plan_s, commit_s = next(blocks)
        times += [p + c for p, c in zip(plan_s, commit_s)]
    out["preplan" if preplan else "eager"] = statistics.median(times[10 * bb.BLOCK:]) * 1e6
print(json.dumps(out))
"""


def run(tree: Path, blocks: int) -> Dict[str, float]:
    """One worker process timing ``tree``'s manager: ``{"eager": us, "preplan": us}``."""
    env = dict(os.environ, PYTHONPATH=str(tree), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _WORKER, str(blocks)], env=env, cwd=str(tree),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=60)
    args = parser.parse_args(argv)
    rows: List[Dict[str, Dict[str, float]]] = []
    for i in range(args.rounds):
        rows.append({"this": run(TREE, args.blocks), "before": run(args.before, args.blocks)})
        print(f"round {i}: {json.dumps(rows[-1])}", flush=True)
    ratios = {}
    for case in ("eager", "preplan"):
        ratios[case] = statistics.median(r["this"][case] / r["before"][case] for r in rows)
        print(f"{case}: this / before, median of {args.rounds} paired ratios: {ratios[case]:.3f}")
    return ratios


if __name__ == "__main__":
    main()
