"""Moving tensors between PyTorch and JAX through DLPack: zero copy, in place, stream-ordered.

Three operations:

- :func:`to_jax` imports a torch tensor as a JAX array over the same memory (through
  DLPack on the GPU, through a numpy view on the CPU: see :func:`to_jax`).
- :func:`to_torch` exports a JAX array as a torch tensor over the same memory.
- :class:`InPlace` runs a jitted JAX function whose outputs replace the contents of
  torch tensors, with the inputs donated so that XLA can write the results into the
  imported buffers themselves.

and the token buckets of the bridge's JAX paths: a jitted function compiles once per
input shape, and an engine's token count changes every step, so :func:`token_bucket`
rounds it up to a power of two and :func:`pad_tokens` stages a tensor at that size (the
callers write back only the real tokens).

Stream ordering on CUDA, with no host synchronisation: ``jax.dlpack.from_dlpack``
passes JAX's stream for external ready events to ``tensor.__dlpack__(stream=...)``,
and torch makes that stream wait for the work queued so far on torch's *current*
stream; ``torch.from_dlpack`` passes torch's current stream to
``array.__dlpack__(stream=...)`` and JAX makes it wait for the array's definition
event. So a JAX computation between the two sees everything torch queued before, and
whatever torch queues next on its current stream sees the computation's results.

Zero copy for in-place writes depends on the runtime: XLA aliases an output onto a
donated imported buffer where it can (the GPU runtime does for device buffers) and
otherwise writes a fresh buffer. :class:`InPlace` checks which happened once per
signature (by comparing buffer pointers; that first check may wait for the device)
and, when the output is a fresh buffer, copies it back into the torch tensor with
``Tensor.copy_`` on torch's current stream. The XLA CPU runtime never aliases an
imported buffer, so on CPU every in-place call ends in that copy.

Non-contiguous tensors cannot be imported (DLPack import needs compact strides) and
imported buffers must meet XLA's alignment; with ``allow_copy=True`` such tensors
are staged through a contiguous copy and written back (two extra copies), otherwise
:class:`NotZeroCopyError` is raised.

Example:
  >>> import torch
  >>> t = torch.arange(4, dtype=torch.float32)
  >>> to_torch(to_jax(t) * 2).tolist()
  [0.0, 2.0, 4.0, 6.0]
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Sequence, Tuple

import jax
import jax.dlpack
import jax.numpy as jnp
import torch

__all__ = ["InPlace", "MIN_BUCKET", "NotZeroCopyError", "jax_device", "jax_dtype_name",
           "pad_tokens", "read_only", "to_jax", "to_torch", "token_bucket", "write_back"]

# The smallest token bucket: decode batches of 1..16 tokens share one compile (padding a
# few tokens costs less than a compile, which takes seconds on CPU).
MIN_BUCKET = 16


class NotZeroCopyError(ValueError):
    """A tensor cannot be shared with JAX without a copy (strides or alignment).

    A ``ValueError``; raised by :func:`to_jax`, and by :class:`InPlace` calls with
    ``allow_copy=False``.

    Example:
      >>> try:
      ...     to_jax(torch.zeros(2, 3).T)
      ... except NotZeroCopyError as e:
      ...     print(str(e).split(";")[0])
      tensor with shape=(3, 2) and stride=(1, 3) is not contiguous
    """


@functools.lru_cache(maxsize=None)
def jax_device(device: torch.device) -> jax.Device:
    """The JAX device that DLPack imports of tensors on ``device`` land on.

    Example:
      >>> jax_device(torch.device("cpu")).platform
      'cpu'

    Raises:
      ValueError: JAX has no backend for the device (e.g. a CUDA tensor with a
        CPU-only JAX).
    """
    probe = torch.zeros((1,), dtype=torch.int32, device=device)
    try:
        array = jax.dlpack.from_dlpack(probe)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(f"device={device} has no JAX backend here ({e}); install a JAX build "
                         "for this device or use device='cpu'") from e
    (dev,) = array.devices()
    return dev


def jax_dtype_name(dtype: torch.dtype) -> str:
    """The name JAX (and numpy, where it has the type) gives torch's ``dtype``: torch's
    own name without its module.

    Example:
      >>> jax_dtype_name(torch.bfloat16), jax_dtype_name(torch.float8_e4m3fn)
      ('bfloat16', 'float8_e4m3fn')
    """
    return str(dtype).removeprefix("torch.")


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A JAX array over ``tensor``'s memory (no copy), ordered after torch's current stream.

    Args:
      tensor: any shape; float32/float16/bfloat16/int32 (int64 is converted by JAX to
        int32, which copies). Must be contiguous, not require grad, and meet XLA's
        alignment.

    Returns:
      ``jax.Array`` of the same shape on :func:`jax_device` of ``tensor.device``. A CPU
      tensor is put on the device as a numpy view (no copy either), so that the buffer
      is released on a thread that holds the GIL, never on XLA's worker (which can
      abort an exiting interpreter).

    Raises:
      NotZeroCopyError: the tensor is non-contiguous or misaligned.
      ValueError: the tensor requires grad.

    Example:
      >>> t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
      >>> x = to_jax(t)
      >>> x.unsafe_buffer_pointer() == t.data_ptr(), x.shape
      (True, (2, 3))
    """
    if tensor.requires_grad:
        raise ValueError("tensor.requires_grad=True: DLPack cannot share a tensor that autograd "
                         "tracks; run under torch.no_grad() or pass tensor.detach()")
    if not tensor.is_contiguous():
        raise NotZeroCopyError(f"tensor with shape={tuple(tensor.shape)} and "
                               f"stride={tensor.stride()} is not contiguous; a zero-copy import "
                               "needs compact strides")
    if tensor.device.type == "cpu":
        return _host_import(tensor)
    try:
        return jax.dlpack.from_dlpack(tensor, copy=False)
    except ValueError as e:
        if "aligned" in str(e):
            raise NotZeroCopyError(f"tensor at data_ptr={tensor.data_ptr():#x} is not aligned "
                                   f"as XLA requires: {e}") from e
        raise


def _host_import(tensor: torch.Tensor) -> jax.Array:
    # Not DLPack on CPU: XLA's CPU runtime releases an imported buffer on its worker
    # thread when the last computation using it ends, and torch's DLPack deleter then
    # takes the GIL, which aborts the process ("terminate called without an active
    # exception") when that happens while the interpreter finalizes. A numpy view put
    # on the device is just as zero copy, and JAX defers its release to a thread that
    # holds the GIL. numpy lacks bfloat16 and the float8 types: those go through an
    # integer view of the same width and numpy's view as JAX's type of that name.
    if tensor.dtype.is_floating_point and tensor.dtype not in _NUMPY_FLOATS:
        bits = _SAME_WIDTH_INT[tensor.element_size()]
        host = tensor.view(bits).numpy().view(getattr(jnp, jax_dtype_name(tensor.dtype)))
    else:
        host = tensor.numpy()
    array = jax.device_put(host, jax_device(tensor.device))
    # device_put copies a buffer XLA cannot alias (misaligned) instead of refusing it;
    # int64 becomes int32 (a copy) as DLPack's import does.
    if (tensor.numel() and array.dtype.itemsize == tensor.element_size()
            and array.unsafe_buffer_pointer() != tensor.data_ptr()):
        raise NotZeroCopyError(f"tensor at data_ptr={tensor.data_ptr():#x} is not aligned as "
                               "XLA requires (64 bytes on CPU)")
    return array


_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def check_contiguous(tensors: Sequence[Tuple[str, Any]]) -> None:
    """What ``allow_copy=False`` asks of a fused append's tensors, checked before the call
    changes anything: every path needs them contiguous (a launcher declines a strided
    tensor, and the JAX path may not stage a copy). ``tensors``: ``(name, tensor)``, a
    tensor None (absent) or a tuple of tensors (a cache pair, named ``name[i]``).

    Raises:
      NotZeroCopyError: naming the first tensor that is not contiguous.
    """
    for name, value in tensors:
        named = ([(f"{name}[{i}]", t) for i, t in enumerate(value)]
                 if isinstance(value, (tuple, list)) else [(name, value)])
        for label, tensor in named:
            if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
                raise NotZeroCopyError(
                    f"{label} with shape={tuple(tensor.shape)} and stride={tensor.stride()} is "
                    "not contiguous; with allow_copy=False no path stages a copy: pass a "
                    "contiguous tensor or build the manager with allow_copy=True")


def read_only(tensor: torch.Tensor, allow_copy: bool) -> jax.Array:
    """:func:`to_jax` of a tensor the JAX function only reads; with ``allow_copy``, a fresh
    contiguous copy's where ``tensor`` cannot be imported as is (strides or alignment).

    Raises:
      NotZeroCopyError: ``allow_copy=False`` and the tensor cannot be imported as is.
    """
    try:
        return to_jax(tensor)
    except NotZeroCopyError:
        if not allow_copy:
            raise
        # torch's allocators align far beyond XLA's requirement.
        return to_jax(tensor.clone(memory_format=torch.contiguous_format))


def to_torch(array: jax.Array) -> torch.Tensor:
    """A torch tensor over ``array``'s memory (no copy); torch's current stream waits for it.

    Example:
      >>> import jax.numpy as jnp
      >>> to_torch(jnp.arange(3, dtype=jnp.int32)).tolist()
      [0, 1, 2]
    """
    return torch.from_dlpack(array)


def token_bucket(tokens: int) -> int:
    """The token count a JAX path compiles for: the next power of two ``>= tokens``, at
    least :data:`MIN_BUCKET`.

    Compiles grow with ``log2`` of the largest token count rather than one per count; the
    padding costs at most as many tokens again.

    Example:
      >>> [token_bucket(t) for t in (1, 16, 17, 100, 128, 129)]
      [16, 16, 32, 128, 128, 256]
    """
    return max(MIN_BUCKET, 1 << (tokens - 1).bit_length())


def pad_tokens(tensor: torch.Tensor, size: int, *, dim: int = 0,
               fill: float = 0) -> torch.Tensor:
    """``tensor`` with exactly ``size`` entries along ``dim``: itself when it has them, else
    a new contiguous tensor holding its first ``min(n, size)`` entries, ``fill`` after.

    Example:
      >>> pad_tokens(torch.tensor([5, 6, 7]), 4, fill=-1).tolist()
      [5, 6, 7, -1]
      >>> pad_tokens(torch.arange(6).view(2, 3), 2, dim=-1).tolist()
      [[0, 1], [3, 4]]
    """
    dim %= tensor.ndim
    n = tensor.shape[dim]
    if n == size:
        return tensor
    shape = (*tensor.shape[:dim], size, *tensor.shape[dim + 1:])
    staged = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
    kept = min(n, size)
    staged.narrow(dim, 0, kept).copy_(tensor.narrow(dim, 0, kept))
    return staged


def write_back(tensor: torch.Tensor, staged: torch.Tensor) -> None:
    """Copy the first ``tensor.shape[0]`` rows of ``staged`` (from :func:`pad_tokens`) into
    ``tensor``; nothing when ``staged`` is ``tensor`` itself."""
    if staged is not tensor:
        tensor.copy_(staged[:tensor.shape[0]])


Signature = Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]


class InPlace:
    """A JAX function applied to torch tensors in place: ``tensors[i] <- fn(*tensors, *args)[i]``.

    Args:
      fn: a JAX function whose first ``num_inplace`` arguments are the arrays to
        rewrite and whose outputs are a tuple starting with ``num_inplace`` arrays of
        the same shapes and dtypes (any further outputs are returned to the caller);
        further arguments are JAX arrays.
      num_inplace: how many leading arguments are rewritten (donated), ``>= 0``.
      static_argnames: keyword arguments of ``fn`` that are static under ``jax.jit``.

    Attributes:
      aliased: ``{signature: bool}``, per ``(shape, dtype)`` signature of the
        rewritten tensors: True when XLA wrote the outputs into the imported buffers
        (zero copy), False when they were copied back.

    Example:
      >>> double = InPlace(lambda x: (x * 2,), 1)
      >>> t = torch.ones(4)
      >>> _ = double([t])
      >>> t.tolist()
      [2.0, 2.0, 2.0, 2.0]
    """

    def __init__(self, fn: Callable, num_inplace: int, *, static_argnames: Sequence[str] = ()):
        if num_inplace < 0:
            raise ValueError(f"{num_inplace=} must be >= 0")
        self._jitted = jax.jit(fn, donate_argnums=tuple(range(num_inplace)),
                               static_argnames=tuple(static_argnames))
        self._num_inplace = num_inplace
        self.aliased: Dict[Signature, bool] = {}

    def __call__(self, tensors: Sequence[torch.Tensor], *args, allow_copy: bool = True,
                 **static) -> Tuple[jax.Array, ...]:
        """Rewrite ``tensors`` in place with ``fn(*tensors, *args, **static)``.

        Args:
          tensors: ``num_inplace`` torch tensors, rewritten in place (their
            ``data_ptr`` never changes).
          args: the remaining positional arguments of ``fn`` (JAX arrays).
          allow_copy: stage non-contiguous or misaligned tensors through a contiguous
            copy; False raises instead.
          static: static keyword arguments of ``fn``.

        Returns:
          all of ``fn``'s outputs as JAX arrays (the first ``num_inplace`` hold the
          values now in ``tensors``).

        Raises:
          NotZeroCopyError: ``allow_copy=False`` and a tensor cannot be imported as is.
          ValueError: wrong number of tensors, or a tensor requires grad.
        """
        if len(tensors) != self._num_inplace:
            raise ValueError(f"got {len(tensors)} tensors, expected {self._num_inplace}")
        sources = [self._importable(t, allow_copy) for t in tensors]
        arrays = []
        for i, source in enumerate(sources):
            try:
                arrays.append(to_jax(source))
            except NotZeroCopyError:
                if not allow_copy:
                    raise
                source = sources[i] = _aligned_copy(source)
                arrays.append(to_jax(source))
        outputs = self._jitted(*arrays, *args, **static)
        if not sources:
            return outputs
        signature = tuple((tuple(t.shape), t.dtype) for t in sources)
        aliased = self.aliased.get(signature)
        if aliased is None:
            aliased = self.aliased[signature] = all(
                out.unsafe_buffer_pointer() == source.data_ptr()
                for out, source in zip(outputs, sources))
        if aliased:
            # Exporting makes torch's current stream wait for the array's definition event;
            # every output of one execution shares it, so one export orders them all (each
            # export costs tens of microseconds on a slow host).
            to_torch(outputs[0])
        for tensor, source, out in zip(tensors, sources, outputs):
            if not aliased:
                source.copy_(to_torch(out))
            if source is not tensor:
                tensor.copy_(source)
        return outputs

    @staticmethod
    def _importable(tensor: torch.Tensor, allow_copy: bool) -> torch.Tensor:
        if tensor.is_contiguous():
            return tensor
        if not allow_copy:
            raise NotZeroCopyError(f"tensor with shape={tuple(tensor.shape)} and "
                                   f"stride={tensor.stride()} is not contiguous; pass a contiguous "
                                   "tensor or allow the staging copy")
        return tensor.contiguous()


def _aligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    # torch's allocators return blocks aligned far beyond XLA's requirement.
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    copy.copy_(tensor)
    return copy
