"""The Mosaic GPU fused append with a per-head QK-norm and an fp8 q, compiled on the
GPU, against the XLA reference
(:func:`jaxrope.ops.rope_append_kv.reference.rope_append_kv_reference`) on the same
inputs:

- launched from torch (``MosaicKVLauncher.rotate_and_append_kv_(..., norm=, q_out=)``):
  q (in place, or quantized into ``q_out`` with q left as it was) and every cache entry,
  bf16 and fp8 caches, a pair and a combined array, both conventions, partial rotary,
  M-RoPE, tokens past a block and padding slots; a per-token norm declined, a wrong
  ``q_out`` refused;
- through JAX (``rope_append_kv_mosaic``, the fp8 q the kernel's result) on named cases.

The CPU suite runs the same kernel body in Mosaic GPU's interpreter
(tests/test_kv_norm_fp8q_mosaic.py).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_mosaic_launch_gpu import _close  # noqa: E402

pytestmark = pytest.mark.gpu

LARGE = 1 << 20


def _numpy(t):
    return t.float().cpu().numpy()


def _expected(q, k, v, pos, caches, slots, cfg, geometry, scales, norm, q_fp8):
    # The reference's (q, caches) on copies of the inputs; q's float32 rotation quantized
    # for an fp8 q (one rounding, as the kernel's).
    import jax.numpy as jnp
    from jaxrope.ops.constants import kernel_constants, kernel_options
    from jaxrope.ops.rope_append_kv.cache_layout import cache_rows
    from jaxrope.ops.rope_append_kv.reference import (FP8, rope_append_kv_reference,
                                                      to_cache_dtype)
    jax_dtype = {torch.bfloat16: jnp.bfloat16, torch.float8_e4m3fn: FP8}
    q_w, k_w, qk_norm = norm
    rows = cache_rows(geometry.layout, geometry.combined,
                      geometry.view_shape[0] // geometry.components, geometry.page_size,
                      geometry.k_heads)
    views = tuple(jnp.asarray(_numpy(c), jax_dtype[c.dtype]).reshape(-1, c.shape[-1])
                  for c in caches)
    tables, _ = kernel_constants(cfg)
    q_in = jnp.asarray(_numpy(q), jnp.float32 if q_fp8 else jnp.bfloat16)
    q_ref, views = rope_append_kv_reference(
        q_in, *(jnp.asarray(_numpy(x), jnp.bfloat16) for x in (k, v)),
        jnp.asarray(pos.cpu().numpy()), jnp.asarray(slots.cpu().numpy().astype(np.int32)),
        jnp.asarray(tables), jnp.asarray(scales, jnp.float32), views, rows=rows,
        q_norm_weight=None if q_w is None else jnp.asarray(_numpy(q_w)),
        k_norm_weight=None if k_w is None else jnp.asarray(_numpy(k_w)), qk_norm=qk_norm,
        **kernel_options(cfg))
    if q_fp8:
        q_ref = to_cache_dtype(q_ref, scales[2], FP8)
    return (np.asarray(q_ref.astype(jnp.float32)),
            [np.asarray(x.astype(jnp.float32)).reshape(c.shape) for x, c in zip(views, caches)])


@pytest.mark.parametrize("layout, combined, fp8_cache, q_fp8, convention, rotary, mrope", [
    ("NHD", False, False, False, "rmsnorm", 128, False),
    ("NHD", False, True, True, "rmsnorm", 128, False),
    ("HND", True, False, True, "gemma", 64, False),
    ("HND", False, True, True, "gemma", 128, True),
    ("NHD", True, False, False, "gemma", 64, True),
])
@pytest.mark.parametrize("tokens", [1, 300])
def test_a_normalised_fp8_q_launch_writes_what_the_reference_writes(
        hopper, device, layout, combined, fp8_cache, q_fp8, convention, rotary, mrope, tokens):
    import jaxrope as jr
    from torch_bridge.kv_append import check_call
    from torch_bridge.launch.mosaic import MosaicKVLauncher
    cfg = jr.RopeConfig(head_dim=128, rotary_dim=rotary, theta=1e6, max_position=LARGE,
                        mrope_section=(8, 12, 12) if mrope and rotary == 64 else (
                            (16, 24, 24) if mrope else None))
    seed = tokens + 2 * combined + 4 * q_fp8 + 8 * fp8_cache
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, 128, device=device, generator=gen).bfloat16()
               for h in (32, 8, 8))
    pages = 2 * -(-tokens // 16) + 1
    entry = (16, 8) if layout == "NHD" else (8, 16)
    shape = (pages, *((2,) if combined else ()), *entry, 128)
    cache_dtype = torch.float8_e4m3fn if fp8_cache else torch.bfloat16
    kv_cache = [torch.randn(shape, device=device, generator=gen).to(cache_dtype)
                for _ in range(1 if combined else 2)]
    kv_cache = kv_cache[0] if combined else tuple(kv_cache)
    slots = torch.randperm(pages * 16, device=device, generator=gen)[:tokens]
    slots[::7] = -1
    pos = torch.randint(0, 1 << 19, (3, tokens) if mrope else (tokens,), device=device,
                        dtype=torch.int32, generator=gen)
    centre = 0.0 if convention == "gemma" else 1.0
    norm = (centre + 0.5 * torch.randn(128, device=device, generator=gen).bfloat16(),
            centre + 0.5 * torch.randn(128, device=device, generator=gen),
            jr.QKNorm(eps=1e-6, convention=convention))
    scale = 0.75 if fp8_cache else None
    caches, geometry, scales = check_call(k, v, kv_cache, slots, layout, scale, scale, device)
    scales = (*scales, 40.0) if q_fp8 else scales
    want_q, want_caches = _expected(q, k, v, pos, caches, slots, cfg, geometry,
                                    (*scales, 1.0)[:3], norm, q_fp8)
    q_before = q.clone()
    q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=device) if q_fp8 else None
    MosaicKVLauncher().rotate_and_append_kv_(q, k, v, pos, caches, slots, cfg, geometry,
                                             scales, norm=norm, q_out=q_out)
    torch.cuda.synchronize()
    def on_device(x):
        return torch.from_numpy(np.array(x, np.float32)).to(device)
    # _close's bounds: an e4m3 step for labels ending "fp8", else two bf16 ulps of the row.
    if q_fp8:
        assert torch.equal(q, q_before), "q is only read when q goes to q_out"
        _close(q_out, on_device(want_q), "q_out fp8")
    else:
        _close(q, on_device(want_q), "q")
    for i, (got, want) in enumerate(zip(caches, want_caches)):
        _close(got, on_device(want), f"cache {i}" + (" fp8" if fp8_cache else ""))


def test_a_per_token_norm_is_declined_and_a_wrong_q_out_refused(hopper, device):
    # A per-token norm goes back to the manager's JAX path (BackendUnavailable); a q_out
    # the kernel would write past is refused before any launch.
    import jaxrope as jr
    from torch_bridge.kv_append import check_call
    from torch_bridge.launch.mosaic import MosaicKVLauncher
    cfg = jr.RopeConfig(head_dim=128)
    q, k, v = (torch.zeros(4, h, 128, device=device, dtype=torch.bfloat16) for h in (32, 8, 8))
    kv_cache = tuple(torch.zeros(2, 16, 8, 128, device=device, dtype=torch.bfloat16)
                     for _ in "kv")
    slots = torch.arange(4, device=device)
    pos = torch.arange(4, device=device, dtype=torch.int32)
    caches, geometry, scales = check_call(k, v, kv_cache, slots, "NHD", None, None, device)
    launcher = MosaicKVLauncher()
    olmo2 = (torch.ones(32 * 128, device=device), None, jr.QKNorm(eps=1e-5, per_head=False))
    with pytest.raises(jr.BackendUnavailable, match="per_head=False"):
        launcher.rotate_and_append_kv_(q, k, v, pos, caches, slots, cfg, geometry, scales,
                                       norm=olmo2)
    short = torch.empty(3, 32, 128, device=device, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="q_out"):
        launcher.rotate_and_append_kv_(q, k, v, pos, caches, slots, cfg, geometry,
                                       (*scales, 1.0), q_out=short)


@pytest.mark.parametrize("name, convention, q_fp8", [
    ("llama3_fp8_nhd", "rmsnorm", True), ("llama3_hnd_p16", "gemma", False),
    ("partial_half_fp8_hnd_combined", "rmsnorm", True), ("gptj_interleave_hnd_combined",
                                                         "gemma", True),
    ("glm41v_pairs_fp8_hnd", "rmsnorm", False), ("head_dim_512_hnd", "gemma", True)])
def test_the_jax_path_kernel_normalises_and_quantizes_as_the_reference(hopper, name,
                                                                        convention, q_fp8):
    # The compiled kernel through rope_append_kv_mosaic (static T, q_out its result)
    # against the XLA reference on the same device: the hardware sine and rsqrt against
    # XLA's, within two bf16 ulps of a row's scale, fp8 within an e4m3 ulp.
    import jax
    import jax.numpy as jnp
    import jaxrope as jr
    from jaxrope.cases import APPEND_BY_NAME
    from jaxrope.ops.constants import kernel_constants, kernel_options
    from jaxrope.ops.rope_append_kv import api as kv_api
    from jaxrope.ops.rope_append_kv.mosaic import rope_append_kv_mosaic
    from jaxrope.ops.rope_append_kv.reference import (FP8, rope_append_kv_reference,
                                                      to_cache_dtype)
    from jaxrope.testing import kv_oracle
    from jaxrope.testing.kv_inputs import make_inputs
    case = APPEND_BY_NAME[name]
    rng = np.random.default_rng(sum(map(ord, name)) + q_fp8)
    x = make_inputs(rng, case, jnp.bfloat16)
    head_dim = case.case.head_dim
    centre = 0.0 if convention == "gemma" else 1.0
    weights = [jnp.asarray(centre + 0.5 * rng.standard_normal(head_dim), dtype)
               for dtype in (jnp.bfloat16, jnp.float32)]
    caches, _, rows = kv_api._caches(x.kv_cache, case.layout, x.k)
    tables, _ = kernel_constants(case.case.cfg)
    options = dict(rows=rows, q_norm_weight=weights[0], k_norm_weight=weights[1],
                   qk_norm=jr.QKNorm(eps=1e-6, convention=convention),
                   **kernel_options(case.case.cfg))
    scales = jnp.asarray([0.75, 150.0, 40.0], jnp.float32)
    views = tuple(c.reshape(-1, c.shape[-1]) for c in caches)
    args = (x.k, x.v, jnp.asarray(x.pos), jnp.asarray(x.slots), jnp.asarray(tables), scales,
            views)
    ours = jax.jit(lambda q, *a: rope_append_kv_mosaic(
        q, *a, q_dtype=FP8 if q_fp8 else None, **options))(x.q, *args)
    theirs = jax.jit(lambda q, *a: rope_append_kv_reference(q, *a, **options))(
        x.q.astype(jnp.float32) if q_fp8 else x.q, *args)
    if q_fp8:
        theirs = (to_cache_dtype(theirs[0], scales[2], FP8), theirs[1])
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        a, b = np.asarray(a), np.asarray(b)
        worst = (kv_oracle.ulps(a, b) if a.dtype == FP8 else kv_oracle.row_ulps(a, b)).max()
        assert worst <= (1 if a.dtype == FP8 else 2), f"{name}: {worst} ulps apart"
