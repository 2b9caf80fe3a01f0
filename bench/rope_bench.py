"""RoPE in place: jaxrope against FlashInfer, XLA, torch eager and the elementwise ceiling.

    python -m bench.rope_bench [--quick] [--out DIR] [--filter TERM ...] [--iters N]
                               [--sweep-blocks] [--write-results | --no-write-results]
    python -m bench.rope_bench --from-json DIR/results.json [--write-results]

Every implementation runs in one process on the same inputs: random normal q and k
(bf16 unless ``--dtype``), drawn fresh for each shape, positions uniform in
``[0, 65536)``; every task starts from a copy of them.

Implementations (``impl``):

- ``jaxrope``: ``apply_rope(..., backend="pallas")`` under ``jax.jit`` with q and k
  donated, i.e. in place (the Pallas interpreter on CPU);
- ``xla``: ``apply_rope(..., backend="xla")``, the jnp formula fused by XLA;
- ``flashinfer``: ``flashinfer.rope.apply_rope_pos_ids_inplace``, or for a variant its
  FlashInfer equivalent (``apply_llama31_rope_pos_ids_inplace`` for Llama 3,
  ``apply_rope_with_cos_sin_cache_inplace`` for the other scalings);
  ``flashinfer_cache``: the cos/sin-cache kernel on the plain config;
- ``jaxrope_torch``: the same Pallas kernel launched from torch
  (``torch_bridge.triton_launch``), at the target head layout only;
- ``jaxrope_mosaic``: ``apply_rope(..., backend="mosaic")``, the Mosaic GPU kernel, jitted
  and donated like ``jaxrope``; GPU only, at the target head layout only;
- ``torch_eager``: HF's ``rotate_half`` formula in torch eager, out of place as HF runs it;
- ``ceiling``: one in-place elementwise pass over the same bytes (torch ``mul_(1.0)`` on
  one buffer the size of q and k together); ``ceiling_2pass``: q and k as two passes;
  ``xla_ceiling``: the same pass as a jitted ``x * s``, timed like the JAX kernels.

Methods (``method``):

- ``loop``: device time per application, no host dispatch. JAX: a jitted ``fori_loop``
  of N applications on donated buffers, compiled once; per repeat, the wall time of
  three chained calls of it minus that of one (so that dispatch and the final sync
  cancel), over 2N. Torch on a GPU: a CUDA graph of N calls, its
  replays timed with CUDA events. N makes one repeat last about ``rep_seconds``; the
  number reported is the median over the repeats.
- ``wall``: per call from Python, dispatch included: M calls, one sync, over M.
- ``kernel``: kernel durations recorded by the JAX profiler (CUPTI), summed per
  application, for every implementation alike (GPU only): the ``kernel`` section, and
  on a GPU the ``variants`` section too.

Sections (``section``): ``main``, the sweep of tokens x heads x head_dim; ``variants``,
each variant of the Pallas kernel against its plain config at the target token counts;
``wall``; ``kernel``; ``ceiling``, the ceilings of every shape measured. With
``--sweep-blocks`` the run is only ``blocks``: ``rope_pallas(config=BlockConfig(...))``
over the grids of ``Plan.block_sweep`` next to the heuristic and FlashInfer, the best
config per token count in the Targets table. On a CPU the numbers check the plumbing,
not performance. ``--help`` lists the other options.

Bytes = 2 * (q.nbytes + k.nbytes) + pos_ids.nbytes (also for partial rotary);
TB/s = bytes / median time. ``%ceil``: TB/s over the ceiling's TB/s at that shape
(``ceiling``, else ``xla_ceiling``). ``t/FI``: time over FlashInfer's, same section and
case. Shapes whose q and k fit in L2 (60 MB on the H200) are marked ``L2``: repeated
applications there run from the cache, for every implementation alike.

Outputs in ``--out``: ``results.json`` (every raw number and the environment, rewritten
after each shape so a killed run keeps what it measured), ``results.md`` (this run's
section), ``table.txt`` and ``rope_tbps.png``. With ``--write-results`` (the default
for a full, unfiltered GPU run) the section is added to ``bench/RESULTS.md``, earlier
runs kept, and the plot copied to ``bench/rope_tbps.png``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import gc
import glob
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# JAX shares the GPU with torch here: it must not reserve most of the memory at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrope import RopeConfig, apply_rope  # noqa: E402
from jaxrope.apply import kernel_constants  # noqa: E402
from jaxrope.cases import BY_NAME  # noqa: E402
from jaxrope.kernels import mosaic_gpu  # noqa: E402
from jaxrope.kernels.pallas_triton import BlockConfig, lanes_for, rope_pallas  # noqa: E402
from jaxrope.scaling import Llama3  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
RESULTS_PNG = BENCH_DIR / "rope_tbps.png"
POSITION_RANGE = 65536
H200_L2_BYTES = 60 * 2**20
# In-place variants with an attention factor != 1 scale q and k at every application;
# the loop length is capped so that values stay far from bf16's overflow (3.4e38).
GROWTH_LIMIT = 1e30
DTYPE_IDS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Half tiles past 4x the heuristic's 4096 elements need more than 128 float32 registers
# per thread for the two halves even at 8 warps: not worth compiling in a sweep.
MAX_TILE_ELEMENTS = 16384


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockGrid:
    """The launch shapes ``--sweep-blocks`` tries at one token count."""

    block_tokens: Tuple[int, ...]
    heads_per_program: Tuple[int, ...]
    num_warps: Tuple[int, ...]

    def configs(self, tokens: int, q_heads: int, k_heads: int, rotary_dim: int) -> List[BlockConfig]:
        lanes = lanes_for(rotary_dim)
        out = []
        for bt in self.block_tokens:
            for hp in self.heads_per_program:
                for warps in self.num_warps:
                    # A program's half tile is [bt, hp, lanes]. Skip launches that duplicate
                    # a smaller one (blocks past T or past the head count), warps with
                    # threads that own no element, and tiles past MAX_TILE_ELEMENTS.
                    elements = bt * hp * lanes
                    if (bt > _next_pow2(tokens) or hp > _next_pow2(max(q_heads, k_heads))
                            or elements < 32 * warps or elements > MAX_TILE_ELEMENTS):
                        continue
                    # num_stages stays 1: the kernel has no loop for Triton to pipeline.
                    out.append(BlockConfig(bt, hp, warps, 1))
        return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures: the sweep table. ``FULL`` and ``QUICK`` are the instances."""

    tokens: Tuple[int, ...]
    heads: Tuple[Tuple[int, int], ...]
    head_dims: Tuple[int, ...]
    target_heads: Tuple[int, int]
    target_head_dim: int
    target_tokens: Tuple[int, ...]
    kernel_tokens: Tuple[int, ...]
    wall_tokens: Tuple[int, ...]
    block_sweep: Tuple[Tuple[int, BlockGrid], ...]
    rep_seconds: float
    reps: int
    max_iters: int


_BLOCKS_LARGE = BlockGrid((2, 4, 8, 16, 32, 64), (1, 2, 4, 8), (2, 4, 8))
FULL = Plan(
    tokens=(1, 8, 64, 512, 4096, 16384, 65536),
    heads=((32, 8), (64, 8), (8, 1), (128, 128)),
    head_dims=(64, 128, 256),
    target_heads=(32, 8),
    target_head_dim=128,
    target_tokens=(16384, 65536),
    kernel_tokens=(64, 16384, 65536),
    wall_tokens=(1, 8, 64, 512),
    block_sweep=((64, BlockGrid((1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 2, 4))),
                 (16384, _BLOCKS_LARGE), (65536, _BLOCKS_LARGE)),
    rep_seconds=0.01,
    reps=5,
    max_iters=1000,
)
QUICK = Plan(
    tokens=(8, 32),
    heads=((32, 8), (8, 1)),
    head_dims=(128,),
    target_heads=(32, 8),
    target_head_dim=128,
    target_tokens=(32,),
    kernel_tokens=(8, 32),
    wall_tokens=(8,),
    block_sweep=((8, BlockGrid((1, 8), (1, 4), (1, 2))), (32, BlockGrid((8, 16), (2, 8), (2, 4)))),
    rep_seconds=0.002,
    reps=3,
    # The Pallas interpreter takes ~0.1 s per application on a CPU.
    max_iters=2,
)

# The variants of issue #3: named cases where one fits (head_dim 128), at the target heads.
VARIANTS: Tuple[Tuple[str, RopeConfig], ...] = (
    ("plain", RopeConfig(head_dim=128)),
    ("llama3", BY_NAME["llama3_8b"].cfg),
    ("yarn", BY_NAME["qwen25_yarn"].cfg),
    ("partial_0.5", BY_NAME["partial_half_d128"].cfg),
    ("interleave", RopeConfig(head_dim=128, interleave=True)),
)
VARIANT_CONFIGS = dict(VARIANTS)

JAX_IMPLS = ("jaxrope", "jaxrope_mosaic", "xla", "xla_ceiling")
TORCH_IMPLS = ("ceiling", "ceiling_2pass", "flashinfer", "flashinfer_cache", "jaxrope_torch",
               "torch_eager")
CEILING_IMPLS = ("ceiling", "ceiling_2pass", "xla_ceiling")
MAIN_IMPLS = ("jaxrope", "jaxrope_torch", "jaxrope_mosaic", "xla", "flashinfer", "flashinfer_cache",
              "torch_eager")
_JAX_BACKENDS = {"jaxrope": "pallas", "jaxrope_mosaic": "mosaic", "xla": "xla"}
VARIANT_IMPLS = ("jaxrope", "flashinfer")
WALL_IMPLS = ("jaxrope", "jaxrope_torch", "xla", "flashinfer", "torch_eager")
# Not "xla": its unrolled loop gives each application's fusions names of their own, each
# run n / unroll times like the loop counter, so profile_kernels cannot tell them apart.
KERNEL_IMPLS = ("jaxrope", "jaxrope_torch", "jaxrope_mosaic", "flashinfer", "ceiling")
PLOT_IMPLS = ("jaxrope", "jaxrope_torch", "jaxrope_mosaic", "xla", "flashinfer", "flashinfer_cache",
              "torch_eager",
              "ceiling", "ceiling_2pass", "xla_ceiling")


@dataclasses.dataclass(frozen=True)
class Shape:
    """``q [tokens, q_heads, head_dim]``, ``k [tokens, k_heads, head_dim]`` of ``dtype``."""

    tokens: int
    q_heads: int
    k_heads: int
    head_dim: int
    dtype: str

    @property
    def id(self) -> str:
        return (f"T{self.tokens}-H{self.q_heads}x{self.k_heads}-D{self.head_dim}-"
                f"{DTYPE_IDS[self.dtype]}")

    @property
    def qk_elements(self) -> int:
        return self.tokens * (self.q_heads + self.k_heads) * self.head_dim

    @property
    def qk_bytes(self) -> int:
        return self.qk_elements * jnp.dtype(self.dtype).itemsize

    @property
    def bytes(self) -> int:
        return 2 * self.qk_bytes + 4 * self.tokens


@dataclasses.dataclass(frozen=True)
class Task:
    """One measurement: an implementation on a shape, in a section of the report."""

    section: str
    impl: str
    shape: Shape
    variant: str = "plain"
    block: Optional[BlockConfig] = None
    # "loop", "wall" or "kernel" (see the module docstring); build_tasks sets it.
    method: str = "loop"

    @property
    def key(self) -> str:
        key = f"{self.section}/{self.impl}/{self.variant}/{self.shape.id}"
        return key + (f"/{block_id(self.block)}" if self.block else "")

    @property
    def cfg(self) -> RopeConfig:
        if self.variant == "plain":
            return RopeConfig(head_dim=self.shape.head_dim)
        return VARIANT_CONFIGS[self.variant]


def block_id(block: BlockConfig) -> str:
    return (f"bt{block.block_tokens}-hp{block.heads_per_program}-w{block.num_warps}"
            f"-s{block.num_stages}")


# ---------------------------------------------------------------------------------------
# Environment


@dataclasses.dataclass
class Env:
    """What this process can run, and why not the rest."""

    on_gpu: bool
    torch: Any = None
    device: Optional[str] = None
    flashinfer: Any = None
    launcher: Any = None
    l2_bytes: Optional[int] = None
    notes: List[str] = dataclasses.field(default_factory=list)
    setup_s: Dict[str, float] = dataclasses.field(default_factory=dict)

    def available(self, impl: str) -> bool:
        if impl == "jaxrope_mosaic":
            return self.on_gpu and mosaic_gpu.unavailable() is None
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
        env.notes.append("no GPU: jaxrope runs in the Pallas interpreter (backend='interpret'); "
                         "flashinfer*, jaxrope_torch and the kernel section are skipped")
    try:
        import torch
    except ImportError:
        env.notes.append("torch is not installed: ceiling, ceiling_2pass, torch_eager, "
                         "flashinfer* and jaxrope_torch are skipped; xla_ceiling is the ceiling")
        return env
    if env.on_gpu and not torch.cuda.is_available():
        env.notes.append(f"torch {torch.__version__} has no CUDA while JAX runs on the GPU: "
                         "torch implementations are skipped")
        return env
    env.torch, env.device = torch, "cuda" if env.on_gpu else "cpu"
    if not env.on_gpu:
        return env
    env.l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", H200_L2_BYTES)
    if want_flashinfer:
        start = time.perf_counter()
        try:
            import flashinfer.rope
            _warm_flashinfer(torch, flashinfer.rope)
            env.flashinfer = flashinfer.rope
        except Exception as e:  # noqa: BLE001 - any failure means: measure without it
            env.notes.append(f"flashinfer unavailable ({type(e).__name__}: {str(e)[:300]})")
        env.setup_s["flashinfer_import_and_first_calls"] = time.perf_counter() - start
    if want_launcher:
        try:
            from torch_bridge.triton_launch import TritonLauncher
            env.launcher = TritonLauncher()
        except Exception as e:  # noqa: BLE001 - the fast path is optional here
            env.notes.append(f"jaxrope_torch unavailable ({type(e).__name__}: {str(e)[:300]})")
    return env


def _warm_flashinfer(torch, fi) -> None:
    """First calls of the three APIs: FlashInfer JIT-builds its rope module here (~1 min)."""
    q = torch.randn(4, 2, 64, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(4, 1, 64, dtype=torch.bfloat16, device="cuda")
    pos = torch.arange(4, dtype=torch.int32, device="cuda")
    fi.apply_rope_pos_ids_inplace(q, k, pos)
    fi.apply_llama31_rope_pos_ids_inplace(q, k, pos)
    cache = torch.rand(16, 64, dtype=torch.float32, device="cuda")
    fi.apply_rope_with_cos_sin_cache_inplace(pos, q.view(4, -1), k.view(4, -1), 64, cache, True)
    torch.cuda.synchronize()


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _command_output(cmd: Sequence[str]) -> Optional[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=BENCH_DIR.parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def environment(env: Env) -> Dict[str, Any]:
    import jaxlib
    device = jax.devices()[0]
    info = dict(
        python=sys.version.split()[0], platform=platform.platform(), hostname=platform.node(),
        jax=jax.__version__, jaxlib=jaxlib.__version__, numpy=np.__version__,
        jax_backend=jax.default_backend(), jax_device=getattr(device, "device_kind", str(device)),
        jax_device_count=jax.device_count(),
        torch=_version("torch"), triton=_version("triton"),
        flashinfer=_version("flashinfer-python"), tvm_ffi=_version("apache-tvm-ffi"),
        git_commit=_command_output(["git", "rev-parse", "HEAD"]),
        git_dirty=bool(_command_output(["git", "status", "--porcelain", "--untracked-files=no"])),
        env_vars={name: os.environ.get(name) for name in (
            "XLA_FLAGS", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_ALLOCATOR",
            "CUDA_VISIBLE_DEVICES", "FLASHINFER_CUDA_ARCH_LIST", "JAX_PLATFORMS")},
    )
    if env.device == "cuda":
        torch = env.torch
        info.update(gpu=torch.cuda.get_device_name(0), torch_cuda=torch.version.cuda,
                    l2_bytes=env.l2_bytes)
        info["nvidia_smi"] = _command_output([
            "nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,"
            "power.draw,power.limit,temperature.gpu,memory.used,memory.total",
            "--format=csv,noheader"])
    return info


# ---------------------------------------------------------------------------------------
# Implementations


def jax_step(task: Task, on_gpu: bool) -> Callable:
    """``(q, k, pos_ids, i) -> (q, k)`` for a JAX task; ``i`` is the loop index or None."""
    cfg = task.cfg
    if task.impl == "xla":
        # XLA would hoist the cos/sin of loop-invariant positions out of the loop; positions
        # that change with the iteration keep that work in the timed body (the xor fuses
        # into it). Nothing can be hoisted out of the Pallas custom call, and an xor in
        # front of it would be a launch of its own, so the Pallas step takes pos_ids as is.
        return lambda q, k, pos, i: apply_rope(q, k, pos if i is None else pos ^ (i & 1), cfg,
                                               backend="xla")
    if task.block is None:
        # Off a GPU the Pallas kernel body runs in its interpreter (jaxrope_mosaic is
        # GPU-only: Env.available).
        backend = _JAX_BACKENDS[task.impl] if on_gpu else "interpret"
        return lambda q, k, pos, i: apply_rope(q, k, pos, cfg, backend=backend)
    tables, attention = kernel_constants(cfg)
    return lambda q, k, pos, i: rope_pallas(
        q, k, pos, jnp.asarray(tables), rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
        attention_factor=attention, interpret=not on_gpu, config=task.block)


@dataclasses.dataclass
class CompiledLoop:
    fn: Any
    n: int
    compile_s: float
    hlo_copies: int


def compile_loop(task: Task, n: int, on_gpu: bool, unroll: int) -> CompiledLoop:
    """A jitted ``fori_loop`` of ``n`` applications on donated buffers, compiled once.

    The body is unrolled ``unroll`` times so the loop counter's own launch is amortised;
    ``optimization_barrier`` keeps XLA from fusing consecutive applications into one.
    """
    shape = task.shape
    dtype = jnp.dtype(shape.dtype)
    unroll = min(unroll, n)
    sds = jax.ShapeDtypeStruct
    if task.impl == "xla_ceiling":
        def loop(buf, scale):
            body = lambda i, b: jax.lax.optimization_barrier(b * scale)  # noqa: E731
            return (jax.lax.fori_loop(0, n, body, buf, unroll=unroll),)
        specs, donate = (sds((shape.qk_elements,), dtype), sds((), dtype)), (0,)
    else:
        step = jax_step(task, on_gpu)

        def loop(q, k, pos):
            body = lambda i, c: jax.lax.optimization_barrier(step(*c, pos, i))  # noqa: E731
            return jax.lax.fori_loop(0, n, body, (q, k), unroll=unroll)
        specs = (sds((shape.tokens, shape.q_heads, shape.head_dim), dtype),
                 sds((shape.tokens, shape.k_heads, shape.head_dim), dtype),
                 sds((shape.tokens,), jnp.int32))
        donate = (0, 1)
    start = time.perf_counter()
    fn = jax.jit(loop, donate_argnums=donate).lower(*specs).compile()
    return CompiledLoop(fn, n, time.perf_counter() - start, fn.as_text().count(" copy("))


def _hf_rope(torch, q, k, pos, cfg: RopeConfig) -> Callable[[], Any]:
    """HF's formula: cos/sin of ``cat(freqs, freqs)`` in float32, ``x*cos + rotate_half(x)*sin``."""
    inv_freq = torch.tensor(cfg.serving_frequencies()[0], dtype=torch.float32, device=q.device)
    half = cfg.head_dim // 2

    def rotate_half(x):
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def run():
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return run


@functools.lru_cache(maxsize=16)
def _cos_sin_cache(cfg: RopeConfig, device: str):
    """FlashInfer/vLLM cache ``[POSITION_RANGE, rotary_dim]`` float32: cos then sin, from float64."""
    import torch
    inv_freq, attention = cfg.serving_frequencies()
    angle = np.arange(POSITION_RANGE, dtype=np.float64)[:, None] * inv_freq[None, :]
    table = np.concatenate([np.cos(angle), np.sin(angle)], axis=1) * attention
    return torch.from_numpy(table.astype(np.float32)).to(device)


def _flashinfer_fn(fi, cfg: RopeConfig, q, k, pos, use_cache: bool) -> Tuple[Callable, str]:
    tokens, _, head_dim = q.shape
    if use_cache or (cfg.scaling is not None and not isinstance(cfg.scaling, Llama3)):
        cache = _cos_sin_cache(cfg, str(q.device))
        q2, k2 = q.view(tokens, -1), k.view(tokens, -1)
        return (lambda: fi.apply_rope_with_cos_sin_cache_inplace(
            pos, q2, k2, head_dim, cache, not cfg.interleave)), "apply_rope_with_cos_sin_cache_inplace"
    if isinstance(cfg.scaling, Llama3):
        s = cfg.scaling
        return (lambda: fi.apply_llama31_rope_pos_ids_inplace(
            q, k, pos, rotary_dim=cfg.rotary_dim, interleave=cfg.interleave, rope_scale=s.factor,
            rope_theta=cfg.theta, low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor, old_context_len=s.original_max_position)
                ), "apply_llama31_rope_pos_ids_inplace"
    return (lambda: fi.apply_rope_pos_ids_inplace(
        q, k, pos, rotary_dim=cfg.rotary_dim, interleave=cfg.interleave, rope_theta=cfg.theta)
            ), "apply_rope_pos_ids_inplace"


def torch_fn(task: Task, env: Env, inputs: "Inputs") -> Tuple[Callable[[], Any], Optional[str]]:
    """The torch callable of ``task`` on fresh copies of the inputs, and the API it calls."""
    torch = env.torch
    q, k, pos = inputs.torch_copies(torch)
    cfg = task.cfg
    if task.impl == "ceiling":
        buf = torch.cat([q.reshape(-1), k.reshape(-1)])
        del q, k
        return (lambda: buf.mul_(1.0)), "torch mul_ on one buffer"
    if task.impl == "ceiling_2pass":
        return (lambda: (q.mul_(1.0), k.mul_(1.0))), "torch mul_ on q, then on k"
    if task.impl == "torch_eager":
        return _hf_rope(torch, q, k, pos, cfg), "HF rotate_half, out of place"
    if task.impl == "jaxrope_torch":
        launcher = env.launcher
        return (lambda: launcher.rotate_(q, k, pos, cfg)), "torch_bridge.triton_launch"
    return _flashinfer_fn(env.flashinfer, cfg, q, k, pos, task.impl == "flashinfer_cache")


# ---------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Inputs:
    """The random inputs of one shape, as JAX arrays; every task copies them."""

    q: Any
    k: Any
    pos: Any

    @classmethod
    def draw(cls, shape: Shape, seed: int) -> "Inputs":
        kq, kk, kp = jax.random.split(jax.random.key(seed), 3)
        dtype = jnp.dtype(shape.dtype)
        q = jax.random.normal(kq, (shape.tokens, shape.q_heads, shape.head_dim), dtype)
        k = jax.random.normal(kk, (shape.tokens, shape.k_heads, shape.head_dim), dtype)
        pos = jax.random.randint(kp, (shape.tokens,), 0, POSITION_RANGE, jnp.int32)
        return cls(*jax.block_until_ready((q, k, pos)))

    def jax_copies(self):
        return jnp.copy(self.q), jnp.copy(self.k)

    def torch_copies(self, torch):
        return tuple(torch.from_dlpack(x).clone() for x in (self.q, self.k, self.pos))


def _iterations(estimate_s: float, plan: Plan, cap: int, fixed: Optional[int]) -> int:
    if fixed:
        return fixed
    return max(1, min(cap, plan.max_iters, round(plan.rep_seconds / max(estimate_s, 1e-9))))


def _growth_cap(task: Task, plan: Plan) -> int:
    """The most applications per repeat that keep in-place values finite (see GROWTH_LIMIT)."""
    if task.impl not in ("jaxrope", "flashinfer", "jaxrope_torch"):
        return plan.max_iters
    attention = kernel_constants(task.cfg)[1]
    if abs(math.log(attention)) < 1e-12:
        return plan.max_iters
    # Every repeat, the warm-up and the calibration calls apply to the same buffers; a JAX
    # repeat runs its loop JaxLoop.CALLS_PER_RUN times.
    per_run = JaxLoop.CALLS_PER_RUN if task.impl in JAX_IMPLS else 1
    cap = int(math.log(GROWTH_LIMIT) / abs(math.log(attention))) // ((plan.reps + 3) * per_run)
    if cap < 1:
        raise ValueError(f"{plan.reps} repeats of {task.variant} (attention factor {attention:.4f}) "
                         f"would scale q and k past {GROWTH_LIMIT:g}: use fewer --reps")
    return cap


class JaxLoop:
    """Runs a compiled loop on its own donated copies of the inputs.

    A call's wall time includes a fixed cost, dispatch and the final sync (~0.6 ms on the
    H200 host), which a 10 ms repeat does not amortise: it made 320 us kernels read as
    344 us. So a repeat times one call and three chained calls, and keeps the difference:
    the device time of ``n`` applications back to back, as a CUDA graph replay gives it.
    Three calls against one, rather than two, halve the host's jitter in the result.
    """

    how = "jax fori_loop, (wall time of 3 chained calls - 1 call) / 2: dispatch and sync cancel"
    CALLS_PER_RUN = 4

    def __init__(self, compiled: CompiledLoop, task: Task, inputs: Inputs):
        self.compiled, self.n = compiled, compiled.n
        if task.impl == "xla_ceiling":
            self.state = (jnp.concatenate([inputs.q.reshape(-1), inputs.k.reshape(-1)]),)
            self.extra = (jnp.asarray(1.0, inputs.q.dtype),)
        else:
            self.state, self.extra = inputs.jax_copies(), (inputs.pos,)
        self.fallbacks = 0

    @property
    def applications_per_run(self) -> int:
        return self.CALLS_PER_RUN * self.n

    def _calls(self, count: int) -> float:
        """Wall seconds of ``count`` chained calls, the final sync included."""
        start = time.perf_counter()
        for _ in range(count):
            self.state = self.compiled.fn(*self.state, *self.extra)
        jax.block_until_ready(self.state)
        return time.perf_counter() - start

    def run(self) -> float:
        """Seconds for ``n`` applications.

        Where the loop is too short for the difference to stand out of the host's jitter
        (under a quarter of a call's wall time; tiny CPU loops), it falls back to the wall
        time of a call, fixed cost included, and ``how`` says so.
        """
        once = self._calls(1)
        three = self._calls(3)
        per_call = (three - once) / 2
        if per_call < three / 3 / 4:
            self.fallbacks += 1
            self.how = (f"{JaxLoop.how}; {self.fallbacks} repeat(s) too short for that: "
                        "wall time of a call")
            return three / 3
        return per_call


class TorchLoop:
    """``n`` calls of ``fn`` back to back: a CUDA graph on a GPU, a host loop on CPU."""

    def __init__(self, env: Env, fn: Callable[[], Any], plan: Plan, cap: int,
                 fixed: Optional[int]):
        torch = self.torch = env.torch
        self.fn, self.cuda = fn, env.device == "cuda"
        fn()  # first call: FlashInfer or Triton compile here, outside any timing
        self._sync()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        self._sync()
        self.n = _iterations((time.perf_counter() - start) / 3, plan, cap, fixed)
        self.graph = None
        self.how = "host loop, wall time" if not self.cuda else "cuda graph replay, cuda events"
        if not self.cuda:
            return
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: JAX compiles on other threads meanwhile and may call CUDA.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(self.n):
                    fn()
            self.graph = graph
        except Exception as e:  # noqa: BLE001 - fall back to eager launches, say so
            torch.cuda.synchronize()
            self.how = f"cuda events around eager calls (graph capture failed: {str(e)[:120]})"

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    @property
    def applications_per_run(self) -> int:
        return self.n

    def run(self) -> float:
        if not self.cuda:
            start = time.perf_counter()
            for _ in range(self.n):
                self.fn()
            return time.perf_counter() - start
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        start.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            for _ in range(self.n):
                self.fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def time_wall(call: Callable[[], None], sync: Callable[[], None], plan: Plan,
              fixed: Optional[int]) -> Tuple[List[float], int]:
    """Per-call wall time (us) of ``call`` issued M times from Python, then one sync."""
    call()
    sync()
    start = time.perf_counter()
    for _ in range(5):
        call()
    sync()
    m = fixed or max(5, min(plan.max_iters, round(plan.rep_seconds * 5 / (time.perf_counter() - start))))
    times = []
    for _ in range(plan.reps):
        start = time.perf_counter()
        for _ in range(m):
            call()
        sync()
        times.append((time.perf_counter() - start) / m * 1e6)
    return times, m


_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code",
                  "Framework Ops", "Framework Name Scope", "XLA TraceMe")


def profile_kernels(run: Callable[[], None],
                    applications: int) -> Tuple[float, Dict[str, list], List[str]]:
    """Kernel time per application (us) from a JAX profiler trace of ``run``.

    Counts the kernels that ran at least once per application (so a loop counter's
    launch, once per unrolled body, and copies are left out) on the GPU's stream lines.
    Torch's kernels are recorded too: CUPTI sees every kernel of the process. Also
    returns every kernel's ``[count, total ns]`` and the names of the lines read.
    """
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            raise RuntimeError("the profiler wrote no trace")
        data = jax.profiler.ProfileData.from_file(paths[0])
    kernels: Dict[str, list] = {}
    read: List[str] = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or [line for line in lines if line.name not in _DERIVED_LINES]:
            read.append(f"{plane.name} {line.name}")
            for event in line.events:
                lowered = event.name.lower()
                if "memcpy" in lowered or "memset" in lowered:
                    continue
                entry = kernels.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.duration_ns
    per_application = [total for count, total in kernels.values() if count >= applications]
    if not per_application:
        raise RuntimeError(f"no kernel ran {applications} times in the trace; "
                           f"saw {sorted(kernels)[:8]}")
    return sum(per_application) / applications / 1e3, kernels, read


# ---------------------------------------------------------------------------------------
# Planning and running


def build_tasks(plan: Plan, dtype: str, sweep_blocks: bool, filters: Sequence[str],
                env: Env) -> List[Task]:
    """Every task of the run, targets first (a time budget cut spares them), then ceilings.

    ``filters``: a task runs when every term is a substring of its key; the ceilings of
    the shapes that remain are always measured (they size loops and give ``%ceil``).
    """
    hq, hk = plan.target_heads

    def target(tokens: int) -> Shape:
        return Shape(tokens, hq, hk, plan.target_head_dim, dtype)

    tasks: List[Task] = []
    if sweep_blocks:
        for tokens, grid in plan.block_sweep:
            shape = target(tokens)
            tasks += [Task("blocks", "jaxrope", shape), Task("blocks", "flashinfer", shape)]
            tasks += [Task("blocks", "jaxrope", shape, block=b)
                      for b in grid.configs(tokens, hq, hk, plan.target_head_dim)]
    else:
        if env.on_gpu:
            tasks += [Task("kernel", impl, target(tokens), method="kernel")
                      for tokens in plan.kernel_tokens for impl in KERNEL_IMPLS]
        # Variants compare kernel durations where there is a profiler: a variant with an
        # attention factor scales q and k at every application, so its loops are capped
        # at a few applications (GROWTH_LIMIT), too few for a wall-clock loop to resolve
        # 5% (yarn's 16-application repeats spread 70-96 us around plain's 81).
        variant_method = "kernel" if env.on_gpu else "loop"
        tasks += [Task("variants", impl, target(tokens), variant=name, method=variant_method)
                  for tokens in plan.target_tokens for name, cfg in VARIANTS
                  if cfg.head_dim == plan.target_head_dim for impl in VARIANT_IMPLS]
        tasks += [Task("wall", impl, target(tokens), method="wall")
                  for tokens in plan.wall_tokens for impl in WALL_IMPLS]
        tasks += [Task("main", impl, Shape(tokens, q_heads, k_heads, head_dim, dtype))
                  for q_heads, k_heads in plan.heads for head_dim in plan.head_dims
                  for tokens in plan.tokens for impl in MAIN_IMPLS
                  # The torch launch compiles per launch shape, and the Mosaic GPU kernel is
                  # there to be measured against the Triton one: the target layout is enough.
                  if impl not in ("jaxrope_torch", "jaxrope_mosaic")
                  or (q_heads, k_heads, head_dim) == (
                      hq, hk, plan.target_head_dim)]
    tasks = [t for t in tasks if env.available(t.impl) and all(f in t.key for f in filters)]
    shapes = list(dict.fromkeys(t.shape for t in tasks))
    tasks += [Task("ceiling", impl, shape) for shape in shapes for impl in CEILING_IMPLS
              if env.available(impl)]
    return tasks


class Progress:
    """A one-line progress bar on stderr, no dependency; silent unless enabled."""

    def __init__(self, total: int, enabled: bool, stream=sys.stderr):
        self.total, self.enabled, self.stream = total, enabled, stream
        self.done = 0
        self.start = time.perf_counter()

    def show(self, label: str) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        frac = self.done / max(1, self.total)
        eta = f"{elapsed / frac * (1 - frac):4.0f}s" if self.done else "  --"
        filled = int(20 * frac)
        text = (f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total} "
                f"{elapsed:4.0f}s, eta {eta}  {label}")
        width = shutil.get_terminal_size((120, 20)).columns - 1
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()

    def advance(self, label: str = "") -> None:
        self.done += 1
        self.show(label)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


@dataclasses.dataclass
class Runner:
    plan: Plan
    env: Env
    args: argparse.Namespace
    report: Dict[str, Any]
    progress: Progress
    out_dir: Path
    started: float
    pool: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def run(self, tasks: List[Task]) -> None:
        groups: Dict[Shape, List[Task]] = {}
        for task in tasks:
            groups.setdefault(task.shape, []).append(task)
        for index, (shape, group) in enumerate(groups.items()):
            if self.args.budget_s and time.time() - self.started > self.args.budget_s:
                for task in group:
                    self._record(task, error=f"skipped: time budget of {self.args.budget_s} s spent")
                continue
            try:
                self._run_group(shape, group, self.args.seed + index)
            except Exception as e:  # noqa: BLE001 - e.g. no memory for the inputs: next shape
                done = {r["key"] for r in self.report["results"]}
                for task in group:
                    if task.key not in done:
                        self._record(task, error=f"{type(e).__name__}: {str(e)[:400]}")
            gc.collect()
            if self.env.device == "cuda":
                self.env.torch.cuda.empty_cache()
            write_json(self.report, self.out_dir)

    def _run_group(self, shape: Shape, group: List[Task], seed: int) -> None:
        inputs = Inputs.draw(shape, seed)
        ceiling_s: List[float] = []
        compiled: Dict[Tuple, concurrent.futures.Future] = {}
        is_torch = lambda t: t.impl in TORCH_IMPLS  # noqa: E731
        # 1. Every torch loop timed with CUDA events, the ceiling (it sizes the JAX loops)
        #    and jaxrope_torch (its Triton export patches JAX's Pallas lowering while it
        #    runs) first, before any JAX compile starts: a compile running meanwhile held
        #    the GPU for ~10 ms at a time (2026-11-30: FlashInfer's 2 us call read 10 ms).
        first = sorted((t for t in group if is_torch(t) and t.method == "loop"),
                       key=lambda t: t.impl not in ("ceiling", "jaxrope_torch"))
        for task in first:
            result = self._measure(task, inputs, compiled)
            if task.impl == "ceiling" and result.get("median_us"):
                ceiling_s.append(result["median_us"] / 1e6)
        # 2. Every JAX loop of the group compiled in the background; 3. the rest, timed on
        #    the host once no compile competes for the CPU.
        estimate = ceiling_s[0] if ceiling_s else _model_seconds(shape, self.env.on_gpu)
        def build(task: Task) -> CompiledLoop:
            # In the background too: a growth cap that refuses the repeats fails this task only.
            n = _iterations(estimate, self.plan, _growth_cap(task, self.plan), self.args.iters)
            if self.args.iters is None and n > self.args.unroll:
                n -= n % self.args.unroll
            return compile_loop(task, n, self.env.on_gpu, self.args.unroll)

        for task in group:
            key = (task.impl, task.variant, task.block)
            if task.impl in JAX_IMPLS and task.method != "wall" and key not in compiled:
                compiled[key] = self._submit(functools.partial(build, task))
        concurrent.futures.wait(list(compiled.values()))
        for task in [t for t in group if t not in first]:
            self._measure(task, inputs, compiled)

    def _submit(self, fn: Callable[[], CompiledLoop]) -> concurrent.futures.Future:
        if self.pool is not None:
            return self.pool.submit(fn)
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn())
        except Exception as e:  # noqa: BLE001 - delivered to the task that needs it
            future.set_exception(e)
        return future

    def _measure(self, task: Task, inputs: Inputs, compiled: Dict) -> Dict[str, Any]:
        self.progress.show(task.key)
        try:
            fields = self._time(task, inputs, compiled)
            result = self._record(task, **fields)
        except Exception as e:  # noqa: BLE001 - one failed task must not end the run
            result = self._record(task, error=f"{type(e).__name__}: {str(e)[:400]}")
        self.progress.advance(task.key)
        return result

    def _time(self, task: Task, inputs: Inputs, compiled: Dict) -> Dict[str, Any]:
        plan, env, fixed = self.plan, self.env, self.args.iters
        if task.method == "wall":
            return self._time_wall(task, inputs)
        if task.impl in JAX_IMPLS:
            loop_compiled = compiled[(task.impl, task.variant, task.block)].result()
            loop: Any = JaxLoop(loop_compiled, task, inputs)
            extra = dict(compile_s=loop_compiled.compile_s, hlo_copies=loop_compiled.hlo_copies,
                         api=f"apply_rope backend={_JAX_BACKENDS[task.impl]}"
                         if task.impl != "xla_ceiling" else "jitted x * s")
        else:
            fn, api = torch_fn(task, env, inputs)
            loop = TorchLoop(env, fn, plan, _growth_cap(task, plan), fixed)
            extra = dict(api=api)
        loop.run()
        if task.method == "kernel":
            kernel_us, kernels, lines = profile_kernels(
                lambda: [loop.run() for _ in range(plan.reps)], loop.applications_per_run * plan.reps)
            top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:6]
            return dict(reps_us=[kernel_us], iters=loop.applications_per_run * plan.reps,
                        how="jax profiler (CUPTI)",
                        kernels={name: dict(count=c, total_us=t / 1e3) for name, (c, t) in top},
                        profile_lines=lines, **extra)
        times = [loop.run() / loop.n * 1e6 for _ in range(plan.reps)]
        return dict(reps_us=times, iters=loop.n, how=loop.how, **extra)

    def _time_wall(self, task: Task, inputs: Inputs) -> Dict[str, Any]:
        fixed = self.args.iters
        if task.impl in JAX_IMPLS:
            step = jax_step(task, self.env.on_gpu)
            fn = jax.jit(lambda q, k, pos: step(q, k, pos, None), donate_argnums=(0, 1))
            state = list(inputs.jax_copies())

            def call():
                state[:] = fn(state[0], state[1], inputs.pos)
            times, m = time_wall(call, lambda: jax.block_until_ready(state), self.plan, fixed)
            return dict(reps_us=times, iters=m, how="jitted call per token batch, donated")
        fn, api = torch_fn(task, self.env, inputs)
        sync = self.env.torch.cuda.synchronize if self.env.device == "cuda" else (lambda: None)
        times, m = time_wall(fn, sync, self.plan, fixed)
        return dict(reps_us=times, iters=m, how="eager call", api=api)

    def _record(self, task: Task, **fields) -> Dict[str, Any]:
        shape, cfg = task.shape, task.cfg
        result = dict(key=task.key, section=task.section, impl=task.impl, variant=task.variant,
                      shape=shape.id, tokens=shape.tokens, q_heads=shape.q_heads,
                      k_heads=shape.k_heads, head_dim=shape.head_dim, dtype=shape.dtype,
                      rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
                      scaling=type(cfg.scaling).__name__ if cfg.scaling else None,
                      method=task.method, bytes=shape.bytes,
                      block=block_id(task.block) if task.block else None,
                      l2_resident=bool(self.env.l2_bytes and shape.qk_bytes <= self.env.l2_bytes))
        result.update(fields)
        times = result.get("reps_us")
        if times:
            result["median_us"] = statistics.median(times)
            result["tbps"] = shape.bytes / (result["median_us"] * 1e-6) / 1e12
        self.report["results"].append(result)
        return result


def _model_seconds(shape: Shape, on_gpu: bool) -> float:
    """A rough time per application when no ceiling was measured: sizes loops only."""
    launch, bandwidth = (2e-6, 3.5e12) if on_gpu else (2e-5, 2e9)
    return launch + shape.bytes / bandwidth


# ---------------------------------------------------------------------------------------
# Derived numbers, targets and reports


def _ok(result: Dict[str, Any]) -> bool:
    return (result.get("median_us") or 0) > 0 and not result.get("error")


def derive(report: Dict[str, Any]) -> None:
    """Adds ``%ceil``, ``t/FI`` and ``vs plain`` to every result, and the target rows."""
    results = [r for r in report["results"] if _ok(r)]
    by = {(r["section"], r["impl"], r["variant"], r["shape"], r.get("block")): r for r in results}
    for r in report["results"]:
        if not _ok(r):
            continue
        if r["method"] == "wall":
            ceilings = {}
        elif r["method"] == "kernel":
            # The kernel section's ceiling, also for variants timed by the profiler.
            ceilings = {"ceiling": by.get(("kernel", "ceiling", "plain", r["shape"], None))}
        else:
            ceilings = {impl: by.get(("ceiling", impl, "plain", r["shape"], None))
                        for impl in CEILING_IMPLS}
        fractions = {impl: r["tbps"] / c["tbps"] for impl, c in ceilings.items() if c}
        r["ceiling_fractions"] = fractions
        primary = next((impl for impl in ("ceiling", "xla_ceiling") if impl in fractions), None)
        r["ceiling_fraction"] = fractions.get(primary)
        r["ceiling_impl"] = primary
        fi = by.get((r["section"], "flashinfer", r["variant"], r["shape"], None))
        r["ratio_flashinfer"] = r["median_us"] / fi["median_us"] if fi else None
        plain = by.get((r["section"], r["impl"], "plain", r["shape"], r.get("block")))
        r["ratio_plain"] = (r["median_us"] / plain["median_us"]
                            if plain and r["section"] == "variants" else None)
    report["targets"] = targets(report, by)


def _kernel_tokens(plan: Dict[str, Any]) -> Tuple[int, ...]:
    # Reports written before 2026-11-30 (read back with --from-json) hold one token count.
    tokens = plan["kernel_tokens"]
    return (tokens,) if isinstance(tokens, int) else tuple(tokens)


def targets(report: Dict[str, Any], by: Dict[Tuple, Dict]) -> List[Dict[str, Any]]:
    plan = report["plan"]
    hq, hk = plan["target_heads"]
    dtype_id = DTYPE_IDS[plan["dtype"]]

    def sid(tokens):
        return f"T{tokens}-H{hq}x{hk}-D{plan['target_head_dim']}-{dtype_id}"

    rows = []
    for tokens in plan["target_tokens"]:
        r = by.get(("main", "jaxrope", "plain", sid(tokens), None))
        if not r or r.get("ceiling_fraction") is None:
            continue
        fractions = r["ceiling_fractions"]
        detail = (f"{r['median_us']:.1f} us, {_tbps(r['tbps'])} TB/s; of ceilings: "
                  + ", ".join(f"{impl} {100 * f:.1f}%" for impl, f in fractions.items()))
        if r.get("ratio_flashinfer"):
            detail += f"; time / FlashInfer {r['ratio_flashinfer']:.3f}"
        rows.append(dict(target="fraction of the in-place elementwise ceiling", case=sid(tokens),
                         value=r["ceiling_fraction"], goal=">= 0.95",
                         met=r["ceiling_fraction"] >= 0.95, detail=detail))
    for tokens in plan["target_tokens"]:
        for name, _ in VARIANTS[1:]:
            r = by.get(("variants", "jaxrope", name, sid(tokens), None))
            if not r or r.get("ratio_plain") is None:
                continue
            detail = f"{r['median_us']:.1f} us ({_tbps(r['tbps'])} TB/s)"
            if r.get("ratio_flashinfer"):
                detail += f"; time / FlashInfer equivalent {r['ratio_flashinfer']:.3f}"
            rows.append(dict(target=f"{name} vs plain kernel (time ratio)", case=sid(tokens),
                             value=r["ratio_plain"], goal="<= 1.05", met=r["ratio_plain"] <= 1.05,
                             detail=detail))
    for tokens in _kernel_tokens(plan):
        kernel_shape = sid(tokens)
        fi = by.get(("kernel", "flashinfer", "plain", kernel_shape, None))
        for impl in ("jaxrope", "jaxrope_torch", "jaxrope_mosaic"):
            mine = by.get(("kernel", impl, "plain", kernel_shape, None))
            if not mine:
                continue
            if tokens in plan["target_tokens"] and mine.get("ceiling_fraction") is not None:
                # The same 95% target on kernel durations alone: what the loop adds between
                # applications (XLA's while loop, a CUDA graph's node launches) left out.
                rows.append(dict(target=f"{impl} kernel time: fraction of the ceiling kernel's",
                                 case=kernel_shape, value=mine["ceiling_fraction"], goal=">= 0.95",
                                 met=mine["ceiling_fraction"] >= 0.95,
                                 detail=f"kernel {mine['median_us']:.2f} us (profiler)"))
            if not fi:
                continue
            loop_mine = by.get(("main", impl, "plain", kernel_shape, None))
            loop_fi = by.get(("main", "flashinfer", "plain", kernel_shape, None))
            detail = f"kernel {mine['median_us']:.2f} us vs FlashInfer {fi['median_us']:.2f} us"
            if loop_mine and loop_fi:
                detail += (f"; back to back (loop / CUDA graph) {loop_mine['median_us']:.2f} vs "
                           f"{loop_fi['median_us']:.2f} us")
            rows.append(dict(target=f"{impl} kernel time vs FlashInfer (time ratio)",
                             case=kernel_shape, value=mine["median_us"] / fi["median_us"],
                             goal="report (<= 1 is parity)", met=None, detail=detail))
    for tokens, _ in plan["block_sweep"] if plan["sweep_blocks"] else ():
        heuristic = by.get(("blocks", "jaxrope", "plain", sid(tokens), None))
        swept = [r for key, r in by.items() if key[0] == "blocks" and key[3] == sid(tokens) and key[4]]
        if not heuristic or not swept:
            continue
        best = min(swept, key=lambda r: r["median_us"])
        detail = f"best {best['block']}: {best['median_us']:.2f} us vs {heuristic['median_us']:.2f} us"
        if best.get("ratio_flashinfer"):
            detail += f"; time / FlashInfer {best['ratio_flashinfer']:.3f}"
        rows.append(dict(target="best swept BlockConfig vs the heuristic (time ratio)",
                         case=sid(tokens), value=best["median_us"] / heuristic["median_us"],
                         goal="report (< 1: the heuristic leaves time)", met=None, detail=detail))
    return rows


def _us(x: Optional[float]) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _tbps(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ratio(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool) -> List[str]:
    cells = [[str(c) for c in row] for row in rows]
    if markdown:
        cells = [[c.replace("|", "/").replace("\n", " ") for c in row] for row in cells]
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return lines + ["| " + " | ".join(row) + " |" for row in cells]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    fmt = lambda row: "  ".join(c.rjust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(row) for row in cells]


def _note(r: Dict[str, Any]) -> str:
    parts = []
    if r.get("error"):
        parts.append(r["error"][:160])
    if r.get("l2_resident"):
        parts.append("L2")
    if r.get("block"):
        parts.append(r["block"])
    if r["impl"].startswith("flashinfer") and r.get("api"):
        parts.append(r["api"])
    if r.get("how", "").startswith("cuda events around"):
        parts.append("no graph")
    return "; ".join(parts)


def long_rows(report: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    headers = ["section", "impl", "variant", "case", "method", "median us", "TB/s", "%ceil",
               "t/FI", "note"]
    rows = [[r["section"], r["impl"], r["variant"], r["shape"], r["method"], _us(r.get("median_us")),
             _tbps(r.get("tbps")), _pct(r.get("ceiling_fraction")), _ratio(r.get("ratio_flashinfer")),
             _note(r)] for r in report["results"]]
    return headers, rows


def _target_shape_results(report: Dict[str, Any], section: str) -> List[Dict[str, Any]]:
    plan = report["plan"]
    hq, hk = plan["target_heads"]
    return [r for r in report["results"] if r["section"] == section and r["q_heads"] == hq
            and r["k_heads"] == hk and r["head_dim"] == plan["target_head_dim"]
            and r["dtype"] == plan["dtype"] and _ok(r)]


def pivot_rows(report: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    """Target heads and head_dim, one row per token count: ``us (TB/s)`` per implementation."""
    found = _target_shape_results(report, "main") + _target_shape_results(report, "ceiling")
    impls = [i for i in PLOT_IMPLS if any(r["impl"] == i for r in found)]
    cell = {(r["tokens"], r["impl"]): r for r in found}
    headers = ["tokens"] + impls + ["jaxrope %ceil", "jaxrope t/FI"]
    rows = []
    for tokens in sorted({r["tokens"] for r in found}):
        row = [tokens]
        for impl in impls:
            r = cell.get((tokens, impl))
            row.append(f"{_us(r['median_us'])} ({_tbps(r['tbps'])})" if r else "-")
        jr = cell.get((tokens, "jaxrope"), {})
        rows.append(row + [_pct(jr.get("ceiling_fraction")), _ratio(jr.get("ratio_flashinfer"))])
    return headers, rows


def variant_rows(report: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    found = _target_shape_results(report, "variants")
    fi = {(r["variant"], r["tokens"]): r for r in found if r["impl"] == "flashinfer"}
    headers = ["variant", "tokens", "jaxrope us", "TB/s", "%ceil", "vs plain", "FlashInfer API",
               "FI us", "t/FI"]
    rows = []
    for r in (r for r in found if r["impl"] == "jaxrope"):
        f = fi.get((r["variant"], r["tokens"]), {})
        rows.append([r["variant"], r["tokens"], _us(r["median_us"]), _tbps(r["tbps"]),
                     _pct(r.get("ceiling_fraction")), _ratio(r.get("ratio_plain")),
                     f.get("api", "-"), _us(f.get("median_us")), _ratio(r.get("ratio_flashinfer"))])
    return headers, rows


def kernel_rows(report: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    found = _target_shape_results(report, "kernel")
    loops = {(r["impl"], r["tokens"]): r for r in _target_shape_results(report, "main")}
    loops.update({(r["impl"], r["tokens"]): r for r in _target_shape_results(report, "ceiling")})
    headers = ["impl", "tokens", "kernel us (profiler)", "back-to-back us (loop)", "t/FI (kernel)",
               "kernels"]
    rows = [[r["impl"], r["tokens"], _us(r["median_us"]),
             _us(loops.get((r["impl"], r["tokens"]), {}).get("median_us")),
             _ratio(r.get("ratio_flashinfer")),
             ", ".join(f"{name[:40]} x{v['count']}" for name, v in list(r.get("kernels", {}).items())[:3])]
            for r in found]
    return headers, rows


def wall_rows(report: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    found = _target_shape_results(report, "wall")
    impls = [i for i in WALL_IMPLS if any(r["impl"] == i for r in found)]
    cell = {(r["tokens"], r["impl"]): r for r in found}
    rows = [[tokens] + [_us(cell.get((tokens, impl), {}).get("median_us")) for impl in impls]
            for tokens in sorted({r["tokens"] for r in found})]
    return ["tokens"] + [f"{impl} us/call" for impl in impls], rows


def block_rows(report: Dict[str, Any], top: int = 8) -> Tuple[List[str], List[List[Any]]]:
    found = _target_shape_results(report, "blocks")
    headers = ["tokens", "config", "median us", "TB/s", "%ceil", "t/FI"]
    rows = []
    for tokens in sorted({r["tokens"] for r in found}):
        here = [r for r in found if r["tokens"] == tokens]
        swept = sorted((r for r in here if r.get("block")), key=lambda r: r["median_us"])
        fixed = [r for r in here if not r.get("block")]
        for r in fixed + swept[:top]:
            label = r["block"] or ("heuristic" if r["impl"] == "jaxrope" else r["impl"])
            rows.append([tokens, label, _us(r["median_us"]), _tbps(r["tbps"]),
                         _pct(r.get("ceiling_fraction")), _ratio(r.get("ratio_flashinfer"))])
    return headers, rows


def target_rows(report: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    headers = ["target", "case", "value", "goal", "met", "detail"]
    rows = [[t["target"], t["case"], f"{t['value']:.3f}", t["goal"],
             {True: "yes", False: "NO", None: "-"}[t["met"]], t["detail"]]
            for t in report.get("targets", [])]
    return headers, rows


def _sections(report: Dict[str, Any]) -> List[Tuple[str, Tuple[List[str], List[List[Any]]]]]:
    plan = report["plan"]
    hq, hk = plan["target_heads"]
    shape = f"Hq={hq} Hk={hk} D={plan['target_head_dim']} {plan['dtype']}"
    return [
        (f"Median us (TB/s) at {shape}, loop method", pivot_rows(report)),
        (f"Variants at {shape}: jaxrope vs its plain kernel and FlashInfer's equivalent "
         "(kernel time from the profiler on a GPU)",
         variant_rows(report)),
        (f"Kernel time (profiler) at {', '.join(map(str, _kernel_tokens(plan)))} tokens, {shape}",
         kernel_rows(report)),
        (f"Wall time per call from Python (dispatch included), {shape}", wall_rows(report)),
        (f"Block sweep at {shape} (heuristic, FlashInfer, then the best configs)",
         block_rows(report)),
        ("Targets", target_rows(report)),
    ]


def render_text(report: Dict[str, Any], full: bool) -> str:
    lines = []
    if full:
        headers, rows = long_rows(report)
        lines += ["All measurements"] + _table(headers, rows, False) + [""]
    for title, (headers, rows) in _sections(report):
        if rows:
            lines += [title] + _table(headers, rows, False) + [""]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def render_markdown(report: Dict[str, Any]) -> str:
    env = report["env"]
    device = env.get("gpu") or env.get("jax_device")
    versions = ", ".join(f"{name} {env.get(name)}" for name in (
        "python", "jax", "jaxlib", "torch", "triton", "flashinfer") if env.get(name))
    git = env.get("git_commit")
    lines = [f"<!-- rope_bench:begin {report['run_id']} -->",
             f"## {report['date']} · {device} · {'quick' if report['plan']['quick'] else 'full'}",
             "", f"Command: `{report['command']}`  ",
             f"Versions: {versions}" + (f"; git {git[:12]}{' (dirty)' if env.get('git_dirty') else ''}"
                                        if git else "") + "  ",
             f"Run time {report.get('elapsed_s', 0):.0f} s; {len(report['results'])} measurements. "
             "Loop method: JAX `fori_loop` / torch CUDA-graph replay, median of "
             f"{report['plan']['reps']} repeats of ~{1e3 * report['plan']['rep_seconds']:.0f} ms. "
             "Bytes = 2*(q+k) + pos; `%ceil` against one in-place `mul_` over the same bytes; "
             "`t/FI` = time / FlashInfer's; `L2` = q and k fit in L2.", ""]
    if env.get("nvidia_smi"):
        lines += [f"nvidia-smi: `{env['nvidia_smi']}`", ""]
    for note in report.get("notes", []):
        lines.append(f"- {note}")
    if report.get("notes"):
        lines.append("")
    sections = _sections(report)
    for title, (headers, rows) in sections[-1:] + sections[:-1]:
        if rows:
            lines += [f"### {title}", ""] + _table(headers, rows, True) + [""]
    headers, rows = long_rows(report)
    lines += ["<details><summary>All measurements</summary>", ""] + _table(headers, rows, True)
    lines += ["", "</details>", f"<!-- rope_bench:end {report['run_id']} -->", ""]
    return "\n".join(lines)


_RESULTS_HEADER = """# jaxrope benchmark results

Each section is one run of `python -m bench.rope_bench` (see its docstring for the
method), newest last; `bench/rope_tbps.png` is the plot of the latest run written here.
"""


def update_results_md(path: Path, section: str, run_id: str) -> None:
    """Adds this run's section to ``path``, or replaces the section of the same run."""
    text = path.read_text() if path.exists() else _RESULTS_HEADER
    begin, end = f"<!-- rope_bench:begin {run_id} -->", f"<!-- rope_bench:end {run_id} -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section.rstrip("\n") + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def plot_tbps(report: Dict[str, Any], path: Path) -> Optional[str]:
    """TB/s vs tokens at the target shape, one line per implementation; None if plotted."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot (render it later with --from-json)"
    found = _target_shape_results(report, "main")
    if not found:
        return "no main-sweep results at the target shape: no plot"
    found += _target_shape_results(report, "ceiling")
    fig, ax = plt.subplots(figsize=(8, 5))
    for impl in PLOT_IMPLS:
        points = sorted((r["tokens"], r["tbps"]) for r in found if r["impl"] == impl)
        if points:
            ax.plot(*zip(*points), marker="o", label=impl,
                    linestyle="--" if "ceiling" in impl else "-")
    plan = report["plan"]
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel("effective TB/s  (2*(q+k) + pos bytes / median time)")
    hq, hk = plan["target_heads"]
    device = report["env"].get("gpu") or report["env"].get("jax_device")
    ax.set_title(f"RoPE in place, Hq={hq} Hk={hk} D={plan['target_head_dim']} {plan['dtype']}, "
                 f"{device}, {report['date']}", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_json(report: Dict[str, Any], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "results.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out_dir / "results.json")


def write_outputs(report: Dict[str, Any], out_dir: Path, write_results: bool) -> List[Path]:
    derive(report)
    write_json(report, out_dir)
    markdown = render_markdown(report)
    (out_dir / "results.md").write_text(markdown)
    (out_dir / "table.txt").write_text(render_text(report, full=True))
    written = [out_dir / name for name in ("results.json", "results.md", "table.txt")]
    png = out_dir / "rope_tbps.png"
    why_not = plot_tbps(report, png)
    if why_not:
        print(f"note: {why_not}")
    else:
        written.append(png)
    if write_results:
        update_results_md(RESULTS_MD, markdown, report["run_id"])
        written.append(RESULTS_MD)
        if not why_not:
            shutil.copyfile(png, RESULTS_PNG)
            written.append(RESULTS_PNG)
    return written


# ---------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.rope_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU, < 1 min)")
    parser.add_argument("--out", default=str(BENCH_DIR / "out"), help="output folder")
    parser.add_argument("--filter", nargs="+", default=[], metavar="TERM",
                        help="run tasks whose key section/impl/variant/case contains every term, "
                             "e.g. main/ T16384-H32x8-D128 or variants/")
    parser.add_argument("--iters", type=int, default=None,
                        help="applications per loop (default: adaptive, ~rep_seconds each); a "
                             "JAX repeat runs its loop 4 times, a torch repeat once")
    parser.add_argument("--reps", type=int, default=None, help="repeats per measurement")
    parser.add_argument("--unroll", type=int, default=8,
                        help="applications per body of the JAX fori_loop")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_IDS))
    parser.add_argument("--sweep-blocks", action="store_true",
                        help="time rope_pallas over BlockConfig grids instead of the sweep")
    parser.add_argument("--write-results", action=argparse.BooleanOptionalAction, default=None,
                        help="add the run to bench/RESULTS.md and bench/rope_tbps.png "
                             "(default: yes for a full unfiltered GPU run)")
    parser.add_argument("--from-json", default=None, metavar="PATH",
                        help="measure nothing: render a saved results.json into --out")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="threads compiling JAX loops ahead (default 4 on GPU, 0 on CPU)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="start no new shape after this many seconds (0: no limit)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        parser.error(f"--iters={args.iters} must be >= 1")
    for name in ("reps", "unroll"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name}={value} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs the benchmark (or renders ``--from-json``); returns the report dict."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        written = write_outputs(report, out_dir, bool(args.write_results))
        print(render_text(report, full=False), end="")
        print("wrote " + ", ".join(map(str, written)))
        return report

    plan = QUICK if args.quick else FULL
    if args.reps:
        plan = dataclasses.replace(plan, reps=args.reps)
    started = time.time()
    date = datetime.datetime.now(datetime.timezone.utc)
    # Which optional implementations the filtered plan wants: FlashInfer's first call
    # builds its kernels (~1 min), worth skipping when no task needs them.
    probe = Env(on_gpu=True, torch=True, flashinfer=True, launcher=True)
    wanted = {t.impl for t in build_tasks(plan, args.dtype, args.sweep_blocks, args.filter, probe)}
    env = detect_env(want_flashinfer=any(i.startswith("flashinfer") for i in wanted),
                     want_launcher="jaxrope_torch" in wanted)
    tasks = build_tasks(plan, args.dtype, args.sweep_blocks, args.filter, env)
    device = env.torch.cuda.get_device_name(0) if env.device == "cuda" else jax.devices()[0].device_kind
    report: Dict[str, Any] = dict(
        schema=1, run_id=f"{date:%Y%m%dT%H%M%SZ}-{''.join(c for c in device if c.isalnum())}",
        date=f"{date:%Y-%m-%d %H:%M} UTC", command=shlex.join(["python", "-m", "bench.rope_bench"] + argv),
        argv=argv, env=environment(env), setup_s=env.setup_s, notes=env.notes,
        plan=dict(dataclasses.asdict(plan), quick=args.quick, dtype=args.dtype,
                  sweep_blocks=args.sweep_blocks, filters=args.filter, iters=args.iters,
                  variants={name: repr(cfg) for name, cfg in VARIANTS},
                  position_range=POSITION_RANGE),
        results=[])
    workers = args.compile_workers if args.compile_workers is not None else (4 if env.on_gpu else 0)
    enabled = args.progress if args.progress is not None else sys.stderr.isatty()
    progress = Progress(len(tasks), enabled)
    runner = Runner(plan, env, args, report, progress, out_dir, started)
    if workers:
        runner.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="compile")
    try:
        runner.run(tasks)
    finally:
        progress.close()
        if runner.pool is not None:
            runner.pool.shutdown(wait=True, cancel_futures=True)
        report["elapsed_s"] = time.time() - started
        write_results = args.write_results
        if write_results is None:
            write_results = env.on_gpu and not args.quick and not args.filter
        written = write_outputs(report, out_dir, write_results)
    print(render_text(report, full=False), end="")
    failed = [r for r in report["results"] if r.get("error")]
    print(f"{len(report['results'])} measurements ({len(failed)} failed or skipped) in "
          f"{report['elapsed_s']:.0f} s; wrote " + ", ".join(map(str, written)))
    return report


if __name__ == "__main__":
    main()
