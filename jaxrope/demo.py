"""``python -m jaxrope.demo``: the serving demos (importing this module imports neither).

Usage::

  python -m jaxrope.demo --jax [--steps N] [--seed S] [--inject-fault]
  python -m jaxrope.demo [--model {llama3.1,qwen2.5-yarn,phi3-longrope,deepseek-v2,
                                   qwen2-vl,qwen2.5-vl,qwen3-vl,glm-4.1v}]
                         [--steps N] [--device {auto,cpu,cuda}] [--seed S] [--speculative]

``--jax``: a continuous-batching engine loop entirely in JAX, no torch
(:mod:`jaxrope.engine_demo`, which parses its own options). Otherwise the demo drives
the PyTorch facade, so its implementation lives in :mod:`torch_bridge.demo` (see there
for the trace and the checks); this module holds its command line (:func:`parser`,
shared with ``python -m torch_bridge.demo``) and loads the implementation only after the
arguments are parsed, which keeps ``import jaxrope`` free of torch and ``--help`` as fast
as ``import jaxrope``. Without torch it prints the install command and exits with
status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

__all__ = ["MODELS", "VL_MODELS", "main", "parser"]

# --model: the real RoPE configs of jaxrope.models.HF_CONFIGS the 1-D traces run ...
MODELS = {
    "llama3.1": "meta-llama/Llama-3.1-8B",
    "qwen2.5-yarn": "Qwen/Qwen2.5-7B-Instruct+yarn",
    "phi3-longrope": "microsoft/Phi-3-mini-128k-instruct",
    "deepseek-v2": "deepseek-ai/DeepSeek-V2-Lite",
}
# ... and the M-RoPE ones (jaxrope.models.HF_VL_CONFIGS) of the multimodal trace.
VL_MODELS = {
    "qwen2-vl": "Qwen/Qwen2-VL-7B-Instruct",
    "qwen2.5-vl": "Qwen/Qwen2.5-VL-7B-Instruct",
    "qwen3-vl": "Qwen/Qwen3-VL-4B-Instruct",
    "glm-4.1v": "zai-org/GLM-4.1V-9B-Thinking",
}


def parser(prog: str = "python -m jaxrope.demo") -> argparse.ArgumentParser:
    """The demo's command line, named ``prog`` in its usage line (no torch, no JAX).

    Example:
      >>> parser("python -m torch_bridge.demo").format_usage().split()[:5]
      ['usage:', 'python', '-m', 'torch_bridge.demo', '[-h]']
    """
    p = argparse.ArgumentParser(
        prog=prog,
        description="Drive torch_bridge.RopeManager through a multi-request serving trace and "
                    "check a tiny attention layer against a float64 recompute at every step.")
    p.add_argument("--model", choices=sorted(MODELS) + sorted(VL_MODELS), default="llama3.1",
                   help="real RoPE config to use (default: llama3.1); the M-RoPE models "
                        f"{', '.join(sorted(VL_MODELS))} run the image + video trace")
    p.add_argument("--steps", type=int, default=14,
                   help="main-node steps to run, at least the scripted trace's (default: 14)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when torch and JAX both see a GPU, else CPU")
    p.add_argument("--seed", type=int, default=0, help="weights and token ids (default: 0)")
    p.add_argument("--inject-fault", action="store_true",
                   help="for tests: the prefix-cache probe claims one token too many (M-RoPE "
                        "models: the decode node admits the handoff without its delta; with "
                        "--speculative: a rollback is published without its epoch), so "
                        "a request's positions are off and the run must FAIL")
    p.add_argument("--speculative", action="store_true",
                   help="the speculative-decoding trace instead: draft steps, verify with "
                        "random acceptance, rollbacks, a handoff after a rollback; --steps "
                        "counts its rounds (1-D models only)")
    return p


INSTALL_HINT = ("jaxrope.demo drives the PyTorch facade (torch_bridge) and needs torch: "
                "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
                "(the CPU build), or run `make demo`, which installs it; `python -m jaxrope.demo --jax` runs the JAX engine demo "
                "without torch")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo with ``argv`` (default: the command line); returns the exit status.

    0: every check passed (or ``--help``); 1: a mismatch; 2: torch is missing, the
    arguments are invalid or the device asked for is not there (the reason goes to stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if "--jax" in argv:
            argv.remove("--jax")
            return importlib.import_module("jaxrope.engine_demo").main(argv)
        command_line = parser()
        command_line.add_argument("--jax", action="store_true",
                                  help="run the JAX engine trace instead (no torch)")
        args = command_line.parse_args(argv)
        try:
            cli = importlib.import_module("torch_bridge.demo.cli")
        except ModuleNotFoundError as e:
            if e.name != "torch" and not (e.name or "").startswith("torch."):
                raise
            print(f"{INSTALL_HINT}\n({e})", file=sys.stderr)
            return 2
        return cli.run(command_line, args)
    except SystemExit as e:
        # argparse has printed its message and exits with a number; a SystemExit that
        # carries the message itself (e.g. "--device cuda: JAX has no GPU backend") is
        # the only word the user gets, so print it.
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
