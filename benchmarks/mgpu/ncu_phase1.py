"""Phase 1's Mosaic GPU kernels at `base`'s shape (7 sources of which 4 valid, S = 8 targets,
B x T = 64 x 1024, d = 1024, bf16 sources; MSAR kernels (0, 4, 8, 12), one head), each called
once, directly, in this order: the scoring pass (``mosaic_gpu.phase1_scores``), the mixing pass
writing a float32 state and then a bf16 one (``mosaic_gpu.phase1_mix``, one output per target as
the model calls it), the backward's value dots and stream cotangents
(``mosaic_gpu.phase1_gdots``, ``phase1_dstreams``, float32 ``g_A``) and the expansion's
transpose (``mosaic_gpu.sources_transpose``). Each Mosaic GPU kernel is named after its op
(``<op>_mosaic_gpu_kernel``, ``mosaic_gpu.named_body``; in order of launch, too). Meant to run under Nsight Compute, as ``ncu_phase2.py`` says::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:mosaic_gpu \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats python3 benchmarks/mgpu/ncu_phase1.py

It calls each kernel alone rather than one forward and Pallas backward of ``api.phase1`` under
``jax.grad``: under ``ncu`` that process segfaults 24 s in (cause not established).
``--interpret``: the same calls in Mosaic GPU interpret mode at a tiny shape on the CPU (a
smoke test of this script). ``--issue``: the bench shape instead (9 sources, all valid, S = 8,
B x T = 8 x 2048, d = 2048; ``ncu_census.py`` reads the counters of both shapes). Every kernel
runs with its defaults, as the model calls it."""
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import mosaic_gpu

KERNELS = (0, 4, 8, 12)


def random_inputs(n, n_live, batch, t_len, d, n_targets, heads=1):
    """Phase 1's kernels' inputs (bf16 sources, float32 rest; the first ``n_live`` sources
    valid) as a dict: sources, banks, queries, valid, p, g_acc (per target), dsr, w."""
    m = len(KERNELS)
    k = jax.random.split(jax.random.key(0), 8)
    valid = jnp.arange(n) < n_live
    return dict(
        sources=jax.random.normal(k[0], (n, batch, t_len, d), jnp.bfloat16),
        banks=0.3 * jax.random.normal(k[1], (n, sum(KERNELS), d), jnp.float32),
        queries=jax.random.normal(k[2], (n_targets, m, d), jnp.float32),
        valid=valid,
        p=jax.random.uniform(k[3], (n_targets, n, m, batch, t_len, heads)) * valid[None, :, None, None, None, None],
        g_acc=[jax.random.normal(kk, (m, batch, t_len, d), jnp.float32) for kk in jax.random.split(k[4], n_targets)],
        dsr=jax.random.normal(k[5], (n_targets, n, m, batch, t_len, heads)),
        w=jax.random.normal(k[6], (n, m, batch, t_len)),
        key=k[7])


def main():
    interpret = "--interpret" in sys.argv
    if interpret:
        n, n_live, batch, t_len, d, n_targets = 3, 2, 1, 70, 64, 2
    elif "--issue" in sys.argv:
        n, n_live, batch, t_len, d, n_targets = 9, 9, 8, 2048, 2048, 8
    else:
        n, n_live, batch, t_len, d, n_targets = 7, 4, 64, 1024, 1024, 8
    m, heads = len(KERNELS), 1
    inputs = random_inputs(n, n_live, batch, t_len, d, n_targets, heads)
    sources, banks, queries, valid, p, g_acc, dsr, w = (
        inputs[name] for name in ("sources", "banks", "queries", "valid", "p", "g_acc", "dsr", "w"))
    kw = dict(stream_kernels=KERNELS, heads=heads, interpret=interpret)

    def run(label, fn, *args):
        out = jax.block_until_ready(jax.jit(fn)(*args))
        if "dstreams" in label:  # the rows of the sources ``valid`` rules out are not written
            out = out[:n_live]
        finite = all(bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) for a in jax.tree.leaves(out))
        print(f"{label}: {len(jax.tree.leaves(out))} outputs, all finite: {finite}", flush=True)

    run("1 scores", lambda x, b, q, v: mosaic_gpu.phase1_scores(x, b, q, None, v, **kw), sources, banks, queries, valid)
    for i, dtype in ((2, jnp.float32), (3, jnp.bfloat16)):
        run(f"{i} mix ({jnp.dtype(dtype).name} state)",
            lambda x, b, pp, v, dtype=dtype: mosaic_gpu.phase1_mix(x, b, pp, None, v, out_dtype=dtype, per_target=True,
                                                                   **kw), sources, banks, p, valid)
    run("4 gdots", lambda x, b, ga, v: mosaic_gpu.phase1_gdots(x, b, ga, None, v, **kw), sources, banks, g_acc,
        valid)
    run("5 dstreams", lambda x, b, q, ga, pp, ds, ww, v: mosaic_gpu.phase1_dstreams(
        x, b, q, ga, pp, ds, ww, None, v, out_dtype=jnp.bfloat16, **kw), sources, banks, queries, g_acc, p, dsr, w, valid)
    d_streams = jax.random.normal(inputs["key"], (n, m, batch, t_len, d), jnp.bfloat16)
    run("6 transpose", lambda de, x, b, v: mosaic_gpu.sources_transpose(
        de, x, b, None, v, stream_kernels=KERNELS, interpret=interpret), d_streams, sources, banks, valid)


if __name__ == "__main__":
    main()
