"""Mosaic GPU RoPE against the Triton-lowered kernel, FlashInfer, liger and the ceiling, in
one run.

    python -m bench.mosaic_bench --out DIR [--tokens 16384 65536] [--rounds 2]
                                 [--liger .whl/liger_kernel-0.8.5-py3-none-any.whl]
                                 [--sweep BYTES:IN_FLIGHT ...]
                                 [--tma-sweep TB:STAGES ...]

bf16 q ``[T, 32, 128]``, k ``[T, 8, 128]`` (Llama-3-8B's heads), positions uniform in
``[0, 65536)``. Per token count, ``--rounds`` rounds (ABAB: the spread between rounds is
the noise) of:

- ``mosaic`` / ``triton``: ``apply_rope(backend=...)`` in a jitted loop, q and k donated
  (:class:`bench.timing.JaxLoop`); ``*_mrope``: the same on Qwen2-VL's M-RoPE sections
  (16, 24, 24), positions ``[3, T]``;
- ``mosaic_tma`` (``_mrope``): the experimental TMA-pipelined variant
  (:func:`bench.experiments.mosaic_tma.rope_mosaic_tma`, default :class:`TmaTuning`), called
  directly (it is no ``backend=``) in the same loop;
- ``mosaic_launch`` / ``triton_launch`` (``*_mrope``): the same kernels launched from
  torch by the bridge's launchers (``torch_bridge.launch.mosaic``,
  ``torch_bridge.launch.triton``); ``mosaic_launch_gridN``: at ``--launch-grids`` N;
- ``flashinfer``: ``apply_rope_pos_ids_inplace``; ``liger``: liger-kernel's
  ``qwen2vl_mrope_forward`` (in place, HF's bf16 cos/sin); ``ceiling``: torch ``mul_(1.0)``
  on one buffer of q's and k's bytes; each a CUDA graph of calls, replayed between events.

``%ceil`` = ceiling time / time (the bytes of the rotation are the ceiling's, plus
positions). ``--sweep`` first times the Mosaic kernel at other split sizes (the
``group_bytes`` and ``in_flight`` of :func:`jaxrope.ops.rope.tuning.mosaic_tuning`, each
point a tuning passed to the kernel); the table runs the default tuning. ``--tma-sweep`` first times the TMA variant at other tuning points (tokens per
block, SMEM stages), 1-D. Writes ``mosaic_bench.json`` and prints a table. GPU only (FlashInfer and torch
CUDA needed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxrope as jr  # noqa: E402
from bench import timing  # noqa: E402
from bench.mrope_bench import hf_cos_sin, load_liger  # noqa: E402

Q_HEADS, K_HEADS, HEAD_DIM = 32, 8, 128
ONE_D = jr.RopeConfig(head_dim=HEAD_DIM)
MROPE = jr.RopeConfig(head_dim=HEAD_DIM, mrope_section=(16, 24, 24))


def jax_time(backend: str, cfg, q, k, pos, iters: int, reps: int) -> timing.Timing:
    step = lambda a, b, p: jr.apply_rope(a, b, p, cfg, backend=backend)  # noqa: E731
    return timing.JaxLoop(step, (q, k), (pos,), iters=iters, unroll=8).time(reps)


def kernel_time(kernel, cfg, q, k, pos, iters: int, reps: int, **tuning) -> timing.Timing:
    """A rope kernel's JAX wrapper (``kernel(q, k, pos_ids, tables, ...)``, as
    ``apply_rope`` calls it) at a tuning of its own (``tuning``: the wrapper's keyword), in
    the same loop as :func:`jax_time`."""
    from jaxrope.ops.constants import kernel_constants, kernel_options
    tables = jnp.asarray(kernel_constants(cfg)[0])

    def step(a, b, p):
        return kernel(a, b, p, tables, **kernel_options(cfg), **tuning)
    return timing.JaxLoop(step, (q, k), (pos,), iters=iters, unroll=8).time(reps)


def _tma_time(cfg, q, k, pos, iters: int, reps: int, tuning=None) -> timing.Timing:
    # The TMA variant has no backend name: its wrapper, called as apply_rope calls a kernel.
    from bench.experiments import mosaic_tma
    return kernel_time(mosaic_tma.rope_mosaic_tma, cfg, q, k, pos, iters, reps,
                       tuning=tuning or mosaic_tma.DEFAULT_TUNING)


def inputs(rng, tokens):
    q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((tokens, K_HEADS, HEAD_DIM)), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, 65536, tokens).astype(np.int32))
    # ~10 ms a sample at 4 TB/s.
    iters = max(8, 8 * round(4e12 * 0.01 / (2 * (q.nbytes + k.nbytes)) / 8))
    return q, k, pos, iters


def tma_sweep(args) -> List[Dict[str, Any]]:
    """The TMA variant at each ``--tma-sweep`` point (tokens per block, stages), 1-D."""
    from bench.experiments import mosaic_tma
    rng = np.random.default_rng(args.seed)
    rows = []
    for tokens in args.tokens:
        q, k, pos, iters = inputs(rng, tokens)
        for tb, stages in args.tma_sweep:
            tuning = mosaic_tma.TmaTuning(tokens_per_block=tb, stages=stages)
            try:
                t = _tma_time(ONE_D, q, k, pos, iters, args.reps, tuning)
            except ValueError as e:  # a point the layout cannot take (SMEM, box sizes)
                print(f"tma sweep tokens {tokens} {tb}:{stages}: {e}", flush=True)
                continue
            rows.append(dict(tokens=tokens, tokens_per_block=tb, stages=stages,
                             us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us))
            print(f"tma sweep tokens {tokens} tokens_per_block {tb} stages {stages}: "
                  f"{t.median_us:.1f} us", flush=True)
    return rows


def sweep_tuning(group_bytes: int, in_flight: int):
    """The Mosaic kernel's tuning for the 1-D table's layout at a sweep point."""
    from jaxrope.ops.rope.tuning import mosaic_tuning
    return mosaic_tuning(Q_HEADS, K_HEADS, HEAD_DIM // 2, HEAD_DIM, 2, False,
                         group_bytes=group_bytes, in_flight=in_flight)


def sweep(args) -> List[Dict[str, Any]]:
    """The Mosaic kernel at other split sizes (bytes a thread rotates at once, groups in
    flight), 1-D: each point a :class:`jaxrope.ops.rope.tuning.MosaicTuning` passed to the
    kernel's wrapper."""
    from jaxrope.ops.rope.mosaic import rope_mosaic
    rng = np.random.default_rng(args.seed)
    rows = []
    for tokens in args.tokens:
        q, k, pos, iters = inputs(rng, tokens)
        for group_bytes, in_flight in args.sweep:
            tuning = sweep_tuning(group_bytes, in_flight)
            t = kernel_time(rope_mosaic, ONE_D, q, k, pos, iters, args.reps, tuning=tuning)
            rows.append(dict(tokens=tokens, group_bytes=group_bytes, in_flight=in_flight,
                             tuning=dataclasses.asdict(tuning),
                             us=t.median_us, p10_us=t.p10_us, p90_us=t.p90_us))
            print(f"sweep tokens {tokens} group_bytes {group_bytes} in_flight {in_flight}: "
                  f"{t.median_us:.1f} us", flush=True)
    return rows


def run(args) -> Dict[str, Any]:
    import torch
    import flashinfer.rope as fi
    from torch_bridge.launch.mosaic import MosaicLauncher
    from torch_bridge.launch.triton import TritonLauncher
    liger = load_liger(args.liger)
    launchers = {"mosaic": MosaicLauncher(), "triton": TritonLauncher()}
    rng = np.random.default_rng(args.seed)
    rows: List[Dict[str, Any]] = []
    for tokens in args.tokens:
        q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((tokens, K_HEADS, HEAD_DIM)), jnp.bfloat16)
        pos3 = jnp.asarray(rng.integers(0, 65536, (3, tokens)).astype(np.int32))
        pos = pos3[0]
        qt, kt = (torch.from_dlpack(jnp.copy(x)).clone() for x in (q, k))
        pt = torch.from_dlpack(jnp.copy(pos)).clone()
        buf = torch.cat([qt.reshape(-1), kt.reshape(-1)])
        # ~10 ms a sample at 4 TB/s.
        iters = max(8, 8 * round(4e12 * 0.01 / (2 * buf.numel() * 2) / 8))
        cos, sin = hf_cos_sin(torch, MROPE, np.asarray(pos3), "cuda", torch.bfloat16)
        ql, kl = qt.clone()[None], kt.clone()[None]
        section = list(MROPE.mrope_section)
        torch_calls = {
            "ceiling": lambda: buf.mul_(1.0),
            "flashinfer": lambda: fi.apply_rope_pos_ids_inplace(qt, kt, pt),
        }
        # The kernels through the torch bridge's launchers (rotate_ on torch's stream).
        pt3 = torch.from_dlpack(jnp.copy(pos3)).clone()
        for name, launcher in launchers.items():
            torch_calls[f"{name}_launch"] = (
                lambda launcher=launcher: launcher.rotate_(qt, kt, pt, ONE_D))
            torch_calls[f"{name}_launch_mrope"] = (
                lambda launcher=launcher: launcher.rotate_(qt, kt, pt3, MROPE))
        for grid in args.launch_grids:
            torch_calls[f"mosaic_launch_grid{grid}"] = (
                lambda grid=grid: launchers["mosaic"].rotate_(qt, kt, pt, ONE_D, grid=grid))
        if liger.forward is not None:
            torch_calls["liger_mrope"] = lambda: liger.forward(
                ql.transpose(1, 2), kl.transpose(1, 2), cos, sin, section)
        for round_ in range(args.rounds):
            measured = {}
            for impl in ("mosaic", "triton"):
                measured[impl] = jax_time(impl, ONE_D, q, k, pos, iters, args.reps)
                measured[f"{impl}_mrope"] = jax_time(impl, MROPE, q, k, pos3, iters, args.reps)
            if not args.no_tma:
                measured["mosaic_tma"] = _tma_time(ONE_D, q, k, pos, iters, args.reps)
                measured["mosaic_tma_mrope"] = _tma_time(MROPE, q, k, pos3, iters, args.reps)
            for impl, fn in torch_calls.items():
                measured[impl] = timing.time_cuda_graph(fn, iters=iters, reps=args.reps)
            for impl, t in measured.items():
                rows.append(dict(tokens=tokens, round=round_, impl=impl, us=t.median_us,
                                 p10_us=t.p10_us, p90_us=t.p90_us, iters=t.iters,
                                 method=t.method,
                                 copies=t.detail.get("hlo_copies")))
            print(f"tokens {tokens} round {round_}: " + ", ".join(
                f"{i} {t.median_us:.1f}" for i, t in measured.items()), flush=True)
    return dict(info=timing.run_info("bench.mosaic_bench", sys.argv[1:]),
                device=torch.cuda.get_device_name(0), jax=jax.__version__,
                torch=torch.__version__, liger=liger.version or liger.skipped,
                rows=rows)


def table(report: Dict[str, Any]) -> str:
    lines = ["| tokens | impl | us (median of rounds) | % ceiling | x mosaic |",
             "|---|---|---|---|---|"]
    by = {}
    for r in report["rows"]:
        by.setdefault((r["tokens"], r["impl"]), []).append(r["us"])
    for tokens in sorted({t for t, _ in by}):
        ceiling = float(np.median(by[(tokens, "ceiling")]))
        mosaic = float(np.median(by[(tokens, "mosaic")]))
        for (t, impl), us in sorted(by.items()):
            if t != tokens:
                continue
            us_m = float(np.median(us))
            spread = f" ({min(us):.1f}-{max(us):.1f})" if len(us) > 1 else ""
            lines.append(f"| {tokens} | {impl} | {us_m:.1f}{spread} | {100 * ceiling / us_m:.1f} "
                         f"| {us_m / mosaic:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mosaic_bench")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--liger", default=None)
    parser.add_argument("--sweep", nargs="*", default=[], metavar="BYTES:IN_FLIGHT",
                        help="first time the Mosaic kernel at these split knobs")
    parser.add_argument("--launch-grids", nargs="*", type=int, default=[],
                        help="also time the Mosaic torch launch at these grid sizes")
    parser.add_argument("--tma-sweep", nargs="*", default=[], metavar="TB:STAGES",
                        help="first time the TMA variant at these tokens per block and stages")
    parser.add_argument("--no-tma", action="store_true",
                        help="leave the TMA variant out of the table")
    parser.add_argument("--sweeps-only", action="store_true",
                        help="run the sweeps asked for, not the table")
    args = parser.parse_args(argv)
    args.sweep = [tuple(int(x) for x in item.split(":")) for item in args.sweep]
    args.tma_sweep = [tuple(int(x) for x in item.split(":")) for item in args.tma_sweep]
    swept = sweep(args) if args.sweep else []
    tma_swept = tma_sweep(args) if args.tma_sweep else []
    report = dict(rows=[]) if args.sweeps_only else run(args)
    from bench.experiments import mosaic_tma
    from jaxrope.ops.rope.tuning import mosaic_tuning
    plan = mosaic_tma.plan_tma(Q_HEADS, K_HEADS, HEAD_DIM // 2, HEAD_DIM, 2, False)
    default = mosaic_tuning(Q_HEADS, K_HEADS, HEAD_DIM // 2, HEAD_DIM, 2, False)
    report.update(sweep=swept, mosaic_tuning=dataclasses.asdict(default),
                  tma_sweep=tma_swept, tma_plan=dataclasses.asdict(plan))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mosaic_bench.json").write_text(json.dumps(report, indent=1))
    if report["rows"]:
        print(table(report))


if __name__ == "__main__":
    main()
