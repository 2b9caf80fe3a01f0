"""Helpers of the 8-device tests: meshes and what a compiled module's text shows."""

from __future__ import annotations

import math
import re

import jax

DEVICES = 8
# Any cross-device op XLA can emit; the async forms (all-gather-start, ...) contain these.
COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter"
                        r"|collective-broadcast|ragged-all-to-all)\b")
AXIS_TYPES = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}


def collectives(compiled_text: str) -> list:
    """The cross-device ops named in a compiled HLO module's text."""
    return sorted(set(COLLECTIVE.findall(compiled_text)))


def aliased_parameters(compiled_text: str) -> list:
    """Entry parameters the compiled module writes its outputs into (donation honoured)."""
    header = compiled_text.splitlines()[0]  # input_output_alias={ {0}: (0, {}, may-alias), ...
    return sorted({int(p) for p in re.findall(r": \((\d+), \{[^}]*\}, \w+-alias\)", header)})


def mesh(axis_type: str, shape=(2, 4), names=("data", "model")):
    """A mesh of ``shape`` over the first devices, every axis ``"auto"`` or ``"explicit"``."""
    return jax.make_mesh(shape, names, axis_types=(AXIS_TYPES[axis_type],) * len(names),
                         devices=jax.devices()[:math.prod(shape)])
