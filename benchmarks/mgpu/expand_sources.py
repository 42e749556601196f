"""Where should a Mosaic GPU kernel get a tile's conv lags from: TMA-filled lag windows in shared
memory (what the kernels do: ``mosaic_gpu._Lags``, one window per lag modulo 8), loads straight
from global memory at any row offset (through L1), or one window and a 0/1 shift matrix per lag
on the tensor cores?

``tma_rate.py`` shows that TMA copies cost bytes, not copies: the aligned windows
bring 544 rows into shared memory per 64-row tile and chunk (8.5x the partial, from L2) and that
traffic, not the count of copies, bounds the kernels. A WGMMA-layout load from shared memory
is exact only at multiples of 8 rows (``offset_loads.py``), so one window of 75
rows cannot serve all lags. A load from global memory (``plgpu.load(gmem_ref.at[...],
optimized=False)``) takes any row offset; its overlap would hit L1 instead of L2.

This script runs the expansion alone (Eq. 10, kernels (0, 4, 8, 12), every stream's sum of
squares per token, as the scoring pass does) both ways at `base`'s phase-2 shape (B x T = 64 x
1024, d = 1024, bf16 partial; 32-channel chunks, and 64 for global memory), checks each against
plain jnp, and times them (median of 21). First it checks WGMMA-layout loads from global memory
at row offsets 0..15 for exactness. Run: ``python benchmarks/mgpu/expand_sources.py`` (GPU);
``--interpret`` on the CPU at a tiny shape (a smoke test; interpret mode is exact either way).
``tma_fetch``: the TMA form's copies with one load per chunk and no conv, to split the fetch's
time from the loads' and arithmetic's. ``tma_wgmma``: one window of 96 rows (128 for 64
channels) per chunk, each lag's tile ``S_delta @ window`` with ``S_delta[i, k] = [k == i + 16 -
delta]`` built in registers (exact: bf16 values, float32 accumulation); the interpret mode
cannot run it (a WGMMA with its left operand in registers), so ``--interpret`` reports it
FAILED; ``--wgmma`` runs only the TMA windows and this form, 32 and 64 channels (untimed).
``--single``: one window of 80 rows per chunk, each lag loaded at
its own row offset (needs ``--lane``: Lane semantics, no inferred swizzle); ``--single-pad``:
the same with 64-byte rows against rows padded to 80 bytes (``PAD`` more channels fetched), to
see whether bank conflicts slow the single window's loads."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import bench, mosaic_gpu
from pallas_kernels.depth_attention.fused import _stream_layout

KERNELS = (0, 4, 8, 12)
PAD = 8  # channels past the chunk in "tma_single_pad"'s window rows
FRONT = 16  # rows of zeros in front of the partial (a multiple of 8, so TMA windows stay aligned)


def gmem_offset_probe(dtype, interpret):
    """Per row offset 0..15: does a WGMMA-layout load of rows [off, off + 64) from global memory
    equal those rows?"""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, out, out_s):
        for off in range(16):
            v = plgpu.load(x_ref.at[pl.ds(off, 64)], layout=plgpu.Layout.WGMMA, optimized=False)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_s[off % 2] = v
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_s.at[off % 2], out.at[off])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((16, 64, 32), dtype), grid=(1,), grid_names=("g",),
                          scratch_types=[plgpu.SMEM((2, 64, 32), dtype)],
                          interpret=plgpu.InterpretGPUParams() if interpret else False)
    x = (jnp.arange(128 * 32, dtype=jnp.float32).reshape(128, 32) % 251).astype(dtype)
    got = np.asarray(jax.jit(kernel)(x))
    return [off for off in range(16) if not np.array_equal(got[off], np.asarray(x[off:off + 64]))]


def build(source, batch, t_len, d, bd=32, interpret=False):
    """``sumsq[m, B, T]`` of the streams of ``x[B, FRONT + T, d]`` (bf16) with ``bank[24, d]``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bt, m = mosaic_gpu.BLOCK_T, len(KERNELS)
    layout = _stream_layout(KERNELS)
    max_lag, nc = max(KERNELS), d // bd
    lags = mosaic_gpu._Lags.of(max_lag, "aligned")
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    n_taps = sum(KERNELS)

    def finish(sqs, ss_s, ss_ref, b, t0):
        for r in range(m):
            ss_s[r] = sqs[r]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(ss_s, ss_ref.at[:, b, pl.ds(t0, bt)])
        plgpu.wait_smem_to_gmem(0)

    zero = lambda: plgpu.layout_cast(jnp.zeros((bt,), jnp.float32), row)  # noqa: E731

    def sumsq_of(sqs, bs, slot, lag_tile):
        """``sqs`` plus each stream's sum of squares over the chunk, its lags from ``lag_tile(delta)``
        and its taps from ``bs[slot]``."""
        es = [None] * m
        for delta in range(max_lag):
            xl = lag_tile(delta).astype(jnp.float32)
            for r, (kernel, off) in enumerate(layout):
                if kernel == 0:
                    es[r] = xl if delta == 0 else es[r]
                elif delta < kernel:
                    tap = plgpu.load(bs, (slot, off + delta), layout=col)
                    term = lax.broadcast_in_dim(tap, (bt, bd), [1]) * xl
                    es[r] = term if es[r] is None else es[r] + term
        return [sq + jnp.sum(e * e, axis=1) for sq, e in zip(sqs, es)]

    if source in ("tma_single", "tma_single_dyn"):
        lags = mosaic_gpu._Lags.of(max_lag, "single")
    if source in ("tma", "tma_fetch", "tma_single", "tma_single_dyn"):
        def body(x_ref, bank_ref, ss_ref, xs, bs, ss_s, bar):
            b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt
            lags_ = lags._replace(zero=b // 4096) if source == "tma_single_dyn" else lags  # a runtime 0

            def fetch(c, slot):
                mosaic_gpu._fetch_partial(plgpu, x_ref, bank_ref, xs, bs, b, t0, FRONT, c, bd, slot, bar, lags_,
                                          max_lag)

            def chunk(c, slot, head, sqs):
                if source == "tma_fetch":  # the same copies, one load and no conv: what the fetch alone costs
                    es = [lags_.load(plgpu, xs, slot, 0).astype(jnp.float32)] * m
                else:
                    es = mosaic_gpu._expand_all(plgpu, xs, bs, slot, layout, [None] * max_lag, bt, bd, lags_)
                return [sq + jnp.sum(e * e, axis=1) for sq, e in zip(sqs, es)]

            sqs = mosaic_gpu._pipelined(plgpu, fetch, bar, nc, 1, chunk, [zero() for _ in range(m)])
            finish(sqs, ss_s, ss_ref, b, t0)

        scratch = [plgpu.SMEM((2, lags.count, lags.rows, bd), jnp.bfloat16), plgpu.SMEM((2, n_taps, bd), jnp.float32),
                   plgpu.SMEM((m, bt), jnp.float32), plgpu.Barrier(num_arrivals=lags.count + 1, num_barriers=2)]
    elif source == "tma_single_pad":
        # one window per chunk as "single", but its rows PAD channels wider (80 bytes for 32 bf16
        # channels + 8): the 8 rows a warp's WGMMA-layout load touches then start 20 banks apart
        # instead of 16 (64-byte rows put rows r and r + 2 on the same banks: 4-way conflicts,
        # if the unoptimized loads are what slows "single" down); the PAD extra channels are
        # fetched and never read (x carries PAD columns past d)
        lags = mosaic_gpu._Lags.of(max_lag, "single")
        front = 8 * lags.extra

        def body(x_ref, bank_ref, ss_ref, xs, bs, ss_s, bar):
            b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt

            def fetch(c, slot):
                plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(t0 + FRONT - front, lags.rows), pl.ds(c * bd, bd + PAD)],
                                        xs.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(bank_ref.at[:, pl.ds(c * bd, bd)], bs.at[slot], bar.at[slot])

            def chunk(c, slot, head, sqs):
                return sumsq_of(sqs, bs, slot, lambda delta: plgpu.load(
                    xs.at[slot, pl.ds(front - delta, bt), pl.ds(0, bd)], (), layout=tile, optimized=False))

            sqs = mosaic_gpu._pipelined(plgpu, fetch, bar, nc, 1, chunk, [zero() for _ in range(m)])
            finish(sqs, ss_s, ss_ref, b, t0)

        scratch = [plgpu.SMEM((2, lags.rows, bd + PAD), jnp.bfloat16), plgpu.SMEM((2, n_taps, bd), jnp.float32),
                   plgpu.SMEM((m, bt), jnp.float32), plgpu.Barrier(num_arrivals=2, num_barriers=2)]
    elif source == "tma_wgmma":
        # one window of the tile's rows, the FRONT rows before it and more after (one TMA copy,
        # 1.5x the tile's bytes for 32 channels, 2x for 64), each lag's tile the product of a 0/1 shift matrix [64, 80] (built in registers)
        # with it on the tensor cores: exact for bf16 values with float32 accumulation
        # the window's rows are the WGMMA's K, a multiple of the swizzle's width in elements (bd for
        # bf16 rows of bd channels: 96 rows for 32 channels, 128 for 64)
        rows = -(-(bt + FRONT) // bd) * bd
        win_transforms = (plgpu.TilingTransform((8, bd)), plgpu.SwizzleTransform(bd * 2))

        def body(x_ref, bank_ref, ss_ref, xs, bs, ss_s, bar):
            b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt

            def fetch(c, slot):
                cs = pl.ds(c * bd, bd)
                plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(t0, rows), cs], xs.at[slot], bar.at[slot])
                plgpu.copy_gmem_to_smem(bank_ref.at[:, cs], bs.at[slot], bar.at[slot])

            out_rows = plgpu.broadcasted_iota(jnp.int32, (bt, rows), 0, layout=tile)
            win_rows = plgpu.broadcasted_iota(jnp.int32, (bt, rows), 1, layout=tile)

            def lag_tile(slot, delta):
                shift = (win_rows == out_rows + (FRONT - delta)).astype(jnp.bfloat16)

                def product(acc_ref):
                    plgpu.wgmma(acc_ref, shift, xs.at[slot])
                    return acc_ref[...]

                return pl.run_scoped(product, plgpu.ACC((bt, bd), jnp.float32))

            def chunk(c, slot, head, sqs):
                return sumsq_of(sqs, bs, slot, lambda delta: lag_tile(slot, delta))

            sqs = mosaic_gpu._pipelined(plgpu, fetch, bar, nc, 1, chunk, [zero() for _ in range(m)])
            finish(sqs, ss_s, ss_ref, b, t0)

        scratch = [plgpu.SMEM((2, rows, bd), jnp.bfloat16, transforms=win_transforms),
                   plgpu.SMEM((2, n_taps, bd), jnp.float32), plgpu.SMEM((m, bt), jnp.float32),
                   plgpu.Barrier(num_arrivals=2, num_barriers=2)]
    else:
        def body(x_ref, bank_ref, ss_ref, ss_s):
            b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt

            def chunk(c, sqs):
                cs = pl.ds(c * bd, bd)
                es = [None] * m
                for delta in range(max_lag):
                    xl = plgpu.load(x_ref.at[b, pl.ds(t0 + FRONT - delta, bt), cs], layout=tile,
                                    optimized=False).astype(jnp.float32)
                    for r, (kernel, off) in enumerate(layout):
                        if kernel == 0:
                            es[r] = xl if delta == 0 else es[r]
                        elif delta < kernel:
                            tap = plgpu.load(bank_ref.at[off + delta, cs], layout=col, optimized=False)
                            term = lax.broadcast_in_dim(tap, (bt, bd), [1]) * xl
                            es[r] = term if es[r] is None else es[r] + term
                return [sq + jnp.sum(e * e, axis=1) for sq, e in zip(sqs, es)]

            sqs = lax.fori_loop(0, nc, chunk, [zero() for _ in range(m)])
            finish(sqs, ss_s, ss_ref, b, t0)

        scratch = [plgpu.SMEM((m, bt), jnp.float32)]
    lane = {} if interpret or "--lane" not in sys.argv else dict(  # no inferred swizzle
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((m, batch, t_len), jnp.float32),
                          grid=(batch, t_len // bt), grid_names=("b", "t"), scratch_types=scratch, **lane,
                          interpret=plgpu.InterpretGPUParams() if interpret else False)
    return jax.jit(kernel)


def reference_sumsq(x, bank, t_len):
    layout = _stream_layout(KERNELS)
    xf = x.astype(jnp.float32)
    out = []
    for kernel, off in layout:
        if kernel == 0:
            e = xf[:, FRONT:FRONT + t_len]
        else:
            e = sum(bank[off + delta] * xf[:, FRONT - delta:FRONT - delta + t_len] for delta in range(kernel))
        out.append(jnp.sum(e * e, axis=-1))
    return jnp.stack(out)


def main():
    interpret = "--interpret" in sys.argv
    for dtype in (jnp.float32, jnp.bfloat16):
        bad = gmem_offset_probe(dtype, interpret)
        print(f"global-memory WGMMA-layout loads, {jnp.dtype(dtype).name}: "
              f"{'exact at offsets 0..15' if not bad else 'WRONG at offsets ' + str(bad)}", flush=True)
    batch, t_len, d = (1, 128, 64) if interpret else (64, 1024, 1024)
    k = jax.random.split(jax.random.key(0), 2)
    # FRONT zero rows before the tokens and after them (the WGMMA form's window reaches past the tile)
    x = jax.random.normal(k[0], (batch, 2 * FRONT + t_len, d), jnp.float32)
    x = x.at[:, :FRONT].set(0).at[:, FRONT + t_len:].set(0).astype(jnp.bfloat16)
    bank = 0.3 * jax.random.normal(k[1], (sum(KERNELS), d), jnp.float32)
    want = reference_sumsq(x, bank, t_len)
    nbytes = batch * t_len * d * 2
    sources = (("tma", 32), ("gmem", 32), ("gmem", 64), ("tma_fetch", 32), ("tma_wgmma", 32))
    if "--wgmma" in sys.argv:  # a shorter device call
        sources = (("tma", 32), ("tma_wgmma", 32), ("tma_wgmma", 64))
    if "--single" in sys.argv:  # one window per chunk, loads at any row offset (static, then runtime)
        sources = (("tma", 32), ("tma_single", 32), ("tma_single_dyn", 32))
    if "--single-pad" in sys.argv:  # one window per chunk, its rows plain (64 bytes) and padded (80)
        sources = (("tma_single", 32), ("tma_single_pad", 32))
    for source, bd in sources:
        try:
            run = build(source, batch, t_len, d, bd=bd, interpret=interpret)
            xin = jnp.pad(x, ((0, 0), (0, 0), (0, PAD))) if source == "tma_single_pad" else x
            got = run(xin, bank)
            expected = want
            if source == "tma_fetch":  # every stream is the partial itself
                expected = jnp.broadcast_to(jnp.sum(x[:, FRONT:FRONT + t_len].astype(jnp.float32) ** 2, axis=-1),
                                            want.shape)
            err = float(jnp.max(jnp.abs(got - expected)) / jnp.max(jnp.abs(expected)))
            ms = bench.timeit(run, xin, bank, reps=1 if interpret else 21, inner=1, warmup=0)[0] * 1e3
            print(f"expansion from {source:4s}, {bd} channels: {ms:8.4f} ms (partial read once: {nbytes / ms / 1e6:6.0f} GB/s)  "
                  f"rel err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"expansion from {source}, {bd} channels: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)


if __name__ == "__main__":
    main()
