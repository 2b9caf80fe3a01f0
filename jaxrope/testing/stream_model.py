"""A plain-Python model of one node's position streams, for the differential test of
``tests/test_manager_differential.py``.

Written from the rules as the README and the issue state them, with none of the bridge's
code (no numpy, no slot arrays, no shared helper): a node holds, per stream ``(rid,
label)``, a counter and its rewinds ``{writer: rollbacks}``, plus at most a current and a
staged plan. The rules:

- ``plan``: an ordinary view of ``n`` tokens at ``counter + i``; a tree verify at
  ``counter + depth``; a draft step at ``counter + d`` (a token at or past
  ``max_seq_len`` planned at 0 and not live). A view reaching past ``max_seq_len``
  (``counter + n > max_seq_len``, a tree's ``counter + depth >= max_seq_len``) fails. A
  preplan is numbered from the counters the current plan leaves when every span commits
  (a draft step commits nothing); a plan that is not a preplan replaces both plans.
- ``commit``: the current plan (else the staged one) advances each stream by its span,
  a stream named in ``accepted`` by ``a + 1`` (a tree's streams must be named; ``a`` at
  most the deepest depth, for a chain its span - 1), a draft step by nothing; refused
  when the staged plan numbers a stream whose advance differs from its span. Then the
  staged plan becomes current.
- a planned stream is frozen: nothing but its plan's commit moves a stream the current
  or staged plan numbers (refused, "planned"); a call that would not move it is taken.
- ``ingest``: idempotent, ``counter = max(counter, override)``.
- ``rollback``: refused for a stream the current or staged plan numbers, and for a move
  back at the last epoch (``2**31 - 1``); ``counter = min(counter, to)``, one more
  rollback by this node's writer when it moves.
- ``admit``: per stream, the record's rewinds against the node's: the record includes
  every rollback the node holds and more (newer) -> take its position; the same ->
  the larger position; fewer (older) -> nothing; neither includes the other -> refused
  ("conflict"); a newer record, or one of the same rewinds with a larger position, for
  a stream a plan numbers -> refused ("planned");
  positions past ``max_seq_len`` -> "position", epochs past int32 -> "epoch", an unknown
  request -> "request". A refusal changes nothing.
- ``remove``: the request leaves both plans (they still commit, without it).
- Integer arguments (:func:`integer_argument`): a Python int, a numpy integer scalar or
  0-d integer array, a 0-d integer torch tensor, read as the Python int it holds; any
  other type (bool, ``np.bool_``, a float, a bool or float tensor) is refused with
  ``"type"``; spans and accepted counts past int32 / int64 with ``"range"`` before any
  rule above sees them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

__all__ = ["INT32_MAX", "MAX_EPOCH", "ModelPlan", "NodeModel", "Refused", "integer_argument"]

MAX_EPOCH = INT32_MAX = 2**31 - 1
Stream = Tuple[str, str]
# Integer dtypes by name (numpy's scalar types and torch's dtypes spell them alike).
_INTEGER_NAMES = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}


def integer_argument(value: Any, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """The Python int an integer argument holds, recognised by its type's name (no numpy
    or torch imported); ``Refused("type")`` for any other type, ``Refused("range")``
    outside ``[low, high]``."""
    kind, module = type(value).__name__, type(value).__module__.split(".")[0]
    if type(value) is int:
        number = value
    elif module == "numpy" and kind in _INTEGER_NAMES:
        number = int(value)
    elif (module in ("numpy", "torch") and kind in ("ndarray", "Tensor") and value.ndim == 0
          and str(value.dtype).split(".")[-1] in _INTEGER_NAMES):
        number = int(value.item())
    else:
        raise Refused("type")
    if (low is not None and number < low) or (high is not None and number > high):
        raise Refused("range")
    return number


class Refused(Exception):
    """A call the model predicts to fail; ``check`` says which rule refuses it."""

    def __init__(self, check: str):
        super().__init__(check)
        self.check = check


@dataclasses.dataclass
class ModelPlan:
    """A planned step: per stream its kind (``"span"``, ``"tree"``, ``"draft"``), token count,
    deepest depth (trees) and positions."""

    kinds: Dict[Stream, str]
    spans: Dict[Stream, int]
    deepest: Dict[Stream, int]
    positions: Dict[Stream, List[int]]
    live: Dict[Stream, List[bool]]
    tag: object = None
    dropped: set = dataclasses.field(default_factory=set)

    def advance(self, stream: Stream, accepted: Dict[Stream, int]) -> int:
        if self.kinds[stream] == "draft":
            return 0
        if stream in accepted:
            return accepted[stream] + 1
        return self.spans[stream]


class NodeModel:
    """One node: its streams, its writer id and its plans."""

    def __init__(self, writer: int, max_seq_len: int, labels: Tuple[str, ...] = ("text",)):
        self.writer, self.max_seq_len, self.labels = writer, max_seq_len, labels
        self.counters: Dict[Stream, int] = {}
        self.rewinds: Dict[Stream, Dict[int, int]] = {}
        self.current: Optional[ModelPlan] = None
        self.staged: Optional[ModelPlan] = None

    # -- requests

    def ingest(self, rid: str, override: int = 0) -> None:
        """Idempotent; ``override`` raises the counters to it (``counter = max(...)``)."""
        if not 0 <= override <= self.max_seq_len:
            raise Refused("position")
        if any(self.numbered((rid, label)) and override > self.counters[(rid, label)]
               for label in self.labels if (rid, label) in self.counters):
            raise Refused("planned")
        for label in self.labels:
            stream = (rid, label)
            self.counters[stream] = max(self.counters.get(stream, 0), override)
            self.rewinds.setdefault(stream, {})

    def remove(self, rid: str) -> None:
        for label in self.labels:
            self.counters.pop((rid, label), None)
            self.rewinds.pop((rid, label), None)
        for plan in (self.current, self.staged):
            if plan is not None:
                plan.dropped.add(rid)
                for table in (plan.kinds, plan.spans, plan.deepest, plan.positions, plan.live):
                    for stream in [s for s in table if s[0] == rid]:
                        del table[stream]

    def epoch(self, stream: Stream) -> int:
        return sum(self.rewinds[stream].values())

    # -- plan / commit

    def plan(self, views: Dict[Stream, Tuple[str, object]], preplan: bool,
             tag: object = None) -> ModelPlan:
        """``views``: ``{stream: ("span", n) | ("tree", depths) | ("draft", (n, d))}``;
        ``tag``: kept on the plan (the caller's step)."""
        for stream in views:
            if stream not in self.counters:
                raise Refused("request")
        base = dict(self.counters)
        if preplan and self.current is not None:
            for stream in self.current.kinds:
                base[stream] += self.current.advance(stream, {})
        kinds, spans, deepest, positions, live = {}, {}, {}, {}, {}
        for stream, (kind, value) in views.items():
            c = base[stream]
            if kind == "span":
                if c + value > self.max_seq_len:
                    raise Refused("bound")
                spans[stream], positions[stream] = value, [c + i for i in range(value)]
                live[stream] = [True] * value
            elif kind == "tree":
                if c + max(value) >= self.max_seq_len:
                    raise Refused("bound")
                spans[stream], deepest[stream] = len(value), max(value)
                positions[stream] = [c + d for d in value]
                live[stream] = [True] * len(value)
            else:
                n, d = value
                spans[stream] = n
                inside = c + d < self.max_seq_len
                positions[stream] = [c + d if inside else 0] * n
                live[stream] = [inside] * n
            kinds[stream] = kind
        plan = ModelPlan(kinds, spans, deepest, positions, live, tag)
        if preplan:
            self.staged = plan
        else:
            self.current, self.staged = plan, None
        return plan

    def commit(self, accepted: Dict[Stream, int]) -> None:
        plan, staged_first = self.current, False
        if plan is None:
            plan, staged_first = self.staged, True
        if plan is None:
            raise Refused("no plan")
        accepted = {s: a for s, a in accepted.items() if s[0] not in plan.dropped}
        for stream, kind in plan.kinds.items():
            if kind == "tree" and stream not in accepted:
                raise Refused("accepted")
        for stream, a in accepted.items():
            if stream not in plan.kinds or plan.kinds[stream] == "draft":
                raise Refused("accepted")
            most = plan.deepest[stream] if plan.kinds[stream] == "tree" else plan.spans[stream] - 1
            if not 0 <= a <= most:
                raise Refused("accepted")
        staged = None if staged_first else self.staged
        if staged is not None:
            for stream in plan.kinds:
                if stream in staged.kinds and plan.advance(stream, accepted) != plan.advance(
                        stream, {}):
                    raise Refused("accepted")
        for stream in plan.kinds:
            self.counters[stream] += plan.advance(stream, accepted)
        self.current = None if staged_first else self.staged
        self.staged = None

    def clear_preplan(self) -> None:
        self.staged = None

    def numbered(self, stream: Stream) -> bool:
        return any(plan is not None and stream in plan.kinds
                   for plan in (self.current, self.staged))

    # -- records

    def rollback(self, stream: Stream, to: int) -> None:
        if stream not in self.counters:
            raise Refused("request")
        if not 0 <= to <= self.max_seq_len:
            raise Refused("position")
        if self.numbered(stream):
            raise Refused("planned")
        if to < self.counters[stream]:
            if self.epoch(stream) >= MAX_EPOCH:
                raise Refused("epoch")
            self.counters[stream] = to
            self.rewinds[stream][self.writer] = self.rewinds[stream].get(self.writer, 0) + 1

    def publish(self, rid: str) -> Optional[Dict[str, Tuple[int, Dict[int, int]]]]:
        if (rid, self.labels[0]) not in self.counters:
            return None
        return {label: (self.counters[(rid, label)], dict(self.rewinds[(rid, label)]))
                for label in self.labels}

    def admit(self, rid: str, record: Dict[str, Tuple[int, Dict[int, int]]]) -> None:
        if (rid, self.labels[0]) not in self.counters:
            raise Refused("request")
        for label, (position, rewinds) in record.items():
            if not 0 <= position <= self.max_seq_len:
                raise Refused("position")
            if sum(rewinds.values()) > MAX_EPOCH:
                raise Refused("epoch")
        taken = {}
        for label, (position, rewinds) in record.items():
            stream = (rid, label)
            mine = self.rewinds[stream]
            writers = set(mine) | set(rewinds)
            includes_mine = all(rewinds.get(w, 0) >= mine.get(w, 0) for w in writers)
            mine_includes = all(mine.get(w, 0) >= rewinds.get(w, 0) for w in writers)
            if not (includes_mine or mine_includes):
                raise Refused("conflict")
            if includes_mine and not mine_includes:
                if self.numbered(stream):
                    raise Refused("planned")
                taken[stream] = (position, dict(rewinds))
            elif includes_mine and position > self.counters[stream]:
                if self.numbered(stream):
                    raise Refused("planned")
                taken[stream] = (position, dict(rewinds))
        for stream, (position, rewinds) in taken.items():
            self.counters[stream], self.rewinds[stream] = position, rewinds
