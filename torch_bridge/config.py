"""``PositionConfig``: what a position manager needs beyond the device."""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from jaxrope.config import RopeConfig
from jaxrope.positions import Scheme

__all__ = ["PositionConfig"]


@dataclasses.dataclass(frozen=True)
class PositionConfig:
    """Configuration of a :class:`~torch_bridge.RopeManager`.

    Args:
      rope: the model's :class:`jaxrope.RopeConfig`, or None to build the default one
        (``RopeConfig(head_dim=head_dim)``) from the manager's ``head_dim``.
      labels: the stream labels every request has (e.g. ``("text",)``, or
        ``("cond", "uncond")`` for CFG); each gets its own counter at
        ``ingest_request``. Non-empty, distinct strings.
      scheme: :class:`jaxrope.Scheme` SEQUENTIAL (token ``i`` of a view at
        ``counter + i``, commit adds the span) or BLOCK (all tokens at ``counter``,
        commit adds ``block_step`` per non-empty segment).
      block_step: the BLOCK advance, ``>= 1``; ignored by SEQUENTIAL.
      kv_resource: the name under which ``StepContext.plan_results`` carries the KV
        planner's ``{plan_label: KVPlanOutput}``. When a step's context has no such
        entry, each stream label is its own plan label and the step's segments are
        its views.

    Raises:
      TypeError: naming the field, for a value of the wrong type (e.g. ``labels="text"``).
      ValueError: naming the field, for an invalid value.

    Example:
      >>> import jaxrope as jr
      >>> cfg = PositionConfig(rope=jr.RopeConfig(head_dim=128, theta=5e5), labels=("cond", "uncond"))
      >>> cfg.scheme
      <Scheme.SEQUENTIAL: 'sequential'>
    """

    rope: Optional[RopeConfig] = None
    labels: Tuple[str, ...] = ("text",)
    scheme: Scheme = Scheme.SEQUENTIAL
    block_step: int = 1
    kv_resource: str = "kv"

    def __post_init__(self) -> None:
        if self.rope is not None and not isinstance(self.rope, RopeConfig):
            raise TypeError(f"rope={self.rope!r} must be a jaxrope.RopeConfig or None")
        labels = self.labels
        if isinstance(labels, str) or not hasattr(labels, "__iter__"):
            raise TypeError(f"labels={labels!r} must be a sequence of strings, e.g. ('text',)")
        labels = tuple(labels)
        if not all(isinstance(label, str) for label in labels):
            raise TypeError(f"labels={labels!r} must be strings")
        if not labels or not all(labels):
            raise ValueError(f"labels={labels!r} must be non-empty strings, at least one")
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels={labels!r} must be distinct")
        object.__setattr__(self, "labels", labels)
        if not isinstance(self.scheme, Scheme):
            raise TypeError(f"scheme={self.scheme!r} must be a jaxrope.Scheme")
        if not isinstance(self.block_step, int) or isinstance(self.block_step, bool):
            raise TypeError(f"block_step={self.block_step!r} must be an int")
        if self.block_step < 1:
            raise ValueError(f"block_step={self.block_step!r} must be >= 1")
        if not isinstance(self.kv_resource, str):
            raise TypeError(f"kv_resource={self.kv_resource!r} must be a string")
        if not self.kv_resource:
            raise ValueError(f"kv_resource={self.kv_resource!r} must be a non-empty string")
