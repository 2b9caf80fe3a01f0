"""RoPE in place: jaxrope against FlashInfer, XLA, torch and the in-place copy ceiling.

    python -m bench.rope_bench [--quick] [--out DIR] [--sections S ...] [--cases NAME ...]
                               [--tokens N ...] [--reps N] [--iters N] [--budget-s S]
    python -m bench.rope_bench --from-json DIR/rope_bench.json [--out DIR] [--write-results]

Shapes and configs are the named cases of :mod:`jaxrope.cases` at benchmark token
counts. Per (case, tokens): random normal q ``[T, Hq, D]`` and k ``[T, Hk, D]`` (bf16
unless ``--dtype``), positions uniform in ``[0, 65536)``; every task starts from copies.

Sections (``--sections``; default all):

- ``sweep``: the target case ``default_d128`` (Hq=32, Hk=8, D=128) at 1 to 65536 tokens,
  every implementation back to back (``loop``): the README table and the plot;
- ``kernel``: kernel durations from the profiler at 64, 16384, 65536 tokens (GPU only);
- ``cases``: every named case at 16384 and 65536 tokens: jaxrope, ``jaxrope_plain``
  (the same shape with ``RopeConfig(head_dim=D)``: ``vs plain``), FlashInfer's
  equivalent call and the ceiling. Kernel durations on a GPU: a variant with an
  attention factor scales q and k at every application, which caps its loops at a few
  applications (``GROWTH_LIMIT``), too few for a wall clock; loops elsewhere;
- ``wall``: wall time per call from Python, dispatch included, at 1 to 512 tokens.

Implementations: ``jaxrope`` / ``jaxrope_plain`` (``apply_rope(backend="triton")`` under
``jax.jit``, q and k donated; the Pallas interpreter on a CPU), ``jaxrope_mosaic``
(``backend="mosaic"``, GPU), ``xla`` (``backend="xla"``), ``jaxrope_torch`` (the same
Pallas kernel launched from torch, ``torch_bridge.launch.triton``), ``flashinfer``
(``apply_rope_pos_ids_inplace``; for Llama 3 ``apply_llama31_rope_pos_ids_inplace``, for
other scalings ``apply_rope_with_cos_sin_cache_inplace``), ``flashinfer_cache`` (the
cache call on the plain config), ``torch_eager`` (HF's ``rotate_half`` formula, out of
place), ``ceiling`` (torch ``mul_(1.0)`` on one buffer of q's and k's bytes),
``ceiling_2pass`` (q, then k) and ``xla_ceiling`` (a jitted ``x * s``, timed like the JAX
kernels).

Methods, all from :mod:`bench.timing`: ``loop`` (JAX: ``time_jax_loop``; torch:
``time_cuda_graph``), ``kernel`` (``kernel_durations``, JAX profiler), ``wall``
(``time_wall``). Bytes = 2 * (q.nbytes + k.nbytes) + pos_ids.nbytes; TB/s = bytes /
median; ``%ceil`` = TB/s over the same section's ceiling at that shape (``ceiling``, else
``xla_ceiling``); ``t/FI`` = time over FlashInfer's. On a CPU the numbers check the
plumbing, not performance.

Writes ``rope_bench.json`` (rewritten after every shape, so a killed run keeps what it
measured), ``rope_bench.md`` and ``rope_tbps.png`` into ``--out`` (:mod:`bench.rope_report`).
``--write-results`` (typically with ``--from-json``, on the machine holding the checkout)
replaces the rope_bench section of ``bench/RESULTS.md`` and copies the plot to
``bench/rope_tbps.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# JAX shares the GPU with torch here: it must not reserve most of the memory at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import timing  # noqa: E402
from bench.rope_torch_calls import flashinfer_call, hf_rope, warm_flashinfer  # noqa: E402
from bench.rope_report import (BENCH_DIR, NAME, PLOT_IMPLS, TARGET, render_markdown,  # noqa: E402
                               write_outputs)
from jaxrope import RopeConfig, apply_rope  # noqa: E402
from jaxrope.ops.constants import kernel_constants  # noqa: E402
from jaxrope.cases import BY_NAME, CASES, Case  # noqa: E402
from jaxrope.ops import mosaic_common  # noqa: E402
from jaxrope.scaling import Llama3  # noqa: E402

POSITION_RANGE = 65536
# In-place variants with an attention factor != 1 scale q and k at every application;
# loops are capped so that values stay far from bf16's overflow (3.4e38).
GROWTH_LIMIT = 1e30
DTYPES = ("bfloat16", "float16", "float32")
UNROLL = 8  # applications per body of a JAX loop

JAX_IMPLS = ("jaxrope", "jaxrope_plain", "jaxrope_mosaic", "xla", "xla_ceiling")
# Implementations that rotate q and k in place, so an attention factor compounds.
IN_PLACE_ROPE = ("jaxrope", "jaxrope_plain", "jaxrope_mosaic", "xla", "jaxrope_torch",
                 "flashinfer", "flashinfer_cache")
CEILINGS = ("ceiling", "xla_ceiling")


@dataclasses.dataclass(frozen=True)
class Section:
    """What one section measures: these cases at these token counts, by ``method``."""

    method: str  # "loop", "kernel" or "wall"; "kernel" falls back to "loop" off a GPU
    cases: Tuple[str, ...]
    tokens: Tuple[int, ...]
    impls: Tuple[str, ...]
    quick_tokens: Tuple[int, ...]


SECTIONS = {
    "sweep": Section("loop", (TARGET,), (1, 8, 64, 512, 4096, 16384, 65536), PLOT_IMPLS, (8, 32)),
    "kernel": Section("kernel", (TARGET,), (64, 16384, 65536),
                      ("jaxrope", "jaxrope_torch", "jaxrope_mosaic", "flashinfer", "ceiling"), (8,)),
    "cases": Section("kernel", tuple(c.name for c in CASES), (16384, 65536),
                     ("jaxrope", "jaxrope_plain", "flashinfer", "ceiling", "xla_ceiling"), (8,)),
    "wall": Section("wall", (TARGET,), (1, 8, 64, 512),
                    ("jaxrope", "jaxrope_torch", "xla", "flashinfer", "torch_eager"), (8,)),
}


@dataclasses.dataclass(frozen=True)
class Task:
    """One measurement: an implementation on a case at a token count, in a section."""

    section: str
    impl: str
    case: Case  # tokens already scaled
    method: str

    @property
    def key(self) -> str:
        return f"{self.section}/{self.impl}/{self.case.name}/T{self.case.tokens}"

    @property
    def cfg(self) -> RopeConfig:
        if self.impl == "jaxrope_plain":
            return RopeConfig(head_dim=self.case.head_dim)
        return self.case.cfg


def nbytes(case: Case, dtype: str) -> int:
    elements = case.tokens * (case.q_heads + case.k_heads) * case.head_dim
    return 2 * elements * jnp.dtype(dtype).itemsize + 4 * case.tokens


# --------------------------------------------------------------------------- environment


@dataclasses.dataclass
class Env:
    """What this process can run, and why not the rest (``notes``)."""

    on_gpu: bool
    torch: Any = None
    flashinfer: Any = None
    launcher: Any = None
    notes: List[str] = dataclasses.field(default_factory=list)

    def method(self, section: Section) -> str:
        return section.method if self.on_gpu or section.method != "kernel" else "loop"

    def available(self, impl: str, method: str) -> bool:
        if method == "kernel" and impl in ("xla", "xla_ceiling"):
            # XLA's unrolled loop gives each application's fusions names of their own,
            # each run n / unroll times like the loop counter: not countable per application.
            return False
        if impl == "jaxrope_mosaic":
            return self.on_gpu and mosaic_common.unavailable() is None
        if impl in JAX_IMPLS:
            return True
        if impl.startswith("flashinfer"):
            return self.flashinfer is not None
        if impl == "jaxrope_torch":
            return self.launcher is not None
        return self.torch is not None


def detect_env(want_flashinfer: bool, want_launcher: bool) -> Env:
    env = Env(on_gpu=jax.default_backend() in ("gpu", "cuda"))
    if not env.on_gpu:
        env.notes.append("no GPU: jaxrope runs in the Pallas interpreter; flashinfer*, "
                         "jaxrope_torch and kernel durations are skipped")
    try:
        import torch
    except ImportError:
        env.notes.append("torch is not installed: torch implementations are skipped")
        return env
    if env.on_gpu and not torch.cuda.is_available():
        env.notes.append(f"torch {torch.__version__} has no CUDA: torch implementations skipped")
        return env
    env.torch = torch
    if env.on_gpu and want_flashinfer:
        try:
            import flashinfer.rope
            warm_flashinfer(torch, flashinfer.rope)
            env.flashinfer = flashinfer.rope
        except Exception as e:  # noqa: BLE001 - any failure means: measure without it
            env.notes.append(f"flashinfer unavailable ({type(e).__name__}: {str(e)[:300]})")
    if env.on_gpu and want_launcher:
        try:
            from torch_bridge.launch.triton import TritonLauncher
            env.launcher = TritonLauncher()
        except Exception as e:  # noqa: BLE001 - the torch launch is optional here
            env.notes.append(f"jaxrope_torch unavailable ({type(e).__name__}: {str(e)[:300]})")
    return env


# --------------------------------------------------------------------------- implementations


def jax_step(impl: str, cfg: RopeConfig, on_gpu: bool, looped: bool) -> Callable:
    """``(q, k, pos[, i]) -> (q, k)``; ``looped`` xla steps take the loop index ``i``."""
    if impl == "xla":
        if looped:
            # XLA would hoist the cos/sin of loop-invariant positions out of the loop;
            # positions that change with the iteration keep that work in the timed body.
            return lambda q, k, pos, i: apply_rope(q, k, pos ^ (i & 1), cfg, backend="xla")
        return lambda q, k, pos: apply_rope(q, k, pos, cfg, backend="xla")
    backend = ("mosaic" if impl == "jaxrope_mosaic" else "triton") if on_gpu else "interpret"
    return lambda q, k, pos: apply_rope(q, k, pos, cfg, backend=backend)


def torch_call(task: Task, env: Env, inputs) -> Tuple[Callable[[], Any], str]:
    """The torch callable of ``task`` on fresh copies of the inputs, and what it calls."""
    torch = env.torch
    q, k, pos = (torch.from_dlpack(x).clone() for x in inputs)
    if task.impl == "ceiling":
        buf = torch.cat([q.reshape(-1), k.reshape(-1)])
        return (lambda: buf.mul_(1.0)), "torch mul_ on one buffer"
    if task.impl == "ceiling_2pass":
        return (lambda: (q.mul_(1.0), k.mul_(1.0))), "torch mul_ on q, then on k"
    if task.impl == "torch_eager":
        return hf_rope(torch, q, k, pos, task.cfg), "HF rotate_half, out of place"
    if task.impl == "jaxrope_torch":
        launcher, cfg = env.launcher, task.cfg
        return (lambda: launcher.rotate_(q, k, pos, cfg)), "torch_bridge.launch.triton"
    return flashinfer_call(torch, env.flashinfer, task.cfg, q, k, pos,
                           task.impl == "flashinfer_cache", POSITION_RANGE)


# --------------------------------------------------------------------------- measuring


def draw_inputs(case: Case, dtype: str, seed: int):
    """JAX q, k of ``dtype`` and int32 positions of ``case``, on the default device."""
    kq, kk, kp = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (case.tokens, case.q_heads, case.head_dim), dtype)
    k = jax.random.normal(kk, (case.tokens, case.k_heads, case.head_dim), dtype)
    pos = jax.random.randint(kp, (case.tokens,), 0, POSITION_RANGE, jnp.int32)
    return jax.block_until_ready((q, k, pos))


def growth_cap(cfg: RopeConfig, reps: int) -> int:
    """Most applications per loop that keep repeatedly rotated values finite."""
    attention = kernel_constants(cfg)[1]
    if abs(math.log(attention)) < 1e-12:
        return 10**9
    # A loop runs (1 + CALLS_PER_REPEAT * reps) times, the kernel method's reps more,
    # after a few warm-up calls.
    budget = math.log(GROWTH_LIMIT) / abs(math.log(attention)) - 8
    cap = int(budget // (1 + (timing.CALLS_PER_REPEAT + 1) * reps))
    if cap < 1:
        raise ValueError(f"{reps} repeats at attention factor {attention:.4f} would scale q and "
                         f"k past {GROWTH_LIMIT:g}: use fewer --reps")
    return cap


def measure(task: Task, env: Env, inputs, args, estimate_s: float) -> Dict[str, Any]:
    """Times ``task`` by its method; returns the result's ``measured`` Timing and ``api``."""
    cap = min(args.max_iters, growth_cap(task.cfg, args.reps)
              if task.impl in IN_PLACE_ROPE else args.max_iters)
    n = args.iters or max(1, min(cap, round(args.rep_seconds / estimate_s)))
    if not args.iters and n > UNROLL:
        n -= n % UNROLL
    if task.impl in JAX_IMPLS:
        return _measure_jax(task, env, inputs, args, n)
    fn, api = torch_call(task, env, inputs)
    sync = env.torch.cuda.synchronize if env.on_gpu else (lambda: None)
    if task.method == "wall":
        t = timing.time_wall(fn, sync, iters=args.iters, reps=args.reps)
    elif task.method == "kernel":
        fn()

        def run():
            for _ in range(n * args.reps):
                fn()
            sync()
        t = timing.kernel_durations(run, n * args.reps)
    else:
        t = timing.time_cuda_graph(fn, iters=args.iters, reps=args.reps,
                                   rep_seconds=args.rep_seconds, max_iters=cap)
    return dict(api=api, measured=t)


def _measure_jax(task: Task, env: Env, inputs, args, n: int) -> Dict[str, Any]:
    q, k, pos = inputs
    if task.impl == "xla_ceiling":
        step = lambda buf, scale: (buf * scale,)  # noqa: E731
        carry, consts = (jnp.concatenate([q.reshape(-1), k.reshape(-1)]),), (jnp.asarray(1.0, q.dtype),)
        api, indexed = "jitted x * s", False
    else:
        indexed = task.impl == "xla" and task.method != "wall"
        step, carry, consts = jax_step(task.impl, task.cfg, env.on_gpu, indexed), (q, k), (pos,)
        backend = "xla" if task.impl == "xla" else "mosaic" if task.impl == "jaxrope_mosaic" else (
            "triton" if env.on_gpu else "interpret")
        api = f"apply_rope backend={backend}"
    if task.method == "wall":
        fn = jax.jit(step, donate_argnums=(0, 1))
        state = [jnp.copy(q), jnp.copy(k)]

        def call():
            state[:] = fn(state[0], state[1], pos)
        return dict(api=api, measured=timing.time_wall(
            call, lambda: jax.block_until_ready(state), iters=args.iters, reps=args.reps))
    loop = timing.JaxLoop(step, carry, consts, iters=n, unroll=UNROLL, with_index=indexed)
    if task.method == "kernel":
        loop(1)
        return dict(api=api, measured=timing.kernel_durations(lambda: loop(args.reps), n * args.reps))
    return dict(api=api, measured=loop.time(args.reps))


def plan_tasks(sections: Sequence[str], case_names: Optional[Sequence[str]],
               tokens: Optional[Sequence[int]], quick: bool, env: Env) -> List[Task]:
    """Every task of the run, grouped by shape (so inputs are drawn once per shape)."""
    tasks = []
    for name in sections:
        section = SECTIONS[name]
        method = env.method(section)
        counts = tokens or (section.quick_tokens if quick else section.tokens)
        for case_name in section.cases:
            if case_names and case_name not in case_names:
                continue
            for count in counts:
                case = dataclasses.replace(BY_NAME[case_name], tokens=count)
                tasks += [Task(name, impl, case, method) for impl in section.impls
                          if env.available(impl, method)]
    order = {task.case: i for i, task in reversed(list(enumerate(tasks)))}
    # Per shape, the ceilings first: they size the other loops.
    return sorted(tasks, key=lambda t: (order[t.case], t.impl not in CEILINGS))


def run(tasks: List[Task], env: Env, args, report: Dict[str, Any], out_dir: Path) -> None:
    started = time.time()
    groups: Dict[Case, List[Task]] = {}
    for task in tasks:
        groups.setdefault(task.case, []).append(task)
    for index, (case, group) in enumerate(groups.items()):
        spent = args.budget_s and time.time() - started > args.budget_s
        inputs = None if spent else draw_inputs(case, args.dtype, args.seed + index)
        estimate, measured = _model_seconds(case, args.dtype, env.on_gpu), False
        for task in group:
            if spent:
                record(report, task, args.dtype, error=f"skipped: budget of {args.budget_s} s spent")
                continue
            start = time.time()
            try:
                fields = measure(task, env, inputs, args, estimate)
            except Exception as e:  # noqa: BLE001 - one failed task must not end the run
                record(report, task, args.dtype, error=f"{type(e).__name__}: {str(e)[:400]}")
                continue
            result = record(report, task, args.dtype, elapsed_s=time.time() - start, **fields)
            if task.impl in CEILINGS and task.method != "wall" and not measured:
                estimate, measured = result["median_us"] / 1e6, True
            if args.progress:
                print(f"{task.key}: {result['median_us']:.2f} us", file=sys.stderr, flush=True)
        gc.collect()
        if env.on_gpu and env.torch is not None:
            env.torch.cuda.empty_cache()
        timing.write_json(out_dir, NAME, report)


def _model_seconds(case: Case, dtype: str, on_gpu: bool) -> float:
    """A rough time per application until a ceiling is measured: sizes loops only."""
    launch, bandwidth = (2e-6, 3.5e12) if on_gpu else (2e-5, 2e9)
    return launch + nbytes(case, dtype) / bandwidth


def record(report: Dict[str, Any], task: Task, dtype: str, measured: Optional[timing.Timing] = None,
           **fields) -> Dict[str, Any]:
    case, cfg = task.case, task.cfg
    result = dict(key=task.key, section=task.section, impl=task.impl, case=case.name,
                  tokens=case.tokens, q_heads=case.q_heads, k_heads=case.k_heads,
                  head_dim=case.head_dim, rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
                  scaling=type(cfg.scaling).__name__ if cfg.scaling else None, dtype=dtype,
                  method=task.method, bytes=nbytes(case, dtype), **fields)
    if measured is not None:
        result.update(timing=measured.as_dict(), median_us=measured.median_us,
                      tbps=result["bytes"] / (measured.median_us * 1e-6) / 1e12)
    report["results"].append(result)
    return result


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rope_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny token counts, 2 applications per loop (CPU: minutes)")
    parser.add_argument("--out", default=str(BENCH_DIR / "out"), help="output folder")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--cases", nargs="+", default=None, choices=sorted(BY_NAME),
                        metavar="NAME", help="only these named cases (jaxrope.cases)")
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help="token counts for every section (default: each section's own)")
    parser.add_argument("--iters", type=int, default=None,
                        help="applications per loop or calls per sample (default: adaptive)")
    parser.add_argument("--reps", type=int, default=None,
                        help="samples per measurement (default 5, --quick 2)")
    parser.add_argument("--rep-seconds", type=float, default=0.01,
                        help="target length of one loop call")
    parser.add_argument("--max-iters", type=int, default=1000)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="start no new shape after this many seconds (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--progress", action="store_true", help="one line per task on stderr")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="measure nothing: render a saved rope_bench.json into --out")
    parser.add_argument("--write-results", action="store_true",
                        help="replace the rope_bench section of bench/RESULTS.md, copy the plot")
    args = parser.parse_args(argv)
    for name in ("iters", "reps", "max_iters"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.reps is None:
        args.reps = 2 if args.quick else 5
    if args.quick:
        args.rep_seconds, args.max_iters = min(args.rep_seconds, 0.002), min(args.max_iters, 2)
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs the benchmark (or renders ``--from-json``); returns the report."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
    else:
        probe = Env(on_gpu=True, torch=True, flashinfer=True, launcher=True)
        wanted = {t.impl for t in plan_tasks(args.sections, args.cases, args.tokens, args.quick, probe)}
        env = detect_env(any(i.startswith("flashinfer") for i in wanted), "jaxrope_torch" in wanted)
        tasks = plan_tasks(args.sections, args.cases, args.tokens, args.quick, env)
        device = env.torch.cuda.get_device_name(0) if env.on_gpu and env.torch else (
            jax.devices()[0].device_kind)
        report = dict(schema=2, info=timing.run_info("bench.rope_bench", argv), device=device,
                      dtype=args.dtype, notes=env.notes, args=vars(args), results=[])
        started = time.time()
        try:
            run(tasks, env, args, report, out_dir)
        finally:
            report["elapsed_s"] = time.time() - started
    written = write_outputs(report, out_dir, args.write_results)
    failed = sum(1 for r in report["results"] if r.get("error"))
    print(render_markdown(report), end="")
    print(f"{len(report['results'])} measurements ({failed} failed or skipped); wrote "
          + ", ".join(map(str, written)))
    return report


if __name__ == "__main__":
    main()
