"""MLA (DeepSeek's multi-head latent attention) RoPE fused with its paged cache append:
:func:`jaxrope.apply_mla_rope_and_append` (``api``) and its XLA reference (``reference``)."""
