"""Phase 1's backward passes 2 and 4 (wide form) and the expansion's transpose on the GPU: Triton's
``fused_bwd_phase1.gdots_call`` (with the XLA sum of its chunk partials into heads) and
``dstreams_call`` (the tiles ``tiling.choose_tiles`` gives them) against the Mosaic GPU kernels
``mosaic_gpu_bwd1.phase1_gdots`` and ``phase1_dstreams``; ``conv_transpose.sources_transpose``
against ``mosaic_gpu_bwd1.sources_transpose`` (bf16 stream cotangents; its floor: the live
sources' cotangents and rows read, their ``d x`` written, the others' zeros written). Shapes: `base`'s last block (B x T =
64 x 1024, d = 1024, S = 8 targets, 7 stacked sources of which ``--live`` (default 4) are
valid) and the bench shape (8 x 2048, d = 2048, S = 8, all 9 sources). MSAR's kernels (0, 4, 8,
12), one head, bf16 sources, a float32 ``g_A`` as ``S`` per-target arrays (as the model's
phase 1 hands it over), random non-zero ``P``, ``DSR``, ``W``. Median of 21 timings of 3
calls each after warm-up (``bench.timeit``); the error against Triton's outputs (the valid
sources' ``dE``), relative to their largest magnitude; the floor: ``g_A`` and the live sources
read once and, for ``dstreams``, the live sources' ``dE`` (bf16) written once, at the measured
copy bandwidth. Each Mosaic variant is (items in flight ``n_slots``, groups' ``g_A`` in shared
memory ``group_slots``, ``regs``: ``GA_REGISTERS``), with its shared memory and how many
programs fit on an SM: the defaults, or with ``--variants`` a set around them; ``--bd16``: each
variant with 32- and 16-channel chunks (``block_d``); ``--store-groups``: gdots with its stores
per (head, stream) committed once and once each (``mosaic_gpu.STORE_GROUPS``). ``--attnres``: one
stream without a conv (AttnRes; kernels ``(0,)``, no transpose) with ``ATTNRES_VARIANTS`` at 16-,
32- and 64-channel chunks. ``--ga_bf16``: ``g_A`` in bf16, as the value channel hands
one stream's kernels the read's ``dh``. ``--window-fetch``: dstreams with each item
bringing its source's lag windows and with a chunk's windows brought once for all streams
(``mosaic_gpu_bwd1.WINDOW_FETCHES``); ``--dstreams-only``: leave out gdots and the
transpose. ``--windows P,Q``: gdots and dstreams with each placement of the lag windows
(``mosaic_gpu.WINDOWS``; the question: ``"padded"``'s 80-byte rows touch three 32-byte sectors for
64 bytes of channels, ``"single"``'s two, where L2 does not hold the neighbours' rows).
``--stream-programs P,Q``: gdots and dstreams with each ``mosaic_gpu_bwd1.STREAM_PROGRAMS``
("split", a program per stream, its tile's m programs side by side). ``--rows-fetch P,Q``:
dstreams with each ``mosaic_gpu_bwd1.ROWS_FETCHES`` ("per_stream", each source's
per-token rows once per (head, stream) instead of once per item). Run on the GPU: ``python
benchmarks/mgpu/time_phase1_bwd.py [--base-only] [--variants] [--bd16] [--attnres] [--ga_bf16]
[--window-fetch] [--dstreams-only] [--windows P,Q] [--stream-programs P,Q] [--rows-fetch P,Q]``."""
import sys
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import (bench, conv_transpose, fused, fused_bwd_phase1, mosaic_gpu, mosaic_gpu_bwd1,
                                            tiling)
from time_phase2 import set_store_groups  # this folder, on the path when run as a script

KERNELS = (0, 4, 8, 12)
# (n_slots, group_slots, GA_REGISTERS)
VARIANTS = {"gdots": ((2, 1, True),), "dstreams": ((3, 2, True),)}
if "--variants" in sys.argv:  # the set SLOTS and GA_REGISTERS were chosen from
    VARIANTS = {"gdots": ((3, 2, False), (2, 1, False), (3, 1, False), (3, 2, True), (2, 1, True)),
                "dstreams": ((3, 2, False), (2, 1, False), (3, 2, True), (2, 1, True))}
GA_DTYPE = jnp.bfloat16 if "--ga_bf16" in sys.argv else jnp.float32
SM_SMEM = 233472  # the H200's shared memory per SM (228 KiB), 1 KiB of it reserved per program


CHUNKS = (32, 16) if "--bd16" in sys.argv else (32,)
# One stream: (n_slots, group_slots, GA_REGISTERS, block_d). 64 channels hold 256 registers of g_A
# per thread, so not in registers there, and one group slot (two would not fit shared memory).
ATTNRES_VARIANTS = {
    "gdots": ((2, 1, True, 32), (2, 1, True, 16), (3, 2, True, 16), (2, 1, False, 64), (3, 1, False, 64)),
    "dstreams": ((3, 2, True, 32), (3, 2, True, 16), (2, 1, True, 16), (3, 1, False, 64), (2, 1, False, 64)),
}
if "--attnres" in sys.argv:
    KERNELS = (0,)
    VARIANTS = {mode: tuple(v[:3] for v in vs) for mode, vs in ATTNRES_VARIANTS.items()}
GROUPS = (True, False) if "--store-groups" in sys.argv else (True,)
# dstreams' window fetches to time (None: the module's default)
FETCHES = mosaic_gpu_bwd1.WINDOW_FETCHES if "--window-fetch" in sys.argv else (None,)
DSTREAMS_ONLY = "--dstreams-only" in sys.argv
# gdots' and dstreams' lag-window placements to time (None: each kernel's default)
WINDOW_PLACEMENTS = tuple(sys.argv[sys.argv.index("--windows") + 1].split(",")) if "--windows" in sys.argv else (None,)
if any(w is not None and w not in mosaic_gpu.WINDOWS for w in WINDOW_PLACEMENTS):
    sys.exit(f"--windows {','.join(WINDOW_PLACEMENTS)}: each must be one of {mosaic_gpu.WINDOWS}")
# gdots' and dstreams' stream programs to time (None: each kernel's default)
STREAM_PROGRAMS = (tuple(sys.argv[sys.argv.index("--stream-programs") + 1].split(","))
                   if "--stream-programs" in sys.argv else (None,))
if any(sp is not None and sp not in mosaic_gpu_bwd1.STREAM_PROGRAMS for sp in STREAM_PROGRAMS):
    sys.exit(f"--stream-programs {','.join(STREAM_PROGRAMS)}: each must be one of {mosaic_gpu_bwd1.STREAM_PROGRAMS}")
# dstreams' rows fetches to time (None: the default)
ROWS = tuple(sys.argv[sys.argv.index("--rows-fetch") + 1].split(",")) if "--rows-fetch" in sys.argv else (None,)
if any(rf is not None and rf not in mosaic_gpu_bwd1.ROWS_FETCHES for rf in ROWS):
    sys.exit(f"--rows-fetch {','.join(ROWS)}: each must be one of {mosaic_gpu_bwd1.ROWS_FETCHES}")


def _variants(mode, groups=GROUPS):
    """``((n_slots, group_slots, regs), block_d, store groups)`` to time for ``mode``."""
    if "--attnres" in sys.argv:
        return [(v[:3], v[3], g) for v in ATTNRES_VARIANTS[mode] for g in groups]
    return [(v, bd, g) for v in VARIANTS[mode] for bd in CHUNKS for g in groups]


def _variant_label(mode, n, n_targets, slots, groups, regs, bd=32, fetch=None, windows=None, programs=None,
                   rows=None):
    smem = mosaic_gpu_bwd1.smem_bytes(block_d=bd, stream_kernels=KERNELS, heads=1, x_dtype=jnp.bfloat16,
                                      acc_dtype=GA_DTYPE, n_targets=n_targets, n_sources=n, mode=mode,
                                      n_slots=slots, group_slots=groups, windows=windows,
                                      window_fetch=fetch or mosaic_gpu_bwd1.DEFAULT_DSTREAMS_WINDOW_FETCH,
                                      rows_fetch=rows or mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH[
                                          "one_stream" if len(KERNELS) == 1 else "several"])
    return (f"mosaic {mode} {slots}/{groups}{' regs' if regs else ''}{f' bd={bd}' if bd != 32 else ''}"
            f"{f' {fetch}' if fetch else ''}{f' {windows}' if windows else ''}{f' {programs}' if programs else ''}"
            f"{f' rows {rows}' if rows else ''} "
            f"({smem // 1024} KB, "
            f"{SM_SMEM // (smem + 1024)}/SM)")


def _timed(label, fn, args, want, floor_ms, rows=None):
    try:
        f = jax.jit(fn)
        got = f(*args)
        if want is None:
            want, err = got, 0.0
        else:
            g, w = (got, want) if rows is None else (got[rows], want[rows])
            err = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                            / jnp.max(jnp.abs(b.astype(jnp.float32))))
                      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w)))
        del got
        ms = bench.timeit(f, *args, reps=21, inner=3)[0] * 1e3
        print(f"{label:50s} {ms:8.3f} ms  {floor_ms / ms:6.1%} of floor  rel err vs triton {err:.1e}", flush=True)
    except Exception:  # noqa: BLE001
        print(f"{label:50s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)
    return want


def main():
    live = int(sys.argv[sys.argv.index("--live") + 1]) if "--live" in sys.argv else 4
    shapes = (("base", (7, live, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8)))
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes[:1] if "--base-only" in sys.argv else shapes:
        m, heads = len(KERNELS), 1
        k = jax.random.split(jax.random.key(0), 7)
        sources = jax.random.normal(k[0], (n, batch, t_len, d), jnp.bfloat16)
        banks = 0.3 * jax.random.normal(k[1], (n, sum(KERNELS), d), jnp.float32) if any(KERNELS) else None
        queries = jax.random.normal(k[2], (n_targets, m, d), jnp.float32)
        g_acc = [jax.random.normal(kk, (m, batch, t_len, d), GA_DTYPE) for kk in jax.random.split(k[3], n_targets)]
        valid = jnp.arange(n) < n_live
        p = jax.random.uniform(k[4], (n_targets, n, m, batch, t_len, heads)) * valid[None, :, None, None, None, None]
        dsr = jax.random.normal(k[5], (n_targets, n, m, batch, t_len, heads))
        w = jax.random.normal(k[6], (n, m, batch, t_len))
        tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(KERNELS), n_targets=n_targets, backend="triton",
                                    n_streams=m)
        t_pad, _ = fused._prepare(t_len, None, tiles)
        pad = fused._pad_t
        kw = dict(stream_kernels=KERNELS, tiles=tiles, backend="triton", interpret=False)
        ga_bytes = n_targets * m * batch * t_len * d * jnp.dtype(GA_DTYPE).itemsize
        x_bytes = n_live * batch * t_len * d * 2
        print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}",
              flush=True)

        def triton_gdots(x, b, ga, v):
            gd = fused_bwd_phase1.gdots_call(pad(x, 2, t_pad), b, [pad(a, 2, t_pad) for a in ga], None, valid=v,
                                             **kw)
            return jnp.sum(gd.reshape(*gd.shape[:-1], heads, -1), axis=-1)[..., :t_len, :]

        floor = (ga_bytes + x_bytes) / bw * 1e3
        print(f"# gdots: floor {floor:.4f} ms", flush=True)
        want = None if DSTREAMS_ONLY else _timed("triton gdots", triton_gdots, (sources, banks, g_acc, valid), None,
                                                 floor)
        for ((slots, groups, regs), bd, grouped), win, sp in [] if DSTREAMS_ONLY else (
                (v, w, sp) for v in _variants("gdots") for w in WINDOW_PLACEMENTS for sp in STREAM_PROGRAMS):
            mosaic_gpu_bwd1.GA_REGISTERS = regs  # read when the jitted function traces (first call in _timed)
            set_store_groups(grouped)
            fn = (lambda sl, gs, bd, win, sp: lambda x, b, ga, v: mosaic_gpu_bwd1.phase1_gdots(
                x, b, ga, None, v, stream_kernels=KERNELS, heads=heads, n_slots=sl, group_slots=gs, block_d=bd,
                windows=win, stream_programs=sp))(slots, groups, bd, win, sp)
            _timed(_variant_label("gdots", n, n_targets, slots, groups, regs, bd, windows=win, programs=sp)
                   + ("" if len(GROUPS) == 1 else " grouped" if grouped else " one by one"), fn,
                   (sources, banks, g_acc, valid), want, floor)
        del want

        def triton_dstreams(x, b, q, ga, p, dsr, w, v):
            return fused_bwd_phase1.dstreams_call(
                pad(x, 2, t_pad), b, q, [pad(a, 2, t_pad) for a in ga], pad(p, 4, t_pad), pad(dsr, 4, t_pad),
                pad(w, 3, t_pad)[..., None], None, heads=heads, out_dtype=jnp.bfloat16, valid=v, **kw)[:, :, :, :t_len]

        floor = (ga_bytes + x_bytes + x_bytes * m) / bw * 1e3
        print(f"# dstreams: floor {floor:.4f} ms", flush=True)
        args = (sources, banks, queries, g_acc, p, dsr, w, valid)
        want = _timed("triton dstreams", triton_dstreams, args, None, floor)
        for ((slots, groups, regs), bd, _), fetch, win, sp, rf in (
                (v, f, w, sp, rf) for v in _variants("dstreams", groups=(True,)) for f in FETCHES
                for w in WINDOW_PLACEMENTS for sp in STREAM_PROGRAMS for rf in ROWS):
            if fetch == "per_chunk" and (sp == "split" or rf == "per_stream"):  # not forms the kernel takes
                continue
            mosaic_gpu_bwd1.GA_REGISTERS = regs
            fn = (lambda sl, gs, bd, wf, win, sp, rf: lambda x, b, q, ga, p, dsr, w, v: mosaic_gpu_bwd1.phase1_dstreams(
                x, b, q, ga, p, dsr, w, None, v, stream_kernels=KERNELS, heads=heads, out_dtype=jnp.bfloat16,
                n_slots=sl, group_slots=gs, block_d=bd, window_fetch=wf, windows=win, stream_programs=sp,
                rows_fetch=rf))(slots, groups, bd, fetch, win, sp, rf)
            _timed(_variant_label("dstreams", n, n_targets, slots, groups, regs, bd, fetch, win, sp, rf), fn, args,
                   want, floor, rows=slice(0, n_live))
        del want

        if not any(KERNELS) or DSTREAMS_ONLY:  # no conv: the transpose is a sum over the streams, in XLA
            continue
        # the expansion's transpose of the live sources' stream cotangents (bf16, as the wide form writes them)
        d_streams = jax.random.normal(k[6], (n, m, batch, t_len, d), jnp.bfloat16)

        def triton_transpose(de, x, b, v):
            dx, dbank = conv_transpose.sources_transpose(de, x, b, None, v, stream_kernels=KERNELS, tiles=tiles,
                                                         backend="triton", interpret=False)
            return dx[:n_live], dbank

        def mosaic_transpose(de, x, b, v):
            dx, dbank = mosaic_gpu_bwd1.sources_transpose(de, x, b, None, v, stream_kernels=KERNELS)
            return dx[:n_live], dbank

        floor = (x_bytes * m + 2 * x_bytes + (n - n_live) * batch * t_len * d * 2) / bw * 1e3
        print(f"# transpose: floor {floor:.4f} ms", flush=True)
        args = (d_streams, sources, banks, valid)
        want = _timed("triton transpose", triton_transpose, args, None, floor)
        _timed("mosaic transpose", mosaic_transpose, args, want, floor)
        del want, d_streams


if __name__ == "__main__":
    main()
