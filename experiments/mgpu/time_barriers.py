"""Phase 1's Mosaic GPU scoring and mixing passes and phase 2's fused forward (MSAR's gate, bf16
``h``) with and without Pallas' automatic warpgroup barriers (``mosaic_gpu.KERNEL_AUTO_BARRIERS``;
session 31).

By default Pallas syncs the warpgroup before every TMA copy into shared memory and around every
store to it; built with ``unsafe_no_auto_barriers`` a kernel syncs only where its pipeline needs
it (``mosaic_gpu._sync``). This times both builds of each kernel, checks that they give the same
bits (the arithmetic is the same; a race would show as a difference or a hang), and prints each
against the floor of its bytes (the mix: the states written and the live sources read once; the
scores: the live sources read once; phase 2: the state and the partial read, ``h`` written once)
at the copy bandwidth measured in the same call.

Shapes: `base`'s last block (B x T = 64 x 1024, d = 1024, S = 8 targets, 7 stacked sources of
which 4 are valid) and the issue's (8 x 2048, d = 2048, S = 8, all 9 sources); MSAR's kernels
(0, 4, 8, 12) and, with ``--attnres``, AttnRes's one stream as well; one head, bf16 sources,
random non-zero taps, queries and weights ``p``, a float32 state, one output per target.
Median of 21 timings of 3 calls each after warm-up (``bench.timeit``).
Run on the GPU: ``python experiments/mgpu/time_barriers.py [--attnres] [--base-only]``.
"""
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.depth_attention import bench, mosaic_gpu
from time_phase2 import inputs as phase2_inputs  # this folder, on the path as a script

SHAPES = (("base", (7, 4, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8)))
CONFIGS = (("msar", (0, 4, 8, 12)),) + ((("attnres", (0,)),) if "--attnres" in sys.argv else ())


def _ops(kernels):
    def mix(x, b, q, p, v):
        return mosaic_gpu.phase1_mix(x, b, p, None, v, stream_kernels=kernels, heads=1, per_target=True)

    def scores(x, b, q, p, v):
        return mosaic_gpu.phase1_scores(x, b, q, None, v, stream_kernels=kernels, heads=1)

    return {"mix": mix, "scores": scores}


def _forward(kernels):
    fuse = "gate" if len(kernels) > 1 else "mean"

    def forward(st, x, b, q, g):
        return mosaic_gpu.phase2_fused_forward(st, x, b, q, True, g, None, fuse=fuse, stream_kernels=kernels,
                                               heads=1, eps=1e-6, gate_eps=1e-6, out_dtype=jnp.bfloat16)
    return forward


def _timed(op, fn, args, floor_ms):
    """``fn(*args)`` built both ways: the times and whether the outputs agree to the bit."""
    outs, times = {}, {}
    for auto in (True, False):
        label = f"{op:7s} {'auto barriers' if auto else 'own barriers':14s}"
        try:
            mosaic_gpu.KERNEL_AUTO_BARRIERS[op] = auto
            f = jax.jit(fn)
            outs[auto] = jax.block_until_ready(f(*args))
            times[auto] = bench.timeit(f, *args, reps=21, inner=3)[0] * 1e3
            print(f"{label} {times[auto]:8.3f} ms  {floor_ms / times[auto]:6.1%} of floor ({floor_ms:.4f} ms)",
                  flush=True)
        except Exception:  # noqa: BLE001
            print(f"{label} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
        finally:
            mosaic_gpu.KERNEL_AUTO_BARRIERS[op] = True
    if len(outs) == 2:
        print(f"{op:7s} own / auto: {times[False] / times[True]:.3f}; same bits: {_same_bits(outs[False], outs[True])}",
              flush=True)


def _same_bits(got, want) -> bool:
    return all(np.array_equal(np.asarray(g), np.asarray(w))
               for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))


def main():
    shapes = SHAPES[:1] if "--base-only" in sys.argv else SHAPES
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    for config, kernels in CONFIGS:
        m = len(kernels)
        for name, (n, n_live, batch, t_len, d, n_targets) in shapes:
            k = jax.random.split(jax.random.key(0), 4)
            sources = jax.random.normal(k[0], (n, batch, t_len, d), jnp.bfloat16)
            banks = 0.3 * jax.random.normal(k[1], (n, sum(kernels), d), jnp.float32) if any(kernels) else None
            queries = jax.random.normal(k[2], (n_targets, m, d), jnp.float32) / d ** 0.5
            valid = jnp.arange(n) < n_live
            p = jax.random.uniform(k[3], (n_targets, n, m, batch, t_len, 1)) * valid[None, :, None, None, None, None]
            src_bytes = n_live * batch * t_len * d * 2
            floors = {"mix": (n_targets * m * batch * t_len * d * 4 + src_bytes) / bw * 1e3,
                      "scores": src_bytes / bw * 1e3}
            print(f"## {config} {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, "
                  f"d = {d}", flush=True)
            for op, fn in _ops(kernels).items():
                _timed(op, fn, (sources, banks, queries, p, valid), floors[op])
            del sources, p
            state, x, bank, q, gate = phase2_inputs(batch, t_len, d, kernels)
            floor = (m * batch * t_len * d * 4 + 2 * batch * t_len * d * 2) / bw * 1e3
            _timed("forward", _forward(kernels), (state, x, bank, q, gate), floor)
            del state, x


if __name__ == "__main__":
    main()
