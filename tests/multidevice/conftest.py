"""Skips this directory's tests in a process without 8 devices.

tests/test_multidevice.py runs them in a child pytest started with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``; helpers are in ``meshes.py``.
"""

from __future__ import annotations

import pathlib

import jax
import pytest

from meshes import DEVICES

HERE = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # Called with the whole session's items: touch only this directory's.
    mine = [item for item in items if pathlib.Path(item.path).parent == HERE]
    if mine and jax.device_count() < DEVICES:
        skip = pytest.mark.skip(
            reason=f"needs {DEVICES} devices, this process has {jax.device_count()}: "
                   f"tests/test_multidevice.py runs these with "
                   f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}")
        for item in mine:
            item.add_marker(skip)
