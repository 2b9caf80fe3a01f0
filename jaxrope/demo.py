"""``python -m jaxrope.demo``: the JAX engine trace, a continuous-batching loop entirely in JAX.

Usage::

  python -m jaxrope.demo [--steps N] [--seed S] [--inject-fault]

The trace, its options and its checks are :mod:`jaxrope.engine_demo`'s; this module only
names the program. The torch traces (the same core under the PyTorch facade) are
``python -m torch_bridge.demo``; ``make demo`` runs both.
"""

import sys

from jaxrope.engine_demo import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
