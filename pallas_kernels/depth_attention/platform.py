"""The platform the depth-attention ops are built for, ``jax.default_backend()`` unless ``target``
says otherwise. It decides which implementation ``implementation=None`` picks (``api``), whether
a Pallas kernel runs compiled or in interpret mode (``_backend``), and how the reference writes
the conv's taps (``reference._conv_form``). An ahead-of-time compile for a device this machine
lacks (an H200 on a CPU machine, ``msar_jax.compile_check --topology=h200``) traces under
``target("gpu")`` to build what that device would run. ``target`` is read at trace time, and a
jitted function traced before with the same arguments comes from JAX's cache as it was: trace
for a target in a fresh process or after ``jax.clear_caches()``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

PLATFORMS = ("cpu", "gpu", "tpu")
_target: str | None = None


def current() -> str:
    """The platform ops are built for: ``target``'s, else ``jax.default_backend()``."""
    return _target or jax.default_backend()


@contextlib.contextmanager
def target(platform: str) -> Iterator[None]:
    """Build ops for ``platform`` (one of ``PLATFORMS``) while tracing inside this block."""
    global _target
    if platform not in PLATFORMS:
        raise ValueError(f"platform={platform!r}: must be one of {PLATFORMS}")
    old, _target = _target, platform
    try:
        yield
    finally:
        _target = old
