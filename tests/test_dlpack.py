"""torch <-> JAX on CPU (numpy views in, DLPack out): zero-copy imports, in-place writes,
staging copies."""

import threading
import time
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from torch_bridge.dlpack import InPlace, NotZeroCopyError, to_jax, to_torch  # noqa: E402
from torch_bridge.dlpack import jax_device  # noqa: E402


def _scale(x, factor):
    return (x * factor,)


def test_to_jax_shares_memory_with_the_tensor():
    t = torch.randn(6, 5)
    x = to_jax(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(x), t.numpy())


def test_to_torch_shares_memory_with_the_array():
    x = jnp.asarray(np.random.default_rng(20261201).standard_normal((4, 3)), jnp.float32)
    t = to_torch(x)
    assert t.data_ptr() == x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(t.numpy(), np.asarray(x))


def test_bfloat16_round_trips_bit_exactly():
    t = torch.randn(7, 3).to(torch.bfloat16)
    back = to_torch(to_jax(t))
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_to_jax_shares_memory_for_dtypes_numpy_lacks_too(dtype):
    t = torch.randn(64, 3).to(dtype)
    x = to_jax(t)
    assert x.unsafe_buffer_pointer() == t.data_ptr()
    assert x.dtype.name == str(dtype)[len("torch."):]
    assert torch.equal(to_torch(x).view(torch.uint8), t.view(torch.uint8))


def test_an_imported_tensor_is_released_on_a_python_thread_not_an_xla_worker():
    # Released on XLA's worker thread (as a DLPack import is), torch's deleter takes the
    # GIL there, which aborts the process when it happens while the interpreter exits.
    @jax.jit
    def slow(x):  # long enough that the worker, not this thread, ends the buffer's use
        return jax.lax.fori_loop(0, 100, lambda i, y: jnp.sin(y) + 1.0, x)

    released = []
    for _ in range(3):
        t = torch.randn(256, 1024)
        weakref.finalize(t, lambda: released.append(threading.get_ident()))
        out = slow(to_jax(t))
        del t
        out.block_until_ready()
    for _ in range(100):  # JAX hands deferred releases back on its next calls
        if len(released) == 3:
            break
        jnp.zeros(1).block_until_ready()
        time.sleep(0.01)
    assert released == [threading.main_thread().ident] * 3


def test_to_jax_rejects_non_contiguous_tensors():
    with pytest.raises(NotZeroCopyError, match="not contiguous"):
        to_jax(torch.randn(8, 6)[:, :4])


def test_to_jax_rejects_misaligned_tensors():
    base = torch.randn(1024)
    misaligned = base[1:17]
    with pytest.raises(NotZeroCopyError, match="aligned"):
        to_jax(misaligned)


def test_to_jax_rejects_tensors_that_require_grad():
    with pytest.raises(ValueError, match="requires_grad"):
        to_jax(torch.randn(3, requires_grad=True))


def test_in_place_rewrites_the_tensor_and_keeps_its_storage():
    t = torch.randn(16, 4)
    expected = t.numpy().astype(np.float64) * 3.0
    ptr = t.data_ptr()
    call = InPlace(_scale, 1)
    call([t], jnp.float32(3.0))
    assert t.data_ptr() == ptr
    np.testing.assert_allclose(t.numpy(), expected, rtol=1e-6)
    # The XLA CPU runtime never aliases imported buffers: the result was copied back.
    assert call.aliased == {(((16, 4), torch.float32),): False}


def test_in_place_stages_non_contiguous_tensors_when_allowed():
    base = torch.randn(8, 6)
    view = base[:, 1:5]
    untouched = base[:, [0, 5]].clone()
    expected = view.numpy().astype(np.float64) * -2.0
    InPlace(_scale, 1)([view], jnp.float32(-2.0))
    np.testing.assert_allclose(base[:, 1:5].numpy(), expected, rtol=1e-6)
    assert torch.equal(base[:, [0, 5]], untouched)


def test_in_place_stages_misaligned_tensors_when_allowed():
    base = torch.randn(1024)
    view = base[3:19]
    expected = view.numpy().astype(np.float64) * 0.5
    InPlace(_scale, 1)([view], jnp.float32(0.5))
    np.testing.assert_allclose(base[3:19].numpy(), expected, rtol=1e-6)


def test_in_place_refuses_a_staging_copy_when_not_allowed():
    t = torch.randn(8, 6)[:, :4]
    before = t.clone()
    with pytest.raises(NotZeroCopyError):
        InPlace(_scale, 1)([t], jnp.float32(2.0), allow_copy=False)
    assert torch.equal(t, before)


def test_in_place_returns_extra_outputs():
    def split(x):
        return x + 1, x.sum()

    t = torch.ones(5)
    written, total = InPlace(split, 1)([t])
    assert torch.equal(t, torch.full((5,), 2.0))
    assert float(total) == 5.0 and float(written[0]) == 2.0


def test_in_place_checks_the_number_of_tensors():
    with pytest.raises(ValueError, match="expected 1"):
        InPlace(_scale, 1)([torch.ones(2), torch.ones(2)], jnp.float32(1.0))


def test_jax_device_of_a_cpu_tensor_is_the_cpu_backend():
    assert jax_device(torch.device("cpu")).platform == "cpu"
