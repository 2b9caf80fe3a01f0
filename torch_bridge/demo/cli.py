"""``python -m torch_bridge.demo``'s command line: arguments, device choice, the step report and
the verdict."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

from jaxrope.config import RopeConfig
from jaxrope.models import HF_CONFIGS
from torch_bridge.demo import multimodal
from torch_bridge.demo.model import KV_HEADS, MODELS, Q_HEADS, TOLERANCE, VL_MODELS
from torch_bridge.demo.node import GRAPH_BUCKET, StepRow
from torch_bridge.demo.speculative_trace import DRAFT_BUCKET, MIN_ROUNDS, SpeculativeTrace, print_row
from torch_bridge.demo.trace import BUDGET, MIN_STEPS, Trace

__all__ = ["main", "parser", "run"]


def parser(prog: str = "python -m torch_bridge.demo") -> argparse.ArgumentParser:
    """The torch demo's command line, named ``prog`` in its usage line.

    Example:
      >>> parser().format_usage().split()[:5]
      ['usage:', 'python', '-m', 'torch_bridge.demo', '[-h]']
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="Drive torch_bridge.RopeManager through a multi-request serving trace and "
                    "check a tiny attention layer against a float64 recompute at every step.",
        epilog="The JAX engine trace (no torch): python -m jaxrope.demo --help")
    p.add_argument("--model", choices=sorted(MODELS) + sorted(VL_MODELS), default="llama3.1",
                   help="real RoPE config to use (default: llama3.1); the M-RoPE models "
                        f"{', '.join(sorted(VL_MODELS))} run the image + video trace")
    p.add_argument("--steps", type=int, default=14,
                   help="main-node steps to run, at least the scripted trace's (default: 14)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when torch and JAX both see a GPU, else CPU")
    p.add_argument("--seed", type=int, default=0, help="weights and token ids (default: 0)")
    p.add_argument("--inject-fault", action="store_true",
                   help="for tests: the prefix-cache probe claims one token too many (M-RoPE "
                        "models: the decode node admits the handoff without its delta; with "
                        "--speculative: a rollback is published without its epoch), so "
                        "a request's positions are off and the run must FAIL")
    p.add_argument("--speculative", action="store_true",
                   help="the speculative-decoding trace instead: draft steps, verify with "
                        "random acceptance, rollbacks, a handoff after a rollback; --steps "
                        "counts its rounds (1-D models only)")
    return p


def _pick_device(choice: str) -> Tuple[torch.device, Optional[str]]:
    """The device to run on, and a note when "auto" had to fall back to the CPU."""
    if choice == "cpu":
        return torch.device("cpu"), None
    if choice == "cuda" or torch.cuda.is_available():
        import jax
        try:
            jax.devices("gpu")
        except RuntimeError as e:
            if choice == "cuda":
                raise SystemExit(f"--device cuda: JAX has no GPU backend here ({e})")
            return torch.device("cpu"), "torch sees a GPU but JAX has no GPU backend: using the CPU"
        return torch.device("cuda", torch.cuda.current_device()), None
    return torch.device("cpu"), None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo with ``argv`` (default: the command line); returns the exit status.

    0: every check passed (or ``--help``); 1: a mismatch; 2: the arguments are invalid or
    the device asked for is not there (the reason goes to stderr).
    """
    command_line = parser()
    try:
        return run(command_line, command_line.parse_args(argv))
    except SystemExit as e:
        # argparse has printed its message and exits with a number; a SystemExit that
        # carries the message itself (e.g. "--device cuda: JAX has no GPU backend") is
        # the only word the user gets, so print it.
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 2


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Run the demo for ``args`` parsed by ``parser`` (:func:`parser`), which
    reports the checks argparse cannot make; returns the exit status (0 pass, 1 mismatch).

    Raises:
      SystemExit: invalid arguments (status 2).
    """
    if args.speculative and args.model in VL_MODELS:
        parser.error(f"--speculative runs a 1-D model's trace; --model={args.model} is M-RoPE")
    if args.speculative and args.steps < MIN_ROUNDS:
        parser.error(f"--steps={args.steps} must be >= {MIN_ROUNDS} with --speculative (the "
                     f"handoff and its late echo happen in its first {MIN_ROUNDS} rounds)")
    if not args.speculative and args.steps < MIN_STEPS:
        parser.error(f"--steps={args.steps} must be >= {MIN_STEPS} (the trace's prefix hit, "
                     "fork, handoff, graph replay and stale admit happen in its first "
                     f"{MIN_STEPS} steps)")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX beside torch on a GPU
    device, note = _pick_device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # TF32 matmuls would exceed the tolerance
    started = time.perf_counter()
    if args.speculative:
        name = MODELS[args.model]
        rope = RopeConfig.from_hf(HF_CONFIGS[name])
        trace = SpeculativeTrace(rope, device, args.seed, args.inject_fault)
        mgr, layer = trace.mgr, trace.target
    elif args.model in VL_MODELS:
        name = VL_MODELS[args.model]
        trace = multimodal.MultimodalTrace(args.model, device, args.seed, args.inject_fault)
        mgr, layer, title, budget = trace.main.mgr, trace.layer, trace.describe(), multimodal.BUDGET
    else:
        name = MODELS[args.model]
        rope = RopeConfig.from_hf(HF_CONFIGS[name])
        trace = Trace(rope, device, args.seed, args.inject_fault)
        mgr, layer, budget = trace.main.mgr, trace.layer, BUDGET
    if args.model not in VL_MODELS:
        scaling = type(rope.scaling).__name__ if rope.scaling is not None else "default"
        title = (f"{scaling}, head_dim={rope.head_dim}, rotary_dim={rope.rotary_dim}, "
                 f"interleave={rope.interleave}")
    rotation = (type(mgr.launcher).__name__ if mgr.launcher is not None
                else f"JAX ({'Pallas' if device.type == 'cuda' else 'XLA'})")
    print(f"jaxrope demo: {name} ({title}, attention factor {layer.attention:.4f})")
    print(f"device {device}, rotation {rotation}, q/k float32, {Q_HEADS} q heads / {KV_HEADS} "
          + (f"kv heads, draft and target layers, draft graph bucket {DRAFT_BUCKET.num_tokens}"
             if args.speculative else f"kv heads, budget {budget['main']} tokens/step, graph "
             f"bucket {GRAPH_BUCKET.num_tokens}"))
    if note:
        print(f"note: {note}")
    print(f"{'step':>4} {'node':<7} {'reqs':>4} {'tokens':>6} {'positions':>9} {'max err':>8}"
          "  events")
    rows: List[StepRow] = (trace.run(args.steps) if args.speculative else
                           [print_row(row) for s in range(args.steps) for row in trace.run_step(s)])
    failed = [row for row in rows if row.failures]
    worst = max(row.error for row in rows)
    elapsed = time.perf_counter() - started
    summary = (f"{len(rows)} steps on 2 nodes, {len(trace.requests)} requests, "
               f"max error {worst:.1e} (tolerance {TOLERANCE:.0e}), {elapsed:.1f} s")
    if failed:
        first = failed[0]
        print(f"verdict: FAIL — {len(failed)} of {summary}; first at step {first.step} "
              f"({first.node}): {first.failures[0]}")
        return 1
    print(f"verdict: PASS — {summary}")
    return 0
