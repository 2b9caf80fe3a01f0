"""Host time of RopeManager.plan + commit, and wall time of apply_qk per call.

    python -m bench.bridge_bench [--quick] [--device cpu|cuda] [--iters N] [--out FILE.json]

Cases:

- ``decode``: 256 requests x 1 token, one plan label (``--quick``: 32 requests);
- ``prefill``: 8 requests x 2048-token chunks, one plan label (``--quick``: 8 x 128).

Each runs with each counter store (on CUDA: ``TritonCounters``, the default, and
``JaxCounters``; on CPU: ``JaxCounters``), as ``eager`` (plan(N), commit(N)) and
``preplan`` (plan(N+1, is_preplan) while N is current, then commit(N): the pipelined
runner's order). Host time is the
``time.perf_counter`` span of each call, with no device synchronisation inside it:
what the Python thread spends before it can queue the next step. On CPU, JAX runs
small computations inline, so there the host time includes the device work. Every 16
steps the counters are reset and the device drained, outside the timed spans. The
step objects are built before timing (the engine's cost, not the manager's).

``apply_qk``: q ``[T, 32, 128]``, k ``[T, 8, 128]`` bf16 on GPU (``--quick`` or CPU:
``[T, 8, 128]``, ``[T, 2, 128]`` float32), T in (64, 16384) (CPU: 64, 1024); M calls,
one device sync, over M: dispatch included. Per launcher: "auto" (Triton on CUDA when
available) and "jax" (the DLPack path).

Prints a table and writes every number (median, p10, p90 in microseconds) plus the
environment to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from typing import Dict, List, Tuple

import jax
import numpy as np
import torch

import jaxrope as jr
from torch_bridge import (KVPlanOutput, KVView, PositionConfig, PositionStep, RopeManager, Segment,
                          StepContext)
from torch_bridge.counter_store import JaxCounters

TARGET_US = 100.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drain(mgr: RopeManager, device: torch.device) -> None:
    """Wait for the counters' device work. Through torch for the Triton store: reading
    ``mgr.table`` would start JAX's GPU client in a process that otherwise never uses
    it, which a torch engine with the Triton store does not pay for either."""
    if isinstance(mgr._store, JaxCounters):
        jax.block_until_ready(mgr.table.counters)
    _sync(device)


def _stats(samples_s: List[float]) -> Dict[str, float]:
    us = np.asarray(samples_s) * 1e6
    return {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90)), "n": int(len(us))}


def _manager(device: torch.device, launcher: str = "jax", counters: str = "auto") -> RopeManager:
    rope = jr.RopeConfig(head_dim=128, theta=5e5, max_position=1 << 20)
    return RopeManager(PositionConfig(rope=rope), device, max_seq_len=1 << 20, launcher=launcher,
                       counters=counters)


def _steps(rids: List[str], span: int, count: int):
    out = []
    for _ in range(count):
        step = PositionStep(tuple(Segment(rid, "text", span) for rid in rids))
        views = tuple(KVView(rid, "text", span) for rid in rids)
        out.append((step, StepContext(tuple(rids), plan_results={"kv": {"attn": KVPlanOutput(views)}})))
    return out


def timed_steps(mgr: RopeManager, steps, preplan: bool, warmup: int,
                device: torch.device) -> Tuple[List[float], List[float]]:
    """Host seconds of each ``plan`` and ``commit`` after ``warmup`` steps.

    ``eager``: plan(N), commit(N); ``preplan``: plan(N+1, is_preplan), then commit(N).
    Every 16 steps all requests are reset and the device drained, outside the timing.
    """
    rids = steps[0][1].request_ids
    plan_s, commit_s = [], []
    if preplan:
        pre = StepContext(rids, is_preplan=True, plan_results=steps[0][1].plan_results)
        mgr.plan(*steps[0])
        for i in range(1, len(steps)):
            if i % 16 == 0:
                mgr.commit(*steps[i - 1])
                for rid in rids:
                    mgr.reset_request(rid)
                _drain(mgr, device)
                mgr.plan(*steps[i])
                continue
            t0 = time.perf_counter()
            mgr.plan(steps[i][0], pre)
            t1 = time.perf_counter()
            mgr.commit(*steps[i - 1])
            t2 = time.perf_counter()
            if i > warmup:
                plan_s.append(t1 - t0)
                commit_s.append(t2 - t1)
    else:
        for i, (step, ctx) in enumerate(steps):
            if i % 16 == 0:
                for rid in rids:
                    mgr.reset_request(rid)
                _drain(mgr, device)
            t0 = time.perf_counter()
            mgr.plan(step, ctx)
            t1 = time.perf_counter()
            mgr.commit(step, ctx)
            t2 = time.perf_counter()
            if i >= warmup:
                plan_s.append(t1 - t0)
                commit_s.append(t2 - t1)
    return plan_s, commit_s


def bench_plan_commit(device: torch.device, requests: int, span: int, iters: int,
                      preplan: bool, counters: str = "auto",
                      warmup: int = 32) -> Dict[str, Dict[str, float]]:
    mgr = _manager(device, counters=counters)
    rids = [f"r{i}" for i in range(requests)]
    for rid in rids:
        mgr.ingest_request(rid)
    plan_s, commit_s = timed_steps(mgr, _steps(rids, span, iters + warmup), preplan, warmup,
                                   device)
    total = [p + c for p, c in zip(plan_s, commit_s)]
    return {"plan": _stats(plan_s), "commit": _stats(commit_s), "plan+commit": _stats(total),
            "store": type(mgr._store).__name__}


def _qk(device: torch.device, tokens: int, q_heads: int, k_heads: int, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(int(time.time()))
    q = torch.randn(tokens, q_heads, 128, device=device, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, 128, device=device, generator=gen).to(dtype)
    return q, k


def _wall_stats(call, device: torch.device, calls: int) -> Dict[str, float]:
    """Wall time per call: 5 warm-up calls, then 5 batches of ``calls`` with one sync each."""
    for _ in range(5):
        call()
    _sync(device)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return _stats(samples)


def bench_apply(device: torch.device, tokens: int, q_heads: int, k_heads: int, dtype: torch.dtype,
                launcher: str, calls: int) -> Dict[str, float]:
    mgr = _manager(device, launcher)
    mgr.ingest_request("r")
    step = PositionStep((Segment("r", "text", tokens),))
    mgr.plan(step, StepContext(("r",)))
    q, k = _qk(device, tokens, q_heads, k_heads, dtype)
    out = _wall_stats(lambda: mgr.apply_qk(q, k, "text"), device, calls)
    out["launcher"] = type(mgr.launcher).__name__ if mgr.launcher is not None else "jax"
    return out


def bench_flashinfer(device: torch.device, tokens: int, q_heads: int, k_heads: int,
                     dtype: torch.dtype, calls: int) -> Dict[str, float]:
    """FlashInfer's in-place RoPE on the same shapes, timed like ``bench_apply`` (GPU only)."""
    from flashinfer import rope as fi
    q, k = _qk(device, tokens, q_heads, k_heads, dtype)
    pos = torch.randint(0, 1 << 16, (tokens,), dtype=torch.int32, device=device)
    return _wall_stats(lambda: fi.apply_rope_pos_ids_inplace(
        q, k, pos, rotary_dim=128, interleave=False, rope_theta=5e5), device, calls)


def main(argv=None) -> Dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CI, CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=200, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=32,
                        help="untimed steps first in every case (the H200 host's first case "
                             "of a process measured up to 1.6x slower after 32)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    small = args.quick or not on_gpu

    cases = {"decode": (32 if args.quick else 256, 1),
             "prefill": (8, 128 if args.quick else 2048)}
    results: Dict = {"plan_commit": {}, "apply_qk": {}}
    rows = []
    # On CUDA both counter stores: "auto" (the Triton kernel) and "jax" (jitted transitions).
    for name, (requests, span) in cases.items():
        for mode, store in itertools.product(("eager", "preplan"),
                                             ("auto", "jax") if on_gpu else ("jax",)):
            r = bench_plan_commit(device, requests, span, args.iters, mode == "preplan", store,
                                  args.warmup)
            key = f"{name}[{requests}x{span}]/{mode}/{r['store']}"
            results["plan_commit"][key] = r
            rows.append((key, r["plan"]["median_us"], r["commit"]["median_us"],
                         r["plan+commit"]["median_us"], r["plan+commit"]["p90_us"]))

    q_heads, k_heads = (8, 2) if small else (32, 8)
    dtype = torch.float32 if not on_gpu else torch.bfloat16
    apply_rows = []
    for tokens in ((64, 1024) if small else (64, 16384)):
        for launcher in (("auto", "jax") if on_gpu else ("jax",)):
            calls = 20 if tokens > 4096 or not on_gpu else 100
            r = bench_apply(device, tokens, q_heads, k_heads, dtype, launcher, calls)
            key = f"T={tokens} Hq={q_heads} Hk={k_heads} {str(dtype).replace('torch.', '')}/{launcher}"
            results["apply_qk"][key] = r
            apply_rows.append((key, r["launcher"], r["median_us"], r["p90_us"]))
        if on_gpu:
            key = f"T={tokens} Hq={q_heads} Hk={k_heads} {str(dtype).replace('torch.', '')}/flashinfer"
            try:
                r = bench_flashinfer(device, tokens, q_heads, k_heads, dtype, calls)
            except ImportError as e:
                print(f"flashinfer unavailable ({e}): no same-run reference")
            else:
                results["apply_qk"][key] = r
                apply_rows.append((key, "flashinfer", r["median_us"], r["p90_us"]))

    print(f"plan + commit host time on {device} (target <= {TARGET_US:.0f} us each on the H200)")
    print(f"{'case':48s} {'plan us':>9s} {'commit us':>10s} {'sum us':>9s} {'sum p90':>9s}")
    for key, p, c, s, s90 in rows:
        print(f"{key:48s} {p:9.1f} {c:10.1f} {s:9.1f} {s90:9.1f}")
    print(f"\napply_qk wall time per call on {device}")
    print(f"{'case':44s} {'path':>14s} {'median us':>10s} {'p90 us':>9s}")
    for key, path, med, p90 in apply_rows:
        print(f"{key:44s} {path:>14s} {med:10.1f} {p90:9.1f}")

    results["environment"] = {
        "device": str(device), "device_name": torch.cuda.get_device_name(device) if on_gpu else platform.processor(),
        "python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
        "jax_devices": [str(d) for d in jax.devices()], "quick": args.quick, "iters": args.iters, "warmup": args.warmup,
        "cpu_count": __import__("os").cpu_count(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
