"""``python -m torch_bridge.demo``: the torch traces (see :mod:`torch_bridge.demo`)."""

import sys

from torch_bridge.demo.cli import main

sys.exit(main())
