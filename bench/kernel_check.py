"""GPU check of the Pallas kernel: correctness on every named case, in-place aliasing,
a launch-shape sweep on the target shapes, and the Triton fast path from torch.

    python3 -m bench.kernel_check --out DIR

At each token count it also times both JAX paths, donated back-to-back jitted calls:
the Pallas kernel compiled by XLA's Triton (``pallas_dispatch_us``) and the Mosaic GPU
kernel (``mosaic_dispatch_us``, :mod:`jaxrope.kernels.mosaic_gpu`; an error string when
it does not build), each with its fraction of the ceiling.

Prints a short table and writes ``DIR/kernel_check.json``. Timings are medians of
wall time over jitted ``fori_loop``s (dispatch excluded) or CUDA-event timings of torch
work; the in-place elementwise ceiling is a torch ``mul_`` on one buffer of the same size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope import RopeConfig, apply_rope
from jaxrope.apply import kernel_constants
from jaxrope.cases import CASES
from jaxrope.kernels import pallas_triton
from jaxrope.scaling import Llama3, Yarn
from jaxrope.testing.oracle import relative_error, rope_oracle


def oracle(x, pos, cfg):
    """float64 rotation of ``x`` at ``pos`` with the frequencies the kernels use."""
    inv_freq, attention = cfg.serving_frequencies()
    return rope_oracle(np.asarray(x, np.float64), pos, inv_freq, attention, cfg.rotary_dim,
                       cfg.interleave)


def check_cases(rng, report):
    rows = []
    for case in CASES:
        cfg = case.cfg
        for dtype, token_counts in ((jnp.bfloat16, (1, case.tokens, 1000)),
                                    (jnp.float16, (case.tokens,)), (jnp.float32, (case.tokens,))):
            for tokens in token_counts:
                q = jnp.asarray(rng.standard_normal((tokens, case.q_heads, cfg.head_dim)), dtype)
                k = jnp.asarray(rng.standard_normal((tokens, case.k_heads, cfg.head_dim)), dtype)
                pos = rng.integers(0, cfg.max_position, tokens).astype(np.int32)
                q2, k2 = apply_rope(q, k, jnp.asarray(pos), cfg, backend="pallas")
                err = max(relative_error(out.astype(jnp.float32), oracle(x.astype(jnp.float32), pos, cfg))
                          for out, x in ((q2, q), (k2, k)))
                tail_same = bool(jnp.all(q2[..., cfg.rotary_dim:] == q[..., cfg.rotary_dim:]))
                rows.append(dict(case=case.name, dtype=jnp.dtype(dtype).name, tokens=tokens,
                                 rel_err=err, tail_untouched=tail_same))
    bad = [r for r in rows if not r["tail_untouched"] or r["rel_err"] > (
        1e-5 if r["dtype"] == "float32" else 2.5e-3)]
    report["cases"] = rows
    report["cases_failed"] = bad
    print(f"correctness: {len(rows)} runs, {len(bad)} failed; worst bf16 "
          f"{max(r['rel_err'] for r in rows if r['dtype'] == 'bfloat16'):.2e}")
    for r in bad:
        print("  FAIL", r)


def check_in_place(rng, report):
    cfg = RopeConfig(head_dim=128, rotary_dim=64)
    q = jnp.asarray(rng.standard_normal((64, 8, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((64, 2, 128)), jnp.bfloat16)
    q_ptr, k_ptr = q.unsafe_buffer_pointer(), k.unsafe_buffer_pointer()
    fn = jax.jit(lambda q, k, p: apply_rope(q, k, p, cfg, backend="pallas"), donate_argnums=(0, 1))
    q2, k2 = fn(q, k, jnp.arange(64, dtype=jnp.int32))
    same = q2.unsafe_buffer_pointer() == q_ptr and k2.unsafe_buffer_pointer() == k_ptr
    report["in_place_same_buffers"] = bool(same)
    print(f"in place (donated): same buffers = {same}")


def dispatch_time(fn, args, n, reps=5):
    """Median per-call wall time (us) of n donated jitted calls queued back to back.

    Once the GPU is the bottleneck (large T) this is the kernel time; at small T it is
    the dispatch cost.
    """
    step = jax.jit(fn, donate_argnums=(0, 1))
    q, k, p = args
    for _ in range(3):
        q, k = step(q, k, p)
    jax.block_until_ready((q, k))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            q, k = step(q, k, p)
        jax.block_until_ready((q, k))
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def torch_event_times(fn, n, reps=5, warmup=3):
    """Per-call device time (us) of n back-to-back calls of ``fn`` between two CUDA events,
    one value per repeat, after ``warmup`` calls."""
    import torch
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return times


def torch_event_time(fn, n, reps=5):
    """Median per-call device time (us) of n calls of ``fn`` between two CUDA events."""
    return statistics.median(torch_event_times(fn, n, reps))


def torch_ceiling_us(nbytes, n):
    import torch
    buf = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    return torch_event_time(lambda: buf.mul_(1.0), n)


def rope_fn(cfg, backend, block=None):
    tables, att = kernel_constants(cfg)

    def step(q, k, p):
        if backend in ("xla", "mosaic"):
            return apply_rope(q, k, p, cfg, backend=backend)
        return pallas_triton.rope_pallas(q, k, p, jnp.asarray(tables), rotary_dim=cfg.rotary_dim,
                                         interleave=cfg.interleave, attention_factor=att,
                                         config=block)
    return step


def inputs(rng, tokens, hq, hk, d, dtype=jnp.bfloat16):
    return (jnp.asarray(rng.standard_normal((tokens, hq, d)), dtype),
            jnp.asarray(rng.standard_normal((tokens, hk, d)), dtype),
            jnp.asarray(rng.integers(0, 100000, tokens), jnp.int32))


VARIANTS = {
    "plain": RopeConfig(head_dim=128, max_position=1 << 20),
    "llama3": RopeConfig(head_dim=128, theta=5e5, scaling=Llama3(), max_position=1 << 20),
    "yarn": RopeConfig(head_dim=128, scaling=Yarn(factor=4.0, original_max_position=32768)),
    "partial_0.5": RopeConfig(head_dim=128, rotary_dim=64),
    "interleave": RopeConfig(head_dim=128, interleave=True),
}


def triton_time(launcher, cfg, tokens, n, block=None):
    import torch
    q = torch.randn(tokens, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, 8, 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 100000, (tokens,), dtype=torch.int32, device="cuda")
    if tokens > 1024:
        return torch_event_time(lambda: launcher.rotate_(q, k, pos, cfg, block=block), n)
    # Small T: replay a graph of 100 launches, so launch gaps don't count.
    launcher.rotate_(q, k, pos, cfg, block=block)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            launcher.rotate_(q, k, pos, cfg, block=block)
    return torch_event_time(graph.replay, max(1, n // 100)) / 100


# Launch shapes the sweep tries: (block_tokens, heads_per_program, num_warps,
# groups_per_program). Programs of one or two tokens, several head groups each: the
# region where the first sweep with groups (RESULTS.md, 2026-11-30) found its best.
SWEEP = [(2, 4, 2, 1), (1, 2, 1, 4), (1, 8, 2, 2), (1, 4, 2, 2), (1, 4, 2, 4), (1, 4, 2, 8),
         (1, 2, 2, 4), (1, 2, 2, 8), (2, 2, 2, 4), (2, 2, 2, 8), (1, 8, 4, 2), (1, 8, 4, 4),
         (2, 4, 4, 4), (1, 2, 1, 2), (1, 2, 1, 8), (1, 2, 1, 16), (1, 4, 1, 2), (2, 2, 1, 4),
         (1, 1, 1, 8), (2, 1, 1, 8)]


def timings(rng, report, sweep_seconds):
    from torch_bridge.triton_launch import TritonLauncher
    launcher = TritonLauncher()
    rows = []
    for tokens in (64, 16384, 65536):
        nbytes = 2 * tokens * 40 * 128 * 2 + tokens * 4
        n = 1000 if tokens == 64 else 100 if tokens == 16384 else 30
        ceiling = torch_ceiling_us(tokens * 40 * 128 * 2, n)  # one buffer of q+k's bytes
        row = dict(tokens=tokens, ceiling_us=ceiling, ceiling_tbps=nbytes / ceiling / 1e6)
        row["xla_dispatch_us"] = dispatch_time(rope_fn(VARIANTS["plain"], "xla"),
                                               inputs(rng, tokens, 32, 8, 128), n)
        row["pallas_dispatch_us"] = dispatch_time(rope_fn(VARIANTS["plain"], "pallas"),
                                                  inputs(rng, tokens, 32, 8, 128), n)
        row["pallas_frac_ceiling_jax"] = ceiling / row["pallas_dispatch_us"]
        try:
            row["mosaic_dispatch_us"] = dispatch_time(rope_fn(VARIANTS["plain"], "mosaic"),
                                                      inputs(rng, tokens, 32, 8, 128), n)
            row["mosaic_frac_ceiling"] = ceiling / row["mosaic_dispatch_us"]
        except Exception as e:  # noqa: BLE001 - a first measurement: report, keep the rest
            row["mosaic_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        for name, cfg in VARIANTS.items():
            row[f"pallas_{name}_kernel_us"] = triton_time(launcher, cfg, tokens, n)
        row["default_block"] = str(pallas_triton.block_config(tokens, 32, 8, 64))
        if sweep_seconds and tokens > 64:
            deadline = time.perf_counter() + sweep_seconds
            results = []
            for bt, hpp, warps, groups in SWEEP:
                if time.perf_counter() > deadline:
                    break
                block = pallas_triton.BlockConfig(bt, hpp, warps, groups_per_program=groups)
                try:
                    results.append((triton_time(launcher, VARIANTS["plain"], tokens, n, block),
                                    str(block)))
                except Exception as e:  # noqa: BLE001 - report and continue the sweep
                    print("  sweep", block, "failed:", str(e)[:200])
            results.sort()
            row["sweep"] = results
        plain = row["pallas_plain_kernel_us"]
        row["pallas_plain_frac_ceiling"] = ceiling / plain
        row["pallas_plain_tbps"] = nbytes / plain / 1e6
        for name in VARIANTS:
            row[f"{name}_vs_plain"] = row[f"pallas_{name}_kernel_us"] / plain
        rows.append(row)
        print(json.dumps({key: (round(v, 3) if isinstance(v, float) else v)
                          for key, v in row.items() if key != "sweep"}))
        if row.get("sweep"):
            print("  sweep best:", row["sweep"][:5])
    report["timings"] = rows


def triton_fast_path(rng, report):
    import torch
    from torch_bridge.triton_launch import TritonLauncher
    out = {}
    launcher = TritonLauncher()
    for case in CASES:
        cfg = case.cfg
        for tokens in (1, 64, 333):
            q = torch.randn(tokens, case.q_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(tokens, case.k_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
            pos = torch.randint(0, cfg.max_position, (tokens,), dtype=torch.int32, device="cuda")
            ref_q = oracle(q.float().cpu().numpy(), pos.cpu().numpy(), cfg)
            ptr = q.data_ptr()
            launcher.rotate_(q, k, pos, cfg)
            torch.cuda.synchronize()
            err = relative_error(q.float().cpu().numpy(), ref_q)
            out.setdefault("errors", []).append((case.name, tokens, err, q.data_ptr() == ptr))
    worst = max(e[2] for e in out["errors"])
    print(f"triton fast path: worst bf16 rel err {worst:.2e} over {len(out['errors'])} runs")
    # Wall time per call at 64 tokens, and CUDA-graph replay.
    cfg = RopeConfig(head_dim=128)
    q = torch.randn(64, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(64, 8, 128, dtype=torch.bfloat16, device="cuda")
    pos = torch.randint(0, 4096, (64,), dtype=torch.int32, device="cuda")
    for _ in range(20):
        launcher.rotate_(q, k, pos, cfg)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            launcher.rotate_(q, k, pos, cfg)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    out["wall_us_per_call_64"] = statistics.median(times)
    # The floor for any launch from Python on this host: one tiny torch kernel per call.
    tiny = torch.ones(8, device="cuda")
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(1000):
            tiny.mul_(1.0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    out["torch_tiny_op_wall_us"] = statistics.median(times)
    q0, k0 = q.clone(), k.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher.rotate_(q, k, pos, cfg)
    q.copy_(q0)
    k.copy_(k0)
    graph.replay()
    torch.cuda.synchronize()
    expect = oracle(q0.float().cpu().numpy(), pos.cpu().numpy(), cfg)
    out["graph_replay_rel_err"] = relative_error(q.float().cpu().numpy(), expect)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph100 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph100):
        for _ in range(100):
            launcher.rotate_(q, k, pos, cfg)
    graph100.replay()
    start.record()
    for _ in range(10):
        graph100.replay()
    end.record()
    torch.cuda.synchronize()
    out["graph_kernel_us_64"] = start.elapsed_time(end) * 1e3 / 1000
    print(f"triton fast path: {out['wall_us_per_call_64']:.1f} us/call wall at 64 tokens "
          f"(a tiny torch op: {out['torch_tiny_op_wall_us']:.1f} us), "
          f"graph kernel {out['graph_kernel_us_64']:.2f} us, "
          f"graph replay rel err {out['graph_replay_rel_err']:.2e}")
    report["triton_fast_path"] = out


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--sweep-seconds", type=float, default=0.0)
    parser.add_argument("--skip", default="", help="comma list of: cases,timings,triton")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    report = dict(jax=jax.__version__, devices=str(jax.devices()), argv=sys.argv)
    skip = set(filter(None, args.skip.split(",")))
    steps = [("cases", check_cases), ("inplace", check_in_place),
             ("timings", lambda r, rep: timings(r, rep, args.sweep_seconds)),
             ("triton", triton_fast_path)]
    for name, step in steps:
        if name in skip:
            continue
        try:
            step(rng, report)
        except Exception as e:  # noqa: BLE001 - keep going, the report says what failed
            import traceback
            traceback.print_exc()
            report[f"{name}_error"] = repr(e)
    with open(os.path.join(args.out, "kernel_check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
