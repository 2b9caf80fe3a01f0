"""The fast paths of ``RopeManager``: compiled jaxrope kernels launched on torch's stream.

- :mod:`torch_bridge.launch.dispatch`: what a launcher is (the ``Launcher`` and
  ``KVLauncher`` protocols), which one ``launcher="auto"`` picks, and the bound launches
  a repeated call signature runs without the manager's checks;
- :mod:`torch_bridge.launch.mosaic`: the Mosaic GPU kernels (Hopper and newer), compiled
  by the JAX CUDA plugin's ``MosaicGpuCompile``;
- :mod:`torch_bridge.launch.triton`: the Triton-lowered kernels, compiled by Triton;
- :mod:`torch_bridge.launch.runtime`: what both share (count and angle tables, launch
  records, the operand checks, slots and M-RoPE positions as the kernels read them).

A launcher declines a call by raising :class:`jaxrope.BackendUnavailable`; the manager then
runs the JAX path (:mod:`torch_bridge.rotate`, :mod:`torch_bridge.kv_append`).
"""
