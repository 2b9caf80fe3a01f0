"""Benchmarks and GPU checks of jaxrope."""
