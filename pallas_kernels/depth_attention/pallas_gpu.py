"""GPU implementation: Pallas' Triton lowering (kernels in ``fused.py``, ``fused_bwd_phase*.py``,
``conv_transpose.py``) and Mosaic GPU (``mosaic_gpu.py``, ``mosaic_gpu_bwd1.py``), chosen per
kernel by ``gpu_kernels`` (``_backend.GPU_KERNELS``).

Why Triton first: the kernels are elementwise conv taps, row reductions and scalar-weighted
accumulations with a causal halo along tokens; no matrix unit work. The Triton lowering
expresses the halo as masked loads at negative offsets and compiles from the same kernel body
as the TPU path. It is deprecated in jax 0.11 but present in the pinned 0.11.2.

Why Mosaic GPU where ``"auto"`` takes it: TMA pipelines with shared-memory lag windows ran
faster on the H200 than Triton's kernels for MSAR's phase 2 forward (1.27-1.30x), then phase
1's passes, phase 2's backward and the transpose (each timed before it was taken; docs/kernels.md).
For one stream (AttnRes, MHAR) the comparison is per kernel: phase 1's
scoring pass and its backward's passes 2 and 4 are faster in Mosaic GPU, its mixing pass and
phase 2's kernels in Triton (``_backend.SINGLE_STREAM_MOSAIC_PHASE1``).
"""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("triton", native_platform="gpu")

api.register("phase1", "pallas_gpu", phase1)
api.register("phase2", "pallas_gpu", phase2)
api.register("phase2_fused", "pallas_gpu", phase2_fused)
