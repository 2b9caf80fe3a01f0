"""Fused RoPE + paged KV append: jaxrope and the torch bridge against FlashInfer's pair.

    python -m bench.kv_append_bench --out DIR [--tokens 64,16384,65536] [--reps 7]
                                    [--rep-seconds 0.2] [--quick]

Issue 18's shape: bf16, Hq 32, Hk 8, D 128, page_size 16, NHD, theta 1e4; decode-like
batches at up to 512 tokens (one token per request, cached lengths in [0, 4096)),
prefill chunks of up to 1024 tokens above; pages drawn at random (``jaxrope.testing.
flashinfer_kv.paged_batch``). Every implementation runs in this process on the same
inputs:

- ``jaxrope``: ``apply_rope_and_append_kv(backend="triton")`` (the Triton-lowered Pallas
  kernel) under ``jax.jit`` with q and the cache donated (in place), N applications in a
  ``fori_loop``; ``jaxrope_mosaic``: the same with ``backend="mosaic"`` (the Mosaic GPU
  kernel, what "auto" runs on Hopper), on the GPU only;
- ``bridge``: ``RopeManager.apply_qk_and_append_kv`` on torch tensors (the fused kernel
  "auto" launches on torch's stream: ``torch_bridge.launch.mosaic.MosaicKVLauncher`` on
  Hopper), what a torch engine calls; ``bridge_triton`` (GPU): the same through the
  Triton-lowered kernel's launcher, ``torch_bridge.launch.triton.TritonKVLauncher``;
- ``flashinfer_pair``: ``apply_rope_pos_ids_inplace`` then ``append_paged_kv_cache``,
  what an engine runs today;
- ``jaxrope_fp8`` / ``bridge_fp8`` / ``flashinfer_fp8``: the same with an fp8 e4m3 cache,
  ours against ``rope_quantize_fp8_append_paged_kv_cache`` (which also writes q as fp8);
- ``ceiling`` (torch ``mul_(1.0)``) and ``xla_ceiling`` (a jitted ``x * s``): one
  in-place elementwise pass over a buffer of q + k + v, i.e. the bytes the fused op
  moves (read q, k, v; write q and the cache rows; positions and slots are 8 B a token
  more): the byte ceiling of both ``jaxrope`` and ``bridge``.

Times, per application (median over ``--reps`` repeats), all through ``bench/timing.py``:

- ``loop_us``: JAX: a :class:`bench.timing.JaxLoop` (one call and three chained calls
  of the compiled loop, half the difference over N: dispatch and the final sync
  cancel); torch: :func:`bench.timing.time_cuda_graph`, N calls in a CUDA graph, its
  replays between CUDA events (the bridge's captured launches included).
- ``kernel_us`` (GPU): :func:`bench.timing.kernel_durations`, kernel durations from the
  JAX profiler (CUPTI sees torch's kernels too), summed over the kernels that ran at
  least once per application.
- ``wall_us`` (torch rows): :func:`bench.timing.time_wall`, eager calls from Python with
  one sync: what a caller pays per call, dispatch included.

Derived: ``tbps`` = fused-op bytes / ``loop_us``; ``ceiling_fraction`` = the faster
ceiling's time over ours; ``vs_flashinfer`` = our time over the pair's. Targets
(``targets`` in the JSON): for ``jaxrope`` and ``bridge`` >= 0.95 of the ceiling and
<= 0.80x the pair at 16k and 64k tokens (loop times), kernel time <= the pair's at 64
tokens (issue 18); for ``jaxrope_mosaic`` >= 0.96 of the ceiling and <= 0.78x the pair at
16k and 64k tokens, <= 0.55x at 512 (issue 27). Output: ``DIR/kv_append.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

# JAX shares the GPU with torch here: it must not reserve most of the memory at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxrope as jr  # noqa: E402
from bench import timing  # noqa: E402
from jaxrope.testing import flashinfer as fp  # noqa: E402
from jaxrope.testing import flashinfer_kv  # noqa: E402

Q_HEADS, K_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16
CFG = jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4)
DECODE_MAX = 512
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


def paged_layout(rng: np.random.Generator, tokens: int, max_cached: int = 4096,
                 page_size: int = PAGE_SIZE) -> Tuple[flashinfer_kv.PagedBatch, int]:
    """``(batch, pages)``: up to ``DECODE_MAX`` tokens one per request on ``[0, max_cached)``
    cached ones, else prefill chunks of ``PREFILL_CHUNK`` from 0; pages drawn at random."""
    if tokens <= DECODE_MAX:
        append = [1] * tokens
        cached = rng.integers(0, max_cached, tokens).tolist()
    else:
        append = [PREFILL_CHUNK] * (tokens // PREFILL_CHUNK) + (
            [tokens % PREFILL_CHUNK] if tokens % PREFILL_CHUNK else [])
        cached = [0] * len(append)
    pages = sum(-(-(c + a) // page_size) for c, a in zip(cached, append)) + 16
    return flashinfer_kv.paged_batch(rng, append, cached, pages, page_size), pages


def make_inputs(rng: np.random.Generator, tokens: int, max_cached: int = 4096) -> Inputs:
    batch, pages = paged_layout(rng, tokens, max_cached)
    bf16 = jnp.bfloat16

    def normal(heads):
        return np.asarray(jnp.asarray(rng.standard_normal((tokens, heads, HEAD_DIM)), bf16))

    return Inputs(normal(Q_HEADS), normal(K_HEADS), normal(K_HEADS),
                  batch.positions.astype(np.int32), batch, pages)


# -- timing ---------------------------------------------------------------------------------

FP8_SCALE = 0.37
UNROLL = 8  # bench.timing.JaxLoop's default unroll


def row(label: str, t: timing.Timing, kernels: Optional[timing.Timing] = None,
        wall: Optional[timing.Timing] = None) -> Dict[str, Any]:
    """One result row: a loop time, and on the GPU kernel and wall times."""
    out = {"impl": label, "loop_us": t.median_us, "reps_us": list(t.samples_us), "n": t.iters,
           "method": t.method}
    if kernels is not None:
        out.update(kernel_us=kernels.median_us, kernels=kernels.detail.get("kernels", {}))
    if wall is not None:
        out.update(wall_us=wall.median_us)
    return out


def iterations(estimate_s: float, rep_seconds: float, cap: int = 20000) -> int:
    """Applications per loop for about ``rep_seconds``; a multiple of the loop's unroll (8),
    so every kernel of the body runs once per application."""
    n = int(max(2, min(cap, rep_seconds / max(estimate_s, 1e-7))))
    return n - n % UNROLL if n > UNROLL else n


def jax_loop(step: Callable, carry, consts, rep_seconds: float) -> timing.JaxLoop:
    """A :class:`bench.timing.JaxLoop` sized to about ``rep_seconds`` a call (probed first)."""
    probe = timing.JaxLoop(step, carry, consts, iters=8).time(1)
    return timing.JaxLoop(step, carry, consts,
                          iters=iterations(probe.median_us * 1e-6, rep_seconds))


def torch_row(label: str, fn: Callable[[], Any], rep_seconds: float, reps: int, on_gpu: bool,
              wall: bool = False) -> Dict[str, Any]:
    """``fn`` in a CUDA graph (host loop off the GPU); kernel and wall times on the GPU."""
    t = timing.time_cuda_graph(fn, reps=reps, rep_seconds=rep_seconds, max_iters=20000)
    kernels = walls = None
    if on_gpu:
        import torch

        def run():
            for _ in range(t.iters):
                fn()
            torch.cuda.synchronize()

        kernels = timing.kernel_durations(run, t.iters)
    if wall:
        sync = (lambda: __import__("torch").cuda.synchronize()) if on_gpu else None
        walls = timing.time_wall(fn, sync, reps=reps)
    return row(label, t, kernels, walls)


# -- implementations ------------------------------------------------------------------------

def jax_runs(x: Inputs, fp8: bool, backend: str, label: str, rep_seconds: float, reps: int,
             on_gpu: bool, ceiling: bool) -> List[Dict[str, Any]]:
    shape = (x.pages, PAGE_SIZE, K_HEADS, HEAD_DIM)
    dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    scales = {"k_quant_scale": FP8_SCALE, "v_quant_scale": FP8_SCALE} if fp8 else {}
    consts = tuple(jnp.asarray(a) for a in (x.k, x.v, x.pos_ids, x.batch.slots))

    def step(q, k_cache, v_cache, k, v, pos, slots):
        q, cache = jr.apply_rope_and_append_kv(q, k, v, pos, (k_cache, v_cache), slots, CFG,
                                               backend=backend, **scales)
        return (q, *cache)

    carry = (jnp.asarray(x.q), jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    loop = jax_loop(step, carry, consts, rep_seconds)
    kernels = timing.kernel_durations(lambda: loop(1), loop.n) if on_gpu else None
    out = [row(f"{label}_fp8" if fp8 else label, loop.time(reps), kernels)]
    if ceiling and not fp8:
        # No kernel time: each unrolled copy of x * s is a fusion of its own name, run
        # fewer times than the applications, like the loop counter.
        out.append(row("xla_ceiling", xla_ceiling(x.q.size + x.k.size + x.v.size,
                                                  loop.n).time(reps)))
    return out


def xla_ceiling(elements: int, iters: int) -> timing.JaxLoop:
    """The byte ceiling in JAX: a jitted in-place ``x * s`` over ``elements`` bf16 values
    (reads and writes 4 bytes an element), ``iters`` times a loop."""
    return timing.JaxLoop(lambda b, s: (b * s,), (jnp.ones(elements, jnp.bfloat16),),
                          (jnp.asarray(1.0, jnp.bfloat16),), iters=iters)


def torch_ceiling(elements: int, dev) -> Callable[[], Any]:
    """The byte ceiling in torch: one in-place ``mul_(1.0)`` over ``elements`` bf16 values."""
    import torch
    buf = torch.ones(elements, dtype=torch.bfloat16, device=dev)
    return lambda: buf.mul_(1.0)


def bridge_step(x: Inputs, dev):
    """A ``RopeManager`` planned for ``x``'s tokens and ``x`` as torch tensors on ``dev``:
    ``(mgr, q, k, v, slots, cache shape)``."""
    import torch

    from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext

    mgr = RopeManager(PositionConfig(rope=CFG), dev, max_seq_len=CFG.max_position)
    mgr.ingest_request("r")
    positions = torch.from_numpy(x.pos_ids).to(dev)
    mgr.plan(PositionStep([Segment("r", "text", len(x.pos_ids))], pos_ids=positions),
             StepContext(("r",)))
    q, k, v = (flashinfer_kv.to_torch(np.ascontiguousarray(a), dev) for a in (x.q, x.k, x.v))
    slots = torch.from_numpy(x.batch.slots).to(dev)
    return mgr, q, k, v, slots, (x.pages, PAGE_SIZE, K_HEADS, HEAD_DIM)


def bridge_runs(x: Inputs, rep_seconds: float, reps: int, on_gpu: bool) -> List[Dict[str, Any]]:
    """``RopeManager.apply_qk_and_append_kv`` on torch tensors, bf16 and fp8 caches."""
    import torch

    dev = torch.device("cuda" if on_gpu else "cpu")
    mgr, q, k, v, slots, shape = bridge_step(x, dev)
    out = []
    for label, dtype, scales in (("bridge", torch.bfloat16, {}),
                                 ("bridge_fp8", torch.float8_e4m3fn,
                                  {"k_quant_scale": FP8_SCALE, "v_quant_scale": FP8_SCALE})):
        caches = tuple(torch.zeros(shape, dtype=dtype, device=dev) for _ in "kv")

        def call(caches=caches, scales=scales):
            mgr.apply_qk_and_append_kv(q, k, v, "text", caches, slots, **scales)

        out.append(torch_row(label, call, rep_seconds, reps, on_gpu, wall=True))
        out[-1]["path"] = "launcher" if mgr._kv_jax is None else "jax"
    if on_gpu:
        # The Triton-lowered kernel's launch beside "auto"'s (Mosaic GPU's on Hopper), bf16.
        from jaxrope.errors import BackendUnavailable
        from torch_bridge.launch.triton import TritonKVLauncher
        try:
            mgr.kv_launcher = TritonKVLauncher()
        except BackendUnavailable as e:
            print(f"bridge_triton: {e}", flush=True)
            return out
        caches = tuple(torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in "kv")
        out.append(torch_row("bridge_triton", lambda: mgr.apply_qk_and_append_kv(
            q, k, v, "text", caches, slots), rep_seconds, reps, on_gpu, wall=True))
        out[-1]["path"] = "launcher" if mgr._kv_jax is None else "jax"
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
            quantize_dtype=torch.float8_e4m3fn, quant_scale_kv=FP8_SCALE, page_size=PAGE_SIZE,
            kv_layout="NHD", q_rope_out=q_out, q_nope_out=nope_out)

    ceiling = torch_ceiling(q.numel() + k.numel() + v.numel(), dev)
    out = []
    for label, fn, wall in (("flashinfer_pair", pair, True), ("flashinfer_fp8", fused_fp8, False),
                            ("ceiling", ceiling, False)):
        try:
            out.append(torch_row(label, fn, rep_seconds, reps, on_gpu=True, wall=wall))
        except Exception as e:  # noqa: BLE001 - measure the rest, say why
            notes.append(f"{x.q.shape[0]} tokens: {label} failed ({type(e).__name__}: {e})")
    return out


# -- report ---------------------------------------------------------------------------------

# Ours and what it is compared with; the rows the targets apply to.
PAIRS = (("jaxrope", "flashinfer_pair"), ("jaxrope_fp8", "flashinfer_fp8"),
         ("jaxrope_mosaic", "flashinfer_pair"), ("jaxrope_mosaic_fp8", "flashinfer_fp8"),
         ("bridge", "flashinfer_pair"), ("bridge_fp8", "flashinfer_fp8"),
         ("bridge_triton", "flashinfer_pair"))
TARGETED = ("jaxrope", "jaxrope_mosaic", "bridge")
# impl -> (ceiling fraction at >= 16k tokens, time vs the pair at >= 16k, at 512 or None).
LIMITS = {"jaxrope": (0.95, 0.80, None), "bridge": (0.95, 0.80, None),
          "jaxrope_mosaic": (0.96, 0.78, 0.55)}


def derive(rows: List[Dict[str, Any]], tokens: int) -> None:
    by = {r["impl"]: r for r in rows}
    for r in rows:
        r["tokens"], r["bytes"] = tokens, fused_bytes(tokens)
        r["tbps"] = r["bytes"] / r["loop_us"] / 1e6
    ceilings = [by[c]["loop_us"] for c in ("ceiling", "xla_ceiling") if c in by]
    for impl, pair in PAIRS:
        if impl not in by:
            continue
        ours = by[impl]
        if ceilings and impl in TARGETED:
            ours["ceiling_fraction"] = min(ceilings) / ours["loop_us"]
        if pair in by:
            ours["vs_flashinfer"] = ours["loop_us"] / by[pair]["loop_us"]
            if ours.get("kernel_us") and by[pair].get("kernel_us"):
                ours["kernel_vs_flashinfer"] = ours["kernel_us"] / by[pair]["kernel_us"]


def targets(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for r in results:
        if r["impl"] not in TARGETED:
            continue
        ceiling, pair, decode = LIMITS[r["impl"]]
        if r["tokens"] == 512 and decode is not None:
            value = r.get("vs_flashinfer")
            out.append({"impl": r["impl"], "tokens": 512,
                        "target": f"time vs FlashInfer pair <= {decode}", "value": value,
                        "met": value is not None and value <= decode})
        if r["tokens"] >= 16384:
            for name, key, limit, better in ((f"ceiling fraction >= {ceiling}", "ceiling_fraction",
                                              ceiling, max),
                                             (f"time vs FlashInfer pair <= {pair}", "vs_flashinfer",
                                              pair, min)):
                value = r.get(key)
                ok = value is not None and (value >= limit if better is max else value <= limit)
                out.append({"impl": r["impl"], "tokens": r["tokens"], "target": name,
                            "value": value, "met": ok})
        elif r["tokens"] == 64 and r["impl"] != "jaxrope_mosaic":
            value = r.get("kernel_vs_flashinfer")
            out.append({"impl": r["impl"], "tokens": 64,
                        "target": "kernel time vs FlashInfer pair <= 1.0",
                        "value": value, "met": value is not None and value <= 1.0})
    return out


def table(results: List[Dict[str, Any]]) -> str:
    lines = [f"{'tokens':>7} {'impl':<18} {'loop us':>10} {'kernel us':>10} {'wall us':>9} "
             f"{'TB/s':>6} {'%ceil':>6} {'t/FI':>6}"]
    for r in results:
        kernel = f"{r['kernel_us']:.2f}" if r.get("kernel_us") else "-"
        wall = f"{r['wall_us']:.1f}" if r.get("wall_us") else "-"
        ceil = f"{100 * r['ceiling_fraction']:.1f}" if "ceiling_fraction" in r else "-"
        vs = f"{r['vs_flashinfer']:.3f}" if "vs_flashinfer" in r else "-"
        lines.append(f"{r['tokens']:>7} {r['impl']:<18} {r['loop_us']:>10.2f} {kernel:>10} "
                     f"{wall:>9} {r['tbps']:>6.2f} {ceil:>6} {vs:>6}")
    return "\n".join(lines)


def print_targets(checked: List[Dict[str, Any]]) -> None:
    """One line per checked target (this bench's and ``bench.fused_family_bench``'s): its
    case when it has one, implementation, tokens, target, value and whether it is met."""
    for t in checked:
        case = f"{t['case']} " if "case" in t else ""
        print(f"target {case}{t['impl']} {t['tokens']:>6} tokens: {t['target']}: {t['value']} "
              f"{'met' if t['met'] else 'NOT met'}")


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", default="64,512,16384,65536")
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
    backend = "triton" if on_gpu else "xla"
    # The Mosaic GPU kernel beside it where it runs (compute capability 9.0+, JAX 0.11).
    mosaic = on_gpu and jr.ops.backends.backend_name(
        "auto", "gpu", "rope_append_kv",
        jr.ops.backends.device_capability(jax.devices()[0])) == "mosaic"
    notes = [] if on_gpu else ["no GPU: backend='xla', no FlashInfer, the bridge on its JAX "
                               "path; numbers check the plumbing only"]
    has_torch = importlib.util.find_spec("torch") is not None
    if not has_torch:
        notes.append("torch is not installed: no bridge rows")
    rng = np.random.default_rng(args.seed)
    results: List[Dict[str, Any]] = []
    argv = list(sys.argv[1:] if argv is None else argv)
    report = {"command": "python -m bench.kv_append_bench " + " ".join(argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "run": timing.run_info("bench.kv_append_bench", argv),
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
        if has_torch:
            try:
                rows += bridge_runs(x, rep_seconds, reps, on_gpu)
            except Exception as e:  # noqa: BLE001 - measure the rest, say why
                notes.append(f"{count} tokens: bridge failed ({type(e).__name__}: {e})")
        for fp8 in (False, True):
            rows += jax_runs(x, fp8, backend, "jaxrope", rep_seconds, reps, on_gpu, True)
            if mosaic:
                rows += jax_runs(x, fp8, "mosaic", "jaxrope_mosaic", rep_seconds, reps, on_gpu,
                                 False)
        derive(rows, count)
        results += rows
        report["targets"] = targets(results)
        timing.write_json(args.out, "kv_append", report)
    print(table(results))
    print_targets(report["targets"])
    return report


if __name__ == "__main__":
    main()
