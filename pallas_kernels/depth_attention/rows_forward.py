"""Phase 2's fused forward with whole channel rows per program, so the state is read once. A
measured alternative, exact and slower than ``mosaic_gpu``'s forward; nothing in the package
calls it (docs/kernels.md).

``mosaic_gpu.phase2_fused_forward`` gives each program 64 tokens and walks their ``d`` channels
in chunks three times (the partial's scores, then the merge with the state and the gate's
statistics, then the merge again and ``h``), so it reads the float32 state twice: 2.15 of the
2.82 GB a call moves at `base`. Holding a 64-token tile's state on chip needs 1 MB at `base`;
``mosaic_gpu_cluster`` spreads it over a cluster of CTAs and is slower. Here a program takes only ``block_t`` tokens (2 to 8) and all their
channels, so the ``m`` retrieved streams ``z_r`` (``m * block_t * d`` float32, 64 KB at `base`
with 4 tokens) live in registers from the merge to ``h``: each state element is loaded once,
the partial's lag rows come from L1/L2, and nothing but ``h`` and the per-token scores is
written.

Per program (one batch row, tokens ``t0 ... t0 + block_t - 1``; Eq. numbers of the MSAR paper):

1. ``E_r = sum_delta c_r[delta] mask_delta x[t - delta]`` for every stream at once (Eq. 10): each
   lag row of the partial is loaded once and added into every stream whose kernel reaches it.
2. ``s_r = (q_r . E_r) / rms(E_r)`` (Eq. 11; docs/design.md §3-4), merged with the phase-1 state by the
   online softmax: ``z_r = (keep / denom) acc_r + (p / denom) E_r`` (``reference.merge`` then
   ``finalize``); ``include=False`` (a block's first target) gives ``z_r = acc_r / denom``.
3. ``g = sigmoid(scale * rms(flatten z) @ W + bias)`` and ``h = sum_r g_r z_r`` (H_pre, Eq.
   13-14), or ``h = mean_r z_r`` without the gate.

Pallas' Triton lowering (one program per token tile, the channel row a power of two); in
interpret mode (CPU tests) the partial gets ``FRONT`` zero rows before token 0 instead of the
GPU's masked loads. One head only (MSAR; AttnRes and MHAR keep ``fused.py``'s kernels). Returns
what ``mosaic_gpu.phase2_fused_forward`` does, so the backward kernels take its scores.

Not wired into the package: exact, and slower than the Mosaic kernel with MSAR's taps and gate
(1.42x on the H200 at `base`). A program of a few tokens reloads every per-channel constant (24
taps, 16 gate columns, 4 queries: 176 KB at `base`) for its tokens; without the taps and the gate
it runs at 92% of its floor on the H200.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import fused, reference

F32 = jnp.float32
FRONT = 16  # interpret mode: zero rows before token 0 (at least the largest lag, max kernel - 1)
# tokens per program and warps, by the channel row: z holds m * block_t * d float32 values in
# registers. The fastest of the tiles timed at `base` (d = 1024) and the bench shape (d = 2048) on
# the H100 and the H200
DEFAULT_TILES = {1024: (2, 4), 2048: (2, 4)}
BLOCK_T_CHOICES = (1, 2, 4, 8, 16)
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)


def check_shape(*, d: int, heads: int, stream_kernels: Sequence[int], fuse) -> None:
    """Raises ``NotImplementedError`` (saying why) unless ``phase2_rows_forward`` takes the shape."""
    if fuse not in ("gate", "mean"):
        raise NotImplementedError(f"rows_forward: fuse={fuse!r}; it fuses the streams ('gate' or 'mean')")
    if heads != 1:
        raise NotImplementedError(f"rows_forward: one head only (got heads={heads})")
    if d < 16 or d & (d - 1):
        raise NotImplementedError(f"rows_forward: the channel row d={d} must be a power of two >= 16 (Triton blocks)")
    if max([1, *stream_kernels]) - 1 > FRONT:
        raise NotImplementedError(f"rows_forward: kernels up to {FRONT + 1} taps (got {tuple(stream_kernels)})")


def default_tiles(d: int) -> tuple[int, int]:
    """``(block_t, num_warps)`` for a channel row of ``d``: ``DEFAULT_TILES``, else 4 warps and
    the ``block_t`` whose ``block_t * d`` is nearest to 2048 (the timed tiles' row at `base`)."""
    if d in DEFAULT_TILES:
        return DEFAULT_TILES[d]
    return max(1, min(8, 2048 // d)), 4


def _kernel(*refs, layout, d, bt, x_front, gate, has_seg, eps, gate_eps, triton, early_state):
    m = len(layout)
    it = iter(refs)
    x_ref, bank_ref, q_ref, consts_ref = next(it), next(it), next(it), next(it)  # [Tp(+F), d], [K, d], [m, d], [8]
    acc_refs = [next(it) for _ in range(m)]  # [bt, d] each
    max_refs = [next(it) for _ in range(m)]  # [bt] each
    den_refs = [next(it) for _ in range(m)]
    w_ref = next(it) if gate else None  # [m m, d]: row r m + j is W[r d + c, j] over c
    seg_ref = next(it) if has_seg else None  # [F + Tp]: FRONT rows of -1, then the ids
    h_ref = next(it)  # [bt, d]
    dots_refs = [next(it) for _ in range(m)]  # [bt] each
    sumsq_refs = [next(it) for _ in range(m)]
    t0 = pl.program_id(1) * bt
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    max_lag = max([1] + [kernel for kernel, _ in layout])

    def lag_rows(delta):
        """Rows ``t - delta`` of the partial, ``[bt, d]`` float32, zero before token 0."""
        if triton:
            from jax.experimental.pallas import triton as pltriton

            ok = jnp.broadcast_to((rows >= delta)[:, None], (bt, d))
            return pltriton.load(x_ref.at[pl.ds(t0 - delta, bt), :], mask=ok, other=0.0).astype(F32)
        return x_ref[pl.ds(t0 + x_front - delta, bt), :].astype(F32)

    def lag_mask(delta):
        """``[bt, 1]``: token ``t - delta`` exists and shares ``t``'s segment (``reference._lag_masks``)."""
        same = seg_ref[pl.ds(t0 + FRONT - delta, bt)] == seg_ref[pl.ds(t0 + FRONT, bt)]
        return ((rows >= delta) & same).astype(F32)[:, None]

    # the state first: its loads are the program's DRAM traffic, issued before the arithmetic
    accs = [acc_ref[...].astype(F32) for acc_ref in acc_refs] if early_state else [None] * m

    # 1. the streams, each lag row loaded once for all of them (Eq. 10)
    e = [None] * m
    for delta in range(max_lag):
        x_lag = lag_rows(delta)
        if has_seg and delta:
            x_lag = x_lag * lag_mask(delta)
        for r, (kernel, off) in enumerate(layout):
            if kernel == 0:
                if delta == 0:
                    e[r] = x_lag
                continue
            if delta >= kernel:
                continue
            term = bank_ref[off + delta, :].astype(F32)[None, :] * x_lag
            e[r] = term if e[r] is None else e[r] + term

    # 2. scores and the merge with the state (Eq. 11; reference.merge, finalize)
    include = consts_ref[0] > 0.5
    z = []
    for r in range(m):
        sumsq = jnp.sum(e[r] * e[r], axis=1)
        dot = jnp.sum(e[r] * q_ref[r, :].astype(F32)[None, :], axis=1)
        dots_refs[r][...] = dot
        sumsq_refs[r][...] = sumsq
        s = jnp.where(include, dot * jax.lax.rsqrt(sumsq / d + eps), reference.NEG_LARGE)
        pmax, pden = max_refs[r][...], den_refs[r][...]
        new_max = jnp.maximum(pmax, s)
        keep = jnp.exp(pmax - new_max)
        pnew = jnp.where(include, jnp.exp(s - new_max), 0.0)
        inv_den = 1.0 / (pden * keep + pnew)
        acc = accs[r] if early_state else acc_refs[r][...].astype(F32)
        z.append((keep * inv_den)[:, None] * acc + (pnew * inv_den)[:, None] * e[r])
        e[r], accs[r] = None, None

    # 3. stream fusion (Eq. 13-14)
    if gate:
        # one reduction over the channels per statistic: the streams are summed elementwise first
        sq = jnp.sum(sum(z_r * z_r for z_r in z), axis=1)
        inv = jax.lax.rsqrt(sq / (m * d) + gate_eps)
        scale = consts_ref[1]
        h = None
        for j in range(m):
            zw = jnp.sum(sum(z[r] * w_ref[r * m + j, :][None, :] for r in range(m)), axis=1)
            g = 1.0 / (1.0 + jnp.exp(-(scale * (inv * zw) + consts_ref[2 + j])))
            term = g[:, None] * z[j]
            h = term if h is None else h + term
    else:
        h = sum(z) * (1.0 / m)
    h_ref[...] = h.astype(h_ref.dtype)


def phase2_rows_forward(state, partial, bank, query, include_partial, gate_params, segment_ids, *, fuse: str,
                        stream_kernels: Sequence[int], heads: int, eps: float, gate_eps: float, out_dtype=F32,
                        block_t: int | None = None, num_warps: int | None = None, early_state: bool = False,
                        interpret: bool = False):
    """``h[B, T, d]`` and the scores ``(dots[m, B, T, 1], sumsq[m, B, T])``, as
    ``mosaic_gpu.phase2_fused_forward`` (same arguments; ``reference.phase2_fused`` is the
    definition). ``block_t``, ``num_warps``: tokens and warps per program (None:
    ``default_tiles``). ``early_state``: load every stream's state tile before the arithmetic
    (more registers, the loads in flight together). ``interpret``: Pallas' interpret mode (CPU tests)."""
    from jax.experimental.pallas import triton as pltriton

    stream_kernels = tuple(stream_kernels)
    batch, t_len, d = partial.shape
    m = len(stream_kernels)
    check_shape(d=d, heads=heads, stream_kernels=stream_kernels, fuse=fuse)
    dbt, dwarps = default_tiles(d)
    bt, warps = block_t or dbt, num_warps or dwarps
    if bt not in BLOCK_T_CHOICES:
        raise ValueError(f"block_t={bt!r}: must be one of {BLOCK_T_CHOICES}")
    if warps not in NUM_WARPS_CHOICES:
        raise ValueError(f"num_warps={warps!r}: must be one of {NUM_WARPS_CHOICES}")
    gate = fuse == "gate"
    if gate and gate_params is None:
        raise ValueError("fuse='gate' needs gate_params = (w, scale, bias)")
    layout = fused._stream_layout(stream_kernels)
    has_bank = any(stream_kernels)
    max_lag = max([1, *stream_kernels])
    has_seg = segment_ids is not None and max_lag > 1
    t_pad = -(-t_len // bt) * bt
    front = FRONT if interpret else 0
    x = jnp.pad(partial, ((0, 0), (front, t_pad - t_len), (0, 0)))
    banks = jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32)
    q = jnp.asarray(query, F32)
    pad_t = lambda a, value=0.0: jnp.pad(a, ((0, 0), (0, 0), (0, t_pad - t_len)), constant_values=value)  # noqa: E731
    acc = jnp.pad(state.acc, ((0, 0), (0, 0), (0, t_pad - t_len), (0, 0)))
    pmax = pad_t(jnp.asarray(state.max, F32)[..., 0])
    pden = pad_t(jnp.asarray(state.denom, F32)[..., 0], 1.0)
    consts = [jnp.asarray(include_partial, F32)]
    if gate:
        w, scale, bias = gate_params
        consts += [jnp.asarray(scale, F32).reshape(()), *jnp.asarray(bias, F32).reshape(m)]
    consts = jnp.pad(jnp.stack(consts), (0, 8 * (-(-len(consts) // 8)) - len(consts)))

    whole = lambda a: pl.BlockSpec(a.shape, lambda b, t: (0,) * a.ndim)  # noqa: E731
    in_specs = [pl.BlockSpec((None, x.shape[1], d), lambda b, t: (b, 0, 0)), whole(banks), whole(q), whole(consts)]
    args = [x, banks, q, consts]
    for r in range(m):
        in_specs.append(pl.BlockSpec((None, None, bt, d), lambda b, t, r=r: (r, b, t, 0)))
        args.append(acc)
    for a in (pmax, pden):
        for r in range(m):
            in_specs.append(pl.BlockSpec((None, None, bt), lambda b, t, r=r: (r, b, t)))
            args.append(a)
    if gate:
        w_rows = jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1).reshape(m * m, d)
        in_specs.append(whole(w_rows))
        args.append(w_rows)
    if has_seg:
        seg = jnp.pad(jnp.asarray(segment_ids, jnp.int32), ((0, 0), (FRONT, t_pad - t_len)), constant_values=-1)
        in_specs.append(pl.BlockSpec((None, seg.shape[1]), lambda b, t: (b, 0)))
        args.append(seg)
    scalar_spec = pl.BlockSpec((None, bt), lambda b, t: (b, t))
    out_specs = [pl.BlockSpec((None, bt, d), lambda b, t: (b, t, 0))] + [scalar_spec] * (2 * m)
    out_shape = [jax.ShapeDtypeStruct((batch, t_pad, d), out_dtype)] + [
        jax.ShapeDtypeStruct((batch, t_pad), F32)] * (2 * m)
    kernel = functools.partial(_kernel, layout=layout, d=d, bt=bt, x_front=front, gate=gate, has_seg=has_seg,
                               eps=float(eps), gate_eps=float(gate_eps), triton=not interpret,
                               early_state=bool(early_state))
    h, *scalars = pl.pallas_call(
        kernel, grid=(batch, t_pad // bt), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        name="depth_attention_phase2_rows_forward",
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1), interpret=interpret,
    )(*args)
    dots = jnp.stack(scalars[:m])[:, :, :t_len, None]
    sumsq = jnp.stack(scalars[m:])[:, :, :t_len]
    return h[:, :t_len], (dots, sumsq)
