"""The body of :mod:`torch_bridge.device_counters`' step kernel, undecorated.

``device_counters`` wraps it with ``triton.jit`` on CUDA or Triton's interpreter on CPU.
It lives apart because Triton reads its annotations from the source text (no
``from __future__ import annotations`` here) and needs Triton importable. It calls only
Triton builtins (``lanes * 0``, not ``tl.zeros``): the interpreter, enabled per kernel
rather than by ``TRITON_INTERPRET``, cannot call ``triton.language``'s jitted helpers.
"""

import triton.language as tl


def step_kernel(counters, work, meta, dmeta, out,
                n_meta, capacity, tmp_offset,
                r_add, r_fork, r_max, r_zero, copy_work, w_add, w_fork, p_fork,
                views_offset, n_views, n_tokens, search_steps,
                SEQUENTIAL: tl.constexpr, BLOCK: tl.constexpr):
    # Meta layout, in int32:
    # [r_add slots, r_add amounts, r_fork src, r_fork dst, r_max slots, r_max values,
    #  r_zero slots, w_add slots, w_add amounts, w_fork src, w_fork dst, p_fork src,
    #  p_fork dst, view slots, view starts]. ``dmeta`` holds a device copy, then fork
    # values at ``tmp_offset``.
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    for i in range(0, n_meta, BLOCK):
        idx = i + lanes
        tl.store(dmeta + idx, tl.load(meta + idx, mask=idx < n_meta), mask=idx < n_meta)
    tl.debug_barrier()

    off = 0
    for i in range(0, r_add, BLOCK):
        idx = i + lanes
        slot = tl.load(dmeta + off + idx, mask=idx < r_add, other=capacity)
        amount = tl.load(dmeta + off + r_add + idx, mask=idx < r_add, other=0)
        tl.atomic_add(counters + slot, amount, mask=(idx < r_add) & (slot < capacity))
    off += 2 * r_add
    tl.debug_barrier()
    for i in range(0, r_fork, BLOCK):
        idx = i + lanes
        src = tl.load(dmeta + off + idx, mask=idx < r_fork, other=capacity)
        value = tl.load(counters + src, mask=(idx < r_fork) & (src < capacity), other=0,
                        volatile=True)
        tl.store(dmeta + tmp_offset + idx, value, mask=idx < r_fork)
    tl.debug_barrier()
    for i in range(0, r_fork, BLOCK):
        idx = i + lanes
        dst = tl.load(dmeta + off + r_fork + idx, mask=idx < r_fork, other=capacity)
        value = tl.load(dmeta + tmp_offset + idx, mask=idx < r_fork, other=0, volatile=True)
        tl.store(counters + dst, value, mask=(idx < r_fork) & (dst < capacity))
    off += 2 * r_fork
    tl.debug_barrier()
    for i in range(0, r_max, BLOCK):
        idx = i + lanes
        slot = tl.load(dmeta + off + idx, mask=idx < r_max, other=capacity)
        value = tl.load(dmeta + off + r_max + idx, mask=idx < r_max, other=0)
        tl.atomic_max(counters + slot, value, mask=(idx < r_max) & (slot < capacity))
    off += 2 * r_max
    tl.debug_barrier()
    for i in range(0, r_zero, BLOCK):
        idx = i + lanes
        slot = tl.load(dmeta + off + idx, mask=idx < r_zero, other=capacity)
        tl.store(counters + slot, lanes * 0, mask=(idx < r_zero) & (slot < capacity))
    off += r_zero
    tl.debug_barrier()

    if copy_work != 0:
        for i in range(0, capacity, BLOCK):
            idx = i + lanes
            tl.store(work + idx, tl.load(counters + idx, mask=idx < capacity, volatile=True),
                     mask=idx < capacity)
        tl.debug_barrier()
    for i in range(0, w_add, BLOCK):
        idx = i + lanes
        slot = tl.load(dmeta + off + idx, mask=idx < w_add, other=capacity)
        amount = tl.load(dmeta + off + w_add + idx, mask=idx < w_add, other=0)
        tl.atomic_add(work + slot, amount, mask=(idx < w_add) & (slot < capacity))
    off += 2 * w_add
    tl.debug_barrier()
    # Speculative post-forks, then the pre-forks: two fork phases over ``work``.
    for phase in range(2):
        n_fork = w_fork if phase == 0 else p_fork
        for i in range(0, n_fork, BLOCK):
            idx = i + lanes
            src = tl.load(dmeta + off + idx, mask=idx < n_fork, other=capacity)
            value = tl.load(work + src, mask=(idx < n_fork) & (src < capacity), other=0,
                            volatile=True)
            tl.store(dmeta + tmp_offset + idx, value, mask=idx < n_fork)
        tl.debug_barrier()
        for i in range(0, n_fork, BLOCK):
            idx = i + lanes
            dst = tl.load(dmeta + off + n_fork + idx, mask=idx < n_fork, other=capacity)
            value = tl.load(dmeta + tmp_offset + idx, mask=idx < n_fork, other=0, volatile=True)
            tl.store(work + dst, value, mask=(idx < n_fork) & (dst < capacity))
        off += 2 * n_fork
        tl.debug_barrier()

    # Positions: token t belongs to the last view whose start is <= t (an empty view
    # shares its start with the next one, which wins).
    off = views_offset
    step = tl.num_programs(0) * BLOCK
    for t0 in range(pid * BLOCK, n_tokens, step):
        token = t0 + lanes
        live = token < n_tokens
        lo = lanes * 0
        hi = lanes * 0 + (n_views - 1)
        for _ in range(search_steps):
            mid = (lo + hi + 1) // 2
            start = tl.load(dmeta + off + n_views + mid, mask=live, other=0, volatile=True)
            ahead = start <= token
            lo = tl.where(ahead, mid, lo)
            hi = tl.where(ahead, hi, mid - 1)
        slot = tl.load(dmeta + off + lo, mask=live, other=capacity, volatile=True)
        base = tl.load(work + slot, mask=live & (slot < capacity), other=0, volatile=True)
        if SEQUENTIAL:
            start = tl.load(dmeta + off + n_views + lo, mask=live, other=0, volatile=True)
            base = base + token - start
        tl.store(out + token, base, mask=live)
