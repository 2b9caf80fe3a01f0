"""One call each of the RoPE kernels and the in-place ceiling (bf16, 16384 tokens, Hq 32 /
Hk 8 / D 128), for Nsight Compute to profile side by side: the Mosaic GPU and the
Triton-lowered kernels as JAX calls, the same two through the torch bridge's launchers,
and torch's ``mul_`` over the same bytes.

    ncu --clock-control none -k regex:'rope|elementwise' --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python3 -m bench.mosaic_ncu [--tokens 16384]

Every kernel runs twice (compile, then the profiled launch is the second); pass
``--launch-count`` / ``--launch-skip`` to ncu to pick.
"""

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxrope as jr  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.mosaic_ncu")
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    import torch

    from torch_bridge.mosaic_launch import MosaicLauncher
    from torch_bridge.triton_launch import TritonLauncher

    t = args.tokens
    cfg = jr.RopeConfig(head_dim=128)
    q = jax.random.normal(jax.random.key(0), (t, 32, 128), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (t, 8, 128), jnp.bfloat16)
    pos = jax.random.randint(jax.random.key(2), (t,), 0, 65536, jnp.int32)
    for backend in ("mosaic", "triton"):
        call = jax.jit(lambda a, b, p: jr.apply_rope(a, b, p, cfg, backend=backend))
        for _ in range(2):
            jax.block_until_ready(call(q, k, pos))
    qt, kt, pt = (torch.from_dlpack(jnp.copy(x)).clone() for x in (q, k, pos))
    buf = torch.cat([qt.reshape(-1), kt.reshape(-1)])
    for launcher in (MosaicLauncher(), TritonLauncher()):
        for _ in range(2):
            launcher.rotate_(qt, kt, pt, cfg)
    for _ in range(2):
        buf.mul_(1.0)
    torch.cuda.synchronize()
