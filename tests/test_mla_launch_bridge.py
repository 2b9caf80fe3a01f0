"""``RopeManager.apply_mla_and_append_kv``'s launcher on CPU: what the manager hands it.

A recording launcher (``rotate_and_append_mla_``) gets the checked call: the engine's own
tensors (no copies), k_pe as ``[T, r]``, the planned positions, the cache tensors as given,
``(q_scale, kv_scale)``, the fp8 outputs, and a padded batch cut to the planned tokens;
doing the work on the JAX path, its result is the JAX path's bit for bit. A launched call
is bound (a repeated signature runs the launcher's ``bind`` run without the checks), a
padded one never; a new scale binds anew; a bound run that refuses sends the call down
the full path. A declining
launcher leaves the call to the JAX path; under CUDA-graph capture only a launcher that
accepts may run (the rule of ``apply_qk_and_append_kv``). ``launcher="auto"`` builds no MLA
launcher on CPU, and :class:`torch_bridge.launch.mla.MosaicMlaLauncher` declines CPU
tensors and refuses shapes it would read past. The compiled launch runs in
tests/gpu/test_mla_launch_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jaxrope as jr  # noqa: E402
from test_mla_bridge import CFG, FP8, H, L, N, R, _clone, _inputs, _plan  # noqa: E402
from torch_bridge import PositionConfig, RopeManager  # noqa: E402
from torch_bridge.launch.mla import MosaicMlaLauncher, launch_pointers  # noqa: E402
from torch_bridge.mla_append import JaxMlaAppend, MlaGeometry, MlaPaths  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded_torch(rng):
    torch.manual_seed(int(rng.integers(2 ** 31)))  # the rng fixture reports the seed


class _Recording:
    """An MLA launcher that records each call and, unless ``decline``, does the work on the
    JAX path (what a CUDA launcher does in its kernel)."""

    def __init__(self, decline: bool = False):
        self.decline = decline
        self.calls = []
        self._jax = JaxMlaAppend(torch.device("cpu"))

    def rotate_(self, q, k, pos_ids, cfg):
        raise jr.BackendUnavailable("rope alone: not used here")

    def rotate_and_append_mla_(self, q_pe, k_pe, ckv, pos_ids, caches, slots, cfg, scales,
                               q_nope=None, q_pe_out=None, q_nope_out=None):
        self.calls.append(dict(q_pe=q_pe, k_pe=k_pe, ckv=ckv, pos_ids=pos_ids.clone(),
                               caches=caches, slots=slots, cfg=cfg, scales=scales,
                               q_nope=q_nope, q_pe_out=q_pe_out, q_nope_out=q_nope_out))
        if self.decline:
            raise jr.BackendUnavailable("declined by the test")
        self._jax_call(q_pe, k_pe, ckv, pos_ids, caches, slots, cfg, scales, q_nope, q_pe_out,
                       q_nope_out)

    def _jax_call(self, q_pe, k_pe, ckv, pos_ids, caches, slots, cfg, scales, q_nope, q_pe_out,
                  q_nope_out):
        pages, page_size = caches[0].shape[:2]
        geometry = MlaGeometry(len(caches) == 1, pages, page_size, ckv.shape[1], k_pe.shape[1],
                               caches[0].dtype)
        outs = tuple(x for x in (q_pe_out, q_nope_out) if x is not None)
        self._jax(q_pe, k_pe, ckv, q_nope, outs, caches, geometry, pos_ids, slots, cfg, scales)


def _manager(launcher):
    mgr = RopeManager(PositionConfig(rope=CFG), "cpu", launcher=launcher)
    mgr.ingest_request("r")
    return mgr


def _leaves(cache):
    return cache if isinstance(cache, tuple) else (cache,)


def _views(seen, given) -> bool:
    return seen.data_ptr() == given.data_ptr() and seen.shape == given.shape


def _bits(x):
    return x.contiguous().view(torch.uint8) if x.dtype.itemsize == 1 else x


def _assert_same(a: dict, b: dict) -> None:
    for key in ("q_pe", "q_pe_out", "q_nope_out"):
        if key in a:
            assert torch.equal(_bits(a[key]), _bits(b[key])), key
    for got, want in zip(_leaves(a["mla_cache"]), _leaves(b["mla_cache"])):
        assert torch.equal(_bits(got), _bits(want)), "cache"


def _call(mgr, x, tokens, scales):
    step, ctx = _plan(mgr, tokens)
    pos = mgr.pos_ids("text")[:tokens].clone()
    with torch.no_grad():
        out = mgr.apply_mla_and_append_kv(**x, label="text", **scales)
    mgr.commit(step, ctx)
    return out, pos


CASES = {
    "one_buffer_bf16": (dict(), {}),
    "pair_fp8_cache_fp8_q": (dict(combined=False, cache_dtype=FP8, fp8_q=True),
                             dict(q_quant_scale=0.5, kv_quant_scale=2.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_launcher_gets_the_engines_tensors_and_its_result_is_the_jax_paths(name):
    case, scales = CASES[name]
    launcher = _Recording()
    x = _inputs(5, **case)
    jax_x = _clone(x)
    out, pos = _call(_manager(launcher), x, 5, scales)
    [seen] = launcher.calls
    # Views of the engine's tensors (the planned tokens'), never copies.
    assert _views(seen["q_pe"], x["q_pe"]) and seen["q_pe"].shape == (5, H, R)
    assert _views(seen["k_pe"], x["k_pe"]) and seen["k_pe"].shape == (5, R)
    assert _views(seen["ckv"], x["ckv"]) and _views(seen["slots"], x["slots"])
    assert seen["caches"] == _leaves(x["mla_cache"])   # the tensors themselves, in order
    assert torch.equal(seen["pos_ids"][:5], pos)
    assert seen["cfg"] == CFG
    assert seen["scales"] == (scales.get("q_quant_scale", 1.0), scales.get("kv_quant_scale", 1.0))
    for key in ("q_nope", "q_pe_out", "q_nope_out"):
        assert seen[key] is None if key not in x else _views(seen[key], x[key]), key
    assert out[2] is x["mla_cache"]
    _call(_manager("jax"), jax_x, 5, scales)
    _assert_same(x, jax_x)


def test_a_padded_batch_hands_the_launcher_the_planned_tokens_only():
    launcher = _Recording()
    x = _inputs(7)
    before = _clone(x)
    _call(_manager(launcher), x, 5, {})      # 7 tokens given, 5 planned
    [seen] = launcher.calls
    assert seen["q_pe"].shape[0] == seen["k_pe"].shape[0] == seen["slots"].shape[0] == 5
    assert torch.equal(x["q_pe"][5:], before["q_pe"][5:])


def test_a_declining_launcher_leaves_the_call_to_the_jax_path():
    launcher = _Recording(decline=True)
    mgr = _manager(launcher)
    x = _inputs(5, combined=False, fp8_q=True)
    jax_x = _clone(x)
    _call(mgr, x, 5, dict(q_quant_scale=0.5))
    assert len(launcher.calls) == 1 and mgr._mla._jax is not None
    _call(_manager("jax"), jax_x, 5, dict(q_quant_scale=0.5))
    _assert_same(x, jax_x)


def test_which_launcher_serves_mla():
    assert _manager("auto").mla_launcher is None           # no CUDA: the JAX path
    assert _manager("jax").mla_launcher is None

    class RopeOnly:
        def rotate_(self, q, k, pos_ids, cfg):
            raise jr.BackendUnavailable("unused")

    assert _manager(RopeOnly()).mla_launcher is None
    launcher = _Recording()
    mgr = _manager(launcher)
    assert mgr.mla_launcher is launcher and mgr.launcher is launcher
    mgr.mla_launcher = None
    assert mgr.mla_launcher is None and mgr.launcher is launcher


@pytest.mark.parametrize("launcher, runs", [(_Recording, True), (None, False),
                                            (lambda: _Recording(decline=True), False)],
                         ids=["accepting", "none", "declining"])
def test_under_capture_only_a_launcher_that_accepts_runs(launcher, runs, monkeypatch):
    # The device is only named: nothing here touches CUDA.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    paths = MlaPaths(launcher and launcher(), torch.device("cuda"), "auto")
    x = _inputs(3)
    cache = x["mla_cache"]
    geometry = MlaGeometry(True, *cache.shape[:2], L, R, cache.dtype)
    call = lambda: paths(x["q_pe"], x["k_pe"], x["ckv"], None, (), (cache,), geometry,  # noqa: E731
                         torch.arange(3, dtype=torch.int32), x["slots"], CFG, (1.0, 1.0), True)
    if runs:
        call()
        assert len(paths.fast.launcher.calls) == 1
    else:
        with pytest.raises(RuntimeError, match="apply_mla_and_append_kv under CUDA-graph capture"):
            call()
        assert paths._jax is None


def _launch(**changes):
    # The launcher's checks run before anything it builds in __init__ is used.
    x = dict(q_pe=torch.zeros(4, H, R, dtype=torch.bfloat16),
             k_pe=torch.zeros(4, R, dtype=torch.bfloat16),
             ckv=torch.zeros(4, L, dtype=torch.bfloat16),
             pos_ids=torch.zeros(4, dtype=torch.int32),
             caches=(torch.zeros(2, 8, L + R, dtype=torch.bfloat16),),
             slots=torch.arange(4), cfg=CFG, scales=(1.0, 1.0))
    x.update(changes)
    MosaicMlaLauncher.rotate_and_append_mla_(object.__new__(MosaicMlaLauncher), **x)


def test_the_launcher_declines_cpu_tensors_and_a_partial_rotation():
    with pytest.raises(jr.BackendUnavailable, match="q_pe is on cpu"):
        _launch()
    partial = jr.RopeConfig(head_dim=R, rotary_dim=R // 2)
    with pytest.raises(jr.BackendUnavailable, match="rotary_dim=8 must be head_dim=16"):
        _launch(cfg=partial)


@pytest.mark.parametrize("changes, message", [
    (dict(k_pe=torch.zeros(4, 2 * R, dtype=torch.bfloat16)), "k_pe"),
    (dict(caches=(torch.zeros(2, 8, L, dtype=torch.bfloat16),)), "caches"),
    (dict(caches=(torch.zeros(2, 8, L + R, dtype=torch.float16),)), "caches"),
    (dict(q_nope=torch.zeros(4, H, N, dtype=torch.bfloat16)), "q_nope is only read"),
    (dict(q_pe_out=torch.zeros(3, H, R, dtype=FP8)), "q_pe_out"),
    (dict(q_pe_out=torch.zeros(4, H, R, dtype=FP8),
          q_nope=torch.zeros(4, H, N, dtype=torch.bfloat16),
          q_nope_out=torch.zeros(4, H, N, dtype=torch.bfloat16)), "q_nope_out"),
], ids=["k_pe", "cache_width", "cache_dtype", "q_nope_alone", "q_pe_out_short", "q_nope_out_bf16"])
def test_the_launcher_refuses_what_it_would_read_or_write_past(changes, message):
    with pytest.raises(ValueError, match=message):
        _launch(**changes)


def test_launch_pointers_pass_the_written_operands_again_as_results():
    # The aliases of the lowered module (tests/test_mla_export.py): result i is operand
    # 6 (q_pe), 9 and 10 (a pair) in place; with an fp8 q and q_nope the cache and the
    # fp8 outputs, operands 10, 11 and 12.
    fixed = tuple(range(6))
    in_place = launch_pointers(False, fixed, 6, 7, 8, (), (9, 10), ())
    assert in_place == (*range(11), 6, 9, 10)
    fp8 = launch_pointers(True, fixed, 6, 7, 8, (9,), (10,), (11, 12))
    assert fp8 == (*range(13), 10, 11, 12)
    assert np.all(np.diff(fp8[:13]) == 1)


class _Binding(_Recording):
    """A recording launcher that binds: its bound run does the work too, or (``refuse``)
    returns False to send the call down the full path."""

    def __init__(self, refuse: bool = False):
        super().__init__()
        self.refuse = refuse
        self.bound_calls = 0

    def bind(self, q_pe, k_pe, ckv, caches, slots, cfg, scales, q_nope=None, q_pe_out=None,
             q_nope_out=None):
        combined = len(caches) == 1

        def run(q_pe, k_pe, ckv, pos_ids, mla_cache, slots, q_nope, q_pe_out, q_nope_out):
            if self.refuse:
                return False
            self.bound_calls += 1
            self._jax_call(q_pe.view(q_pe.shape[0], -1, k_pe.shape[1]), k_pe, ckv, pos_ids,
                           (mla_cache,) if combined else tuple(mla_cache), slots, cfg, scales,
                           q_nope, q_pe_out, q_nope_out)
            return True

        return run


def _twice(mgr, x, scales, second=None):
    """Two steps of one shape: the second call's inputs are ``second`` (default: fresh
    copies of the first's)."""
    second = second or _clone(x)
    _call(mgr, x, 5, scales)
    mgr.remove_request("r")
    mgr.ingest_request("r")
    _call(mgr, second, 5, scales)
    return second


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_repeated_signature_runs_the_bound_launch_with_the_same_result(name):
    case, scales = CASES[name]
    launcher = _Binding()
    x = _inputs(5, **case)
    second = _twice(_manager(launcher), _clone(x), scales, _clone(x))
    assert (len(launcher.calls), launcher.bound_calls) == (1, 1)
    want = _clone(x)
    _call(_manager("jax"), want, 5, scales)
    _assert_same(second, want)


def test_a_new_scale_a_padded_batch_or_a_refusing_run_take_the_full_path():
    launcher = _Binding()
    mgr = _manager(launcher)
    x = _inputs(5, cache_dtype=FP8)
    _twice(mgr, x, dict(kv_quant_scale=2.0))
    _twice(mgr, x, dict(kv_quant_scale=0.5))            # another signature: bound anew
    assert (len(launcher.calls), launcher.bound_calls) == (2, 2)
    padded = _Binding()
    mgr = _manager(padded)
    for _ in range(2):
        _call(mgr, _inputs(7), 5, {})                   # 7 tokens given, 5 planned
        mgr.remove_request("r")
        mgr.ingest_request("r")
    assert (len(padded.calls), padded.bound_calls) == (2, 0)
    refusing = _Binding(refuse=True)
    _twice(_manager(refusing), _inputs(5), {})
    assert (len(refusing.calls), refusing.bound_calls) == (2, 0)
