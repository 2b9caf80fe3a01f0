"""Bad input to apply_rope and the position tables it reads (positions, RowMap): each
refused naming the argument, nothing changed (:mod:`bad_input_harness`)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxrope as jr
from jaxrope import positions
from jaxrope.positions import RowMap

from bad_input_harness import Bad, core_raises_naming_it_and_changes_nothing


def _rope(env, **changes):
    args = dict(q=env.q, k=env.k, pos_ids=env.pos_ids, cfg=env.cfg)
    args.update(changes)
    backend = args.pop("backend", "auto")
    return jr.apply_rope(args["q"], args["k"], args["pos_ids"], args["cfg"], backend=backend)


APPLY_ROPE_CASES = [
    Bad("apply_rope q of rank 2", lambda e: _rope(e, q=e.q[:, 0]), ValueError, "q.shape=(5, 16)"),
    Bad("apply_rope integer q", lambda e: _rope(e, q=e.q.astype(jnp.int32)),
        ValueError, "q.dtype=int32"),
    Bad("apply_rope k head_dim differs from cfg", lambda e: _rope(e, k=e.k[..., :8]), ValueError,
        "k.shape[2]=8"),
    Bad("apply_rope k with fewer tokens", lambda e: _rope(e, k=e.k[:4]),
        ValueError, "k.shape[0]=4"),
    Bad("apply_rope k dtype differs from q", lambda e: _rope(e, k=e.k.astype(jnp.bfloat16)),
        ValueError, "k.dtype=bfloat16"),
    Bad("apply_rope pos_ids of the wrong length", lambda e: _rope(e, pos_ids=e.pos_ids[:3]),
        ValueError, "pos_ids.shape=(3,)"),
    Bad("apply_rope float pos_ids", lambda e: _rope(e, pos_ids=e.pos_ids.astype(jnp.float32)),
        ValueError, "pos_ids.dtype=float32"),
    Bad("apply_rope negative position", lambda e: _rope(e, pos_ids=e.pos_ids.at[2].set(-1)),
        ValueError, "pos_ids must lie in [0, 1024)"),
    Bad("apply_rope position at max_position", lambda e: _rope(e, pos_ids=e.pos_ids.at[0].set(1024)),
        ValueError, "pos_ids must lie in [0, 1024)"),
    Bad("apply_rope cfg of the wrong type", lambda e: _rope(e, cfg={"head_dim": 16}), TypeError,
        "cfg must be a RopeConfig"),
    Bad("apply_rope q as a list", lambda e: _rope(e, q=[[[0.5] * 16]]),
        TypeError, "q must be an array"),
    Bad("apply_rope unknown backend", lambda e: _rope(e, backend="cuda"),
        ValueError, "backend='cuda'"),
    Bad("apply_rope triton backend off GPU", lambda e: _rope(e, backend="triton"),
        NotImplementedError, "backend='triton' needs a GPU"),
    Bad("apply_rope pallas, no backend name", lambda e: _rope(e, backend="pallas"),
        ValueError, "the Pallas kernels are 'triton' and 'mosaic'"),
    Bad("positions.init zero capacity", lambda e: positions.init(0), ValueError, "capacity=0"),
    Bad("positions.grow to a smaller capacity", lambda e: positions.grow(e.table, 4), ValueError,
        "capacity=4"),
    Bad("RowMap zero capacity", lambda e: RowMap(0), ValueError, "capacity=0"),
    Bad("pad_rows past its bucket", lambda e: positions.pad_rows([1, 2, 3], 2), ValueError,
        "bucket of size=2"),
]


@pytest.mark.parametrize("case", APPLY_ROPE_CASES, ids=lambda c: c.name)
def test_apply_rope_bad_input_raises_naming_the_argument_and_changes_nothing(case):
    if case.name.startswith("apply_rope triton") and jnp.zeros(()).devices().pop().platform == "gpu":
        pytest.skip("the Triton-lowered backend is available on this GPU")
    core_raises_naming_it_and_changes_nothing(case)
