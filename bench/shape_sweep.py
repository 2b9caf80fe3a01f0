"""Launch-shape sweep of the Pallas RoPE kernel over head layouts, on the GPU.

    python3 -m bench.shape_sweep [--tokens 16384] [--seconds-per-shape 25] [--layouts 32x8x128]
                                 [--out FILE.json]

For each head layout (q heads, k heads, head_dim) the kernel is launched from torch
(``TritonLauncher.rotate_`` with an explicit ``BlockConfig``), bf16, in place, and timed
with CUDA events (median of 5 x n launches), beside the in-place ``mul_`` ceiling over
the same bytes. The default shape (:func:`jaxrope.kernels.pallas_triton.block_config`)
is timed first; each shape then tries the candidates until its time budget runs out.
Prints, per layout, the default's and the best candidate's time and fraction of the
ceiling, and writes every timing to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List, Tuple

import jax.numpy as jnp

from bench.kernel_check import dispatch_time, rope_fn, torch_ceiling_us, torch_event_time
from jaxrope.config import RopeConfig
from jaxrope.kernels import pallas_triton

LAYOUTS = [(32, 8, 64), (8, 1, 128), (8, 1, 64), (64, 8, 64), (8, 1, 256), (32, 8, 128)]


def candidates(lanes: int) -> List[Tuple[int, int, int, int, int, bool]]:
    """(block_tokens, heads_per_program, num_warps, groups, token_loop, heads_major) to try.

    The heuristic's family first (one warp, 128-element groups), then its program order
    and token loops, then wider programs.
    """
    hp = max(1, 128 // lanes)
    shapes = [(1, hp, 1, g, 1, False) for g in (4, 2, 8, 1)]
    shapes += [(1, hp, 1, 4, 1, True), (1, hp, 1, 2, 1, True)]
    shapes += [(1, hp, 1, 4, loop, major) for loop in (2, 4, 8, 16) for major in (False, True)]
    shapes += [(2, hp, 1, g, 1, major) for g in (1, 2, 4) for major in (False, True)]
    shapes += [(4, hp, 2, g, 1, False) for g in (1, 2)] + [(2, 2 * hp, 2, 1, 1, False),
                                                         (4, 2 * hp, 2, 1, 1, False),
                                                         (8, hp, 2, 1, 1, False)]
    return list(dict.fromkeys(shapes))


def main(argv=None) -> Dict:
    import torch
    from torch_bridge.triton_launch import TritonLauncher

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seconds-per-shape", type=float, default=25.0)
    parser.add_argument("--layouts", default=None, metavar="HQxHKxD,...",
                        help="only these head layouts, e.g. 32x8x128 (default: all of LAYOUTS)")
    parser.add_argument("--path", choices=("torch", "jax"), default="torch",
                        help="launch from torch (Triton's compiler, CUDA events) or through "
                             "jax.jit (XLA's Triton; donated back-to-back calls, wall / n)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("shape_sweep needs a CUDA device")
    launcher = TritonLauncher()
    tokens, n = args.tokens, 50
    report: Dict = {"tokens": tokens, "path": args.path, "layouts": []}
    layouts = LAYOUTS if args.layouts is None else [
        tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    for q_heads, k_heads, head_dim in layouts:
        cfg = RopeConfig(head_dim=head_dim, max_position=1 << 20)
        lanes = pallas_triton.lanes_for(head_dim)
        q = torch.randn(tokens, q_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(tokens, k_heads, head_dim, dtype=torch.bfloat16, device="cuda")
        pos = torch.randint(0, 1 << 20, (tokens,), dtype=torch.int32, device="cuda")
        ceiling = torch_ceiling_us(q.numel() * 2 + k.numel() * 2, n)
        jax_args = tuple(jnp.asarray(x.cpu().float().numpy(), jnp.bfloat16) for x in (q, k)) + (
            jnp.asarray(pos.cpu().numpy()),)
        default = pallas_triton.block_config(tokens, q_heads, k_heads, lanes)
        rows = []
        deadline = time.perf_counter() + args.seconds_per_shape
        for block in [default] + [pallas_triton.BlockConfig(bt, hp, w, groups_per_program=g,
                                                            token_loop=loop, heads_major=major)
                                  for bt, hp, w, g, loop, major in candidates(lanes)]:
            if rows and time.perf_counter() > deadline:
                break
            try:
                if args.path == "jax":
                    us = dispatch_time(rope_fn(cfg, "pallas", block),
                                       tuple(jnp.array(x) for x in jax_args), n)  # donated
                else:
                    us = torch_event_time(lambda: launcher.rotate_(q, k, pos, cfg, block=block), n)
            except Exception as e:  # noqa: BLE001 - report and continue the sweep
                print(f"  {block} failed: {str(e)[:160]}")
                continue
            rows.append((us, block))
        best_us, best = min(rows, key=lambda r: r[0])
        entry = {"q_heads": q_heads, "k_heads": k_heads, "head_dim": head_dim,
                 "ceiling_us": ceiling, "default": str(default), "default_us": rows[0][0],
                 "best": str(best), "best_us": best_us,
                 "all": [(us, str(b)) for us, b in sorted(rows, key=lambda r: r[0])]}
        report["layouts"].append(entry)
        print(f"H{q_heads}x{k_heads} D{head_dim} T{tokens}: ceiling {ceiling:.1f} us | default "
              f"{rows[0][0]:.1f} us ({ceiling / rows[0][0]:.1%}) {default} | best {best_us:.1f} us "
              f"({ceiling / best_us:.1%}) {best} | {len(rows)} tried", flush=True)
        for us, b in sorted(rows, key=lambda r: r[0])[:4]:
            print(f"    {us:8.1f} us  {b}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
