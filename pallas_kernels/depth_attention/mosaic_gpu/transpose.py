"""The expansion's transpose for ``n`` sources in Mosaic GPU (``sources_transpose``: the vjp of
Eq. 10, ``d x`` and the bank gradient from the streams' cotangents; the contract of
``conv_transpose.sources_transpose``). docs/kernels.md §4, "Phase 1 backward"."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention.fused import pad_tokens, stream_layout
from pallas_kernels.depth_attention.mosaic_gpu.common import (
    BLOCK_T, F32, KernelConfig, LanePlgpu, MAX_LAG_BITS, lag_bits, named_body, pad_rows4, per_col, per_row, rows4,
    valid_first,
)

# ``sources_transpose``' channel chunk: the bank gradient's token sums ride in the loop carry as
# whole ``[64, 8]`` float32 tiles (4 registers per thread each, 96 for kernels (0, 4, 8, 12)), as
# in ``phase2_inputs.phase2_backward_inputs``
TRANSPOSE_BLOCK_D = 8
TRANSPOSE_AHEAD = 16  # rows past the tile the transposed conv reaches (max_lag - 1, in 8s)
# ``sources_transpose``' taps come once per source (their own copy, a source ahead), held in
# registers through the source's tiles (175 -> 224 registers: two programs per SM either way),
# rather than with each tile's copies: an H100, 3.119 -> 3.032 ms per call at `base`'s last block
# (-2.8%), 2.922 -> 2.791 at the bench shape (-4.5%), the same bits.
# Measured and taken out again (commit dfe9301 has them): its bf16 windows widened to
# float32 once per tile instead of per lag (96 fewer instructions in its 608-instruction loop, 7-19%
# slower: twice the shared-memory bytes per lag load), and the kernel without Pallas' automatic
# barriers (0.1% / 1.6% faster at `base` / the bench shape). Measured and taken out
# (commit 7037f37 has it): three or four items in flight instead of two (about 7 KB each), 2-7% /
# 5-17% slower at the bench shape / `base`'s last block on an H200, the same bits: the copies'
# latency does not hold this kernel.


def check_transpose_shape(*, d: int, stream_kernels: Sequence[int]) -> None:
    """Raises ``NotImplementedError`` (saying why) unless ``sources_transpose`` takes the shape."""
    if d % TRANSPOSE_BLOCK_D:
        raise NotImplementedError(f"mosaic_gpu.sources_transpose: d = {d} must be a multiple of "
                                  f"{TRANSPOSE_BLOCK_D}")
    max_lag = max([1, *stream_kernels])
    if max_lag - 1 > TRANSPOSE_AHEAD or max_lag > MAX_LAG_BITS:
        raise NotImplementedError(f"mosaic_gpu.sources_transpose: kernels up to {TRANSPOSE_AHEAD + 1} taps "
                                  f"(got {tuple(stream_kernels)})")
    if not any(stream_kernels):
        raise NotImplementedError("mosaic_gpu.sources_transpose: no conv (identity streams need no kernel)")


def sources_transpose(d_streams, x, banks, segment_ids, valid, *, stream_kernels, out_dtype=None,
                      interpret: bool = False):
    """``conv_transpose.sources_transpose`` (the vjp of the expansion, Eq. 10, for ``n`` sources)
    as one Mosaic GPU kernel: ``d x[t] = sum_{r: kernel_r = 0} dE_r[t] + sum_r sum_delta
    c_r[delta] mask_delta[t + delta] dE_r[t + delta]`` and ``d c_r[delta] = sum_{b, t}
    mask_delta[t] dE_r[t] x[t - delta]``.

    One program per (batch row, 8-channel chunk) walks the valid sources and, for each, its
    64-token tiles, with the next item's copies in flight: the streams' cotangents ``[m, 80, 8]``
    (the tile's rows and the 16 after it, which the transposed conv reaches; loaded back at each
    lag's row offset, Lane semantics), the source's ``[80, 8]`` rows (the 16 before the tile, for
    the bank gradient), its taps and lag bits. The bank gradient's token sums ride in the loop
    carry as whole tiles, reduced over rows once per source. The sources ``valid`` rules out get
    zeros (their cotangents are not read).

    ``d_streams[n, m, B, T, d]`` (rows past ``T`` are taken as zeros), ``x[n, B, T, d]``,
    ``banks[n, K, d]``, ``segment_ids[B, T]`` or None, ``valid[n]`` or None. Returns ``(d x[n, B,
    T, d]`` in ``out_dtype`` (None: ``x``'s), ``d banks[n, K, d]`` float32)."""
    stream_kernels = tuple(stream_kernels)
    n, m, batch, t_len, d = d_streams.shape
    if m != len(stream_kernels) or x.shape != (n, batch, t_len, d):
        raise ValueError(f"mosaic_gpu.sources_transpose: d_streams {d_streams.shape} and x {x.shape} do not "
                         f"match {len(stream_kernels)} streams")
    check_transpose_shape(d=d, stream_kernels=stream_kernels)
    n_taps = sum(stream_kernels)
    if banks is None or banks.shape != (n, n_taps, d):
        raise ValueError(f"mosaic_gpu.sources_transpose: banks {None if banks is None else banks.shape}: "
                         f"want ({n}, {n_taps}, {d})")
    bt, ahead = BLOCK_T, TRANSPOSE_AHEAD
    max_lag = max(stream_kernels)
    has_seg = segment_ids is not None and max_lag > 1
    t_pad = -(-t_len // bt) * bt
    # rows before token 0 and past the last tile: zeros, as TMA fills them on the GPU (interpret
    # mode pads them; on the GPU only T is padded to whole tiles)
    front, back = (ahead, ahead) if interpret else (0, 0)
    de = jnp.pad(d_streams, ((0, 0),) * 3 + ((0, t_pad - t_len + back), (0, 0))).reshape(n * m, batch, -1, d)
    xp = jnp.pad(x, ((0, 0), (0, 0), (front, t_pad - t_len), (0, 0))).reshape(n * batch, -1, d)
    bank_rows = pad_rows4(jnp.asarray(banks, F32).transpose(1, 0, 2).reshape(n_taps, n * d))
    inputs = [de, xp, bank_rows, valid_first(valid, n)]
    if has_seg:  # each tile's window: its rows and the next tile's first ones (zeros past the end)
        bits = pad_tokens(lag_bits(segment_ids, t_len, max_lag), 1, t_pad)
        inputs.append(jnp.pad(bits, ((0, 0), (0, _BITS_ROWS - bt))))
    call = _transpose_kernel(TransposeConfig(
        n=n, batch=batch, t_pad=t_pad, d=d, stream_kernels=stream_kernels, heads=1, block_d=TRANSPOSE_BLOCK_D,
        has_seg=has_seg, front=front,
        x_dtype=jnp.dtype(x.dtype), de_dtype=jnp.dtype(d_streams.dtype),
        out_dtype=jnp.dtype(out_dtype or x.dtype), n_tap_rows=rows4(n_taps), interpret=bool(interpret)))
    dx, dbank = call(*inputs)  # [n, B, Tp, d], [n, B, K4, d]
    return dx[:, :, :t_len], jnp.sum(dbank[:, :, :n_taps], axis=1)


_BITS_ROWS = 96  # a tile's lag bits and the 16 rows after it, padded to 384 bytes (Lane copies: 128-byte multiples)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransposeConfig(KernelConfig):
    """What ``sources_transpose``' kernel code depends on besides ``KernelConfig``."""

    n: int  # sources
    de_dtype: jnp.dtype
    out_dtype: jnp.dtype
    n_tap_rows: int  # the taps' rows, padded to a multiple of 4


@functools.lru_cache(maxsize=None)
def _transpose_kernel(cfg: TransposeConfig):
    """``sources_transpose``' kernel for ``cfg``, built and jitted once."""
    from jax.experimental.pallas import mosaic_gpu as plgpu_module

    plgpu = LanePlgpu(plgpu_module)
    n, batch, t_pad, d, has_seg = cfg.n, cfg.batch, cfg.t_pad, cfg.d, cfg.has_seg
    stream_kernels = cfg.stream_kernels
    m, bt, bd, ahead = len(stream_kernels), BLOCK_T, TRANSPOSE_BLOCK_D, TRANSPOSE_AHEAD
    layout = stream_layout(stream_kernels)
    n_taps, n_tiles = sum(stream_kernels), t_pad // bt
    rows_in = bt + ahead
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA

    def to_f32(v):  # a register tile as float32
        return v.astype(F32)

    scratch = dict(
        des=plgpu.SMEM((2, m, rows_in, bd), cfg.de_dtype),  # the tile's rows of dE and the 16 after
        xs=plgpu.SMEM((2, rows_in, bd), cfg.x_dtype),  # the 16 rows before the tile and its own
        taps=plgpu.SMEM((2, cfg.n_tap_rows, bd), F32),  # per source, one ahead
        bits_s=plgpu.SMEM((2, _BITS_ROWS), jnp.int32) if has_seg else None,
        dxs=plgpu.SMEM((2, bt, bd), cfg.out_dtype),
        zero_s=plgpu.SMEM((bt, bd), cfg.out_dtype),
        sums_s=plgpu.SMEM((2, cfg.n_tap_rows, bd), F32),
        meta_s=plgpu.SMEM((n + 1, 64), jnp.int32),
        bar=plgpu.Barrier(num_arrivals=2 + has_seg, num_barriers=2),
        bar_in=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        bar_taps=plgpu.Barrier(num_arrivals=1, num_barriers=2),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        de_ref, x_ref, bank_ref, meta_ref = (next(it) for _ in range(4))
        bits_ref = next(it) if has_seg else None
        dx_ref, dbank_ref = next(it), next(it)
        sc = dict(zip(names, it))
        des, xs, taps, bits_s, dxs, zero_s, sums_s, meta_s = (
            sc.get(k) for k in ("des", "xs", "taps", "bits_s", "dxs", "zero_s", "sums_s", "meta_s"))
        bar, bar_in, bar_taps = sc["bar"], sc["bar_in"], sc["bar_taps"]
        b, c = lax.axis_index("b"), lax.axis_index("c")
        cs = pl.ds(c * bd, bd)
        plgpu.copy_gmem_to_smem(meta_ref, meta_s, bar_in.at[0])
        zero = plgpu.layout_cast(jnp.zeros((bt, bd), F32), tile)
        zero_s[...] = zero.astype(zero_s.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(bar_in.at[0])
        n_live = meta_s[n, 0]
        total = n_live * n_tiles
        front = cfg.front  # the rows the interpreted x carries before token 0

        def fetch(f):
            """Item ``f`` (valid source ``f // n_tiles``, tile ``f % n_tiles``), if there is one."""
            @pl.when(f < total)
            def _():
                i, k, slot = meta_s[f // n_tiles, 0], lax.rem(f, n_tiles), lax.rem(f, 2)
                t0 = k * bt + b * 0  # traced: the x window starts before row 0 (TMA fills zeros)
                plgpu.copy_gmem_to_smem(de_ref.at[pl.ds(i * m, m), b, pl.ds(t0, rows_in), cs], des.at[slot],
                                        bar.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[i * batch + b, pl.ds(t0 + front - ahead, rows_in), cs],
                                        xs.at[slot], bar.at[slot])
                if has_seg:
                    plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t0, _BITS_ROWS)], bits_s.at[slot], bar.at[slot])

        def fetch_taps(j):
            """Valid source ``j``'s taps, if there is one, into ``taps[j % 2]``."""
            @pl.when(j < n_live)
            def _():
                sslot = lax.rem(j, 2)
                plgpu.copy_gmem_to_smem(bank_ref.at[:, pl.ds(meta_s[j, 0] * d + c * bd, bd)], taps.at[sslot],
                                        bar_taps.at[sslot])

        def tile_step(f, dbank, held):
            """Tile ``f % n_tiles`` of valid source ``f // n_tiles``: ``d x`` stored, the bank sums
            carried; ``held``: the source's taps in registers."""
            slot = lax.rem(f, 2)
            plgpu.barrier_wait(bar.at[slot])

            def tap_of(k):
                return per_col(held[k], bt, bd)

            def de_rows(r, off):  # rows [off, off + 64) of stream r's dE in this tile's window, widened
                return to_f32(plgpu.load(des.at[slot, r, pl.ds(off, bt)], (), layout=tile))

            def x_rows(off):
                return to_f32(plgpu.load(xs.at[slot, pl.ds(off, bt)], (), layout=tile))

            behind, lead = [None] * max(1, max(stream_kernels)), [None] * max(1, max(stream_kernels))
            if has_seg:
                bits = plgpu.load(bits_s.at[slot, pl.ds(0, bt)], (), layout=row)
                for delta in range(1, len(behind)):
                    behind[delta] = per_row(((bits >> delta) & 1).astype(F32), bt, bd)
                    nbits = plgpu.load(bits_s.at[slot, pl.ds(delta, bt)], (), layout=row)
                    lead[delta] = per_row(((nbits >> delta) & 1).astype(F32), bt, bd)
            dbank = list(dbank)
            dx = None
            for r, (kernel, off) in enumerate(layout):
                if kernel == 0:
                    de0 = to_f32(plgpu.load(des.at[slot, r, pl.ds(0, bt)], (), layout=tile))
                    dx = de0 if dx is None else dx + de0
                    continue
                de0 = de_rows(r, 0)
                for delta in range(kernel):
                    tap = tap_of(off + delta)
                    de_lead = de0 if delta == 0 else de_rows(r, delta)
                    if lead[delta] is not None:
                        de_lead = de_lead * lead[delta]
                    term = tap * de_lead
                    dx = term if dx is None else dx + term
                    xl = x_rows(ahead - delta)
                    g = de0 * xl
                    if behind[delta] is not None:
                        g = g * behind[delta]
                    dbank[off + delta] = dbank[off + delta] + g
            j, k = f // n_tiles, lax.rem(f, n_tiles)
            i = meta_s[j, 0]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot two tiles ago is read
            dxs[slot] = dx.astype(dxs.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dxs.at[slot], dx_ref.at[i, b, pl.ds(k * bt, bt), cs])
            fetch(f + 2)  # every thread is done with this slot (the commit above)
            return dbank

        def source_body(j, carry):
            sslot = lax.rem(j, 2)
            plgpu.barrier_wait(bar_taps.at[sslot])
            held = [plgpu.load(taps, (sslot, k), layout=col) for k in range(n_taps)]
            dbank = lax.fori_loop(j * n_tiles, (j + 1) * n_tiles, lambda f, dbank: tile_step(f, dbank, held),
                                  [zero] * n_taps)
            fetch_taps(j + 2)  # every thread loaded this source's taps before the loop's commits
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            for t in range(n_taps):
                sums_s[sslot, t] = jnp.sum(dbank[t], axis=0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sums_s.at[sslot], dbank_ref.at[meta_s[j, 0], b, :, cs])
            return carry

        fetch_taps(0)
        fetch_taps(1)
        fetch(0)
        fetch(1)
        lax.fori_loop(0, n_live, source_body, 0)

        # the ruled-out sources: zeros for d x and the bank partial (sums_s[0] zeroed once its
        # last store has read it)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for t in range(cfg.n_tap_rows):
            sums_s[0, t] = plgpu.layout_cast(jnp.zeros((bd,), F32), col)
        plgpu.commit_smem()

        def zero_source(j, carry):
            i = meta_s[j, 0]
            for k in range(n_tiles):
                plgpu.copy_smem_to_gmem(zero_s, dx_ref.at[i, b, pl.ds(k * bt, bt), cs])
            plgpu.copy_smem_to_gmem(sums_s.at[0], dbank_ref.at[i, b, :, cs])
            return carry

        lax.fori_loop(n_live, n, zero_source, 0)
        plgpu.wait_smem_to_gmem(0)

    out_type = (jax.ShapeDtypeStruct((n, batch, t_pad, d), cfg.out_dtype),
                jax.ShapeDtypeStruct((n, batch, cfg.n_tap_rows, d), F32))
    params = dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    kernel = plgpu.kernel(named_body(body, "depth_attention_expansion_transpose_mosaic"),
                          out_type=out_type, scratch_types=[scratch[k] for k in names],
                          grid=(batch, d // bd), grid_names=("b", "c"),
                          interpret=plgpu.InterpretGPUParams() if cfg.interpret else False, **params)

    @jax.jit
    def run_kernel(*inputs):
        with jax.named_scope("depth_attention_expansion_transpose_mosaic"):
            return kernel(*inputs)

    return run_kernel
