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
