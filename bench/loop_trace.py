"""What runs inside the jitted loop ``bench.mosaic_bench`` times, kernel by kernel.

    python -m bench.loop_trace --out DIR [--tokens 16384 65536] [--backends mosaic triton]

Under Nsight Compute (kernels one at a time, caches flushed) the Mosaic GPU and the
Triton-lowered kernels are 1-2% apart, in the jitted loop 3-6%: this says where the
loop's time goes. Per backend and token count (bf16 q ``[T, 32, 128]``, k ``[T, 8,
128]``, the inputs of :func:`bench.mosaic_bench.inputs`): the loop's time per
application (:class:`bench.timing.JaxLoop`), then one loop call under the JAX profiler
(CUPTI), every kernel, copies and memsets included: each kernel's count and median
duration, the median period between consecutive rope kernels' starts and the median
idle gap between a rope kernel's end and the next kernel's start; the compiled loop's
HLO op counts (custom calls, fusions, copies). Writes ``DIR/loop_trace.json`` and each
loop's HLO as ``DIR/<backend>_<tokens>.hlo.txt``. GPU only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
from pathlib import Path
from typing import Any, Dict, List

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

import jaxrope as jr  # noqa: E402
from bench import timing  # noqa: E402
from bench.mosaic_bench import ONE_D, inputs  # noqa: E402


def trace(backend: str, tokens: int, reps: int, out: Path) -> Dict[str, Any]:
    q, k, pos, iters = inputs(np.random.default_rng(0), tokens)
    step = lambda a, b, p: jr.apply_rope(a, b, p, ONE_D, backend=backend)  # noqa: E731
    loop = timing.JaxLoop(step, (q, k), (pos,), iters=iters, unroll=8)
    loop_us = loop.time(reps).median_us
    hlo = loop.hlo
    (out / f"{backend}_{tokens}.hlo.txt").write_text(hlo)
    events = sorted(timing.jax_kernel_events(lambda: loop(1), copies=True),
                    key=lambda e: e[1])
    by_name: Dict[str, List[float]] = collections.defaultdict(list)
    for name, _, duration in events:
        by_name[name].append(duration)
    kernels = {name: dict(count=len(d), median_us=float(np.median(d)) / 1e3,
                          total_us=float(np.sum(d)) / 1e3)
               for name, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))}
    rope = [i for i, e in enumerate(events) if "rope" in e[0]]
    starts = np.asarray([events[i][1] for i in rope], np.float64)
    gaps = [events[i + 1][1] - (events[i][1] + events[i][2]) for i in rope
            if i + 1 < len(events)]
    return dict(backend=backend, tokens=tokens, iters=iters, loop_us=loop_us,
                rope_kernels=len(rope),
                rope_median_us=float(np.median([events[i][2] for i in rope])) / 1e3,
                period_median_us=float(np.median(np.diff(starts))) / 1e3,
                gap_median_us=float(np.median(gaps)) / 1e3 if gaps else None,
                gap_max_us=float(np.max(gaps)) / 1e3 if gaps else None,
                kernels=kernels,
                hlo_ops=dict(custom_calls=collections.Counter(
                    re.findall(r'custom_call_target="([^"]+)"', hlo)),
                    fusions=len(re.findall(r"\bfusion\(", hlo)),
                    copies=loop.hlo_copies))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.loop_trace")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--backends", nargs="+", default=["mosaic", "triton"])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens in args.tokens:
        for backend in args.backends:
            row = trace(backend, tokens, args.reps, args.out)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            for name, stats in list(row["kernels"].items())[:6]:
                print(f"  {stats['count']:6d} x {stats['median_us']:9.2f} us  {name[:90]}",
                      flush=True)
    timing.write_json(args.out, "loop_trace", dict(
        run=timing.run_info("bench.loop_trace", argv or []), rows=rows))


if __name__ == "__main__":
    main()
