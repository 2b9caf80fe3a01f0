"""The MLA fused op's data movement alone: the bound ``bench.fused_family_bench`` sets
beside ours and FlashInfer's for the DeepSeek-V3 cases (issue 46: "if a target proves out
of reach, measure the bound").

:func:`move_step` returns a step that does what ``apply_mla_rope_and_append`` must do to
memory and nothing else: q_pe (``[T, H, r]``) read and written (in place in bf16; into
an e4m3 output in fp8, q_nope ``[T, H, L]`` too), each token's k_pe ``[r]`` and ckv
``[L]`` rows read and written to the cache rows at its slot (FlashInfer's two-buffer
layout). Values are negated (a store of the value just loaded may be dropped) and cast;
no angle, no rotation, no scale. One Triton kernel (Triton itself, not Pallas), programs
of :data:`W` elements, a token's programs neighbours; :func:`check` compares one step with
torch before it is timed. GPU only (``TRITON_INTERPRET=1`` runs it on CPU tensors).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

W = 2048  # q elements a program: the Mosaic kernels' 4 KB piece of bf16
WARPS = 4


def _kernel():
    """The Triton kernel (imported here: Triton is a GPU-machine package).

    Program ``t * (PE + NOPE + 1) + j`` of token ``t``: ``j < PE``, elements ``[j * W,
    (j + 1) * W)`` of the token's q_pe row into ``q_pe_out`` (back into q_pe with
    ``IN_PLACE``);
    ``PE <= j < PE + NOPE``, the same of q_nope into ``q_nope_out``; the last program, the
    token's k_pe and ckv rows into the caches' row ``slots[t]``.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def move(q_pe, q_pe_out, q_nope, q_nope_out, k_pe, ckv, kpe_cache, ckv_cache, slots,
             PE: tl.constexpr, NOPE: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
             L: tl.constexpr, IN_PLACE: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        t = pid // (PE + NOPE + 1)
        j = pid % (PE + NOPE + 1)
        lanes = tl.arange(0, W)
        if j < PE:
            at = t * (PE * W) + j * W + lanes
            if IN_PLACE:
                tl.store(q_pe + at, -tl.load(q_pe + at))
            else:
                tl.store(q_pe_out + at, (-tl.load(q_pe + at)).to(q_pe_out.dtype.element_ty))
        elif j < PE + NOPE:
            at = t * (NOPE * W) + (j - PE) * W + lanes
            tl.store(q_nope_out + at, (-tl.load(q_nope + at)).to(q_nope_out.dtype.element_ty))
        else:
            slot = tl.load(slots + t).to(tl.int64)
            r = tl.arange(0, R)
            tl.store(kpe_cache + slot * R + r,
                     (-tl.load(k_pe + t * R + r)).to(kpe_cache.dtype.element_ty))
            c = tl.arange(0, L)
            tl.store(ckv_cache + slot * L + c,
                     (-tl.load(ckv + t * L + c)).to(ckv_cache.dtype.element_ty))

    return move


def move_step(q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
              ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, slots: torch.Tensor,
              q_nope: Optional[torch.Tensor] = None) -> Callable[[], None]:
    """A step moving one call's bytes. With fp8 caches, q_pe (and ``q_nope``, when given)
    go to e4m3 outputs made here (``step.outputs``); in bf16 q_pe is written in place.

    Raises:
      ValueError: a q row that is not a whole number of :data:`W` elements, or r / L not
        powers of two (Triton's ranges).
    """
    tokens, heads, rank = q_pe.shape
    latent = ckv.shape[-1]
    fp8 = ckv_cache.dtype == torch.float8_e4m3fn
    for name, n in (("q_pe row", heads * rank), ("q_nope row", q_nope[0].numel()
                                                 if q_nope is not None else 0)):
        if n % W:
            raise ValueError(f"{name} of {n} elements is not a multiple of W={W}")
    for name, n in (("r", rank), ("kv_lora_rank", latent)):
        if n & (n - 1):
            raise ValueError(f"{name}={n} must be a power of two")
    q_pe_out = torch.empty_like(q_pe, dtype=torch.float8_e4m3fn) if fp8 else q_pe
    nope_out = (torch.empty_like(q_nope, dtype=torch.float8_e4m3fn)
                if fp8 and q_nope is not None else None)
    pe_parts = heads * rank // W
    nope_parts = q_nope[0].numel() // W if nope_out is not None else 0
    kernel = _kernel()
    slots32 = slots.to(torch.int32)
    grid = (tokens * (pe_parts + nope_parts + 1),)
    # Pointers a call does not use get a one-element stand-in of their own (never read or
    # written: their branch does not run), not an alias of a used buffer.
    unused = torch.empty(1, dtype=q_pe.dtype, device=q_pe.device)
    pe_to = unused if q_pe_out is q_pe else q_pe_out
    nope_in, nope_to = (q_nope, nope_out) if nope_out is not None else (unused, unused)

    def step() -> None:
        kernel[grid](q_pe, pe_to, nope_in, nope_to, k_pe, ckv,
                     kpe_cache.view(-1, rank), ckv_cache.view(-1, latent), slots32,
                     PE=pe_parts, NOPE=nope_parts, W=W, R=rank, L=latent,
                     IN_PLACE=q_pe_out is q_pe, num_warps=WARPS)

    step.outputs = (q_pe_out, nope_out)
    return step


def check(step: Callable[[], None], q_pe: torch.Tensor, k_pe: torch.Tensor,
          ckv: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
          slots: torch.Tensor, q_nope: Optional[torch.Tensor] = None) -> None:
    """Run ``step`` once and compare what it wrote with torch's (exact: a negation and a
    cast round alike); q_pe is restored afterwards when it is written in place.

    Raises:
      AssertionError: a written row or output that differs.
    """
    q_pe_before = q_pe.clone()
    step()
    q_pe_out, nope_out = step.outputs
    out_dtype = q_pe_out.dtype
    assert torch.equal(q_pe_out, (-q_pe_before).to(out_dtype)), "q_pe"
    if nope_out is not None:
        assert torch.equal(nope_out, (-q_nope).to(out_dtype)), "q_nope"
    rank, latent = k_pe.shape[-1], ckv.shape[-1]
    rows = slots.long()
    assert torch.equal(kpe_cache.view(-1, rank)[rows], (-k_pe).to(kpe_cache.dtype)), "k_pe rows"
    assert torch.equal(ckv_cache.view(-1, latent)[rows], (-ckv).to(ckv_cache.dtype)), "ckv rows"
    if q_pe_out is q_pe:
        q_pe.copy_(q_pe_before)
