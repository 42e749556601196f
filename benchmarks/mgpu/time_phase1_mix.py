"""Phase 1's mixing pass on the GPU: Triton's ``fused.mix_call(mode="acc")`` (the tiles
``tiling.choose_tiles`` gives it) against the Mosaic GPU kernel ``mosaic_gpu.phase1_mix``
with 32-channel chunks, 2 or 3 items in flight (``n_slots``) and each placement of the lag
windows (``mosaic_gpu.WINDOWS``; with ``--narrow`` also 16-channel chunks with 2 to 4); a
variant whose program does not fit in shared memory is reported as such, with each one's
shared memory and how many programs fit on an SM. Both write one output per target
(``per_target=True``, as the model calls phase 1), float32 and, with ``--bf16``, bf16 states.
Shapes: `base`'s last block (B x T = 64 x 1024, d = 1024, S = 8 targets, 7 stacked sources of
which ``--live`` (default 4) are valid) and the bench shape (8 x 2048, d = 2048, S = 8, all 9
sources). MSAR's kernels (0, 4, 8, 12), one head, bf16 sources, random weights ``p`` (zero on
the invalid sources). Median of 21 timings of 3 calls each after warm-up (``bench.timeit``);
the error of the Mosaic states against Triton's, relative to their largest magnitude; the
floor: the states written once and the live sources read once at the measured copy bandwidth.
Run on the GPU: ``python benchmarks/mgpu/time_phase1_mix.py [--bf16] [--base-only] [--narrow]``;
``--bf16-aligned``: only the bf16 state and the aligned windows. ``--single``: 3 slots, the
aligned windows against one window per chunk (``"single"``, Lane semantics), with
its output tiles swizzled and plain. ``--single-slots``: one window per chunk with 2, 3 and 4 slots.
``--chunks``: the padded window with 32-channel chunks (3 slots) and 64 (2 and 3 slots).
``--bd16``: the padded window with 32-channel chunks (3 slots) and 16 (3 and 4 slots;
the 32-channel kernel holds 255 registers, so two programs per SM). ``--store-groups``: the
default kernel with its 8 stores per chunk and stream committed once (``"grouped"``) and once
each (``mosaic_gpu.STORE_GROUPS``). ``--attnres``: AttnRes's single stream (kernels ``(0,)``, no bank),
Triton against the Mosaic default. ``--triton-tiles``: Triton's kernel alone with the tiles
``choose_tiles`` gives it (first) and nine others (tokens x channels per program, warps, stages);
with ``--small-tiles`` seven smaller ones instead. ``--fetch-bound``: the
Mosaic kernel against itself with parts of its traffic left out (``mosaic_gpu.MIX_TIMING_SKIPS``;
the outputs then wrong, their error printed all the same): how much of the pass each part
holds. With the windows per chunk (the default) the ``p`` rows of streams 1-3
or the state's stores; per item also streams 1-3's lag windows and both. ``--window-fetch``:
the default with each item bringing its lag window and with a chunk's windows
brought once for all streams (``mosaic_gpu.MIX_WINDOW_FETCHES``), 3 and 2 items in flight. (The stores spread over the next
chunk and stream's items, at commit a4a473d, were 1.3-1.8x slower; that option is gone.)
"""
import sys
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import bench, fused, mosaic_gpu, tiling
from time_phase2 import PLAIN, set_lane_tile_swizzle, set_store_groups  # this folder, on the path as a script

KERNELS = (0,) if "--attnres" in sys.argv else (0, 4, 8, 12)
# (block_d, n_slots, windows); 16-channel chunks (slower on the H200) with --narrow
MOSAIC_VARIANTS = ((32, 2, "per_lag"), (32, 3, "per_lag"), (32, 2, "aligned"), (32, 3, "aligned"))
NARROW_VARIANTS = ((16, 2, "per_lag"), (16, 3, "per_lag"), (16, 4, "per_lag"))
SM_SMEM = 233472  # the H200's shared memory per SM (228 KiB), 1 KiB of it reserved per program


def main():
    live = int(sys.argv[sys.argv.index("--live") + 1]) if "--live" in sys.argv else 4
    state_dtypes = [jnp.float32] + ([jnp.bfloat16] if "--bf16" in sys.argv else [])
    mosaic_variants = MOSAIC_VARIANTS
    if "--bf16-aligned" in sys.argv:  # a shorter device call: bf16 state, aligned windows only
        state_dtypes, mosaic_variants = [jnp.bfloat16], tuple(v for v in MOSAIC_VARIANTS if v[2] == "aligned")
    shapes = (("base", (7, live, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8)))
    if "--single" in sys.argv:  # aligned against one window per chunk (Lane semantics), float32 state, 3 slots
        mosaic_variants = ((32, 3, "aligned"), (32, 3, "single"), (32, 3, PLAIN))
    if "--padded" in sys.argv:  # the one window with 64-byte against 80-byte rows, 3 slots
        mosaic_variants = ((32, 3, "single"), (32, 3, "padded"))
    if "--single-slots" in sys.argv:  # one window per chunk with 2-4 slots (2: three programs per SM)
        mosaic_variants = ((32, 2, "single"), (32, 3, "single"), (32, 4, "single"))
    if "--chunks" in sys.argv:  # the padded window with 32- and 64-channel chunks
        mosaic_variants = ((32, 3, "padded"), (64, 2, "padded"), (64, 3, "padded"))
    if "--bd16" in sys.argv:  # the padded window with 32- and 16-channel chunks
        mosaic_variants = ((32, 3, "padded"), (16, 3, "padded"), (16, 4, "padded"))
    if "--attnres" in sys.argv:  # one stream: Triton (what "auto" takes for it) and the Mosaic default
        mosaic_variants = ((32, 3, "padded"),)
    # (timing_skip, window_fetch) per Mosaic variant: the default fetch, nothing left out
    runs = [((), mosaic_gpu.DEFAULT_MIX_WINDOW_FETCH)]
    if "--window-fetch" in sys.argv:  # a chunk's windows once for all streams
        mosaic_variants = ((32, 3, "padded"), (32, 2, "padded"))
        runs = [((), fetch) for fetch in mosaic_gpu.MIX_WINDOW_FETCHES]
    if "--fetch-bound" in sys.argv:  # parts of the traffic left out (timing only): per chunk (the default)
        # its p rows or its stores; per item also streams 1-3's windows
        mosaic_variants = ((32, 3, "padded"),)
        runs = [(k, "per_chunk") for k in ((), ("p",), ("stores",))] + [
            (k, "per_item") for k in ((), ("windows",), ("p",), ("p", "windows"), ("stores",))]
    if "--store-groups" in sys.argv:  # the default, its stores committed once per group and once each
        mosaic_variants = ((32, 3, "padded", "grouped"), (32, 3, "padded", "one by one"))
    # (block_t, block_d_mix, num_warps, num_stages) of Triton's kernel, the first choose_tiles'
    triton_tiles = [None]
    if "--triton-tiles" in sys.argv:
        mosaic_variants = ()
        triton_tiles += [(16, 64, 4, 2), (16, 64, 8, 1), (16, 128, 8, 1), (32, 64, 8, 1), (32, 64, 4, 2),
                         (32, 32, 4, 1), (32, 128, 8, 1), (64, 32, 8, 1), (64, 64, 8, 1)]
        if "--small-tiles" in sys.argv:  # the default was the best of the tiles above and the smallest: smaller ones
            triton_tiles = [None, (16, 32, 4, 1), (16, 32, 2, 1), (16, 64, 2, 1), (16, 128, 4, 1), (8, 64, 4, 1),
                            (8, 128, 4, 1), (8, 64, 2, 1)]
    if "--base-only" in sys.argv:
        shapes = shapes[:1]
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes:
        m = len(KERNELS)
        k = jax.random.split(jax.random.key(0), 3)
        sources = jax.random.normal(k[0], (n, batch, t_len, d), jnp.bfloat16)
        banks = 0.3 * jax.random.normal(k[1], (n, sum(KERNELS), d), jnp.float32) if any(KERNELS) else None
        valid = jnp.arange(n) < n_live
        tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max([1, *KERNELS]), n_targets=n_targets, backend="triton",
                                    n_streams=m)
        t_pad, _ = fused._prepare(t_len, None, tiles)
        p = jax.random.uniform(k[2], (n_targets, n, m, batch, t_pad, 1)) * valid[None, :, None, None, None, None]
        for dtype in state_dtypes:
            floor_ms = (n_targets * m * batch * t_len * d * jnp.dtype(dtype).itemsize
                        + n_live * batch * t_len * d * 2) / bw * 1e3

            def triton(x, b, p, v, dtype=dtype, tiles=tiles):
                out = fused.mix_call(fused._pad_t(x, 2, t_pad), b, p, None, mode="acc", stream_kernels=KERNELS,
                                     heads=1, tiles=tiles, backend="triton", interpret=False, out_dtype=dtype,
                                     valid=v, split_targets=True)
                return [a[..., :t_len, :] for a in out]

            variants = {}
            for tt in triton_tiles:
                if tt is None:
                    variants["triton"] = triton
                    continue
                bt, bdm, warps, stages = tt
                alt = tiling.Tiles(bt, tiles.block_d_scores, bdm, num_warps=warps, num_stages=stages)
                variants[f"triton {bt}x{bdm} w{warps} s{stages}"] = (
                    lambda alt: lambda x, b, p, v, dtype=dtype: triton(x, b, p, v, dtype, alt))(alt)
            for (bd, slots, windows, *stores), (skip, fetch) in [(v, r) for v in mosaic_variants + (
                    NARROW_VARIANTS if "--narrow" in sys.argv else ()) for r in runs]:
                label = (f"mosaic bd={bd} n_slots={slots} {windows}" + "".join(f" stores {s}" for s in stores)
                         + "".join(f" -{k}" for k in skip) + f" {fetch}")
                windows = "single" if windows == PLAIN else windows
                smem = mosaic_gpu.mix_smem_bytes(block_d=bd, stream_kernels=KERNELS, heads=1, x_dtype=jnp.bfloat16,
                                                 out_dtype=dtype, n_targets=n_targets, n_slots=slots, windows=windows,
                                                 window_fetch=fetch, n_sources=n)
                if smem > mosaic_gpu.SMEM_BYTES:
                    print(f"{label:36s} does not fit: {smem} bytes of shared memory", flush=True)
                    continue
                print(f"{label:36s} {smem} bytes of shared memory: {SM_SMEM // (smem + 1024)} programs per SM",
                      flush=True)
                variants[label] = (lambda sl, dt, bd, w, k, wf: lambda x, b, p, v: mosaic_gpu.phase1_mix(
                    x, b, p, None, v, stream_kernels=KERNELS, heads=1, out_dtype=dt, per_target=True,
                    n_slots=sl, block_d=bd, windows=w, timing_skip=k, window_fetch=wf))(slots, dtype, bd, windows,
                                                                                      skip, fetch)
            print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}, "
                  f"{jnp.dtype(dtype).name} state; floor {floor_ms:.4f} ms", flush=True)
            want = None
            for label, fn in variants.items():
                try:
                    set_lane_tile_swizzle(PLAIN not in label)
                    set_store_groups("one by one" not in label)
                    f = jax.jit(fn)
                    got = f(sources, banks, p, valid)
                    if want is None:
                        want, err = got, 0.0
                    else:
                        err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))
                                        / jnp.max(jnp.abs(w.astype(jnp.float32)))) for g, w in zip(got, want))
                    del got
                    ms = bench.timeit(f, sources, banks, p, valid, reps=21, inner=3)[0] * 1e3
                    print(f"{label:36s} {ms:8.3f} ms  {floor_ms / ms:6.1%} of floor  rel err vs triton {err:.1e}",
                          flush=True)
                except Exception:  # noqa: BLE001
                    print(f"{label:36s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
            del want


if __name__ == "__main__":
    main()
