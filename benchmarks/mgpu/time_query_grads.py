"""Phase 1's query gradient (``fused_bwd_phase1._query_grads``, the wide backward's token-axis
matrix products) on the GPU: the current form, which splits the float32 ``DSR`` into its three
bfloat16 parts before taking the lags (one lagged operand, built in bf16), against the earlier
form (``split_after``, below: the lags stacked in float32, then split), which wrote the lagged
operand twice. Shapes: `base`'s last block (7 stacked sources, ``--live`` (default 4) valid,
B x T = 64 x 1024, d = 1024, S = 8 targets) and the bench shape (9 of 9 sources, 8 x 2048, d = 2048,
S = 8); MSAR's kernels (0, 4, 8, 12), one head, bf16 sources, segments. Median of 21 timings of 3
calls each after warm-up (``bench.timeit``); the largest difference between the two forms
relative to the largest magnitude (the same products, so float32 rounding apart); the floor:
the sources and ``DSR`` read once and the bf16 lagged operand (``3 K S`` values per token and
source) written and read once, at the measured copy bandwidth. Run on the GPU:
``python benchmarks/mgpu/time_query_grads.py [--base-only]``."""
import functools
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import bench, reference
from pallas_kernels.depth_attention import fused_bwd_phase1 as fb

KERNELS = (0, 4, 8, 12)
F32 = jnp.float32


def split_after(x, banks, dsr, seg, valid, *, stream_kernels, heads):
    """The earlier ``_query_grads`` for bf16 sources (kept here to time against): the lagged
    operand stacked in float32, then split into bf16 parts."""
    n, batch, t_pad, d = x.shape
    n_targets, dh = dsr.shape[0], d // heads
    masks = reference._lag_masks(seg, t_pad, max([1, *stream_kernels]), batch)
    ok = reference._source_valid(n, valid)
    x = jnp.where(ok[:, None, None, None], x, jnp.zeros((), x.dtype)).reshape(n, batch * t_pad, heads, dh)
    dsr = jnp.moveaxis(dsr, 1, 0)
    lagged = []
    for r, kernel in enumerate(stream_kernels):
        a = dsr[:, :, r]
        lagged.append(a)
        lagged += [reference._unshift(a * masks[delta][:, :, None], delta) for delta in range(1, kernel)]
    lagged = jnp.stack(lagged, axis=1).reshape(n, len(lagged), n_targets, batch * t_pad, heads)
    y = jnp.sum(jnp.einsum("npksuh,nuhe->pksnhe", fb._bf16_parts(lagged, axis=1), x, preferred_element_type=F32),
                axis=0)
    out, off, row = [], 0, 0
    for kernel in stream_kernels:
        if kernel == 0:
            out.append(jnp.sum(y[row], axis=1).reshape(n_targets, d))
            row += 1
        else:
            c = jnp.where(ok[:, None, None], banks[:, off:off + kernel].astype(F32), 0.0).reshape(n, kernel, heads, dh)
            out.append(jnp.einsum("ksnhe,nkhe->she", y[row:row + kernel], c,
                                  precision=jax.lax.Precision.HIGHEST).reshape(n_targets, d))
            off, row = off + kernel, row + kernel
    return jnp.stack(out, axis=1)


def main():
    live = int(sys.argv[sys.argv.index("--live") + 1]) if "--live" in sys.argv else 4
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    shapes = (("base", (7, live, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8)))
    m, k_total = len(KERNELS), sum(max(1, k) for k in KERNELS)
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes[:1] if "--base-only" in sys.argv else shapes:
        ks = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(ks[0], (n, batch, t_len, d), jnp.bfloat16)
        banks = 0.3 * jax.random.normal(ks[1], (n, sum(KERNELS), d), F32)
        valid = jnp.arange(n) < n_live
        dsr = jax.random.normal(ks[2], (n_targets, n, m, batch, t_len, 1), F32) * valid[None, :, None, None, None,
                                                                                        None]
        seg = (jnp.arange(t_len)[None, :] >= t_len // 3).astype(jnp.int32) * jnp.ones((batch, 1), jnp.int32)
        tokens = batch * t_len
        floor_bytes = n * tokens * (d * 2 + n_targets * m * 4 + 2 * 3 * k_total * n_targets * 2)
        floor_ms = floor_bytes / bw * 1e3
        print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}; "
              f"floor {floor_ms:.3f} ms ({floor_bytes / 1e9:.2f} GB)", flush=True)
        want = None
        for label, fn in (("split_after (earlier form)", split_after), ("split_first (current)", fb._query_grads)):
            f = jax.jit(functools.partial(fn, stream_kernels=KERNELS, heads=1))
            got = f(x, banks, dsr, seg, valid)
            err = 0.0 if want is None else float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            want = got if want is None else want
            ms = bench.timeit(f, x, banks, dsr, seg, valid, reps=21, inner=3)[0] * 1e3
            print(f"{label:26s} {ms:8.3f} ms  {floor_ms / ms:6.1%} of floor  rel diff {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
