"""Phase 2's scoring pass (MSAR, kernels (0, 4, 8, 12), one head, no segments): the Triton
kernel (``fused.scores_call``, the phase-2 tiles ``tiling.choose_tiles`` picks) against the
Mosaic GPU prototype (``scores_mgpu.py``) at several tiles, and plain XLA, at `base`'s shape
(B x T = 64 x 1024, d = 1024) and the bench shape (8 x 2048, d = 2048). Median of 21 timings of 5
calls each after warm-up (``bench.timeit``); the largest error against the XLA sums, relative
to their largest magnitude; the floor is the partial's bytes read once at the measured copy
bandwidth. Run on the GPU: ``python benchmarks/mgpu/time_scores.py``."""
import os
import sys
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scores_mgpu import scores_mgpu, scores_reference  # noqa: E402

from pallas_kernels.depth_attention import bench, fused, tiling  # noqa: E402

KERNELS = (0, 4, 8, 12)
# (bt, bd, windows); the "offset" form (wrong on the GPU) took 1.071, 0.363, 0.895 ms at `base`
# on the H200 at (64, 128), (64, 64) and (128, 64); (64, 256) did not finish compiling.
MGPU_TILES = ((64, 32, "tma", True), (64, 32, "tma", False), (64, 16, "tma", False), (64, 64, "tma", False))


def main():
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    for name, (batch, t_len, d) in (("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048))):
        k = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(k[0], (batch, t_len, d), jnp.bfloat16)
        bank = 0.3 * jax.random.normal(k[1], (sum(KERNELS), d), jnp.float32)
        q = jax.random.normal(k[2], (len(KERNELS), d), jnp.float32)
        # read once; the copy bandwidth counts bytes read + written (bench.py's floor). Counting a
        # read at half the copy's bytes/s would double the floor, and every percentage with it.
        floor_ms = x.size * x.dtype.itemsize / bw * 1e3
        want = jax.jit(lambda x, b, q: scores_reference(x, b, q, kernels=KERNELS))(x, bank, q)
        tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(KERNELS), n_targets=1, backend="triton",
                                    n_streams=len(KERNELS))

        def triton(x, b, q):
            dots, sumsq = fused.scores_call(x[None], b[None], q[None], None, stream_kernels=KERNELS, heads=1,
                                            tiles=tiles, backend="triton", interpret=False)
            return dots[0, 0, ..., 0], sumsq[0]

        variants = {
                    f"triton bt{tiles.bt_scores} bd{tiles.block_d_scores}": triton,
                    "pad alone (XLA)": lambda x, b, q: jnp.pad(x, ((0, 0), (16, 0), (0, 0)))}
        for bt, bd, windows, pad in MGPU_TILES:
            variants[f"mgpu bt{bt} bd{bd} {windows}{' pad' * pad}"] = (lambda bt, bd, w, pad: lambda x, b, q: scores_mgpu(
                x, b, q, kernels=KERNELS, bt=bt, bd=bd, windows=w, pad=pad))(bt, bd, windows, pad)
        print(f"## {name}: B x T = {batch} x {t_len}, d = {d}; floor {floor_ms:.4f} ms", flush=True)
        for label, fn in variants.items():
            try:
                f = jax.jit(fn)
                got = f(x, bank, q)
                err = "" if label.startswith("pad") else "rel err " + ", ".join(
                    f"{float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))):.1e}" for g, w in zip(got, want))
                ms = bench.timeit(f, x, bank, q, reps=21, inner=5)[0] * 1e3
                print(f"{label:24s} {ms:8.4f} ms  {floor_ms / ms:6.1%} of floor  {err}", flush=True)
            except Exception:  # noqa: BLE001
                print(f"{label:24s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
