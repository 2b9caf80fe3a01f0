import os

os.environ.setdefault("JAX_PLATFORMS", "cpu" if not os.environ.get("JAXROPE_GPU_TESTS") else "")
