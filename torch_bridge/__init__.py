"""torch_bridge: the PyTorch-facing RopeManager over the jaxrope core (the only torch importer)."""
