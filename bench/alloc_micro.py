"""A host loop shaped like a plan: small numpy arrays and Python lists per step; median us per step."""
import time
import numpy as np
ts = []
for i in range(20000):
    t = time.perf_counter()
    a = np.arange(256, dtype=np.int32)
    b = np.repeat(a, 2)
    c = [int(x) for x in range(256)]
    d = np.asarray(c, dtype=np.int64) + b[:256]
    e = {j: j for j in range(64)}
    ts.append(time.perf_counter() - t)
ts = np.array(ts[2000:]) * 1e6
print(f"alloc_micro median {np.median(ts):.2f} us p90 {np.percentile(ts, 90):.2f} us")
