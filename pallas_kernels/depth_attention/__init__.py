"""Multi-stream depth attention (MSAR Eq. 9-17; AttnRes and MHAR as special cases)."""

from pallas_kernels.depth_attention.api import (
    depth_read,
    phase1,
    phase2,
    phase2_fused,
)
from pallas_kernels.depth_attention.reference import (
    SoftmaxState,
    ValueChannel,
    bank_size,
    expand,
    finalize,
    fuse_gate,
    fuse_mean,
    key_rms,
)

__all__ = [
    "SoftmaxState",
    "ValueChannel",
    "bank_size",
    "depth_read",
    "expand",
    "finalize",
    "fuse_gate",
    "fuse_mean",
    "key_rms",
    "phase1",
    "phase2",
    "phase2_fused",
]
