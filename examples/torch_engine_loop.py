"""A torch engine loop over ``RopeManager``: plan -> ``apply_qk_and_append_kv`` into a
paged cache -> attention over each token's pages -> commit.

The engine keeps what an engine keeps: each request's pages (a block table) and its
``slot_mapping``, computed from the positions ``plan`` returns. Three requests prefill
in chunks and decode side by side; one leaves and its pages go to a later one. Every
token's attention output is checked against a float64 recompute of its sequence from
scratch. Run: ``python examples/torch_engine_loop.py`` (CPU is fine; on CUDA the fused
kernel is launched on torch's current stream).
"""

from __future__ import annotations

import numpy as np
import torch

import jaxrope as jr
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext

from float64_oracle import attention, verdict

CFG = jr.RopeConfig(head_dim=64, theta=10000.0)
HQ, HK, PAGE_SIZE, PAGES_PER_SEQ, PAGES = 4, 2, 4, 4, 16
SEED = 0


def attend(q: torch.Tensor, kv_cache: torch.Tensor, pages: torch.Tensor,
           kv_pos: torch.Tensor) -> torch.Tensor:
    """``[T, Hq, D]``: token ``t`` (rotated query ``q[t]``) over the keys ``0..kv_pos[t]``
    of its pages ``pages[t]`` in ``kv_cache [pages, 2, page_size, Hk, D]``."""
    k, v = (kv_cache[pages, i].flatten(1, 2) for i in (0, 1))       # [T, L, Hk, D]
    k, v = (x.repeat_interleave(HQ // HK, dim=2) for x in (k, v))    # GQA: head h reads h // group
    logits = torch.einsum("thd,tlhd->thl", q, k) * CFG.head_dim ** -0.5
    causal = torch.arange(k.shape[1], device=q.device)[None, :] <= kv_pos[:, None]
    logits = logits.masked_fill(~causal[:, None, :], float("-inf"))
    return torch.einsum("thl,tlhd->thd", logits.softmax(dim=-1), v)


def main() -> float:
    torch.manual_seed(SEED)
    print(f"seed {SEED}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mgr = RopeManager(PositionConfig(rope=CFG), device, max_seq_len=PAGES_PER_SEQ * PAGE_SIZE)
    lengths = {"a": 11, "b": 6, "c": 9}                # c arrives at step 3, on b's pages
    qkv = {rid: [torch.randn(n, h, CFG.head_dim) for h in (HQ, HK, HK)] for rid, n in lengths.items()}
    kv_cache = torch.zeros(PAGES, 2, PAGE_SIZE, HK, CFG.head_dim, device=device)
    free_pages, block_table, done, worst = list(range(PAGES)), {}, {}, 0.0
    for step_index in range(12):
        for rid in {0: ["a", "b"], 3: ["c"]}.get(step_index, []):
            mgr.ingest_request(rid)
            block_table[rid] = torch.tensor([free_pages.pop(0) for _ in range(PAGES_PER_SEQ)])
            done[rid] = 0
        live = [rid for rid in done if done[rid] < lengths[rid]]
        if not live:
            break
        # Up to 4 tokens a request (a prefill chunk; 1 once the "prompt" is half done: decode).
        segments = [Segment(r, "text", min(lengths[r] - done[r], 4 if done[r] < lengths[r] // 2 else 1))
                    for r in live]
        step, ctx = PositionStep(segments), StepContext(tuple(live))
        kv_pos = mgr.plan(step, ctx)["text"].cpu()                       # each token's position
        owner = [s.request_id for s in segments for _ in range(s.span)]
        pages = torch.stack([block_table[r] for r in owner])             # [T, PAGES_PER_SEQ]
        slot_mapping = pages[torch.arange(len(owner)), kv_pos // PAGE_SIZE] * PAGE_SIZE + kv_pos % PAGE_SIZE
        q, k, v = (torch.cat([qkv[s.request_id][i][done[s.request_id]:done[s.request_id] + s.span]
                              for s in segments]).to(device) for i in range(3))
        mgr.apply_qk_and_append_kv(q, k, v, "text", kv_cache, slot_mapping.to(device))
        out = attend(q, kv_cache, pages.to(device), kv_pos.to(device)).cpu().numpy()
        mgr.commit(step, ctx)
        for t, (rid, p) in enumerate(zip(owner, kv_pos.tolist())):
            expected = attention(CFG, *(x.numpy() for x in qkv[rid]), p)
            worst = max(worst, float(np.abs(out[t] - expected).max()))
        for s in segments:
            done[s.request_id] += s.span
            if done[s.request_id] == lengths[s.request_id]:               # it leaves: pages freed
                mgr.remove_request(s.request_id)
                free_pages += block_table.pop(s.request_id).tolist()
        print(f"step {step_index}: {[(s.request_id, s.span) for s in segments]}, "
              f"worst |out - float64| {worst:.2e}")
    return verdict(done, lengths, worst)


if __name__ == "__main__":
    main()
