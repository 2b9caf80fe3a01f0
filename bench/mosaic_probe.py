"""How the Mosaic GPU RoPE kernel's time moves with its split: each split point's time
beside its register count, one point per process so that Mosaic GPU's compiler dumps
(``MOSAIC_GPU_DUMP_PTXAS``: ptxas's resource lines; ``--dump`` adds PTX and SASS) land in a
folder of their own.

    python -m bench.mosaic_probe --out DIR [--points 32:2:0 128:3:5:16 ...] [--tokens ...]
                                 [--dump 32:2:0]

A point is ``GROUP_BYTES:IN_FLIGHT:SPLITS[:VEC_BYTES]`` (``mosaic_gpu._GROUP_BYTES`` and
``_IN_FLIGHT``, the blocks each token block's head groups are split among, ``SPLITS`` 0
for :func:`jaxrope.kernels.mosaic_gpu.head_splits`'s default, and ``_VEC_BYTES``, the
widest vector a thread moves, the module's when left out; a group under
``mosaic_gpu._ANGLE_HEADS`` heads is still raised to that many where they fit). bf16 q ``[T, 32, 128]``,
k ``[T, 8, 128]``, positions in ``[0, 65536)``; each point times the kernel in a jitted
loop on donated buffers (:class:`bench.timing.JaxLoop`), the Triton-lowered kernel in
the same process as the reference. Writes ``DIR/mosaic_probe.json`` and
``DIR/dump/<point>/`` (what the compiler wrote).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

def one_point(point: str, tokens: List[int], reps: int) -> Dict[str, Any]:
    """Times one point (this process compiles nothing else with Mosaic GPU)."""
    import jax.numpy as jnp
    import numpy as np

    from bench import timing
    from bench.mosaic_bench import ONE_D, inputs, jax_time
    from jaxrope.apply import kernel_constants
    from jaxrope.kernels import mosaic_gpu

    group_bytes, in_flight, splits, *vec_bytes = (int(x) for x in point.split(":"))
    mosaic_gpu._GROUP_BYTES, mosaic_gpu._IN_FLIGHT = group_bytes, in_flight
    if vec_bytes:
        mosaic_gpu._VEC_BYTES = vec_bytes[0]
    tables, attention = kernel_constants(ONE_D)
    tables = jnp.asarray(tables)

    def mosaic(a, b, p):
        return mosaic_gpu.run_static(
            mosaic_gpu.build, a, b, p, tables, rotary_dim=ONE_D.rotary_dim,
            interleave=False, attention_factor=attention, mrope_section=None,
            mrope_interleaved=False, splits=splits or None)

    rng = np.random.default_rng(0)
    rows = []
    for t in tokens:
        q, k, pos, iters = inputs(rng, t)
        mosaic_t = timing.JaxLoop(mosaic, (q, k), (pos,), iters=iters, unroll=8).time(reps)
        triton_t = jax_time("triton", ONE_D, q, k, pos, iters, reps)
        rows.append(dict(tokens=t, mosaic_us=mosaic_t.median_us, triton_us=triton_t.median_us))
    return dict(point=point, rows=rows)


def registers(dump: Path, log: str) -> List[str]:
    """ptxas's "Used N registers" lines, from the dump folder and the process's output."""
    text = log + "".join(p.read_text(errors="replace") for p in dump.rglob("*") if p.is_file()
                         and p.suffix not in (".ptx", ".sass", ".mlir", ".bc"))
    return sorted(set(re.findall(r"Used \d+ registers[^\n]*", text)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mosaic_probe")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--points", nargs="+", default=[
        "32:2:0", "32:2:0:8", "64:2:0", "32:2:5", "128:3:5:16"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dump", nargs="*", default=["32:2:0"],
                        help="points whose PTX and SASS are dumped too")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("PROBE " + json.dumps(one_point(args.one, args.tokens, args.reps)), flush=True)
        return
    out = Path(args.out)
    results = []
    for point in args.points:
        dump = out / "dump" / point.replace(":", "_")
        dump.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, MOSAIC_GPU_DUMP_TO=str(dump), MOSAIC_GPU_DUMP_PTXAS="1",
                   MOSAIC_GPU_DUMP_RESOURCES="1")
        if point in args.dump:
            env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_SASS="1")
        proc = subprocess.run(
            [sys.executable, "-m", "bench.mosaic_probe", "--one", point, "--reps",
             str(args.reps), "--tokens", *map(str, args.tokens)],
            env=env, capture_output=True, text=True, timeout=240)
        log = proc.stdout + proc.stderr
        (dump / "log.txt").write_text(log)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("PROBE ")]
        result = json.loads(lines[-1][6:]) if lines else dict(point=point, error=log[-2000:])
        result["registers"] = registers(dump, log)
        results.append(result)
        print(json.dumps(result), flush=True)
    (out / "mosaic_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
