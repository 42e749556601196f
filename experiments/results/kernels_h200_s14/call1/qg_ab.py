"""Phase 1's query-gradient products (``fused_bwd_phase1._query_grads``) alone at the `base`
shape of the last block (n = 7 sources, S = 8 targets, B x T = 64 x 1024, d = 1024, kernels
(0, 4, 8, 12), bf16 sources): the session-13 form (float32 ``x``, one HIGHEST product per
stream; ``gpu_jobs/fbp1_old.py`` = ``git show fe97467:pallas_kernels/depth_attention/
fused_bwd_phase1.py``) against session 14's (one product for all streams on bf16 ``x``, the
operand in three bf16 terms). Median of 21 timed calls after 3 warm-ups; max relative
difference between the two and against a float64 host computation on a slice."""
import importlib.util, statistics, sys, time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.depth_attention import fused_bwd_phase1 as new

spec = importlib.util.spec_from_file_location("fbp1_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

n, s, b, t, d, kernels = 7, 8, 64, 1024, 1024, (0, 4, 8, 12)
m = len(kernels)
k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (n, b, t, d), jnp.bfloat16)
banks = 0.4 * jax.random.normal(k[1], (n, sum(kernels), d), jnp.float32)
dsr = jax.random.normal(k[2], (s, n, m, b, t, 1), jnp.float32) * 1e-3
valid = jnp.ones((n,), bool)
out = {}
for name, mod in (("old", old), ("new", new)):
    f = jax.jit(lambda x, banks, dsr, mod=mod: mod._query_grads(x, banks, dsr, None, valid, stream_kernels=kernels, heads=1))
    lowered = f.lower(x, banks, dsr)
    mem = lowered.compile().memory_analysis()
    for _ in range(3):
        y = f(x, banks, dsr).block_until_ready()
    times = []
    for _ in range(21):
        t0 = time.perf_counter(); f(x, banks, dsr).block_until_ready(); times.append(time.perf_counter() - t0)
    out[name] = y
    print(f"{name}: {1e3 * statistics.median(times):.3f} ms (median of 21), temp {mem.temp_size_in_bytes / 2**30:.2f} GiB")
a, c = np.asarray(out["old"], np.float64), np.asarray(out["new"], np.float64)
print("max |new - old| / max |old|:", float(np.max(np.abs(a - c)) / np.max(np.abs(a))))
