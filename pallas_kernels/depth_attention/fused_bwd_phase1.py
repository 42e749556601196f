"""Pallas backward of phase 1 (Triton and Mosaic TPU): the gradients of
``xla_streaming.phase1_backward`` for the sources, conv banks and queries, from the state
cotangent ``(g_D, g_A)``. ``phase1_backward(form=...)`` runs the scoring pass again,
``gdots_call`` (``<g_A, E>`` per head), the per-token scalars ``P, DSR, W`` in XLA, then either
the ``"wide"`` form (the default: ``dstreams_call`` writes every source's stream cotangents,
``conv_transpose`` and matrix products give the gradients) or the ``"reverse_t"`` form
(``grads_call``: one program per batch row, chunk and source walks the token tiles in reverse,
carrying the transposed conv's spill, the bank and query gradients). The derivation, the passes
and their bytes: docs/kernels.md §4, "Phase 1 backward"; the Mosaic TPU layouts: "Techniques the
kernels share"."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import conv_transpose, fused, mosaic_gpu, reference, tpu_blocks
from pallas_kernels.depth_attention.fused import (
    F32, call_kwargs, expand_chunk, head_column, if_live, lag_masks, next_target_ref, pad_tokens, stream_layout,
    target_input, token_inputs, TokenWindow,
)
from pallas_kernels.depth_attention.row_shift import SHIFTS, scratch_rows, scratch_slots, shift_rows, shift_rows_via_buffer
from pallas_kernels.depth_attention.tiling import Tiles


def _dot_shift(backend: str) -> bool:
    """Whether the transposed conv shifts rows with a 0/1 matrix product (Triton) instead of a
    concatenate + slice (Mosaic TPU, interpret). A function so tests can force the Triton way
    through the interpret path."""
    return backend == "triton"


# --------------------------------------------------------------------------- pass 2


def _gdots_kernel(*refs, stream_kernels, n, n_targets, bt, has_bank, has_seg, backend, has_live=False, split_ga=0):
    """``out[s, i, r, t] = <g_A[s, r, t, chunk], E_r[x_i][t, chunk]>`` for one chunk (zeros for
    a source the ``live`` mask skips). ``split_ga``: ``g_A`` came as that many per-target refs."""
    it = iter(refs)
    x_ref = next(it)  # [n, Tp, bd]
    bank_ref = next(it) if has_bank else None  # [n, K, bd]
    ga_ref = next_target_ref(it, split_ga)  # [S, m, bt, bd]
    seg_ref = next(it) if has_seg else None  # [Tp, 1]
    live_ref = next(it) if has_live else None  # [n] int32
    out_ref = next(it)  # [S, n, m, bt, 1]
    t0 = pl.program_id(1) * bt
    max_lag = max([1, *stream_kernels])
    masks = lag_masks(seg_ref, t0, bt, max_lag, backend)
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        ga = [ga_ref[s, r, :, :].astype(F32) for s in range(n_targets)]

        def source_body(i, carry, kernel=kernel, off=off, r=r, ga=ga):
            def work():
                win = TokenWindow(x_ref, (i,), t0, bt, slice(None), backend, width=ga[0].shape[1])
                e = expand_chunk(win, bank_ref, (i,), slice(None), kernel, off, masks)
                for s in range(n_targets):
                    out_ref[s, i, r, :, 0] = jnp.sum(ga[s] * e, axis=1)

            def skipped():
                for s in range(n_targets):
                    out_ref[s, i, r, :, 0] = jnp.zeros((bt,), F32)

            if_live(live_ref, i, work, skipped)
            return carry

        jax.lax.fori_loop(0, n, source_body, 0)


def gdots_call(x, banks, g_acc, seg, *, stream_kernels, tiles: Tiles, backend, interpret, valid=None):
    """``x[n, B, Tp, d]``, ``g_acc[S, m, B, Tp, d]`` (or ``S`` arrays ``[m, B, Tp, d]``) -> ``[S,
    n, m, B, Tp, d/bd]`` chunk partials of ``<g_A{s,r}, E_r[x_i]>`` (float32; ``valid[n]``: the
    others may be skipped, zeros)."""
    n, batch, t_pad, d = x.shape
    n_targets, m = (len(g_acc), g_acc[0].shape[0]) if isinstance(g_acc, (list, tuple)) else g_acc.shape[:2]
    bt, bd = tiles.block_t, tiles.block_d_mix
    has_bank = banks is not None and any(stream_kernels)
    has_seg = seg is not None
    nc = d // bd
    in_specs = [pl.BlockSpec((n, None, t_pad, bd), lambda b, t, c: (0, b, 0, c))]
    args = [x]
    if has_bank:
        in_specs.append(pl.BlockSpec((n, banks.shape[1], bd), lambda b, t, c: (0, 0, c)))
        args.append(banks)
    split_ga = target_input(in_specs, args, g_acc, (n_targets, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c))
    has_live = token_inputs(in_specs, args, seg, valid, n, t_pad, backend, batch_axis=0)
    kernel = functools.partial(
        _gdots_kernel, stream_kernels=tuple(stream_kernels), n=n, n_targets=n_targets, bt=bt, has_bank=has_bank,
        has_seg=has_seg, backend=backend, has_live=has_live, split_ga=split_ga,
    )
    # [S, n, m, B, nc, Tp, 1]: the token tile and a whole trailing dim last (Mosaic's block-shape
    # rule); returned as [S, n, m, B, Tp, nc]
    out = pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt, nc),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((n_targets, n, m, None, None, bt, 1), lambda b, t, c: (0, 0, 0, b, c, t, 0)),
        out_shape=jax.ShapeDtypeStruct((n_targets, n, m, batch, nc, t_pad, 1), F32),
        name="depth_attention_bwd1_gdots",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)
    return jnp.swapaxes(out[..., 0], -1, -2)


# --------------------------------------------------------------------------- wide form, pass 4


def _dstreams_kernel(*refs, stream_kernels, n, n_targets, heads, d, bt, bd, has_bank, has_seg, has_live, backend,
                     split_ga=0):
    """``dE[i, r] = sum_s (P g_A{s,r} + DSR q_{s,r}) - W E_r[x_i]`` on one tile and chunk, for
    every source: each ``g_A`` tile is loaded once for all sources."""
    it = iter(refs)
    x_ref = next(it)  # [n, Tp, bd]
    bank_ref = next(it) if has_bank else None  # [n, K, bd]
    q_ref = next(it)  # [S, m, bd]
    ga_ref = next_target_ref(it, split_ga)  # [S, m, bt, bd]
    p_ref = next(it)  # [S, n, m, bt, H]
    dsr_ref = next(it)  # [S, n, m, bt, H]
    w_ref = next(it)  # [n, m, bt, 1]
    seg_ref = next(it) if has_seg else None  # [Tp, 1]
    live_ref = next(it) if has_live else None  # [n] int32
    out_ref = next(it)  # [n, m, bt, bd]
    t0 = pl.program_id(1) * bt
    head = (pl.program_id(2) * bd) // (d // heads)
    col = functools.partial(head_column, head=head, heads=heads, backend=backend)
    masks = lag_masks(seg_ref, t0, bt, max([1, *stream_kernels]), backend)
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        ga = [ga_ref[s, r, :, :].astype(F32) for s in range(n_targets)]
        q = [q_ref[s, r, :].astype(F32)[None, :] for s in range(n_targets)]

        def source_body(i, carry, kernel=kernel, off=off, r=r, ga=ga, q=q):
            def work():
                win = TokenWindow(x_ref, (i,), t0, bt, slice(None), backend, width=bd)
                e = expand_chunk(win, bank_ref, (i,), slice(None), kernel, off, masks)
                de = -w_ref[i, r, :, 0][:, None] * e
                for s in range(n_targets):
                    de = de + col(p_ref, (s, i, r, slice(None)))[:, None] * ga[s]
                    de = de + col(dsr_ref, (s, i, r, slice(None)))[:, None] * q[s]
                out_ref[i, r, :, :] = de.astype(out_ref.dtype)

            def skipped():
                out_ref[i, r, :, :] = jnp.zeros((bt, bd), out_ref.dtype)

            if_live(live_ref, i, work, skipped)
            return carry

        jax.lax.fori_loop(0, n, source_body, 0)


def dstreams_call(x, banks, queries, g_acc, p, dsr, w, seg, *, stream_kernels, heads, tiles: Tiles, backend,
                  interpret, out_dtype, valid=None):
    """``x[n, B, Tp, d]``, ``g_acc[S, m, B, Tp, d]`` (or ``S`` arrays ``[m, B, Tp, d]``),
    ``p``/``dsr`` ``[S, n, m, B, Tp, H]``, ``w[n, m, B, Tp, 1]`` -> the stream cotangents ``dE[n,
    m, B, Tp, d]`` (``out_dtype``; zeros for the sources ``valid`` excludes)."""
    n, batch, t_pad, d = x.shape
    n_targets, m = queries.shape[:2]
    bt, bd = tiles.block_t, tiles.block_d_mix
    if (d // heads) % bd:
        raise ValueError(f"block_d={bd} must divide the head width {d // heads}")
    has_bank = banks is not None and any(stream_kernels)
    has_seg = seg is not None
    in_specs = [pl.BlockSpec((n, None, t_pad, bd), lambda b, t, c: (0, b, 0, c))]
    args = [x]
    if has_bank:
        in_specs.append(pl.BlockSpec((n, banks.shape[1], bd), lambda b, t, c: (0, 0, c)))
        args.append(banks)
    in_specs.append(pl.BlockSpec((n_targets, m, bd), lambda b, t, c: (0, 0, c)))
    args.append(queries)
    split_ga = target_input(in_specs, args, g_acc, (n_targets, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c))
    in_specs += [
        pl.BlockSpec((n_targets, n, m, None, bt, heads), lambda b, t, c: (0, 0, 0, b, t, 0)),
        pl.BlockSpec((n_targets, n, m, None, bt, heads), lambda b, t, c: (0, 0, 0, b, t, 0)),
        pl.BlockSpec((n, m, None, bt, 1), lambda b, t, c: (0, 0, b, t, 0)),
    ]
    args += [p, dsr, w]
    has_live = token_inputs(in_specs, args, seg, valid, n, t_pad, backend, batch_axis=0)
    kernel = functools.partial(
        _dstreams_kernel, stream_kernels=tuple(stream_kernels), n=n, n_targets=n_targets, heads=heads, d=d, bt=bt,
        bd=bd, has_bank=has_bank, has_seg=has_seg, has_live=has_live, backend=backend, split_ga=split_ga,
    )
    return pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt, d // bd),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((n, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c)),
        out_shape=jax.ShapeDtypeStruct((n, m, batch, t_pad, d), out_dtype),
        name="depth_attention_bwd1_dstreams",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)


def _bf16_parts(a: jax.Array, n_parts: int = 3, axis: int = 0) -> jax.Array:
    """``a`` (float32) as ``n_parts`` bfloat16 terms whose float32 sum is ``a``: each term is
    the next 8 significant bits of what the earlier ones left, cut by masking the low 16 bits
    of the float32 pattern (so three terms hold all 24 bits of float32's significand and the
    split is exact). A round trip through bfloat16 (``astype``) would not do: XLA may drop a
    float32 -> bfloat16 -> float32 pair as excess precision (on the H200 it did, leaving one
    term of 8 bits). Stacked on a new axis ``axis``."""
    parts, rest = [], a.astype(F32)
    for _ in range(n_parts):
        high = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000), F32)
        parts.append(high.astype(jnp.bfloat16))  # exact: the low 16 bits are zero
        rest = rest - high  # exact: the bits below the cut
    return jnp.stack(parts, axis=axis)


# How ``_query_grads`` runs its products with several heads: ``"batched"``, one product per
# (source, head), heads a batch axis of the matrix product, for which XLA transposes the sources
# to heads-major first (a full copy: 0.56 GiB per block at the bench shape for MHAR's 8 heads,
# the ``wrapped_transpose`` that took 0.31 ms per block on the H200, as the H200 compile read
# back on a CPU machine names it); ``"all_heads"``, one product per source over
# every head's channels, read in the sources' own layout, keeping the ``(h, h)`` blocks: ``heads``
# times the multiply-adds (on the tensor cores), no copy. The same products of the same terms.
QUERY_GRADS_HEADS = ("batched", "all_heads")
DEFAULT_QUERY_GRADS_HEADS = "batched"


def _query_grads(x, banks, dsr, seg, valid, *, stream_kernels, heads, heads_form=None):
    """``dq_{s,r} = sum_{i,b,t} DSR_{s,r,i}[b,t] E_r[x_i][b,t]`` (per head) as matrix products
    over the tokens, without ``E``: with ``E[t] = sum_delta c[delta] mask_delta[t] x[t - delta]``,
    ``sum_t DSR[t] E[t] = sum_delta c[delta] sum_u DSR[u + delta] mask_delta[u + delta] x[u]``.
    ``x[n, B, Tp, d]``, ``dsr[S, n, m, B, Tp, H]`` -> ``[S, m, d]`` float32 (exact float32 products).

    Every stream's lag-shifted ``DSR`` rows go into one ``[n, K, S, B Tp, H]`` operand (``K =
    sum(max(kernel, 1))``, 25 for kernels (0, 4, 8, 12)), so ``x`` is read once per block, not
    once per stream. A bfloat16 ``x`` (the model's sources) stays in its dtype: it is exact in
    bfloat16, so the operand is split into three bfloat16 terms (``_bf16_parts``) and the product
    runs on bfloat16 inputs with float32 accumulation, as exact as a float32 product without
    materialising ``x`` in float32 (on the H200 the float32 ``x``, 4 bytes per element read once
    per stream, bounded these products). ``heads_form``:
    ``QUERY_GRADS_HEADS`` (None: ``DEFAULT_QUERY_GRADS_HEADS``; one head runs the batched form)."""
    heads_form = heads_form or DEFAULT_QUERY_GRADS_HEADS
    if heads_form not in QUERY_GRADS_HEADS:
        raise ValueError(f"heads_form={heads_form!r}: must be one of {QUERY_GRADS_HEADS}")
    all_heads = heads_form == "all_heads" and heads > 1
    n, batch, t_pad, d = x.shape
    n_targets = dsr.shape[0]
    dh = d // heads
    masks = reference.segment_lag_masks(seg, t_pad, max([1, *stream_kernels]), batch)  # [delta, B, Tp]
    ok = reference._source_valid(n, valid)
    x = jnp.where(ok[:, None, None, None], x, jnp.zeros((), x.dtype)).reshape(n, batch * t_pad, heads, dh)
    # the sources' axis leads the operand, as the product's batch axis: the matrix-product call
    # then takes it as built, with no transpose of its 25 x 3 lagged copies
    dsr = jnp.moveaxis(dsr, 1, 0)  # [n, S, m, B, Tp, H]
    lagged = []
    for r, kernel in enumerate(stream_kernels):
        a = dsr[:, :, r]  # [n, S, B, Tp, H]
        lagged.append(a)
        lagged += [reference._unshift(a * masks[delta][:, :, None], delta) for delta in range(1, kernel)]
    lagged = jnp.stack(lagged, axis=1).reshape(n, len(lagged), n_targets, batch * t_pad, heads)  # [n, K, S, U, H]
    if all_heads:  # every head's rows against all d channels, then each head's own block
        x_all = x.reshape(n, batch * t_pad, d)
        # the operand's rows (parts, lags, targets, heads) ahead of the tokens: a plain product
        # [n, rows, U] @ [n, U, d] (its ``heads`` times smaller than the sources to move)
        a = _bf16_parts(lagged, axis=1) if x.dtype == jnp.bfloat16 else lagged[:, None]  # [n, P, K, S, U, H]
        n_parts = a.shape[1]
        a = jnp.moveaxis(a, -1, -2).reshape(n, -1, batch * t_pad)
        if x.dtype == jnp.bfloat16:
            y = jnp.einsum("nru,nuc->nrc", a, x_all, preferred_element_type=F32)
        else:
            y = jnp.einsum("nru,nuc->nrc", a, x_all.astype(F32), precision=jax.lax.Precision.HIGHEST)
        y = jnp.sum(y.reshape(n, n_parts, -1, n_targets, heads, d), axis=1)  # [n, K, S, H, d]
        y = jnp.diagonal(y.reshape(*y.shape[:-1], heads, dh), axis1=-3, axis2=-2)  # [n, K, S, dh, H]
        y = jnp.moveaxis(y, (0, -1), (2, -2))  # [K, S, n, H, dh]
    elif x.dtype == jnp.bfloat16:
        y = jnp.einsum("npksuh,nuhe->pksnhe", _bf16_parts(lagged, axis=1), x, preferred_element_type=F32)
        y = jnp.sum(y, axis=0)  # [K, S, n, H, dh]
    else:
        y = jnp.einsum("nksuh,nuhe->ksnhe", lagged, x.astype(F32), precision=jax.lax.Precision.HIGHEST)
    out, off, row = [], 0, 0
    for r, kernel in enumerate(stream_kernels):
        if kernel == 0:
            out.append(jnp.sum(y[row], axis=1).reshape(n_targets, d))
            row += 1
        else:
            c = jnp.where(ok[:, None, None], banks[:, off:off + kernel].astype(F32), 0.0)  # invalid: never read
            c = c.reshape(n, kernel, heads, dh)  # [n, K_r, H, dh]
            out.append(jnp.einsum("ksnhe,nkhe->she", y[row:row + kernel], c,
                                  precision=jax.lax.Precision.HIGHEST).reshape(n_targets, d))
            off += kernel
            row += kernel
    return jnp.stack(out, axis=1)  # [S, m, d]


# --------------------------------------------------------------------------- reverse-T form, pass 4


def _grads_kernel(*refs, stream_kernels, n_targets, bt, bd, n_tiles, has_bank, has_seg, backend, shift, dq_dot,
                  has_live=False):
    """One (batch row, channel chunk, source): ``d x`` tiles in reverse order, the bank and query
    gradient partials at the end (see the module docstring); zeros for a source the ``live``
    mask skips."""
    it = iter(refs)
    x_ref = next(it)  # [Tp, bd]
    bank_ref = next(it) if has_bank else None  # [K, bd]
    q_ref = next(it)  # [S, m, bd]
    ga_ref = next(it)  # [S, m, Tp, bd]
    p_ref = next(it)  # [S, m, Tp, 1] (this chunk's head)
    dsr_ref = next(it)  # [S (S_pad with dq_dot), m, Tp, 1]
    w_ref = next(it)  # [m, Tp, 1]
    seg_ref = next(it) if has_seg else None  # [Tp, 1]
    live_ref = next(it) if has_live else None  # [n] int32
    dx_ref = next(it)  # [Tp, bd]
    dbank_ref = next(it) if has_bank else None  # [K, bd]
    dq_ref = next(it)  # [S (S_pad with dq_dot), m, bd]
    buf_ref = next(it) if shift == "buffer" else None  # [slots, 4 bt, bd]: row_shift.shift_rows_via_buffer
    m = len(stream_kernels)
    layout = stream_layout(stream_kernels)
    n_taps = sum(stream_kernels)
    max_lag = max([1, *stream_kernels])
    zero_row = jnp.zeros((bd,), F32)
    zero_tile = jnp.zeros((bt, bd), F32)
    q = [[q_ref[s, r, :].astype(F32)[None, :] for r in range(m)] for s in range(n_targets)]
    bank = [bank_ref[k, :].astype(F32)[None, :] for k in range(n_taps)] if has_bank else []

    def tile_body(j, carry):
        spill_in, dbank, dq = carry
        dbank, dq = list(dbank), (list(dq) if dq_dot else [list(row) for row in dq])
        t0 = pl.multiple_of((n_tiles - 1 - j) * bt, bt)
        rows = pl.ds(t0, bt)
        masks = lag_masks(seg_ref, t0, bt, max_lag, backend)
        win = TokenWindow(x_ref, (), t0, bt, slice(None), backend, width=bd)
        hs = [zero_tile] * max_lag  # H_delta of this tile
        for r, (kernel, off) in enumerate(layout):
            e = expand_chunk(win, bank_ref, (), slice(None), kernel, off, masks)
            de = -w_ref[r, rows, 0][:, None] * e
            for s in range(n_targets):
                dsr = dsr_ref[s, r, rows, 0][:, None]
                de = de + p_ref[s, r, rows, 0][:, None] * ga_ref[s, r, rows, :].astype(F32) + dsr * q[s][r]
                if not dq_dot:
                    dq[s][r] = dq[s][r] + jnp.sum(dsr * e, axis=0)
            if dq_dot:
                # dq_{s,r} = sum_t DSR_s[t] E[t]: one [S_pad, bt] @ [bt, bd] product per stream and
                # tile instead of S cross-row reductions (which cost most of phase 2's reverse-T
                # kernel on the H200); S_pad >= 16, Triton's
                # smallest dot, the extra rows of DSR are zeros
                dq[r] = dq[r] + jnp.dot(dsr_ref[:, r, rows, 0], e, precision=jax.lax.Precision.HIGHEST,
                                        preferred_element_type=F32)
            if kernel == 0:
                hs[0] = hs[0] + de
                continue
            for delta in range(kernel):
                g = de if delta == 0 else de * masks[delta]
                # a whole tile, summed over rows after the loop (a cross-row reduction per tap and
                # tile was most of phase 2's reverse-T kernel on the H200)
                dbank[off + delta] = dbank[off + delta] + g * win.shift(delta)
                hs[delta] = hs[delta] + bank[off + delta] * g
        dx = hs[0] + spill_in
        spill_out = zero_tile
        lagged = dict(enumerate(hs))
        del lagged[0]
        if shift == "buffer":
            shifted = shift_rows_via_buffer(buf_ref, lagged, bt, backend)
        else:
            shifted = {delta: shift_rows(tap, delta, bt, shift) for delta, tap in lagged.items()}
        for within, back in shifted.values():
            dx = dx + within
            spill_out = spill_out + back
        dx_ref[rows, :] = dx.astype(dx_ref.dtype)
        return spill_out, dbank, dq

    def work():
        if shift == "buffer":
            for g in range(buf_ref.shape[0]):  # the rows around each lag's tile stay zero
                buf_ref[g, :, :] = jnp.zeros(buf_ref.shape[1:], F32)

        if dq_dot:
            dq0 = [jnp.zeros((dq_ref.shape[0], bd), F32)] * m
        else:
            dq0 = [[zero_row] * m for _ in range(n_targets)]
        _, dbank, dq = jax.lax.fori_loop(0, n_tiles, tile_body, (zero_tile, [zero_tile] * n_taps, dq0))
        for k in range(n_taps if has_bank else 0):
            dbank_ref[k, :] = jnp.sum(dbank[k], axis=0)
        for r in range(m):
            if dq_dot:
                dq_ref[:, r, :] = dq[r]
                continue
            for s in range(n_targets):
                dq_ref[s, r, :] = dq[s][r]

    def skipped():
        def zero_rows(j, carry):
            dx_ref[pl.ds(pl.multiple_of(j * bt, bt), bt), :] = zero_tile.astype(dx_ref.dtype)
            return carry

        jax.lax.fori_loop(0, n_tiles, zero_rows, 0)
        for k in range(n_taps if has_bank else 0):
            dbank_ref[k, :] = zero_row
        for s in range(dq_ref.shape[0]):
            for r in range(m):
                dq_ref[s, r, :] = zero_row

    if_live(live_ref, pl.program_id(2), work, skipped)


def grads_call(x, banks, queries, g_acc, p, dsr, w, seg, *, stream_kernels, heads, tiles: Tiles, backend, interpret,
               out_dtype, shift=None, valid=None):
    """``x[n, B, Tp, d]``, ``g_acc[S, m, B, Tp, d]``, ``p``/``dsr`` ``[S, n, m, B, H, Tp, 1]``,
    ``w[n, m, B, Tp, 1]`` (per-token scalars: tokens on sublanes and a whole trailing dim, as
    Mosaic's block-shape rule wants them) -> ``d x[n, B, Tp, d]``, ``d banks`` partials
    ``[n, B, K, d]`` (or None),
    ``d queries`` partials ``[n, B, S, m, d]``. ``shift``: the transposed conv's row shift
    (``row_shift.SHIFTS``); None: ``"dot"`` on Triton, ``"concat"`` elsewhere. ``valid[n]``: the
    other sources' programs may skip their work (zero gradients)."""
    n, batch, t_pad, d = x.shape
    n_targets, m = queries.shape[:2]
    bt, bd = tiles.block_t, tiles.block_d_grads
    dh = d // heads
    if dh % bd:
        raise ValueError(f"block_d={bd} must divide the head width {dh}")
    max_kernel = max([1, *stream_kernels])
    if bt < max_kernel - 1:
        raise ValueError(f"block_t={bt} < max_kernel - 1 = {max_kernel - 1}: the transposed conv spills one tile back")
    use_dot = _dot_shift(backend)
    shift = shift or ("dot" if use_dot else "concat")
    if shift not in SHIFTS:
        raise ValueError(f"shift={shift!r}: must be one of {SHIFTS}")
    if backend == "triton" and shift == "dot" and (bt < 16 or bd < 16) and max_kernel > 1:
        raise ValueError(f"the Triton row shift is a dot: block_t={bt} and block_d={bd} must be >= 16")
    has_bank = banks is not None and any(stream_kernels)
    has_seg = seg is not None
    nc = d // bd
    head = lambda c: (c * bd) // dh  # noqa: E731
    in_specs = [pl.BlockSpec((None, None, t_pad, bd), lambda b, c, i: (i, b, 0, c))]
    args = [x]
    if has_bank:
        in_specs.append(pl.BlockSpec((None, banks.shape[1], bd), lambda b, c, i: (i, 0, c)))
        args.append(banks)
    in_specs += [
        pl.BlockSpec((n_targets, m, bd), lambda b, c, i: (0, 0, c)),
        pl.BlockSpec((n_targets, m, None, t_pad, bd), lambda b, c, i: (0, 0, b, 0, c)),
        pl.BlockSpec((n_targets, None, m, None, None, t_pad, 1), lambda b, c, i: (0, i, 0, b, head(c), 0, 0)),
        pl.BlockSpec((n_targets, None, m, None, None, t_pad, 1), lambda b, c, i: (0, i, 0, b, head(c), 0, 0)),
        pl.BlockSpec((None, m, None, t_pad, 1), lambda b, c, i: (i, 0, b, 0, 0)),
    ]
    # On Triton the query gradient's token sums are products (``_grads_kernel``): DSR gets zero
    # rows up to the dot's smallest size, 16, and the partials as many (sliced off below).
    dq_dot = use_dot and bt >= 16 and bd >= 16
    s_pad = max(n_targets, 16) if dq_dot else n_targets
    if s_pad > n_targets:
        dsr = jnp.pad(dsr, ((0, s_pad - n_targets),) + ((0, 0),) * (dsr.ndim - 1))
        in_specs[-2] = pl.BlockSpec((s_pad, None, m, None, None, t_pad, 1), lambda b, c, i: (0, i, 0, b, head(c), 0, 0))
    args += [queries, g_acc, p, dsr, w]
    has_live = token_inputs(in_specs, args, seg, valid, n, t_pad, backend, batch_axis=0)
    out_specs = [pl.BlockSpec((None, None, t_pad, bd), lambda b, c, i: (i, b, 0, c))]
    out_shape = [jax.ShapeDtypeStruct((n, batch, t_pad, d), out_dtype)]
    if has_bank:
        out_specs.append(pl.BlockSpec((None, None, banks.shape[1], bd), lambda b, c, i: (i, b, 0, c)))
        out_shape.append(jax.ShapeDtypeStruct((n, batch, banks.shape[1], d), F32))
    out_specs.append(pl.BlockSpec((None, None, s_pad, m, bd), lambda b, c, i: (i, b, 0, 0, c)))
    out_shape.append(jax.ShapeDtypeStruct((n, batch, s_pad, m, d), F32))
    if shift == "buffer":  # each program's scratch (row_shift.shift_rows_via_buffer); discarded
        if backend == "tpu":
            raise NotImplementedError("shift='buffer' is for Triton; Mosaic shifts by concatenate")
        slots, rows = scratch_slots(max_kernel, tiles.shift_slots), scratch_rows(bt)
        out_specs.append(pl.BlockSpec((None, None, None, slots, rows, bd), lambda b, c, i: (i, b, c, 0, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((n, batch, nc, slots, rows, bd), F32))
    kernel = functools.partial(
        _grads_kernel, stream_kernels=tuple(stream_kernels), n_targets=n_targets, bt=bt, bd=bd,
        n_tiles=t_pad // bt, has_bank=has_bank, has_seg=has_seg, backend=backend, shift=shift,
        dq_dot=dq_dot, has_live=has_live,
    )
    out = pl.pallas_call(
        kernel,
        grid=(batch, nc, n),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="depth_attention_bwd1_grads",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")),
    )(*args)
    dq = out[2 if has_bank else 1][:, :, :n_targets]
    return out[0], (out[1] if has_bank else None), dq


# --------------------------------------------------------------------------- entry point


FORMS = ("reverse_t", "wide")
DEFAULT_FORM = "wide"


def phase1_backward(sources, banks, queries, valid, segment_ids, smax, g, *, stream_kernels: Sequence[int], heads,
                    eps, tiles: Tiles, backend, interpret, shift=None, form=DEFAULT_FORM, mosaic_scores=False,
                    mosaic_gdots=False, mosaic_dstreams=False, mosaic_transpose=False, value_scale=None):
    """Gradients ``(d sources, d banks or None, d queries)`` of phase 1: the values of
    ``xla_streaming.phase1_backward(...)[:3]`` (``banks``: ``[n, K, d]`` or None without conv;
    ``valid``: ``[n]`` or None; ``smax``: the forward's running max; ``g``: the state cotangent,
    its ``max`` ignored, its ``acc`` one ``[S, m, B, T, d]`` array or ``S`` arrays ``[m, B, T,
    d]``; ``shift``: the transposed conv's row shift, see ``grads_call``).

    ``form``: ``"reverse_t"`` (pass 4 is ``grads_call``, one program per source walking the
    tokens in reverse) or ``"wide"`` (pass 4 is ``dstreams_call``, every source's stream
    cotangents from one load of each ``g_A`` tile, written in the sources' dtype; then
    ``conv_transpose.sources_transpose`` for the source and bank gradients and token-axis
    matrix products for the query gradient, ``_query_grads``). ``mosaic_scores``: pass 1 as the
    Mosaic GPU kernel (``fused.phase1_scores``); ``mosaic_gdots`` / ``mosaic_dstreams``: pass 2 /
    the wide form's pass 4 as the Mosaic GPU kernels of ``mosaic_gpu.phase1_backward``; ``mosaic_transpose``:
    the wide form's transpose as ``mosaic_gpu.sources_transpose``.

    ``value_scale[S, m, B, T, H]``: ``g.acc`` is factored (``reference.ValueChannel``): the true
    ``g_A{s,r}`` is ``value_scale[s, r]`` (per head) times the given ``g.acc[s, r]``. Both terms that
    read ``g_A`` are linear in it with a per-(token, head) factor, so the kernels run on the given
    arrays and the scale goes into the scalars: ``<g_A, E> = scale <g.acc, E>`` (pass 2's dots, scaled
    after) and ``P g_A = (P scale) g.acc`` (pass 4's value term, ``P`` scaled before)."""
    if form not in FORMS:
        raise ValueError(f"form={form!r}: must be one of {FORMS}")
    if backend == "tpu" and form == "wide":
        return _phase1_backward_tpu(sources, banks, queries, valid, segment_ids, smax, g,
                                    stream_kernels=tuple(stream_kernels), heads=heads, eps=eps, tiles=tiles,
                                    interpret=interpret, value_scale=value_scale)
    n, batch, t_len, d = sources.shape
    n_targets, m = queries.shape[:2]
    stream_kernels = tuple(stream_kernels)
    t_pad, seg = fused.prepare_tokens(t_len, segment_ids, tiles)
    x = pad_tokens(sources, 2, t_pad)
    conv_banks = banks if (banks is not None and any(stream_kernels)) else None
    kw = dict(stream_kernels=stream_kernels, tiles=tiles, backend=backend, interpret=interpret)

    # pass 1: per-head dots and sums of squares -> rho, s, p
    dots, sumsq = fused.phase1_scores(sources, x, conv_banks, queries, seg, segment_ids, heads=heads, valid=valid,
                                      mosaic=mosaic_scores, **kw)
    rho = jax.lax.rsqrt(sumsq / d + eps)  # [n, m, B, Tp]
    s = dots * rho[None, ..., None]  # [S, n, m, B, Tp, H]
    ok = reference._source_valid(n, valid)[None, :, None, None, None, None]
    real = (jnp.arange(t_pad) < t_len)[:, None]  # padded tokens: p = 0 (their s is arbitrary)
    smax_p = pad_tokens(jnp.asarray(smax, F32), 3, t_pad)
    p = jnp.where(ok & real, jnp.exp(jnp.where(ok & real, s - smax_p[:, None], 0.0)), 0.0)

    # pass 2: the value-path dots <g_A, E> (chunk partials summed into heads)
    g_denom = pad_tokens(jnp.asarray(g.denom, F32), 3, t_pad)
    # g_A in the state's dtype (a bf16 state has a bf16 cotangent): the kernels load it as float32.
    if isinstance(g.acc, (list, tuple)):  # per target (``per_target``): the kernels take them apart
        g_acc = [pad_tokens(a, 2, t_pad) for a in g.acc]
    else:
        g_acc = pad_tokens(g.acc, 3, t_pad)
    if mosaic_gdots:
        gd = mosaic_gpu.phase1_gdots(sources, conv_banks, g_acc, segment_ids, valid, stream_kernels=stream_kernels,
                                     heads=heads, interpret=interpret)  # [S, n, m, B, T, H]
        gd = pad_tokens(gd, 4, t_pad)
    else:
        gd = gdots_call(x, conv_banks, g_acc, seg, valid=valid, **kw)  # [S, n, m, B, Tp, nc]
        gd = jnp.sum(gd.reshape(*gd.shape[:-1], heads, -1), axis=-1)  # [S, n, m, B, Tp, H]

    p_value = p  # the value term's coefficient of g.acc in dE
    if value_scale is not None:
        scale = pad_tokens(jnp.asarray(value_scale, F32), 3, t_pad)[:, None]  # [S, 1, m, B, Tp, H]
        gd, p_value = gd * scale, p * scale

    # pass 3 (XLA): the per-token coefficients of dE
    ds = p * (g_denom[:, None] + gd)
    dsr = ds * rho[None, ..., None]
    w = rho * rho * jnp.sum(ds * s, axis=(0, 5)) / d  # [n, m, B, Tp]
    if form == "wide":
        streams_dtype = jnp.promote_types(sources.dtype, jnp.bfloat16)
        if mosaic_dstreams:  # the valid sources' dE only: sources_transpose skips or masks the others
            d_streams = mosaic_gpu.phase1_dstreams(
                sources, conv_banks, queries, g_acc, p_value, dsr, w, segment_ids, valid, stream_kernels=stream_kernels,
                heads=heads, out_dtype=streams_dtype, interpret=interpret)
            d_streams = d_streams if mosaic_transpose else pad_tokens(d_streams, 3, t_pad)
        else:
            d_streams = dstreams_call(x, conv_banks, queries, g_acc, p_value, dsr, w[..., None], seg, heads=heads,
                                      out_dtype=streams_dtype, valid=valid, **kw)
        if mosaic_transpose:
            dx, dbank = mosaic_gpu.sources_transpose(
                d_streams[:, :, :, :t_len], sources, conv_banks, segment_ids, valid, stream_kernels=stream_kernels,
                out_dtype=sources.dtype, interpret=interpret)
        else:
            dx, dbank = conv_transpose.sources_transpose(
                d_streams, x, conv_banks, seg, valid, stream_kernels=stream_kernels, tiles=tiles, backend=backend,
                interpret=interpret, out_dtype=sources.dtype)
        d_queries = _query_grads(x, conv_banks, dsr, seg, valid, stream_kernels=stream_kernels, heads=heads)
        d_banks = None if banks is None else (jnp.zeros_like(banks) if conv_banks is None
                                              else dbank.astype(banks.dtype))
        return dx[:, :, :t_len], d_banks, d_queries.astype(queries.dtype)
    to_heads_major = lambda a: jnp.moveaxis(a, -1, -2)[..., None]  # noqa: E731  [S, n, m, B, H, Tp, 1]

    # pass 4: dE, transposed conv, bank and query gradients
    if isinstance(g_acc, list):
        g_acc = jnp.stack(g_acc)  # this form reads g_A whole-T per program; it keeps one array
    dx, dbank, dq = grads_call(
        x, conv_banks, queries, g_acc, to_heads_major(p_value), to_heads_major(dsr), w[..., None], seg, heads=heads,
        out_dtype=sources.dtype, shift=shift, valid=valid, **kw,
    )
    d_sources = dx[:, :, :t_len]
    d_queries = jnp.sum(dq, axis=(0, 1)).astype(queries.dtype)
    if banks is None:
        d_banks = None
    elif dbank is None:
        d_banks = jnp.zeros_like(banks)
    else:
        d_banks = jnp.sum(dbank, axis=1).astype(banks.dtype)
    return d_sources, d_banks, d_queries


# --------------------------------------------------------------------------- Mosaic TPU, token-tiled
#
# The wide form's passes 2 and 4 as token-tiled kernels (``tpu_blocks``): each program maps one
# ``[block_t, block_d]`` tile of every source, ``g_A`` and the per-token scalars into VMEM, and
# the conv's halo from a ``halo``-row block of the previous tile of the same sources
# (``TokenWindow``'s tiled form). The per-token scalars come with the tokens on sublanes and the
# (target, stream) pairs on lanes, ``[n, B, H, Tp, S m]``, their head picked by the block index:
# one ``[block_t, S m]`` block per source rather than ``S m`` blocks with a single lane each (128x
# the VMEM).


def _source_window(x_ref, behind_ref, i, t, bt):
    return TokenWindow(x_ref, (i,), t * bt, bt, slice(None), "tpu", prev=behind_ref, tiled=True)


def _gdots_kernel_tpu(*refs, stream_kernels, n, n_targets, bt, halo, has_bank, has_mask, has_live, split_ga):
    """``out[i, t, s m + r] = <g_A[s, r, t, chunk], E_r[x_i][t, chunk]>`` on one token tile and chunk."""
    it = iter(refs)
    x_ref = next(it)  # [n, bt, bd]
    behind_ref = next(it) if halo else None  # [n, halo, bd]
    bank_ref = next(it) if has_bank else None  # [n, K, bd]
    ga_ref = next_target_ref(it, split_ga)  # [S, m, bt, bd]
    mask_ref = next(it) if has_mask else None  # [bt, L]
    live_ref = next(it) if has_live else None  # [n] int32
    out_ref = next(it)  # [n, bt, S m]
    m = len(stream_kernels)
    t = pl.program_id(1)
    masks = tpu_blocks.tile_masks(mask_ref, t * bt, bt, max([1, *stream_kernels]))
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        ga = [ga_ref[s, r, :, :].astype(F32) for s in range(n_targets)]

        def source_body(i, carry, kernel=kernel, off=off, r=r, ga=ga):
            def work():
                e = expand_chunk(_source_window(x_ref, behind_ref, i, t, bt), bank_ref, (i,), slice(None), kernel, off,
                                 masks)
                for s in range(n_targets):
                    out_ref[i, :, pl.ds(s * m + r, 1)] = jnp.sum(ga[s] * e, axis=1, keepdims=True)

            def skipped():
                for s in range(n_targets):
                    out_ref[i, :, pl.ds(s * m + r, 1)] = jnp.zeros((bt, 1), F32)

            if_live(live_ref, i, work, skipped)
            return carry

        jax.lax.fori_loop(0, n, source_body, 0)


def _dstreams_kernel_tpu(*refs, stream_kernels, n, n_targets, bt, halo, has_bank, has_mask, has_live, split_ga):
    """``dE[i, r] = sum_s (P g_A{s,r} + DSR q_{s,r}) - W E_r[x_i]`` on one token tile and chunk."""
    it = iter(refs)
    x_ref = next(it)  # [n, bt, bd]
    behind_ref = next(it) if halo else None  # [n, halo, bd]
    bank_ref = next(it) if has_bank else None  # [n, K, bd]
    q_ref = next(it)  # [S, m, bd]
    ga_ref = next_target_ref(it, split_ga)  # [S, m, bt, bd]
    p_ref, dsr_ref = next(it), next(it)  # [n, bt, S m] (this chunk's head)
    w_ref = next(it)  # [n, bt, m]
    mask_ref = next(it) if has_mask else None  # [bt, L]
    live_ref = next(it) if has_live else None  # [n] int32
    out_ref = next(it)  # [n, m, bt, bd]
    m = len(stream_kernels)
    t = pl.program_id(1)
    masks = tpu_blocks.tile_masks(mask_ref, t * bt, bt, max([1, *stream_kernels]))
    for r, (kernel, off) in enumerate(stream_layout(stream_kernels)):
        ga = [ga_ref[s, r, :, :].astype(F32) for s in range(n_targets)]
        q = [q_ref[s, r, :].astype(F32)[None, :] for s in range(n_targets)]

        def source_body(i, carry, kernel=kernel, off=off, r=r, ga=ga, q=q):
            def work():
                e = expand_chunk(_source_window(x_ref, behind_ref, i, t, bt), bank_ref, (i,), slice(None), kernel, off,
                                 masks)
                de = -w_ref[i, :, pl.ds(r, 1)] * e
                for s in range(n_targets):
                    col = pl.ds(s * m + r, 1)
                    de = de + p_ref[i, :, col] * ga[s] + dsr_ref[i, :, col] * q[s]
                out_ref[i, r, :, :] = de.astype(out_ref.dtype)

            def skipped():
                out_ref[i, r, :, :] = jnp.zeros(out_ref.shape[2:], out_ref.dtype)

            if_live(live_ref, i, work, skipped)
            return carry

        jax.lax.fori_loop(0, n, source_body, 0)


def _wide_vmem_bytes(kernel: str, *, n, n_targets, m, n_taps, max_lag, x_itemsize, ga_itemsize, out_itemsize,
                     has_mask):
    """``need(bt, bd)`` (``tpu_blocks.choose``) of ``"gdots"`` or ``"dstreams"``: double-buffered
    blocks and the live float32 temporaries (every target's ``g_A`` tile of a stream, the source
    window, the expansion and the sum being built)."""
    halo = tpu_blocks.halo_rows(max_lag)
    size = tpu_blocks.block_bytes

    def bytes_of(bt, bd):
        blocks = (size((n, bt + halo, bd), x_itemsize) + (size((n, n_taps, bd), 4) if n_taps else 0)
                  + size((n_targets * m, bt, bd), ga_itemsize) + (size((bt, max_lag), 4) if has_mask else 0))
        if kernel == "gdots":
            blocks += size((n, bt, n_targets * m), 4)
        else:
            blocks += (size((n_targets * m, bd), 4) + 2 * size((n, bt, n_targets * m), 4) + size((n, bt, m), 4)
                       + size((n, m, bt, bd), out_itemsize))
        temps = (n_targets * bt + (bt + halo) + 4 * bt) * bd * 4
        return 2 * blocks + temps

    return bytes_of


def tpu_tiles(*, n, n_targets, stream_kernels, heads, d, t_len, acc_itemsize=4, x_itemsize=2, has_mask=True,
              cap_t=None, cap_d=None, vmem=None) -> dict:
    """``{kernel: tpu_blocks.TpuTile}`` of the TPU wide form's passes 1 (the forward's scoring
    kernel), 2 and 4 and of its transpose (``tpu_blocks.choose``: caps ``Tiles.tpu_block_t`` /
    ``tpu_block_d``, ``vmem`` the chip)."""
    m, n_taps, max_lag = len(stream_kernels), sum(stream_kernels), max([1, *stream_kernels])
    dhp = tpu_blocks.padded_head_width(d // heads)
    streams_itemsize = max(x_itemsize, 2)
    sizes = dict(n=n, n_targets=n_targets, m=m, n_taps=n_taps, max_lag=max_lag, x_itemsize=x_itemsize,
                 ga_itemsize=acc_itemsize, has_mask=has_mask)
    choose = lambda need, name: tpu_blocks.choose(need, name=name, dhp=dhp, t_len=t_len,  # noqa: E731
                                                  max_kernel=max_lag, cap_t=cap_t, cap_d=cap_d, vmem=vmem)
    out = {"phase 1 scores": fused.tpu_scores_tile(t_len=t_len, d=d, heads=heads, n_targets=n_targets, n_streams=m,
                                                   max_kernel=max_lag, n_taps=n_taps, x_itemsize=x_itemsize,
                                                   cap_t=cap_t, cap_d=cap_d, vmem=vmem,
                                                   name="phase 1 backward scores"),
           "phase 1 gdots": choose(_wide_vmem_bytes("gdots", **sizes, out_itemsize=4), "phase 1 <g_A, E>"),
           "phase 1 dstreams": choose(_wide_vmem_bytes("dstreams", **sizes, out_itemsize=streams_itemsize),
                                      "phase 1 stream cotangents")}
    if n_taps:
        out["phase 1 transpose"] = choose(
            conv_transpose.transpose_vmem_bytes(m=m, n_taps=n_taps, max_lag=max_lag, de_itemsize=streams_itemsize,
                                                x_itemsize=x_itemsize, out_itemsize=x_itemsize, has_mask=has_mask),
            "phase 1 transpose")
    return out


def _to_lanes(a, n_targets, m):
    """``[S, n, m, B, Tp, H]`` -> ``[n, B, H, Tp, S m]`` (tokens on sublanes, (target, stream) on lanes)."""
    _, n, _, batch, t_pad, heads = a.shape
    return jnp.transpose(a, (1, 3, 5, 4, 0, 2)).reshape(n, batch, heads, t_pad, n_targets * m)


def _phase1_backward_tpu(sources, banks, queries, valid, segment_ids, smax, g, *, stream_kernels, heads, eps, tiles,
                         interpret, value_scale):
    """The ``wide`` form on the TPU: pass 1 (the forward's tiled scoring kernel), the token-tiled passes 2 and 4
    and the transpose (``conv_transpose.sources_transpose_tpu``) on sources whose heads are padded
    to whole 128-lane vregs (``tpu_blocks.pad_heads``; every mean keeps the real ``d``)."""
    n, batch, t_len, d = sources.shape
    n_targets, m = queries.shape[:2]
    conv_banks = banks if (banks is not None and any(stream_kernels)) else None
    n_taps, max_lag = sum(stream_kernels), max([1, *stream_kernels])
    dhp = tpu_blocks.padded_head_width(d // heads)
    split = isinstance(g.acc, (list, tuple))
    acc_dtype = (g.acc[0] if split else g.acc).dtype
    streams_dtype = jnp.promote_types(sources.dtype, jnp.bfloat16)
    has_mask = segment_ids is not None and max_lag > 1
    chosen = tpu_tiles(n=n, n_targets=n_targets, stream_kernels=stream_kernels, heads=heads, d=d, t_len=t_len,
                       acc_itemsize=acc_dtype.itemsize, x_itemsize=sources.dtype.itemsize, has_mask=has_mask,
                       cap_t=tiles.tpu_block_t, cap_d=tiles.tpu_block_d)
    t_gdots, t_streams = chosen["phase 1 gdots"], chosen["phase 1 dstreams"]
    unit = max([tt.block_t for tt in chosen.values()] + [tiles.block_t])  # powers of two: the others divide it
    t_pad = -(-t_len // unit) * unit
    seg = None if segment_ids is None else pad_tokens(jnp.asarray(segment_ids, jnp.int32), 1, t_pad, -1)
    pad = lambda a, axis: pad_tokens(tpu_blocks.pad_heads(a, heads), axis, t_pad)  # noqa: E731
    x = pad(sources, 2)
    kbanks = None if conv_banks is None else tpu_blocks.pad_heads(conv_banks, heads)
    q = tpu_blocks.pad_heads(queries, heads)
    g_acc = [pad(a, 2) for a in g.acc] if split else pad(g.acc, 3)

    # pass 1: per-head dots and sums of squares (the forward's scoring kernel) -> rho, s, p
    dots, sumsq = fused.scores_call(x, kbanks, q, seg, valid=valid, stream_kernels=stream_kernels, heads=heads,
                                    tiles=tiles, backend="tpu", interpret=interpret, tpu=chosen["phase 1 scores"])
    rho = jax.lax.rsqrt(sumsq / d + eps)  # [n, m, B, Tp]: the real d
    s = dots * rho[None, ..., None]
    ok = reference._source_valid(n, valid)[None, :, None, None, None, None]
    real = (jnp.arange(t_pad) < t_len)[:, None]
    smax_p = pad_tokens(jnp.asarray(smax, F32), 3, t_pad)
    p = jnp.where(ok & real, jnp.exp(jnp.where(ok & real, s - smax_p[:, None], 0.0)), 0.0)

    masks = None if not has_mask else tpu_blocks.segment_masks(seg, max_lag)
    live = None if valid is None else jnp.asarray(valid, jnp.int32).reshape(n)  # read from SMEM

    def common_inputs(tt):
        """Sources (tile and halo), banks: specs and arguments, grid (b, t, c)."""
        specs = tpu_blocks.token_specs(pl.BlockSpec((n, None, tt.block_t, tt.block_d), lambda b, t, c: (0, b, t, c)),
                                       2, tt.block_t, tt.halo)
        args = [x] * len(specs)
        if kbanks is not None:
            specs.append(pl.BlockSpec((n, n_taps, tt.block_d), lambda b, t, c: (0, 0, c)))
            args.append(kbanks)
        return specs, args

    def tail_inputs(specs, args, tt):
        if masks is not None:
            specs.append(pl.BlockSpec((None, tt.block_t, max_lag), lambda b, t, c: (b, t, 0)))
            args.append(masks)
        if live is not None:
            from jax.experimental.pallas import tpu as pltpu

            specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
            args.append(live)

    static = dict(stream_kernels=tuple(stream_kernels), n=n, n_targets=n_targets, has_bank=kbanks is not None,
                  has_mask=masks is not None, has_live=live is not None)

    # pass 2: the value-path dots <g_A, E> per chunk, summed into heads
    tt = t_gdots
    bt, bd = tt.block_t, tt.block_d
    specs, args = common_inputs(tt)
    split_ga = target_input(specs, args, g_acc, (n_targets, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c))
    tail_inputs(specs, args, tt)
    nc = heads * dhp // bd
    gd = pl.pallas_call(
        functools.partial(_gdots_kernel_tpu, bt=bt, halo=tt.halo, split_ga=split_ga, **static),
        grid=(batch, t_pad // bt, nc),
        in_specs=specs,
        out_specs=pl.BlockSpec((n, None, None, bt, n_targets * m), lambda b, t, c: (0, b, c, t, 0)),
        out_shape=jax.ShapeDtypeStruct((n, batch, nc, t_pad, n_targets * m), F32),
        name="depth_attention_bwd1_gdots",
        compiler_params=tpu_blocks.compiler_params(("parallel", "parallel", "parallel"), tt),
        interpret=interpret,
    )(*args)
    gd = jnp.sum(gd.reshape(n, batch, heads, nc // heads, t_pad, n_targets, m), axis=3)  # [n, B, H, Tp, S, m]
    gd = jnp.transpose(gd, (4, 0, 5, 1, 3, 2))  # [S, n, m, B, Tp, H]

    p_value = p
    if value_scale is not None:
        scale = pad_tokens(jnp.asarray(value_scale, F32), 3, t_pad)[:, None]
        gd, p_value = gd * scale, p * scale

    # pass 3 (XLA): the per-token coefficients of dE
    ds = p * (pad_tokens(jnp.asarray(g.denom, F32), 3, t_pad)[:, None] + gd)
    dsr = ds * rho[None, ..., None]
    w = rho * rho * jnp.sum(ds * s, axis=(0, 5)) / d  # [n, m, B, Tp]

    # pass 4: every source's stream cotangents, then the transpose and the query products
    tt = t_streams
    bt, bd = tt.block_t, tt.block_d
    specs, args = common_inputs(tt)
    specs.append(pl.BlockSpec((n_targets, m, bd), lambda b, t, c: (0, 0, c)))
    args.append(q)
    split_ga = target_input(specs, args, g_acc, (n_targets, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c))
    head = lambda c: (c * bd) // dhp  # noqa: E731
    scal = pl.BlockSpec((n, None, None, bt, n_targets * m), lambda b, t, c: (0, b, head(c), t, 0))
    specs += [scal, scal, pl.BlockSpec((n, None, bt, m), lambda b, t, c: (0, b, t, 0))]
    args += [_to_lanes(p_value, n_targets, m), _to_lanes(dsr, n_targets, m), jnp.moveaxis(w, 1, -1)]
    tail_inputs(specs, args, tt)
    d_streams = pl.pallas_call(
        functools.partial(_dstreams_kernel_tpu, bt=bt, halo=tt.halo, split_ga=split_ga, **static),
        grid=(batch, t_pad // bt, heads * dhp // bd),
        in_specs=specs,
        out_specs=pl.BlockSpec((n, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c)),
        out_shape=jax.ShapeDtypeStruct((n, m, batch, t_pad, heads * dhp), streams_dtype),
        name="depth_attention_bwd1_dstreams",
        compiler_params=tpu_blocks.compiler_params(("parallel", "parallel", "parallel"), tt),
        interpret=interpret,
    )(*args)
    if n_taps:
        dx, dbank = conv_transpose.sources_transpose_tpu(d_streams, x, kbanks, seg, valid,
                                                         stream_kernels=tuple(stream_kernels), interpret=interpret,
                                                         out_dtype=sources.dtype, tile=chosen["phase 1 transpose"])
    else:
        dx, dbank = conv_transpose.sources_transpose(d_streams, x, None, seg, valid, stream_kernels=stream_kernels,
                                                     tiles=tiles, backend="tpu", interpret=interpret,
                                                     out_dtype=sources.dtype)
    d_queries = _query_grads(x, kbanks, dsr, seg, valid, stream_kernels=stream_kernels, heads=heads)
    d_banks = None if banks is None else (jnp.zeros_like(banks) if conv_banks is None else
                                          tpu_blocks.unpad_heads(dbank, heads, d).astype(banks.dtype))
    d_sources = tpu_blocks.unpad_heads(dx[:, :, :t_len], heads, d)
    return d_sources, d_banks, tpu_blocks.unpad_heads(d_queries, heads, d).astype(queries.dtype)
