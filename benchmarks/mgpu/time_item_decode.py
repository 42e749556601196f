"""Phase 1's Mosaic GPU mixing pass, ``gdots`` and ``dstreams`` with the next pipeline item decoded
from its flat index (``"divide"``; the mix's default) against carried through the loops (``"carried"``;
``gdots``' and ``dstreams``' default;
``mosaic_gpu.ITEM_DECODES``).

The deviceless H200 compile (``sass_stats.py``) counts the instructions of each
kernel's per-item loops: decoding the next item's (chunk, stream, source) costs the mix two
integer divisions by the runtime count of valid sources per item (about 70 of its 371-930
instructions per item, by stream), ``gdots`` and ``dstreams`` one (about 24-36). The same items
in the same order: the outputs must agree to the bit (checked). Shapes: `base`'s last block
(B x T = 64 x 1024, d = 1024, S = 8, 7 stacked sources of which 4 are valid) and the bench shape
(8 x 2048, d = 2048, S = 8, all 9 sources); MSAR's kernels (0, 4, 8, 12), one head, bf16 sources,
float32 state and ``g_A`` (one array per target). Median of 21 timings of 3 calls each after
warm-up (``bench.timeit``). Run on the GPU: ``python benchmarks/mgpu/time_item_decode.py
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


def _ops(n_live):
    """``{name: fn(decode) -> f(x, banks, q, p, g_acc, dsr, w, valid)}`` (the first ``n_live``
    sources valid)."""
    def mix(decode):
        def f(x, b, q, p, ga, dsr, w, v):
            return mosaic_gpu.phase1_mix(x, b, p, None, v, stream_kernels=KERNELS, heads=1, per_target=True,
                                         item_decode=decode)
        return f

    def bwd1(decode, mode):
        def f(x, b, q, p, ga, dsr, w, v):
            old, mosaic_gpu_bwd1.DEFAULT_ITEM_DECODE = mosaic_gpu_bwd1.DEFAULT_ITEM_DECODE, decode
            try:  # read when the kernel is traced: inside this jitted function's trace
                if mode == "gdots":
                    return mosaic_gpu_bwd1.phase1_gdots(x, b, ga, None, v, stream_kernels=KERNELS, heads=1)
                out = mosaic_gpu_bwd1.phase1_dstreams(x, b, q, ga, p, dsr, w, None, v, stream_kernels=KERNELS,
                                                      heads=1, out_dtype=jnp.bfloat16)
                return out[:n_live]  # the ruled-out sources' rows are not written
            finally:
                mosaic_gpu_bwd1.DEFAULT_ITEM_DECODE = old
        return f

    return {"mix": mix, "gdots": lambda dec: bwd1(dec, "gdots"), "dstreams": lambda dec: bwd1(dec, "dstreams")}


def _flat(tree):
    return np.concatenate([np.asarray(a, np.float32).ravel() for a in jax.tree.leaves(tree)])


def main():
    shapes = SHAPES[:1] if "--base-only" in sys.argv else SHAPES
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes:
        m = len(KERNELS)
        sources, banks, queries, valid = phase1_inputs(n, n_live, batch, t_len, d, n_targets)
        k = jax.random.split(jax.random.key(1), 4)
        live = valid[None, :, None, None, None, None]
        p = jax.random.uniform(k[0], (n_targets, n, m, batch, t_len, 1)) * live
        dsr = jax.random.normal(k[2], (n_targets, n, m, batch, t_len, 1)) * live
        w = jax.random.normal(k[3], (n, m, batch, t_len))
        g_acc = [jax.random.normal(kk, (m, batch, t_len, d), jnp.float32) for kk in jax.random.split(k[1], n_targets)]
        args = (sources, banks, queries, p, g_acc, dsr, w, valid)
        print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}",
              flush=True)
        for op, make in _ops(n_live).items():
            want, base_ms = None, None
            for decode in mosaic_gpu.ITEM_DECODES:
                label = f"{op:8s} {decode:8s}"
                try:
                    f = jax.jit(make(decode))
                    got = _flat(f(*args))
                    same = want is None or np.array_equal(got, want)
                    want = got if want is None else want
                    ms = bench.timeit(f, *args, reps=21, inner=3)[0] * 1e3
                    base_ms = base_ms or ms
                    print(f"{label} {ms:8.3f} ms  {ms / base_ms:5.3f}x divide  same bits: {same}", flush=True)
                except Exception:  # noqa: BLE001
                    print(f"{label} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
            del want
        del args, sources, p, g_acc


if __name__ == "__main__":
    main()
