"""Sample the host every second: per-CPU busy share, CPU MHz, the top CPU consumers (by delta),
load average. Writes JSON lines to argv[1] until killed."""
import json, os, sys, time

HZ = os.sysconf("SC_CLK_TCK")

def cpu_times():
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3] != " ":
                p = line.split()
                vals = list(map(int, p[1:]))
                idle = vals[3] + vals[4]
                out[p[0]] = (sum(vals), idle, vals[7] if len(vals) > 7 else 0)
    return out

def procs():
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                s = f.read()
            comm = s[s.index("(") + 1:s.rindex(")")]
            rest = s[s.rindex(")") + 2:].split()
            out[int(pid)] = (comm, int(rest[11]) + int(rest[12]), int(rest[36]) if len(rest) > 36 else -1)
        except Exception:
            pass
    return out

def mhz():
    vals = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    vals.append(float(line.split(":")[1]))
    except Exception:
        pass
    return vals

SWEEP = [c for c in range(os.cpu_count()) if str(c) not in sys.argv[2:]]


def sweep():
    """Median us of a fixed Python loop pinned to each CPU in SWEEP (not the bench's)."""
    out = {}
    for c in SWEEP:
        os.sched_setaffinity(0, {c})
        ts = []
        for _ in range(200):
            t = time.perf_counter()
            sum(i * i for i in range(200))
            ts.append(time.perf_counter() - t)
        ts.sort()
        out[c] = round(ts[len(ts) // 2] * 1e6, 2)
    os.sched_setaffinity(0, set(SWEEP))
    return out


out = open(sys.argv[1], "a")
c0, p0, t0 = cpu_times(), procs(), time.time()
while True:
    time.sleep(1.0)
    c1, p1, t1 = cpu_times(), procs(), time.time()
    busy = {k: round(1 - (c1[k][1] - c0[k][1]) / max(1, c1[k][0] - c0[k][0]), 3) for k in c1 if k in c0}
    top = []
    for pid, (comm, t, cpu) in p1.items():
        d = t - p0.get(pid, (comm, t, cpu))[1] if pid in p0 else t
        if d > 0:
            top.append((d / HZ / (t1 - t0), pid, comm, cpu))
    top.sort(reverse=True)
    steal = {k: round((c1[k][2] - c0[k][2]) / max(1, c1[k][0] - c0[k][0]), 3) for k in c1 if k in c0}
    speed = sweep()
    rec = dict(t=round(t1, 2), load=open("/proc/loadavg").read().split()[:3], busy=busy, steal=steal,
               speed=speed, mhz=mhz()[:1],
               top=[(round(a, 3), b, c, d) for a, b, c, d in top[:6]])
    out.write(json.dumps(rec) + "\n"); out.flush()
    c0, p0, t0 = c1, p1, t1
