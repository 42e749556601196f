"""Fused expansion + scoring + mixing kernels of the Triton and Mosaic TPU back ends: ``scores``
(per token tile, every source expanded for every stream and dotted with all ``S*m`` queries, with
each stream's sum of squares) and ``mix`` (each source re-expanded and summed into phase 1's
accumulators, or merged with phase 2's state, optionally with the stream fusion folded in through
a ``stats`` and a ``gate`` pass), with a small XLA step between them; no expanded stream is
written to memory. The causal conv's halo comes from masked loads on Triton and from the previous
token tile elsewhere (``TokenWindow``). The design: docs/kernels.md §4, "Phase 1 forward" and "Phase 2
forward"."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference
from pallas_kernels.depth_attention import tpu_blocks
from pallas_kernels.depth_attention.tiling import Tiles

F32 = jnp.float32


# --------------------------------------------------------------------------- helpers


class TokenWindow:
    """Lag-shifted ``[block_t, width]`` views of rows ``t0 - delta ... t0 + bt - 1 - delta``
    of a ``[T, width]``-indexable ref region, zero before row 0; ``ahead(delta)``: rows
    ``t0 + delta ...`` (needs ``n_rows``, the region's row count; ``fill`` past its end).

    Two forms. Whole-T (Triton, the generic interpreter): ``ref`` holds every row and the
    window indexes it at ``t0``; Triton takes the halo by masked loads, the interpreter from the
    neighbouring tile of the same ref. Tiled (the Mosaic TPU kernels, forward and backward:
    ``tiled``, or ``prev`` / ``next`` given): ``ref`` is this program's ``[bt]``-row block only
    (local row 0 is token ``t0``), ``prev`` the ``halo`` rows just before it and ``next`` the
    ``halo`` rows just after it, each a second BlockSpec over the same array
    (``tpu_blocks.halo_spec``), indexed with the same ``lead`` and ``cs``. ``prev`` reads as
    ``fill`` on the first tile (``t0 == 0``) and ``next`` from row ``n_rows`` on, so their clamped
    block indices never leak a wrong row. ``shift(delta)`` and ``ahead(delta)`` then need
    ``delta <= halo``: ``tpu_blocks.halo_rows`` sizes the halo from the largest conv kernel
    (Eq. 10). The expansion's transpose reads ``dE`` ahead (``next``) and ``x`` behind
    (``prev``)."""

    def __init__(self, ref, lead: tuple, t0, bt: int, cs, backend: str, fill=0.0, dtype=F32, width=None,
                 n_rows=None, prev=None, next=None, tiled=False):
        self.ref, self.lead, self.t0, self.bt, self.cs, self.width = ref, lead, t0, bt, cs, width
        self.backend, self.fill, self.dtype, self.n_rows = backend, fill, dtype, n_rows
        self.prev, self.next = prev, next
        self.tiled = tiled or prev is not None or next is not None
        self._cat = None
        self._next = None
        self._cache = {}

    def _halo(self, ref, ok):
        """The ``halo`` rows of a halo ref, ``fill`` where ``ok`` is false."""
        rows = ref.shape[len(self.lead)]
        idx = (*self.lead, pl.ds(0, rows)) if self.cs is None else (*self.lead, pl.ds(0, rows), self.cs)
        return jnp.where(ok, ref[idx].astype(self.dtype), jnp.asarray(self.fill, self.dtype))

    def ahead(self, delta: int):
        """Rows ``t0 + delta ... t0 + bt - 1 + delta`` (``delta <= bt``), ``fill`` from row
        ``n_rows`` on: the transposed conv's view (``conv_transpose``)."""
        if delta == 0:
            return self.shift(0)
        if ("ahead", delta) in self._cache:
            return self._cache["ahead", delta]
        if self.tiled:
            if self.next is None:
                raise ValueError("TokenWindow.ahead of a tiled window needs the next-halo ref (next=)")
            if self._next is None:
                nxt = self._halo(self.next, self.t0 + self.bt < self.n_rows)
                self._next = jnp.concatenate([self.shift(0), nxt], axis=0)
            v = self._next[delta : self.bt + delta]
        elif self.backend == "triton":
            from jax.experimental.pallas import triton as pltriton

            rows = self.t0 + delta + jax.lax.broadcasted_iota(jnp.int32, (self.bt,), 0)
            ok = rows < self.n_rows
            if self.width is not None:
                ok = jnp.broadcast_to(ok[:, None], (self.bt, self.width))
            v = pltriton.load(self.ref.at[self._idx(self.t0 + delta)], mask=ok, other=self.fill).astype(self.dtype)
        else:
            if self._next is None:
                nxt = self.ref[self._idx(jnp.minimum(self.t0 + self.bt, self.n_rows - self.bt))].astype(self.dtype)
                nxt = jnp.where(self.t0 + self.bt < self.n_rows, nxt, jnp.asarray(self.fill, self.dtype))
                self._next = jnp.concatenate([self.shift(0), nxt], axis=0)
            v = self._next[delta : self.bt + delta]
        self._cache["ahead", delta] = v
        return v

    def _idx(self, start):
        if self.backend != "triton":  # starts are whole tiles here; Mosaic must see it (aligned loads)
            start = pl.multiple_of(start, self.bt)
        rows = pl.ds(start, self.bt)
        return (*self.lead, rows) if self.cs is None else (*self.lead, rows, self.cs)

    def shift(self, delta: int):
        if delta in self._cache:
            return self._cache[delta]
        if delta == 0:
            v = self.ref[self._idx(0 if self.tiled else self.t0)].astype(self.dtype)
        elif self.tiled:
            if self.prev is None:
                raise ValueError("TokenWindow.shift of a tiled window needs the previous-halo ref (prev=)")
            if self._cat is None:
                self._cat = jnp.concatenate([self._halo(self.prev, self.t0 > 0), self.shift(0)], axis=0)
            rows = self._cat.shape[0] - self.bt
            v = self._cat[rows - delta : rows - delta + self.bt]
        elif self.backend == "triton":
            from jax.experimental.pallas import triton as pltriton

            rows = self.t0 - delta + jax.lax.broadcasted_iota(jnp.int32, (self.bt,), 0)
            ok = rows >= 0
            if self.width is not None:
                ok = jnp.broadcast_to(ok[:, None], (self.bt, self.width))
            v = pltriton.load(self.ref.at[self._idx(self.t0 - delta)], mask=ok, other=self.fill).astype(self.dtype)
        else:
            if self._cat is None:
                cur = self.shift(0)
                prev = self.ref[self._idx(jnp.maximum(self.t0 - self.bt, 0))].astype(self.dtype)
                prev = jnp.where(self.t0 > 0, prev, jnp.asarray(self.fill, self.dtype))
                self._cat = jnp.concatenate([prev, cur], axis=0)
            v = self._cat[self.bt - delta : 2 * self.bt - delta]
        self._cache[delta] = v
        return v


def head_column(ref, idx, head, heads: int, backend: str):
    """``ref[*idx, head]`` (``[bt]``) of a ``[..., T, H]`` ref (``idx`` ends with the rows):
    this chunk's head column. Mosaic cannot load at a dynamic lane index, so off Triton the
    row of heads is loaded and the head picked by a one-hot sum, as ``fused._mix_kernel`` does
    (a select, not a product, so it is exact, ``x + 0``, whatever the other heads hold)."""
    if heads == 1:
        return ref[(*idx, 0)]
    if backend == "triton":
        return ref[(*idx, head)]
    onehot = jax.lax.broadcasted_iota(jnp.int32, (1, heads), 1) == head
    return jnp.sum(jnp.where(onehot, ref[(*idx, slice(None))], 0.0), axis=1)


def lag_masks(seg_ref, t0, bt: int, max_lag: int, backend: str, seg_prev=None):
    """``masks[delta]`` ``[bt, 1]`` float: token ``t - delta`` exists and shares ``t``'s segment.
    ``seg_prev``: the segment ids' previous-halo ref of a tiled window (``TokenWindow``; needed
    only with a conv, ``max_lag > 1``)."""
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt,), 0)
    # seg_ref is [Tp] or [Tp, 1] (tokens on sublanes, as Mosaic wants them: see scores_call)
    col = 0 if seg_ref is not None and len(seg_ref.shape) == 2 else None
    win = None
    if seg_ref is not None:
        win = TokenWindow(seg_ref, (), t0, bt, col, backend, fill=-1, dtype=jnp.int32, prev=seg_prev)
    masks = []
    for delta in range(max_lag):
        ok = rows - delta >= 0
        if win is not None and delta > 0:
            ok = ok & (win.shift(delta) == win.shift(0))
        masks.append(ok.astype(F32)[:, None])
    return masks


def stream_layout(stream_kernels: Sequence[int]):
    """(kernel, first tap index in the bank) per stream."""
    out, off = [], 0
    for k in stream_kernels:
        out.append((k, off))
        off += k
    return out


def expand_chunk(win: TokenWindow, bank_ref, bank_lead: tuple, cs, kernel: int, offset: int, masks):
    """One stream of one source chunk, ``[bt, bd]`` float32 (Eq. 10)."""
    if kernel == 0:
        return win.shift(0)
    y = None
    for delta in range(kernel):
        idx = (*bank_lead, offset + delta) if cs is None else (*bank_lead, offset + delta, cs)
        tap = bank_ref[idx].astype(F32)[None, :]
        term = tap * win.shift(delta)
        if delta:
            term = term * masks[delta]
        y = term if y is None else y + term
    return y


def _skips_sources(backend: str) -> bool:
    """Whether the kernels skip invalid sources (a scalar load and a branch per source) rather
    than compute them and mask their weights. The model's phase 1 runs on the whole source
    buffer with only the completed blocks valid (half of its ``n`` slots over a step), so
    computing them doubled phase 1's work on the H200. Every backend
    skips: Triton and interpret mode read the mask like any input, Mosaic TPU from scalar
    memory (``token_inputs``; compiled ahead of time, not yet timed on a TPU)."""
    return backend in ("triton", "interpret", "tpu")


def _live_input(valid, n: int, backend: str):
    """The ``int32[n]`` source mask the kernels branch on, or None (every source is computed)."""
    if valid is None or not _skips_sources(backend):
        return None
    return jnp.asarray(valid, jnp.int32).reshape(n)


def token_inputs(in_specs: list, args: list, seg, valid, n: int, t_pad: int, backend: str, batch_axis: int) -> bool:
    """Append the segment ids (``seg[B, Tp]`` as ``[B, Tp, 1]`` blocks: tokens on sublanes and a
    whole trailing dim, as Mosaic's block-shape rule wants them; grid axis ``batch_axis`` picks
    the row) and the source mask (``_live_input``) to a call's inputs, in the order the kernels
    read them. Returns whether the mask went in."""
    if seg is not None:
        in_specs.append(pl.BlockSpec((None, t_pad, 1), lambda *g: (g[batch_axis], 0, 0)))
        args.append(seg[:, :, None])
    live = _live_input(valid, n, backend)
    if live is not None:
        if backend == "tpu":  # a scalar per source, read by the scalar core: SMEM, whole
            from jax.experimental.pallas import tpu as pltpu

            in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        else:
            in_specs.append(pl.BlockSpec((n,), lambda *g: (0,)))
        args.append(live)
    return live is not None


class _Targets:
    """``S`` refs ``[...]`` read and written as one ``[S, ...]`` ref (target index first and
    static): phase 1's per-target state, whose ``S`` arrays stay apart so that no XLA op stacks
    them into, or slices them out of, one ``[S, m, B, T, d]`` array (``per_target``)."""

    def __init__(self, refs):
        self.refs = tuple(refs)
        self.dtype = self.refs[0].dtype

    def __getitem__(self, idx):
        return self.refs[idx[0]][tuple(idx[1:])]

    def __setitem__(self, idx, value):
        self.refs[idx[0]][tuple(idx[1:])] = value


def target_input(in_specs: list, args: list, arrays, block: tuple, index_map) -> int:
    """Append a per-target input: one ``[S, ...]`` array, or a sequence of ``S`` arrays ``[...]``
    (``per_target``), with the block shape and index map of the stacked form. Returns ``S`` when
    it went in as separate arrays (the kernel reads them through ``_Targets``), else 0."""
    if isinstance(arrays, (list, tuple)):
        for a in arrays:
            in_specs.append(pl.BlockSpec(block[1:], lambda *g: index_map(*g)[1:]))
            args.append(a)
        return len(arrays)
    in_specs.append(pl.BlockSpec(block, index_map))
    args.append(arrays)
    return 0


def next_target_ref(it, n_split: int):
    """The next kernel ref of an input ``target_input`` appended."""
    return _Targets(next(it) for _ in range(n_split)) if n_split else next(it)


def if_live(live_ref, i, work, otherwise=None):
    """Run ``work()`` for a valid source ``i`` (always without a mask), else ``otherwise()``."""
    if live_ref is None:
        work()
        return
    live = live_ref[i] != 0
    pl.when(live)(work)
    if otherwise is not None:
        pl.when(jnp.logical_not(live))(otherwise)


def _live_update(live_ref, i, update, carry):
    """``update(carry)`` for a valid source ``i``, else ``carry`` unchanged."""
    if live_ref is None:
        return update(carry)
    return jax.lax.cond(live_ref[i] != 0, update, lambda c: c, carry)


# --------------------------------------------------------------------------- kernels


# Register budget of the whole-tile channel sums (``_whole_tile_sums``), in float32 values per
# program: 8 tiles of 16 x 32 (32 registers a thread at 4 warps). Phase 2's scoring (4 dot and 4
# square accumulators at 16 x 32) and gate statistics (5) fit; phase 1's 8 targets (36 at 16 x 64)
# do not and keep the per-chunk reductions.
_WHOLE_TILE_BUDGET = 4096


def _whole_tile_sums(backend: str, n_accumulators: int, bt: int, bd: int) -> bool:
    """Whether a kernel's channel sums are carried as whole ``[bt, bd]`` tiles and reduced over
    channels once at the end (Triton, when ``n_accumulators`` such tiles fit the budget) rather
    than by a cross-lane reduction per chunk. Cross-lane and cross-row reductions inside the
    loops cost the reverse-T kernels most of their time on the H200; a function so the tests can force either form through the interpret path."""
    return backend == "triton" and n_accumulators * bt * bd <= _WHOLE_TILE_BUDGET


def _scores_kernel(*refs, stream_kernels, n, n_targets, heads, d, bt, bd, has_bank, has_seg, has_live, backend,
                   whole, tiled=False, has_halo=False):
    """Raw per-head dots with all queries and the sum of squares of every expanded chunk
    (zeros for a source the ``live`` mask skips).

    ``whole``: the dots and squares accumulate as ``[bt, bd]`` tiles, reduced over channels once
    per head (dots) and per source (squares), instead of once per chunk (``_whole_tile_sums``).
    ``tiled`` (Mosaic TPU): one source per program (grid axis 2), its ``[bt]``-row block and the
    halo before it if ``has_halo`` (``TokenWindow``'s tiled form); ``n`` is then 1 and the
    source mask is read at the program's source."""
    it = iter(refs)
    x_ref = next(it)  # [n, Tp, d]; tiled: [1, bt, d]
    x_prev = next(it) if has_halo else None  # [1, halo, d]
    bank_ref = next(it) if has_bank else None  # [n, K, d]
    q_ref = next(it)  # [S, m, d]
    seg_ref = next(it) if has_seg else None  # [Tp]
    seg_prev = next(it) if has_halo and has_seg else None  # [halo, 1]
    live_ref = next(it) if has_live else None  # [n] int32
    dots_ref = next(it)  # [S, n, m, bt, H]
    ss_ref = next(it)  # [n, m, bt]
    m = len(stream_kernels)
    layout = stream_layout(stream_kernels)
    t0 = pl.program_id(1) * bt
    max_lag = max([1, *stream_kernels])
    masks = lag_masks(seg_ref, t0, bt, max_lag, backend, seg_prev=seg_prev)
    dh = d // heads
    zero = jnp.zeros((bt, bd) if whole else (bt,), F32)
    fold = (lambda v: v) if whole else (lambda v: jnp.sum(v, axis=1))  # noqa: E731  (per chunk)
    finish = (lambda v: jnp.sum(v, axis=1)) if whole else (lambda v: v)  # noqa: E731  (at the write)

    def source_body(i, carry):
        def work():
            ss = [zero] * m
            for h in range(heads):

                def chunk_body(c, carry):
                    ss, dots = carry
                    c0 = h * dh + c * bd
                    cs = pl.ds(pl.multiple_of(c0, bd), bd)
                    win = TokenWindow(x_ref, (i,), t0, bt, cs, backend, width=bd, prev=x_prev, tiled=tiled)
                    ss, dots = list(ss), [list(row) for row in dots]
                    for r, (kernel, off) in enumerate(layout):
                        e = expand_chunk(win, bank_ref, (i,), cs, kernel, off, masks)
                        ss[r] = ss[r] + fold(e * e)
                        for s in range(n_targets):
                            q = q_ref[s, r, cs].astype(F32)[None, :]
                            dots[s][r] = dots[s][r] + fold(e * q)
                    return ss, dots

                dots0 = [[zero] * m for _ in range(n_targets)]
                ss, dots = jax.lax.fori_loop(0, dh // bd, chunk_body, (ss, dots0))
                for s in range(n_targets):
                    for r in range(m):
                        dots_ref[s, i, r, :, h] = finish(dots[s][r])
            for r in range(m):
                ss_ref[i, r, :, 0] = finish(ss[r])

        def skipped():
            empty = jnp.zeros((bt,), F32)
            for r in range(m):
                ss_ref[i, r, :, 0] = empty
                for s in range(n_targets):
                    for h in range(heads):
                        dots_ref[s, i, r, :, h] = empty

        if tiled:  # the program's source: block row 0, mask entry program_id(2)
            if live_ref is None:
                work()
            else:
                live = live_ref[pl.program_id(2)] != 0
                pl.when(live)(work)
                pl.when(jnp.logical_not(live))(skipped)
            return carry
        if_live(live_ref, i, work, skipped)
        return carry

    if tiled:
        source_body(0, 0)
    else:
        jax.lax.fori_loop(0, n, source_body, 0)


def _mix_kernel(*refs, stream_kernels, n, n_targets, heads, d, bt, bd, has_bank, has_seg, has_base, mode, backend,
                whole=False, has_live=False, split_targets=False, tiled=False, has_halo=False):
    """``z[s, r] = a * base + sum_i p[s, i, r] * E_r[x_i]`` on one chunk, then by ``mode``:
    ``acc`` writes z; ``mean``/``gate`` write ``h = sum_r g_r z_r``; ``stats`` writes the
    chunk's ``sum z^2`` and ``z @ W`` partials (the gate's inputs). ``whole`` (stats): those
    ``1 + m`` sums accumulate over the streams as ``[bt, bd]`` tiles and are reduced over
    channels once, not once per stream (``_whole_tile_sums``). ``split_targets`` (acc): one
    output per target (``_Targets``). ``tiled`` (Mosaic TPU): ``x`` is this program's
    ``[n, bt, bd]`` block, followed (``has_halo``) by the ``[n, halo, bd]`` block before it
    (``TokenWindow``)."""
    it = iter(refs)
    x_ref = next(it)  # [n, Tp, bd]; tiled: [n, bt, bd]
    x_prev = next(it) if has_halo else None  # [n, halo, bd]
    bank_ref = next(it) if has_bank else None  # [n, K, bd]
    p_ref = next(it)  # [S, n, m, bt, H]
    base_ref = next(it) if has_base else None  # [S, m, bt, bd]
    a_ref = next(it) if has_base else None  # [S, m, bt, H]
    g_ref = next(it) if mode == "gate" else None  # [bt, m]
    w_ref = next(it) if mode == "stats" else None  # [m, m, bd]: wt[r, j, channel]
    seg_ref = next(it) if has_seg else None  # [Tp]
    seg_prev = next(it) if has_halo and has_seg else None  # [halo, 1]
    live_ref = next(it) if has_live else None  # [n] int32: skip the invalid sources (p = 0 there)
    outs = list(it)
    acc_out = (_Targets(outs) if split_targets else outs[0]) if mode == "acc" else None
    m = len(stream_kernels)
    layout = stream_layout(stream_kernels)
    t0 = pl.program_id(1) * bt
    head = (pl.program_id(2) * bd) // (d // heads)

    def head_col(ref, lead):
        """``ref[*lead, :, head]`` (``[bt]``): this chunk's head column of a ``[..., bt, H]`` ref."""
        if heads == 1:
            return ref[(*lead, slice(None), 0)]
        if backend == "triton":
            return ref[(*lead, slice(None), head)]
        # Mosaic cannot load at a dynamic lane index: load the row of heads, pick by a one-hot sum.
        onehot = (jax.lax.broadcasted_iota(jnp.int32, (1, heads), 1) == head).astype(F32)
        return jnp.sum(ref[(*lead, slice(None), slice(None))] * onehot, axis=1)
    max_lag = max([1, *stream_kernels])
    masks = lag_masks(seg_ref, t0, bt, max_lag, backend, seg_prev=seg_prev)
    zero = jnp.zeros((bt, bd), F32)
    h_acc = zero
    sq = jnp.zeros((bt, bd) if whole else (bt,), F32)
    zw = [sq] * m
    fold = (lambda v: v) if whole else (lambda v: jnp.sum(v, axis=1))  # noqa: E731

    for r, (kernel, off) in enumerate(layout):

        def source_body(i, accs, kernel=kernel, off=off, r=r):
            def update(accs):
                win = TokenWindow(x_ref, (i,), t0, bt, slice(None), backend, width=bd, prev=x_prev, tiled=tiled)
                e = expand_chunk(win, bank_ref, (i,), slice(None), kernel, off, masks)
                return [accs[s] + head_col(p_ref, (s, i, r))[:, None] * e for s in range(n_targets)]

            return _live_update(live_ref, i, update, accs)

        accs = jax.lax.fori_loop(0, n, source_body, [zero] * n_targets)
        for s in range(n_targets):
            z = accs[s]
            if has_base:
                z = z + head_col(a_ref, (s, r))[:, None] * base_ref[s, r, :, :].astype(F32)
            if mode == "acc":
                acc_out[s, r, :, :] = z.astype(acc_out.dtype)
            elif mode == "mean":
                h_acc = h_acc + z * (1.0 / m)
            elif mode == "gate":
                h_acc = h_acc + g_ref[:, r][:, None] * z
            else:  # stats
                sq = sq + fold(z * z)
                for j in range(m):
                    zw[j] = zw[j] + fold(z * w_ref[r, j, :].astype(F32)[None, :])
    if mode in ("mean", "gate"):
        outs[0][...] = h_acc.astype(outs[0].dtype)
    elif mode == "stats":
        finish = (lambda v: jnp.sum(v, axis=1)) if whole else (lambda v: v)  # noqa: E731
        outs[0][:, 0] = finish(sq)
        for j in range(m):
            outs[1][:, j] = finish(zw[j])


# --------------------------------------------------------------------------- calls


def pad_tokens(x, axis: int, t_pad: int, value=0):
    extra = t_pad - x.shape[axis]
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def call_kwargs(backend: str, tiles: Tiles, interpret, semantics):
    if backend == "triton":
        from jax.experimental.pallas import triton as pltriton

        return dict(
            compiler_params=pltriton.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
            interpret=interpret,
        )
    from jax.experimental.pallas import tpu as pltpu

    return dict(compiler_params=pltpu.CompilerParams(dimension_semantics=semantics), interpret=interpret)


def _tpu_token_inputs(in_specs: list, args: list, seg, valid, n: int, bt: int, halo: int, backend: str) -> bool:
    """``token_inputs`` of the tiled TPU kernels: the segment ids as ``[bt, 1]`` blocks of
    token tile ``g[1]`` plus (``halo``) their halo block before it, and the source mask."""
    if seg is not None:
        specs = tpu_blocks.token_specs(pl.BlockSpec((None, bt, 1), lambda *g: (g[0], g[1], 0)), 1, bt, halo)
        in_specs += specs
        args += [seg[:, :, None]] * len(specs)
    return token_inputs(in_specs, args, None, valid, n, 0, backend, batch_axis=0)


def scores_call(x, banks, queries, seg, *, stream_kernels, heads, tiles: Tiles, backend, interpret, valid=None,
                tpu=None):
    """``x[n, B, Tp, d]`` -> ``dots[S, n, m, B, Tp, H]``, ``sumsq[n, m, B, Tp]`` (float32);
    ``valid[n]``: sources to compute (the others may be skipped, their outputs zero).
    ``tpu`` (a ``tpu_blocks.TpuTile``, Mosaic TPU): the tiled form, ``_scores_tiled``."""
    if tpu is not None:
        return _scores_tiled(x, banks, queries, seg, stream_kernels=stream_kernels, heads=heads, tiles=tiles,
                             backend=backend, interpret=interpret, valid=valid, tpu=tpu)
    n, batch, t_pad, d = x.shape
    n_targets, m = queries.shape[:2]
    bt, bd = tiles.bt_scores, tiles.block_d_scores
    has_bank = banks is not None and any(stream_kernels)
    has_seg = seg is not None
    in_specs = [pl.BlockSpec((n, None, t_pad, d), lambda b, t: (0, b, 0, 0))]
    args = [x]
    if has_bank:
        in_specs.append(pl.BlockSpec(banks.shape, lambda b, t: (0, 0, 0)))
        args.append(banks)
    in_specs.append(pl.BlockSpec(queries.shape, lambda b, t: (0, 0, 0)))
    args.append(queries)
    has_live = token_inputs(in_specs, args, seg, valid, n, t_pad, backend, batch_axis=0)
    kernel = functools.partial(
        _scores_kernel, stream_kernels=tuple(stream_kernels), n=n, n_targets=n_targets, heads=heads, d=d,
        bt=bt, bd=bd, has_bank=has_bank, has_seg=has_seg, has_live=has_live, backend=backend,
        whole=_whole_tile_sums(backend, (n_targets + 1) * m, bt, bd),
    )
    dots, sumsq = pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((n_targets, n, m, None, bt, heads), lambda b, t: (0, 0, 0, b, t, 0)),
            pl.BlockSpec((n, m, None, bt, 1), lambda b, t: (0, 0, b, t, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_targets, n, m, batch, t_pad, heads), F32),
            jax.ShapeDtypeStruct((n, m, batch, t_pad, 1), F32),
        ],
        name="depth_attention_scores",
        **call_kwargs(backend, tiles, interpret, ("parallel", "parallel")),
    )(*args)
    return dots, sumsq[..., 0]


def _scores_tiled(x, banks, queries, seg, *, stream_kernels, heads, tiles, backend, interpret, valid, tpu):
    """``scores_call`` on the Mosaic TPU: grid ``(B, Tp / bt, n)``, one source's ``[bt, d]``
    block and its conv halo per program (``d`` padded to whole 128-lane heads by the caller),
    its bank row, all queries; VMEM limit from ``tpu`` (docs/kernels.md §4, "Mosaic TPU tiling")."""
    n, batch, t_pad, d = x.shape
    n_targets, m = queries.shape[:2]
    bt, bd, halo = tpu.block_t, tpu.block_d, tpu.halo
    has_bank = banks is not None and any(stream_kernels)
    in_specs = tpu_blocks.token_specs(pl.BlockSpec((1, None, bt, d), lambda b, t, i: (i, b, t, 0)), 2, bt, halo)
    args = [x] * len(in_specs)
    if has_bank:
        in_specs.append(pl.BlockSpec((1, banks.shape[1], d), lambda b, t, i: (i, 0, 0)))
        args.append(banks)
    in_specs.append(pl.BlockSpec(queries.shape, lambda b, t, i: (0, 0, 0)))
    args.append(queries)
    has_live = _tpu_token_inputs(in_specs, args, seg, valid, n, bt, halo, backend)
    kernel = functools.partial(
        _scores_kernel, stream_kernels=tuple(stream_kernels), n=1, n_targets=n_targets, heads=heads, d=d,
        bt=bt, bd=bd, has_bank=has_bank, has_seg=seg is not None, has_live=has_live, backend=backend,
        whole=False, tiled=True, has_halo=halo > 0,
    )
    dots, sumsq = pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt, n),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((n_targets, 1, m, None, bt, heads), lambda b, t, i: (0, i, 0, b, t, 0)),
            pl.BlockSpec((1, m, None, bt, 1), lambda b, t, i: (i, 0, b, t, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_targets, n, m, batch, t_pad, heads), F32),
            jax.ShapeDtypeStruct((n, m, batch, t_pad, 1), F32),
        ],
        name="depth_attention_scores",
        compiler_params=tpu_blocks.compiler_params(("parallel", "parallel", "parallel"), tpu),
        interpret=interpret,
    )(*args)
    return dots, sumsq[..., 0]


def phase1_scores(sources, x, banks, queries, seg, segment_ids, *, valid, stream_kernels, heads, tiles: Tiles,
                  backend, interpret, mosaic=False):
    """Phase 1's scoring pass: ``scores_call`` on the T-padded sources ``x``, or with ``mosaic``
    the Mosaic GPU kernel (``mosaic_gpu.phase1_scores``) on the unpadded ``sources`` and
    ``segment_ids``, its outputs padded to ``x``'s T (zeros, as the Triton kernel gives there)."""
    if not mosaic:
        return scores_call(x, banks, queries, seg, stream_kernels=stream_kernels, heads=heads, tiles=tiles,
                           backend=backend, interpret=interpret, valid=valid)
    from pallas_kernels.depth_attention import mosaic_gpu  # it imports this module

    dots, sumsq = mosaic_gpu.phase1_scores(sources, banks, queries, segment_ids, valid, stream_kernels=stream_kernels,
                                           heads=heads, interpret=interpret)
    t_pad = x.shape[2]
    return pad_tokens(dots, 4, t_pad), pad_tokens(sumsq, 3, t_pad)


def gate_rows(w, m: int, d: int):
    """The gate's ``W[m d, m]`` as ``wt[r, j, c] = W[r d + c, j]`` (float32), the layout the
    statistics kernels (``mix_call(mode="stats")``, ``fused_bwd_phase2._stats_kernel``) read it
    in: their ``[block_d]`` channel run per ``(r, j)`` is then contiguous, not strided by ``m``.
    Measured on the H200: 0.98 -> 0.69 and 1.07 -> 0.81 ms per
    call at ``base``. The two kernels built on ``fused_bwd_phase2._dz`` read ``gate_cols``
    instead: there the strided layout was 3-5% faster, timed side by side."""
    return jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1)


def gate_cols(w, m: int, d: int):
    """The gate's ``W[m d, m]`` as ``w3[r, c, j] = W[r d + c, j]`` (float32), the layout ``_dz``
    reads it in (see ``gate_rows``)."""
    return jnp.asarray(w, F32).reshape(m, d, m)


def mix_call(x, banks, p, seg, *, base=None, a=None, gate=None, w=None, mode, stream_kernels, heads, tiles: Tiles,
             backend, interpret, out_dtype=F32, valid=None, split_targets=False, tpu=None):
    """See ``_mix_kernel``. ``p[S, n, m, B, Tp, H]``; ``base[S, m, B, Tp, d]``; ``a`` like ``p``
    without ``n``; ``gate[B, Tp, m]``; ``w[m, m, d]`` (``gate_rows``); ``valid[n]``: sources that
    may have ``p != 0`` (the others may be skipped). ``split_targets`` (``mode="acc"``): return a list of
    ``S`` arrays ``[m, B, Tp, d]``, written by the kernel as separate outputs. ``tpu`` (a
    ``tpu_blocks.TpuTile``, Mosaic TPU): its ``[bt, bd]`` tile, ``x`` mapped as ``[n, bt, bd]``
    token blocks plus the conv halo before them (``tpu_blocks.halo_spec``), and its VMEM limit."""
    n, batch, t_pad, d = x.shape
    n_targets, m = p.shape[0], p.shape[2]
    bt, bd = (tpu.block_t, tpu.block_d) if tpu is not None else tiles.mix_tile(mode)
    if (d // heads) % bd or t_pad % bt:
        raise ValueError(f"mix_call: a {bt} x {bd} tile must divide the padded tokens {t_pad} and the head width "
                         f"{d // heads}")
    has_bank = banks is not None and any(stream_kernels)
    has_seg = seg is not None
    has_base = base is not None
    nc = d // bd
    if tpu is not None:
        in_specs = tpu_blocks.token_specs(pl.BlockSpec((n, None, bt, bd), lambda b, t, c: (0, b, t, c)), 2, bt,
                                          tpu.halo)
        args = [x] * len(in_specs)
    else:
        in_specs = [pl.BlockSpec((n, None, t_pad, bd), lambda b, t, c: (0, b, 0, c))]
        args = [x]
    if has_bank:
        in_specs.append(pl.BlockSpec((n, banks.shape[1], bd), lambda b, t, c: (0, 0, c)))
        args.append(banks)
    in_specs.append(pl.BlockSpec((n_targets, n, m, None, bt, heads), lambda b, t, c: (0, 0, 0, b, t, 0)))
    args.append(p)
    if has_base:
        in_specs.append(pl.BlockSpec((n_targets, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c)))
        in_specs.append(pl.BlockSpec((n_targets, m, None, bt, heads), lambda b, t, c: (0, 0, b, t, 0)))
        args += [base, a]
    if mode == "gate":
        in_specs.append(pl.BlockSpec((None, bt, m), lambda b, t, c: (b, t, 0)))
        args.append(gate)
    if mode == "stats":
        in_specs.append(pl.BlockSpec((m, m, bd), lambda b, t, c: (0, 0, c)))
        args.append(w)
    if tpu is not None:
        has_live = _tpu_token_inputs(in_specs, args, seg, valid, n, bt, tpu.halo, backend)
    else:
        has_live = token_inputs(in_specs, args, seg, valid, n, t_pad, backend, batch_axis=0)
    if mode == "acc" and split_targets:
        out_specs = [pl.BlockSpec((m, None, bt, bd), lambda b, t, c: (0, b, t, c))] * n_targets
        out_shape = [jax.ShapeDtypeStruct((m, batch, t_pad, d), out_dtype)] * n_targets
    elif mode == "acc":
        out_specs = [pl.BlockSpec((n_targets, m, None, bt, bd), lambda b, t, c: (0, 0, b, t, c))]
        out_shape = [jax.ShapeDtypeStruct((n_targets, m, batch, t_pad, d), out_dtype)]
    elif mode in ("mean", "gate"):
        out_specs = [pl.BlockSpec((None, bt, bd), lambda b, t, c: (b, t, c))]
        out_shape = [jax.ShapeDtypeStruct((batch, t_pad, d), out_dtype)]
    else:
        # [B, nc, Tp, 1] and [B, nc, Tp, m]: the token tile and a full trailing dim last (Mosaic's
        # block-shape rule); returned below as [B, Tp, nc] and [B, Tp, nc, m]
        out_specs = [
            pl.BlockSpec((None, None, bt, 1), lambda b, t, c: (b, c, t, 0)),
            pl.BlockSpec((None, None, bt, m), lambda b, t, c: (b, c, t, 0)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((batch, nc, t_pad, 1), F32),
            jax.ShapeDtypeStruct((batch, nc, t_pad, m), F32),
        ]
    kernel = functools.partial(
        _mix_kernel, stream_kernels=tuple(stream_kernels), n=n, n_targets=n_targets, heads=heads, d=d, bt=bt,
        bd=bd, has_bank=has_bank, has_seg=has_seg, has_base=has_base, mode=mode, backend=backend,
        whole=mode == "stats" and _whole_tile_sums(backend, 1 + m, bt, bd), has_live=has_live,
        split_targets=mode == "acc" and split_targets,
        **({"tiled": True, "has_halo": tpu.halo > 0} if tpu is not None else {}),
    )
    out = pl.pallas_call(
        kernel,
        grid=(batch, t_pad // bt, nc),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name=f"depth_attention_mix_{mode}",
        **(call_kwargs(backend, tiles, interpret, ("parallel", "parallel", "parallel")) if tpu is None else
           dict(compiler_params=tpu_blocks.compiler_params(("parallel", "parallel", "parallel"), tpu),
                interpret=interpret)),
    )(*args)
    if mode == "stats":
        return out[0][..., 0].transpose(0, 2, 1), out[1].transpose(0, 2, 1, 3)
    if mode == "acc" and split_targets:
        return list(out)
    return out[0]


# --------------------------------------------------------------------------- reads


def tpu_scores_tile(*, t_len: int, d: int, heads: int, n_targets: int, n_streams: int, max_kernel: int, n_taps: int,
                    x_itemsize: int, cap_t=None, cap_d=None, vmem=None, name="scores") -> tpu_blocks.TpuTile:
    """The scoring kernel's tile (``scores_call``, one source per program): its ``[block_t, d]``
    source block and halo, the bank and queries, the dots (``[S, m, block_t, H]``, H padded to 128
    lanes) and sums of squares, all double-buffered, plus the window's live ``[block_t, block_d]``
    shifts (one per lag). ``d``: the real width (heads padded here)."""
    dh_pad = tpu_blocks.padded_head_width(d // heads)
    d_pad = dh_pad * heads
    halo = tpu_blocks.halo_rows(max_kernel, x_itemsize)
    size = tpu_blocks.block_bytes

    def need(bt, bd):
        blocks = (size((bt + halo, d_pad), x_itemsize) + size((max(n_taps, 1), d_pad), 4)
                  + size((n_targets * n_streams, d_pad), 4) + 2 * size((bt, 1), 4)  # segment ids, halo (bound)
                  + size((n_targets * n_streams * bt, heads), 4) + size((n_streams * bt, 1), 4))
        return 2 * blocks + (max_kernel + 3) * size((bt + halo, bd), 4)

    return tpu_blocks.choose(need, name=name, dhp=dh_pad, t_len=t_len, max_kernel=max_kernel,
                             itemsize=x_itemsize, cap_t=cap_t, cap_d=cap_d, vmem=vmem)


def tpu_mix_tile(mode: str, *, t_len: int, d: int, heads: int, n_sources: int, n_targets: int, n_streams: int,
                 max_kernel: int, n_taps: int, x_itemsize: int, out_itemsize: int, base_itemsize: int | None = None,
                 cap_t=None, cap_d=None, vmem=None) -> tpu_blocks.TpuTile:
    """The mixing kernel's tile (``mix_call`` in ``mode``): all ``n`` sources' ``[block_t,
    block_d]`` blocks and halos, the weights ``p`` (``[S, n, m, block_t, H]``, H padded to 128
    lanes: the largest block at phase 1's sizes), phase 2's base state and its weight, the gate
    or its ``W`` chunk, the outputs, all double-buffered, plus ``S`` float32 accumulators and the
    window's shifts."""
    item = min(x_itemsize, out_itemsize, base_itemsize or 4)
    halo = tpu_blocks.halo_rows(max_kernel, item)
    s, n, m = n_targets, n_sources, n_streams
    size = tpu_blocks.block_bytes

    def need(bt, bd):
        blocks = (size((n * (bt + halo), bd), x_itemsize) + size((n * max(n_taps, 1), bd), 4)
                  + size((s * n * m * bt, heads), 4) + 2 * size((bt, 1), 4))
        if base_itemsize is not None:
            blocks += size((s * m * bt, bd), base_itemsize) + size((s * m * bt, heads), 4)
        if mode == "gate":
            blocks += size((bt, m), 4)
        if mode == "stats":
            blocks += size((m * m, bd), 4) + size((bt, 1), 4) + size((bt, m), 4)
        elif mode == "acc":
            blocks += size((s * m * bt, bd), out_itemsize)
        else:
            blocks += size((bt, bd), out_itemsize)
        return 2 * blocks + (s + max_kernel + 4) * size((bt + halo, bd), 4)

    return tpu_blocks.choose(need, name=f"mix ({mode})", dhp=tpu_blocks.padded_head_width(d // heads), t_len=t_len,
                             max_kernel=max_kernel, itemsize=item, cap_t=cap_t, cap_d=cap_d, vmem=vmem)


def tpu_token_unit(*tiles) -> int:
    """The token padding unit of tiled TPU calls: their largest ``block_t`` (each a power-of-two
    multiple of one halo, so the others divide it)."""
    return max(t.block_t for t in tiles)


def prepare_tokens(t_len, segment_ids, tiles, unit=None):
    unit = tiles.block_t if unit is None else unit
    t_pad = -(-t_len // unit) * unit
    seg = None if segment_ids is None else pad_tokens(jnp.asarray(segment_ids, jnp.int32), 1, t_pad, -1)
    return t_pad, seg


def phase1_forward(sources, banks, queries, valid=None, *, stream_kernels, heads, segment_ids, eps, tiles,
                   backend, interpret, per_target=False, state_dtype=F32, mosaic_scores=False, mosaic_mix=False):
    """Fused phase 1; same contract as ``reference.phase1`` (with ``per_target``, as
    ``reference.split_targets`` of it: each target's state is its own output of the kernel).
    ``state_dtype``: the dtype the kernel writes ``acc`` in (``api.phase1`` says why); the
    weights and sums are float32 either way. ``mosaic_scores`` / ``mosaic_mix``: the scoring /
    mixing pass as the Mosaic GPU kernel (``mosaic_gpu.phase1_scores`` / ``phase1_mix``)."""
    n, _, t_len, d = sources.shape
    kw = dict(stream_kernels=stream_kernels, heads=heads, tiles=tiles, backend=backend, interpret=interpret)
    tpu = backend == "tpu"
    if tpu:  # tiled T, lane-padded heads, tiles from the chip's VMEM (docs/kernels.md §4)
        shape = dict(t_len=t_len, d=d, heads=heads, n_targets=queries.shape[0], n_streams=len(stream_kernels),
                     max_kernel=max([1, *stream_kernels]), n_taps=sum(stream_kernels),
                     x_itemsize=sources.dtype.itemsize, cap_t=tiles.tpu_block_t, cap_d=tiles.tpu_block_d)
        score_tile = tpu_scores_tile(**shape)
        mix_tile = tpu_mix_tile("acc", n_sources=n, out_itemsize=jnp.dtype(state_dtype).itemsize, **shape)
        t_pad, seg = prepare_tokens(t_len, segment_ids, tiles, tpu_token_unit(score_tile, mix_tile))
        x = pad_tokens(tpu_blocks.pad_heads(sources, heads), 2, t_pad)
        banks, queries = tpu_blocks.pad_heads(banks, heads), tpu_blocks.pad_heads(queries, heads)
        dots, sumsq = scores_call(x, banks, queries, seg, valid=valid, tpu=score_tile, **kw)
    else:
        mix_tile = None
        t_pad, seg = prepare_tokens(t_len, segment_ids, tiles)
        x = pad_tokens(sources, 2, t_pad)
        dots, sumsq = phase1_scores(sources, x, banks, queries, seg, segment_ids, valid=valid, mosaic=mosaic_scores,
                                    **kw)
    s = dots * jax.lax.rsqrt(sumsq / d + eps)[None, ..., None]  # [S, n, m, B, Tp, H]
    ok = reference._source_valid(n, valid)[None, :, None, None, None, None]
    s = jnp.where(ok, s, reference.NEG_LARGE)
    smax = jnp.max(s, axis=1)
    p = jnp.where(ok, jnp.exp(s - smax[:, None]), 0.0)
    denom = jnp.sum(p, axis=1)
    if mosaic_mix:
        from pallas_kernels.depth_attention import mosaic_gpu  # it imports this module

        acc = mosaic_gpu.phase1_mix(sources, banks, p, segment_ids, valid, stream_kernels=stream_kernels, heads=heads,
                                    out_dtype=state_dtype, per_target=per_target, interpret=interpret)
    else:
        acc = mix_call(x, banks, p, seg, mode="acc", valid=valid, split_targets=per_target, out_dtype=state_dtype,
                       tpu=mix_tile, **kw)
        if tpu:
            unpad = lambda a: tpu_blocks.unpad_heads(a, heads, d)  # noqa: E731
            acc = [unpad(a) for a in acc] if per_target else unpad(acc)
    cut = lambda a: a[..., :t_len, :]  # noqa: E731
    if per_target:
        return tuple(reference.SoftmaxState(max=cut(smax[i]), denom=cut(denom[i]), acc=cut(acc[i]))
                     for i in range(len(acc)))
    return reference.SoftmaxState(max=cut(smax), denom=cut(denom), acc=cut(acc))


def phase2_forward(state, partial, bank, query, include_partial=True, gate_params=None, *, fuse, stream_kernels,
                   heads, segment_ids, eps, gate_eps, tiles, backend, interpret, out_dtype=F32, return_scores=False):
    """Fused phase 2. ``fuse=None`` returns ``z[m, B, T, d]`` like ``reference.phase2``;
    ``"mean"`` / ``"gate"`` return ``h[B, T, d]`` (``fuse_mean`` / ``fuse_gate`` of it).
    ``return_scores``: also return the scoring pass's per-token scalars ``(dots[m, B, T, H],
    sumsq[m, B, T])`` (the raw per-head dots and the keys' sums of squares), which the Pallas
    backward would otherwise recompute (``fused_bwd_phase2``'s pass 0)."""
    batch, t_len, d = partial.shape
    m = query.shape[0]
    kw = dict(stream_kernels=stream_kernels, heads=heads, tiles=tiles, backend=backend, interpret=interpret)
    tpu, mix_tiles, score_tile = backend == "tpu", {}, None
    if tpu:  # tiled T, lane-padded heads, tiles from the chip's VMEM (docs/kernels.md §4)
        shape = dict(t_len=t_len, d=d, heads=heads, n_targets=1, n_streams=m, max_kernel=max([1, *stream_kernels]),
                     n_taps=sum(stream_kernels), x_itemsize=partial.dtype.itemsize, cap_t=tiles.tpu_block_t,
                     cap_d=tiles.tpu_block_d)
        score_tile = tpu_scores_tile(**shape)
        modes = ["acc"] if fuse is None else ["mean"] if fuse == "mean" else ["stats", "gate"]
        for mode in modes:
            mix_tiles[mode] = tpu_mix_tile(
                mode, n_sources=1, out_itemsize=4 if mode == "stats" else jnp.dtype(out_dtype).itemsize,
                base_itemsize=state.acc.dtype.itemsize, **shape)
        t_pad, seg = prepare_tokens(t_len, segment_ids, tiles, tpu_token_unit(score_tile, *mix_tiles.values()))
        partial, bank, query = (tpu_blocks.pad_heads(a, heads) for a in (partial, bank, query))
        state = state._replace(acc=tpu_blocks.pad_heads(state.acc, heads))
    else:
        t_pad, seg = prepare_tokens(t_len, segment_ids, tiles)
    x = pad_tokens(partial, 1, t_pad)[None]
    banks = None if bank is None else bank[None]
    dots, sumsq = scores_call(x, banks, query[None], seg, tpu=score_tile, **kw)
    s = dots[0, 0] * jax.lax.rsqrt(sumsq[0] / d + eps)[..., None]  # [m, B, Tp, H]
    pmax = pad_tokens(state.max, 2, t_pad)
    pden = pad_tokens(state.denom, 2, t_pad, 1.0)
    include = jnp.asarray(include_partial, bool)
    s = jnp.where(include, s, reference.NEG_LARGE)
    new_max = jnp.maximum(pmax, s)
    keep = jnp.exp(pmax - new_max)
    pnew = jnp.where(include, jnp.exp(s - new_max), 0.0)
    denom = pden * keep + pnew
    a = (keep / denom)[None]
    b = (pnew / denom)[None, None]
    base = pad_tokens(state.acc, 2, t_pad)[None]
    unpad = (lambda v: tpu_blocks.unpad_heads(v, heads, d)) if tpu else (lambda v: v)  # noqa: E731

    def mix(mode, **more):
        return mix_call(x, banks, b, seg, base=base, a=a, mode=mode, tpu=mix_tiles.get(mode), **kw, **more)

    if fuse is None:
        if return_scores:
            raise ValueError("return_scores needs a fused phase 2 (fuse='mean' or 'gate')")
        return unpad(mix("acc", out_dtype=out_dtype)[0, :, :, :t_len])
    if fuse == "mean":
        out = unpad(mix("mean", out_dtype=out_dtype)[:, :t_len])
    else:
        w, scale, bias = gate_params
        # W as wt[r, j, c]: each (r, j) channel run contiguous (gate_rows); zero rows on padded lanes
        wt = tpu_blocks.pad_heads(gate_rows(w, m, d), heads) if tpu else gate_rows(w, m, d)
        sq, zw = mix("stats", w=wt)
        inv = jax.lax.rsqrt(jnp.sum(sq, axis=-1) / (m * d) + gate_eps)  # [B, Tp]: the real d
        g = jax.nn.sigmoid(scale * (inv[..., None] * jnp.sum(zw, axis=2)) + bias)  # [B, Tp, m]
        out = unpad(mix("gate", gate=g, out_dtype=out_dtype)[:, :t_len])
    if return_scores:
        return out, (dots[0, 0, :, :, :t_len], sumsq[0, :, :, :t_len])
    return out
