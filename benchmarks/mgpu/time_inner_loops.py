"""Two kernels' inner loops with the options that take instructions out of them:
phase 2's backward input kernel (``mosaic_gpu.phase2_backward_inputs``) with each place its
per-channel constants come from (``mosaic_gpu.INPUTS_CONSTANTS_CHOICES``: the taps, queries and
W's columns loaded at every use, once per token tile, or once per program and held in registers),
with its bf16 widened in place (``INPUTS_WIDEN``) and with two tiles in flight
(``INPUTS_SLOTS``: three by default),
and phase 1's expansion transpose (``mosaic_gpu_bwd1.sources_transpose``) with its taps per tile
or held per source (``TRANSPOSE_TAPS_CHOICES``) and its bf16 widened in place (``TRANSPOSE_WIDEN``).
Options measured and taken out (the transpose's windows widened once per tile, both kernels
without Pallas' automatic barriers) are in commit dfe9301. MSAR's kernels (0, 4, 8, 12), bf16 partial / sources and
cotangents, float32 state, as the model runs them; `base`'s shape (B x T = 64 x 1024, d = 1024;
the transpose at its last block: 7 sources, 4 valid) and the bench shape (8 x 2048, d = 2048; 9
sources). Per variant: each output's largest difference from the first variant's (relative to
its largest magnitude: the variants compute the same values, but ptxas may contract and order
them differently, up to a bf16 rounding of `d_x`), the median of 21
timings of 5 calls, and the floor: the bytes the kernel must move (each input read once, each
output written once) at the copy bandwidth measured in the same run.

Run on the GPU: ``python benchmarks/mgpu/time_inner_loops.py [--base-only] [--inputs-only |
--transpose-only] [--only TEXT]`` (``--only``: the first variant of each kernel and those whose
label holds TEXT); ``--aot`` compiles every variant for an H200 on a machine without one (JAX's
CUDA plugin on ``PYTHONPATH``, ``msar_jax.deviceless_gpu``)."""

from __future__ import annotations

import os
import sys

if "--aot" in sys.argv:  # before jax starts: the CUDA plugin's deviceless topology
    from msar_jax import deviceless_gpu

    deviceless_gpu.prepare_gpu_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from time_cluster_forward import compile_variants, time_variants  # noqa: E402

from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_bwd1  # noqa: E402

KERNELS = (0, 4, 8, 12)
SHAPES = (("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048)))
TRANSPOSE_SOURCES = {"base": (7, 4), "issue": (9, 9)}  # sources, valid ones


def inputs(batch, t_len, d):
    """Random non-zero operands of the input kernel (``phase2_backward_inputs``' argument order)."""
    m = len(KERNELS)
    ks = jax.random.split(jax.random.key(0), 13)
    x = jax.random.normal(ks[0], (batch, t_len, d), jnp.bfloat16)
    bank = 0.3 * jax.random.normal(ks[1], (sum(KERNELS), d))
    q = jax.random.normal(ks[2], (m, d))
    a, b, u = (jax.random.uniform(ks[3 + i], (m, batch, t_len, 1), minval=0.1) for i in range(3))
    v = jax.random.normal(ks[6], (m, batch, t_len))
    acc = jax.random.normal(ks[7], (m, batch, t_len, d))
    dh = jax.random.normal(ks[8], (batch, t_len, d), jnp.bfloat16)
    gate_in = (jax.random.uniform(ks[9], (batch, t_len, m)), jax.random.normal(ks[10], (batch, t_len, m)),
               jax.random.normal(ks[11], (batch, t_len)), jax.random.normal(ks[12], (m, d, m)))
    return x, bank, q, a, b, u, v, acc, dh, gate_in, None


def variants(d, n_tiles):
    """The defaults first (the reference for the differences; three tiles in flight), then bf16
    widened in place (``INPUTS_WIDEN``), two tiles in flight (``INPUTS_SLOTS``), then the other
    places for the constants (per use, per tile). Two tiles per fetch and the refills by the last
    warpgroup were measured and taken out (commit 07655f3 has them and this script's variants for
    them)."""
    run = lambda **kw: lambda *a: mosaic_gpu.phase2_backward_inputs(  # noqa: E731
        *a, stream_kernels=KERNELS, heads=1, dx_dtype=jnp.bfloat16, **kw)
    return ([("defaults", run(widen="extf", slots=3)), ("widen bits", run(widen="bits", slots=3)),
             ("2 slots", run(slots=2)), ("2 slots, widen bits", run(slots=2, widen="bits")),
             ("4 slots", run(slots=4, widen="extf"))]
            + [(f"constants {c}", run(constants=c, widen="extf")) for c in ("per_use", "per_tile")])


def floor_bytes(batch, t_len, d) -> int:
    tok, m = batch * t_len, len(KERNELS)
    per_token_rows = (4 * m + 2 * m + 1) * 4  # a, b, u, v per stream, then g, dy, coef (float32)
    return tok * d * 2 + m * tok * d * 4 + tok * d * 2 + tok * d * 2 + tok * per_token_rows


def transpose_inputs(batch, t_len, d):
    """The transpose's operands (``sources_transpose``' order): `base`'s last block or the bench
    shape's sources, told apart by the shape."""
    n, n_live = TRANSPOSE_SOURCES["base" if batch == 64 else "issue"]
    ks = jax.random.split(jax.random.key(5), 3)
    d_streams = jax.random.normal(ks[0], (n, len(KERNELS), batch, t_len, d), jnp.bfloat16)
    x = jax.random.normal(ks[1], (n, batch, t_len, d), jnp.bfloat16)
    banks = jax.random.normal(ks[2], (n, sum(KERNELS), d))
    return d_streams, x, banks, None, jnp.arange(n) < n_live


def transpose_variants(d, n_tiles):
    """The defaults first (taps per source), then each other place the taps come from, then
    the default's taps with bf16 widened in place (``TRANSPOSE_WIDEN_CHOICES``).
    (Three or four items in flight, ``TRANSPOSE_SLOTS``, were 2-17% slower on an
    H200 and are taken out: commit 7037f37 has them.)"""
    run = lambda **kw: lambda *a: mosaic_gpu_bwd1.sources_transpose(*a, stream_kernels=KERNELS, **kw)  # noqa: E731
    taps = sorted(mosaic_gpu_bwd1.TRANSPOSE_TAPS_CHOICES, key=lambda t: t != "per_source")
    return ([(f"transpose taps {t}", run(taps=t, widen="extf")) for t in taps]
            + [("transpose widen bits", run(widen="bits"))])


def transpose_floor_bytes(batch, t_len, d) -> int:
    n, n_live = TRANSPOSE_SOURCES["base" if batch == 64 else "issue"]
    x_bytes = batch * t_len * d * 2
    return n_live * x_bytes * (len(KERNELS) + 2) + (n - n_live) * x_bytes  # dE and x read, d x written; zeros


def main(argv):
    shapes = SHAPES[:1] if "--base-only" in argv else SHAPES
    kernels = [("input kernel", inputs, variants, floor_bytes, "d_x, d_query, d_bank, d_W"),
               ("transpose", transpose_inputs, transpose_variants, transpose_floor_bytes, "d_x, d_bank")]
    if "--inputs-only" in argv or "--transpose-only" in argv:
        kernels = kernels[:1] if "--inputs-only" in argv else kernels[1:]
    if "--aot" in argv:
        return 1 if sum(compile_variants(shapes, make, var) for _, make, var, _, _ in kernels) else 0
    from pallas_kernels.depth_attention import bench

    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {jax.devices()[0].device_kind}", flush=True)
    for title, make, var, floor, what in kernels:
        time_variants(shapes, make, var, lambda batch, t_len, d, label, floor=floor: floor(batch, t_len, d) / bw * 1e3,
                      f" {title}", what, argv[argv.index("--only") + 1] if "--only" in argv else None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
