"""torch_bridge: the PyTorch-facing RopeManager over the jaxrope core (the only torch importer).

The public API is the list below; every other name is an implementation detail.
"""

from torch_bridge.config import PositionConfig
from torch_bridge.device_counters import KernelUnavailable
from torch_bridge.dlpack import InPlace, NotZeroCopyError, to_jax, to_torch
from torch_bridge.engine_types import (AdmitOutcome, EngineInfo, Fork, GraphBucket, GraphSlot,
                                       KVPlanOutput, KVView, PositionStep, PublishedInfo, Resource,
                                       ResourceSpec, Segment, StepContext)
from torch_bridge.manager import PositionManager, PublishedPositionInfo, RopeManager
from torch_bridge.rotate import Launcher, LaunchUnavailable

__all__ = [
    "AdmitOutcome",
    "EngineInfo",
    "Fork",
    "GraphBucket",
    "GraphSlot",
    "InPlace",
    "KVPlanOutput",
    "KVView",
    "KernelUnavailable",
    "LaunchUnavailable",
    "Launcher",
    "NotZeroCopyError",
    "PositionConfig",
    "PositionManager",
    "PositionStep",
    "PublishedInfo",
    "PublishedPositionInfo",
    "Resource",
    "ResourceSpec",
    "RopeManager",
    "Segment",
    "StepContext",
    "to_jax",
    "to_torch",
]
