"""Which part of the Mosaic GPU scoring prototype is wrong on the GPU (exact in interpret mode):
per stream, the largest error of the dots and squares against XLA, and where in the 64-row tile
and the batch the errors sit; one conv stream alone and MSAR's four; both ``windows`` forms."""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scores_mgpu import scores_mgpu, scores_reference  # noqa: E402

batch, t_len, d = 4, 256, 256
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (batch, t_len, d), jnp.bfloat16)
for kernels in ((4,), (0, 4, 8, 12)):
    bank = 0.3 * jax.random.normal(k[1], (max(sum(kernels), 1), d), jnp.float32)
    q = jax.random.normal(k[2], (len(kernels), d), jnp.float32)
    want = [np.asarray(w) for w in scores_reference(x, bank, q, kernels=kernels)]
    for bt, bd, windows in ((64, 64, "offset"), (64, 64, "tma")):
        try:
            got = [np.asarray(g) for g in jax.jit(lambda x, b, q: scores_mgpu(x, b, q, kernels=kernels, bt=bt,
                                                                              bd=bd, windows=windows))(x, bank, q)]
        except Exception as e:  # noqa: BLE001
            print(kernels, bt, bd, windows, "FAILED", repr(e)[:800])
            continue
        for what, g, w in zip(("dots", "sumsq"), got, want):
            for r in range(len(kernels)):
                err = np.abs(g[r] - w[r])
                rel = err.max() / np.abs(w[r]).max()
                bad = err > 1e-4 * np.abs(w[r]).max()
                rows = np.nonzero(bad.any(axis=0))[0] % bt
                print(f"{kernels} bt{bt} bd{bd} {windows} {what}[{r}] rel {rel:.1e}; bad tokens {int(bad.sum())} of {bad.size}; "
                      f"rows in tile {sorted(set(rows.tolist()))[:12]}; batches {sorted(set(np.nonzero(bad.any(1))[0].tolist()))}; "
                      f"ratio got/want at a bad token {(g[r][bad][:3] / w[r][bad][:3]) if bad.any() else '-'}", flush=True)
