"""The sharded apply_rope over a 1-device mesh against the plain call, on one GPU.

    python -m bench.shard_bench --out DIR [--tokens 16384 65536] [--reps 15] [--quick]

On a 1-device mesh the per-shard wrapper (:mod:`jaxrope.sharding`) is pure overhead:
the target is the plain call's time within 3%. Variants, all ``apply_rope`` with
backend "auto" (the Pallas kernel on a GPU, XLA on a CPU) on bf16 q ``[T, 32, 128]``
and k ``[T, 8, 128]``, donated, positions uniform in ``[0, 65536)``:

- ``plain``: arrays on one device, no mesh;
- ``explicit``: q and k ``NamedSharding(mesh, P(None, "model"))`` on a 1-device mesh
  with an Explicit axis (the ``shard_map`` path);
- ``auto``: the same on an Auto axis (the ``custom_partitioning`` path).

Each is a jitted ``fori_loop`` of ``iters`` applications carrying q and k (an
``optimization_barrier`` between applications keeps XLA from fusing them), compiled
once. Per repeat: the wall time of three chained calls minus that of one, over
``2 * iters`` (dispatch and the final sync cancel); the variants take turns within each
repeat so drift hits them alike; the median over repeats is reported. On a GPU the JAX
profiler also gives the kernel time per application (every kernel that ran at least
once per application, summed) and the names of those kernels, and the compiled module
of each loop is counted (Triton calls, copies, transposes): the wrapper must add none.

This timing is self-contained for now. When ``bench/timing.py`` (a shared module
being written) lands, ``_loop_us`` becomes its loop timer and ``_kernel_us`` its
profiler reader; the JSON fields stay.

Writes ``DIR/shard_bench.json``: environment, per variant and token count the loop
median and every repeat (us per application), the kernel time, kernels and HLO counts,
and ``ratio`` (variant over plain, loop and kernel) with ``within_target``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxrope as jr

Q_HEADS, K_HEADS, HEAD_DIM = 32, 8, 128
TARGET = 0.03
VARIANTS = ("plain", "explicit", "auto")
CFG = jr.RopeConfig(head_dim=HEAD_DIM, theta=500000.0, scaling=jr.Llama3(), max_position=1 << 20)


def _placement(variant: str) -> Optional[NamedSharding]:
    if variant == "plain":
        return None
    axis_type = AxisType.Explicit if variant == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((1,), ("model",), axis_types=(axis_type,), devices=jax.devices()[:1])
    return NamedSharding(mesh, P(None, "model"))


def _loop(iters: int) -> Callable:
    def loop(q, k, pos):
        def body(_, qk):
            return jax.lax.optimization_barrier(jr.apply_rope(*qk, pos, CFG))
        return jax.lax.fori_loop(0, iters, body, (q, k))
    return loop


def _compile(variant: str, tokens: int, iters: int, rng: np.random.Generator):
    """The variant's compiled loop and its (placed) inputs."""
    q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((tokens, K_HEADS, HEAD_DIM)), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 65536, tokens), jnp.int32)
    placement = _placement(variant)
    if placement is not None:
        q, k = jax.device_put(q, placement), jax.device_put(k, placement)
        pos = jax.device_put(pos, NamedSharding(placement.mesh, P()))
    compiled = jax.jit(_loop(iters), donate_argnums=(0, 1)).lower(q, k, pos).compile()
    return compiled, [q, k], pos


def _hlo_counts(text: str) -> Dict[str, int]:
    return {"triton_calls": text.count('custom_call_target="__gpu$xla.gpu.triton"'),
            "custom_calls": text.count(" custom-call("),
            "copies": text.count(" copy("), "transposes": text.count(" transpose("),
            "fusions": text.count(" fusion(")}


class _Runner:
    """One variant's compiled loop on its own donated q and k."""

    def __init__(self, compiled, state, pos):
        self.compiled, self.state, self.pos = compiled, state, pos

    def __call__(self, calls: int) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            self.state = list(self.compiled(*self.state, self.pos))
        jax.block_until_ready(self.state)
        return time.perf_counter() - start


def _loop_us(runners: Dict[str, _Runner], iters: int, reps: int) -> Dict[str, List[float]]:
    """Per repeat and variant: (wall of 3 chained calls - wall of 1) / (2 * iters), in us."""
    for run in runners.values():
        run(2)  # warm-up
    times: Dict[str, List[float]] = {name: [] for name in runners}
    for _ in range(reps):
        for name, run in runners.items():
            one = run(1)
            three = run(3)
            times[name].append((three - one) / (2 * iters) * 1e6)
    return times


def _kernel_us(run: _Runner, iters: int) -> Optional[dict]:
    """Kernel time per application from a profiler trace of one loop call (GPU only)."""
    if jax.default_backend() != "gpu":
        return None
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run(1)
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(paths[0])
    kernels: Dict[str, List[float]] = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                if "memcpy" in event.name.lower() or "memset" in event.name.lower():
                    continue
                entry = kernels.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.duration_ns
    every = {name: total / iters / 1e3 for name, (count, total) in kernels.items()
             if count >= iters}
    return {"us": sum(every.values()), "per_application": every}


def run(tokens_list: List[int], reps: int, out: pathlib.Path, iters: Optional[int]) -> dict:
    rng = np.random.default_rng(0)
    results = []
    for tokens in tokens_list:
        n = iters or max(4, 1_000_000 // tokens)
        compiled = {v: _compile(v, tokens, n, rng) for v in VARIANTS}
        runners = {v: _Runner(*compiled[v]) for v in VARIANTS}
        loops = _loop_us(runners, n, reps)
        for variant in VARIANTS:
            results.append({
                "variant": variant, "tokens": tokens, "iters": n,
                "loop_us": statistics.median(loops[variant]), "loop_us_reps": loops[variant],
                "kernel": _kernel_us(runners[variant], n),
                "hlo": _hlo_counts(compiled[variant][0].as_text())})
    for row in results:
        plain = next(r for r in results if r["tokens"] == row["tokens"] and r["variant"] == "plain")
        ratio = {"loop": row["loop_us"] / plain["loop_us"]}
        if row["kernel"] and plain["kernel"]:
            ratio["kernel"] = row["kernel"]["us"] / plain["kernel"]["us"]
        row["ratio"] = ratio
        row["within_target"] = all(abs(r - 1) <= TARGET for r in ratio.values())
        row["same_program"] = row["hlo"] == plain["hlo"]
    report = {
        "bench": "shard_bench", "target": f"sharded over a 1-device mesh within {TARGET:.0%} "
                                          f"of the plain call",
        "shape": {"q_heads": Q_HEADS, "k_heads": K_HEADS, "head_dim": HEAD_DIM,
                  "dtype": "bfloat16", "cfg": repr(CFG)},
        "method": "jitted fori_loop of iters donated applications; (3 calls - 1 call) / "
                  "(2 iters), median over reps, variants interleaved; kernel: JAX profiler",
        "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                "device": jax.devices()[0].device_kind, "python": platform.python_version(),
                "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "results": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "shard_bench.json").write_text(json.dumps(report, indent=1))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=None,
                        help="applications per loop call (default: ~1M tokens' worth)")
    parser.add_argument("--quick", action="store_true",
                        help="a plumbing check: 64 tokens, 3 repeats, 4 applications")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.reps, args.iters = [64], 3, 4
    report = run(args.tokens, args.reps, args.out, args.iters)
    for row in report["results"]:
        kernel = row["kernel"]["us"] if row["kernel"] else float("nan")
        print(f"{row['variant']:>9} {row['tokens']:>6} tokens  loop {row['loop_us']:9.2f} us  "
              f"kernel {kernel:9.2f} us  ratio {row['ratio']}  hlo {row['hlo']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
