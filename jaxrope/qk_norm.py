"""QK-norm: the RMSNorm some models apply to q and k before RoPE, as a frozen value.

Qwen3, Qwen3-MoE and Gemma 3 normalise each head of q and of k over its ``head_dim``
with a weight ``[D]`` (one for q, one for k); OLMo 2 and OLMo 3 normalise the whole
projection of a token, all heads at once, with a weight ``[H * D]``. Every one computes,
in float32, for ``x`` one head (or one token's heads)::

    y = x / sqrt(mean(x ** 2) + eps) * w         # "rmsnorm": Qwen3, Qwen3-MoE, OLMo 2/3
    y = x / sqrt(mean(x ** 2) + eps) * (1 + w)   # "gemma": Gemma 3 (its weights start at 0)

:class:`QKNorm` holds ``eps``, the convention and the span (per head or per token);
the weights are arrays the caller passes with each call
(:func:`jaxrope.apply_rope_and_append_kv`'s ``q_norm_weight`` and ``k_norm_weight``).
:meth:`QKNorm.from_hf` reads the first two from a HF config (``rms_norm_eps``, which
every family in :data:`MODEL_NORMS` passes to its ``q_norm`` and ``k_norm``).

Example:
  >>> import jax.numpy as jnp, numpy as np, jaxrope as jr
  >>> qwen3 = {"model_type": "qwen3", "rms_norm_eps": 1e-6, "head_dim": 128}
  >>> jr.QKNorm.from_hf(qwen3)
  QKNorm(eps=1e-06, convention='rmsnorm', per_head=True)
  >>> x = jnp.array([[[3.0, 4.0]]])                          # [T=1, H=1, D=2]
  >>> y = normalize(x, jnp.array([1.0, 0.5]), jr.QKNorm(eps=1e-12))
  >>> np.asarray(y, np.float64).round(4).tolist()
  [[[0.8485, 0.5657]]]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrope.hf_source import load_config
from jaxrope.numbers import check_float32_positive

__all__ = ["CONVENTIONS", "MODEL_NORMS", "QKNorm", "check_weight", "norm_asked",
           "normalize", "per_token_norm"]

# "rmsnorm": y = x_hat * w; "gemma": y = x_hat * (1 + w).
CONVENTIONS = ("rmsnorm", "gemma")
# Weight dtypes accepted: a model's own parameter dtypes.
WEIGHT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


class ModelNorm(NamedTuple):
    """A model family's q_norm / k_norm, as its transformers modeling code builds them."""

    convention: str
    per_head: bool
    # The config class's rms_norm_eps default: what transformers uses when the field is absent.
    eps_default: float


# model_type -> its QK-norm (transformers 5.x: modeling_<family>.py, the attention's
# q_norm / k_norm built with eps=config.rms_norm_eps).
MODEL_NORMS: Mapping[str, ModelNorm] = {
    "qwen3": ModelNorm("rmsnorm", True, 1e-6),       # Qwen3RMSNorm(head_dim)
    "qwen3_moe": ModelNorm("rmsnorm", True, 1e-6),   # Qwen3MoeRMSNorm(head_dim)
    "gemma3": ModelNorm("gemma", True, 1e-6),        # its text_config, read below
    "gemma3_text": ModelNorm("gemma", True, 1e-6),   # Gemma3RMSNorm: x_hat * (1 + w)
    "olmo2": ModelNorm("rmsnorm", False, 1e-5),      # Olmo2RMSNorm(heads * head_dim)
    "olmo3": ModelNorm("rmsnorm", False, 1e-5),      # Olmo3RMSNorm(heads * head_dim)
}


def _check_eps(eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    value = float(eps)
    check_float32_positive("eps", value, " (rms_norm_eps: 1e-6 for Qwen3 and Gemma 3, 1e-5 "
                           "for OLMo 2)")
    return value


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class QKNorm:
    """How q and k are normalised before RoPE; frozen and hashable.

    A pytree without leaves (``jax.tree_util.register_static``): a jitted function takes
    it as an argument as it is, static, one compile per value.

    Attributes:
      eps: added to the mean square before the square root; finite and > 0 within the
        normal float32 range (the kernels add it as a float32).
      convention: "rmsnorm" (``x_hat * w``: Qwen3, Qwen3-MoE, OLMo 2) or "gemma"
        (``x_hat * (1 + w)``: Gemma 3).
      per_head: True (Qwen3, Gemma 3): each head is normalised over its ``head_dim``,
        weights ``[D]``; False (OLMo 2): the ``H`` heads of a token together, over
        ``H * D`` values, weights ``[H * D]`` (``[Hq * D]`` for q, ``[Hk * D]`` for k).

    Raises:
      TypeError: ``eps`` is not a number, ``per_head`` not a bool.
      ValueError: ``eps`` <= 0, infinite, NaN or outside the normal float32 range; an
        unknown ``convention``.

    Example:
      >>> olmo2 = QKNorm(eps=1e-5, per_head=False)
      >>> olmo2.weight_length(heads=32, head_dim=128), QKNorm(eps=1e-5) == olmo2
      (4096, False)
      >>> QKNorm(eps=0.0)
      Traceback (most recent call last):
      ...
      ValueError: eps=0.0 must be finite and > 0 (rms_norm_eps: 1e-6 for Qwen3 and Gemma 3, 1e-5 for OLMo 2)
    """

    eps: float = 1e-6
    convention: str = "rmsnorm"
    per_head: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", _check_eps(self.eps))
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention={self.convention!r} must be one of {CONVENTIONS}")
        if not isinstance(self.per_head, bool):
            raise TypeError(f"per_head must be a bool, got {type(self.per_head).__name__}")

    def weight_length(self, heads: int, head_dim: int) -> int:
        """The length of the weight for an input ``[T, heads, head_dim]``."""
        return head_dim if self.per_head else heads * head_dim

    @classmethod
    def from_hf(cls, config: Any) -> "QKNorm":
        """The QK-norm of a HF transformers model, from its config.

        Reads ``model_type`` (of the nested ``text_config`` when there is one, as Gemma
        3's multimodal config holds it) and ``rms_norm_eps`` (the config class's default
        when absent); the convention and the span come from :data:`MODEL_NORMS`.

        Args:
          config: a ``config.json`` as a dict, a path to one (or to its directory), or an
            object with ``to_dict()`` (a transformers ``PretrainedConfig``).

        Raises:
          ValueError: a ``model_type`` not in :data:`MODEL_NORMS` (its attention may not
            normalise q and k; build a :class:`QKNorm` by hand if it does), or an
            ``rms_norm_eps`` that is not finite and > 0.
          TypeError: ``config`` is none of the above.

        Example:
          >>> QKNorm.from_hf({"model_type": "gemma3", "text_config": {
          ...     "model_type": "gemma3_text", "rms_norm_eps": 1e-6}})
          QKNorm(eps=1e-06, convention='gemma', per_head=True)
          >>> QKNorm.from_hf({"model_type": "olmo2"}).per_head
          False
        """
        raw = load_config(config)
        text = raw.get("text_config")
        fields = text if isinstance(text, Mapping) else raw
        model_type = fields.get("model_type", raw.get("model_type"))
        row = MODEL_NORMS.get(model_type)
        if row is None:
            raise ValueError(f"model_type={model_type!r} has no q_norm / k_norm known here "
                             f"(known: {sorted(MODEL_NORMS)}); if its attention normalises q "
                             "and k, build QKNorm(eps=..., convention=..., per_head=...)")
        eps = fields.get("rms_norm_eps")
        return cls(eps=row.eps_default if eps is None else eps, convention=row.convention,
                   per_head=row.per_head)


def per_token_norm(backend: str) -> str:
    """Why ``backend``'s kernel declines ``per_head=False``: its ``NotImplementedError``'s
    message. Both GPU kernels normalise per head only: OLMo 2/3's norm needs the mean
    square over all of a token's heads, and a program (a block) holds a subset of them."""
    return (f"backend={backend!r} normalises q and k per head only: qk_norm.per_head=False "
            "(OLMo 2/3) normalises all of a token's heads together, and a program of this "
            "kernel holds a subset of a token's heads; use backend='xla', or 'auto', which "
            "takes XLA for such a call")


def check_weight(name: str, weight: Any, x: Any, qk_norm: Optional[QKNorm]) -> None:
    """Check ``weight`` (named ``name``) for normalising ``x [T, H, D]`` by ``qk_norm``.

    Raises:
      TypeError: ``weight`` is not an array, or ``qk_norm`` not a :class:`QKNorm`.
      ValueError: ``qk_norm`` is None, ``weight`` is not 1-D of the span's length or not
        float32, bfloat16 or float16.
    """
    if not (hasattr(weight, "shape") and hasattr(weight, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(weight).__name__}")
    if qk_norm is None:
        raise ValueError(f"{name} is given but qk_norm=None: pass qk_norm=QKNorm(eps=..., "
                         "convention=...) (QKNorm.from_hf(config) reads a model's) to say "
                         "how to normalise")
    if not isinstance(qk_norm, QKNorm):
        raise TypeError(f"qk_norm must be a jaxrope.QKNorm, got {type(qk_norm).__name__}")
    heads, head_dim = x.shape[1:]
    length = qk_norm.weight_length(heads, head_dim)
    if tuple(weight.shape) != (length,):
        span = "D" if qk_norm.per_head else "H * D (per_head=False)"
        raise ValueError(f"{name}.shape={tuple(weight.shape)} must be ({length},): [{span}] "
                         f"for {tuple(x.shape)}")
    if jnp.dtype(weight.dtype) not in WEIGHT_DTYPES:
        raise ValueError(f"{name}.dtype={weight.dtype} must be one of "
                         f"{[d.name for d in WEIGHT_DTYPES]}")


def norm_asked(q: Any, k: Any, q_norm_weight: Any, k_norm_weight: Any,
               qk_norm: Optional[QKNorm]) -> bool:
    """Whether a call of the fused append normalises q or k; its norm arguments checked.

    The weights need only ``shape`` and ``dtype`` here (the torch bridge passes stand-ins).

    Raises:
      TypeError, ValueError: as :func:`check_weight`; ``qk_norm`` without a weight.
    """
    if q_norm_weight is None and k_norm_weight is None:
        if qk_norm is not None:
            raise ValueError(f"qk_norm={qk_norm!r} is given without q_norm_weight or "
                             "k_norm_weight: pass the weights to normalise, or leave it None")
        return False
    for name, weight, x in (("q_norm_weight", q_norm_weight, q),
                            ("k_norm_weight", k_norm_weight, k)):
        if weight is not None:
            check_weight(name, weight, x, qk_norm)
    return True


def normalize(x: jax.Array, weight: jax.Array, qk_norm: QKNorm) -> jax.Array:
    """``x [T, H, D]`` normalised by ``qk_norm`` with ``weight``, as float32.

    The mean square, the reciprocal square root and the product with the weight are all
    float32, whatever ``x``'s dtype: one rounding later, where the caller stores.
    """
    xf = x.astype(jnp.float32)
    axes = (-1,) if qk_norm.per_head else (-2, -1)
    mean_square = jnp.mean(xf * xf, axis=axes, keepdims=True)
    w = weight.astype(jnp.float32)
    if not qk_norm.per_head:
        w = w.reshape(x.shape[-2:])
    if qk_norm.convention == "gemma":
        w = 1.0 + w
    return xf * jax.lax.rsqrt(mean_square + jnp.float32(qk_norm.eps)) * w
