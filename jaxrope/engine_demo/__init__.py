"""``python -m jaxrope.demo``: a continuous-batching engine loop entirely in JAX (no torch).

Usage::

  python -m jaxrope.demo [--steps N] [--seed S] [--inject-fault]

Nine requests join and leave over about ``N`` steps (default 200) through
:class:`jaxrope.RowMap`: chunked prefill, batched decode, a prefix-cache hit (a prompt
starting with another's first pages shares them) and an M-RoPE request (an image in the
prompt, :func:`jaxrope.mrope.rope_index`) on Qwen2-VL's rotation. Each step is one
jitted function per token bucket (:mod:`jaxrope.engine_demo.model`): positions from the
counters pytree (:mod:`jaxrope.positions`), KV slots from the block table
(:mod:`jaxrope.paging`), :func:`jaxrope.apply_rope_and_append_kv` into a
``"paged_attention"`` cache, and attention read from the pages by JAX's own Pallas
``paged_attention`` kernel (the Pallas interpreter off the GPU). After every step the host
checks each token's position and attention output and every live sequence's cached k
and v against a float64 recompute of the layer (:mod:`jaxrope.engine_demo.engine`).

Prints the events, a line every 20 steps, the compile count per bucket and a verdict;
exit status 0 on PASS, 1 on the first mismatch (``--inject-fault`` makes one: a stream's
counter advanced twice at a third of the run), 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import time
from typing import Optional, Sequence

__all__ = ["main"]

MIN_STEPS = 40   # below this the scaled trace's requests no longer overlap as designed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxrope.demo",
                                     description=__doc__.split("\n")[0].split(": ", 1)[1],
                                     epilog="The torch traces (RopeManager over the same core): "
                                            "python -m torch_bridge.demo --help")
    parser.add_argument("--steps", type=int, default=200,
                        help="about how many steps the trace takes (default 200)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the weights and the requests' token ids (default 0)")
    parser.add_argument("--inject-fault", action="store_true",
                        help="advance one stream's counter twice at a third of the run")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the trace; returns the exit status (0 pass, 1 mismatch).

    Raises:
      SystemExit: invalid arguments (status 2).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS:
        parser.error(f"--steps={args.steps} must be >= {MIN_STEPS}")
    import jax
    import numpy as np

    from jaxrope.engine_demo import engine, model

    started = time.perf_counter()
    requests = engine.trace(args.steps, args.seed)
    eng = engine.Engine(args.seed, engine.interpret_default(),
                        args.steps // 3 if args.inject_fault else None)
    print(f"JAX {jax.__version__} on {jax.default_backend()}: {model.MODEL}'s rotation "
          f"(mrope_section={eng.cfg.mrope_section}), Hq={model.Q_HEADS} Hk={model.K_HEADS} "
          f"D={eng.cfg.head_dim}, cache layout 'paged_attention' {model.PAGES} pages of "
          f"{model.PAGE_SIZE}, token buckets {engine.BUCKETS}, "
          f"{'interpreted' if engine.interpret_default() else 'compiled'} paged_attention")
    rng = np.random.default_rng(args.seed + 2)
    pending, live, joined, left, worst, s, ran = list(requests), [], 0, 0, 0.0, 0, 0
    while pending or live:
        for r in [r for r in pending if r.arrive <= s]:
            pending.remove(r)
            eng.join(r)
            live.append(r)
            joined += 1
        work = eng.schedule(live)
        if work:
            outputs, tokens = eng.run_step(s, work, rng)
            ran += 1
            mismatch, error = eng.check(s, outputs, tokens, live)
            worst = max(worst, error)
            if mismatch:
                for event in eng.events:
                    print(f"step {s:>3}: {event}")
                print(f"verdict: FAIL — first mismatch: {mismatch}")
                return 1
        for r in [r for r in live if r.done == r.length]:
            live.remove(r)
            eng.leave(r)
            left += 1
        for event in eng.events:
            print(f"step {s:>3}: {event}")
        eng.events.clear()
        if work and s % 20 == 0:
            prefill = sum(n for r, n in work if r.done <= len(r.prompt))
            print(f"step {s:>3}: {len(work)} streams, {sum(n for _, n in work)} tokens "
                  f"(bucket {outputs['bucket']}, {prefill} prefill), worst attention error "
                  f"so far {worst:.1e}")
        s += 1
    compiles = ", ".join(f"T={t}: {n}" for t, n in sorted(eng.traces.items()))
    print(f"step function compiles: {compiles} ({sum(eng.traces.values())} for "
          f"{len(engine.BUCKETS)} buckets)")
    print(f"verdict: PASS — {ran} steps, {joined} streams joined and {left} left, every token's "
          f"position and attention and every live sequence's cache rows within tolerance of "
          f"float64 (worst attention error {worst:.1e}), {time.perf_counter() - started:.1f} s")
    return 0
