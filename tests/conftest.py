"""Shared pytest setup: run JAX on the CPU with 8 virtual host devices.

The environment variables must be set before jax is first imported, which is why
they live here (pytest imports conftest.py before any test module). float64 stays
off globally; tests that need it enable it locally and restore it.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
