"""The manager's costs in two checkouts, paired: the check that a change to the manager
kept its speed.

    python -m bench.bridge_paired --before /path/to/other-checkout [--rounds 6] [--blocks 60]
        [--measure plan_commit|apply_qk|apply_qk_host]

Each round runs one process per tree (this one, then ``--before``), each importing its own
``jaxrope`` / ``torch_bridge`` / ``bench`` (``PYTHONPATH``). Prints each round's medians
and the median of the paired ratios (this tree / before). What a process times:

- ``plan_commit`` (default): 256 decode requests built through a KV plan output,
  :func:`bench.bridge_bench.timed_blocks` on the CPU, eager and preplan, ``--blocks``
  blocks of 16 steps (the first 10 dropped);
- ``apply_qk``: ``RopeManager.apply_qk`` at 64 tokens (bf16 Hq 32 / Hk 8 / D 128) on the
  GPU (the launch "auto" picks), wall time of 1000 calls from Python and one sync, the
  median of ``--blocks`` such samples after 2000 calls of warm-up; only the public API
  both trees have;
- ``apply_qk_host``: the same call on the CPU with a launcher whose bound run passes the
  Mosaic launch's pointers through the tree's ``CompiledModule`` to a C function that does
  nothing: the host's cost a call (the manager's lock, compile checks and bound-call
  lookup, and the launch's argument passing), the median of ``--blocks`` samples of
  10,000 calls after 20,000 of warm-up.
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
_APPLY_QK_WORKER = """
import json, statistics, sys, time, torch
import jaxrope as jr
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
samples_n, device = int(sys.argv[1]), torch.device("cuda")
gen = torch.Generator(device=device).manual_seed(64)
q = torch.randn(64, 32, 128, device=device, generator=gen).to(torch.bfloat16)
k = torch.randn(64, 8, 128, device=device, generator=gen).to(torch.bfloat16)
mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=128, theta=5e5)), device,
                  max_seq_len=8192)
mgr.ingest_request("r")
mgr.apply_cached_prefix("r", None, None, None, {"text": 4096})
mgr.plan(PositionStep((Segment("r", "text", 64),)), StepContext(("r",)))
for _ in range(2000):
    mgr.apply_qk(q, k, "text")
samples = []
for _ in range(samples_n):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        mgr.apply_qk(q, k, "text")
    torch.cuda.synchronize()
    samples.append((time.perf_counter() - start) * 1e3)
print(json.dumps({"apply_qk_64": statistics.median(samples),
                  "launcher": type(mgr.launcher).__name__}))
"""
# The host cost per apply_qk call, on the CPU: the manager's (lock, compile checks, the
# bound-call lookup) and its Mosaic launch's argument passing (MosaicLauncher._run's
# pointers through the tree's own CompiledModule) into a C function that does nothing
# (libc's labs, its extra arguments ignored) in place of the kernel's host launch.
_APPLY_QK_HOST_WORKER = """
import ctypes, json, statistics, sys, time, types, torch
import jaxrope as jr
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
try:
    from torch_bridge.launch.mosaic import CompiledModule
except ImportError:  # 870842b's layout
    from torch_bridge.mosaic_launch import CompiledModule

host = (ctypes.c_void_p * 2)(0, ctypes.cast(ctypes.CDLL(None).labs, ctypes.c_void_p).value)
module = CompiledModule(types.SimpleNamespace(module=b"none"),
                        lambda m, n: ctypes.cast(host, ctypes.POINTER(ctypes.c_void_p)))

class Bound:
    def rotate_(self, q, k, pos_ids, cfg):
        pass
    def bind(self, q, k, cfg):
        def run(q, k, pos_ids):
            q_ptr, k_ptr = q.data_ptr(), k.data_ptr()
            module(0, 1 << 40, pos_ids.data_ptr(), 1 << 41, 1 << 42, q_ptr, k_ptr, q_ptr, k_ptr)
            return True
        return run

samples_n = int(sys.argv[1])
q, k = torch.zeros(64, 32, 128, dtype=torch.bfloat16), torch.zeros(64, 8, 128, dtype=torch.bfloat16)
mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=128, theta=5e5)), "cpu",
                  max_seq_len=8192, launcher=Bound())
mgr.ingest_request("r")
mgr.plan(PositionStep((Segment("r", "text", 64),)), StepContext(("r",)))
for _ in range(20000):
    mgr.apply_qk(q, k, "text")
samples = []
for _ in range(samples_n):
    start = time.perf_counter()
    for _ in range(10000):
        mgr.apply_qk(q, k, "text")
    samples.append((time.perf_counter() - start) * 1e2)
print(json.dumps({"apply_qk_host": statistics.median(samples)}))
"""
_MEASURES = {"plan_commit": (_WORKER, {"JAX_PLATFORMS": "cpu"}, ("eager", "preplan")),
             "apply_qk": (_APPLY_QK_WORKER, {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                          ("apply_qk_64",)),
             "apply_qk_host": (_APPLY_QK_HOST_WORKER, {"JAX_PLATFORMS": "cpu"},
                               ("apply_qk_host",))}


def run(tree: Path, blocks: int, measure: str = "plan_commit") -> Dict[str, float]:
    """One worker process timing ``tree``'s manager: us per case of ``measure``."""
    worker, env_vars, _ = _MEASURES[measure]
    env = dict(os.environ, PYTHONPATH=str(tree), **env_vars)
    done = subprocess.run([sys.executable, "-c", worker, str(blocks)], env=env, cwd=str(tree),
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--blocks", type=int, default=60)
    parser.add_argument("--measure", choices=sorted(_MEASURES), default="plan_commit")
    args = parser.parse_args(argv)
    rows: List[Dict[str, Dict[str, float]]] = []
    for i in range(args.rounds):
        rows.append({"this": run(TREE, args.blocks, args.measure),
                     "before": run(args.before, args.blocks, args.measure)})
        print(f"round {i}: {json.dumps(rows[-1])}", flush=True)
    ratios = {}
    for case in _MEASURES[args.measure][2]:
        ratios[case] = statistics.median(r["this"][case] / r["before"][case] for r in rows)
        print(f"{case}: this / before, median of {args.rounds} paired ratios: {ratios[case]:.3f}")
    return ratios


if __name__ == "__main__":
    main()
