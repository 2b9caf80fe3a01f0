"""One-off: where a plan's host time goes (run once on the H200, 2026-12-01 13:17 UTC; removed after)."""
import time, sys, cProfile, pstats
import numpy as np, torch
from bench.bridge_bench import _case, timed_steps
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
def med(f, n=3000):
    ts = []
    for _ in range(n):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e6
for name, (reqs, span) in {"decode": (256, 1), "prefill": (8, 2048)}.items():
    mgr, steps, _ = _case(dev, reqs, span, 600)
    p, c = timed_steps(mgr, steps, False, 100, dev)
    print(name, "plan", np.median(p) * 1e6, "commit", np.median(c) * 1e6)
    step, ctx = steps[100]
    R = mgr._reader
    arrays = R.read(step, ctx, device=mgr.device, max_seq_len=mgr.max_seq_len)
    g = R._groups(step, ctx)[0]
    (pl, views), = g.items()
    base = mgr._plans.base_counters(arrays, False)
    computed = mgr._plans.positions(base, arrays)
    for label, f in [("read", lambda: R.read(step, ctx, device=mgr.device, max_seq_len=mgr.max_seq_len)),
                     ("groups", lambda: R._groups(step, ctx)),
                     ("label_arrays", lambda: R._label_arrays(pl, views)),
                     ("tuple_eq", lambda: tuple(views) == step.segments),
                     ("explicit", lambda: R._explicit(step.pos_ids, arrays.labels, mgr.device, mgr.max_seq_len)),
                     ("forks", lambda: R.forks((), "pre_forks")),
                     ("capture_check", mgr._upload.check_not_capturing),
                     ("base", lambda: mgr._plans.base_counters(arrays, False)),
                     ("positions", lambda: mgr._plans.positions(base, arrays)),
                     ("upload", lambda: mgr._upload.step(computed, arrays.explicit, tuple(arrays.labels), None)),
                     ("plan", lambda: mgr.plan(step, ctx))]:
        print(f"  {label:14s} {med(f):7.2f} us")
    mgr.plan(step, ctx)
    print("  commit", med(lambda: (mgr.plan(step, ctx), mgr.commit(step, ctx))) , "(plan+commit)")
    pr = cProfile.Profile(); pr.enable()
    timed_steps(mgr, steps[:300], False, 50, dev)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
