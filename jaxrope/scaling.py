"""RoPE scaling variants: one frozen, hashable dataclass per HF ``rope_type``.

Each variant is plain data; the arithmetic that turns it into inverse frequencies
lives in :mod:`jaxrope.frequencies`. Field names follow HF transformers' rope
parameters, with ``original_max_position_embeddings`` shortened to
``original_max_position``.

Every variant validates its fields at construction, naming the field: ``TypeError``
for a value of the wrong type, ``ValueError`` for a bad value. Numbers may be Python or
numpy scalars; they are stored as Python ``int`` / ``float``. A variant only takes effect through :class:`jaxrope.RopeConfig`, whose
``frequencies()`` returns float64 ``inv_freq [R/2]`` and the attention factor.

Example:
  >>> import jaxrope as jr
  >>> jr.Llama3() == jr.Llama3(factor=8.0), hash(jr.Linear(2.0)) == hash(jr.Linear(2.0))
  (True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

from jaxrope.numbers import as_float, as_int


def _positive_floats(obj, **values: Optional[float]) -> None:
    """Check and normalise float fields of a frozen variant (None passes through)."""
    owner = type(obj).__name__
    for name, value in values.items():
        if value is None:
            continue
        number = as_float(value, f"{owner}.{name}")
        if number <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be > 0")
        object.__setattr__(obj, name, number)


def _positive_ints(obj, **values: int) -> None:
    owner = type(obj).__name__
    for name, value in values.items():
        number = as_int(value, f"{owner}.{name}")
        if number <= 0:
            raise ValueError(f"{owner}.{name}={value!r} must be a positive int")
        object.__setattr__(obj, name, number)


@dataclasses.dataclass(frozen=True)
class Linear:
    """Position interpolation: every inverse frequency is divided by ``factor``.

    Args:
      factor: the divisor, a finite number > 0 (no default).

    Raises:
      TypeError: ``factor`` is not a number.
      ValueError: ``factor`` is not a finite number > 0.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0, scaling=jr.Linear(2.0))
      >>> cfg.frequencies()[0].tolist()  # unscaled: [1.0, 0.1]
      [0.5, 0.05]
    """

    factor: float

    def __post_init__(self) -> None:
        _positive_floats(self, factor=self.factor)


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
      TypeError: naming the field, for a value of the wrong type.
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
        _positive_floats(self, factor=self.factor)
        _positive_ints(self, original_max_position=self.original_max_position)


@dataclasses.dataclass(frozen=True)
class Llama3:
    """Llama 3.1: low frequencies divided by ``factor``, high ones kept, a smooth band between.

    Defaults are Llama 3.1's: ``factor=8.0``, ``low_freq_factor=1.0``,
    ``high_freq_factor=4.0``, ``original_max_position=8192``. Wavelengths above
    ``original_max_position / low_freq_factor`` are scaled, those below
    ``original_max_position / high_freq_factor`` are kept. ``high_freq_factor ==
    low_freq_factor`` (Llama 4 Scout) leaves no band between: a step at
    ``original_max_position / low_freq_factor``, as transformers computes it.

    Raises:
      TypeError: naming the field, for a value that is not a number.
      ValueError: naming the field, for a non-positive value or
        ``high_freq_factor < low_freq_factor``.

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
        _positive_floats(self, factor=self.factor, low_freq_factor=self.low_freq_factor,
                         high_freq_factor=self.high_freq_factor)
        _positive_ints(self, original_max_position=self.original_max_position)
        if self.high_freq_factor < self.low_freq_factor:
            raise ValueError(f"Llama3.high_freq_factor={self.high_freq_factor!r} must be >= "
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
      TypeError: naming the field, for a value that is not a number, or a non-bool
        ``truncate``.
      ValueError: naming the field, for a non-positive value.

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
        _positive_floats(self, factor=self.factor, beta_fast=self.beta_fast,
                         beta_slow=self.beta_slow, mscale=self.mscale,
                         mscale_all_dim=self.mscale_all_dim, attention_factor=self.attention_factor)
        _positive_ints(self, original_max_position=self.original_max_position)
        if not isinstance(self.truncate, bool):
            raise TypeError(f"Yarn.truncate={self.truncate!r} must be a bool")


LONGROPE_FACTORS = ("auto", "short", "long")


@dataclasses.dataclass(frozen=True)
class LongRope:
    """Phi-3 LongRoPE: per-frequency divisors, ``short_factor`` or ``long_factor``.

    Which set the kernels use is a serving policy, ``factors``:

    - ``"auto"`` (default), vLLM's rule: the long factors when the config serves past
      the original length (:attr:`RopeConfig.max_position` ``> original_max_position``),
      the short ones otherwise; fixed once per config, so a key already in the KV
      cache is never rotated two ways. ``from_hf`` of Phi-3.5-mini serves 131072
      positions and so takes the long factors: a prompt that fits in 4096 tokens
      rotates differently from transformers (which uses the short factors there).
    - ``"short"`` / ``"long"``: that set, whatever the length.

    transformers' rule is per forward call: the long factors once the longest
    sequence in it exceeds ``original_max_position`` (``max(pos_ids) + 1 >
    original_max_position``), the short ones otherwise, for every token of the call;
    keys cached before the switch keep their short rotation. A position manager
    knows each stream's length and can follow it with two configs,
    ``factors="short"`` for streams that stay within ``original_max_position`` and
    ``factors="long"`` for longer ones (no per-token choice inside one call).

    :meth:`RopeConfig.frequencies` with ``seq_len`` follows transformers' rule under
    ``"auto"``, and returns the fixed set otherwise.

    The attention factor is ``sqrt(1 + ln(factor) / ln(original_max_position))``
    (1 for ``factor <= 1``) unless ``attention_factor`` is given. ``factor`` is the
    model's extension ratio; ``from_hf`` sets it from the config's lengths
    (``max_position_embeddings / original_max_position_embeddings`` when the config
    has no ``factor``), so serving fewer positions never changes it. None (for
    hand-built configs) means ``RopeConfig.max_position / original_max_position``.

    Args:
      short_factor, long_factor: ``R/2`` positive divisors each (any sequence of
        numbers, numpy arrays included; stored as tuples of floats).
      original_max_position: positive int, the pre-training length.
      attention_factor: explicit attention factor, or None (default) to derive it.
      factor: None (default) or a number > 0, see above.
      factors: ``"auto"`` (default), ``"short"`` or ``"long"``, see above.

    Raises:
      TypeError: naming the field, for a non-sequence, an entry that is not a number
        or a ``factors`` that is not a string.
      ValueError: naming the field, for a non-positive entry or an unknown ``factors``.

    Example:
      >>> import jaxrope as jr
      >>> cfg = jr.RopeConfig(head_dim=4, theta=100.0, max_position=8192,
      ...                     scaling=jr.LongRope((1.0, 2.0), (4.0, 8.0), 4096))
      >>> cfg.frequencies(seq_len=4096)[0].tolist()  # transformers' rule: short factors
      [1.0, 0.05]
      >>> cfg.serving_frequencies()[0].tolist()  # "auto" serves 8192 > 4096: long factors
      [0.25, 0.0125]
      >>> short = jr.LongRope((1.0, 2.0), (4.0, 8.0), 4096, factors="short")
      >>> jr.RopeConfig(head_dim=4, theta=100.0, max_position=8192,
      ...               scaling=short).serving_frequencies()[0].tolist()
      [1.0, 0.05]
    """

    short_factor: Tuple[float, ...]
    long_factor: Tuple[float, ...]
    original_max_position: int
    attention_factor: Optional[float] = None
    factor: Optional[float] = None
    factors: str = "auto"

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(f"LongRope.{name}={value!r} must be a sequence of numbers")
            entries = []
            for i, entry in enumerate(value):
                number = as_float(entry, f"LongRope.{name}[{i}]")
                if number <= 0:
                    raise ValueError(f"LongRope.{name}[{i}]={entry!r} must be > 0")
                entries.append(number)
            object.__setattr__(self, name, tuple(entries))
        _positive_ints(self, original_max_position=self.original_max_position)
        _positive_floats(self, attention_factor=self.attention_factor, factor=self.factor)
        if not isinstance(self.factors, str):
            raise TypeError(f"LongRope.factors={self.factors!r} must be a str, one of "
                            f"{LONGROPE_FACTORS}")
        if self.factors not in LONGROPE_FACTORS:
            raise ValueError(f"LongRope.factors={self.factors!r} must be one of {LONGROPE_FACTORS}")


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
      TypeError: naming the field, for a value that is not a number.
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
        _positive_floats(self, factor=self.factor,
                         partial_rotary_factor=self.partial_rotary_factor)
        if self.partial_rotary_factor > 1:
            raise ValueError(f"Proportional.partial_rotary_factor={self.partial_rotary_factor!r} "
                             "must be <= 1")


Scaling = Union[None, Linear, DynamicNTK, Llama3, Yarn, LongRope, Proportional]
SCALING_TYPES = (Linear, DynamicNTK, Llama3, Yarn, LongRope, Proportional)
