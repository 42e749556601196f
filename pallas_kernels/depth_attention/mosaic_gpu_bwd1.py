"""Phase 1's backward passes 2 and 4 (wide form) as Mosaic GPU kernels, on ``mosaic_gpu``'s helpers:
``phase1_gdots``, the value-path dots ``<g_A{s,r}, E_{i,r}>`` per head, and ``phase1_dstreams``,
every source's stream cotangents ``dE = sum_s (P g_A{s,r} + DSR q_{s,r}) - W E`` (the math is in
docs/kernels.md §4, "Phase 1 backward"; the Triton forms are ``fused_bwd_phase1.gdots_call`` and
``dstreams_call``). Both are built around reading ``g_A`` once: one program per stream, batch row
and 64-token tile walks its (head, channel chunk) groups, each group's ``S`` tiles of ``g_A`` in
one swizzled TMA copy set, with the valid sources pipelined behind it."""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention.fused import _pad_t, _stream_layout
from pallas_kernels.depth_attention.mosaic_gpu import (
    BLOCK_T, F32, MAX_LAG_BITS, SMEM_BYTES, _cols, _expand_item, _jitted_kernel, _Lags, _lag_masks_of, _lane_plgpu,
    _LanePlgpu, _pad_rows4, _rows, _rows4, _shape, _smem_sum, _store_group, _tile_smem, _valid_first, _window_elems,
    lag_bits, named_body,
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
    """Shared memory of one program of ``mode``'s kernel (its scratch list, ``mosaic_gpu._smem_sum``;
    ``acc_dtype``: ``g_A``'s; ``rows_fetch`` (``ROWS_FETCHES``, "dstreams"): "per_stream" holds the
    rows per source instead of per item in flight)."""
    bt, bd, n_slots, n_groups = BLOCK_T, block_d, n_slots or SLOTS[mode], group_slots or GROUP_SLOTS[mode]
    m, n = len(stream_kernels), n_sources
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    window = _window_elems(stream_kernels, bd) * size(x_dtype)
    common = (n_slots * window, *(n_slots * kernel * bd * 4 for kernel in stream_kernels),
              n_groups * n_targets * bt * bd * size(acc_dtype), (n + 1) * 64 * 4, bt * 4)
    barriers = m * n_slots + n_groups + 1
    if mode == "gdots":
        return _smem_sum(*common, n * n_targets * bt * 4, barriers=barriers, reduces=True)  # its row dots
    per_stream = rows_fetch == "per_stream"
    return _smem_sum(*common, n_groups * n_targets * bd * 4, (n if per_stream else n_slots) * (2 * n_targets + 1) * bt * 4,
                     2 * bt * bd * size(out_dtype), barriers=barriers + (n if per_stream else 0))


def _acc_rows(g_acc, t_len: int, t_pad: int):
    """``g_A`` as ``S`` arrays ``[m, B * Tp, d]`` (``T`` cut or padded to ``Tp``; free reshapes
    when it is already ``Tp`` long): each group copies one 2D box per target, the copy
    ``mosaic_gpu._copy_state`` makes per stream."""
    parts = list(g_acc) if isinstance(g_acc, (list, tuple)) else [g_acc[s] for s in range(g_acc.shape[0])]
    out = []
    for a in parts:
        a = a[:, :, :t_len] if a.shape[2] > t_len else a
        m, batch, _, d = a.shape
        out.append(_pad_t(a, 2, t_pad).reshape(m, batch * t_pad, d))
    return out


def _check(name, sources, g_acc, stream_kernels):
    n, batch, t_len, d = sources.shape
    m = len(stream_kernels)
    shapes = [a.shape for a in g_acc] if isinstance(g_acc, (list, tuple)) else [g_acc.shape[1:]] * g_acc.shape[0]
    for shape in shapes:
        if len(shape) != 4 or shape[0] != m or shape[1] != batch or shape[2] < t_len or shape[3] != d:
            raise ValueError(f"mosaic_gpu_bwd1.{name}: g_acc per target {shape}: want [{m}, {batch}, >= {t_len}, {d}]")
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
        raise ValueError(f"mosaic_gpu_bwd1.phase1_dstreams: queries {queries.shape}: want [{n_targets}, {m}, {d}]")
    for name, a in (("p", p), ("dsr", dsr)):
        if a.shape[:4] != (n_targets, n, m, batch) or a.shape[4] < t_len or a.shape[5] != heads:
            raise ValueError(f"mosaic_gpu_bwd1.phase1_dstreams: {name} {a.shape}: want [{n_targets}, {n}, {m}, "
                             f"{batch}, >= {t_len}, {heads}]")
    if w.shape[:3] != (n, m, batch) or w.shape[3] < t_len:
        raise ValueError(f"mosaic_gpu_bwd1.phase1_dstreams: w {w.shape}: want [{n}, {m}, {batch}, >= {t_len}]")
    return _call("dstreams", sources, banks, g_acc, segment_ids, valid, stream_kernels=stream_kernels, heads=heads,
                 block_d=block_d, n_slots=n_slots, group_slots=group_slots, interpret=interpret,
                 queries=queries, p=p, dsr=dsr, w=w, out_dtype=out_dtype, rows_fetch=rows_fetch)


def _rows_fetch(rows_fetch: str | None, fits) -> str:
    """``dstreams``' rows fetch (``ROWS_FETCHES``): ``rows_fetch`` if given (one that does not fit
    fails in ``_shape``), else "per_stream" where ``fits("per_stream")``, else "per_item"."""
    if rows_fetch is not None:
        if rows_fetch not in ROWS_FETCHES:
            raise ValueError(f"mosaic_gpu_bwd1.phase1_dstreams: rows_fetch={rows_fetch!r}: must be one of "
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
        raise ValueError(f"mosaic_gpu_bwd1.phase1_{mode}: group_slots={group_slots} must be 1 or 2, "
                         f"n_slots={n_slots} at least 1")
    smem = functools.partial(smem_bytes, n_targets=n_targets, n_sources=n, mode=mode, n_slots=n_slots,
                             group_slots=group_slots, out_dtype=out_dtype)
    rows_fetch = "per_item" if mode == "gdots" else _rows_fetch(rows_fetch, lambda fetch: interpret or any(
        smem(block_d=bd, rows_fetch=fetch, stream_kernels=stream_kernels, heads=heads, x_dtype=sources.dtype,
             acc_dtype=acc_dtype) <= SMEM_BYTES for bd in ((block_d,) if block_d else BLOCK_D_CHOICES)))
    smem = functools.partial(smem, rows_fetch=rows_fetch)
    sh = _shape(f"phase1_{mode}", sources.reshape(n * batch, t_len, d), segment_ids, stream_kernels=stream_kernels,
                heads=heads, block_d=block_d, interpret=interpret, smem=smem, choices=BLOCK_D_CHOICES,
                x_dtype=sources.dtype, acc_dtype=acc_dtype, out_dtype=out_dtype)
    has_bank = sh.has_bank and banks is not None
    t_pad = sh.t_pad
    inputs = [sh.x, jnp.asarray(banks, F32) if has_bank else jnp.zeros((n, 1, d), F32), _valid_first(valid, n),
              *_acc_rows(g_acc, t_len, t_pad)]
    if mode == "dstreams":
        # per (source, stream, head): the rows [P_s (S) | DSR_s (S) | W], one TMA copy per item
        cut = lambda a: _pad_t(jnp.asarray(a, F32)[..., :t_len, :], 4, t_pad)  # noqa: E731
        per_head = jnp.concatenate([cut(p), cut(dsr)]).transpose(1, 2, 5, 0, 3, 4)  # [n, m, H, 2S, B, Tp]
        w_rows = _pad_t(jnp.asarray(w, F32)[..., :t_len], 3, t_pad)[:, :, None, None]
        rows = jnp.concatenate([per_head, jnp.broadcast_to(w_rows, (n, m, heads, 1, batch, t_pad))], axis=3)
        inputs += [jnp.asarray(queries, F32), rows.reshape(n, m, heads * (2 * n_targets + 1), batch, t_pad)]
    if sh.has_seg:
        inputs.append(sh.bits)
    call = _kernel(_Config(mode=mode, n=n, batch=batch, t_pad=t_pad, d=d, stream_kernels=tuple(stream_kernels),
                           heads=heads, n_targets=n_targets, block_d=sh.block_d, has_bank=has_bank,
                           has_seg=sh.has_seg, front=sh.front, x_dtype=jnp.dtype(sh.x.dtype),
                           acc_dtype=jnp.dtype(acc_dtype), out_dtype=jnp.dtype(out_dtype), n_slots=n_slots,
                           group_slots=group_slots, ga_registers=ga_registers, interpret=bool(interpret),
                           rows_fetch=rows_fetch))
    out = call(*inputs)
    if mode == "gdots":  # [n, m H S, B, Tp] -> [S, n, m, B, T, H]
        out = out.reshape(n, m, heads, n_targets, batch, t_pad).transpose(3, 0, 1, 4, 5, 2)
        return out[:, :, :, :, :t_len]
    return out[:, :, :, :t_len]


class _Config(NamedTuple):
    """Everything the kernels' code depends on (see ``mosaic_gpu._Config``)."""

    mode: str
    n: int
    batch: int
    t_pad: int
    d: int
    stream_kernels: tuple
    heads: int
    n_targets: int
    block_d: int
    has_bank: bool
    has_seg: bool
    front: int
    x_dtype: jnp.dtype
    acc_dtype: jnp.dtype
    out_dtype: jnp.dtype
    n_slots: int
    group_slots: int
    ga_registers: bool
    interpret: bool
    rows_fetch: str = "per_item"  # ROWS_FETCHES ("dstreams")


@functools.lru_cache(maxsize=None)
def _kernel(cfg: _Config):
    """``cfg.mode``'s kernel for ``cfg``, built and jitted once: one program per (stream, batch
    row, token tile) walks its stream's (head, chunk) groups."""
    plgpu = _lane_plgpu()
    mode, n, batch, d, heads, bd, n_targets = cfg.mode, cfg.n, cfg.batch, cfg.d, cfg.heads, cfg.block_d, cfg.n_targets
    stream_kernels, has_bank, has_seg, front, n_slots = (cfg.stream_kernels, cfg.has_bank, cfg.has_seg, cfg.front,
                                                         cfg.n_slots)
    n_gslots = cfg.group_slots
    gdots = mode == "gdots"
    m, bt, t_pad = len(stream_kernels), BLOCK_T, cfg.t_pad
    layout = _stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    nch = d // bd // heads  # chunks per head
    n_groups = heads * nch  # the program's stream's (head, chunk) groups
    n_rows = 2 * n_targets + 1  # "dstreams": an item's per-token rows
    # "dstreams" with ROWS_FETCHES' "per_stream": each valid source's rows once per (head, stream)
    rows_cached = not gdots and cfg.rows_fetch == "per_stream"
    rows_per_item = not gdots and not rows_cached
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    lags = _Lags.of(max_lag)
    copies = [len(lags.copies(kernel)) for kernel in stream_kernels]  # lag-window copies of a stream's item
    taps = [has_bank and kernel > 0 for kernel in stream_kernels]
    scratch = dict(
        xs=plgpu.SMEM((n_slots, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        **{f"bs{r}": plgpu.SMEM((n_slots, kernel, bd), F32) for r, kernel in enumerate(stream_kernels) if taps[r]},
        gas=_tile_smem(plgpu, (n_gslots, n_targets, bt, bd), cfg.acc_dtype),
        qs=None if gdots else plgpu.SMEM((n_gslots, n_targets, bd), F32),
        rs=plgpu.SMEM((n if rows_cached else n_slots, n_rows, bt), F32) if not gdots else None,
        bar_rows=plgpu.Barrier(num_arrivals=1, num_barriers=n) if rows_cached else None,
        out_s=None if gdots else _tile_smem(plgpu, (2, bt, bd), cfg.out_dtype),
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
        plgpu.copy_gmem_to_smem(meta_ref, meta_s, bar_in.at[0])
        if has_seg:
            plgpu.copy_gmem_to_smem(bits_ref.at[b, rows], bits_s, bar_in.at[0])
        plgpu.barrier_wait(bar_in.at[0])
        masks = _lag_masks_of(plgpu, bits_s, max_lag, bt, bd)
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
            return _expand_item(plgpu, lags, xs, bss[r] if taps[r] else None, slot, stream_kernels[r], masks, bt, bd)

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
                        return _rows(plgpu.load(rs, (j if rows_cached else slot, k), layout=row), bt, bd)

                    de = -row_of(2 * n_targets) * e
                    for s in range(n_targets):
                        ga = ga_tile(s)
                        q = _cols(plgpu.load(qs, (gslot, s), layout=col), bt, bd)
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
                    _store_group(plgpu, ((dots_s.at[i], out_ref.at[i, pl.ds((r * heads + head) * n_targets,
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
    return _jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names],
                          name=f"depth_attention_bwd1_{mode}_mosaic", batch=batch, t_pad=t_pad,
                          interpret=cfg.interpret, streams=m)


# --------------------------------------------------------------------------- the expansion's transpose

# ``sources_transpose``' channel chunk: the bank gradient's token sums ride in the loop carry as
# whole ``[64, 8]`` float32 tiles (4 registers per thread each, 96 for kernels (0, 4, 8, 12)), as
# in ``mosaic_gpu.phase2_backward_inputs``
TRANSPOSE_BLOCK_D = 8
TRANSPOSE_AHEAD = 16  # rows past the tile the transposed conv reaches (max_lag - 1, in 8s)
# ``sources_transpose``' taps come once per source (their own copy, a source ahead), held in
# registers through the source's tiles (175 -> 224 registers: two programs per SM either way),
# rather than with each tile's copies: an H100, 3.119 -> 3.032 ms per call at `base`'s last block
# (-2.8%), 2.922 -> 2.791 at the bench shape (-4.5%), the same bits.
# Measured and taken out again (commit dfe9301 has them): its bf16 windows widened to
# float32 once per tile instead of per lag (96 fewer instructions in its 608-instruction loop, 7-19%
# slower: twice the shared-memory bytes per lag load), and the kernel without Pallas' automatic
# barriers (0.1% / 1.6% faster at `base` / the bench shape). Measured and taken out
# (commit 7037f37 has it): three or four items in flight instead of two (about 7 KB each), 2-7% /
# 5-17% slower at the bench shape / `base`'s last block on an H200, the same bits: the copies'
# latency does not hold this kernel.


def check_transpose_shape(*, d: int, stream_kernels: Sequence[int]) -> None:
    """Raises ``NotImplementedError`` (saying why) unless ``sources_transpose`` takes the shape."""
    if d % TRANSPOSE_BLOCK_D:
        raise NotImplementedError(f"mosaic_gpu_bwd1.sources_transpose: d = {d} must be a multiple of "
                                  f"{TRANSPOSE_BLOCK_D}")
    max_lag = max([1, *stream_kernels])
    if max_lag - 1 > TRANSPOSE_AHEAD or max_lag > MAX_LAG_BITS:
        raise NotImplementedError(f"mosaic_gpu_bwd1.sources_transpose: kernels up to {TRANSPOSE_AHEAD + 1} taps "
                                  f"(got {tuple(stream_kernels)})")
    if not any(stream_kernels):
        raise NotImplementedError("mosaic_gpu_bwd1.sources_transpose: no conv (identity streams need no kernel)")


def sources_transpose(d_streams, x, banks, segment_ids, valid, *, stream_kernels, out_dtype=None,
                      interpret: bool = False):
    """``conv_transpose.sources_transpose`` (the vjp of the expansion, Eq. 10, for ``n`` sources)
    as one Mosaic GPU kernel: ``d x[t] = sum_{r: kernel_r = 0} dE_r[t] + sum_r sum_delta
    c_r[delta] mask_delta[t + delta] dE_r[t + delta]`` and ``d c_r[delta] = sum_{b, t}
    mask_delta[t] dE_r[t] x[t - delta]``.

    One program per (batch row, 8-channel chunk) walks the valid sources and, for each, its
    64-token tiles, with the next item's copies in flight: the streams' cotangents ``[m, 80, 8]``
    (the tile's rows and the 16 after it, which the transposed conv reaches; loaded back at each
    lag's row offset, Lane semantics), the source's ``[80, 8]`` rows (the 16 before the tile, for
    the bank gradient), its taps and lag bits. The bank gradient's token sums ride in the loop
    carry as whole tiles, reduced over rows once per source. The sources ``valid`` rules out get
    zeros (their cotangents are not read).

    ``d_streams[n, m, B, T, d]`` (rows past ``T`` are taken as zeros), ``x[n, B, T, d]``,
    ``banks[n, K, d]``, ``segment_ids[B, T]`` or None, ``valid[n]`` or None. Returns ``(d x[n, B,
    T, d]`` in ``out_dtype`` (None: ``x``'s), ``d banks[n, K, d]`` float32)."""
    stream_kernels = tuple(stream_kernels)
    n, m, batch, t_len, d = d_streams.shape
    if m != len(stream_kernels) or x.shape != (n, batch, t_len, d):
        raise ValueError(f"mosaic_gpu_bwd1.sources_transpose: d_streams {d_streams.shape} and x {x.shape} do not "
                         f"match {len(stream_kernels)} streams")
    check_transpose_shape(d=d, stream_kernels=stream_kernels)
    n_taps = sum(stream_kernels)
    if banks is None or banks.shape != (n, n_taps, d):
        raise ValueError(f"mosaic_gpu_bwd1.sources_transpose: banks {None if banks is None else banks.shape}: "
                         f"want ({n}, {n_taps}, {d})")
    bt, ahead = BLOCK_T, TRANSPOSE_AHEAD
    max_lag = max(stream_kernels)
    has_seg = segment_ids is not None and max_lag > 1
    t_pad = -(-t_len // bt) * bt
    # rows before token 0 and past the last tile: zeros, as TMA fills them on the GPU (interpret
    # mode pads them; on the GPU only T is padded to whole tiles)
    front, back = (ahead, ahead) if interpret else (0, 0)
    de = jnp.pad(d_streams, ((0, 0),) * 3 + ((0, t_pad - t_len + back), (0, 0))).reshape(n * m, batch, -1, d)
    xp = jnp.pad(x, ((0, 0), (0, 0), (front, t_pad - t_len), (0, 0))).reshape(n * batch, -1, d)
    inputs = [de, xp, _pad_rows4(jnp.asarray(banks, F32).transpose(1, 0, 2).reshape(n_taps, n * d)), _valid_first(valid, n)]
    if has_seg:  # each tile's window: its rows and the next tile's first ones (zeros past the end)
        bits = _pad_t(lag_bits(segment_ids, t_len, max_lag), 1, t_pad)
        inputs.append(jnp.pad(bits, ((0, 0), (0, _BITS_ROWS - bt))))
    call = _transpose_kernel(_TransposeConfig(
        n=n, batch=batch, t_pad=t_pad, d=d, stream_kernels=stream_kernels, has_seg=has_seg,
        x_dtype=jnp.dtype(x.dtype), de_dtype=jnp.dtype(d_streams.dtype),
        out_dtype=jnp.dtype(out_dtype or x.dtype), n_tap_rows=_rows4(n_taps), interpret=bool(interpret)))
    dx, dbank = call(*inputs)  # [n, B, Tp, d], [n, B, K4, d]
    return dx[:, :, :t_len], jnp.sum(dbank[:, :, :n_taps], axis=1)


_BITS_ROWS = 96  # a tile's lag bits and the 16 rows after it, padded to 384 bytes (Lane copies: 128-byte multiples)


class _TransposeConfig(NamedTuple):
    n: int
    batch: int
    t_pad: int
    d: int
    stream_kernels: tuple
    has_seg: bool
    x_dtype: jnp.dtype
    de_dtype: jnp.dtype
    out_dtype: jnp.dtype
    n_tap_rows: int
    interpret: bool


@functools.lru_cache(maxsize=None)
def _transpose_kernel(cfg: _TransposeConfig):
    """``sources_transpose``' kernel for ``cfg``, built and jitted once."""
    from jax.experimental.pallas import mosaic_gpu as plgpu_module

    plgpu = _LanePlgpu(plgpu_module)
    n, batch, t_pad, d, has_seg = cfg.n, cfg.batch, cfg.t_pad, cfg.d, cfg.has_seg
    stream_kernels = cfg.stream_kernels
    m, bt, bd, ahead = len(stream_kernels), BLOCK_T, TRANSPOSE_BLOCK_D, TRANSPOSE_AHEAD
    layout = _stream_layout(stream_kernels)
    n_taps, n_tiles = sum(stream_kernels), t_pad // bt
    rows_in = bt + ahead
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA

    def to_f32(v):  # a register tile as float32
        return v.astype(F32)

    scratch = dict(
        des=plgpu.SMEM((2, m, rows_in, bd), cfg.de_dtype),  # the tile's rows of dE and the 16 after
        xs=plgpu.SMEM((2, rows_in, bd), cfg.x_dtype),  # the 16 rows before the tile and its own
        taps=plgpu.SMEM((2, cfg.n_tap_rows, bd), F32),  # per source, one ahead
        bits_s=plgpu.SMEM((2, _BITS_ROWS), jnp.int32) if has_seg else None,
        dxs=plgpu.SMEM((2, bt, bd), cfg.out_dtype),
        zero_s=plgpu.SMEM((bt, bd), cfg.out_dtype),
        sums_s=plgpu.SMEM((2, cfg.n_tap_rows, bd), F32),
        meta_s=plgpu.SMEM((n + 1, 64), jnp.int32),
        bar=plgpu.Barrier(num_arrivals=2 + has_seg, num_barriers=2),
        bar_in=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        bar_taps=plgpu.Barrier(num_arrivals=1, num_barriers=2),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        de_ref, x_ref, bank_ref, meta_ref = (next(it) for _ in range(4))
        bits_ref = next(it) if has_seg else None
        dx_ref, dbank_ref = next(it), next(it)
        sc = dict(zip(names, it))
        des, xs, taps, bits_s, dxs, zero_s, sums_s, meta_s = (
            sc.get(k) for k in ("des", "xs", "taps", "bits_s", "dxs", "zero_s", "sums_s", "meta_s"))
        bar, bar_in, bar_taps = sc["bar"], sc["bar_in"], sc["bar_taps"]
        b, c = lax.axis_index("b"), lax.axis_index("c")
        cs = pl.ds(c * bd, bd)
        plgpu.copy_gmem_to_smem(meta_ref, meta_s, bar_in.at[0])
        zero = plgpu.layout_cast(jnp.zeros((bt, bd), F32), tile)
        zero_s[...] = zero.astype(zero_s.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(bar_in.at[0])
        n_live = meta_s[n, 0]
        total = n_live * n_tiles
        front = ahead if cfg.interpret else 0  # the rows the interpreted x carries before token 0

        def fetch(f):
            """Item ``f`` (valid source ``f // n_tiles``, tile ``f % n_tiles``), if there is one."""
            @pl.when(f < total)
            def _():
                i, k, slot = meta_s[f // n_tiles, 0], lax.rem(f, n_tiles), lax.rem(f, 2)
                t0 = k * bt + b * 0  # traced: the x window starts before row 0 (TMA fills zeros)
                plgpu.copy_gmem_to_smem(de_ref.at[pl.ds(i * m, m), b, pl.ds(t0, rows_in), cs], des.at[slot],
                                        bar.at[slot])
                plgpu.copy_gmem_to_smem(x_ref.at[i * batch + b, pl.ds(t0 + front - ahead, rows_in), cs],
                                        xs.at[slot], bar.at[slot])
                if has_seg:
                    plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t0, _BITS_ROWS)], bits_s.at[slot], bar.at[slot])

        def fetch_taps(j):
            """Valid source ``j``'s taps, if there is one, into ``taps[j % 2]``."""
            @pl.when(j < n_live)
            def _():
                sslot = lax.rem(j, 2)
                plgpu.copy_gmem_to_smem(bank_ref.at[:, pl.ds(meta_s[j, 0] * d + c * bd, bd)], taps.at[sslot],
                                        bar_taps.at[sslot])

        def tile_step(f, dbank, held):
            """Tile ``f % n_tiles`` of valid source ``f // n_tiles``: ``d x`` stored, the bank sums
            carried; ``held``: the source's taps in registers."""
            slot = lax.rem(f, 2)
            plgpu.barrier_wait(bar.at[slot])

            def tap_of(k):
                return _cols(held[k], bt, bd)

            def de_rows(r, off):  # rows [off, off + 64) of stream r's dE in this tile's window, widened
                return to_f32(plgpu.load(des.at[slot, r, pl.ds(off, bt)], (), layout=tile))

            def x_rows(off):
                return to_f32(plgpu.load(xs.at[slot, pl.ds(off, bt)], (), layout=tile))

            behind, lead = [None] * max(1, max(stream_kernels)), [None] * max(1, max(stream_kernels))
            if has_seg:
                bits = plgpu.load(bits_s.at[slot, pl.ds(0, bt)], (), layout=row)
                for delta in range(1, len(behind)):
                    behind[delta] = _rows(((bits >> delta) & 1).astype(F32), bt, bd)
                    nbits = plgpu.load(bits_s.at[slot, pl.ds(delta, bt)], (), layout=row)
                    lead[delta] = _rows(((nbits >> delta) & 1).astype(F32), bt, bd)
            dbank = list(dbank)
            dx = None
            for r, (kernel, off) in enumerate(layout):
                if kernel == 0:
                    de0 = to_f32(plgpu.load(des.at[slot, r, pl.ds(0, bt)], (), layout=tile))
                    dx = de0 if dx is None else dx + de0
                    continue
                de0 = de_rows(r, 0)
                for delta in range(kernel):
                    tap = tap_of(off + delta)
                    de_lead = de0 if delta == 0 else de_rows(r, delta)
                    if lead[delta] is not None:
                        de_lead = de_lead * lead[delta]
                    term = tap * de_lead
                    dx = term if dx is None else dx + term
                    xl = x_rows(ahead - delta)
                    g = de0 * xl
                    if behind[delta] is not None:
                        g = g * behind[delta]
                    dbank[off + delta] = dbank[off + delta] + g
            j, k = f // n_tiles, lax.rem(f, n_tiles)
            i = meta_s[j, 0]
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot two tiles ago is read
            dxs[slot] = dx.astype(dxs.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dxs.at[slot], dx_ref.at[i, b, pl.ds(k * bt, bt), cs])
            fetch(f + 2)  # every thread is done with this slot (the commit above)
            return dbank

        def source_body(j, carry):
            sslot = lax.rem(j, 2)
            plgpu.barrier_wait(bar_taps.at[sslot])
            held = [plgpu.load(taps, (sslot, k), layout=col) for k in range(n_taps)]
            dbank = lax.fori_loop(j * n_tiles, (j + 1) * n_tiles, lambda f, dbank: tile_step(f, dbank, held),
                                  [zero] * n_taps)
            fetch_taps(j + 2)  # every thread loaded this source's taps before the loop's commits
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            for t in range(n_taps):
                sums_s[sslot, t] = jnp.sum(dbank[t], axis=0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(sums_s.at[sslot], dbank_ref.at[meta_s[j, 0], b, :, cs])
            return carry

        fetch_taps(0)
        fetch_taps(1)
        fetch(0)
        fetch(1)
        lax.fori_loop(0, n_live, source_body, 0)

        # the ruled-out sources: zeros for d x and the bank partial (sums_s[0] zeroed once its
        # last store has read it)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        for t in range(cfg.n_tap_rows):
            sums_s[0, t] = plgpu.layout_cast(jnp.zeros((bd,), F32), col)
        plgpu.commit_smem()

        def zero_source(j, carry):
            i = meta_s[j, 0]
            for k in range(n_tiles):
                plgpu.copy_smem_to_gmem(zero_s, dx_ref.at[i, b, pl.ds(k * bt, bt), cs])
            plgpu.copy_smem_to_gmem(sums_s.at[0], dbank_ref.at[i, b, :, cs])
            return carry

        lax.fori_loop(n_live, n, zero_source, 0)
        plgpu.wait_smem_to_gmem(0)

    out_type = (jax.ShapeDtypeStruct((n, batch, t_pad, d), cfg.out_dtype),
                jax.ShapeDtypeStruct((n, batch, cfg.n_tap_rows, d), F32))
    params = dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    kernel = plgpu.kernel(named_body(body, "depth_attention_expansion_transpose_mosaic"),
                          out_type=out_type, scratch_types=[scratch[k] for k in names],
                          grid=(batch, d // bd), grid_names=("b", "c"),
                          interpret=plgpu.InterpretGPUParams() if cfg.interpret else False, **params)

    @jax.jit
    def run_kernel(*inputs):
        with jax.named_scope("depth_attention_expansion_transpose_mosaic"):
            return kernel(*inputs)

    return run_kernel
