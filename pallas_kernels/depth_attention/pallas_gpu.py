"""GPU implementation: Pallas' Triton lowering (kernels in ``fused.py``), and Mosaic GPU for
phase 2's fused forward with several streams (``mosaic_gpu.py``).

Why Triton first: the kernels are elementwise conv taps, row reductions and scalar-weighted
accumulations with a causal halo along tokens; no matrix unit work. The Triton lowering
expresses the halo as masked loads at negative offsets and compiles from the same kernel body
as the TPU path. It is deprecated in jax 0.11 but present in the pinned 0.11.2.

Measured against Mosaic GPU (``plgpu.kernel``): a prototype of phase 2's scoring pass with a
TMA pipeline and one shared-memory window per conv lag ran 1.55-1.70x faster than the Triton
kernel on the H200 (session 15, ``experiments/mgpu/scores_mgpu.py``), and phase 2's whole
fused forward as one Mosaic GPU kernel 1.27-1.30x faster than its three Triton calls for MSAR,
but 1.16-1.32x slower for one stream (session 16). So ``gpu_kernels="auto"`` takes the Mosaic
kernel for MSAR's phase 2 forward; porting the other kernels is the open work (BENCHMARKS.md,
kernels, "What remains").
"""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("triton", native_platform="gpu")

api.register("phase1", "pallas_gpu", phase1)
api.register("phase2", "pallas_gpu", phase2)
api.register("phase2_fused", "pallas_gpu", phase2_fused)
