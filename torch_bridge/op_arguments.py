"""What the bridge's custom ops take, and the checks they share with ``RopeManager``.

An op's schema takes tensors, numbers, bools and strings only (:mod:`torch_bridge.custom_ops`
defines the ops); the Python objects of a call reach an op as such values:

=================================  ==============================================================
``jaxrope.RopeConfig``             a string key of this module's registry: :func:`config_key`
                                   (the config's fingerprint, equal for equal configs), read
                                   back by :func:`config_of`
a ``RopeManager``                  a string key given to each manager at construction
                                   (:func:`manager_key`, held weakly; :func:`manager_of`)
``jaxrope.QKNorm``                 three scalars, ``qk_norm_eps`` (None: no norm),
                                   ``qk_norm_convention`` and ``qk_norm_per_head``
                                   (:func:`norm_args`, read back by :func:`qk_norm_of`); the
                                   weights are tensor arguments of their own, only read
=================================  ==============================================================

Every one is a constant of the traced graph, so a compiled model calling an op with the
same config, manager and norm at every step compiles once.

The fused-append ops' schemas give no argument a default: torch 2.11 drops the trailing
arguments that equal their defaults before its in-place bookkeeping looks the mutated
ones up by position (``q_out`` among them), an IndexError under fake tensors. A direct
caller passes :data:`APPEND_OPTIONS_OFF` for the options it does not use.

The tensor checks here (:func:`check_heads`, :func:`check_qk`, :func:`check_positions`) are
the manager methods' and the explicit ops', so bad input gets one error through either.

Example:
  >>> import jaxrope as jr
  >>> norm = jr.QKNorm(eps=1e-6, convention="gemma")
  >>> _, _, *scalars = norm_args(torch.ones(8), None, norm)
  >>> scalars, qk_norm_of(*scalars) == norm
  ([1e-06, 'gemma', True], True)
"""

from __future__ import annotations

import functools
import itertools
import weakref
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from jaxrope.config import RopeConfig
from jaxrope.ops.rope.api import _check_pos_shape
from jaxrope.qk_norm import QKNorm, norm_asked
from torch_bridge import kv_append
from torch_bridge.rotate import TORCH_DTYPES

__all__ = ["APPEND_OPTIONS_OFF", "NormArgs", "check_heads", "check_positions", "check_qk",
           "config_key", "config_of", "manager_key", "manager_of", "norm_args", "qk_norm_of"]

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


# -- QK-norm as schema values ----------------------------------------------------------------

# (q_norm_weight, k_norm_weight, qk_norm_eps, qk_norm_convention, qk_norm_per_head).
NormArgs = Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[float], str, bool]
_NO_NORM = (None, QKNorm.convention, QKNorm.per_head)   # QKNorm's own defaults

# The fused-append ops' arguments from ``q_out`` on, for a call that uses neither fp8 q
# nor a norm (read-only: shared by every caller).
APPEND_OPTIONS_OFF: Mapping[str, Any] = MappingProxyType(dict(
    q_out=None, q_quant_scale=None, q_norm_weight=None, k_norm_weight=None,
    **dict(zip(("qk_norm_eps", "qk_norm_convention", "qk_norm_per_head"), _NO_NORM))))


def norm_args(q_norm_weight: Any, k_norm_weight: Any, qk_norm: Any) -> NormArgs:
    """A call's QK-norm as the ops take it: the two weights as given, then ``qk_norm``
    as ``(eps, convention, per_head)`` (``eps`` None: no ``qk_norm``).

    Only what the schema cannot carry is refused here, with the method's error; the
    rest (shapes, dtypes, a weight without ``qk_norm``) is the op's check, the method's.

    Raises:
      TypeError: a weight that is not a tensor; ``qk_norm`` not a :class:`jaxrope.QKNorm`
        with a weight given.
      ValueError: ``qk_norm`` not a QKNorm, and no weight.
    """
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        kv_append.check_weight_type(name, weight)
    if qk_norm is None:
        return (q_norm_weight, k_norm_weight, *_NO_NORM)
    if not isinstance(qk_norm, QKNorm):
        # The core's rule refuses it before reading q or k: a ValueError without a weight,
        # else check_weight's TypeError.
        norm_asked(None, None, q_norm_weight, k_norm_weight, qk_norm)
    return q_norm_weight, k_norm_weight, qk_norm.eps, qk_norm.convention, qk_norm.per_head


@functools.lru_cache(maxsize=64)
def qk_norm_of(eps: Optional[float], convention: str = "rmsnorm",
               per_head: bool = True) -> Optional[QKNorm]:
    """The :class:`jaxrope.QKNorm` an op's scalars describe; None when ``eps`` is None.

    Raises:
      TypeError, ValueError: as :class:`jaxrope.QKNorm` (an ``eps`` not finite and > 0
        as a normal float32, an unknown ``convention``).
    """
    return None if eps is None else QKNorm(eps=eps, convention=convention, per_head=per_head)


# -- checks shared with RopeManager ----------------------------------------------------------


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


def check_positions(pos_ids: Any, tokens: int, cfg: RopeConfig,
                    device: torch.device) -> torch.Tensor:
    """``pos_ids`` as the launches read them: int32, contiguous, ``[T]`` (``[3, T]`` for
    an M-RoPE ``cfg``), on ``device``.

    Raises:
      TypeError: not a tensor.
      ValueError: another device, not an integer dtype, or a shape as
        :func:`jaxrope.apply_rope` refuses it.
    """
    if not isinstance(pos_ids, torch.Tensor):
        raise TypeError(f"pos_ids must be an integer torch.Tensor, got {type(pos_ids).__name__}")
    if pos_ids.device != device:
        raise ValueError(f"pos_ids is on {pos_ids.device}, expected {device} (q's device)")
    if pos_ids.dtype.is_floating_point or pos_ids.dtype.is_complex or pos_ids.dtype == torch.bool:
        raise ValueError(f"pos_ids.dtype={pos_ids.dtype} must be an integer type (int32)")
    _check_pos_shape(tuple(pos_ids.shape), tokens, cfg)
    return pos_ids.to(torch.int32).contiguous()
