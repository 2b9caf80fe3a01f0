"""``python -m jaxrope.demo``: the serving demos (importing this module imports neither).

Usage::

  python -m jaxrope.demo --jax [--steps N] [--seed S] [--inject-fault]
  python -m jaxrope.demo [--model {llama3.1,qwen2.5-yarn,phi3-longrope,deepseek-v2,
                                   qwen2-vl,qwen2.5-vl,qwen3-vl,glm-4.1v}]
                         [--steps N] [--device {auto,cpu,cuda}] [--seed S] [--speculative]

``--jax``: a continuous-batching engine loop entirely in JAX, no torch
(:mod:`jaxrope.engine_demo`). Otherwise the demo drives the PyTorch facade, so its
implementation lives in :mod:`torch_bridge.demo` (see there for the trace and the
checks); this entry point loads it only when run, which keeps ``import jaxrope`` free of
torch. Without torch it prints the install command and exits with status 2.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

__all__ = ["main"]

INSTALL_HINT = ("jaxrope.demo drives the PyTorch facade (torch_bridge) and needs torch: "
                "pip install -e '.[torch]' from a clone (CPU-only: pip install torch "
                "--index-url https://download.pytorch.org/whl/cpu), or run `make demo`, "
                "which installs it; `python -m jaxrope.demo --jax` runs the JAX engine demo "
                "without torch")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo with ``argv`` (default: the command line); returns the exit status.

    0: every check passed; 1: a mismatch; 2: torch is missing, the arguments are invalid
    or the device asked for is not there (the reason goes to stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--jax" in argv:
        argv.remove("--jax")
        demo = importlib.import_module("jaxrope.engine_demo")
    else:
        try:
            demo = importlib.import_module("torch_bridge.demo")
        except ModuleNotFoundError as e:
            if e.name != "torch" and not (e.name or "").startswith("torch."):
                raise
            print(f"{INSTALL_HINT}\n({e})", file=sys.stderr)
            return 2
    try:
        return demo.main(argv)
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
