"""Phase 2's Pallas backward (``fused_bwd_phase2._backward``, reverse-T form, buffer row shift)
alone at the `base` shape (B x T = 64 x 1024, d = 1024, one target): session 14's three
recompute passes (``gpu_jobs/fbp2_old.py`` = ``git show 83c7a4d:pallas_kernels/depth_attention/
fused_bwd_phase2.py``: statistics, ``d_state``, inputs) against session 15's two (channel-sum
products, inputs writing ``d_acc``). MSAR (kernels (0, 4, 8, 12), the gate) and AttnRes
(kernels (0,), mean fusion). Inputs as ``bench.parts_p2_bwd`` builds them (phase-1 state of 7
sources, float32). Median of 21 timed calls (2 per timing) after warm-up; the largest
difference between the two per output, relative to that output's largest magnitude."""
import importlib.util, sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.depth_attention import bench, reference, tiling
from pallas_kernels.depth_attention import fused_bwd_phase2 as new

spec = importlib.util.spec_from_file_location("fbp2_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

on_gpu = jax.default_backend() == "gpu"
n, batch, t_len, d = (7, 64, 1024, 1024) if on_gpu else (3, 2, 40, 64)  # off the GPU: a smoke run, interpreted
backend = dict(backend="triton", interpret=False) if on_gpu else dict(backend="interpret", interpret=True)
for name, kernels in (("msar", (0, 4, 8, 12)), ("attnres", (0,))):
    m = len(kernels)
    sources, banks, queries, partial, bank, query, gate = bench.make_inputs(n, batch, t_len, d, 1, kernels, 1,
                                                                          jnp.bfloat16)
    gate = gate if m > 1 else None
    state = jax.tree.map(lambda a: a[0], reference.phase1(sources, banks, queries, stream_kernels=kernels, heads=1))
    del sources
    dh = jax.random.normal(jax.random.key(11), (batch, t_len, d), jnp.float32)
    tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(kernels), n_targets=1, backend="triton", n_streams=m)
    outs = {}
    for label, mod in (("old", old), ("new", new)):
        f = jax.jit(lambda state, partial, bank, query, gate, dh, mod=mod: mod._backward(
            state, partial, bank, query, True, gate, None, dh, stream_kernels=kernels, heads=1, eps=1e-6,
            gate_eps=1e-6, tiles=tiles, shift="buffer", **backend))
        args = (state, partial, bank, query, gate, dh)
        mem = f.lower(*args).compile().memory_analysis()
        med, _ = bench.timeit(f, *args, reps=21, inner=2, warmup=3)
        outs[label] = jax.device_get(f(*args))
        print(f"{name} {label}: {1e3 * med:.3f} ms per call (median of 21), temp {mem.temp_size_in_bytes / 2**30:.2f} GiB",
              flush=True)
    flat_old = jax.tree_util.tree_leaves(outs["old"])
    flat_new = jax.tree_util.tree_leaves(outs["new"])
    rel = [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(c, np.float64)))
                 / max(float(np.max(np.abs(np.asarray(a, np.float64)))), 1e-30)) for a, c in zip(flat_old, flat_new)]
    print(f"{name} max |new - old| / max |old| per output: " + ", ".join(f"{r:.2e}" for r in rel), flush=True)
