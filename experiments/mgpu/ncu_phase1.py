"""Phase 1's Mosaic GPU kernels at `base`'s shape (7 sources of which 4 valid, S = 8 targets,
B x T = 64 x 1024, d = 1024, bf16 sources, float32 state; MSAR kernels (0, 4, 8, 12)), through
one forward and Pallas backward of ``api.phase1`` with ``gpu_kernels="auto"`` (what the model
runs). The Mosaic kernels launch in this order: the forward's scoring and mixing passes
(``mosaic_gpu.phase1_scores``, ``phase1_mix``), then the backward's scoring pass, value dots,
stream cotangents and transpose (``mosaic_gpu_bwd1.phase1_gdots``, ``phase1_dstreams``,
``sources_transpose``). Meant to run under Nsight Compute, as ``ncu_phase2.py`` says::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:mosaic_gpu \\
        --section SpeedOfLight --section Occupancy python3 experiments/mgpu/ncu_phase1.py

``--interpret``: the same call in Mosaic GPU interpret mode at a tiny shape on the CPU (a smoke
test of this script). Under ``ncu`` (with ``--section SpeedOfLight --section Occupancy --section
LaunchStats --section SchedulerStats`` and the stall metrics) the process segfaulted 24 s in on
the H200 in session 23, call 3; without ``ncu`` it has not run on the GPU."""
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import api

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from time_phase1_scores import KERNELS, phase1_inputs  # noqa: E402


def main():
    interpret = "--interpret" in sys.argv
    n, n_live, batch, t_len, d, n_targets = (3, 2, 1, 70, 64, 2) if interpret else (7, 4, 64, 1024, 1024, 8)
    sources, banks, queries, valid = phase1_inputs(n, n_live, batch, t_len, d, n_targets)
    kw = dict(stream_kernels=KERNELS, heads=1, implementation="pallas_gpu", backward="pallas",
              gpu_kernels="mosaic" if interpret else "auto", per_target=True)

    def loss(x, b, q):
        states = api.phase1(x, b, q, valid, **kw)
        return sum(jnp.sum(s.acc.astype(jnp.float32)) + jnp.sum(s.denom) for s in states)

    grads = jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(sources, banks, queries))
    finite = all(bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))) for g in grads)
    print(f"phase 1 forward + backward at {(n, batch, t_len, d)}: gradients finite: {finite}", flush=True)


if __name__ == "__main__":
    main()
