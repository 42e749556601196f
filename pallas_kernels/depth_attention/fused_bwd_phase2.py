"""Pallas backward of the fused phase-2 read with stream fusion (``phase2_fused``), Triton and Mosaic
TPU: exactly the gradients of ``xla_streaming._phase2_fused_bwd``, without writing any
``[m, B, T, d]`` temporary besides the state's cotangent ``d_acc``.

Starting from the forward's per-token scores (or the scoring pass again), ``_stats_kernel`` (gate
only) forms the gate's statistics and ``<dh, z_r>``, ``_dstate_kernel`` writes ``d_acc`` and the
per-head sums the scalar cotangents need, and ``_dinput_kernel`` walks each channel chunk's token
tiles in reverse for the partial's, bank's, query's and ``W``'s gradients; XLA finishes the
per-token scalars between them. The formulas, bytes and row shifts: docs/kernels.md §4, "Phase 2
backward"; the Mosaic TPU layouts: "Techniques the kernels share"."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import conv_transpose, fused, mosaic_gpu, reference, tiling, tpu_blocks
from pallas_kernels.depth_attention.fused import (
    F32,
    call_kwargs,
    expand_chunk,
    head_column,
    lag_masks,
    pad_tokens,
    stream_layout,
    TokenWindow,
    gate_cols,
    gate_rows,
    scores_call,
)
from pallas_kernels.depth_attention.row_shift import (
    SHIFTS,
    scratch_rows,
    scratch_slots,
    shift_rows,
    shift_rows_via_buffer,
)

# --------------------------------------------------------------------------- in-kernel helpers


def _col(v):
    """``[bt]`` -> ``[bt, 1]`` (a per-token scalar against a ``[bt, bd]`` tile)."""
    return v[:, None]


def _dz(r, m, dh, z, gate_vals, w_ref, w_rows):
    """``dz_r = g_r dh + sum_j W[r, :, j] dy_j + coef z_r`` on one tile (``dh / m`` without
    the gate). ``gate_vals = (g[bt, m] loader, dy loader, coef[bt])``; ``w_ref`` holds ``W``
    as ``w3[r, channel, j]`` (``gate_cols``) and ``w_rows`` indexes the chunk's channels."""
    if gate_vals is None:
        return dh * (1.0 / m)
    g_of, dy_of, coef = gate_vals
    dz = _col(g_of(r)) * dh + _col(coef) * z
    for j in range(m):
        dz = dz + w_ref[r, w_rows, j].astype(F32)[None, :] * _col(dy_of(j))
    return dz


# --------------------------------------------------------------------------- kernels


def _stats_kernel(*refs, stream_kernels, heads, d, bt, bd, has_bank, has_seg, backend):
    """Pass 1: per-chunk ``sum z^2``, ``z @ W`` (the gate's forward statistics) and
    ``dg_r = <dh, z_r>`` (the gate's first backward reduction), from recomputed ``z``.

    The per-stream scalars are loaded first and every sum is kept as a whole ``[bt, bd]`` tile
    and reduced over channels after the stream loop, not inside it: on the H200 that took this
    kernel from 1.40 to 1.07 ms per call at `base` (and ``_dstate_kernel``, written the same way,
    from 2.24 to 1.75). Looping over 2, 4 or 8 channel chunks
    per program, to reduce once per program rather than once per chunk, was slower."""
    it = iter(refs)
    x_ref = next(it)  # [Tp, bd]
    bank_ref = next(it) if has_bank else None  # [K, bd]
    a_ref, b_ref = next(it), next(it)  # [m, bt, H]
    acc_ref = next(it)  # [m, bt, bd]
    dh_ref = next(it)  # [bt, bd]
    w_ref = next(it)  # [m, m, bd] (``gate_rows``)
    seg_ref = next(it) if has_seg else None  # [Tp, 1]
    sq_ref, zw_ref, dg_ref = it  # [bt, 1], [bt, m], [bt, m]
    m = len(stream_kernels)
    layout = stream_layout(stream_kernels)
    t0 = pl.program_id(1) * bt
    head = (pl.program_id(2) * bd) // (d // heads)
    col = functools.partial(head_column, head=head, heads=heads, backend=backend)
    masks = lag_masks(seg_ref, t0, bt, max([1, *stream_kernels]), backend)
    a = [_col(col(a_ref, (r, slice(None)))) for r in range(m)]
    b = [_col(col(b_ref, (r, slice(None)))) for r in range(m)]
    win = TokenWindow(x_ref, (), t0, bt, slice(None), backend, width=bd)
    dh = dh_ref[:, :].astype(F32)
    zero = jnp.zeros((bt, bd), F32)
    sq, zw, dg = zero, [zero] * m, [zero] * m
    for r, (kernel, off) in enumerate(layout):
        e = expand_chunk(win, bank_ref, (), slice(None), kernel, off, masks)
        z = a[r] * acc_ref[r, :, :].astype(F32) + b[r] * e
        sq = sq + z * z
        for j in range(m):
            zw[j] = zw[j] + z * w_ref[r, j, :].astype(F32)[None, :]
        dg[r] = dg[r] + dh * z
    sq_ref[:, 0] = jnp.sum(sq, axis=1)
    for j in range(m):
        zw_ref[:, j] = jnp.sum(zw[j], axis=1)
        dg_ref[:, j] = jnp.sum(dg[j], axis=1)


def _dstate_kernel(*refs, stream_kernels, heads, d, bt, bd, has_bank, has_seg, has_gate, backend, write_dacc=True):
    """Pass 2: ``d_acc = a dz`` and per-chunk partials of ``sum dz z``, ``sum dz (A - E D)``,
    ``sum dz (E - z)`` (per stream and token; summed per head in XLA), reduced over channels
    after the stream loop (as ``_stats_kernel``, which says why). ``write_dacc=False``: the
    partials only (``d_acc`` goes back factored, ``value_channel``)."""
    it = iter(refs)
    x_ref = next(it)  # [Tp, bd]
    bank_ref = next(it) if has_bank else None  # [K, bd]
    a_ref, b_ref, dold_ref = next(it), next(it), next(it)  # [m, bt, H]
    acc_ref = next(it)  # [m, bt, bd]
    dh_ref = next(it)  # [bt, bd]
    if has_gate:
        g_ref, dy_ref, coef_ref, w_ref = next(it), next(it), next(it), next(it)  # [bt, m] x2, [bt, 1], [m, bd, m]
    else:
        w_ref = None
    seg_ref = next(it) if has_seg else None  # [Tp, 1]
    dacc_ref = next(it) if write_dacc else None  # [m, bt, bd]
    s1_ref, sm_ref, ss_ref = it  # [m, bt, 1] x3
    m = len(stream_kernels)
    layout = stream_layout(stream_kernels)
    t0 = pl.program_id(1) * bt
    head = (pl.program_id(2) * bd) // (d // heads)
    col = functools.partial(head_column, head=head, heads=heads, backend=backend)
    masks = lag_masks(seg_ref, t0, bt, max([1, *stream_kernels]), backend)
    gate_vals = None
    if has_gate:
        gate_vals = (lambda r: g_ref[:, r], lambda j: dy_ref[:, j], coef_ref[:, 0])
    a = [_col(col(a_ref, (r, slice(None)))) for r in range(m)]
    b = [_col(col(b_ref, (r, slice(None)))) for r in range(m)]
    dold = [_col(col(dold_ref, (r, slice(None)))) for r in range(m)]

    win = TokenWindow(x_ref, (), t0, bt, slice(None), backend, width=bd)
    dh = dh_ref[:, :].astype(F32)
    zero = jnp.zeros((bt, bd), F32)
    s1, sm, ss = [zero] * m, [zero] * m, [zero] * m
    for r, (kernel, off) in enumerate(layout):
        e = expand_chunk(win, bank_ref, (), slice(None), kernel, off, masks)
        acc = acc_ref[r, :, :].astype(F32)
        z = a[r] * acc + b[r] * e
        dz = _dz(r, m, dh, z, gate_vals, w_ref, slice(None))
        if write_dacc:
            dacc_ref[r, :, :] = (a[r] * dz).astype(dacc_ref.dtype)
        s1[r] = s1[r] + dz * z
        sm[r] = sm[r] + dz * (acc - e * dold[r])
        ss[r] = ss[r] + dz * (e - z)
    for r in range(m):
        s1_ref[r, :, 0] = jnp.sum(s1[r], axis=1)
        sm_ref[r, :, 0] = jnp.sum(sm[r], axis=1)
        ss_ref[r, :, 0] = jnp.sum(ss[r], axis=1)


class _Pass3Inputs:
    """The input refs of pass 3 (both forms), in the order ``_pass3_inputs`` lays them out."""

    def __init__(self, it, has_bank, has_gate, has_seg):
        self.x = next(it)  # [Tp, bd]
        self.bank = next(it) if has_bank else None  # [K, bd]
        self.q = next(it)  # [m, bd]
        self.a, self.b, self.u = next(it), next(it), next(it)  # [m, Tp, H]
        self.v = next(it)  # [m, Tp, 1]
        self.acc = next(it)  # [m, Tp, bd]
        self.dh = next(it)  # [Tp, bd]
        self.g, self.dy, self.coef, self.w = (next(it), next(it), next(it), next(it)) if has_gate else (None,) * 4
        self.seg = next(it) if has_seg else None  # [Tp, 1]


class _Tile:
    """One token tile of pass 3 (both forms): its rows, lag masks, window of ``x``, ``dh`` and
    the gate's per-token values."""

    def __init__(self, ins, stream_kernels, rows, t0, bt, bd, backend):
        m = len(stream_kernels)
        self.rows = rows
        self.masks = lag_masks(ins.seg, t0, bt, max([1, *stream_kernels]), backend)
        self.win = TokenWindow(ins.x, (), t0, bt, slice(None), backend, width=bd)
        self.dh = ins.dh[rows, :].astype(F32)
        self.gate_vals, self.dy_cols = None, None
        if ins.g is not None:
            self.dy_cols = [ins.dy[rows, j] for j in range(m)]
            self.gate_vals = (lambda r: ins.g[rows, r], lambda j: self.dy_cols[j], ins.coef[rows, 0])


def _stream_cotangent(ins, tile, q, r, kernel, off, m, col):
    """Stream ``r``'s ``(E_r, z_r, d_E_r = b dz_r + u q_r + v E_r, u_r)`` on one tile (pass 3 of
    both forms; ``q``: the stream's query row, loaded once per program). One stream at a time,
    consumed before the next is made: computing all ``m`` first kept them all live and made the
    reverse-T kernel 37% slower on the H200 (`base`, 3.05 -> 4.19 ms per call)."""
    rows = tile.rows
    e = expand_chunk(tile.win, ins.bank, (), slice(None), kernel, off, tile.masks)
    b = _col(col(ins.b, (r, rows)))
    z = _col(col(ins.a, (r, rows))) * ins.acc[r, rows, :].astype(F32) + b * e
    dz = _dz(r, m, tile.dh, z, tile.gate_vals, ins.w, slice(None))
    u = _col(col(ins.u, (r, rows)))
    de = b * dz + u * q + _col(ins.v[r, rows, 0]) * e
    return e, z, de, u


def _dinput_kernel(*refs, stream_kernels, heads, d, bt, bd, n_tiles, has_bank, has_seg, has_gate, backend, shift,
                   grouped=False):
    """Pass 3: one (batch row, channel chunk) per program, T tiles in reverse. Recomputes
    ``d_E_r = b dz_r + u q_r + v E_r`` per tile, applies the transposed conv (``d_x``) and
    accumulates the bank, query and gate-weight gradients in the loop carry. ``grouped``
    (streams without a conv only: nothing crosses a tile): program ``(i, c, g)`` walks the
    ``n_tiles`` tiles of token group ``g`` and writes its own rows of ``d_x`` (a block of the
    group's rows) and its own partials."""
    it = iter(refs)
    ins = _Pass3Inputs(it, has_bank, has_gate, has_seg)
    bank_ref = ins.bank
    dx_ref = next(it)  # [Tp, bd]
    dq_ref = next(it)  # [m, bd]
    dbank_ref = next(it) if has_bank else None  # [K, bd]
    dw_ref = next(it) if has_gate else None  # [m, bd, m]
    # [slots, 4 bt, bd]: row_shift.shift_rows_via_buffer (no lags when grouped: no scratch)
    buf_ref = next(it) if shift == "buffer" and not grouped else None
    m = len(stream_kernels)
    layout = stream_layout(stream_kernels)
    n_taps = sum(stream_kernels)
    max_lag = max([1, *stream_kernels])
    head = (pl.program_id(1) * bd) // (d // heads)
    col = functools.partial(head_column, head=head, heads=heads, backend=backend)
    q = [ins.q[r, :].astype(F32)[None, :] for r in range(m)]

    first = pl.program_id(2) * n_tiles if grouped else 0

    def body(i, carry):
        spill, dq, dbank, dw = carry
        dq, dbank, dw = list(dq), list(dbank), [list(row) for row in dw]
        t0 = pl.multiple_of((first + n_tiles - 1 - i) * bt, bt)
        rows = pl.ds(t0, bt)
        tile = _Tile(ins, stream_kernels, rows, t0, bt, bd, backend)
        masks, win, dy_cols = tile.masks, tile.win, tile.dy_cols
        taps_d = [None] * max_lag  # sum_r c_r[delta] d_E_r, before the lag mask
        for r, (kernel, off) in enumerate(layout):
            e, z, de, u = _stream_cotangent(ins, tile, q[r], r, kernel, off, m, col)
            # The token sums of d_query, d_W and d_bank stay whole [bt, bd] tiles in the carry and
            # are reduced over rows once, after the loop: a cross-row reduction per tile and
            # gradient (44 per tile for kernels (0, 4, 8, 12) with the gate) cost 60% of this
            # kernel on the H200. d_W as one [bd, bt] @
            # [bt, m] product per stream and tile was slower there and compiled 50% longer.
            dq[r] = dq[r] + u * e
            if has_gate:
                for j in range(m):
                    dw[r][j] = dw[r][j] + z * _col(dy_cols[j])
            if kernel == 0:
                taps_d[0] = de if taps_d[0] is None else taps_d[0] + de
                continue
            for delta in range(kernel):
                masked = de * masks[delta] if delta else de
                dbank[off + delta] = dbank[off + delta] + masked * win.shift(delta)
                term = bank_ref[off + delta, :].astype(F32)[None, :] * de
                taps_d[delta] = term if taps_d[delta] is None else taps_d[delta] + term
        # transposed conv: d_x[t] = sum_delta mask_delta[t + delta] taps_d[delta][t + delta]
        dx = spill + taps_d[0]
        new_spill = jnp.zeros((bt, bd), F32)
        lagged = {delta: taps_d[delta] * masks[delta] for delta in range(1, max_lag) if taps_d[delta] is not None}
        if buf_ref is not None:
            shifted = shift_rows_via_buffer(buf_ref, lagged, bt, backend)
        else:
            shifted = {delta: shift_rows(tap, delta, bt, shift) for delta, tap in lagged.items()}
        for within, back in shifted.values():
            dx = dx + within
            new_spill = new_spill + back
        out_rows = pl.ds(pl.multiple_of((n_tiles - 1 - i) * bt, bt), bt) if grouped else rows
        dx_ref[out_rows, :] = dx.astype(dx_ref.dtype)
        return new_spill, dq, dbank, dw

    if buf_ref is not None:
        for g in range(buf_ref.shape[0]):  # the rows around each lag's tile stay zero
            buf_ref[g, :, :] = jnp.zeros(buf_ref.shape[1:], F32)

    zero = jnp.zeros((bt, bd), F32)
    carry = (zero, [zero] * m, [zero] * n_taps, [[zero] * m for _ in range(m)] if has_gate else [])
    _, dq, dbank, dw = jax.lax.fori_loop(0, n_tiles, body, carry)
    for r in range(m):
        dq_ref[r, :] = jnp.sum(dq[r], axis=0)
        if has_gate:
            for j in range(m):
                dw_ref[r, :, j] = jnp.sum(dw[r][j], axis=0)
    for k in range(n_taps if has_bank else 0):
        dbank_ref[k, :] = jnp.sum(dbank[k], axis=0)


def _dstreams_kernel(*refs, stream_kernels, heads, d, bt, bd, tiles_per_program, has_bank, has_seg, has_gate,
                     backend):
    """Pass 3 of the ``wide`` form: ``d_E_r = b dz_r + u q_r + v E_r`` written per tile (no
    transposed conv here: ``conv_transpose`` applies it), over ``tiles_per_program`` token
    tiles; the query and gate-weight gradients ride as whole tiles over those rows and are
    written once per program as partials (as in ``_dinput_kernel``)."""
    it = iter(refs)
    ins = _Pass3Inputs(it, has_bank, has_gate, has_seg)
    de_ref = next(it)  # [m, rows, bd]: this program's rows
    dq_ref = next(it)  # [m, bd]
    dw_ref = next(it) if has_gate else None  # [m, bd, m]
    m = len(stream_kernels)
    head = (pl.program_id(2) * bd) // (d // heads)
    col = functools.partial(head_column, head=head, heads=heads, backend=backend)
    first = pl.program_id(1) * tiles_per_program
    q = [ins.q[r, :].astype(F32)[None, :] for r in range(m)]

    def body(j, carry):
        dq, dw = list(carry[0]), [list(row) for row in carry[1]]
        t0 = pl.multiple_of((first + j) * bt, bt)
        tile = _Tile(ins, stream_kernels, pl.ds(t0, bt), t0, bt, bd, backend)
        for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
            e, z, de, u = _stream_cotangent(ins, tile, q[r], r, kernel, off, m, col)
            de_ref[r, pl.ds(pl.multiple_of(j * bt, bt), bt), :] = de.astype(de_ref.dtype)
            dq[r] = dq[r] + u * e
            if has_gate:
                for k in range(m):
                    dw[r][k] = dw[r][k] + z * _col(tile.dy_cols[k])
        return dq, dw

    zero = jnp.zeros((bt, bd), F32)
    dq, dw = jax.lax.fori_loop(0, tiles_per_program, body,
                               ([zero] * m, [[zero] * m for _ in range(m)] if has_gate else []))
    for r in range(m):
        dq_ref[r, :] = jnp.sum(dq[r], axis=0)
        if has_gate:
            for k in range(m):
                dw_ref[r, :, k] = jnp.sum(dw[r][k], axis=0)


# --------------------------------------------------------------------------- calls


def _common(stream_kernels, heads, d, tiles, backend):
    return dict(stream_kernels=tuple(stream_kernels), heads=heads, d=d, bt=tiles.block_t, bd=tiles.block_d_mix,
                backend=backend)


def _stats_call(x, bank, a, b, acc, dh, w3, seg, *, stream_kernels, heads, tiles, backend, interpret):
    batch, t_pad, d = x.shape
    m = len(stream_kernels)
    bt, bd = tiles.block_t, tiles.block_d_mix
    nc = d // bd
    has_bank, has_seg = bank is not None, seg is not None
    specs = [pl.BlockSpec((None, t_pad, bd), lambda i, t, c: (i, 0, c))]
    args = [x]
    if has_bank:
        specs.append(pl.BlockSpec((bank.shape[0], bd), lambda i, t, c: (0, c)))
        args.append(bank)
    scal = pl.BlockSpec((m, None, bt, heads), lambda i, t, c: (0, i, t, 0))
    specs += [scal, scal, pl.BlockSpec((m, None, bt, bd), lambda i, t, c: (0, i, t, c)),
              pl.BlockSpec((None, bt, bd), lambda i, t, c: (i, t, c)),
              pl.BlockSpec((m, m, bd), lambda i, t, c: (0, 0, c))]
    args += [a, b, acc, dh, w3]
    if has_seg:  # [B, Tp, 1]: tokens on sublanes, a whole trailing dim (Mosaic's block-shape rule)
        specs.append(pl.BlockSpec((None, t_pad, 1), lambda i, t, c: (i, 0, 0)))
        args.append(seg[:, :, None])
    kernel = functools.partial(_stats_kernel, has_bank=has_bank, has_seg=has_seg,
                               **_common(stream_kernels, heads, d, tiles, backend))
    # [B, nc, Tp, 1] and [B, nc, Tp, m] x2: the token tile and a whole trailing dim last (Mosaic's
    # block-shape rule, as in fused.mix_call); returned as [B, Tp, nc] and [B, Tp, nc, m] x2
    sq, zw, dg = pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt, nc),
        in_specs=specs,
        out_specs=[
            pl.BlockSpec((None, None, bt, 1), lambda i, t, c: (i, c, t, 0)),
            pl.BlockSpec((None, None, bt, m), lambda i, t, c: (i, c, t, 0)),
            pl.BlockSpec((None, None, bt, m), lambda i, t, c: (i, c, t, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, nc, t_pad, 1), F32),
            jax.ShapeDtypeStruct((batch, nc, t_pad, m), F32),
            jax.ShapeDtypeStruct((batch, nc, t_pad, m), F32),
        ],
        name="depth_attention_phase2_bwd_stats",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)
    return sq[..., 0].transpose(0, 2, 1), zw.transpose(0, 2, 1, 3), dg.transpose(0, 2, 1, 3)


def _dstate_call(x, bank, a, b, dold, acc, dh, gate_in, seg, *, stream_kernels, heads, tiles, backend, interpret,
                 write_dacc=True):
    """Pass 2: ``(d_acc, S1, Sm, Ss)``; ``d_acc`` is None with ``write_dacc=False``."""
    batch, t_pad, d = x.shape
    m = len(stream_kernels)
    bt, bd = tiles.block_t, tiles.block_d_mix
    nc = d // bd
    has_bank, has_seg, has_gate = bank is not None, seg is not None, gate_in is not None
    specs = [pl.BlockSpec((None, t_pad, bd), lambda i, t, c: (i, 0, c))]
    args = [x]
    if has_bank:
        specs.append(pl.BlockSpec((bank.shape[0], bd), lambda i, t, c: (0, c)))
        args.append(bank)
    scal = pl.BlockSpec((m, None, bt, heads), lambda i, t, c: (0, i, t, 0))
    specs += [scal, scal, scal, pl.BlockSpec((m, None, bt, bd), lambda i, t, c: (0, i, t, c)),
              pl.BlockSpec((None, bt, bd), lambda i, t, c: (i, t, c))]
    args += [a, b, dold, acc, dh]
    if has_gate:
        g, dy, coef, w3 = gate_in
        per_tok = pl.BlockSpec((None, bt, m), lambda i, t, c: (i, t, 0))
        specs += [per_tok, per_tok, pl.BlockSpec((None, bt, 1), lambda i, t, c: (i, t, 0)),
                  pl.BlockSpec((m, bd, m), lambda i, t, c: (0, c, 0))]
        args += [g, dy, coef[:, :, None], w3]
    if has_seg:  # [B, Tp, 1]: tokens on sublanes, a whole trailing dim (Mosaic's block-shape rule)
        specs.append(pl.BlockSpec((None, t_pad, 1), lambda i, t, c: (i, 0, 0)))
        args.append(seg[:, :, None])
    kernel = functools.partial(_dstate_kernel, has_bank=has_bank, has_seg=has_seg, has_gate=has_gate,
                               write_dacc=write_dacc, **_common(stream_kernels, heads, d, tiles, backend))
    # the reductions as [m, B, nc, Tp, 1] (token tile and a whole trailing dim last, for Mosaic),
    # returned as [m, B, Tp, nc]
    red = pl.BlockSpec((m, None, None, bt, 1), lambda i, t, c: (0, i, c, t, 0))
    out_specs, out_shape = [red] * 3, [jax.ShapeDtypeStruct((m, batch, nc, t_pad, 1), F32)] * 3
    if write_dacc:  # d_acc in the state's dtype
        out_specs = [pl.BlockSpec((m, None, bt, bd), lambda i, t, c: (0, i, t, c)), *out_specs]
        out_shape = [jax.ShapeDtypeStruct((m, batch, t_pad, d), acc.dtype), *out_shape]
    outs = pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt, nc),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="depth_attention_phase2_bwd_state",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)
    d_acc, reds = (outs[0], outs[1:]) if write_dacc else (None, outs)
    return (d_acc, *(jnp.swapaxes(v[..., 0], 2, 3) for v in reds))


def _pass3_inputs(x, bank, query, a, b, u, v, acc, dh, gate_in, seg, *, heads, bd, grid_ids):
    """Block specs and arguments of pass 3's inputs (both forms; ``_Pass3Inputs`` reads them):
    whole-T blocks of one batch row and one ``bd`` chunk. ``grid_ids(*program ids) -> (batch
    row, chunk)``."""
    t_pad, m = x.shape[1], query.shape[0]

    def spec(shape, index):
        return pl.BlockSpec(shape, lambda *ids: index(*grid_ids(*ids)))

    specs = [spec((None, t_pad, bd), lambda i, c: (i, 0, c))]
    args = [x]
    if bank is not None:
        specs.append(spec((bank.shape[0], bd), lambda i, c: (0, c)))
        args.append(bank)
    scal = spec((m, None, t_pad, heads), lambda i, c: (0, i, 0, 0))
    specs += [spec((m, bd), lambda i, c: (0, c)), scal, scal, scal,
              spec((m, None, t_pad, 1), lambda i, c: (0, i, 0, 0)),
              spec((m, None, t_pad, bd), lambda i, c: (0, i, 0, c)),
              spec((None, t_pad, bd), lambda i, c: (i, 0, c))]
    args += [query, a, b, u, v[..., None], acc, dh]
    if gate_in is not None:
        g, dy, coef, w3 = gate_in
        per_tok = spec((None, t_pad, m), lambda i, c: (i, 0, 0))
        specs += [per_tok, per_tok, spec((None, t_pad, 1), lambda i, c: (i, 0, 0)),
                  spec((m, bd, m), lambda i, c: (0, c, 0))]
        args += [g, dy, coef[:, :, None], w3]
    if seg is not None:  # [B, Tp, 1]
        specs.append(spec((None, t_pad, 1), lambda i, c: (i, 0, 0)))
        args.append(seg[:, :, None])
    return specs, args


def _dinput_call(x, bank, query, a, b, u, v, acc, dh, gate_in, seg, *, stream_kernels, heads, tiles, backend,
                 interpret, shift, dx_dtype=F32):
    batch, t_pad, d = x.shape
    m = len(stream_kernels)
    bt, bd = tiles.block_t, tiles.block_d_grads  # its own chunk: it writes nothing per chunk
    if (d // heads) % bd:
        raise ValueError(f"block_d={bd} must divide the head width {d // heads}")
    nc = d // bd
    has_bank, has_seg, has_gate = bank is not None, seg is not None, gate_in is not None
    # Streams without a conv carry nothing from tile to tile, so the T tiles split over programs:
    # with (batch row, chunk) programs alone the bench shape (B = 8, d = 2048, 64-channel chunks)
    # gives 256 programs of 128 sequential tiles each on 132 SMs, latency-bound (AttnRes: 0.105 ms
    # per call for 201 MB, 60% of the copy bandwidth, on the H200). Not on
    # the TPU (its Mosaic form stays as compiled for v5p).
    grouped = max([1, *stream_kernels]) == 1 and backend != "tpu"
    rows = conv_transpose.rows_per_program(t_pad, bt, cap=INPUTS_GROUP_ROWS) if grouped else t_pad
    n_groups = t_pad // rows
    specs, args = _pass3_inputs(x, bank, query, a, b, u, v, acc, dh, gate_in, seg, heads=heads, bd=bd,
                                grid_ids=lambda i, c, g: (i, c))
    out_specs = [pl.BlockSpec((None, rows, bd), lambda i, c, g: (i, g, c)),
                 pl.BlockSpec((None, None, m, bd), lambda i, c, g: (i, g, 0, c))]
    out_shape = [jax.ShapeDtypeStruct((batch, t_pad, d), dx_dtype), jax.ShapeDtypeStruct((batch, n_groups, m, d), F32)]
    if has_bank:
        out_specs.append(pl.BlockSpec((None, None, bank.shape[0], bd), lambda i, c, g: (i, g, 0, c)))
        out_shape.append(jax.ShapeDtypeStruct((batch, n_groups, bank.shape[0], d), F32))
    if has_gate:
        out_specs.append(pl.BlockSpec((None, None, m, bd, m), lambda i, c, g: (i, g, 0, c, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, n_groups, m, d, m), F32))
    if shift == "buffer" and not grouped:  # each program's scratch (row_shift.shift_rows_via_buffer); discarded
        if backend == "tpu":
            raise NotImplementedError("shift='buffer' is for Triton; Mosaic shifts by concatenate")
        slots = scratch_slots(max([1, *stream_kernels]), tiles.shift_slots)
        out_specs.append(pl.BlockSpec((None, None, slots, scratch_rows(bt), bd), lambda i, c, g: (i, c, 0, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, nc, slots, scratch_rows(bt), bd), F32))
    kernel = functools.partial(_dinput_kernel, n_tiles=rows // bt, has_bank=has_bank, has_seg=has_seg,
                               has_gate=has_gate, shift=shift, grouped=grouped,
                               **{**_common(stream_kernels, heads, d, tiles, backend), "bd": bd})
    outs = pl.pallas_call(
        kernel,
        grid=(batch, nc, n_groups),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="depth_attention_phase2_bwd_inputs",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)
    flat = lambda w: w.reshape(batch * n_groups, *w.shape[2:])  # noqa: E731 - the callers sum over axis 0
    dx, dq = outs[0], flat(outs[1])
    rest = list(outs[2:])
    dbank = flat(rest.pop(0)) if has_bank else None
    dw = flat(rest.pop(0)) if has_gate else None
    return dx, dq, dbank, dw


def _dstreams_call(x, bank, query, a, b, u, v, acc, dh, gate_in, seg, *, stream_kernels, heads, tiles, backend,
                   interpret, out_dtype):
    """Pass 3 of the ``wide`` form: ``d_E[m, B, Tp, d]`` (``out_dtype``) and the per-program
    partials of ``d_query`` ``[B, G, m, d]`` and ``d_W`` ``[B, G, m, d, m]`` (or None)."""
    batch, t_pad, d = x.shape
    m = len(stream_kernels)
    bt, bd = tiles.block_t, tiles.block_d_grads
    if (d // heads) % bd:
        raise ValueError(f"block_d={bd} must divide the head width {d // heads}")
    rows = conv_transpose.rows_per_program(t_pad, bt)
    n_groups, nc = t_pad // rows, d // bd
    has_bank, has_seg, has_gate = bank is not None, seg is not None, gate_in is not None
    specs, args = _pass3_inputs(x, bank, query, a, b, u, v, acc, dh, gate_in, seg, heads=heads, bd=bd,
                                grid_ids=lambda i, g, c: (i, c))
    out_specs = [pl.BlockSpec((m, None, rows, bd), lambda i, g, c: (0, i, g, c)),
                 pl.BlockSpec((None, None, m, bd), lambda i, g, c: (i, g, 0, c))]
    out_shape = [jax.ShapeDtypeStruct((m, batch, t_pad, d), out_dtype),
                 jax.ShapeDtypeStruct((batch, n_groups, m, d), F32)]
    if has_gate:
        out_specs.append(pl.BlockSpec((None, None, m, bd, m), lambda i, g, c: (i, g, 0, c, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, n_groups, m, d, m), F32))
    kernel = functools.partial(_dstreams_kernel, tiles_per_program=rows // bt, has_bank=has_bank, has_seg=has_seg,
                               has_gate=has_gate, **{**_common(stream_kernels, heads, d, tiles, backend), "bd": bd})
    outs = pl.pallas_call(
        kernel,
        grid=(batch, n_groups, nc),
        in_specs=specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="depth_attention_phase2_bwd_dstreams",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)
    return outs[0], outs[1], (outs[2] if has_gate else None)


# --------------------------------------------------------------------------- entry point

# Token rows per program of the input pass when its streams have no conv (``_dinput_call``): 256 gives
# the bench shape 8 x 32 x 8 programs and `base`'s 64 x 16 x 4.
INPUTS_GROUP_ROWS = 256

FORMS = ("reverse_t", "wide")
# "wide" was slower on the H200 at `base`: the whole backward (Mosaic passes 1-2) 5.62 against 4.75 ms
# per call with Triton's reverse-T pass (docs/kernels.md)
DEFAULT_FORM = "reverse_t"


def phase2_fused_backward(state, partial, bank, query, include, gate, segment_ids, dh, *, stream_kernels, heads, eps,
                          gate_eps, tiles, backend, interpret, scores=None, form=DEFAULT_FORM, mosaic_state=False,
                          mosaic_inputs=False, value_channel=False):
    """Gradients of ``reference.phase2_fused`` (same values as ``xla_streaming._phase2_fused_bwd``).

    Returns ``(d_state, d_partial, d_bank, d_query, d_gate)``: ``d_state`` a
    ``reference.SoftmaxState(max, denom, acc)`` (float32), ``d_bank`` ``None`` when ``bank``
    is, ``d_gate`` ``(d_W[m d, m], d_scale, d_bias[m])`` or ``None`` (mean fusion).
    ``backend``: ``"triton"``, ``"tpu"`` or ``"interpret"`` (as in ``fused.py``). ``dh``: bf16
    (read as it is, half the bytes; the cotangent of an ``h`` stored in bf16) or float32.
    ``scores``: the forward's ``(dots[m, B, T, H], sumsq[m, B, T])``
    (``fused.phase2_forward(..., return_scores=True)``); None recomputes them (pass 0).
    ``form``: pass 3 as the reverse-T input kernel (``"reverse_t"``) or as ``_dstreams_call``
    (the partial's stream cotangents written in its dtype) followed by
    ``conv_transpose.expansion_transpose`` (``"wide"``, as phase 1's default form).
    ``mosaic_state``: passes 1 and 2, with the gate's backward between them, as one Mosaic GPU
    kernel (``mosaic_gpu.phase2_backward_state``; on a GPU, or interpreted). ``mosaic_inputs``:
    pass 3 of the ``"reverse_t"`` form as a Mosaic GPU kernel (``mosaic_gpu.phase2_backward_inputs``).
    ``value_channel``: with mean fusion (``gate`` None) and the Triton / TPU state pass, ``d_state.acc``
    comes back factored, ``reference.ValueChannel(dh, a / m)`` (``d_acc = (a / m) dh``, the scale per
    stream, token and head), and pass 2 writes no ``d_acc``; otherwise (the gate, ``mosaic_state``) it
    is the array, as without the option.
    """
    return _backward(state, partial, bank, query, include, gate, segment_ids, dh, stream_kernels=stream_kernels,
                     heads=heads, eps=eps, gate_eps=gate_eps, tiles=tiles, backend=backend, interpret=interpret,
                     shift="buffer" if backend == "triton" else "concat", scores=scores, form=form,
                     mosaic_state=mosaic_state, mosaic_inputs=mosaic_inputs, value_channel=value_channel)


class _ScoreMerge(NamedTuple):
    """The forward's online-softmax merge of the partial's scores into phase 1's state, recomputed
    for the backward (Eq. 11-12; the names of docs/kernels.md §4, "Phase 2 backward"): ``keep = c =
    e^{M - M'}``, ``p = e^{s - M'}`` (0 for an excluded partial), ``denom = D' = c D + p``, the
    weights ``a = c / D'``, ``b = p / D'`` and ``dold = D``, each ``[m, B, Tp, H]``; ``dots`` the
    partial's scores and ``rk`` its key's inverse rms. The Triton / Mosaic GPU and Mosaic TPU
    backwards share it, so the two cannot drift apart."""

    dots: jax.Array
    rk: jax.Array
    keep: jax.Array
    p: jax.Array
    denom: jax.Array
    dold: jax.Array
    a: jax.Array
    b: jax.Array

    @classmethod
    def recompute(cls, dots, sumsq, include, state, *, d, eps, t_pad):
        rk = jax.lax.rsqrt(sumsq / d + eps)
        include = jnp.asarray(include, bool)
        s = jnp.where(include, dots * rk[..., None], reference.NEG_LARGE)
        pmax = pad_tokens(state.max.astype(F32), 2, t_pad)
        dold = pad_tokens(state.denom.astype(F32), 2, t_pad, 1.0)
        new_max = jnp.maximum(pmax, s)
        keep = jnp.exp(pmax - new_max)
        p = jnp.where(include, jnp.exp(s - new_max), 0.0)
        denom = dold * keep + p
        return cls(dots, rk, keep, p, denom, dold, keep / denom, p / denom)

    def cotangents(self, s1, sm, ss, d):
        """``d_denom``, ``d_max`` and the key-norm coefficients ``u`` ``[m, B, Tp, H]``, ``v`` ``[m, B,
        Tp]`` from pass 2's per-head sums ``S1, Sm, Ss``."""
        d_denom = -self.keep * s1 / self.denom
        d_max = self.keep * self.p * sm / (self.denom * self.denom)
        ds = self.b * ss
        u = self.rk[..., None] * ds
        v = -(self.rk**3) / d * jnp.sum(ds * self.dots, axis=-1)
        return d_denom, d_max, u, v


def _backward(state, partial, bank, query, include, gate, segment_ids, dh, *, stream_kernels, heads, eps, gate_eps,
              tiles, backend, interpret, shift, scores=None, form=DEFAULT_FORM, mosaic_state=False,
              mosaic_inputs=False, value_channel=False):
    """``phase2_fused_backward`` with the transposed conv's row shift chosen explicitly
    (``row_shift.SHIFTS``; the tests run the Triton ones, ``"dot"`` and ``"buffer"``, in
    interpret mode too)."""
    if shift not in SHIFTS:
        raise ValueError(f"shift={shift!r}: must be one of {SHIFTS}")
    if form not in FORMS:
        raise ValueError(f"form={form!r}: must be one of {FORMS}")
    if backend == "tpu" and form == "reverse_t" and not (mosaic_state or mosaic_inputs):
        return _backward_tpu(state, partial, bank, query, include, gate, segment_ids, dh,
                             stream_kernels=tuple(stream_kernels), heads=heads, eps=eps, gate_eps=gate_eps,
                             tiles=tiles, interpret=interpret, scores=scores, value_channel=value_channel)
    stream_kernels = tuple(stream_kernels)
    batch, t_len, d = partial.shape
    m = len(stream_kernels)
    max_lag = max([1, *stream_kernels])
    if tiles.block_t < max_lag - 1:  # the carry of the reverse loop (and the halo) span one tile
        tiles = dataclasses.replace(tiles, block_t=tiling._next_pow2(max_lag - 1))
    bt, bd = tiles.block_t, tiles.block_d_mix
    if (d // heads) % bd:
        raise ValueError(f"block_d_mix={bd} must divide the head width {d // heads}")
    if backend == "triton" and shift == "dot" and max_lag > 1 and min(bt, bd) < 16:
        # tl.dot needs every dimension >= 16 (the shift matrices are [bt, bt] @ [bt, bd]).
        raise NotImplementedError(f"Triton phase-2 backward needs block_t, block_d >= 16 (got {bt}, {bd})")
    t_pad = -(-t_len // bt) * bt
    nc = d // bd
    seg = None if segment_ids is None else pad_tokens(jnp.asarray(segment_ids, jnp.int32), 1, t_pad, -1)
    has_bank = bank is not None and any(stream_kernels)
    kbank = bank.astype(F32) if has_bank else None
    x = pad_tokens(partial, 1, t_pad)
    # bf16 as it comes (the cotangent of a bf16 h, exact), else float32: every kernel widens its tiles
    dh = jnp.asarray(dh)
    dh = dh if dh.dtype == jnp.bfloat16 else dh.astype(F32)
    g_h = pad_tokens(dh, 1, t_pad)
    # d_partial in the partial's dtype when that is bf16: each kernel writes every element once, so
    # that is the float32 value rounded once, as the cast at the end would give, in half the bytes
    dx_dtype = partial.dtype if partial.dtype == jnp.bfloat16 else F32
    q = query.astype(F32)
    kw = dict(stream_kernels=stream_kernels, heads=heads, tiles=tiles, backend=backend, interpret=interpret)
    valid = (jnp.arange(t_pad) < t_len).astype(F32)  # [Tp]

    # Pass 0: the forward's per-token scalars (scores, online-softmax merge); the scores are the
    # forward's own when it kept them.
    if scores is None:
        dots, sumsq = scores_call(x[None], None if kbank is None else kbank[None], q[None], seg, **kw)
        dots, sumsq = dots[0, 0], sumsq[0]  # [m, B, Tp, H], [m, B, Tp]
    else:
        dots, sumsq = (pad_tokens(jnp.asarray(v, F32), 2, t_pad) for v in scores)
    merge = _ScoreMerge.recompute(dots, sumsq, include, state, d=d, eps=eps, t_pad=t_pad)
    a, b, dold = merge.a, merge.b, merge.dold
    acc = pad_tokens(state.acc, 2, t_pad)  # float32 or bf16 (api.phase1's state_dtype); loaded as float32

    gate_in, d_gate = None, None
    if mosaic_state:  # passes 1 and 2 and the gate's backward in one Mosaic GPU kernel
        cut_t = lambda v: v[:, :, :t_len]  # noqa: E731
        d_acc, sums, gate_out = mosaic_gpu.phase2_backward_state(
            partial, kbank, cut_t(a), cut_t(b), cut_t(dold), state.acc, dh, gate, segment_ids,
            stream_kernels=stream_kernels, heads=heads, gate_eps=gate_eps, interpret=interpret)
        s1, sm, ss = (pad_tokens(v, 2, t_pad) for v in sums)
        if gate is not None:
            g, dy, coef, d_scale, d_bias = gate_out
            gate_in = (pad_tokens(g, 1, t_pad), pad_tokens(dy, 1, t_pad), pad_tokens(coef, 1, t_pad), gate_cols(gate[0], m, d))
            d_gate = [None, d_scale, d_bias]
    elif gate is not None:
        # Pass 1 + XLA: the gate's statistics and its backward on [B, Tp, m] scalars.
        w, scale, bias = gate
        w3 = gate_rows(w, m, d)
        scale_f, bias_f = jnp.asarray(scale, F32), jnp.asarray(bias, F32)
        sq, zw, dg = _stats_call(x, kbank, a, b, acc, g_h, w3, seg, **kw)
        rz = jax.lax.rsqrt(jnp.sum(sq, axis=-1) / (m * d) + gate_eps)  # [B, Tp]
        y = jnp.sum(zw, axis=2)  # [B, Tp, m]
        g = jax.nn.sigmoid(scale_f * rz[..., None] * y + bias_f)
        dlogit = jnp.sum(dg, axis=2) * g * (1.0 - g) * valid[None, :, None]
        d_bias = jnp.sum(dlogit, axis=(0, 1))
        d_scale = jnp.sum(dlogit * rz[..., None] * y)
        dy = scale_f * rz[..., None] * dlogit
        coef = -scale_f * jnp.sum(dlogit * y, axis=-1) * rz**3 / (m * d)
        gate_in = (g * valid[None, :, None], dy, coef, gate_cols(w, m, d))
        d_gate = [None, d_scale.reshape(jnp.shape(scale)), d_bias]

    # Pass 2 + XLA: d_acc and the per-head reductions -> d_denom, d_max, ds, key-norm coefficients.
    factored = value_channel and gate is None and not mosaic_state  # d_acc = (a / m) dh: not written
    if not mosaic_state:
        d_acc, s1, sm, ss = _dstate_call(x, kbank, a, b, dold, acc, g_h, gate_in, seg, write_dacc=not factored, **kw)
        per_head = lambda v: jnp.sum(v.reshape(m, batch, t_pad, heads, nc // heads), axis=-1)  # noqa: E731
        s1, sm, ss = per_head(s1), per_head(sm), per_head(ss)
    d_denom, d_max, u, v = merge.cotangents(s1, sm, ss, d)

    # Pass 3: d_partial (transposed conv, reverse T loop), d_bank, d_query, d_W.
    if form == "wide":
        d_streams, dq, dw = _dstreams_call(x, kbank, q, a, b, u, v, acc, g_h, gate_in, seg,
                                           out_dtype=jnp.promote_types(partial.dtype, jnp.bfloat16), **kw)
        dq, dw = jnp.sum(dq, axis=1), None if dw is None else jnp.sum(dw, axis=1)
        dx, dbank = conv_transpose.expansion_transpose(
            d_streams, x, kbank, seg, stream_kernels=stream_kernels, tiles=tiles, backend=backend, interpret=interpret,
            out_dtype=dx_dtype)
        dbank = dbank[None] if has_bank else None
    elif mosaic_inputs:
        cut_t = lambda w, axis: jax.lax.slice_in_dim(w, 0, t_len, axis=axis)  # noqa: E731
        gate3 = None if gate_in is None else (*(cut_t(w, 1) for w in gate_in[:3]), gate_in[3])
        dx, dq, dbank, dw = mosaic_gpu.phase2_backward_inputs(
            partial, kbank, q, cut_t(a, 2), cut_t(b, 2), cut_t(u, 2), cut_t(v, 2), state.acc, dh, gate3, segment_ids,
            stream_kernels=stream_kernels, heads=heads, dx_dtype=dx_dtype, interpret=interpret)
    else:
        dx, dq, dbank, dw = _dinput_call(x, kbank, q, a, b, u, v, acc, g_h, gate_in, seg, shift=shift,
                                         dx_dtype=dx_dtype, **kw)

    cut = lambda t: t[..., :t_len, :]  # noqa: E731
    d_acc = reference.ValueChannel(dh, cut(a) / m) if factored else cut(d_acc)
    d_state = reference.SoftmaxState(cut(d_max), cut(d_denom), d_acc)
    d_bank = None
    if bank is not None:
        d_bank = (jnp.sum(dbank, axis=0) if has_bank else jnp.zeros(bank.shape, F32)).astype(bank.dtype)
    if d_gate is not None:
        d_gate[0] = jnp.sum(dw, axis=0).reshape(m * d, m)
        d_gate = tuple(d_gate)
    return (d_state, dx[:, :t_len].astype(partial.dtype), d_bank, jnp.sum(dq, axis=0).astype(query.dtype), d_gate)


# --------------------------------------------------------------------------- Mosaic TPU, token-tiled
#
# The reverse-T form as token-tiled kernels (``tpu_blocks``): passes 1 and 2 map one ``[block_t,
# block_d]`` tile of each input per program, the conv's halo from a ``halo``-row block of the
# previous tile (``TokenWindow``'s tiled form); pass 3 walks the token tiles in reverse as its last grid axis (``"arbitrary"``),
# the transposed conv's spill carried in VMEM scratch and the query, bank and gate-weight
# gradients accumulated in output blocks that stay in VMEM over that axis. Per-token scalars come
# with tokens on sublanes and streams on lanes (``[B, H, Tp, m]``, the head picked by the block
# index); the gate's ``W`` as ``gate_rows`` (a ``[block_d]`` lane row per (r, j)).


def _dz_rows(r, m, dh, z, gate_vals, w_ref):
    """``_dz`` with ``W`` as ``wt[r, j, chunk]`` rows (``gate_rows``)."""
    if gate_vals is None:
        return dh * (1.0 / m)
    g_of, dy_of, coef = gate_vals
    dz = g_of(r) * dh + coef * z
    for j in range(m):
        dz = dz + w_ref[r, j, :].astype(F32)[None, :] * dy_of(j)
    return dz


class _TpuInputs:
    """Refs of the TPU passes, in ``_tpu_inputs``'s order; ``names``: which are present."""

    def __init__(self, it, names):
        for name in ("x", "behind", "bank", "q", "a", "b", "dold", "u", "v", "acc", "dh", "g", "dy", "coef", "w",
                     "masks"):
            setattr(self, name, next(it) if name in names else None)

    def col(self, name, j):
        return getattr(self, name)[:, pl.ds(j, 1)]  # [bt, 1]


def _tpu_inputs(arrays: dict, names, *, bt, bd, halo, dhp, t_pad, tile):
    """Specs and arguments of the named inputs of a TPU pass; grid ids ``(i, c, t)`` with
    ``tile(i, c, t)`` the token tile."""
    head = lambda c: (c * bd) // dhp  # noqa: E731
    specs, args = [], []

    def add(name, new_specs):
        specs.extend(new_specs)
        args.extend([arrays[name]] * len(new_specs))

    for name in names:
        m = arrays["a"].shape[-1]
        if name == "x":
            add(name, tpu_blocks.token_specs(pl.BlockSpec((None, bt, bd), lambda i, c, t: (i, tile(i, c, t), c)), 1,
                                             bt, halo))
        elif name == "behind":
            continue  # the x spec's second block
        elif name == "bank":
            add(name, [pl.BlockSpec((arrays[name].shape[0], bd), lambda i, c, t: (0, c))])
        elif name == "q":
            add(name, [pl.BlockSpec((m, bd), lambda i, c, t: (0, c))])
        elif name in ("a", "b", "dold", "u"):
            add(name, [pl.BlockSpec((None, None, bt, m), lambda i, c, t: (i, head(c), tile(i, c, t), 0))])
        elif name in ("v", "g", "dy", "coef", "masks"):
            add(name, [pl.BlockSpec((None, bt, arrays[name].shape[-1]), lambda i, c, t: (i, tile(i, c, t), 0))])
        elif name == "acc":
            add(name, [pl.BlockSpec((m, None, bt, bd), lambda i, c, t: (0, i, tile(i, c, t), c))])
        elif name == "dh":
            add(name, [pl.BlockSpec((None, bt, bd), lambda i, c, t: (i, tile(i, c, t), c))])
        elif name == "w":
            add(name, [pl.BlockSpec((m, m, bd), lambda i, c, t: (0, 0, c))])
    return specs, args


def _tpu_gate_vals(ins, m):
    if ins.g is None:
        return None
    return (lambda r: ins.col("g", r), lambda j: ins.col("dy", j), ins.coef[:, :])


def _tpu_tile_z(ins, r, kernel, off, win, masks):
    e = expand_chunk(win, ins.bank, (), slice(None), kernel, off, masks)
    return e, ins.col("a", r) * ins.acc[r, :, :].astype(F32) + ins.col("b", r) * e


def _stats_kernel_tpu(*refs, names, stream_kernels, bt):
    """Pass 1 on one token tile and chunk (``_stats_kernel``)."""
    it = iter(refs)
    ins = _TpuInputs(it, names)
    sq_ref, zw_ref, dg_ref = it  # [bt, 1], [bt, m], [bt, m]
    m = len(stream_kernels)
    t = pl.program_id(2)
    masks = tpu_blocks.tile_masks(ins.masks, t * bt, bt, max([1, *stream_kernels]))
    win = TokenWindow(ins.x, (), t * bt, bt, slice(None), "tpu", prev=ins.behind, tiled=True)
    dh = ins.dh[:, :].astype(F32)
    sq, zw, dg = None, [None] * m, [None] * m
    add = lambda acc, v: v if acc is None else acc + v  # noqa: E731
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        _, z = _tpu_tile_z(ins, r, kernel, off, win, masks)
        sq = add(sq, z * z)
        for j in range(m):
            zw[j] = add(zw[j], z * ins.w[r, j, :].astype(F32)[None, :])
        dg[r] = dh * z
    sq_ref[...] = jnp.sum(sq, axis=1, keepdims=True)
    for j in range(m):
        zw_ref[:, pl.ds(j, 1)] = jnp.sum(zw[j], axis=1, keepdims=True)
        dg_ref[:, pl.ds(j, 1)] = jnp.sum(dg[j], axis=1, keepdims=True)


def _dstate_kernel_tpu(*refs, names, stream_kernels, bt, write_dacc):
    """Pass 2 on one token tile and chunk (``_dstate_kernel``)."""
    it = iter(refs)
    ins = _TpuInputs(it, names)
    dacc_ref = next(it) if write_dacc else None  # [m, bt, bd]
    s1_ref, sm_ref, ss_ref = it  # [bt, m] each
    m = len(stream_kernels)
    t = pl.program_id(2)
    masks = tpu_blocks.tile_masks(ins.masks, t * bt, bt, max([1, *stream_kernels]))
    win = TokenWindow(ins.x, (), t * bt, bt, slice(None), "tpu", prev=ins.behind, tiled=True)
    dh = ins.dh[:, :].astype(F32)
    gate_vals = _tpu_gate_vals(ins, m)
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        e, z = _tpu_tile_z(ins, r, kernel, off, win, masks)
        acc = ins.acc[r, :, :].astype(F32)
        dz = _dz_rows(r, m, dh, z, gate_vals, ins.w)
        if write_dacc:
            dacc_ref[r, :, :] = (ins.col("a", r) * dz).astype(dacc_ref.dtype)
        col = pl.ds(r, 1)
        s1_ref[:, col] = jnp.sum(dz * z, axis=1, keepdims=True)
        sm_ref[:, col] = jnp.sum(dz * (acc - e * ins.col("dold", r)), axis=1, keepdims=True)
        ss_ref[:, col] = jnp.sum(dz * (e - z), axis=1, keepdims=True)


def _dinput_kernel_tpu(*refs, names, stream_kernels, bt, n_tiles):
    """Pass 3 (``_dinput_kernel``) on one token tile, the tiles taken in reverse along the last grid
    axis: ``d_x`` of the tile plus the spill of the tile after it (scratch), the gradients' row sums
    added into their resident output blocks."""
    it = iter(refs)
    ins = _TpuInputs(it, names)
    dx_ref, dq_ref = next(it), next(it)  # [bt, bd], [m, bd]
    dbank_ref = next(it) if ins.bank is not None else None  # [K, bd]
    dw_ref = next(it) if ins.g is not None else None  # [m, m, bd]: dw[r, j, chunk]
    spill_ref = next(it)  # [bt, bd] scratch: rows of this tile's d_x from the tile after it
    m = len(stream_kernels)
    max_lag = max([1, *stream_kernels])
    step = pl.program_id(2)
    tile = n_tiles - 1 - step
    t0 = tile * bt

    @pl.when(step == 0)
    def _():
        spill_ref[...] = jnp.zeros(spill_ref.shape, F32)
        for ref in (dq_ref, dbank_ref, dw_ref):
            if ref is not None:
                ref[...] = jnp.zeros(ref.shape, F32)

    def accumulate(ref, idx, v):
        ref[idx] = ref[idx] + jnp.sum(v, axis=0, keepdims=True)

    masks = tpu_blocks.tile_masks(ins.masks, t0, bt, max_lag)
    win = TokenWindow(ins.x, (), t0, bt, slice(None), "tpu", prev=ins.behind, tiled=True)
    dh = ins.dh[:, :].astype(F32)
    gate_vals = _tpu_gate_vals(ins, m)
    taps_d = [None] * max_lag  # sum_r c_r[delta] d_E_r, before the lag mask
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        e, z = _tpu_tile_z(ins, r, kernel, off, win, masks)
        dz = _dz_rows(r, m, dh, z, gate_vals, ins.w)
        u = ins.col("u", r)
        de = ins.col("b", r) * dz + u * ins.q[r, :].astype(F32)[None, :] + ins.col("v", r) * e
        accumulate(dq_ref, (pl.ds(r, 1), slice(None)), u * e)
        if dw_ref is not None:
            for j in range(m):
                accumulate(dw_ref, (r, pl.ds(j, 1), slice(None)), z * ins.col("dy", j))
        if kernel == 0:
            taps_d[0] = de if taps_d[0] is None else taps_d[0] + de
            continue
        for delta in range(kernel):
            masked = de * masks[delta] if delta else de
            accumulate(dbank_ref, (pl.ds(off + delta, 1), slice(None)), masked * win.shift(delta))
            term = ins.bank[off + delta, :].astype(F32)[None, :] * de
            taps_d[delta] = term if taps_d[delta] is None else taps_d[delta] + term
    # transposed conv: d_x[t] = sum_delta mask_delta[t + delta] taps_d[delta][t + delta]
    dx = spill_ref[...] if taps_d[0] is None else spill_ref[...] + taps_d[0]
    new_spill = jnp.zeros(spill_ref.shape, F32)
    for delta in range(1, max_lag):
        if taps_d[delta] is not None:
            within, back = shift_rows(taps_d[delta] * masks[delta], delta, bt, "concat")
            dx, new_spill = dx + within, new_spill + back
    dx_ref[...] = dx.astype(dx_ref.dtype)
    spill_ref[...] = new_spill


def _tpu_vmem_bytes(kernel: str, *, m, n_taps, max_lag, has_gate, has_mask, x_itemsize, acc_itemsize, dh_itemsize):
    """``need(bt, bd)`` (``tpu_blocks.choose``) of a TPU pass: double-buffered blocks and the
    live float32 temporaries (the window, ``m`` streams' tiles, the sums being built)."""
    halo = tpu_blocks.halo_rows(max_lag)
    size = tpu_blocks.block_bytes

    def bytes_of(bt, bd):
        blocks = (size((bt + halo, bd), x_itemsize) + (size((n_taps, bd), 4) if n_taps else 0)
                  + 4 * size((bt, m), 4) + size((m, bt, bd), acc_itemsize) + size((bt, bd), dh_itemsize)
                  + (size((bt, max_lag), 4) if has_mask else 0))
        if has_gate:
            blocks += 3 * size((bt, m), 4) + size((m * m, bd), 4)
        temps = ((bt + halo) + 6 * bt) * bd * 4
        if kernel == "stats":
            blocks += 3 * size((bt, m), 4)
            temps += 2 * m * bt * bd * 4
        elif kernel == "state":
            blocks += size((m, bt, bd), acc_itemsize) + 3 * size((bt, m), 4)
        else:  # inputs
            blocks += (size((bt, bd), x_itemsize) + size((m + n_taps, bd), 4)
                       + (size((m * m, bd), 4) if has_gate else 0))
            temps += (max_lag + 1) * bt * bd * 4  # the taps' sums and the spill scratch
        return 2 * blocks + temps

    return bytes_of


def tpu_tiles(*, stream_kernels, heads, d, t_len, gate, x_itemsize=2, acc_itemsize=4, dh_itemsize=2,
              has_mask=True, cap_t=None, cap_d=None, vmem=None) -> dict:
    """``{kernel: tpu_blocks.TpuTile}`` of the TPU reverse-T backward's passes, pass 0 (the forward's
    scoring kernel, run when the forward's scores are not given) included (``tpu_blocks.choose``:
    caps ``Tiles.tpu_block_t`` / ``tpu_block_d``, ``vmem`` the chip)."""
    m, n_taps, max_lag = len(stream_kernels), sum(stream_kernels), max([1, *stream_kernels])
    sizes = dict(m=m, n_taps=n_taps, max_lag=max_lag, has_gate=gate, has_mask=has_mask and max_lag > 1,
                 x_itemsize=x_itemsize, acc_itemsize=acc_itemsize, dh_itemsize=dh_itemsize)
    choose = functools.partial(tpu_blocks.choose, dhp=tpu_blocks.padded_head_width(d // heads), t_len=t_len,
                               max_kernel=max_lag, cap_t=cap_t, cap_d=cap_d, vmem=vmem)
    kernels = (("stats",) if gate else ()) + ("state", "inputs")
    out = {"phase 2 scores": fused.tpu_scores_tile(t_len=t_len, d=d, heads=heads, n_targets=1, n_streams=m,
                                                   max_kernel=max_lag, n_taps=n_taps, x_itemsize=x_itemsize,
                                                   cap_t=cap_t, cap_d=cap_d, vmem=vmem,
                                                   name="phase 2 backward scores")}
    return out | {f"phase 2 {k}": choose(_tpu_vmem_bytes(k, **sizes), name=f"phase 2 backward {k}") for k in kernels}


def _backward_tpu(state, partial, bank, query, include, gate, segment_ids, dh, *, stream_kernels, heads, eps,
                  gate_eps, tiles, interpret, scores, value_channel):
    """``_backward``'s reverse-T form on the TPU: the passes above on inputs whose heads are padded to
    whole 128-lane vregs (``tpu_blocks.pad_heads``; every mean keeps the real ``d``)."""
    batch, t_len, d = partial.shape
    m, n_taps, max_lag = len(stream_kernels), sum(stream_kernels), max([1, *stream_kernels])
    dhp = tpu_blocks.padded_head_width(d // heads)
    dp = heads * dhp
    has_bank, has_gate = bank is not None and n_taps > 0, gate is not None
    has_mask = segment_ids is not None and max_lag > 1
    dh = jnp.asarray(dh)
    dh = dh if dh.dtype == jnp.bfloat16 else dh.astype(F32)
    chosen = tpu_tiles(stream_kernels=stream_kernels, heads=heads, d=d, t_len=t_len, gate=has_gate,
                       x_itemsize=partial.dtype.itemsize, acc_itemsize=state.acc.dtype.itemsize,
                       dh_itemsize=dh.dtype.itemsize, has_mask=has_mask, cap_t=tiles.tpu_block_t,
                       cap_d=tiles.tpu_block_d)
    unit = max([tt.block_t for tt in chosen.values()] + [tiles.block_t])
    t_pad = -(-t_len // unit) * unit
    pad = lambda a, axis: pad_tokens(tpu_blocks.pad_heads(a, heads), axis, t_pad)  # noqa: E731
    x = pad(partial, 1)
    kbank = tpu_blocks.pad_heads(bank.astype(F32), heads) if has_bank else None
    q = tpu_blocks.pad_heads(query.astype(F32), heads)
    acc = pad(state.acc, 2)
    g_h = pad(dh, 1)
    seg = None if segment_ids is None else pad_tokens(jnp.asarray(segment_ids, jnp.int32), 1, t_pad, -1)
    dx_dtype = partial.dtype if partial.dtype == jnp.bfloat16 else F32
    valid = (jnp.arange(t_pad) < t_len).astype(F32)

    # Pass 0: the forward's per-token scalars
    if scores is None:
        dots, sumsq = scores_call(x[None], None if kbank is None else kbank[None], q[None], seg,
                                  stream_kernels=stream_kernels, heads=heads, tiles=tiles, backend="tpu",
                                  interpret=interpret, tpu=chosen["phase 2 scores"])
        dots, sumsq = dots[0, 0], sumsq[0]
    else:
        dots, sumsq = (pad_tokens(jnp.asarray(v, F32), 2, t_pad) for v in scores)
    merge = _ScoreMerge.recompute(dots, sumsq, include, state, d=d, eps=eps, t_pad=t_pad)
    a, b, dold = merge.a, merge.b, merge.dold

    lanes = lambda v: jnp.transpose(v, (1, 3, 2, 0))  # noqa: E731  [m, B, Tp, H] -> [B, H, Tp, m]
    arrays = dict(x=x, bank=kbank, q=q, a=lanes(a), b=lanes(b), dold=lanes(dold), acc=acc, dh=g_h)
    if has_mask:
        arrays["masks"] = tpu_blocks.segment_masks(seg, max_lag)
    base = ["x"] + (["behind"] if max_lag > 1 else []) + (["bank"] if has_bank else [])
    tail = ["masks"] if has_mask else []

    def call(kernel_name, kernel, names, out_specs, out_shape, *, reverse=False, scratch=(), **static):
        tt = chosen[f"phase 2 {kernel_name}"]
        bt, bd = tt.block_t, tt.block_d
        n_tiles = t_pad // bt
        tile = (lambda i, c, t: n_tiles - 1 - t) if reverse else (lambda i, c, t: t)
        specs, args = _tpu_inputs(arrays, names, bt=bt, bd=bd, halo=tt.halo, dhp=dhp, t_pad=t_pad, tile=tile)
        from jax.experimental.pallas import tpu as pltpu

        return pl.pallas_call(
            functools.partial(kernel, names=tuple(names), stream_kernels=tuple(stream_kernels), bt=bt, **static),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=0, grid=(batch, dp // bd, n_tiles), in_specs=specs,
                out_specs=out_specs(bt, bd, tile), scratch_shapes=[pltpu.VMEM(s(bt, bd), F32) for s in scratch]),
            out_shape=out_shape(bt, bd),
            name=f"depth_attention_phase2_bwd_{kernel_name}",
            compiler_params=tpu_blocks.compiler_params(
                ("parallel", "parallel", "arbitrary" if reverse else "parallel"), tt),
            interpret=interpret,
        )(*args)

    def per_chunk(cols):
        return (lambda bt, bd, tile: [pl.BlockSpec((None, None, bt, c), lambda i, ch, t: (i, ch, tile(i, ch, t), 0))
                                      for c in cols],
                lambda bt, bd: [jax.ShapeDtypeStruct((batch, dp // bd, t_pad, c), F32) for c in cols])

    def per_head(v, bd):  # [B, nc, Tp, m] chunk partials -> [m, B, Tp, H]
        nc = dp // bd
        return jnp.transpose(jnp.sum(v.reshape(batch, heads, nc // heads, t_pad, m), axis=2), (3, 0, 2, 1))

    gate_in, d_gate = None, None
    if has_gate:
        w, scale, bias = gate
        arrays["w"] = tpu_blocks.pad_heads(gate_rows(w, m, d), heads)  # [m, m, dp]
        sq, zw, dg = call("stats", _stats_kernel_tpu, base + ["a", "b", "acc", "dh", "w"] + tail, *per_chunk((1, m, m)))
        scale_f, bias_f = jnp.asarray(scale, F32), jnp.asarray(bias, F32)
        rz = jax.lax.rsqrt(jnp.sum(sq[..., 0], axis=1) / (m * d) + gate_eps)  # [B, Tp]
        y = jnp.sum(zw, axis=1)  # [B, Tp, m]
        g = jax.nn.sigmoid(scale_f * rz[..., None] * y + bias_f)
        dlogit = jnp.sum(dg, axis=1) * g * (1.0 - g) * valid[None, :, None]
        d_bias = jnp.sum(dlogit, axis=(0, 1))
        d_scale = jnp.sum(dlogit * rz[..., None] * y)
        arrays.update(g=g * valid[None, :, None], dy=scale_f * rz[..., None] * dlogit,
                      coef=(-scale_f * jnp.sum(dlogit * y, axis=-1) * rz**3 / (m * d))[..., None])
        gate_in = ["g", "dy", "coef", "w"]
        d_gate = [None, d_scale.reshape(jnp.shape(scale)), d_bias]

    # Pass 2: d_acc and the per-head reductions
    factored = value_channel and not has_gate
    specs2, shapes2 = per_chunk((m, m, m))
    if not factored:
        specs2 = (lambda f: lambda bt, bd, tile: [
            pl.BlockSpec((m, None, bt, bd), lambda i, c, t: (0, i, tile(i, c, t), c)), *f(bt, bd, tile)])(specs2)
        shapes2 = (lambda f: lambda bt, bd: [jax.ShapeDtypeStruct((m, batch, t_pad, dp), acc.dtype), *f(bt, bd)])(shapes2)
    outs = call("state", _dstate_kernel_tpu, base + ["a", "b", "dold", "acc", "dh"] + (gate_in or []) + tail,
                specs2, shapes2, write_dacc=not factored)
    d_acc, reds = (None, outs) if factored else (outs[0], outs[1:])
    bd_state = chosen["phase 2 state"].block_d
    s1, sm, ss = (per_head(v, bd_state) for v in reds)
    d_denom, d_max, u, v = merge.cotangents(s1, sm, ss, d)
    arrays.update(u=lanes(u), v=jnp.moveaxis(v, 0, -1))

    # Pass 3: d_partial (reverse T), d_bank, d_query, d_W
    def specs3(bt, bd, tile):
        out = [pl.BlockSpec((None, bt, bd), lambda i, c, t: (i, tile(i, c, t), c)),
               pl.BlockSpec((None, m, bd), lambda i, c, t: (i, 0, c))]
        if has_bank:
            out.append(pl.BlockSpec((None, n_taps, bd), lambda i, c, t: (i, 0, c)))
        if has_gate:
            out.append(pl.BlockSpec((None, m, m, bd), lambda i, c, t: (i, 0, 0, c)))
        return out

    def shapes3(bt, bd):
        out = [jax.ShapeDtypeStruct((batch, t_pad, dp), dx_dtype), jax.ShapeDtypeStruct((batch, m, dp), F32)]
        if has_bank:
            out.append(jax.ShapeDtypeStruct((batch, n_taps, dp), F32))
        if has_gate:
            out.append(jax.ShapeDtypeStruct((batch, m, m, dp), F32))
        return out

    outs = call("inputs", _dinput_kernel_tpu,
                base + ["q", "a", "b", "u", "v", "acc", "dh"] + (gate_in or []) + tail, specs3, shapes3,
                reverse=True, scratch=[lambda bt, bd: (bt, bd)], n_tiles=t_pad // chosen["phase 2 inputs"].block_t)
    outs = list(outs)
    dx, dq = outs.pop(0), outs.pop(0)
    dbank = outs.pop(0) if has_bank else None
    dw = outs.pop(0) if has_gate else None

    cut = lambda t: t[..., :t_len, :]  # noqa: E731
    if factored:
        d_acc = reference.ValueChannel(dh, cut(a) / m)
    else:
        d_acc = tpu_blocks.unpad_heads(cut(d_acc), heads, d)
    d_state = reference.SoftmaxState(cut(d_max), cut(d_denom), d_acc)
    d_bank = None
    if bank is not None:
        d_bank = (tpu_blocks.unpad_heads(jnp.sum(dbank, axis=0), heads, d) if has_bank
                  else jnp.zeros(bank.shape, F32)).astype(bank.dtype)
    if d_gate is not None:
        dw = tpu_blocks.unpad_heads(jnp.sum(dw, axis=0), heads, d)  # [r, j, c]
        d_gate[0] = jnp.transpose(dw, (0, 2, 1)).reshape(m * d, m)
        d_gate = tuple(d_gate)
    d_partial = tpu_blocks.unpad_heads(dx[:, :t_len], heads, d).astype(partial.dtype)
    return d_state, d_partial, d_bank, tpu_blocks.unpad_heads(jnp.sum(dq, axis=0), heads, d).astype(query.dtype), d_gate
