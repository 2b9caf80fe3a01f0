"""jaxrope: rotary position embedding for LLM serving, in JAX and Pallas.

The public API is the list below; every other module is an implementation detail.
"""

from jaxrope import cases, hf, models, mrope, positions, wire
from jaxrope.apply import apply_rope
from jaxrope.backend import BACKENDS
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.positions import PositionTable, Scheme, SlotMap
from jaxrope.scaling import DynamicNTK, Linear, Llama3, LongRope, Proportional, Yarn

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "DynamicNTK",
    "Linear",
    "Llama3",
    "LongRope",
    "PositionTable",
    "Proportional",
    "RopeConfig",
    "Scheme",
    "SlotMap",
    "Yarn",
    "apply_rope",
    "cases",
    "hf",
    "models",
    "mrope",
    "positions",
    "wire",
]
