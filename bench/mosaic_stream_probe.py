"""Is the Mosaic GPU RoPE kernel's gap to the ceiling its own, or Mosaic GPU's? One process
times, in jitted loops on donated buffers beside the ceiling (torch ``mul_(1.0)`` in a CUDA
graph) and the Triton-lowered rope kernel:

- ``stream_<C>``: the least a Mosaic GPU kernel can do over the same bytes, a block
  scaling ``C`` contiguous bf16 elements of one flat buffer (q's and k's bytes) by 1.0
  through ``plgpu.load``/:func:`jaxrope.kernels.mosaic_gpu.store` in a strided layout of
  16-byte vectors;
- ``xla``: XLA's fusion of the same scale;
- ``mosaic``: the rope kernel; ``mosaic_no_angle``: the same kernel with the angle
  replaced by cos 1, sin 0 (its loads of positions and tables stay), which shows what the
  accurate angle's arithmetic costs.

    python -m bench.mosaic_stream_probe --out DIR [--tokens 16384 65536] [--reps 5]

bf16 q ``[T, 32, 128]``, k ``[T, 8, 128]``, positions in ``[0, 65536)``. Writes
``DIR/mosaic_stream_probe.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from bench import timing
from bench.mosaic_bench import ONE_D, inputs, jax_time

_STREAM_ELEMENTS = (2048, 8192, 32768)


def stream(buf, elements: int):
    """``buf * 1.0`` in place, a block per ``elements`` contiguous elements."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental import pallas as pl
    from jaxrope.kernels import mosaic_gpu

    layout = plgpu.Layout.WG_STRIDED((elements,), vec_size=8)

    def body(ref):
        part = ref.at[pl.ds(jax.lax.axis_index("block") * elements, elements)]
        x = plgpu.load(part, layout=layout, optimized=False)
        mosaic_gpu.store(part, (x.astype(jnp.float32) * 1.0).astype(x.dtype))

    ref = jax.new_ref(buf)
    mosaic_gpu.kernel(body, buf.size // elements, "jaxrope_stream_probe", False)(ref)
    return jax.freeze(ref)


def run(args) -> Dict[str, Any]:
    import torch
    from jaxrope.kernels import mosaic_gpu

    rng = np.random.default_rng(args.seed)
    rows: List[Dict[str, Any]] = []
    for tokens in args.tokens:
        q, k, pos, iters = inputs(rng, tokens)
        buf = jnp.concatenate([q.reshape(-1), k.reshape(-1)])
        tbuf = torch.from_dlpack(jnp.copy(buf)).clone()
        measured = {"ceiling": timing.time_cuda_graph(lambda: tbuf.mul_(1.0), iters=iters,
                                                      reps=args.reps)}
        for impl in ("triton", "mosaic"):
            measured[impl] = jax_time(impl, ONE_D, q, k, pos, iters, args.reps)
        angle = mosaic_gpu.angle_cos_sin
        mosaic_gpu.angle_cos_sin = lambda p, *rest, floor: (  # noqa: E731
            p.astype(jnp.float32) * 0.0 + 1.0, p.astype(jnp.float32) * 0.0)
        try:
            measured["mosaic_no_angle"] = jax_time("mosaic", ONE_D, q, k, pos, iters, args.reps)
        finally:
            mosaic_gpu.angle_cos_sin = angle
        measured["xla"] = timing.JaxLoop(lambda b: (b * jnp.bfloat16(1.0),), (buf,),
                                         iters=iters, unroll=8).time(args.reps)
        for elements in _STREAM_ELEMENTS:
            measured[f"stream_{elements}"] = timing.JaxLoop(
                lambda b, e=elements: (stream(b, e),), (buf,), iters=iters,
                unroll=8).time(args.reps)
        ceiling = measured["ceiling"].median_us
        for impl, t in measured.items():
            rows.append(dict(tokens=tokens, impl=impl, us=t.median_us, p10_us=t.p10_us,
                             p90_us=t.p90_us, pct_ceiling=100 * ceiling / t.median_us))
        print(f"tokens {tokens}: " + ", ".join(
            f"{i} {t.median_us:.1f} ({100 * ceiling / t.median_us:.1f}%)"
            for i, t in measured.items()), flush=True)
    return dict(info=timing.run_info("bench.mosaic_stream_probe", sys.argv[1:]),
                device=torch.cuda.get_device_name(0), jax=jax.__version__,
                torch=torch.__version__, rows=rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mosaic_stream_probe")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    timing.write_json(args.out, "mosaic_stream_probe", run(args))


if __name__ == "__main__":
    main()
