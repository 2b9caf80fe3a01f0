"""The recorded FlashInfer outputs (``tests/data/flashinfer_golden.npz``) that CPU CI replays.

``bench/record_goldens.py`` runs FlashInfer on the GPU machine over the cases of
:mod:`jaxrope.testing.flashinfer` and saves them with :func:`save_golden`;
``tests/test_golden.py`` and ``tests/test_conventions.py`` read them back through
:func:`golden_record`. Arrays are stored as their bits, so a recording round-trips
exactly; a file written with ``--fake-flashinfer`` (the float64 oracle standing in) is
refused unless ``$JAXROPE_ALLOW_FAKE_GOLDEN=1``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

import jaxrope as jr
from jaxrope.scaling import SCALING_TYPES
from jaxrope.testing.flashinfer import DTYPE, Batch


# -- golden file format ------------------------------------------------------------------

GOLDEN_FORMAT = 1


def config_to_json(cfg: jr.RopeConfig) -> Dict[str, object]:
    scaling = None
    if cfg.scaling is not None:
        scaling = {"type": type(cfg.scaling).__name__, **dataclasses.asdict(cfg.scaling)}
    return {"head_dim": cfg.head_dim, "rotary_dim": cfg.rotary_dim, "theta": cfg.theta,
            "interleave": cfg.interleave, "max_position": cfg.max_position, "scaling": scaling}


def config_from_json(data: Mapping[str, object]) -> jr.RopeConfig:
    data = dict(data)
    scaling = data.pop("scaling")
    if scaling is not None:
        scaling = dict(scaling)
        kind = {t.__name__: t for t in SCALING_TYPES}[scaling.pop("type")]
        scaling = kind(**{k: tuple(v) if isinstance(v, list) else v for k, v in scaling.items()})
    return jr.RopeConfig(scaling=scaling, **data)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


@dataclasses.dataclass
class Recorded:
    """One recorded case: inputs, FlashInfer's outputs, the call's arguments."""

    name: str
    api: str
    cfg: jr.RopeConfig
    dtype: str
    q: np.ndarray
    k: np.ndarray
    q_out: np.ndarray
    k_out: np.ndarray
    batch: Batch
    kwargs: Dict[str, object]
    cache: Optional[Tuple[np.ndarray, np.ndarray]] = None
    dense_cache: bool = False


def save_golden(path, records: Sequence[Recorded], meta: Mapping[str, object]) -> None:
    arrays = {"meta": np.array(json.dumps({**meta, "format": GOLDEN_FORMAT,
                                           "cases": [r.name for r in records]}))}
    for r in records:
        spec = {"api": r.api, "cfg": config_to_json(r.cfg), "dtype": r.dtype, "kwargs": r.kwargs,
                "dense_cache": r.dense_cache}
        arrays[f"{r.name}__spec"] = np.array(json.dumps(spec))
        for key in ("q", "k", "q_out", "k_out"):
            arrays[f"{r.name}__{key}"] = _bits(getattr(r, key))
        arrays[f"{r.name}__indptr"] = r.batch.indptr
        arrays[f"{r.name}__offsets"] = r.batch.offsets
        arrays[f"{r.name}__pos_ids"] = r.batch.pos_ids
        if r.cache is not None:
            arrays[f"{r.name}__cos_sin_cache"], arrays[f"{r.name}__cache_rows"] = r.cache
    np.savez_compressed(path, **arrays)


def load_golden(path) -> Tuple[Dict[str, object], List[Recorded]]:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != GOLDEN_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r}, expected {GOLDEN_FORMAT}")
        records = []
        for name in meta["cases"]:
            spec = json.loads(str(data[f"{name}__spec"]))
            dtype = DTYPE[spec["dtype"]]
            cache = None
            if f"{name}__cos_sin_cache" in data:
                cache = (data[f"{name}__cos_sin_cache"], data[f"{name}__cache_rows"])
            records.append(Recorded(
                name=name, api=spec["api"], cfg=config_from_json(spec["cfg"]), dtype=spec["dtype"],
                **{key: data[f"{name}__{key}"].view(dtype) for key in ("q", "k", "q_out", "k_out")},
                batch=Batch(data[f"{name}__indptr"], data[f"{name}__offsets"],
                            data[f"{name}__pos_ids"]),
                kwargs=spec["kwargs"], cache=cache, dense_cache=spec["dense_cache"]))
    return meta, records


# -- the committed golden file -----------------------------------------------------------

GOLDEN_PATH_ENV = "JAXROPE_GOLDEN"
ALLOW_FAKE_ENV = "JAXROPE_ALLOW_FAKE_GOLDEN"
_MISSING = "golden-file-missing"
_golden_cache: Dict[str, Tuple[Dict[str, object], Dict[str, Recorded]]] = {}


def golden_path():
    """``tests/data/flashinfer_golden.npz``, or ``$JAXROPE_GOLDEN``."""
    import os
    import pathlib
    # The recording lives with the tests of a source checkout: <repo>/tests/data.
    default = (pathlib.Path(__file__).resolve().parents[2] / "tests" / "data"
               / "flashinfer_golden.npz")
    return pathlib.Path(os.environ.get(GOLDEN_PATH_ENV, default))


def _golden():
    path = golden_path()
    key = str(path)
    if key not in _golden_cache:
        meta, records = load_golden(path)
        _golden_cache[key] = (meta, {r.name: r for r in records})
    return _golden_cache[key]


def golden_record_names() -> List[str]:
    """Recorded case names, for parametrize; one placeholder that fails when the file is missing."""
    if not golden_path().exists():
        return [_MISSING]
    return list(_golden()[1])


def golden_meta() -> Dict[str, object]:
    """The file's metadata; fails the test if the file is missing or was made without FlashInfer."""
    import os

    import pytest
    path = golden_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: CI checks FlashInfer parity from it. Record it on the "
                    "GPU machine: bash bench/gpu_suite.sh <logdir> (runs bench/record_goldens.py)")
    meta = _golden()[0]
    if meta.get("fake") and os.environ.get(ALLOW_FAKE_ENV) != "1":
        pytest.fail(f"{path} was written by record_goldens.py --fake-flashinfer (the float64 "
                    "oracle standing in for FlashInfer); it must never be the committed file")
    return meta


def golden_record(name: str) -> Recorded:
    golden_meta()
    return _golden()[1][name]
