"""One-off experiments: kernels and probes kept out of the package (not in the wheel)."""
