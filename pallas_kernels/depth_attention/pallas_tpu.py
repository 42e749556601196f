"""Mosaic TPU implementation: ``pl.pallas_call`` with BlockSpecs and
``pltpu.CompilerParams(dimension_semantics=..., vmem_limit_bytes=...)``, for the kernels of
``fused.py``, ``fused_bwd_phase1.py``, ``fused_bwd_phase2.py`` and ``conv_transpose.py``. Run here in
interpret mode; forward and backward compile for TPU v5e and v5p with libtpu's ahead-of-time
compiler on a CPU machine (``benchmarks/tpu_kernels_aot.py``), and nothing has run on a TPU. T
tiled with a conv halo block, heads padded to 128 lanes, tiles and ``vmem_limit_bytes`` from the
chip's VMEM (``tpu_blocks``): docs/kernels.md §4, "Techniques the kernels share" and "Mosaic TPU
tiling"."""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("tpu", native_platform="tpu")

api.register("phase1", "pallas_tpu", phase1)
api.register("phase2", "pallas_tpu", phase2)
api.register("phase2_fused", "pallas_tpu", phase2_fused)
