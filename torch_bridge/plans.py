"""The plan / commit / preplan state machine of a position manager.

A step is *planned* (its positions computed from the counters), run, then *committed*
(the counters advance by what it consumed). At most two plans exist:

- the *current* plan: the step being run; ``commit`` commits it;
- a *staged* plan (a preplan: step N+1 planned while step N runs). Its positions are
  numbered from the counters as they will be once the current plan commits; its
  pre-forks reach the counters only when it becomes current (:meth:`StepPlans.promote`:
  at the current plan's commit, or at first use when there is no current plan).
  ``clear_preplan`` drops it, and since its forks never reached the counters nothing
  else changes.

A plan that is not a preplan replaces the current plan and drops a staged one; its
pre-forks apply at once. Removing a request drops its streams from the plans made
before (a plan still commits, without them).

**A planned stream is frozen.** Until a plan commits (or, staged, is cleared or
replaced), every stream it numbers or forks (:meth:`Plan.role`) keeps its counter and
delta: the plan's positions were numbered from them, so a move in between would leave
its commit where no KV ends. The managers' other paths that move a counter ask
:meth:`StepPlans.frozen` first and refuse, naming the plan and the stream. For the same
reason a preplan may not write into the CUDA-graph buffers of the slot the current plan
reads (:meth:`StepPlans.check_graph_slot`).

Every method validates before it changes anything: a call that raises leaves the
counters and both plans as they were.

Example:
  >>> from jaxrope.positions import Scheme
  >>> from torch_bridge.engine_types import PositionStep, Segment, StepContext
  >>> from torch_bridge.step_arrays import StepReader
  >>> from torch_bridge.streams import StreamTable
  >>> streams = StreamTable(("text",)); _ = streams.ingest("r0")
  >>> plans = StepPlans(streams, Scheme.SEQUENTIAL, 1, max_seq_len=64)
  >>> step = PositionStep([Segment("r0", "text", 3)])
  >>> arrays = StepReader(streams, "kv").read(step, StepContext())
  >>> base = plans.base_counters(arrays, preplan=False)
  >>> plans.positions(base, arrays)["text"].tolist()
  [0, 1, 2]
  >>> plans.install(Plan(step, arrays, {}, {}), preplan=False, base=base)
  >>> plans.commit(step); int(streams.counters[0])
  3
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set

import numpy as np
import torch

from jaxrope.positions import Scheme
from torch_bridge import speculative_steps
from torch_bridge import streams as rules
from torch_bridge.engine_types import GraphSlot, PositionStep
from torch_bridge.step_arrays import StepArrays
from torch_bridge.streams import CommitArrays, StreamTable

__all__ = ["Plan", "StepPlans"]

def _fresh(sizes: Sequence[int]) -> List[np.ndarray]:
    return [np.empty((n,), np.int32) for n in sizes]


@dataclasses.dataclass(eq=False)
class Plan:
    """One planned step.

    Attributes:
      step: the planned step (commit must match it).
      arrays: its validated arrays.
      tensors: ``{plan_label: int32 tensor}``, what ``plan`` returned.
      limits: ``{plan_label: int}``, the most q tokens ``apply_qk`` accepts.
      commit: the commit still to apply (without removed requests' streams).
      pre_src, pre_dst: pre-forks still to apply at promotion (a staged plan's).
      dropped: the requests removed since the plan (a later ingest of the same id is a
        new request, outside this plan).
      graph: the CUDA-graph slot whose buffers hold its positions, or None.
    """

    step: PositionStep
    arrays: StepArrays
    tensors: Dict[str, torch.Tensor]
    limits: Dict[str, int]
    commit: CommitArrays = None  # type: ignore[assignment]
    pre_src: np.ndarray = None  # type: ignore[assignment]
    pre_dst: np.ndarray = None  # type: ignore[assignment]
    dropped: Set[Hashable] = dataclasses.field(default_factory=set)
    graph: Optional[GraphSlot] = None

    def __post_init__(self) -> None:
        if self.commit is None:
            self.commit = self.arrays.commit
        if self.pre_src is None:
            self.pre_src, self.pre_dst = self.arrays.pre_src, self.arrays.pre_dst

    @property
    def live(self) -> Dict[str, np.ndarray]:
        """``{plan_label: bool host array}`` of a draft step's labels holding a token past
        ``max_seq_len`` (False, planned at 0); a label without one is live everywhere."""
        spec = self.arrays.speculation
        return {} if spec is None else spec.live

    def drop(self, rid: Hashable, slots: Sequence[int]) -> None:
        """Forget removed request ``rid``'s streams (``slots``) in the commit and pending forks."""
        self.dropped.add(rid)
        self.commit = self.commit.without(slots)
        keep = ~(np.isin(self.pre_src, slots) | np.isin(self.pre_dst, slots))
        self.pre_src, self.pre_dst = self.pre_src[keep], self.pre_dst[keep]

    def role(self, slot: int) -> Optional[str]:
        """How this plan uses stream ``slot`` (what freezes it), or None: a view of it (a
        removed request's excepted), its commit, a pending pre-fork or a post-fork from
        or into it. Checked per call (a few vector compares): it moves with every drop
        and promotion."""
        for plan_label, label in self.arrays.labels.items():
            views = self.arrays.groups[plan_label]
            if any(views[i][0] not in self.dropped
                   for i in np.flatnonzero(label.slots == slot).tolist()):
                return f"numbers it in plan label {plan_label!r}"
        commit = self.commit
        for slots, role in ((self.pre_src, "forks from it before its step (a pre-fork source)"),
                            (self.pre_dst, "forks into it before its step"),
                            (commit.slots, "advances it at commit"),
                            (commit.adv_slots, "advances it at commit"),
                            (commit.fork_src, "forks from it at commit (a post-fork source)"),
                            (commit.fork_dst, "forks into it at commit")):
            if len(slots) and bool((slots == slot).any()):
                return role
        return None

    def describe(self) -> str:
        """The step, for a refusal: its segment count and graph slot."""
        where = "" if self.graph is None else (f", planned into graph slot {self.graph.slot} "
                                               f"of {self.graph.bucket}")
        count = len(self.step.segments)
        return f"a step of {count} segment{'' if count == 1 else 's'}{where}"

    def state(self) -> Dict[str, Any]:
        """Identity and contents, for ``state_snapshot``."""
        commit = self.commit
        return {"plan": self, "positions": {label: tuple(t.tolist()) for label, t in self.tensors.items()},
                "commit": tuple(tuple(a.tolist()) for a in (
                    commit.slots, commit.spans, commit.adv_slots, commit.adv_amounts,
                    commit.fork_src, commit.fork_dst)),
                "pre_forks": (tuple(self.pre_src.tolist()), tuple(self.pre_dst.tolist()))}


class StepPlans:
    """The current and staged plans of one manager, over its :class:`StreamTable`.

    Args:
      streams: the manager's streams (the counters this changes).
      scheme, block_step: the numbering scheme (:class:`jaxrope.Scheme`).
      max_seq_len: no position may reach it; no counter may pass it.
      mrope: plan M-RoPE positions: int32 ``[3, n]`` per plan label, ``counter + delta``
        (+ ``arange`` for SEQUENTIAL) on all three rows, each in ``[0, max_seq_len)``.
    """

    def __init__(self, streams: StreamTable, scheme: Scheme, block_step: int, max_seq_len: int,
                 mrope: bool = False):
        self._streams = streams
        self._scheme, self._block_step = scheme, block_step
        self.max_seq_len = max_seq_len
        self._mrope = mrope
        self.current: Optional[Plan] = None
        self.staged: Optional[Plan] = None

    # -- planning ------------------------------------------------------------------

    def base_counters(self, arrays: StepArrays, preplan: bool) -> rules.Columns:
        """The counters a step's positions are numbered from, pre-forks applied (the
        counters themselves when nothing changes them: callers only read it).

        A preplan is numbered as if the current plan had committed (post-forks too).
        """
        base = self._streams.columns
        after_current = preplan and self.current is not None  # numbered ahead of the current plan
        if not (after_current or len(arrays.pre_src)):
            return base  # read only until install() keeps it
        base = base.copy()
        if after_current:
            rules.apply_commit(base, self.current.commit, self._scheme, self._block_step)
        if len(arrays.pre_src):
            rules.fork(base, arrays.pre_src, arrays.pre_dst)
        return base

    def positions(self, base: rules.Columns, arrays: StepArrays,
                  stage: Callable[[Sequence[int]], Sequence[np.ndarray]] = _fresh
                  ) -> Dict[str, np.ndarray]:
        """int32 host positions of every plan label without explicit ones (``[n]``, M-RoPE
        ``[3, n]``); checks the bound.

        Each label's are written into its buffer of ``stage(sizes)`` (the upload's
        pinned spans: the positions land where their copy reads them).

        Returns:
          ``{plan_label: positions}`` (the buffers).

        Raises:
          ValueError: a view's sequence index (counter + token) would reach past
            ``max_seq_len``, or (M-RoPE) its rotary position counter + delta is below 0
            (a negative delta on a counter that has not reached the prompt's end). The
            bound is on the sequence index, never on an M-RoPE row (vLLM #54498).
        """
        computed = [plan_label for plan_label in arrays.labels if plan_label not in arrays.explicit]
        rows = 3 if self._mrope else 1
        if not computed:
            return {}
        buffers = stage([rows * arrays.labels[plan_label].num_tokens for plan_label in computed])
        out = {}
        # Sufficient first: no counter is high enough (nor, with M-RoPE deltas, any
        # rotary start low enough) for any view to fail.
        peak = int(base.counters.max())
        low = int((base.counters + base.deltas).min()) if self._mrope else 0
        for plan_label, dest in zip(computed, buffers):
            label = arrays.labels[plan_label]
            if self._mrope:
                dest = dest.reshape(3, label.num_tokens)
            out[plan_label] = dest
            if arrays.speculation is not None and speculative_steps.positions(
                    base, arrays, plan_label, self.max_seq_len, self._mrope, dest) is not None:
                continue
            if peak + label.num_tokens > self.max_seq_len or low < 0:
                self._check_bounds(base, arrays, plan_label)
            rules.plan(base, label.slots, label.counts, self._scheme, label.num_tokens,
                       mrope=self._mrope, out=dest)
        return out

    def _check_bounds(self, base: rules.Columns, arrays: StepArrays, plan_label: str) -> None:
        label = arrays.labels[plan_label]
        if not len(label.slots):
            return
        index = base.counters[label.slots]
        if self._scheme is Scheme.SEQUENTIAL:
            past = index + label.counts > self.max_seq_len
        else:
            past = (label.counts > 0) & (index >= self.max_seq_len)
        below = np.zeros_like(past)
        if self._mrope:
            below = (label.counts > 0) & (index + base.deltas[label.slots] < 0)
        if past.any() or below.any():
            i = int(np.argmax(past | below))
            rid, stream_label = arrays.groups[plan_label][i][:2]
            stream = f"stream ({rid!r}, {stream_label!r}) of plan label {plan_label!r}"
            if below[i]:
                raise ValueError(f"{stream} at counter {int(index[i])} + M-RoPE delta "
                                 f"{int(base.deltas[label.slots][i])} is below 0 (a decode plan "
                                 "needs the prompt in: plan the prompt with explicit [3, n] pos_ids)")
            raise ValueError(f"{stream} at position {int(index[i])} with {int(label.counts[i])} "
                             f"tokens passes max_seq_len={self.max_seq_len}")

    def install(self, plan: Plan, preplan: bool, base: rules.Columns) -> None:
        """Make ``plan`` staged (preplan) or current; a current plan's pre-forks apply now
        (``base`` holds them)."""
        if preplan:
            self.staged = plan
            return
        self._streams.columns = base
        plan.pre_src = plan.pre_dst = plan.arrays.pre_src[:0]
        self.current, self.staged = plan, None

    # -- committing ----------------------------------------------------------------

    def commit(self, step: PositionStep,
               resolve: Optional[Callable[[Plan, Optional[Plan]], CommitArrays]] = None) -> None:
        """Commit the current plan (a staged plan first becomes current when there is none).

        ``resolve(plan, staged)``, when given, returns the commit to apply instead of the
        plan's own (accepted drafts: :func:`torch_bridge.speculative_steps.accepted_commit`);
        the caller passes one only for a speculative step.

        Raises:
          ValueError: no plan, ``step`` differs from the plan's, ``resolve`` refuses, or
            a counter would pass ``max_seq_len``.
        """
        plan, staged_first = self.current, False
        if plan is None:
            plan, staged_first = self.staged, True
        if plan is None:
            raise ValueError("commit without a plan: call plan(step, ctx) for this step first")
        _check_same_step(step, plan.step)
        commit = plan.commit if resolve is None else resolve(plan, None if staged_first else self.staged)
        columns = self._streams.columns
        # A draft step changes nothing (no copy); only forks write deltas (a plain commit
        # copies the counters alone).
        forks = len(commit.fork_src) or (staged_first and len(plan.pre_src))
        if forks:
            columns = columns.copy()
        elif len(commit.slots) or len(commit.adv_slots):
            columns = columns._replace(counters=columns.counters.copy())
        if staged_first and len(plan.pre_src):
            rules.fork(columns, plan.pre_src, plan.pre_dst)
        rules.apply_commit(columns, commit, self._scheme, self._block_step)
        # Post-fork targets too: a fork can carry an overflowing counter to a stream whose
        # own advance did not overflow, after the source was overwritten. Every counter
        # is within max_seq_len before a commit, so the largest of all is checked first.
        counters = columns.counters
        if counters.max() > self.max_seq_len:
            touched = commit.touched
            slot = int(touched[np.argmax(counters[touched])])
            raise ValueError(f"commit would move slot {slot} to {int(counters[slot])}, past "
                             f"max_seq_len={self.max_seq_len}")
        self._streams.columns = columns
        self.current = None
        if staged_first:
            self.staged = None
        else:
            self.promote()

    def promote(self) -> None:
        """Make a staged plan current when there is none: its pre-forks reach the counters."""
        if self.current is None and self.staged is not None:
            plan, self.staged = self.staged, None
            if len(plan.pre_src):
                rules.fork(self._streams.columns, plan.pre_src, plan.pre_dst)
                plan.pre_src = plan.pre_dst = plan.pre_src[:0]
            self.current = plan

    def peek(self) -> Optional[Plan]:
        """The plan that is current after :meth:`promote`, without promoting."""
        return self.current if self.current is not None else self.staged

    def next_commit_is_speculative(self) -> bool:
        """Whether the plan a commit commits (:meth:`peek`) is a draft step or tree verify."""
        plan = self.peek()
        return plan is not None and plan.arrays.speculation is not None

    def clear_preplan(self) -> None:
        """Drop the staged plan; its forks never reached the counters."""
        self.staged = None

    def frozen(self, slot: int, stream: str) -> Optional[str]:
        """Why stream ``stream`` (at ``slot``) may not move now, or None: the current or
        the staged plan numbers or forks it (:meth:`Plan.role`). The reason names the plan,
        its step and the way out; callers put what they would have moved before it."""
        for which, plan in (("current", self.current), ("staged", self.staged)):
            role = None if plan is None else plan.role(slot)
            if role is not None:
                way_out = ("commit that step first (a draft step commits nothing)"
                           if which == "current" else "commit it or clear_preplan first")
                return (f"stream {stream} is in a plan not yet committed (the {which} plan "
                        f"{role}; {plan.describe()}): {way_out}")
        return None

    def check_graph_slot(self, graph: Optional[GraphSlot], preplan: bool) -> None:
        """Refuse a preplan into the graph slot of the current plan, whose buffers its
        launches (or graph replay) still read; a plan that is not a preplan replaces the
        current one, and a preplan replaces the staged one, so those may reuse theirs.

        Raises:
          ValueError: naming the slot, its bucket and the current plan.
        """
        current = self.current
        if preplan and graph is not None and current is not None and current.graph == graph:
            raise ValueError(f"preplan into ctx.graph_slot: slot {graph.slot} of {graph.bucket} "
                             f"holds the current plan's positions ({current.describe()}), "
                             "which it reads until it commits; lease the other slot for the "
                             "preplan (double-buffer)")

    def drop(self, rid: Hashable, slots: Sequence[int]) -> None:
        """Request ``rid`` was removed: its streams (``slots``) leave both plans."""
        for plan in (self.current, self.staged):
            if plan is not None:
                plan.drop(rid, slots)


def _check_same_step(step: PositionStep, planned: PositionStep) -> None:
    if step is planned:
        return
    if step.segments != planned.segments:
        if len(step.segments) != len(planned.segments):
            raise ValueError(f"commit's step has {len(step.segments)} segments but the plan has "
                             f"{len(planned.segments)}; commit the step that was planned")
        i = next(i for i, (a, b) in enumerate(zip(step.segments, planned.segments)) if a != b)
        raise ValueError(f"commit's step.segments[{i}]={tuple(step.segments[i])!r} differs from "
                         f"the planned {tuple(planned.segments[i])!r}; commit the step that was "
                         "planned")
    if step.advance != planned.advance:
        raise ValueError(f"commit's step.advance={step.advance!r} differs from the planned "
                         f"{planned.advance!r}; commit the step that was planned")
    if step.draft_depth != planned.draft_depth:
        raise ValueError(f"commit's step.draft_depth={step.draft_depth!r} differs from the planned "
                         f"{planned.draft_depth!r}; commit the step that was planned")
    # Both None on an ordinary step: the speculative module is not called.
    if step.tree is not planned.tree and not speculative_steps.same_tree(step.tree, planned.tree):
        raise ValueError(f"commit's step.tree={step.tree!r} differs from the planned "
                         f"{planned.tree!r}; commit the step that was planned")
