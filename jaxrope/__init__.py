"""jaxrope: rotary position embedding for LLM serving, in JAX and Pallas.

The public API is the list below; every other module is an implementation detail.
"""

from jaxrope import cases, hf, models, mrope, paging, positions, speculative, wire
from jaxrope.apply import apply_rope
from jaxrope.backend import BACKENDS
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.kv_cache import apply_rope_and_append_kv
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
    "apply_rope_and_append_kv",
    "cases",
    "hf",
    "models",
    "mrope",
    "paging",
    "positions",
    "speculative",
    "wire",
]
