"""Phase 2's fused forward (and its backward's state pass) with the state read once: a cluster of
CTAs holds a token tile's state. A measured alternative, exact and slower than the one-CTA
kernels of ``mosaic_gpu``; nothing in the package calls it (docs/kernels.md).

``mosaic_gpu.phase2_fused_forward`` reads the float32 state twice per call (2.15 of its 2.82 GB
at `base`): the gate (Eq. 13-14) needs ``sum z^2`` and ``z . W_j`` over all ``m d`` entries of a
token before any channel of ``h`` can be formed, and a 64-token tile's whole state (``m d``
float32 per token: 1 MB at `base`, 2 MB at the bench shape) does not fit in one SM's shared
memory. Here a cluster of ``G`` CTAs shares a tile: CTA ``g`` takes channels ``[g d/G, (g+1)
d/G)`` (128 of them at ``G = d / 128``), brings its slice of the state into shared memory once
and keeps it through all three passes:

* A: the partial's scores (Eq. 10-11: ``q_r . E_r`` and ``sum E_r^2`` over the CTA's channels),
  then the cluster's sums of both (exchange 1) and the online-softmax merge coefficients;
* B: the gate's statistics (``sum z^2``, ``z . W_j`` with ``z_r = a A_r + b E_r``) over the
  CTA's channels, then their cluster sums (exchange 2) and the gate ``g``;
* C: ``h = sum_r g_r z_r`` for the CTA's channels, from the state still in shared memory.

The exchanges move a ``[64, 8]`` float32 tile of per-token sums per CTA (column ``j``: sum
``j``) with ``plgpu.async_store_smem`` (``st.async`` into a peer's shared memory, counted on the
peer's barrier): ``"all"`` sends each CTA's tile to every CTA (one hop; ``G`` tiles of receive
buffer per exchange), ``"butterfly"`` adds pairs ``g, g xor 2^s`` for ``s < log2 G`` (``log2 G``
hops and tiles). ``"pull"`` leaves each CTA's tile in its own shared memory and, once a
``ClusterBarrier`` says all are written, every CTA loads all of them through
``plgpu.cluster_ref`` (one tile per exchange). Every CTA adds the same values in the same order
(``"all"``, ``"pull"``: the tiles in CTA order; ``"butterfly"``: ``a + b`` and ``b + a`` are the
same float), so all ``G`` CTAs form the same gate to the bit. The channel sums are grouped
differently from ``mosaic_gpu``'s (per CTA, then across the cluster): the same values to float32
rounding.

Bytes per call: the partial's windows and the state once, ``h`` once (the one-CTA kernel: the
state twice). One CTA per SM (the state's slice is 128 KB); the passes of one tile do not
overlap each other's copies, only the copies still in flight. Built to remove the state's second
read; ``benchmarks/mgpu/cluster_probe.py`` tests the exchange alone. On the CPU it runs interpreted with ``G = 1`` (no exchange: jax 0.11.2's Mosaic GPU
interpreter has no rule for ``async_store_smem``); ``G > 1`` runs on a GPU only.

**Exact, and slower than the one-CTA kernels; nothing in the package calls it.** On an H100
(docs/kernels.md) the ``"pull"`` exchange is exact: ``cluster_probe.py``'s sums at ``G = 2, 8, 16``, this forward
at ``G = 8`` against the one-CTA kernel at 1e-5 (segments, a ragged tile), the backward's state
pass (``phase2_cluster_backward_state``, below) at ``G = 8`` and 16. The ``st.async`` forms
(``"all"``, ``"butterfly"``) fault at launch (unspecified launch failure; sums "off by 2" in the
probe are its own float32 rounding of its test values), so they ask for
``unverified_exchange=True``. Timed at `base`, the cluster forward takes 1.39-1.48 ms against the
one-CTA kernel's 1.18-1.19 (one warpgroup per CTA; two: 2.32), and the backward's state pass
1.64-1.71 against 1.58-1.60: with one CTA per SM (its slice of the state is 128 KB) a tile's
loads, passes and exchanges run one after another, where the one-CTA kernels overlap programs;
clusters that walk the tiles take 1.3-1.7x the time of one cluster per tile, and clusters of 16
are slower than of 8.
``PULL_FENCE`` (``fence.acq_rel.cluster`` around the barrier, which PTX's memory model asks for)
costs 4-7%.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference
from pallas_kernels.depth_attention.fused import _pad_t, _stream_layout
from pallas_kernels.depth_attention.mosaic_gpu import (
    BLOCK_T, F32, SMEM_BYTES, _cols, _copy_state, _expand_all, _fetch_partial, _Lags, _lag_masks_of, _LanePlgpu,
    _dh_operand, _rows, _shape, _smem_sum, _state_rows, _tile_smem, _window_elems, gate_backward, named_body,
)

BLOCK_D = 32  # channels per chunk, as ``mosaic_gpu``'s forward
SLICE_D = 128  # channels per CTA that ``cluster_size`` aims at: the state's slice 128 KB (m = 4, float32)
# "all" and "butterfly" push tiles into the peers' shared memory (``st.async``); "pull" reads them
# from there (``plgpu.cluster_ref`` after a ``ClusterBarrier``): the module docstring
EXCHANGES = ("all", "butterfly", "pull")
PULL_FENCE = True  # cluster_fence around the pull exchange's barrier (timing experiments: False)
XCH_COLS = 8  # per-token sums per exchange tile: m dots and m sums of squares (m <= 4), or 1 + m
MAX_CLUSTER = 16  # Hopper's largest cluster (above 8: non-portable, opted into at launch)
WARPGROUPS = (1, 2)  # per CTA (``_kernel``)


def cluster_size(d: int, slice_d: int = SLICE_D) -> int:
    """The cluster that gives each CTA ``slice_d`` channels of ``d`` (at least 1)."""
    return max(1, d // slice_d)


def persistent_programs(n_tiles: int, cluster: int, sms: int = 132) -> int:
    """Clusters that walk ``n_tiles`` token tiles when each CTA holds one SM (its shared memory):
    the largest divisor of ``n_tiles`` up to ``sms / cluster`` (the H200 has 132 SMs)."""
    return max(k for k in range(1, max(1, sms // cluster) + 1) if n_tiles % k == 0)


def smem_bytes(*, d: int, cluster: int, stream_kernels: Sequence[int], x_dtype, acc_dtype, out_dtype,
               exchange: str = "all", has_seg: bool = True, warpgroups: int = 1) -> int:
    """Shared memory of one CTA (its scratch list as ``_kernel`` builds it; ``_smem_sum``)."""
    m, bt, bd = len(stream_kernels), BLOCK_T, BLOCK_D
    nck = d // cluster // bd
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    n_taps = max(1, sum(stream_kernels))
    n_xch = _exchange_tiles(cluster, exchange)
    return _smem_sum(nck * _window_elems(stream_kernels, "padded", bd) * size(x_dtype), nck * n_taps * bd * 4,
                     nck * m * bd * 4, nck * m * m * bd * 4, nck * m * bt * bd * size(acc_dtype), 2 * 2 * m * bt * 4,
                     2 * bt * 4 if has_seg else 0, (2 + m) * bt * 4, warpgroups * 2 * bt * bd * size(out_dtype),
                     2 * m * bt * 4, 2 * n_xch * bt * XCH_COLS * 4, 2 * (warpgroups - 1) * bt * XCH_COLS * 4,
                     2 * bt * XCH_COLS * 4 if warpgroups > 1 else 0,
                     barriers=warpgroups + 1 + 2 * nck + 2 + _exchange_barriers(cluster, exchange)
                     + (4 if warpgroups > 1 else 0), reduces=True)


def _exchange_barriers(cluster: int, exchange: str) -> int:
    """Barriers of the two exchanges: one each (``"all"``, ``"pull"``), one per butterfly step,
    none alone."""
    return 0 if cluster == 1 else 2 if exchange in ("all", "pull") else 2 * _exchange_tiles(cluster, exchange)


def _exchange_tiles(cluster: int, exchange: str) -> int:
    """Tiles per exchange: one per CTA received (``"all"``), one per butterfly step, the CTA's
    own (``"pull"``), none alone."""
    if cluster == 1:
        return 0
    return cluster if exchange == "all" else 1 if exchange == "pull" else cluster.bit_length() - 1


def phase2_cluster_forward(state, partial, bank, query, include_partial, gate_params, segment_ids, *,
                           stream_kernels: Sequence[int], heads: int, eps: float, gate_eps: float, out_dtype=F32,
                           cluster: int | None = None, exchange: str | None = None, programs: int | None = None,
                           warpgroups: int = 1, unverified_exchange: bool = False, interpret: bool = False):
    """``mosaic_gpu.phase2_fused_forward(fuse="gate")``'s outputs, ``h[B, T, d]`` and the scores
    ``(dots[m, B, T, 1], sumsq[m, B, T])``, from a cluster of ``cluster`` CTAs per 64-token tile
    (None: ``cluster_size(d)``) that reads the state once (the module docstring). MSAR's shape
    only: one head, the H_pre gate, ``d`` a multiple of ``cluster * 32``, ``cluster`` a power of
    two up to ``MAX_CLUSTER``; ``exchange``: ``EXCHANGES`` (None: ``"pull"``, the one that works). ``programs``: None runs one cluster per
    64-token tile; an integer runs that many clusters (a divisor of the ``B * ceil(T / 64)``
    tiles; ``persistent_programs`` picks one per SM group), each walking its tiles and bringing the
    next tile's chunks in as the last pass frees their buffers. ``warpgroups``: 1 or 2 per CTA
    (``_kernel``), each with half the CTA's chunks. ``unverified_exchange``: required for
    ``cluster > 1`` with ``"all"`` or ``"butterfly"``, whose launches fail (the module docstring). Raises
    ``NotImplementedError`` for other shapes and where a CTA's scratch exceeds the shared memory;
    ``ValueError`` for a bad ``cluster``, ``exchange``, ``warpgroups`` or ``programs``."""
    batch, t_len, d = partial.shape
    m = len(stream_kernels)
    cluster = cluster_size(d) if cluster is None else cluster
    exchange = "pull" if exchange is None else exchange
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange={exchange!r}: must be one of {EXCHANGES}")
    if cluster < 1 or cluster > MAX_CLUSTER or cluster & (cluster - 1):
        raise ValueError(f"cluster={cluster}: must be a power of two from 1 to {MAX_CLUSTER}")
    if cluster > 1 and exchange != "pull" and not unverified_exchange:
        raise NotImplementedError(
            f"cluster={cluster}, exchange={exchange!r}: the st.async exchange's launches fail on an H100 (jax "
            "0.11.2: unspecified launch failure); exchange='pull' works; pass "
            "unverified_exchange=True to run it anyway")
    if interpret and cluster > 1:
        raise NotImplementedError(f"cluster={cluster}: the Mosaic GPU interpreter (jax 0.11.2) has no rule for "
                                  "the cluster exchange (async_store_smem, cluster_ref); interpret mode runs cluster=1")
    if heads != 1 or m > XCH_COLS // 2:
        raise NotImplementedError(f"phase2_cluster_forward: one head and at most {XCH_COLS // 2} streams "
                                  f"(got heads={heads}, m={m})")
    if warpgroups not in WARPGROUPS:
        raise ValueError(f"warpgroups={warpgroups!r}: must be one of {WARPGROUPS}")
    if d % (cluster * warpgroups * BLOCK_D):
        raise NotImplementedError(f"phase2_cluster_forward: d = {d} must be a multiple of cluster x warpgroups x "
                                  f"{BLOCK_D} = {cluster * warpgroups * BLOCK_D}")
    if max([1, *stream_kernels]) - 1 > 8 * _Lags.of(max([1, *stream_kernels]), "padded").extra:
        raise NotImplementedError(f"phase2_cluster_forward: kernels {tuple(stream_kernels)}")
    sh = _shape("phase2_cluster_forward", partial, segment_ids, stream_kernels=stream_kernels, heads=1,
                block_d=BLOCK_D, interpret=interpret, smem=None, x_dtype=partial.dtype, acc_dtype=state.acc.dtype,
                out_dtype=out_dtype)
    smem = smem_bytes(d=d, cluster=cluster, stream_kernels=stream_kernels, x_dtype=partial.dtype,
                      acc_dtype=state.acc.dtype, out_dtype=out_dtype, exchange=exchange, has_seg=sh.has_seg,
                      warpgroups=warpgroups)
    if not interpret and smem > SMEM_BYTES:
        raise NotImplementedError(f"phase2_cluster_forward: {smem} bytes of shared memory per CTA at d = {d}, "
                                  f"cluster = {cluster}, exchange = {exchange!r}, warpgroups = {warpgroups} (the "
                                  f"H200 has {SMEM_BYTES})")
    t_pad = sh.t_pad
    n_tiles = batch * (t_pad // BLOCK_T)
    if programs is not None and (programs < 1 or n_tiles % programs):
        raise ValueError(f"programs={programs}: must divide the {n_tiles} token tiles (B x ceil(T / 64))")
    pad_t = lambda a, axis, value=0.0: _pad_t(a, axis, t_pad, value)  # noqa: E731
    banks = jnp.asarray(bank, F32) if sh.has_bank and bank is not None else jnp.zeros((1, d), F32)
    w, scale, bias = gate_params
    w_rows = jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1).reshape(m * m, d)  # [(r, j), c]
    consts = [jnp.asarray(include_partial, F32), jnp.asarray(scale, F32).reshape(()),
              *jnp.asarray(bias, F32).reshape(m)]
    consts = jnp.broadcast_to(jnp.stack(consts)[:, None], (len(consts), BLOCK_T))
    rows = jnp.stack([pad_t(jnp.asarray(state.max, F32)[..., 0], 2),  # [2, m, B, Tp]: max, denom
                      pad_t(jnp.asarray(state.denom, F32)[..., 0], 2, 1.0)])
    inputs = [sh.x, banks, jnp.asarray(query, F32), _state_rows(state.acc, t_pad), rows, consts, w_rows]
    if sh.has_seg:
        inputs.append(sh.bits)
    cfg = _Config(batch=batch, t_pad=t_pad, d=d, cluster=cluster, exchange=exchange,
                  stream_kernels=tuple(stream_kernels), has_bank=bool(sh.has_bank and bank is not None),
                  has_seg=sh.has_seg, front=sh.front, eps=float(eps), gate_eps=float(gate_eps),
                  x_dtype=jnp.dtype(sh.x.dtype), acc_dtype=jnp.dtype(state.acc.dtype), out_dtype=jnp.dtype(out_dtype),
                  programs=programs or 0, warpgroups=warpgroups, interpret=bool(interpret))
    h, dots, sumsq = _kernel(cfg)(*inputs)
    return h[:, :t_len], (dots[:, :, :t_len, None], sumsq[:, :, :t_len])


class _Config(NamedTuple):
    """Everything ``_kernel``'s code depends on (hashable: built once per value)."""

    batch: int
    t_pad: int
    d: int
    cluster: int
    exchange: str
    stream_kernels: tuple
    has_bank: bool
    has_seg: bool
    front: int
    eps: float
    gate_eps: float
    x_dtype: jnp.dtype
    acc_dtype: jnp.dtype
    out_dtype: jnp.dtype
    programs: int  # 0: one program per tile; else that many programs (clusters) walk the tiles
    warpgroups: int
    interpret: bool


def _pack(plgpu, vals, width: int = XCH_COLS):
    """Row vectors ``vals`` (``[64]`` each, at most ``width``) as the columns of one ``[64, width]`` tile."""
    tile = plgpu.Layout.WGMMA
    cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK_T, width), 1, layout=tile)
    out = None
    for j, v in enumerate(vals):
        term = _rows(v, BLOCK_T, width) * (cols == j).astype(F32)
        out = term if out is None else out + term
    return out


def _unpack(plgpu, packed, n: int):
    """The first ``n`` columns of a ``[64, width]`` tile as row vectors (``_pack``'s inverse)."""
    cols = plgpu.broadcasted_iota(jnp.int32, packed.shape, 1, layout=plgpu.Layout.WGMMA)
    return [jnp.sum(packed * (cols == j).astype(F32), axis=1) for j in range(n)]


def cluster_fence(plgpu) -> None:
    """``fence.acq_rel.cluster`` in every thread that calls it. Mosaic GPU's cluster barrier
    arrives and waits at CTA scope (``mbarrier.arrive.shared::cluster`` with PTX's default
    ``.release.cta``), which orders a CTA's own shared-memory writes but, by PTX's memory model,
    not for a peer's ``ld.shared::cluster``: the writer fences before its arrival, the reader
    after its wait (the pattern of ``barrier.cluster.arrive.release`` / ``wait.acquire``)."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu()
    def fence(_ctx):
        mgpu_utils.inline_ptx("fence.acq_rel.cluster;", has_side_effects=True)

    fence()


def _cluster_sum(plgpu, cfg: _Config, mine, recv, bar, round_: int):
    """The sum over the cluster's CTAs of each CTA's ``[64, 8]`` tile ``mine`` (``cfg.exchange``;
    exchange ``round_`` of the tile: its own receive tiles and barriers, so no round overwrites a
    tile a CTA may still read). Every CTA gets the same bits (the module docstring)."""
    if cfg.cluster == 1:
        return mine
    tile = plgpu.Layout.WGMMA
    g = lax.axis_index("g")
    if cfg.exchange == "pull":  # the CTA's tile in its own shared memory; once all are, every CTA reads all
        recv[round_, 0] = mine
        if PULL_FENCE:
            cluster_fence(plgpu)  # each thread's part of the tile released to the cluster
        plgpu.commit_smem()  # a warpgroup barrier: the whole tile is written before the arrival
        plgpu.barrier_arrive(bar.at[round_])
        plgpu.barrier_wait(bar.at[round_])
        if PULL_FENCE:
            cluster_fence(plgpu)  # the peers' tiles acquired before they are loaded
        total = None
        for j in range(cfg.cluster):
            got = plgpu.load(plgpu.cluster_ref(recv.at[round_, 0], {"g": jnp.int32(j)}), (), layout=tile)
            total = got if total is None else total + got
        return total
    if cfg.exchange == "all":  # every CTA's tile into slot g of every CTA, then the slots in order
        for j in range(cfg.cluster):
            plgpu.async_store_smem(mine, recv.at[round_, g], bar.at[round_], cluster_idx=jnp.int32(j),
                                   cluster_dim="g")
        plgpu.barrier_wait(bar.at[round_])
        total = None
        for j in range(cfg.cluster):
            got = plgpu.load(recv.at[round_, j], (), layout=tile)
            total = got if total is None else total + got
        return total
    steps = cfg.cluster.bit_length() - 1  # butterfly: after step s, the sum over a 2^(s+1)-aligned group
    total = mine
    for s in range(steps):
        k = round_ * steps + s
        partner = (g ^ (1 << s)).astype(jnp.int32)
        plgpu.async_store_smem(total, recv.at[round_, s], bar.at[k], cluster_idx=partner, cluster_dim="g")
        plgpu.barrier_wait(bar.at[k])
        total = total + plgpu.load(recv.at[round_, s], (), layout=tile)
    return total


def _tile_of(programs: int, n_t: int, j):
    """The (batch row, token tile) of a program's ``j``-th tile: its own (``programs == 0``, grid
    ``("b", "t")``) or, for ``programs`` programs walking the tiles (grid ``("b",)``), every
    ``programs``-th of them in row-major order."""
    if not programs:
        return lax.axis_index("b"), lax.axis_index("t")
    i = lax.axis_index("b") + j * programs  # "b": the program (``_Lags.columns`` reads that axis)
    return i // n_t, lax.rem(i, n_t)


class _TileCopies(NamedTuple):
    """A CTA's TMA copies of a tile's pieces into its buffers (both cluster kernels): the per-token
    rows (and segment bits) into slot ``slot``, and chunk ``k`` of its channel slice (from
    ``c_first``) of the partial's lag windows and of the state."""

    plgpu: object
    programs: int
    n_t: int
    t_pad: int
    front: int
    c_first: object
    lags: _Lags
    max_lag: int
    rows_ref: object
    rows_s: object
    bits_ref: object
    bits_s: object
    bar_in: object
    x_ref: object
    xs: object
    bar_x: object
    acc_ref: object
    accs: object
    bar_acc: object

    def rows(self, j, slot):
        bi, ti = _tile_of(self.programs, self.n_t, j)
        self.plgpu.copy_gmem_to_smem(self.rows_ref.at[:, :, bi, pl.ds(ti * BLOCK_T, BLOCK_T)], self.rows_s.at[slot],
                                     self.bar_in.at[slot])
        if self.bits_ref is not None:
            self.plgpu.copy_gmem_to_smem(self.bits_ref.at[bi, pl.ds(ti * BLOCK_T, BLOCK_T)], self.bits_s.at[slot],
                                         self.bar_in.at[slot])

    def x(self, j, k):
        bi, ti = _tile_of(self.programs, self.n_t, j)
        _fetch_partial(self.plgpu, self.x_ref, None, self.xs, None, bi, ti * BLOCK_T, self.front, self.c_first + k,
                       BLOCK_D, k, self.bar_x, self.lags, self.max_lag)

    def acc(self, j, k):
        bi, ti = _tile_of(self.programs, self.n_t, j)
        _copy_state(self.plgpu, self.acc_ref, self.accs, pl.ds(bi * self.t_pad + ti * BLOCK_T, BLOCK_T),
                    pl.ds((self.c_first + k) * BLOCK_D, BLOCK_D), k, self.bar_acc.at[k], "one")


def _cta_sum(plgpu, cfg: _Config, w: int, vals, rnd, hand, width: int, recv, bar_xch, part_s, total_s, bar_part,
             bar_total):
    """The sums over the CTA's warpgroups and the cluster of warpgroup ``w``'s row vectors ``vals``,
    packed as the columns of a ``[64, width]`` tile. The other warpgroups hand their tiles to the
    first (slot ``hand`` of ``part_s``), which adds them, runs the cluster's exchange (round ``rnd``:
    ``_cluster_sum``) and hands the totals back (``total_s``)."""
    tile = plgpu.Layout.WGMMA
    mine = _pack(plgpu, vals, width)
    if cfg.warpgroups == 1:
        return _unpack(plgpu, _cluster_sum(plgpu, cfg, mine, recv, bar_xch, rnd), len(vals))
    if w:
        part_s[hand, w - 1] = mine
        plgpu.commit_smem()  # a warpgroup barrier: every thread's part written before the arrival
        plgpu.barrier_arrive(bar_part.at[hand])
        plgpu.barrier_wait(bar_total.at[hand])
        return _unpack(plgpu, plgpu.load(total_s.at[hand, 0], (), layout=tile), len(vals))
    plgpu.barrier_wait(bar_part.at[hand])
    for other in range(cfg.warpgroups - 1):
        mine = mine + plgpu.load(part_s.at[hand, other], (), layout=tile)
    total = _cluster_sum(plgpu, cfg, mine, recv, bar_xch, rnd)
    total_s[hand, 0] = total
    plgpu.commit_smem()
    plgpu.barrier_arrive(bar_total.at[hand])
    return _unpack(plgpu, total, len(vals))


def _run_warpgroups(run, warpgroups: int) -> None:
    """``run(w)`` in warpgroup ``w`` of the CTA (thread axis ``"wg"`` when there are several)."""
    if warpgroups == 1:
        run(0)
        return
    wg = lax.axis_index("wg")
    for w in range(warpgroups):
        pl.when(wg == w)(functools.partial(run, w))


def _launch(plgpu, body, name: str, out_type, scratch_types, *, batch: int, n_t: int, cluster: int,
            warpgroups: int, programs: int, interpret: bool):
    """``body`` as a jitted Mosaic GPU kernel named ``name`` (Lane semantics): ``warpgroups``
    warpgroups per CTA, clusters of ``cluster`` CTAs along ``"g"``, and one program per (batch row,
    token tile) or ``programs`` programs walking them (``_tile_of``)."""
    params = dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    if warpgroups > 1:
        params.update(num_threads=warpgroups, thread_name="wg")
    if cluster > 1:
        params.update(cluster=(cluster,), cluster_names=("g",))
    grid = dict(grid=(programs,), grid_names=("b",)) if programs else dict(grid=(batch, n_t), grid_names=("b", "t"))
    kernel = plgpu.kernel(named_body(body, name), out_type=out_type, scratch_types=scratch_types, **grid,
                          interpret=plgpu.InterpretGPUParams() if interpret else False, **params)

    @jax.jit
    def run(*inputs):
        with jax.named_scope(name):
            return kernel(*inputs)

    return run


@functools.lru_cache(maxsize=None)
def _kernel(cfg: _Config):
    """The kernel for ``cfg``, jitted (``mosaic_gpu._kernel`` says why once per configuration).

    ``cfg.warpgroups`` warpgroups per CTA, each with its share of the CTA's chunks (a
    contiguous run): per-token sums meet in the first (``part_s``), which runs the cluster's
    exchange and hands the totals back (``total_s``). Two warpgroups of 255 registers fill an
    SM's register file, as two one-warpgroup programs of ``mosaic_gpu._kernel`` do: one CTA of
    one warpgroup per SM leaves each scheduler a single warp to issue from."""
    from jax.experimental.pallas import mosaic_gpu as plgpu_module

    plgpu = _LanePlgpu(plgpu_module)
    batch, t_pad, d, G, W = cfg.batch, cfg.t_pad, cfg.d, cfg.cluster, cfg.warpgroups
    m, bt, bd = len(cfg.stream_kernels), BLOCK_T, BLOCK_D
    layout = _stream_layout(cfg.stream_kernels)
    max_lag = max([1, *cfg.stream_kernels])
    lags = _Lags.of(max_lag, "padded")
    nck = d // G // bd  # chunks per CTA
    nw = nck // W  # chunks per warpgroup
    n_taps = max(1, sum(cfg.stream_kernels))
    n_xch = _exchange_tiles(G, cfg.exchange)
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    xch_tiles = lambda n: plgpu.SMEM((2, n, bt, XCH_COLS), F32, transforms=(  # noqa: E731
        plgpu.TilingTransform((8, XCH_COLS)), plgpu.SwizzleTransform(XCH_COLS * 4)))
    # "all": one barrier per exchange, G stores each; "butterfly": one per step, one store each
    # (Pallas counts a Lane kernel's arrivals per thread: num_arrivals is per store)
    xch_bar = plgpu.Barrier(num_arrivals=G if cfg.exchange == "all" else 1,
                            num_barriers=max(1, _exchange_barriers(G, cfg.exchange)))
    if cfg.exchange == "pull":  # each CTA's (leading) warpgroup arrives once at every CTA's barrier
        xch_bar = plgpu.ClusterBarrier(collective_axes=("g",), num_arrivals=1, num_barriers=2)
    n_t = t_pad // bt
    persistent = cfg.programs > 0
    n_iter = batch * n_t // cfg.programs if persistent else 1  # tiles per program
    scratch = dict(
        xs=plgpu.SMEM((nck, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((nck, n_taps, bd), F32) if cfg.has_bank else None,
        qs=plgpu.SMEM((nck, m, bd), F32),
        ws=plgpu.SMEM((nck, m * m, bd), F32),
        accs=_tile_smem(plgpu, (nck, m, bt, bd), cfg.acc_dtype),
        rows_s=plgpu.SMEM((2, 2, m, bt), F32),  # per tile slot: the state's max and denom rows
        bits_s=plgpu.SMEM((2, bt), jnp.int32) if cfg.has_seg else None,
        scal_s=plgpu.SMEM((2 + m, bt), F32),
        h_s=_tile_smem(plgpu, (W * 2, bt, bd), cfg.out_dtype),  # two store slots per warpgroup
        scores_s=plgpu.SMEM((2, m, bt), F32),
        recv=xch_tiles(max(1, n_xch)) if G > 1 else None,
        part_s=xch_tiles(W - 1) if W > 1 else None,  # per exchange, the other warpgroups' sums
        total_s=xch_tiles(1) if W > 1 else None,  # per exchange, the CTA's totals for them
        # per warpgroup, its chunks' taps, queries and gate columns (once); the constants
        bar_const=plgpu.Barrier(num_arrivals=nw * (cfg.has_bank + 2), num_barriers=W),
        bar_scal=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        bar_x=plgpu.Barrier(num_arrivals=lags.count, num_barriers=nck),  # a tile's chunk of the partial
        bar_acc=plgpu.Barrier(num_arrivals=1, num_barriers=nck),  # a tile's chunk of the state
        bar_in=plgpu.Barrier(num_arrivals=1 + cfg.has_seg, num_barriers=2),  # a tile's rows, per slot
        bar_xch=xch_bar if G > 1 else None,
        bar_part=plgpu.Barrier(num_arrivals=W - 1, num_barriers=2) if W > 1 else None,
        bar_total=plgpu.Barrier(num_arrivals=1, num_barriers=2) if W > 1 else None,
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(x_ref, bank_ref, q_ref, acc_ref, rows_ref, consts_ref, w_ref, *rest):
        bits_ref = rest[0] if cfg.has_seg else None
        h_ref, dots_ref, ss_ref = rest[cfg.has_seg:cfg.has_seg + 3]
        sc = dict(zip(names, rest[cfg.has_seg + 3:]))
        xs, bs, qs, ws, accs = (sc.get(k) for k in ("xs", "bs", "qs", "ws", "accs"))
        rows_s, bits_s, scal_s, h_s, scores_s = (sc.get(k) for k in ("rows_s", "bits_s", "scal_s", "h_s", "scores_s"))
        recv, part_s, total_s = sc.get("recv"), sc.get("part_s"), sc.get("total_s")
        bar_const, bar_x, bar_acc, bar_in = (sc.get(k) for k in ("bar_const", "bar_x", "bar_acc", "bar_in"))
        bar_xch, bar_part, bar_total = sc.get("bar_xch"), sc.get("bar_part"), sc.get("bar_total")
        bar_scal = sc["bar_scal"]
        g = lax.axis_index("g") if G > 1 else 0
        c_first = g * nck  # the CTA's first channel chunk

        tile_of = functools.partial(_tile_of, cfg.programs, n_t)
        copies = _TileCopies(plgpu, cfg.programs, n_t, t_pad, cfg.front, c_first, lags, max_lag, rows_ref, rows_s,
                             bits_ref, bits_s, bar_in, x_ref, xs, bar_x, acc_ref, accs, bar_acc)
        fetch_rows, fetch_x, fetch_acc = copies.rows, copies.x, copies.acc

        def run(w: int):
            """Warpgroup ``w``: its chunks ``k0 .. k0 + nw - 1`` of every tile; the first also the
            tile's rows, the exchanges and the scores."""
            leader, k0 = w == 0, w * nw

            def cta_sum(vals, rnd):  # the exchange's round: its own buffers and barriers
                return _cta_sum(plgpu, cfg, w, vals, rnd, rnd, XCH_COLS, recv, bar_xch, part_s, total_s, bar_part,
                                bar_total)

            # the constants of this warpgroup's chunks once; the first tile's rows, then its chunks of
            # the partial (pass A) and of the state (pass B); later tiles' come as the tile before
            # frees their buffers
            for k in range(k0, k0 + nw):
                cs = pl.ds((c_first + k) * bd, bd)
                if cfg.has_bank:
                    plgpu.copy_gmem_to_smem(bank_ref.at[:, cs], bs.at[k], bar_const.at[w])
                plgpu.copy_gmem_to_smem(q_ref.at[:, cs], qs.at[k], bar_const.at[w])
                plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws.at[k], bar_const.at[w])
            if leader:
                plgpu.copy_gmem_to_smem(consts_ref, scal_s, bar_scal.at[0])
                fetch_rows(0, 0)
            for k in range(k0, k0 + nw):
                fetch_x(0, k)
            for k in range(k0, k0 + nw):
                fetch_acc(0, k)
            plgpu.barrier_wait(bar_const.at[w])
            plgpu.barrier_wait(bar_scal.at[0])
            zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)
            inc = plgpu.load(scal_s, 0, layout=row) > 0.5
            scale = plgpu.load(scal_s, 1, layout=row)

            def tile_step(j, carry):
                slot = lax.rem(j, 2)
                bi, ti = tile_of(j)
                t0 = ti * bt
                has_next = j + 1 < n_iter
                if leader:
                    @pl.when(has_next)
                    def _():
                        fetch_rows(j + 1, 1 - slot)

                plgpu.barrier_wait(bar_in.at[slot])
                masks = _lag_masks_of(plgpu, bits_s.at[slot] if cfg.has_seg else None, max_lag, bt, bd)

                def expand(k):
                    return _expand_all(plgpu, xs, bs, k, layout, masks, bt, bd, lags, "shared")

                # ---- A: the partial's dots and sums of squares over these chunks, then the CTA's and cluster's
                def scores_chunk(k, carry):
                    plgpu.barrier_wait(bar_x.at[k])
                    dots, sqs = list(carry[0]), list(carry[1])
                    for r, e in enumerate(expand(k)):
                        dots[r] = dots[r] + jnp.sum(e * _cols(plgpu.load(qs, (k, r), layout=col), bt, bd), axis=1)
                        sqs[r] = sqs[r] + jnp.sum(e * e, axis=1)
                    return dots, sqs

                dots, sqs = lax.fori_loop(k0, k0 + nw, scores_chunk, ([zero] * m, [zero] * m))
                sums = cta_sum([*dots, *sqs], 0)
                dots, sqs = sums[:m], sums[m:]

                # the online-softmax merge with the phase-1 state (Eq. 11): z_r = a_r A_r + b_r E_r
                if leader:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's score stores have read scores_s
                coef_a, coef_b = [], []
                for r in range(m):
                    s = jnp.where(inc, dots[r] * lax.rsqrt(sqs[r] * (1.0 / d) + cfg.eps), reference.NEG_LARGE)
                    mx = plgpu.load(rows_s, (slot, 0, r), layout=row)
                    den = plgpu.load(rows_s, (slot, 1, r), layout=row)
                    new_max = jnp.maximum(mx, s)
                    keep = jnp.exp(mx - new_max)
                    pnew = jnp.where(inc, jnp.exp(s - new_max), 0.0)
                    new_den = den * keep + pnew
                    coef_a.append(_rows(keep / new_den, bt, bd))
                    coef_b.append(_rows(pnew / new_den, bt, bd))
                    if leader:
                        scores_s[0, r] = dots[r]
                        scores_s[1, r] = sqs[r]

                def store_scores():
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(scores_s.at[0], dots_ref.at[:, bi, pl.ds(t0, bt)])
                    plgpu.copy_smem_to_gmem(scores_s.at[1], ss_ref.at[:, bi, pl.ds(t0, bt)])

                if leader and G == 1:
                    store_scores()
                elif leader:  # one CTA of the cluster writes them (every CTA holds the same sums)
                    pl.when(g == 0)(store_scores)

                def merged(k, r, e):
                    return coef_a[r] * plgpu.load(accs, (k, r), layout=tile).astype(F32) + coef_b[r] * e

                # ---- B: the gate's statistics over these chunks, then the CTA's and cluster's (Eq. 13)
                def stats_chunk(k, carry):
                    plgpu.barrier_wait(bar_acc.at[k])
                    sq, zw = carry[0], list(carry[1])
                    for r, e in enumerate(expand(k)):
                        z = merged(k, r, e)
                        sq = sq + jnp.sum(z * z, axis=1)
                        for jj in range(m):
                            w_col = _cols(plgpu.load(ws, (k, r * m + jj), layout=col), bt, bd)
                            zw[jj] = zw[jj] + jnp.sum(z * w_col, axis=1)
                    return sq, zw

                sq, zw = lax.fori_loop(k0, k0 + nw, stats_chunk, (zero, [zero] * m))
                sums = cta_sum([sq, *zw], 1)
                sq, zw = sums[0], sums[1:]
                inv = lax.rsqrt(sq * (1.0 / (m * d)) + cfg.gate_eps)
                mix = [_rows(1.0 / (1.0 + jnp.exp(-(scale * (inv * zw[jj]) + plgpu.load(scal_s, 2 + jj, layout=row)))),
                             bt, bd) for jj in range(m)]

                # ---- C: h = sum_r g_r z_r (Eq. 14), chunk by chunk from the state kept in shared
                # memory; each chunk's buffers then take the next tile's chunk
                def fuse_chunk(k, carry):
                    h = None
                    for r, e in enumerate(expand(k)):
                        term = mix[r] * merged(k, r, e)
                        h = term if h is None else h + term
                    hslot = 2 * w + lax.rem(k, 2)
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that last read this slot is done
                    h_s[hslot] = h.astype(h_s.dtype)
                    plgpu.commit_smem()  # also: every thread's loads of chunk k are done (a warpgroup barrier)
                    plgpu.copy_smem_to_gmem(h_s.at[hslot],
                                            h_ref.at[bi, pl.ds(t0, bt), pl.ds((c_first + k) * bd, bd)])

                    @pl.when(has_next)
                    def _():
                        fetch_x(j + 1, k)
                        fetch_acc(j + 1, k)

                    return carry

                lax.fori_loop(k0, k0 + nw, fuse_chunk, 0)
                return carry

            lax.fori_loop(0, n_iter, tile_step, 0)
            plgpu.wait_smem_to_gmem(0)
            if leader and G > 1 and cfg.exchange == "pull":
                # no CTA leaves while a peer may still load its last tile's sums (a CTA's shared memory
                # goes when it exits); the first exchange's barrier, whose last phase every CTA has passed
                plgpu.barrier_arrive(bar_xch.at[0])
                plgpu.barrier_wait(bar_xch.at[0])

        _run_warpgroups(run, W)

    out_type = (jax.ShapeDtypeStruct((batch, t_pad, d), cfg.out_dtype), jax.ShapeDtypeStruct((m, batch, t_pad), F32),
                jax.ShapeDtypeStruct((m, batch, t_pad), F32))
    return _launch(plgpu, body, "depth_attention_phase2_cluster_mosaic", out_type, [scratch[k] for k in names],
                   batch=batch, n_t=n_t, cluster=G, warpgroups=W, programs=cfg.programs, interpret=cfg.interpret)


# --------------------------------------------------------------------------- the backward's state pass

BWD_XCH_COLS = 16  # the backward's per-token sums: sum z^2, m dots z . W_j, m dots <dh, z_r> (2 m + 1)
BWD_WARPGROUPS = (1, 2)


def backward_smem_bytes(*, d: int, cluster: int, stream_kernels: Sequence[int], x_dtype, acc_dtype, dh_dtype,
                        has_seg: bool = True, warpgroups: int = 1) -> int:
    """Shared memory of one CTA of ``phase2_cluster_backward_state`` (its scratch list as
    ``_backward_kernel`` builds it; ``_smem_sum``)."""
    m, bt, bd = len(stream_kernels), BLOCK_T, BLOCK_D
    nck = d // cluster // bd
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    n_taps = max(1, sum(stream_kernels))
    xch = bt * BWD_XCH_COLS * 4
    return _smem_sum(nck * _window_elems(stream_kernels, "padded", bd) * size(x_dtype), nck * n_taps * bd * 4,
                     nck * m * m * bd * 4, nck * m * bt * bd * size(acc_dtype), nck * bt * bd * size(dh_dtype),
                     2 * 3 * m * bt * 4, 2 * bt * 4 if has_seg else 0, (1 + m) * bt * 4,
                     warpgroups * 3 * m * bt * 4, (3 * m + 2) * bt * 4, 2 * xch if cluster > 1 else 0,
                     (warpgroups - 1) * xch, xch if warpgroups > 1 else 0,
                     barriers=warpgroups + 1 + 2 * nck + 2 + (2 if cluster > 1 else 0) + (2 if warpgroups > 1 else 0),
                     reduces=True)


def phase2_cluster_backward_state(partial, bank, a, b, dold, acc, dh, gate_params, segment_ids, *,
                                  stream_kernels: Sequence[int], heads: int, gate_eps: float,
                                  cluster: int | None = None, programs: int | None = None, warpgroups: int = 1,
                                  interpret: bool = False):
    """``mosaic_gpu.phase2_backward_state``'s outputs (with the H_pre gate) from a cluster of
    ``cluster`` CTAs per 64-token tile (None: ``cluster_size(d)``), each holding its slice of the
    state in shared memory through both passes: the state is read once, not twice.

    Per tile, CTA ``g`` over its channels: (1) ``z_r = a A_r + b E_r`` and the sums ``sum z^2``,
    ``y_j = z . W[:, j]``, ``dg_r = <dh, z_r>``, then their cluster sums (one ``"pull"`` exchange of
    ``[64, 16]`` tiles) and, in registers, the gate ``g`` and its backward (``dlogit = dg g (1 -
    g)``, ``dy = scale rz dlogit``, ``coef = -scale (dlogit . y) rz^3 / (m d)``; Eq. 13-14); (2)
    ``dz_r = g_r dh + sum_j W[r, :, j] dy_j + coef z_r`` from the state still in shared memory,
    ``d_acc = a dz`` and the CTA's part of ``S1 = dz . z``, ``Sm = dz . (A - E D)``, ``Ss = dz .
    (E - z)`` (summed over the CTAs and warpgroups here, in XLA: ``[G W, 3 m, B, T]``, 0.2% of the
    state's bytes at `base`). One head, at most ``BWD_XCH_COLS // 2`` streams, ``d`` a multiple of
    ``cluster * warpgroups * 32``. ``programs`` and ``warpgroups`` as ``phase2_cluster_forward``'s.
    Exact on an H100 at clusters of 8 and 16; slower than the one-CTA kernel there
    (the module docstring)."""
    batch, t_len, d = partial.shape
    m = len(stream_kernels)
    cluster = cluster_size(d) if cluster is None else cluster
    if cluster < 1 or cluster > MAX_CLUSTER or cluster & (cluster - 1):
        raise ValueError(f"cluster={cluster}: must be a power of two from 1 to {MAX_CLUSTER}")
    if interpret and cluster > 1:
        raise NotImplementedError(f"cluster={cluster}: the Mosaic GPU interpreter (jax 0.11.2) has no rule for the "
                                  "cluster exchange (cluster_ref); interpret mode runs cluster=1")
    if gate_params is None or heads != 1 or 2 * m + 1 > BWD_XCH_COLS:
        raise NotImplementedError(f"phase2_cluster_backward_state: the H_pre gate, one head and at most "
                                  f"{(BWD_XCH_COLS - 1) // 2} streams (got gate={gate_params is not None}, "
                                  f"heads={heads}, m={m})")
    if warpgroups not in BWD_WARPGROUPS:
        raise ValueError(f"warpgroups={warpgroups!r}: must be one of {BWD_WARPGROUPS}")
    if d % (cluster * warpgroups * BLOCK_D):
        raise NotImplementedError(f"phase2_cluster_backward_state: d = {d} must be a multiple of cluster x "
                                  f"warpgroups x {BLOCK_D} = {cluster * warpgroups * BLOCK_D}")
    if max([1, *stream_kernels]) - 1 > 8 * _Lags.of(max([1, *stream_kernels]), "padded").extra:
        raise NotImplementedError(f"phase2_cluster_backward_state: kernels {tuple(stream_kernels)}")
    dh = _dh_operand(dh)
    sh = _shape("phase2_cluster_backward_state", partial, segment_ids, stream_kernels=stream_kernels, heads=1,
                block_d=BLOCK_D, interpret=interpret, smem=None, x_dtype=partial.dtype, acc_dtype=acc.dtype,
                out_dtype=F32)
    smem = backward_smem_bytes(d=d, cluster=cluster, stream_kernels=stream_kernels, x_dtype=partial.dtype,
                               acc_dtype=acc.dtype, dh_dtype=dh.dtype, has_seg=sh.has_seg, warpgroups=warpgroups)
    if not interpret and smem > SMEM_BYTES:
        raise NotImplementedError(f"phase2_cluster_backward_state: {smem} bytes of shared memory per CTA at d = {d}, "
                                  f"cluster = {cluster}, warpgroups = {warpgroups}, a {dh.dtype} dh (the H200 has "
                                  f"{SMEM_BYTES})")
    t_pad = sh.t_pad
    n_tiles = batch * (t_pad // BLOCK_T)
    if programs is not None and (programs < 1 or n_tiles % programs):
        raise ValueError(f"programs={programs}: must divide the {n_tiles} token tiles (B x ceil(T / 64))")
    pad_t = lambda v, axis, value=0.0: _pad_t(v, axis, t_pad, value)  # noqa: E731
    rows = jnp.stack([pad_t(jnp.asarray(v, F32)[..., 0], 2, fill)  # [3, m, B, Tp]: a, b, dold
                      for v, fill in ((a, 0.0), (b, 0.0), (dold, 1.0))])
    w, scale, bias = gate_params
    w_rows = jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1).reshape(m * m, d)  # [(r, j), c]
    consts = jnp.stack([jnp.asarray(scale, F32).reshape(()), *jnp.asarray(bias, F32).reshape(m)])
    consts = jnp.broadcast_to(consts[:, None], (1 + m, BLOCK_T))
    banks = jnp.asarray(bank, F32) if sh.has_bank and bank is not None else jnp.zeros((1, d), F32)
    inputs = [sh.x, banks, rows, _state_rows(acc, t_pad), pad_t(dh, 1), w_rows, consts]
    if sh.has_seg:
        inputs.append(sh.bits)
    cfg = _BwdConfig(batch=batch, t_pad=t_pad, t_len=t_len, d=d, cluster=cluster,
                     stream_kernels=tuple(stream_kernels), has_bank=bool(sh.has_bank and bank is not None),
                     has_seg=sh.has_seg, front=sh.front, gate_eps=float(gate_eps), x_dtype=jnp.dtype(sh.x.dtype),
                     acc_dtype=jnp.dtype(acc.dtype), dh_dtype=jnp.dtype(dh.dtype), programs=programs or 0,
                     warpgroups=warpgroups, interpret=bool(interpret))
    d_acc, sums, gate_rows = _backward_kernel(cfg)(*inputs)
    sums = jnp.sum(sums, axis=0)[:, :, :t_len, None]  # the CTAs' and warpgroups' parts: [3 m, B, T, 1]
    s1, sm, ss = sums[:m], sums[m:2 * m], sums[2 * m:]
    rows_out = gate_rows[:, :, :t_len]  # [3 m + 2, B, T]
    g, dy, coef = jnp.moveaxis(rows_out[:m], 0, -1), jnp.moveaxis(rows_out[m:2 * m], 0, -1), rows_out[2 * m]
    d_bias = jnp.sum(rows_out[2 * m + 1:3 * m + 1], axis=(1, 2))
    d_scale = jnp.sum(rows_out[3 * m + 1]).reshape(jnp.shape(scale))
    return (d_acc.reshape(m, batch, t_pad, d)[:, :, :t_len], (s1, sm, ss), (g, dy, coef, d_scale, d_bias))


class _BwdConfig(NamedTuple):
    """Everything ``_backward_kernel``'s code depends on (hashable: built once per value)."""

    batch: int
    t_pad: int
    t_len: int
    d: int
    cluster: int
    stream_kernels: tuple
    has_bank: bool
    has_seg: bool
    front: int
    gate_eps: float
    x_dtype: jnp.dtype
    acc_dtype: jnp.dtype
    dh_dtype: jnp.dtype
    programs: int  # 0: one program per tile; else that many programs (clusters) walk the tiles
    warpgroups: int
    interpret: bool


@functools.lru_cache(maxsize=None)
def _backward_kernel(cfg: _BwdConfig):
    """The kernel for ``cfg``, jitted (as ``_kernel``): per CTA, ``cfg.warpgroups`` warpgroups,
    each with a contiguous run of the CTA's chunks; pass 1's sums meet in the first warpgroup,
    which runs the cluster's exchange (slot: the tile's parity, so a CTA's next exchange never
    overwrites a tile a peer may still load) and hands the totals back."""
    from jax.experimental.pallas import mosaic_gpu as plgpu_module

    plgpu = _LanePlgpu(plgpu_module)
    batch, t_pad, d, G, W = cfg.batch, cfg.t_pad, cfg.d, cfg.cluster, cfg.warpgroups
    m, bt, bd = len(cfg.stream_kernels), BLOCK_T, BLOCK_D
    layout = _stream_layout(cfg.stream_kernels)
    max_lag = max([1, *cfg.stream_kernels])
    lags = _Lags.of(max_lag, "padded")
    nck = d // G // bd  # chunks per CTA
    nw = nck // W  # chunks per warpgroup
    n_taps = max(1, sum(cfg.stream_kernels))
    n_gate_rows = 3 * m + 2  # g, dy, coef, dlogit, dlogit . rz y
    xw = BWD_XCH_COLS
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    xch_tiles = lambda slots, n: plgpu.SMEM((slots, n, bt, xw), F32, transforms=(  # noqa: E731
        plgpu.TilingTransform((8, xw)), plgpu.SwizzleTransform(xw * 4)))
    n_t = t_pad // bt
    persistent = cfg.programs > 0
    n_iter = batch * n_t // cfg.programs if persistent else 1  # tiles per program
    scratch = dict(
        xs=plgpu.SMEM((nck, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((nck, n_taps, bd), F32) if cfg.has_bank else None,
        ws=plgpu.SMEM((nck, m * m, bd), F32),
        accs=_tile_smem(plgpu, (nck, m, bt, bd), cfg.acc_dtype),  # the state's slice; d_acc's, stored in place
        dhs=_tile_smem(plgpu, (nck, bt, bd), cfg.dh_dtype),
        rows_s=plgpu.SMEM((2, 3, m, bt), F32),  # per tile slot: a, b, dold
        bits_s=plgpu.SMEM((2, bt), jnp.int32) if cfg.has_seg else None,
        scal_s=plgpu.SMEM((1 + m, bt), F32),
        sums_s=plgpu.SMEM((W, 3 * m, bt), F32),  # per warpgroup, its part of S1, Sm, Ss
        gate_s=plgpu.SMEM((n_gate_rows, bt), F32),
        recv=xch_tiles(2, 1) if G > 1 else None,  # per tile parity, the CTA's own tile (pull)
        # one slot each (two do not fit with two warpgroups): a warpgroup writes its part of tile j + 1
        # only after it has read tile j's totals, and the first writes those only after reading the parts
        part_s=xch_tiles(1, W - 1) if W > 1 else None,
        total_s=xch_tiles(1, 1) if W > 1 else None,
        bar_const=plgpu.Barrier(num_arrivals=nw * (cfg.has_bank + 1), num_barriers=W),
        bar_scal=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        bar_x=plgpu.Barrier(num_arrivals=lags.count, num_barriers=nck),
        bar_acc=plgpu.Barrier(num_arrivals=2, num_barriers=nck),  # a tile's chunk of the state and of dh
        bar_in=plgpu.Barrier(num_arrivals=1 + cfg.has_seg, num_barriers=2),
        bar_xch=plgpu.ClusterBarrier(collective_axes=("g",), num_arrivals=1, num_barriers=2) if G > 1 else None,
        bar_part=plgpu.Barrier(num_arrivals=W - 1, num_barriers=1) if W > 1 else None,
        bar_total=plgpu.Barrier(num_arrivals=1, num_barriers=1) if W > 1 else None,
    )
    names = [k for k, v in scratch.items() if v is not None]
    pull = _Config(batch=batch, t_pad=t_pad, d=d, cluster=G, exchange="pull", stream_kernels=cfg.stream_kernels,
                   has_bank=cfg.has_bank, has_seg=cfg.has_seg, front=cfg.front, eps=0.0, gate_eps=cfg.gate_eps,
                   x_dtype=cfg.x_dtype, acc_dtype=cfg.acc_dtype, out_dtype=F32, programs=cfg.programs,
                   warpgroups=W, interpret=cfg.interpret)

    def body(x_ref, bank_ref, rows_ref, acc_ref, dh_ref, w_ref, consts_ref, *rest):
        bits_ref = rest[0] if cfg.has_seg else None
        dacc_ref, sums_ref, gate_ref = rest[cfg.has_seg:cfg.has_seg + 3]
        sc = dict(zip(names, rest[cfg.has_seg + 3:]))
        xs, bs, ws, accs, dhs = (sc.get(k) for k in ("xs", "bs", "ws", "accs", "dhs"))
        rows_s, bits_s, scal_s, sums_s, gate_s = (sc.get(k) for k in ("rows_s", "bits_s", "scal_s", "sums_s",
                                                                       "gate_s"))
        recv, part_s, total_s = sc.get("recv"), sc.get("part_s"), sc.get("total_s")
        bar_const, bar_x, bar_acc, bar_in = (sc.get(k) for k in ("bar_const", "bar_x", "bar_acc", "bar_in"))
        bar_xch, bar_part, bar_total, bar_scal = (sc.get(k) for k in ("bar_xch", "bar_part", "bar_total",
                                                                        "bar_scal"))
        g_idx = lax.axis_index("g") if G > 1 else 0
        c_first = g_idx * nck  # the CTA's first channel chunk

        tile_of = functools.partial(_tile_of, cfg.programs, n_t)
        copies = _TileCopies(plgpu, cfg.programs, n_t, t_pad, cfg.front, c_first, lags, max_lag, rows_ref, rows_s,
                             bits_ref, bits_s, bar_in, x_ref, xs, bar_x, acc_ref, accs, bar_acc)
        fetch_rows, fetch_x, fetch_acc = copies.rows, copies.x, copies.acc

        def fetch_dh(j, k):
            bi, ti = tile_of(j)
            plgpu.copy_gmem_to_smem(dh_ref.at[bi, pl.ds(ti * bt, bt), pl.ds((c_first + k) * bd, bd)], dhs.at[k],
                                    bar_acc.at[k])


        def run(w: int):
            leader, k0 = w == 0, w * nw

            def cta_sum(vals, rnd):  # rnd: the tile's parity (the exchange's buffers); one handoff slot
                return _cta_sum(plgpu, pull, w, vals, rnd, 0, xw, recv, bar_xch, part_s, total_s, bar_part, bar_total)

            for k in range(k0, k0 + nw):  # this warpgroup's chunks' taps and gate columns, once
                cs = pl.ds((c_first + k) * bd, bd)
                if cfg.has_bank:
                    plgpu.copy_gmem_to_smem(bank_ref.at[:, cs], bs.at[k], bar_const.at[w])
                plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws.at[k], bar_const.at[w])
            if leader:
                plgpu.copy_gmem_to_smem(consts_ref, scal_s, bar_scal.at[0])
                fetch_rows(0, 0)
            for k in range(k0, k0 + nw):
                fetch_x(0, k)
            for k in range(k0, k0 + nw):
                fetch_acc(0, k)
                fetch_dh(0, k)
            plgpu.barrier_wait(bar_const.at[w])
            plgpu.barrier_wait(bar_scal.at[0])
            zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)

            def tile_step(j, carry):
                slot = lax.rem(j, 2)
                bi, ti = tile_of(j)
                t0 = ti * bt
                has_next = j + 1 < n_iter
                if leader:
                    @pl.when(has_next)
                    def _():
                        fetch_rows(j + 1, 1 - slot)

                plgpu.barrier_wait(bar_in.at[slot])
                masks = _lag_masks_of(plgpu, bits_s.at[slot] if cfg.has_seg else None, max_lag, bt, bd)
                coef_a, coef_b, dold = ([plgpu.load(rows_s, (slot, i, r), layout=row) for r in range(m)]
                                        for i in range(3))

                def expand(k):
                    return _expand_all(plgpu, xs, bs, k, layout, masks, bt, bd, lags, "shared")

                def chunk_values(k, r, e):
                    """``A_r`` and ``z_r = a A_r + b E_r`` of chunk ``k``."""
                    acc = plgpu.load(accs, (k, r), layout=tile).astype(F32)
                    return acc, _rows(coef_a[r], bt, bd) * acc + _rows(coef_b[r], bt, bd) * e

                def w_col(k, r, jj):
                    return _cols(plgpu.load(ws, (k, r * m + jj), layout=col), bt, bd)

                # ---- 1: the gate's statistics over these chunks, then the CTA's and cluster's (Eq. 13)
                def stats_chunk(k, carry):
                    plgpu.barrier_wait(bar_x.at[k])
                    plgpu.barrier_wait(bar_acc.at[k])
                    sq, zw, dg = carry[0], list(carry[1]), list(carry[2])
                    dh = plgpu.load(dhs, k, layout=tile).astype(F32)
                    for r, e in enumerate(expand(k)):
                        _, z = chunk_values(k, r, e)
                        sq = sq + jnp.sum(z * z, axis=1)
                        for jj in range(m):
                            zw[jj] = zw[jj] + jnp.sum(z * w_col(k, r, jj), axis=1)
                        dg[r] = dg[r] + jnp.sum(dh * z, axis=1)
                    return sq, zw, dg

                sq, y, dg = lax.fori_loop(k0, k0 + nw, stats_chunk, (zero, [zero] * m, [zero] * m))
                sums = cta_sum([sq, *y, *dg], slot)
                sq, y, dg = sums[0], sums[1:1 + m], sums[1 + m:]
                # the gate and its backward on per-token scalars (Eq. 13-14)
                valid = (plgpu.broadcasted_iota(jnp.int32, (bt,), 0, layout=row) + t0 < cfg.t_len).astype(F32)
                (g, dy, coef), gate_rows = gate_backward(plgpu, scal_s, sq, y, dg, valid, d=d, gate_eps=cfg.gate_eps)

                def store_gate():  # one CTA of the cluster (every CTA holds the same values)
                    for i, v in enumerate(gate_rows):
                        gate_s[i] = v
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(gate_s, gate_ref.at[:, bi, pl.ds(t0, bt)])

                if leader and G == 1:
                    store_gate()
                elif leader:
                    pl.when(g_idx == 0)(store_gate)

                # ---- 2: d_acc = a dz and this warpgroup's part of S1, Sm, Ss; each chunk's buffers then
                # take the next tile's chunk (the state's once its d_acc store has read it)
                def state_chunk(k, carry):
                    s1, sm, ss = (list(v) for v in carry)
                    dh = plgpu.load(dhs, k, layout=tile).astype(F32)
                    for r, e in enumerate(expand(k)):
                        acc, z = chunk_values(k, r, e)
                        dz = _rows(g[r], bt, bd) * dh + _rows(coef, bt, bd) * z
                        for jj in range(m):
                            dz = dz + w_col(k, r, jj) * _rows(dy[jj], bt, bd)
                        s1[r] = s1[r] + jnp.sum(dz * z, axis=1)
                        sm[r] = sm[r] + jnp.sum(dz * (acc - e * _rows(dold[r], bt, bd)), axis=1)
                        ss[r] = ss[r] + jnp.sum(dz * (e - z), axis=1)
                        accs[k, r] = (_rows(coef_a[r], bt, bd) * dz).astype(accs.dtype)
                    plgpu.commit_smem()  # also: every thread's loads of chunk k are done (a warpgroup barrier)
                    plgpu.copy_smem_to_gmem(accs.at[k], dacc_ref.at[:, pl.ds(bi * t_pad + t0, bt),
                                                                    pl.ds((c_first + k) * bd, bd)])

                    @pl.when(has_next)
                    def _():
                        fetch_x(j + 1, k)
                        fetch_dh(j + 1, k)

                        @pl.when(k > k0)
                        def _():
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # chunk k - 1's d_acc store
                            fetch_acc(j + 1, k - 1)

                    return s1, sm, ss

                s1, sm, ss = lax.fori_loop(k0, k0 + nw, state_chunk, ([zero] * m,) * 3)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # every store has read its buffer

                @pl.when(has_next)
                def _():
                    fetch_acc(j + 1, k0 + nw - 1)

                for i, part in enumerate((s1, sm, ss)):
                    for r in range(m):
                        sums_s[w, i * m + r] = part[r]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(sums_s.at[w], sums_ref.at[g_idx * W + w, :, bi, pl.ds(t0, bt)])
                return carry

            lax.fori_loop(0, n_iter, tile_step, 0)
            plgpu.wait_smem_to_gmem(0)
            if leader and G > 1:  # no CTA leaves while a peer may still load its last sums (as _kernel)
                plgpu.barrier_arrive(bar_xch.at[n_iter % 2])
                plgpu.barrier_wait(bar_xch.at[n_iter % 2])

        _run_warpgroups(run, W)

    out_type = (jax.ShapeDtypeStruct((m, batch * t_pad, d), cfg.acc_dtype),
                jax.ShapeDtypeStruct((G * W, 3 * m, batch, t_pad), F32),
                jax.ShapeDtypeStruct((n_gate_rows, batch, t_pad), F32))
    return _launch(plgpu, body, "depth_attention_phase2_bwd_state_cluster_mosaic", out_type,
                   [scratch[k] for k in names], batch=batch, n_t=n_t, cluster=G, warpgroups=W,
                   programs=cfg.programs, interpret=cfg.interpret)
