"""The torch bridge's counters against the core's, driven by random operation sequences.

Hypothesis' ``RuleBasedStateMachine`` runs ingest / plan / preplan / commit / publish /
snapshot / admit / apply_cached_prefix / fork / clear_preplan / reset / remove /
apply_qk, plus deliberately bad calls, over four requests and two labels, with a small
``max_seq_len`` so that the bounds are hit often. This is the differential test of the
two executors of the counter rules: the manager (host counters, the numpy rules of
:mod:`torch_bridge.streams`) on one side; on the other a model whose every counter and
position comes from the core's pure transitions (:mod:`jaxrope.positions` on a
:class:`jaxrope.PositionTable`, its own :class:`jaxrope.RowMap`). The model keeps only
the plan bookkeeping itself:

- plan: pre-forks first (applied to the counters now, or when a staged plan becomes
  current); ``positions.plan`` numbers the views; a preplan is numbered from the
  counters as they will be after the current commit;
- commit: ``positions.commit`` (spans or block_step), ``positions.advance`` (explicit
  advance), then ``positions.fork`` (post-forks); the staged plan becomes current (its
  pre-forks apply);
- admit: ``positions.admit`` (epoch order, the delta with the winning position); cached
  prefix / ingest overrides: ``positions.raise_to``; ingest deltas:
  ``positions.set_deltas``; removal drops the request from plans made earlier; reset:
  ``positions.reset``; each of these (and a rollback) is refused where it would change a
  stream that the current or staged plan numbers or forks (a planned stream is frozen);
- speculative decoding (:mod:`jaxrope.speculative_positions`): a verify step of chains or draft
  trees (``plan_tree``), committed with accepted counts (``accept`` for the named
  streams, ``commit`` for the others; refused when a count passes the drafts, a tree
  is left out, or a staged plan numbered rejected drafts), draft steps
  (``plan_draft``: clamped past ``max_seq_len``, committing nothing), and rollbacks
  between steps (``positions.rollback``, a new epoch).

The M-RoPE machines (``mrope_section`` set) plan ``[3, n]`` positions: ``positions.plan``
into a ``[3, N]`` out (counter + delta on every row), explicit ``[3, n]`` prompt chunks,
and every stream's delta and epoch compared after each rule too.

After every rule the manager must agree with the model on every counter (``position``,
``publish``, ``mgr.table``), on the positions of the current and staged plans, and hold
no counter past ``max_seq_len``, no slot beyond its live requests and no non-zero free
slot. A call the model predicts to fail must raise ``ValueError`` and leave
``state_snapshot()`` as it was.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope import positions as core  # noqa: E402
from jaxrope import speculative_positions  # noqa: E402
from jaxrope.positions import Scheme, RowMap  # noqa: E402

from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (Fork, KVPlanOutput, KVView, PositionConfig, PositionStep,  # noqa: E402
                          PublishedPositionInfo, RopeManager, Segment, StepContext)

RIDS = ("r0", "r1", "r2", "r3")
LABELS = ("cond", "uncond")
MAX_SEQ_LEN = 40
HEAD_DIM = 8
Stream = Tuple[str, str]
# Positions given to ingest / admit / prefix: mostly well inside the range, sometimes at
# or just past max_seq_len.
# True nine times in ten (hypothesis favours small integers, so no integers(0, 9) here).
MOSTLY = st.sampled_from((True,) * 9 + (False,))
POSITIONS = st.one_of(st.integers(0, 12), st.integers(MAX_SEQ_LEN - 2, MAX_SEQ_LEN + 2))
# M-RoPE deltas: mostly negative (an image's tokens outnumber its positions), sometimes
# positive (a long video), sometimes out of range.
DELTAS = st.one_of(st.integers(-12, 3), st.integers(MAX_SEQ_LEN - 1, MAX_SEQ_LEN + 2).map(
    lambda d: -d))


@dataclasses.dataclass
class ModelPlan:
    segments: List[Tuple[str, str, int]]
    advance: Any
    views: Dict[str, List[Tuple[str, str, int]]]
    pre_forks: List[Tuple[str, str, str]]
    post_forks: List[Tuple[str, str, str]]
    positions: Dict[str, List[int]]
    step: PositionStep
    ctx: StepContext
    dropped: set = dataclasses.field(default_factory=set)
    depths: Any = None    # a draft tree per stream (PositionStep.tree), or a draft step's int (draft_depth)
    live: Dict[str, List[bool]] = dataclasses.field(default_factory=dict)

    @property
    def draft(self) -> bool:
        return isinstance(self.depths, int)

    def trees(self) -> List[Stream]:
        """The streams a depths mapping numbers and the commit advances (accepted required)."""
        if not isinstance(self.depths, dict):
            return []
        return [s for s in self.depths if s[0] not in self.dropped
                and s in {(r, l) for r, l, _ in self.segments}]


def _slots(values: Sequence[int]) -> jnp.ndarray:
    return jnp.asarray(np.asarray(values, np.int32).reshape(-1))


class Model:
    """The expected state: counters in a core PositionTable, changed only by the core's
    transitions; the plan bookkeeping (current, staged, dropped) kept here."""

    def __init__(self, scheme: Scheme, block_step: int, mrope: bool = False):
        self.scheme, self.block_step, self.mrope = scheme, block_step, mrope
        self.row_map = RowMap(4)
        self.table = core.init(4)
        self.current: Optional[ModelPlan] = None
        self.staged: Optional[ModelPlan] = None

    # -- the streams ----------------------------------------------------------------

    @property
    def requests(self) -> List[str]:
        return self.row_map.requests()

    def slot(self, rid: str, label: str) -> int:
        return self.row_map.find(rid, label)

    def counters(self, table: Optional[core.PositionTable] = None,
                 column: str = "counters") -> Dict[str, Dict[str, int]]:
        values = np.asarray(getattr(self.table if table is None else table, column)).tolist()
        return {rid: {label: values[self.slot(rid, label)] for label in LABELS}
                for rid in self.requests}

    def deltas(self, rid: str) -> Dict[str, int]:
        """The request's non-zero M-RoPE deltas (what publish lists)."""
        return {label: d for label, d in self.counters(column="deltas")[rid].items() if d}

    def ingest(self, rid: str) -> None:
        for label in LABELS:
            self.row_map.acquire(rid, label)
        if self.row_map.capacity > self.table.capacity:
            self.table = core.grow(self.table, self.row_map.capacity)

    def forget(self, rid: str) -> None:
        self.table = core.reset(self.table, _slots(self.row_map.release(rid)))

    def admit(self, rid: str, positions: Dict[str, int], epochs: Dict[str, int],
              deltas: Dict[str, int]) -> None:
        if positions:
            labels = list(positions)
            self.table = core.admit(self.table, _slots([self.slot(rid, l) for l in labels]),
                                    _slots([positions[l] for l in labels]),
                                    _slots([deltas.get(l, 0) for l in labels]),
                                    _slots([epochs.get(l, 0) for l in labels]))

    def set_deltas(self, rid: str, deltas: Dict[str, int]) -> None:
        if deltas:
            self.table = core.set_deltas(self.table, _slots([self.slot(rid, l) for l in deltas]),
                                         _slots(list(deltas.values())))

    def raise_to(self, rid: str, values: Dict[str, int]) -> None:
        if values:
            self.table = core.raise_to(self.table, _slots([self.slot(rid, l) for l in values]),
                                       _slots(list(values.values())))

    # -- the rules, through the core -------------------------------------------------

    def forked(self, table, forks, dropped=()) -> core.PositionTable:
        live = [f for f in forks if f[0] not in dropped]
        if not live:
            return table
        return core.fork(table, _slots([self.slot(rid, src) for rid, src, _ in live]),
                         _slots([self.slot(rid, dst) for rid, _, dst in live]))

    def committed(self, plan: ModelPlan, table,
                  accepted: Optional[Dict[Stream, int]] = None) -> Tuple[core.PositionTable, List[int]]:
        """The table after ``plan``'s commit (with ``accepted`` counts), and the slots whose
        bound is checked."""
        segments = [s for s in plan.segments if s[0] not in plan.dropped]
        if plan.draft:
            return table, []
        accepted = {s: a for s, a in (accepted or {}).items() if s[0] not in plan.dropped}
        segments = [s for s in segments if (s[0], s[1]) not in accepted]
        advance = plan.advance
        if isinstance(advance, int):
            streams = list(dict.fromkeys((rid, label) for rid, label, _ in segments))
            named = {stream: advance for stream in streams}
            segments = []
        else:
            named = {} if advance is None else {s: a for s, a in advance.items()
                                                if s[0] not in plan.dropped}
            segments = [s for s in segments if (s[0], s[1]) not in named]
        spans = [self.slot(rid, label) for rid, label, _ in segments]
        table = core.commit(table, _slots(spans), _slots([n for *_, n in segments]),
                            scheme=self.scheme, block_step=self.block_step)
        advanced = [self.slot(*stream) for stream in named]
        table = core.advance(table, _slots(advanced), _slots(list(named.values())))
        named = [self.slot(*stream) for stream in accepted]
        table = speculative_positions.accept(table, _slots(named), _slots(list(accepted.values())))
        live_forks = [f for f in plan.post_forks if f[0] not in plan.dropped]
        table = self.forked(table, live_forks)
        return table, spans + advanced + named + [self.slot(rid, dst) for rid, _, dst in live_forks]

    def positions(self, views, table, depths=None
                  ) -> Tuple[Optional[Dict[str, List[int]]], Dict[str, List[bool]]]:
        """Each plan label's positions, or None when a view passes max_seq_len (SEQUENTIAL:
        counter + tokens > max_seq_len, an empty view included; BLOCK: a non-empty view
        at a counter >= max_seq_len; a tree: a position at max_seq_len; M-RoPE: ``[3, n]``
        from counter + delta, which a non-empty view must also keep >= 0); and a draft
        step's live masks."""
        out, live = {}, {}
        for plan_label, records in views.items():
            counts = [n for *_, n in records]
            slots = _slots([self.slot(rid, label) for rid, label, _ in records])
            shape = (3, sum(counts)) if self.mrope else (sum(counts),)
            out_buffer = jnp.zeros(shape, jnp.int32)
            if isinstance(depths, int):
                got, mask = speculative_positions.plan_draft(table, slots, _slots(counts), out_buffer,
                                                   step=depths, max_seq_len=MAX_SEQ_LEN, offset=0)
                out[plan_label], live[plan_label] = got.tolist(), mask.tolist()
                continue
            if depths is not None and any((rid, label) in depths for rid, label, _ in records):
                per_token = [d for rid, label, n in records
                             for d in depths.get((rid, label), range(n))]
                # The bound is on the sequence index, counter + depth (a 1-D plan).
                index = speculative_positions.plan_tree(table, slots, _slots(counts), _slots(per_token),
                                              jnp.zeros(shape[-1:], jnp.int32)).tolist()
                if index and max(index) >= MAX_SEQ_LEN:
                    return None, {}
                out[plan_label] = speculative_positions.plan_tree(table, slots, _slots(counts),
                                                        _slots(per_token), out_buffer).tolist()
                continue
            # The bound is on the sequence index (the counter); M-RoPE's rotary start
            # (counter + delta) must not be negative.
            index = core.read(table, slots)
            rotary = index + core.read(table, slots, "deltas") if self.mrope else index
            for base, start, n in zip(index.tolist(), rotary.tolist(), counts):
                if (base + n > MAX_SEQ_LEN if self.scheme is Scheme.SEQUENTIAL
                        else n and base >= MAX_SEQ_LEN) or (n and start < 0):
                    return None, {}
            out[plan_label] = core.plan(table, slots, _slots(counts), out_buffer,
                                        scheme=self.scheme).tolist()
        return out, live

    def promote(self) -> None:
        """A staged plan becomes current when there is none (its pre-forks apply now)."""
        if self.current is None and self.staged is not None:
            self.current, self.staged = self.staged, None
            self.table = self.forked(self.table, self.current.pre_forks, self.current.dropped)


@st.composite
def step_specs(draw, live: List[str]):
    """(segments, views, pre_forks, post_forks, advance): mostly valid, sometimes not."""
    pool = list(live) if live and draw(MOSTLY) else list(RIDS)
    streams = draw(st.lists(st.tuples(st.sampled_from(pool), st.sampled_from(LABELS)),
                            min_size=1, max_size=4, unique=True))
    segments = [(rid, label, draw(st.integers(0, 5))) for rid, label in streams]
    layout = draw(st.sampled_from(["segments", "packed", "per_label"]))
    if layout == "segments":
        views = None
    elif layout == "packed":
        views = {"cfg": draw(st.permutations(segments))}
    else:
        views = {f"attn_{label}": [s for s in segments if s[1] == label] for label in LABELS}
    forks: Dict[str, List[Tuple[str, str, str]]] = {"pre": [], "post": []}
    if views is not None:
        for kind in ("pre", "post"):
            for rid in draw(st.lists(st.sampled_from(pool), max_size=2, unique=True)):
                # One direction, or a swap (both read before either is written).
                pairs = draw(st.sampled_from([[LABELS], [LABELS[::-1]], [LABELS, LABELS[::-1]]]))
                forks[kind] += [(rid, src, dst) for src, dst in pairs]
    # Explicit advances: small, or large enough to pass max_seq_len at commit.
    amounts = st.one_of(st.integers(0, 3), st.integers(MAX_SEQ_LEN // 2, MAX_SEQ_LEN + 2))
    advance = draw(st.one_of(st.none(), st.none(), amounts,
                             st.dictionaries(st.sampled_from(streams), amounts, max_size=2)))
    return segments, views, forks["pre"], forks["post"], advance


class ManagerMachine(RuleBasedStateMachine):
    scheme = Scheme.SEQUENTIAL
    block_step = 1
    device = "cpu"
    mrope_section: Optional[Tuple[int, int, int]] = None  # M-RoPE: positions [3, n]

    def __init__(self):
        super().__init__()
        rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4, max_position=1024,
                             mrope_section=self.mrope_section)
        config = PositionConfig(rope=rope, labels=LABELS, scheme=self.scheme,
                                block_step=self.block_step)
        self.mgr = RopeManager(config, self.device, max_seq_len=MAX_SEQ_LEN,
                               launcher="jax" if self.device == "cpu" else "auto")
        self.mrope = self.mrope_section is not None
        self.model = Model(self.scheme, self.block_step, self.mrope)
        self.snapshots: List[Tuple[str, Any, Dict[str, int]]] = []

    # -------------------------------------------------------------- helpers

    def live(self) -> List[str]:
        return sorted(self.model.requests)

    def pick(self, data) -> str:
        """Mostly a live request; sometimes any id (removed or never ingested)."""
        live = self.live()
        if live and data.draw(MOSTLY):
            return data.draw(st.sampled_from(live))
        return data.draw(st.sampled_from(RIDS))

    def expect_failure(self, call, *args, error=ValueError, **kwargs) -> None:
        before = self.mgr.state_snapshot()
        with pytest.raises(error):
            call(*args, **kwargs)
        assert self.mgr.state_snapshot() == before

    def _plan(self, spec, preplan: bool, explicit: Optional[List[List[int]]] = None,
              depths=None) -> None:
        """Plan ``spec``; ``explicit``: the M-RoPE rows of a one-label step's prompt chunk;
        ``depths``: a draft step's int (``PositionStep.draft_depth``) or ``{stream: tree}``
        (``PositionStep.tree``)."""
        segments, views, pre_forks, post_forks, advance = spec
        model = self.model
        pos_ids = None if explicit is None else torch.tensor(explicit, device=self.device)
        draft = isinstance(depths, int)
        step = PositionStep([Segment(*s) for s in segments], advance=advance, pos_ids=pos_ids,
                            draft_depth=depths if draft else None, tree=None if draft else depths)
        kv = None if views is None else {
            label: KVPlanOutput([KVView(*v) for v in records],
                                pre_forks=[Fork(*f) for f in pre_forks] if i == 0 else (),
                                post_forks=[Fork(*f) for f in post_forks] if i == 0 else ())
            for i, (label, records) in enumerate(views.items())}
        ctx = StepContext(tuple(dict.fromkeys(s[0] for s in segments)), is_preplan=preplan,
                          plan_results={} if kv is None else {"kv": kv})
        if views is None:
            views = {}
            for s in segments:
                views.setdefault(s[1], []).append(s)
        mentioned = ({s[0] for s in segments} | {f[0] for f in pre_forks + post_forks}
                     | {v[0] for records in views.values() for v in records})
        valid = mentioned <= set(model.requests)
        for forks in (pre_forks, post_forks):
            targets = {}
            valid &= all(targets.setdefault((rid, dst), src) == src for rid, src, dst in forks)
        if depths is not None:
            valid &= self.scheme is Scheme.SEQUENTIAL and (
                advance is None if isinstance(depths, int) else
                all(any((r, l) == stream and n == len(d) for records in views.values()
                        for r, l, n in records) for stream, d in depths.items())
                and all(n == len(depths[(r, l)]) for records in views.values()
                        for r, l, n in records if (r, l) in depths))
        plan = ModelPlan(segments, advance, views, pre_forks, post_forks, {}, step, ctx,
                         depths=depths)
        if valid:
            base = model.table
            if preplan and model.current is not None:
                base, _ = model.committed(model.current, base)
            base = model.forked(base, pre_forks)
            positions, plan.live = (model.positions(views, base, depths) if explicit is None
                                    else ({next(iter(views)): explicit}, {}))
            valid = positions is not None
        if not valid:
            self.expect_failure(self.mgr.plan, step, ctx)
            return
        got = self.mgr.plan(step, ctx)
        assert {label: t.tolist() for label, t in got.items()} == positions
        plan.positions = positions
        if preplan:
            model.staged = plan
        else:
            model.table = base
            model.current, model.staged = plan, None

    # -------------------------------------------------------------- rules

    @initialize()
    def ingest_two(self):
        for rid in RIDS[:2]:
            self.ingest(rid, {}, {})

    @rule(rid=st.sampled_from(RIDS),
          overrides=st.dictionaries(st.sampled_from(LABELS), POSITIONS, max_size=2),
          deltas=st.dictionaries(st.sampled_from(LABELS), DELTAS, max_size=2))
    def ingest(self, rid, overrides, deltas):
        deltas = deltas if self.mrope else {}
        if (any(v > MAX_SEQ_LEN for v in overrides.values())
                or any(abs(d) > MAX_SEQ_LEN for d in deltas.values())
                or self.moves_planned(rid, overrides) or self.moves_planned(rid, deltas, "deltas")):
            self.expect_failure(self.mgr.ingest_request, rid, overrides, deltas=deltas)
            return
        self.mgr.ingest_request(rid, overrides, deltas=deltas)
        self.model.ingest(rid)
        self.model.raise_to(rid, overrides)
        self.model.set_deltas(rid, deltas)

    @precondition(lambda self: self.mrope)
    @rule(data=st.data())
    def prefill_chunk(self, data):
        """A prompt chunk of a live request with explicit [3, n] positions (rope_index's)."""
        live = self.live()
        if not live:
            return
        rid, label = data.draw(st.sampled_from(live)), data.draw(st.sampled_from(LABELS))
        n = data.draw(st.integers(1, 4))
        rows = data.draw(st.lists(st.lists(st.integers(0, MAX_SEQ_LEN - 1), min_size=n,
                                           max_size=n), min_size=3, max_size=3))
        segment = [(rid, label, n)]
        self._plan((segment, None, [], [], None), preplan=data.draw(st.booleans()),
                   explicit=rows)

    @rule(data=st.data())
    def plan(self, data):
        self._plan(data.draw(step_specs(self.live())), preplan=False)

    @rule(data=st.data())
    def run_step(self, data):
        """The serving path: plan a step and commit it at once."""
        before = self.model.current
        self._plan(data.draw(step_specs(self.live())), preplan=False)
        if self.model.current is not before:
            self.commit()

    @rule(data=st.data())
    def preplan(self, data):
        self._plan(data.draw(step_specs(self.live())), preplan=True)

    @rule(data=st.data())
    def fork(self, data):
        """A CFG branch starts: uncond takes cond's counter, then runs n tokens."""
        rid = self.pick(data)
        n = data.draw(st.integers(1, 3))
        post = [(rid, "uncond", "cond")] if data.draw(st.booleans()) else []
        view = [(rid, "uncond", n)]
        spec = (view, {"cfg": view}, [(rid, "cond", "uncond")], post, None)
        self._plan(spec, preplan=data.draw(st.booleans()))

    @precondition(lambda self: self.model.current is not None or self.model.staged is not None)
    @rule()
    def commit(self):
        model = self.model
        plan, staged_first = model.current, False
        if plan is None:
            plan, staged_first = model.staged, True
        table = model.table
        if staged_first:
            table = model.forked(table, plan.pre_forks, plan.dropped)
        new, touched = model.committed(plan, table)
        if plan.trees() or any(np.asarray(new.counters)[touched] > MAX_SEQ_LEN):
            self.expect_failure(self.mgr.commit, plan.step, plan.ctx)
            return
        self.mgr.commit(plan.step, plan.ctx)
        self._committed(new, staged_first)

    def _committed(self, table, staged_first: bool) -> None:
        model = self.model
        model.table = table
        model.current = None
        if staged_first:
            model.staged = None
        else:
            model.promote()

    # -------------------------------------------------------------- speculative decoding

    @rule(data=st.data(), preplan=st.booleans())
    def verify(self, data, preplan):
        """A verify step: each stream's root and drafts, as a chain or a tree."""
        pool = self.live() if self.live() and data.draw(MOSTLY) else list(RIDS)
        streams = data.draw(st.lists(st.tuples(st.sampled_from(pool), st.sampled_from(LABELS)),
                                     min_size=1, max_size=3, unique=True))
        segments = [(rid, label, data.draw(st.integers(1, 5))) for rid, label in streams]
        depths = {}
        for rid, label, n in segments:
            if data.draw(st.booleans()):   # a tree: each token one deeper than some earlier one
                tree = [0]
                for i in range(1, n):
                    tree.append(tree[data.draw(st.integers(0, i - 1))] + 1)
                if not data.draw(MOSTLY):
                    tree = tree[:-1] or [0, 1]   # the wrong length
                depths[(rid, label)] = tuple(tree)
        packed = data.draw(st.booleans())
        views = {"spec": data.draw(st.permutations(segments))} if packed else None
        before = self.model.current
        self._plan((segments, views, [], [], None), preplan, depths=depths or None)
        if self.model.current is not before and data.draw(MOSTLY):
            self.commit_accepted(data)   # the serving path: verify, then accept at once

    @precondition(lambda self: self.model.current is not None or self.model.staged is not None)
    @rule(data=st.data())
    def commit_accepted(self, data):
        """Commit with accepted counts: the named streams keep their root and ``a`` drafts."""
        model = self.model
        plan, staged_first = model.current, False
        if plan is None:
            plan, staged_first = model.staged, True
        spans: Dict[Stream, int] = {}
        for rid, label, n in plan.segments:
            spans[(rid, label)] = spans.get((rid, label), 0) + n
        trees = plan.trees()
        deepest = {s: max(plan.depths[s]) if s in trees else n - 1 for s, n in spans.items()}
        named = data.draw(st.lists(st.sampled_from(list(spans)), unique=True, max_size=len(spans))
                          if spans else st.just([]))
        if data.draw(MOSTLY):
            named = list(dict.fromkeys(named + trees))
        # Mostly a count the drafts allow; sometimes one past them, or negative.
        accepted = {s: data.draw(st.integers(0, max(deepest[s], 0)) if data.draw(MOSTLY)
                                 else st.sampled_from([-1, deepest[s] + 1])) for s in named}
        live = {s: a for s, a in accepted.items() if s[0] not in plan.dropped}
        named_advance = plan.advance if isinstance(plan.advance, dict) else {}
        valid = (not plan.draft and not isinstance(plan.advance, int)
                 and all(s not in named_advance for s in live)
                 and all(0 <= a <= deepest[s] for s, a in live.items())
                 and set(trees) <= set(live))
        rejected = [s for s, a in live.items() if a + 1 != spans[s]]
        staged = None if staged_first else model.staged
        if valid and staged is not None and rejected:
            numbered = ({(r, l) for records in staged.views.values() for r, l, _ in records}
                        | {(r, l) for r, l, _ in staged.segments})
            numbered |= {(r, dst) for r, _, dst in staged.post_forks}
            valid = not any(s in numbered for s in rejected if s[0] not in staged.dropped)
        table = model.table
        if staged_first:
            table = model.forked(table, plan.pre_forks, plan.dropped)
        if valid:
            new, touched = model.committed(plan, table, accepted)
            valid = not any(np.asarray(new.counters)[touched] > MAX_SEQ_LEN)
        if not valid:
            event("commit_accepted: refused")
            self.expect_failure(self.mgr.commit, plan.step, plan.ctx, accepted=accepted)
            return
        self.mgr.commit(plan.step, plan.ctx, accepted=accepted)
        event("commit_accepted: taken" + (" (rejecting)" if rejected else ""))
        self._committed(new, staged_first)

    @rule(data=st.data(), preplan=st.booleans())
    def draft_step(self, data, preplan):
        """An EAGLE draft step: each stream's branches at counter + d, clamped, nothing committed."""
        pool = self.live() if self.live() and data.draw(MOSTLY) else list(RIDS)
        streams = data.draw(st.lists(st.tuples(st.sampled_from(pool), st.sampled_from(LABELS)),
                                     min_size=1, max_size=3, unique=True))
        segments = [(rid, label, data.draw(st.integers(1, 3))) for rid, label in streams]
        depth = data.draw(st.one_of(st.integers(0, 4), st.integers(MAX_SEQ_LEN - 4, MAX_SEQ_LEN)))
        self._plan((segments, None, [], [], None), preplan, depths=depth)
        plan = self.model.current
        if not preplan and plan is not None and plan.step.draft_depth == depth:
            for label, mask in plan.live.items():
                assert self.mgr.live(label).tolist() == mask
            event("draft_step: planned" + ("" if all(all(m) for m in plan.live.values())
                                            else " (clamped)"))

    @rule()
    def clear_preplan(self):
        self.mgr.clear_preplan()
        self.model.staged = None

    @rule(rid=st.sampled_from(RIDS))
    def publish(self, rid):
        info = self.mgr.publish(rid)
        expected = self.model.counters().get(rid)
        assert (info is None) if expected is None else (info.counters == expected)
        if info is not None:
            assert info.deltas == self.model.deltas(rid)

    @rule(rid=st.sampled_from(RIDS))
    def snapshot(self, rid):
        record = self.mgr.publish_snapshot_for_step(rid, "node", "walk")
        expected = self.model.counters().get(rid)
        assert (record is None) == (expected is None)
        if record is not None:
            self.snapshots.append((rid, record, (dict(expected), self.model.deltas(rid))))

    @rule(data=st.data())
    def publish_from_snapshot(self, data):
        if not self.snapshots:
            return
        rid, record, expected = data.draw(st.sampled_from(self.snapshots))
        info = self.mgr.publish_from_snapshot(rid, record, "node", "walk")
        assert (info.counters, info.deltas) == expected

    @rule(data=st.data(), published=st.dictionaries(st.sampled_from(LABELS), POSITIONS, max_size=2),
          epochs=st.dictionaries(st.sampled_from(LABELS), st.integers(0, 2), max_size=2),
          deltas=st.dictionaries(st.sampled_from(LABELS), DELTAS, max_size=2))
    def admit(self, data, published, epochs, deltas):
        rid = self.pick(data)
        before = self.mgr.state_snapshot()
        epochs = {label: e for label, e in epochs.items() if label in published}
        deltas = {label: d for label, d in deltas.items() if label in published and self.mrope}
        # The manager's own rollbacks: one writer, so the rewind order is the epoch order.
        rewinds = {label: ((self.mgr.writer, e),) for label, e in epochs.items() if e}
        outcome = self.mgr.admit_retrieve(rid, "node", "walk",
                                          PublishedPositionInfo(published, deltas, epochs,
                                                                rewinds=rewinds))
        valid = (rid in self.model.requests and all(v <= MAX_SEQ_LEN for v in published.values())
                 and all(abs(d) <= MAX_SEQ_LEN for d in deltas.values()))
        if valid:   # neither a newer epoch nor a larger position reaches a planned stream
            epochs_now = self.model.table.epochs
            newer = {label: e > int(epochs_now[self.model.slot(rid, label)])
                     for label, e in epochs.items()}
            valid = not any(newer.get(label) and self.planned(rid, label) for label in published)
            valid &= not self.moves_planned(rid, {label: v for label, v in published.items()
                                                  if epochs.get(label, 0) == int(
                                                      epochs_now[self.model.slot(rid, label)])})
        assert outcome.ok == valid and outcome.ready == valid, outcome
        if not valid:
            assert self.mgr.state_snapshot() == before
            return
        self.model.admit(rid, published, epochs, deltas)

    def planned(self, rid: str, label: str) -> bool:
        """Whether the current or staged plan numbers or forks the stream (it is frozen):
        its views (a draft step's too), its segments, its post-forks' sources and targets,
        and a staged plan's pre-forks' (a current plan's have been applied)."""
        for which, p in (("current", self.model.current), ("staged", self.model.staged)):
            if p is None or rid in p.dropped:
                continue
            forks = p.post_forks + (p.pre_forks if which == "staged" else [])
            streams = ({(s[0], s[1]) for s in p.segments}
                       | {(v[0], v[1]) for views in p.views.values() for v in views}
                       | {(r, end) for r, src, dst in forks for end in (src, dst)})
            if (rid, label) in streams:
                return True
        return False

    def moves_planned(self, rid: str, values: Dict[str, int], column: str = "counters") -> bool:
        """Whether ``counter = max(counter, value)`` (``column="deltas"``: setting the delta)
        would change a planned stream of an ingested ``rid``."""
        if rid not in self.model.requests:
            return False
        now = self.model.counters(column=column)[rid]
        return any(self.planned(rid, label) and (value > now[label] if column == "counters"
                                                 else value != now[label])
                   for label, value in values.items())

    @rule(data=st.data(), label=st.sampled_from(LABELS), to=POSITIONS)
    def rollback(self, data, label, to):
        """An engine's rewind between steps: refused while a plan holds the stream."""
        rid = self.pick(data)
        model = self.model
        if rid not in model.requests or to > MAX_SEQ_LEN or self.planned(rid, label):
            self.expect_failure(self.mgr.rollback, rid, label, to)
            return
        self.mgr.rollback(rid, label, to)
        model.table = core.rollback(model.table, _slots([model.slot(rid, label)]), _slots([to]))

    @rule(data=st.data(), prefix=st.dictionaries(st.sampled_from(LABELS), POSITIONS, max_size=2))
    def apply_cached_prefix(self, data, prefix):
        rid = self.pick(data)
        if (rid not in self.model.requests or any(v > MAX_SEQ_LEN for v in prefix.values())
                or self.moves_planned(rid, prefix)):
            self.expect_failure(self.mgr.apply_cached_prefix, rid, "node", "walk", None, prefix)
            return
        self.mgr.apply_cached_prefix(rid, "node", "walk", None, prefix)
        self.model.raise_to(rid, prefix)

    @rule(data=st.data(), free=st.booleans())
    def reset(self, data, free):
        rid = self.pick(data)
        if rid not in self.model.requests or (not free and any(
                self.planned(rid, label) and any(self.model.counters(column=c)[rid][label]
                                                 for c in ("counters", "deltas", "epochs"))
                for label in LABELS)):
            self.expect_failure(self.mgr.reset_request, rid, free)
            return
        self.mgr.reset_request(rid, free)
        if free:
            self._forget(rid)
        else:
            model = self.model
            model.table = core.reset(model.table, _slots([model.slot(rid, l) for l in LABELS]))

    @rule(data=st.data())
    def remove(self, data):
        rid = self.pick(data)
        self.mgr.remove_request(rid)
        self._forget(rid)

    def _forget(self, rid):
        if rid in self.model.requests:
            self.model.forget(rid)
        for plan in (self.model.current, self.model.staged):
            if plan is not None:
                plan.dropped.add(rid)

    @rule(data=st.data())
    def apply_qk(self, data):
        """Rotate q, k at the current plan's positions (a staged plan becomes current first)."""
        model = self.model
        plan = model.current if model.current is not None else model.staged
        labels = sorted(self.mgr.state_snapshot()["plan_labels"])
        if plan is not None and plan.positions and data.draw(MOSTLY):
            labels = sorted(plan.positions)
        label = data.draw(st.sampled_from(labels))
        if plan is None or label not in plan.positions:
            ones = torch.ones(1, 1, HEAD_DIM, device=self.device)
            self.expect_failure(self.mgr.apply_qk, ones, ones.clone(), label)
            return
        model.promote()
        positions = np.asarray(plan.positions[label], np.int64)  # [n], M-RoPE [3, n]
        tokens = data.draw(st.integers(0, positions.shape[-1]))
        seed = data.draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        q = (torch.randn(tokens, 2, HEAD_DIM, generator=gen) + 0.5).to(self.device)
        k = (torch.randn(tokens, 1, HEAD_DIM, generator=gen) + 0.5).to(self.device)
        rope = self.mgr.rope
        inv_freq, attention = oracle.serving_frequencies(rope)
        want = [oracle.rope_oracle(x.cpu().numpy(), positions[..., :tokens], inv_freq, attention,
                                   HEAD_DIM, False, rope.mrope_section, rope.mrope_interleaved)
                for x in (q, k)]
        positions = plan.positions[label]
        assert self.mgr.pos_ids(label).tolist() == positions
        self.mgr.apply_qk(q, k, label)
        np.testing.assert_allclose(q.cpu().numpy(), want[0], rtol=0, atol=2e-5)
        np.testing.assert_allclose(k.cpu().numpy(), want[1], rtol=0, atol=2e-5)

    @rule(data=st.data())
    def bad_call(self, data):
        """A call that must fail, between valid ones: nothing may move."""
        mgr = self.mgr
        live = self.live()
        rid = data.draw(st.sampled_from(live)) if live else "r0"
        calls = [
            lambda: mgr.plan(PositionStep([Segment("ghost", "cond", 1)]), StepContext()),
            lambda: mgr.plan(PositionStep([Segment(rid, "cond", -1)]), StepContext()),
            lambda: mgr.plan(PositionStep([Segment(rid, "cond", 1), Segment(rid, "cond", 1)]),
                             StepContext()),
            lambda: mgr.plan(PositionStep([Segment(rid, "cond", 1)],
                                          pos_ids=torch.tensor([MAX_SEQ_LEN], device=self.device)),
                             StepContext()),
            lambda: mgr.plan(PositionStep([Segment(rid, "cond", 1)], pos_ids=torch.full(
                (3, 1), MAX_SEQ_LEN if self.mrope else 0, device=self.device)), StepContext()),
            lambda: mgr.apply_cached_prefix(rid, None, None, None, {"cond": -1}),
            lambda: mgr.ingest_request(rid, {"image": 1}),
            lambda: mgr.position(rid, "image"),
            lambda: mgr.commit(PositionStep([Segment(rid, "uncond", 99)]), StepContext()),
            lambda: mgr.reset_request("ghost"),
        ]
        self.expect_failure(data.draw(st.sampled_from(calls)))

    # -------------------------------------------------------------- invariants

    @invariant()
    def agrees_with_the_model(self):
        mgr, model = self.mgr, self.model
        state = mgr.state_snapshot()
        model_counters = model.counters()
        assert set(mgr.requests()) == set(model_counters)
        expected = {(rid, label): value for rid, counters in model_counters.items()
                    for label, value in counters.items()}
        assert state["counters"] == expected
        table = np.asarray(mgr.table.counters).tolist()
        for column in ("epochs", "deltas"):
            values = np.asarray(getattr(model.table, column)).tolist()
            for rid in model_counters:
                want = tuple(values[model.slot(rid, label)] for label in LABELS)
                assert tuple(state[column][s] for s in state["requests"][rid]) == want, column
                assert tuple(np.asarray(getattr(mgr.table, column))[list(state["requests"][rid])]
                             .tolist()) == want, column
        for rid, counters in model_counters.items():
            assert mgr.publish(rid).counters == counters
            assert {label: mgr.position(rid, label) for label in LABELS} == counters
            assert [table[s] for s in state["requests"][rid]] == [counters[l] for l in LABELS]
        live_slots = {slot for slots in state["requests"].values() for slot in slots}
        for column in ("slots", "deltas", "epochs"):
            assert all(v == 0 for slot, v in enumerate(state[column]) if slot not in live_slots)
        assert max(state["slots"]) <= MAX_SEQ_LEN
        assert state["row_map"]["live"] == len(LABELS) * len(model_counters)
        for name in ("current", "staged"):
            plan, got = getattr(model, name), state[name]
            assert (plan is None) == (got is None), name
            if plan is not None:
                assert got["positions"] == {k: tuple(v) for k, v in plan.positions.items()}


class BlockManagerMachine(ManagerMachine):
    scheme = Scheme.BLOCK
    block_step = 3


class MropeManagerMachine(ManagerMachine):
    """M-RoPE: [3, n] plans at counter + delta on every row, deltas set at ingest, carried by
    admit / publish / snapshots / forks, explicit [3, n] prompt chunks."""
    mrope_section = (2, 1, 1)


class MropeBlockManagerMachine(MropeManagerMachine):
    scheme = Scheme.BLOCK
    block_step = 2


_FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TestManagerMatchesTheModel = ManagerMachine.TestCase
TestManagerMatchesTheModel.settings = settings(max_examples=100, stateful_step_count=50, **_FAST)

TestBlockManagerMatchesTheModel = BlockManagerMachine.TestCase
TestBlockManagerMatchesTheModel.settings = settings(max_examples=40, stateful_step_count=40, **_FAST)

TestMropeManagerMatchesTheModel = MropeManagerMachine.TestCase
TestMropeManagerMatchesTheModel.settings = settings(max_examples=50, stateful_step_count=50, **_FAST)

TestMropeBlockManagerMatchesTheModel = MropeBlockManagerMachine.TestCase
TestMropeBlockManagerMatchesTheModel.settings = settings(max_examples=20, stateful_step_count=40,
                                                         **_FAST)

