"""Phase 2's three Mosaic GPU kernels at `base`'s shape (B x T = 64 x 1024, d = 1024; MSAR:
kernels (0, 4, 8, 12), gate, float32 state), launched once each in this order: the forward
(``mosaic_gpu.phase2_fused_forward``), the backward's state kernel
(``mosaic_gpu.phase2_backward_state``) and its input kernel
(``mosaic_gpu.phase2_backward_inputs``). Meant to run under Nsight Compute, which reads the
hardware counters the timings cannot (occupancy, stall reasons, shared-memory bank conflicts,
memory throughput); each Mosaic GPU kernel is named after its op (``<op>_mosaic_gpu_kernel``)::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:mosaic_gpu \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \\
        python3 benchmarks/mgpu/ncu_phase2.py

(``XLA_PYTHON_CLIENT_PREALLOCATE=false``: Nsight Compute saves and restores the device memory a
replayed kernel may touch, so JAX should not hold the whole GPU.) ``--interpret``: the same
calls in Mosaic GPU interpret mode at a tiny shape on the CPU (a smoke test of this script).
``--issue``: the bench shape (B x T = 8 x 2048, d = 2048) with ``h`` and its cotangent in bf16, as
the bench and a bf16 model run them (``ncu_census.py`` reads the counters of both shapes)."""
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import fused_bwd_phase2, reference, tiling


def inputs(batch, t_len, d, kernels, key=0):
    """Phase 2's inputs: a random float32 state (positive denominators), bf16 partial, float32
    bank, queries and gate (``(W, scale, bias)``, Eq. 13-14)."""
    m = len(kernels)
    k = jax.random.split(jax.random.key(key), 8)
    x = jax.random.normal(k[0], (batch, t_len, d), jnp.bfloat16)
    bank = 0.3 * jax.random.normal(k[1], (max(1, sum(kernels)), d), jnp.float32) if any(kernels) else None
    q = jax.random.normal(k[2], (m, d), jnp.float32)
    state = reference.SoftmaxState(jax.random.normal(k[3], (m, batch, t_len, 1)),
                                   jnp.exp(jax.random.normal(k[4], (m, batch, t_len, 1))),
                                   jax.random.normal(k[5], (m, batch, t_len, d)))
    gate = (jax.random.normal(k[6], (m * d, m)) / (m * d) ** 0.5, jnp.float32(0.7), jax.random.normal(k[7], (m,)))
    return state, x, bank, q, gate


def main():
    interpret = "--interpret" in sys.argv
    issue = "--issue" in sys.argv
    from pallas_kernels.depth_attention import mosaic_gpu

    batch, t_len, d = (1, 70, 64) if interpret else (8, 2048, 2048) if issue else (64, 1024, 1024)
    out_dtype = jnp.bfloat16 if issue else jnp.float32  # h and its cotangent
    kernels = (0, 4, 8, 12)
    kw = dict(stream_kernels=kernels, heads=1, eps=1e-6, gate_eps=1e-6)
    state, x, bank, q, gate = inputs(batch, t_len, d, kernels)
    dh = jax.random.normal(jax.random.key(7), (batch, t_len, d), out_dtype)
    h, scores = jax.block_until_ready(mosaic_gpu.phase2_fused_forward(state, x, bank, q, True, gate, None, fuse="gate",
                                                                      out_dtype=out_dtype, interpret=interpret, **kw))
    print(f"forward: h {h.shape} {h.dtype}", flush=True)
    tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(kernels), n_targets=1,
                                backend="tpu" if interpret else "triton", n_streams=len(kernels))
    grads = fused_bwd_phase2.phase2_fused_backward(
        state, x, bank, q, True, gate, None, dh, tiles=tiles, backend="interpret" if interpret else "triton",
        interpret=interpret, scores=scores, mosaic_state=True, mosaic_inputs=True, **kw)
    leaves = jax.block_until_ready(jax.tree.leaves(grads))
    print(f"backward: {len(leaves)} gradients, all finite: {all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)}",
          flush=True)


if __name__ == "__main__":
    main()
