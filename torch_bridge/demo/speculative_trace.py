"""The speculative-decoding trace (``python -m torch_bridge.demo --speculative``).

Two nodes serve requests with a draft model and a target model (two tiny attention
layers with their own weights and KV caches, the model's real RoPE config), every
attention output checked against a float64 recompute of the stream from scratch:

1. **prefill** on node ``A``: each prompt in one step through the target and the draft
   layer (one plan, two plan labels).
2. each **round** drafts ``k`` tokens per request (``k`` random in 1..4): ``k + 1`` draft
   steps (``PositionStep(draft_depth=j - 1)``, committing nothing), planned into the static
   buffer of a CUDA-graph bucket, whose padding rows must keep their values; the draft
   layer reads the root and each draft it proposed (the last one too, so that its KV
   cache covers whatever is accepted).
3. **verify**: one step of the root and the ``k`` drafts per request, numbered
   ``counter + arange(k + 1)``; a random number ``a`` of drafts is accepted.
   ``commit(accepted=...)``, or for one request in four the commit of every token
   followed by ``rollback(rid, "main", n + a + 1)`` (vLLM's order). Both KV caches drop
   the rejected tokens; every counter must equal its KV length. The verify step runs
   in a bucket of its own (one compile of the rotation for every round).
4. **handoff after a rollback** (round 3): ``A`` commits ``r1``'s drafts, publishes them,
   ``B`` admits them; ``A`` rolls back (a new publish epoch) and publishes again; ``B``
   must take the lower position, takes the KV over and continues ``r1``; a late echo of
   the first record (round 4) must not move it.

``--inject-fault`` drops the epoch from ``A``'s second record (a rollback that does not
start an epoch): ``B`` keeps the drafts' position, its next verify step rotates at the
wrong positions and the run FAILs.

Example:
  >>> import contextlib, io, torch
  >>> from jaxrope.config import RopeConfig
  >>> out = io.StringIO()
  >>> with contextlib.redirect_stdout(out):
  ...     rows = SpeculativeTrace(RopeConfig(head_dim=16), torch.device("cpu"), 0, False).run(5)
  >>> [r.failures for r in rows if r.failures], any("handoff r1" in e for r in rows for e in r.events)
  ([], True)
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from jaxrope.config import RopeConfig
from torch_bridge.config import PositionConfig
from torch_bridge.demo.model import KV_HEADS, TOLERANCE, VOCAB, Layer, Stream
from torch_bridge.demo.node import StepRow
from torch_bridge.engine_types import (GraphBucket, GraphSlot, KVPlanOutput, KVView, PositionStep,
                                       Segment, StepContext)
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.rope_manager import RopeManager

__all__ = ["DRAFT_BUCKET", "HANDOFF_ROUND", "MIN_ROUNDS", "SpeculativeTrace", "VERIFY_BUCKET"]

LABEL = "main"
DRAFT_BUCKET = GraphBucket("draft", batch_size=4, num_tokens=4)
VERIFY_BUCKET = GraphBucket("verify", batch_size=4, num_tokens=16)   # up to 3 x (4 + 1)
PROMPTS = {"r0": 21, "r1": 34, "r2": 9}
HANDOFF_ROUND = 3           # r1 moves from A to B after a rollback
MIN_ROUNDS = HANDOFF_ROUND + 2   # the late echo arrives the round after


@dataclasses.dataclass
class Request:
    rid: str
    node: str
    ids: List[int]           # committed tokens (in both KV caches)
    root: int                # the token sampled last: not yet in a KV cache


class SpeculativeTrace:
    """Requests drafted, verified, rolled back and handed over between nodes ``A`` and ``B``."""

    def __init__(self, rope: RopeConfig, device: torch.device, seed: int, inject_fault: bool):
        self.rng = np.random.default_rng(seed)
        self.target = Layer(rope, device, self.rng)
        self.drafter = Layer(rope, device, self.rng)
        self.device, self.inject_fault = device, inject_fault
        config = PositionConfig(rope=rope, labels=(LABEL,))
        self.mgrs = {name: RopeManager(config, device, max_seq_len=4096)
                     for name in "AB"}
        # {(node, rid): stream} of each layer's KV cache
        self.caches: Dict[str, Dict[Tuple[str, str], Stream]] = {"target": {}, "drafter": {}}
        self.requests = [Request(rid, "A", self._tokens(n), self._tokens(1)[0])
                         for rid, n in PROMPTS.items()]
        self.graph_pos: Dict[str, torch.Tensor] = {}
        self.stale: Optional[PublishedPositionInfo] = None
        self.mgr = self.mgrs["A"]

    def _tokens(self, n: int) -> List[int]:
        return self.rng.integers(0, VOCAB, n).tolist()

    def _empty(self) -> Stream:
        d = self.target.head_dim
        empty = torch.zeros((0, KV_HEADS, d), dtype=torch.float32, device=self.device)
        return Stream([], empty, empty.clone())

    # ------------------------------------------------------------------ the trace

    def run(self, rounds: int) -> List[StepRow]:
        """Prefill, then ``rounds`` rounds of draft / verify / accept; every row, printed."""
        rows = [self._prefill()]
        for r in range(1, rounds + 1):
            for node in "AB":
                batch = [q for q in self.requests if q.node == node]
                if batch:
                    rows += self._round(r, node, batch)
        return rows

    def _prefill(self) -> StepRow:
        row = StepRow(0, "A")
        mgr = self.mgrs["A"]
        kv = {"target": KVPlanOutput(tuple(KVView(q.rid, LABEL, len(q.ids)) for q in self.requests)),
              "drafter": KVPlanOutput(tuple(KVView(q.rid, LABEL, len(q.ids)) for q in self.requests))}
        step = PositionStep(tuple(Segment(q.rid, LABEL, len(q.ids)) for q in self.requests))
        ctx = StepContext(tuple(q.rid for q in self.requests), plan_results={"kv": kv})
        for q in self.requests:
            mgr.ingest_request(q.rid)
            for cache in self.caches.values():
                cache["A", q.rid] = self._empty()
        positions = mgr.plan(step, ctx)
        for name, layer in (("target", self.target), ("drafter", self.drafter)):
            self._attend(row, "A", name, layer, [(q.rid, q.ids) for q in self.requests], name)
        mgr.commit(step, ctx)
        row.requests, row.tokens = len(self.requests), step.num_tokens
        row.positions = _span(positions["target"])
        row.events.append("prefill " + " ".join(f"{q.rid}[0:{len(q.ids)}]" for q in self.requests))
        self._check_lengths(row, "A", self.requests)
        print_row(row)
        return row

    def _round(self, r: int, node: str, batch: List[Request]) -> List[StepRow]:
        mgr = self.mgrs[node]
        rows = []
        if r == HANDOFF_ROUND + 1 and node == "B" and self.stale is not None:
            rows.append(self._late_echo(r))
        k = int(self.rng.integers(1, 5))
        drafts = {q.rid: [] for q in batch}
        for j in range(1, k + 2):     # draft steps: the root, then each draft
            row = StepRow(r, node)
            tokens = [(q.rid, [q.root] if j == 1 else [drafts[q.rid][-1]]) for q in batch]
            self._draft_step(row, node, batch, tokens, j)
            for q in batch:
                drafts[q.rid].append(self._tokens(1)[0])
            rows.append(print_row(row))
        row = StepRow(r, node)
        verify = [(q.rid, [q.root] + drafts[q.rid][:k]) for q in batch]
        step = PositionStep(tuple(Segment(rid, LABEL, len(ids)) for rid, ids in verify))
        ctx = StepContext(tuple(q.rid for q in batch), graph_slot=GraphSlot(VERIFY_BUCKET, 0))
        n = {q.rid: mgr.position(q.rid, LABEL) for q in batch}
        positions = mgr.plan(step, ctx)[LABEL][:step.num_tokens]
        self._attend(row, node, "target", self.target, verify, LABEL, graph=VERIFY_BUCKET)
        handoff = r == HANDOFF_ROUND and node == "A" and any(q.rid == "r1" for q in batch)
        # The handed-off request rejects a draft at least: its rollback moves back.
        accepted = {q.rid: int(self.rng.integers(0, k if handoff and q.rid == "r1" else k + 1))
                    for q in batch}
        full = {q.rid for q in batch if (handoff and q.rid == "r1") or self.rng.random() < 0.25}
        mgr.commit(step, ctx, accepted={(rid, LABEL): a for rid, a in accepted.items()
                                        if rid not in full})
        row.requests, row.tokens, row.positions = len(batch), step.num_tokens, _span(positions)
        row.events.append(f"verify k={k} accepted " + " ".join(
            f"{rid}:{a}" + ("*" if rid in full else "") for rid, a in accepted.items()))
        for q in batch:
            keep = n[q.rid] + accepted[q.rid] + 1
            q.ids = (q.ids + [q.root] + drafts[q.rid])[:keep]
            q.root = self._tokens(1)[0]
            for name in self.caches:
                self._truncate(node, name, q.rid, keep)
            if q.rid in full and not (handoff and q.rid == "r1"):
                mgr.rollback(q.rid, LABEL, keep)
        if handoff:
            self._handoff(row, next(q for q in batch if q.rid == "r1"))
        self._check_lengths(row, node, [q for q in batch if q.node == node])
        rows.append(print_row(row))
        return rows

    # ------------------------------------------------------------------ steps

    def _draft_step(self, row: StepRow, node: str, batch: List[Request],
                    tokens: Sequence[Tuple[str, List[int]]], j: int) -> None:
        """Draft step ``j``: each request's token at ``counter + j - 1``, in the graph bucket."""
        mgr = self.mgrs[node]
        step = PositionStep(tuple(Segment(q.rid, LABEL, 1) for q in batch), draft_depth=j - 1)
        lease = GraphSlot(DRAFT_BUCKET, slot=0)
        ctx = StepContext(tuple(q.rid for q in batch), graph_slot=lease)
        before = {q.rid: mgr.position(q.rid, LABEL) for q in batch}
        previous = self.graph_pos.get(node)
        old = None if previous is None else previous.clone()
        positions = mgr.plan(step, ctx)[LABEL]
        live = len(batch)
        if previous is not None and not torch.equal(positions[live:], old[live:]):
            row.failures.append(f"graph tail changed: {old[live:].tolist()} -> "
                                f"{positions[live:].tolist()}")
        self.graph_pos[node] = positions
        self._attend(row, node, "drafter", self.drafter, tokens, LABEL, graph=DRAFT_BUCKET)
        mgr.commit(step, ctx)
        if any(mgr.position(q.rid, LABEL) != before[q.rid] for q in batch):
            row.failures.append("a draft step moved a counter")
        row.requests, row.tokens, row.positions = live, live, _span(positions[:live])
        row.events.append(f"draft step {j} ({DRAFT_BUCKET.walk} bucket {live}/"
                          f"{DRAFT_BUCKET.num_tokens})")

    def _attend(self, row: StepRow, node: str, cache: str, layer: Layer,
                views: Sequence[Tuple[str, List[int]]], label: str,
                graph: Optional[GraphBucket] = None) -> None:
        """Project, rotate in place at plan label ``label`` (in ``graph``'s static q/k buffers
        when given), append the keys, attend, check."""
        mgr = self.mgrs[node]
        q, k, v = layer.project([t for _, ids in views for t in ids])
        n = q.shape[0]
        if graph is not None:
            qs, ks = self.target.static_qk((node, graph), graph.num_tokens)
            qs[:n].copy_(q)
            ks[:n].copy_(k)
            mgr.apply_qk(qs, ks, label)   # the replay rotates the whole bucket
            q, k = qs[:n], ks[:n]
        else:
            mgr.apply_qk(q, k, label)
        start = 0
        for rid, ids in views:
            stream = self.caches[cache][node, rid]
            stop = start + len(ids)
            stream.ids.extend(ids)
            stream.k = torch.cat([stream.k, k[start:stop]])
            stream.v = torch.cat([stream.v, v[start:stop]])
            out = layer.attend(q[start:stop], stream).double().cpu().numpy()
            error = float(np.max(np.abs(out - layer.recompute(stream.ids, len(ids)))))
            row.error = max(row.error, error)
            if not error <= TOLERANCE:
                row.failures.append(f"{rid} {cache} attention error {error:.2e}")
            start = stop

    def _truncate(self, node: str, cache: str, rid: str, keep: int) -> None:
        stream = self.caches[cache][node, rid]
        stream.ids, stream.k, stream.v = stream.ids[:keep], stream.k[:keep], stream.v[:keep]

    # ------------------------------------------------------------------ handoff

    def _handoff(self, row: StepRow, q: Request) -> None:
        """``A`` committed r1's drafts: publish them, roll back, publish again; ``B`` takes over."""
        sender, receiver = self.mgrs["A"], self.mgrs["B"]
        with_drafts = sender.publish(q.rid)
        receiver.ingest_request(q.rid)
        receiver.admit_retrieve(q.rid, "A", None, with_drafts)
        sender.rollback(q.rid, LABEL, len(q.ids))
        info = sender.publish(q.rid)
        if self.inject_fault:
            info = PublishedPositionInfo(info.counters, info.deltas, {}, info.fingerprint)
            row.events.append("FAULT: rollback published without its epoch")
        outcome = receiver.admit_retrieve(q.rid, "A", None, info)
        if not outcome.ok:
            row.failures.append(f"admit {q.rid}: {outcome.reason}")
        for cache in self.caches.values():
            cache["B", q.rid] = cache.pop(("A", q.rid)).clone()
        sender.remove_request(q.rid)
        q.node = "B"
        if receiver.position(q.rid, LABEL) != len(q.ids):
            row.failures.append(f"{q.rid} on B at {receiver.position(q.rid, LABEL)} != its "
                                f"{len(q.ids)} tokens")
        self.stale = with_drafts
        row.events.append(f"handoff {q.rid} A->B: published @{with_drafts.counters[LABEL]} "
                          f"(drafts), rolled back @{info.counters[LABEL]} epoch "
                          f"{info.epochs.get(LABEL, 0)}, B @{receiver.position(q.rid, LABEL)}")

    def _late_echo(self, r: int) -> StepRow:
        row = StepRow(r, "B")
        mgr = self.mgrs["B"]
        before = mgr.position("r1", LABEL)
        mgr.admit_retrieve("r1", "A", None, self.stale)
        after = mgr.position("r1", LABEL)
        row.events.append(f"late echo r1 @{self.stale.counters[LABEL]}: stays {after}")
        if after != before:
            row.failures.append(f"late echo moved r1 from {before} to {after}")
        self.stale = None
        return print_row(row)

    def _check_lengths(self, row: StepRow, node: str, batch: Sequence[Request]) -> None:
        mgr = self.mgrs[node]
        for q in batch:
            counter = mgr.position(q.rid, LABEL)
            for name, cache in self.caches.items():
                length = len(cache[node, q.rid].ids)
                if counter != length:
                    row.failures.append(f"{q.rid} counter {counter} != {name} KV length {length}")


def _span(positions: torch.Tensor) -> str:
    return f"{int(positions.min())}..{int(positions.max())}" if positions.numel() else "-"


def print_row(row: StepRow) -> StepRow:
    mark = "  FAIL " + "; ".join(row.failures) if row.failures else ""
    print(f"{row.step:>4} {row.node:<7} {row.requests:>4} {row.tokens:>6} {row.positions:>9} "
          f"{row.error:>8.1e}  {', '.join(row.events)}{mark}")
    return row
