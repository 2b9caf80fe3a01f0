"""One call each of the Mosaic GPU and the Triton-lowered RoPE kernels (bf16, 16384 tokens,
Hq 32 / Hk 8 / D 128), for Nsight Compute to profile side by side:

    ncu --clock-control none -k regex:rope --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats python3 -m bench.mosaic_ncu
"""

import jax
import jax.numpy as jnp

import jaxrope as jr

if __name__ == "__main__":
    cfg = jr.RopeConfig(head_dim=128)
    q = jax.random.normal(jax.random.key(0), (16384, 32, 128), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (16384, 8, 128), jnp.bfloat16)
    pos = jax.random.randint(jax.random.key(2), (16384,), 0, 65536, jnp.int32)
    for backend in ("mosaic", "triton"):
        jax.block_until_ready(jax.jit(lambda a, b, p: jr.apply_rope(a, b, p, cfg,
                                                                    backend=backend))(q, k, pos))
