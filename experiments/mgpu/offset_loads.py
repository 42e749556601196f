"""Which shared-memory loads at a row offset give the right values on the GPU: the probe the
Mosaic GPU port of phase 2's reverse-T input kernel needs (BENCHMARKS.md, kernels, what
remains). Its transposed conv shifts register tiles by 1..11 rows; the cheap way is to store a
tile to shared memory and load it back at a row offset, which session 15 found WRONG for bf16
rows loaded from a TMA-filled window at offsets not a multiple of 8 (exact at 16; interpret
mode exact throughout; ``scores_mgpu.py``).

One program, one warpgroup: a ``[128, bd]`` array goes to shared memory two ways, by TMA
(``tma``) and as two ``[64, bd]`` register tiles stored by the warpgroup (``stored``, the ring
the input kernel would keep), and comes back as ``[64, bd]`` WGMMA-layout tiles loaded at row
offsets 0..15 (``optimized`` loads, and ``optimized=False``), each written out by TMA. Prints,
per dtype, source, load mode and offset, whether the tile equals the source rows
``[offset, offset + 64)``. Run on the GPU: ``python experiments/mgpu/offset_loads.py``; on
the CPU ``--interpret`` (Pallas' Mosaic GPU interpret mode).

Result on the H200 (session 17, call 2; jax 0.11.2): exact at offsets 0 and 8 only, WRONG at
every other offset in 1..15, for float32 and bf16, TMA-filled and register-stored, optimized
loads or not; interpret mode exact throughout. A WGMMA-layout load from shared memory must
start at a multiple of 8 rows, so a shift by 1..7 rows cannot go through one window. Tried
after that run: the same loads in the ``WG_STRIDED`` layout (the tile as one flat run of
elements) did not finish lowering for sm_90 within 60 s of CPU, even at offset 0, so that
variant is not here."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

OFFSETS = tuple(range(16))


def probe(dtype, bd=32, optimized=True, interpret=False):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile = plgpu.Layout.WGMMA
    n = len(OFFSETS)

    def body(x_ref, tma_out, stored_out, win, ring, out_s, bar):
        plgpu.copy_gmem_to_smem(x_ref, win, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        for half in range(2):  # the same rows stored from registers, as the input kernel would
            ring[pl.ds(half * 64, 64), :] = plgpu.load(win.at[pl.ds(half * 64, 64)], layout=tile)
        plgpu.commit_smem()
        for src, out in ((win, tma_out), (ring, stored_out)):
            for i, off in enumerate(OFFSETS):
                v = plgpu.load(src.at[pl.ds(off, 64)], layout=tile, optimized=optimized)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_s[i % 2] = v
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[i % 2], out.at[i])
        plgpu.wait_smem_to_gmem(0)

    out = jax.ShapeDtypeStruct((n, 64, bd), dtype)
    kernel = plgpu.kernel(body, out_type=(out, out), grid=(1,), grid_names=("g",),
                          scratch_types=[plgpu.SMEM((128, bd), dtype), plgpu.SMEM((128, bd), dtype),
                                         plgpu.SMEM((2, 64, bd), dtype), plgpu.Barrier(num_arrivals=1, num_barriers=1)],
                          interpret=plgpu.InterpretGPUParams() if interpret else False)
    x = (jnp.arange(128 * bd, dtype=jnp.float32).reshape(128, bd) % 251).astype(dtype)
    got = jax.jit(kernel)(x)
    want = np.stack([np.asarray(x[off:off + 64]) for off in OFFSETS])
    return {name: [bool(np.array_equal(np.asarray(g[i]), want[i])) for i in range(n)]
            for name, g in zip(("tma", "stored"), got)}


def main():
    interpret = "--interpret" in sys.argv
    for dtype in (jnp.float32, jnp.bfloat16):
        for optimized in (True, False):
            try:
                res = probe(dtype, optimized=optimized, interpret=interpret)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{jnp.dtype(dtype).name:8s} optimized={optimized!s:5s} FAILED: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)
                continue
            for src, ok in res.items():
                bad = [off for off, good in zip(OFFSETS, ok) if not good]
                print(f"{jnp.dtype(dtype).name:8s} optimized={optimized!s:5s} {src:6s} "
                      f"{'all exact' if not bad else 'WRONG at offsets ' + str(bad)}", flush=True)


if __name__ == "__main__":
    main()
