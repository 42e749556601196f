"""Phase 1's mixing pass in Mosaic GPU (``phase1_mix``: ``acc[s, r] = sum_i p[s, i, r] E_r[x_i]``,
Eq. 11's weighted sum; ``fused.mix_call(mode="acc")``). docs/kernels.md §4, "Phase 1 forward"."""

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
    BLOCK_T, F32, KernelConfig, LagWindow, SMEM_BYTES, expand_item, jitted_kernel, lane_plgpu, per_row, smem_sum,
    stage_table_and_masks, store_group, tile_partial, tile_smem, valid_first, window_elems,
)

# Items in flight in ``phase1_mix``'s TMA pipeline (``mix_smem_bytes`` counts them): 5.18 against
# 5.60 ms with 2 at `base`.
MIX_SLOTS = 3
# ``phase1_mix``'s channel chunks, first choice first (``choose_block_d``)
MIX_BLOCK_D_CHOICES = (32,)
# Where the mixing pass's items find their source's lag window. "per_item": each item (chunk,
# stream, source) brings it into its pipeline slot, so a source's window comes once per stream
# (4 times for MSAR); "per_chunk": a chunk's window of each valid source comes once, into a buffer
# of its own that all the streams read, and is refilled for the next chunk as the last stream is
# done with it (the lead: the other sources' items). "per_chunk" holds a window per source slot
# (``n`` of them) and stages the targets' stores in two halves to stay at two programs per SM.
# "per_chunk" by measurement on the H200 (docs/kernels.md; the same bits):
# 4.175 -> 3.962 ms per call at `base`'s last block (-5.1%), 3.216 -> 2.851 at the bench shape
# (-11.3%); the MSAR `base` step's mixing passes 56.0 -> 52.5 ms. Where a window per
# source does not fit (more than 31 sources at 2 targets), ``phase1_mix`` takes "per_item"
# (``resolve_window_fetch``).
MIX_WINDOW_FETCHES = ("per_item", "per_chunk")


def resolve_window_fetch(window_fetch: str | None, fits) -> str:
    """``phase1_mix``'s window fetch (``MIX_WINDOW_FETCHES``): ``window_fetch`` if given, else
    ``"per_chunk"`` (a window per source) where ``fits("per_chunk")`` says one program's shared
    memory holds it, ``"per_item"`` otherwise."""
    if window_fetch is not None:
        if window_fetch not in MIX_WINDOW_FETCHES:
            raise ValueError(f"phase1_mix: window_fetch={window_fetch!r}: must be one of {MIX_WINDOW_FETCHES}")
        return window_fetch
    return "per_chunk" if fits("per_chunk") else "per_item"


def _staged_targets(n_targets: int, window_fetch: str) -> int:
    """Targets whose state tiles ``phase1_mix`` stages in shared memory at once (``MIX_WINDOW_FETCHES``)."""
    return -(-n_targets // 2) if window_fetch == "per_chunk" else n_targets


def mix_smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, out_dtype, n_targets: int,
                   n_sources: int, n_slots: int | None = None, window_fetch: str | None = None, **_unused) -> int:
    """Shared memory of one program of ``phase1_mix`` (its scratch list, ``smem_sum``; ``n_slots``:
    None is ``MIX_SLOTS``; ``window_fetch``: None is what ``phase1_mix`` takes by default,
    ``"per_chunk"`` where it fits (``resolve_window_fetch``); the ``"per_chunk"`` form holds one
    window per source slot: ``n_sources`` of them)."""
    if window_fetch is None:
        kw = dict(block_d=block_d, stream_kernels=stream_kernels, heads=heads, x_dtype=x_dtype, out_dtype=out_dtype,
                  n_targets=n_targets, n_sources=n_sources, n_slots=n_slots)
        window_fetch = resolve_window_fetch(None, lambda fetch: mix_smem_bytes(**kw, window_fetch=fetch) <= SMEM_BYTES)
    bt, bd, m, n_slots = BLOCK_T, block_d, len(stream_kernels), n_slots or MIX_SLOTS
    per_chunk = window_fetch == "per_chunk"
    n_windows = n_sources if per_chunk else n_slots
    window = window_elems(stream_kernels, bd) * jnp.dtype(x_dtype).itemsize
    return smem_sum(n_windows * window, *(n_slots * kernel * bd * 4 for kernel in stream_kernels),
                    n_slots * n_targets * heads * bt * 4,
                    _staged_targets(n_targets, window_fetch) * bt * bd * jnp.dtype(out_dtype).itemsize,
                    (n_sources + 1) * 64 * 4, bt * 4, barriers=(n_sources if per_chunk else 0) + m * n_slots + 1)


def phase1_mix(sources, banks, p, segment_ids, valid, *, stream_kernels, heads: int, out_dtype=F32,
               per_target: bool = False, block_d: int | None = None, n_slots: int | None = None,
               interpret: bool = False, window_fetch: str | None = None):
    """Phase 1's mixing pass (``fused.mix_call(mode="acc")``) as one Mosaic GPU kernel:
    ``acc[s, r] = sum_i p[s, i, r] E_r[x_i]`` (Eq. 11's weighted sum over the completed sources,
    before the merge with the partial), each source's stream ``E_r`` built in registers (Eq. 10)
    and never written.

    One program per (batch row, 64-token tile) runs over the channel chunks; for each chunk and
    stream ``r`` it sums the valid sources into ``S`` register tiles (one per target) and writes
    them with TMA stores. The work items (chunk, stream, valid source) stream through an
    ``n_slots``-deep TMA pipeline: the lag windows of the source's chunk that the stream's kernel
    reaches (``LagWindow.copies``), its taps and its ``p`` rows. The valid sources are listed
    first by XLA, so the ones ``valid`` rules out cost nothing (their ``p`` is 0).

    ``sources[n, B, T, d]``, ``banks[n, K, d]`` or None, ``p[S, n, m, B, T', H]`` float32
    (``T' >= T``), ``segment_ids[B, T]`` or None, ``valid[n]`` (bool, may be traced) or None.
    ``block_d``: the channel chunk (None: the first of ``MIX_BLOCK_D_CHOICES`` that fits);
    ``n_slots``: None is ``MIX_SLOTS``. Returns ``acc[S, m, B, T, d]`` in ``out_dtype`` or, with
    ``per_target``, a list of ``S`` arrays ``[m, B, T, d]`` (each its own output of the kernel).
    ``window_fetch``: ``MIX_WINDOW_FETCHES`` (None: ``"per_chunk"``, or ``"per_item"`` where
    ``"per_chunk"`` does not fit; ``resolve_window_fetch``); the sums are the same in either."""
    n, batch, t_len, d = sources.shape

    def fits(fetch):  # one program's shared memory holds it (interpret mode: no limit)
        return interpret or any(
            mix_smem_bytes(block_d=bd, stream_kernels=stream_kernels, heads=heads, x_dtype=sources.dtype,
                           out_dtype=out_dtype, n_targets=p.shape[0], n_slots=n_slots, window_fetch=fetch,
                           n_sources=n) <= SMEM_BYTES
            for bd in ((block_d,) if block_d else MIX_BLOCK_D_CHOICES))

    window_fetch = resolve_window_fetch(window_fetch, fits)
    n_slots = n_slots or MIX_SLOTS
    n_targets, m = p.shape[0], p.shape[2]
    if p.shape[1] != n or p.shape[3] != batch or p.shape[4] < t_len or m != len(stream_kernels):
        raise ValueError(f"p {p.shape}: want [S, {n}, {len(stream_kernels)}, {batch}, >= {t_len}, H]")
    if p.shape[5] != heads:
        raise ValueError(f"p {p.shape}: its last axis is the {heads} heads")
    smem = functools.partial(mix_smem_bytes, n_targets=n_targets, n_slots=n_slots, window_fetch=window_fetch,
                             n_sources=n)
    sh = tile_partial("phase1_mix", sources.reshape(n * batch, t_len, d), segment_ids, stream_kernels=stream_kernels,
                      heads=heads, block_d=block_d, interpret=interpret, smem=smem, choices=MIX_BLOCK_D_CHOICES,
                      x_dtype=sources.dtype, acc_dtype=F32, out_dtype=out_dtype)
    has_bank = sh.has_bank and banks is not None
    meta = valid_first(valid, n)  # the kernel loops over the valid sources only
    # [S, n, m, B, T', H] -> [n, m, S H, B, Tp]: one TMA copy per (source, stream) brings a tile's p rows
    p_rows = pad_tokens(jnp.asarray(p, F32)[:, :, :, :, :t_len], 4, sh.t_pad)
    p_rows = p_rows.transpose(1, 2, 0, 5, 3, 4).reshape(n, m, n_targets * heads, batch, sh.t_pad)
    inputs = [sh.x, jnp.asarray(banks, F32) if has_bank else jnp.zeros((n, 1, d), F32), p_rows, meta]
    if sh.has_seg:
        inputs.append(sh.bits)
    call = _mix_kernel(MixConfig(n=n, batch=batch, t_pad=sh.t_pad, d=d, stream_kernels=tuple(stream_kernels),
                                 heads=heads, n_targets=n_targets, block_d=sh.block_d, has_bank=has_bank,
                                 has_seg=sh.has_seg, front=sh.front, x_dtype=jnp.dtype(sh.x.dtype),
                                 out_dtype=jnp.dtype(out_dtype), per_target=bool(per_target), n_slots=n_slots,
                                 interpret=bool(interpret), window_fetch=window_fetch))
    out = call(*inputs)
    cut = lambda a: a[..., :t_len, :]  # noqa: E731
    return [cut(a) for a in out] if per_target else cut(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixConfig(KernelConfig):
    """What ``phase1_mix``'s kernel code depends on besides ``KernelConfig``."""

    n: int  # sources
    n_targets: int
    has_bank: bool
    out_dtype: jnp.dtype
    per_target: bool
    n_slots: int
    window_fetch: str  # MIX_WINDOW_FETCHES


@functools.lru_cache(maxsize=None)
def _mix_kernel(cfg: MixConfig):
    """``phase1_mix``'s kernel for ``cfg``, built and jitted once (``KernelConfig``)."""
    plgpu = lane_plgpu()

    n, batch, d, heads, bd, n_targets = cfg.n, cfg.batch, cfg.d, cfg.heads, cfg.block_d, cfg.n_targets
    stream_kernels, has_bank, has_seg, front, n_slots = (cfg.stream_kernels, cfg.has_bank, cfg.has_seg, cfg.front,
                                                         cfg.n_slots)
    m, bt = len(stream_kernels), BLOCK_T
    layout = stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    nc, nch = d // bd, d // bd // heads
    row, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA
    lags = LagWindow.of(max_lag)
    taps = [has_bank and kernel > 0 for kernel in stream_kernels]
    # "per_chunk" (``MIX_WINDOW_FETCHES``): a window buffer and a barrier per source slot, apart
    # from the items' ring, which then brings only the taps and the p rows
    per_chunk_windows = cfg.window_fetch == "per_chunk"
    # lag-window copies of a stream's item
    copies = [0 if per_chunk_windows else len(lags.copies(kernel)) for kernel in stream_kernels]
    staged = _staged_targets(n_targets, cfg.window_fetch)  # targets staged for the stores at once
    scratch = dict(
        xs=plgpu.SMEM((n if per_chunk_windows else n_slots, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        **{f"bs{r}": plgpu.SMEM((n_slots, kernel, bd), F32) for r, kernel in enumerate(stream_kernels) if taps[r]},
        ps=plgpu.SMEM((n_slots, n_targets * heads, bt), F32),
        out_s=tile_smem(plgpu, (staged, bt, bd), cfg.out_dtype),
        bar_win=plgpu.Barrier(num_arrivals=len(lags.copies(max_lag)), num_barriers=n) if per_chunk_windows else None,
        meta_s=plgpu.SMEM((n + 1, 64), jnp.int32),
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        **{f"bar{r}": plgpu.Barrier(num_arrivals=copies[r] + taps[r] + 1, num_barriers=n_slots) for r in range(m)},
        bar_in=plgpu.Barrier(num_arrivals=1 + has_seg, num_barriers=1),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, p_ref, meta_ref = (next(it) for _ in range(4))
        bits_ref = next(it) if has_seg else None
        outs = [next(it) for _ in range(n_targets if cfg.per_target else 1)]
        sc = dict(zip(names, it))
        xs, ps, out_s, meta_s, bits_s = (sc.get(k) for k in ("xs", "ps", "out_s", "meta_s", "bits_s"))
        bss = [sc.get(f"bs{r}") for r in range(m)]
        bars = [sc[f"bar{r}"] for r in range(m)]
        bar_in, bar_win = sc["bar_in"], sc.get("bar_win")
        b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt
        rows = pl.ds(t0, bt)
        masks = stage_table_and_masks(plgpu, meta_ref, meta_s, bits_ref, bits_s, bar_in.at[0], b, t0, max_lag, bt, bd)
        n_live = meta_s[n, 0]
        per_chunk = m * n_live
        total = nc * per_chunk

        def fetch_stream(r, c, i, slot):
            """Item (chunk ``c``, stream ``r``, source ``i``)'s copies into ``slot``."""
            cs, xcs = pl.ds(c * bd, bd), lags.columns(c, bd)
            if not per_chunk_windows:
                lags.fetch(plgpu, lambda lag, n_rows: x_ref.at[i * batch + b, pl.ds(t0 + front - lag, n_rows), xcs],
                           xs, slot, bars[r].at[slot], stream_kernels[r])
            if taps[r]:
                kernel, off = layout[r]
                plgpu.copy_gmem_to_smem(bank_ref.at[i, pl.ds(off, kernel), cs], bss[r].at[slot], bars[r].at[slot])
            plgpu.copy_gmem_to_smem(p_ref.at[i, r, :, b, rows], ps.at[slot], bars[r].at[slot])

        def fetch_window(c, j):
            """"per_chunk": chunk ``c``'s window of valid source ``j`` (all the lags any stream
            reaches) into its own buffer ``xs[j]``."""
            i = meta_s[j, 0]
            lags.fetch(plgpu, lambda lag, n_rows: x_ref.at[i * batch + b, pl.ds(t0 + front - lag, n_rows),
                                                           lags.columns(c, bd)], xs, j, bar_win.at[j], max_lag)

        def decode(f):
            """Item ``f`` of the flat order (chunk, stream, valid source) as ``(c, r, j)`` (with no
            valid source nothing is fetched; the divisors are kept non-zero all the same)."""
            live = jnp.maximum(n_live, 1)
            return f // (m * live), lax.rem(f // live, m), lax.rem(f, live)

        def fetch(f):
            """Item ``f`` of the flat order, if there is one."""
            @pl.when(f < total)
            def _():
                c, r, j = decode(f)
                i, slot = meta_s[j, 0], lax.rem(f, n_slots)
                for rr in range(m):
                    pl.when(r == rr)(functools.partial(fetch_stream, rr, c, i, slot))

        def expand(r, slot, j):
            taps_s = bss[r] if taps[r] else None
            if per_chunk_windows:  # the window from the source's buffer, the taps from the item's slot
                return expand_item(plgpu, lags, xs, taps_s, slot, stream_kernels[r], masks, bt, bd, window=j)
            return expand_item(plgpu, lags, xs, taps_s, slot, stream_kernels[r], masks, bt, bd)

        if per_chunk_windows:
            for j in range(n):
                pl.when(j < n_live)(functools.partial(fetch_window, 0, j))
        for k in range(n_slots):
            fetch(k)
        # the loops carry an unused 0 (the timed kernel's loops have it; ``phase1_backward``
        # carries its next item there)
        unused = 0
        zero = plgpu.layout_cast(jnp.zeros((bt, bd), F32), tile)
        for head in range(heads):

            def chunk_body(c, unused, head=head):
                for r in range(m):

                    def source_body(j, carry, r=r):
                        accs, unused = carry
                        f = c * per_chunk + r * n_live + j
                        slot = lax.rem(f, n_slots)
                        if per_chunk_windows and r == 0:  # the first stream waits for the chunk's window
                            plgpu.barrier_wait(bar_win.at[j])
                        plgpu.barrier_wait(bars[r].at[slot])
                        e = expand(r, slot, j)
                        accs = [accs[s] + per_row(plgpu.load(ps, (slot, s * heads + head), layout=row), bt, bd) * e
                                for s in range(n_targets)]
                        if per_chunk_windows and r == m - 1:  # the last stream is done with it: the next chunk's
                            pl.when(c + 1 < nc)(functools.partial(fetch_window, c + 1, j))
                        fetch(f + n_slots)
                        return accs, unused

                    accs, unused = lax.fori_loop(0, n_live, source_body, ([zero] * n_targets, unused))
                    cs = pl.ds(c * bd, bd)
                    for s0 in range(0, n_targets, staged):  # "per_chunk": the targets in two halves
                        group = range(s0, min(s0 + staged, n_targets))
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read the staging
                        for s in group:
                            out_s[s - s0] = accs[s].astype(out_s.dtype)
                        plgpu.commit_smem()
                        # issued all at once: spread over the next chunk and stream's items (a few per
                        # item) they made the pass 1.3-1.8x slower
                        store_group(plgpu, ((out_s.at[s - s0], outs[s].at[r, b, rows, cs] if cfg.per_target
                                             else outs[0].at[s, r, b, rows, cs]) for s in group))
                return unused

            unused = lax.fori_loop(head * nch, (head + 1) * nch, chunk_body, unused)
        plgpu.wait_smem_to_gmem(0)

    if cfg.per_target:
        out_type = [jax.ShapeDtypeStruct((m, batch, cfg.t_pad, d), cfg.out_dtype)] * n_targets
    else:
        out_type = jax.ShapeDtypeStruct((n_targets, m, batch, cfg.t_pad, d), cfg.out_dtype)
    return jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names], name="depth_attention_mix_mosaic",
                         batch=batch, t_pad=cfg.t_pad, interpret=cfg.interpret)
