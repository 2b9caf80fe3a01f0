"""The demo's scripted serving trace over a main node and a prefill node."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from jaxrope.config import RopeConfig
from torch_bridge.config import PositionConfig
from torch_bridge.demo.model import VOCAB, Layer
from torch_bridge.demo.node import (GRAPH_BUCKET, LABELS, STALE_ADMIT_STEP, Node, PrefixCache,
                                    StepRow, TwoNodeTrace)
from torch_bridge.engine_types import Fork
from torch_bridge.rope_manager import RopeManager

__all__ = ["BUDGET", "MIN_STEPS", "TRACE", "Trace"]

BUDGET = {"main": 32, "prefill": 16}   # tokens per step (chunked prefill)
MIN_STEPS = STALE_ADMIT_STEP + 1       # the stale admit is the trace's last scripted feature


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of the trace.

    ``shares=(rid, n)``: its first ``n`` prompt tokens are ``rid``'s (a prefix-cache hit);
    ``cfg_suffix``: tokens of a negative prompt on a ``cfg`` stream forked from ``main``
    at the first decode step; ``remote``: prefilled on the prefill node, then handed off.
    """

    rid: str
    prompt: int
    arrival: int
    max_new: int
    shares: Optional[Tuple[str, int]] = None
    cfg_suffix: int = 0
    remote: bool = False


TRACE = (
    RequestSpec("r0", prompt=45, arrival=0, max_new=12),
    RequestSpec("r1", prompt=23, arrival=0, max_new=5),
    RequestSpec("r2", prompt=30, arrival=1, max_new=8, cfg_suffix=6),
    RequestSpec("rD", prompt=27, arrival=2, max_new=8, remote=True),
    RequestSpec("r3", prompt=40, arrival=3, max_new=6, shares=("r0", 35)),
    RequestSpec("r4", prompt=20, arrival=9, max_new=4),
)


@dataclasses.dataclass
class Request:
    spec: RequestSpec
    ids: List[int]                 # the prompt
    done: int = 0                  # prompt tokens already in the KV cache
    generated: int = 0
    forked: bool = False
    cfg_ids: List[int] = dataclasses.field(default_factory=list)


class Trace(TwoNodeTrace):
    """The scripted serving trace over a main node and a prefill node."""

    def __init__(self, rope: RopeConfig, device: torch.device, seed: int, inject_fault: bool):
        self.rng = np.random.default_rng(seed)
        self.layer = Layer(rope, device, self.rng)
        config = PositionConfig(rope=rope, labels=LABELS)
        self.nodes = {name: Node(name, RopeManager(config, device, max_seq_len=4096),
                                 self.layer)
                      for name in ("main", "prefill")}
        self.inject_fault = inject_fault
        self.cache = PrefixCache()
        self.requests: Dict[str, Request] = {}
        self.waiting: Dict[str, List[str]] = {"main": [], "prefill": []}
        self.running: List[str] = []
        self.graph_steps = 0

    @property
    def prefill(self) -> Node:
        return self.nodes["prefill"]

    def _tokens(self, n: int) -> List[int]:
        return self.rng.integers(0, VOCAB, n).tolist()

    # ------------------------------------------------------------------ events

    def _arrivals(self, s: int, row: StepRow) -> None:
        for spec in [spec for spec in TRACE if spec.arrival == s] + self._steady_arrivals(s):
            ids = self._tokens(spec.prompt)
            if spec.shares is not None:
                source, count = spec.shares
                ids[:count] = self.requests[source].ids[:count]
            self.requests[spec.rid] = Request(spec, ids, cfg_ids=self._tokens(spec.cfg_suffix))
            node = self.prefill if spec.remote else self.main
            node.mgr.ingest_request(spec.rid)
            node.new_stream(spec.rid, "main")
            self.waiting[node.name].append(spec.rid)
            if spec.shares is not None:
                self._prefix_hit(self.requests[spec.rid], row)

    def _steady_arrivals(self, s: int) -> List[RequestSpec]:
        """Past the scripted trace, a request every 4 steps; every other one shares r0's prefix."""
        since = s - TRACE[-1].arrival
        if since <= 0 or since % 4:
            return []
        shares = since % 8 == 0
        prompt = int(self.rng.integers(36 if shares else 8, 41))
        return [RequestSpec(f"r{len(self.requests) - 1}", prompt=prompt, arrival=s,
                            max_new=int(self.rng.integers(4, 11)),
                            shares=("r0", 35) if shares else None)]

    def _prefix_hit(self, request: Request, row: StepRow) -> None:
        main, rid = self.main, request.spec.rid
        cached, pages = self.cache.longest(main.mgr.fingerprint(), request.ids)
        if not cached:
            row.failures.append(f"prefix cache missed {rid}")
            return
        stream = main.streams[rid, "main"]
        stream.ids = list(request.ids[:cached])
        stream.k, stream.v = pages[0].clone(), pages[1].clone()
        request.done = cached
        claimed = cached + 1 if self.inject_fault else cached
        for _ in range(2):   # the probe repeats (one per partition); the position is absolute
            main.mgr.apply_cached_prefix(rid, main.name, None, None, {"main": claimed})
        row.events.append(f"prefix hit {rid}: {cached} cached")
        if self.inject_fault:
            row.events.append(f"FAULT: probe claims {claimed}")

    def _handoff(self, row: StepRow) -> None:
        main = self.main
        (rid, info), self.published = self.published, None
        for _ in range(2):   # one NewRequest per partition: ingest is idempotent
            main.mgr.ingest_request(rid)
        outcome = main.mgr.admit_retrieve(rid, "prefill", None, info)
        if not outcome.ok:
            row.failures.append(f"admit {rid}: {outcome.reason}")
        main.streams[rid, "main"] = self.prefill.streams[rid, "main"].clone()   # the KV transfer
        self.prefill.drop(rid)
        self.requests[rid].done = self.requests[rid].spec.prompt
        self.running.append(rid)
        self.stale = (rid, info.clone())
        row.events.append(f"admit {rid} @{main.mgr.position(rid, 'main')}")

    def _stale_admit(self, row: StepRow) -> None:
        main, (rid, info) = self.main, self.stale
        before = main.mgr.position(rid, "main")
        outcome = main.mgr.admit_retrieve(rid, "prefill", None, info)
        after = main.mgr.position(rid, "main")
        row.events.append(f"stale admit {rid} @{info.counters['main']}: stays {after}")
        if not outcome.ok or after != before:
            row.failures.append(f"stale admit moved {rid} from {before} to {after} ({outcome})")

    # ------------------------------------------------------------------ steps

    def _prefill_chunks(self, node: str, budget: int, row: StepRow):
        """Chunks of the node's waiting prompts, first come first served, within ``budget`` tokens.

        Returns ``(views, rids whose prompt this step completes)``.
        """
        views, chunks, completed = [], [], []
        for rid in list(self.waiting[node]):
            if budget == 0:
                break
            request = self.requests[rid]
            n = min(budget, request.spec.prompt - request.done)
            views.append((rid, "main", request.ids[request.done:request.done + n]))
            chunks.append(f"{rid}[{request.done}:{request.done + n}]")
            request.done += n
            budget -= n
            if request.done == request.spec.prompt:
                self.waiting[node].remove(rid)
                completed.append(rid)
        if chunks:
            row.events.append("prefill " + " ".join(chunks))
        return views, completed

    def _prefill_node_step(self, s: int) -> Optional[StepRow]:
        if not self.waiting["prefill"]:
            return None
        row = StepRow(s, "prefill")
        views, completed = self._prefill_chunks("prefill", BUDGET["prefill"], row)
        self.prefill.step(row, views)
        for rid in completed:
            info = self.prefill.mgr.publish(rid)
            prompt = self.requests[rid].spec.prompt
            if info is None or info.counters["main"] != prompt:
                row.failures.append(f"published {info} for a {prompt}-token prompt")
                continue
            self.published = (rid, info)
            row.events.append(f"publish {rid} @{info.counters['main']}")
        return row

    def _main_step(self, row: StepRow) -> None:
        views: List[Tuple[str, str, List[int]]] = []
        forks: List[Fork] = []
        for rid in self.running:
            request = self.requests[rid]
            token = self._tokens(1)
            views.append((rid, "main", token))
            if request.spec.cfg_suffix:
                if not request.forked:
                    forks.append(Fork(rid, "main", "cfg"))
                    self.main.streams[rid, "cfg"] = self.main.streams[rid, "main"].clone()
                    request.forked = True
                    views.append((rid, "cfg", request.cfg_ids + token))
                    row.events.append(f"fork {rid} main->cfg +{len(request.cfg_ids)}")
                else:
                    views.append((rid, "cfg", token))
        if views:
            row.events.append(f"decode {len(views)}")
        chunks, completed = self._prefill_chunks(
            "main", BUDGET["main"] - sum(len(ids) for *_, ids in views), row)
        views += chunks
        if not views:
            row.events.append("idle")
            return
        pure_decode = all(len(ids) == 1 for *_, ids in views)
        graph_slot = None
        if pure_decode and len(views) <= GRAPH_BUCKET.num_tokens:
            graph_slot = self.graph_steps % 2
            self.graph_steps += 1
        self.main.step(row, views, forks, graph_slot)

        root = self.main.mgr.fingerprint()
        for rid, label, _ in views:
            if label == "main":
                self.cache.insert(root, self.main.streams[rid, label])
        for rid in list(self.running):
            request = self.requests[rid]
            request.generated += 1
            if request.generated == request.spec.max_new:
                self.running.remove(rid)
                self.main.drop(rid)
                row.events.append(f"done {rid}")
        self.running += completed
