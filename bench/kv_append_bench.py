"""Fused RoPE + paged KV append: jaxrope against FlashInfer's pair and the byte ceiling.

    python -m bench.kv_append_bench --out DIR [--tokens 64,16384,65536] [--reps 7]
                                    [--rep-seconds 0.2] [--quick]

Issue 18's shape: bf16, Hq 32, Hk 8, D 128, page_size 16, NHD, theta 1e4; decode-like
batches at up to 256 tokens (one token per request, cached lengths in [0, 4096)),
prefill chunks of up to 1024 tokens above; pages drawn at random (``jaxrope.testing.
flashinfer_kv.paged_batch``). Every implementation runs in this process on the same
inputs:

- ``jaxrope``: ``apply_rope_and_append_kv(backend="pallas")`` under ``jax.jit`` with q
  and the cache donated (in place), N applications in a ``fori_loop``;
- ``flashinfer_pair``: ``apply_rope_pos_ids_inplace`` then ``append_paged_kv_cache``,
  what an engine runs today;
- ``jaxrope_fp8`` / ``flashinfer_fp8``: the same with an fp8 e4m3 cache, ours against
  ``rope_quantize_fp8_append_paged_kv_cache`` (which also writes q as fp8);
- ``ceiling`` (torch ``mul_(1.0)``) and ``xla_ceiling`` (a jitted ``x * s``): one
  in-place elementwise pass over a buffer of q + k + v, i.e. the bytes the fused op
  moves (read q, k, v; write q and the cache rows; positions and slots are 8 B a token
  more).

Times, per application (median over ``--reps`` repeats):

- ``loop_us``: JAX: wall time of three chained calls of the compiled loop minus one,
  over 2N (dispatch and the final sync cancel); torch: a CUDA graph of N calls, timed
  with CUDA events.
- ``kernel_us`` (GPU): kernel durations from the JAX profiler (CUPTI sees torch's
  kernels too), summed over the kernels that ran at least once per application.

Derived: ``tbps`` = fused-op bytes / ``loop_us``; ``ceiling_fraction`` = the faster
ceiling's time over ours; ``vs_flashinfer`` = our time over the pair's. Targets
(``targets`` in the JSON): >= 0.95 of the ceiling and <= 0.80x the pair at 16k and 64k
tokens (loop times), kernel time <= the pair's at 64 tokens.

Timing here is minimal and self-contained on purpose: switch it to ``bench/timing.py``
(the shared timing module) when that lands. Output: ``DIR/kv_append.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

# JAX shares the GPU with torch here: it must not reserve most of the memory at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxrope as jr  # noqa: E402
from jaxrope.testing import flashinfer as fp  # noqa: E402
from jaxrope.testing import flashinfer_kv  # noqa: E402

Q_HEADS, K_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
CFG = jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4)
DECODE_MAX = 256
PREFILL_CHUNK = 1024


def fused_bytes(tokens: int) -> int:
    """q read + q write + k, v read + k, v cache write (bf16) + positions + slots (int32)."""
    return tokens * ((2 * Q_HEADS + 4 * K_HEADS) * HEAD_DIM * 2 + 8)


@dataclasses.dataclass
class Inputs:
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    pos_ids: np.ndarray
    batch: flashinfer_kv.PagedBatch
    pages: int


def make_inputs(rng: np.random.Generator, tokens: int, max_cached: int = 4096) -> Inputs:
    if tokens <= DECODE_MAX:
        append = [1] * tokens
        cached = rng.integers(0, max_cached, tokens).tolist()
    else:
        append = [PREFILL_CHUNK] * (tokens // PREFILL_CHUNK) + (
            [tokens % PREFILL_CHUNK] if tokens % PREFILL_CHUNK else [])
        cached = [0] * len(append)
    pages = sum(-(-(c + a) // PAGE_SIZE) for c, a in zip(cached, append)) + 16
    batch = flashinfer_kv.paged_batch(rng, append, cached, pages, PAGE_SIZE)
    bf16 = jnp.bfloat16

    def normal(heads):
        return np.asarray(jnp.asarray(rng.standard_normal((tokens, heads, HEAD_DIM)), bf16))

    return Inputs(normal(Q_HEADS), normal(K_HEADS), normal(K_HEADS),
                  batch.positions.astype(np.int32), batch, pages)


# -- timing (minimal; to be replaced by bench/timing.py) ----------------------------------

def _median_us(samples: List[float]) -> float:
    return statistics.median(samples) * 1e6


class JaxLoop:
    """A jitted ``fori_loop`` of ``n`` applications of ``step`` on donated ``state``.

    The body is unrolled ``UNROLL`` times, so the loop counter's own launch is amortised
    and runs fewer times than the applications (which keeps it out of ``kernel_us``).
    """

    UNROLL = 8

    def __init__(self, step: Callable, state, extra, n: int):
        n = -(-n // self.UNROLL) * self.UNROLL

        def loop(state, *extra):
            body = lambda i, s: jax.lax.optimization_barrier(step(s, *extra))  # noqa: E731
            return jax.lax.fori_loop(0, n, body, state, unroll=self.UNROLL)

        self.fn = jax.jit(loop, donate_argnums=0)
        self.state, self.extra, self.n = state, extra, n
        self.applications_per_run = 4 * n
        self._calls(1)  # compile and warm up

    def _calls(self, count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            self.state = self.fn(self.state, *self.extra)
        jax.block_until_ready(self.state)
        return time.perf_counter() - start

    def seconds_per_application(self) -> float:
        once, three = self._calls(1), self._calls(3)
        return max(three - once, 1e-9) / 2 / self.n


class TorchLoop:
    """``n`` calls of ``fn`` captured in a CUDA graph, replays timed with CUDA events."""

    def __init__(self, torch, fn: Callable[[], None], n: int):
        self.torch, self.n = torch, n
        self.applications_per_run = n
        fn()  # FlashInfer JIT-builds or loads its module here, outside any timing
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(n):
                fn()
        torch.cuda.synchronize()

    def seconds_per_application(self) -> float:
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / self.n


def kernel_us(run: Callable[[], None], applications: int) -> Dict[str, Any]:
    """Kernel time per application from a JAX profiler trace of ``run``."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        [path, *_] = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    kernels: Dict[str, List[float]] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                name = event.name
                if "memcpy" in name.lower() or "memset" in name.lower():
                    continue
                entry = kernels.setdefault(name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.duration_ns
    # Kernels of every application, not the loop counter's or a copy.
    every = {name: total / applications / 1e3 for name, (count, total) in kernels.items()
             if count >= applications}
    return {"kernel_us": sum(every.values()) if every else None, "kernels": every}


def measure(label: str, loop, reps: int, profile: bool) -> Dict[str, Any]:
    """Loop times; with ``profile`` (GPU) also kernel times from the profiler."""
    samples = [loop.seconds_per_application() for _ in range(reps)]
    result = {"impl": label, "loop_us": _median_us(samples), "reps_us": [s * 1e6 for s in samples],
              "n": loop.n}
    if profile:
        result.update(kernel_us(loop.seconds_per_application, loop.applications_per_run))
    return result


def iterations(estimate_s: float, rep_seconds: float, cap: int = 20000) -> int:
    return int(max(2, min(cap, rep_seconds / max(estimate_s, 1e-7))))


# -- implementations ------------------------------------------------------------------------

def jax_runs(x: Inputs, fp8: bool, backend: str, rep_seconds: float, reps: int,
             on_gpu: bool) -> List[Dict[str, Any]]:
    shape = (x.pages, PAGE_SIZE, K_HEADS, HEAD_DIM)
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    scales = {"k_quant_scale": 0.37, "v_quant_scale": 0.37} if fp8 else {}
    k, v, pos, slots = (jnp.asarray(a) for a in (x.k, x.v, x.pos_ids, x.batch.slots))

    def step(state, k, v, pos, slots):
        q, cache = state
        return jr.apply_rope_and_append_kv(q, k, v, pos, cache, slots, CFG, backend=backend,
                                           **scales)

    def state():
        return jnp.asarray(x.q), (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    probe = JaxLoop(step, state(), (k, v, pos, slots), 2)
    n = iterations(probe.seconds_per_application(), rep_seconds)
    out = [measure("jaxrope_fp8" if fp8 else "jaxrope",
                   JaxLoop(step, state(), (k, v, pos, slots), n), reps, profile=on_gpu)]
    if not fp8:
        # No kernel time: each unrolled copy of x * s is a fusion of its own name, run
        # fewer times than the applications, like the loop counter.
        elements = x.q.size + x.k.size + x.v.size
        ceiling = JaxLoop(lambda b, s: b * s, jnp.ones(elements, jnp.bfloat16),
                          (jnp.asarray(1.0, jnp.bfloat16),), n)
        out.append(measure("xla_ceiling", ceiling, reps, profile=False))
    return out


def torch_runs(x: Inputs, rep_seconds: float, reps: int, notes: List[str]) -> List[Dict[str, Any]]:
    import flashinfer
    import torch

    dev = torch.device("cuda")

    def t(a):
        return flashinfer_kv.to_torch(np.ascontiguousarray(a), dev)

    q, k, v, pos = t(x.q), t(x.k), t(x.v), t(x.pos_ids)
    ids = flashinfer_kv.batch_tensors(x.batch, dev)
    shape = (x.pages, PAGE_SIZE, K_HEADS, HEAD_DIM)
    caches = tuple(torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in "kv")
    fp8_caches = tuple(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=dev) for _ in "kv")
    table, rows = (t(a) for a in fp.cos_sin_cache(CFG, x.pos_ids, dense=False))
    q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=dev)
    nope_out = torch.empty((q.shape[0], Q_HEADS, 0), dtype=torch.float8_e4m3fn, device=dev)

    def pair():
        flashinfer.apply_rope_pos_ids_inplace(q, k, pos, rotary_dim=HEAD_DIM, interleave=False,
                                              rope_scale=1.0, rope_theta=1e4)
        flashinfer.append_paged_kv_cache(k, v, ids["batch_indices"], ids["positions"], caches,
                                         ids["kv_indices"], ids["kv_indptr"],
                                         ids["kv_last_page_len"], kv_layout="NHD")

    def fused_fp8():
        flashinfer.rope.rope_quantize_fp8_append_paged_kv_cache(
            q, k, None, None, v, table, rows, fp8_caches, ids["kv_indices"], ids["kv_indptr"],
            ids["batch_indices"], ids["positions"], is_neox=True,
            quantize_dtype=torch.float8_e4m3fn, quant_scale_kv=0.37, page_size=PAGE_SIZE,
            kv_layout="NHD", q_rope_out=q_out, q_nope_out=nope_out)

    buf = torch.ones(q.numel() + k.numel() + v.numel(), dtype=torch.bfloat16, device=dev)
    out = []
    for label, fn in (("flashinfer_pair", pair), ("flashinfer_fp8", fused_fp8),
                      ("ceiling", lambda: buf.mul_(1.0))):
        try:
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            n = iterations((time.perf_counter() - start) / 5, rep_seconds)
            out.append(measure(label, TorchLoop(torch, fn, n), reps, profile=True))
        except Exception as e:  # noqa: BLE001 - measure the rest, say why
            notes.append(f"{x.q.shape[0]} tokens: {label} failed ({type(e).__name__}: {e})")
    return out


# -- report ---------------------------------------------------------------------------------

def derive(rows: List[Dict[str, Any]], tokens: int) -> None:
    by = {r["impl"]: r for r in rows}
    for r in rows:
        r["tokens"], r["bytes"] = tokens, fused_bytes(tokens)
        r["tbps"] = r["bytes"] / r["loop_us"] / 1e6
    ceilings = [by[c]["loop_us"] for c in ("ceiling", "xla_ceiling") if c in by]
    for impl, pair in (("jaxrope", "flashinfer_pair"), ("jaxrope_fp8", "flashinfer_fp8")):
        if impl not in by:
            continue
        ours = by[impl]
        if ceilings and impl == "jaxrope":
            ours["ceiling_fraction"] = min(ceilings) / ours["loop_us"]
        if pair in by:
            ours["vs_flashinfer"] = ours["loop_us"] / by[pair]["loop_us"]
            if ours.get("kernel_us") and by[pair].get("kernel_us"):
                ours["kernel_vs_flashinfer"] = ours["kernel_us"] / by[pair]["kernel_us"]


def targets(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for r in results:
        if r["impl"] != "jaxrope":
            continue
        if r["tokens"] >= 16384:
            for name, key, limit, better in (("ceiling fraction >= 0.95", "ceiling_fraction", 0.95, max),
                                             ("time vs FlashInfer pair <= 0.80", "vs_flashinfer", 0.80,
                                              min)):
                value = r.get(key)
                ok = value is not None and (value >= limit if better is max else value <= limit)
                out.append({"tokens": r["tokens"], "target": name, "value": value, "met": ok})
        elif r["tokens"] == 64:
            value = r.get("kernel_vs_flashinfer")
            out.append({"tokens": 64, "target": "kernel time vs FlashInfer pair <= 1.0",
                        "value": value, "met": value is not None and value <= 1.0})
    return out


def table(results: List[Dict[str, Any]]) -> str:
    lines = [f"{'tokens':>7} {'impl':<16} {'loop us':>10} {'kernel us':>10} {'TB/s':>6} "
             f"{'%ceil':>6} {'t/FI':>6}"]
    for r in results:
        kernel = f"{r['kernel_us']:.2f}" if r.get("kernel_us") else "-"
        ceil = f"{100 * r['ceiling_fraction']:.1f}" if "ceiling_fraction" in r else "-"
        vs = f"{r['vs_flashinfer']:.3f}" if "vs_flashinfer" in r else "-"
        lines.append(f"{r['tokens']:>7} {r['impl']:<16} {r['loop_us']:>10.2f} {kernel:>10} "
                     f"{r['tbps']:>6.2f} {ceil:>6} {vs:>6}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", default="64,16384,65536")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--rep-seconds", type=float, default=0.2)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 16 tokens, 2 short repeats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    tokens = [16] if args.quick else [int(t) for t in args.tokens.split(",")]
    reps, rep_seconds = (2, 0.01) if args.quick else (args.reps, args.rep_seconds)
    # Off the GPU the XLA path stands in (the interpreter takes seconds per application).
    backend = "pallas" if on_gpu else "xla"
    notes = [] if on_gpu else ["no GPU: backend='xla', no FlashInfer; numbers check the "
                               "plumbing only"]
    rng = np.random.default_rng(args.seed)
    results: List[Dict[str, Any]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"command": "python -m bench.kv_append_bench " + " ".join(argv or sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                      "device": str(jax.devices()[0].device_kind)},
              "shape": {"q_heads": Q_HEADS, "k_heads": K_HEADS, "head_dim": HEAD_DIM,
                        "page_size": PAGE_SIZE, "dtype": "bfloat16", "layout": "NHD"},
              "notes": notes, "results": results}
    for count in tokens:
        # The interpreter copies the whole cache per program: keep it small off the GPU.
        x = make_inputs(rng, count, 4096 if on_gpu else 32)
        rows = []
        if on_gpu:  # torch first: a JAX compile meanwhile would disturb its timing
            try:
                rows += torch_runs(x, rep_seconds, reps, notes)
            except Exception as e:  # noqa: BLE001 - measure the rest, say why
                notes.append(f"{count} tokens: FlashInfer/torch skipped ({type(e).__name__}: {e})")
        for fp8 in (False, True):
            rows += jax_runs(x, fp8, backend, rep_seconds, reps, on_gpu)
        derive(rows, count)
        results += rows
        report["targets"] = targets(results)
        (args.out / "kv_append.json").write_text(json.dumps(report, indent=1, default=float))
    print(table(results))
    for t in report["targets"]:
        print(f"target {t['tokens']:>6} tokens: {t['target']}: {t['value']} "
              f"{'met' if t['met'] else 'NOT met'}")
    return report


if __name__ == "__main__":
    main()
