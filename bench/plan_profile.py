"""Where plan + commit's host time goes on the GPU host: launch, Python, and by function.

    python3 -m bench.plan_profile [--device cuda|cpu] [--steps N]

Decode 256 x 1 (eager and preplan), one plan label, Triton counter store (on CPU the
interpreter, so only the "no launch" rows mean anything there). Prints, per mode:

- ``full``: median plan + commit host time, as ``bench.bridge_bench`` times it;
- ``no launch``: the same with the counter kernel's launch skipped (what the manager's
  Python costs on this host);
- the counter kernel's compiled launch alone, same arguments, per call;
- cProfile's top functions by own time over the full run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from typing import List

import numpy as np
import torch

from bench.bridge_bench import _manager, _steps, timed_steps


def _run_steps(mgr, steps, preplan: bool, device: torch.device) -> List[float]:
    """plan + commit host seconds per step, timed as ``bench.bridge_bench`` times them."""
    plan_s, commit_s = timed_steps(mgr, steps, preplan, 32, device)
    return [p + c for p, c in zip(plan_s, commit_s)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--init-jax", action="store_true",
                        help="start JAX's client on the device first (as a JAX-path apply_qk or "
                             "reading mgr.table would)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.init_jax:
        import jax
        jax.block_until_ready(jax.device_put(1.0, jax.devices()[0]) + 1)
        print(f"JAX client started on {jax.devices()[0]}")
    rids = [f"r{i}" for i in range(256)]
    steps = _steps(rids, 1, args.steps)
    for preplan in (False, True):
        mode = "preplan" if preplan else "eager"
        mgr = _manager(device, counters="triton")
        for rid in rids:
            mgr.ingest_request(rid)
        store = mgr._store._counters
        if device.type == "cuda":
            full = _run_steps(mgr, steps, preplan, device)
            prof = cProfile.Profile()
            prof.enable()
            _run_steps(mgr, steps[:1000], preplan, device)
            prof.disable()
            real_run = store._run
            calls = []
            store._run = lambda *a: calls.append(a)
            bare = _run_steps(mgr, steps, preplan, device)
            programs, run_args, meta_offset, values, stream = calls[-1]
            store._run = real_run
            n = 5000
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(n):
                store._run(programs, run_args, meta_offset, values, stream)
            launch_us = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize(device)
            print(f"decode 256x1 {mode}: full {np.median(full) * 1e6:.1f} us "
                  f"(p90 {np.percentile(full, 90) * 1e6:.1f}), no launch "
                  f"{np.median(bare) * 1e6:.1f} us, one counter-kernel launch {launch_us:.2f} us, "
                  f"{len(calls) / len(steps):.2f} counter launches per step (resets included)")
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue())
        else:
            store._run = lambda *a: None
            bare = _run_steps(mgr, steps, preplan, device)
            print(f"decode 256x1 {mode}: no launch {np.median(bare) * 1e6:.1f} us "
                  f"(p90 {np.percentile(bare, 90) * 1e6:.1f})")


if __name__ == "__main__":
    main()
