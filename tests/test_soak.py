"""Soak: 100k requests stream through one RopeManager with a bounded live set.

Each request is ingested (some with a cached prefix, some admitted from another node),
prefilled in chunks, decoded a few tokens, published and removed; a few are cancelled
between plan and commit. The live set swings between two bounds in waves, so slots
are freed and reused while the table has to grow once past its initial size.

Checked along the way: every step's positions and every publication against a plain
Python model, and now and then an ``apply_qk`` against the float64 oracle. At the end:
no slot leaked (no request, stream or non-zero counter left, every slot free), the
slot table is the smallest that held the peak live set, and process memory (RSS) did
not grow after warm-up by more than ``RSS_TOLERANCE``. Run with ``-s`` for the figures;
``--run-slow`` adds a 1M-request run.
"""

from __future__ import annotations

import gc
import os
import random
import time
from typing import Dict, List, Tuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402

from jaxrope.testing import oracle  # noqa: E402
from torch_bridge import (PositionConfig, PositionStep, PublishedPositionInfo,  # noqa: E402
                          RopeManager, Segment, StepContext)
from torch_bridge import manager as manager_module  # noqa: E402

HEAD_DIM = 8
MAX_SEQ_LEN = 4096
CHUNK = 16                     # prefill chunk size
LIVE_LOW, LIVE_HIGH = 96, 320  # the live set swings between these (requests, one stream each)
RSS_TOLERANCE = 64 << 20       # bytes of RSS growth allowed after warm-up
# ... and between two checkpoints (a tenth of the run) in which nothing new was compiled.
# New step shapes compile new executables (a few hundred KiB each, a bounded set: sizes
# are bucketed); anything else that grows is a leak.
RSS_WINDOW_TOLERANCE = 8 << 20
CHECK_APPLY_EVERY = 256        # steps between apply_qk checks


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compiled(mgr: RopeManager) -> int:
    """Executables compiled so far: the JAX path's rotations (plan and commit compile nothing)."""
    rotation = mgr._jax
    return 0 if rotation is None else rotation.call._jitted._cache_size()


class Live:
    """The model of one live request: what is left to run and its next position."""

    __slots__ = ("prompt", "decode", "position")

    def __init__(self, prompt: int, decode: int, position: int):
        self.prompt, self.decode, self.position = prompt, decode, position


def next_span(request: Live) -> int:
    return min(request.prompt, CHUNK) if request.prompt else 1


def after(request: Live, span: int) -> Live:
    """The request once a step of ``span`` tokens has committed."""
    if request.prompt:
        return Live(request.prompt - span, request.decode, request.position + span)
    return Live(0, request.decode - 1, request.position + span)


def build(requests: Dict[str, Live]):
    """A step over ``requests``: its segments and the positions the model expects."""
    segments, expected = [], []
    for rid, request in requests.items():
        n = next_span(request)
        segments.append(Segment(rid, "text", n))
        expected.append(np.arange(request.position, request.position + n))
    return PositionStep(segments), np.concatenate(expected) if expected else np.zeros(0, np.int64)


def soak(total: int, seed: int) -> Dict[str, object]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rope = jr.RopeConfig(head_dim=HEAD_DIM, theta=1e4, max_position=MAX_SEQ_LEN)
    mgr = RopeManager(PositionConfig(rope=rope), "cpu", max_seq_len=MAX_SEQ_LEN, launcher="jax")
    inv_freq, attention = oracle.serving_frequencies(rope)
    ctx, preplan_ctx = StepContext(), StepContext(is_preplan=True)
    live: Dict[str, Live] = {}
    ingested = steps = pipelined = published = cancelled = peak = 0
    staged = None  # (step, positions) planned early, current in the manager once the last commit ran
    bound = LIVE_HIGH
    # Many short windows: whatever the seed, several see no new executable (whose code
    # legitimately grows RSS), and those must not grow.
    checkpoint_every = max(total // 40, 1)
    rss: List[Tuple[int, int]] = []  # (RSS bytes, executables compiled) at each checkpoint
    start = time.perf_counter()

    while ingested < total or live:
        if staged is not None and rng.random() < 0.8:
            (step, positions), staged = staged, None
            pipelined += 1
        else:
            staged = None
            # Waves: fill up to the bound, then let the live set drain to the other one.
            if len(live) <= LIVE_LOW:
                bound = LIVE_HIGH
            elif len(live) >= LIVE_HIGH:
                bound = LIVE_LOW
            while len(live) < bound and ingested < total:
                rid = f"req{ingested}"
                ingested += 1
                mgr.ingest_request(rid)
                prompt, start_at = rng.randint(1, 40), 0
                kind = rng.random()
                if kind < 0.1:  # part of the prompt is in the prefix cache
                    start_at = rng.randint(1, prompt)
                    mgr.apply_cached_prefix(rid, "node", "walk", None, {"text": start_at})
                elif kind < 0.15:  # prefilled elsewhere: only decode runs here
                    start_at = prompt
                    outcome = mgr.admit_retrieve(rid, "node", "walk",
                                                 PublishedPositionInfo({"text": prompt}))
                    assert outcome.ok
                live[rid] = Live(prompt - start_at, rng.randint(1, 4), start_at)
                if ingested % checkpoint_every == 0:
                    gc.collect()
                    rss.append((rss_bytes(), compiled(mgr)))
            peak = max(peak, len(live))
            step, expected = build(live)
            positions = mgr.plan(step, ctx)["text"]
            np.testing.assert_array_equal(positions.numpy(), expected)

        if steps % CHECK_APPLY_EVERY == 0:
            q = torch.randn(1, 1, HEAD_DIM, generator=gen) + 1.0
            k = torch.randn(1, 1, HEAD_DIM, generator=gen) + 1.0
            want = oracle.rope_oracle(q.numpy(), positions[:1].numpy(), inv_freq, attention,
                                      HEAD_DIM, False)
            mgr.apply_qk(q, k, "text")
            np.testing.assert_allclose(q.numpy(), want, rtol=0, atol=2e-5)
        # A request cancelled mid-step: the plan still commits, without it.
        if rng.random() < 0.05:
            victim = step.segments[rng.randrange(len(step.segments))].request_id
            mgr.remove_request(victim)
            del live[victim]
            cancelled += 1
        # Half the time the next step (the requests that go on) is planned before this commit.
        updated = {s.request_id: after(live[s.request_id], s.span)
                   for s in step.segments if s.request_id in live}
        going_on = {rid: r for rid, r in updated.items() if r.prompt or r.decode}
        if going_on and rng.random() < 0.5:
            next_step, expected = build(going_on)
            next_positions = mgr.plan(next_step, preplan_ctx)["text"]
            np.testing.assert_array_equal(next_positions.numpy(), expected)
            staged = next_step, next_positions
        mgr.commit(step, ctx)
        steps += 1

        live.update(updated)
        for rid in [rid for rid in updated if rid not in going_on]:
            if rng.random() < 0.5:
                info = mgr.publish(rid)
            else:
                snapshot = mgr.publish_snapshot_for_step(rid, "node", "walk")
                info = mgr.publish_from_snapshot(rid, snapshot, "node", "walk")
            assert info.counters == {"text": live[rid].position}, rid
            published += 1
            mgr.remove_request(rid)
            del live[rid]

    elapsed = time.perf_counter() - start
    gc.collect()
    rss.append((rss_bytes(), compiled(mgr)))
    state = mgr.state_snapshot()
    return {"requests": ingested, "steps": steps, "pipelined": pipelined, "published": published,
            "cancelled": cancelled, "seconds": elapsed, "peak_live": peak, "rss": rss,
            "state": state, "slot_peak": state["row_map"]["peak"],
            "capacity": state["row_map"]["capacity"]}


def smallest_capacity(peak_streams: int) -> int:
    """The slot map's capacity after growing from its initial size to hold ``peak_streams``."""
    capacity = manager_module._INITIAL_SLOTS
    while capacity < peak_streams:
        capacity *= 2
    return capacity


def check(result: Dict[str, object], total: int) -> None:
    state = result["state"]
    rss = [r for r, _ in result["rss"]]
    compiles = [c for _, c in result["rss"]]
    growth = max(rss[1:]) - rss[0]
    quiet = [b - a for (a, ca), (b, cb) in zip(result["rss"], result["rss"][1:]) if ca == cb]
    print(f"\nsoak: {result['requests']} requests, {result['steps']} steps "
          f"({result['pipelined']} planned while the previous one ran), "
          f"{result['published']} published, {result['cancelled']} cancelled in "
          f"{result['seconds']:.1f} s; peak live set {result['peak_live']} requests, slot map "
          f"peak {result['slot_peak']}, capacity {result['capacity']}; RSS after warm-up "
          f"{rss[0] / 2**20:.1f} MiB, max {max(rss[1:]) / 2**20:.1f} MiB, end {rss[-1] / 2**20:.1f} MiB "
          f"(growth {growth / 2**20:+.1f} MiB, checkpoints "
          f"{[round(r / 2**20, 1) for r in rss]}, executables {compiles}; largest growth "
          f"between checkpoints without a new executable "
          f"{max(quiet, default=0) / 2**20:+.1f} MiB over {len(quiet)} windows)")
    assert result["requests"] == total
    assert result["published"] + result["cancelled"] == total
    # No slot leaked: nothing live, every counter back to 0, every slot on the free list.
    assert state["requests"] == {} and state["counters"] == {}
    assert state["current"] is None and state["staged"] is None
    assert set(state["slots"]) == {0}
    row_map = state["row_map"]
    assert row_map["live"] == 0 and sorted(row_map["free"]) == list(range(row_map["capacity"]))
    # The table never grew past what the peak live set needed.
    assert result["slot_peak"] == result["peak_live"] > manager_module._INITIAL_SLOTS
    assert result["capacity"] == len(state["slots"]) == smallest_capacity(result["peak_live"])
    assert growth < RSS_TOLERANCE, f"RSS grew {growth / 2**20:.1f} MiB after warm-up"
    assert len(quiet) >= 3 and max(quiet) < RSS_WINDOW_TOLERANCE, quiet


def test_100k_requests_leak_no_slot_and_no_memory(rng):
    total = 100_000
    check(soak(total, seed=int(rng.integers(2**32))), total)


@pytest.mark.slow
def test_1m_requests_leak_no_slot_and_no_memory(rng):
    total = 1_000_000
    check(soak(total, seed=int(rng.integers(2**32))), total)
