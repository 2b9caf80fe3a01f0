"""``RopeManager``: :class:`PositionManager` plus ``apply_qk``, rotating torch tensors in place.

``apply_qk`` and ``apply_qk_and_append_kv`` first offer the call to a *launcher* (on
CUDA the compiled kernel launched on torch's stream: :mod:`torch_bridge.launch.dispatch` says
which); a launcher that raises :class:`jaxrope.BackendUnavailable` declines and the JAX
path runs (DLPack import and a donated jitted call, :class:`torch_bridge.rotate.JaxRotation`,
:class:`torch_bridge.kv_append.JaxAppend`). Both methods dispatch through one
:class:`torch_bridge.launch.dispatch.FastPath` each: a repeated call signature runs its bound
launch without the Python-level checks.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, Optional, Tuple

import torch

from jaxrope.config import RopeConfig
from jaxrope.ops.rope_append_kv.api import check_slots
from jaxrope.qk_norm import QKNorm
from torch_bridge import custom_ops, kv_append, mla_append
from torch_bridge.config import PositionConfig
from torch_bridge.dlpack import check_contiguous, jax_device
from torch_bridge.resource import EngineInfo
from torch_bridge.locking import traceable
from torch_bridge.launch.dispatch import (FastPath, launcher_property, resolve_launchers,
                                          resolve_mla_launcher)
from torch_bridge.launch.runtime import narrowed_in_place
from torch_bridge.manager import PositionManager
from torch_bridge.plans import Plan
from torch_bridge.rotate import TORCH_DTYPES, ConfigCache, JaxRotation
from torch_bridge.step_arrays import check_hashable

__all__ = ["RopeManager"]

class RopeManager(PositionManager):
    """Rotary position embedding on top of :class:`PositionManager`: ``apply_qk`` in place.

    Args:
      config: a :class:`~torch_bridge.PositionConfig`; ``config.rope`` None builds
        ``RopeConfig(head_dim=head_dim, max_position=max(max_seq_len, 131072))``.
      device: the torch device of q, k and the position ids.
      max_seq_len: positions stay below it; at most ``config.rope.max_position``.
      head_dim: ``D``; must equal ``config.rope.head_dim`` when both are given.
      launcher: the fast paths the methods try first: "auto" (on CUDA:
        :func:`torch_bridge.launch.dispatch.auto_launcher_class`, the Mosaic GPU launches
        on Hopper), "jax" (always the JAX path), or an object with ``rotate_(q, k,
        pos_ids, cfg)`` (:class:`torch_bridge.Launcher`), which serves the fused calls too
        if it has ``rotate_and_append_kv_`` / ``rotate_and_append_mla_``; see
        :func:`torch_bridge.launch.dispatch.resolve_launchers`.
      backend: the jaxrope backend of the JAX path ("auto", "mosaic", "triton", "xla", "interpret").
      allow_copy: let the JAX path stage q/k through copies (written back in place):
        padded to a token bucket, so it compiles once per bucket, and contiguous where
        they are non-contiguous or misaligned; False raises on the latter instead and
        compiles once per token count (a fused append names its first strided tensor
        before anything changes).
      writer: the writer id of :class:`~torch_bridge.PositionManager`.

    Attributes:
      launcher: the resolved launcher, or None; assignable.
      kv_launcher, mla_launcher: those of the fused methods, or None; assignable.
      rope: the base :class:`jaxrope.RopeConfig`.

    Raises:
      TypeError: ``config`` is not a PositionConfig, or ``allow_copy`` not a bool.
      ValueError: an invalid argument (named in the message).

    Example:
      >>> import torch, jaxrope as jr
      >>> from torch_bridge import PositionConfig, PositionStep, RopeManager, Segment, StepContext
      >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu")
      >>> mgr.ingest_request("r0")
      >>> step, ctx = PositionStep([Segment("r0", "text", 3)]), StepContext(("r0",))
      >>> _ = mgr.plan(step, ctx)
      >>> q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
      >>> q2, k2 = mgr.apply_qk(q, k, "text")
      >>> q2 is q
      True
      >>> mgr.commit(step, ctx)
    """

    def __init__(self, config: PositionConfig, device: Any, max_seq_len: int = 32768,
                 head_dim: Optional[int] = None, *, launcher: Any = "auto", backend: str = "auto",
                 allow_copy: bool = True, writer: Optional[int] = None):
        super().__init__(config, device, max_seq_len, writer=writer)
        rope = config.rope
        if rope is None:
            if head_dim is None:
                raise ValueError("head_dim is required when config.rope is None")
            rope = RopeConfig(head_dim=head_dim, max_position=max(self.max_seq_len, 131072))
        elif head_dim is not None and head_dim != rope.head_dim:
            raise ValueError(f"{head_dim=} must equal config.rope.head_dim={rope.head_dim}")
        if self.max_seq_len > rope.max_position:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be <= "
                             f"config.rope.max_position={rope.max_position}")
        if not isinstance(allow_copy, bool):
            raise TypeError(f"{allow_copy=} must be a bool")
        self.rope = rope
        self.head_dim = rope.head_dim
        self.allow_copy = allow_copy
        rope_launcher, kv_launcher = resolve_launchers(launcher, self.device)
        self._rope_path = FastPath("apply_qk", rope_launcher)
        self._kv_path = FastPath("apply_qk_and_append_kv", kv_launcher)
        self._kv_jax: Optional[kv_append.JaxAppend] = None
        self._mla = mla_append.MlaPaths(resolve_mla_launcher(launcher, self.device), self.device,
                                        backend)
        self._configs = ConfigCache(rope)
        self._backend = backend
        JaxRotation.check_backend(backend, self.device)
        self._jax: Optional[JaxRotation] = None  # built at first use: JAX's GPU client is costly
        self._op_key = custom_ops.manager_key(self)  # how the custom ops name this manager

    launcher = launcher_property("_rope_path", "apply_qk")
    kv_launcher = launcher_property("_kv_path", "apply_qk_and_append_kv")
    mla_launcher = launcher_property("_mla.fast", "apply_mla_and_append_kv")

    @classmethod
    def _build_kwargs(cls, info: EngineInfo) -> Dict[str, Any]:
        return {**super()._build_kwargs(info), "head_dim": info.head_dim}

    def _fingerprint_payload(self) -> bytes:
        return super()._fingerprint_payload() + b"|" + self.rope.fingerprint()

    @traceable
    def apply_qk(self, q: torch.Tensor, k: torch.Tensor, label: str,
                 rotary_dim: Optional[int] = None, interleave: Optional[bool] = None,
                 rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
                 **llama31: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` and ``k`` in place at the planned positions of plan label ``label``.

        Args:
          q: ``[T, Hq, D]`` or ``[T, Hq * D]``, float32/float16/bfloat16, on ``device``.
          k: ``[T, Hk, D]`` or ``[T, Hk * D]``, same dtype, device and ``T``.
          label: a plan label of the current plan; token ``t`` gets ``pos_ids(label)[t]``
            (M-RoPE: column ``t`` of the ``[3, n]`` rows, ``config.rope.mrope_section``
            splitting the frequencies over them). ``T`` may be less than the planned
            tokens (the first ``T`` are used) or more (an engine's padded batch): tokens
            past the planned ones are left untouched.
          rotary_dim: with ``interleave``, ``rope_scale``, ``rope_theta`` and the keywords
            ``low_freq_factor``, ``high_freq_factor``, ``old_context_len``: per-call
            overrides with FlashInfer's meaning (see :class:`torch_bridge.rotate.ConfigCache`).

        Returns:
          ``(q, k)``: the same tensors, rotated. Dims ``[rotary_dim, D)`` are untouched.

        The JAX path compiles once per token bucket (powers of two, at least 16; see
        :class:`torch_bridge.rotate.JaxRotation`), not once per token count.

        Ordering: on CUDA the rotation runs after the work queued on torch's current
        stream and before whatever is queued next on it; there is no host sync.
        Zero copy: the launcher works on the tensors themselves; the JAX path
        imports them through DLPack and writes into them (see
        :mod:`torch_bridge.dlpack`; on CPU it copies the result back).

        Raises:
          ValueError: no positions planned for ``label`` (or it is unknown), q/k of the
            wrong rank, head size, dtype or device, k's token count unlike q's, or an
            invalid override.
          TypeError: q or k not a tensor, or an unknown keyword argument.
          RuntimeError: called under CUDA-graph capture without a launcher that
            accepts the call.
        """
        if torch.compiler.is_compiling():  # what the graph records: see torch_bridge.custom_ops
            return custom_ops.traced_apply_qk(self, q, k, label, (
                rotary_dim, interleave, rope_scale, rope_theta), llama31)
        # Peek: a staged plan becomes current (its pre-forks apply) only once the call is valid.
        plan = self._plans.peek()
        overrides = (rotary_dim, interleave, rope_scale, rope_theta)
        signature = lambda: _call_signature(label, q, k, overrides)  # noqa: E731
        if not llama31 and self._run_bound(self._rope_path, plan, label, q, signature,
                                           lambda run, pos: run(q, k, pos)):
            return q, k
        q3, k3 = self._checked_qk(q, k, label, plan)
        padded = q3.shape[0] > plan.limits[label]   # an engine's padded batch: cut the tail
        if padded:
            q3, k3 = q3[:plan.limits[label]], k3[:plan.limits[label]]
        tokens = q3.shape[0]
        cfg = self._configs.get(rotary_dim, interleave, rope_scale, rope_theta, **llama31)
        self._plans.promote()
        if tokens == 0:
            return q, k
        # The launcher reads the first ``tokens`` positions; no slice (a view per call costs
        # microseconds on the hot path). A bound run gets q as given: not one longer than
        # its plan.
        if self._rope_path.launch(lambda launcher: launcher.rotate_(q3, k3, plan.tensors[label], cfg),
                                  None if llama31 or padded else lambda bind: bind(q3, k3, cfg),
                                  signature):
            return q, k
        self._rope_path.refuse_under_capture(self.device)
        self._jax_rotation()(q3, k3, plan.tensors[label], cfg, allow_copy=self.allow_copy)
        return q, k

    @traceable
    def apply_qk_and_append_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               label: str, kv_cache: Any, slots: torch.Tensor, *,
                               layout: str = "NHD", k_quant_scale: Optional[float] = None,
                               v_quant_scale: Optional[float] = None,
                               q_norm_weight: Optional[torch.Tensor] = None,
                               k_norm_weight: Optional[torch.Tensor] = None,
                               qk_norm: Optional[QKNorm] = None,
                               q_out: Optional[torch.Tensor] = None,
                               q_quant_scale: Optional[float] = None) -> Tuple[torch.Tensor, Any]:
        """``apply_qk`` fused with the paged KV-cache append: q rotated in place, k and v cached.

        One launch on CUDA (:mod:`torch_bridge.launch`) where an engine runs two
        (RoPE in place, then its cache append, which reads k again):
        :func:`jaxrope.apply_rope_and_append_kv` on the engine's own tensors.

        Args:
          q: ``[T, Hq, D]`` or ``[T, Hq * D]``, float32/float16/bfloat16, on ``device``;
            rotated in place at ``pos_ids(label)[:T]`` (M-RoPE: the first ``T`` columns
            of the ``[3, n]`` rows), as ``apply_qk`` rotates it: tokens past the planned
            ones (an engine's padded batch) are neither rotated nor cached.
          k: ``[T, Hk, D]`` or ``[T, Hk * D]``, q's dtype; read only (not rotated in
            place: the cache gets the rotated k).
          v: k's shape and dtype; read only.
          label: a plan label of the current plan (as ``apply_qk``).
          kv_cache: the engine's paged cache, FlashInfer's ``paged_kv_cache``: a
            ``(k_cache, v_cache)`` pair of ``[pages, page_size, Hk, D]`` tensors
            (``layout="NHD"``) or ``[pages, Hk, page_size, D]`` (``"HND"``), or one
            ``[pages, 2, page_size, Hk, D]`` (``[pages, 2, Hk, page_size, D]``) tensor
            with keys at ``[:, 0]`` and values at ``[:, 1]``; k's dtype or
            ``torch.float8_e4m3fn``; written in place.
          slots: ``[T]`` of any integer dtype (vLLM's int64 ``slot_mapping``) on
            ``device``: token ``t`` goes to page ``slots[t] // page_size``, entry
            ``slots[t] % page_size``; -1 (any slot outside ``[0, pages * page_size)``,
            decided at the slots' own width: nothing wraps) skips the token. Values are
            not checked (they are on the device); of two tokens naming one slot either
            may win.
          layout: "NHD" (default, FlashInfer's) or "HND".
          k_quant_scale, v_quant_scale: fp8 caches only (None otherwise): the cache
            stores ``e4m3(clip(x * scale, -448, 448))`` of the float32 rotated k (and v),
            FlashInfer's ``quant_scale_kv`` (vLLM's ``k_scale`` divides: pass its
            reciprocal); floats, default 1.
          q_norm_weight, k_norm_weight, qk_norm: QK-norm before the rotation, as
            :func:`jaxrope.apply_rope_and_append_kv` takes them (weights ``[D]``, or
            ``[H * D]`` for ``qk_norm.per_head=False``, float32/bfloat16/float16 tensors
            on ``device``, a model's ``q_norm.weight`` as it is). The CUDA launchers
            normalise per head in their kernel; a per-token norm (OLMo 2/3) takes the
            JAX path (not under CUDA-graph capture). Under ``torch.compile`` the weights
            are tensor arguments of the op and ``qk_norm`` its constant scalars: one
            compile serves every step with the same norm.
          q_out: None (q rotated in place), or a ``torch.float8_e4m3fn`` tensor of q's
            shape on ``device`` (FlashInfer's ``q_rope_out``): it receives
            ``e4m3(clip(x * q_quant_scale, -448, 448))`` of the float32 rotated q, every
            dim, and q itself is left unchanged (:func:`jaxrope.apply_rope_and_append_kv`'s
            ``q_dtype=float8_e4m3fn``); rows past the planned tokens are left as they are.
            The CUDA launchers write it in their kernel.
          q_quant_scale: with ``q_out`` only: FlashInfer's ``quant_scale_q``, a float,
            default 1.

        Returns:
          ``(q, kv_cache)``: the objects given, q rotated and the cache written at every
          valid slot; every other cache entry, k and v unchanged. With ``q_out``:
          ``(q_out, kv_cache)``, q as it was.

        Ordering: on CUDA the launch runs after the work queued on torch's current stream
        and before whatever is queued next on it; no host sync. CUDA graphs: call once
        outside capture per signature (shapes, dtypes, cache, scales), then capture and
        replay (the positions read are the plan's buffer: plan graph steps with their
        ``graph_slot``). The JAX path (no launcher, or one declining: no CUDA, no CUDA
        plugin or Triton to build it, non-contiguous or misaligned tensors; the Triton
        launcher also an fp8 cache of 2-4 GiB) imports the
        tensors through DLPack and writes into them (on CPU the results are copied back;
        non-contiguous tensors are staged through copies when ``allow_copy``).

        Raises:
          ValueError: as ``apply_qk`` for label, q and k; v unlike k; an unknown layout;
            a cache of the wrong rank, heads, head size, dtype or device; a
            ``(k_cache, v_cache)`` pair sharing memory; slots of the wrong shape, dtype
            or device; a scale given for a cache in k's dtype, or not finite and > 0; a
            norm weight of the wrong shape, dtype or device, or one without ``qk_norm``;
            ``q_out`` of another dtype, shape or device, or ``q_quant_scale`` without it.
          TypeError: a tensor argument of the wrong type, the cache neither a pair nor a
            tensor, a scale that is not a number, or ``qk_norm`` not a QKNorm.
          NotImplementedError: a per-token norm with the manager's backend "mosaic",
            "triton" or "interpret".
          RuntimeError: called under CUDA-graph capture without a launcher that accepts
            the call.

        Example:
          >>> import torch, jaxrope as jr
          >>> from torch_bridge import PositionConfig, PositionStep, Segment, StepContext
          >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8)), "cpu")
          >>> mgr.ingest_request("r0")
          >>> step, ctx = PositionStep([Segment("r0", "text", 3)]), StepContext(("r0",))
          >>> _ = mgr.plan(step, ctx)
          >>> q, k, v = torch.randn(3, 4, 8), torch.ones(3, 2, 8), torch.full((3, 2, 8), 2.0)
          >>> cache = (torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8))   # 4 pages of 16
          >>> slots = torch.tensor([17, 40, -1])     # page 1 entry 1, page 2 entry 8, padding
          >>> q2, (k_cache, v_cache) = mgr.apply_qk_and_append_kv(q, k, v, "text", cache, slots)
          >>> q2 is q, k_cache[1, 1, 0].tolist(), float(v_cache.sum())   # position 0: k as is
          (True, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 64.0)
          >>> mgr.commit(step, ctx)
        """
        if torch.compiler.is_compiling():  # what the graph records: see torch_bridge.custom_ops
            return custom_ops.traced_apply_qk_and_append_kv(
                self, q, k, v, label, kv_cache, slots, layout, k_quant_scale, v_quant_scale,
                q_out, q_quant_scale, q_norm_weight, k_norm_weight, qk_norm)
        normed = not (q_norm_weight is None and k_norm_weight is None and qk_norm is None)
        plan = self._plans.peek()
        signature = lambda: kv_append.call_signature(  # noqa: E731
            label, q, k, v, kv_cache, slots, layout, k_quant_scale, v_quant_scale)
        # A bound launch has no norm and no fp8 q: such a call takes the full path.
        if not normed and q_out is None and q_quant_scale is None and self._run_bound(
                self._kv_path, plan, label, q, signature,
                lambda run, pos: run(q, k, v, pos, kv_cache, slots)):
            return q, kv_cache
        q3, k3 = self._checked_qk(q, k, label, plan)
        v3 = self._heads(v, "v")
        norm = kv_append.check_norm(q3, k3, q_norm_weight, k_norm_weight, qk_norm, self.device)
        caches, geometry, scales = kv_append.check_call(k3, v3, kv_cache, slots, layout,
                                                        k_quant_scale, v_quant_scale, self.device)
        out3, q_scale = kv_append.check_q_out(q, q3, q_out, q_quant_scale, self.device)
        padded = q3.shape[0] > plan.limits[label]
        if padded:
            n = plan.limits[label]
            q3, k3, v3, slots = q3[:n], k3[:n], v3[:n], slots[:n]
            out3 = None if out3 is None else out3[:n]
        if slots.device.type == "cpu":
            # The eager rule of jaxrope.apply_rope_and_append_kv, where the values are on
            # the host; a CUDA launch reads them on the device and skips those outside.
            check_slots(slots.numpy(), geometry.num_slots)
        if not self.allow_copy and q3.shape[0]:
            check_contiguous((("q", q3), ("k", k3), ("v", v3), ("kv_cache", kv_cache),
                              ("q_out", out3), ("slots", narrowed_in_place(slots))))
        self._plans.promote()
        if q3.shape[0]:
            self._append_kv(q3, k3, v3, plan.tensors[label], caches, slots, geometry, scales,
                            None if padded else signature, norm, out3, q_scale)
        return q if q_out is None else q_out, kv_cache

    def _append_kv(self, q3: torch.Tensor, k3: torch.Tensor, v3: torch.Tensor,
                   pos_ids: torch.Tensor, caches: Tuple[torch.Tensor, ...], slots: torch.Tensor,
                   geometry: kv_append.CacheGeometry, scales: Tuple[float, float], signature,
                   norm: Optional[kv_append.Norm], q_out: Optional[torch.Tensor],
                   q_scale: float) -> None:
        """The checked call on the launcher, else on the JAX path. ``signature`` None: a
        padded call, which must not be bound; nor is a call with a norm or an fp8 q (a
        bound launch carries neither)."""
        plain = norm is None and q_out is None
        launched = self._kv_path.launch(
            kv_append.launcher_call(q3, k3, v3, pos_ids, caches, slots, self.rope, geometry,
                                    scales, norm, q_out, q_scale),
            None if signature is None or not plain else lambda bind: bind(
                q3, k3, v3, caches, slots, self.rope, geometry, scales),
            signature)
        if launched:
            return
        self._kv_path.refuse_under_capture(self.device)
        if self._kv_jax is None:
            self._kv_jax = kv_append.JaxAppend(self.device, self._backend)
        self._kv_jax(q3, k3, v3, caches, geometry, pos_ids, slots, self.rope, scales,
                     allow_copy=self.allow_copy, norm=norm, q_out=q_out, q_scale=q_scale)

    @traceable
    def apply_mla_and_append_kv(self, q_pe: torch.Tensor, k_pe: torch.Tensor, ckv: torch.Tensor,
                                label: str, mla_cache: Any, slots: torch.Tensor, *,
                                q_nope: Optional[torch.Tensor] = None,
                                q_pe_out: Optional[torch.Tensor] = None,
                                q_nope_out: Optional[torch.Tensor] = None,
                                q_quant_scale: Optional[float] = None,
                                kv_quant_scale: Optional[float] = None) -> Tuple[Any, Any, Any]:
        """MLA's ``apply_qk`` fused with its paged cache append (DeepSeek-V2/V3):
        :func:`jaxrope.apply_mla_rope_and_append` on the engine's own tensors.

        Args:
          q_pe: ``[T, H, r]`` (or ``[T, H * r]``), ``r == config.rope.head_dim``, rotated in
            place at ``pos_ids(label)[:T]`` unless ``q_pe_out`` is given; tokens past the
            planned ones (a padded batch) are neither rotated nor cached, as ``apply_qk``.
          k_pe: ``[T, r]``, q_pe's dtype; read only (the cache gets it rotated).
          ckv: ``[T, L]``, q_pe's dtype; cached as it is (read only).
          label: a plan label of the current plan.
          mla_cache: ``(ckv_cache [pages, page_size, L], kpe_cache [pages, page_size, r])``
            (FlashInfer's) or one ``[pages, page_size, L + r]`` tensor (vLLM's), k_pe's
            dtype or ``torch.float8_e4m3fn``; written in place.
          slots: ``[T]`` of any integer dtype, as ``apply_qk_and_append_kv`` takes them.
          q_pe_out: a ``[T, H, r]`` ``torch.float8_e4m3fn`` tensor (FlashInfer's
            ``q_rope_out``): receives ``e4m3(clip(rot(q_pe) * q_quant_scale))``; q_pe is
            then left unchanged.
          q_nope, q_nope_out: ``[T, H, N]`` in q_pe's dtype and its fp8 output, both or
            neither, only with ``q_pe_out``: q_nope quantized as q_pe.
          q_quant_scale: with ``q_pe_out`` only, a float, default 1.
          kv_quant_scale: fp8 caches only (ckv and k_pe), a float, default 1 (vLLM's
            ``scale`` divides: pass its reciprocal).

        Returns:
          ``(q_pe, q_nope, mla_cache)``: the objects given (``q_pe_out`` and ``q_nope_out``
          in place of q_pe and q_nope when given), rotated, quantized and written.

        On Hopper the Mosaic GPU kernel launches on torch's current stream
        (:class:`torch_bridge.launch.mla.MosaicMlaLauncher`; ``mla_launcher``, assignable),
        under the rules of ``apply_qk_and_append_kv``: one compile per launch shape, then
        capturable in a CUDA graph. Elsewhere, or where it declines, the JAX path runs.

        Raises:
          ValueError: as ``apply_qk`` for label, q_pe and k_pe (k_pe as one head); a
            tensor of the wrong shape, dtype or device; a pair of caches sharing memory;
            q_nope or q_nope_out without q_pe_out; a scale where it does not apply, or
            not finite and > 0; visible (CPU) slots past the cache or repeated.
          TypeError: an argument of the wrong type, a scale that is not a number.
          BackendUnavailable: the manager's backend cannot run here ("mosaic" or
            "triton" off a CUDA GPU).
          RuntimeError: under CUDA-graph capture without a launcher that accepts the call.

        Example:
          >>> import torch, jaxrope as jr
          >>> from torch_bridge import PositionConfig, PositionStep, Segment, StepContext
          >>> mgr = RopeManager(PositionConfig(rope=jr.RopeConfig(head_dim=8, interleave=True)),
          ...                   "cpu")
          >>> mgr.ingest_request("r0")
          >>> step, ctx = PositionStep([Segment("r0", "text", 2)]), StepContext(("r0",))
          >>> _ = mgr.plan(step, ctx)
          >>> q_pe, k_pe, ckv = torch.randn(2, 4, 8), torch.ones(2, 8), torch.full((2, 16), 3.0)
          >>> cache = torch.zeros(4, 4, 16 + 8)                   # 4 pages of 4, [L + r]
          >>> out = mgr.apply_mla_and_append_kv(q_pe, k_pe, ckv, "text", cache, torch.tensor([5, -1]))
          >>> out[0] is q_pe, cache[1, 1, :17].tolist() == [3.0] * 16 + [1.0], float(cache[0].sum())
          (True, True, 0.0)
          >>> mgr.commit(step, ctx)
        """
        if torch.compiler.is_compiling():  # what the graph records: see torch_bridge.custom_ops
            return mla_append.traced_apply_mla_and_append_kv(
                self, q_pe, k_pe, ckv, label, mla_cache, slots, q_nope, q_pe_out, q_nope_out,
                q_quant_scale, kv_quant_scale)
        plan = self._plans.peek()
        signature = lambda: mla_append.call_signature(  # noqa: E731
            label, q_pe, k_pe, ckv, mla_cache, slots, q_nope, q_pe_out, q_nope_out,
            q_quant_scale, kv_quant_scale)
        if self._run_bound(self._mla.fast, plan, label, q_pe, signature, lambda run, pos: run(
                q_pe, k_pe, ckv, pos, mla_cache, slots, q_nope, q_pe_out, q_nope_out)):
            return mla_append.outputs(q_pe, q_nope, q_pe_out, q_nope_out, mla_cache)
        q3, k3 = self._checked_qk(q_pe, k_pe, label, plan, ("q_pe", "k_pe"))
        caches, geometry, scales = mla_append.check_call(
            q3, k_pe, ckv, q_nope, mla_cache, slots, q_pe_out, q_nope_out, q_quant_scale,
            kv_quant_scale, self.device)
        q_outs = tuple(x for x in (q_pe_out, q_nope_out) if x is not None)
        n = min(q3.shape[0], plan.limits[label])   # an engine's padded batch: cut the tail
        # What the paths read: the first n tokens (q_nope_out only comes with q_pe_out).
        q_n, k_n, ckv_n, slots_n = q3[:n], k3[:n, 0], ckv[:n], slots[:n]
        nope_n = None if q_nope is None else q_nope[:n]
        outs_n = tuple(x[:n] for x in q_outs)
        if slots.device.type == "cpu":
            check_slots(slots_n.numpy(), geometry.num_slots)   # the core's eager rule
        if not self.allow_copy and n:
            check_contiguous((("q_pe", q_n), ("k_pe", k_n), ("ckv", ckv_n), ("q_nope", nope_n),
                              ("mla_cache", mla_cache), *zip(("q_pe_out", "q_nope_out"), outs_n),
                              ("slots", narrowed_in_place(slots_n))))
        self._plans.promote()
        if n:
            self._mla(q_n, k_n, ckv_n, nope_n, outs_n, caches, geometry, plan.tensors[label],
                      slots_n, self.rope, scales, self.allow_copy,
                      None if n < q3.shape[0] else signature)
        return mla_append.outputs(q_pe, q_nope, q_pe_out, q_nope_out, mla_cache)

    def _checked_qk(self, q: torch.Tensor, k: torch.Tensor, label: Hashable,
                    plan: Optional[Plan],
                    names: Tuple[str, str] = ("q", "k")) -> Tuple[torch.Tensor, torch.Tensor]:
        """``[T, H, D]`` views of q and k, checked for a ``label`` with positions in ``plan``."""
        check_hashable(label, "label")
        if plan is None or label not in plan.tensors:
            self._check_plan_label(label)
            raise ValueError(f"no positions planned for label={label!r}: call plan() for this step")
        return custom_ops.check_qk(q, k, self.head_dim, self.device, names=names)

    def _run_bound(self, path: FastPath, plan: Optional[Plan], label: Hashable,
                   q: torch.Tensor, signature, run) -> bool:
        """``run(bound, positions)`` when the call's signature has a bound launch and its
        plan label holds q's tokens (the staged plan then becomes current); False sends
        the call down the full path."""
        if plan is None:
            return False
        bound = path.bound(signature)
        if bound is None:
            return False
        pos = plan.tensors.get(label)
        if pos is None or q.shape[0] > plan.limits[label]:
            return False
        self._plans.promote()
        return run(bound, pos)

    def _jax_rotation(self) -> JaxRotation:
        if self._jax is None:
            self._jax = JaxRotation(jax_device(self.device), self._backend)
        return self._jax

    def _heads(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return custom_ops.check_heads(x, name, self.head_dim, self.device)


def _call_signature(label: Hashable, q: torch.Tensor, k: torch.Tensor,
                    overrides: Tuple[Any, ...]) -> Tuple[Any, ...]:
    """What ``apply_qk``'s checks depend on, apart from the plan: the key of a bound launch."""
    return (label, q.shape, k.shape, q.dtype, k.dtype, q.device, k.device, q.requires_grad,
            k.requires_grad, overrides)
