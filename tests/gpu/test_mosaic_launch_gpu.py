"""The Mosaic GPU kernel launched from torch (torch_bridge.launch.mosaic): the float64
oracle's answer on every named case, one compile per launch shape with T read at run
time, torch's current stream, CUDA-graph capture, and the bridge's default path with
Pallas's Triton backend turned into an error.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from jaxrope.cases import BY_NAME, CASES, MROPE_CASES  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402

pytestmark = pytest.mark.gpu

LARGE = 1 << 20
BOUND = {torch.bfloat16: 2.5e-3, torch.float16: 2.5e-3, torch.float32: 1e-5}


@pytest.fixture(scope="module")
def launcher(hopper, device):
    from torch_bridge.launch.mosaic import MosaicLauncher
    return MosaicLauncher()


def _inputs(case, tokens, dtype, device, seed):
    cfg = dataclasses.replace(case.cfg, max_position=LARGE)
    gen = np.random.default_rng(seed)
    q, k = (torch.from_numpy(gen.standard_normal((tokens, h, cfg.head_dim))).to(device, dtype)
            for h in (case.q_heads, case.k_heads))
    shape = (tokens,) if cfg.mrope_section is None else (3, tokens)
    pos = torch.from_numpy(gen.integers(0, LARGE, shape).astype(np.int32)).to(device)
    return cfg, q, k, pos


def _check(cfg, before, after, pos, dtype):
    for x, y in zip(before, after):
        x, y = x.double().cpu().numpy(), y.double().cpu().numpy()
        assert oracle.relative_error(y, oracle.rope_of(cfg, x, pos.cpu().numpy())) < BOUND[dtype]
        np.testing.assert_array_equal(y[..., cfg.rotary_dim:], x[..., cfg.rotary_dim:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES + MROPE_CASES, ids=lambda c: c.name)
def test_mosaic_launch_rotates_every_case_in_place_like_the_oracle(launcher, device, case, dtype):
    cfg, q, k, pos = _inputs(case, 257, dtype, device, seed=hash(case.name) % 1000)
    before = q.clone(), k.clone()
    pointers = q.data_ptr(), k.data_ptr()
    launcher.rotate_(q, k, pos, cfg)
    assert (q.data_ptr(), k.data_ptr()) == pointers
    _check(cfg, before, (q, k), pos, dtype)


@pytest.mark.parametrize("grid", [1, 3, None])
@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 4099])
@pytest.mark.parametrize("name", ["llama3_8b", "qwen2_vl_7b", "gptj_interleave"])
def test_mosaic_launch_covers_any_token_count_and_grid(launcher, device, name, tokens, grid):
    # A grid smaller than the count's blocks walks them in turn; rows past T (the rest of
    # a larger buffer) stay as they were.
    case = BY_NAME[name]
    cfg, q_all, k_all, pos = _inputs(case, tokens + 40, torch.bfloat16, device, seed=tokens)
    before = q_all.clone(), k_all.clone()
    q, k = q_all[:tokens], k_all[:tokens]
    launcher.rotate_(q, k, pos[..., :tokens].contiguous(), cfg, grid=grid)
    _check(cfg, (before[0][:tokens], before[1][:tokens]), (q, k), pos[..., :tokens],
           torch.bfloat16)
    assert torch.equal(q_all[tokens:], before[0][tokens:])
    assert torch.equal(k_all[tokens:], before[1][tokens:])


def test_one_compile_serves_every_token_count_of_a_launch_shape(hopper, device):
    from torch_bridge.launch.mosaic import MosaicLauncher
    launcher = MosaicLauncher()
    case = BY_NAME["llama3_8b"]
    for tokens in range(33, 65):  # 3 or 4 blocks of 16 tokens: one grid of 4
        cfg, q, k, pos = _inputs(case, tokens, torch.bfloat16, device, seed=tokens)
        before = q.clone(), k.clone()
        launcher.rotate_(q, k, pos, cfg)
        _check(cfg, before, (q, k), pos, torch.bfloat16)
    assert len(launcher._modules) == 1


def test_mosaic_launch_runs_on_the_current_stream_and_in_a_cuda_graph(launcher, device):
    case = BY_NAME["llama3_8b"]
    cfg, q, k, pos = _inputs(case, 300, torch.bfloat16, device, seed=7)
    side = torch.cuda.Stream(device)
    source, k_before = q.clone(), k.clone()
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        # Written on the side stream just before the launch: a launch on another stream
        # would read the stale zeros.
        torch.cuda._sleep(10_000_000)
        q.zero_().add_(source)
        launcher.rotate_(q, k, pos, cfg)
    side.synchronize()
    _check(cfg, (source, k_before), (q, k), pos, torch.bfloat16)
    # The captured graph replays on new contents of the same buffers.
    static_q, static_k, static_pos = q.clone(), k.clone(), pos.clone()
    launcher.rotate_(static_q, static_k, static_pos, cfg)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launcher.rotate_(static_q, static_k, static_pos, cfg)
    _, q2, k2, pos2 = _inputs(case, 300, torch.bfloat16, device, seed=8)
    static_q.copy_(q2)
    static_k.copy_(k2)
    static_pos.copy_(pos2)
    graph.replay()
    torch.cuda.synchronize()
    _check(cfg, (q2, k2), (static_q, static_k), pos2, torch.bfloat16)


def test_bridge_default_is_the_mosaic_launch_with_pallas_triton_an_error(hopper, device):
    # The seed's apply_qk and apply_qk_and_append_kv on Hopper launch the Mosaic kernels:
    # with the Triton backend's deprecation turned into the error it becomes, no warning,
    # no fallback.
    from jax._src import deprecations

    import jaxrope as jr
    from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
    from torch_bridge.launch.mosaic import MosaicKVLauncher, MosaicLauncher
    cfg = jr.RopeConfig(head_dim=128, theta=5e5, max_position=LARGE)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        deprecations.accelerate("jax-pallas-triton")
        try:
            mgr = RopeManager(PositionConfig(rope=cfg), device, max_seq_len=LARGE)
            assert isinstance(mgr.launcher, MosaicLauncher)
            assert isinstance(mgr.kv_launcher, MosaicKVLauncher)
            for rid in ("a", "b"):
                mgr.ingest_request(rid)
            step = PositionStep([Segment("a", "text", 5), Segment("b", "text", 3)])
            ctx = StepContext(("a", "b"))
            pos = mgr.plan(step, ctx)["text"]
            _, q, k, _ = _inputs(BY_NAME["llama3_8b"], 8, torch.bfloat16, device, seed=3)
            before = q.clone(), k.clone()
            for _ in range(2):  # the full path, then the bound one
                q.copy_(before[0])
                k.copy_(before[1])
                mgr.apply_qk(q, k, "text")
            assert mgr._jax is None  # the launcher ran both calls, not the JAX path
            cache = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16, device=device)
            pair = (cache, cache.clone())
            kv_q = before[0].clone()
            mgr.apply_qk_and_append_kv(kv_q, before[1], before[1], "text", pair,
                                       torch.arange(8, device=device))
            assert mgr._kv_jax is None  # the launcher ran it, not the JAX path
            mgr.commit(step, ctx)
        finally:
            deprecations._registered_deprecations["jax-pallas-triton"].accelerated = False
    _check(cfg, before, (q, k), pos[:8], torch.bfloat16)
    _check(cfg, (before[0],), (kv_q,), pos[:8], torch.bfloat16)
    # Keys cached rotated, values as given, at slots 0-7 of page 0.
    _check(cfg, (before[1],), (pair[0][0, :8],), pos[:8], torch.bfloat16)
    assert torch.equal(pair[1][0, :8], before[1])


def _kv_inputs(device, cfg, layout, combined, tokens, fp8, seed, q_heads=32, k_heads=8,
               page_size=16):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, q_heads, cfg.head_dim, device=device, generator=gen).bfloat16()
    k, v = (torch.randn(tokens, k_heads, cfg.head_dim, device=device, generator=gen).bfloat16()
            for _ in range(2))
    pages = 2 * -(-tokens // page_size) + 1
    entry = (page_size, k_heads) if layout == "NHD" else (k_heads, page_size)
    shape = (pages, *((2,) if combined else ()), *entry, cfg.head_dim)
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    caches = [torch.randn(shape, device=device, generator=gen).to(cache_dtype)
              for _ in range(1 if combined else 2)]
    slots = torch.randperm(pages * page_size, device=device, generator=gen)[:tokens]
    slots[::7] = -1  # padding tokens: q rotated, nothing cached
    span = 3 if cfg.mrope_section is not None else None
    high = 1 << 19
    pos = torch.randint(0, high, (span, tokens) if span else (tokens,), device=device,
                        dtype=torch.int32, generator=gen)
    return q, k, v, (caches[0] if combined else tuple(caches)), slots, pos


def _close(a, b, label):
    a, b = a.float(), b.float()
    if a.dtype == torch.float8_e4m3fn or label.endswith("fp8"):
        # One e4m3 step of the larger value (3 mantissa bits), or the smallest subnormal.
        bound = torch.maximum(a.abs(), b.abs()) * 2.0 ** -3 + 2.0 ** -9
    else:
        # Two bf16 ulps of the row's scale: the two kernels' hardware sines differ.
        bound = 2.0 ** -6 * torch.maximum(a.abs().amax(-1, keepdim=True),
                                          b.abs().amax(-1, keepdim=True))
    worst = ((a - b).abs() - bound).max().item()
    assert worst <= 0, f"{label}: {worst:.3g} past the bound"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [1, 17, 512, 4099])
@pytest.mark.parametrize("layout, combined", [("NHD", False), ("HND", False), ("NHD", True),
                                              ("HND", True)])
def test_mosaic_kv_launch_writes_what_the_triton_launch_writes(hopper, device, layout, combined,
                                                                tokens, fp8):
    import jaxrope as jr
    from torch_bridge.kv_append import check_call
    from torch_bridge.launch.triton import TritonKVLauncher
    from torch_bridge.launch.mosaic import MosaicKVLauncher
    cfg = jr.RopeConfig(head_dim=128, theta=5e5, max_position=LARGE)
    if tokens == 17:  # M-RoPE once per form
        cfg = jr.RopeConfig(head_dim=128, theta=1e6, max_position=LARGE,
                            mrope_section=(16, 24, 24))
    q, k, v, kv_cache, slots, pos = _kv_inputs(device, cfg, layout, combined, tokens, fp8,
                                                seed=tokens + 2 * combined + fp8)
    scale = 0.5 if fp8 else None
    outs = []
    for launcher in (MosaicKVLauncher(), TritonKVLauncher()):
        q2 = q.clone()
        cache2 = kv_cache.clone() if combined else tuple(c.clone() for c in kv_cache)
        caches, geometry, scales = check_call(k, v, cache2, slots, layout, scale, scale, device)
        launcher.rotate_and_append_kv_(q2, k, v, pos, caches, slots, cfg, geometry, scales)
        outs.append((q2, caches))
    torch.cuda.synchronize()
    (q_m, caches_m), (q_t, caches_t) = outs
    _close(q_m, q_t, f"{layout} combined={combined} q")
    for i, (a, b) in enumerate(zip(caches_m, caches_t)):
        _close(a, b, f"{layout} combined={combined} cache {i}" + (" fp8" if fp8 else ""))


@pytest.mark.parametrize("q_heads, k_heads", [(4, 1), (16, 2)])
def test_mosaic_kv_launch_walking_one_block_rotates_q_once(hopper, device, q_heads, k_heads):
    # Few heads: several warps hold copies of each q element, rotated in place; one block
    # walking every token lets the warps drift apart, so a copy stored before another
    # warp's load would rotate q twice. Against the Triton launch on the same inputs.
    import jaxrope as jr
    from torch_bridge.kv_append import check_call
    from torch_bridge.launch.triton import TritonKVLauncher
    from torch_bridge.launch.mosaic import MosaicKVLauncher
    cfg = jr.RopeConfig(head_dim=64, theta=5e5, max_position=LARGE)
    q, k, v, kv_cache, slots, pos = _kv_inputs(device, cfg, "NHD", False, 999, False, seed=5,
                                                q_heads=q_heads, k_heads=k_heads)
    outs = []
    for launcher, grid in ((MosaicKVLauncher(), 1), (TritonKVLauncher(), None)):
        q2, cache2 = q.clone(), tuple(c.clone() for c in kv_cache)
        caches, geometry, scales = check_call(k, v, cache2, slots, "NHD", None, None, device)
        extra = {} if grid is None else dict(grid=grid)
        launcher.rotate_and_append_kv_(q2, k, v, pos, caches, slots, cfg, geometry, scales,
                                       **extra)
        outs.append((q2, caches))
    torch.cuda.synchronize()
    (q_m, caches_m), (q_t, caches_t) = outs
    _close(q_m, q_t, f"{q_heads}/{k_heads} q")
    for i, (a, b) in enumerate(zip(caches_m, caches_t)):
        _close(a, b, f"{q_heads}/{k_heads} cache {i}")
