"""Phase 2's backward input kernel in Mosaic GPU (``phase2_backward_inputs``: the transposed conv
of ``d_x`` over the token tiles in reverse and the token sums of the query, bank and gate
gradients; pass 3 of ``fused_bwd_phase2``). docs/kernels.md §4, "Phase 2 backward"."""

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
    BLOCK_T, F32, KernelConfig, LagWindow, LanePlgpu, MAX_LAG_BITS, dh_operand, lag_bits, named_body, pad_rows4,
    per_col, per_row, rows4, state_as_rows,
)

# ``phase2_backward_inputs``' channel chunk: 8 channels keep its carried token sums (44 ``[64, 8]``
# float32 tiles for kernels (0, 4, 8, 12) with the gate, 4 registers each per thread) in
# registers; its 16-byte rows (bf16) and 32-byte rows (float32) make every row-offset load one
# contiguous run of shared memory, so no window needs padding against bank conflicts.
INPUTS_BLOCK_D = 8
INPUTS_NEXT_ROWS = 16  # rows of the next token tile the transposed conv reaches (max_lag - 1, in 8s)
# Lane semantics copies only whole multiples of 128 bytes: the lag bits come as 96-row windows
# (the tile's 64 and the 16 it reaches, padded), the small per-chunk rows padded to 4 (4 x 32 bytes)
INPUTS_BITS_ROWS = 96
# warpgroups per program of ``phase2_backward_inputs`` (``_inputs_kernel`` says why 2): with two,
# no spills and 1.63 against 2.61 ms per call in the `base` step with one. Nsight Compute found
# two warps per scheduler issuing every 2.6 cycles, but more warpgroups did not pay: phase 2's
# whole backward at `base` 3.217 ms with two, 3.426 with three (168 registers, no spills), 3.721
# with four (128, spills). Each lag of the partial's window and each per-token row is loaded
# once per tile and reused (once per use: 49 loads where 12 lags exist, 3.297 against 3.220 ms).
INPUTS_WARPGROUPS = 2
# The per-channel constants (the taps, the queries and W's columns: the same in every token tile
# of a program) are loaded once per program, before the token loop, and stay in registers (each
# warpgroup only its streams'): an H100, 1.375 -> 1.229 ms per call at `base` (-10.7%), 0.695 ->
# 0.635 at the bench shape (-8.7%) against a load at every use (once per tile: -4.9% / -5.7%). A
# program of one warpgroup loads them at every use (``_inputs_constants``).
INPUTS_CONSTANTS_CHOICES = ("per_use", "per_program")
# batch rows each program of ``phase2_backward_inputs`` walks, one after the other (the largest
# divisor of the batch up to this): its carried token sums are reduced over the 64 rows, and its
# first copies waited for, once per program rather than once per row
INPUTS_ROWS_PER_PROGRAM = 4
# the token tiles ``phase2_backward_inputs`` has in flight: its buffers, the fetch barriers and the
# handoff of ``d_x``'s parts per slot; the fetch for tile ``i + INPUTS_SLOTS`` issued once tile ``i``
# is done. 3 slots (about 85 KB of shared memory per program, not 59; the same bits) against 2 on
# the H200 (two rounds each): 1.2460 / 1.2504 -> 1.2597 / 1.2191 ms at `base` (+1.1% / -2.5%) and
# 0.6491 / 0.6454 -> 0.6207 / 0.6279 at the bench shape (-4.4% / -2.7%).
INPUTS_SLOTS = 3


def check_inputs_shape(*, d: int, heads: int, stream_kernels: Sequence[int]) -> None:
    """Raises ``NotImplementedError`` (saying why) unless ``phase2_backward_inputs`` takes the shape."""
    if d % heads or (d // heads) % INPUTS_BLOCK_D:
        raise NotImplementedError(f"mosaic_gpu.phase2_backward_inputs: the head width d/heads = {d}/{heads} must be "
                                  f"a multiple of {INPUTS_BLOCK_D}")
    max_lag = max([1, *stream_kernels])
    if max_lag - 1 > INPUTS_NEXT_ROWS or max_lag > MAX_LAG_BITS:
        raise NotImplementedError(f"mosaic_gpu.phase2_backward_inputs: kernels up to {INPUTS_NEXT_ROWS + 1} taps "
                                  f"(got {tuple(stream_kernels)})")


def inputs_rows_per_program(batch: int) -> int:
    """The batch rows one program of ``phase2_backward_inputs`` walks: the largest divisor of
    ``batch`` up to ``INPUTS_ROWS_PER_PROGRAM``."""
    return max(k for k in range(1, INPUTS_ROWS_PER_PROGRAM + 1) if batch % k == 0)


def phase2_backward_inputs(partial, bank, query, a, b, u, v, acc, dh, gate_in, segment_ids, *, stream_kernels,
                           heads: int, dx_dtype=F32, interpret: bool = False):
    """Pass 3 of ``fused_bwd_phase2`` (its reverse-T input kernel, ``_dinput_kernel``) as one
    Mosaic GPU kernel: per (group of batch rows, 8-channel chunk), each row's 64-token tiles in
    reverse (``inputs_rows_per_program``: the carried sums are reduced once per group); per
    tile and stream ``r`` it recomputes ``E_r`` (Eq. 10), ``z_r = a A_r + b E_r`` (Eq. 11),
    ``dz_r = g_r dh + sum_j W[r, :, j] dy_j + coef z_r`` (the H_pre gate's backward, Eq. 13-14;
    ``dh / m`` for mean fusion) and ``d_E_r = b dz_r + u q_r + v E_r``, and applies the
    transposed causal conv: ``d_x[t] = sum_r sum_delta c_r[delta] mask_delta[t + delta]
    d_E_r[t + delta]``. Rows ``t + delta`` reach up to 11 rows into the next tile, which the
    reverse loop has already made: each stream's ``d_E`` goes through a 128-row shared-memory
    buffer (this tile's rows, then the next tile's) and is loaded back at each lag's row offset
    (Lane semantics, as the partial's lag windows). The token sums ``d_query_r = sum_t u E_r``,
    ``d_bank[delta] = sum_t mask_delta d_E_r x[t - delta]`` and ``d_W[r, :, j] = sum_t z_r
    dy_j`` ride in the loop carry as whole tiles and are reduced over rows once per program.

    ``a, b, u``: ``[m, B, T, H]``; ``v``: ``[m, B, T]``; ``acc[m, B, T, d]``; ``dh[B, T, d]``
    (bf16 or float32: ``dh_operand``); ``gate_in``: ``(g[B, T, m], dy[B, T, m], coef[B, T], w3[m, d, m])``
    (``fused.gate_cols``) or None (mean fusion). Returns what ``fused_bwd_phase2._dinput_call``
    does, except that the token sums come per program, not per batch row: ``d_x[B, T, d]``
    in ``dx_dtype`` (float32 or bf16: each element is written once, so bf16 is the float32 value
    rounded once, as a cast after the kernel would give) and the partials ``d_query[P, m, d]``,
    ``d_bank[P, K, d]`` (None without a bank) and ``d_W[P, m, d, m]`` (None without the gate),
    ``P = B / inputs_rows_per_program(B)``; their sum over the first axis is the gradient."""
    stream_kernels = tuple(stream_kernels)
    batch, t_len, d = partial.shape
    rows_per_program = inputs_rows_per_program(batch)
    m, bt = len(stream_kernels), BLOCK_T
    check_inputs_shape(d=d, heads=heads, stream_kernels=stream_kernels)
    max_lag = max([1, *stream_kernels])
    gate = gate_in is not None
    has_bank = any(stream_kernels) and bank is not None
    has_seg = segment_ids is not None and max_lag > 1
    t_pad = -(-t_len // bt) * bt
    lags = LagWindow.of(max_lag, pad=0)
    front = 8 * lags.extra if interpret else 0
    x = pad_tokens(partial, 1, t_pad)
    if interpret:  # the rows before token 0: zeros, as TMA fills them on the GPU
        x = jnp.pad(x, ((0, 0), (front, 0), (0, 0)))
    pad_t = lambda w, axis: pad_tokens(jnp.asarray(w, F32), axis, t_pad)  # noqa: E731

    # per-token rows [H, R, B, Tp]: a, b, u, v per stream (v repeated per head), then g, dy, coef
    per_head = [jnp.moveaxis(pad_t(w, 2), -1, 0) for w in (a, b, u)]  # [H, m, B, Tp] each
    per_head.append(jnp.broadcast_to(pad_t(v, 2)[None], (heads, m, batch, t_pad)))
    if gate:
        g, dy, coef, w3 = gate_in
        for w in (g, dy):
            per_head.append(jnp.broadcast_to(jnp.moveaxis(pad_t(w, 1), -1, 0)[None], (heads, m, batch, t_pad)))
        per_head.append(jnp.broadcast_to(pad_t(coef, 1)[None, None], (heads, 1, batch, t_pad)))
    rows = jnp.concatenate(per_head, axis=1)
    inputs = [x, pad_rows4(jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32)),
              pad_rows4(jnp.asarray(query, F32)), rows, state_as_rows(acc, t_pad), pad_tokens(dh_operand(dh), 1, t_pad)]
    if gate:
        inputs.append(pad_rows4(jnp.asarray(w3, F32).transpose(0, 2, 1).reshape(m * m, d)))  # [(r, j), c]
    if has_seg:  # each tile's window: its rows and the next tile's first ones (zeros past the end)
        bits = pad_tokens(lag_bits(segment_ids, t_len, max_lag), 1, t_pad)
        inputs.append(jnp.pad(bits, ((0, 0), (0, INPUTS_BITS_ROWS - bt))))
    call = _inputs_kernel(InputsConfig(batch=batch, t_pad=t_pad, d=d, stream_kernels=stream_kernels, heads=heads,
                                       block_d=INPUTS_BLOCK_D, gate=gate, has_bank=has_bank, has_seg=has_seg,
                                       front=front, x_dtype=jnp.dtype(x.dtype), acc_dtype=jnp.dtype(acc.dtype),
                                       dh_dtype=jnp.dtype(dh_operand(dh).dtype), dx_dtype=jnp.dtype(dx_dtype),
                                       rows_per_program=rows_per_program,
                                       constants=_inputs_constants(stream_kernels, gate),
                                       interpret=bool(interpret)))
    dx, sums = call(*inputs)
    n_taps = sum(stream_kernels) if has_bank else 0
    dq = sums[:, :m]
    dbank = sums[:, m:m + n_taps] if has_bank else None
    dw = sums[:, m + n_taps:m + n_taps + m * m].reshape(-1, m, m, d).transpose(0, 1, 3, 2) if gate else None
    return dx[:, :t_len], dq, dbank, dw


def _inputs_constants(stream_kernels, gate: bool) -> str:
    """Where ``phase2_backward_inputs`` loads its per-channel constants (``INPUTS_CONSTANTS_CHOICES``):
    once per program, except in a program of one warpgroup (one stream), which loads them at every
    use (with one warpgroup for all four streams, holding their constants in registers took its
    spills from 404 to 1060 bytes and its loop from 1080 to 1180 instructions, the H200's compile at
    `base`)."""
    if len(_stream_groups(stream_layout(stream_kernels), gate, INPUTS_WARPGROUPS)) == 1:
        return "per_use"
    return "per_program"


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputsConfig(KernelConfig):
    """What ``phase2_backward_inputs``' kernel code depends on besides ``KernelConfig``."""

    gate: bool
    has_bank: bool
    acc_dtype: jnp.dtype
    dh_dtype: jnp.dtype
    dx_dtype: jnp.dtype
    rows_per_program: int
    constants: str  # INPUTS_CONSTANTS_CHOICES


def _stream_groups(layout, gate: bool, n_groups: int):
    """The streams (indices into ``layout``) each warpgroup of ``phase2_backward_inputs`` takes:
    balanced by the token sums each stream carries (``d_query``, its taps' ``d_bank``, its row of
    ``d_W``), largest first to the group with the fewest. Every group is non-empty or dropped."""
    m = len(layout)
    cost = lambda r: 1 + layout[r][0] + (m if gate else 0)  # noqa: E731
    groups, loads = [[] for _ in range(n_groups)], [0] * n_groups
    for r in sorted(range(m), key=lambda r: (-cost(r), r)):
        g = loads.index(min(loads))
        groups[g].append(r)
        loads[g] += cost(r)
    return tuple(tuple(sorted(g)) for g in groups if g)


@functools.lru_cache(maxsize=None)
def _inputs_kernel(cfg: InputsConfig):
    """``phase2_backward_inputs``' kernel for ``cfg``, built and jitted once (``KernelConfig``).

    With ``INPUTS_WARPGROUPS > 1`` each program runs that many warpgroups, each with its own streams
    (``_stream_groups``) and so its share of the carried token sums: with one warpgroup the 44
    sums of kernels (0, 4, 8, 12) with the gate take 176 registers per thread and ptxas spills;
    more warpgroups also give each scheduler more warps to issue from (Nsight Compute: the
    kernel is issue-bound at two). The streams meet only in ``d_x``: the other
    warpgroups hand their parts over through shared memory (``dx1s``, one buffer each per slot,
    a barrier per slot that all of them arrive at); the first adds them, stores ``d_x`` and
    issues every TMA copy."""
    from jax.experimental.pallas import mosaic_gpu as plgpu_module

    plgpu = LanePlgpu(plgpu_module)
    batch, t_pad, d, heads, gate, has_seg, front = (cfg.batch, cfg.t_pad, cfg.d, cfg.heads, cfg.gate, cfg.has_seg,
                                                    cfg.front)
    stream_kernels = cfg.stream_kernels
    m, bt, bd = len(stream_kernels), BLOCK_T, INPUTS_BLOCK_D
    layout = stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    lags = LagWindow.of(max_lag, pad=0)
    has_bank = cfg.has_bank
    n_taps = sum(stream_kernels)
    nc, n_tiles = d // bd, t_pad // bt
    rows_per_program = cfg.rows_per_program
    n_steps = rows_per_program * n_tiles  # the program's tiles: each of its batch rows' in reverse
    n_slots = INPUTS_SLOTS  # fetches in flight

    def to_f32(v):  # a register tile as float32
        return v.astype(F32)
    n_rows = 4 * m + (2 * m + 1 if gate else 0)
    convs = [r for r, (kernel, _) in enumerate(layout) if kernel > 0]  # streams with a transposed conv
    n_sums = m + (n_taps if has_bank else 0) + (m * m if gate else 0)
    groups = _stream_groups(layout, gate, INPUTS_WARPGROUPS)
    n_wg = len(groups)
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    scratch = dict(
        xs=plgpu.SMEM((n_slots, 1, lags.rows, bd), cfg.x_dtype),
        accs=plgpu.SMEM((n_slots, m, bt, bd), cfg.acc_dtype),
        dhs=plgpu.SMEM((n_slots, bt, bd), cfg.dh_dtype),
        rows_s=plgpu.SMEM((n_slots, n_rows, bt), F32),
        bits_s=plgpu.SMEM((n_slots, INPUTS_BITS_ROWS), jnp.int32) if has_seg else None,
        consts=plgpu.SMEM((rows4(max(1, n_taps)) + rows4(m) + (rows4(m * m) if gate else 0), bd), F32),
        des=plgpu.SMEM((max(1, len(convs)), 2 * bt, bd), F32),  # d_E: this tile's rows, then the next tile's
        dxs=plgpu.SMEM((n_slots, bt, bd), cfg.dx_dtype),
        dx1s=plgpu.SMEM((n_wg - 1, n_slots, bt, bd), F32) if n_wg > 1 else None,  # the other warpgroups' parts of d_x
        sums_s=plgpu.SMEM((rows4(n_sums), bd), F32),
        bar=plgpu.Barrier(num_arrivals=4 + has_seg, num_barriers=n_slots),  # one per copy of ``fetch``
        bar_in=plgpu.Barrier(num_arrivals=1 + has_bank + gate, num_barriers=1),
        handoff=plgpu.Barrier(num_arrivals=n_wg - 1, num_barriers=n_slots) if n_wg > 1 else None,
        done=plgpu.Barrier(num_arrivals=1, num_barriers=n_wg - 1) if n_wg > 1 else None,  # the sums' relay
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, q_ref, rows_ref, acc_ref, dh_ref = (next(it) for _ in range(6))
        w_ref = next(it) if gate else None
        bits_ref = next(it) if has_seg else None
        dx_ref, sums_ref = next(it), next(it)
        sc = dict(zip(names, it))
        xs, accs, dhs, rows_s, bits_s, consts = (sc.get(k) for k in ("xs", "accs", "dhs", "rows_s", "bits_s",
                                                                     "consts"))
        des, dxs, dx1s, sums_s, bar, bar_in = (sc.get(k) for k in ("des", "dxs", "dx1s", "sums_s", "bar", "bar_in"))
        handoff, done = sc.get("handoff"), sc.get("done")
        program, c = lax.axis_index("b"), lax.axis_index("c")
        cs = pl.ds(c * bd, bd)
        head = (c * bd) // (d // heads)
        taps_at, q_at = 0, rows4(max(1, n_taps))
        w_at = q_at + rows4(m)

        def tile_of(j):
            """Step ``j``'s batch row and token tile: the program's rows one after the other, each
            row's tiles in reverse."""
            return program * rows_per_program + j // n_tiles, n_tiles - 1 - j % n_tiles

        def fetch(j, slot):
            bi, k = tile_of(j)
            # a traced start: the first tile's window starts before row 0 on the GPU (TMA fills the
            # rows with zeros), which Pallas refuses as a static slice
            t0 = k * bt + bi * 0
            plgpu.copy_gmem_to_smem(x_ref.at[bi, pl.ds(t0 + front - 8 * lags.extra, lags.rows), cs],
                                    xs.at[slot, 0], bar.at[slot])
            plgpu.copy_gmem_to_smem(acc_ref.at[:, pl.ds(bi * t_pad + t0, bt), cs], accs.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(dh_ref.at[bi, pl.ds(t0, bt), cs], dhs.at[slot], bar.at[slot])
            plgpu.copy_gmem_to_smem(rows_ref.at[head, :, bi, pl.ds(t0, bt)], rows_s.at[slot], bar.at[slot])
            if has_seg:
                plgpu.copy_gmem_to_smem(bits_ref.at[bi, pl.ds(t0, INPUTS_BITS_ROWS)], bits_s.at[slot], bar.at[slot])

        def run(g: int):
            """Warpgroup ``g``'s loop over the token tiles, for its streams ``groups[g]``."""
            group, leader = groups[g], g == 0
            zero = plgpu.layout_cast(jnp.zeros((bt, bd), F32), tile)
            own_convs = [r for r in group if r in convs]
            if leader:  # the per-program constants (taps, queries, W's columns) and the first tiles
                if has_bank:
                    plgpu.copy_gmem_to_smem(bank_ref.at[:, cs], consts.at[pl.ds(taps_at, bank_ref.shape[0])],
                                            bar_in.at[0])
                plgpu.copy_gmem_to_smem(q_ref.at[:, cs], consts.at[pl.ds(q_at, q_ref.shape[0])], bar_in.at[0])
                if gate:
                    plgpu.copy_gmem_to_smem(w_ref.at[:, cs], consts.at[pl.ds(w_at, w_ref.shape[0])], bar_in.at[0])
                for j in range(min(n_slots, n_steps)):
                    fetch(j, j)
            for r in own_convs:  # the next tile's rows of d_E start as zeros (nothing lies past the last tile)
                des[convs.index(r), pl.ds(bt, bt)] = zero
            plgpu.barrier_wait(bar_in.at[0])
            const_rows = [taps_at + layout[r][1] + delta for r in own_convs for delta in range(layout[r][0])]
            const_rows += [q_at + r for r in group] + ([w_at + r * m + j for r in group for j in range(m)] if gate else [])
            # "per_program": this warpgroup's constants, loaded once and held in registers by the loop
            held = ({k: plgpu.load(consts, k, layout=col) for k in const_rows} if cfg.constants == "per_program"
                    else {})

            def step(i, carry):
                dq, dbank, dw = dict(carry[0]), dict(carry[1]), dict(carry[2])
                bi, k = tile_of(i)
                slot = lax.rem(i, n_slots)
                plgpu.barrier_wait(bar.at[slot])
                masks = [None] * max_lag
                if has_seg:
                    bits = plgpu.load(bits_s.at[slot, pl.ds(0, bt)], (), layout=row)
                    masks = [None] + [per_row(((bits >> delta) & 1).astype(F32), bt, bd) for delta in range(1, max_lag)]

                loaded = {}  # this tile's values, loaded at their first use

                def once(key, load):
                    if key not in loaded:
                        loaded[key] = load()
                    return loaded[key]

                def rows_of(j):
                    return once(("rows", j), lambda: per_row(plgpu.load(rows_s, (slot, j), layout=row), bt, bd))

                def x_lag(delta):
                    return once(("x", delta), lambda: to_f32(lags.load(plgpu, xs, slot, delta)))

                def const(k):  # row ``k`` of ``consts`` (a tap, a query, a column of W), per ``cfg.constants``
                    if k in held:
                        return per_col(held[k], bt, bd)
                    return per_col(plgpu.load(consts, k, layout=col), bt, bd)

                def tap(k):
                    return const(taps_at + k)

                dh = to_f32(plgpu.load(dhs, slot, layout=tile))
                dx = None
                for r in group:
                    kernel, off = layout[r]
                    if kernel == 0:
                        e = x_lag(0)
                    else:
                        e = None
                        for delta in range(kernel):
                            term = tap(off + delta) * x_lag(delta)
                            if masks[delta] is not None:
                                term = term * masks[delta]
                            e = term if e is None else e + term
                    acc = plgpu.load(accs, (slot, r), layout=tile).astype(F32)
                    coef_b = rows_of(m + r)
                    z = rows_of(r) * acc + coef_b * e
                    if gate:
                        dz = rows_of(4 * m + r) * dh + rows_of(6 * m) * z
                        for j in range(m):
                            w_rj = const(w_at + r * m + j)
                            dz = dz + w_rj * rows_of(5 * m + j)
                            dw[r, j] = dw[r, j] + z * rows_of(5 * m + j)
                    else:
                        dz = dh * (1.0 / m)
                    coef_u = rows_of(2 * m + r)
                    q_r = const(q_at + r)
                    de = coef_b * dz + coef_u * q_r + rows_of(3 * m + r) * e
                    dq[r] = dq[r] + coef_u * e
                    if kernel == 0:
                        dx = de if dx is None else dx + de
                        continue
                    for delta in range(kernel):
                        masked = de if masks[delta] is None else de * masks[delta]
                        dbank[off + delta] = dbank[off + delta] + masked * x_lag(delta)
                    des[convs.index(r), pl.ds(0, bt)] = de
                plgpu.commit_smem()  # this warpgroup's d_E visible to all its threads
                # transposed conv: row t of this tile takes d_E_r[t + delta] (this tile's or the next's)
                for r in own_convs:
                    kernel, off = layout[r]
                    for delta in range(kernel):
                        term = tap(off + delta) * plgpu.load(des.at[convs.index(r), pl.ds(delta, bt)], (),
                                                             layout=tile)
                        if has_seg and delta:
                            nbits = plgpu.load(bits_s.at[slot, pl.ds(delta, bt)], (), layout=row)
                            term = term * per_row(((nbits >> delta) & 1).astype(F32), bt, bd)
                        dx = term if dx is None else dx + term
                dx = zero if dx is None else dx
                if not leader:  # hand this warpgroup's part of d_x to the first
                    dx1s[g - 1, slot] = dx
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(handoff.at[slot])
                else:
                    if n_wg > 1:
                        plgpu.barrier_wait(handoff.at[slot])
                        for other in range(n_wg - 1):
                            dx = dx + plgpu.load(dx1s, (other, slot), layout=tile)
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # one store in flight at most: this slot's last is read
                    dxs[slot] = dx.astype(cfg.dx_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dxs.at[slot], dx_ref.at[bi, pl.ds(k * bt, bt), cs])
                # this tile's d_E becomes the next (earlier) tile's "next rows" (read by this thread
                # only; every thread of the warpgroup has done its shifted loads: the commit above);
                # after a row's first tile the next step starts another row, past whose end lie zeros
                keep = (k > 0).astype(F32) if rows_per_program > 1 else None
                for r in own_convs:
                    de = plgpu.load(des.at[convs.index(r), pl.ds(0, bt)], (), layout=tile)
                    des[convs.index(r), pl.ds(bt, bt)] = de if keep is None else de * keep
                if leader:  # both warpgroups are done with this slot (the handoff above)
                    @pl.when(i + n_slots < n_steps)
                    def _():
                        fetch(i + n_slots, slot)

                return dq, dbank, dw

            own_taps = [layout[r][1] + delta for r in group for delta in range(layout[r][0])] if has_bank else []
            carry = ({r: zero for r in group}, {t: zero for t in own_taps},
                     {(r, j): zero for r in group for j in range(m)} if gate else {})
            dq, dbank, dw = lax.fori_loop(0, n_steps, step, carry)
            # the token sums: one row each of [d_query (m) | d_bank (taps) | d_W (m x m)]; the
            # warpgroups reduce in turn, the last first (the cross-warp reductions share a scratch
            # buffer): warpgroup g waits for g + 1 (``done[g]``) and then lets g - 1 go (``done[g - 1]``)
            if g < n_wg - 1:
                plgpu.barrier_wait(done.at[g])
            for r, v in dq.items():
                sums_s[r] = jnp.sum(v, axis=0)
            for t, v in dbank.items():
                sums_s[m + t] = jnp.sum(v, axis=0)
            for (r, j), v in dw.items():
                sums_s[m + (n_taps if has_bank else 0) + r * m + j] = jnp.sum(v, axis=0)
            plgpu.commit_smem()
            if not leader:
                plgpu.barrier_arrive(done.at[g - 1])
            else:
                plgpu.copy_smem_to_gmem(sums_s, sums_ref.at[program, :, cs])
                plgpu.wait_smem_to_gmem(0)

        if n_wg == 1:
            run(0)
        else:
            wg = lax.axis_index("wg")
            for g in range(n_wg):
                pl.when(wg == g)(functools.partial(run, g))

    out_type = (jax.ShapeDtypeStruct((batch, t_pad, d), cfg.dx_dtype),
                jax.ShapeDtypeStruct((batch // rows_per_program, rows4(n_sums), d), F32))
    params = dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    if n_wg > 1:
        params.update(num_threads=n_wg, thread_name="wg")
    kernel = plgpu.kernel(named_body(body, "depth_attention_phase2_bwd_inputs_mosaic"), out_type=out_type,
                          scratch_types=[scratch[k] for k in names], grid=(batch // rows_per_program, nc),
                          grid_names=("b", "c"), interpret=plgpu.InterpretGPUParams() if cfg.interpret else False,
                          **params)

    @jax.jit
    def run_kernel(*inputs):
        with jax.named_scope("depth_attention_phase2_bwd_inputs_mosaic"):
            return kernel(*inputs)

    return run_kernel
