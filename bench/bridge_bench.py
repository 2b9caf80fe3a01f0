"""Host time of ``RopeManager.plan`` + ``commit`` per step, and ``apply_qk``'s wall time per call.

    python -m bench.bridge_bench --out DIR [--quick] [--device cpu|cuda] [--iters N] [--warmup N]

Steps (``--quick``: smaller), each through a KV plan output as an engine sends them:

- ``decode``: 256 requests x 1 token (``--quick``: 32);
- ``prefill``: 8 requests x 2048-token chunks (``--quick``: 8 x 128);

each ``eager`` (plan(N), commit(N)) and ``preplan`` (plan(N+1, is_preplan) while N is
current, then commit(N): the pipelined runner's order). Host time is the
``time.perf_counter`` span of each call with no device sync inside: what the Python
thread spends before it can queue the next step (the counters live on the host; a plan
ends with one non-blocking copy on torch's stream). The cases run in blocks of 16 steps
that alternate between them; each block starts from reset counters and a drained
device, outside the timed spans; the step records are built before timing (the
engine's cost, not the manager's). Before each block a fixed pure-Python loop reads the
host's own speed: on a VM it can move by a large factor within a run, for seconds at a
time, so the report gives, beside the medians of all steps, the median over the blocks
run at full speed (their reading within 1.25x of the run's fastest). Targets: plan +
commit <= 50 us median for decode, <= 60 us for prefill.

Speculative steps (``--quick``: 32 requests instead of 256), eager, each in blocks
alternating with a plain decode step of the same token count (issue 16's target: plan
+ commit within 1.2x of it), reported as the ratio of the pooled medians and as the
median ratio of the blocks run back to back:

- ``draft[256x4]/chain``: a verify step of 3 chain drafts per request, committed with
  an array of per-request accepted counts (random, drawn before timing) vs
  ``decode[1024x1]``;
- ``draft[256x8]/tree``: a draft tree of 8 tokens per request (``PositionStep.tree``, one
  ``[256, 8]`` depth array), committed with an array of accepted counts, vs
  ``decode[2048x1]``;
- ``draft[256x8]/tree-shared``: the same as ``{(rid, label): depths}`` with one tuple
  for every request (a fixed tree shape) and accepted counts as a mapping;
- ``drafter[256x1]/step``: an EAGLE draft step (``draft_depth=2``: one token per request
  at ``counter + 2``, nothing committed) vs ``decode[256x1]``.

``apply_qk``: q ``[T, 32, 128]``, k ``[T, 8, 128]`` bf16 on CUDA (CPU or ``--quick``:
``[T, 8, 128]``, ``[T, 2, 128]`` float32), T in (64, 16384) (CPU: 64, 1024), wall time
per call with one sync per batch (dispatch included), for each launcher ("auto": the
Mosaic GPU launch on Hopper, else the Triton one; "triton": the Triton launch; "jax": the
DLPack path), beside FlashInfer's
``apply_rope_pos_ids_inplace`` and ``apply_llama31_rope_pos_ids_inplace`` on the same
tensors when FlashInfer imports.

Writes ``DIR/bridge_bench.json`` (every number, with :func:`bench.timing.run_info`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

import jaxrope as jr
from bench import timing
from torch_bridge import (KVPlanOutput, KVView, PositionConfig, PositionStep, RopeManager, Segment,
                          StepContext)

TARGETS_US = {"decode": 50.0, "prefill": 60.0}
# A speculative step's plan + commit against a decode step of as many tokens (issue 16).
SPECULATIVE_RATIO = 1.2
TREE = (0, 1, 1, 1, 1, 2, 2, 3)   # 8 tokens: the root, 4 children, 2 grandchildren, 1 below


def _manager(device: torch.device, launcher: Any = "jax") -> RopeManager:
    rope = jr.RopeConfig(head_dim=128, theta=5e5, max_position=1 << 20)
    return RopeManager(PositionConfig(rope=rope), device, max_seq_len=1 << 20, launcher=launcher)


def _steps(rids: List[str], span: int, count: int, tree=None, mapping: bool = False,
           draft_depth: Optional[int] = None) -> List[Tuple[PositionStep, StepContext]]:
    if tree is not None:
        # One tuple for every stream, or the engine's [streams, k] array (a row a segment).
        tree = (dict.fromkeys([(rid, "text") for rid in rids], tree) if mapping
                else np.tile(np.asarray(tree, np.int64), (len(rids), 1)))
    out = []
    for _ in range(count):
        step = PositionStep(tuple(Segment(rid, "text", span) for rid in rids), tree=tree,
                            draft_depth=draft_depth)
        views = tuple(KVView(rid, "text", span) for rid in rids)
        kv = {"kv": {"attn": KVPlanOutput(views)}}
        out.append((step, StepContext(tuple(rids), plan_results=kv)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BLOCK = 16   # steps between counter resets: the unit in which the cases of a run alternate
# A block counts as run at the host's full speed when the reference loop timed just before
# it read within this factor of the fastest reading of the run.
FULL_SPEED = 1.25


def timed_blocks(mgr: RopeManager, steps, preplan: bool, device: torch.device,
                 accepted: Optional[List[dict]] = None) -> Iterator[Tuple[List[float], List[float]]]:
    """Endless blocks of host seconds ``(plan_s, commit_s)``: each block resets the
    counters and drains the device (untimed), then runs BLOCK steps of ``steps``, cycled
    (preplan: step 0 planned untimed, then plan(N+1, is_preplan) + commit(N) timed, the
    last plan committed untimed). ``accepted``: each eager step's ``commit(accepted=...)``."""
    rids = steps[0][1].request_ids
    pre = StepContext(rids, is_preplan=True, plan_results=steps[0][1].plan_results)
    at = 0
    while True:
        for rid in rids:
            mgr.reset_request(rid)
        _sync(device)
        block = range(at, at + BLOCK)
        at += BLOCK
        plan_s, commit_s = [], []
        if preplan:
            mgr.plan(*steps[block[0] % len(steps)])
        for prev, i in zip(block, block[1:]) if preplan else zip([None] * BLOCK, block):
            step, ctx = steps[i % len(steps)]
            if preplan:
                t0 = time.perf_counter()
                mgr.plan(step, pre)
                t1 = time.perf_counter()
                mgr.commit(*steps[prev % len(steps)])
                t2 = time.perf_counter()
            else:
                extra = {} if accepted is None else {"accepted": accepted[i % len(steps)]}
                t0 = time.perf_counter()
                mgr.plan(step, ctx)
                t1 = time.perf_counter()
                mgr.commit(step, ctx, **extra)
                t2 = time.perf_counter()
            plan_s.append(t1 - t0)
            commit_s.append(t2 - t1)
        if preplan:
            mgr.commit(*steps[block[-1] % len(steps)])
        yield plan_s, commit_s


def _case(device: torch.device, requests: int, span: int, count: int, tree=None,
          draft_depth: Optional[int] = None, accept: int = -1, mapping: bool = False):
    """``(manager, steps, accepted)`` of ``count`` steps; ``tree``: every request's depths
    (a tuple), as one array or (``mapping``) a mapping; ``draft_depth``: a draft step;
    ``accept >= 0``: accepted counts drawn in ``[0, accept]``, an array per step or
    (``mapping``) a mapping."""
    mgr = _manager(device)
    rids = [f"r{i}" for i in range(requests)]
    for rid in rids:
        mgr.ingest_request(rid)
    accepted = None
    if accept >= 0:
        draws = np.random.default_rng(0).integers(0, accept + 1, (count, requests))
        accepted = ([{(rid, "text"): int(a) for rid, a in zip(rids, row)} for row in draws]
                    if mapping else list(draws))
    return mgr, _steps(rids, span, count, tree, mapping, draft_depth), accepted


def _timings(plan_s: List[float], commit_s: List[float]) -> Dict[str, dict]:
    how = "host perf_counter span of the call, no device sync inside"
    return {"plan": timing.Timing.from_seconds(plan_s, how).as_dict(),
            "commit": timing.Timing.from_seconds(commit_s, how).as_dict(),
            "plan+commit": timing.Timing.from_seconds(
                [p + c for p, c in zip(plan_s, commit_s)], how).as_dict()}


def _alternating(cases: Dict[str, tuple], iters: int, warmup: int,
                 device: torch.device) -> Dict[str, Dict[str, dict]]:
    """Time ``{name: (manager, steps, accepted, preplan)}``: ``warmup`` untimed steps of
    each, then ``iters // BLOCK`` blocks of every case in turn, so that a case and its
    neighbours see the same host (a VM's speed can move within a run, at times for
    seconds, at times within one case's share of a round). Before each block
    a fixed pure-Python loop reads the host's own speed (:func:`host_reference_us`)."""
    blocks = {name: timed_blocks(mgr, steps, preplan, device, accepted)
              for name, (mgr, steps, accepted, preplan) in cases.items()}
    for name, it in blocks.items():
        for _ in range(-(-warmup // BLOCK)):
            next(it)
    samples = {name: ([], []) for name in cases}
    per_block: Dict[str, List[dict]] = {name: [] for name in cases}
    for _ in range(max(1, iters // BLOCK)):
        for name, it in blocks.items():
            next(it)  # untimed: the previous case's block left the caches to its own data
            reference = host_reference_us()
            plan_s, commit_s = next(it)
            samples[name][0].extend(plan_s)
            samples[name][1].extend(commit_s)
            per_block[name].append({"host_reference_us": reference, "plan+commit_median_us": float(
                np.median(np.add(plan_s, commit_s)) * 1e6)})
    fastest = min(b["host_reference_us"] for rows in per_block.values() for b in rows)
    out = {}
    for name in cases:
        full = [b["plan+commit_median_us"] for b in per_block[name]
                if b["host_reference_us"] <= FULL_SPEED * fastest]
        out[name] = {**_timings(*samples[name]), "blocks": per_block[name],
                     "full_speed": {"blocks": len(full), "median_of_block_medians_us":
                                    float(np.median(full)) if full else None}}
    return out


def host_reference_us() -> float:
    """Median us of a fixed pure-Python loop: the host's own speed at that moment. When the
    host runs slow, plan + commit slows by less than this reading: its numpy and driver
    calls less than this bytecode."""
    spans = []
    for _ in range(16):
        t0 = time.perf_counter()
        sum(i * i for i in range(200))
        spans.append(time.perf_counter() - t0)
    return float(np.median(spans) * 1e6)


def _records(iters: int, warmup: int) -> int:
    """Step records per case: the blocks cycle through them (each block starts from reset
    counters), so a run of any length holds at most 32 blocks' worth."""
    return BLOCK * min(32, -(-(iters + warmup) // BLOCK))


def bench_plan_commit(device: torch.device, cases: Dict[str, Tuple[int, int]], iters: int,
                      warmup: int) -> Dict[str, Dict[str, dict]]:
    """``{name: (requests, span)}``, each eager and preplan, in alternating blocks."""
    timed = {}
    for name, (requests, span) in cases.items():
        for mode in ("eager", "preplan"):
            mgr, steps, _ = _case(device, requests, span, _records(iters, warmup))
            timed[f"{name}[{requests}x{span}]/{mode}"] = (mgr, steps, None, mode == "preplan")
    return _alternating(timed, iters, warmup, device)


def bench_speculative(device: torch.device, requests: int, iters: int,
                      warmup: int) -> Dict[str, dict]:
    """Each speculative case beside a plain decode step of its token count (module doc),
    the two in alternating blocks."""
    cases = {f"draft[{requests}x4]/chain": (dict(span=4, accept=3), 4),
             f"draft[{requests}x8]/tree": (dict(span=8, tree=TREE, accept=max(TREE)), 8),
             f"draft[{requests}x8]/tree-shared": (dict(span=8, tree=TREE, accept=max(TREE),
                                                        mapping=True), 8),
             f"drafter[{requests}x1]/step": (dict(span=1, draft_depth=2), 1)}
    out: Dict[str, dict] = {}
    print(f"speculative plan + commit host time on {device} (target: <= {SPECULATIVE_RATIO}x a "
          "decode step of the same token count)")
    count = _records(iters, warmup)
    for key, (kwargs, tokens) in cases.items():
        pair = {name: (*_case(device, **spec), False) for name, spec in (
            ("ours", dict(requests=requests, count=count, **kwargs)),
            ("base", dict(requests=requests * tokens, span=1, count=count)))}
        timed = _alternating(pair, iters, warmup, device)
        ours, base = timed["ours"], timed["base"]
        plain = f"decode[{requests * tokens}x1]/eager"
        ratio = ours["plan+commit"]["median_us"] / base["plan+commit"]["median_us"]
        # A block of each, back to back, sees one host speed far more often than the pooled
        # medians do when the host's speed flips during the run.
        paired = float(np.median([o["plan+commit_median_us"] / b["plan+commit_median_us"]
                                  for o, b in zip(ours["blocks"], base["blocks"])]))
        out[key] = {**ours, "baseline": plain, "baseline_plan+commit": base["plan+commit"],
                    "baseline_blocks": base["blocks"], "ratio": ratio, "paired_ratio": paired,
                    "target_ratio": SPECULATIVE_RATIO}
        print(f"  {key:27s} {ours['plan+commit']['median_us']:7.1f} us vs {plain:20s} "
              f"{base['plan+commit']['median_us']:7.1f} us: {ratio:.2f}x (paired blocks: "
              f"{paired:.2f}x)")
    return out


def _qk(device: torch.device, tokens: int, q_heads: int, k_heads: int, dtype: torch.dtype):
    gen = torch.Generator(device=device).manual_seed(tokens)
    q = torch.randn(tokens, q_heads, 128, device=device, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, 128, device=device, generator=gen).to(dtype)
    return q, k


def bench_apply(device: torch.device, tokens: int, q_heads: int, k_heads: int,
                dtype: torch.dtype, launcher: str) -> Dict[str, object]:
    if launcher == "triton":  # the Triton-lowered kernel's launcher, beside auto's choice
        from torch_bridge.launch.triton import TritonLauncher
        mgr = _manager(device, TritonLauncher())
    else:
        mgr = _manager(device, launcher)
    mgr.ingest_request("r")
    mgr.apply_cached_prefix("r", None, None, None, {"text": 4096})
    mgr.plan(PositionStep((Segment("r", "text", tokens),)), StepContext(("r",)))
    q, k = _qk(device, tokens, q_heads, k_heads, dtype)
    result = timing.time_wall(lambda: mgr.apply_qk(q, k, "text"), lambda: _sync(device)).as_dict()
    result["path"] = type(mgr.launcher).__name__ if mgr.launcher is not None else "jax"
    return result


def bench_flashinfer(device: torch.device, tokens: int, q_heads: int, k_heads: int,
                     dtype: torch.dtype) -> Dict[str, dict]:
    """FlashInfer's in-place calls on the same shapes, timed like :func:`bench_apply`."""
    import flashinfer
    q, k = _qk(device, tokens, q_heads, k_heads, dtype)
    pos = torch.arange(4096, 4096 + tokens, dtype=torch.int32, device=device)
    sync = lambda: _sync(device)  # noqa: E731
    return {
        "apply_rope_pos_ids_inplace": timing.time_wall(
            lambda: flashinfer.apply_rope_pos_ids_inplace(q, k, pos, rope_theta=5e5), sync).as_dict(),
        "apply_llama31_rope_pos_ids_inplace": timing.time_wall(
            lambda: flashinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos, rope_theta=5e5),
            sync).as_dict()}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, object]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for bridge_bench.json")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI, CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=1000, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=500, help="untimed steps first in every case")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    cases = {"decode": (32 if args.quick else 256, 1), "prefill": (8, 128 if args.quick else 2048)}
    report: Dict[str, object] = {"run": timing.run_info("bench.bridge_bench", argv),
                                 "targets_us": TARGETS_US, "plan_commit": {}, "apply_qk": {}}
    print(f"plan + commit host time on {device} (targets: decode <= 50 us, prefill <= 60 us)")
    report["plan_commit"] = bench_plan_commit(device, cases, args.iters, args.warmup)
    for key, r in report["plan_commit"].items():
        total = r["plan+commit"]
        print(f"  {key:28s} plan {r['plan']['median_us']:7.1f}  commit "
              f"{r['commit']['median_us']:7.1f}  sum {total['median_us']:7.1f} "
              f"(p90 {total['p90_us']:.1f}) us")
    refs = [b["host_reference_us"] for r in report["plan_commit"].values() for b in r["blocks"]]
    print(f"  host reference loop {min(refs):.1f}-{max(refs):.1f} us (median "
          f"{np.median(refs):.1f}); in blocks within {FULL_SPEED}x of its fastest reading:")
    for key, r in report["plan_commit"].items():
        full = r["full_speed"]
        median = full["median_of_block_medians_us"]
        print(f"  {key:28s} " + ("   none" if median is None else f"{median:7.1f} us") +
              f" ({full['blocks']} of {len(r['blocks'])} blocks)")

    report["speculative"] = bench_speculative(device, 32 if args.quick else 256, args.iters,
                                              args.warmup)

    small = args.quick or not on_gpu
    q_heads, k_heads = (8, 2) if small else (32, 8)
    dtype = torch.float32 if small else torch.bfloat16
    print(f"apply_qk wall time per call on {device}")
    for tokens in ((64, 1024) if small else (64, 16384)):
        for launcher in (("auto", "triton", "jax") if on_gpu else ("jax",)):
            r = bench_apply(device, tokens, q_heads, k_heads, dtype, launcher)
            report["apply_qk"][f"T={tokens}/{launcher}"] = r
            print(f"  T={tokens:<6d} {launcher:5s} ({r['path']}) {r['median_us']:8.1f} us")
        if on_gpu:
            try:
                theirs = bench_flashinfer(device, tokens, q_heads, k_heads, dtype)
            except ImportError as e:
                print(f"  flashinfer unavailable ({e}): no same-run reference")
                continue
            for call, r in theirs.items():
                report["apply_qk"][f"T={tokens}/flashinfer.{call}"] = r
                print(f"  T={tokens:<6d} flashinfer.{call} {r['median_us']:8.1f} us")
    path = timing.write_json(args.out, "bridge_bench", report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
