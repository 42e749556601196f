"""Mosaic TPU implementation: ``pl.pallas_call`` with BlockSpecs and
``pltpu.CompilerParams(dimension_semantics=...)`` (kernels in ``fused.py``).

Verified only in interpret mode (no TPU here). Known limit for real TPUs: the
source BlockSpec spans the whole token axis of one batch row (``[n, T, d]`` per
program in the scores kernel), which overflows VMEM at long T; a TPU-tuned version
would DMA ``block_t + halo`` rows per program instead.
"""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("tpu", native_platform="tpu")

api.register("phase1", "pallas_tpu", phase1)
api.register("phase2", "pallas_tpu", phase2)
api.register("phase2_fused", "pallas_tpu", phase2_fused)
