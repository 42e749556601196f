"""Mosaic TPU implementation: ``pl.pallas_call`` with BlockSpecs and
``pltpu.CompilerParams(dimension_semantics=...)`` (kernels in ``fused.py``).

Verified only in interpret mode (no TPU here). **It does not lower for a real TPU yet**
(checked on CPU with ``jit(...).lower(lowering_platforms=("tpu",))``, 2026-11-29): Mosaic
wants the last two dimensions of every block either equal to the array's or divisible by
8 and 128, and several blocks here put a squeezed batch row or a channel-chunk index in
those places (``sumsq`` ``(n, m, None, bt)``, the segment ids ``(None, T)``, the gate
statistics ``(None, bt, None)``). A trailing singleton axis fixes the BlockSpecs (e.g.
``sumsq[n, m, B, T, 1]``); the kernel bodies' 1-D per-token vectors and cross-lane sums
would then meet Mosaic's own layout rules. Also: the source BlockSpec spans the whole token
axis of one batch row (``[n, T, d]`` per program in the scores kernel), which overflows VMEM
at long T; a TPU-tuned version would DMA ``block_t + halo`` rows per program instead.
"""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("tpu", native_platform="tpu")

api.register("phase1", "pallas_tpu", phase1)
api.register("phase2", "pallas_tpu", phase2)
api.register("phase2_fused", "pallas_tpu", phase2_fused)
