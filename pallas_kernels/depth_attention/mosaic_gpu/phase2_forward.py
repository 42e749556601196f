"""Phase 2's fused forward as Mosaic GPU kernels (``phase2_fused_forward``: score and merge the
partial with the phase-1 state, the H_pre gate, ``h``; Eq. 11-14, the contract of
``fused.phase2_forward``), one kernel or the split form's two. docs/kernels.md §4, "Phase 2
forward"."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference
from pallas_kernels.depth_attention.fused import pad_tokens, stream_layout
from pallas_kernels.depth_attention.mosaic_gpu.common import (
    BLOCK_T, F32, KernelConfig, LagWindow, copy_state, expand_streams, fetch_partial, jitted_kernel, lag_masks,
    lane_plgpu, per_col, per_row, pipeline_chunks, smem_sum, state_as_rows, tile_partial, tile_smem, window_elems,
)

def smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, acc_dtype, out_dtype,
               gate: bool = True) -> int:
    """Shared memory of one program of ``phase2_fused_forward`` (its scratch list, ``smem_sum``;
    the taps and segment bits counted whether present or not)."""
    bt, bd, m, mh = BLOCK_T, block_d, len(stream_kernels), len(stream_kernels) * heads
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    n_taps = max(1, sum(stream_kernels))
    n_consts = 1 + (1 + m if gate else 0)  # include, then the gate's scale and biases
    return smem_sum(2 * window_elems(stream_kernels, bd) * size(x_dtype),
                    2 * n_taps * bd * 4, 2 * m * bd * 4, 2 * m * bt * bd * size(acc_dtype),
                    2 * m * m * bd * 4 if gate else 0, 2 * mh * bt * 4, bt * 4, n_consts * bt * 4, mh * bt * 4,
                    m * bt * 4, 2 * bt * bd * size(out_dtype), barriers=5, reduces=True)


def phase2_fused_forward(state, partial, bank, query, include_partial, gate_params, segment_ids, *, fuse: str,
                         stream_kernels: Sequence[int], heads: int, eps: float, gate_eps: float, out_dtype=F32,
                         block_d: int | None = None, split: bool = False, interpret: bool = False):
    """``h[B, T, d]`` and the scores ``(dots[m, B, T, H], sumsq[m, B, T])``.

    ``state``: ``reference.SoftmaxState`` (``[m, B, T, H]`` max and denom, ``[m, B, T, d]`` acc,
    float32 or bf16); ``partial[B, T, d]``; ``bank[K, d]`` or None; ``query[m, d]``;
    ``include_partial`` a (traced) bool; ``gate_params = (w[m d, m], scale, bias[m])`` for
    ``fuse="gate"``. ``block_d``: the channel chunk (None: ``choose_block_d``; it raises
    ``NotImplementedError`` when no chunk fits). ``split``: two kernels (``FORWARD_PASSES``), the
    scores and then the merge with the state, the gate and ``h`` (``h`` to float32 rounding of
    one kernel's: see ``GATE_STATS``); where ``h`` is not used (the backward's re-run of a read
    whose output a model saved) XLA drops the second, so the re-run reads the partial once and the
    state not at all. ``interpret``: run in Pallas' Mosaic GPU interpret mode (CPU tests)."""
    # where the gate's statistics are summed (``GATE_STATS``): the split form has no scoring pass
    # in the kernel that merges, so its merge sums them in a pass of their own
    gate_stats = "own_pass" if split else "in_scores"
    if fuse not in ("gate", "mean"):
        raise ValueError(f"fuse={fuse!r}: the Mosaic GPU phase 2 fuses the streams ('gate' or 'mean')")
    m, bt = len(stream_kernels), BLOCK_T
    gate = fuse == "gate"
    sh = tile_partial("phase2_fused_forward", partial, segment_ids, stream_kernels=stream_kernels, heads=heads,
                      block_d=block_d, interpret=interpret, smem=smem_bytes,
                      x_dtype=partial.dtype, acc_dtype=state.acc.dtype, out_dtype=out_dtype, gate=gate)
    batch, t_len, d, bd, t_pad, x = sh.batch, sh.t_len, sh.d, sh.block_d, sh.t_pad, sh.x
    front, has_bank, has_seg, mh = sh.front, sh.has_bank, sh.has_seg, m * heads

    def pad_t(a, axis, value=0.0):
        return pad_tokens(a, axis, t_pad, value)

    banks = (jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32))
    q = jnp.asarray(query, F32)
    acc = state_as_rows(state.acc, t_pad)
    # [m, B, T, H] -> [m H, B, T]: a head's row of tokens contiguous (a reshape when H = 1)
    pmax = pad_t(jnp.moveaxis(jnp.asarray(state.max, F32), -1, 1).reshape(mh, batch, t_len), 2)
    pden = pad_t(jnp.moveaxis(jnp.asarray(state.denom, F32), -1, 1).reshape(mh, batch, t_len), 2, 1.0)
    include = jnp.asarray(include_partial, F32)
    if gate:
        w, scale, bias = gate_params
        w_rows = jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1).reshape(m * m, d)  # [(r, j), c]
        consts = [jnp.asarray(scale, F32).reshape(()), *jnp.asarray(bias, F32).reshape(m)]
    else:
        w_rows, consts = None, []
    consts = jnp.broadcast_to(jnp.stack([include, *consts])[:, None], (1 + len(consts), bt))
    inputs = [x, banks, q, acc, pmax, pden, consts]
    if gate:
        inputs.append(w_rows)
    if has_seg:
        inputs.append(sh.bits)
    cfg = ForwardConfig(batch=batch, t_pad=t_pad, d=d, stream_kernels=tuple(stream_kernels), heads=heads,
                        block_d=bd, gate=gate, has_seg=has_seg, front=front, eps=float(eps),
                        gate_eps=float(gate_eps), x_dtype=jnp.dtype(x.dtype), acc_dtype=jnp.dtype(acc.dtype),
                        out_dtype=jnp.dtype(out_dtype), n_consts=consts.shape[0], gate_stats=gate_stats, passes="all",
                        interpret=bool(interpret))
    if split:
        dots, sumsq = _kernel(dataclasses.replace(cfg, passes="scores"))(*inputs)
        (h,) = _kernel(dataclasses.replace(cfg, passes="merge"))(*inputs, dots, sumsq)
    else:
        h, dots, sumsq = _kernel(cfg)(*inputs)
    dots = jnp.moveaxis(dots.reshape(m, heads, batch, t_pad), 1, -1)[:, :, :t_len]
    return h[:, :t_len], (dots, sumsq[:, :, :t_len])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ForwardConfig(KernelConfig):
    """What ``phase2_fused_forward``'s kernel code depends on besides ``KernelConfig``."""

    gate: bool
    eps: float
    gate_eps: float
    acc_dtype: jnp.dtype
    out_dtype: jnp.dtype
    n_consts: int
    gate_stats: str  # GATE_STATS
    passes: str  # FORWARD_PASSES


# Where the forward sums the gate's statistics. ``"in_scores"`` (one kernel): pass A sums
# ``A.A``, ``A.E``, ``E.E``, ``A.W_j``, ``E.W_j`` per stream and head and the statistics follow
# from them once a and b are known, so the forward expands twice and reads the partial twice (an
# H100: 1.1644 -> 1.0265 ms per call at `base`, 0.6202 -> 0.5605 at the bench shape against
# ``"own_pass"``; Nsight Compute: 6% fewer instructions and DRAM bytes). ``"own_pass"`` (the
# split form, whose merge kernel has no scoring pass): pass B re-expands the partial to sum
# ``sum z^2`` and ``z . W_j``.
GATE_STATS = ("own_pass", "in_scores")
# What one kernel of ``phase2_fused_forward`` runs: ``"all"`` (passes A-C, one kernel), or the
# split form's two kernels, ``"scores"`` (pass A: the partial's scores alone, written out) and
# ``"merge"`` (passes B-C from those scores: the merge with the state, the gate and ``h``)
FORWARD_PASSES = ("all", "scores", "merge")


@functools.lru_cache(maxsize=None)
def _kernel(cfg: ForwardConfig):
    """The kernel for ``cfg`` as a jitted function of ``phase2_fused_forward``'s inputs, built and
    jitted once per configuration (``KernelConfig`` says why)."""
    plgpu = lane_plgpu()

    batch, t_pad, d, heads, bd, gate, has_seg, front = (cfg.batch, cfg.t_pad, cfg.d, cfg.heads, cfg.block_d,
                                                        cfg.gate, cfg.has_seg, cfg.front)
    eps, gate_eps, stream_kernels = cfg.eps, cfg.gate_eps, cfg.stream_kernels
    m, bt = len(stream_kernels), BLOCK_T
    layout = stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    has_bank = any(stream_kernels)
    nc = d // bd
    mh = m * heads
    n_taps = max(1, sum(stream_kernels))
    row = plgpu.Layout.WGMMA.reduce(1)  # one value per token row
    col = plgpu.Layout.WGMMA.reduce(0)  # one value per channel
    tile = plgpu.Layout.WGMMA
    lags = LagWindow.of(max_lag)
    scores_pass, merge_pass = cfg.passes in ("all", "scores"), cfg.passes in ("all", "merge")

    # max, denom, constants and the scores for the merge; the lag bits
    n_in = (3 + 2 * (not scores_pass) if merge_pass else 0) + (1 if has_seg else 0)
    # the gate's statistics summed in pass A (``GATE_STATS``): pass A then also brings the state and W
    fused_stats = gate and cfg.gate_stats == "in_scores"
    arrivals_a = lags.count + has_bank + 1 + (1 + 1 if fused_stats else 0)
    arrivals_bc = lags.count + has_bank + 1 + gate
    scratch = dict(
        xs=plgpu.SMEM((2, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((2, n_taps, bd), F32) if has_bank else None,
        qs=plgpu.SMEM((2, m, bd), F32) if scores_pass else None,
        accs=tile_smem(plgpu, (2, m, bt, bd), cfg.acc_dtype) if merge_pass or fused_stats else None,
        ws=plgpu.SMEM((2, m * m, bd), F32) if gate and (merge_pass or fused_stats) else None,
        rows_s=plgpu.SMEM((2, mh, bt), F32) if merge_pass else None,
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        scal_s=plgpu.SMEM((cfg.n_consts, bt), F32) if merge_pass else None,
        dots_s=plgpu.SMEM((mh, bt), F32),
        ss_s=plgpu.SMEM((m, bt), F32),
        h_s=tile_smem(plgpu, (2, bt, bd), cfg.out_dtype) if merge_pass else None,
        bar_a=plgpu.Barrier(num_arrivals=arrivals_a, num_barriers=2) if scores_pass else None,
        bar_bc=plgpu.Barrier(num_arrivals=arrivals_bc, num_barriers=2) if merge_pass else None,
        bar_in=plgpu.Barrier(num_arrivals=n_in, num_barriers=1) if n_in else None,
    )
    scratch_names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, q_ref, acc_ref, pmax_ref, pden_ref, consts_ref = (next(it) for _ in range(7))
        w_ref = next(it) if gate else None
        bits_ref = next(it) if has_seg else None
        dots_in, ss_in = (next(it), next(it)) if not scores_pass else (None, None)  # the split form's scores
        h_ref = next(it) if merge_pass else None
        dots_ref, ss_ref = (next(it), next(it)) if scores_pass else (None, None)
        sc = dict(zip(scratch_names, it))
        xs, bs, qs, accs, ws = (sc.get(k) for k in ("xs", "bs", "qs", "accs", "ws"))
        rows_s, bits_s, scal_s, dots_s, ss_s, h_s = (sc.get(k) for k in ("rows_s", "bits_s", "scal_s", "dots_s",
                                                                         "ss_s", "h_s"))
        bar_a, bar_bc, bar_in = sc.get("bar_a"), sc.get("bar_bc"), sc.get("bar_in")
        b, t = lax.axis_index("b"), lax.axis_index("t")
        t0 = t * bt

        # ---- per-tile inputs: the state's max / denom rows, the lag bits, the constants (and the
        # scores, for the split form's merge)
        if merge_pass:
            plgpu.copy_gmem_to_smem(pmax_ref.at[:, b, pl.ds(t0, bt)], rows_s.at[0], bar_in.at[0])
            plgpu.copy_gmem_to_smem(pden_ref.at[:, b, pl.ds(t0, bt)], rows_s.at[1], bar_in.at[0])
            plgpu.copy_gmem_to_smem(consts_ref, scal_s, bar_in.at[0])
        if not scores_pass:
            plgpu.copy_gmem_to_smem(dots_in.at[:, b, pl.ds(t0, bt)], dots_s, bar_in.at[0])
            plgpu.copy_gmem_to_smem(ss_in.at[:, b, pl.ds(t0, bt)], ss_s, bar_in.at[0])
        if has_seg:
            plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t0, bt)], bits_s, bar_in.at[0])

        def fetch(bar, with_state, with_query):
            def issue(c, slot):
                fetch_partial(plgpu, x_ref, bank_ref if has_bank else None, xs, bs, b, t0, front, c, bd, slot,
                              bar, lags, max_lag)
                cs = pl.ds(c * bd, bd)
                if with_state:
                    copy_state(plgpu, acc_ref, accs, pl.ds(b * t_pad + t0, bt), cs, slot, bar.at[slot])
                    if gate:
                        plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws.at[slot], bar.at[slot])
                if with_query:
                    plgpu.copy_gmem_to_smem(q_ref.at[:, cs], qs.at[slot], bar.at[slot])

            return issue

        def pipelined(bar, with_state, per_chunk, carry, with_query=False, reverse=False):
            return pipeline_chunks(plgpu, fetch(bar, with_state, with_query), bar, nc, heads, per_chunk, carry,
                                   reverse=reverse)

        if n_in:
            plgpu.barrier_wait(bar_in.at[0])
        masks = lag_masks(plgpu, bits_s, max_lag, bt, bd)

        def expand(slot):
            return expand_streams(plgpu, xs, bs, slot, layout, masks, bt, bd, lags)

        def w_col(slot, r, j):
            return per_col(plgpu.load(ws, (slot, r * m + j), layout=col), bt, bd)

        # ---- A: per-head dots and the keys' sums of squares; with ``fused_stats`` also, per stream
        # and head, the sums that give the gate's statistics once a and b are known:
        # sum z^2 = a^2 A.A + 2 a b A.E + b^2 E.E and z . W_j = a A.W_j + b E.W_j (z = a A + b E)
        def scores_chunk(c, slot, head, carry):
            dots, sqs = [list(v) for v in carry[0]], list(carry[1])
            if fused_stats:
                aa, ae, ee = ([list(v) for v in sums] for sums in carry[2])
                aw, ew = ([[list(u) for u in v] for v in sums] for sums in carry[3])
            for r, e in enumerate(expand(slot)):
                qr = per_col(plgpu.load(qs, (slot, r), layout=col), bt, bd)
                dots[r][head] = dots[r][head] + jnp.sum(e * qr, axis=1)
                e2 = jnp.sum(e * e, axis=1)
                sqs[r] = sqs[r] + e2
                if fused_stats:
                    a_state = plgpu.load(accs, (slot, r), layout=tile).astype(F32)
                    aa[r][head] = aa[r][head] + jnp.sum(a_state * a_state, axis=1)
                    ae[r][head] = ae[r][head] + jnp.sum(a_state * e, axis=1)
                    ee[r][head] = ee[r][head] + e2
                    for j in range(m):
                        wj = w_col(slot, r, j)
                        aw[r][j][head] = aw[r][j][head] + jnp.sum(a_state * wj, axis=1)
                        ew[r][j][head] = ew[r][j][head] + jnp.sum(e * wj, axis=1)
            if fused_stats:
                return dots, sqs, (aa, ae, ee), (aw, ew)
            return dots, sqs

        zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)
        if scores_pass:
            per_head = lambda: [[zero] * heads for _ in range(m)]  # noqa: E731
            carry = (per_head(), [zero] * m)
            if fused_stats:
                per_head_j = lambda: [[[zero] * heads for _ in range(m)] for _ in range(m)]  # noqa: E731
                carry += ((per_head(), per_head(), per_head()), (per_head_j(), per_head_j()))
            out = pipelined(bar_a, fused_stats, scores_chunk, carry, with_query=True)
            dots, sqs = out[0], out[1]
        else:  # the split form's merge: the scores its first kernel wrote
            dots = [[plgpu.load(dots_s, r * heads + head, layout=row) for head in range(heads)] for r in range(m)]
            sqs = [plgpu.load(ss_s, r, layout=row) for r in range(m)]
        if not merge_pass:  # the split form's first kernel: the scores are its output
            for r in range(m):
                for head in range(heads):
                    dots_s[r * heads + head] = dots[r][head]
                ss_s[r] = sqs[r]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dots_s, dots_ref.at[:, b, pl.ds(t0, bt)])
            plgpu.copy_smem_to_gmem(ss_s, ss_ref.at[:, b, pl.ds(t0, bt)])
            plgpu.wait_smem_to_gmem(0)
            return

        # the scores and the online-softmax merge with the phase-1 state: a, b per (stream, head)
        inc = plgpu.load(scal_s, 0, layout=row) > 0.5
        coef_a, coef_b = [], []
        for r in range(m):
            rk = lax.rsqrt(sqs[r] * (1.0 / d) + eps)
            coef_a.append([])
            coef_b.append([])
            for head in range(heads):
                s = jnp.where(inc, dots[r][head] * rk, reference.NEG_LARGE)
                mx = plgpu.load(rows_s, (0, r * heads + head), layout=row)
                den = plgpu.load(rows_s, (1, r * heads + head), layout=row)
                new_max = jnp.maximum(mx, s)
                keep = jnp.exp(mx - new_max)
                pnew = jnp.where(inc, jnp.exp(s - new_max), 0.0)
                new_den = den * keep + pnew
                coef_a[r].append(keep / new_den)
                coef_b[r].append(pnew / new_den)
                if scores_pass:
                    dots_s[r * heads + head] = dots[r][head]
            if scores_pass:
                ss_s[r] = sqs[r]
        if scores_pass:
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dots_s, dots_ref.at[:, b, pl.ds(t0, bt)])
            plgpu.copy_smem_to_gmem(ss_s, ss_ref.at[:, b, pl.ds(t0, bt)])

        def merged(slot, r, head, e):
            """``z_r = a A_r + b E_r`` of the chunk in ``slot`` (Eq. 11, merged)."""
            a_state = plgpu.load(accs, (slot, r), layout=tile).astype(F32)
            return per_row(coef_a[r][head], bt, bd) * a_state + per_row(coef_b[r][head], bt, bd) * e

        # ---- B: the gate's statistics, then the gate (Eq. 13-14)
        mix = [None] * m
        if fused_stats:  # from pass A's sums (see there)
            (aa, ae, ee), (aw, ew) = out[2], out[3]
            sq, zw = zero, [zero] * m
            for r in range(m):
                for head in range(heads):
                    ca, cb = coef_a[r][head], coef_b[r][head]
                    sq = sq + ca * ca * aa[r][head] + 2.0 * ca * cb * ae[r][head] + cb * cb * ee[r][head]
                    for j in range(m):
                        zw[j] = zw[j] + ca * aw[r][j][head] + cb * ew[r][j][head]
        elif gate:

            def stats_chunk(c, slot, head, carry):
                sq, zw = carry[0], list(carry[1])
                for r, e in enumerate(expand(slot)):
                    z = merged(slot, r, head, e)
                    sq = sq + jnp.sum(z * z, axis=1)
                    for j in range(m):
                        zw[j] = zw[j] + jnp.sum(z * w_col(slot, r, j), axis=1)
                return sq, zw

            sq, zw = pipelined(bar_bc, True, stats_chunk, (zero, [zero] * m))
        if gate:
            inv = lax.rsqrt(sq * (1.0 / (m * d)) + gate_eps)
            scale = plgpu.load(scal_s, 1, layout=row)
            for j in range(m):
                logit = scale * (inv * zw[j]) + plgpu.load(scal_s, 2 + j, layout=row)
                mix[j] = 1.0 / (1.0 + jnp.exp(-logit))

        # ---- C: h = sum_r g_r z_r, chunk by chunk to the output
        def fuse_chunk(c, slot, head, carry):
            h = None
            for r, e in enumerate(expand(slot)):
                z = merged(slot, r, head, e)
                term = z * (1.0 / m) if mix[r] is None else per_row(mix[r], bt, bd) * z
                h = term if h is None else h + term
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that last read this slot is done
            h_s[slot] = h.astype(h_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(h_s.at[slot], h_ref.at[b, pl.ds(t0, bt), pl.ds(c * bd, bd)])
            return carry

        # with the gate, the state's second read (pass B, or with ``fused_stats`` pass A, read it
        # first), in reverse (``pipeline_chunks`` says why)
        pipelined(bar_bc, True, fuse_chunk, 0, reverse=gate)
        plgpu.wait_smem_to_gmem(0)

    out_type = ([jax.ShapeDtypeStruct((batch, t_pad, d), cfg.out_dtype)] if merge_pass else []) + (
        [jax.ShapeDtypeStruct((mh, batch, t_pad), F32), jax.ShapeDtypeStruct((m, batch, t_pad), F32)]
        if scores_pass else [])
    name = {"all": "depth_attention_phase2_mosaic", "scores": "depth_attention_phase2_scores_mosaic",
            "merge": "depth_attention_phase2_merge_mosaic"}[cfg.passes]
    return jitted_kernel(plgpu, body, tuple(out_type), [scratch[k] for k in scratch_names],
                         name=name, batch=batch, t_pad=t_pad, interpret=cfg.interpret)
