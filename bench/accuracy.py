"""bf16 accuracy per named case at ~4k, ~128k and ~1M positions, against float64.

    python -m bench.accuracy [--backend xla|interpret|pallas] [--tokens 512]

For every case of :mod:`jaxrope.cases` (``max_position`` raised to 2**21), random bf16
``q [T, 4, D]`` at positions drawn from the 4096 positions below 2**12, 2**17 and 2**20:
the relative error (norm) of ``apply_rope`` against a float64 rotation of the same bf16
inputs, and, for contrast, of the same rotation with a plain float32 angle
``pos * inv_freq``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxrope import apply_rope
from jaxrope.cases import CASES

BANDS = (1 << 12, 1 << 17, 1 << 20)


def _rotate(x, cos, sin, cfg):
    x = x.copy()
    r = cfg.rotary_dim
    cos, sin = cos[:, None, :], sin[:, None, :]
    if cfg.interleave:
        a, b = x[..., 0:r:2].copy(), x[..., 1:r:2].copy()
        x[..., 0:r:2], x[..., 1:r:2] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = x[..., :r // 2].copy(), x[..., r // 2:r].copy()
        x[..., :r // 2], x[..., r // 2:r] = a * cos - b * sin, b * cos + a * sin
    return x


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="xla")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    print("| case (R/D) | " + " | ".join(f"< 2^{b.bit_length() - 1}" for b in BANDS)
          + " | " + " | ".join(f"f32 angle < 2^{b.bit_length() - 1}" for b in BANDS) + " |")
    print("|---" * (1 + 2 * len(BANDS)) + "|")
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
            angle = pos[:, None].astype(np.float64) * inv_freq[None]
            exact = _rotate(x, np.cos(angle) * attention, np.sin(angle) * attention, cfg)
            ours.append(_rel(np.asarray(q2.astype(jnp.float32), np.float64), exact))
            angle32 = (pos[:, None].astype(np.float32) * inv_freq.astype(np.float32)[None])
            rounded = _rotate(x, np.cos(angle32).astype(np.float64) * attention,
                              np.sin(angle32).astype(np.float64) * attention, cfg)
            rounded = np.asarray(jnp.asarray(rounded, jnp.bfloat16).astype(jnp.float32), np.float64)
            plain.append(_rel(rounded, exact))
        print(f"| {case.name} ({cfg.rotary_dim}/{cfg.head_dim}) | "
              + " | ".join(f"{e:.2e}" for e in ours) + " | "
              + " | ".join(f"{e:.2e}" for e in plain) + " |")


if __name__ == "__main__":
    main()
