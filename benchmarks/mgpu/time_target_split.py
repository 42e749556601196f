"""Phase 1's Mosaic GPU mixing, scoring and ``gdots`` passes on all ``S`` targets at once against
the same kernels called once per group of ``S / k`` targets.

Each of these kernels holds per-target tiles in registers for every item (the mix: ``S``
``[64, 32]`` float32 accumulators, 128 registers a thread for 8 targets; ``gdots``: the group's
``S`` tiles of ``g_A``) and runs at 253-255 registers a thread, so two programs (8 warps) per SM,
waiting more than issuing (Nsight Compute, on the H200). Split into ``k`` calls, each program
holds ``S / k`` targets' tiles and may fit more programs per SM, at the price of rebuilding every
source's streams ``k`` times. The per-target sums are the same in either form, so the outputs
must agree to the bit (checked). Shapes: `base`'s last block (B x T = 64 x 1024, d = 1024, S =
8, 7 stacked sources of which 4 are valid) and the bench shape (8 x 2048, d = 2048, S = 8, all 9
sources); MSAR's kernels (0, 4, 8, 12), one head, bf16 sources, float32 state and ``g_A`` (one
array per target, as the model hands them over). Median of 21 timings of 3 calls each after
warm-up (``bench.timeit``). Run on the GPU: ``python benchmarks/mgpu/time_target_split.py
[--base-only]``.
"""
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.depth_attention import bench, mosaic_gpu, mosaic_gpu_bwd1
from time_phase1_scores import KERNELS, phase1_inputs  # this folder, on the path as a script

assert KERNELS == (0, 4, 8, 12), "MSAR's streams (time_phase1_scores reads --attnres)"
SHAPES = (("base", (7, 4, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8)))
SPLITS = (1, 2, 4)


def _groups(n_targets, k):
    size = n_targets // k
    return [slice(g * size, (g + 1) * size) for g in range(k)]


def _ops(n_targets):
    """``{name: fn(k) -> f(x, banks, q, p, g_acc, valid)}``: each kernel in ``k`` calls."""
    def mix(k):
        def f(x, b, q, p, ga, v):
            return [a for g in _groups(n_targets, k) for a in mosaic_gpu.phase1_mix(
                x, b, p[g], None, v, stream_kernels=KERNELS, heads=1, per_target=True)]
        return f

    def scores(k):
        def f(x, b, q, p, ga, v):
            outs = [mosaic_gpu.phase1_scores(x, b, q[g], None, v, stream_kernels=KERNELS, heads=1)
                    for g in _groups(n_targets, k)]
            return [o[0] for o in outs], outs[0][1]  # per group's dots; the sums of squares (the same in each)
        return f

    def gdots(k):
        def f(x, b, q, p, ga, v):
            return [mosaic_gpu_bwd1.phase1_gdots(x, b, ga[g], None, v, stream_kernels=KERNELS, heads=1)
                    for g in _groups(n_targets, k)]
        return f

    return {"mix": mix, "scores": scores, "gdots": gdots}


def _flat(tree):
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in jax.tree.leaves(tree)])


def main():
    shapes = SHAPES[:1] if "--base-only" in sys.argv else SHAPES
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes:
        m = len(KERNELS)
        sources, banks, queries, valid = phase1_inputs(n, n_live, batch, t_len, d, n_targets)
        k = jax.random.split(jax.random.key(1), 2)
        p = jax.random.uniform(k[0], (n_targets, n, m, batch, t_len, 1)) * valid[None, :, None, None, None, None]
        g_acc = [jax.random.normal(kk, (m, batch, t_len, d), jnp.float32) for kk in jax.random.split(k[1], n_targets)]
        args = (sources, banks, queries, p, g_acc, valid)
        print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}",
              flush=True)
        for op, make in _ops(n_targets).items():
            want, base_ms = None, None
            for split in SPLITS:
                label = f"{op:6s} {split} call{'s' if split > 1 else ''} of {n_targets // split} targets"
                try:
                    f = jax.jit(make(split))
                    got = _flat(f(*args))
                    same = want is None or np.array_equal(got, want)
                    want = got if want is None else want
                    ms = bench.timeit(f, *args, reps=21, inner=3)[0] * 1e3
                    base_ms = base_ms or ms
                    print(f"{label:28s} {ms:8.3f} ms  {ms / base_ms:5.3f}x one call  same bits: {same}", flush=True)
                except Exception:  # noqa: BLE001
                    print(f"{label:28s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
            del want
        del args, sources, p, g_acc


if __name__ == "__main__":
    main()
