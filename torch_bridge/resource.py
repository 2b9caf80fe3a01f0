"""The engine resource protocol: the hooks a serving engine's runner calls on each of its
resources (:class:`Resource`), how it builds one (:class:`ResourceSpec`, :class:`EngineInfo`,
``build``). :class:`torch_bridge.PositionManager` is such a resource.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Mapping, Optional, Tuple, Union

import torch

from torch_bridge.engine_types import PublishedInfo

__all__ = ["EngineInfo", "Resource", "ResourceSpec"]


class Resource:
    """Base of an engine resource: the hooks a runner calls, with neutral defaults.

    Attributes:
      name: the resource's name in ``StepContext.plan_results`` and ``depends_on``.
      prefix_skip_safe: the resource handles a prefix served from the cache
        (tokens skipped) correctly.

    Example (the neutral defaults a subclass overrides):
      >>> r = Resource()
      >>> r.name, r.depends_on(), r.supports_preplan, r.fingerprint(), r.publish("r0")
      ('resource', (), False, None, None)
    """

    name: str = "resource"
    prefix_skip_safe: bool = False

    def depends_on(self) -> Tuple[str, ...]:
        """Names of the resources whose plan results this one reads in ``plan``."""
        return ()

    @property
    def supports_preplan(self) -> bool:
        """Whether ``plan`` may be called for step N+1 while step N runs."""
        return False

    @property
    def force_double_buffer(self) -> bool:
        """Whether the runner must double-buffer this resource even off the preplan path."""
        return False

    def fingerprint(self) -> Optional[bytes]:
        """What this resource adds to the prefix cache's root; None leaves it out."""
        return None

    def publish(self, request_id: Hashable) -> Optional[PublishedInfo]:
        """What another node needs to continue ``request_id``; None if nothing."""
        return None

    def publish_snapshot_for_step(self, request_id: Hashable, node_name: Optional[str],
                                  graph_walk: Optional[str]) -> Any:
        """A record of what :meth:`publish` returns now; the default is the publication itself."""
        return self.publish(request_id)

    def publish_from_snapshot(self, request_id: Hashable, snapshot: Any,
                              node_name: Optional[str], graph_walk: Optional[str]) -> Any:
        """Finish a :meth:`publish_snapshot_for_step` record into the publication."""
        return snapshot


@dataclasses.dataclass(frozen=True)
class ResourceSpec:
    """How an engine declares a resource: its name, config and constructor options.

    Attributes:
      name: the resource's name (other resources find its plan results under it).
      config: the resource's config (a ``PositionConfig`` for the position manager).
      options: extra keyword arguments of the constructor (e.g. ``max_seq_len``),
        default empty.

    Example:
      >>> from torch_bridge import PositionConfig, PositionManager
      >>> spec = ResourceSpec("pos", PositionConfig(), {"max_seq_len": 128})
      >>> PositionManager.build(spec, EngineInfo("cpu")).max_seq_len
      128
    """

    name: str
    config: Any
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the engine knows about the model and device when it builds resources.

    Attributes:
      device: the torch device the step runs on.
      head_dim: the attention head size ``D``, or None to take it from the config.
      max_seq_len: the longest sequence the engine serves, or None for the
        resource's default.

    Example:
      >>> from torch_bridge import PositionConfig, ResourceSpec, RopeManager
      >>> info = EngineInfo("cpu", head_dim=64, max_seq_len=256)
      >>> mgr = RopeManager.build(ResourceSpec("rope", PositionConfig()), info)
      >>> mgr.rope.head_dim, mgr.max_seq_len
      (64, 256)
    """

    device: Union[str, torch.device]
    head_dim: Optional[int] = None
    max_seq_len: Optional[int] = None
