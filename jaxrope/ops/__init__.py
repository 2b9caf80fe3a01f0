"""The kernels' ops, one folder each, and what they share.

==================================  ====================================================
``ops/rope/``                       :func:`jaxrope.apply_rope`
``ops/rope_append_kv/``             :func:`jaxrope.apply_rope_and_append_kv`
``ops/<op>/api.py``                 the public function: validate, pick, call
``ops/<op>/reference.py``           the XLA backend, which is also the test oracle
``ops/<op>/mosaic.py``              the Mosaic GPU kernel (Hopper+)
``ops/<op>/triton.py``              the Triton-lowered Pallas kernel
``ops/<op>/tuning.py``              each kernel's frozen tuning and its heuristic
``ops/<op>/*_export.py``            the kernel lowered for a launch from torch
``ops/backends.py``                 backend names and the one implementations table
``ops/constants.py``                what every kernel takes from a ``RopeConfig``
``ops/angle.py``                    the accurate angle every backend shares
``ops/mosaic_common.py``            layouts, loads, stores, walk, kernel, export (Mosaic)
``ops/triton_common.py``            block sizes, small-T rule, IR capture (Triton)
==================================  ====================================================
"""
