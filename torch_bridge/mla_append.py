"""How ``RopeManager.apply_mla_and_append_kv`` checks an MLA cache and runs the JAX path.

The manager's method is :func:`jaxrope.apply_mla_rope_and_append` on an engine's own
tensors at the planned positions of a label (semantics, layouts and fp8 rules in
:mod:`jaxrope.ops.mla_rope_append.api`). This module holds what the method needs beyond
``apply_qk``'s checks of q_pe and k_pe:

- :func:`check_call`: ckv, q_nope, the cache (a ``(ckv_cache, kpe_cache)`` pair or one
  ``[pages, page_size, L + r]`` tensor), the slots, the fp8 outputs and the scales,
  from their static properties; it returns the :class:`MlaGeometry` the cache is
  addressed by;
- :class:`MlaPaths`: the launcher (:class:`torch_bridge.launch.dispatch.MlaLauncher`,
  on CUDA :class:`torch_bridge.launch.mla.MosaicMlaLauncher`), else
- :class:`JaxMlaAppend`: the JAX path, the core op on DLPack imports with q_pe (or the
  fp8 outputs) and the cache rewritten in place (:class:`torch_bridge.dlpack.InPlace`);
- the ``jaxrope::apply_mla_and_append_kv`` custom op that ``torch.compile`` records
  (:func:`traced_apply_mla_and_append_kv`), as :mod:`torch_bridge.custom_ops` does for
  the other methods.

Slot values on a CUDA device are not checked (as for the GQA append): a slot outside
``[0, pages * page_size)`` writes nothing, at any integer width.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import jax
import jax.numpy as jnp
import torch

from jaxrope.config import RopeConfig
from jaxrope.ops.mla_rope_append.api import apply_mla_rope_and_append
from torch_bridge import custom_ops, kv_append
from torch_bridge.dlpack import InPlace, pad_tokens, read_only, token_bucket, write_back
from torch_bridge.launch.dispatch import FastPath
from torch_bridge.launch.runtime import int32_slots
from torch_bridge.memory_overlap import share_memory

__all__ = ["JaxMlaAppend", "MlaGeometry", "MlaPaths", "call_signature", "check_call",
           "traced_apply_mla_and_append_kv"]

FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class MlaGeometry:
    """An MLA cache as the kernels address it: ``pages * page_size`` rows.

    Attributes:
      combined: one ``[pages, page_size, L + r]`` tensor rather than a pair.
      pages, page_size, lora, rope: its sizes (``L``, ``r``).
      dtype: k_pe's dtype or ``torch.float8_e4m3fn``.

    Example:
      >>> g = MlaGeometry(True, 8, 16, 512, 64, torch.bfloat16)
      >>> g.num_slots, g.quantized
      (128, False)
    """

    combined: bool
    pages: int
    page_size: int
    lora: int
    rope: int
    dtype: torch.dtype

    @property
    def num_slots(self) -> int:
        """``pages * page_size``: the valid slots are ``[0, num_slots)``."""
        return self.pages * self.page_size

    @property
    def quantized(self) -> bool:
        """An fp8 e4m3 cache (scaled and saturated on the way in)."""
        return self.dtype == FP8


def _tensor(name: str, x: Any, shape: Tuple[Optional[int], ...], dtype: torch.dtype,
            device: torch.device, layout: str) -> torch.Tensor:
    """``x`` checked: a tensor of ``shape`` (None: any size), ``dtype``, on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != len(shape) or any(n is not None and n != m for n, m in zip(shape, x.shape)):
        want = tuple("any" if n is None else n for n in shape)
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be {layout} = {want}")
    if x.dtype != dtype:
        raise ValueError(f"{name}.dtype={x.dtype} must be {dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the manager's device)")
    if x.requires_grad:
        raise ValueError(f"{name}.requires_grad=True: run under torch.no_grad() on tensors "
                         "autograd does not track")
    return x


def _caches(mla_cache: Any, lora: int, rope: int, dtype: torch.dtype,
            device: torch.device) -> Tuple[Tuple[torch.Tensor, ...], MlaGeometry]:
    if isinstance(mla_cache, (tuple, list)):
        if len(mla_cache) != 2 or not all(isinstance(c, torch.Tensor) for c in mla_cache):
            raise TypeError(f"mla_cache must be a (ckv_cache, kpe_cache) pair of tensors or one "
                            f"tensor, got a {type(mla_cache).__name__} of "
                            f"{[type(c).__name__ for c in mla_cache]}")
        ckv_cache, kpe_cache = mla_cache
        if ckv_cache.ndim != 3:
            raise ValueError(f"ckv_cache.shape={tuple(ckv_cache.shape)} must be [pages, "
                             f"page_size, L] with L={lora}")
        pages, page_size = ckv_cache.shape[:2]
        caches = (ckv_cache, kpe_cache)
        names, widths = ("ckv_cache", "kpe_cache"), ((lora, "L"), (rope, "r"))
    elif isinstance(mla_cache, torch.Tensor):
        if mla_cache.ndim != 3:
            raise ValueError(f"mla_cache.shape={tuple(mla_cache.shape)} must be [pages, "
                             f"page_size, L + r] with L + r={lora + rope}")
        pages, page_size = mla_cache.shape[:2]
        caches, names, widths = (mla_cache,), ("mla_cache",), ((lora + rope, "L + r"),)
    else:
        raise TypeError(f"mla_cache must be a (ckv_cache, kpe_cache) pair of tensors or one "
                        f"tensor, got {type(mla_cache).__name__}")
    cache_dtype = caches[0].dtype
    if cache_dtype not in (dtype, FP8):
        raise ValueError(f"{names[0]}.dtype={cache_dtype} must be k_pe's dtype ({dtype}) or {FP8}")
    for name, c, (width, label) in zip(names, caches, widths):
        _tensor(name, c, (pages, page_size, width), cache_dtype, device,
                f"[pages, page_size, {label}]")
    if len(caches) == 2 and share_memory(*caches):
        raise ValueError("mla_cache's ckv_cache and kpe_cache share memory; pass two separate "
                         "tensors or one [pages, page_size, L + r] tensor")
    geometry = MlaGeometry(len(caches) == 1, pages, page_size, lora, rope, cache_dtype)
    if geometry.num_slots >= 2 ** 31:
        raise ValueError(f"the cache has {geometry.num_slots} slots; slots are int32, at most "
                         "2**31 - 1")
    return caches, geometry


def _scale(name: str, value: Any, applies: bool, what: str) -> float:
    if not applies and value is not None:
        raise ValueError(f"{name}={value!r} applies only {what}; leave it None")
    return kv_append._scale(name, value, applies)


def check_call(q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: Any, q_nope: Any, mla_cache: Any,
               slots: Any, q_pe_out: Any, q_nope_out: Any, q_quant_scale: Any,
               kv_quant_scale: Any, device: torch.device
               ) -> Tuple[Tuple[torch.Tensor, ...], MlaGeometry, Tuple[float, float]]:
    """Check what ``apply_mla_and_append_kv`` takes beyond q_pe and k_pe; nothing is changed.

    ``q_pe [T, H, r]`` and ``k_pe`` are checked by the manager (``apply_qk``'s rules,
    k_pe as one head); ``k_pe`` must be ``[T, r]``.

    Returns:
      ``(caches, geometry, (q_scale, kv_scale))``: the cache tensors as given (the pair,
      or the one tensor alone), their :class:`MlaGeometry`, the scales as floats (1.0
      where not given).

    Raises:
      TypeError: a tensor argument not a tensor, the cache neither a pair nor a tensor,
        a scale not a number.
      ValueError: a shape, dtype or device unlike the rules; q_nope without the fp8
        outputs, ``q_nope_out`` without ``q_pe_out`` or ``q_nope``; a scale where it
        does not apply, or not finite and > 0 as a normal float32; a pair of caches
        sharing memory.
    """
    tokens, heads, rope = q_pe.shape
    dtype = q_pe.dtype
    if k_pe.ndim != 2 or k_pe.shape[1] != rope:
        raise ValueError(f"k_pe.shape={tuple(k_pe.shape)} must be [T, r] = {(tokens, rope)}")
    _tensor("ckv", ckv, (tokens, None), dtype, device, "[T, L]")
    fp8_q = q_pe_out is not None
    if fp8_q:
        _tensor("q_pe_out", q_pe_out, tuple(q_pe.shape), FP8, device, "q_pe's [T, H, r]")
    if q_nope is not None:
        if not fp8_q:
            raise ValueError("q_nope is only read to quantize it into q_nope_out: pass "
                             "q_pe_out and q_nope_out with it, or leave it None")
        _tensor("q_nope", q_nope, (tokens, heads, None), dtype, device, "[T, H, N]")
    if (q_nope_out is None) != (q_nope is None):
        raise ValueError("q_nope and q_nope_out go together (q_nope_out receives the fp8 "
                         f"q_nope), got q_nope={'a tensor' if q_nope is not None else None} and "
                         f"q_nope_out={'a tensor' if q_nope_out is not None else None}")
    if q_nope_out is not None:
        _tensor("q_nope_out", q_nope_out, tuple(q_nope.shape), FP8, device, "q_nope's [T, H, N]")
    caches, geometry = _caches(mla_cache, ckv.shape[1], rope, dtype, device)
    kv_append.check_slot_tensor(slots, tokens, device)
    scales = (_scale("q_quant_scale", q_quant_scale, fp8_q, "with q_pe_out (fp8 q)"),
              _scale("kv_quant_scale", kv_quant_scale, geometry.quantized,
                     "to a float8_e4m3fn cache"))
    return caches, geometry, scales


def _mla_and_append(*arrays, cfg: RopeConfig, backend: str, fp8_q: bool, fp8_cache: bool,
                    num_outs: int):
    # arrays: the rewritten ones (``num_outs`` of q: q_pe itself, or the fp8 q outputs;
    # then the caches), then q_pe (fp8 q only), k_pe, ckv, q_nope, pos_ids, slots and the two scales.
    outs, rest = arrays[:num_outs], arrays[num_outs:]
    caches, (q_pe, k_pe, ckv, q_nope, pos_ids, slots, scales) = rest[:-7], rest[-7:]
    if not fp8_q:
        q_pe = outs[0]
    if fp8_cache:
        # fp8 tensors are imported as uint8 (DLPack's float8 support varies across torch).
        caches = [jax.lax.bitcast_convert_type(c, jnp.float8_e4m3fn) for c in caches]
    q_scale, kv_scale = scales
    q_pe, q_nope, cache = apply_mla_rope_and_append(
        q_pe, k_pe, ckv, pos_ids, caches[0] if len(caches) == 1 else tuple(caches), slots, cfg,
        q_nope=q_nope, q_dtype=jnp.float8_e4m3fn if fp8_q else None,
        q_quant_scale=q_scale if fp8_q else None, kv_quant_scale=kv_scale if fp8_cache else None,
        backend=backend)
    written = [q_pe, q_nope][:num_outs]
    written = [jax.lax.bitcast_convert_type(x, jnp.uint8) if fp8_q else x for x in written]
    cache = jax.tree.leaves(cache)
    if fp8_cache:
        cache = [jax.lax.bitcast_convert_type(c, jnp.uint8) for c in cache]
    return (*written, *cache)


class JaxMlaAppend:
    """The JAX path: :func:`jaxrope.apply_mla_rope_and_append` on DLPack imports, in place.

    q_pe (or, for fp8 q, ``q_pe_out`` and ``q_nope_out``) and the cache tensors are
    imported and donated, then written back as :class:`torch_bridge.kv_append.JaxAppend`
    does; the call sees ``T`` rounded up to a token bucket (padding tokens at position 0
    and slot -1, never written).

    Args:
      device: the torch device of the tensors.
      backend: the jaxrope backend ("auto": XLA where no MLA kernel runs).

    Raises:
      ValueError, BackendUnavailable: as :func:`jaxrope.ops.backends.backend_name` for
        the op "mla_rope_append" on ``device``.
    """

    def __init__(self, device: torch.device, backend: str = "auto"):
        self.backend = kv_append.jax_backend(backend, device, "mla_rope_append")
        self._calls: Dict[int, InPlace] = {}

    def __call__(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
                 q_nope: Optional[torch.Tensor], q_outs: Tuple[torch.Tensor, ...],
                 caches: Tuple[torch.Tensor, ...], geometry: MlaGeometry, pos_ids: torch.Tensor,
                 slots: torch.Tensor, cfg: RopeConfig, scales: Tuple[float, float],
                 allow_copy: bool = True) -> None:
        """Rotate q_pe at ``pos_ids[..., :T]`` and append ``ckv`` and k_pe to ``caches``.

        ``q_outs``: ``()`` (q_pe rotated in place) or the fp8 ``(q_pe_out[, q_nope_out])``;
        ``caches``, ``geometry`` and ``scales`` as :func:`check_call` returns them.
        """
        fp8_q = bool(q_outs)
        rewritten = [x.view(torch.uint8) for x in q_outs] if fp8_q else [q_pe]
        if geometry.quantized:
            caches = tuple(c.view(torch.uint8) for c in caches)
        num_outs, num_inplace = len(rewritten), len(rewritten) + len(caches)
        call = self._calls.get(num_inplace)
        if call is None:
            call = self._calls[num_inplace] = InPlace(
                _mla_and_append, num_inplace,
                static_argnames=("cfg", "backend", "fp8_q", "fp8_cache", "num_outs"))
        size = token_bucket(q_pe.shape[0]) if allow_copy else q_pe.shape[0]
        staged = [pad_tokens(x, size) for x in rewritten]
        reads = [None if x is None else read_only(pad_tokens(x, size, fill=fill), allow_copy)
                 for x, fill in ((q_pe if fp8_q else None, 0), (k_pe, 0), (ckv, 0), (q_nope, 0),
                                 (int32_slots(slots, geometry.num_slots), -1))]
        q_read, k_read, ckv_read, nope_read, slots_read = reads
        pos = read_only(pad_tokens(pos_ids, size, dim=-1), True)
        call([*staged, *caches], q_read, k_read, ckv_read, nope_read, pos, slots_read, scales,
             allow_copy=allow_copy, cfg=cfg, backend=self.backend, fp8_q=fp8_q,
             fp8_cache=geometry.quantized, num_outs=num_outs)
        for tensor, copy in zip(rewritten, staged):
            write_back(tensor, copy)


def call_signature(label: Hashable, q_pe: Any, k_pe: Any, ckv: Any, mla_cache: Any, slots: Any,
                   *optional: Any) -> Tuple[Any, ...]:
    """What the checks of a call depend on, apart from the plan: the key of a bound launch.
    ``optional``: q_nope, q_pe_out, q_nope_out (None or tensors), then the two scales.

    Raises AttributeError, TypeError or ValueError for arguments that are not tensors
    (or a pair of them) or not hashable; the caller then runs the full checks.
    """
    def tensor(x):
        return (x.shape, x.dtype, x.device, x.requires_grad)

    cache = (tensor(mla_cache) if isinstance(mla_cache, torch.Tensor)
             else tuple(tensor(c) for c in mla_cache))
    return (label, tensor(q_pe), tensor(k_pe), tensor(ckv), cache, tensor(slots),
            *(x if x is None or not isinstance(x, torch.Tensor) else tensor(x)
              for x in optional))


class MlaPaths:
    """The paths of ``apply_mla_and_append_kv``: ``fast``, the launcher's
    (:class:`torch_bridge.launch.dispatch.FastPath`: a launched call's signature is bound
    to the launcher's ``bind``), else :class:`JaxMlaAppend` (built at first use: JAX's GPU
    client is costly), never under CUDA-graph capture.
    """

    def __init__(self, launcher: Any, device: torch.device, backend: str):
        self.fast = FastPath("apply_mla_and_append_kv", launcher)
        self._device, self._backend = device, backend
        self._jax: Optional[JaxMlaAppend] = None

    def __call__(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
                 q_nope: Optional[torch.Tensor], q_outs: Tuple[torch.Tensor, ...],
                 caches: Tuple[torch.Tensor, ...], geometry: MlaGeometry, pos_ids: torch.Tensor,
                 slots: torch.Tensor, cfg: RopeConfig, scales: Tuple[float, float],
                 allow_copy: bool, signature: Optional[Callable[[], Hashable]] = None) -> None:
        """The checked call (:meth:`JaxMlaAppend.__call__`'s arguments) on the launcher,
        else on the JAX path; once launched, bound to ``signature()`` (None: a padded
        call, never bound).

        Raises:
          RuntimeError: the JAX path under CUDA-graph capture.
        """
        q_pe_out, q_nope_out = (*q_outs, None, None)[:2]
        outs = dict(q_nope=q_nope, q_pe_out=q_pe_out, q_nope_out=q_nope_out)

        def call(launcher) -> None:
            launcher.rotate_and_append_mla_(q_pe, k_pe, ckv, pos_ids, caches, slots, cfg, scales,
                                            **outs)

        if self.fast.launch(call, None if signature is None else lambda bind: bind(
                q_pe, k_pe, ckv, caches, slots, cfg, scales, **outs), signature):
            return
        self.fast.refuse_under_capture(self._device)
        if self._jax is None:
            self._jax = JaxMlaAppend(self._device, self._backend)
        self._jax(q_pe, k_pe, ckv, q_nope, q_outs, caches, geometry, pos_ids, slots, cfg, scales,
                  allow_copy=allow_copy)


# -- the method as a torch custom op ---------------------------------------------------------


@torch.library.custom_op("jaxrope::apply_mla_and_append_kv",
                         mutates_args=("q_pe", "ckv_cache", "kpe_cache", "q_pe_out", "q_nope_out"),
                         device_types=("cpu", "cuda"))
def _mla_op(q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: Optional[torch.Tensor], slots: torch.Tensor, q_nope: Optional[torch.Tensor],
            q_pe_out: Optional[torch.Tensor], q_nope_out: Optional[torch.Tensor], manager: str,
            label: str, q_quant_scale: Optional[float], kv_quant_scale: Optional[float]) -> None:
    mla_cache = ckv_cache if kpe_cache is None else (ckv_cache, kpe_cache)
    custom_ops.manager_of(manager).apply_mla_and_append_kv(
        q_pe, k_pe, ckv, label, mla_cache, slots, q_nope=q_nope, q_pe_out=q_pe_out,
        q_nope_out=q_nope_out, q_quant_scale=q_quant_scale, kv_quant_scale=kv_quant_scale)


@_mla_op.register_fake
def _(q_pe, k_pe, ckv, ckv_cache, kpe_cache, slots, q_nope, q_pe_out, q_nope_out, manager, label,
      q_quant_scale, kv_quant_scale):
    return None


def traced_apply_mla_and_append_kv(manager: Any, q_pe: torch.Tensor, k_pe: torch.Tensor,
                                   ckv: torch.Tensor, label: Hashable, mla_cache: Any,
                                   slots: torch.Tensor, q_nope: Optional[torch.Tensor],
                                   q_pe_out: Optional[torch.Tensor],
                                   q_nope_out: Optional[torch.Tensor], q_quant_scale: Any,
                                   kv_quant_scale: Any) -> Tuple[Any, ...]:
    """``manager.apply_mla_and_append_kv`` as ``torch.compile`` records it: the
    ``jaxrope::apply_mla_and_append_kv`` op (the cache a tensor or a pair).

    Raises:
      TypeError: ``label`` not a str, the cache neither a tensor nor a pair, a scale
        that is not a number.
      ValueError: a scale not finite and > 0 as a normal float32.
    """
    ckv_cache, kpe_cache = custom_ops.split_cache(mla_cache, "mla_cache",
                                                  ("ckv_cache", "kpe_cache"))
    scales = [None if value is None else kv_append._scale(name, value, True)
              for name, value in (("q_quant_scale", q_quant_scale),
                                  ("kv_quant_scale", kv_quant_scale))]
    torch.ops.jaxrope.apply_mla_and_append_kv(
        q_pe, k_pe, ckv, ckv_cache, kpe_cache, slots, q_nope, q_pe_out, q_nope_out,
        manager._op_key, custom_ops._op_label(label), *scales)
    return outputs(q_pe, q_nope, q_pe_out, q_nope_out, mla_cache)


def outputs(q_pe: torch.Tensor, q_nope: Optional[torch.Tensor], q_pe_out: Optional[torch.Tensor],
            q_nope_out: Optional[torch.Tensor], mla_cache: Any) -> Tuple[Any, ...]:
    """What the method returns: ``(q_pe, q_nope, mla_cache)``, with the fp8 outputs in
    place of q_pe and q_nope when given."""
    if q_pe_out is None:
        return q_pe, q_nope, mla_cache
    return q_pe_out, q_nope_out, mla_cache
