"""Test and benchmark support: the float64 oracle, the FlashInfer adapter
(:mod:`jaxrope.testing.flashinfer`), the parity bounds (:mod:`jaxrope.testing.flashinfer_bounds`)
and FlashInfer's recorded outputs (:mod:`jaxrope.testing.golden`).

Importable by the tests and by ``bench/`` alike (bench never imports from ``tests``).
Needs numpy and jaxrope only; torch and FlashInfer are imported inside the functions
of :mod:`jaxrope.testing.flashinfer` that call them.
"""
