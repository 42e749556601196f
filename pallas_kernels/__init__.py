"""Standalone Pallas kernels for depth-wise residual mechanisms.

This package never imports ``msar_jax``: it takes plain arrays and static
options, so it can be reused by any model. Layout follows tokamax: one folder
per op with ``api.py`` (the public entry with ``implementation=``),
``reference.py`` (plain jnp: the oracle and the XLA/CPU path) and the kernels.
"""
