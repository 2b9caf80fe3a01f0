"""RoPE: :func:`jaxrope.apply_rope` (``api``), its XLA reference, its Mosaic GPU and
Triton-lowered kernels, their tunings and their exports for the torch launch."""
