"""How the Mosaic GPU fused RoPE + KV append moves with the bytes one block loads a token
and the widest vector a thread moves: points beside the Triton-lowered kernel and the
byte ceiling, in one process.

    python -m bench.kv_mosaic_probe --out DIR [--points 4096:8 4096:4 4096:8:1:0 ...]
                                    [--tokens 16384 65536] [--reps 5]
                                    [--pages random sequential] [--no-angle] [--launch]

A point is ``PIECE_BYTES:VECTOR_BYTES[:TOKENS[:SHARE]]`` (``kv_mosaic._PIECE_BYTES``: a
token's q, k and v over that are split among blocks,
:func:`jaxrope.kernels.kv_mosaic.pieces`; ``kv_mosaic._VECTOR_BYTES``;
``kv_mosaic._TOKENS_PER_BLOCK``; ``kv_mosaic._SHARE_ANGLE``, 1 or 0: the angle formed
one element a thread and passed on through SMEM, or formed in the rotation's layout; the
module's values when left out). bf16 Hq 32 / Hk 8 / D 128, NHD pages of 16 drawn at random
(:func:`bench.kv_append_bench.make_inputs`); each implementation is
``apply_rope_and_append_kv`` in a jitted loop on donated q and caches
(:func:`bench.kv_append_bench.jax_runs`); the ceiling is torch ``mul_(1.0)`` over q's,
k's and v's bytes in a CUDA graph. Writes ``DIR/kv_mosaic_probe.json``.

What the byte ceiling leaves out, measured: ``--pages sequential`` puts the same requests
on pages in order (the cache writes then stream like the ceiling's), and ``--no-angle``
adds each point with the angle replaced by cos 1 / sin 0 (its loads and stores kept), so
the rows show what the page scatter and the angle's arithmetic cost.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from bench import kv_append_bench as kvb
from bench import timing
from bench.mosaic_bench import angle_removed, patched


def in_order(x: kvb.Inputs) -> kvb.Inputs:
    """``x`` with its requests' pages taken in order: request after request, page after
    page (slots ``0..T-1`` for the prefill chunks of ``make_inputs``)."""
    indices = x.batch.kv_indices
    batch = dataclasses.replace(x.batch, kv_indices=np.arange(indices.size, dtype=indices.dtype))
    return dataclasses.replace(x, batch=batch)


def run(points: List[str], tokens: List[int], reps: int, rep_seconds: float,
        seed: int, page_orders: Sequence[str] = ("random",),
        angles: Sequence[bool] = (True,), launches: bool = False) -> List[Dict[str, Any]]:
    import torch

    from jaxrope.kernels import kv_mosaic

    rng = np.random.default_rng(seed)
    rows: List[Dict[str, Any]] = []
    names = ("_PIECE_BYTES", "_VECTOR_BYTES", "_TOKENS_PER_BLOCK", "_SHARE_ANGLE")
    defaults = tuple(getattr(kv_mosaic, n) for n in names)
    for count, order in [(c, o) for c in tokens for o in page_orders]:
        x = kvb.make_inputs(rng, count)
        if order == "sequential":
            x = in_order(x)
        buf = torch.ones(x.q.size + x.k.size + x.v.size, dtype=torch.bfloat16, device="cuda")
        ceiling = timing.time_cuda_graph(lambda: buf.mul_(1.0), reps=reps,
                                         rep_seconds=rep_seconds).median_us

        def time(backend: str) -> float:
            return kvb.jax_runs(x, False, backend, backend, rep_seconds, reps, False,
                                False)[0]["loop_us"]

        def launch() -> float:
            # apply_qk_and_append_kv through "auto"'s launch (Mosaic GPU's on Hopper), bf16,
            # a fresh manager (and launcher: its compiles) for the point's kernel.
            mgr, q, k, v, slots, shape = kvb.bridge_step(x, torch.device("cuda"))
            caches = tuple(torch.zeros(shape, dtype=torch.bfloat16, device="cuda") for _ in "kv")
            return timing.time_cuda_graph(
                lambda: mgr.apply_qk_and_append_kv(q, k, v, "text", caches, slots), reps=reps,
                rep_seconds=rep_seconds, max_iters=20000).median_us

        triton = time("triton")
        for point, angle in [(p, a) for p in points for a in angles]:
            values = [int(v) for v in point.split(":")]
            with patched(kv_mosaic, **dict(zip(names, values))), (
                    contextlib.nullcontext() if angle else angle_removed(kv_mosaic)):
                us = time("mosaic")
                # The torch launch runs one token a block whatever the point says.
                launch_us = launch() if launches and kv_mosaic._TOKENS_PER_BLOCK == 1 else None
                pieces = len(kv_mosaic.pieces(kvb.Q_HEADS, kvb.K_HEADS, kvb.HEAD_DIM,
                                              kvb.HEAD_DIM, 2))
            rows.append(dict(tokens=count, pages=order, angle=angle, point=point, mosaic_us=us,
                             triton_us=triton, ceiling_us=ceiling, pct_ceiling=100 * ceiling / us,
                             default=tuple(values) == defaults[:len(values)], pieces=pieces,
                             launch_us=launch_us))
            launched = (f", launch {launch_us:.1f} ({100 * ceiling / launch_us:.1f}%)"
                        if launch_us is not None else "")
            print(f"{count} {order} {point}{'' if angle else ' no angle'}: {us:.1f} us "
                  f"({100 * ceiling / us:.1f}% of {ceiling:.1f}){launched}, Triton "
                  f"{triton:.1f} ({100 * ceiling / triton:.1f}%)", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_mosaic_probe")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--points", nargs="+", default=["4096:8", "4096:4", "4096:16",
                                                         "4096:8:1:0", "8192:8", "4096:8:2"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rep-seconds", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pages", nargs="+", choices=("random", "sequential"),
                        default=["random"])
    parser.add_argument("--no-angle", action="store_true",
                        help="also time each point with the angle replaced by cos 1 / sin 0")
    parser.add_argument("--launch", action="store_true",
                        help="also time each point of one token a block through the torch "
                             "bridge's launch (which runs one token a block)")
    args = parser.parse_args(argv)
    rows = run(args.points, args.tokens, args.reps, args.rep_seconds, args.seed, args.pages,
               [True, False] if args.no_angle else [True], args.launch)
    timing.write_json(args.out, "kv_mosaic_probe", {"points": args.points,
                                                    "pages": args.pages, "rows": rows})


if __name__ == "__main__":
    main()
