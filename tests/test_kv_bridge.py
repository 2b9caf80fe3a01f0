"""RopeManager.apply_qk_and_append_kv on CPU: every append case, the JAX path, the launchers.

Every case of ``jaxrope.cases.APPEND_CASES`` and ``MROPE_APPEND_CASES`` (M-RoPE managers,
positions ``[3, n]``) goes through the manager on torch CPU tensors
(the JAX DLPack path) in float32, float16 and bfloat16: q and the cache rows written
against the float64 oracle, every other cache entry bit for bit unchanged (padding slots
included), k and v untouched, and q and the cache within one ulp of the core op's XLA
backend on the same inputs. Then the manager's own behaviour (int64 slots, 2-D views,
staging copies, fewer tokens than planned, on 1-D and M-RoPE plans, launchers asked first, bound
launches), and the Triton launcher's steps that run without a GPU (export, compile for
sm_90, a failing export declined once, tensors off CUDA declined). Bad inputs are in
tests/test_bad_inputs_kv_append.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from jaxrope.cases import (APPEND_BY_NAME, APPEND_CASES, MROPE_APPEND_CASES,  # noqa: E402
                           AppendCase)
from jaxrope.ops.rope_append_kv import triton_export as append_triton_export  # noqa: E402
from jaxrope.ops.rope_append_kv import tuning as append_tuning  # noqa: E402
from jaxrope.testing import kv_oracle, oracle  # noqa: E402
from jaxrope.testing import kv_inputs  # noqa: E402
from jaxrope.testing.kv_inputs import FP8_SCALES, cache_shape, fused  # noqa: E402
from jaxrope.testing.kv_oracle import bits  # noqa: E402
from jaxrope.testing.lowering import cuda_target  # noqa: E402
from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext  # noqa: E402
from torch_bridge import kv_append  # noqa: E402
from torch_bridge.dlpack import NotZeroCopyError  # noqa: E402
from torch_bridge.launch import runtime  # noqa: E402
from torch_bridge.memory_overlap import share_memory  # noqa: E402

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOLERANCE = oracle.RELATIVE_TOLERANCE
LABEL = "text"


@dataclasses.dataclass
class Call:
    """One call's torch inputs (the cache as given: a pair or one combined tensor)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pos: np.ndarray
    slots: torch.Tensor
    kv_cache: object
    scales: dict


def make_call(rng, case: AppendCase, dtype_name: str) -> Call:
    c, dtype = case.case, DTYPES[dtype_name]

    def normal(*shape, to=dtype):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(to)

    tokens = c.tokens
    # M-RoPE: t, h and w rows that differ per token.
    rows = () if c.cfg.mrope_section is None else (3,)
    pos = rng.integers(0, c.cfg.max_position, (*rows, tokens)).astype(np.int32)
    slots = rng.permutation(case.pages * case.page_size)[:tokens].astype(np.int32)
    slots[tokens - case.padding:] = -1
    cache_dtype = torch.float8_e4m3fn if case.fp8 else dtype
    # Random old contents, so an entry written by mistake shows.
    old = [normal(*cache_shape(case), to=cache_dtype) for _ in "kv"]
    kv_cache = torch.stack(old, dim=1) if case.combined else tuple(old)
    return Call(normal(tokens, c.q_heads, c.head_dim), normal(tokens, c.k_heads, c.head_dim),
                normal(tokens, c.k_heads, c.head_dim), pos, torch.from_numpy(slots), kv_cache,
                FP8_SCALES if case.fp8 else {})


def manager(cfg: jr.RopeConfig, **kwargs) -> RopeManager:
    mgr = RopeManager(PositionConfig(rope=cfg), "cpu", max_seq_len=cfg.max_position,
                      **{"launcher": "jax", **kwargs})
    mgr.ingest_request("r")
    return mgr


def plan(mgr: RopeManager, pos: np.ndarray) -> None:
    step = PositionStep([Segment("r", LABEL, pos.shape[-1])], pos_ids=torch.from_numpy(pos))
    mgr.plan(step, StepContext(("r",)))


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    return tuple(t.clone() for t in x)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """``t``'s values in numpy (bfloat16 and fp8 through ml_dtypes, bit for bit)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(kv_oracle.E4M3)
    return t.numpy()


def split(kv_cache):
    """numpy ``(k_cache, v_cache)`` of a pair or of a combined tensor."""
    if isinstance(kv_cache, torch.Tensor):
        both = to_numpy(kv_cache)
        return both[:, 0], both[:, 1]
    return tuple(to_numpy(c) for c in kv_cache)


def check_against_oracle(case: AppendCase, x: Call, q_out: torch.Tensor, kv_out, q_in, kv_in,
                         dtype_name: str) -> None:
    """:func:`kv_inputs.check_against_oracle` on numpy copies of the call's tensors (``q_in``,
    ``kv_in``: before the call)."""
    def host(cache):
        return to_numpy(cache) if isinstance(cache, torch.Tensor) else tuple(map(to_numpy, cache))

    before = kv_inputs.Inputs(to_numpy(q_in), to_numpy(x.k), to_numpy(x.v), x.pos,
                              x.slots.numpy(), host(kv_in), x.scales)
    kv_inputs.check_against_oracle(case, before, (to_numpy(q_out), host(kv_out)),
                                   TOLERANCE[dtype_name])


def core_reference(case: AppendCase, x: Call, q_in, kv_in):
    """The core op's XLA backend on the same inputs: numpy ``(q, k_cache, v_cache)``."""
    def jx(t):
        return jnp.asarray(to_numpy(t))

    kv = jx(kv_in) if isinstance(kv_in, torch.Tensor) else tuple(jx(c) for c in kv_in)
    q, kv = fused(jx(q_in), jx(x.k), jx(x.v), jnp.asarray(x.pos), kv,
                  jnp.asarray(x.slots.numpy()), case.case.cfg, layout=case.layout,
                  backend="xla", **x.scales)
    if isinstance(kv, tuple):
        return (np.asarray(q), *(np.asarray(c) for c in kv))
    both = np.asarray(kv)
    return np.asarray(q), both[:, 0], both[:, 1]


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", APPEND_CASES + MROPE_APPEND_CASES, ids=lambda c: c.name)
def test_every_append_case_through_the_manager_matches_the_oracle(case, dtype_name, rng):
    x = make_call(rng, case, dtype_name)
    mgr = manager(case.case.cfg)
    plan(mgr, x.pos)
    q_in, kv_in, k_in, v_in = x.q.clone(), clone(x.kv_cache), x.k.clone(), x.v.clone()
    q_out, kv_out = mgr.apply_qk_and_append_kv(x.q, x.k, x.v, LABEL, x.kv_cache, x.slots,
                                               layout=case.layout, **x.scales)
    assert q_out is x.q and kv_out is x.kv_cache, "the objects given come back, updated"
    assert torch.equal(x.k, k_in) and torch.equal(x.v, v_in), "k and v are only read"
    check_against_oracle(case, x, q_out, kv_out, q_in, kv_in, dtype_name)
    want = core_reference(case, x, q_in, kv_in)
    for label, got, ref in zip(("q", "k_cache", "v_cache"), (to_numpy(q_out), *split(kv_out)),
                               want):
        worst = kv_oracle.ulps(got, ref).max(initial=0)
        assert worst <= 1, f"{label}: {worst} ulp from the core op's XLA backend"


def test_int64_slots_as_vllm_passes_them_give_the_same_cache(rng):
    case = APPEND_BY_NAME["neox_quarter_nhd_combined"]
    x = make_call(rng, case, "bfloat16")
    outs = []
    for slots in (x.slots, x.slots.to(torch.int64)):
        mgr = manager(case.case.cfg)
        plan(mgr, x.pos)
        q, kv = x.q.clone(), clone(x.kv_cache)
        mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, kv, slots, layout=case.layout)
        outs.append((q, kv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_negative_slots_write_nothing_and_slots_past_the_cache_are_refused_on_cpu(rng):
    # A CPU tensor's values are on the host: the eager rule of the core op, a negative
    # slot skips its token and one past the cache is refused, cache untouched.
    case = APPEND_BY_NAME["llama3_hnd_p16"]
    x = make_call(rng, case, "float32")
    num_slots = case.pages * case.page_size
    x.slots[:3] = torch.tensor([num_slots, -1, -7], dtype=torch.int32)
    mgr = manager(case.case.cfg)
    plan(mgr, x.pos)
    before = clone(x.kv_cache)
    with pytest.raises(ValueError, match=f"slots must be < {num_slots}"):
        mgr.apply_qk_and_append_kv(x.q, x.k, x.v, LABEL, x.kv_cache, x.slots, layout="HND")
    for new, old in zip(split(x.kv_cache), split(before)):
        np.testing.assert_array_equal(bits(new), bits(old))
    x.slots[0] = -3
    mgr = manager(case.case.cfg)
    plan(mgr, x.pos)
    before = clone(x.kv_cache)
    mgr.apply_qk_and_append_kv(x.q, x.k, x.v, LABEL, x.kv_cache, x.slots, layout="HND")
    written, page, entry = kv_oracle.entries(x.slots.numpy(), case.pages, case.page_size)
    assert written.sum() == case.case.tokens - 3 - case.padding
    for new, old in zip(split(x.kv_cache), split(before)):
        kv_oracle.assert_untouched("cache", new, old, kv_oracle.written_mask(
            new.shape, "HND", page[written], entry[written]))
    np.testing.assert_array_equal(
        bits(kv_oracle.rows(split(x.kv_cache)[1], "HND", page[written], entry[written])),
        bits(to_numpy(x.v))[written])


def _reference_call(case, x, **kwargs):
    """The manager's result for ``x`` with ``[T, H, D]`` contiguous inputs: ``(q, kv_cache)``."""
    mgr = manager(case.case.cfg, **kwargs)
    plan(mgr, x.pos)
    q, kv = x.q.clone(), clone(x.kv_cache)
    mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, kv, x.slots, layout=case.layout, **x.scales)
    return q, kv


def test_flat_heads_and_split_qkv_views_give_the_same_result(rng):
    # [T, H * D] inputs; then q, k, v as the column views of one fused qkv projection
    # (vLLM's split): non-contiguous, so the JAX path stages k and v through copies and
    # writes q back into qkv.
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    c = case.case
    x = make_call(rng, case, "bfloat16")
    want_q, want_kv = _reference_call(case, x)
    mgr = manager(c.cfg)
    plan(mgr, x.pos)
    q, kv = x.q.clone().flatten(1), clone(x.kv_cache)
    mgr.apply_qk_and_append_kv(q, x.k.flatten(1), x.v.flatten(1), LABEL, kv, x.slots)
    assert torch.equal(q.view_as(want_q), want_q) and all(map(torch.equal, kv, want_kv))
    qkv = torch.cat([x.q, x.k, x.v], dim=1)
    k_before, v_before = x.k.clone(), x.v.clone()
    q, k, v = qkv.split([c.q_heads, c.k_heads, c.k_heads], dim=1)
    kv = clone(x.kv_cache)
    mgr.apply_qk_and_append_kv(q, k, v, LABEL, kv, x.slots)
    assert not q.is_contiguous()
    assert torch.equal(q, want_q) and all(map(torch.equal, kv, want_kv))
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


def test_without_allow_copy_a_non_contiguous_cache_raises_and_changes_nothing(rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_call(rng, case, "bfloat16")
    mgr = manager(case.case.cfg, allow_copy=False)
    # A preplan, staged until its first use: a refused call must not promote it.
    mgr.plan(PositionStep([Segment("r", LABEL, x.pos.shape[-1])], pos_ids=torch.from_numpy(x.pos)),
             StepContext(("r",), is_preplan=True))
    wide = torch.zeros(case.pages, case.page_size, case.case.k_heads, 2 * case.case.head_dim,
                       dtype=torch.bfloat16)
    kv = (wide[..., :case.case.head_dim], wide[..., case.case.head_dim:])
    q, k, v, slots = (aligned(t) for t in (x.q, x.k, x.v, x.slots))
    q_before = q.clone()
    with pytest.raises(NotZeroCopyError, match=r"kv_cache\[0\] with shape=.* is not contiguous"):
        mgr.apply_qk_and_append_kv(q, k, v, LABEL, kv, slots)
    assert torch.equal(q, q_before) and not wide.any()
    assert mgr._plans.current is None and mgr._plans.staged is not None
    # Refused before the plan was touched: the same call with contiguous caches runs.
    good = tuple(aligned(torch.zeros_like(c)) for c in kv)
    mgr.apply_qk_and_append_kv(q, k, v, LABEL, good, slots)
    assert all(c.any() for c in good)


def test_without_allow_copy_only_the_planned_tokens_must_be_contiguous(rng):
    # q, k, v as views of one fused [T, (Hq + 2 Hk) * D] projection: strided, but the one
    # planned token's rows are contiguous, and nothing else is read.
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_call(rng, case, "bfloat16")
    widths = [t[0].numel() for t in (x.q, x.k, x.v)]
    qkv = aligned(torch.cat([t.flatten(1) for t in (x.q, x.k, x.v)], dim=1))
    q, k, v = (part.view(t.shape) for part, t in zip(qkv.split(widths, dim=1), (x.q, x.k, x.v)))
    assert not q.is_contiguous() and q[:1].is_contiguous()
    results = []
    for args in ((q, k, v, x.slots), tuple(aligned(t[:1]) for t in (q, k, v, x.slots))):
        mgr = manager(case.case.cfg, allow_copy=False)
        plan(mgr, x.pos[..., :1])
        kv = tuple(aligned(c) for c in clone(x.kv_cache))
        mgr.apply_qk_and_append_kv(*args[:3], LABEL, kv, aligned(args[3]))
        results.append((args[0][0].clone(), kv))
    (q_strided, kv_strided), (q_packed, kv_packed) = results
    assert torch.equal(q_strided, q_packed) and all(map(torch.equal, kv_strided, kv_packed))
    assert not all(map(torch.equal, kv_packed, x.kv_cache))  # the token was written


def aligned(t: torch.Tensor, alignment: int = 64) -> torch.Tensor:
    """A copy of ``t`` at an address XLA's CPU client imports without a copy."""
    raw = torch.empty(t.numel() * t.element_size() + alignment, dtype=torch.uint8)
    start = -raw.data_ptr() % alignment
    out = raw[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    return out.copy_(t)


@pytest.mark.parametrize("name", ["llama3_nhd_p16", "qwen3_vl_interleaved_hnd_combined"])
def test_fewer_tokens_than_planned_use_the_first_positions(name, rng):
    # M-RoPE: the first T columns of the [3, n] plan.
    case = APPEND_BY_NAME[name]
    x = make_call(rng, case, "float32")
    full = _reference_call(case, x)
    mgr = manager(case.case.cfg)
    more = np.broadcast_to(np.array([5, 6, 7], np.int32), (*x.pos.shape[:-1], 3))
    plan(mgr, np.concatenate([x.pos, more], axis=-1))
    q, kv = x.q.clone(), clone(x.kv_cache)
    mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, kv, x.slots, layout=case.layout)
    assert torch.equal(q, full[0]) and all(map(torch.equal, jax.tree.leaves(kv),
                                               jax.tree.leaves(full[1])))


def test_zero_tokens_change_nothing():
    mgr = manager(jr.RopeConfig(head_dim=64))
    plan(mgr, np.zeros(0, np.int32))
    cache = (torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64))
    before = clone(cache)
    empty = torch.zeros(0, 1, 64)
    mgr.apply_qk_and_append_kv(torch.zeros(0, 4, 64), empty, empty, LABEL, cache,
                               torch.zeros(0, dtype=torch.int32))
    assert all(map(torch.equal, cache, before))


def test_an_mrope_decode_plan_fuses_at_counter_plus_delta(rng):
    # The manager's own [3, n] positions (no explicit pos_ids): text decode at counter +
    # delta on every row, as apply_qk rotates it, written into the cache in one call.
    case = APPEND_BY_NAME["mrope_partial_halves_nhd_p1"]
    cfg = case.case.cfg
    mgr = RopeManager(PositionConfig(rope=cfg), "cpu", max_seq_len=4096, launcher="jax")
    mgr.ingest_request("r", {LABEL: 300}, deltas={LABEL: -120})
    mgr.plan(PositionStep([Segment("r", LABEL, 1)]), StepContext(("r",)))
    x = make_call(rng, dataclasses.replace(case, padding=0), "float32")
    q, k, v = x.q[:1].clone(), x.k[:1], x.v[:1]
    q_in, cache = q.clone(), tuple(torch.zeros(cache_shape(case)) for _ in "kv")
    mgr.apply_qk_and_append_kv(q, k, v, LABEL, cache, torch.tensor([5]))
    pos = np.full((3, 1), 180)
    np.testing.assert_allclose(q.numpy(), oracle.rope_of(cfg, q_in.numpy(), pos), rtol=0, atol=2e-5)
    np.testing.assert_allclose(cache[0][5, 0].numpy(), oracle.rope_of(cfg, k.numpy(), pos)[0],
                               rtol=0, atol=2e-5)
    assert torch.equal(cache[1][5, 0], v[0]) and not torch.cat([cache[0][:5], cache[0][6:]]).any()


# -- launchers ------------------------------------------------------------------------------

class _AppendingLauncher:
    """Does the work through the JAX path and records each call; may decline or bind."""

    def __init__(self, decline: bool = False, binds: bool = False):
        self.calls, self.bound_calls, self.decline = [], 0, decline
        self._jax = kv_append.JaxAppend(torch.device("cpu"), "xla")
        if binds:
            self.bind = self._bind

    def rotate_(self, q, k, pos_ids, cfg):
        raise jr.BackendUnavailable("rope alone is not what this test launches")

    def rotate_and_append_kv_(self, q, k, v, pos_ids, caches, slots, cfg, geometry, scales):
        self.calls.append((tuple(q.shape), pos_ids.tolist(), geometry, scales))
        if self.decline:
            raise jr.BackendUnavailable("declined for the test")
        self._jax(q, k, v, caches, geometry, pos_ids, slots, cfg, scales)

    def _bind(self, q, k, v, caches, slots, cfg, geometry, scales):
        def run(q, k, v, pos_ids, kv_cache, slots):
            self.bound_calls += 1
            caches = (kv_cache,) if geometry.combined else tuple(kv_cache)
            self._jax(q.view(q.shape[0], -1, cfg.head_dim), k.view(k.shape[0], -1, cfg.head_dim),
                      v.view(v.shape[0], -1, cfg.head_dim), caches, geometry,
                      pos_ids, slots, cfg, scales)
            return True
        return run


def test_the_launcher_is_asked_first_with_the_plan_and_the_cache_geometry(rng):
    case = APPEND_BY_NAME["partial_half_fp8_hnd_combined"]
    x = make_call(rng, case, "bfloat16")
    want = _reference_call(case, x)
    launcher = _AppendingLauncher()
    got = _reference_call(case, x, launcher=launcher)
    [(shape, pos, geometry, scales)] = launcher.calls
    c = case.case
    assert shape == (c.tokens, c.q_heads, c.head_dim) and pos == x.pos.tolist()
    assert geometry == kv_append.CacheGeometry(
        "HND", True, (2 * case.pages, c.k_heads, case.page_size, c.head_dim), torch.float8_e4m3fn)
    assert scales == (0.75, 150.0)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_declining_launcher_falls_back_to_the_jax_path(rng):
    case = APPEND_BY_NAME["gptj_interleave_hnd_combined"]
    x = make_call(rng, case, "float16")
    want = _reference_call(case, x)
    launcher = _AppendingLauncher(decline=True)
    got = _reference_call(case, x, launcher=launcher)
    assert len(launcher.calls) == 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_rope_only_launcher_leaves_the_fused_call_to_jax():
    class RopeOnly:
        def rotate_(self, q, k, pos_ids, cfg):
            raise jr.BackendUnavailable("unused")

    mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu", launcher=RopeOnly())
    assert mgr.launcher is not None and mgr.kv_launcher is None


def test_repeated_calls_take_the_bound_launch_until_the_signature_changes(rng):
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    x = make_call(rng, case, "bfloat16")
    mgr = manager(case.case.cfg)
    launcher = mgr.kv_launcher = _AppendingLauncher(binds=True)
    plan(mgr, x.pos)
    want = _reference_call(case, x)
    for _ in range(2):
        q, kv = x.q.clone(), clone(x.kv_cache)
        mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, kv, x.slots)
        assert torch.equal(q, want[0]) and all(map(torch.equal, kv, want[1]))
    assert (len(launcher.calls), launcher.bound_calls) == (1, 1)
    # Another signature (int64 slots; then a combined cache) is checked and bound anew.
    mgr.apply_qk_and_append_kv(x.q.clone(), x.k, x.v, LABEL, clone(x.kv_cache),
                               x.slots.to(torch.int64))
    mgr.apply_qk_and_append_kv(x.q.clone(), x.k, x.v, LABEL, torch.stack(x.kv_cache, 1), x.slots)
    assert (len(launcher.calls), launcher.bound_calls) == (3, 1)
    # A bound signature never skips the checks of a different call.
    with pytest.raises(ValueError, match="layout='hnd'"):
        mgr.apply_qk_and_append_kv(x.q, x.k, x.v, LABEL, x.kv_cache, x.slots, layout="hnd")
    with pytest.raises(ValueError, match="requires_grad"):
        mgr.apply_qk_and_append_kv(x.q.clone().requires_grad_(), x.k, x.v, LABEL, x.kv_cache,
                                   x.slots)
    assert launcher.bound_calls == 1
    # Replacing the launcher forgets its bound launches.
    mgr.kv_launcher = None
    q, kv = x.q.clone(), clone(x.kv_cache)
    mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, kv, x.slots)
    assert (len(launcher.calls), launcher.bound_calls) == (3, 1)
    assert torch.equal(q, want[0]) and all(map(torch.equal, kv, want[1]))


# -- the Triton launcher, off the GPU -----------------------------------------------------

def _geometry(case: AppendCase, dtype=torch.bfloat16) -> kv_append.CacheGeometry:
    shape = cache_shape(case)
    view = (2 * shape[0], *shape[1:]) if case.combined else shape
    return kv_append.CacheGeometry(case.layout, case.combined, view,
                                   torch.float8_e4m3fn if case.fp8 else dtype)


@pytest.mark.requires_triton
@pytest.mark.parametrize("name", ["llama3_nhd_p16", "partial_half_fp8_hnd_combined",
                                  "qwen2_vl_nhd_p16"])
def test_the_kv_launcher_exports_and_compiles_its_kernel_for_sm90_once(name):
    from triton.backends.compiler import GPUTarget
    from torch_bridge.launch.triton import TritonKVLauncher

    case = APPEND_BY_NAME[name]
    c = case.case
    launcher = TritonKVLauncher(target=GPUTarget("cuda", 90, 32))
    block = append_tuning.append_triton_tuning(64, c.q_heads, c.k_heads, c.cfg.rotary_dim // 2)
    with cuda_target():
        compiled, exported = launcher.kernel(c.q_heads, torch.bfloat16, c.cfg, _geometry(case),
                                             block)
        again = launcher.kernel(c.q_heads, torch.bfloat16, c.cfg, _geometry(case), block)
    assert again[0] is compiled, "one compile per key"
    assert exported.num_caches == (1 if case.combined else 2)
    assert exported.grid(64) == (*append_tuning.grid(64, c.q_heads, c.k_heads, block), 1, 1)
    ptx = compiled.asm["ptx"]
    assert ".entry jaxrope_rope_append_kv" in ptx and "sin.approx.f32" in ptx
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) == case.fp8


@pytest.mark.requires_triton
def test_compiling_a_kernel_leaves_no_ir_directory_behind(monkeypatch, tmp_path):
    import tempfile
    from triton.backends.compiler import GPUTarget
    from torch_bridge.launch.triton import TritonKVLauncher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    case = APPEND_BY_NAME["llama3_nhd_p16"]
    c = case.case
    launcher = TritonKVLauncher(target=GPUTarget("cuda", 90, 32))
    block = append_tuning.append_triton_tuning(64, c.q_heads, c.k_heads, c.cfg.rotary_dim // 2)
    with cuda_target():
        compiled, _ = launcher.kernel(c.q_heads, torch.bfloat16, c.cfg, _geometry(case), block)
    assert ".entry jaxrope_rope_append_kv" in compiled.asm["ptx"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("jaxrope_")] == []


@pytest.mark.requires_triton
def test_a_failing_kv_export_declines_once_and_is_remembered(monkeypatch):
    from torch_bridge.launch.triton import TritonKVLauncher

    calls = []

    def failing_export(**kwargs):
        calls.append(kwargs)
        raise jr.BackendUnavailable("export forced to fail by the test")

    monkeypatch.setattr(append_triton_export, "export_append_kv", failing_export)
    case = APPEND_BY_NAME["llama3_hnd_p16"]
    c = case.case
    launcher = TritonKVLauncher()
    block = append_tuning.append_triton_tuning(17, c.q_heads, c.k_heads, 64)
    for _ in range(2):
        with pytest.raises(jr.BackendUnavailable, match="forced to fail"):
            launcher.kernel(c.q_heads, torch.bfloat16, c.cfg, _geometry(case), block)
    assert len(calls) == 1 and calls[0]["cache_shape"] == cache_shape(case)


@pytest.mark.requires_triton
def test_the_kv_launcher_declines_cpu_tensors_and_the_manager_takes_the_jax_path(rng):
    from torch_bridge.launch.triton import TritonKVLauncher

    case = APPEND_BY_NAME["llama3_nhd_p1_combined"]
    x = make_call(rng, case, "bfloat16")
    want = _reference_call(case, x)
    launcher = TritonKVLauncher()
    with pytest.raises(jr.BackendUnavailable, match="q is on cpu: the launcher needs CUDA"):
        launcher.rotate_and_append_kv_(x.q, x.k, x.v, torch.from_numpy(x.pos), (x.kv_cache,),
                                       x.slots, case.case.cfg, _geometry(case), (1.0, 1.0))
    mgr = manager(case.case.cfg)
    mgr.kv_launcher = launcher
    plan(mgr, x.pos)
    q, kv = x.q.clone(), x.kv_cache.clone()
    mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, kv, x.slots)
    assert torch.equal(q, want[0]) and torch.equal(kv, want[1])


# Slots and aliasing on the bridge (the core's side: tests/test_kv_slot_range.py).

def _one_step_manager(tokens: int) -> RopeManager:
    mgr = manager(jr.RopeConfig(head_dim=8))
    plan(mgr, np.zeros(tokens, np.int32))
    return mgr


def test_int64_slots_past_2_32_are_refused_not_cut_to_their_low_32_bits():
    mgr = _one_step_manager(2)
    cache = tuple(torch.zeros(2, 4, 1, 8) for _ in "kv")
    v = torch.tensor([1.0, 2.0])[:, None, None].expand(2, 1, 8).contiguous()
    with pytest.raises(ValueError, match="got a maximum of 4294967301"):
        mgr.apply_qk_and_append_kv(torch.ones(2, 2, 8), v, v, LABEL, cache,
                                   torch.tensor([2 ** 32 + 5, 3]))
    assert not any(c.any() for c in cache)
    mgr.apply_qk_and_append_kv(torch.ones(2, 2, 8), v, v, LABEL, cache,
                               torch.tensor([-2 ** 32 + 5, 3]))   # negative: skipped, not slot 5
    assert cache[1][:, :, 0, 0].reshape(-1).tolist() == [0, 0, 0, 2, 0, 0, 0, 0]


@pytest.mark.parametrize("name", ["uint8", "int8", "int16", "int32", "int64", "uint16",
                                  "uint32", "uint64"])
def test_the_launchers_int32_slots_decide_the_range_at_the_slots_own_width(name):
    # Both launcher paths (the first call and the bound one) narrow slots through this.
    dtype = getattr(torch, name)
    info = torch.iinfo(dtype)
    candidates = [0, 5, 299, 300, -1, info.min, info.max, 2 ** 32 + 5, -2 ** 32 + 5,
                  2 ** 64 - 2 ** 32 + 5, 2 ** 31 + 5]
    values = [v for v in candidates if info.min <= v <= info.max]
    got = runtime.int32_slots(torch.tensor(values, dtype=dtype), 300)
    assert got.dtype == torch.int32
    inside = [v if 0 <= v < 300 else -1 for v in values]
    if dtype == torch.int32:   # passed as is: the kernels skip what is outside the cache
        inside = values
    assert got.tolist() == inside


def test_a_cache_pair_sharing_memory_is_refused_and_changes_nothing():
    mgr = _one_step_manager(2)
    c = torch.zeros(3, 4, 1, 8)
    q, k = torch.ones(2, 2, 8), torch.ones(2, 1, 8)
    for pair in ((c, c), (c, c.view(3, 4, 1, 8)), (c[:2], c[1:]),
                 (c[:, :2], c[:, 1:3])):
        with pytest.raises(ValueError, match="kv_cache's k_cache and v_cache share memory"):
            mgr.apply_qk_and_append_kv(q, k, k, LABEL, pair, torch.tensor([0, 5]))
    assert not c.any() and torch.equal(q, torch.ones(2, 2, 8))


def test_vllm_split_views_of_a_combined_cache_give_the_combined_result(rng):
    # vLLM hands its FlashInfer cache [pages, 2, ...] to reshape_and_cache_flash as
    # kv[:, 0] and kv[:, 1]: interleaved views, no element shared.
    case = APPEND_BY_NAME["neox_quarter_nhd_combined"]
    x = make_call(rng, case, "float32")
    want = _reference_call(case, x)
    mgr = manager(case.case.cfg)
    plan(mgr, x.pos)
    q, kv = x.q.clone(), x.kv_cache.clone()
    mgr.apply_qk_and_append_kv(q, x.k, x.v, LABEL, (kv[:, 0], kv[:, 1]), x.slots)
    assert torch.equal(q, want[0]) and torch.equal(kv, want[1])


def test_share_memory_agrees_with_the_element_addresses_of_random_views(rng):
    storage = torch.zeros(4 * 3 * 5 * 2)
    whole = storage.view(4, 3, 5, 2)

    def view():
        # A random strided slice: a random start, stop and step on each axis.
        index = []
        for n in whole.shape:
            start = int(rng.integers(n))
            index.append(slice(start, int(rng.integers(start + 1, n + 1)), int(rng.integers(1, 3))))
        return whole[tuple(index)]

    def addresses(t):
        offset = t.storage_offset() + np.zeros((), np.int64)
        for n, stride in zip(t.shape, t.stride()):
            offset = np.add.outer(offset, np.arange(n) * stride)
        return set(offset.reshape(-1).tolist())

    for trial in range(400):
        a = view()
        if trial % 2:
            b = view()   # another layout: refused whenever an element is shared
            assert share_memory(a, b) or not addresses(a) & addresses(b)
            continue
        # The same layout at another offset (as vLLM's kv[:, 0] and kv[:, 1]): exact.
        span = sum((n - 1) * st for n, st in zip(a.shape, a.stride())) + 1
        b = storage.as_strided(a.shape, a.stride(), int(rng.integers(storage.numel() - span + 1)))
        assert share_memory(a, b) == bool(addresses(a) & addresses(b)), (
            a.shape, a.stride(), a.storage_offset(), b.storage_offset())
