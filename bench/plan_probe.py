"""H200 host: plan/commit piece by piece with the new upload, and the old upload path A/B (a one-off).

    python3 bench/plan_probe.py OUT_DIR
"""
import collections, json, os, sys, time
import numpy as np, torch
from bench import bridge_bench as bb
from torch_bridge import step_arrays, plans, upload, manager

acc = collections.defaultdict(list)
def wrap(obj, name):
    f = getattr(obj, name); key = f"{obj.__name__}.{name}"
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[key].append(time.perf_counter() - t0); return r
    setattr(obj, name, g)
for obj, names in [(step_arrays.StepReader, ["read"]), (plans.StepPlans, ["base_counters", "positions", "install", "commit"]),
                   (upload.PositionUpload, ["stage", "step", "check_not_capturing"]), (upload._PinnedRing, ["send", "span"]),
                   (manager.PositionManager, ["plan", "commit"])]:
    for n in names: wrap(obj, n)
dev = torch.device("cuda", 0)
out = {}
for case, (req, span) in {"decode": (256, 1), "prefill": (8, 2048)}.items():
    mgr, steps, _ = bb._case(dev, req, span, 3000)
    acc.clear()
    bb.timed_steps(mgr, steps, False, 1000, dev)
    out[case] = {k: float(np.median(v[1000:]) * 1e6) for k, v in acc.items()}
    print(case, " ".join(f"{k}={v:.1f}" for k, v in out[case].items()), flush=True)
# A/B: the old upload (to_device: ring write, slice, torch.empty, copy_) vs the new (stage + send).
up = upload.PositionUpload(dev)
for n in (256, 16384):
    pos = np.arange(n, dtype=np.int32)
    old, new = [], []
    def via_old():
        t0 = time.perf_counter(); up.to_device(pos); return time.perf_counter() - t0
    def via_new():
        t0 = time.perf_counter()
        buf, = up.stage([n]); buf[...] = pos; up.step({"t": buf}, {}, ("t",), None)
        return time.perf_counter() - t0
    for r in range(40):
        for _ in range(100):
            old.append(via_old()); new.append(via_new())
        if r % 10 == 9: torch.cuda.synchronize()
    out[f"ab[{n}]"] = {"old": float(np.median(old[500:]) * 1e6), "new": float(np.median(new[500:]) * 1e6)}
    print(f"A/B upload [{n}]", out[f"ab[{n}]"], flush=True)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(out, open(os.path.join(sys.argv[1], "plan_probe.json"), "w"), indent=1)
