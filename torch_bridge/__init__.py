"""torch_bridge: the PyTorch-facing RopeManager over the jaxrope core (the only torch importer).

The public API is the list below: what an engine uses. Everything else is an
implementation detail; the DLPack plumbing stays importable from
:mod:`torch_bridge.dlpack`. A launcher declines a call by raising
:class:`jaxrope.BackendUnavailable`.
"""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    # A ModuleNotFoundError still (name "torch"), so callers can tell what is missing.
    raise ModuleNotFoundError(
        "torch_bridge needs PyTorch, which is not installed: pip install 'jaxrope[torch]' "
        "(from a clone: pip install -e '.[torch]'); for the CPU-only build install torch first: "
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu",
        name="torch") from e

from torch_bridge.config import PositionConfig
from torch_bridge.engine_types import (AdmitOutcome, EngineInfo, Fork, GraphBucket, GraphSlot,
                                       KVPlanOutput, KVView, PositionStep, PublishedInfo, Resource,
                                       ResourceSpec, Segment, StepContext)
from torch_bridge.kv_launch import KVLauncher
from torch_bridge.manager import PositionManager
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.rope_manager import RopeManager
from torch_bridge.rotate import Launcher

__all__ = [
    "AdmitOutcome",
    "EngineInfo",
    "Fork",
    "GraphBucket",
    "GraphSlot",
    "KVLauncher",
    "KVPlanOutput",
    "KVView",
    "Launcher",
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
]
