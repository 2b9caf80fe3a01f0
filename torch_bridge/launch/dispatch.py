"""The fast paths of ``RopeManager``: what a launcher is, which one "auto" picks, and the
one dispatch ``apply_qk``, ``apply_qk_and_append_kv`` and ``apply_mla_and_append_kv`` share.

A *launcher* works on torch tensors itself, on torch's current stream: ``rotate_`` for
``apply_qk`` (:class:`Launcher`), ``rotate_and_append_kv_`` for
``apply_qk_and_append_kv`` (:class:`KVLauncher`), ``rotate_and_append_mla_`` for
``apply_mla_and_append_kv`` (:class:`MlaLauncher`). It declines a call by raising
:class:`jaxrope.BackendUnavailable`; the manager then runs the JAX path.
:func:`resolve_launchers` maps ``RopeManager(launcher=...)`` to the first two,
:func:`resolve_mla_launcher` to the third. :class:`FastPath`
is one method's launcher with its bound launches: after a launch succeeded, the call's
signature is bound to ``launcher.bind(...)``'s run, so a repeated call skips the
Python-level checks (host time of the order of the launch itself).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Hashable, Optional, Protocol, Sequence, Tuple

import torch

from jaxrope.ops import backends as _backend
from jaxrope.config import RopeConfig
from jaxrope.errors import BackendUnavailable
from torch_bridge.kv_append import CacheGeometry

__all__ = ["FastPath", "KVLauncher", "Launcher", "MlaLauncher", "auto_launcher_class",
           "launcher_property", "resolve_launchers", "resolve_mla_launcher"]

# Bound launches kept (one per call signature) before a path's cache starts over.
_MAX_BOUND = 1024


class Launcher(Protocol):
    """A fast path that rotates torch tensors itself, on torch's current stream.

    ``rotate_(q, k, pos_ids, cfg)``: ``q [T, Hq, D]``, ``k [T, Hk, D]`` (validated by
    the manager: same dtype and device, ``D == cfg.head_dim``), ``pos_ids`` int32
    ``[N >= T]`` on the same device, of which the first ``T`` are used (M-RoPE, when
    ``cfg.mrope_section`` is set: ``[3, N]``, the first ``T`` of each row); rotates q
    and k in place. Raises :class:`jaxrope.BackendUnavailable` to decline (the manager then
    runs the JAX path); any other exception propagates.

    Optionally also ``bind(q, k, cfg) -> run``: after a successful ``rotate_`` the
    manager binds the call's signature (label, shapes, dtypes, devices, overrides) and
    later calls ``run(q, k, pos_ids) -> bool`` with the caller's q and k as given
    (``[T, H, D]`` or ``[T, H * D]``) instead of validating again; ``run`` returns
    False to send the call down the full path. Only a launcher that defines ``bind``
    for this purpose should have an attribute of that name.

    Example (a launcher that always declines, so the JAX path rotates):
      >>> import jaxrope as jr
      >>> from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
      >>> class Declining:
      ...     calls = 0
      ...     def rotate_(self, q, k, pos_ids, cfg):
      ...         Declining.calls += 1
      ...         raise jr.BackendUnavailable("no compiled kernel for this shape")
      >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu",
      ...                   launcher=Declining())
      >>> mgr.ingest_request("r0")
      >>> step, ctx = PositionStep([Segment("r0", "text", 2)]), StepContext(("r0",))
      >>> _ = mgr.plan(step, ctx)
      >>> q, k = torch.ones(2, 1, 8), torch.ones(2, 1, 8)
      >>> _ = mgr.apply_qk(q, k, "text")
      >>> Declining.calls, q[0, 0].tolist()  # position 0 rotates by angle 0
      (1, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    """

    def rotate_(self, q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor,
                cfg: RopeConfig) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hk, D]`` in place at ``pos_ids[..., :T]`` under ``cfg``.

        ``pos_ids`` is int32 ``[N >= T]`` (M-RoPE: ``[3, N]``) on q's device; q and k share
        dtype (float32, float16 or bfloat16) and device, and ``D == cfg.head_dim``.

        Raises:
          BackendUnavailable: to decline this call; the manager then runs the JAX path.
        """


class KVLauncher(Protocol):
    """A fast path for ``RopeManager.apply_qk_and_append_kv`` that works on torch tensors itself.

    ``rotate_and_append_kv_(q, k, v, pos_ids, caches, slots, cfg, geometry, scales)``:
    ``q [T, Hq, D]``, ``k, v [T, Hk, D]`` (validated by the manager: one dtype and
    device, ``D == cfg.head_dim``), ``pos_ids`` int32 ``[N >= T]`` (the first ``T`` are
    used; an M-RoPE config's ``[3, N]``, its first ``T`` columns), ``caches`` the engine's
    cache tensors (the ``(k_cache, v_cache)`` pair, or the combined tensor alone),
    ``slots`` ``[T]`` of any integer dtype, ``geometry`` a
    :class:`torch_bridge.kv_append.CacheGeometry`, ``scales`` ``(k_scale, v_scale)``
    floats (1.0 for a cache in k's dtype). Rotates q in place and writes the rotated k
    and the v into the cache with :func:`jaxrope.apply_rope_and_append_kv`'s semantics.
    Raises :class:`jaxrope.BackendUnavailable` to decline (the manager then runs the JAX
    path); any other exception propagates.

    Optionally ``bind(q, k, v, caches, slots, cfg, geometry, scales) -> run``: after a
    successful call the manager binds its signature and later calls ``run(q, k, v,
    pos_ids, kv_cache, slots) -> bool`` with the caller's arguments as given; False
    sends the call down the full path.

    An object given as ``RopeManager(launcher=...)`` serves ``apply_qk`` through
    ``rotate_`` (:class:`torch_bridge.Launcher`) and this method through
    ``rotate_and_append_kv_`` when it has one.

    Example (a launcher that always declines, so the JAX path writes the cache):
      >>> import jaxrope as jr
      >>> from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
      >>> class Declining:
      ...     calls = 0
      ...     def rotate_(self, q, k, pos_ids, cfg):
      ...         raise jr.BackendUnavailable("rope alone: not used here")
      ...     def rotate_and_append_kv_(self, q, k, v, pos_ids, caches, slots, cfg, geometry,
      ...                               scales):
      ...         Declining.calls += 1
      ...         raise jr.BackendUnavailable("no compiled kernel for this cache")
      >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu",
      ...                   launcher=Declining())
      >>> mgr.ingest_request("r0")
      >>> _ = mgr.plan(PositionStep([Segment("r0", "text", 1)]), StepContext(("r0",)))
      >>> cache = torch.zeros(2, 2, 4, 1, 8)                  # combined: 2 pages of 4
      >>> q, kv = torch.ones(1, 2, 8), torch.ones(1, 1, 8)
      >>> _ = mgr.apply_qk_and_append_kv(q, kv, kv, "text", cache, torch.tensor([5]))
      >>> Declining.calls, cache[1, 0, 1, 0].tolist()        # keys of page 1, entry 1
      (1, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    """

    def rotate_and_append_kv_(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              pos_ids: torch.Tensor, caches: Sequence[torch.Tensor],
                              slots: torch.Tensor, cfg: RopeConfig, geometry: CacheGeometry,
                              scales: Tuple[float, ...]) -> None:
        """Rotate q in place at ``pos_ids[:T]``; write the rotated k and the v at ``slots``.

        A launcher whose class attribute ``accepts`` names ``"norm"`` and/or ``"q_out"``
        is also called with those keywords: ``norm=(q_norm_weight, k_norm_weight,
        qk_norm)`` (:func:`torch_bridge.kv_append.check_norm`), normalising q and k before
        the rotation, and ``q_out``, a float8_e4m3fn tensor shaped like q that receives
        ``e4m3(clip(rot(q) * scales[2], -448, 448))`` (``scales`` then ``(k, v, q)``), q
        left unchanged. Other launchers never see such a call: the JAX path serves it.

        Raises:
          BackendUnavailable: to decline this call; the manager then runs the JAX path.
        """


class MlaLauncher(Protocol):
    """A fast path for ``RopeManager.apply_mla_and_append_kv`` that works on torch tensors itself.

    ``rotate_and_append_mla_(q_pe, k_pe, ckv, pos_ids, caches, slots, cfg, scales, q_nope=,
    q_pe_out=, q_nope_out=)``: the manager's checked tensors (``q_pe [T, H, r]``, ``k_pe
    [T, r]``, ``ckv [T, L]``, the cache tensors as given: the ``(ckv_cache, kpe_cache)``
    pair or the one ``[P, S, L + r]`` tensor alone, ``slots [T]`` of any integer dtype,
    ``scales`` the ``(q_scale, kv_scale)`` floats), with
    :func:`jaxrope.apply_mla_rope_and_append`'s semantics
    (:meth:`torch_bridge.launch.mla.MosaicMlaLauncher.rotate_and_append_mla_`). Raises
    :class:`jaxrope.BackendUnavailable` to decline (the manager then runs the JAX path).

    Optionally ``bind(q_pe, k_pe, ckv, caches, slots, cfg, scales, q_nope=, q_pe_out=,
    q_nope_out=) -> run``: after a successful call the manager binds its signature and
    later calls ``run(q_pe, k_pe, ckv, pos_ids, mla_cache, slots, q_nope, q_pe_out,
    q_nope_out) -> bool`` with the caller's arguments as given; False sends the call
    down the full path.
    """

    def rotate_and_append_mla_(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
                               pos_ids: torch.Tensor, caches: Sequence[torch.Tensor],
                               slots: torch.Tensor, cfg: RopeConfig, scales: Tuple[float, float],
                               q_nope: Optional[torch.Tensor] = None,
                               q_pe_out: Optional[torch.Tensor] = None,
                               q_nope_out: Optional[torch.Tensor] = None) -> None:
        """Rotate q_pe (or quantise it and q_nope into the fp8 outputs); cache ckv and k_pe."""


def auto_launcher_class(device: torch.device, op: str = "rope") -> type:
    """The launcher of the kernel ``backend="auto"`` runs for ``op`` ("rope",
    "rope_append_kv" or "mla_rope_append") on CUDA ``device``
    (:func:`jaxrope.ops.backends.backend_name`, the one rule): the Mosaic GPU kernel's on
    Hopper or newer with a JAX that lowers it
    (:class:`~torch_bridge.launch.mosaic.MosaicLauncher`,
    :class:`~torch_bridge.launch.mosaic.MosaicKVLauncher`,
    :class:`~torch_bridge.launch.mla.MosaicMlaLauncher`), else the Triton-lowered
    kernel's (:class:`~torch_bridge.launch.triton.TritonLauncher`,
    :class:`~torch_bridge.launch.triton.TritonKVLauncher`).

    Raises:
      BackendUnavailable: "mla_rope_append" where "auto" does not run Mosaic GPU (the
        Triton MLA kernel has no torch launch: :mod:`torch_bridge.launch.mla` says why).
    """
    major, minor = torch.cuda.get_device_capability(device)
    mosaic = _backend.backend_name("auto", "cuda", op, f"{major}.{minor}") == "mosaic"
    if op == "mla_rope_append":
        if not mosaic:
            raise BackendUnavailable(f"no MLA launcher on compute capability {major}.{minor}: "
                                     "only the Mosaic GPU kernel (Hopper) launches from torch")
        from torch_bridge.launch.mla import MosaicMlaLauncher
        return MosaicMlaLauncher
    if op == "rope_append_kv":
        if mosaic:
            from torch_bridge.launch.mosaic import MosaicKVLauncher
            return MosaicKVLauncher
        from torch_bridge.launch.triton import TritonKVLauncher
        return TritonKVLauncher
    if mosaic:
        from torch_bridge.launch.mosaic import MosaicLauncher
        return MosaicLauncher
    from torch_bridge.launch.triton import TritonLauncher
    return TritonLauncher


def _built(cls_of: Callable[[], type]) -> Optional[Any]:
    try:
        return cls_of()()
    except BackendUnavailable:
        return None


def resolve_launchers(launcher: Any, device: torch.device) -> Tuple[Optional[Launcher],
                                                                    Optional[KVLauncher]]:
    """``(rope launcher, fused-append launcher)`` for ``RopeManager(launcher=...)``.

    ``"jax"`` -> neither (always the JAX path). ``"auto"`` on a CUDA device -> the
    launcher of the kernel ``backend="auto"`` runs there for each op
    (:func:`auto_launcher_class`), None where one cannot be built and off CUDA. An
    object with ``rotate_`` -> itself, and itself for the fused append too when it has
    ``rotate_and_append_kv_`` (else that runs the JAX path).

    Raises:
      ValueError: any other value.

    Example:
      >>> resolve_launchers("auto", torch.device("cpu"))  # no fast path on CPU
      (None, None)
    """
    if isinstance(launcher, str) and launcher in ("auto", "jax"):
        if launcher == "jax" or device.type != "cuda":
            return None, None
        return (_built(lambda: auto_launcher_class(device, "rope")),
                _built(lambda: auto_launcher_class(device, "rope_append_kv")))
    if not isinstance(launcher, str) and callable(getattr(launcher, "rotate_", None)):
        fused = callable(getattr(launcher, "rotate_and_append_kv_", None))
        return launcher, launcher if fused else None
    raise ValueError(f"launcher={launcher!r} must be 'auto', 'jax' or an object with "
                     "rotate_(q, k, pos_ids, cfg)")


def resolve_mla_launcher(launcher: Any, device: torch.device) -> Optional[MlaLauncher]:
    """The launcher of ``apply_mla_and_append_kv`` for ``RopeManager(launcher=...)``, or None
    (the JAX path): for "auto" on a CUDA device :func:`auto_launcher_class`'s
    "mla_rope_append" launcher where one can be built; an object with
    ``rotate_and_append_mla_`` serves it itself; anything else (``"jax"``, an object
    without the method) None. :func:`resolve_launchers` refuses unknown values.

    Example:
      >>> resolve_mla_launcher("auto", torch.device("cpu")) is None
      True
    """
    if isinstance(launcher, str):
        if launcher != "auto" or device.type != "cuda":
            return None
        return _built(lambda: auto_launcher_class(device, "mla_rope_append"))
    return launcher if callable(getattr(launcher, "rotate_and_append_mla_", None)) else None


def launcher_property(path: str, method: str) -> property:
    """A manager attribute reading and assigning the launcher of its :class:`FastPath` at
    the dotted attribute ``path``, the fast path of ``method``."""
    fast_path = operator.attrgetter(path)

    # Named functions with plain signatures: torch_bridge.locking wraps a property's
    # getter and setter by their source-level signature.
    def launcher(self) -> Any:
        return fast_path(self).launcher

    def set_launcher(self, value: Any) -> None:
        fast_path(self).launcher = value

    return property(launcher, set_launcher,
                    doc=f"The fast path ``{method}`` tries first (None: always JAX); assignable.")


class FastPath:
    """One manager method's launcher and the launches bound to its call signatures.

    ``method`` names the method in errors. Assigning ``launcher`` drops the bound
    launches (they must not outlive the launcher that bound them).
    """

    def __init__(self, method: str, launcher: Any):
        self.method = method
        self.launcher = launcher

    @property
    def launcher(self) -> Any:
        """The launcher (None: always the JAX path); assignable."""
        return self._launcher

    @launcher.setter
    def launcher(self, value: Any) -> None:
        self._launcher = value
        self._bound: Dict[Hashable, Callable[..., bool]] = {}

    def bound(self, signature: Callable[[], Hashable]) -> Optional[Callable[..., bool]]:
        """The run bound to ``signature()``, or None (also when the call's arguments are
        not tensors or unhashable: the full path's checks then name them)."""
        if not self._bound:
            return None
        try:
            return self._bound.get(signature())
        except (AttributeError, TypeError, ValueError):
            return None

    def launch(self, call: Callable[[Any], None],
               bind: Optional[Callable[[Callable[..., Callable[..., bool]]], Callable[..., bool]]],
               signature: Callable[[], Hashable]) -> bool:
        """``call(launcher)``; True when it ran, False when there is no launcher or it
        declined. After a run, ``bind(launcher.bind)`` is kept for ``signature()`` when
        the launcher binds and ``bind`` is given (None: this call must not be bound)."""
        if self._launcher is None:
            return False
        try:
            call(self._launcher)
        except BackendUnavailable:
            return False
        launcher_bind = getattr(self._launcher, "bind", None)
        if bind is not None and launcher_bind is not None:
            if len(self._bound) >= _MAX_BOUND:
                self._bound.clear()
            self._bound[signature()] = bind(launcher_bind)
        return True

    def refuse_under_capture(self, device: torch.device) -> None:
        """Raise when the JAX path would run under CUDA-graph capture.

        Raises:
          RuntimeError: ``device`` is CUDA and its current stream is capturing.
        """
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            state = "off" if self._launcher is None else "declining"
            raise RuntimeError(f"{self.method} under CUDA-graph capture needs the launcher: "
                               "the JAX path runs on JAX's stream, which the capture cannot "
                               f"record, and the launcher is {state}")
