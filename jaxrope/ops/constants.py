"""What every kernel takes from a :class:`jaxrope.RopeConfig`: the float32 angle tables (an
operand) and the static keywords (rotary dims, layout, attention factor, M-RoPE
sections), one rule for both ops, their backends and their exports."""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import numpy as np

from jaxrope.config import RopeConfig
from jaxrope.frequencies import angle_tables


@functools.lru_cache(maxsize=256)
def kernel_constants(cfg: RopeConfig) -> Tuple[np.ndarray, float]:
    """float32 angle tables ``[3, R/2]`` and the attention factor the kernels use for ``cfg``.

    Keyed by the whole (frozen) config, so two configs that differ in any field never
    share an entry.
    """
    inv_freq, attention = cfg.serving_frequencies()
    tables = angle_tables(inv_freq)
    tables.setflags(write=False)
    return tables, attention


def kernel_options(cfg: RopeConfig) -> Dict[str, Any]:
    """The static keywords every kernel body and export takes from ``cfg``:
    ``rotary_dim``, ``interleave``, ``attention_factor`` (of :func:`kernel_constants`),
    ``mrope_section`` and ``mrope_interleaved``."""
    _, attention = kernel_constants(cfg)
    return dict(rotary_dim=cfg.rotary_dim, interleave=cfg.interleave,
                attention_factor=attention, mrope_section=cfg.mrope_section,
                mrope_interleaved=cfg.mrope_interleaved)
