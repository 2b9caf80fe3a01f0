"""One process of :mod:`bench.layout_speed`: the rope and fused-append timings of the
jaxrope on ``PYTHONPATH``, as one JSON line on stdout.

Run by path (``python bench/layout_speed_worker.py --tree DIR ...``), never imported from
the tree it times: only ``jaxrope``'s public API is used (``apply_rope``,
``apply_rope_and_append_kv``, ``RopeConfig``), which both trees share, so the same code
times both. An editable install's import hook is dropped first, and the run stops if
``jaxrope`` does not come from ``--tree``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

Q_HEADS, K_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def _import_jaxrope(tree: str):
    # An editable install maps jaxrope's modules to its own checkout whatever sys.path
    # says; without its hook PYTHONPATH decides.
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    import jaxrope
    where = os.path.realpath(jaxrope.__file__)
    if not where.startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"jaxrope imported from {where}, not from --tree {tree}")
    return jaxrope


def _loop(step, carry, consts, iters: int):
    """``step`` applied ``iters`` times in one jitted ``fori_loop`` on the donated carry."""
    import jax
    import jax.numpy as jnp

    def loop(carry, consts):
        def body(_, c):
            return jax.lax.optimization_barrier(tuple(step(*c, *consts)))
        return jax.lax.fori_loop(0, iters, body, carry, unroll=8)

    compiled = jax.jit(loop, donate_argnums=0).lower(carry, consts).compile()
    state = [jax.tree.map(jnp.copy, carry)]

    def run(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            state[0] = compiled(state[0], consts)
        jax.block_until_ready(state[0])
        return time.perf_counter() - start
    return run


def _seconds_per_call(run, iters: int, reps: int) -> float:
    """The median over ``reps`` of (3 chained loops - 1 loop) / 2 / ``iters``: the launch
    and sync of a loop cancel."""
    run(1)
    samples = []
    for _ in range(reps):
        once, three = run(1), run(3)
        samples.append((three - once) / 2 / iters)
    return statistics.median(samples)


def _iters(nbytes: int) -> int:
    # About 10 ms a loop at 4 TB/s, in multiples of the unroll.
    return max(8, 8 * round(4e12 * 0.01 / nbytes / 8))


def time_cases(jr, tokens_list, backends, reps: int, seed: int, max_iters: int):
    import jax.numpy as jnp
    import numpy as np
    cfg = jr.RopeConfig(head_dim=HEAD_DIM)
    rng = np.random.default_rng(seed)
    rows = []
    for tokens in tokens_list:
        q = jnp.asarray(rng.standard_normal((tokens, Q_HEADS, HEAD_DIM)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((tokens, K_HEADS, HEAD_DIM)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((tokens, K_HEADS, HEAD_DIM)), jnp.bfloat16)
        pos = jnp.asarray(rng.integers(0, 65536, tokens).astype(np.int32))
        pages = -(-tokens // PAGE_SIZE)
        slots = jnp.asarray(rng.permutation(pages * PAGE_SIZE)[:tokens].astype(np.int32))
        cache = tuple(jnp.zeros((pages, PAGE_SIZE, K_HEADS, HEAD_DIM), jnp.bfloat16)
                      for _ in "kv")
        rope_bytes = 2 * (q.nbytes + k.nbytes)
        append_bytes = 2 * q.nbytes + 3 * k.nbytes + v.nbytes
        for backend in backends:
            def rope(a, b, p, backend=backend):
                return jr.apply_rope(a, b, p, cfg, backend=backend)

            def append(a, kv, kk, vv, p, s, backend=backend):
                return jr.apply_rope_and_append_kv(a, kk, vv, p, kv, s, cfg, backend=backend)

            for op, step, carry, consts, nbytes in (
                    ("rope", rope, (q, k), (pos,), rope_bytes),
                    ("rope_append_kv", append, (q, cache), (k, v, pos, slots), append_bytes)):
                iters = min(_iters(nbytes), max_iters)
                run = _loop(step, carry, consts, iters)
                seconds = _seconds_per_call(run, iters, reps)
                rows.append(dict(op=op, backend=backend, tokens=tokens, us=seconds * 1e6,
                                 tb_per_s=nbytes / seconds / 1e12))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", required=True, help="the checkout whose jaxrope is timed")
    parser.add_argument("--tokens", nargs="+", type=int, required=True)
    parser.add_argument("--backends", nargs="+", required=True)
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--max-iters", type=int, required=True)
    args = parser.parse_args(argv)
    jr = _import_jaxrope(args.tree)
    import jax
    rows = time_cases(jr, args.tokens, args.backends, args.reps, args.seed, args.max_iters)
    print(json.dumps(dict(tree=args.tree, jax=jax.__version__,
                          device=str(jax.devices()[0].device_kind), rows=rows)))


if __name__ == "__main__":
    main()
