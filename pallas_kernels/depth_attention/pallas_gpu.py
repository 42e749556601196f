"""GPU implementation: Pallas' Triton lowering (kernels in ``fused.py``, ``fused_bwd_phase*.py``,
``conv_transpose.py``) and Mosaic GPU (the ``mosaic_gpu`` package), chosen per
kernel by ``gpu_kernels`` (``_backend.GPU_KERNELS``; for one stream
``_backend.SINGLE_STREAM_MOSAIC_PHASE1``). Why Triton first, and where Mosaic GPU is faster:
docs/kernels.md §3."""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("triton", native_platform="gpu")

api.register("phase1", "pallas_gpu", phase1)
api.register("phase2", "pallas_gpu", phase2)
api.register("phase2_fused", "pallas_gpu", phase2_fused)
