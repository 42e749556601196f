"""The ``parallel`` config section: defaults and the checks that need no devices.

Kept free of jax so that config files (``configs/common.py``) can build the section without
importing jax (``msar_jax.compile_check`` sets ``XLA_FLAGS`` before jax is first imported).
The fields ``mesh``, ``pipeline`` and ``distributed`` and their rules: docs/parallelism.md
section 1, "The ``parallel`` config section".
"""

from __future__ import annotations

import ml_collections

from msar_jax.config import ConfigError

MESH_AXES = ("data", "stage", "fsdp", "tensor")  # outer (slow links) to inner (fast links)
INITIALIZE_MODES = ("auto", "always", "never")


def parallel_config() -> ml_collections.ConfigDict:
    """Defaults of the ``parallel`` config section: mesh degrees and the pipeline."""
    return ml_collections.ConfigDict(dict(
        mesh=dict(data=1, stage=1, fsdp=1, tensor=1),  # degrees; one of them may be -1 (the rest)
        pipeline=dict(
            stages=1,  # pipeline stages (a multiple of mesh.stage); 1 = no pipeline
            repeats=1,  # circular (virtual) stages per device; 1 = GPipe
            microbatches=1,  # microbatches per global batch; a multiple of stages
            cache=True,  # circular: keep received block summaries, send only the new ones
        ),
        distributed=dict(
            initialize="auto",  # "auto" (when the environment names a cluster), "always", "never"
        ),
    ))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_degrees(mesh_cfg) -> tuple[int, ...]:
    """The raw degrees in ``MESH_AXES`` order (``-1`` kept); ``ConfigError`` on a bad value."""
    degrees = []
    for name in MESH_AXES:
        value = mesh_cfg[name]
        if not _is_int(value) or (value < 1 and value != -1):
            raise ConfigError(f"parallel.mesh.{name}", value, "must be a positive integer or -1 (the rest)")
        degrees.append(value)
    if degrees.count(-1) > 1:
        raise ConfigError("parallel.mesh", dict(zip(MESH_AXES, degrees)), "at most one axis may be -1")
    return tuple(degrees)


def check(pcfg) -> None:
    """Device-free checks of a ``parallel`` section (``ConfigError`` naming the field)."""
    check_degrees(pcfg.mesh)
    for name in ("stages", "repeats", "microbatches"):
        value = pcfg.pipeline[name]
        if not _is_int(value) or value < 1:
            raise ConfigError(f"parallel.pipeline.{name}", value, "must be a positive integer")
    mode = pcfg.distributed.initialize
    if mode not in INITIALIZE_MODES:
        raise ConfigError("parallel.distributed.initialize", mode, f"must be one of {INITIALIZE_MODES}")
