"""RoPE scaling variants: one frozen, hashable dataclass per HF ``rope_type``.

Each variant is plain data; the arithmetic that turns it into inverse frequencies
lives in :mod:`jaxrope.frequencies`. Field names follow HF transformers' rope
parameters, with ``original_max_position_embeddings`` shortened to
``original_max_position``.
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
    """Position interpolation: every inverse frequency is divided by ``factor``."""

    factor: float

    def __post_init__(self) -> None:
        _check_positive("Linear", factor=self.factor)


@dataclasses.dataclass(frozen=True)
class DynamicNTK:
    """HF ``dynamic``: the base grows with the sequence length seen.

    ``original_max_position`` is the length the model was trained at (HF's
    ``max_position_embeddings``). The frequencies depend on the sequence length;
    kernels fix it at :attr:`RopeConfig.max_position` (see ``frequencies``).
    """

    factor: float
    original_max_position: int

    def __post_init__(self) -> None:
        _check_positive("DynamicNTK", factor=self.factor)
        _check_int("DynamicNTK", original_max_position=self.original_max_position)


@dataclasses.dataclass(frozen=True)
class Llama3:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth band between."""

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
