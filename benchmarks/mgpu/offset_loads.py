"""Which shared-memory loads at a row offset give the right values on the GPU: the probe the
Mosaic GPU port of phase 2's reverse-T input kernel needs (docs/kernels.md). Its transposed
conv shifts register tiles by 1..11 rows; the cheap way is to store a tile to shared memory and
load it back at a row offset, which is WRONG for bf16 rows loaded from a TMA-filled window at offsets not a multiple of 8 (exact at 16; interpret
mode exact throughout; ``scores_mgpu.py``).

One program, one warpgroup: a ``[128, bd]`` array goes to shared memory two ways, by TMA
(``tma``) and as two ``[64, bd]`` register tiles stored by the warpgroup (``stored``, the ring
the input kernel would keep), and comes back as ``[64, bd]`` WGMMA-layout tiles loaded at row
offsets 0..15 (``optimized`` loads, and ``optimized=False``), each written out by TMA. Prints,
per dtype, source, load mode and offset, whether the tile equals the source rows
``[offset, offset + 64)``. Run on the GPU: ``python benchmarks/mgpu/offset_loads.py``; on
the CPU ``--interpret`` (Pallas' Mosaic GPU interpret mode).

Result on the H200 (jax 0.11.2): exact at offsets 0 and 8 only, WRONG at
every other offset in 1..15, for float32 and bf16, TMA-filled and register-stored, optimized
loads or not; interpret mode exact throughout. A WGMMA-layout load from shared memory must
start at a multiple of 8 rows, so a shift by 1..7 rows cannot go through one window. Also
tried: the same loads in the ``WG_STRIDED`` layout (the tile as one flat run of
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


def probe_runtime_offsets(dtype, bd=32, interpret=False):
    """The same loads from a TMA-filled window at offsets 0..15, each offset a static
    int (``static``) and the same plus a runtime 0 (``dynamic``, the program index // 4: the row
    offset reaches the address arithmetic as a value, not a constant). Returns per mode the wrong
    offsets and, for the first wrong one, which source row each loaded row equals (-1: none)."""
    from jax import lax
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile = plgpu.Layout.WGMMA
    out = {}
    for mode in ("static", "dynamic"):
        def body(x_ref, out_ref, win, out_s, bar):
            plgpu.copy_gmem_to_smem(x_ref, win, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            zero = lax.axis_index("g") // 4
            for i, off in enumerate(OFFSETS):
                start = off if mode == "static" else zero + off
                v = plgpu.load(win.at[pl.ds(start, 64)], layout=tile, optimized=False)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                out_s[i % 2] = v
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_s.at[i % 2], out_ref.at[lax.axis_index("g"), i])
            plgpu.wait_smem_to_gmem(0)

        lane = {} if interpret or "--lane" not in sys.argv else dict(
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
        kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, len(OFFSETS), 64, bd), dtype), grid=(2,),
                              grid_names=("g",), **lane,
                              scratch_types=[plgpu.SMEM((128, bd), dtype), plgpu.SMEM((2, 64, bd), dtype),
                                             plgpu.Barrier(num_arrivals=1, num_barriers=1)],
                              interpret=plgpu.InterpretGPUParams() if interpret else False)
        x = np.asarray((jnp.arange(128 * bd, dtype=jnp.float32).reshape(128, bd) % 251).astype(dtype))
        got = np.asarray(jax.jit(kernel)(jnp.asarray(x)))[0]
        bad = [off for off in OFFSETS if not np.array_equal(got[off], x[off:off + 64])]
        rows = None
        if bad:
            rows = [next((r for r in range(128) if np.array_equal(got[bad[0], i], x[r])), -1) for i in range(64)]
        out[mode] = (bad, rows)
    return out


def map_elements(dtype, bd=32, interpret=False):
    """Where each element of a wrong load comes from: the window holds its row index in one run
    and its column index in another (small integers, exact in bf16); per offset 1..7, the
    source (row, column) of each loaded element of the first 16 rows."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile = plgpu.Layout.WGMMA

    def body(x_ref, out_ref, win, out_s, bar):
        plgpu.copy_gmem_to_smem(x_ref, win, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        for i, off in enumerate(range(8)):
            v = plgpu.load(win.at[pl.ds(off, 64)], layout=tile, optimized=False)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_s[i % 2] = v
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s.at[i % 2], out_ref.at[i])
        plgpu.wait_smem_to_gmem(0)

    kernel = jax.jit(plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((8, 64, bd), dtype), grid=(1,),
                                  grid_names=("g",),
                                  scratch_types=[plgpu.SMEM((128, bd), dtype), plgpu.SMEM((2, 64, bd), dtype),
                                                 plgpu.Barrier(num_arrivals=1, num_barriers=1)],
                                  interpret=plgpu.InterpretGPUParams() if interpret else False))
    rows = np.asarray(kernel(jnp.broadcast_to(jnp.arange(128, dtype=dtype)[:, None], (128, bd))))
    cols = np.asarray(kernel(jnp.broadcast_to(jnp.arange(bd, dtype=dtype)[None, :], (128, bd))))
    for off in range(1, 8):
        print(f"{jnp.dtype(dtype).name} offset {off}: loaded row i, columns 0..15 <- (source row - i - {off}, "
              f"source column)", flush=True)
        for i in range(16):
            pairs = " ".join(f"{int(rows[off, i, j]) - i - off:+d},{int(cols[off, i, j])}" for j in range(16))
            print(f"  {i:2d}: {pairs}", flush=True)


def main():
    interpret = "--interpret" in sys.argv
    if "--map" in sys.argv:
        for dtype in (jnp.bfloat16, jnp.float32):
            map_elements(dtype, interpret=interpret)
        return
    if "--runtime" in sys.argv:
        for dtype in (jnp.float32, jnp.bfloat16):
            try:
                res = probe_runtime_offsets(dtype, interpret=interpret)
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{jnp.dtype(dtype).name:8s} runtime offsets FAILED: {type(e).__name__}: {str(e)[:300]}")
                continue
            for mode, (bad, rows) in res.items():
                print(f"{jnp.dtype(dtype).name:8s} {mode:7s} offsets: "
                      f"{'all exact' if not bad else 'WRONG at ' + str(bad) + '; rows loaded at offset ' + str(bad[0]) + ': ' + str(rows)}",
                      flush=True)
        return
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
