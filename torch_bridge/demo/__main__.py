"""``python -m torch_bridge.demo``: the same as ``python -m jaxrope.demo``."""

import sys

from torch_bridge.demo.cli import main

sys.exit(main())
