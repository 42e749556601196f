"""The depth read's Mosaic GPU kernels (``plgpu.kernel``, sm_90), one module per kernel on the
shared ``common`` module: phase 1's scoring and mixing passes (``phase1_scoring``,
``phase1_mixing``), its backward's value dots and stream cotangents (``phase1_backward``) and
the expansion's transpose (``transpose``); phase 2's fused forward (``phase2_forward``) and its
backward's state and input kernels (``phase2_state``, ``phase2_inputs``). What each fuses and
why, with the figures: docs/kernels.md §4. The entry points below are what the Pallas ops
(``_backend``, ``fused``, ``fused_bwd_phase1``, ``fused_bwd_phase2``) call."""

from pallas_kernels.depth_attention.mosaic_gpu.common import SMEM_BYTES, WINDOW_PAD, choose_block_d, lag_bits
from pallas_kernels.depth_attention.mosaic_gpu.phase1_backward import phase1_dstreams, phase1_gdots
from pallas_kernels.depth_attention.mosaic_gpu.phase1_mixing import MIX_BLOCK_D_CHOICES, mix_smem_bytes, phase1_mix
from pallas_kernels.depth_attention.mosaic_gpu.phase1_scoring import (phase1_scores, scores_block_d_choices,
                                                                      scores_smem_bytes)
from pallas_kernels.depth_attention.mosaic_gpu.phase2_forward import phase2_fused_forward, smem_bytes
from pallas_kernels.depth_attention.mosaic_gpu.phase2_inputs import check_inputs_shape, phase2_backward_inputs
from pallas_kernels.depth_attention.mosaic_gpu.phase2_state import phase2_backward_state, state_smem_bytes
from pallas_kernels.depth_attention.mosaic_gpu.transpose import check_transpose_shape, sources_transpose

__all__ = [
    "MIX_BLOCK_D_CHOICES", "SMEM_BYTES", "WINDOW_PAD", "check_inputs_shape", "check_transpose_shape", "choose_block_d",
    "lag_bits", "mix_smem_bytes", "phase1_dstreams", "phase1_gdots", "phase1_mix", "phase1_scores",
    "phase2_backward_inputs", "phase2_backward_state", "phase2_fused_forward", "scores_block_d_choices",
    "scores_smem_bytes", "smem_bytes", "sources_transpose", "state_smem_bytes",
]
