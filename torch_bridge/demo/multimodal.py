"""The demo's multimodal trace: M-RoPE prompts with an image and a video over two nodes.

``python -m torch_bridge.demo --model qwen2.5-vl`` (or ``qwen2-vl``, ``qwen3-vl``, ``glm-4.1v``)
runs this instead of the text trace, with the model's real RoPE config
(``RopeConfig.from_hf`` of :data:`jaxrope.models.HF_VL_CONFIGS`: sections, pair layout,
rotated fraction) and its :func:`jaxrope.mrope.rope_index` family:

- ``v0`` (text, an image, text, a 4-frame video, text) is prefilled on the *prefill*
  node in chunks of explicit ``[3, n]`` pos_ids sliced from ``rope_index``; the node
  publishes its counter and M-RoPE delta; the *main* node ingests it, admits the
  publication (the delta travels with it), takes the KV over and decodes at
  ``counter + delta`` on all three rows; a duplicate (stale) delivery later changes
  nothing;
- ``v1`` (text, an image, text) arrives on the main node and is prefilled there in
  chunks while ``v0`` decodes: one step plans a ``chunk`` plan label from explicit
  positions and a ``decode`` one from the counters;
- pure decode steps plan into the static ``[3, 8]`` buffer of a graph slot (tokens past
  the live ones keep their values) and rotate static ``[8, H, D]`` q/k buffers.

Every step is checked against the float64 recompute of each stream's whole sequence
(:meth:`Layer.recompute` at the stream's ``[3, L]`` positions: the prompt's from
``rope_index``, then token ``i >= L`` at ``i + delta`` on every row), and after each
commit the counter must equal the KV length and the delta the prompt's. The fault
(``--inject-fault``) is the lost-delta bug of disaggregated serving (SGLang #8094,
Dynamo #5281): the main node admits the publication without its delta.

Example:
  >>> import torch
  >>> trace = MultimodalTrace("qwen2.5-vl", torch.device("cpu"), seed=0, inject_fault=False)
  >>> trace.describe().split(", head_dim")[0]
  'M-RoPE mrope_section=(16, 24, 24) interleaved=False'
  >>> [row.events[0] for row in trace.run_step(0)]
  ['arrive v0 (191 tokens, delta -160)', 'prefill v0[0:64]']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from jaxrope import models, mrope
from jaxrope.config import RopeConfig
from torch_bridge.config import PositionConfig
from torch_bridge.demo.model import KV_HEADS, TOLERANCE, VL_MODELS, VOCAB, Layer, Stream
from torch_bridge.demo.node import GRAPH_BUCKET, STALE_ADMIT_STEP, StepRow, TwoNodeTrace
from torch_bridge.engine_types import (GraphSlot, KVPlanOutput, KVView, PositionStep, Segment,
                                       StepContext)
from torch_bridge.published import PublishedPositionInfo
from torch_bridge.rope_manager import RopeManager

__all__ = ["BUDGET", "MIN_STEPS", "MODELS", "MultimodalTrace", "PROMPTS"]

MODELS = VL_MODELS   # the --model names of this trace
LABEL = "text"
BUDGET = {"main": 48, "prefill": 64}   # tokens per step (chunked prefill)
MIN_STEPS = STALE_ADMIT_STEP + 1


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """One request: its prompt as ``rope_index`` parts, where it arrives, how long it runs."""

    rid: str
    parts: Tuple[Any, ...]  # mrope.Text, mrope.Image, mrope.Video in token order
    arrival: int
    max_new: int
    remote: bool = False


PROMPTS = (
    # 6 + 48 + 4 + 128 + 5 = 191 tokens: a 12 x 16 patch image, 4 frames of 8 x 16 patches
    # one temporal patch (1 s) apart. Their temporal positions stay inside the spatial
    # ones, so rope_index's two advance rules agree on it.
    PromptSpec("v0", (mrope.Text(6), mrope.Image((1, 12, 16)), mrope.Text(4),
                      mrope.Video((4, 8, 16), second_per_grid_t=1.0), mrope.Text(5)),
               arrival=0, max_new=10, remote=True),
    # 3 + 64 + 7 = 74 tokens: a 16 x 16 image.
    PromptSpec("v1", (mrope.Text(3), mrope.Image((1, 16, 16)), mrope.Text(7)),
               arrival=2, max_new=8),
)


@dataclasses.dataclass
class Request:
    spec: PromptSpec
    ids: List[int]          # prompt then generated tokens
    truth: np.ndarray       # int64 [3, prompt + max_new]: every token's position, rows t, h, w
    delta: int
    prompt: int
    done: int = 0           # prompt tokens in the KV cache
    generated: int = 0


class MultimodalTrace(TwoNodeTrace):
    """The scripted multimodal trace; ``run_step(s)`` gives the step's :class:`StepRow`\\ s."""

    def __init__(self, model: str, device: torch.device, seed: int, inject_fault: bool):
        self.config = models.HF_VL_CONFIGS[MODELS[model]]
        self.rope: RopeConfig = RopeConfig.from_hf(self.config)
        self.index_args = mrope.hf_index_args(self.config)
        self.rng = np.random.default_rng(seed)
        self.layer = Layer(self.rope, device, self.rng)
        position_config = PositionConfig(rope=self.rope, labels=(LABEL,))
        self.nodes = {name: _VLNode(name, RopeManager(position_config, device,
                                                      max_seq_len=4096), self.layer)
                      for name in ("main", "prefill")}
        self.inject_fault = inject_fault
        self.requests: Dict[str, Request] = {}
        self.waiting: Dict[str, List[str]] = {"main": [], "prefill": []}
        self.running: List[str] = []
        self.graph_steps = 0

    def describe(self) -> str:
        cfg = self.rope
        return (f"M-RoPE mrope_section={cfg.mrope_section} interleaved={cfg.mrope_interleaved}, "
                f"head_dim={cfg.head_dim}, rotary_dim={cfg.rotary_dim}, interleave={cfg.interleave}, "
                f"rope_index family {self.index_args['family']}")

    # ------------------------------------------------------------------ events

    def _arrivals(self, s: int, row: StepRow) -> None:
        for spec in PROMPTS:
            if spec.arrival != s:
                continue
            positions, delta = mrope.rope_index(spec.parts, **self.index_args)
            prompt = positions.shape[1]
            decode = np.arange(prompt, prompt + spec.max_new) + delta
            truth = np.concatenate([positions, np.broadcast_to(decode, (3, spec.max_new))], axis=1)
            self.requests[spec.rid] = Request(spec, self.rng.integers(0, VOCAB, prompt).tolist(),
                                              truth.astype(np.int64), delta, prompt)
            node = self.nodes["prefill" if spec.remote else "main"]
            node.mgr.ingest_request(spec.rid, deltas={LABEL: delta})
            node.new_stream(spec.rid)
            self.waiting[node.name].append(spec.rid)
            row.events.append(f"arrive {spec.rid} ({prompt} tokens, delta {delta})")

    def _handoff(self, row: StepRow) -> None:
        main = self.main
        (rid, info), self.published = self.published, None
        main.mgr.ingest_request(rid)
        if self.inject_fault:  # the engines' bug: the record crosses without its delta
            info = PublishedPositionInfo(dict(info.counters), fingerprint=info.fingerprint)
            row.events.append("FAULT: admit drops the delta")
        outcome = main.mgr.admit_retrieve(rid, "prefill", None, info)
        if not outcome.ok:
            row.failures.append(f"admit {rid}: {outcome.reason}")
        main.streams[rid] = self.nodes["prefill"].streams.pop(rid).clone()   # the KV transfer
        self.nodes["prefill"].mgr.remove_request(rid)
        self.running.append(rid)
        self.stale = (rid, info.clone())
        row.events.append(f"admit {rid} @{main.mgr.position(rid, LABEL)} "
                          f"delta {main.mgr.delta(rid, LABEL)}")

    def _stale_admit(self, row: StepRow) -> None:
        main, (rid, info) = self.main, self.stale
        before = (main.mgr.position(rid, LABEL), main.mgr.delta(rid, LABEL))
        outcome = main.mgr.admit_retrieve(rid, "prefill", None, info)
        after = (main.mgr.position(rid, LABEL), main.mgr.delta(rid, LABEL))
        row.events.append(f"stale admit {rid} @{info.counters[LABEL]}: stays {after[0]}")
        if not outcome.ok or after != before:
            row.failures.append(f"stale admit moved {rid} from {before} to {after} ({outcome})")

    # ------------------------------------------------------------------ steps

    def _chunks(self, node: str, budget: int, row: StepRow):
        """``[(rid, n)]`` prompt chunks of the node's waiting requests within ``budget``."""
        chunks, completed = [], []
        for rid in list(self.waiting[node]):
            if budget == 0:
                break
            request = self.requests[rid]
            n = min(budget, request.prompt - request.done)
            chunks.append((rid, n))
            budget -= n
            if request.done + n == request.prompt:
                self.waiting[node].remove(rid)
                completed.append(rid)
        if chunks:
            row.events.append("prefill " + " ".join(
                f"{rid}[{self.requests[rid].done}:{self.requests[rid].done + n}]" for rid, n in chunks))
        return chunks, completed

    def _prefill_node_step(self, s: int) -> Optional[StepRow]:
        if not self.waiting["prefill"]:
            return None
        row = StepRow(s, "prefill")
        node = self.nodes["prefill"]
        chunks, completed = self._chunks("prefill", BUDGET["prefill"], row)
        node.step(row, self.requests, chunks, [])
        for rid in completed:
            info = node.mgr.publish(rid)
            request = self.requests[rid]
            if info is None or info.record(LABEL)[:2] != (request.prompt, request.delta):
                row.failures.append(f"published {info} for a {request.prompt}-token prompt "
                                    f"with delta {request.delta}")
                continue
            self.published = (rid, info)
            row.events.append(f"publish {rid} @{info.counters[LABEL]} delta {info.deltas[LABEL]}")
        return row

    def _main_step(self, row: StepRow) -> None:
        decode = list(self.running)
        for rid in decode:
            self.requests[rid].ids.append(int(self.rng.integers(0, VOCAB)))
        if decode:
            row.events.append(f"decode {len(decode)}")
        chunks, completed = self._chunks("main", BUDGET["main"] - len(decode), row)
        if not decode and not chunks:
            row.events.append("idle")
            return
        graph_slot = None
        if not chunks and len(decode) <= GRAPH_BUCKET.num_tokens:
            graph_slot = self.graph_steps % 2
            self.graph_steps += 1
        self.main.step(row, self.requests, chunks, decode, graph_slot)
        for rid in list(self.running):
            request = self.requests[rid]
            if request.generated == request.spec.max_new:
                self.running.remove(rid)
                self.main.streams.pop(rid)
                self.main.mgr.remove_request(rid)
                row.events.append(f"done {rid}")
        self.running += completed


class _VLNode:
    """A node of the multimodal trace: a RopeManager, its streams' KV cache, graph buffers."""

    def __init__(self, name: str, mgr: RopeManager, layer: Layer):
        self.name, self.mgr, self.layer = name, mgr, layer
        self.streams: Dict[str, Stream] = {}
        self.graph_pos: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}

    def new_stream(self, rid: str) -> None:
        empty = torch.zeros((0, KV_HEADS, self.layer.head_dim), dtype=torch.float32,
                            device=self.layer.device)
        self.streams[rid] = Stream([], empty, empty.clone())

    def step(self, row: StepRow, requests: Dict[str, Request], chunks: Sequence[Tuple[str, int]],
             decode: Sequence[str], graph_slot: Optional[int] = None) -> None:
        """Plan (``chunk``: explicit prompt rows; ``decode``: the counters), rotate in place,
        cache, attend, check against float64, commit, check counters and deltas."""
        labels: Dict[str, List[Tuple[str, List[int]]]] = {"decode": [], "chunk": []}
        for rid in decode:  # the trace appended each one's next token
            labels["decode"].append((rid, requests[rid].ids[-1:]))
        explicit = []
        for rid, n in chunks:
            request = requests[rid]
            labels["chunk"].append((rid, request.ids[request.done:request.done + n]))
            explicit.append(request.truth[:, request.done:request.done + n])
        labels = {label: views for label, views in labels.items() if views}
        segments = tuple(Segment(rid, LABEL, len(ids)) for views in labels.values()
                         for rid, ids in views)
        kv = {label: KVPlanOutput(tuple(KVView(rid, LABEL, len(ids)) for rid, ids in views))
              for label, views in labels.items()}
        pos_ids = None if not explicit else {"chunk": torch.from_numpy(
            np.concatenate(explicit, axis=1)).to(self.layer.device)}
        step = PositionStep(segments, pos_ids=pos_ids)
        slot = None if graph_slot is None else GraphSlot(GRAPH_BUCKET, graph_slot)
        ctx = StepContext(tuple(dict.fromkeys(s.request_id for s in segments)),
                          plan_results={self.mgr.config.kv_resource: kv}, graph_slot=slot)
        row.requests, row.tokens = len(ctx.request_ids), step.num_tokens

        planned = self.mgr.plan(step, ctx)
        live = []
        for label, views in labels.items():
            n = sum(len(ids) for _, ids in views)
            q, k, v = self.layer.project([t for _, ids in views for t in ids])
            if slot is None:
                self.mgr.apply_qk(q, k, label)
            else:
                self._check_graph_buffer(row, graph_slot, planned[label], n)
                key, tokens = (self.name, graph_slot), GRAPH_BUCKET.num_tokens
                q_static, k_static = self.layer.static_qk(key, tokens)
                q_static[:n].copy_(q)
                k_static[:n].copy_(k)
                self.mgr.apply_qk(q_static, k_static, label)   # the whole bucket, as a replay
                q, k = q_static[:n], k_static[:n]
            live.append(planned[label][:, :n])
            self._attend(row, requests, views, q, k, v)
        live = torch.cat(live, dim=1)
        row.positions = f"{int(live.min())}..{int(live.max())}"

        self.mgr.commit(step, ctx)
        for rid, n in chunks:
            requests[rid].done += n
        for rid in decode:
            requests[rid].generated += 1
        for rid in dict.fromkeys(s.request_id for s in segments):
            counter, cached = self.mgr.position(rid, LABEL), len(self.streams[rid].ids)
            delta = self.mgr.delta(rid, LABEL)
            if counter != cached:
                row.failures.append(f"{rid} counter {counter} != KV length {cached}")
            if delta != requests[rid].delta:
                row.failures.append(f"{rid} delta {delta} != the prompt's {requests[rid].delta}")

    def _attend(self, row: StepRow, requests: Dict[str, Request],
                views: Sequence[Tuple[str, List[int]]], q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
        start = 0
        for rid, ids in views:
            stream, stop = self.streams[rid], start + len(ids)
            stream.ids.extend(ids)
            stream.k = torch.cat([stream.k, k[start:stop]])
            stream.v = torch.cat([stream.v, v[start:stop]])
            out = self.layer.attend(q[start:stop], stream).double().cpu().numpy()
            truth = requests[rid].truth[:, :len(stream.ids)]
            want = self.layer.recompute(stream.ids, len(ids), truth)
            error = float(np.max(np.abs(out - want)))
            row.error = max(row.error, error)
            if not error <= TOLERANCE:
                row.failures.append(f"{rid} attention error {error:.2e}")
            start = stop

    def _check_graph_buffer(self, row: StepRow, graph_slot: int, positions: torch.Tensor,
                            n: int) -> None:
        size = GRAPH_BUCKET.num_tokens
        tail = positions[0, n:].tolist()
        row.events.append(f"graph slot{graph_slot} {n}/{size} tail={tail}")
        if tuple(positions.shape) != (3, size):
            row.failures.append(f"graph buffer shape {tuple(positions.shape)} != (3, {size})")
        previous = self.graph_pos.get(graph_slot)
        if previous is not None:
            buffer, old = previous
            if positions.data_ptr() != buffer.data_ptr():
                row.failures.append(f"graph slot {graph_slot} buffer moved")
            elif not torch.equal(positions[:, n:], old[:, n:]):
                row.failures.append(f"graph tail changed: {old[:, n:].tolist()} -> "
                                    f"{positions[:, n:].tolist()}")
        self.graph_pos[graph_slot] = (positions, positions.clone())
