"""Every launch shape the sweeps try rotates exactly like the default one, compiled on the GPU.

The CPU suite checks the same through the Pallas interpreter
(``tests/test_apply.py::test_every_launch_shape_gives_the_same_rotation``); this runs
the compiled Triton kernel, launched from torch and through JAX, where a lowering bug
(a loop's bounds, the flattened program grid) would show.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrope.ops.constants import kernel_constants  # noqa: E402
from jaxrope.cases import BY_NAME  # noqa: E402
from jaxrope.ops.rope import triton as triton_rope  # noqa: E402
from jaxrope.ops.rope import tuning as rope_tuning  # noqa: E402
from jaxrope.testing import oracle  # noqa: E402

pytestmark = pytest.mark.gpu

# (block_tokens, heads_per_program, num_warps, groups, token_loop, heads_major)
SHAPES = [(1, 2, 1, 4, 4, False), (1, 2, 1, 4, 1, False), (1, 2, 1, 4, 8, True),
          (2, 2, 1, 2, 3, False), (4, 2, 2, 1, 2, True)]
TOKENS = 1001  # divides no token block or loop above


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "bt{}-hp{}-w{}-g{}-loop{}-hm{:d}".format(*s))
@pytest.mark.parametrize("name", ["llama3_8b", "gptj_interleave"])
def test_launch_shape_matches_the_default_bit_for_bit(device, name, shape):
    from torch_bridge.launch.triton import TritonLauncher

    cfg = BY_NAME[name].cfg
    gen = torch.Generator(device=device).manual_seed(len(name) + sum(map(int, shape)))
    q = torch.randn(TOKENS, 32, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(TOKENS, 8, cfg.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    pos = torch.randint(0, cfg.max_position, (TOKENS,), device=device, dtype=torch.int32,
                        generator=gen)
    launcher = TritonLauncher()
    want_q, want_k = q.clone(), k.clone()
    launcher.rotate_(want_q, want_k, pos, cfg)
    bt, hp, warps, groups, loop, major = shape
    block = rope_tuning.TritonTuning(bt, hp, warps, groups_per_program=groups, token_loop=loop,
                                      heads_major=major)
    got_q, got_k = q.clone(), k.clone()
    launcher.rotate_(got_q, got_k, pos, cfg, block=block)
    torch.cuda.synchronize(device)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert not torch.equal(got_q, q)  # something was rotated

    # The JAX path compiles the same kernel body through XLA's own Triton, whose float
    # contractions may differ from torch's Triton by an ulp: compare shapes within it.
    tables, attention = kernel_constants(cfg)
    jq, jk = (jnp.asarray(x.float().cpu().numpy(), jnp.bfloat16) for x in (q, k))
    jpos = jnp.asarray(pos.cpu().numpy())

    def through_jax(config):
        return jax.jit(lambda a, b: triton_rope.rope_triton(
            a, b, jpos, jnp.asarray(tables), rotary_dim=cfg.rotary_dim,
            interleave=cfg.interleave, attention_factor=attention, tuning=config))(jq, jk)

    (jax_q, jax_k), (default_q, default_k) = through_jax(block), through_jax(None)
    np.testing.assert_array_equal(np.asarray(jax_q, np.float32), np.asarray(default_q, np.float32))
    np.testing.assert_array_equal(np.asarray(jax_k, np.float32), np.asarray(default_k, np.float32))
    for x, got in ((q, got_q), (k, got_k)):
        expected = oracle.rope_oracle(x.float().cpu().numpy(), pos.cpu().numpy().astype(np.int64),
                                      *oracle.serving_frequencies(cfg), cfg.rotary_dim,
                                      cfg.interleave)
        np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=0, atol=2.0 ** -5)
