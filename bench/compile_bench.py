"""The custom ops' cost: eager ``apply_qk`` per call, and a compiled layer under CUDA graphs.

``python -m bench.compile_bench --out DIR`` writes ``DIR/compile_bench.json``:

- ``apply_qk``: wall time per eager call at 64 tokens (bf16, Hq=32, Hk=8, D=128 on the
  GPU) of ``RopeManager.apply_qk`` (the direct launch eager calls keep), of
  ``RotaryEmbedding`` (vLLM's call), of the ``jaxrope::rope_`` op called eagerly (what
  the dispatch of a custom op adds) and of FlashInfer's
  ``apply_llama31_rope_pos_ids_inplace`` when it is importable. Targets: ``apply_qk``
  no slower than before the ops (bench/RESULTS.md) and below FlashInfer's.
- ``layer``: wall time per step of :class:`bench.compile_layers.FusedQKVAttention`
  with the vLLM-shaped layer, eager against ``torch.compile(mode="reduce-overhead")``
  (CUDA graphs; new positions and inputs each step). Target: compiled no slower.

``--quick`` runs small sizes on any device (the CPU smoke run: no CUDA graphs there,
the compiled layer uses inductor's default mode).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, Optional, Sequence

import torch

import jaxrope as jr
from bench import timing
from bench.compile_layers import FusedQKVAttention
from torch_bridge import PositionConfig, PositionStep, RopeManager, RotaryEmbedding, Segment, StepContext
from torch_bridge import custom_ops


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def bench_apply(device: torch.device, tokens: int, q_heads: int, k_heads: int, head_dim: int,
                dtype: torch.dtype) -> Dict[str, Any]:
    """Per-call wall time of the eager rotations on the same q, k and positions."""
    cfg = jr.RopeConfig(head_dim=head_dim, theta=5e5)
    gen = torch.Generator(device=device).manual_seed(tokens)
    q = torch.randn(tokens, q_heads, head_dim, device=device, generator=gen).to(dtype)
    k = torch.randn(tokens, k_heads, head_dim, device=device, generator=gen).to(dtype)
    mgr = RopeManager(PositionConfig(rope=cfg), device, max_seq_len=8192)
    mgr.ingest_request("r")
    mgr.apply_cached_prefix("r", None, None, None, {"text": 4096})
    mgr.plan(PositionStep((Segment("r", "text", tokens),)), StepContext(("r",)))
    pos = mgr.pos_ids("text")
    rotary, key = RotaryEmbedding(cfg), custom_ops.config_key(cfg)
    sync = _sync(device)
    out: Dict[str, Any] = {
        "RopeManager.apply_qk": timing.time_wall(lambda: mgr.apply_qk(q, k, "text"), sync),
        "RotaryEmbedding": timing.time_wall(lambda: rotary(pos, q, k), sync),
        "torch.ops.jaxrope.rope_": timing.time_wall(
            lambda: torch.ops.jaxrope.rope_(q, k, pos, key), sync)}
    try:
        import flashinfer
        out["flashinfer.apply_llama31_rope_pos_ids_inplace"] = timing.time_wall(
            lambda: flashinfer.apply_llama31_rope_pos_ids_inplace(q, k, pos, rope_theta=5e5), sync)
    except ImportError as e:
        out["flashinfer"] = f"not importable: {e}"
    out = {name: t.as_dict() if isinstance(t, timing.Timing) else t for name, t in out.items()}
    out["path"] = type(mgr.launcher).__name__ if mgr.launcher is not None else "jax"
    return out


def bench_layer(device: torch.device, tokens: int, hidden: int, q_heads: int, k_heads: int,
                head_dim: int, dtype: torch.dtype) -> Dict[str, Any]:
    """Per-step wall time of the fused-qkv layer, eager and compiled, new positions each step."""
    cfg = jr.RopeConfig(head_dim=head_dim, theta=5e5)
    torch.manual_seed(tokens)
    layer = FusedQKVAttention(RotaryEmbedding(cfg), hidden, q_heads, k_heads, head_dim,
                              dtype=dtype, device=device)
    mode = "reduce-overhead" if device.type == "cuda" else "default"
    compiled = torch.compile(layer, mode=mode, fullgraph=True)
    gen = torch.Generator(device=device).manual_seed(hidden)
    inputs = [(torch.randint(0, 8192, (tokens,), device=device, generator=gen),
               torch.randn(tokens, hidden, device=device, generator=gen).to(dtype))
              for _ in range(8)]
    steps = iter(range(1 << 62))
    sync = _sync(device)

    def step(fn):
        def run():
            positions, x = inputs[next(steps) % len(inputs)]
            fn(positions, x)
        return run

    with torch.no_grad():
        eager_t = timing.time_wall(step(layer), sync)
        compiled_t = timing.time_wall(step(compiled), sync, warmup=10)
    return {"mode": mode, "eager": eager_t.as_dict(), "compiled": compiled_t.as_dict(),
            "compiled_over_eager": compiled_t.median_us / eager_t.median_us}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for compile_bench.json")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI, CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    small = args.quick or device.type != "cuda"
    q_heads, k_heads, hidden = (8, 2, 256) if small else (32, 8, 4096)
    dtype = torch.float32 if small else torch.bfloat16
    head_dim = 32 if small else 128
    report: Dict[str, Any] = {"run": timing.run_info("bench.compile_bench", argv)}
    report["apply_qk"] = bench_apply(device, 64, q_heads, k_heads, head_dim, dtype)
    print(f"eager rotation of 64 tokens on {device} ({report['apply_qk']['path']}), us per call")
    for name, r in report["apply_qk"].items():
        if isinstance(r, dict):
            print(f"  {name:48s} {r['median_us']:8.1f}")
    for tokens in ((64,) if args.quick else (64, 512)):
        r = report[f"layer_T={tokens}"] = bench_layer(device, tokens, hidden, q_heads, k_heads,
                                                      head_dim, dtype)
        print(f"fused-qkv layer T={tokens}: eager {r['eager']['median_us']:.1f} us, compiled "
              f"({r['mode']}) {r['compiled']['median_us']:.1f} us per step "
              f"({r['compiled_over_eager']:.2f}x)")
    path = timing.write_json(args.out, "compile_bench", report)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
