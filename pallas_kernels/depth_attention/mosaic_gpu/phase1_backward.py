"""Phase 1's backward passes 2 and 4 (wide form) in Mosaic GPU: ``phase1_gdots``, the value-path
dots ``<g_A{s,r}, E_{i,r}>`` per head, and ``phase1_dstreams``, every source's stream cotangents
``dE = sum_s (P g_A{s,r} + DSR q_{s,r}) - W E`` (the Triton forms are
``fused_bwd_phase1.gdots_call`` and ``dstreams_call``). One program per (stream, batch row,
64-token tile) walks its (head, channel chunk) groups, each group's ``S`` tiles of ``g_A`` in
one TMA copy set, the valid sources pipelined behind it. docs/kernels.md §4, "Phase 1
backward"."""

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
    BLOCK_D_CHOICES, BLOCK_T, F32, KernelConfig, LagWindow, SMEM_BYTES, expand_item, jitted_kernel, lane_plgpu,
    per_col, per_row, smem_sum, stage_table_and_masks, store_group, tile_partial, tile_smem, valid_first, window_elems,
)

MODES = ("gdots", "dstreams")
# Per mode, by measurement on the H200 at `base`:
# items (one valid source of one group) in flight, each with its lag windows, taps and, for
# "dstreams", its per-token rows; and groups whose g_A is in shared memory at once (64 KB each for
# 8 float32 targets and 32 channels): 2 overlaps the next group's copies with this one's work in
# one program per SM, 1 leaves room for two programs per SM, which overlap each other's.
# gdots: 4.25 ms with (2, 1) against 5.16 with (3, 2); dstreams: 4.81 with (3, 2) against 5.06.
SLOTS = {"gdots": 2, "dstreams": 3}
GROUP_SLOTS = {"gdots": 1, "dstreams": 2}
BLOCK_D_CHOICES = (32,)
# A group's g_A tiles are loaded into registers once for all its items (128 registers per thread
# for 8 float32 targets; no spills) rather than read from shared memory by each item: gdots 7.27
# -> 5.16 ms, dstreams 6.29 -> 4.81 on the H200 (except ``SINGLE_STREAM_BF16_GA``).
# One stream (AttnRes, MHAR) with a bf16 g_A (the value channel hands phase 1 the read's bf16 dh,
# api.phase1(value_channel=True); a bf16 state's cotangent is bf16 too): (n_slots, group_slots, g_A
# in registers, block_d) per mode, taken
# when the caller sets none of them and 64 channels divide a head. At the bench shape on the H200:
# gdots 0.747 -> 0.684 and dstreams 1.200 -> 0.806 ms
# per call against the defaults above (`base`: 0.843 -> 0.665, 1.159 -> 0.895). With a float32 g_A
# 64-channel chunks were 1.4-2.5x slower.
SINGLE_STREAM_BF16_GA = {"gdots": (2, 1, False, 64), "dstreams": (2, 1, False, 64)}
# Both kernels carry the (group, source) of the item they fetch next through the loops and step it
# (a few compares and selects) rather than decode its flat index (an integer division by the
# runtime count of valid sources per item): on the H200 gdots 4.0-4.1% and dstreams 4.4-6.2%
# faster per call at `base`'s last block and the bench shape, the same bits.
# One program per (stream, batch row, token tile), the stream the grid's fastest axis, each item
# bringing its own lag window: against one program per (batch row, token tile) walking every
# stream's groups (an H100; the same bits) gdots 4.547 -> 4.514 ms per call at `base`'s last block
# and 3.891 -> 3.740 at the bench shape, dstreams 5.316 -> 5.209 / 4.987 -> 4.892; against such a
# program sharing a chunk's window of each source across its streams, dstreams 4.615 -> 4.769 ms
# at `base` (+3.3%), 4.595 -> 4.563 at the bench shape.
# Where ``dstreams``' items find their per-token rows (``P`` and ``DSR`` of every target and ``W``:
# ``2 S + 1`` float32 rows of 64 tokens per (source, stream, head), the same for every channel
# chunk). "per_item": each item copies its source's rows into its pipeline slot, so the rows come
# once per chunk (64 times at d = 2048: 2.6 GB of copies per call at the bench shape for 40 MB of
# rows); "per_stream": each valid source's rows come once per (head, stream) into a buffer of their
# own (``n (2 S + 1) 64`` floats, 39 KB at the bench shape), refilled as the (head, stream)'s last
# chunk is done; taken where it fits, else "per_item" (``_rows_fetch``). Measured (an H100; the
# same bits): 5.336 -> 5.209 ms per call at `base`'s last block (-2.4%) and 5.461 -> 4.892 at the
# bench shape (-10.4%); one stream (AttnRes, MHAR) 1.046 -> 1.034 at `base`, 0.981 -> 0.963 at the
# bench shape.
ROWS_FETCHES = ("per_item", "per_stream")


def smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, acc_dtype, n_targets: int,
               n_sources: int, mode: str, out_dtype=jnp.bfloat16, n_slots: int | None = None,
               group_slots: int | None = None, rows_fetch: str = "per_item", **_unused) -> int:
    """Shared memory of one program of ``mode``'s kernel (its scratch list, ``common.smem_sum``;
    ``acc_dtype``: ``g_A``'s; ``rows_fetch`` (``ROWS_FETCHES``, "dstreams"): "per_stream" holds the
    rows per source instead of per item in flight)."""
    bt, bd, n_slots, n_groups = BLOCK_T, block_d, n_slots or SLOTS[mode], group_slots or GROUP_SLOTS[mode]
    m, n = len(stream_kernels), n_sources
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    window = window_elems(stream_kernels, bd) * size(x_dtype)
    common = (n_slots * window, *(n_slots * kernel * bd * 4 for kernel in stream_kernels),
              n_groups * n_targets * bt * bd * size(acc_dtype), (n + 1) * 64 * 4, bt * 4)
    barriers = m * n_slots + n_groups + 1
    if mode == "gdots":
        return smem_sum(*common, n * n_targets * bt * 4, barriers=barriers, reduces=True)  # its row dots
    per_stream = rows_fetch == "per_stream"
    rows = (n if per_stream else n_slots) * (2 * n_targets + 1) * bt * 4
    return smem_sum(*common, n_groups * n_targets * bd * 4, rows,
                    2 * bt * bd * size(out_dtype), barriers=barriers + (n if per_stream else 0))


def _acc_rows(g_acc, t_len: int, t_pad: int):
    """``g_A`` as ``S`` arrays ``[m, B * Tp, d]`` (``T`` cut or padded to ``Tp``; free reshapes
    when it is already ``Tp`` long): each group copies one 2D box per target, the copy
    ``common.copy_state`` makes per stream."""
    parts = list(g_acc) if isinstance(g_acc, (list, tuple)) else [g_acc[s] for s in range(g_acc.shape[0])]
    out = []
    for a in parts:
        a = a[:, :, :t_len] if a.shape[2] > t_len else a
        m, batch, _, d = a.shape
        out.append(pad_tokens(a, 2, t_pad).reshape(m, batch * t_pad, d))
    return out


def _check(name, sources, g_acc, stream_kernels):
    n, batch, t_len, d = sources.shape
    m = len(stream_kernels)
    shapes = [a.shape for a in g_acc] if isinstance(g_acc, (list, tuple)) else [g_acc.shape[1:]] * g_acc.shape[0]
    for shape in shapes:
        if len(shape) != 4 or shape[0] != m or shape[1] != batch or shape[2] < t_len or shape[3] != d:
            raise ValueError(f"mosaic_gpu.{name}: g_acc per target {shape}: want [{m}, {batch}, >= {t_len}, {d}]")
    return len(shapes)


def phase1_gdots(sources, banks, g_acc, segment_ids, valid, *, stream_kernels, heads: int,
                 block_d: int | None = None, n_slots: int | None = None, group_slots: int | None = None,
                 interpret: bool = False):
    """``gd[S, n, m, B, T, H]`` float32: ``<g_A{s,r}, E_r[x_i]>`` per head (the value-path dots of
    ``fused_bwd_phase1``'s pass 2; zeros for a source ``valid`` rules out, not computed).

    ``sources[n, B, T, d]``, ``banks[n, K, d]`` or None, ``g_acc`` one ``[S, m, B, T', d]`` array
    or ``S`` arrays ``[m, B, T', d]`` (``T' >= T``; float32 or bf16), ``segment_ids[B, T]`` or
    None, ``valid[n]`` or None. ``n_slots``: items in flight (None: ``SLOTS``); ``group_slots``:
    groups' ``g_A`` in shared memory (None: ``GROUP_SLOTS``); both per mode."""
    return _call("gdots", sources, banks, g_acc, segment_ids, valid, stream_kernels=stream_kernels, heads=heads,
                 block_d=block_d, n_slots=n_slots, group_slots=group_slots, interpret=interpret)


def phase1_dstreams(sources, banks, queries, g_acc, p, dsr, w, segment_ids, valid, *, stream_kernels, heads: int,
                    out_dtype, block_d: int | None = None, n_slots: int | None = None,
                    group_slots: int | None = None, interpret: bool = False, rows_fetch: str | None = None):
    """The stream cotangents ``dE[n, m, B, T, d]`` (``out_dtype``) of the wide form's pass 4:
    ``dE[i, r] = sum_s (P_{s,i,r} g_A{s,r} + DSR_{s,i,r} q_{s,r}) - W_{i,r} E_r[x_i]`` (per head
    for ``P`` and ``DSR``). A source ``valid`` rules out is not written (its rows hold whatever
    the output buffer held): pass the same ``valid`` to the consumer
    (``conv_transpose.sources_transpose`` skips or masks those sources).

    ``queries[S, m, d]``, ``p``/``dsr`` ``[S, n, m, B, T', H]`` and ``w[n, m, B, T']`` float32
    (``T' >= T``); ``rows_fetch``: one of ``ROWS_FETCHES`` (None: "per_stream", or "per_item"
    where "per_stream" does not fit); the outputs are the same in either. The rest as
    ``phase1_gdots``."""
    n, batch, t_len, d = sources.shape
    m = len(stream_kernels)
    n_targets = _check("phase1_dstreams", sources, g_acc, stream_kernels)
    if queries.shape != (n_targets, m, d):
        raise ValueError(f"mosaic_gpu.phase1_dstreams: queries {queries.shape}: want [{n_targets}, {m}, {d}]")
    for name, a in (("p", p), ("dsr", dsr)):
        if a.shape[:4] != (n_targets, n, m, batch) or a.shape[4] < t_len or a.shape[5] != heads:
            raise ValueError(f"mosaic_gpu.phase1_dstreams: {name} {a.shape}: want [{n_targets}, {n}, {m}, "
                             f"{batch}, >= {t_len}, {heads}]")
    if w.shape[:3] != (n, m, batch) or w.shape[3] < t_len:
        raise ValueError(f"mosaic_gpu.phase1_dstreams: w {w.shape}: want [{n}, {m}, {batch}, >= {t_len}]")
    return _call("dstreams", sources, banks, g_acc, segment_ids, valid, stream_kernels=stream_kernels, heads=heads,
                 block_d=block_d, n_slots=n_slots, group_slots=group_slots, interpret=interpret,
                 queries=queries, p=p, dsr=dsr, w=w, out_dtype=out_dtype, rows_fetch=rows_fetch)


def _rows_fetch(rows_fetch: str | None, fits) -> str:
    """``dstreams``' rows fetch (``ROWS_FETCHES``): ``rows_fetch`` if given (one that does not fit
    fails in ``tile_partial``), else "per_stream" where ``fits("per_stream")``, else "per_item"."""
    if rows_fetch is not None:
        if rows_fetch not in ROWS_FETCHES:
            raise ValueError(f"mosaic_gpu.phase1_dstreams: rows_fetch={rows_fetch!r}: must be one of "
                             f"{ROWS_FETCHES}")
        return rows_fetch
    return "per_stream" if fits("per_stream") else "per_item"


def _call(mode, sources, banks, g_acc, segment_ids, valid, *, stream_kernels, heads, block_d, n_slots, group_slots,
          interpret, queries=None, p=None, dsr=None, w=None, out_dtype=jnp.bfloat16, rows_fetch=None):
    n, batch, t_len, d = sources.shape
    m = len(stream_kernels)
    n_targets = _check(f"phase1_{mode}", sources, g_acc, stream_kernels)
    acc_dtype = (g_acc[0] if isinstance(g_acc, (list, tuple)) else g_acc).dtype
    ga_registers = True
    single = SINGLE_STREAM_BF16_GA.get(mode)
    if (single and m == 1 and acc_dtype == jnp.bfloat16 and n_slots is None and group_slots is None
            and block_d is None and d % heads == 0 and (d // heads) % single[3] == 0):
        n_slots, group_slots, ga_registers, block_d = single
    n_slots = n_slots or SLOTS[mode]
    group_slots = group_slots or GROUP_SLOTS[mode]
    if group_slots not in (1, 2) or n_slots < 1:
        raise ValueError(f"mosaic_gpu.phase1_{mode}: group_slots={group_slots} must be 1 or 2, "
                         f"n_slots={n_slots} at least 1")
    smem = functools.partial(smem_bytes, n_targets=n_targets, n_sources=n, mode=mode, n_slots=n_slots,
                             group_slots=group_slots, out_dtype=out_dtype)
    rows_fetch = "per_item" if mode == "gdots" else _rows_fetch(rows_fetch, lambda fetch: interpret or any(
        smem(block_d=bd, rows_fetch=fetch, stream_kernels=stream_kernels, heads=heads, x_dtype=sources.dtype,
             acc_dtype=acc_dtype) <= SMEM_BYTES for bd in ((block_d,) if block_d else BLOCK_D_CHOICES)))
    smem = functools.partial(smem, rows_fetch=rows_fetch)
    sh = tile_partial(f"phase1_{mode}", sources.reshape(n * batch, t_len, d), segment_ids,
                      stream_kernels=stream_kernels, heads=heads, block_d=block_d, interpret=interpret, smem=smem,
                      choices=BLOCK_D_CHOICES, x_dtype=sources.dtype, acc_dtype=acc_dtype, out_dtype=out_dtype)
    has_bank = sh.has_bank and banks is not None
    t_pad = sh.t_pad
    inputs = [sh.x, jnp.asarray(banks, F32) if has_bank else jnp.zeros((n, 1, d), F32), valid_first(valid, n),
              *_acc_rows(g_acc, t_len, t_pad)]
    if mode == "dstreams":
        # per (source, stream, head): the rows [P_s (S) | DSR_s (S) | W], one TMA copy per item
        cut = lambda a: pad_tokens(jnp.asarray(a, F32)[..., :t_len, :], 4, t_pad)  # noqa: E731
        per_head = jnp.concatenate([cut(p), cut(dsr)]).transpose(1, 2, 5, 0, 3, 4)  # [n, m, H, 2S, B, Tp]
        w_rows = pad_tokens(jnp.asarray(w, F32)[..., :t_len], 3, t_pad)[:, :, None, None]
        rows = jnp.concatenate([per_head, jnp.broadcast_to(w_rows, (n, m, heads, 1, batch, t_pad))], axis=3)
        inputs += [jnp.asarray(queries, F32), rows.reshape(n, m, heads * (2 * n_targets + 1), batch, t_pad)]
    if sh.has_seg:
        inputs.append(sh.bits)
    call = _kernel(Phase1BackwardConfig(mode=mode, n=n, batch=batch, t_pad=t_pad, d=d,
                                        stream_kernels=tuple(stream_kernels), heads=heads, n_targets=n_targets,
                                        block_d=sh.block_d, has_bank=has_bank, has_seg=sh.has_seg, front=sh.front,
                                        x_dtype=jnp.dtype(sh.x.dtype), acc_dtype=jnp.dtype(acc_dtype),
                                        out_dtype=jnp.dtype(out_dtype), n_slots=n_slots, group_slots=group_slots,
                                        ga_registers=ga_registers, interpret=bool(interpret), rows_fetch=rows_fetch))
    out = call(*inputs)
    if mode == "gdots":  # [n, m H S, B, Tp] -> [S, n, m, B, T, H]
        out = out.reshape(n, m, heads, n_targets, batch, t_pad).transpose(3, 0, 1, 4, 5, 2)
        return out[:, :, :, :, :t_len]
    return out[:, :, :, :t_len]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phase1BackwardConfig(KernelConfig):
    """What the kernels' code depends on besides ``KernelConfig``."""

    mode: str  # MODES
    n: int  # sources
    n_targets: int
    has_bank: bool
    acc_dtype: jnp.dtype  # g_A's
    out_dtype: jnp.dtype
    n_slots: int
    group_slots: int
    ga_registers: bool
    rows_fetch: str  # ROWS_FETCHES ("dstreams")


@functools.lru_cache(maxsize=None)
def _kernel(cfg: Phase1BackwardConfig):
    """``cfg.mode``'s kernel for ``cfg``, built and jitted once: one program per (stream, batch
    row, token tile) walks its stream's (head, chunk) groups."""
    plgpu = lane_plgpu()
    mode, n, batch, d, heads, bd, n_targets = cfg.mode, cfg.n, cfg.batch, cfg.d, cfg.heads, cfg.block_d, cfg.n_targets
    stream_kernels, has_bank, has_seg, front, n_slots = (cfg.stream_kernels, cfg.has_bank, cfg.has_seg, cfg.front,
                                                         cfg.n_slots)
    n_gslots = cfg.group_slots
    gdots = mode == "gdots"
    m, bt, t_pad = len(stream_kernels), BLOCK_T, cfg.t_pad
    layout = stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    nch = d // bd // heads  # chunks per head
    n_groups = heads * nch  # the program's stream's (head, chunk) groups
    n_rows = 2 * n_targets + 1  # "dstreams": an item's per-token rows
    # "dstreams" with ROWS_FETCHES' "per_stream": each valid source's rows once per (head, stream)
    rows_cached = not gdots and cfg.rows_fetch == "per_stream"
    rows_per_item = not gdots and not rows_cached
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    lags = LagWindow.of(max_lag)
    copies = [len(lags.copies(kernel)) for kernel in stream_kernels]  # lag-window copies of a stream's item
    taps = [has_bank and kernel > 0 for kernel in stream_kernels]
    scratch = dict(
        xs=plgpu.SMEM((n_slots, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        **{f"bs{r}": plgpu.SMEM((n_slots, kernel, bd), F32) for r, kernel in enumerate(stream_kernels) if taps[r]},
        gas=tile_smem(plgpu, (n_gslots, n_targets, bt, bd), cfg.acc_dtype),
        qs=None if gdots else plgpu.SMEM((n_gslots, n_targets, bd), F32),
        rs=plgpu.SMEM((n if rows_cached else n_slots, n_rows, bt), F32) if not gdots else None,
        bar_rows=plgpu.Barrier(num_arrivals=1, num_barriers=n) if rows_cached else None,
        out_s=None if gdots else tile_smem(plgpu, (2, bt, bd), cfg.out_dtype),
        dots_s=plgpu.SMEM((n, n_targets, bt), F32) if gdots else None,
        meta_s=plgpu.SMEM((n + 1, 64), jnp.int32),
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        **{f"bar{r}": plgpu.Barrier(num_arrivals=copies[r] + taps[r] + rows_per_item, num_barriers=n_slots)
           for r in range(m)},
        gbar=plgpu.Barrier(num_arrivals=n_targets + (not gdots), num_barriers=n_gslots),
        bar_in=plgpu.Barrier(num_arrivals=1 + has_seg, num_barriers=1),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, meta_ref = next(it), next(it), next(it)
        ga_refs = [next(it) for _ in range(n_targets)]  # [m, B Tp, d] each
        q_ref, rows_ref = (None, None) if gdots else (next(it), next(it))
        bits_ref = next(it) if has_seg else None
        out_ref = next(it)
        sc = dict(zip(names, it))
        xs, gas, qs, rs, out_s, dots_s, meta_s, bits_s = (
            sc.get(k) for k in ("xs", "gas", "qs", "rs", "out_s", "dots_s", "meta_s", "bits_s"))
        bss = [sc.get(f"bs{r}") for r in range(m)]
        bars = [sc[f"bar{r}"] for r in range(m)]
        gbar, bar_in, bar_rows = sc["gbar"], sc["bar_in"], sc.get("bar_rows")
        b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt
        program_stream = lax.axis_index("r")
        rows = pl.ds(t0, bt)
        masks = stage_table_and_masks(plgpu, meta_ref, meta_s, bits_ref, bits_s, bar_in.at[0], b, t0, max_lag, bt, bd)
        n_live = meta_s[n, 0]
        total = n_groups * n_live

        def group_of(g):
            """(head, stream, chunk) of group ``g``: (head, chunk) of the program's stream; a static
            g past the groups (the first fetches' guard is traced) stays inside d."""
            return lax.rem(g // nch, heads), program_stream, lax.rem(g, heads * nch)

        def fetch_group(g):
            """Group ``g``'s ``g_A`` tiles (and query chunks) into its slot, if it has items."""
            @pl.when((g < n_groups) & (n_live > 0))
            def _():
                _, r, c = group_of(g)
                cs, gslot = pl.ds(c * bd, bd), lax.rem(g, n_gslots)
                for s in range(n_targets):
                    plgpu.copy_gmem_to_smem(ga_refs[s].at[r, pl.ds(b * t_pad + t0, bt), cs], gas.at[gslot, s],
                                            gbar.at[gslot])
                if not gdots:
                    plgpu.copy_gmem_to_smem(q_ref.at[:, r, cs], qs.at[gslot], gbar.at[gslot])

        def fetch_item(r, head, c, i, slot):
            """Item (stream ``r``, chunk ``c``, source ``i``)'s copies into ``slot``."""
            cs, xcs = pl.ds(c * bd, bd), lags.columns(c, bd)
            lags.fetch(plgpu, lambda lag, n_rows: x_ref.at[i * batch + b, pl.ds(t0 + front - lag, n_rows), xcs],
                       xs, slot, bars[r].at[slot], stream_kernels[r])
            if taps[r]:
                kernel, off = layout[r]
                plgpu.copy_gmem_to_smem(bank_ref.at[i, pl.ds(off, kernel), cs], bss[r].at[slot], bars[r].at[slot])
            if rows_per_item:
                plgpu.copy_gmem_to_smem(rows_ref.at[i, r, pl.ds(head * n_rows, n_rows), b, rows], rs.at[slot],
                                        bars[r].at[slot])

        def fetch_rows(head, r: int):
            """"per_stream" rows: every valid source's rows of (``head``, stream ``r``) into ``rs[j]``."""
            for j in range(n):
                @pl.when(j < n_live)
                def _(j=j):
                    plgpu.copy_gmem_to_smem(rows_ref.at[meta_s[j, 0], r, pl.ds(head * n_rows, n_rows), b, rows],
                                            rs.at[j], bar_rows.at[j])

        def wait_rows():
            for j in range(n):
                pl.when(j < n_live)(functools.partial(plgpu.barrier_wait, bar_rows.at[j]))

        def step(item):
            """The item after ``item = (g, j)`` in the flat order (group, valid source)."""
            g, j = item
            j = j + 1
            next_g = j == n_live
            return jnp.where(next_g, g + 1, g), jnp.where(next_g, 0, j)

        def fetch(f, item=None):
            """Item ``f`` of the flat order (group, valid source), if there is one (``item``: its
            ``(g, j)``, else decoded from ``f``)."""
            @pl.when(f < total)
            def _():
                g, j = (f // n_live, lax.rem(f, n_live)) if item is None else item
                head, r, c = group_of(g)
                i, slot = meta_s[j, 0], lax.rem(f, n_slots)
                for rr in range(m):
                    pl.when(r == rr)(functools.partial(fetch_item, rr, head, c, i, slot))

        def expand(r, slot):
            return expand_item(plgpu, lags, xs, bss[r] if taps[r] else None, slot, stream_kernels[r], masks, bt, bd)

        for k in range(n_slots):
            fetch(k)
        for g in range(n_gslots):
            fetch_group(g)
        # the next item to fetch, carried through the loops (with no valid source nothing is
        # fetched; the divisor is kept non-zero all the same)
        upcoming = (jnp.int32(n_slots) // jnp.maximum(n_live, 1), lax.rem(jnp.int32(n_slots), jnp.maximum(n_live, 1)))
        zero_row = plgpu.layout_cast(jnp.zeros((bt,), F32), row)

        def group_body(g, c, r: int, upcoming):
            """Group ``g`` (chunk ``c``, stream ``r``): its items, one per valid source."""
            gslot, cs = lax.rem(g, n_gslots), pl.ds(c * bd, bd)

            @pl.when(n_live > 0)
            def _():
                plgpu.barrier_wait(gbar.at[gslot])

            def ga_tile(s):
                return plgpu.load(gas, (gslot, s), layout=tile).astype(F32)

            if cfg.ga_registers:  # loaded once for the group's items (garbage when it has none)
                held = [ga_tile(s) for s in range(n_targets)]
                ga_tile = held.__getitem__  # noqa: F811

            def source_body(j, upcoming):
                f = g * n_live + j
                slot = lax.rem(f, n_slots)
                plgpu.barrier_wait(bars[r].at[slot])
                e = expand(r, slot)
                i = meta_s[j, 0]
                if gdots:
                    for s in range(n_targets):
                        ga = ga_tile(s)
                        dots_s[i, s] = plgpu.load(dots_s, (i, s), layout=row) + jnp.sum(ga * e, axis=1)
                else:
                    def row_of(k):
                        return per_row(plgpu.load(rs, (j if rows_cached else slot, k), layout=row), bt, bd)

                    de = -row_of(2 * n_targets) * e
                    for s in range(n_targets):
                        ga = ga_tile(s)
                        q = per_col(plgpu.load(qs, (gslot, s), layout=col), bt, bd)
                        de = de + row_of(s) * ga + row_of(n_targets + s) * q
                    oslot = lax.rem(f, 2)
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot is read
                    out_s[oslot] = de.astype(out_s.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_s.at[oslot], out_ref.at[i, r, b, rows, cs])
                fetch(f + n_slots, upcoming)
                return step(upcoming)

            upcoming = lax.fori_loop(0, n_live, source_body, upcoming)
            # every thread is done with this group's g_A slot (and, for gdots, its sums)
            plgpu.commit_smem()
            fetch_group(g + n_gslots)
            return upcoming

        def walk(r: int, upcoming):
            """The program's groups (its stream ``r``): every head's chunks, in the order ``group_of``
            numbers them."""
            if rows_cached:  # "per_stream" rows: one fill per head
                fetch_rows(0, r)
            for head in range(heads):
                if rows_cached:
                    wait_rows()
                if gdots:  # this (head, stream)'s sums start at zero, once the last one's stores have read them
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for i in range(n):
                        for s in range(n_targets):
                            dots_s[i, s] = zero_row
                    plgpu.commit_smem()
                first = head * nch  # the (head, stream)'s first group
                upcoming = lax.fori_loop(
                    0, nch, lambda cc, upcoming, head=head, first=first: group_body(
                        first + cc, head * nch + cc, r, upcoming), upcoming)
                if gdots:
                    store_group(plgpu, ((dots_s.at[i], out_ref.at[i, pl.ds((r * heads + head) * n_targets,
                                                                           n_targets), b, rows])
                                         for i in range(n)))
                if rows_cached and head + 1 < heads:  # every thread is done with these rows: the next head's
                    plgpu.commit_smem()
                    fetch_rows(head + 1, r)

        for r in range(m):  # the stream's code, static per stream, under the program's stream
            pl.when(program_stream == r)(functools.partial(walk, r, upcoming))
        plgpu.wait_smem_to_gmem(0)

    if gdots:
        out_type = jax.ShapeDtypeStruct((n, m * heads * n_targets, batch, t_pad), F32)
    else:
        out_type = jax.ShapeDtypeStruct((n, m, batch, t_pad, d), cfg.out_dtype)
    return jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names],
                         name=f"depth_attention_bwd1_{mode}_mosaic", batch=batch, t_pad=t_pad,
                         interpret=cfg.interpret, streams=m)
