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

Both append ops take the call's QK-norm too: the weights as tensors (only read) and the
:class:`jaxrope.QKNorm` as three scalars (:func:`torch_bridge.op_arguments.norm_args`).

Every op runs on CPU (the JAX path through DLPack) and CUDA (the Mosaic GPU or
Triton-lowered launch on torch's current stream, the JAX path where the launcher
declines); M-RoPE needs no op of its own (an M-RoPE config reads ``[3, T]`` positions).

**One rule for Python objects.** An op's schema takes tensors, numbers and strings, so
a :class:`jaxrope.RopeConfig` or a manager reaches an op as a string key of a registry:
:func:`config_key` (the config's fingerprint, equal for equal configs) and
:func:`manager_key` (given to each manager at construction, held weakly), a QK-norm as
its scalars; :mod:`torch_bridge.op_arguments` holds these and the tensor checks the ops
share with the manager (both importable from here too).

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

from typing import Any, Callable, Dict, Hashable, Optional, Sequence, Tuple

import torch

from jaxrope.config import RopeConfig
from jaxrope.ops.rope_append_kv.api import check_slots
from jaxrope.qk_norm import QKNorm
from torch_bridge import kv_append
from torch_bridge.dlpack import jax_device
from torch_bridge.launch.dispatch import FastPath, resolve_launchers
from torch_bridge.op_arguments import (check_heads, check_positions, check_qk,
                                       config_key, config_of, manager_key, manager_of,
                                       norm_args, qk_norm_of)
from torch_bridge.rotate import LLAMA31_PARAMS, JaxRotation

__all__ = ["check_heads", "check_qk", "config_key", "config_of", "manager_key", "manager_of",
           "rope_", "rope_append_kv_", "split_cache", "traced_apply_qk",
           "traced_apply_qk_and_append_kv"]

# The launchers' alignment (torch_bridge.launch.runtime.ALIGN): a CUDA tensor is staged
# when it is not contiguous or its address is not a multiple of this.
_ALIGN = 32

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
               norm: Optional[kv_append.Norm], q_out: Optional[torch.Tensor],
               q_scale: float) -> None:
        if self.kv.launch(kv_append.launcher_call(q, k, v, pos_ids, caches, slots, cfg, geometry,
                                                  scales, norm, q_out, q_scale),
                          None, lambda: None):
            return
        self.kv.refuse_under_capture(self.device)
        if self._kv_jax is None:
            self._kv_jax = kv_append.JaxAppend(self.device)
        self._kv_jax(q, k, v, caches, geometry, pos_ids, slots, cfg, scales, norm=norm,
                     q_out=q_out, q_scale=q_scale)


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
    pos = check_positions(pos_ids, q3.shape[0], cfg, q.device)
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
                     q_quant_scale: Optional[float], *norm: Any) -> None:
    """The ``jaxrope::rope_append_kv_`` op's body; ``norm``: the op's last five arguments
    (:data:`torch_bridge.op_arguments.NormArgs`)."""
    cfg = config_of(config)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    q3, k3 = check_qk(q, k, cfg.head_dim, q.device, "q's device")
    v3 = check_heads(v, "v", cfg.head_dim, q.device, "q's device")
    q_w, k_w, *qk_norm = norm
    norm3 = kv_append.check_norm(q3, k3, q_w, k_w, qk_norm_of(*qk_norm), q.device, "q's device")
    kv_cache = k_cache if v_cache is None else (k_cache, v_cache)
    caches, geometry, scales = kv_append.check_call(k3, v3, kv_cache, slots, layout,
                                                    k_quant_scale, v_quant_scale, q.device)
    out3, q_scale = kv_append.check_q_out(q, q3, q_out, q_quant_scale, q.device, "q's device")
    pos = check_positions(pos_ids, q3.shape[0], cfg, q.device)
    if slots.device.type == "cpu":
        check_slots(slots.numpy(), geometry.num_slots)  # as the manager's method does
    if q3.shape[0]:
        runtime = _runtime(q.device)
        _staged((q3, k3, v3), (True, False, False), lambda a, b, c: runtime.append(
            a, b, c, pos, caches, slots, cfg, geometry, scales, norm3, out3, q_scale))


@torch.library.custom_op("jaxrope::rope_append_kv_",
                         mutates_args=("q", "k_cache", "v_cache", "q_out"),
                         device_types=("cpu", "cuda"))
def _rope_append_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], slots: torch.Tensor,
                    config: str, layout: str, k_quant_scale: Optional[float],
                    v_quant_scale: Optional[float], q_out: Optional[torch.Tensor],
                    q_quant_scale: Optional[float], q_norm_weight: Optional[torch.Tensor],
                    k_norm_weight: Optional[torch.Tensor], qk_norm_eps: Optional[float],
                    qk_norm_convention: str, qk_norm_per_head: bool) -> None:
    _append_explicit(q, k, v, pos_ids, k_cache, v_cache, slots, config, layout, k_quant_scale,
                     v_quant_scale, q_out, q_quant_scale, q_norm_weight, k_norm_weight,
                     qk_norm_eps, qk_norm_convention, qk_norm_per_head)


@_rope_append_op.register_fake
def _(*args: Any, **kwargs: Any) -> None:
    return None


def rope_append_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_ids: torch.Tensor,
                    kv_cache: Any, slots: torch.Tensor, config: str, *, layout: str = "NHD",
                    k_quant_scale: Optional[float] = None,
                    v_quant_scale: Optional[float] = None,
                    q_out: Optional[torch.Tensor] = None,
                    q_quant_scale: Optional[float] = None,
                    q_norm_weight: Optional[torch.Tensor] = None,
                    k_norm_weight: Optional[torch.Tensor] = None,
                    qk_norm: Optional[QKNorm] = None) -> None:
    """Rotate ``q`` in place at ``pos_ids`` and write the rotated ``k`` and the ``v`` into
    the paged ``kv_cache`` at ``slots``: :meth:`RopeManager.apply_qk_and_append_kv` with
    explicit positions (as :func:`rope_`) and no manager.

    ``kv_cache``, ``slots``, ``layout``, the scales, ``q_out`` (the fp8 q, q then
    unchanged) and the QK-norm (``q_norm_weight``, ``k_norm_weight``, ``qk_norm``) as the
    method takes them (a ``(k_cache, v_cache)`` pair or one ``[pages, 2, ...]`` tensor;
    any integer slots, -1 or any slot outside the cache skipping the token); ``pos_ids``
    and ``config`` as :func:`rope_`. Under ``torch.compile`` this is the
    ``jaxrope::rope_append_kv_`` op, ``qk_norm`` passed as its three scalars.

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
      >>> rope_append_kv_(q, kv, kv, torch.tensor([0]), cache, torch.tensor([6]), key,
      ...                 k_norm_weight=torch.full((8,), 2.0), qk_norm=jr.QKNorm(eps=1e-12))
      >>> cache[1, 0, 2, 0].tolist() == [2.0] * 8              # k / rms(k) * w
      True
    """
    if isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2:
        k_cache, v_cache = kv_cache
    else:
        k_cache, v_cache = kv_cache, None
    call = torch.ops.jaxrope.rope_append_kv_ if torch.compiler.is_compiling() else _append_explicit
    call(q, k, v, pos_ids, k_cache, v_cache, slots, config, layout, k_quant_scale, v_quant_scale,
         q_out, q_quant_scale, *norm_args(q_norm_weight, k_norm_weight, qk_norm))


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
               q_out: Optional[torch.Tensor], q_quant_scale: Optional[float],
               q_norm_weight: Optional[torch.Tensor], k_norm_weight: Optional[torch.Tensor],
               qk_norm_eps: Optional[float], qk_norm_convention: str,
               qk_norm_per_head: bool) -> None:
    mgr = manager_of(manager)
    kv_cache = k_cache if v_cache is None else (k_cache, v_cache)
    qk_norm = qk_norm_of(qk_norm_eps, qk_norm_convention, qk_norm_per_head)
    _staged((q, k, v), (True, False, False), lambda a, b, c: mgr.apply_qk_and_append_kv(
        a, b, c, label, kv_cache, slots, layout=layout, k_quant_scale=k_quant_scale,
        v_quant_scale=v_quant_scale, q_out=q_out, q_quant_scale=q_quant_scale,
        q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, qk_norm=qk_norm))


@_append_op.register_fake
def _(*args: Any, **kwargs: Any) -> None:
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
                                  q_quant_scale: Any = None, q_norm_weight: Any = None,
                                  k_norm_weight: Any = None,
                                  qk_norm: Any = None) -> Tuple[torch.Tensor, Any]:
    """``manager.apply_qk_and_append_kv`` as ``torch.compile`` records it: the
    ``jaxrope::apply_qk_and_append_kv`` op (the cache a tensor or a pair, ``qk_norm`` its
    scalars); returns what the method returns (``q_out`` in q's place when given).

    Raises:
      TypeError: ``label`` is not a str, the cache neither a tensor nor a pair, a scale
        that is not a number, a norm weight not a tensor, or ``qk_norm`` not a QKNorm.
      ValueError: a scale not finite and > 0; ``qk_norm`` not a QKNorm and no weight.
    """
    k_cache, v_cache = split_cache(kv_cache, "kv_cache", ("k_cache", "v_cache"))
    torch.ops.jaxrope.apply_qk_and_append_kv(
        q, k, v, k_cache, v_cache, slots, manager._op_key, _op_label(label), layout,
        _op_scale("k_quant_scale", k_quant_scale), _op_scale("v_quant_scale", v_quant_scale),
        q_out, _op_scale("q_quant_scale", q_quant_scale),
        *norm_args(q_norm_weight, k_norm_weight, qk_norm))
    return q if q_out is None else q_out, kv_cache
