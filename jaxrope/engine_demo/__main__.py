"""``python -m jaxrope.engine_demo``: the JAX engine demo (``python -m jaxrope.demo --jax``)."""

import sys

from jaxrope.engine_demo import main

sys.exit(main())
