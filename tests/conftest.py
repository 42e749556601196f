"""Shared pytest setup: run JAX on the CPU with 8 virtual host devices.

The environment variables must be set before jax is first imported, which is why
they live here (pytest imports conftest.py before any test module). float64 stays
off globally; tests that need it enable it locally and restore it.
"""

import os

# XLA:CPU's optimisation passes cost more than they save on the suite's tiny shapes (the
# model-level kernel test: 36 -> 22 s without them); results do not depend on them. Processes
# the tests start (notebook kernels, multi-process training) get them through
# MSAR_TEST_XLA_FLAGS. MSAR_TEST_XLA_OPT=1 keeps XLA's default optimisation.
FAST_XLA_FLAGS = "" if os.environ.get("MSAR_TEST_XLA_OPT") == "1" else (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
os.environ["MSAR_TEST_XLA_FLAGS"] = FAST_XLA_FLAGS
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '--xla_force_host_platform_device_count=8')} {FAST_XLA_FLAGS}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Synchronous dispatch on the CPU (read when the CPU client is made, so before any test runs).
# Pallas' GPU interpreter runs each kernel's barriers and copies as Python callbacks that
# dispatch JAX ops of their own; with asynchronous dispatch the test's thread can queue its next
# ops while an interpreted kernel is still running, and the slow suite can hang that way: the
# kernel's callback (``wait_smem_to_gmem``) and the test's next eager op each waiting in XLA
# (seen in ``test_item_decodes_agree``). The tests time nothing, so nothing is lost.
jax.config.update("jax_cpu_enable_async_dispatch", False)

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
