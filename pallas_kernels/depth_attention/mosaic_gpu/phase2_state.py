"""Phase 2's backward state kernel in Mosaic GPU (``phase2_backward_state``: the gate's
statistics and backward, then ``d_acc`` and the per-head sums; passes 1 and 2 of
``fused_bwd_phase2``). docs/kernels.md §4, "Phase 2 backward"."""

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
    BLOCK_T, F32, KernelConfig, LagWindow, copy_state, dh_operand, expand_streams, fetch_partial, jitted_kernel,
    lag_masks, lane_plgpu, per_col, per_row, pipeline_chunks, smem_sum, state_as_rows, tile_partial, tile_smem,
    window_elems,
)

def state_smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, acc_dtype,
                     out_dtype=F32, gate: bool = True, dh_dtype=F32) -> int:
    """Shared memory of one program of ``phase2_backward_state`` (its scratch list, ``smem_sum``;
    ``dh_dtype``: the output cotangent's, float32 when not known)."""
    bt, bd, m, mh = BLOCK_T, block_d, len(stream_kernels), len(stream_kernels) * heads
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    n_taps = max(1, sum(stream_kernels))
    return smem_sum(
        2 * window_elems(stream_kernels, bd) * size(x_dtype),
        2 * n_taps * bd * 4, 2 * m * bt * bd * size(acc_dtype), 2 * bt * bd * size(dh_dtype),
        2 * m * m * bd * 4 if gate else 0,
        3 * mh * bt * 4, (1 + m) * bt * 4 if gate else 0, bt * 4, 3 * mh * bt * 4,
        (3 * m + 2) * bt * 4 if gate else 0, barriers=3, reduces=True)


def phase2_backward_state(partial, bank, a, b, dold, acc, dh, gate_params, segment_ids, *, stream_kernels,
                          heads: int, gate_eps: float, block_d: int | None = None, interpret: bool = False):
    """Passes 1 and 2 of ``fused_bwd_phase2`` (the gate's statistics and backward, then
    ``d_acc``) as one Mosaic GPU kernel: per (batch row, 64-token tile), (1) recompute ``z_r =
    a A_r + b E_r`` chunk by chunk and sum ``sum z^2``, ``y_j = z . W[:, j]`` and ``dg_r = <dh,
    z_r>``; in registers the gate ``g`` and its backward (``dlogit = dg g (1 - g)``, ``dy =
    scale rz dlogit``, ``coef = -scale (dlogit . y) rz^3 / (m d)``; Eq. 13-14); (2) recompute
    ``z_r``, ``dz_r = g_r dh + sum_j W[r, :, j] dy_j + coef z_r`` (``dh / m`` for mean fusion),
    write ``d_acc = a dz`` and sum ``S1 = dz . z``, ``Sm = dz . (A - E D)``, ``Ss = dz . (E - z)``
    per head over all its channels (the Triton passes write per-chunk partials for XLA to add).

    ``a, b, dold``: ``[m, B, T, H]`` (the merge's coefficients and the phase-1 denominator);
    ``acc[m, B, T, d]``; ``dh[B, T, d]`` (bf16 or float32: ``dh_operand``); ``gate_params =
    (w, scale, bias)`` or None. Returns ``d_acc`` (``acc``'s dtype), ``(S1, Sm, Ss)`` each ``[m,
    B, T, H]``, and for the gate ``(g, dy, coef, d_scale, d_bias)`` (``[B, T, m]``, ``[B, T, m]``,
    ``[B, T]``, the scale's and bias's gradients) or None. On the H200 at `base` the whole Pallas
    backward ran 5.40 ms per call with it against 6.19 with the two Triton passes
    (docs/kernels.md), so ``gpu_kernels="auto"`` takes it wherever it takes the forward. With the
    gate, pass 2 reads the chunks in reverse (``pipeline_chunks`` says why)."""
    m, bt = len(stream_kernels), BLOCK_T
    gate = gate_params is not None
    sh = tile_partial("phase2_backward_state", partial, segment_ids, stream_kernels=stream_kernels, heads=heads,
                      block_d=block_d, interpret=interpret,
                      smem=functools.partial(state_smem_bytes, dh_dtype=dh.dtype),
                      x_dtype=partial.dtype, acc_dtype=acc.dtype, out_dtype=F32, gate=gate)
    batch, t_len, d, bd, t_pad, x = sh.batch, sh.t_len, sh.d, sh.block_d, sh.t_pad, sh.x
    front, has_bank, has_seg, mh = sh.front, sh.has_bank, sh.has_seg, m * heads

    def pad_t(v, axis, value=0.0):
        return pad_tokens(v, axis, t_pad, value)

    def head_rows(v, value=0.0):  # [m, B, T, H] -> [m H, B, Tp]
        return pad_t(jnp.moveaxis(jnp.asarray(v, F32), -1, 1).reshape(mh, batch, t_len), 2, value)

    dh = dh_operand(dh)
    inputs = [x, jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32), head_rows(a), head_rows(b),
              head_rows(dold, 1.0), state_as_rows(acc, t_pad), pad_t(dh, 1)]
    if gate:
        w, scale, bias = gate_params
        inputs.append(jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1).reshape(m * m, d))  # [(r, j), c]
        consts = jnp.stack([jnp.asarray(scale, F32).reshape(()), *jnp.asarray(bias, F32).reshape(m)])
        inputs.append(jnp.broadcast_to(consts[:, None], (1 + m, bt)))
    if has_seg:
        inputs.append(sh.bits)
    call = _state_kernel(StateConfig(batch=batch, t_pad=t_pad, t_len=t_len, d=d, stream_kernels=tuple(stream_kernels),
                                     heads=heads, block_d=bd, gate=gate, has_seg=has_seg, front=front,
                                     gate_eps=float(gate_eps), x_dtype=jnp.dtype(x.dtype),
                                     acc_dtype=jnp.dtype(acc.dtype), dh_dtype=jnp.dtype(dh.dtype),
                                     interpret=bool(interpret)))
    d_acc, sums, gate_rows_out = call(*inputs)
    per_head = lambda v: jnp.moveaxis(v.reshape(m, heads, batch, t_pad), 1, -1)[:, :, :t_len]  # noqa: E731
    s1, sm, ss = (per_head(sums[i * mh:(i + 1) * mh]) for i in range(3))
    gate_out = None
    if gate:
        rows = gate_rows_out[:, :, :t_len]  # [3 m + 2, B, T]
        g, dy, coef = jnp.moveaxis(rows[:m], 0, -1), jnp.moveaxis(rows[m:2 * m], 0, -1), rows[2 * m]
        d_bias = jnp.sum(rows[2 * m + 1:3 * m + 1], axis=(1, 2))
        d_scale = jnp.sum(rows[3 * m + 1]).reshape(jnp.shape(scale))
        gate_out = (g, dy, coef, d_scale, d_bias)
    return d_acc.reshape(m, batch, t_pad, d)[:, :, :t_len], (s1, sm, ss), gate_out


def gate_backward(plgpu, scal_s, sq, y, dg, valid, *, d: int, gate_eps: float):
    """The H_pre gate and its backward on a tile's per-token scalars (Eq. 13-14), from the sums
    over a token's ``m d`` channels ``sq = sum z^2``, ``y_j = z . W[:, j]`` and ``dg_r = <dh,
    z_r>``: ``rz = rsqrt(sq / (m d) + eps)``, ``g_j = sigmoid(scale rz y_j + bias_j)`` (``scale``
    and ``bias_j``: rows 0 and ``1 + j`` of ``scal_s``), ``dlogit = dg g (1 - g)``, ``dy = scale rz
    dlogit``, ``coef = -scale (dlogit . y) rz^3 / (m d)``; tokens past T (``valid`` 0) get none.
    Returns ``(g, dy, coef)`` for ``dz`` and the gate's rows as ``phase2_backward_state`` returns
    them (``g``, ``dy``, ``coef``, ``dlogit``, ``dlogit . y rz``)."""
    m = len(y)
    row = plgpu.Layout.WGMMA.reduce(1)
    rz = lax.rsqrt(sq * (1.0 / (m * d)) + gate_eps)
    scale = plgpu.load(scal_s, 0, layout=row)
    g, dlogit = [], []
    for j in range(m):
        gj = 1.0 / (1.0 + jnp.exp(-(scale * (rz * y[j]) + plgpu.load(scal_s, 1 + j, layout=row))))
        g.append(gj * valid)
        dlogit.append(dg[j] * gj * (1.0 - gj) * valid)
    dy = [scale * rz * dlogit[j] for j in range(m)]
    dly = dlogit[0] * y[0]
    for j in range(1, m):
        dly = dly + dlogit[j] * y[j]
    coef = -scale * dly * (rz * rz * rz) * (1.0 / (m * d))
    return (g, dy, coef), [*g, *dy, coef, *dlogit, dly * rz]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateConfig(KernelConfig):
    """What ``phase2_backward_state``'s kernel code depends on besides ``KernelConfig``."""

    t_len: int
    gate: bool
    gate_eps: float
    acc_dtype: jnp.dtype
    dh_dtype: jnp.dtype


@functools.lru_cache(maxsize=None)
def _state_kernel(cfg: StateConfig):
    """``phase2_backward_state``'s kernel for ``cfg``, built and jitted once (``KernelConfig``)."""
    plgpu = lane_plgpu()

    batch, t_pad, d, heads, bd, gate, has_seg, front = (cfg.batch, cfg.t_pad, cfg.d, cfg.heads, cfg.block_d,
                                                        cfg.gate, cfg.has_seg, cfg.front)
    stream_kernels = cfg.stream_kernels
    m, bt = len(stream_kernels), BLOCK_T
    layout = stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    lags = LagWindow.of(max_lag)
    has_bank = any(stream_kernels)
    nc, mh = d // bd, m * heads
    n_taps = max(1, sum(stream_kernels))
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    n_gate_rows = 3 * m + 2  # g, dy, coef, dlogit, dlogit . rz y
    scratch = dict(
        xs=plgpu.SMEM((2, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((2, n_taps, bd), F32) if has_bank else None,
        accs=tile_smem(plgpu, (2, m, bt, bd), cfg.acc_dtype),  # the state's chunk; d_acc's, stored in place
        dhs=tile_smem(plgpu, (2, bt, bd), cfg.dh_dtype),
        ws=plgpu.SMEM((2, m * m, bd), F32) if gate else None,
        rows_s=plgpu.SMEM((3 * mh, bt), F32),  # a, b, dold
        scal_s=plgpu.SMEM((1 + m, bt), F32) if gate else None,
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        sums_s=plgpu.SMEM((3 * mh, bt), F32),
        gate_s=plgpu.SMEM((n_gate_rows, bt), F32) if gate else None,
        bar=plgpu.Barrier(num_arrivals=lags.count + has_bank + 1 + 1 + gate, num_barriers=2),
        bar_in=plgpu.Barrier(num_arrivals=3 + gate + has_seg, num_barriers=1),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, a_ref, b_ref, dold_ref, acc_ref, dh_ref = (next(it) for _ in range(7))
        w_ref, consts_ref = (next(it), next(it)) if gate else (None, None)
        bits_ref = next(it) if has_seg else None
        dacc_ref, sums_ref, gate_ref = next(it), next(it), next(it)
        sc = dict(zip(names, it))
        xs, bs, accs, dhs, ws = (sc.get(k) for k in ("xs", "bs", "accs", "dhs", "ws"))
        rows_s, scal_s, bits_s, sums_s, gate_s = (sc.get(k) for k in ("rows_s", "scal_s", "bits_s", "sums_s",
                                                                      "gate_s"))
        bar, bar_in = sc["bar"], sc["bar_in"]
        bi, t0 = lax.axis_index("b"), lax.axis_index("t") * bt
        rows = pl.ds(t0, bt)
        state_rows = pl.ds(bi * t_pad + t0, bt)  # the tile's rows in the state's [m, B * Tp, d] layout
        for i, ref in enumerate((a_ref, b_ref, dold_ref)):
            plgpu.copy_gmem_to_smem(ref.at[:, bi, rows], rows_s.at[pl.ds(i * mh, mh)], bar_in.at[0])
        if gate:
            plgpu.copy_gmem_to_smem(consts_ref, scal_s, bar_in.at[0])
        if has_seg:
            plgpu.copy_gmem_to_smem(bits_ref.at[bi, rows], bits_s, bar_in.at[0])

        def fetch(c, slot):
            fetch_partial(plgpu, x_ref, bank_ref if has_bank else None, xs, bs, bi, t0, front, c, bd, slot, bar,
                          lags, max_lag)
            cs = pl.ds(c * bd, bd)
            copy_state(plgpu, acc_ref, accs, state_rows, cs, slot, bar.at[slot])
            plgpu.copy_gmem_to_smem(dh_ref.at[bi, rows, cs], dhs.at[slot], bar.at[slot])
            if gate:
                plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws.at[slot], bar.at[slot])

        plgpu.barrier_wait(bar_in.at[0])
        masks = lag_masks(plgpu, bits_s, max_lag, bt, bd)
        coef_a, coef_b, dold = ([[plgpu.load(rows_s, i * mh + r * heads + h, layout=row) for h in range(heads)]
                                 for r in range(m)] for i in range(3))

        def expand(slot):
            return expand_streams(plgpu, xs, bs, slot, layout, masks, bt, bd, lags)

        def chunk_values(slot, r, head, e):
            """``A_r`` and ``z_r = a A_r + b E_r`` of the chunk in ``slot``."""
            acc = plgpu.load(accs, (slot, r), layout=tile).astype(F32)
            return acc, per_row(coef_a[r][head], bt, bd) * acc + per_row(coef_b[r][head], bt, bd) * e

        def w_col(slot, r, j):
            return per_col(plgpu.load(ws, (slot, r * m + j), layout=col), bt, bd)

        zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)
        gate_vals = None
        if gate:
            # ---- 1: the gate's statistics, then its backward on per-token scalars (Eq. 13-14)
            def stats_chunk(c, slot, head, carry):
                sq, zw, dg = carry[0], list(carry[1]), list(carry[2])
                dh = plgpu.load(dhs, slot, layout=tile).astype(F32)
                for r, e in enumerate(expand(slot)):
                    _, z = chunk_values(slot, r, head, e)
                    sq = sq + jnp.sum(z * z, axis=1)
                    for j in range(m):
                        zw[j] = zw[j] + jnp.sum(z * w_col(slot, r, j), axis=1)
                    dg[r] = dg[r] + jnp.sum(dh * z, axis=1)
                return sq, zw, dg

            sq, y, dg = pipeline_chunks(plgpu, fetch, bar, nc, heads, stats_chunk, (zero, [zero] * m, [zero] * m))
            valid = (plgpu.broadcasted_iota(jnp.int32, (bt,), 0, layout=row) + t0 < cfg.t_len).astype(F32)
            gate_vals, gate_rows = gate_backward(plgpu, scal_s, sq, y, dg, valid, d=d, gate_eps=cfg.gate_eps)
            for i, v in enumerate(gate_rows):
                gate_s[i] = v

        # ---- 2: d_acc = a dz, and the per-head sums S1, Sm, Ss
        def state_chunk(c, slot, head, carry):
            s1, sm, ss = (list(v) for v in carry)
            dh = plgpu.load(dhs, slot, layout=tile).astype(F32)
            for r, e in enumerate(expand(slot)):
                acc, z = chunk_values(slot, r, head, e)
                if gate_vals is None:
                    dz = dh * (1.0 / m)
                else:
                    g, dy, coef = gate_vals
                    dz = per_row(g[r], bt, bd) * dh + per_row(coef, bt, bd) * z
                    for j in range(m):
                        dz = dz + w_col(slot, r, j) * per_row(dy[j], bt, bd)
                k = r * heads + head
                s1[k] = s1[k] + jnp.sum(dz * z, axis=1)
                sm[k] = sm[k] + jnp.sum(dz * (acc - e * per_row(dold[r][head], bt, bd)), axis=1)
                ss[k] = ss[k] + jnp.sum(dz * (e - z), axis=1)
                # d_acc over the state's chunk in shared memory, read by this thread alone (same layout)
                accs[slot, r] = (per_row(coef_a[r][head], bt, bd) * dz).astype(accs.dtype)
            plgpu.commit_smem()
            cs = pl.ds(c * bd, bd)
            plgpu.copy_smem_to_gmem(accs.at[slot], dacc_ref.at[:, state_rows, cs])
            return s1, sm, ss

        def stores_done():  # d_acc's stores from this slot have read it before the slot is refilled
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        # with the gate, the state's second read (pass 1 read it first), in reverse (``pipeline_chunks``)
        s1, sm, ss = pipeline_chunks(plgpu, fetch, bar, nc, heads, state_chunk, ([zero] * mh,) * 3,
                                     before_refill=stores_done, reverse=gate)
        for i, sums in enumerate((s1, sm, ss)):
            for k in range(mh):
                sums_s[i * mh + k] = sums[k]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(sums_s, sums_ref.at[:, bi, rows])
        if gate:
            plgpu.copy_smem_to_gmem(gate_s, gate_ref.at[:, bi, rows])
        plgpu.wait_smem_to_gmem(0)

    out_type = (
        jax.ShapeDtypeStruct((m, batch * t_pad, d), cfg.acc_dtype),
        jax.ShapeDtypeStruct((3 * mh, batch, t_pad), F32),
        jax.ShapeDtypeStruct((n_gate_rows if gate else 1, batch, t_pad), F32),
    )
    return jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names],
                         name="depth_attention_phase2_bwd_state_mosaic", batch=batch, t_pad=t_pad,
                         interpret=cfg.interpret)
