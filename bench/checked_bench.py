"""What checked mode costs: one jitted step with jaxrope's range checks off and on.

    python -m bench.checked_bench --out DIR [--quick] [--rounds N] [--backend auto]

Steps (bf16, Hq 32, Hk 8, D 128, theta 1e4, max_position 65536; positions uniform in
``[0, 65536)``):

- ``rope_64``, ``rope_16384``: :func:`jaxrope.apply_rope` at 64 and 16384 tokens, q and
  k donated;
- ``append_64``, ``append_16384``: :func:`jaxrope.apply_rope_and_append_kv` into an NHD
  cache of pages of 16 (twice the pages the tokens need), slots a random permutation,
  q and the cache donated;
- ``plan_commit_256``: :func:`jaxrope.positions.plan` then ``commit`` for 256 decode
  requests (one token each) on a table of 512 rows, the table donated.

Each step is jitted twice, ``jax.jit(step)`` ("off", the default path) and
``jaxrope.checked(step)`` ("on"), and timed two ways, both through
:func:`bench.timing.time_wall`:

- ``call_us``: one call from Python, waited for: ``jax.block_until_ready`` off,
  ``jaxrope.checks.throw`` on, as ``jaxrope.checked`` calls it (it reads the error back,
  so a checked step syncs the host once a call: part of what it costs);
- ``loop_us``: device time per application: ``--loop`` applications in one jitted
  ``fori_loop`` (the checks inside the loop body when on), one call timed, divided.

After one warm-up call each, the two outputs are compared (``identical_outputs``: bit for
bit, as they must be). Off and on alternate within each of ``--rounds`` rounds (paired: the host's speed drifts
alike for both); reported per step: the median over rounds of each side's median, and
``ratio`` = the median of the per-round on / off ratios. Backend ``auto``: the Mosaic GPU
kernels on the H200, XLA on a CPU. Output: ``DIR/checked_bench.json``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from bench import timing
from jaxrope import positions
from jaxrope.checks import checkified, throw

HQ, HK, D, PAGE = 32, 8, 128, 16
MAX_POSITION = 65536


def _rope_case(tokens: int, cfg: jr.RopeConfig, backend: str, rng) -> Tuple[Callable, List, int]:
    def step(q, k, pos_ids):
        q, k = jr.apply_rope(q, k, pos_ids, cfg, backend=backend)
        return q, k, pos_ids
    q = jnp.asarray(rng.standard_normal((tokens, HQ, D)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((tokens, HK, D)), jnp.bfloat16)
    pos = jnp.asarray(rng.integers(0, MAX_POSITION, tokens), jnp.int32)
    return step, [q, k, pos], 2


def _append_case(tokens: int, cfg: jr.RopeConfig, backend: str, rng) -> Tuple[Callable, List, int]:
    pages = 2 * -(-tokens // PAGE)

    def step(q, cache, k, v, pos_ids, slots):
        q, cache = jr.apply_rope_and_append_kv(q, k, v, pos_ids, cache, slots, cfg,
                                               backend=backend)
        return q, cache, k, v, pos_ids, slots
    q = jnp.asarray(rng.standard_normal((tokens, HQ, D)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((tokens, HK, D)), jnp.bfloat16) for _ in "kv")
    cache = tuple(jnp.zeros((pages, PAGE, HK, D), jnp.bfloat16) for _ in "kv")
    pos = jnp.asarray(rng.integers(0, MAX_POSITION, tokens), jnp.int32)
    slots = jnp.asarray(rng.permutation(pages * PAGE)[:tokens], jnp.int32)
    return step, [q, cache, k, v, pos, slots], 2


def _plan_case(requests: int, cfg: jr.RopeConfig, backend: str, rng) -> Tuple[Callable, List, int]:
    del cfg, backend

    def step(table, out, rows, counts):
        out = positions.plan(table, rows, counts, out)
        return positions.commit(table, rows, counts), out, rows, counts
    table = positions.PositionTable(jnp.asarray(rng.integers(0, 4096, 2 * requests), jnp.int32))
    rows = jnp.asarray(rng.permutation(2 * requests)[:requests], jnp.int32)
    counts = jnp.ones((requests,), jnp.int32)
    return step, [table, jnp.zeros((requests,), jnp.int32), rows, counts], 2


CASES = {"rope_64": (_rope_case, 64), "rope_16384": (_rope_case, 16384),
         "append_64": (_append_case, 64), "append_16384": (_append_case, 16384),
         "plan_commit_256": (_plan_case, 256)}


class _Runner:
    """One step, jitted off or on, called on its own outputs (the donated carry)."""

    def __init__(self, step: Callable, state: List, donated: int, checked: bool, loop: int):
        self.state = [jax.tree.map(jnp.copy, x) for x in state]
        donate = tuple(range(donated))
        if loop > 1:
            def looped(*carry):
                return jax.lax.fori_loop(0, loop, lambda i, c: tuple(step(*c)), tuple(carry))
            fn = looped
        else:
            fn = step
        self.checked = checked
        self.fn = jax.jit(checkified(fn) if checked else fn, donate_argnums=donate)

    def __call__(self) -> None:
        out = self.fn(*self.state)
        if self.checked:
            error, out = out
            throw(error)
        else:
            jax.block_until_ready(out)
        self.state = list(out)


def _paired(make: Callable[[bool], _Runner], rounds: int, reps: int,
            rep_seconds: float, per_call: int) -> Dict[str, Any]:
    runners = {side: make(side == "on") for side in ("off", "on")}
    for runner in runners.values():  # compile and warm up before any timing
        runner()
    # Both started from one state: one application each must agree bit for bit.
    identical = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves(runners["off"].state), jax.tree.leaves(runners["on"].state)))
    medians: Dict[str, List[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for side, runner in runners.items():
            t = timing.time_wall(runner, reps=reps, rep_seconds=rep_seconds, warmup=2)
            medians[side].append(t.median_us / per_call)
    ratios = [on / off for off, on in zip(medians["off"], medians["on"])]
    return {"off_us": float(np.median(medians["off"])), "on_us": float(np.median(medians["on"])),
            "ratio": float(np.median(ratios)), "added_us": float(np.median(
                np.subtract(medians["on"], medians["off"]))),
            "rounds_off_us": medians["off"], "rounds_on_us": medians["on"],
            "identical_outputs": identical}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m bench.checked_bench",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for checked_bench.json")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--backend", default="auto", help="jaxrope backend of the ops")
    parser.add_argument("--rounds", type=int, default=7, help="off/on pairs per timing")
    parser.add_argument("--reps", type=int, default=5, help="repeats per side and round")
    parser.add_argument("--rep-seconds", type=float, default=0.05)
    parser.add_argument("--loop", type=int, default=64, help="applications per loop_us call")
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds of 3 repeats, loops of 8 (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.reps, args.rep_seconds, args.loop = 3, 3, 0.01, 8
    cfg = jr.RopeConfig(head_dim=D, theta=1e4, max_position=MAX_POSITION)
    print(f"checked_bench on {jax.devices()[0].device_kind} ({jax.default_backend()}), "
          f"backend={args.backend!r}, seed {args.seed}", flush=True)
    results: Dict[str, Any] = {}
    for name in args.cases:
        build, size = CASES[name]
        step, state, donated = build(size, cfg, args.backend, np.random.default_rng(args.seed))
        row = {}
        try:
            for method, loop in (("call_us", 1), ("loop_us", args.loop)):
                row[method] = _paired(lambda on: _Runner(step, state, donated, on, loop),
                                      args.rounds, args.reps, args.rep_seconds, loop)
        except Exception as e:  # noqa: BLE001 -- one step failing must not lose the others
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{name:16s} FAILED: {results[name]['error'][:300]}", flush=True)
            continue
        results[name] = row
        print(f"{name:16s} call off {row['call_us']['off_us']:9.1f} us on "
              f"{row['call_us']['on_us']:9.1f} us (x{row['call_us']['ratio']:.3f}) | loop off "
              f"{row['loop_us']['off_us']:9.1f} us on {row['loop_us']['on_us']:9.1f} us "
              f"(x{row['loop_us']['ratio']:.3f})", flush=True)
    report = {"info": timing.run_info("bench.checked_bench", sys.argv[1:] if argv is None
                                      else list(argv)),
              "backend": args.backend, "seed": args.seed, "rounds": args.rounds,
              "loop": args.loop, "results": results}
    timing.write_json(args.out, "checked_bench", report)
    failed = [name for name, row in results.items() if "error" in row]
    if failed:
        raise SystemExit(f"checked_bench: {failed} failed (their errors are in the JSON)")
    return report


if __name__ == "__main__":
    main()
