"""The one place that times things: every benchmark in ``bench/`` measures through it.

Each timer returns a :class:`Timing`: per-call microseconds (median, p10, p90, mean) over
``n`` samples, the calls behind each sample (``iters``) and a sentence saying how it was
measured (``method``); ``Timing.as_dict()`` is its JSON form. Warm-up calls (compiles,
caches) always come first and are never timed.

- :func:`time_jax_loop` -- device time of one application of a JAX step, dispatch left
  out: a jitted ``fori_loop`` of ``iters`` applications on donated buffers, compiled
  once. A call's wall time carries a fixed cost (dispatch and the final sync) that a
  short repeat does not amortise, so a repeat times one call and three chained calls
  and keeps half the difference. A repeat too short for that difference to stand out of the host's jitter
  (under a quarter of a call's wall time: tiny loops on a CPU) falls back to a call's
  wall time, and ``method`` says how many did. :class:`JaxLoop` is the loop itself, for
  benchmarks that also profile it.
- :func:`time_cuda` -- CUDA events around ``iters`` eager calls of a torch callable.
- :func:`time_cuda_graph` -- ``iters`` calls captured in one CUDA graph, its replays
  between CUDA events: back-to-back device time without launch gaps. When capture fails
  it times eager calls instead and says why. Without CUDA both fall back to a host
  loop's wall time (CPU smoke runs), and ``method`` says so.
- :func:`time_wall` -- wall time per call from Python, dispatch included: ``iters``
  calls, then one sync.
- :func:`kernel_durations` -- kernel time per application from the JAX profiler (CUPTI,
  which records torch's kernels too) or torch's profiler.
- :meth:`Timing.from_seconds` -- for spans a benchmark times itself (host time of
  ``plan`` + ``commit``, say).
- :func:`run_info` and :func:`write_json` -- the date, command, versions and git commit
  every result file records, and the atomic write of ``DIR/<name>.json``.

Example (a benchmark in a few lines; ``python -m bench.<name> --out DIR`` then writes
``DIR/<name>.json``)::

    from bench import timing
    t = timing.time_jax_loop(lambda q, k, pos: apply_rope(q, k, pos, cfg), (q, k), (pos,))
    g = timing.time_cuda_graph(lambda: flashinfer.apply_rope_pos_ids_inplace(tq, tk, tpos))
    print(t.median_us, g.median_us, t.method)
    timing.write_json(out_dir, "my_bench", {"info": timing.run_info("bench.my_bench", argv),
                                            "ours": t.as_dict(), "flashinfer": g.as_dict()})
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Timing", "JaxLoop", "time_jax_loop", "time_cuda", "time_cuda_graph", "time_wall",
           "kernel_durations", "per_application", "run_info", "write_json", "CALLS_PER_REPEAT"]

# A JaxLoop repeat runs the loop once, then three times (see time_jax_loop).
CALLS_PER_REPEAT = 4
# Trace lines XLA derives from the stream lines (they repeat the same kernels).
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code",
                  "Framework Ops", "Framework Name Scope", "XLA TraceMe")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call times in microseconds over ``n`` samples of ``iters`` calls each.

    >>> t = Timing.from_seconds([1e-6, 2e-6, 3e-6], "example", iters=10)
    >>> t.median_us, t.n, t.iters
    (2.0, 3, 10)
    """

    median_us: float
    p10_us: float
    p90_us: float
    mean_us: float
    n: int
    iters: int
    method: str
    samples_us: Tuple[float, ...] = ()
    detail: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_seconds(cls, samples_s: Sequence[float], method: str, iters: int = 1,
                     **detail: Any) -> "Timing":
        """A Timing of per-call samples given in seconds; ``detail`` is kept as is."""
        if len(samples_s) == 0:
            raise ValueError(f"no samples to summarise ({method})")
        us = np.asarray(samples_s, np.float64) * 1e6
        return cls(float(np.median(us)), float(np.percentile(us, 10)),
                   float(np.percentile(us, 90)), float(us.mean()), len(us), int(iters), method,
                   tuple(float(x) for x in us), dict(detail))

    def as_dict(self) -> Dict[str, Any]:
        """JSON-ready fields."""
        out = dataclasses.asdict(self)
        out["samples_us"] = list(self.samples_us)
        return out


def _iterations(estimate_s: float, rep_seconds: float, max_iters: int) -> int:
    return max(1, min(max_iters, round(rep_seconds / max(estimate_s, 1e-9))))


# --------------------------------------------------------------------------- JAX


class JaxLoop:
    """``step`` applied ``iters`` times in one jitted ``fori_loop`` on donated ``carry``.

    ``step(*carry, *consts)`` (``with_index``: ``step(*carry, *consts, i)``, ``i`` the loop
    index, e.g. to keep XLA from hoisting loop-invariant work) returns the new carry.
    The carry is copied first (the caller's arrays stay valid), then donated; the body
    is unrolled ``unroll`` times so the loop counter's own launch is amortised, and an
    ``optimization_barrier`` keeps XLA from fusing consecutive applications. Calling the
    loop with ``count`` runs ``count`` chained calls and returns their wall seconds,
    the final sync included. ``hlo`` is the compiled loop's HLO text.
    """

    def __init__(self, step: Callable, carry: Sequence[Any], consts: Sequence[Any] = (), *,
                 iters: int, unroll: int = 8, with_index: bool = False):
        import jax
        import jax.numpy as jnp
        self.n = iters
        consts = tuple(consts)

        def loop(carry, consts):
            def body(i, c):
                out = step(*c, *consts, *((i,) if with_index else ()))
                return jax.lax.optimization_barrier(tuple(out))
            return jax.lax.fori_loop(0, iters, body, carry, unroll=min(unroll, iters))

        self._state = tuple(jnp.copy(x) for x in carry)
        self._consts = consts
        start = time.perf_counter()
        self._fn = jax.jit(loop, donate_argnums=0).lower(self._state, consts).compile()
        self.compile_s = time.perf_counter() - start
        self.hlo = self._fn.as_text()
        # Copies in the compiled loop mean a donation did not take: not in place.
        self.hlo_copies = self.hlo.count(" copy(")

    @property
    def carry(self) -> Tuple[Any, ...]:
        """The loop's current carry (its copies of ``carry`` after every call so far)."""
        return self._state

    def __call__(self, count: int = 1) -> float:
        import jax
        start = time.perf_counter()
        for _ in range(count):
            self._state = self._fn(self._state, self._consts)
        jax.block_until_ready(self._state)
        return time.perf_counter() - start

    def time(self, reps: int = 5) -> Timing:
        """Seconds per application, one sample per repeat (see :func:`time_jax_loop`)."""
        self(1)
        samples, fallbacks = [], 0
        for _ in range(reps):
            once, three = self(1), self(3)
            per_call = (three - once) / 2
            if per_call < three / 3 / 4:
                fallbacks += 1
                per_call = three / 3
            samples.append(per_call / self.n)
        method = "jax fori_loop, (wall time of 3 chained calls - 1 call) / 2"
        if fallbacks:
            method += f"; {fallbacks} of {reps} repeats too short for that: wall time of a call"
        return Timing.from_seconds(samples, method, self.n, compile_s=self.compile_s,
                                   hlo_copies=self.hlo_copies)


def time_jax_loop(step: Callable, carry: Sequence[Any], consts: Sequence[Any] = (), *,
                  iters: Optional[int] = None, reps: int = 5, rep_seconds: float = 0.01,
                  max_iters: int = 1000, unroll: int = 8, with_index: bool = False,
                  estimate_s: Optional[float] = None) -> Timing:
    """Device time per application of ``step`` (a :class:`JaxLoop`), median over ``reps``.

    ``iters`` applications per loop; by default enough for one call to take about
    ``rep_seconds`` (at most ``max_iters``, a multiple of ``unroll``), sized from
    ``estimate_s`` (seconds per application) or else from the wall time of one jitted
    call, dispatch included. The carry goes through ``(1 + 4 * reps) * iters``
    applications (a step that grows its values must cap ``max_iters`` for that).

    >>> import jax.numpy as jnp
    >>> t = time_jax_loop(lambda x, s: (x * s,), (jnp.ones(8),), (jnp.float32(1.0),),
    ...                   iters=4, reps=2)
    >>> t.iters, t.n, t.median_us > 0
    (4, 2, True)
    """
    if iters is None:
        if estimate_s is None:
            estimate_s = _jax_call_seconds(step, carry, consts, with_index)
        iters = _iterations(estimate_s, rep_seconds, max_iters)
        if iters > unroll:
            iters -= iters % unroll
    loop = JaxLoop(step, carry, consts, iters=iters, unroll=unroll, with_index=with_index)
    return loop.time(reps)


def _jax_call_seconds(step, carry, consts, with_index) -> float:
    import jax
    import jax.numpy as jnp
    index = (jnp.int32(0),) if with_index else ()
    fn = jax.jit(step)
    jax.block_until_ready(fn(*carry, *consts, *index))
    start = time.perf_counter()
    for _ in range(3):
        out = fn(*carry, *consts, *index)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / 3


# --------------------------------------------------------------------------- torch


class _Clock:
    """CUDA events around device work when torch has CUDA, else the host's wall clock."""

    def __init__(self):
        import torch
        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.kind = "cuda events" if self.cuda else "host wall clock (no CUDA)"

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, work: Callable[[], None]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            work()
            return time.perf_counter() - start
        start, end = (self.torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def _warm(fn: Callable[[], Any], clock: _Clock, warmup: int, iters: Optional[int],
          rep_seconds: float, max_iters: int) -> int:
    """Runs ``warmup`` calls (compiles happen there), then sizes a sample."""
    for _ in range(max(1, warmup)):
        fn()
    clock.sync()
    if iters:
        return iters
    estimate = clock.seconds(lambda: [fn() for _ in range(3)]) / 3
    return _iterations(estimate, rep_seconds, max_iters)


def time_cuda(fn: Callable[[], Any], *, iters: Optional[int] = None, reps: int = 5,
              warmup: int = 3, rep_seconds: float = 0.01, max_iters: int = 1000) -> Timing:
    """Per-call time of ``iters`` eager calls of ``fn`` between two CUDA events.

    Launch gaps count (use :func:`time_cuda_graph` for back-to-back device time).
    ``iters`` defaults to about ``rep_seconds`` of calls, at most ``max_iters``.
    """
    clock = _Clock()
    n = _warm(fn, clock, warmup, iters, rep_seconds, max_iters)
    samples = [clock.seconds(lambda: [fn() for _ in range(n)]) / n for _ in range(reps)]
    return Timing.from_seconds(samples, f"{n} eager calls, {clock.kind}", n)


def time_cuda_graph(fn: Callable[[], Any], *, iters: Optional[int] = None, reps: int = 5,
                    warmup: int = 3, rep_seconds: float = 0.01,
                    max_iters: int = 1000) -> Timing:
    """Per-call time of ``iters`` calls of ``fn`` captured in one CUDA graph, replayed.

    Capture warms up on a side stream and uses ``capture_error_mode="thread_local"``
    (another thread may call CUDA meanwhile, e.g. a JAX compile).
    """
    clock = _Clock()
    if not clock.cuda:
        return time_cuda(fn, iters=iters, reps=reps, warmup=warmup, rep_seconds=rep_seconds,
                         max_iters=max_iters)
    torch = clock.torch
    n = _warm(fn, clock, warmup, iters, rep_seconds, max_iters)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(n):
                fn()
    except Exception as e:  # noqa: BLE001 - eager calls instead, and the method says why
        torch.cuda.synchronize()
        eager = time_cuda(fn, iters=n, reps=reps, warmup=0)
        return dataclasses.replace(
            eager, method=f"{eager.method} (CUDA graph capture failed: {str(e)[:120]})")
    graph.replay()
    samples = [clock.seconds(graph.replay) / n for _ in range(reps)]
    return Timing.from_seconds(samples, f"CUDA graph of {n} calls, replays between cuda events", n)


def time_wall(fn: Callable[[], Any], sync: Optional[Callable[[], Any]] = None, *,
              iters: Optional[int] = None, reps: int = 5, warmup: int = 5,
              rep_seconds: float = 0.05, max_iters: int = 1000) -> Timing:
    """Wall time per call of ``fn`` issued ``iters`` times from Python, then ``sync()``.

    What a caller pays per call, dispatch included. ``sync`` waits for the device work
    (``torch.cuda.synchronize``, or ``jax.block_until_ready`` on the outputs).

    >>> t = time_wall(lambda: sum(range(100)), iters=10, reps=3)
    >>> t.n, t.iters, t.median_us > 0
    (3, 10, True)
    """
    sync = sync or (lambda: None)

    def batch(count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            fn()
        sync()
        return time.perf_counter() - start

    batch(warmup)
    n = iters or _iterations(batch(5) / 5, rep_seconds, max_iters)
    samples = [batch(n) / n for _ in range(reps)]
    return Timing.from_seconds(samples, f"wall time of {n} calls from Python, one sync", n)


# --------------------------------------------------------------------------- profilers


def kernel_durations(run: Callable[[], Any], applications: int, *,
                     profiler: str = "jax") -> Timing:
    """Kernel time per application of the GPU work ``run`` does, from a profiler trace.

    ``run`` performs ``applications`` applications and waits for them. ``profiler``:
    ``"jax"`` (``jax.profiler``, CUPTI: it sees every kernel of the process, torch's
    included) or ``"torch"`` (``torch.profiler``, for processes that never start JAX's
    GPU client). Counted: every kernel that ran at least ``applications`` times (a
    loop counter launched once per unrolled body, copies and memsets are left out);
    sample ``i`` is the sum of application ``i``'s share of each, so the median is over
    applications. ``detail["kernels"]`` lists the six longest kernels' counts and totals.
    """
    if profiler == "jax":
        events = jax_kernel_events(run)
    elif profiler == "torch":
        events = _torch_kernel_events(run)
    else:
        raise ValueError(f"{profiler=} must be 'jax' or 'torch'")
    samples_ns, kernels = per_application(events, applications)
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["total_us"])[:6]
    return Timing.from_seconds(np.asarray(samples_ns) / 1e9,
                               f"{profiler} profiler kernel durations", applications,
                               kernels=dict(top))


def per_application(events: Sequence[Tuple[str, float, float]],
                    applications: int) -> Tuple[List[float], Dict[str, Dict[str, float]]]:
    """``(name, start_ns, duration_ns)`` kernel events -> per-application ns, per-kernel totals.

    >>> events = [("rope", t, 10.0) for t in range(4)] + [("counter", 9, 1.0)]
    >>> per_application(events, 2)[0]
    [20.0, 20.0]
    """
    by_name: Dict[str, List[Tuple[float, float]]] = {}
    for name, start, duration in events:
        by_name.setdefault(name, []).append((start, duration))
    kernels = {name: {"count": len(ev), "total_us": sum(d for _, d in ev) / 1e3}
               for name, ev in by_name.items()}
    samples = np.zeros(applications)
    counted = 0
    for ev in by_name.values():
        per = len(ev) // applications
        if per == 0:
            continue
        durations = np.asarray([d for _, d in sorted(ev)][:per * applications])
        samples += durations.reshape(applications, per).sum(axis=1)
        counted += 1
    if not counted:
        raise RuntimeError(f"no kernel ran {applications} times in the trace; "
                           f"saw {sorted(kernels)[:8]}")
    return samples.tolist(), kernels


def jax_kernel_events(run: Callable[[], Any], *,
                      copies: bool = False) -> List[Tuple[str, float, float]]:
    """``(name, start_ns, duration_ns)`` of every GPU kernel the JAX profiler saw while
    ``run`` ran (CUPTI: torch's too); copies and memsets only with ``copies``."""
    import jax
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError("the JAX profiler wrote no trace")
        data = jax.profiler.ProfileData.from_file(paths[0])
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or [line for line in lines if line.name not in _DERIVED_LINES]:
            events += [(e.name, e.start_ns, e.duration_ns) for e in line.events
                       if copies or not _is_copy(e.name)]
    return events


def _torch_kernel_events(run: Callable[[], Any]) -> List[Tuple[str, float, float]]:
    import torch
    from torch.profiler import ProfilerActivity, profile
    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA here: no kernels to profile")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    return [(e.name, e.time_range.start * 1e3, e.time_range.elapsed_us() * 1e3)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and not _is_copy(e.name)]


def _is_copy(name: str) -> bool:
    lowered = name.lower()
    return "memcpy" in lowered or "memset" in lowered


# --------------------------------------------------------------------------- output


def run_info(module: str, argv: Sequence[str]) -> Dict[str, Any]:
    """Date, command, versions, devices and git commit: what every result file records."""
    import importlib.metadata
    import platform
    import subprocess
    import sys

    def version(dist: str) -> Optional[str]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def output(*cmd: str) -> Optional[str]:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=20,
                                  cwd=Path(__file__).resolve().parent)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    info: Dict[str, Any] = dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=" ".join(["python", "-m", module, *argv]), python=platform.python_version(),
        host=platform.node(), git_commit=output("git", "rev-parse", "--short=12", "HEAD"),
        **{name: version(dist) for name, dist in (
            ("jax", "jax"), ("jaxlib", "jaxlib"), ("numpy", "numpy"), ("torch", "torch"),
            ("triton", "triton"), ("flashinfer", "flashinfer-python"))})
    if "jax" in sys.modules:
        import jax
        info["jax_devices"] = [getattr(d, "device_kind", str(d)) for d in jax.devices()]
    info["nvidia_smi"] = output("nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,"
                                "clocks.mem,power.draw,temperature.gpu", "--format=csv,noheader")
    return info


def write_json(out_dir, name: str, report: Mapping[str, Any]) -> Path:
    """Writes ``report`` to ``out_dir/<name>.json`` atomically (a killed run keeps the last)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
    return path
