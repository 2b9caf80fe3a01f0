"""Is the Mosaic GPU RoPE kernel's gap to the ceiling its own, or Mosaic GPU's? One process
times, in jitted loops on donated buffers beside the ceiling (torch ``mul_(1.0)`` in a CUDA
graph) and the Triton-lowered rope kernel:

- ``stream_<C>_v<V>``: the least a Mosaic GPU kernel can do over the same bytes, a block
  negating ``C`` contiguous bf16 elements of one flat buffer (q's and k's bytes) (a
  scale by 1.0 is not a test: LLVM drops the store of a value loaded from the same address)
  through ``plgpu.load``/:func:`jaxrope.kernels.mosaic_gpu.store` in a strided layout of
  ``V``-element vectors;
- ``stream_<C>_v<V>_w<W>``: the same with ``W`` warpgroups a block, each its own ``C``
  elements (``--warpgroups``);
- ``mosaic_<B>:<H>`` and ``mosaic_<B>:<H>_no_angle``: the rope kernel planned with
  vectors of up to ``B`` bytes and angle groups of ``H`` heads (``--plans``);
- ``stream_global_<C>``: :func:`stream_global`, the same with ``ld.global`` / ``st.global``;
- ``stream_two_<C>_v<V>``: :func:`stream_two`, the stream over q and k as two buffers;
- ``stream_<C>_v<V>_pos``: the stream with each block's store waiting on a position it
  reads, as a RoPE block's does;
- ``xla``: XLA's fusion of the same negation;
- ``mosaic``: the rope kernel; ``mosaic_no_angle``: the same kernel with the angle
  replaced by cos 1, sin 0 (its loads of positions and tables stay), which shows what the
  accurate angle's arithmetic costs.

    python -m bench.mosaic_stream_probe --out DIR [--tokens 16384 65536] [--reps 5]
                                       [--warpgroups 2 4] [--plans 16:1 8:4]

bf16 q ``[T, 32, 128]``, k ``[T, 8, 128]``, positions in ``[0, 65536)``. Writes
``DIR/mosaic_stream_probe.json``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Dict, List

import jax
import jax.numpy as jnp
import numpy as np

from bench import timing
from bench.mosaic_bench import ONE_D, angle_removed, inputs, jax_time, patched

# (elements a block, elements a thread vector): 16-byte vectors at three block sizes, 8-byte
# ones, and the rope kernel's 4-byte ones.
_STREAMS = ((2048, 8), (2048, 2), (8192, 8), (32768, 8), (8192, 4))


def stream(buf, elements: int, vec: int, warpgroups: int = 1, pos=None,
           interpret: bool = False):
    """``-buf`` in place, a warpgroup per ``elements`` contiguous elements, ``warpgroups``
    of them a block. With ``pos`` (int32 ``[T]``), block ``b`` also reads ``pos[b % T]``
    and adds it times 0 before its store (not folded away: ``x + 0.0`` turns ``-0.0``
    into ``+0.0``), the dependence of a RoPE block's stores on its token's position."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental import pallas as pl
    from jaxrope.kernels import mosaic_gpu

    layout = plgpu.Layout.WG_STRIDED((elements,), vec_size=vec)

    def body(*refs):
        ref = refs[-1]
        block = part = jax.lax.axis_index("block")
        if warpgroups > 1:
            part = part * warpgroups + jax.lax.axis_index("warpgroup")
        part = ref.at[pl.ds(part * elements, elements)]
        x = plgpu.load(part, layout=layout, optimized=False)
        if pos is not None:
            p = refs[0].at[jax.lax.rem(block, pos.shape[0])][...]
            x = x + (p.astype(jnp.float32) * 0.0).astype(x.dtype)
        mosaic_gpu.store(part, -x)

    ref = jax.new_ref(buf)
    mosaic_gpu.kernel(body, buf.size // (elements * warpgroups), "jaxrope_stream_probe",
                      interpret, warpgroups)(*(() if pos is None else (pos,)), ref)
    return jax.freeze(ref)


def stream_two(q, k, elements: int, vec: int, interpret: bool = False):
    """:func:`stream` over q and k as the two buffers they are: blocks in groups of
    ``q.size // k.size`` q parts and one k part of ``elements`` each, neighbours as a rope
    block's head groups of q and k are."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental import pallas as pl
    from jaxrope.kernels import mosaic_gpu

    layout = plgpu.Layout.WG_STRIDED((elements,), vec_size=vec)
    ratio = q.size // k.size

    def negate(ref, part):
        part = ref.at[pl.ds(part * elements, elements)]
        mosaic_gpu.store(part, -plgpu.load(part, layout=layout, optimized=False))

    def body(q_ref, k_ref):
        block = jax.lax.axis_index("block")
        group, j = jax.lax.div(block, ratio + 1), jax.lax.rem(block, ratio + 1)
        pl.when(j < ratio)(lambda: negate(q_ref, group * ratio + j))
        pl.when(j == ratio)(lambda: negate(k_ref, group))

    refs = [jax.new_ref(x.reshape(-1)) for x in (q, k)]
    mosaic_gpu.kernel(body, (q.size + k.size) // elements, "jaxrope_stream_two_probe",
                      interpret)(*refs)
    return tuple(jax.freeze(r).reshape(x.shape) for r, x in zip(refs, (q, k)))


def stream_global(buf, elements: int):
    """:func:`stream` with 16-byte vectors moved by ``ld.global`` / ``st.global`` (inline
    PTX in an ``inline_mgpu`` block): Mosaic GPU's own transfers address GMEM through
    generic pointers (``ld`` / ``st``), and this shows what that costs."""
    from jax.experimental.mosaic.gpu import utils as mu
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, gpu, llvm
    from jaxrope.kernels import mosaic_gpu

    vecs = elements // 1024  # 16-byte vectors a thread, 128 threads a block

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def negate(ctx, ref):
        void = ir.Type.parse("!llvm.void")
        four = ir.Type.parse("!llvm.struct<(i32, i32, i32, i32)>")
        i64, i32 = (ir.IntegerType.get_signless(b) for b in (64, 32))
        base = llvm.ptrtoint(i64, mu.memref_ptr(ref))
        tid, bid = (arith.index_cast(i64, f(gpu.Dimension.x)) for f in (gpu.thread_id,
                                                                         gpu.block_id))
        start = arith.addi(base, arith.addi(arith.muli(bid, mu.c(elements * 2, i64)),
                                            arith.muli(tid, mu.c(16, i64))))
        start = llvm.inline_asm(i64, [start], "cvta.to.global.u64 $0, $1;", "=l,l")
        addrs = [arith.addi(start, mu.c(i * 2048, i64)) for i in range(vecs)]
        loaded = [llvm.inline_asm(four, [a], "ld.global.v4.b32 {$0, $1, $2, $3}, [$4];",
                                  "=r,=r,=r,=r,l", has_side_effects=True) for a in addrs]
        sign = mu.c(-2147450880, i32)  # 0x80008000: both bf16 sign bits of a word
        for a, v in zip(addrs, loaded):
            words = [arith.xori(llvm.extractvalue(i32, v, [j]), sign) for j in range(4)]
            llvm.inline_asm(void, [a, *words], "st.global.v4.b32 [$0], {$1, $2, $3, $4};",
                            "l,r,r,r,r", has_side_effects=True)

    def body(ref):
        negate(ref)

    ref = jax.new_ref(buf)
    mosaic_gpu.kernel(body, buf.size // elements, "jaxrope_stream_global_probe", False)(ref)
    return jax.freeze(ref)


def plan_times(plan: str, q, k, pos, iters: int, reps: int) -> Dict[str, timing.Timing]:
    """The rope kernel at ``plan`` = ``VEC_BYTES:ANGLE_HEADS`` (``mosaic_gpu._VEC_BYTES``,
    ``mosaic_gpu._ANGLE_HEADS``), with its angle and without: rows ``mosaic_<plan>`` and
    ``mosaic_<plan>_no_angle``."""
    from jaxrope.kernels import mosaic_gpu
    vec_bytes, angle_heads = (int(v) for v in plan.split(":"))
    with patched(mosaic_gpu, _VEC_BYTES=vec_bytes, _ANGLE_HEADS=angle_heads):
        with_angle = jax_time("mosaic", ONE_D, q, k, pos, iters, reps)
        with angle_removed(mosaic_gpu):
            without = jax_time("mosaic", ONE_D, q, k, pos, iters, reps)
    return {f"mosaic_{plan}": with_angle, f"mosaic_{plan}_no_angle": without}


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
        with angle_removed(mosaic_gpu):
            measured["mosaic_no_angle"] = jax_time("mosaic", ONE_D, q, k, pos, iters, args.reps)
        for plan in args.plans:
            measured.update(plan_times(plan, q, k, pos, iters, args.reps))
        measured["xla"] = timing.JaxLoop(lambda b: (-b,), (buf,),
                                         iters=iters, unroll=8).time(args.reps)
        kernels = {f"stream_{e}_v{v}": functools.partial(stream, elements=e, vec=v)
                   for e, v in _STREAMS}
        kernels.update({f"stream_{e}_v{v}_w{w}": functools.partial(stream, elements=e, vec=v,
                                                                  warpgroups=w)
                        for e, v in _STREAMS[-1:] for w in args.warpgroups})
        kernels.update({f"stream_global_{e}": functools.partial(stream_global, elements=e)
                        for e in (2048, 8192)})
        kernels.update({f"stream_{e}_v{v}_pos": functools.partial(stream, elements=e, vec=v,
                                                                 pos=pos)
                        for e, v in _STREAMS[:1]})
        # name -> (loop step, carry): the flat buffer's kernels, then q and k's.
        steps = {name: (lambda b, fn=fn: (fn(b),), (buf,)) for name, fn in kernels.items()}
        steps.update({f"stream_two_{e}_v{v}": (functools.partial(stream_two, elements=e, vec=v),
                                               (q, k)) for e, v in ((2048, 8), (2048, 2))})
        errors = {}
        for name, (step, carry) in steps.items():
            try:
                measured[name] = timing.JaxLoop(step, carry, iters=iters,
                                                unroll=8).time(args.reps)
            except Exception as e:  # a probe: record what failed, time the rest
                errors[name] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{name} failed: {errors[name][:300]}", flush=True)
        # The rope kernel again, last: how far one kernel moves within the run.
        measured["mosaic_again"] = jax_time("mosaic", ONE_D, q, k, pos, iters, args.reps)
        ceiling = measured["ceiling"].median_us
        for impl, t in measured.items():
            rows.append(dict(tokens=tokens, impl=impl, us=t.median_us, p10_us=t.p10_us,
                             p90_us=t.p90_us, pct_ceiling=100 * ceiling / t.median_us))
        print(f"tokens {tokens}: " + ", ".join(
            f"{i} {t.median_us:.1f} ({100 * ceiling / t.median_us:.1f}%)"
            for i, t in measured.items()), flush=True)
        rows.extend(dict(tokens=tokens, impl=name, error=error) for name, error in errors.items())
    return dict(info=timing.run_info("bench.mosaic_stream_probe", sys.argv[1:]),
                device=torch.cuda.get_device_name(0), jax=jax.__version__,
                torch=torch.__version__, rows=rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.mosaic_stream_probe")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plans", nargs="*", default=[],
                        help="also time the rope kernel at VEC_BYTES:ANGLE_HEADS, with "
                             "and without its angle (e.g. 16:1 8:4)")
    parser.add_argument("--warpgroups", nargs="*", type=int, default=[2, 4],
                        help="also time the 8-byte-vector stream with this many warpgroups "
                             "a block")
    args = parser.parse_args(argv)
    timing.write_json(args.out, "mosaic_stream_probe", run(args))


if __name__ == "__main__":
    main()
