"""The MLA kernel launched from torch on Hopper (:class:`torch_bridge.launch.mla.MosaicMlaLauncher`)
and through ``RopeManager.apply_mla_and_append_kv``.

Run on the device machine (``bash bench/gpu_suite.sh``: ``JAXROPE_GPU_TESTS=1``, ``-m gpu``);
each test skips with the reason without a Hopper GPU for torch and JAX.

- The launch (run-time T, torch's stream) writes what the JAX op's Mosaic GPU kernel
  (``jaxrope.apply_mla_rope_and_append(backend="mosaic")``, static T) writes, bit for bit:
  q_pe in place or the fp8 ``q_pe_out`` / ``q_nope_out``, every cache byte; pair and one
  ``[L + r]`` cache, bf16 and fp8 caches, GPT-J pairs (DeepSeek-V3's YaRN config), NeoX
  halves, M-RoPE; decode, odd and prefill token counts.
- One compile per launch shape: token counts of one shape share the compiled module.
- CUDA graphs: one eager call (launched, then bound), then the manager's call captured
  (its bound run) and replayed on new inputs and new positions (the plan's graph buffer)
  gives the eager results, the JAX path never built; a failing export leaves the call
  to the JAX path, which refuses capture.
- A bound launch refuses a pair of caches it would see overlap and a misaligned view:
  the full path then answers (refusing the pair, declining the view to the JAX path).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.ops.mla_rope_append import mosaic_export as mla_export  # noqa: E402
from jaxrope.testing import kv_oracle  # noqa: E402
from torch_bridge import (GraphBucket, GraphSlot, PositionConfig, PositionStep,  # noqa: E402
                          RopeManager, Segment, StepContext)

pytestmark = pytest.mark.gpu

_CONFIG = (pathlib.Path(__file__).parents[1] / "data" / "hf_configs"
           / "deepseek-ai__DeepSeek-V3.json")
DEEPSEEK = jr.RopeConfig.from_hf(json.loads(_CONFIG.read_text())["config"])
CONFIGS = {"deepseek": DEEPSEEK, "neox": dataclasses.replace(DEEPSEEK, interleave=False),
           "mrope": jr.RopeConfig(head_dim=64, rotary_dim=64, interleave=True,
                                  mrope_section=(16, 8, 8), max_position=1 << 20)}
FP8 = torch.float8_e4m3fn
R, L, HEADS, LABEL = 64, 512, 16, "text"
Q_SCALE, KV_SCALE = 0.75, 1.5


def _to_jax(t):
    import jax.numpy as jnp
    from torch_bridge.dlpack import jax_dtype_name
    host = t.detach().cpu().contiguous()
    if t.dtype in (torch.bfloat16, FP8):
        width = torch.int16 if t.dtype == torch.bfloat16 else torch.uint8
        return jnp.asarray(host.view(width).numpy().view(jnp.dtype(jax_dtype_name(t.dtype))))
    return jnp.asarray(host.numpy())


def _bytes(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().view(torch.uint8).numpy()
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


class Call(dict):
    """One MLA call's tensors on ``device``: q_pe, k_pe, ckv, positions, slots, the cache
    (``caches``: its tensors), and the fp8 q outputs when asked."""

    def __init__(self, device, cfg, tokens, combined, fp8_cache, fp8_q, nope, seed, pages=None):
        super().__init__()
        gen = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape):
            return torch.randn(*shape, device=device, generator=gen).to(torch.bfloat16)

        pages = pages or 2 * -(-tokens // 16) + 1
        cache_dtype = FP8 if fp8_cache else torch.bfloat16
        widths = (L + R,) if combined else (L, R)
        self.caches = tuple(normal(pages, 16, w).to(cache_dtype) for w in widths)
        slots = torch.randperm(pages * 16, device=device, generator=gen)[:tokens]
        slots[1::5] = -1  # padding
        pos_shape = (3, tokens) if cfg.mrope_section else (tokens,)
        self.update(q_pe=normal(tokens, HEADS, R), k_pe=normal(tokens, R), ckv=normal(tokens, L),
                    slots=slots, pos=torch.randint(0, cfg.max_position, pos_shape, device=device,
                                                   dtype=torch.int32, generator=gen))
        if fp8_q:
            self["q_pe_out"] = torch.zeros(tokens, HEADS, R, dtype=FP8, device=device)
            if nope:
                self["q_nope"] = normal(tokens, HEADS, nope)
                self["q_nope_out"] = torch.zeros(tokens, HEADS, nope, dtype=FP8, device=device)
        self.scales = (Q_SCALE if fp8_q else 1.0, KV_SCALE if fp8_cache else 1.0)

    @property
    def mla_cache(self):
        return self.caches[0] if len(self.caches) == 1 else self.caches

    def launch(self, launcher, cfg) -> None:
        launcher.rotate_and_append_mla_(
            self["q_pe"], self["k_pe"], self["ckv"], self["pos"], self.caches, self["slots"],
            cfg, self.scales, q_nope=self.get("q_nope"), q_pe_out=self.get("q_pe_out"),
            q_nope_out=self.get("q_nope_out"))

    def jax_op(self, cfg):
        """The JAX op's Mosaic GPU kernel on copies: ``(q_pe or q_pe_out, q_nope_out, cache
        leaves)``."""
        import jax
        import jax.numpy as jnp
        fp8_q = "q_pe_out" in self
        cache = tuple(_to_jax(c) for c in self.caches)
        q_pe, q_nope, cache = jr.apply_mla_rope_and_append(
            _to_jax(self["q_pe"]), _to_jax(self["k_pe"]), _to_jax(self["ckv"]),
            _to_jax(self["pos"]), cache[0] if len(cache) == 1 else cache,
            self["slots"].cpu().numpy().astype(np.int32), cfg,
            q_nope=_to_jax(self["q_nope"]) if "q_nope" in self else None,
            q_dtype=jnp.float8_e4m3fn if fp8_q else None,
            q_quant_scale=self.scales[0] if fp8_q else None,
            kv_quant_scale=self.scales[1] if self.caches[0].dtype == FP8 else None,
            backend="mosaic")
        return q_pe, (q_nope if "q_nope_out" in self else None), jax.tree.leaves(cache)

    def written(self):
        """What the call writes, as torch tensors, in :meth:`jax_op`'s order."""
        q = self["q_pe_out"] if "q_pe_out" in self else self["q_pe"]
        return q, self.get("q_nope_out"), list(self.caches)


FORMS = [("deepseek", True, False, False, 0), ("deepseek", False, True, True, 512),
         ("deepseek", True, True, True, 0), ("neox", True, True, False, 0),
         ("neox", False, False, True, 128), ("mrope", True, False, True, 128),
         ("mrope", False, True, False, 0)]


@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize("name, combined, fp8_cache, fp8_q, nope", FORMS,
                         ids=["-".join(map(str, form)) for form in FORMS])
def test_the_launch_writes_what_the_jax_ops_kernel_writes(hopper, device, name, combined,
                                                          fp8_cache, fp8_q, nope, tokens):
    from torch_bridge.launch.mla import MosaicMlaLauncher
    cfg = CONFIGS[name]
    call = Call(device, cfg, tokens, combined, fp8_cache, fp8_q, nope, seed=tokens + 7 * nope)
    q_before = call["q_pe"].clone()
    want = call.jax_op(cfg)
    call.launch(MosaicMlaLauncher(), cfg)
    torch.cuda.synchronize()
    got = call.written()
    if fp8_q:
        assert torch.equal(call["q_pe"], q_before), "q_pe is only read with q_pe_out"
    else:
        assert not torch.equal(call["q_pe"], q_before), "q_pe rotated in place"
    for label, a, b in (("q", got[0], want[0]), ("q_nope_out", got[1], want[1])):
        if b is not None:
            np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg=label)
    for a, b in zip(got[2], want[2]):
        np.testing.assert_array_equal(_bytes(a), _bytes(b), err_msg="cache")


def test_token_counts_of_one_launch_shape_share_one_compile(hopper, device):
    from torch_bridge.launch.mla import MosaicMlaLauncher
    launcher = MosaicMlaLauncher()

    def compiled():
        return sum(1 for key in launcher._rope._modules if key[0] == "mla")

    for tokens, modules in ((17, 1), (20, 1), (32, 1), (33, 2), (1, 3)):
        call = Call(device, DEEPSEEK, tokens, True, False, False, 0, seed=tokens)
        want = call.jax_op(DEEPSEEK)
        call.launch(launcher, DEEPSEEK)
        torch.cuda.synchronize()
        assert compiled() == modules, f"{tokens} tokens"
        np.testing.assert_array_equal(_bytes(call["q_pe"]), _bytes(want[0]))
        np.testing.assert_array_equal(_bytes(call.caches[0]), _bytes(want[2][0]))


def _decode_manager(device, launcher):
    """A manager with 4 requests planned for one decode step into a graph bucket of 8
    tokens: ``(mgr, step, ctx, pos)``."""
    mgr = RopeManager(PositionConfig(rope=DEEPSEEK), device, max_seq_len=DEEPSEEK.max_position,
                      launcher=launcher)
    rids = [f"g{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        mgr.ingest_request(rid)
        mgr.apply_cached_prefix(rid, None, None, None, {LABEL: 1000 * i + 7})
    lease = GraphSlot(GraphBucket(None, batch_size=4, num_tokens=8), 0)
    step = PositionStep([Segment(rid, LABEL, 1) for rid in rids])
    ctx = StepContext(tuple(rids), graph_slot=lease)
    return mgr, step, ctx, mgr.plan(step, ctx)[LABEL]


def _run(mgr, call):
    return mgr.apply_mla_and_append_kv(
        call["q_pe"], call["k_pe"], call["ckv"], LABEL, call.mla_cache, call["slots"],
        q_nope=call.get("q_nope"), q_pe_out=call.get("q_pe_out"),
        q_nope_out=call.get("q_nope_out"),
        q_quant_scale=Q_SCALE if "q_pe_out" in call else None,
        kv_quant_scale=KV_SCALE if call.caches[0].dtype == FP8 else None)


def _clone(call: Call) -> Call:
    twin = Call.__new__(Call)
    twin.update({k: v.clone() for k, v in call.items()})
    twin.caches, twin.scales = tuple(c.clone() for c in call.caches), call.scales
    return twin


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_captured_in_a_cuda_graph_and_replayed_on_new_inputs(hopper, device, fp8):
    mgr, step, ctx, pos = _decode_manager(device, "auto")
    if mgr.mla_launcher is None:
        pytest.skip("\"auto\" built no MLA launcher here")
    call = Call(device, DEEPSEEK, 8, not fp8, fp8, fp8, 512 if fp8 else 0, seed=11, pages=16)
    call["slots"].fill_(-1)                              # graph padding: -1
    call["slots"][:4] = torch.tensor([3, 40, 77, 250], device=device)
    _run(mgr, call)                                      # once outside capture: compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: JAX's runtime threads may call CUDA meanwhile (bench/timing.py does too).
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        _run(mgr, call)
    gen = torch.Generator(device=device).manual_seed(12)
    for step_index in range(2):
        mgr.commit(step, ctx)
        assert mgr.plan(step, ctx)[LABEL].data_ptr() == pos.data_ptr(), "the graph's buffer"
        for key in ("q_pe", "k_pe", "ckv", "q_nope"):
            if key in call:
                call[key].copy_(torch.randn(call[key].shape, device=device, generator=gen))
        call["slots"][:4] = torch.tensor([5 + step_index, 60, 101, 200 - step_index],
                                         device=device)
        want = _clone(call)
        _run(mgr, want)                                  # eagerly, at the same positions
        q_before = call["q_pe"].clone()
        graph.replay()
        torch.cuda.synchronize()
        assert mgr._mla._jax is None, "the JAX path ran"
        if not fp8:
            assert not torch.equal(call["q_pe"], q_before), "the replay rotated q_pe"
        for a, b in zip((*call.written()[:2], *call.caches), (*want.written()[:2], *want.caches)):
            if a is not None:
                assert torch.equal(_bytes_t(a), _bytes_t(b)), f"replay {step_index}"


def _bytes_t(t):
    return t.contiguous().view(torch.uint8)


def test_a_failing_export_falls_back_to_the_jax_path_which_refuses_capture(hopper, device,
                                                                           monkeypatch):
    def failing_export(**kwargs):
        raise jr.BackendUnavailable("export forced to fail by the test")

    monkeypatch.setattr(mla_export, "export_mla", failing_export)
    mgr, step, ctx, pos = _decode_manager(device, "auto")
    if mgr.mla_launcher is None:
        pytest.skip("\"auto\" built no MLA launcher here")
    call = Call(device, DEEPSEEK, 4, True, False, False, 0, seed=13, pages=16)
    call["pos"] = pos[:4].clone()                        # the planned positions
    want = call.jax_op(DEEPSEEK)
    _run(mgr, call)
    torch.cuda.synchronize()
    assert mgr._mla._jax is not None, "the JAX path ran"
    for a, b in ((call["q_pe"], want[0]), (call.caches[0], want[2][0])):
        a = np.asarray(_to_jax(a))
        assert kv_oracle.row_ulps(a, np.asarray(b)).max() <= 2
    before = [x.clone() for x in (call["q_pe"], *call.caches)]
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="apply_mla_and_append_kv under CUDA-graph capture"):
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            _run(mgr, call)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(before, (call["q_pe"], *call.caches)))


def test_the_bound_run_sends_odd_tensors_down_the_full_path(hopper, device):
    mgr, step, ctx, pos = _decode_manager(device, "auto")
    if mgr.mla_launcher is None:
        pytest.skip("\"auto\" built no MLA launcher here")
    call = Call(device, DEEPSEEK, 4, False, False, False, 0, seed=14, pages=16)
    _run(mgr, call)                                      # launched and bound
    assert len(mgr._mla.fast._bound) == 1
    mgr.commit(step, ctx)
    mgr.plan(step, ctx)
    ckv_cache = call.caches[0]
    overlapping = (ckv_cache, ckv_cache[..., :R])        # kpe_cache inside ckv_cache
    with pytest.raises(ValueError, match="share memory|must be"):
        mgr.apply_mla_and_append_kv(call["q_pe"], call["k_pe"], call["ckv"], LABEL,
                                    overlapping, call["slots"])
    # A view one element in: misaligned for the launch, so the JAX path writes it.
    storage = torch.zeros(4 * L + 1, dtype=torch.bfloat16, device=device)
    shifted = storage[1:].view(4, L)
    shifted.copy_(call["ckv"])
    want = _clone(call)
    _run(mgr, want)
    twin = _clone(call)
    mgr.apply_mla_and_append_kv(twin["q_pe"], twin["k_pe"], shifted, LABEL, twin.caches,
                                twin["slots"])
    torch.cuda.synchronize()
    assert mgr._mla._jax is not None, "the JAX path ran"
    for a, b in zip(twin.caches, want.caches):
        a, b = np.asarray(_to_jax(a)), np.asarray(_to_jax(b))
        assert kv_oracle.row_ulps(a, b).max() <= 2
