"""What the depth read's Mosaic GPU kernels share (docs/kernels.md §4, "Techniques the kernels
share"): the tile and shared-memory constants and counts (``smem_sum``), the channel chunk
(``choose_block_d``), the lag window of a chunk of the partial in shared memory (``LagWindow``:
where each conv lag's rows go; rows before token 0 come from TMA's zero fill, which interpret
mode lacks, so there XLA pads the partial in front: ``tile_partial``), the TMA pipeline over
channel chunks (``pipeline_chunks``), the streams' expansion in registers (Eq. 10:
``expand_streams``, ``expand_item``), the kernels' configuration base (``KernelConfig``) and the
Lane-semantics kernel plumbing (``LanePlgpu``, ``jitted_kernel``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference
from pallas_kernels.depth_attention.fused import pad_tokens

F32 = jnp.float32
BLOCK_T = 64  # one warpgroup's WGMMA register layout: 64 rows
MAX_LAG_BITS = 31  # lag bits per token in one int32 (``lag_bits``)


# What Mosaic GPU lets one program allocate on the H200 (227 KiB, its limit for sm_90). The
# kernels' counts (each kernel module's ``smem_bytes``, ``state_smem_bytes``, ``scores_smem_bytes``,
# ``mix_smem_bytes``) lay out the scratch list as Pallas does (``smem_sum``), so they
# bound the allocation from above (``tests/kernels/test_mosaic_gpu_smem.py`` lowers each kernel
# and compares). Summing the buffers' bytes alone undercounts: it misses each buffer's alignment
# padding, the reduction scratch and the barriers.
SMEM_BYTES = 227 * 1024
SMEM_ALIGNMENT = 1024  # Pallas' Mosaic GPU lowering starts each scratch buffer at a multiple of this
BARRIER_BYTES = 8  # one mbarrier, after the scratch buffers
# what Pallas reserves for a kernel that sums across warps (``CompilerParams.reduction_scratch_bytes``,
# its default; our kernels' row and column sums of WGMMA-layout tiles)
REDUCTION_SCRATCH_BYTES = 2048


def smem_sum(*buffers: int, barriers: int = 0, reduces: bool = False) -> int:
    """Shared memory of a scratch list as Pallas lays it out: each buffer's bytes (0: absent)
    rounded up to ``SMEM_ALIGNMENT``, the reduction scratch of a kernel that ``reduces`` across
    warps, then ``barriers`` mbarriers."""
    return (sum(-(-b // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for b in buffers) + BARRIER_BYTES * barriers
            + (REDUCTION_SCRATCH_BYTES if reduces else 0))

# Channel chunks, widest first. 16 ran MSAR's forward at `base` 12-13% slower than 32 (1.59-1.60
# against 1.42 ms) and AttnRes's crashed with a misaligned address on the H200, so
# only 32 is offered: a program that does not fit with it (a float32 partial) runs on Triton.
BLOCK_D_CHOICES = (32,)


def choose_block_d(*, d: int, heads: int, stream_kernels: Sequence[int], x_dtype, acc_dtype, out_dtype,
                   smem, gate: bool = True, smem_limit: int | None = SMEM_BYTES,
                   choices: Sequence[int] | None = None) -> int | None:
    """The first channel chunk of ``choices`` that divides a head and whose program fits in
    ``smem_limit`` bytes of shared memory (``smem``: the kernel's count, e.g.
    ``phase2_forward.smem_bytes``; None: no limit, as in interpret mode), or
    None (the shape is not supported). ``choices``: None is ``BLOCK_D_CHOICES`` (read at the call, so
    that a timing script may set it)."""
    for bd in choices or BLOCK_D_CHOICES:
        fits = smem_limit is None or smem(block_d=bd, stream_kernels=stream_kernels, heads=heads,
                                          x_dtype=x_dtype, acc_dtype=acc_dtype, out_dtype=out_dtype,
                                          gate=gate) <= smem_limit
        if d % heads == 0 and (d // heads) % bd == 0 and fits and max([1, *stream_kernels]) <= MAX_LAG_BITS:
            return bd
    return None


def lag_bits(segment_ids, t_len: int, max_lag: int):
    """``bits[B, T]`` int32: bit ``delta`` set where token ``t - delta`` exists and lies in
    ``t``'s segment (``reference.segment_lag_masks``' rule: equal ids). Bit 0 is always set."""
    masks = reference.segment_lag_masks(segment_ids, t_len, max_lag, segment_ids.shape[0])  # [K, B, T]
    weights = (2 ** jnp.arange(max_lag, dtype=jnp.int32))[:, None, None]
    return jnp.sum(masks.astype(jnp.int32) * weights, axis=0)


def per_row(v, bt, bd):
    return lax.broadcast_in_dim(v, (bt, bd), [0])


def per_col(v, bt, bd):
    return lax.broadcast_in_dim(v, (bt, bd), [1])


# channels past the chunk in each window row: 80-byte rows for 32 bf16 channels, so that the 8
# rows of a warp's load start on different banks (64-byte rows put rows r and r + 2 on the same
# banks; on the H200 the expansion alone 0.594 -> 0.364 ms); fetched, never read. Every kernel's
# lag window is one such padded window per chunk (docs/kernels.md has the other placements'
# figures: the step 1571.2 -> 1530.1 ms against an unpadded window).
WINDOW_PAD = 8


class LagWindow(NamedTuple):
    """Where a tile's conv lags sit in shared memory: one window of ``64 + 8 extra`` rows per
    chunk, lag ``delta`` at row ``8 extra - delta``: one TMA copy of about the tile's bytes, loads
    at row offsets that are not multiples of 8 (exact in Lane semantics, ``LanePlgpu``), with
    ``pad`` (``WINDOW_PAD``) more channels in each row against shared-memory bank conflicts."""

    rows: int  # rows of the window
    extra: int  # 8-row groups above the 64 rows
    pad: int = WINDOW_PAD  # channels past the chunk in each window row
    count = 1  # windows per slot

    @staticmethod
    def of(max_lag: int, pad: int = WINDOW_PAD) -> "LagWindow":
        extra = -(-(max_lag - 1) // 8)
        return LagWindow(BLOCK_T + 8 * extra, extra, pad)

    def copies(self, n_lags: int):
        """``(window, first row in it, rows, lag of its first row)`` of the TMA copies that bring
        lags ``0 .. n_lags - 1``: the whole window (a TMA copy into shared memory must start
        128-byte aligned; a window starting at row 8 extra - (n_lags - 1) failed with a misaligned
        address)."""
        return [(0, 0, self.rows, 8 * self.extra)]

    def fetch(self, plgpu, src_rows, xs, slot, bar, n_lags: int):
        """The copies of ``copies(n_lags)`` into ``xs[slot]`` on ``bar``; ``src_rows(lag, rows)``
        is the global-memory ref of the rows starting ``lag`` rows before the tile."""
        for w, first, rows, lag in self.copies(n_lags):
            plgpu.copy_gmem_to_smem(src_rows(lag, rows), xs.at[slot, w, pl.ds(first, rows)], bar)

    def load(self, plgpu, xs, slot, delta: int):
        """Lag ``delta``'s ``[64, bd]`` tile (WGMMA layout, the window's dtype)."""
        return plgpu.load(xs.at[slot, 0, pl.ds(8 * self.extra - delta, BLOCK_T), pl.ds(0, xs.shape[-1] - self.pad)],
                          (), layout=plgpu.Layout.WGMMA, optimized=False)

    def smem_rows(self) -> int:
        return self.count * self.rows

    def width(self, bd: int) -> int:
        """Channels of each window row (the chunk's ``bd`` and the pad)."""
        return bd + self.pad

    def columns(self, c, bd: int):
        """The partial's columns that chunk ``c``'s windows copy. A padded window's last chunk
        reaches past d on purpose (TMA fills those columns with zeros; they are never read), so
        its start is made a traced value: Pallas checks static slices against the ref's bounds."""
        if self.pad:
            c = c + lax.axis_index("b") * 0
        return pl.ds(c * bd, self.width(bd))


def window_elems(stream_kernels, bd: int) -> int:
    """Elements of one slot's lag window (``LagWindow``), for the shared-memory counts."""
    lags = LagWindow.of(max([1, *stream_kernels]))
    return lags.smem_rows() * lags.width(bd)


def fetch_partial(plgpu, x_ref, bank_ref, xs, bs, b, t0, front, c, bd, slot, bar, lags: LagWindow, n_lags: int):
    """TMA copies of chunk ``c``'s lag windows of the partial (``lags``: where each lag goes; see
    ``tile_partial``) and of its conv taps."""
    cs, xcs = pl.ds(c * bd, bd), lags.columns(c, bd)
    lags.fetch(plgpu, lambda lag, rows: x_ref.at[b, pl.ds(t0 + front - lag, rows), xcs], xs, slot, bar.at[slot],
               n_lags)
    if bank_ref is not None:
        plgpu.copy_gmem_to_smem(bank_ref.at[:, cs], bs.at[slot], bar.at[slot])


def state_as_rows(state, t_pad: int):
    """``[m, B, T, d]`` -> ``[m, B * Tp, d]`` (T padded): a tile's rows of every stream are then
    one 3D box (``[m, 64, bd]``), which TMA takes in one copy. (With the batch row as a fourth,
    squeezed dimension, Mosaic GPU's tiled shared-memory view of the box needs 6 dimensions,
    one more than TMA has.)"""
    m, batch, _, d = state.shape
    return pad_tokens(state, 2, t_pad).reshape(m, batch * t_pad, d)


def copy_state(plgpu, acc_ref, accs, rows, cs, slot, bar):
    """The TMA copy of the state's chunk ``acc[:, rows, cs]`` (``[m, 64, bd]``, one 3D box;
    ``acc`` as ``state_as_rows`` lays it out) into ``accs[slot]``."""
    plgpu.copy_gmem_to_smem(acc_ref.at[:, rows, cs], accs.at[slot], bar)


def store_group(plgpu, pairs):
    """TMA stores ``(src, dst)`` from shared to global memory, committed as one bulk-copy group
    after the last (Nsight Compute put 5% of the mixing pass's warp samples on the commits of its
    8 stores per chunk and stream when each was its own group); only for stores that are awaited
    together (``wait_smem_to_gmem(0)``), since the groups are what a wait counts."""
    pairs = list(pairs)
    for k, (src, dst) in enumerate(pairs):
        plgpu.copy_smem_to_gmem(src, dst, commit_group=k == len(pairs) - 1)


def pipeline_chunks(plgpu, fetch, bar, nc, heads, per_chunk, carry, before_refill=None, n_slots=2, head_end=None,
                    reverse=False):
    """``per_chunk(c, slot, head, carry)`` over the ``nc`` channel chunks, head by head (a static
    head index; ``nc / heads`` chunks each), with the next ``n_slots - 1`` chunks' copies in
    flight: ``fetch(c, slot)`` issues chunk ``c``'s copies on ``bar.at[slot]``, the ``k``-th
    chunk walked in slot ``k mod n_slots``. ``before_refill()`` runs before a slot is refilled
    (to wait for stores still reading it). ``head_end(head, carry) -> carry`` runs after each
    head's chunks (outside the loop: what only one head needs need not ride through the others'
    loops). ``reverse``: the chunks (and heads) last to first.

    The gated kernels (the forward, the backward's state kernel) read each state element twice:
    the gate's statistics need the whole tile (every stream and channel, 1 MB at `base`, 2 MB at
    the bench shape) before the output pass. In the same order the second read of a chunk comes a
    whole tile's bytes after its first, about 260 MB of other traffic with some 260 programs in
    flight, far more than L2 (50 MiB on the H100), so it comes from DRAM again; in reverse the
    last chunks read are the first read again, while they may still be in L2. Measured (an H100,
    three alternating rounds): the forward 1.8% / 0.5% faster at `base` / the bench shape, the
    state kernel 1.3% / 1.7%. The same bits for ``h``, the scores and ``d_acc``; the state
    kernel's per-token sums add their chunks in the other order (3e-7 apart)."""
    nch = nc // heads
    chunk = (lambda k: nc - 1 - k) if reverse else (lambda k: k)  # noqa: E731
    for k in range(min(n_slots, nc)):
        fetch(chunk(k), k)
    for walked in range(heads):
        head = heads - 1 - walked if reverse else walked

        def step(k, carry, head=head):
            slot = lax.rem(k, n_slots)
            plgpu.barrier_wait(bar.at[slot])
            carry = per_chunk(chunk(k), slot, head, carry)

            @pl.when(k + n_slots < nc)
            def _():
                if before_refill is not None:
                    before_refill()
                fetch(chunk(k + n_slots), slot)

            return carry

        # the k-th chunk walked lies in ``head``'s chunks, reversed or not
        carry = lax.fori_loop(walked * nch, (walked + 1) * nch, step, carry)
        if head_end is not None:
            carry = head_end(head, carry)
    return carry


def lag_masks(plgpu, bits_s, max_lag, bt, bd):
    """``masks[delta]`` (``[bt, bd]`` float32, None where nothing is masked) from the tile's lag
    bits in shared memory (``lag_bits``), or all None without segments (the rows before token 0
    are zeros: TMA's fill, or the interpreted pad)."""
    if bits_s is None:
        return [None] * max_lag
    bits = plgpu.load(bits_s, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return [None] + [per_row(((bits >> delta) & 1).astype(F32), bt, bd) for delta in range(1, max_lag)]


def stage_table_and_masks(plgpu, table_ref, table_s, bits_ref, bits_s, bar, b, t0, max_lag, bt, bd):
    """A program's prologue: copy its table of live sources (``table_ref``, whole) and, with
    segments (``bits_ref`` not None), tile ``t0``'s lag bits of batch row ``b`` into shared memory
    on the one barrier ``bar`` (so it counts ``1 + has_seg`` arrivals), wait, and return the
    tile's ``lag_masks``."""
    plgpu.copy_gmem_to_smem(table_ref, table_s, bar)
    if bits_ref is not None:
        plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t0, bt)], bits_s, bar)
    plgpu.barrier_wait(bar)
    return lag_masks(plgpu, bits_s, max_lag, bt, bd)


def expand_streams(plgpu, xs, bs, slot, layout, masks, bt, bd, lags: LagWindow):
    """``[E_r for every stream]`` of the chunk in ``slot`` (Eq. 10): each lag window is loaded
    (and masked) once and feeds every stream whose kernel reaches it (12 window loads for kernels
    (0, 4, 8, 12), not 25)."""
    col = plgpu.Layout.WGMMA.reduce(0)
    es = [None] * len(layout)
    for delta in range(max([1, *(kernel for kernel, _ in layout)])):
        xl = lags.load(plgpu, xs, slot, delta).astype(F32)
        masked = xl if masks[delta] is None else xl * masks[delta]
        for r, (kernel, off) in enumerate(layout):
            if kernel == 0:
                if delta == 0:
                    es[r] = xl
                continue
            if delta < kernel:
                term = per_col(plgpu.load(bs, (slot, off + delta), layout=col), bt, bd) * masked
                es[r] = term if es[r] is None else es[r] + term
    return es


def expand_item(plgpu, lags: "LagWindow", xs, taps_s, slot, kernel: int, masks, bt, bd, window=None):
    """``E_r`` (Eq. 10) of one pipeline item: a stream of ``kernel`` taps from the lag windows in
    ``xs[slot]`` (``xs[window]`` when given) and its taps in ``taps_s[slot]`` (``[kernel, bd]``;
    None: the taps are zero); ``expand_streams``'s sums for one stream, in the same order."""
    window = slot if window is None else window
    if kernel == 0:
        return lags.load(plgpu, xs, window, 0).astype(F32)
    col = plgpu.Layout.WGMMA.reduce(0)
    e = None
    for delta in range(kernel):
        xl = lags.load(plgpu, xs, window, delta).astype(F32)
        if masks[delta] is not None:
            xl = xl * masks[delta]
        tap = per_col(plgpu.load(taps_s, (slot, delta), layout=col), bt, bd) if taps_s is not None else 0.0
        term = tap * xl
        e = term if e is None else e + term
    return e


def valid_first(valid, n: int):
    """The valid sources first (their order kept), then their count, as ``[n + 1, 64]`` int32
    rows (one TMA copy): a kernel loops over the valid ones only."""
    live = jnp.ones((n,), jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32).reshape(n)
    order = jnp.argsort(1 - live, stable=True).astype(jnp.int32)
    return jnp.broadcast_to(jnp.concatenate([order, jnp.sum(live, keepdims=True)])[:, None], (n + 1, 64))


class TiledPartial(NamedTuple):
    """What both kernels' wrappers derive from their inputs (``tile_partial``)."""

    batch: int
    t_len: int
    d: int
    block_d: int
    max_lag: int
    has_bank: bool
    has_seg: bool
    t_pad: int
    front: int  # rows padded in front of the partial (interpret mode: see ``tile_partial``)
    x: jax.Array  # the partial, T padded to whole tiles (and the front rows)
    bits: jax.Array | None  # ``lag_bits`` of the segment ids, T padded


def tile_partial(name, partial, segment_ids, *, stream_kernels, heads, block_d, interpret, smem,
                 choices: Sequence[int] | None = None, **dtypes) -> TiledPartial:
    """The channel chunk (``choose_block_d`` over ``choices`` with the kernel's shared memory
    ``smem``; raises ``NotImplementedError`` when none fits), the tiling of T and the padded
    partial (``choices``: None is ``BLOCK_D_CHOICES``)."""
    choices = choices or BLOCK_D_CHOICES
    batch, t_len, d = partial.shape
    bd = block_d or choose_block_d(d=d, heads=heads, stream_kernels=stream_kernels, smem=smem, **dtypes,
                                   smem_limit=None if interpret else SMEM_BYTES, choices=choices)
    if bd is None or d % heads or (d // heads) % bd:
        raise NotImplementedError(
            f"mosaic_gpu.{name}: no channel chunk of {tuple(choices)} divides the head width "
            f"d/heads = {d}/{heads} with a program in {SMEM_BYTES} bytes of shared memory (block_d={block_d})")
    max_lag = max([1, *stream_kernels])
    has_seg = segment_ids is not None and max_lag > 1
    t_pad = -(-t_len // BLOCK_T) * BLOCK_T
    front = 8 * -(-(max_lag - 1) // 8) if interpret else 0  # rows a window reaches back: whole 8s
    x = pad_tokens(partial, 1, t_pad)
    if interpret:  # rows before token 0 and the "padded" windows' channels past d: zeros, as TMA fills them
        x = jnp.pad(x, ((0, 0), (front, 0), (0, WINDOW_PAD)))
    bits = pad_tokens(lag_bits(segment_ids, t_len, max_lag), 1, t_pad) if has_seg else None
    return TiledPartial(batch, t_len, d, bd, max_lag, any(stream_kernels), has_seg, t_pad, front, x, bits)


class LanePlgpu:
    """``plgpu`` for a kernel lowered in Lane semantics (every kernel here): the default
    Warpgroup semantics infers a swizzle for every shared-memory ref (64 bytes for a window of
    32 bf16 channels), and a WGMMA-layout load that starts at a row offset that is not a
    multiple of the swizzle's 8 rows unswizzles it relative to its own start, so it returns the
    right rows with their 16-byte column groups permuted (``benchmarks/mgpu/
    offset_loads.py --map`` shows the permutation). Lane semantics leaves unannotated refs unswizzled; their loads
    must then be unoptimized (no bank-conflict-free plan exists for them), so ``load`` passes
    ``optimized=False``. Everything else is ``plgpu``'s."""

    def __init__(self, plgpu):
        self._plgpu = plgpu

    def __getattr__(self, name):
        return getattr(self._plgpu, name)

    def load(self, src, *idx, layout=None, optimized=True):
        del optimized
        return self._plgpu.load(src, *idx, layout=layout, optimized=False)


def tile_smem(plgpu, shape, dtype):
    """``plgpu.SMEM(shape, dtype)`` for a buffer of ``[.., 64, bd]`` tiles (the state's chunk,
    dh, the outputs' staging): where its rows are 32, 64 or 128 bytes, with the (8, bd) tiling and
    the swizzle that Warpgroup semantics would infer, so that its loads and stores stay free of
    bank conflicts in Lane semantics (the lag window stays unswizzled: its loads start at any row)."""
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    if row_bytes in (32, 64, 128):
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, shape[-1])),
                                                    plgpu.SwizzleTransform(row_bytes)))
    return plgpu.SMEM(shape, dtype)


def lane_plgpu():
    """The ``plgpu`` a kernel body uses: the Lane-semantics wrapper (``LanePlgpu``; interpreted
    too, so that the CPU tests run its buffers' transforms and unoptimized loads)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return LanePlgpu(plgpu)


def named_body(body, name: str):
    """``body`` renamed ``name``: Pallas names a Mosaic GPU kernel after its body function (in
    Nsight, ``<name>_mosaic_gpu_kernel``) and Mosaic GPU names its dumps after it
    (``MOSAIC_GPU_DUMP_TO``: ``<name>_<k>.ptxas`` ...), where every kernel was ``body``."""
    body.__name__ = body.__qualname__ = name
    return body


def jitted_kernel(plgpu, body, out_type, scratch_types, *, name, batch, t_pad, interpret, streams=None):
    """``body`` as a ``plgpu.kernel`` over (batch row, 64-token tile), one warpgroup each, jitted
    under the named scope ``name`` (the kernel's name in profiles), in Lane semantics.
    ``streams``: a leading grid axis ``"r"`` of that many programs per (batch row, tile), the
    fastest in launch order (the grid's first axis is CUDA's x)."""
    params = dict(compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane))
    grid, names = (batch, t_pad // BLOCK_T), ("b", "t")
    if streams is not None:
        grid, names = (streams, *grid), ("r", *names)
    kernel = plgpu.kernel(named_body(body, name), out_type=out_type, scratch_types=scratch_types,
                          grid=grid, grid_names=names, interpret=plgpu.InterpretGPUParams() if interpret else False,
                          **params)

    @jax.jit
    def run(*inputs):
        with jax.named_scope(name):
            return kernel(*inputs)

    return run


def dh_operand(dh):
    """``h``'s cotangent as the backward kernels read it: bf16 as it comes (a model with bf16
    activations casts ``h`` to bf16, so its cotangent is bf16 and exact; the kernels widen it in
    registers, half the bytes of a float32 copy), any other dtype as float32."""
    dh = jnp.asarray(dh)
    return dh if dh.dtype == jnp.bfloat16 else dh.astype(F32)


def rows4(n: int) -> int:
    return -(-n // 4) * 4


def pad_rows4(w):
    """``w[n, ...]`` with zero rows appended up to a multiple of 4 (``rows4``)."""
    return jnp.pad(w, ((0, rows4(w.shape[0]) - w.shape[0]),) + ((0, 0),) * (w.ndim - 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """What every kernel's code depends on (hashable: each kernel module builds and jits its
    kernel once per value, so that every call site of a model traces the same function and JAX
    lowers it once per program; the Mosaic GPU lowering of phase 2's forward takes about 15 s on
    the CPU and a `base` step has 56 call sites of one configuration). Each kernel's config adds
    its own fields."""

    batch: int
    t_pad: int  # T padded to whole 64-token tiles
    d: int
    stream_kernels: tuple
    heads: int
    block_d: int  # the channel chunk
    has_seg: bool  # segment ids reach the kernel (lag bits)
    front: int  # rows padded in front of the partial (interpret mode: see ``tile_partial``)
    x_dtype: jnp.dtype
    interpret: bool
