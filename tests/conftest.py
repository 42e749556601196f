"""Shared pytest setup: run JAX on the CPU with 8 virtual host devices.

The environment variables must be set before jax is first imported, which is why
they live here (pytest imports conftest.py before any test module). float64 stays
off globally; tests that need it enable it locally and restore it.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def fast_train_compile():
    """Compile the training step without XLA's expensive CPU optimisation passes (about half
    the compile time; used by the training, config and experiment tests)."""
    from msar_jax.train import step

    old = step.COMPILER_OPTIONS
    step.COMPILER_OPTIONS = step.FAST_COMPILE
    yield
    step.COMPILER_OPTIONS = old
