"""M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4.1V) on the host: prompt positions and
HF config fields.

- :func:`rope_index`: positions ``[3, L]`` and the decode delta of a prompt given as
  :class:`Text`, :class:`Image` and :class:`Video` parts (:mod:`jaxrope.mrope.index`);
- :func:`hf_mrope_args`, :func:`hf_index_args`, :func:`hf_text_config`: what a HF
  ``config.json`` says about M-RoPE, for the model types :data:`HF_MODEL_TYPES`
  (:mod:`jaxrope.mrope.hf`; :meth:`jaxrope.RopeConfig.from_hf` reads them through it);
- :func:`mrope_rows`: the row of ``[3, T]`` each frequency pair reads, for a rotation
  written outside the kernels (:mod:`jaxrope.mrope.sections`).

Real VL configs' RoPE fields are :data:`jaxrope.models.HF_VL_CONFIGS`.

The rotation itself is :func:`jaxrope.apply_rope` with a :class:`jaxrope.RopeConfig`
whose ``mrope_section`` is set, and ``pos_ids [3, T]``.

Example:
  >>> import jax.numpy as jnp, jaxrope as jr
  >>> from jaxrope import mrope
  >>> pos, delta = mrope.rope_index([mrope.Text(3), mrope.Image((1, 4, 4))],
  ...                               family="qwen2_vl", spatial_merge_size=2)
  >>> cfg = jr.RopeConfig(head_dim=128, theta=1e6, mrope_section=(16, 24, 24))
  >>> q = k = jnp.ones((pos.shape[1], 2, 128), jnp.bfloat16)
  >>> jr.apply_rope(q, k, jnp.asarray(pos), cfg)[0].shape, delta
  ((7, 2, 128), -2)
"""

from jaxrope.mrope.hf import HF_MODEL_TYPES, hf_index_args, hf_mrope_args, hf_text_config
from jaxrope.mrope.index import ADVANCES, FAMILIES, Image, Text, Video, rope_index
from jaxrope.mrope.sections import mrope_rows

__all__ = [
    "ADVANCES",
    "FAMILIES",
    "HF_MODEL_TYPES",
    "Image",
    "Text",
    "Video",
    "hf_index_args",
    "hf_mrope_args",
    "hf_text_config",
    "mrope_rows",
    "rope_index",
]
