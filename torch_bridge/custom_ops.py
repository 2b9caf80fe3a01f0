"""The bridge's rotations as torch custom ops: what ``torch.compile`` records for them.

The ops of the ``jaxrope`` library, each writing its first tensor arguments in place
and returning nothing, so their fake (meta) implementations are empty and any token
count ``T`` traces as a symbol:

==========================================  =============================================
``jaxrope::rope_(q!, k!, pos_ids, config)``  rotate at explicit positions (:func:`rope_`,
                                             the vLLM-shaped layer's op)
``jaxrope::rope_append_kv_(...)``            the fused RoPE + paged KV append at explicit
                                             positions (:func:`rope_append_kv_`)
``jaxrope::apply_qk(q!, k!, manager, ...)``  :meth:`RopeManager.apply_qk` at the planned
                                             positions of ``label``
``jaxrope::apply_qk_and_append_kv(...)``     :meth:`RopeManager.apply_qk_and_append_kv`
                                             (q rotated, ``k_cache!``, ``v_cache!``;
                                             an fp8 q into ``q_out!``)
``jaxrope::apply_mla_and_append_kv(...)``    :meth:`RopeManager.apply_mla_and_append_kv`
                                             (defined in :mod:`torch_bridge.mla_append`)
==========================================  =============================================

Every op runs on CPU (the JAX path through DLPack) and CUDA (the Mosaic GPU or
Triton-lowered launch on torch's current stream, the JAX path where the launcher
declines); M-RoPE needs no op of its own (an M-RoPE config reads ``[3, T]`` positions).

**One rule for Python objects.** An op's schema takes tensors, numbers and strings, so
a :class:`jaxrope.RopeConfig` or a manager reaches an op as a string key of this
module's registry: :func:`config_key` (the config's fingerprint, equal for equal
configs) and :func:`manager_key` (given to each manager at construction, held weakly).

**Eager calls keep the direct path.** A custom op's dispatch alone, with an empty
body, costs more than the whole bound launch of ``apply_qk`` at decode sizes
(bench/RESULTS.md), so the manager's methods and
:class:`torch_bridge.rotary_layer.RotaryEmbedding` call the op only while
``torch.compiler.is_compiling()`` (a flag read) and run the same implementation
directly otherwise: compiled and eager calls share every check and launch.

**Refusals.** The ops' implementations are the methods' (``apply_qk``,
``apply_qk_and_append_kv``) or share their checks (:func:`check_qk`), so bad input
gets the same error through an op, compiled or not, and leaves every tensor untouched.

**CUDA graphs** (``mode="reduce-overhead"``): the launchers are capturable once a
signature has run outside capture; q, k and v that a launcher cannot take as they are
(non-contiguous views of a fused qkv buffer, misaligned) are staged through
contiguous copies on the stream and written back, which a capture records, where the
JAX path (not capturable) would otherwise run.

Example:
  >>> import jaxrope as jr
  >>> key = config_key(jr.RopeConfig(head_dim=8))
  >>> q, k = torch.ones(2, 2, 8), torch.ones(2, 1, 8)
  >>> torch.ops.jaxrope.rope_(q, k, torch.tensor([0, 5]), key)  # what a compiled graph calls
  >>> bool((q[0] == 1).all()), bool((q[1] != 1).any())
  (True, True)
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

from jaxrope.ops.rope.api import _check_pos_shape
from jaxrope.ops.rope_append_kv.api import check_slots
from jaxrope.config import RopeConfig
from torch_bridge import kv_append
from torch_bridge.dlpack import jax_device
from torch_bridge.launch.dispatch import FastPath, resolve_launchers
from torch_bridge.rotate import LLAMA31_PARAMS, TORCH_DTYPES, JaxRotation

__all__ = ["check_heads", "check_qk", "config_key", "config_of", "manager_key", "manager_of",
           "rope_", "rope_append_kv_", "split_cache", "traced_apply_qk",
           "traced_apply_qk_and_append_kv"]

# The launchers' alignment (torch_bridge.launch.runtime.ALIGN): a CUDA tensor is staged
# when it is not contiguous or its address is not a multiple of this.
_ALIGN = 32

_CONFIGS: Dict[str, RopeConfig] = {}
_MANAGERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_MANAGER_IDS = itertools.count()


def config_key(cfg: RopeConfig) -> str:
    """The string ``jaxrope::rope_`` takes for ``cfg``: its fingerprint in hex (equal
    configs share one key), registered here.

    Raises:
      TypeError: ``cfg`` is not a RopeConfig.

    Example:
      >>> import jaxrope as jr
      >>> key = config_key(jr.RopeConfig(head_dim=64))
      >>> config_of(key) == jr.RopeConfig(head_dim=64), len(key)
      (True, 64)
    """
    if not isinstance(cfg, RopeConfig):
        raise TypeError(f"cfg must be a RopeConfig, got {type(cfg).__name__}")
    key = cfg.fingerprint().hex()
    _CONFIGS.setdefault(key, cfg)
    return key


def config_of(key: str) -> RopeConfig:
    """The config registered under ``key``.

    Raises:
      ValueError: no config has this key.
    """
    cfg = _CONFIGS.get(key)
    if cfg is None:
        raise ValueError(f"config={key!r} is not a registered RopeConfig key; make one with "
                         "torch_bridge.custom_ops.config_key(cfg)")
    return cfg


def manager_key(manager: Any) -> str:
    """A new key for ``manager``, held weakly (the op of a dropped manager refuses)."""
    key = f"{type(manager).__name__}-{next(_MANAGER_IDS)}"
    _MANAGERS[key] = manager
    return key


def manager_of(key: str) -> Any:
    """The manager registered under ``key``.

    Raises:
      ValueError: no live manager has this key.
    """
    manager = _MANAGERS.get(key)
    if manager is None:
        raise ValueError(f"manager={key!r} names no live RopeManager")
    return manager


# -- checks shared with RopeManager ------------------------------------------------------


def check_heads(x: Any, name: str, head_dim: int, device: torch.device,
                owner: str = "the manager's device") -> torch.Tensor:
    """``x`` as ``[T, H, head_dim]`` (a view of ``[T, H * head_dim]``), checked.

    Raises:
      TypeError: ``x`` is not a tensor.
      ValueError: another device, an unsupported dtype, requires grad, or a shape that
        is not ``[T, H, D]`` or ``[T, H * D]`` (or that cannot be viewed so).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, expected {device} ({owner})")
    if x.dtype not in TORCH_DTYPES:
        raise ValueError(f"{name}.dtype={x.dtype} must be one of {list(TORCH_DTYPES)}")
    if x.requires_grad:
        raise ValueError(f"{name}.requires_grad=True: apply_qk rotates in place; run under "
                         "torch.no_grad() on tensors autograd does not track")
    if x.ndim == 2:
        if x.shape[1] % head_dim:
            raise ValueError(f"{name}.shape={tuple(x.shape)}: {x.shape[1]} is not a multiple of "
                             f"{head_dim=}")
        try:
            return x.view(x.shape[0], x.shape[1] // head_dim, head_dim)
        except RuntimeError as e:
            raise ValueError(f"{name}.shape={tuple(x.shape)} with stride={x.stride()} cannot be "
                             f"viewed as [T, H, {head_dim}]: {e}") from e
    if x.ndim != 3 or x.shape[2] != head_dim:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [T, H, {head_dim}] or "
                         f"[T, H * {head_dim}]")
    return x


def check_qk(q: Any, k: Any, head_dim: int, device: torch.device,
             owner: str = "the manager's device",
             names: Tuple[str, str] = ("q", "k")) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[T, H, D]`` views of q and k (:func:`check_heads`), one dtype and one ``T``;
    ``names`` name them in errors (MLA's "q_pe", "k_pe").

    Raises:
      TypeError, ValueError: as :func:`check_heads`; k's dtype or token count unlike q's.
    """
    qn, kn = names
    q3, k3 = check_heads(q, qn, head_dim, device, owner), check_heads(k, kn, head_dim, device,
                                                                       owner)
    if q.dtype != k.dtype:
        raise ValueError(f"{kn}.dtype={k.dtype} must equal {qn}.dtype={q.dtype}")
    if k3.shape[0] != q3.shape[0]:
        raise ValueError(f"{kn}.shape[0]={k3.shape[0]} must equal {qn}.shape[0]={q3.shape[0]} "
                         "(tokens)")
    return q3, k3


def _check_positions(pos_ids: Any, tokens: int, cfg: RopeConfig,
                     device: torch.device) -> torch.Tensor:
    """``pos_ids`` as the launches read them: int32, contiguous, ``[T]`` (``[3, T]``)."""
    if not isinstance(pos_ids, torch.Tensor):
        raise TypeError(f"pos_ids must be an integer torch.Tensor, got {type(pos_ids).__name__}")
    if pos_ids.device != device:
        raise ValueError(f"pos_ids is on {pos_ids.device}, expected {device} (q's device)")
    if pos_ids.dtype.is_floating_point or pos_ids.dtype.is_complex or pos_ids.dtype == torch.bool:
        raise ValueError(f"pos_ids.dtype={pos_ids.dtype} must be an integer type (int32)")
    _check_pos_shape(tuple(pos_ids.shape), tokens, cfg)
    return pos_ids.to(torch.int32).contiguous()


# -- running: launcher, staging, JAX -------------------------------------------------------


class _Runtime:
    """One device's launchers (``resolve_launchers("auto")``) and JAX path, built once."""

    def __init__(self, device: torch.device):
        self.device = device
        rope, kv = resolve_launchers("auto", device)
        self.rope = FastPath("jaxrope::rope_", rope)
        self.kv = FastPath("jaxrope::rope_append_kv_", kv)
        self._jax: Optional[JaxRotation] = None
        self._kv_jax: Optional[kv_append.JaxAppend] = None

    def rotate(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
               cfg: RopeConfig) -> None:
        if self.rope.launch(lambda launcher: launcher.rotate_(q, k, pos_ids, cfg), None,
                            lambda: None):
            return
        self.rope.refuse_under_capture(self.device)
        if self._jax is None:
            self._jax = JaxRotation(jax_device(self.device))
        self._jax(q, k, pos_ids, cfg)

    def append(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
               caches: Tuple[torch.Tensor, ...], slots: torch.Tensor, cfg: RopeConfig,
               geometry: kv_append.CacheGeometry, scales: Tuple[float, float],
               q_out: Optional[torch.Tensor], q_scale: float) -> None:
        # The launchers have no fp8 q: a call with q_out takes the JAX path.
        if q_out is None and self.kv.launch(lambda launcher: launcher.rotate_and_append_kv_(
                q, k, v, pos_ids, caches, slots, cfg, geometry, scales), None, lambda: None):
            return
        self.kv.refuse_under_capture(self.device)
        if self._kv_jax is None:
            self._kv_jax = kv_append.JaxAppend(self.device)
        self._kv_jax(q, k, v, caches, geometry, pos_ids, slots, cfg, scales, q_out=q_out,
                     q_scale=q_scale)


_RUNTIMES: Dict[torch.device, _Runtime] = {}


def _runtime(device: torch.device) -> _Runtime:
    runtime = _RUNTIMES.get(device)
    if runtime is None:
        runtime = _RUNTIMES[device] = _Runtime(device)
    return runtime


def _launchable(x: torch.Tensor) -> bool:
    return x.is_contiguous() and x.data_ptr() % _ALIGN == 0


def _staged(tensors: Sequence[torch.Tensor], written: Sequence[bool],
            run: Callable[..., None]) -> None:
    """``run(*tensors)``; on CUDA through contiguous copies of the tensors a launcher
    cannot take as they are, the ``written`` ones copied back after (stream-ordered,
    capturable). On CPU the JAX path stages what it needs itself."""
    if not tensors[0].is_cuda or all(_launchable(x) for x in tensors):
        run(*tensors)
        return
    staged = [x if _launchable(x) else x.clone(memory_format=torch.contiguous_format)
              for x in tensors]
    run(*staged)
    for x, copy, write in zip(tensors, staged, written):
        if write and copy is not x:
            x.copy_(copy)


def _rotate_explicit(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                     config: str) -> None:
    cfg = config_of(config)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    q3, k3 = check_qk(q, k, cfg.head_dim, q.device, "q's device")
    pos = _check_positions(pos_ids, q3.shape[0], cfg, q.device)
    if q3.shape[0]:
        runtime = _runtime(q.device)
        _staged((q3, k3), (True, True), lambda a, b: runtime.rotate(a, b, pos, cfg))


@torch.library.custom_op("jaxrope::rope_", mutates_args=("q", "k"), device_types=("cpu", "cuda"))
def _rope_op(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, config: str) -> None:
    _rotate_explicit(q, k, pos_ids, config)


@_rope_op.register_fake
def _(q, k, pos_ids, config):
    return None


def rope_(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, config: str) -> None:
    """Rotate ``q [T, Hq, D]`` (or ``[T, Hq * D]``) and ``k`` in place at ``pos_ids``.

    ``pos_ids``: integer ``[T]`` (``[3, T]`` for an M-RoPE config), on q's device,
    narrowed to int32 on the device; their values are not checked (that would wait for
    the device) and outside ``[0, cfg.max_position)`` the rotation is unspecified.
    ``config``: :func:`config_key` of the :class:`jaxrope.RopeConfig`. q and k may be
    non-contiguous views (of a fused qkv buffer); under ``torch.compile`` this is the
    ``jaxrope::rope_`` op, else the same implementation called directly.

    Raises:
      TypeError: q, k or pos_ids not a tensor.
      ValueError: an unknown ``config``; q, k as :meth:`RopeManager.apply_qk` refuses
        them (device: q's); pos_ids not an integer tensor ``[T]`` (``[3, T]``) on q's
        device.
      RuntimeError: under CUDA-graph capture where the launcher declines.

    Example:
      >>> import jaxrope as jr
      >>> key = config_key(jr.RopeConfig(head_dim=8))
      >>> q, k = torch.ones(2, 2 * 8), torch.ones(2, 8)
      >>> rope_(q, k, torch.tensor([0, 3]), key)
      >>> q[0, :4].tolist()                         # position 0: unrotated
      [1.0, 1.0, 1.0, 1.0]
    """
    if torch.compiler.is_compiling():
        torch.ops.jaxrope.rope_(q, k, pos_ids, config)
    else:
        _rotate_explicit(q, k, pos_ids, config)


def _append_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], slots: torch.Tensor,
                     config: str, layout: str, k_quant_scale: Optional[float],
                     v_quant_scale: Optional[float], q_out: Optional[torch.Tensor],
                     q_quant_scale: Optional[float]) -> None:
    cfg = config_of(config)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    q3, k3 = check_qk(q, k, cfg.head_dim, q.device, "q's device")
    v3 = check_heads(v, "v", cfg.head_dim, q.device, "q's device")
    kv_cache = k_cache if v_cache is None else (k_cache, v_cache)
    caches, geometry, scales = kv_append.check_call(k3, v3, kv_cache, slots, layout,
                                                    k_quant_scale, v_quant_scale, q.device)
    out3, q_scale = kv_append.check_q_out(q, q3, q_out, q_quant_scale, q.device, "q's device")
    pos = _check_positions(pos_ids, q3.shape[0], cfg, q.device)
    if slots.device.type == "cpu":
        check_slots(slots.numpy(), geometry.num_slots)  # as the manager's method does
    if q3.shape[0]:
        runtime = _runtime(q.device)
        _staged((q3, k3, v3), (True, False, False), lambda a, b, c: runtime.append(
            a, b, c, pos, caches, slots, cfg, geometry, scales, out3, q_scale))


@torch.library.custom_op("jaxrope::rope_append_kv_",
                         mutates_args=("q", "k_cache", "v_cache", "q_out"),
                         device_types=("cpu", "cuda"))
def _rope_append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], slots: torch.Tensor,
                    config: str, layout: str, k_quant_scale: Optional[float],
                    v_quant_scale: Optional[float], q_out: Optional[torch.Tensor] = None,
                    q_quant_scale: Optional[float] = None) -> None:
    _append_explicit(q, k, v, pos_ids, k_cache, v_cache, slots, config, layout, k_quant_scale,
                     v_quant_scale, q_out, q_quant_scale)


@_rope_append_op.register_fake
def _(q, k, v, pos_ids, k_cache, v_cache, slots, config, layout, k_quant_scale, v_quant_scale,
      q_out=None, q_quant_scale=None):
    return None


def rope_append_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                    kv_cache: Any, slots: torch.Tensor, config: str, *, layout: str = "NHD",
                    k_quant_scale: Optional[float] = None,
                    v_quant_scale: Optional[float] = None,
                    q_out: Optional[torch.Tensor] = None,
                    q_quant_scale: Optional[float] = None) -> None:
    """Rotate ``q`` in place at ``pos_ids`` and write the rotated ``k`` and the ``v`` into
    the paged ``kv_cache`` at ``slots``: :meth:`RopeManager.apply_qk_and_append_kv` with
    explicit positions (as :func:`rope_`) and no manager.

    ``kv_cache``, ``slots``, ``layout``, the scales and ``q_out`` (the fp8 q, q then
    unchanged) as the method takes them (a ``(k_cache, v_cache)`` pair or one ``[pages,
    2, ...]`` tensor; any integer slots, -1 or any slot outside the cache skipping the
    token); ``pos_ids`` and ``config`` as :func:`rope_`. Under ``torch.compile`` this is
    the ``jaxrope::rope_append_kv_`` op.

    Raises:
      TypeError, ValueError: as the method refuses each argument (devices: q's), and
        ``pos_ids`` as :func:`rope_`.

    Example:
      >>> import jaxrope as jr
      >>> key = config_key(jr.RopeConfig(head_dim=8))
      >>> cache = torch.zeros(2, 2, 4, 1, 8)                  # 2 pages of 4, combined
      >>> q, kv = torch.ones(1, 2, 8), torch.ones(1, 1, 8)
      >>> rope_append_kv_(q, kv, kv, torch.tensor([0]), cache, torch.tensor([5]), key)
      >>> cache[1, 0, 1, 0].tolist() == [1.0] * 8, cache[1, 1, 1, 0].tolist() == [1.0] * 8
      (True, True)
    """
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        k_cache, v_cache = kv_cache
    else:
        k_cache, v_cache = kv_cache, None
    call = torch.ops.jaxrope.rope_append_kv_ if torch.compiler.is_compiling() else _append_explicit
    call(q, k, v, pos_ids, k_cache, v_cache, slots, config, layout, k_quant_scale, v_quant_scale,
         q_out, q_quant_scale)


# -- the manager's methods as ops ----------------------------------------------------------


@torch.library.custom_op("jaxrope::apply_qk", mutates_args=("q", "k"),
                         device_types=("cpu", "cuda"))
def _apply_qk_op(q: torch.Tensor, k: torch.Tensor, manager: str, label: str,
                 rotary_dim: Optional[int], interleave: Optional[bool],
                 rope_scale: Optional[float], rope_theta: Optional[float],
                 low_freq_factor: Optional[float],
                 high_freq_factor: Optional[float], old_context_len: Optional[int]) -> None:
    llama31 = {name: value for name, value in zip(
        LLAMA31_PARAMS, (low_freq_factor, high_freq_factor, old_context_len)) if value is not None}
    mgr = manager_of(manager)
    _staged((q, k), (True, True), lambda a, b: mgr.apply_qk(
        a, b, label, rotary_dim, interleave, rope_scale, rope_theta, **llama31))


@_apply_qk_op.register_fake
def _(q, k, manager, label, rotary_dim, interleave, rope_scale, rope_theta, low_freq_factor,
      high_freq_factor, old_context_len):
    return None


@torch.library.custom_op("jaxrope::apply_qk_and_append_kv",
                         mutates_args=("q", "k_cache", "v_cache", "q_out"),
                         device_types=("cpu", "cuda"))
def _append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: Optional[torch.Tensor], slots: torch.Tensor, manager: str, label: str,
               layout: str, k_quant_scale: Optional[float], v_quant_scale: Optional[float],
               q_out: Optional[torch.Tensor] = None,
               q_quant_scale: Optional[float] = None) -> None:
    mgr = manager_of(manager)
    kv_cache = k_cache if v_cache is None else (k_cache, v_cache)
    _staged((q, k, v), (True, False, False), lambda a, b, c: mgr.apply_qk_and_append_kv(
        a, b, c, label, kv_cache, slots, layout=layout, k_quant_scale=k_quant_scale,
        v_quant_scale=v_quant_scale, q_out=q_out, q_quant_scale=q_quant_scale))


@_append_op.register_fake
def _(q, k, v, k_cache, v_cache, slots, manager, label, layout, k_quant_scale, v_quant_scale,
      q_out=None, q_quant_scale=None):
    return None


def _op_label(label: Hashable) -> str:
    if not isinstance(label, str):
        raise TypeError(f"label={label!r} must be a str under torch.compile (the custom op "
                        "takes plan labels by name)")
    return label


def traced_apply_qk(manager: Any, q: torch.Tensor, k: torch.Tensor, label: Hashable,
                    overrides: Tuple[Any, ...],
                    llama31: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``manager.apply_qk`` as ``torch.compile`` records it: the ``jaxrope::apply_qk`` op.

    ``overrides``: ``(rotary_dim, interleave, rope_scale, rope_theta)``.

    Raises:
      TypeError: ``label`` is not a str, or an unknown keyword argument (as the method).
    """
    if set(llama31) - set(LLAMA31_PARAMS):
        manager._configs.get(**llama31)  # raises the method's TypeError
    torch.ops.jaxrope.apply_qk(q, k, manager._op_key, _op_label(label), *overrides,
                               *(llama31.get(name) for name in LLAMA31_PARAMS))
    return q, k


def split_cache(cache: Any, name: str,
                parts: Tuple[str, str]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A cache argument as an op's schema takes it: ``(first, second)`` of a pair, ``(cache,
    None)`` of one tensor.

    Raises:
      TypeError: neither a tensor nor a pair.
    """
    if isinstance(cache, torch.Tensor):
        return cache, None
    if isinstance(cache, (tuple, list)) and len(cache) == 2:
        return cache[0], cache[1]
    raise TypeError(f"{name} must be a ({parts[0]}, {parts[1]}) pair of tensors or one tensor, "
                    f"got {type(cache).__name__}")


def _op_scale(name: str, value: Any) -> Optional[float]:
    # The method's type and range refusal, before the op's schema (which would raise
    # its own RuntimeError); whether the cache takes a scale is the method's check.
    return None if value is None else kv_append._scale(name, value, True)


def traced_apply_qk_and_append_kv(manager: Any, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, label: Hashable, kv_cache: Any,
                                  slots: torch.Tensor, layout: str, k_quant_scale: Any,
                                  v_quant_scale: Any, q_out: Optional[torch.Tensor] = None,
                                  q_quant_scale: Any = None) -> Tuple[torch.Tensor, Any]:
    """``manager.apply_qk_and_append_kv`` as ``torch.compile`` records it: the
    ``jaxrope::apply_qk_and_append_kv`` op (the cache a tensor or a pair); returns what the
    method returns (``q_out`` in q's place when given).

    Raises:
      TypeError: ``label`` is not a str, the cache neither a tensor nor a pair, or a
        scale that is not a number.
      ValueError: a scale not finite and > 0.
    """
    k_cache, v_cache = split_cache(kv_cache, "kv_cache", ("k_cache", "v_cache"))
    torch.ops.jaxrope.apply_qk_and_append_kv(
        q, k, v, k_cache, v_cache, slots, manager._op_key, _op_label(label), layout,
        _op_scale("k_quant_scale", k_quant_scale), _op_scale("v_quant_scale", v_quant_scale),
        q_out, _op_scale("q_quant_scale", q_quant_scale))
    return q if q_out is None else q_out, kv_cache
