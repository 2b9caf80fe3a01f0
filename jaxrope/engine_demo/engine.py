"""The JAX engine demo's host loop: continuous batching over the jitted step of :mod:`.model`.

Per step the host schedules every decoding stream one token and gives the rest of the
token budget to prefill chunks (a long prompt takes several steps); pads the step to the
smallest token bucket; allocates pages and writes the block table; runs the step; then
checks it against a float64 recompute of every sequence: each token's position and
attention output, and every live sequence's cached k and v rows read back from the pages.
Streams join and leave through :class:`jaxrope.RowMap` (a freed stream's counters reset
with :func:`jaxrope.positions.reset`); a prompt whose first pages another prompt already
filled shares them (a prefix-cache hit: :func:`jaxrope.positions.raise_to` moves the
counter past them, and only the rest is prefilled); the M-RoPE request's prompt takes
positions from :func:`jaxrope.mrope.rope_index` and its decode tokens the counter plus
the delta (:func:`jaxrope.positions.set_deltas`).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxrope as jr
from jaxrope import models, mrope, positions
from jaxrope.layer_reference import relative_error
from jaxrope.engine_demo import model

BUCKETS = (16, 64)            # token buckets: one compile of the step each
CHUNK = 24                    # the most prompt tokens one stream prefills in a step
CAPACITY = 8                  # streams (views) a step holds: its view bucket
LABEL = "text"                # one stream per request
# The float32 layer vs the float64 recompute: cache rows (the fused op's rotation) ~1e-6;
# attention ~1e-6 on CPU, ~1e-3 where the GPU kernel's dots take TF32 inputs. A wrong
# position or page is off by 1e-1 or more.
ATTENTION_TOLERANCE, CACHE_TOLERANCE = 5e-3, 1e-4


@dataclasses.dataclass
class Request:
    """One request of the trace: a prompt, then ``new_tokens`` decoded ones."""

    rid: str
    arrive: int
    prompt: List[int]
    new_tokens: int
    positions: np.ndarray          # int [3, prompt + new_tokens]: what the model defines
    mrope_prompt: bool = False
    done: int = 0                  # tokens in the cache (prompt, then decoded)
    pages: List[int] = dataclasses.field(default_factory=list)
    ids: List[int] = dataclasses.field(default_factory=list)   # every token so far

    @property
    def length(self) -> int:
        return len(self.prompt) + self.new_tokens


def trace(steps: int, seed: int) -> List[Request]:
    """The demo's requests, their arrivals spread over ``steps`` (about the trace's length)."""
    rng = np.random.default_rng(seed)
    scale = steps / 200

    def text(n):
        return [int(t) for t in rng.integers(1, model.VOCAB, n)]

    def request(rid, arrive, prompt, new, vl_parts=None):
        new = max(4, int(new * scale))
        if vl_parts is None:
            pos = np.broadcast_to(np.arange(len(prompt) + new), (3, len(prompt) + new))
        else:
            prompt_pos, delta = mrope.rope_index(vl_parts, **mrope.hf_index_args(
                models.HF_VL_CONFIGS[model.MODEL]))
            pos = np.concatenate([prompt_pos, np.broadcast_to(
                np.arange(len(prompt), len(prompt) + new) + delta, (3, new))], axis=1)
        return Request(rid, int(arrive * scale), prompt, new, np.asarray(pos, np.int64),
                       mrope_prompt=vl_parts is not None)

    a, b = text(40), text(21)
    vl = [mrope.Text(6), mrope.Image((1, 8, 8)), mrope.Text(9)]   # 6 + 16 + 9 tokens
    return [request("a", 0, a, 60), request("b", 0, b, 95),
            request("vl", 6, text(31), 70, vl),
            request("c", 24, a[:32] + text(12), 70),                  # a's first 2 pages
            request("d", 50, text(70), 50), request("e", 85, text(33), 80),
            request("f", 110, b[:16] + text(30), 75),                 # b's first page
            request("g", 150, text(50), 60), request("h", 170, text(20), 40)]


class Engine:
    """Host state of the demo engine (the counters and the cache stay on the device)."""

    def __init__(self, seed: int, interpret: bool, fault_step: Optional[int]):
        self.cfg = model.config()
        rng = np.random.default_rng(seed + 1)
        self.weights = model.Weights.random(rng, self.cfg.head_dim)
        self.projected = model.projections(self.weights, self.cfg.head_dim)
        self.traces: Dict[int, int] = {}
        self.step_fn = model.make_step(self.cfg, interpret, self.traces)
        self.smap = jr.RowMap(CAPACITY)
        self.device_weights = model.device_weights(self.weights)
        self.table = positions.init(CAPACITY)
        self.cache = model.empty_cache()
        self.block_table = np.zeros((CAPACITY, model.PAGES_PER_SEQ), np.int32)
        self.free_pages = [int(p) for p in rng.permutation(model.PAGES)]
        self.owners = np.zeros(model.PAGES, np.int64)      # requests + prefix cache per page
        self.prefix_pages: Dict[Tuple[int, ...], int] = {}  # a text prefix of whole pages -> page
        self.fault_step = fault_step
        self.events: List[str] = []

    # -- joining and leaving ---------------------------------------------------------------
    def join(self, r: Request) -> None:
        slot = self.smap.acquire(r.rid, LABEL)
        if self.smap.capacity != self.table.capacity:
            raise RuntimeError(f"{CAPACITY} streams is the demo's view bucket")
        shared = []
        if not r.mrope_prompt:
            while (len(shared) + 1) * model.PAGE_SIZE < len(r.prompt):
                key = tuple(r.prompt[:(len(shared) + 1) * model.PAGE_SIZE])
                if key not in self.prefix_pages:
                    break
                shared.append(self.prefix_pages[key])
        for page in shared:
            self.owners[page] += 1
        r.pages, r.done = list(shared), len(shared) * model.PAGE_SIZE
        r.ids = list(r.prompt[:r.done])
        self.block_table[slot] = 0
        self.block_table[slot, :len(shared)] = shared
        if shared:
            # A cached prefix: the counter moves past what the pages hold.
            self.table = positions.raise_to(self.table, jnp.array([slot], jnp.int32),
                                            jnp.array([r.done], jnp.int32))
            self.events.append(f"{r.rid} joins: prefix hit, {r.done} tokens on "
                               f"{len(shared)} shared page(s)")
        else:
            self.events.append(f"{r.rid} joins ({len(r.prompt)}-token "
                               f"{'M-RoPE ' if r.mrope_prompt else ''}prompt)")

    def leave(self, r: Request) -> None:
        freed = self.smap.release(r.rid)
        self.table = positions.reset(self.table, jnp.asarray(freed, jnp.int32))
        self.block_table[freed] = 0
        for page in r.pages:
            self.owners[page] -= 1
            if not self.owners[page]:
                self.free_pages.append(page)
        self.events.append(f"{r.rid} leaves after {r.done} tokens")

    def _reserve(self, r: Request, upto: int) -> None:
        # Pages for KV positions [0, upto).
        while len(r.pages) * model.PAGE_SIZE < upto:
            page = self.free_pages.pop(0)
            self.owners[page] += 1
            self.block_table[self.smap.find(r.rid, LABEL), len(r.pages)] = page
            r.pages.append(page)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self, live: List[Request]) -> List[Tuple[Request, int]]:
        """``(request, tokens)`` of this step: decodes first, then prompt chunks."""
        decodes = [(r, 1) for r in live if r.done >= len(r.prompt)]
        budget = BUCKETS[-1] - len(decodes)
        chunks = []
        for r in live:
            if r.done < len(r.prompt) and budget > 0:
                n = min(CHUNK, budget, len(r.prompt) - r.done)
                chunks.append((r, n))
                budget -= n
        return decodes + chunks

    def run_step(self, s: int, work: List[Tuple[Request, int]], rng) -> Tuple[dict, list]:
        """Run the jitted step on ``work``; returns its outputs and each token's
        ``(request, index)``."""
        n = sum(count for _, count in work)
        bucket = next(b for b in BUCKETS if b >= n)
        ids = np.zeros(bucket, np.int32)
        prompt_pos = np.zeros((3, bucket), np.int32)
        use_prompt_pos = np.zeros(bucket, bool)
        tokens = []
        for r, count in work:
            if r.done >= len(r.prompt):     # decode: the next token id of the "sampler"
                r.ids.append(int(rng.integers(1, model.VOCAB)))
            else:
                r.ids.extend(r.prompt[r.done:r.done + count])
            self._reserve(r, r.done + count)
            t0 = len(tokens)
            ids[t0:t0 + count] = r.ids[r.done:r.done + count]
            if r.mrope_prompt and r.done < len(r.prompt):
                prompt_pos[:, t0:t0 + count] = r.positions[:, r.done:r.done + count]
                use_prompt_pos[t0:t0 + count] = True
            tokens.extend((r, r.done + i) for i in range(count))
        rows = positions.pad_rows([self.smap.find(r.rid, LABEL) for r, _ in work], CAPACITY)
        counts = np.zeros(CAPACITY, np.int32)
        counts[:len(work)] = [count for _, count in work]
        if s == self.fault_step:
            # A double commit: one stream's counter one past its tokens.
            self.table = positions.advance(self.table, jnp.asarray(rows[:1]),
                                           jnp.ones(1, jnp.int32))
            self.events.append(f"fault: {work[0][0].rid}'s counter advanced by one")
        self.table, self.cache, out, pos, kv_slots = self.step_fn(
            self.table, self.cache, self.device_weights, jnp.asarray(rows), jnp.asarray(counts),
            jnp.asarray(ids), jnp.asarray(prompt_pos), jnp.asarray(use_prompt_pos),
            jnp.asarray(self.block_table))
        for r, count in work:
            before = r.done
            r.done += count
            if r.mrope_prompt and before < len(r.prompt) <= r.done:
                # The prompt is in: decode positions are the counter plus the delta.
                delta = int(r.positions[0, len(r.prompt)] - len(r.prompt))
                self.table = positions.set_deltas(
                    self.table, jnp.array([self.smap.find(r.rid, LABEL)], jnp.int32),
                    jnp.array([delta], jnp.int32))
            self._register_prefix(r, before)
        return dict(out=np.asarray(out), pos=np.asarray(pos), kv_slots=np.asarray(kv_slots),
                    bucket=bucket), tokens

    def _register_prefix(self, r: Request, before: int) -> None:
        if r.mrope_prompt:
            return
        for p in range(before // model.PAGE_SIZE, min(r.done, len(r.prompt)) // model.PAGE_SIZE):
            key = tuple(r.prompt[:(p + 1) * model.PAGE_SIZE])
            if key not in self.prefix_pages:
                self.prefix_pages[key] = r.pages[p]
                self.owners[r.pages[p]] += 1

    # -- the float64 check -------------------------------------------------------------------
    def check(self, s: int, outputs: dict, tokens: list,
              live: List[Request]) -> Tuple[Optional[str], float]:
        """The first mismatch of step ``s`` (or None) and the largest attention error."""
        recomputed = {r.rid: model.recompute(self.cfg, self.projected, r.ids,
                                             r.positions[:, :len(r.ids)]) for r in live}
        worst = 0.0
        by_request: Dict[str, List[Tuple[int, int]]] = {}
        for t, (r, index) in enumerate(tokens):
            want = tuple(int(x) for x in r.positions[:, index])
            got = tuple(int(x) for x in outputs["pos"][:, t])
            if got != want:
                return (f"step {s}: request {r.rid!r} token {index}: position {got}, "
                        f"expected {want}"), worst
            by_request.setdefault(r.rid, []).append((t, index))
        for r in live:
            if r.rid not in by_request:
                continue
            rows, index = map(np.array, zip(*by_request[r.rid]))
            want = model.attention_of(recomputed[r.rid], index, self.cfg.head_dim)
            error = relative_error(outputs["out"][rows], want)
            worst = max(worst, error)
            if not error < ATTENTION_TOLERANCE:
                return (f"step {s}: request {r.rid!r} tokens {index[0]}-{index[-1]}: attention "
                        f"off by {error:.2e} (> {ATTENTION_TOLERANCE:.0e})"), worst
        k_pages, v_pages = (np.asarray(c) for c in self.cache)
        for r in live:
            index = np.arange(r.done)
            page = np.asarray(r.pages)[index // model.PAGE_SIZE]
            entry = index % model.PAGE_SIZE
            for name, pages in (("k", k_pages), ("v", v_pages)):
                got = pages[:, page, entry].transpose(1, 0, 2)
                error = relative_error(got, recomputed[r.rid][name][:r.done])
                if not error < CACHE_TOLERANCE:
                    return (f"step {s}: request {r.rid!r}: cached {name} rows off by "
                            f"{error:.2e} (> {CACHE_TOLERANCE:.0e})"), worst
        return None, worst


def interpret_default() -> bool:
    """The Pallas interpreter runs JAX's paged_attention off the GPU."""
    return jax.default_backend() != "gpu"
