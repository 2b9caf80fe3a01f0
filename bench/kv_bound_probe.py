"""How fast can anything move the fused RoPE + KV append's bytes in its pattern? Kernels
that do only the data movement of ``apply_rope_and_append_kv``, beside ours, the byte
ceiling and FlashInfer's pair, in one process: the bound issue 27's "<= 0.78x the pair"
target at 64k meets.

    python -m bench.kv_bound_probe --out DIR [--tokens 16384 65536] [--reps 5]
                                   [--pages random sequential]

Rows, per token count and page order (bf16 Hq 32 / Hk 8 / D 128, NHD pages of 16 drawn at
random, :func:`bench.kv_append_bench.make_inputs`; ``sequential``: the same requests on
pages in order, :func:`bench.kv_mosaic_probe.in_order`):

- ``move_<W>_w<N>[_hints]``: :func:`move_kernel`, a Triton kernel written for this probe
  (Triton itself, not Pallas): a token's q negated in place in programs of ``W``
  elements, and one program copying its k and v rows (negated) to the cache rows at its
  slot, ``N`` warps a program (``_hints``: with L2 cache hints): the fused op's loads and
  stores with no angle and no rotation;
- ``stream_<W>_w<N>[_hints]``: the same kernel on a flat buffer of q + k + v (every
  program in place, no slots): the ceiling's pattern;
- ``mosaic`` / ``mosaic_no_angle`` / ``triton_lowered``: ``apply_rope_and_append_kv``
  (Mosaic GPU; the same with cos 1 / sin 0, :func:`bench.mosaic_bench.angle_removed`;
  the Triton-lowered Pallas kernel) in jitted loops on donated q and caches;
- ``ceiling``: torch ``mul_(1.0)`` over q's, k's and v's bytes; ``flashinfer_pair``:
  ``apply_rope_pos_ids_inplace`` then ``append_paged_kv_cache``
  (:func:`bench.kv_append_bench.torch_runs`).

Torch rows and the ``move`` / ``stream`` kernels run in CUDA graphs
(:func:`bench.timing.time_cuda_graph`); ours in jitted JAX loops. Each ``move`` and
``stream`` kernel is checked once against torch before it is timed (the caches zeroed
first). ``pct_ceiling`` = ceiling / time;
``vs_pair`` = time / the pair's. Writes ``DIR/kv_bound_probe.json``. GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np

from bench import kv_append_bench as kvb
from bench import timing
from bench.kv_mosaic_probe import in_order
from bench.mosaic_bench import angle_removed

# (elements a q program, warps a program, cache hints): 2048 is the Mosaic kernel's 4 KB
# piece.
_MOVES = ((1024, 4, False), (2048, 4, False), (2048, 8, False), (4096, 4, False),
          (4096, 8, False), (1024, 4, True), (2048, 4, True))


def move_kernel():
    """The Triton kernel (imported here: Triton is on the GPU machine only).

    Program ``t * (q_parts + 1) + j`` (a token's programs are neighbours, as the Mosaic
    kernel's pieces are): for ``j < q_parts``, elements ``[j * W, (j + 1) * W)`` of token
    ``t``'s q row (``q_parts * W`` elements) negated in place; ``j == q_parts``, token
    ``t``'s k and v rows (``ROW`` elements each) negated into row ``slots[t]`` of the k
    and v caches. ``STREAM``: program ``i`` negates elements ``[i * W, (i + 1) * W)`` of
    ``q`` in place, the ceiling's pattern. ``EVICT`` and ``STORE``: the loads' eviction
    policy and the stores' cache modifier (``"evict_first"`` and ``".cs"``: the hints a
    kernel can give the L2 for bytes it will not touch again; ``""``: none). Negation,
    not a copy by 1.0: a store of the value just loaded from the same address may be
    dropped by the compiler.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def move(q, k, v, k_cache, v_cache, slots, Q_PARTS: tl.constexpr, W: tl.constexpr,
             ROW: tl.constexpr, STREAM: tl.constexpr, EVICT: tl.constexpr = "",
             STORE: tl.constexpr = ""):
        t = tl.program_id(0).to(tl.int64) // (Q_PARTS + 1)
        j = tl.program_id(0) % (Q_PARTS + 1)
        if STREAM:
            at = q + tl.program_id(0).to(tl.int64) * W + tl.arange(0, W)
            tl.store(at, -tl.load(at, eviction_policy=EVICT), cache_modifier=STORE)
        elif j < Q_PARTS:
            at = q + t * (Q_PARTS * W) + j * W + tl.arange(0, W)
            tl.store(at, -tl.load(at, eviction_policy=EVICT), cache_modifier=STORE)
        else:
            row = tl.arange(0, ROW)
            slot = tl.load(slots + t).to(tl.int64)
            key = tl.load(k + t * ROW + row, eviction_policy=EVICT)
            value = tl.load(v + t * ROW + row, eviction_policy=EVICT)
            tl.store(k_cache + slot * ROW + row, -key, cache_modifier=STORE)
            tl.store(v_cache + slot * ROW + row, -value, cache_modifier=STORE)

    return move


def run(tokens: Sequence[int], reps: int, rep_seconds: float, seed: int,
        page_orders: Sequence[str]) -> List[Dict[str, Any]]:
    import torch

    from jaxrope.kernels import kv_mosaic
    from jaxrope.testing import flashinfer_kv

    move = move_kernel()
    dev = torch.device("cuda")
    rng = np.random.default_rng(seed)
    rows: List[Dict[str, Any]] = []
    q_row, kv_row = kvb.Q_HEADS * kvb.HEAD_DIM, kvb.K_HEADS * kvb.HEAD_DIM
    for count, order in [(c, o) for c in tokens for o in page_orders]:
        x = kvb.make_inputs(rng, count)
        if order == "sequential":
            x = in_order(x)
        found: Dict[str, float] = {}

        def graph(fn) -> float:
            return timing.time_cuda_graph(fn, reps=reps, rep_seconds=rep_seconds,
                                          max_iters=20000).median_us

        peers = {r["impl"]: r["loop_us"] for r in kvb.torch_runs(x, rep_seconds, reps, [])}
        found["ceiling"], found["flashinfer_pair"] = peers["ceiling"], peers["flashinfer_pair"]
        for label, backend, plain in (("mosaic", "mosaic", True),
                                      ("mosaic_no_angle", "mosaic", False),
                                      ("triton_lowered", "triton", True)):
            with contextlib.nullcontext() if plain else angle_removed(kv_mosaic):
                found[label] = kvb.jax_runs(x, False, backend, label, rep_seconds, reps,
                                            False, False)[0]["loop_us"]

        q, k, v = (flashinfer_kv.to_torch(np.ascontiguousarray(a), dev).view(count, -1)
                   for a in (x.q, x.k, x.v))
        slots = torch.from_numpy(x.batch.slots.astype(np.int64)).to(dev)
        caches = [torch.zeros((x.pages * kvb.PAGE_SIZE, kv_row), dtype=torch.bfloat16,
                              device=dev) for _ in "kv"]
        flat = torch.ones(q.numel() + k.numel() + v.numel(), dtype=torch.bfloat16, device=dev)
        for width, warps, hints in _MOVES:
            parts = q_row // width
            name = f"{width}_w{warps}{'_hints' if hints else ''}"
            hinted = dict(EVICT="evict_first", STORE=".cs") if hints else {}

            def fused(width=width, warps=warps, parts=parts, hinted=hinted):
                move[(count * (parts + 1),)](q, k, v, *caches, slots, Q_PARTS=parts, W=width,
                                             ROW=kv_row, STREAM=False, **hinted,
                                             num_warps=warps)

            def stream(width=width, warps=warps, hinted=hinted):
                move[(flat.numel() // width,)](flat, flat, flat, flat, flat, slots,
                                               Q_PARTS=1, W=width, ROW=kv_row, STREAM=True,
                                               **hinted, num_warps=warps)

            # Zeroed first: the previous entry's timing left -k and -v at the slots.
            for cache in caches:
                cache.zero_()
            before, flat_before = q.clone(), flat.clone()
            fused()
            stream()
            torch.cuda.synchronize()
            assert torch.equal(q, -before), (name, "q")
            for cache, src in zip(caches, (k, v)):
                assert torch.equal(cache[slots], -src), (name, "cache")
            assert torch.equal(flat, -flat_before), (name, "stream")
            found[f"move_{name}"] = graph(fused)
            found[f"stream_{name}"] = graph(stream)
        ceiling, pair = found["ceiling"], found["flashinfer_pair"]
        for impl, us in found.items():
            rows.append(dict(tokens=count, pages=order, impl=impl, us=us,
                             pct_ceiling=100 * ceiling / us, vs_pair=us / pair,
                             target_us=0.78 * pair))
        best = min((i for i in found if i.startswith("move_")), key=found.get)
        print(f"{count} {order}: ceiling {ceiling:.1f}, pair {pair:.1f} (0.78x = "
              f"{0.78 * pair:.1f}); " + ", ".join(
                  f"{i} {found[i]:.1f} ({100 * ceiling / found[i]:.1f}%)"
                  for i in ("mosaic", "mosaic_no_angle", "triton_lowered", best)), flush=True)
        print("  " + ", ".join(f"{i} {u:.1f}" for i, u in found.items()
                               if i.startswith(("move_", "stream_"))), flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_bound_probe")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rep-seconds", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pages", nargs="+", choices=("random", "sequential"),
                        default=["random", "sequential"])
    args = parser.parse_args(argv)
    rows = run(args.tokens, args.reps, args.rep_seconds, args.seed, args.pages)
    timing.write_json(args.out, "kv_bound_probe", {
        "info": timing.run_info("bench.kv_bound_probe", sys.argv[1:]), "rows": rows})


if __name__ == "__main__":
    main()
