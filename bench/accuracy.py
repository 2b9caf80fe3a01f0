"""bf16 accuracy per named case at ~4k, ~128k and ~1M positions, against float64.

    python -m bench.accuracy [--backend auto|mosaic|triton|xla|interpret] [--tokens 512] [--out DIR]

For every case of :mod:`jaxrope.cases` (``max_position`` raised to 2**21), random bf16
``q [T, 4, D]`` at positions drawn from the 4096 positions below 2**12, 2**17 and 2**20:
the relative error (norm) of ``apply_rope`` against a float64 rotation of the same bf16
inputs, and, for contrast, of textbook float32 RoPE (``cos(float32(pos) * inv_freq)``,
float32 rotation) rounded to bf16. Prints a Markdown table; ``--out DIR`` also writes
``DIR/accuracy.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax.numpy as jnp
import numpy as np

from bench import timing
from jaxrope import apply_rope
from jaxrope.cases import CASES
from jaxrope.testing.oracle import relative_error, rope_naive_float32, rope_oracle

BANDS = (1 << 12, 1 << 17, 1 << 20)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write DIR/accuracy.json too")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print("| case (R/D) | " + " | ".join(f"< 2^{b.bit_length() - 1}" for b in BANDS)
          + " | " + " | ".join(f"f32 angle < 2^{b.bit_length() - 1}" for b in BANDS) + " |")
    print("|---" * (1 + 2 * len(BANDS)) + "|")
    rows = {}
    for case in CASES:
        cfg = dataclasses.replace(case.cfg, max_position=1 << 21)
        inv_freq, attention = cfg.serving_frequencies()
        ours, plain = [], []
        for band in BANDS:
            pos = rng.integers(band - 4096, band, args.tokens).astype(np.int32)
            q = jnp.asarray(rng.standard_normal((args.tokens, 4, cfg.head_dim)), jnp.bfloat16)
            k = q[:, :1]
            q2, _ = apply_rope(q, k, jnp.asarray(pos), cfg, backend=args.backend)
            x = np.asarray(q.astype(jnp.float32), np.float64)
            rotation = (pos, inv_freq, attention, cfg.rotary_dim, cfg.interleave)
            exact = rope_oracle(x, *rotation)
            ours.append(relative_error(q2.astype(jnp.float32), exact))
            plain_bf16 = jnp.asarray(rope_naive_float32(x, *rotation), jnp.bfloat16)
            plain.append(relative_error(plain_bf16.astype(jnp.float32), exact))
        rows[case.name] = dict(rotary_dim=cfg.rotary_dim, head_dim=cfg.head_dim, ours=ours,
                               float32_angle=plain)
        print(f"| {case.name} ({cfg.rotary_dim}/{cfg.head_dim}) | "
              + " | ".join(f"{e:.2e}" for e in ours) + " | "
              + " | ".join(f"{e:.2e}" for e in plain) + " |")
    report = dict(info=timing.run_info("bench.accuracy", argv), backend=args.backend,
                  tokens=args.tokens, bands=BANDS, cases=rows)
    if args.out:
        print(f"wrote {timing.write_json(args.out, 'accuracy', report)}")
    return report


if __name__ == "__main__":
    main()
