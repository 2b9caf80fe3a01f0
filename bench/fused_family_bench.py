"""Issue 46's fused family against FlashInfer 0.5.3, in one run: QK-norm, fp8 q and MLA.

    python -m bench.fused_family_bench --out DIR [--tokens 512,16384,65536]
        [--cases NAME,...] [--backends mosaic,triton] [--reps 5] [--rep-seconds 0.1]
        [--no-kernel-times] [--label NAME] [--quick]

The cases are ``jaxrope.cases.FUSED_CASES`` (Qwen3-8B's Hq 32 / Hk 8 / D 128 with its
QK-norm, DeepSeek-V3's MLA H 128 / r 64 / kv_lora_rank 512; bf16 and fp8), each at
``--tokens``: up to 512 tokens one per request over up to 4096 cached ones, above that
prefill chunks of 1024; pages of 16 drawn at random (``bench.kv_append_bench.paged_layout``).
The calls on both sides are ``jaxrope.testing.fused_family``'s:

- ``jaxrope_<backend>``: ours, jitted with q and the cache donated (the fp8 q output is
  carried and donated instead), N applications in a :class:`bench.timing.JaxLoop`;
- ``flashinfer``: the FlashInfer chain the issue names for the case, in a CUDA graph
  (:func:`bench.timing.time_cuda_graph`): (a) ``rmsnorm(q)`` + ``rmsnorm(k)`` +
  ``apply_rope_pos_ids_inplace`` + ``append_paged_kv_cache``; (b) fp8:
  ``rope_quantize_fp8_append_paged_kv_cache`` (after the two norms for the norm + fp8
  case, which has no target); (c) MLA bf16: ``apply_rope_pos_ids_inplace(q_pe, k_pe)`` +
  ``append_paged_mla_kv_cache``; (d) MLA fp8: the fused fp8 op in MLA mode;
- ``jaxrope_mosaic_launch``: the same Mosaic kernel as ``RopeManager`` launches it from
  torch (``apply_qk_and_append_kv`` / ``apply_mla_and_append_kv``; :func:`launch_row`),
  in a CUDA graph: the kernel without the JAX loop's dispatch between applications;
- ``move`` (MLA cases): :mod:`bench.mla_move`, a Triton kernel that moves the MLA op's
  bytes in its pattern (q_pe in place or to fp8, q_nope to fp8, k_pe and ckv rows to
  their slots) and computes nothing: the bound the MLA targets meet, checked against
  torch once, in a CUDA graph;
- ``ceiling`` (torch) and ``xla_ceiling`` (JAX): ``bench.kv_append_bench``'s byte
  ceiling, one in-place bf16 ``x * 1`` pass, here over ``bytes / 4`` elements where
  ``bytes`` is what the case's fused op must move (:func:`op_bytes`): every input read
  once (bf16), every output written once (bf16, or e4m3 for fp8), int32 positions and
  slots. The faster of the two is the ceiling.

Times per application, medians of ``--reps`` repeats, through ``bench/timing.py``:
``loop_us`` (JAX loop / CUDA graph), ``kernel_us`` on the GPU (profiler kernel
durations). Derived: ``tbps``, ``ceiling_fraction`` (ceiling time / ours, and
FlashInfer's too) and ``vs_peer`` (ours / FlashInfer's). A case or backend this jaxrope
cannot run (a part of the round's contract not built yet, a kernel declining) gives a
row with ``"unavailable": <reason>`` and the run goes on. Targets (issue 46;
:data:`TARGETS`) sit beside each row; the ceiling target applies at 16k tokens and up,
as in ``bench.kv_append_bench``. Output: ``DIR/fused_family.json`` and ``DIR/fused_family.md``
(``fused_family-<label>.*`` with ``--label``, to split a run over two commands).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxrope as jr  # noqa: E402
from bench import kv_append_bench as kvb  # noqa: E402
from bench import timing  # noqa: E402
from jaxrope import cases  # noqa: E402
from jaxrope.testing import flashinfer_kv  # noqa: E402
from jaxrope.testing import fused_family as ff  # noqa: E402

# case -> (x the peer at >= 16k tokens, x the peer at 512, ceiling fraction at >= 16k);
# None: the issue sets none. MLA fp8's "<= 0.85x" has no token qualifier: both apply.
TARGETS: Dict[str, Tuple[Optional[float], Optional[float], Optional[float]]] = {
    "qwen3_8b_norm_bf16": (0.55, 0.40, 0.95),
    "qwen3_8b_fp8": (0.75, 1.0, 0.95),
    "qwen3_8b_norm_fp8": (None, None, None),
    "deepseek_v3_mla_bf16": (0.95, 0.75, 0.95),
    "deepseek_v3_mla_fp8": (0.85, 0.85, 0.95),
}
LARGE = 16384  # token counts from here on are "16k and 64k" for the targets
DRAWN = 1024  # rows of each input drawn at random (see make_inputs)


def op_bytes(case: cases.FusedCase, tokens: int) -> int:
    """Bytes the fused op must move: inputs read once (bf16, norm weights included), q,
    q_nope (fp8 MLA), k and v written once (bf16, or 1 B for fp8), positions and slots.

    >>> op_bytes(cases.FUSED_BY_NAME["qwen3_8b_fp8"], 1)  # (32 + 2 * 8) * 128 * (2 + 1) + 8
    18440
    """
    shapes = ff.input_shapes(case, tokens)
    read = sum(math.prod(s) for s in shapes.values()) * 2
    written = sum(math.prod(s) for name, s in shapes.items()
                  if name in ("q", "k", "v") or (name == "q_nope" and case.fp8))
    return read + written * (1 if case.fp8 else 2) + 8 * tokens


def ceiling_elements(case: cases.FusedCase, tokens: int) -> int:
    """bf16 elements of the ceiling's in-place pass (4 bytes each: read and written)."""
    return -(-op_bytes(case, tokens) // 4)


@dataclasses.dataclass
class Inputs:
    """One (case, tokens) point: JAX arrays on the default device and the page table."""

    case: cases.FusedCase
    arrays: Dict[str, jax.Array]
    pos_ids: np.ndarray
    batch: flashinfer_kv.PagedBatch
    pages: int

    @property
    def tokens(self) -> int:
        return len(self.pos_ids)


def make_inputs(case: cases.FusedCase, tokens: int, seed: int, max_cached: int) -> Inputs:
    """Pages from a numpy generator, activations drawn on the device (64k tokens of
    DeepSeek-V3's q_nope are 4G values: too many to draw on the host)."""
    rng = np.random.default_rng([seed, tokens, cases.FUSED_CASES.index(case)])
    batch, pages = kvb.paged_layout(rng, tokens, max_cached, case.page_size)
    shapes = tuple(sorted(ff.input_shapes(case, tokens).items()))
    arrays = _draw(jax.random.key(int(rng.integers(1 << 31))), shapes)
    return Inputs(case, arrays, batch.positions.astype(np.int32), batch, pages)


@functools.partial(jax.jit, static_argnums=1)
def _draw(key: jax.Array, shapes: Tuple[Tuple[str, Tuple[int, ...]], ...]) -> Dict[str, jax.Array]:
    """bf16 arrays by name: 2 N(0, 1), norm weights 1 + N(0, 0.1**2); one compile."""
    arrays = {}
    for i, (name, shape) in enumerate(shapes):
        # At most DRAWN rows drawn, then repeated: one draw stays far below 2**32 values
        # (DeepSeek-V3's q_nope at 64k tokens is exactly 2**32), and times do not
        # depend on the values.
        drawn = (min(shape[0], DRAWN), *shape[1:])
        x = jax.random.normal(jax.random.fold_in(key, i), drawn, jnp.float32)
        x = (1 + 0.1 * x if name in ("wq", "wk") else 2 * x).astype(jnp.bfloat16)
        if drawn[0] < shape[0]:
            x = jnp.tile(x, (-(-shape[0] // drawn[0]),) + (1,) * (len(shape) - 1))[:shape[0]]
        arrays[name] = x
    return arrays


def _unavailable(label: str, reason: str) -> Dict[str, Any]:
    print(f"{label}: unavailable: {reason}", flush=True)
    return {"impl": label, "unavailable": reason}


def jax_run(x: Inputs, backend: str, rep_seconds: float, reps: int, kernel_times: bool,
            iters: Optional[int] = None) -> Dict[str, Any]:
    """Ours on ``backend`` in a JaxLoop of ``iters`` applications (default: sized to about
    ``rep_seconds`` by a probe): a row, or an "unavailable" row saying why."""
    label = f"jaxrope_{backend}"
    case = x.case
    reason = ff.unavailable(case)
    if reason:
        return _unavailable(label, reason)
    call = ff.ours(case, backend)
    a = x.arrays
    dtype = jnp.float8_e4m3fn if case.fp8 else jnp.bfloat16
    caches = tuple(jnp.zeros(s, dtype) for s in ff.cache_shapes(case, x.pages))
    args = (a["k"], a["v"], a.get("q_nope"), a.get("wq"), a.get("wk"), jnp.asarray(x.pos_ids),
            jnp.asarray(x.batch.slots))
    if case.fp8:
        # q is read, not rotated in place: the fp8 outputs are the carry.
        outs = [jnp.zeros(a["q"].shape, dtype)]
        if case.mla and case.q_nope_dim:
            outs.append(jnp.zeros(a["q_nope"].shape, dtype))
        n_out = len(outs)

        def step(*carry_and_consts):
            carry, consts = carry_and_consts[:n_out + 2], carry_and_consts[n_out + 2:]
            q_out, nope_out, new = call(consts[0], *consts[1:], carry[n_out:])
            return (q_out, *((nope_out,) if n_out == 2 else ()), *new)
        carry, consts = (*outs, *caches), (a["q"], *args)
    else:
        def step(q, c0, c1, *consts):
            q_out, _, new = call(q, *consts, (c0, c1))
            return (q_out, *new)
        carry, consts = (a["q"], *caches), args
    try:
        loop = (kvb.jax_loop(step, carry, consts, rep_seconds) if iters is None
                else timing.JaxLoop(step, carry, consts, iters=iters))
        kernels = timing.kernel_durations(lambda: loop(1), loop.n) if kernel_times else None
        t = loop.time(reps)
    except Exception as e:  # noqa: BLE001 - a declining backend is a result, not a crash
        return _unavailable(label, f"{type(e).__name__}: {str(e)[:400]}")
    out = kvb.row(label, t, kernels)
    out["hlo_copies"] = t.detail.get("hlo_copies")
    return out


def torch_runs(x: Inputs, rep_seconds: float, reps: int, notes: List[str]) -> List[Dict[str, Any]]:
    """FlashInfer's chain and the torch ceiling on the GPU (copies of ``x``'s arrays)."""
    import torch

    dev = torch.device("cuda")
    case = x.case
    tensors = {name: torch.from_dlpack(a).clone() for name, a in x.arrays.items()}
    dtype = torch.float8_e4m3fn if case.fp8 else torch.bfloat16
    tensors["caches"] = tuple(torch.zeros(s, dtype=dtype, device=dev)
                              for s in ff.cache_shapes(case, x.pages))
    tensors["pos"] = flashinfer_kv.to_torch(x.pos_ids, dev)
    tensors["slots"] = flashinfer_kv.to_torch(x.batch.slots.astype(np.int32), dev)
    out = []
    try:
        step, fi_out = ff.flashinfer_step(case, tensors, x.pos_ids, x.batch)
        if fi_out["note"] and fi_out["note"] not in notes:
            notes.append(fi_out["note"])
        out.append(kvb.torch_row("flashinfer", step, rep_seconds, reps, on_gpu=True))
    except Exception as e:  # noqa: BLE001 - measure the rest, say why
        out.append(_unavailable("flashinfer", f"{type(e).__name__}: {str(e)[:400]}"))
    if case.mla:
        out.append(move_row(x, tensors, rep_seconds, reps))
    out.append(launch_row(x, tensors, rep_seconds, reps))
    step = fi_out = tensors = None  # free FlashInfer's buffers before the ceiling's
    torch.cuda.empty_cache()
    out.append(kvb.torch_row("ceiling", kvb.torch_ceiling(ceiling_elements(case, x.tokens), dev),
                             rep_seconds, reps, on_gpu=True))
    torch.cuda.empty_cache()
    return out


def move_row(x: Inputs, tensors: Dict[str, Any], rep_seconds: float,
             reps: int) -> Dict[str, Any]:
    """The MLA bound (:mod:`bench.mla_move`) on the case's torch tensors: checked, timed."""
    from bench import mla_move  # torch's: imported where torch is

    ckv_cache, kpe_cache = tensors["caches"]
    args = (tensors["q"], tensors["k"], tensors["v"], ckv_cache, kpe_cache, tensors["slots"],
            tensors.get("q_nope"))
    try:
        step = mla_move.move_step(*args)
        mla_move.check(step, *args)
    except Exception as e:  # noqa: BLE001 - measure the rest, say why
        return _unavailable("move", f"{type(e).__name__}: {str(e)[:400]}")
    return kvb.torch_row("move", step, rep_seconds, reps, on_gpu=True)


def launch_row(x: Inputs, tensors: Dict[str, Any], rep_seconds: float,
               reps: int) -> Dict[str, Any]:
    """Ours as ``RopeManager`` runs it on Hopper, in a CUDA graph: the Mosaic kernel
    exported and launched from torch on the case's tensors (raw pointers, no JAX loop
    around it): :class:`torch_bridge.launch.mla.MosaicMlaLauncher` for MLA (what
    ``apply_mla_and_append_kv`` launches), :class:`torch_bridge.launch.mosaic.
    MosaicKVLauncher` with the case's norm and fp8 q otherwise (``apply_qk_and_append_kv``)."""
    import torch

    case = x.case
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    caches, slots, pos = tensors["caches"], tensors["slots"], tensors["pos"]
    e4m3 = torch.float8_e4m3fn
    try:
        if case.mla:
            from torch_bridge.launch.mla import MosaicMlaLauncher

            q_nope, outs, scales = tensors.get("q_nope"), {}, (1.0, 1.0)
            if case.fp8:
                scales = (ff.Q_SCALE, ff.KV_SCALE)
                outs["q_pe_out"] = torch.empty_like(q, dtype=e4m3)
                if q_nope is not None:
                    outs.update(q_nope=q_nope, q_nope_out=torch.empty_like(q_nope, dtype=e4m3))
            launcher = MosaicMlaLauncher()

            def step() -> None:
                launcher.rotate_and_append_mla_(q, k, v, pos, caches, slots, case.cfg,
                                                scales, **outs)
        else:
            from torch_bridge.kv_append import check_call
            from torch_bridge.launch.mosaic import MosaicKVLauncher

            kv_scale = ff.KV_SCALE if case.fp8 else None
            caches, geometry, scales = check_call(k, v, caches, slots, "NHD", kv_scale,
                                                  kv_scale, q.device)
            opts: Dict[str, Any] = {}
            if case.fp8:
                scales = (*scales, ff.Q_SCALE)
                opts["q_out"] = torch.empty_like(q, dtype=e4m3)
            if case.qk_norm is not None:
                opts["norm"] = (tensors["wq"], tensors["wk"], case.qk_norm)
            launcher = MosaicKVLauncher()

            def step() -> None:
                launcher.rotate_and_append_kv_(q, k, v, pos, caches, slots, case.cfg,
                                               geometry, scales, **opts)
        step()  # compiled outside the graph's capture
    except Exception as e:  # noqa: BLE001 - measure the rest, say why
        return _unavailable("jaxrope_mosaic_launch", f"{type(e).__name__}: {str(e)[:400]}")
    return kvb.torch_row("jaxrope_mosaic_launch", step, rep_seconds, reps, on_gpu=True)


def xla_ceiling_row(case: cases.FusedCase, tokens: int, rep_seconds: float, reps: int,
                    iters: Optional[int] = None) -> Dict[str, Any]:
    """``bench.kv_append_bench.xla_ceiling`` over the case's bytes, ``iters`` applications
    a loop (default: sized by a probe to about ``rep_seconds``)."""
    elements = ceiling_elements(case, tokens)
    if iters is None:
        probe = kvb.xla_ceiling(elements, 8).time(1)
        iters = kvb.iterations(probe.median_us * 1e-6, rep_seconds)
    return kvb.row("xla_ceiling", kvb.xla_ceiling(elements, iters).time(reps))


def derive(rows: List[Dict[str, Any]], case: cases.FusedCase, tokens: int) -> None:
    """Bytes, TB/s, ceiling fraction and time over FlashInfer's, per timed row."""
    timed = {r["impl"]: r for r in rows if "loop_us" in r}
    ceilings = [timed[c]["loop_us"] for c in ("ceiling", "xla_ceiling") if c in timed]
    peer = timed.get("flashinfer")
    for r in rows:
        r.update(case=case.name, tokens=tokens, bytes=op_bytes(case, tokens))
        if "loop_us" not in r:
            continue
        r["tbps"] = r["bytes"] / r["loop_us"] / 1e6
        compared = r["impl"].startswith("jaxrope_") or r["impl"] == "move"
        if ceilings and (compared or r is peer):
            r["ceiling_fraction"] = min(ceilings) / r["loop_us"]
        if compared:
            if peer is not None:
                r["vs_peer"] = r["loop_us"] / peer["loop_us"]
                if r.get("kernel_us") and peer.get("kernel_us"):
                    r["kernel_vs_peer"] = r["kernel_us"] / peer["kernel_us"]


def target_text(case: str, tokens: int) -> str:
    """The issue's targets for a (case, tokens) point, as a table cell."""
    large, decode, ceiling = TARGETS.get(case, (None, None, None))
    peer = large if tokens >= LARGE else decode if tokens == 512 else None
    parts = [f"<= {peer}x FI"] if peer is not None else []
    if ceiling is not None and tokens >= LARGE:
        parts.append(f">= {100 * ceiling:.0f}% ceil")
    return ", ".join(parts) or "-"


def targets(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One entry per (our row, applicable target): the value and whether it is met."""
    out = []
    for r in results:
        if not r["impl"].startswith("jaxrope_"):
            continue
        large, decode, ceiling = TARGETS.get(r["case"], (None, None, None))
        tokens = r["tokens"]
        peer = large if tokens >= LARGE else decode if tokens == 512 else None
        checks = []
        if peer is not None:
            checks.append((f"time vs FlashInfer <= {peer}", r.get("vs_peer"), peer, False))
        if ceiling is not None and tokens >= LARGE:
            checks.append((f"ceiling fraction >= {ceiling}", r.get("ceiling_fraction"),
                           ceiling, True))
        for name, value, limit, at_least in checks:
            met = value is not None and (value >= limit if at_least else value <= limit)
            out.append({"case": r["case"], "impl": r["impl"], "tokens": tokens, "target": name,
                        "value": value, "met": met,
                        **({"unavailable": r["unavailable"]} if "unavailable" in r else {})})
    return out


def table(results: List[Dict[str, Any]]) -> str:
    """The markdown table of every row: times, TB/s, % of ceiling, x FlashInfer, target."""
    lines = ["| case | tokens | impl | loop us | kernel us | TB/s | % ceiling | x FlashInfer "
             "| issue target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "unavailable" in r:
            lines.append(f"| {r['case']} | {r['tokens']} | {r['impl']} | unavailable: "
                         f"{r['unavailable'][:120]} | | | | | |")
            continue

        def fmt(key, spec, scale=1.0):
            return format(scale * r[key], spec) if r.get(key) is not None else "-"
        ours = r["impl"].startswith("jaxrope_")
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['impl']} | {fmt('loop_us', '.2f')} | "
            f"{fmt('kernel_us', '.2f')} | {fmt('tbps', '.2f')} | "
            f"{fmt('ceiling_fraction', '.1f', 100)} | {fmt('vs_peer', '.3f')} | "
            f"{target_text(r['case'], r['tokens']) if ours else ''} |")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tokens", default=",".join(map(str, cases.FUSED_BENCH_TOKENS)))
    parser.add_argument("--cases", default=",".join(c.name for c in cases.FUSED_CASES),
                        help="comma-separated names from jaxrope.cases.FUSED_CASES")
    parser.add_argument("--backends", default=None,
                        help="ours on each (default: mosaic,triton on a GPU, xla elsewhere)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rep-seconds", type=float, default=0.1)
    parser.add_argument("--no-kernel-times", action="store_true",
                        help="skip the profiler pass (kernel us) on the GPU")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 16 tokens, 2 short repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="",
                        help="output DIR/fused_family-<label>.json/.md (to split a run)")
    args = parser.parse_args(argv)
    if args.label and not args.label.replace("_", "").isalnum():
        parser.error(f"--label={args.label!r} must be letters, digits and '_'")
    args.name = f"fused_family-{args.label}" if args.label else "fused_family"
    if args.backends and not set(args.backends.split(",")) <= set(jr.BACKENDS):
        parser.error(f"--backends={args.backends!r}: each must be one of {jr.BACKENDS}")
    unknown = [n for n in args.cases.split(",") if n not in cases.FUSED_BY_NAME]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {sorted(cases.FUSED_BY_NAME)}")
    try:
        args.token_counts = [16] if args.quick else [int(t) for t in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens={args.tokens!r} must be comma-separated ints")
    if any(t <= 0 for t in args.token_counts):
        parser.error(f"--tokens={args.tokens!r} must be positive")
    if args.quick:
        args.reps, args.rep_seconds = 2, 0.01
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    args = parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    on_gpu = jax.default_backend() == "gpu"
    backends = (args.backends.split(",") if args.backends
                else ["mosaic", "triton"] if on_gpu else ["xla"])
    notes = [] if on_gpu else ["no GPU: no FlashInfer, no torch ceiling; numbers check the "
                               "plumbing only"]
    flashinfer = on_gpu and importlib.util.find_spec("flashinfer") is not None
    if on_gpu and not flashinfer:
        notes.append("FlashInfer is not installed: no peer rows")
    results: List[Dict[str, Any]] = []
    report = {"command": "python -m bench.fused_family_bench " + " ".join(argv),
              "run": timing.run_info("bench.fused_family_bench", argv),
              "env": {"jax": jax.__version__, "backend": jax.default_backend(),
                      "device": str(jax.devices()[0].device_kind)},
              "backends": backends, "seed": args.seed, "targets_by_case": TARGETS,
              "scales": {"q": ff.Q_SCALE, "kv": ff.KV_SCALE}, "notes": notes,
              "results": results}
    for name in args.cases.split(","):
        case = cases.FUSED_BY_NAME[name]
        for tokens in args.token_counts:
            # Off the GPU the XLA path copies whole caches: keep them small.
            x = make_inputs(case, tokens, args.seed, 4096 if on_gpu else 32)
            rows: List[Dict[str, Any]] = []
            if flashinfer:  # torch first: a JAX compile meanwhile would disturb its timing
                rows += torch_runs(x, args.rep_seconds, args.reps, notes)
            # Quick runs skip the probes that size the loops: one compile each.
            iters = kvb.UNROLL if args.quick else None
            for backend in backends:
                rows.append(jax_run(x, backend, args.rep_seconds, args.reps,
                                    on_gpu and not args.no_kernel_times, iters))
            rows.append(xla_ceiling_row(case, tokens, args.rep_seconds, args.reps, iters))
            derive(rows, case, tokens)
            results += rows
            del x
            report["targets"] = targets(results)
            timing.write_json(args.out, args.name, report)
    text = table(results)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    print(text)
    kvb.print_targets(report["targets"])
    return report


if __name__ == "__main__":
    main()
