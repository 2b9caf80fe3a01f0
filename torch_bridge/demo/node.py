"""A serving node of the demo (a RopeManager, its streams' KV cache, graph buffers) and the
prefix cache shared by the nodes."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from torch_bridge.demo.model import KV_HEADS, TOLERANCE, Layer, Stream
from torch_bridge.engine_types import (Fork, GraphBucket, GraphSlot, KVPlanOutput, KVView,
                                       PositionStep, Segment, StepContext)
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.rope_manager import RopeManager

__all__ = ["GRAPH_BUCKET", "LABELS", "Node", "PAGE", "PLAN_LABEL", "PrefixCache", "STALE_ADMIT_STEP",
           "StepRow", "TwoNodeTrace"]

LABELS = ("main", "cfg")
PLAN_LABEL = "attn"
PAGE = 16                              # prefix-cache page size (tokens)
GRAPH_BUCKET = GraphBucket("decode", batch_size=8, num_tokens=8)
STALE_ADMIT_STEP = 6                   # where both traces deliver a publication a second time


@dataclasses.dataclass
class StepRow:
    step: int
    node: str
    requests: int = 0
    tokens: int = 0
    positions: str = "-"
    error: float = 0.0
    events: List[str] = dataclasses.field(default_factory=list)
    failures: List[str] = dataclasses.field(default_factory=list)


class Node:
    """A serving node: a RopeManager, the KV cache of its streams, static graph buffers."""

    def __init__(self, name: str, mgr: RopeManager, layer: Layer):
        self.name, self.mgr, self.layer = name, mgr, layer
        self.streams: Dict[Tuple[str, str], Stream] = {}
        self.graph_pos: Dict[int, torch.Tensor] = {}

    def new_stream(self, rid: str, label: str) -> None:
        d = self.layer.head_dim
        empty = torch.zeros((0, KV_HEADS, d), dtype=torch.float32, device=self.layer.device)
        self.streams[rid, label] = Stream([], empty, empty.clone())

    def drop(self, rid: str) -> None:
        self.mgr.remove_request(rid)
        for label in LABELS:
            self.streams.pop((rid, label), None)

    def step(self, row: StepRow, views: Sequence[Tuple[str, str, List[int]]],
             pre_forks: Sequence[Fork] = (), graph_slot: Optional[int] = None) -> None:
        """Run one step: plan, rotate in place, cache, attend, check against float64, commit."""
        segments = tuple(Segment(rid, label, len(ids)) for rid, label, ids in views)
        kv = {PLAN_LABEL: KVPlanOutput(tuple(KVView(*s) for s in segments),
                                       pre_forks=tuple(pre_forks))}
        slot = None if graph_slot is None else GraphSlot(GRAPH_BUCKET, graph_slot)
        step = PositionStep(segments)
        ctx = StepContext(tuple(dict.fromkeys(rid for rid, _, _ in views)),
                          plan_results={self.mgr.config.kv_resource: kv}, graph_slot=slot)
        n = step.num_tokens
        row.requests, row.tokens = len(ctx.request_ids), n

        previous = self.graph_pos.get(graph_slot)
        old = None if previous is None else previous.clone()
        positions = self.mgr.plan(step, ctx)[PLAN_LABEL]
        q, k, v = self.layer.project([t for _, _, ids in views for t in ids])
        if slot is None:
            self.mgr.apply_qk(q, k, PLAN_LABEL)
        else:
            self._check_graph_buffer(row, graph_slot, positions, previous, old, n)
            key, tokens = (self.name, graph_slot), GRAPH_BUCKET.num_tokens
            q_static, k_static = self.layer.static_qk(key, tokens)
            q_static[:n].copy_(q)
            k_static[:n].copy_(k)
            # The replay rotates the whole bucket; the padded rows are never read.
            self.mgr.apply_qk(q_static, k_static, PLAN_LABEL)
            q, k = q_static[:n], k_static[:n]
        live = positions[:n]
        row.positions = f"{int(live.min())}..{int(live.max())}"

        start = 0
        for rid, label, ids in views:
            stream = self.streams[rid, label]
            stop = start + len(ids)
            stream.ids.extend(ids)
            stream.k = torch.cat([stream.k, k[start:stop]])
            stream.v = torch.cat([stream.v, v[start:stop]])
            out = self.layer.attend(q[start:stop], stream).double().cpu().numpy()
            want = self.layer.recompute(stream.ids, len(ids))
            error = float(np.max(np.abs(out - want)))
            row.error = max(row.error, error)
            if not error <= TOLERANCE:
                row.failures.append(f"{rid}/{label} attention error {error:.2e}")
            start = stop

        self.mgr.commit(step, ctx)
        for rid, label, _ in views:
            counter, cached = self.mgr.position(rid, label), len(self.streams[rid, label].ids)
            if counter != cached:
                row.failures.append(f"{rid}/{label} counter {counter} != KV length {cached}")

    def _check_graph_buffer(self, row: StepRow, graph_slot: int, positions: torch.Tensor,
                            previous: Optional[torch.Tensor], old: Optional[torch.Tensor],
                            n: int) -> None:
        size = GRAPH_BUCKET.num_tokens
        tail = positions[n:].tolist()
        row.events.append(f"graph slot{graph_slot} {n}/{size} tail={tail}")
        if positions.shape != (size,):
            row.failures.append(f"graph buffer shape {tuple(positions.shape)} != ({size},)")
        if previous is not None:
            if positions.data_ptr() != previous.data_ptr():
                row.failures.append(f"graph slot {graph_slot} buffer moved")
            elif not torch.equal(positions[n:], old[n:]):
                row.failures.append(f"graph tail changed: {old[n:].tolist()} -> {tail}")
        self.graph_pos[graph_slot] = positions


Pages = Tuple[torch.Tensor, torch.Tensor]


class TwoNodeTrace:
    """What the 1-D and the multimodal trace share: a main node and a prefill node that hands
    its requests over through ``published`` (and delivers one of them again, stale, at
    STALE_ADMIT_STEP). A subclass gives the events in the order ``run_step`` calls them."""

    nodes: Dict[str, object]
    published: Optional[Tuple[str, PublishedPositionInfo]] = None
    stale: Optional[Tuple[str, PublishedPositionInfo]] = None

    @property
    def main(self):
        return self.nodes["main"]

    def run_step(self, s: int) -> List[StepRow]:
        """Step ``s`` of both nodes: the main node's row, then the prefill node's if it ran."""
        row = StepRow(s, "main")
        if self.published is not None:
            self._handoff(row)
        if s == STALE_ADMIT_STEP and self.stale is not None:
            self._stale_admit(row)
        self._arrivals(s, row)
        prefill_row = self._prefill_node_step(s)
        self._main_step(row)
        return [row] if prefill_row is None else [row, prefill_row]


class PrefixCache:
    """Full pages of rotated KV, keyed by the manager's fingerprint and the token prefix."""

    def __init__(self):
        self.pages: Dict[Tuple[bytes, Tuple[int, ...]], Pages] = {}

    def insert(self, root: bytes, stream: Stream) -> None:
        for end in range(PAGE, len(stream.ids) + 1, PAGE):
            key = (root, tuple(stream.ids[:end]))
            if key not in self.pages:
                self.pages[key] = (stream.k[:end].clone(), stream.v[:end].clone())

    def longest(self, root: bytes, ids: Sequence[int]) -> Tuple[int, Optional[Pages]]:
        """``(cached tokens, (k, v))`` of the longest cached full-page prefix of ``ids``."""
        for end in range(len(ids) // PAGE * PAGE, 0, -PAGE):
            hit = self.pages.get((root, tuple(ids[:end])))
            if hit is not None:
                return end, hit
        return 0, None
