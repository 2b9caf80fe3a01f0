"""torch_bridge: the PyTorch-facing RopeManager over the jaxrope core (the only torch importer).

The public API is exactly what ``__all__`` lists: the classes an engine uses (the
managers, their config, the engine types they take and return, the launchers, the
vLLM-shaped rotary layer) and three modules used as ``torch_bridge.<module>.<name>``:
:mod:`torch_bridge.dlpack` (zero-copy tensors between torch and JAX),
:mod:`torch_bridge.handoff` (a request's record and KV between processes) and
:mod:`torch_bridge.custom_ops` (the rotations as torch custom ops, for
``torch.compile``). Every other module is private: importable, its names may change
without notice. A launcher declines a call by
raising :class:`jaxrope.BackendUnavailable`.

Example:
  >>> import jaxrope as jr
  >>> from torch_bridge import PositionConfig, RopeManager
  >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=64)), "cpu", max_seq_len=16)
  >>> mgr.ingest_request("r0")
  >>> mgr.position("r0", "text")
  0
"""

try:
    import torch  # noqa: F401
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    # A ModuleNotFoundError still (name "torch"), so callers can tell what is missing.
    raise ModuleNotFoundError(
        "torch_bridge needs PyTorch, which is not installed. The CPU build: "
        "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
        "(from a clone, `make demo` installs it); on a GPU, the torch build for your CUDA "
        "version first. The `torch` extra only names the tested range: alone, pip takes "
        "the default build from the index, a CUDA one of several GB on Linux.",
        name="torch") from e

from torch_bridge import custom_ops, dlpack, handoff
from torch_bridge.config import PositionConfig
from torch_bridge.engine_types import (AdmitOutcome, Fork, GraphBucket, GraphSlot, KVPlanOutput,
                                       KVView, PositionStep, PublishedInfo, Segment, StepContext)
from torch_bridge.launch.dispatch import KVLauncher, Launcher
from torch_bridge.manager import PositionManager
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.resource import EngineInfo, Resource, ResourceSpec
from torch_bridge.rope_manager import RopeManager
from torch_bridge.rotary_layer import RotaryEmbedding

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
    "RotaryEmbedding",
    "Segment",
    "StepContext",
    "custom_ops",
    "dlpack",
    "handoff",
]
