"""Where the torch bridge's host time goes: DLPack import/export, jit dispatch, plan.

    python3 -m bench.bridge_profile [--device cuda]

Times each primitive the manager's JAX path is built from (median of many calls, one
device sync at the end of each batch) and prints a cProfile of ``plan + commit`` for
a 256-request decode step and of ``apply_qk`` on the JAX path, so the cost of the
bridge on a given host can be attributed before changing it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxrope as jr
from torch_bridge import (KVPlanOutput, KVView, PositionConfig, PositionStep, RopeManager,
                          StepContext)
from torch_bridge.dlpack import to_jax, to_torch


def per_call_us(fn, device, calls=200, reps=5, warmup=5):
    """Median over ``reps`` batches of wall time (us) per call of ``calls`` calls, one sync each."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def primitives(device):
    q = torch.randn(64, 32, 128, dtype=torch.bfloat16, device=device)
    small = np.arange(64, dtype=np.int32)
    add_one = jax.jit(lambda x: x + 1)
    x = jnp.arange(64, dtype=jnp.int32)
    rows = {
        "to_jax(q) (DLPack import)": lambda: to_jax(q),
        "to_torch(jax array) (DLPack export)": lambda: to_torch(add_one(x)),
        "jitted tiny op dispatch": lambda: add_one(x),
        "jnp.asarray(numpy int32[64]) (H2D)": lambda: jnp.asarray(small),
        "torch tiny op": lambda: q.mul_(1.0),
    }
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn, device):9.1f} us/call")


def profile(label, fn, calls=100):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(18)
    print(f"--- cProfile: {label} ({calls} calls)")
    print(out.getvalue()[-4000:])


def manager_paths(device):
    rope = jr.RopeConfig(head_dim=128, theta=5e5, max_position=1 << 20)
    mgr = RopeManager(PositionConfig(rope=rope), device, max_seq_len=1 << 20, launcher="jax")
    rids = [f"r{i}" for i in range(256)]
    for rid in rids:
        mgr.ingest_request(rid)
    kv = {"kv": {"text": KVPlanOutput(tuple(KVView(rid, "text", 1) for rid in rids))}}
    step = PositionStep(tuple((rid, "text", 1) for rid in rids))
    ctx = StepContext(tuple(rids), plan_results=kv)

    def plan_commit():
        mgr.plan(step, ctx)
        mgr.commit(step, ctx)

    print(f"{'plan+commit decode 256':40s} {per_call_us(plan_commit, device, calls=50):9.1f} us/call")
    profile("plan+commit decode 256", plan_commit)
    q = torch.randn(256, 32, 128, dtype=torch.bfloat16, device=device)
    k = torch.randn(256, 8, 128, dtype=torch.bfloat16, device=device)
    mgr.plan(step, ctx)
    print(f"{'apply_qk jax path T=256':40s} "
          f"{per_call_us(lambda: mgr.apply_qk(q, k, 'text'), device, calls=50):9.1f} us/call")
    profile("apply_qk jax path T=256", lambda: mgr.apply_qk(q, k, "text"), calls=50)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    print("jax", jax.__version__, jax.devices(), "torch", torch.__version__)
    primitives(device)
    manager_paths(device)


if __name__ == "__main__":
    main()
