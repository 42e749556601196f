"""GPU implementation: Pallas' Triton lowering (kernels in ``fused.py``, ``fused_bwd_phase*.py``,
``conv_transpose.py``) and Mosaic GPU (the ``mosaic_gpu`` package), chosen per
kernel by ``gpu_kernels`` (``heuristics.GPU_KERNELS``; the per-kernel rules are
``heuristics.mosaic_phase1`` and ``mosaic_phase2``). Why Triton first, and where Mosaic GPU is faster:
docs/kernels.md §3."""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("triton", native_platform="gpu")

api.register("phase1", "pallas_gpu", phase1)
api.register("phase2", "pallas_gpu", phase2)
api.register("phase2_fused", "pallas_gpu", phase2_fused)
