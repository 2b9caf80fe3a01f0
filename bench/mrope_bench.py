"""M-RoPE: jaxrope's kernel with pos_ids [3, T] against its 1-D kernel and liger-kernel's
Qwen2-VL M-RoPE Triton kernel, timed in one run, and bf16 accuracy vs float64.

    python -m bench.mrope_bench --out DIR [--tokens 16384 65536] [--liger PATH] [--quick]

Sections of ``DIR/results.json`` (also printed as tables):

- ``kernel``: seconds per application at Hq 32, Hk 8, bf16 (``tbps``: the bytes it must
  move, 2 (q + k) plus what it reads of positions or of liger's cos/sin, over the time), for each M-RoPE layout of
  :data:`jaxrope.cases.MROPE_CASES` timed here (Qwen2-VL sectioned, Qwen3-VL interleaved,
  GLM-4.1V partial GPT-J pairs; head_dim 128) and its 1-D twin (the same config without
  ``mrope_section``, positions ``[T]``), ``apply_rope(..., backend="triton")`` jitted with
  q and k donated; and liger's ``qwen2vl_mrope_forward`` on the Qwen2-VL layout, in place
  on q and k laid out ``[1, T, H, D]`` (the transposed views HF passes it), with cos/sin
  ``[3, 1, T, D]`` bf16 precomputed HF-style outside the timing (its kernel reads them;
  ours computes the angle). Targets: M-RoPE <= 1.05x its 1-D twin; faster than liger.
- ``accuracy``: bf16 relative error (norm) vs the float64 oracle of the kernel on every
  M-RoPE case, at positions uniform in ``[0, 2**20)`` and in ``[2**19, 2**20)``, next to
  the floor (the float64 result rounded to bf16), a float32 angle ``pos * inv_freq`` and,
  for the Qwen2-VL layout, liger with HF's float32 cos/sin cast to bf16. Target <= 2.5e-3.

Timing (self-contained until bench/timing.py lands; then replace :func:`time_jax` and
:func:`time_torch` by its JAX-loop and CUDA-graph timers, which have the same contract:
seconds per application): JAX, a jitted ``fori_loop`` of ``n`` applications on donated
buffers; per repeat the wall time of a ``3n`` loop minus an ``n`` loop, over ``2n``, so
dispatch and the final sync cancel; torch, a CUDA graph of ``n`` calls replayed between
CUDA events, over ``n``. The median over ``--reps`` repeats is reported; ``n`` makes one
``n``-loop last about ``--rep-ms``.

liger-kernel (a pure-Python wheel; the GPU machine has no index): ``python3 -m pip
download --no-deps liger-kernel==0.8.5 -d .whl`` and pass ``--liger
.whl/liger_kernel-0.8.5-py3-none-any.whl`` (or an unpacked or installed package; by
default the installed one). Only its ``ops/qwen2vl_mrope.py`` is loaded (torch and triton
imports), not the package, whose ``__init__`` probes every backend. Without CUDA it runs
only under ``TRITON_INTERPRET=1`` (a plumbing check: the interpreter's bf16 comes back
NaN, its float32 matched the oracle to 2e-6); otherwise it is skipped with the reason. On CPU the jaxrope kernels run in the Pallas interpreter: the numbers check
the plumbing, not performance.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time
import zipfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope.cases import BY_NAME, MROPE_CASES
from jaxrope.testing import oracle

# The layouts timed, by case name; liger implements only the first (sectioned, NeoX
# halves, full rotary).
TIMED = ("qwen2_vl_7b", "qwen3_vl_interleaved", "glm41v_partial_pairs")
LIGER_LAYOUT = "qwen2_vl_7b"
Q_HEADS, K_HEADS = 32, 8
TARGET_RATIO_1D = 1.05
TARGET_BF16 = 2.5e-3
ACCURACY_TOKENS = 4096
POSITIONS = {"uniform_2_20": (0, 1 << 20), "upper_half_2_20": (1 << 19, 1 << 20)}


# -- timing ------------------------------------------------------------------------------

def time_jax(apply: Callable, q, k, pos, reps: int, rep_ms: float) -> Tuple[float, int]:
    """Median seconds per application of ``apply(q, k, pos) -> (q, k)``, and ``n``."""
    def loop(n):
        def run(q, k, pos):
            return jax.lax.fori_loop(0, n, lambda _, qk: apply(*qk, pos), (q, k))
        return jax.jit(run, donate_argnums=(0, 1))

    def wall(fn, q, k):
        start = time.perf_counter()
        q, k = fn(q, k, pos)
        jax.block_until_ready((q, k))
        return time.perf_counter() - start, q, k

    one = loop(1)
    q, k = jax.block_until_ready(one(q, k, pos))  # compile
    probe, q, k = wall(one, q, k)
    n = max(1, int(rep_ms / 1e3 / max(probe, 1e-6)))
    short, long = loop(n), loop(3 * n)
    q, k = jax.block_until_ready(short(q, k, pos))
    q, k = jax.block_until_ready(long(q, k, pos))
    samples = []
    for _ in range(reps):
        t_short, q, k = wall(short, q, k)
        t_long, q, k = wall(long, q, k)
        samples.append((t_long - t_short) / (2 * n))
    return statistics.median(samples), n


def time_torch(call: Callable[[], Any], reps: int, rep_ms: float) -> Tuple[float, int]:
    """Median seconds per ``call()`` on the current CUDA stream (a CUDA graph of ``n``)."""
    import torch
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    n = max(1, int(rep_ms / max(start.elapsed_time(end), 1e-3)))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture stream, as CUDA graph capture wants
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(n):
                call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    samples = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / n)
    return statistics.median(samples), n


def time_cpu(call: Callable[[], Any], reps: int) -> Tuple[float, int]:
    """Median wall seconds of ``call()`` (the CPU smoke path: plumbing only)."""
    call()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), 1


# -- liger ---------------------------------------------------------------------------

@dataclasses.dataclass
class Liger:
    forward: Optional[Callable] = None
    version: Optional[str] = None
    source: Optional[str] = None
    skipped: Optional[str] = None


def load_liger(path: Optional[str]) -> Liger:
    """liger-kernel's ``ops/qwen2vl_mrope.py`` from a wheel, a package directory or the
    installed package, loaded by file so the package ``__init__`` never runs."""
    try:
        import torch  # noqa: F401
        import triton  # noqa: F401
    except ImportError as e:
        return Liger(skipped=f"liger needs torch and triton: {e}")
    module_file, version = None, None
    if path and path.endswith(".whl"):
        version = pathlib.Path(path).name.split("-")[1]
        target = pathlib.Path(tempfile.mkdtemp(prefix="liger_"))
        with zipfile.ZipFile(path) as wheel:
            module_file = wheel.extract("liger_kernel/ops/qwen2vl_mrope.py", target)
    elif path:
        root = pathlib.Path(path)
        module_file = next((str(p) for p in (root / "liger_kernel/ops/qwen2vl_mrope.py",
                                             root / "ops/qwen2vl_mrope.py") if p.exists()), None)
    else:
        spec = importlib.util.find_spec("liger_kernel")
        if spec and spec.submodule_search_locations:
            candidate = pathlib.Path(list(spec.submodule_search_locations)[0]) / "ops/qwen2vl_mrope.py"
            module_file = str(candidate) if candidate.exists() else None
            try:
                version = importlib.metadata.version("liger-kernel")
            except importlib.metadata.PackageNotFoundError:
                pass
    if module_file is None:
        return Liger(skipped=f"liger-kernel not found ({path or 'not installed'}); pass --liger "
                             "a wheel from `pip download --no-deps liger-kernel==0.8.5`")
    spec = importlib.util.spec_from_file_location("liger_qwen2vl_mrope", module_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Liger(forward=module.qwen2vl_mrope_forward, version=version, source=module_file)


def liger_device() -> Tuple[Optional[str], Optional[str]]:
    """(torch device, None) where liger can run, else (None, the reason)."""
    import torch
    if torch.cuda.is_available():
        return "cuda", None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu", None
    return None, "no CUDA device for torch (TRITON_INTERPRET=1 runs liger on CPU, slowly)"


def hf_cos_sin(torch, cfg: jr.RopeConfig, pos: np.ndarray, device: str, dtype):
    """cos, sin ``[3, 1, T, D]`` as HF's Qwen2-VL rotary class builds them before the
    section recomposition: float32 ``pos * inv_freq``, both halves, cast to q's dtype."""
    inv_freq = torch.tensor(cfg.serving_frequencies()[0], dtype=torch.float32, device=device)
    freqs = torch.as_tensor(pos, device=device)[:, None, :, None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# -- the runs ----------------------------------------------------------------------------

def one_d(cfg: jr.RopeConfig) -> jr.RopeConfig:
    return dataclasses.replace(cfg, mrope_section=None, mrope_interleaved=False)


def qk_bytes(tokens: int, head_dim: int, itemsize: int = 2) -> int:
    return 2 * tokens * (Q_HEADS + K_HEADS) * head_dim * itemsize


def kernel_section(args, backend: str, liger: Liger, rng) -> List[Dict[str, Any]]:
    rows = []
    for tokens in args.tokens:
        for name in (n for n in TIMED if n in args.cases):
            cfg = BY_NAME[name].cfg
            q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, cfg.head_dim)), jnp.bfloat16)
            k = jnp.asarray(rng.standard_normal((tokens, K_HEADS, cfg.head_dim)), jnp.bfloat16)
            pos = rng.integers(0, 65536, (3, tokens)).astype(np.int32)
            for impl, use_cfg, use_pos in (("jaxrope_1d", one_d(cfg), pos[0]),
                                           ("jaxrope_mrope", cfg, pos)):
                def apply(q, k, p, c=use_cfg):
                    return jr.apply_rope(q, k, p, c, backend=backend)
                if backend == "triton":
                    seconds, n = time_jax(apply, jnp.array(q), jnp.array(k), jnp.asarray(use_pos),
                                          args.reps, args.rep_ms)
                else:
                    jitted, p = jax.jit(apply), jnp.asarray(use_pos)
                    seconds, n = time_cpu(lambda: jax.block_until_ready(jitted(q, k, p)), args.reps)
                rows.append(_timing(name, tokens, impl, cfg, seconds, n, use_pos.nbytes))
            if name == LIGER_LAYOUT:
                rows.append(_liger_timing(args, liger, cfg, tokens, q, k, pos))
    return rows


def _timing(layout, tokens, impl, cfg, seconds, n, pos_bytes, **extra) -> Dict[str, Any]:
    moved = qk_bytes(tokens, cfg.head_dim) + pos_bytes
    return {"layout": layout, "tokens": tokens, "impl": impl, "us": seconds * 1e6, "n": n,
            "bytes": moved, "tbps": moved / seconds / 1e12 if seconds > 0 else None, **extra}


def _liger_timing(args, liger: Liger, cfg, tokens, q, k, pos) -> Dict[str, Any]:
    row = {"layout": LIGER_LAYOUT, "tokens": tokens, "impl": "liger", "liger": liger.version}
    if liger.skipped:
        return dict(row, skipped=liger.skipped)
    import torch
    device, why = liger_device()
    if device is None:
        return dict(row, skipped=why)
    # HF hands liger q as [1, Hq, T, D] views of [1, T, Hq, D] projections; it rotates
    # the contiguous storage in place.
    q_t = torch.as_tensor(np.asarray(q.astype(jnp.float32))).to(device, torch.bfloat16)[None]
    k_t = torch.as_tensor(np.asarray(k.astype(jnp.float32))).to(device, torch.bfloat16)[None]
    cos, sin = hf_cos_sin(torch, cfg, pos, device, torch.bfloat16)
    section = list(cfg.mrope_section)

    def call():
        liger.forward(q_t.transpose(1, 2), k_t.transpose(1, 2), cos, sin, section)

    seconds, n = time_torch(call, args.reps, args.rep_ms) if device == "cuda" else time_cpu(
        call, args.reps)
    # Per token it reads R/2 cos and R/2 sin values (bf16) across the three rows.
    return _timing(LIGER_LAYOUT, tokens, "liger", cfg, seconds, n, tokens * cfg.rotary_dim * 2,
                   liger=liger.version)


def accuracy_section(args, backend: str, liger: Liger, rng) -> List[Dict[str, Any]]:
    rows = []
    tokens = args.accuracy_tokens
    for case in (c for c in MROPE_CASES if c.name in args.cases):
        cfg = case.cfg
        inv_freq, attention = oracle.serving_frequencies(cfg)
        q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, cfg.head_dim)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((tokens, K_HEADS, cfg.head_dim)), jnp.bfloat16)
        inputs = [np.asarray(x, np.float64) for x in (q, k)]
        for where, bounds in POSITIONS.items():
            pos = rng.integers(*bounds, (3, tokens)).astype(np.int32)
            expected = np.concatenate([oracle.rope_oracle(
                x, pos, inv_freq, attention, cfg.rotary_dim, cfg.interleave, cfg.mrope_section,
                cfg.mrope_interleaved).ravel() for x in inputs])
            got = jr.apply_rope(q, k, jnp.asarray(pos), cfg, backend=backend)
            naive = [oracle.rope_naive_float32(x, pos, inv_freq, attention, cfg.rotary_dim,
                                               cfg.interleave, cfg.mrope_section,
                                               cfg.mrope_interleaved) for x in inputs]
            row = {"case": case.name, "positions": where, "tokens": tokens,
                   "error": _bf16_error(got, expected),
                   "floor": _bf16_error([expected], expected),
                   "naive_float32_angle": _bf16_error(naive, expected)}
            if case.name == LIGER_LAYOUT:
                row["liger"] = _liger_error(liger, cfg, q, k, pos, expected)
            row["ok"] = row["error"] <= TARGET_BF16
            rows.append(row)
    return rows


def _bf16_error(outputs: Sequence, expected: np.ndarray) -> float:
    flat = np.concatenate([np.asarray(jnp.asarray(np.asarray(y, np.float32), jnp.bfloat16),
                                      np.float64).ravel() for y in outputs])
    return oracle.relative_error(flat, expected)


def _liger_error(liger: Liger, cfg, q, k, pos, expected) -> Optional[float]:
    if liger.skipped or liger_device()[0] is None:
        return None
    import torch
    device = liger_device()[0]
    q_t = torch.as_tensor(np.asarray(q.astype(jnp.float32))).to(device, torch.bfloat16)[None]
    k_t = torch.as_tensor(np.asarray(k.astype(jnp.float32))).to(device, torch.bfloat16)[None]
    cos, sin = hf_cos_sin(torch, cfg, pos, device, torch.bfloat16)
    liger.forward(q_t.transpose(1, 2), k_t.transpose(1, 2), cos, sin, list(cfg.mrope_section))
    return _bf16_error([x[0].float().cpu().numpy() for x in (q_t, k_t)], expected)


def summarize(kernel: List[Dict[str, Any]], accuracy: List[Dict[str, Any]]) -> Dict[str, Any]:
    by = {(r["layout"], r["tokens"], r["impl"]): r for r in kernel}
    ratios, versus_liger = [], []
    for (layout, tokens, impl), row in by.items():
        if impl == "jaxrope_mrope" and (layout, tokens, "jaxrope_1d") in by:
            ratio = row["us"] / by[(layout, tokens, "jaxrope_1d")]["us"]
            ratios.append({"layout": layout, "tokens": tokens, "mrope_over_1d": ratio,
                           "target": TARGET_RATIO_1D, "ok": ratio <= TARGET_RATIO_1D})
        if impl == "liger" and "us" in row:
            ours = by[(layout, tokens, "jaxrope_mrope")]["us"]
            versus_liger.append({"layout": layout, "tokens": tokens, "ours_us": ours,
                                 "liger_us": row["us"], "ours_over_liger": ours / row["us"],
                                 "ok": ours < row["us"]})
    worst = max((r["error"] for r in accuracy), default=None)
    return {"mrope_over_1d": ratios, "versus_liger": versus_liger,
            "bf16_worst_error": worst, "bf16_target": TARGET_BF16,
            "bf16_ok": worst is not None and worst <= TARGET_BF16,
            "all_ok": (all(r["ok"] for r in ratios + versus_liger) and bool(versus_liger)
                       and worst is not None and worst <= TARGET_BF16)}


def environment(backend: str, liger: Liger) -> Dict[str, Any]:
    env = {"jax": jax.__version__, "backend": backend, "devices": [str(d) for d in jax.devices()],
           "python": platform.python_version(), "liger": liger.version, "liger_source": liger.source,
           "liger_skipped": liger.skipped}
    for dist in ("jaxlib", "torch", "triton"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            env[dist] = None
    return env


def render(report: Dict[str, Any]) -> str:
    lines = ["kernel (us per application; TB/s = 2 (q + k) + positions bytes / time)"]
    for r in report["kernel"]:
        value = (f"{r['us']:10.2f} us {r['tbps'] or 0:6.3f} TB/s n={r['n']}" if "us" in r
                 else f"skipped: {r['skipped']}")
        lines.append(f"  {r['layout']:24s} T={r['tokens']:<6d} {r['impl']:14s} {value}")
    for r in report["summary"]["mrope_over_1d"]:
        lines.append(f"  M-RoPE / 1-D  {r['layout']:24s} T={r['tokens']:<6d} {r['mrope_over_1d']:.3f} "
                     f"(target <= {r['target']}) {'ok' if r['ok'] else 'MISSED'}")
    for r in report["summary"]["versus_liger"]:
        lines.append(f"  ours / liger  T={r['tokens']:<6d} {r['ours_over_liger']:.3f} "
                     f"(target < 1) {'ok' if r['ok'] else 'MISSED'}")
    lines.append("accuracy (bf16 relative error vs float64)")
    for r in report["accuracy"]:
        liger = f" liger {r['liger']:.3e}" if r.get("liger") is not None else ""
        lines.append(f"  {r['case']:26s} {r['positions']:16s} {r['error']:.3e} floor {r['floor']:.3e} "
                     f"float32-angle {r['naive_float32_angle']:.3e}{liger} "
                     f"{'ok' if r['ok'] else 'MISSED'}")
    lines.append(f"all targets met: {report['summary']['all_ok']}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.mrope_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json and table.txt")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=7, help="repeats per timing (median)")
    parser.add_argument("--rep-ms", type=float, default=20.0, help="target length of one loop")
    parser.add_argument("--accuracy-tokens", type=int, default=ACCURACY_TOKENS)
    parser.add_argument("--liger", help="liger-kernel wheel, package directory (default: installed)")
    parser.add_argument("--cases", nargs="+", default=[c.name for c in MROPE_CASES],
                        choices=[c.name for c in MROPE_CASES],
                        help="M-RoPE cases to run (default: all; timed: those of TIMED)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats (CPU smoke)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.reps, args.accuracy_tokens = [8], 2, 8
    on_gpu = jax.default_backend() == "gpu"
    backend = "triton" if on_gpu else "interpret"
    liger = load_liger(args.liger)
    rng = np.random.default_rng(args.seed)
    started = time.time()
    kernel = kernel_section(args, backend, liger, rng)
    accuracy = accuracy_section(args, backend, liger, rng)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m bench.mrope_bench " + " ".join(sys.argv[1:] if argv is None else argv),
              "env": environment(backend, liger), "shape": {"q_heads": Q_HEADS, "k_heads": K_HEADS,
                                                             "dtype": "bfloat16"},
              "kernel": kernel, "accuracy": accuracy, "summary": summarize(kernel, accuracy),
              "elapsed_s": time.time() - started}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    table = render(report)
    (out / "table.txt").write_text(table + "\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
