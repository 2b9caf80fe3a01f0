"""RoPE fused with the paged KV-cache append: :func:`jaxrope.apply_rope_and_append_kv`
(``api``), the cache layouts, its XLA reference, its Mosaic GPU and Triton-lowered
kernels, their tunings and their exports for the torch launch."""
