"""Our speculative positions and counters against vLLM's and SGLang's rules, step by step.

``jaxrope.testing.speculative_reference`` re-implements both engines' rules in plain
numpy (each function cites the file and function it follows). Here random serving runs
drive the reference and our implementation side by side, and every position and
counter must agree, with zero mismatches:

- **vLLM** (chain drafts, ``k`` in 1..8 per phase, trimmed near ``max_model_len``):
  scheduler positions and M-RoPE rows vs ``mgr.plan`` of the verify step and
  ``jaxrope.speculative_positions.plan_chain``; ``num_computed_tokens -= num_rejected`` vs
  ``commit(accepted=...)`` (or, for one stream in ten, committing every token and then
  ``rollback``, vLLM's own order); the EAGLE drafter's step-0 ids vs ``eagle_input_ids``
  and its later steps (clamped to 0 with a padding slot past the end) vs the manager's
  draft steps (``draft_depth=j - 1``, ``live``) and ``plan_draft`` on all three rows.
- **SGLang** (``topk`` 1 and 4, ``spec_steps`` 1..8): random draft trees built as its
  drafter builds them; ``build_tree_efficient``'s ``seq_len + depth`` vs the manager's
  depth-numbered verify step (depths from the tree's parents by our ``tree_depths``)
  and ``plan_tree``; ``VerifyTreeGreedy`` + ``seq_lens += accept_length + 1`` vs
  ``commit(accepted=...)``; draft forwards at ``seq_lens + i + 1`` vs draft steps.
- **Handoffs**: every stream lives on one of two managers and moves between them
  (publish, ingest, admit on the other, remove); some moves publish a stream whose
  drafts were committed, roll it back on the sender and publish again: the receiver
  must take the lower position (new epoch), and a late echo of the first record must
  not move it. M-RoPE deltas (non-zero) travel with every record.

Each run counts its stream-steps (a stream verified or drafted in one step); the total
is over 10^5 in a few tens of seconds on one CPU core.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, List

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrope as jr
from jaxrope import speculative_positions
from jaxrope.positions import PAD
from jaxrope.testing import speculative_reference as ref

torch = pytest.importorskip("torch")

from torch_bridge import PositionConfig, PositionManager, PositionStep, Segment, StepContext  # noqa: E402
from torch_bridge import streams as rules  # noqa: E402

MAX_LEN = 2048
LABEL = "text"
ROPE = jr.RopeConfig(head_dim=16, theta=1e6, mrope_section=(2, 3, 3), max_position=1 << 16)
MAX_DRAFT_STEPS = 8


@dataclasses.dataclass
class Stream:
    rid: str
    home: int
    delta: int
    counter: int            # the reference engine's committed tokens


class Cluster:
    """Two managers and the streams living on them; counts what it checked."""

    def __init__(self, rng: np.random.Generator, streams: int, prompt=(16, 1500)):
        self.rng = rng
        self.nodes = [PositionManager(PositionConfig(rope=ROPE), "cpu", max_seq_len=MAX_LEN)
                      for _ in range(2)]
        self.prompt = prompt
        self.ids = itertools.count()
        self.streams: List[Stream] = [self._new() for _ in range(streams)]
        self.slots: Dict[tuple, int] = {}
        self.checked = {"stream_steps": 0, "handoffs": 0, "draft_handoffs": 0, "rollbacks": 0,
                        "clamped": 0}

    def _new(self) -> Stream:
        home, counter = int(self.rng.integers(2)), int(self.rng.integers(*self.prompt))
        # A prompt of L tokens leaves delta = max + 1 - L >= 1 - L: counter + delta >= 1.
        s = Stream(f"r{next(self.ids)}", home, int(self.rng.integers(max(-300, 1 - counter), 50)),
                   counter)
        self.nodes[s.home].ingest_request(s.rid, overrides={LABEL: s.counter},
                                          deltas={LABEL: s.delta})
        return s

    def replace(self, stream: Stream) -> None:
        self.nodes[stream.home].remove_request(stream.rid)
        self.streams[self.streams.index(stream)] = self._new()

    def on(self, node: int) -> List[Stream]:
        return [s for s in self.streams if s.home == node]

    def slot(self, node: int, rid: str) -> int:
        key = (node, rid)
        if key not in self.slots:
            self.slots[key] = self.nodes[node].state_snapshot()["requests"][rid][0]
        return self.slots[key]

    def table_args(self, node: int, streams: List[Stream], size: int):
        slots = np.full(size, PAD, np.int32)
        slots[:len(streams)] = [self.slot(node, s.rid) for s in streams]
        return self.nodes[node].table, jnp.asarray(slots)

    def check_counters(self, node: int, streams: List[Stream]) -> None:
        counters = self.nodes[node].state_snapshot()["counters"]
        got = [counters[(s.rid, LABEL)] for s in streams]
        assert got == [s.counter for s in streams]

    def hand_off(self, stream: Stream, with_drafts_to: int = -1) -> None:
        """Move ``stream`` to the other node. ``with_drafts_to >= 0``: the sender has committed
        its drafts up to that position; it publishes them, rolls back to the stream's
        counter and publishes again."""
        sender, receiver = self.nodes[stream.home], self.nodes[1 - stream.home]
        stale = None
        if with_drafts_to >= 0:
            stale = sender.publish(stream.rid)
            assert stale.counters[LABEL] == with_drafts_to
            receiver.ingest_request(stream.rid)
            assert receiver.admit_retrieve(stream.rid, "sender", None, stale).ok
            sender.rollback(stream.rid, LABEL, stream.counter)
            self.checked["draft_handoffs"] += 1
        info = sender.publish(stream.rid)
        receiver.ingest_request(stream.rid)
        assert receiver.admit_retrieve(stream.rid, "sender", None, info).ok
        if stale is not None:   # a late echo of the record with the drafts
            assert receiver.admit_retrieve(stream.rid, "sender", None, stale).ok
        sender.remove_request(stream.rid)
        self.slots.pop((stream.home, stream.rid), None)
        stream.home = 1 - stream.home
        position, delta, _ = receiver.publish(stream.rid).record(LABEL)
        assert (position, delta) == (stream.counter, stream.delta)
        self.checked["handoffs"] += 1


def _ctx(streams):
    return StepContext(tuple(s.rid for s in streams))


@jax.jit
def _core_chain(table, slots, drafts):
    return speculative_positions.plan_chain(table, slots, drafts, jnp.zeros((3, slots.shape[0] * 9), jnp.int32))


@jax.jit
def _core_tree(table, slots, counts, depths):
    return speculative_positions.plan_tree(table, slots, counts, depths, jnp.zeros((3, depths.shape[0]), jnp.int32))


@jax.jit
def _core_drafts(table, slots, counts, offset):
    """Draft steps 1 .. MAX_DRAFT_STEPS - 1 at once, M-RoPE rows and live masks."""
    out = jnp.zeros((3, slots.shape[0] * 4), jnp.int32)
    return jax.vmap(lambda j: speculative_positions.plan_draft(table, slots, counts, out, step=j,
                                                     max_seq_len=MAX_LEN, offset=offset)
                    )(jnp.arange(1, MAX_DRAFT_STEPS))


def _padded(values, size, fill=0):
    out = np.full(size, fill, np.int32)
    out[:len(values)] = values
    return jnp.asarray(out)


# ------------------------------------------------------------------------------ vLLM


def run_vllm(cluster: Cluster, steps: int, batch: int) -> None:
    rng = cluster.rng
    k = 1
    for step in range(steps):
        if step % 50 == 0:
            k = int(rng.integers(1, MAX_DRAFT_STEPS + 1))     # num_speculative_tokens
        for node in (0, 1):
            streams = cluster.on(node)
            n = np.array([s.counter for s in streams], np.int64)
            scheduled, spec = ref.vllm_schedule(n, np.full(len(n), k), MAX_LEN)
            done = [s for s, m in zip(streams, scheduled) if m <= 0]
            for s in done:
                cluster.replace(s)
            if done or not streams:
                continue
            mgr = cluster.nodes[node]
            want = ref.vllm_positions(n, scheduled)
            plan = PositionStep(tuple(Segment(s.rid, LABEL, int(m)) for s, m in zip(streams, scheduled)))
            deltas = np.array([s.delta for s in streams])
            # An M-RoPE manager: the three rows at counter + delta.
            assert (mgr.plan(plan, _ctx(streams))[LABEL].tolist()
                    == ref.vllm_mrope_positions(n, scheduled, deltas).tolist())
            rows = _core_chain(*cluster.table_args(node, streams, batch), _padded(spec, batch))
            assert np.array_equal(np.asarray(rows)[:, :len(want)],
                                  ref.vllm_mrope_positions(n, scheduled, deltas))
            # The target samples a + 1 tokens: a of the drafts accepted, then its own.
            accepted = np.minimum(rng.geometric(0.35, len(n)) - 1, spec)
            n_scheduled = n + scheduled                          # _update_after_schedule
            truth = ref.vllm_update_from_output(n_scheduled, spec, accepted + 1)
            full = rng.random(len(n)) < 0.1                      # vLLM's order: commit all, take back
            mgr.commit(plan, _ctx(streams), accepted={(s.rid, LABEL): int(a) for s, a, f in
                                                      zip(streams, accepted, full) if not f})
            if step % 4 == 0:
                _check_step0_ids(rng, want, scheduled, accepted, batch)
            for s, t, f, m in zip(streams, truth, full, n_scheduled):
                s.counter = int(t)
                if f:
                    if rng.random() < 0.3:
                        cluster.hand_off(s, with_drafts_to=int(m))
                    else:
                        mgr.rollback(s.rid, LABEL, s.counter)
                    cluster.checked["rollbacks"] += 1
            cluster.check_counters(node, [s for s in streams if s.home == node])
            cluster.checked["stream_steps"] += len(streams)
            # The drafter, from the last accepted token of each request.
            last = np.cumsum(scheduled) - scheduled + accepted
            _check_vllm_drafts(cluster, node, streams, want, last, k, deltas, batch)
        for s in list(cluster.streams):
            if rng.random() < 0.02:
                cluster.hand_off(s)


_eagle_input_ids = jax.jit(speculative_positions.eagle_input_ids)


def _check_step0_ids(rng, positions, scheduled, accepted, batch):
    """The drafter's step-0 ids, in the core's static bucket: the padding repeats the last
    id, so the shifted entry before it is what vLLM leaves there (its docstring's ``c3``)."""
    ids = rng.integers(0, 50000, len(positions))
    last = (np.cumsum(scheduled) - scheduled + accepted).astype(np.int32)
    nxt = rng.integers(0, 50000, len(scheduled))
    got = _eagle_input_ids(_padded(ids, batch * 9, fill=ids[-1]), _padded(nxt, batch),
                           _padded(last, batch, fill=PAD))
    assert np.asarray(got)[:len(ids)].tolist() == ref.vllm_eagle_input_ids(ids, nxt, last).tolist()


def _check_vllm_drafts(cluster, node, streams, target_positions, last, k, deltas, batch):
    """Draft steps 1 .. k - 1 of the streams still on ``node`` (one handed off this step
    drafts on its new node from the next step)."""
    stayed = np.array([i for i, s in enumerate(streams) if s.home == node], np.int64)
    if not len(stayed):
        return
    here = [streams[i] for i in stayed]
    mgr = cluster.nodes[node]
    want = ref.vllm_draft_positions(target_positions, last, k, MAX_LEN, deltas=deltas)
    rows, live = _core_drafts(*cluster.table_args(node, here, batch),
                              _padded(np.ones(len(here)), batch), -1)
    rows, live = np.asarray(rows), np.asarray(live)
    segments = tuple(Segment(s.rid, LABEL, 1) for s in here)
    for j, (want_rows, valid) in enumerate(want, start=1):
        step = PositionStep(segments, draft_depth=j - 1)
        assert mgr.plan(step, _ctx(here))[LABEL].tolist() == want_rows[:, stayed].tolist()
        assert mgr.live(LABEL).tolist() == valid[stayed].tolist()
        assert np.array_equal(rows[j - 1][:, :len(here)], want_rows[:, stayed])
        assert live[j - 1][:len(here)].tolist() == valid[stayed].tolist()
        cluster.checked["clamped"] += int((~valid[stayed]).sum())
        cluster.checked["stream_steps"] += len(here)


# ------------------------------------------------------------------------------ SGLang


def _parents(tree: ref.SglangTree) -> np.ndarray:
    """Each verify token's parent within its request (-1: the root): the engine's reading
    of SGLang's ``parent_list`` / ``selected_index``."""
    b, draft = tree.draft_tokens.shape
    width = tree.topk + (tree.spec_steps - 1) * tree.topk ** 2
    lookup = np.full((b, width), -1, np.int64)
    np.put_along_axis(lookup, tree.selected_index, np.arange(draft - 1)[None].repeat(b, 0), 1)
    bucket = tree.selected_index // tree.topk      # 0: a child of the root
    parent_list = tree.parent_list if tree.parent_list.shape[1] else np.full((b, 1), -1)
    parent_abs = np.take_along_axis(parent_list, bucket, 1)
    parent = np.where(bucket == 0, 0,
                      np.take_along_axis(lookup, np.maximum(parent_abs, 0), 1) + 1)
    return np.concatenate([np.full((b, 1), -1), parent], 1)


def _target_predictions(rng, tree: ref.SglangTree, next_token: np.ndarray) -> np.ndarray:
    """The target's argmax at each node: often one of its children's draft, else random."""
    predict = rng.integers(0, 16, tree.draft_tokens.shape)
    child = np.take_along_axis(tree.draft_tokens, np.maximum(next_token, 0), 1)
    return np.where((next_token >= 0) & (rng.random(next_token.shape) < 0.7), child, predict)


def run_sglang(cluster: Cluster, steps: int, batch: int, topk: int) -> None:
    rng = cluster.rng
    spec_steps, num_draft = 1, 2
    for step in range(steps):
        if step % 40 == 0:
            spec_steps = int(rng.integers(1, MAX_DRAFT_STEPS + 1))
            most = topk + (spec_steps - 1) * topk * topk + 1
            num_draft = int(rng.integers(2, min(most, 16) + 1)) if topk > 1 else spec_steps + 1
        for node in (0, 1):
            streams = cluster.on(node)
            done = [s for s in streams if s.counter + num_draft + spec_steps + 1 >= MAX_LEN]
            for s in done:
                cluster.replace(s)
            if done or not streams:
                continue
            mgr = cluster.nodes[node]
            seq_lens = np.array([s.counter for s in streams], np.int64)
            tree = ref.sglang_draft_tree(rng, rng.integers(0, 16, len(streams)), topk, spec_steps,
                                         num_draft, vocab=16)
            want, next_token, next_sibling, _ = ref.sglang_build_tree(tree, seq_lens)
            parents = _parents(tree)
            flat = (parents + np.where(parents >= 0, np.arange(len(streams))[:, None] * num_draft, 0))
            depths = rules.tree_depths(flat.reshape(-1)).reshape(len(streams), num_draft)
            segments = tuple(Segment(s.rid, LABEL, num_draft) for s in streams)
            # A tree as the engine's [streams, draft] array, or every other step a mapping.
            numbered = (None if topk == 1 else depths if step % 2 else
                        {(s.rid, LABEL): tuple(d) for s, d in zip(streams, depths.tolist())})
            plan = PositionStep(segments, tree=numbered)
            deltas = np.array([s.delta for s in streams])
            assert (mgr.plan(plan, _ctx(streams))[LABEL].tolist()
                    == ref.sglang_mrope(want, deltas).tolist())
            table, slots = cluster.table_args(node, streams, batch)
            rows = _core_tree(table, slots, _padded(np.full(len(streams), num_draft), batch),
                              _padded(depths.reshape(-1), batch * 16))
            assert np.array_equal(np.asarray(rows)[:, :want.size], ref.sglang_mrope(want, deltas))
            accept = ref.sglang_verify_greedy(tree.draft_tokens, next_token, next_sibling,
                                              _target_predictions(rng, tree, next_token), spec_steps)
            truth = ref.sglang_accept(seq_lens, accept)
            # One stream in ten commits optimistically (a chain: every token; a tree: its
            # deepest branch) and is rolled back to what SGLang accepted.
            full = rng.random(len(streams)) < 0.1
            deepest = depths.max(axis=1)
            committed = {(s.rid, LABEL): int(d if f else a)
                         for s, a, f, d in zip(streams, accept, full, deepest) if topk > 1 or not f}
            if len(committed) == len(streams) and step % 2:    # every stream: one count a segment
                committed = np.array(list(committed.values()))
            mgr.commit(plan, _ctx(streams), accepted=committed)
            for s, t, f, n, d in zip(streams, truth, full, seq_lens, deepest):
                s.counter = int(t)
                if f:
                    if rng.random() < 0.3:
                        cluster.hand_off(s, with_drafts_to=int(n) + int(d) + 1)
                    else:
                        mgr.rollback(s.rid, LABEL, s.counter)
                    cluster.checked["rollbacks"] += 1
            streams = [s for s in streams if s.home == node]
            cluster.check_counters(node, streams)
            cluster.checked["stream_steps"] += len(streams)
            _check_sglang_drafts(cluster, node, streams, topk, spec_steps, batch)
        for s in list(cluster.streams):
            if rng.random() < 0.02:
                cluster.hand_off(s)


def _check_sglang_drafts(cluster, node, streams, topk, spec_steps, batch):
    if not streams:
        return
    mgr = cluster.nodes[node]
    seq_lens = np.array([s.counter for s in streams], np.int64)
    deltas = np.array([s.delta for s in streams])
    rows, _ = _core_drafts(*cluster.table_args(node, streams, batch),
                           _padded(np.full(len(streams), topk), batch), 0)
    rows = np.asarray(rows)
    segments = tuple(Segment(s.rid, LABEL, topk) for s in streams)
    for i, want in enumerate(ref.sglang_draft_positions(seq_lens, topk, spec_steps)):
        step = PositionStep(segments, draft_depth=i + 1)
        want_rows = ref.sglang_mrope(want.reshape(len(streams), topk), deltas)
        assert mgr.plan(step, _ctx(streams))[LABEL].tolist() == want_rows.tolist()
        assert np.array_equal(rows[i][:, :want.size], want_rows)
        cluster.checked["stream_steps"] += len(streams)


# ------------------------------------------------------------------------------ the runs


@pytest.mark.parametrize("engine,streams,steps", [("vllm", 48, 400), ("sglang-topk4", 24, 250),
                                                  ("sglang-topk1", 24, 250)])
def test_positions_and_counters_match_the_engines_rules_through_handoffs(rng, engine, streams, steps):
    cluster = Cluster(rng, streams, prompt=(16, 1800) if engine == "vllm" else (16, 1500))
    batch = streams   # the core's static bucket: every stream on one node at most
    if engine == "vllm":
        run_vllm(cluster, steps, batch)
    else:
        run_sglang(cluster, steps, batch, topk=int(engine[-1]))
    checked = cluster.checked
    assert checked["handoffs"] > 20 and checked["rollbacks"] > 20 and checked["draft_handoffs"] > 5
    if engine == "vllm":
        assert checked["clamped"] > 0
    test_positions_and_counters_match_the_engines_rules_through_handoffs.totals[engine] = checked


test_positions_and_counters_match_the_engines_rules_through_handoffs.totals = {}


def test_the_runs_cover_over_a_hundred_thousand_stream_steps():
    totals = test_positions_and_counters_match_the_engines_rules_through_handoffs.totals
    if len(totals) < 3:
        pytest.skip("runs with the three engine runs (select the whole module)")
    assert sum(t["stream_steps"] for t in totals.values()) >= 100_000, totals


# ------------------------------------------------------------------------------ the tree rule


def _depth_lists(rng, count):
    """Random depth lists: trees built from random earlier parents, half of them then
    changed in one entry (a skipped level, a second root, a negative or huge depth)."""
    lists = []
    for _ in range(count):
        n = int(rng.integers(1, 9))
        depths = [0]
        for t in range(1, n):
            depths.append(depths[int(rng.integers(0, t))] + 1)
        if rng.random() < 0.5:
            depths[int(rng.integers(0, n))] = int(rng.choice([-1, 0, 1, 2, 5, 2 ** 31 - 1]))
        lists.append(depths)
    return lists


def test_both_executors_accept_exactly_the_depth_lists_that_have_parents_before_them(rng):
    from torch_bridge.draft_trees import check_trees

    lists = _depth_lists(rng, 600)
    counts = np.array([len(d) for d in lists], np.int32)
    core = np.asarray(speculative_positions.valid_trees(jnp.asarray(counts),
                                              jnp.asarray(np.concatenate(lists), jnp.int32)))
    width = int(counts.max())
    rows = np.zeros((len(lists), width), np.int64)
    for i, depths in enumerate(lists):
        rows[i, :len(depths)] = depths
    kinds = {True: 0, False: 0}
    for i, depths in enumerate(lists):
        parents = ref.parents_first(depths)
        kinds[parents is not None] += 1
        try:
            check_trees(rows[i:i + 1, :len(depths)], None, str)
            bridge = True
        except ValueError:
            bridge = False
        assert bridge == core[i] == (parents is not None), depths
    # The valid lists' parents give back their depths in both executors (one flat layout).
    valid_rows = [i for i, d in enumerate(lists) if ref.parents_first(d) is not None]
    flat, start = [], 0
    for i in valid_rows:
        flat += [p if p < 0 else p + start for p in ref.parents_first(lists[i])]
        start += len(lists[i])
    want = [d for i in valid_rows for d in lists[i]]
    assert rules.tree_depths(np.asarray(flat)).tolist() == want
    assert speculative_positions.tree_depths(jnp.asarray(flat, jnp.int32)).tolist() == want
    # The valid lists at once, padded rows, and their deepest depths.
    checked, deepest = check_trees(rows[valid_rows], counts[valid_rows].astype(np.int64), str)
    assert deepest.tolist() == [max(lists[i]) for i in valid_rows]
    assert min(kinds.values()) > 100, kinds
