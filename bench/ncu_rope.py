"""Nsight Compute driver: why the Pallas RoPE kernel stops short of the in-place ceiling.

    bash bench/ncu_rope.sh OUTDIR          # the whole investigation, on the GPU machine

which runs, in turn (``python`` standing for the device's ``python3``):

    python -m bench.ncu_rope --what all --tokens 16384 65536 --time OUTDIR/timing.json
    # then, likewise for ceiling and flashinfer:
    ncu ... --nvtx --nvtx-include ncu_rope/ python -m bench.ncu_rope --what ours \\
        --tokens 16384 65536 --manifest OUTDIR/ncu_ours.manifest.json
    python -m bench.ncu_rope --summarize OUTDIR

The target shape is the one of the 95% goal: q ``[T, 32, 128]`` and k ``[T, 8, 128]``
bf16 on the GPU, rotated in place at int32 positions uniform in ``[0, 2**20)``,
``RopeConfig(head_dim=128, theta=5e5, max_position=2**20)``. Kernels (``--what``):

- ``ours``: the Pallas kernel launched from torch as production does,
  ``TritonLauncher().rotate_(q, k, pos_ids, cfg)``, labelled ``ours_heuristic`` (the
  ``block_config`` launch shape); and ``ours_<shape>``, the same with
  ``--block`` (default: the heuristic's shape at Hq=32 Hk=8 D=128, token-major).
- ``ceiling``: the in-place elementwise ceiling exactly as ``bench/rope_bench.py`` times
  it: ``mul_(1.0)`` on one buffer holding q and k (``torch.cat`` of both, flattened).
- ``flashinfer``: ``flashinfer.rope.apply_rope_pos_ids_inplace(q, k, pos_ids,
  rotary_dim=128, interleave=False, rope_theta=5e5)``, the call rope_bench times;
  skipped with a message when FlashInfer does not import.
- ``jax`` / ``mosaic``: the JAX paths, ``apply_rope(backend="pallas")`` (the same Triton
  IR as ``ours``, compiled by XLA) and ``apply_rope(backend="mosaic")`` (Mosaic GPU),
  jitted with q and k donated, on JAX copies of the same inputs. XLA launches them from
  its own threads, outside the driver's NVTX range: ncu_rope.sh profiles them by kernel
  name and launch count instead, one process per token count. ``--time`` times them by
  wall clock over back-to-back calls (torch's events do not see XLA's stream).

Each kernel gets ``--warmup`` launches (compiles and caches happen there), then
``--launches`` launches inside an NVTX push/pop range named ``ncu_rope``: ncu run with
``--nvtx --nvtx-include ncu_rope/`` profiles exactly those. ``--manifest`` records, in
launch order, which label each profiled launch belongs to (with its expected grid), and
``--summarize`` maps ncu's rows back to labels in that order. ``--time`` instead times
``--time-launches`` back-to-back eager launches between CUDA events (median of 5 repeats):
the profiler-free time next to ncu's ``gpu__time_duration`` (``jax`` and ``mosaic``: wall
clock over back-to-back jitted calls, dispatch included).

Bytes moved = 2 * (q.nbytes + k.nbytes) + pos_ids.nbytes for every kernel, as in
rope_bench, so effective TB/s and "% of ceiling" (ceiling time / kernel time at the same
T) are comparable with bench/RESULTS.md.

``--summarize OUTDIR`` (no GPU needed) reads ``ncu_*.csv`` (``ncu --import R --csv
--page raw --print-units base``) with their manifests and ``timing.json``, and writes
``summary.md`` (per token count, one column per kernel, rows = the key metrics),
``metrics_by_kernel.csv`` (every metric, median over launches, one column per kernel)
and ``launches.csv`` (every profiled launch with its label); it prints summary.md.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# JAX (imported by the launcher to export the kernel) shares the GPU with torch here.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

Q_HEADS, K_HEADS, HEAD_DIM = 32, 8, 128
THETA = 5e5
MAX_POSITION = 1 << 20
NVTX_RANGE = "ncu_rope"
WHATS = ("ours", "ceiling", "flashinfer", "jax", "mosaic")
# Today's default shape in token-major order: the profile shows what program order changes.
DEFAULT_BLOCK = (1, 2, 1, 4, 1, 0)


# ---------------------------------------------------------------------------------------
# The kernels


@dataclasses.dataclass
class Kernel:
    """One kernel ready to launch: ``call`` launches it once on the current stream."""

    call: Callable[[], Any]
    api: str
    config: Optional[str] = None
    expected_grid: Optional[Tuple[int, int, int]] = None
    expected_block: Optional[int] = None
    # Set for kernels JAX launches: they run on XLA's stream, which torch's CUDA events do
    # not order, so --time takes wall time over calls ended by ``sync`` instead.
    sync: Optional[Callable[[], None]] = None


def shape_bytes(tokens: int) -> Dict[str, int]:
    """q+k bytes (bf16) and the bytes model of rope_bench: 2 * (q + k) + 4 * T."""
    qk = tokens * (Q_HEADS + K_HEADS) * HEAD_DIM * 2
    return dict(qk_bytes=qk, bytes=2 * qk + 4 * tokens)


def _require_cuda():
    """torch with a CUDA device, or exit with a message saying so (no traceback)."""
    try:
        import torch
    except ImportError as e:
        sys.exit(f"ncu_rope: torch does not import ({e}); run this on the GPU machine")
    if not torch.cuda.is_available():
        sys.exit(f"ncu_rope: no CUDA device (torch {torch.__version__}, CUDA "
                 f"{torch.version.cuda}): the kernels can only run on the GPU machine "
                 "(--summarize and --help work anywhere)")
    return torch


def _block_label(block) -> str:
    return (f"bt{block.block_tokens}-hp{block.heads_per_program}-w{block.num_warps}"
            f"-g{block.groups_per_program}-l{block.token_loop}{'-hm' if block.heads_major else ''}")


def _launch_shape(block, tokens: int) -> Tuple[Tuple[int, int, int], int]:
    """The grid and threads per block the launcher uses for ``block``."""
    from jaxrope.kernels import pallas_triton

    axes = pallas_triton.grid(tokens, Q_HEADS, K_HEADS, block)
    return (*axes, 1, 1)[:3], 32 * block.num_warps


def build_kernels(torch, what: str, tokens: int, q, k, pos, launcher_box: Dict[str, Any],
                  variant: Tuple[int, ...]) -> List[Tuple[str, Callable[[], Kernel]]]:
    """(label, builder) pairs of ``what`` at ``tokens``; each builder gets its own copies.

    Builders run one at a time so that a failure (no FlashInfer, a Triton compile error)
    costs only that label.
    """
    from jaxrope import RopeConfig
    from jaxrope.kernels import pallas_triton

    cfg = RopeConfig(head_dim=HEAD_DIM, theta=THETA, max_position=MAX_POSITION)
    out: List[Tuple[str, Callable[[], Kernel]]] = []
    if what == "ours":
        heuristic = pallas_triton.block_config(tokens, Q_HEADS, K_HEADS,
                                               pallas_triton.lanes_for(cfg.rotary_dim))
        bt, hp, warps, *rest = variant
        groups, loop, major = (*rest, *(1, 1, 0)[len(rest):])
        swept = pallas_triton.BlockConfig(bt, hp, warps, groups_per_program=groups,
                                          token_loop=loop, heads_major=bool(major))
        for label, block, passed in (("ours_heuristic", heuristic, None),
                                     (f"ours_{_block_label(swept)}", swept, swept)):
            def make(block=block, passed=passed) -> Kernel:
                if "launcher" not in launcher_box:
                    from torch_bridge.triton_launch import TritonLauncher
                    launcher_box["launcher"] = TritonLauncher()
                launcher = launcher_box["launcher"]
                q2, k2 = q.clone(), k.clone()
                grid, threads = _launch_shape(block, tokens)
                # ``block=None`` is the production call: the launcher applies the heuristic.
                return Kernel(lambda: launcher.rotate_(q2, k2, pos, cfg, block=passed),
                              "torch_bridge.triton_launch.TritonLauncher.rotate_",
                              f"{_block_label(block)}-s{block.num_stages}", grid, threads)
            out.append((label, make))
    elif what == "ceiling":
        def make_ceiling() -> Kernel:
            buf = torch.cat([q.reshape(-1), k.reshape(-1)])
            return Kernel(lambda: buf.mul_(1.0),
                          "torch mul_(1.0) on one buffer of q and k (as rope_bench)")
        out.append(("ceiling", make_ceiling))
    elif what == "flashinfer":
        def make_flashinfer() -> Kernel:
            import flashinfer.rope as fi  # lazily: absent or broken FlashInfer skips this label
            q2, k2 = q.clone(), k.clone()
            return Kernel(lambda: fi.apply_rope_pos_ids_inplace(
                q2, k2, pos, rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
                rope_theta=cfg.theta), "flashinfer.rope.apply_rope_pos_ids_inplace")
        out.append(("flashinfer", make_flashinfer))
    elif what in ("jax", "mosaic"):
        backend = "pallas" if what == "jax" else "mosaic"

        def make_jax() -> Kernel:
            import jax
            import jax.numpy as jnp

            from jaxrope import apply_rope
            fn = jax.jit(lambda q, k, p: apply_rope(q, k, p, cfg, backend=backend),
                         donate_argnums=(0, 1))
            # Copies through the host: the profiled buffers are JAX's own, as a JAX user's.
            box = [jnp.asarray(x.float().cpu().numpy(), jnp.bfloat16) for x in (q, k)]
            pos_jax = jnp.asarray(pos.cpu().numpy())

            def call():
                box[:] = fn(box[0], box[1], pos_jax)

            def sync():
                jax.block_until_ready(box)
            return Kernel(call, f"jax.jit(apply_rope(backend={backend!r})), q and k donated",
                          sync=sync)
        out.append((f"{what}_heuristic", make_jax))
    return out


def _environment(torch) -> Dict[str, Any]:
    import importlib.metadata

    def version(dist: str) -> Optional[str]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    return dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                torch_cuda=torch.version.cuda, triton=version("triton"), jax=version("jax"),
                flashinfer=version("flashinfer-python"), python=sys.version.split()[0])


def run(args: argparse.Namespace) -> int:
    """Launches (and with ``--time`` times) every kernel of ``--what``; 0 if any ran."""
    torch = _require_cuda()
    from bench.kernel_check import torch_event_times  # imports JAX: only where CUDA runs
    whats = list(WHATS) if "all" in args.what else list(dict.fromkeys(args.what))
    manifest: Dict[str, Any] = dict(what=whats, tokens=args.tokens, nvtx_range=NVTX_RANGE,
                                    warmup=args.warmup, launches=args.launches,
                                    env=_environment(torch), kernels=[])
    timing: List[Dict[str, Any]] = []
    launcher_box: Dict[str, Any] = {}
    generator = torch.Generator(device="cuda").manual_seed(args.seed)
    for tokens in args.tokens:
        q = torch.randn(tokens, Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                        generator=generator)
        k = torch.randn(tokens, K_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                        generator=generator)
        pos = torch.randint(0, MAX_POSITION, (tokens,), dtype=torch.int32, device="cuda",
                            generator=generator)
        sizes = shape_bytes(tokens)
        for what in whats:
            for label, make in build_kernels(torch, what, tokens, q, k, pos, launcher_box,
                                             tuple(args.block)):
                entry: Dict[str, Any] = dict(label=label, impl=what, tokens=tokens, launches=0,
                                             **sizes)
                try:
                    kernel = make()
                    entry.update(api=kernel.api, config=kernel.config,
                                 expected_grid=kernel.expected_grid,
                                 expected_block=kernel.expected_block)
                    sync = kernel.sync or torch.cuda.synchronize
                    for _ in range(args.warmup):
                        kernel.call()
                    sync()
                    # The only launches inside the range: what ncu --nvtx-include profiles.
                    torch.cuda.nvtx.range_push(NVTX_RANGE)
                    try:
                        for _ in range(args.launches):
                            kernel.call()
                    finally:
                        torch.cuda.nvtx.range_pop()
                    sync()
                    entry["launches"] = args.launches
                    if args.time:
                        # Warmed up above, outside the NVTX range.
                        reps = (torch_event_times(kernel.call, args.time_launches, warmup=0)
                                if kernel.sync is None else
                                _wall_times(kernel.call, kernel.sync, args.time_launches))
                        median = statistics.median(reps)
                        timing.append(dict(label=label, impl=what, tokens=tokens, reps_us=reps,
                                           median_us=median, launches=args.time_launches,
                                           tbps=sizes["bytes"] / median / 1e6, **sizes))
                        how = "events" if kernel.sync is None else "wall, JAX stream"
                        print(f"{label:24s} T={tokens:6d}  {median:8.2f} us  "
                              f"{sizes['bytes'] / median / 1e6:5.2f} TB/s  ({how})")
                    else:
                        print(f"{label:24s} T={tokens:6d}  {args.launches} launches in "
                              f"NVTX range {NVTX_RANGE!r}")
                except Exception as e:  # noqa: BLE001 - one missing kernel must not stop the rest
                    entry["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    print(f"{label:24s} T={tokens:6d}  skipped: {entry['error']}")
                    torch.cuda.synchronize()
                manifest["kernels"].append(entry)
        del q, k, pos
        torch.cuda.empty_cache()
    if args.manifest:
        _write_json(Path(args.manifest), manifest)
    if args.time:
        _write_json(Path(args.time), dict(env=manifest["env"], entries=timing,
                                          errors=[e for e in manifest["kernels"] if e.get("error")]))
    return 0 if any(e["launches"] for e in manifest["kernels"]) else 1


def _wall_times(call: Callable[[], Any], sync: Callable[[], None], n: int,
                reps: int = 5) -> List[float]:
    """Per-call time (us) of ``n`` back-to-back calls ended by ``sync``, one per repeat."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        times.append((time.perf_counter() - start) / n * 1e6)
    return times


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


# ---------------------------------------------------------------------------------------
# Reading ncu's raw CSV

# ncu 2025.3 writes "ns" even under --print-units base.
_TIME_UNITS = {"nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0,
               "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_HERTZ = {"hz": 1.0, "khz": 1e3, "mhz": 1e6, "ghz": 1e9}
_PREFIXES = {"K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_STALL = re.compile(r"^smsp__average_warps?_(?:latency_)?issue_stalled_(\w+?)"
                    r"(_per_issue_active)?\.ratio$")


def _to_base(value: float, unit: str) -> float:
    """``value`` in ``unit`` as base units (seconds, bytes, .../second), in case a CSV
    was written without ``--print-units base``."""
    numer, _, denom = unit.strip().partition("/")
    if numer in _TIME_UNITS and not denom:
        return value * _TIME_UNITS[numer]
    if numer.lower() in _HERTZ:
        return value * _HERTZ[numer.lower()]
    if numer[:1] in _PREFIXES and numer[1:] in ("byte", "sector", "cycle", "inst", "warp",
                                                 "request", "thread", "block"):
        value *= _PREFIXES[numer[0]]
    if denom in _TIME_UNITS:
        value /= _TIME_UNITS[denom]
    return value


def _number(text: str) -> Optional[float]:
    cleaned = text.strip().replace(",", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def read_raw_csv(path: Path) -> List[Dict[str, Any]]:
    """The launches of an ncu raw-page CSV, in profiling order, values in base units.

    Non-numeric columns (kernel name, "Grid Size" tuples) stay strings.
    """
    lines = [line for line in path.read_text(errors="replace").splitlines()
             if line.strip() and not line.startswith("==")]
    rows = list(csv.reader(lines))
    header_at = next((i for i, r in enumerate(rows) if "ID" in r and "Kernel Name" in r), None)
    if header_at is None:
        return []
    header = rows[header_at]
    units = [""] * len(header)
    launches = []
    for row in rows[header_at + 1:]:
        record = dict(zip(header, row))
        if _number(record.get("ID", "")) is None:
            # The units row: its ID cell is empty.
            if not launches:
                units = (row + [""] * len(header))[:len(header)]
            continue
        parsed: Dict[str, Any] = {}
        for name, unit, text in zip(header, units, row):
            # Metric columns (``unit__name...``) are numbers; the rest (kernel name, the
            # "Grid Size" tuple, NVTX stacks) stay text.
            value = _number(text) if "__" in name or name == "ID" else None
            parsed[name] = text if value is None else _to_base(value, unit)
        launches.append(parsed)
    return sorted(launches, key=lambda r: r["ID"])


def _shape_matches(launch: Dict[str, Any], entry: Dict[str, Any]) -> Optional[bool]:
    """Whether ncu's grid and block size are the ones ``entry`` expects; None if unknown."""
    grid, block = entry.get("expected_grid"), entry.get("expected_block")
    got_grid, got_block = launch.get("launch__grid_size"), launch.get("launch__block_size")
    if not grid or not isinstance(got_grid, float) or not isinstance(got_block, float):
        return None
    return got_grid == grid[0] * grid[1] * grid[2] and got_block == block


def label_launches(launches: List[Dict[str, Any]], manifest: Dict[str, Any]) -> Tuple[
        List[Tuple[Dict[str, Any], Dict[str, Any]]], List[str]]:
    """Pairs each ncu launch with its manifest entry; and warnings.

    The driver launches only the profiled calls inside the NVTX range, one kernel per
    call, so launch order gives the labels when the counts agree; the expected grid and
    block size of our kernels check it. When the counts differ, only launches whose
    shape matches exactly one entry (ours: every launch config differs) get a label.
    """
    entries = [e for e in manifest.get("kernels", []) if e.get("launches")]
    expected = [e for e in entries for _ in range(e["launches"])]
    if not launches:
        return [], []
    if len(expected) == len(launches):
        pairs = list(zip(launches, expected))
        return pairs, [f"{e['label']} T{e['tokens']}: ncu ran {launch['launch__grid_size']:.0f} "
                       f"blocks x {launch['launch__block_size']:.0f} threads, expected grid "
                       f"{e['expected_grid']} x {e['expected_block']}"
                       for launch, e in pairs if _shape_matches(launch, e) is False]
    pairs = []
    for launch in launches:
        matching = [e for e in entries if _shape_matches(launch, e)]
        if len(matching) == 1:
            pairs.append((launch, matching[0]))
    return pairs, [f"{'+'.join(manifest.get('what', []))}: ncu recorded {len(launches)} "
                   f"launches, the driver made {len(expected)} in the NVTX range; "
                   f"{len(pairs)} labelled by launch shape, the rest are '?' in launches.csv"]


# ---------------------------------------------------------------------------------------
# Summary


def _median(values: Sequence[Any]) -> Optional[float]:
    numbers = [v for v in values if isinstance(v, float)]
    return statistics.median(numbers) if numbers else None


@dataclasses.dataclass
class Column:
    """One kernel at one token count: its manifest entry, launches and timing."""

    entry: Dict[str, Any]
    launches: List[Dict[str, Any]]
    timing: Optional[Dict[str, Any]]

    @property
    def name(self) -> str:
        return self.entry["label"]

    def metric(self, name: str) -> Optional[float]:
        return _median([launch.get(name) for launch in self.launches])

    @property
    def ncu_s(self) -> Optional[float]:
        return self.metric("gpu__time_duration.sum")

    @property
    def event_s(self) -> Optional[float]:
        return self.timing["median_us"] * 1e-6 if self.timing else None

    def stalls(self) -> List[Tuple[str, float]]:
        found: Dict[str, Tuple[bool, float]] = {}
        names = {key for launch in self.launches for key in launch}
        for key in names:
            match = _STALL.match(key)
            value = self.metric(key)
            # "selected" is the issuing warp (1 per issue by definition), not a stall.
            if match and value is not None and match.group(1) != "selected":
                reason, per_issue = match.group(1), bool(match.group(2))
                # The per-issue-active ratio when both families are there.
                if reason not in found or per_issue >= found[reason][0]:
                    found[reason] = (per_issue, value)
        return sorted(((r, v) for r, (_, v) in found.items()), key=lambda rv: -rv[1])


def _fmt(value: Optional[float], spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _sum(*values: Optional[float]) -> Optional[float]:
    return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]


def summary_rows(columns: List[Column]) -> List[Tuple[str, List[str]]]:
    """The rows of one token count's table: (metric, one cell per column)."""
    ceiling = next((c for c in columns if c.entry["impl"] == "ceiling"), None)

    def row(title: str, cell: Callable[[Column], str]) -> Tuple[str, List[str]]:
        return title, [cell(c) for c in columns]

    def per_request(c: Column, op: str) -> str:
        sectors = c.metric(f"l1tex__t_sectors_pipe_lsu_mem_global_op_{op}.sum")
        return _fmt(_ratio(sectors, c.metric(f"l1tex__t_requests_pipe_lsu_mem_global_op_{op}.sum")),
                    ".1f")

    def dram_peak(c: Column) -> Optional[float]:
        per_cycle = c.metric("dram__bytes.sum.peak_sustained")
        hz = c.metric("dram__cycles_elapsed.avg.per_second")
        return None if per_cycle is None or hz is None else per_cycle * hz

    def limits(c: Column) -> str:
        parts = [_fmt(c.metric(f"launch__occupancy_limit_{n}"), ".0f")
                 for n in ("registers", "shared_mem", "warps", "blocks")]
        return " / ".join(parts)

    def stalls(c: Column) -> str:
        top = c.stalls()[:4]
        return ", ".join(f"{r} {v:.2f}" for r, v in top) if top else "-"

    def dram_vs_ideal(c: Column, direction: str) -> str:
        measured = c.metric(f"dram__bytes_{direction}.sum")
        # The ceiling reads no positions; the RoPE kernels read 4 bytes per token more.
        reads_pos = direction == "read" and c.entry["impl"] != "ceiling"
        ideal = c.entry["qk_bytes"] + (4 * c.entry["tokens"] if reads_pos else 0)
        if measured is None:
            return "-"
        return f"{measured / 1e6:.1f} ({measured / ideal:.3f}x)"

    def l2_from_l1(c: Column, op: str) -> str:
        sectors = c.metric(f"lts__t_sectors_srcunit_tex_op_{op}.sum")
        return _fmt(None if sectors is None else sectors * 32 / 1e6, ".1f")

    return [
        row("launch config", lambda c: c.entry.get("config") or "-"),
        row("grid blocks x threads", lambda c: f"{_fmt(c.metric('launch__grid_size'), '.0f')} x "
                                               f"{_fmt(c.metric('launch__block_size'), '.0f')}"),
        row("launches profiled", lambda c: str(len(c.launches))),
        row("ncu time us (median)", lambda c: _fmt(c.ncu_s, ".2f", 1e6)),
        row("ncu time spread us (max-min)", lambda c: _fmt(
            None if not c.launches or c.ncu_s is None else
            max(x.get("gpu__time_duration.sum", 0.0) for x in c.launches)
            - min(x.get("gpu__time_duration.sum", 0.0) for x in c.launches), ".2f", 1e6)),
        row("effective TB/s (ncu)", lambda c: _fmt(_ratio(c.entry["bytes"], c.ncu_s), ".2f", 1e-12)),
        row("% of ceiling (ncu time)", lambda c: _fmt(
            _ratio(ceiling.ncu_s if ceiling else None, c.ncu_s), ".1%")),
        row("events time us (back to back; jax/mosaic: wall, dispatch included)",
            lambda c: _fmt(c.event_s, ".2f", 1e6)),
        row("effective TB/s (events)", lambda c: _fmt(_ratio(c.entry["bytes"], c.event_s), ".2f",
                                                      1e-12)),
        row("% of ceiling (events)", lambda c: _fmt(
            _ratio(ceiling.event_s if ceiling else None, c.event_s), ".1%")),
        row("DRAM read MB (x ideal)", lambda c: dram_vs_ideal(c, "read")),
        row("DRAM write MB (x ideal)", lambda c: dram_vs_ideal(c, "write")),
        row("DRAM TB/s achieved (read+write)/time", lambda c: _fmt(_ratio(
            _sum(c.metric("dram__bytes_read.sum"), c.metric("dram__bytes_write.sum")), c.ncu_s),
            ".2f", 1e-12)),
        row("DRAM peak TB/s (ncu)", lambda c: _fmt(dram_peak(c), ".2f", 1e-12)),
        row("dram__throughput % peak", lambda c: _fmt(
            c.metric("dram__throughput.avg.pct_of_peak_sustained_elapsed"), ".1f")),
        row("compute_memory_throughput % peak", lambda c: _fmt(
            c.metric("gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"), ".1f")),
        row("sm__throughput % peak", lambda c: _fmt(
            c.metric("sm__throughput.avg.pct_of_peak_sustained_elapsed"), ".1f")),
        row("issue slots busy % (smsp__issue_active)", lambda c: _fmt(
            c.metric("smsp__issue_active.avg.pct_of_peak_sustained_active"), ".1f")),
        row("occupancy achieved % / theoretical %", lambda c: (
            f"{_fmt(c.metric('sm__warps_active.avg.pct_of_peak_sustained_active'), '.1f')} / "
            f"{_fmt(c.metric('sm__maximum_warps_per_active_cycle_pct'), '.1f')}")),
        row("registers / thread", lambda c: _fmt(c.metric("launch__registers_per_thread"), ".0f")),
        row("blocks/SM limit: regs / smem / warps / blocks", limits),
        row("waves per SM", lambda c: _fmt(c.metric("launch__waves_per_multiprocessor"), ".2f")),
        row("SM cycles elapsed (avg) / active (avg)", lambda c: (
            f"{_fmt(c.metric('sm__cycles_elapsed.avg'), '.0f')} / "
            f"{_fmt(c.metric('sm__cycles_active.avg'), '.0f')}")),
        row("L2 MB read / written by L1 (sectors x 32)", lambda c: (
            f"{l2_from_l1(c, 'read')} / {l2_from_l1(c, 'write')}")),
        row("global ld / st sectors per request", lambda c: (
            f"{per_request(c, 'ld')} / {per_request(c, 'st')}")),
        row("global ld / st warp instructions", lambda c: (
            f"{_fmt(c.metric('smsp__sass_inst_executed_op_global_ld.sum'), '.0f')} / "
            f"{_fmt(c.metric('smsp__sass_inst_executed_op_global_st.sum'), '.0f')}")),
        row("warp instructions / KB moved", lambda c: _fmt(_ratio(
            c.metric("smsp__inst_executed.sum"), c.entry["bytes"] / 1024), ".1f")),
        row("top warp stalls (per issue active)", stalls),
    ]


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    clean = lambda s: str(s).replace("|", "/")  # noqa: E731
    return (["| " + " | ".join(map(clean, headers)) + " |", "|" + "---|" * len(headers)]
            + ["| " + " | ".join(map(clean, r)) + " |" for r in rows])


def summarize(out_dir: Path) -> str:
    """Writes summary.md, metrics_by_kernel.csv and launches.csv into ``out_dir``; returns
    the markdown."""
    warnings: List[str] = []
    columns: Dict[Tuple[str, int], Column] = {}
    all_launches: List[Dict[str, Any]] = []
    env: Dict[str, Any] = {}
    stems = sorted({p.name[:-len(".manifest.json")] for p in out_dir.glob("ncu_*.manifest.json")}
                   | {p.stem for p in out_dir.glob("ncu_*.csv")})
    for stem in stems:
        csv_path, manifest_path = out_dir / f"{stem}.csv", out_dir / f"{stem}.manifest.json"
        launches = read_raw_csv(csv_path) if csv_path.exists() else []
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        env = env or manifest.get("env", {})
        if not manifest:
            warnings.append(f"{stem}: the driver wrote no manifest (see {stem}.log): "
                            "its launches are '?' in launches.csv")
        elif not launches:
            warnings.append(f"{stem}: ncu profiled nothing (see {stem}.log)")
        for entry in manifest.get("kernels", []):
            if entry.get("error"):
                warnings.append(f"{entry['label']} T{entry['tokens']}: {entry['error']}")
            columns.setdefault((entry["label"], entry["tokens"]), Column(entry, [], None))
        pairs, why = label_launches(launches, manifest)
        warnings += why
        labelled = {id(launch): entry for launch, entry in pairs}
        for launch in launches:
            entry = labelled.get(id(launch))
            if entry:
                columns[(entry["label"], entry["tokens"])].launches.append(launch)
            all_launches.append(dict(source=csv_path.name,
                                     label=entry["label"] if entry else "?",
                                     tokens=entry["tokens"] if entry else "?", **launch))
    timing_path = out_dir / "timing.json"
    if timing_path.exists():
        timing = json.loads(timing_path.read_text())
        env = env or timing.get("env", {})
        for t in timing.get("entries", []):
            key = (t["label"], t["tokens"])
            if key not in columns:
                columns[key] = Column(dict(t, config=None), [], None)
            columns[key].timing = t
        warnings += [f"timing: {e['label']} T{e['tokens']}: {e['error']}"
                     for e in timing.get("errors", [])]
    else:
        warnings.append("no timing.json: no CUDA-event times")

    if env:
        warnings.insert(0, "environment: " + ", ".join(f"{k} {v}" for k, v in env.items() if v))
    order = {"ours": 0, "jax": 1, "mosaic": 2, "ceiling": 3, "flashinfer": 4}
    lines = ["# ncu_rope: Pallas RoPE vs the in-place ceiling and FlashInfer", "",
             f"q [T,{Q_HEADS},{HEAD_DIM}] + k [T,{K_HEADS},{HEAD_DIM}] bf16, in place. Bytes moved "
             "= 2*(q+k) + 4T (rope_bench's model); '% of ceiling' = ceiling time / kernel time. "
             "ncu times are single launches with caches flushed (--cache-control all); event "
             "times are back-to-back launches (jax and mosaic: wall clock over back-to-back "
             "jitted calls, dispatch included). 'x ideal': measured DRAM bytes over q+k (+ pos "
             "for the RoPE kernels' reads).", ""]
    for tokens in sorted({t for _, t in columns}):
        # Stable: within a family, the driver's launch order (the heuristic first).
        here = sorted((c for (_, t), c in columns.items() if t == tokens),
                      key=lambda c: order.get(c.entry["impl"], 9))
        rows = summary_rows(here)
        lines += [f"## T = {tokens}", ""]
        lines += _markdown_table(["metric"] + [c.name for c in here],
                                 [[title] + cells for title, cells in rows]) + [""]
    if warnings:
        lines += ["## Notes", ""] + [f"- {w}" for w in dict.fromkeys(warnings)] + [""]
    markdown = "\n".join(lines)
    (out_dir / "summary.md").write_text(markdown)
    _write_metrics_by_kernel(out_dir / "metrics_by_kernel.csv", columns)
    _write_launches(out_dir / "launches.csv", all_launches)
    return markdown


def _write_metrics_by_kernel(path: Path, columns: Dict[Tuple[str, int], Column]) -> None:
    profiled = [c for c in columns.values() if c.launches]
    names = sorted({k for c in profiled for launch in c.launches for k in launch
                    if "__" in k})
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["metric"] + [f"{c.name} T{c.entry['tokens']}" for c in profiled])
        for name in names:
            writer.writerow([name] + ["" if c.metric(name) is None else f"{c.metric(name):.6g}"
                                      for c in profiled])


def _write_launches(path: Path, launches: List[Dict[str, Any]]) -> None:
    fields = list(dict.fromkeys(k for launch in launches for k in launch))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(launches)


# ---------------------------------------------------------------------------------------
# Command line


def _block(text: str) -> Tuple[int, ...]:
    parts = text.split(",")
    if not 3 <= len(parts) <= 6 or not all(p.strip().isdigit() for p in parts) or \
            not all(int(p) > 0 for p in parts[:5]):
        raise argparse.ArgumentTypeError(
            f"{text!r}: want BLOCK_TOKENS,HEADS_PER_PROGRAM,NUM_WARPS[,GROUPS[,TOKEN_LOOP"
            "[,HEADS_MAJOR 0|1]]]")
    return tuple(int(p) for p in parts)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.ncu_rope",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="One command for everything: bash bench/ncu_rope.sh OUTDIR")
    parser.add_argument("--what", nargs="+", choices=WHATS + ("all",), default=["all"],
                        help="kernels to launch (default all)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[16384, 65536], metavar="N",
                        help="token counts (default 16384 65536)")
    parser.add_argument("--block", type=_block, default=DEFAULT_BLOCK, metavar="BT,HP,W[,G,L,M]",
                        help="launch shape of the ours_* variant: tokens, heads, warps, groups, "
                             "token loop, heads-major (default 1,2,1,4,1,0)")
    parser.add_argument("--warmup", type=int, default=3, help="launches before the NVTX range")
    parser.add_argument("--launches", type=int, default=3,
                        help="launches inside the NVTX range (profiled under ncu)")
    parser.add_argument("--manifest", default=None, metavar="PATH",
                        help="write the labels of the profiled launches, in order, here")
    parser.add_argument("--time", default=None, metavar="PATH",
                        help="also time each kernel with CUDA events; write the times here")
    parser.add_argument("--time-launches", type=int, default=20,
                        help="back-to-back launches per timed repeat (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--summarize", default=None, metavar="OUTDIR",
                        help="launch nothing: summarise the CSVs, manifests and timing in OUTDIR")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        parser.error("--tokens must be >= 1")
    for name in ("warmup", "launches", "time_launches"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is out of range")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the driver (or ``--summarize``); returns the exit code."""
    args = parse_args(argv)
    if args.summarize:
        out_dir = Path(args.summarize)
        if not out_dir.is_dir():
            sys.exit(f"ncu_rope: {out_dir} is not a directory")
        print(summarize(out_dir))
        return 0
    start = time.perf_counter()
    code = run(args)
    print(f"ncu_rope: done in {time.perf_counter() - start:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
