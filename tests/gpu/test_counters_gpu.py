"""The Triton counter store on CUDA: the manager's state machine against its model.

The same rule-based machine as ``tests/test_manager_state_machine.py`` (every method,
bad calls between good ones, snapshots, preplans, forks), with the manager on the GPU:
counters in an int32 CUDA tensor changed by the compiled Triton step kernel, and q/k
rotated by the launcher. Run on the device machine (``-m gpu``).
"""

import pytest
from hypothesis import settings

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.test_manager_state_machine import (_FAST, BlockManagerMachine,  # noqa: E402
                                              ManagerMachine)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="torch has no CUDA device")]


class CudaTritonMachine(ManagerMachine):
    device = "cuda"
    counters = "triton"


class CudaTritonBlockMachine(BlockManagerMachine):
    device = "cuda"
    counters = "triton"


TestCudaTritonStoreMatchesTheModel = CudaTritonMachine.TestCase
TestCudaTritonStoreMatchesTheModel.settings = settings(max_examples=40, stateful_step_count=40,
                                                       **_FAST)
TestCudaTritonBlockStoreMatchesTheModel = CudaTritonBlockMachine.TestCase
TestCudaTritonBlockStoreMatchesTheModel.settings = settings(max_examples=15,
                                                            stateful_step_count=40, **_FAST)


def test_transitions_refuse_cuda_graph_capture_and_change_nothing():
    # A captured counter launch would replay with the meta of capture time; every
    # transition must refuse under capture, before any host or device state changes.
    import jaxrope as jr
    from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext

    rope = jr.RopeConfig(head_dim=64, max_position=1 << 16)
    mgr = RopeManager(PositionConfig(rope=rope), "cuda", max_seq_len=1 << 16, counters="triton")
    mgr.ingest_request("a")
    step, ctx = PositionStep([Segment("a", "text", 3)]), StepContext(("a",))
    mgr.plan(step, ctx)
    mgr.commit(step, ctx)
    torch.cuda.synchronize()
    before = mgr.state_snapshot()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    errors = []
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for call in (lambda: mgr.plan(step, ctx), lambda: mgr.reset_request("a"),
                         lambda: mgr.apply_cached_prefix("a", None, None, None, {"text": 9})):
                try:
                    call()
                except RuntimeError as e:
                    errors.append(str(e))
    assert len(errors) == 3 and all("CUDA graph" in e for e in errors), errors
    assert mgr.state_snapshot() == before


def test_a_long_prefill_plan_on_cuda_numbers_every_token():
    # Past 8192 tokens the compiled kernel writes positions in a second, many-program
    # launch; a preplan on top of it reads the scratch table.
    import numpy as np

    import jaxrope as jr
    from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext

    rope = jr.RopeConfig(head_dim=64, max_position=1 << 20)
    mgr = RopeManager(PositionConfig(rope=rope), "cuda", max_seq_len=1 << 20, counters="triton")
    spans = [5000, 1, 7000, 300]
    rids = [f"r{i}" for i in range(len(spans))]
    for i, rid in enumerate(rids):
        mgr.ingest_request(rid, overrides={"text": 1000 * i})
    step = PositionStep([Segment(rid, "text", n) for rid, n in zip(rids, spans)])
    got = mgr.plan(step, StepContext(tuple(rids)))["text"].cpu().numpy()
    want = np.concatenate([1000 * i + np.arange(n) for i, n in enumerate(spans)])
    np.testing.assert_array_equal(got, want)
    staged = mgr.plan(step, StepContext(tuple(rids), is_preplan=True))["text"].cpu().numpy()
    np.testing.assert_array_equal(staged, want + np.repeat(spans, spans))
    mgr.commit(step, StepContext(tuple(rids)))
    assert [mgr.position(rid, "text") for rid in rids] == [1000 * i + n for i, n in enumerate(spans)]
    assert np.asarray(mgr.table.counters)[[mgr._slot(r, "text") for r in rids]].tolist() == [
        1000 * i + n for i, n in enumerate(spans)]
