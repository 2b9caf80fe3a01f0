"""RoPE scaling variants: one frozen, hashable dataclass per HF ``rope_type``.

Each variant is plain data; the arithmetic that turns it into inverse frequencies
lives in :mod:`jaxrope.frequencies`. Field names follow HF transformers' rope
parameters, with ``original_max_position_embeddings`` shortened to
``original_max_position``.

Every variant validates its fields at construction and raises ``ValueError`` naming
the field. A variant only takes effect through :class:`jaxrope.RopeConfig`, whose
``frequencies()`` returns float64 ``inv_freq [R/2]`` and the attention factor.

Example:
  >>> import jaxrope as jr
  >>> jr.Llama3() == jr.Llama3(factor=8.0), hash(jr.Linear(2.0)) == hash(jr.Linear(2.0))
  (True, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union


def _check_positive(owner: str, **values: Optional[float]) -> None:
    for name, value in values.items():
        if value is None:
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{owner}.{name}={value!r} must be a finite number")
        if value <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be > 0")


def _check_int(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive int")


@dataclasses.dataclass(frozen=True)
class Linear:
    """Position interpolation: every inverse frequency is divided by ``factor``.

    Args:
      factor: the divisor, a finite number > 0 (no default).

    Raises:
      ValueError: ``factor`` is not a finite number > 0.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0, scaling=jr.Linear(2.0))
      >>> cfg.frequencies()[0].tolist()  # unscaled: [1.0, 0.1]
      [0.5, 0.05]
    """

    factor: float

    def __post_init__(self) -> None:
        _check_positive("Linear", factor=self.factor)


@dataclasses.dataclass(frozen=True)
class DynamicNTK:
    """HF ``dynamic``: the base grows with the sequence length seen.

    ``original_max_position`` is the length the model was trained at (HF's
    ``max_position_embeddings``). The frequencies depend on the sequence length;
    kernels fix it at :attr:`RopeConfig.max_position` (see ``frequencies``).

    Args:
      factor: finite number > 0.
      original_max_position: positive int; at or below this length the frequencies
        are the unscaled ones.

    Raises:
      ValueError: naming the field, for a non-positive or non-finite value.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0, max_position=8192,
      ...                     scaling=jr.DynamicNTK(factor=2.0, original_max_position=4096))
      >>> cfg.frequencies(seq_len=4096)[0].tolist()
      [1.0, 0.1]
      >>> [round(f, 4) for f in cfg.serving_frequencies()[0].tolist()]  # at max_position
      [1.0, 0.0333]
    """

    factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        _check_positive("DynamicNTK", factor=self.factor)
        _check_int("DynamicNTK", original_max_position=self.original_max_position)


@dataclasses.dataclass(frozen=True)
class Llama3:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth band between.

    Defaults are Llama 3.1's: ``factor=8.0``, ``low_freq_factor=1.0``,
    ``high_freq_factor=4.0``, ``original_max_position=8192``. Wavelengths above
    ``original_max_position / low_freq_factor`` are scaled, those below
    ``original_max_position / high_freq_factor`` are kept.

    Raises:
      ValueError: naming the field, for a non-positive value or
        ``high_freq_factor <= low_freq_factor``.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=1e8, scaling=jr.Llama3())
      >>> cfg.frequencies()[0].tolist()  # unscaled: [1.0, 0.0001]
      [1.0, 1.25e-05]
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        _check_positive("Llama3", factor=self.factor, low_freq_factor=self.low_freq_factor,
                        high_freq_factor=self.high_freq_factor)
        _check_int("Llama3", original_max_position=self.original_max_position)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"Llama3.high_freq_factor={self.high_freq_factor!r} must be > "
                             f"low_freq_factor={self.low_freq_factor!r}")


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN, with DeepSeek's ``mscale`` / ``mscale_all_dim`` form of the attention factor.

    ``attention_factor`` None means derived: ``get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim)`` when both are set, else
    ``0.1 * ln(factor) + 1`` (1 for factor <= 1), exactly as HF does.

    Args:
      factor: finite number > 0.
      original_max_position: positive int, the pre-training length.
      beta_fast, beta_slow: the ramp bounds in rotations (defaults 32.0 and 1.0).
      mscale, mscale_all_dim: DeepSeek's attention-factor terms (default None).
      attention_factor: explicit attention factor, or None (default) to derive it.
      truncate: floor/ceil the ramp's dimension bounds to ints, HF's default (default True).

    Raises:
      ValueError: naming the field, for a non-positive value or a non-bool ``truncate``.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0, scaling=jr.Yarn(4.0, 4096))
      >>> inv_freq, attention = cfg.frequencies()
      >>> inv_freq.tolist(), round(attention, 4)  # attention = 0.1 * ln(4) + 1
      ([1.0, 0.1], 1.1386)
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self) -> None:
        _check_positive("Yarn", factor=self.factor, beta_fast=self.beta_fast,
                        beta_slow=self.beta_slow, mscale=self.mscale,
                        mscale_all_dim=self.mscale_all_dim, attention_factor=self.attention_factor)
        _check_int("Yarn", original_max_position=self.original_max_position)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"Yarn.truncate={self.truncate!r} must be a bool")


@dataclasses.dataclass(frozen=True)
class LongRope:
    """Phi-3 LongRoPE: per-frequency divisors, ``short_factor`` or ``long_factor``.

    The long factors apply when the sequence length exceeds
    ``original_max_position``. ``factor`` None means HF's default
    ``max_position / original_max_position`` (used only for the attention factor).

    Args:
      short_factor, long_factor: ``R/2`` positive divisors each (any sequence;
        stored as tuples of floats).
      original_max_position: positive int.
      attention_factor: explicit attention factor, or None (default) to derive it.
      factor: None (default) or a number > 0, see above.

    Raises:
      ValueError: naming the field, for a non-sequence or a non-positive entry.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0, max_position=8192,
      ...                     scaling=jr.LongRope((1.0, 2.0), (4.0, 8.0), 4096))
      >>> cfg.frequencies(seq_len=4096)[0].tolist()  # short factors
      [1.0, 0.05]
      >>> cfg.serving_frequencies()[0].tolist()  # long factors, at max_position
      [0.25, 0.0125]
    """

    short_factor: Tuple[float, ...]
    long_factor: Tuple[float, ...]
    original_max_position: int
    attention_factor: Optional[float] = None
    factor: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise ValueError(f"LongRope.{name}={value!r} must be a sequence of numbers")
            value = tuple(float(v) for v in value)
            for v in value:
                _check_positive("LongRope", **{name: v})
            object.__setattr__(self, name, value)
        _check_int("LongRope", original_max_position=self.original_max_position)
        _check_positive("LongRope", attention_factor=self.attention_factor, factor=self.factor)


@dataclasses.dataclass(frozen=True)
class Proportional:
    """Gemma-style ``proportional``: the rotation spans the whole head, NeoX halves.

    The first ``int(partial_rotary_factor * rotary_dim // 2)`` pairs rotate at
    ``theta ** (-2i / rotary_dim)``; the other pairs get frequency zero (cos 1,
    sin 0: left as they are). All frequencies are divided by ``factor``.

    Args:
      factor: divisor of every frequency, > 0 (default 1.0).
      partial_rotary_factor: fraction of the pairs that rotate, in ``(0, 1]``
        (default 1.0).

    Raises:
      ValueError: naming the field, for a non-positive value or
        ``partial_rotary_factor > 1``.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0,
      ...                     scaling=jr.Proportional(partial_rotary_factor=0.5))
      >>> cfg.frequencies()[0].tolist()  # the second pair does not rotate
      [1.0, 0.0]
    """

    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        _check_positive("Proportional", factor=self.factor,
                        partial_rotary_factor=self.partial_rotary_factor)
        if self.partial_rotary_factor > 1:
            raise ValueError(f"Proportional.partial_rotary_factor={self.partial_rotary_factor!r} "
                             "must be <= 1")


Scaling = Union[None, Linear, DynamicNTK, Llama3, Yarn, LongRope, Proportional]
SCALING_TYPES = (Linear, DynamicNTK, Llama3, Yarn, LongRope, Proportional)
