"""How ``RopeManager.apply_qk_and_append_kv`` checks an engine's paged cache and runs the JAX path.

The manager's method rotates q in place and writes the rotated k and the v into the
engine's paged KV cache at its slot mapping, with :func:`jaxrope.apply_rope_and_append_kv`'s
semantics (slots, layouts, fp8 scales: see :mod:`jaxrope.ops.rope_append_kv.api`). This module holds
what the method needs beyond ``apply_qk``'s checks of q and k:

- :func:`check_call`: v, the cache (a ``(k_cache, v_cache)`` pair or one ``[pages, 2,
  ...]`` tensor, its layout, heads, head size, dtype and device), the slots and the fp8
  scales, checked from their static properties once per call signature; it returns the
  :class:`CacheGeometry` both paths address the cache by;
- :func:`check_q_out`: the fp8 q a call may ask for (``q_out``, ``q_quant_scale``);
  :func:`check_norm`: its QK-norm (the weights and ``qk_norm``);
- :func:`launcher_call`: a checked call as a launcher takes it (the norm and the fp8 q
  only where the launcher declares them);
- slots as the kernels read them, the range decided at their own width on the device,
  come from :func:`torch_bridge.launch.runtime.int32_slots` (shared with the launchers);
- :class:`JaxAppend`: the JAX path, the core op on DLPack imports with q and the cache
  rewritten in place (:class:`torch_bridge.dlpack.InPlace`);
- :func:`call_signature`: what the checks depend on, the key of a bound launch.

Slot values live on the device and are not checked (that would wait for the device):
as under ``jax.jit`` in the core, a slot outside ``[0, pages * page_size)`` writes
nothing, at any integer width (int64 ``2**32 + 5`` is skipped, never slot 5), and of two
tokens naming one slot either may win.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import torch

from jaxrope.ops import backends as _backend
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from jaxrope.ops.rope_append_kv.api import LAYOUTS, apply_rope_and_append_kv
from jaxrope.ops.rope_append_kv import cache_layout
from jaxrope.numbers import check_float32_positive
from jaxrope.qk_norm import QKNorm, norm_asked
from torch_bridge.dlpack import InPlace, pad_tokens, read_only, token_bucket, write_back
from torch_bridge.launch.runtime import int32_slots
from torch_bridge.memory_overlap import share_memory
from torch_bridge.rotate import torch_capability

__all__ = ["CacheGeometry", "JaxAppend", "call_signature", "check_call", "check_q_out",
           "check_slot_tensor", "jax_backend"]

FP8 = torch.float8_e4m3fn
SLOT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16,
               torch.uint32, torch.uint64)


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """An engine's paged cache as the kernels address it: hashable, fixed per engine.

    Attributes:
      layout: "NHD" or "HND".
      combined: one ``[pages, 2, ...]`` tensor (keys at ``[:, 0]``, values at ``[:, 1]``)
        rather than a ``(k_cache, v_cache)`` pair.
      view_shape: the canonical 4-D view of :mod:`jaxrope.ops.rope_append_kv.api`: NHD ``[pages *
        components, page_size, Hk, D]``, HND ``[pages * components, Hk, page_size, D]``
        (a combined cache's page ``p`` holds keys at view page ``2p``, values at ``2p + 1``).
      dtype: the cache's dtype: k's, or ``torch.float8_e4m3fn``.

    Example:
      >>> g = CacheGeometry("HND", True, (8, 2, 16, 64), torch.bfloat16)
      >>> g.components, g.page_size, g.k_heads, g.num_slots, g.quantized
      (2, 16, 2, 64, False)
    """

    layout: str
    combined: bool
    view_shape: Tuple[int, int, int, int]
    dtype: torch.dtype

    @property
    def components(self) -> int:
        """2 for a combined cache (keys and values in one tensor), else 1."""
        return 2 if self.combined else 1

    @property
    def page_size(self) -> int:
        """Entries (tokens) a page holds."""
        return self.view_shape[1] if self.layout == "NHD" else self.view_shape[2]

    @property
    def k_heads(self) -> int:
        """``Hk``: heads of a cache row."""
        return self.view_shape[2] if self.layout == "NHD" else self.view_shape[1]

    @property
    def num_slots(self) -> int:
        """``pages * page_size``: the valid slots are ``[0, num_slots)``."""
        return self.view_shape[0] // self.components * self.page_size

    @property
    def quantized(self) -> bool:
        """An fp8 e4m3 cache (scaled and saturated on the way in)."""
        return self.dtype == FP8


def _check_tensor(name: str, x: torch.Tensor, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} (the manager's device)")
    if x.requires_grad:
        raise ValueError(f"{name}.requires_grad=True: the cache is written in place; run under "
                         "torch.no_grad() on tensors autograd does not track")


def _caches(kv_cache: Any, layout: str, k: torch.Tensor,
            device: torch.device) -> Tuple[Tuple[torch.Tensor, ...], CacheGeometry]:
    if isinstance(kv_cache, (tuple, list)):
        kinds = [type(c).__name__ for c in kv_cache]
        if len(kv_cache) != 2 or not all(isinstance(c, torch.Tensor) for c in kv_cache):
            raise TypeError(f"kv_cache must be a (k_cache, v_cache) pair of tensors or one tensor, "
                            f"got a {type(kv_cache).__name__} of {kinds}")
        k_cache, v_cache = kv_cache
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            _check_tensor(name, c, device)
        cache_layout.check_pair(k_cache, v_cache, layout)
        if share_memory(k_cache, v_cache):
            raise ValueError("kv_cache's k_cache and v_cache share memory (one tensor twice, or "
                             "overlapping views): the values would overwrite the rotated keys; "
                             "pass two separate tensors or one [pages, 2, ...] tensor")
        caches, combined, name = (k_cache, v_cache), False, "k_cache"
        view = tuple(k_cache.shape)
    elif isinstance(kv_cache, torch.Tensor):
        _check_tensor("kv_cache", kv_cache, device)
        if kv_cache.ndim != 5 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache.shape={tuple(kv_cache.shape)} must be "
                             f"{cache_layout.layout_text(layout, True)} "
                             "(or pass a (k_cache, v_cache) pair)")
        caches, combined, name = (kv_cache,), True, "kv_cache"
        view = (2 * kv_cache.shape[0], *kv_cache.shape[2:])
    else:
        raise TypeError(f"kv_cache must be a (k_cache, v_cache) pair of tensors or one tensor, "
                        f"got {type(kv_cache).__name__}")
    geometry = CacheGeometry(layout, combined, view, caches[0].dtype)
    if geometry.k_heads != k.shape[1] or view[3] != k.shape[2]:
        raise ValueError(f"{name}.shape={tuple(caches[0].shape)} must be "
                         f"{cache_layout.layout_text(layout, combined)} with Hk={k.shape[1]} and "
                         f"D={k.shape[2]} (k's heads and head_dim)")
    if geometry.dtype not in (k.dtype, FP8):
        raise ValueError(f"{name}.dtype={geometry.dtype} must be k's dtype ({k.dtype}) or "
                         f"{FP8}")
    if geometry.num_slots >= 2 ** 31:
        raise ValueError(f"the cache has {geometry.num_slots} slots; slots are int32, at most "
                         "2**31 - 1")
    return caches, geometry


# What each scale applies to, for the refusal of one given without it.
_CACHE_ONLY = "a float8_e4m3fn cache; leave it None for a cache in k's dtype"
_Q_OUT_ONLY = "q_out (a float8_e4m3fn tensor); leave it None when q is rotated in place"


def _scale(name: str, value: Any, quantized: bool, applies_to: str = _CACHE_ONLY) -> float:
    if not quantized:
        if value is not None:
            raise ValueError(f"{name}={value!r} applies only to {applies_to}")
        return 1.0
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float (fp8 stores x * {name}, FlashInfer's "
                        f"quant_scale_q / quant_scale_kv), got {type(value).__name__}")
    number = float(value)
    check_float32_positive(name, number)
    return number


def check_call(k: torch.Tensor, v: torch.Tensor, kv_cache: Any, slots: Any, layout: Any,
               k_quant_scale: Any, v_quant_scale: Any,
               device: torch.device) -> Tuple[Tuple[torch.Tensor, ...], CacheGeometry,
                                              Tuple[float, float]]:
    """Check what ``apply_qk_and_append_kv`` takes beyond q and k; nothing is changed.

    ``k`` and ``v`` are the checked ``[T, Hk, D]`` views (v checked as k by the manager:
    a tensor on the device, a float dtype, no grad).

    Returns:
      ``(caches, geometry, scales)``: the cache tensors as given (the pair, or the
      combined tensor alone), their :class:`CacheGeometry`, and ``(k_scale, v_scale)``
      as floats (1.0 where not given, and for a cache in k's dtype).

    Raises:
      TypeError: the cache is neither a pair of tensors nor a tensor, slots are not a
        tensor, or a scale is not a number.
      ValueError: v unlike k; an unknown layout; a cache of the wrong rank, heads, head
        size, dtype or device, or requiring grad; a ``(k_cache, v_cache)`` pair sharing
        memory (:func:`torch_bridge.memory_overlap.share_memory`); slots of the wrong shape, dtype or device; a
        scale given for a cache in k's dtype, or not finite and > 0.
    """
    if v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(f"v ({tuple(v.shape)}, {v.dtype}) must match k ({tuple(k.shape)}, "
                         f"{k.dtype})")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")
    caches, geometry = _caches(kv_cache, layout, k, device)
    check_slot_tensor(slots, k.shape[0], device)
    scales = (_scale("k_quant_scale", k_quant_scale, geometry.quantized),
              _scale("v_quant_scale", v_quant_scale, geometry.quantized))
    return caches, geometry, scales


def check_slot_tensor(slots: Any, tokens: int, device: torch.device) -> None:
    """Slots' static properties, for every fused append: an integer tensor ``[T]`` on
    ``device`` (its values are checked where they live: see the module docstring).

    Raises:
      TypeError: not a tensor.
      ValueError: another device, a non-integer dtype, or a shape other than ``[T]``.
    """
    if not isinstance(slots, torch.Tensor):
        raise TypeError(f"slots must be an integer torch.Tensor [T] (vLLM's slot_mapping, int64), "
                        f"got {type(slots).__name__}")
    if slots.device != device:
        raise ValueError(f"slots is on {slots.device}, expected {device} (the manager's device)")
    if slots.dtype not in SLOT_DTYPES:
        raise ValueError(f"slots.dtype={slots.dtype} must be an integer dtype (vLLM passes "
                         f"torch.int64)")
    if tuple(slots.shape) != (tokens,):
        raise ValueError(f"slots.shape={tuple(slots.shape)} must be [T] with T={tokens}")


def check_q_out(q: torch.Tensor, q3: torch.Tensor, q_out: Any, q_quant_scale: Any,
                device: torch.device, owner: str = "the manager's device"
                ) -> Tuple[Optional[torch.Tensor], float]:
    """The fp8 q of a call: ``(q_out as [T, Hq, D], q_scale)``, or ``(None, 1.0)`` without one.

    ``q`` is the tensor given, ``q3`` its ``[T, Hq, D]`` view; ``q_out`` must be a
    ``torch.float8_e4m3fn`` tensor of q's shape on ``device`` (FlashInfer's
    ``q_rope_out``), ``q_quant_scale`` a float (default 1), given only with ``q_out``.

    Raises:
      TypeError: ``q_out`` not a tensor, or the scale not a number.
      ValueError: ``q_out`` of another dtype, shape or device; a scale without
        ``q_out``, or not finite and > 0.

    Example:
      >>> q = torch.ones(3, 2 * 8)
      >>> q_out, scale = check_q_out(q, q.view(3, 2, 8), torch.empty(3, 16, dtype=FP8), 0.5,
      ...                            q.device)
      >>> tuple(q_out.shape), scale
      ((3, 2, 8), 0.5)
    """
    scale = _scale("q_quant_scale", q_quant_scale, q_out is not None, _Q_OUT_ONLY)
    if q_out is None:
        return None, scale
    if not isinstance(q_out, torch.Tensor):
        raise TypeError(f"q_out must be a torch.float8_e4m3fn tensor shaped like q, got "
                        f"{type(q_out).__name__}")
    if q_out.dtype != FP8:
        raise ValueError(f"q_out.dtype={q_out.dtype} must be {FP8} (the fp8 q is written there)")
    if q_out.shape != q.shape:
        raise ValueError(f"q_out.shape={tuple(q_out.shape)} must be q's shape {tuple(q.shape)}")
    if q_out.device != device:
        raise ValueError(f"q_out is on {q_out.device}, expected {device} ({owner})")
    try:
        return q_out.view(q3.shape), scale
    except RuntimeError as e:
        raise ValueError(f"q_out.shape={tuple(q_out.shape)} with stride={q_out.stride()} cannot "
                         f"be viewed as {list(q3.shape)}: {e}") from e


def call_signature(label: Hashable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   kv_cache: Any, slots: torch.Tensor, layout: Any, k_quant_scale: Any,
                   v_quant_scale: Any) -> Tuple[Any, ...]:
    """What the checks of a call depend on, apart from the plan: the key of a bound launch.

    Raises AttributeError, TypeError or ValueError for arguments that are not tensors
    (or a pair of them) or not hashable; the caller then runs the full checks.
    """
    if isinstance(kv_cache, torch.Tensor):
        cache = (kv_cache.shape, kv_cache.dtype, kv_cache.device, kv_cache.requires_grad)
    else:
        k_cache, v_cache = kv_cache
        cache = (k_cache.shape, k_cache.dtype, k_cache.device, k_cache.requires_grad,
                 v_cache.shape, v_cache.dtype, v_cache.device, v_cache.requires_grad)
    return (label, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device,
            v.device, q.requires_grad, k.requires_grad, v.requires_grad, cache, slots.shape,
            slots.dtype, slots.device, layout, k_quant_scale, v_quant_scale)


# The weight dtypes the JAX path imports (jaxrope.qk_norm.WEIGHT_DTYPES, in torch's names).
NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
Norm = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], QKNorm]


def check_weight_type(name: str, weight: Any) -> None:
    """Refuse a norm weight (named ``name``) that is neither None nor a tensor.

    Raises:
      TypeError: ``weight`` is not a torch.Tensor.
    """
    if weight is not None and not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")


def check_norm(q: torch.Tensor, k: torch.Tensor, q_norm_weight: Any, k_norm_weight: Any,
               qk_norm: Any, device: torch.device,
               owner: str = "the manager's device") -> Optional[Norm]:
    """A call's QK-norm, checked by the core's rule (:func:`jaxrope.qk_norm.norm_asked`) on
    ``[T, H, D]`` q and k: None when none is asked, else ``(q_norm_weight, k_norm_weight,
    qk_norm)`` with the weights detached (a model's ``nn.Parameter`` is only read).

    Raises:
      TypeError: a weight that is not a tensor, ``qk_norm`` not a :class:`jaxrope.QKNorm`.
      ValueError: a weight of the wrong shape, dtype or device; a weight without
        ``qk_norm`` or ``qk_norm`` without one.
    """
    stand_ins = []
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_weight_type(name, weight)
        if weight is None:
            stand_ins.append(None)
            continue
        if weight.dtype not in NORM_DTYPES:
            raise ValueError(f"{name}.dtype={weight.dtype} must be one of {NORM_DTYPES}")
        if weight.device != device:
            raise ValueError(f"{name} is on {weight.device}, expected {device} ({owner})")
        stand_ins.append(jax.ShapeDtypeStruct(tuple(weight.shape), jnp.float32))
    if not norm_asked(q, k, *stand_ins, qk_norm):
        return None
    return (None if q_norm_weight is None else q_norm_weight.detach(),
            None if k_norm_weight is None else k_norm_weight.detach(), qk_norm)


def launcher_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                  caches: Sequence[torch.Tensor], slots: torch.Tensor, cfg: RopeConfig,
                  geometry: CacheGeometry, scales: Tuple[float, float],
                  norm: Optional[Norm] = None, q_out: Optional[torch.Tensor] = None,
                  q_scale: float = 1.0) -> Callable[[Any], None]:
    """A checked call as :meth:`torch_bridge.launch.dispatch.FastPath.launch` runs it on a
    launcher: ``launcher.rotate_and_append_kv_(...)``, the norm and the fp8 q passed only
    to a launcher that declares them (``accepts``: :class:`torch_bridge.KVLauncher`), the
    q scale then third in ``scales``; any other launcher declines such a call
    (:class:`jaxrope.BackendUnavailable`) and the JAX path serves it."""
    extras = {name: value for name, value in (("norm", norm), ("q_out", q_out))
              if value is not None}
    if q_out is not None:
        scales = (*scales, q_scale)

    def call(launcher: Any) -> None:
        if not set(extras) <= getattr(launcher, "accepts", frozenset()):
            raise BackendUnavailable(f"the launcher takes no {sorted(extras)}")
        launcher.rotate_and_append_kv_(q, k, v, pos_ids, caches, slots, cfg, geometry, scales,
                                       **extras)
    return call


def _rope_and_append(target, *rest, cfg: RopeConfig, layout: str, backend: str, fp8: bool,
                     qk_norm: Optional[QKNorm] = None):
    # target: q, rotated in place; or, with an fp8 q, the q_out buffer (uint8, overwritten
    # whole). rest: the caches (rewritten in place), then q (None: it is the target), k, v,
    # pos_ids, slots, the cache scales, q's scale (None: q keeps its dtype) and the norm
    # weights (None without a norm).
    caches, (q, k, v, pos_ids, slots, scales, q_scale, q_w, k_w) = rest[:-9], rest[-9:]
    # fp8 arrays cross DLPack as uint8 (its float8 support varies across torch versions).
    if fp8:
        caches = [jax.lax.bitcast_convert_type(c, jnp.float8_e4m3fn) for c in caches]
    k_scale, v_scale = scales if fp8 else (None, None)
    q_dtype = None if q_scale is None else jnp.float8_e4m3fn
    q, kv_cache = apply_rope_and_append_kv(
        target if q_scale is None else q, k, v, pos_ids,
        caches[0] if len(caches) == 1 else tuple(caches), slots, cfg, layout=layout,
        k_quant_scale=k_scale, v_quant_scale=v_scale, q_norm_weight=q_w, k_norm_weight=k_w,
        qk_norm=qk_norm, q_dtype=q_dtype, q_quant_scale=q_scale, backend=backend)
    out = jax.tree.leaves(kv_cache)
    if fp8:
        out = [jax.lax.bitcast_convert_type(c, jnp.uint8) for c in out]
    if q_dtype is not None:
        q = jax.lax.bitcast_convert_type(q, jnp.uint8)
    return (q, *out)


def jax_backend(backend: str, device: torch.device, op: str) -> str:
    """The backend a JAX path passes to the core op ``op``: "auto" where it means a kernel
    (the core keeps its fall-through to XLA), else the one
    :func:`jaxrope.ops.backends.backend_name` picks for ``device``. Inside the jitted call
    the core sees tracers, so an "auto" that means XLA is decided here.

    Raises:
      ValueError, BackendUnavailable: as :func:`jaxrope.ops.backends.backend_name`.
    """
    chosen = _backend.backend_name(backend, device.type, op, torch_capability(device))
    return "auto" if backend == "auto" and chosen != "xla" else chosen


class JaxAppend:
    """The JAX path: :func:`jaxrope.apply_rope_and_append_kv` on DLPack imports, in place.

    q and the cache tensors are imported and donated, so XLA writes into them where the
    runtime aliases imported buffers (on the GPU) and :class:`~torch_bridge.dlpack.InPlace`
    copies the results back where it does not (on CPU, the whole cache every call). k, v
    and the slots are only read. Stream-ordered as every DLPack exchange of
    :mod:`torch_bridge.dlpack`: after torch's current stream, before what is queued next.

    The jitted call sees ``T`` rounded up to a token bucket
    (:func:`torch_bridge.dlpack.token_bucket`), so it compiles once per bucket and cache
    signature: q, k, v and the slots are staged into bucket-sized copies, the padding
    tokens at position 0 and slot -1 (never written), and only q's first ``T`` rows are
    written back. With ``allow_copy=False`` nothing is staged (one compile per token count).

    Args:
      device: the torch device of the tensors.
      backend: the jaxrope backend; "auto" follows :func:`jaxrope.ops.backends.backend_name`'s
        rule for ``device`` (inside the jitted call the core sees tracers, so an "auto"
        that means XLA is decided here; on a GPU "auto" goes through, keeping the core's
        fallback for a cache its kernel declines).

    Example:
      >>> import jaxrope as jr
      >>> append = JaxAppend(torch.device("cpu"))
      >>> q, k, v = torch.ones(2, 2, 8), torch.ones(2, 1, 8), torch.full((2, 1, 8), 3.0)
      >>> cache = torch.zeros(4, 2, 4, 1, 8)            # 4 pages of 4, keys and values
      >>> slots = torch.tensor([6, -1])                   # page 1 entry 2; padding
      >>> _, geometry, scales = check_call(k, v, cache, slots, "NHD", None, None, q.device)
      >>> append(q, k, v, (cache,), geometry, torch.arange(2, dtype=torch.int32), slots,
      ...        jr.RopeConfig(head_dim=8), scales)
      >>> cache[1, 1, 2, 0].tolist(), float(cache.abs().sum())   # v written once, nothing else
      ([3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0], 32.0)
    """

    def __init__(self, device: torch.device, backend: str = "auto"):
        self.backend = jax_backend(backend, device, "rope_append_kv")
        self._calls: Dict[int, InPlace] = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 caches: Sequence[torch.Tensor], geometry: CacheGeometry, pos_ids: torch.Tensor,
                 slots: torch.Tensor, cfg: RopeConfig, scales: Tuple[float, float],
                 allow_copy: bool = True, norm: Optional[Norm] = None,
                 q_out: Optional[torch.Tensor] = None, q_scale: float = 1.0) -> None:
        """Rotate ``q [T, Hq, D]`` in place at ``pos_ids[..., :T]`` and write k, v into ``caches``.

        ``pos_ids`` int32 ``[N >= T]``, or ``[3, N]`` for an M-RoPE ``cfg``, on q's device.

        ``caches``, ``geometry`` and ``scales`` as :func:`check_call` returns them;
        ``norm`` as :func:`check_norm` returns it (q and k normalised before the rotation);
        ``q_out`` and ``q_scale`` as :func:`check_q_out` returns them: with a
        ``q_out``, the fp8 q is written there and q is only read.
        """
        if geometry.quantized:
            caches = [c.view(torch.uint8) for c in caches]
        call = self._calls.get(len(caches))
        if call is None:
            call = self._calls[len(caches)] = InPlace(
                _rope_and_append, 1 + len(caches),
                static_argnames=("cfg", "layout", "backend", "fp8", "qk_norm"))
        size = token_bucket(q.shape[0]) if allow_copy else q.shape[0]
        # The tensor written: q in place, or the fp8 q_out (q then only read).
        target = q if q_out is None else q_out.view(torch.uint8)
        staged = pad_tokens(target, size)
        q_read = None if q_out is None else read_only(pad_tokens(q, size), allow_copy)
        k, v, slots = (read_only(pad_tokens(x, size, fill=fill), allow_copy)
                       for x, fill in ((k, 0), (v, 0),
                                       (int32_slots(slots, geometry.num_slots), -1)))
        q_w, k_w, qk_norm = norm or (None, None, None)
        weights = [None if w is None else read_only(w, True) for w in (q_w, k_w)]
        # Scales and norm weights are traced arguments (one compile serves every layer's).
        call([staged, *caches], q_read, k, v, read_only(pad_tokens(pos_ids, size, dim=-1), True),
             slots, scales if geometry.quantized else None, None if q_out is None else q_scale,
             *weights, allow_copy=allow_copy, cfg=cfg, layout=geometry.layout,
             backend=self.backend, fp8=geometry.quantized, qk_norm=qk_norm)
        write_back(target, staged)
