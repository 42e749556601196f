"""GPU implementation through the Pallas Triton lowering (kernels in ``fused.py``).

Why Triton and not Mosaic GPU (``plgpu.kernel``): the kernels are elementwise
conv taps, row reductions and scalar-weighted accumulations with a causal halo
along tokens; no matrix unit work. The Triton lowering expresses the halo as masked
loads at negative offsets and compiles from the same kernel body as the TPU path,
and a first Triton AttnRes read already reached 43% of its floor on this H200
(shared/GPU_NOTES.md). A Mosaic GPU port (TMA pipelines with explicit barriers) is
the follow-up once this version is measured; the Triton lowering is deprecated in
jax 0.11 but present in the pinned 0.11.2. See BENCHMARKS.md for the measurements.
"""

from __future__ import annotations

from pallas_kernels.depth_attention import _backend, api

phase1, phase2, phase2_fused = _backend.build("triton", native_platform="gpu")

api.register("phase1", "pallas_gpu", phase1)
api.register("phase2", "pallas_gpu", phase2)
api.register("phase2_fused", "pallas_gpu", phase2_fused)
