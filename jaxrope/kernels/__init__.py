"""RoPE kernels: the XLA reference and the Pallas GPU kernel, one signature for all."""
