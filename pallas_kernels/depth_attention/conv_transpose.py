"""The expansion's transpose as a Pallas kernel: the source and bank gradients from the streams'
cotangents ``dE`` (the vjp of ``reference.expand``, Eq. 10). Used by phase 1's ``wide`` Pallas
backward (``sources_transpose``, all sources in one call) and by the ``backward="hybrid"`` option
of ``vjp.py`` (one source's ``dE`` from the closed-form XLA backward). Each program owns its
``d x`` rows, reading ``dE`` ahead of its tile and ``x`` behind, so nothing is carried between
programs; the bank gradient is reduced over rows once per program. The formulas and figures:
docs/kernels.md §4, "Phase 1 backward"."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import tpu_blocks
from pallas_kernels.depth_attention.fused import (
    F32, call_kwargs, if_live, lag_masks, pad_tokens, stream_layout, token_inputs, TokenWindow,
)
from pallas_kernels.depth_attention.tiling import Tiles


def _lead_masks(seg_ref, t0, bt: int, max_lag: int, backend: str, n_rows: int):
    """``masks[delta]`` ``[bt, 1]`` float: token ``t + delta`` shares ``t``'s segment (rows past
    the end read as zeros from ``dE``, so their mask does not matter); None without segments."""
    if seg_ref is None:
        return None
    col = 0 if len(seg_ref.shape) == 2 else None
    win = TokenWindow(seg_ref, (), t0, bt, col, backend, fill=-1, dtype=jnp.int32, n_rows=n_rows)
    return [None] + [(win.ahead(delta) == win.shift(0)).astype(F32)[:, None] for delta in range(1, max_lag)]


def _transpose_tile(layout, de_window, x, ahead, behind, dx, bank_row, add_tap):
    """One token tile of the expansion's transpose, shared by the Triton / generic kernel and the
    Mosaic TPU one (they differ only in how the tiles are windowed and where the bank gradient
    accumulates): returns ``dx`` plus every stream's ``dE`` read ahead through the bank taps, and
    hands each tap's bank gradient ``[bt, bd]`` (``dE * x`` lagged, masked at segment starts) to
    ``add_tap(k, tap)``. ``de_window(r)`` is stream ``r``'s ``dE`` window, ``bank_row(k)`` tap
    ``k``'s ``[1, bd]`` float32 row; ``ahead[delta]`` / ``behind[delta]`` are zero where token
    ``t + delta`` / ``t - delta`` lies outside ``t``'s segment (``ahead`` None: no segments)."""
    for r, (kernel, off) in enumerate(layout):
        de = de_window(r)
        if kernel == 0:
            dx = dx + de.shift(0)
            continue
        for delta in range(kernel):
            lead = de.ahead(delta)
            if delta and ahead is not None:
                lead = lead * ahead[delta]
            dx = dx + bank_row(off + delta) * lead
            tap = de.shift(0) * x.shift(delta)
            add_tap(off + delta, tap * behind[delta] if delta else tap)
    return dx


def _kernel(*refs, stream_kernels, bt, bd, tiles_per_program, n_rows, has_seg, has_live, backend):
    it = iter(refs)
    de_ref = next(it)  # [m, Tp, bd]
    x_ref = next(it)  # [Tp, bd]
    bank_ref = next(it)  # [K, bd]
    seg_ref = next(it) if has_seg else None  # [Tp, 1]
    live_ref = next(it) if has_live else None  # [n] int32
    dx_ref = next(it)  # [rows, bd]: this program's rows
    dbank_ref = next(it)  # [K, bd]: this program's partial
    layout = stream_layout(stream_kernels)
    n_taps = sum(stream_kernels)
    max_lag = max(stream_kernels)
    bank = [bank_ref[k, :].astype(F32)[None, :] for k in range(n_taps)]
    first = pl.program_id(2) * tiles_per_program

    def tile_body(j, dbank):
        dbank = list(dbank)
        t0 = pl.multiple_of((first + j) * bt, bt)
        behind = lag_masks(seg_ref, t0, bt, max_lag, backend)
        ahead = _lead_masks(seg_ref, t0, bt, max_lag, backend, n_rows)
        x = TokenWindow(x_ref, (), t0, bt, slice(None), backend, width=bd)

        def add_tap(k, tap):  # the bank gradient rides the loop carry, reduced over rows once at the end
            dbank[k] = dbank[k] + tap

        def de(r):
            return TokenWindow(de_ref, (r,), t0, bt, slice(None), backend, width=bd, n_rows=n_rows)

        dx = _transpose_tile(layout, de, x, ahead, behind, jnp.zeros((bt, bd), F32), bank.__getitem__, add_tap)
        dx_ref[pl.ds(pl.multiple_of(j * bt, bt), bt), :] = dx.astype(dx_ref.dtype)
        return dbank

    zero = jnp.zeros((bt, bd), F32)

    def work():
        dbank = jax.lax.fori_loop(0, tiles_per_program, tile_body, [zero] * n_taps)
        for k in range(n_taps):
            dbank_ref[k, :] = jnp.sum(dbank[k], axis=0)

    def skipped():  # an invalid source: zero gradients
        for j in range(tiles_per_program):
            dx_ref[pl.ds(j * bt, bt), :] = zero.astype(dx_ref.dtype)
        for k in range(n_taps):
            dbank_ref[k, :] = jnp.zeros((bd,), F32)

    if_live(live_ref, pl.program_id(0), work, skipped)


def rows_per_program(t_pad: int, bt: int, cap: int = 128) -> int:
    """Token rows per program: whole tiles, at most ``cap``, dividing ``t_pad``."""
    tiles = t_pad // bt
    k = max(1, min(cap // bt, tiles))
    while tiles % k:
        k -= 1
    return k * bt


def expansion_transpose(d_streams, x, bank, segment_ids=None, *, stream_kernels: Sequence[int], tiles: Tiles,
                        backend: str, interpret: bool, out_dtype=None, rows: int | None = None):
    """The vjp of ``reference.expand(x, bank, stream_kernels, segment_ids)`` at ``d_streams``.

    ``d_streams[m, B, T, d]``, ``x[B, T, d]``, ``bank[K, d]`` -> ``(d x[B, T, d]`` in
    ``out_dtype`` (default ``x.dtype``), ``d bank[K, d]`` float32). ``rows``: token rows per
    program (a multiple of ``tiles.block_t``; default: up to 128)."""
    if d_streams.ndim != 4:
        raise ValueError(f"d_streams {d_streams.shape}: expected [m, B, T, d]")
    dx, dbank = sources_transpose(d_streams[None], x[None], None if bank is None else bank[None], segment_ids,
                                  stream_kernels=stream_kernels, tiles=tiles, backend=backend, interpret=interpret,
                                  out_dtype=out_dtype, rows=rows)
    return dx[0], dbank[0]


def sources_transpose(d_streams, x, banks, segment_ids=None, valid=None, *, stream_kernels: Sequence[int],
                      tiles: Tiles, backend: str, interpret: bool, out_dtype=None, rows: int | None = None):
    """``expansion_transpose`` of ``n`` sources in one call: ``d_streams[n, m, B, T, d]``,
    ``x[n, B, T, d]``, ``banks[n, K, d]`` -> ``(d x[n, B, T, d], d banks[n, K, d])``;
    ``valid[n]``: the other sources get zeros (and their programs skip the work)."""
    stream_kernels = tuple(stream_kernels)
    n, m, batch, t_len, d = d_streams.shape
    if m != len(stream_kernels) or x.shape != (n, batch, t_len, d):
        raise ValueError(f"d_streams {d_streams.shape} and x {x.shape} do not match {len(stream_kernels)} streams")
    n_taps = sum(stream_kernels)
    if n_taps == 0:  # identity streams only: no kernel needed
        dx = jnp.sum(d_streams.astype(F32), axis=1)
        if valid is not None:
            dx = jnp.where(jnp.asarray(valid, bool)[:, None, None, None], dx, 0.0)
        return dx.astype(out_dtype or x.dtype), jnp.zeros((n, 0, d), F32)
    if banks is None or banks.shape != (n, n_taps, d):
        raise ValueError(f"banks {None if banks is None else banks.shape}: expected ({n}, {n_taps}, {d})")
    if backend == "tpu":  # token-tiled, channels padded to whole 128-lane vregs (exact: zero channels)
        pad = lambda a: tpu_blocks.pad_heads(a, 1)  # noqa: E731
        dx, dbank = sources_transpose_tpu(pad(d_streams), pad(x), pad(banks), segment_ids, valid,
                                          stream_kernels=stream_kernels, interpret=interpret, out_dtype=out_dtype,
                                          cap_t=tiles.tpu_block_t, cap_d=tiles.tpu_block_d)
        return dx[..., :d], dbank[..., :d]
    bt, bd = tiles.bt_transpose, tiles.block_d_grads
    if bt < max(stream_kernels) - 1:
        raise ValueError(f"block_t={bt} < max_kernel - 1 = {max(stream_kernels) - 1}: the halo reaches one tile")
    if d % bd:
        raise ValueError(f"block_d={bd} must divide d={d}")
    t_pad = -(-t_len // bt) * bt
    rows = rows or rows_per_program(t_pad, bt)
    if rows % bt or t_pad % rows:
        raise ValueError(f"rows={rows}: must be a multiple of block_t={bt} dividing the padded length {t_pad}")
    de = pad_tokens(d_streams, 3, t_pad)
    xp = pad_tokens(x, 2, t_pad)
    has_seg = segment_ids is not None
    in_specs = [
        pl.BlockSpec((None, m, None, t_pad, bd), lambda i, b, g, c: (i, 0, b, 0, c)),
        pl.BlockSpec((None, None, t_pad, bd), lambda i, b, g, c: (i, b, 0, c)),
        pl.BlockSpec((None, n_taps, bd), lambda i, b, g, c: (i, 0, c)),
    ]
    args = [de, xp, banks]
    seg = None if segment_ids is None else pad_tokens(jnp.asarray(segment_ids, jnp.int32), 1, t_pad, -1)
    has_live = token_inputs(in_specs, args, seg, valid, n, t_pad, backend, batch_axis=1)
    n_groups = t_pad // rows
    kernel = functools.partial(
        _kernel, stream_kernels=stream_kernels, bt=bt, bd=bd, tiles_per_program=rows // bt, n_rows=t_pad,
        has_seg=has_seg, has_live=has_live, backend=backend,
    )
    dx, dbank = pl.pallas_call(
        kernel,
        grid=(n, batch, n_groups, d // bd),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, rows, bd), lambda i, b, g, c: (i, b, g, c)),
            pl.BlockSpec((None, None, None, n_taps, bd), lambda i, b, g, c: (i, b, g, 0, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, batch, t_pad, d), out_dtype or x.dtype),
            jax.ShapeDtypeStruct((n, batch, n_groups, n_taps, d), F32),
        ],
        name="depth_attention_expansion_transpose",
        **call_kwargs(backend, tiles, interpret, ("parallel",) * 4),
    )(*args)
    dx = dx[:, :, :t_len]
    if valid is not None and not has_live:  # Mosaic computed every source: mask the invalid ones
        ok = jnp.asarray(valid, bool)
        dx = jnp.where(ok[:, None, None, None], dx, jnp.zeros((), dx.dtype))
        return dx, jnp.where(ok[:, None, None], jnp.sum(dbank, axis=(1, 2)), 0.0)
    return dx, jnp.sum(dbank, axis=(1, 2))


# --------------------------------------------------------------------------- Mosaic TPU, token-tiled


def _kernel_tpu(*refs, stream_kernels, bt, n_tiles, has_mask, has_live):
    """One (source, batch row, chunk, token tile): ``d x`` of the tile from ``dE`` of the tile and
    the ``halo`` rows after it, and the tile's bank-gradient rows added into the output block,
    which stays in VMEM over the token axis (``"arbitrary"``, the last grid axis)."""
    it = iter(refs)
    de_ref, de_ahead = next(it), next(it)  # [m, bt, bd], [m, halo, bd]
    x_ref, x_behind = next(it), next(it)  # [bt, bd], [halo, bd]
    bank_ref = next(it)  # [K, bd]
    behind_ref, ahead_ref = (next(it), next(it)) if has_mask else (None, None)  # [bt, L] each
    live_ref = next(it) if has_live else None  # [n] int32
    dx_ref = next(it)  # [bt, bd]
    dbank_ref = next(it)  # [K, bd]
    max_lag = max(stream_kernels)
    t = pl.program_id(3)
    t0 = t * bt

    @pl.when(t == 0)
    def _():
        dbank_ref[...] = jnp.zeros(dbank_ref.shape, F32)

    def work():
        behind = tpu_blocks.tile_masks(behind_ref, t0, bt, max_lag)
        ahead = tpu_blocks.tile_masks(ahead_ref, t0, bt, max_lag, ahead=True)
        x = TokenWindow(x_ref, (), t0, bt, slice(None), "tpu", prev=x_behind)

        def add_tap(k, tap):  # the bank gradient accumulates in its resident output block
            rows = pl.ds(k, 1)
            dbank_ref[rows, :] = dbank_ref[rows, :] + jnp.sum(tap, axis=0, keepdims=True)

        def de(r):
            return TokenWindow(de_ref, (r,), t0, bt, slice(None), "tpu", next=de_ahead, n_rows=n_tiles * bt)

        bank_row = lambda k: bank_ref[k, :].astype(F32)[None, :]  # noqa: E731
        dx = _transpose_tile(stream_layout(stream_kernels), de, x, ahead, behind, jnp.zeros(dx_ref.shape, F32),
                             bank_row, add_tap)
        dx_ref[...] = dx.astype(dx_ref.dtype)

    def skipped():  # an invalid source: zero gradients (its bank rows stay as zeroed above)
        dx_ref[...] = jnp.zeros(dx_ref.shape, dx_ref.dtype)

    if_live(live_ref, pl.program_id(0), work, skipped)


def transpose_vmem_bytes(*, m: int, n_taps: int, max_lag: int, de_itemsize: int, x_itemsize: int, out_itemsize: int,
                         has_mask: bool):
    """``need(bt, bd)`` for ``tpu_blocks.choose``: the transpose's double-buffered blocks and its
    live float32 temporaries (the ``dE`` and ``x`` windows, ``d x``, one tap product)."""
    halo = tpu_blocks.halo_rows(max_lag)
    size = tpu_blocks.block_bytes

    def bytes_of(bt, bd):
        blocks = (size((m, bt + halo, bd), de_itemsize) + size((bt + halo, bd), x_itemsize)
                  + size((n_taps, bd), 4) + (2 * size((bt, max_lag), 4) if has_mask else 0)
                  + size((bt, bd), out_itemsize) + size((n_taps, bd), 4))
        temps = ((m + 1) * (bt + halo) + 4 * bt) * bd * 4
        return 2 * blocks + temps

    return bytes_of


def sources_transpose_tpu(d_streams, x, banks, segment_ids=None, valid=None, *, stream_kernels: Sequence[int],
                          interpret, out_dtype=None, tile=None, cap_t=None, cap_d=None):
    """``sources_transpose`` as the token-tiled Mosaic TPU kernel (``tpu_blocks``): ``d_streams[n,
    m, B, T, d]`` with ``d`` padded per head as ``tpu_blocks.pad_heads`` pads it (a multiple of 128),
    ``x[n, B, T, d]``, ``banks[n, K, d]``, ``segment_ids[B, T]`` (padded with -1 past the real
    tokens, or None). ``tile``: a ``tpu_blocks.TpuTile`` (default: chosen here, capped by
    ``cap_t`` / ``cap_d``)."""
    stream_kernels = tuple(stream_kernels)
    n, m, batch, t_len, d = d_streams.shape
    n_taps, max_lag = sum(stream_kernels), max(stream_kernels)
    if d % tpu_blocks.LANES:
        raise ValueError(f"sources_transpose_tpu: d={d} must be padded to a multiple of {tpu_blocks.LANES}")
    has_mask = segment_ids is not None
    tile = tile or tpu_blocks.choose(
        transpose_vmem_bytes(m=m, n_taps=n_taps, max_lag=max_lag, de_itemsize=d_streams.dtype.itemsize,
                             x_itemsize=x.dtype.itemsize, out_itemsize=jnp.dtype(out_dtype or x.dtype).itemsize,
                             has_mask=has_mask),
        name="sources_transpose", dhp=d, t_len=t_len, max_kernel=max_lag, cap_t=cap_t, cap_d=cap_d)
    bt, bd, halo = tile.block_t, tile.block_d, tile.halo
    t_pad = -(-t_len // bt) * bt
    n_tiles = t_pad // bt
    de = pad_tokens(d_streams, 3, t_pad)
    xp = pad_tokens(x, 2, t_pad)
    in_specs = tpu_blocks.token_specs(pl.BlockSpec((None, m, None, bt, bd), lambda i, b, c, t: (i, 0, b, t, c)), 3,
                                      bt, halo, prev=False, next=True, n_rows=t_pad)
    in_specs += tpu_blocks.token_specs(pl.BlockSpec((None, None, bt, bd), lambda i, b, c, t: (i, b, t, c)), 2, bt,
                                       halo)
    in_specs.append(pl.BlockSpec((None, n_taps, bd), lambda i, b, c, t: (i, 0, c)))
    args = [de, de, xp, xp, banks]
    if has_mask:
        seg = pad_tokens(jnp.asarray(segment_ids, jnp.int32), 1, t_pad, -1)
        mask_spec = pl.BlockSpec((None, bt, max_lag), lambda i, b, c, t: (b, t, 0))
        in_specs += [mask_spec, mask_spec]
        args += [tpu_blocks.segment_masks(seg, max_lag), tpu_blocks.segment_masks(seg, max_lag, ahead=True)]
    has_live = token_inputs(in_specs, args, None, valid, n, t_pad, "tpu", batch_axis=1)
    kernel = functools.partial(_kernel_tpu, stream_kernels=stream_kernels, bt=bt, n_tiles=n_tiles,
                               has_mask=has_mask, has_live=has_live)
    dx, dbank = pl.pallas_call(
        kernel,
        grid=(n, batch, d // bd, n_tiles),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bt, bd), lambda i, b, c, t: (i, b, t, c)),
            pl.BlockSpec((None, None, n_taps, bd), lambda i, b, c, t: (i, b, 0, c)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n, batch, t_pad, d), out_dtype or x.dtype),
            jax.ShapeDtypeStruct((n, batch, n_taps, d), F32),
        ],
        name="depth_attention_expansion_transpose",
        compiler_params=tpu_blocks.compiler_params(("parallel", "parallel", "parallel", "arbitrary"), tile),
        interpret=interpret,
    )(*args)
    return dx[:, :, :t_len], jnp.sum(dbank, axis=1)
