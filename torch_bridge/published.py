"""``PublishedPositionInfo``: where each of a request's streams has reached, for another node.

A node that hands a request over (disaggregated prefill -> decode, a CFG branch on its own
GPU) publishes its counters; the receiving node admits them (``admit_retrieve``:
per label ``counter = max(counter, published)``, so a stale echo never rewinds).
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from torch_bridge.engine_types import PublishedInfo

__all__ = ["PublishedPositionInfo"]


@dataclasses.dataclass
class PublishedPositionInfo(PublishedInfo):
    """Where each of a request's streams has reached: ``{label: next position}``.

    Example:
      >>> a = PublishedPositionInfo({"text": 7})
      >>> a.update(PublishedPositionInfo({"text": 5, "image": 2}))
      >>> a.counters
      {'text': 7, 'image': 2}
    """

    counters: Dict[str, int] = dataclasses.field(default_factory=dict)

    def clone(self) -> "PublishedPositionInfo":
        """An independent copy (for deferred sending)."""
        return PublishedPositionInfo(dict(self.counters))

    def update(self, other: "PublishedPositionInfo") -> None:
        """Merge ``other`` in: per label, the larger position wins (positions never go back).

        Raises:
          TypeError: ``other`` is not a PublishedPositionInfo.
        """
        if not isinstance(other, PublishedPositionInfo):
            raise TypeError(f"other must be a PublishedPositionInfo, got {type(other).__name__}")
        for label, position in other.counters.items():
            mine = self.counters.get(label)
            self.counters[label] = position if mine is None else max(mine, position)
