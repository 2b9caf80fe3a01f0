"""Touch GIB GiB of fresh anonymous memory, one write per 4 KiB page, and print seconds per GiB."""
import mmap, sys, time
import numpy as np
gib = int(sys.argv[1])
t0 = time.perf_counter()
per = []
maps = []
for i in range(gib):
    t = time.perf_counter()
    m = mmap.mmap(-1, 1 << 30, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, dtype=np.uint8)
    a[::4096] = 1
    per.append(time.perf_counter() - t)
    maps.append((m, a))
print(f"touched {gib} GiB in {time.perf_counter() - t0:.2f} s; per GiB median {np.median(per):.3f} s, "
      f"first {per[0]:.3f} s, last {per[-1]:.3f} s")
