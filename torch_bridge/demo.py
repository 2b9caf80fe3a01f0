"""The jaxrope demo: ``RopeManager`` through a serving trace, checked at every step.

Usage::

  make demo                      # creates .venv on first use, then runs the line below
  python -m jaxrope.demo [--model {llama3.1,qwen2.5-yarn,phi3-longrope,deepseek-v2}]
                         [--steps N] [--device {auto,cpu,cuda}] [--seed S]

  --model   the real RoPE config (default llama3.1: Llama-3.1-8B's llama3 scaling;
            qwen2.5-yarn, phi3-longrope (Phi-3-mini-128k), deepseek-v2 (V2-Lite, YaRN,
            interleaved pairs))
  --steps   main-node steps, >= 7 (default 14); past the scripted trace a new request
            arrives every 4 steps, every other one a prefix-cache hit
  --device  auto (default): CUDA when torch and JAX both see a GPU, else CPU
  --seed    weights and token ids (default 0)
  --inject-fault  for tests: the prefix-cache probe claims one token too many, so the
            run must FAIL

Two serving nodes share one tiny attention layer (random weights, 4 query heads,
2 KV heads, the model's real ``head_dim`` and RoPE config from
:data:`jaxrope.models.HF_CONFIGS`):

- the *main* node schedules up to 32 tokens a step: one decode token per running
  stream first, then chunks of the waiting prompts (chunked prefill). Its trace has
  requests of different lengths, batched decode, a prefix-cache hit (``r3`` shares
  35 prompt tokens with ``r0``; the cache serves its two full 16-token pages, then
  its prefill continues at position 32), a CFG branch (``r2``'s ``cfg`` stream is
  forked from ``main`` by a pre-fork in the KV plan, takes a 6-token negative
  prompt, and is packed with ``main`` under one plan label), requests finishing and
  new ones arriving;
- the *prefill* node prefills ``rD`` and publishes its counters; the main node
  ingests it, admits the publication, takes the KV over and continues decoding; a
  duplicate (stale) delivery of the same publication later must not rewind it;
- pure decode steps run as CUDA-graph-style replays: positions are planned into
  the static ``[8]`` buffer of a (bucket, slot) lease, q/k live in static ``[8, H, D]``
  buffers, and the entries past the live tokens must keep their old values.

Every step projects its tokens' q/k/v, lets the manager plan the positions and
rotate q and k in place, appends the rotated keys to each stream's KV cache, and
attends. The result is compared with a float64 numpy recompute of each stream's
whole sequence from scratch: raw projections of all its tokens, rotated at the
absolute positions the trace implies (token ``i`` of a stream sits at position
``i``; a forked stream shares its parent's first tokens), causal attention. A
wrong position anywhere (in q, in a cached key, after a fork, a prefix hit or a
handoff) shows up as an error. After each commit, every stream's counter must also
equal its KV length. The recompute uses the config's float64 serving
frequencies (``RopeConfig.serving_frequencies``); their agreement with HF's formulas
is what ``tests/test_frequencies.py`` checks, not this demo.

Output: one line per step and node (requests, tokens, range of the planned
positions, max abs error of the attention output, events), then a verdict line.
Exit status 0 when every check passes, 1 on any mismatch.

Example:
  >>> import contextlib, io
  >>> out = io.StringIO()
  >>> with contextlib.redirect_stdout(out):
  ...     status = main(["--steps", "7", "--device", "cpu"])
  >>> status, out.getvalue().splitlines()[-1].startswith("verdict: PASS")
  (0, True)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from jaxrope.config import RopeConfig
from jaxrope.models import HF_CONFIGS
from torch_bridge.config import PositionConfig
from torch_bridge.engine_types import (Fork, GraphBucket, GraphSlot, KVPlanOutput, KVView,
                                       PositionStep, Segment, StepContext)
from torch_bridge.manager import PublishedPositionInfo, RopeManager

__all__ = ["MODELS", "TOLERANCE", "main"]

MODELS = {
    "llama3.1": "meta-llama/Llama-3.1-8B",
    "qwen2.5-yarn": "Qwen/Qwen2.5-7B-Instruct+yarn",
    "phi3-longrope": "microsoft/Phi-3-mini-128k-instruct",
    "deepseek-v2": "deepseek-ai/DeepSeek-V2-Lite",
}

# q/k/v and attention run in float32 with the float32 RoPE kernel; outputs are O(1).
# Rounding of the projections, the rotation (angles reduced in more than float32) and
# a softmax over <= ~80 keys with logits O(1) stays near 1e-6; 1e-4 leaves margin on any
# device. A position off by one turns the fastest pair by about a radian, which moves
# the output by ~1e-2 or more.
TOLERANCE = 1e-4

LABELS = ("main", "cfg")
PLAN_LABEL = "attn"
BUDGET = {"main": 32, "prefill": 16}   # tokens per step (chunked prefill)
PAGE = 16                              # prefix-cache page size (tokens)
GRAPH_BUCKET = GraphBucket("decode", batch_size=8, num_tokens=8)
Q_HEADS, KV_HEADS, HIDDEN, VOCAB = 4, 2, 64, 512
STALE_ADMIT_STEP = 6
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
class Stream:
    """One (request, label) stream on a node: its tokens and its rotated KV cache."""

    ids: List[int]
    k: torch.Tensor   # [len(ids), KV_HEADS, D], rotated
    v: torch.Tensor   # [len(ids), KV_HEADS, D]

    def clone(self) -> "Stream":
        return Stream(list(self.ids), self.k.clone(), self.v.clone())


@dataclasses.dataclass
class Request:
    spec: RequestSpec
    ids: List[int]                 # the prompt
    done: int = 0                  # prompt tokens already in the KV cache
    generated: int = 0
    forked: bool = False
    cfg_ids: List[int] = dataclasses.field(default_factory=list)


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


class Layer:
    """A one-layer attention block with random weights, in torch float32 and numpy float64.

    The float64 weights are the float32 ones widened, so both sides compute the same
    function; only rounding differs.
    """

    def __init__(self, rope: RopeConfig, device: torch.device, rng: np.random.Generator):
        d = rope.head_dim
        self.rope, self.device, self.head_dim = rope, device, d
        self.emb32 = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        self.w32 = {
            name: (rng.standard_normal((HIDDEN, heads * d)) / math.sqrt(HIDDEN)).astype(np.float32)
            for name, heads in (("q", Q_HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        self.emb = torch.from_numpy(self.emb32).to(device)
        self.w = {name: torch.from_numpy(w).to(device) for name, w in self.w32.items()}
        self.inv_freq, self.attention = rope.serving_frequencies()

    def project(self, ids: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 ``q [n, Hq, D]``, ``k [n, Hk, D]``, ``v [n, Hk, D]``, unrotated."""
        x = self.emb[torch.tensor(list(ids), device=self.device)]
        n, d = len(ids), self.head_dim
        return ((x @ self.w["q"]).view(n, Q_HEADS, d), (x @ self.w["k"]).view(n, KV_HEADS, d),
                (x @ self.w["v"]).view(n, KV_HEADS, d))

    def attend(self, q: torch.Tensor, stream: Stream) -> torch.Tensor:
        """float32 causal attention of the stream's last ``q.shape[0]`` tokens over its cache."""
        n, total = q.shape[0], stream.k.shape[0]
        group = Q_HEADS // KV_HEADS
        k = stream.k.repeat_interleave(group, dim=1)
        v = stream.v.repeat_interleave(group, dim=1)
        scores = q.transpose(0, 1) @ k.permute(1, 2, 0) / math.sqrt(self.head_dim)   # [H, n, total]
        q_pos = torch.arange(total - n, total, device=q.device)
        future = torch.arange(total, device=q.device)[None, :] > q_pos[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        return (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1)

    def recompute(self, ids: Sequence[int], last: int) -> np.ndarray:
        """float64 attention output ``[last, Hq, D]`` of a stream's last tokens, from scratch.

        Every token of ``ids`` is projected again and rotated at its absolute position
        (its index), so nothing computed by the manager or the caches is reused.
        """
        x = self.emb32.astype(np.float64)[np.asarray(ids)]
        total, d = len(ids), self.head_dim
        pos = np.arange(total, dtype=np.float64)
        q = self._rotate((x @ self.w32["q"].astype(np.float64)).reshape(total, Q_HEADS, d), pos)
        k = self._rotate((x @ self.w32["k"].astype(np.float64)).reshape(total, KV_HEADS, d), pos)
        v = (x @ self.w32["v"].astype(np.float64)).reshape(total, KV_HEADS, d)
        group = Q_HEADS // KV_HEADS
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = q[total - last:].transpose(1, 0, 2) @ k.transpose(1, 2, 0) / math.sqrt(d)
        q_pos = np.arange(total - last, total)
        scores = np.where(np.arange(total)[None, None, :] > q_pos[None, :, None], -np.inf, scores)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return (weights @ v.transpose(1, 0, 2)).transpose(1, 0, 2)

    def _rotate(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        r = self.rope.rotary_dim
        angle = pos[:, None, None] * self.inv_freq[None, None, :]
        cos, sin = np.cos(angle) * self.attention, np.sin(angle) * self.attention
        out = x.copy()
        first, second = ((slice(0, r, 2), slice(1, r, 2)) if self.rope.interleave
                         else (slice(0, r // 2), slice(r // 2, r)))
        a, b = x[..., first], x[..., second]
        out[..., first] = a * cos - b * sin
        out[..., second] = b * cos + a * sin
        return out


class Node:
    """A serving node: a RopeManager, the KV cache of its streams, static graph buffers."""

    def __init__(self, name: str, mgr: RopeManager, layer: Layer):
        self.name, self.mgr, self.layer = name, mgr, layer
        self.streams: Dict[Tuple[str, str], Stream] = {}
        self.graph_qk: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
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
            q_static, k_static = self._graph_qk(graph_slot)
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

    def _graph_qk(self, graph_slot: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if graph_slot not in self.graph_qk:
            d, t = self.layer.head_dim, GRAPH_BUCKET.num_tokens
            self.graph_qk[graph_slot] = (
                torch.zeros((t, Q_HEADS, d), dtype=torch.float32, device=self.layer.device),
                torch.zeros((t, KV_HEADS, d), dtype=torch.float32, device=self.layer.device))
        return self.graph_qk[graph_slot]

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


class Trace:
    """The scripted serving trace over a main node and a prefill node."""

    def __init__(self, rope: RopeConfig, device: torch.device, seed: int, inject_fault: bool):
        self.rng = np.random.default_rng(seed)
        self.layer = Layer(rope, device, self.rng)
        config = PositionConfig(rope=rope, labels=LABELS)
        self.nodes = {name: Node(name, RopeManager(config, device, max_seq_len=4096,
                                                   dtype=torch.float32), self.layer)
                      for name in ("main", "prefill")}
        self.inject_fault = inject_fault
        self.cache = PrefixCache()
        self.requests: Dict[str, Request] = {}
        self.waiting: Dict[str, List[str]] = {"main": [], "prefill": []}
        self.running: List[str] = []
        # (rid, publication) from the prefill node: in flight, and kept for a duplicate delivery.
        self.published: Optional[Tuple[str, PublishedPositionInfo]] = None
        self.stale: Optional[Tuple[str, PublishedPositionInfo]] = None
        self.graph_steps = 0

    @property
    def main(self) -> Node:
        return self.nodes["main"]

    @property
    def prefill(self) -> Node:
        return self.nodes["prefill"]

    def _tokens(self, n: int) -> List[int]:
        return self.rng.integers(0, VOCAB, n).tolist()

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


def _pick_device(choice: str) -> Tuple[torch.device, Optional[str]]:
    """The device to run on, and a note when "auto" had to fall back to the CPU."""
    if choice == "cpu":
        return torch.device("cpu"), None
    if choice == "cuda" or torch.cuda.is_available():
        import jax
        try:
            jax.devices("gpu")
        except RuntimeError as e:
            if choice == "cuda":
                raise SystemExit(f"--device cuda: JAX has no GPU backend here ({e})")
            return torch.device("cpu"), "torch sees a GPU but JAX has no GPU backend: using the CPU"
        return torch.device("cuda", torch.cuda.current_device()), None
    return torch.device("cpu"), None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jaxrope.demo",
        description="Drive torch_bridge.RopeManager through a multi-request serving trace and "
                    "check a tiny attention layer against a float64 recompute at every step.")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3.1",
                        help="real RoPE config to use (default: llama3.1)")
    parser.add_argument("--steps", type=int, default=14,
                        help=f"main-node steps to run, >= {MIN_STEPS} (default: 14)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA when torch and JAX both see a GPU, else CPU")
    parser.add_argument("--seed", type=int, default=0, help="weights and token ids (default: 0)")
    parser.add_argument("--inject-fault", action="store_true",
                        help="for tests: the prefix-cache probe claims one token too many, so "
                             "a request's positions are off by one and the run must FAIL")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the demo; returns the exit status (0 pass, 1 mismatch).

    Raises:
      SystemExit: invalid arguments (status 2).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < MIN_STEPS:
        parser.error(f"--steps={args.steps} must be >= {MIN_STEPS} (the trace's prefix hit, "
                     "fork, handoff, graph replay and stale admit happen in its first "
                     f"{MIN_STEPS} steps)")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX beside torch on a GPU
    device, note = _pick_device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False   # TF32 matmuls would exceed the tolerance
    name = MODELS[args.model]
    rope = RopeConfig.from_hf(HF_CONFIGS[name])
    started = time.perf_counter()
    trace = Trace(rope, device, args.seed, args.inject_fault)
    mgr = trace.main.mgr
    rotation = (type(mgr.launcher).__name__ if mgr.launcher is not None
                else f"JAX ({'Pallas' if device.type == 'cuda' else 'XLA'})")
    scaling = type(rope.scaling).__name__ if rope.scaling is not None else "default"
    print(f"jaxrope demo: {name} ({scaling}, head_dim={rope.head_dim}, "
          f"rotary_dim={rope.rotary_dim}, interleave={rope.interleave}, "
          f"attention factor {trace.layer.attention:.4f})")
    print(f"device {device}, rotation {rotation}, q/k float32, {Q_HEADS} q heads / {KV_HEADS} "
          f"kv heads, budget {BUDGET['main']} tokens/step, graph bucket {GRAPH_BUCKET.num_tokens}")
    if note:
        print(f"note: {note}")
    print(f"{'step':>4} {'node':<7} {'reqs':>4} {'tokens':>6} {'positions':>9} {'max err':>8}"
          "  events")
    rows: List[StepRow] = []
    for s in range(args.steps):
        for row in trace.run_step(s):
            rows.append(row)
            mark = "  FAIL " + "; ".join(row.failures) if row.failures else ""
            print(f"{row.step:>4} {row.node:<7} {row.requests:>4} {row.tokens:>6} "
                  f"{row.positions:>9} {row.error:>8.1e}  {', '.join(row.events)}{mark}")
    failed = [row for row in rows if row.failures]
    worst = max(row.error for row in rows)
    elapsed = time.perf_counter() - started
    summary = (f"{len(rows)} steps on 2 nodes, {len(trace.requests)} requests, "
               f"max error {worst:.1e} (tolerance {TOLERANCE:.0e}), {elapsed:.1f} s")
    if failed:
        first = failed[0]
        print(f"verdict: FAIL — {len(failed)} of {summary}; first at step {first.step} "
              f"({first.node}): {first.failures[0]}")
        return 1
    print(f"verdict: PASS — {summary}")
    return 0
