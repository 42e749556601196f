"""The depth read's Mosaic GPU kernels (``plgpu.kernel``): phase 2's fused forward
(``phase2_fused_forward``: score and merge the partial, the gate, ``h``; the contract of
``fused.phase2_forward``), phase 2's backward state and input kernels (``phase2_backward_state``,
``phase2_backward_inputs``), and phase 1's scoring and mixing passes (``phase1_scores``,
``phase1_mix``). Phase 1's backward passes are in ``mosaic_gpu_bwd1``, which uses this module's
helpers. Each kernel streams channel chunks through a TMA pipeline of lag windows in shared memory
(``_Lags``: where each conv lag's rows go); rows before token 0 come from TMA's
zero fill, which interpret mode lacks, so there XLA pads the partial in front. What each kernel
fuses, why the windows are padded and lowered in Lane semantics, and the figures:
docs/kernels.md §4."""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference
from pallas_kernels.depth_attention.fused import _pad_t, _stream_layout

F32 = jnp.float32
BLOCK_T = 64  # one warpgroup's WGMMA register layout: 64 rows
MAX_LAG_BITS = 31  # lag bits per token in one int32 (``lag_bits``)


# What Mosaic GPU lets one program allocate on the H200 (227 KiB, its limit for sm_90). The
# kernels' counts (``smem_bytes``, ``state_smem_bytes``, ``scores_smem_bytes``, ``mix_smem_bytes``,
# ``mosaic_gpu_bwd1.smem_bytes``) lay out the scratch list as Pallas does (``_smem_sum``), so they
# bound the allocation from above (``tests/kernels/test_mosaic_gpu_smem.py`` lowers each kernel
# and compares). Summing the buffers' bytes alone undercounts: it misses each buffer's alignment
# padding, the reduction scratch and the barriers.
SMEM_BYTES = 227 * 1024
SMEM_ALIGNMENT = 1024  # Pallas' Mosaic GPU lowering starts each scratch buffer at a multiple of this
BARRIER_BYTES = 8  # one mbarrier, after the scratch buffers
# what Pallas reserves for a kernel that sums across warps (``CompilerParams.reduction_scratch_bytes``,
# its default; our kernels' row and column sums of WGMMA-layout tiles)
REDUCTION_SCRATCH_BYTES = 2048


def _smem_sum(*buffers: int, barriers: int = 0, reduces: bool = False) -> int:
    """Shared memory of a scratch list as Pallas lays it out: each buffer's bytes (0: absent)
    rounded up to ``SMEM_ALIGNMENT``, the reduction scratch of a kernel that ``reduces`` across
    warps, then ``barriers`` mbarriers."""
    return (sum(-(-b // SMEM_ALIGNMENT) * SMEM_ALIGNMENT for b in buffers) + BARRIER_BYTES * barriers
            + (REDUCTION_SCRATCH_BYTES if reduces else 0))

# Channel chunks, widest first. 16 ran MSAR's forward at `base` 12-13% slower than 32 (1.59-1.60
# against 1.42 ms) and AttnRes's crashed with a misaligned address on the H200, so
# only 32 is offered: a program that does not fit with it (a float32 partial) runs on Triton.
BLOCK_D_CHOICES = (32,)


def smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, acc_dtype, out_dtype,
               gate: bool = True) -> int:
    """Shared memory of one program of ``phase2_fused_forward`` (its scratch list, ``_smem_sum``;
    the taps and segment bits counted whether present or not)."""
    bt, bd, m, mh = BLOCK_T, block_d, len(stream_kernels), len(stream_kernels) * heads
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    n_taps = max(1, sum(stream_kernels))
    n_consts = 1 + (1 + m if gate else 0)  # include, then the gate's scale and biases
    return _smem_sum(2 * _window_elems(stream_kernels, bd) * size(x_dtype),
                     2 * n_taps * bd * 4, 2 * m * bd * 4, 2 * m * bt * bd * size(acc_dtype),
                     2 * m * m * bd * 4 if gate else 0, 2 * mh * bt * 4, bt * 4, n_consts * bt * 4, mh * bt * 4,
                     m * bt * 4, 2 * bt * bd * size(out_dtype), barriers=5, reduces=True)


def state_smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, acc_dtype,
                     out_dtype=F32, gate: bool = True, dh_dtype=F32) -> int:
    """Shared memory of one program of ``phase2_backward_state`` (its scratch list, ``_smem_sum``;
    ``dh_dtype``: the output cotangent's, float32 when not known)."""
    bt, bd, m, mh = BLOCK_T, block_d, len(stream_kernels), len(stream_kernels) * heads
    size = lambda dtype: jnp.dtype(dtype).itemsize  # noqa: E731
    n_taps = max(1, sum(stream_kernels))
    return _smem_sum(
        2 * _window_elems(stream_kernels, bd) * size(x_dtype),
        2 * n_taps * bd * 4, 2 * m * bt * bd * size(acc_dtype), 2 * bt * bd * size(dh_dtype),
        2 * m * m * bd * 4 if gate else 0,
        3 * mh * bt * 4, (1 + m) * bt * 4 if gate else 0, bt * 4, 3 * mh * bt * 4,
        (3 * m + 2) * bt * 4 if gate else 0, barriers=3, reduces=True)


def choose_block_d(*, d: int, heads: int, stream_kernels: Sequence[int], x_dtype, acc_dtype, out_dtype,
                   gate: bool = True, smem_limit: int | None = SMEM_BYTES, smem=smem_bytes,
                   choices: Sequence[int] | None = None) -> int | None:
    """The first channel chunk of ``choices`` that divides a head and whose program fits in
    ``smem_limit`` bytes of shared memory (``smem``: ``smem_bytes`` for the forward,
    ``state_smem_bytes`` for the backward's kernel; None: no limit, as in interpret mode), or
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
    ``t``'s segment (``reference._lag_masks``' rule: equal ids). Bit 0 is always set."""
    masks = reference._lag_masks(segment_ids, t_len, max_lag, segment_ids.shape[0])  # [K, B, T]
    weights = (2 ** jnp.arange(max_lag, dtype=jnp.int32))[:, None, None]
    return jnp.sum(masks.astype(jnp.int32) * weights, axis=0)


def _rows(v, bt, bd):
    return lax.broadcast_in_dim(v, (bt, bd), [0])


def _cols(v, bt, bd):
    return lax.broadcast_in_dim(v, (bt, bd), [1])


# channels past the chunk in each window row: 80-byte rows for 32 bf16 channels, so that the 8
# rows of a warp's load start on different banks (64-byte rows put rows r and r + 2 on the same
# banks; on the H200 the expansion alone 0.594 -> 0.364 ms); fetched, never read. Every kernel's
# lag window is one such padded window per chunk (docs/kernels.md has the other placements'
# figures: the step 1571.2 -> 1530.1 ms against an unpadded window).
WINDOW_PAD = 8


class _Lags(NamedTuple):
    """Where a tile's conv lags sit in shared memory: one window of ``64 + 8 extra`` rows per
    chunk, lag ``delta`` at row ``8 extra - delta``: one TMA copy of about the tile's bytes, loads
    at row offsets that are not multiples of 8 (exact in Lane semantics, ``_LanePlgpu``), with
    ``pad`` (``WINDOW_PAD``) more channels in each row against shared-memory bank conflicts."""

    rows: int  # rows of the window
    extra: int  # 8-row groups above the 64 rows
    pad: int = WINDOW_PAD  # channels past the chunk in each window row
    count = 1  # windows per slot

    @staticmethod
    def of(max_lag: int, pad: int = WINDOW_PAD) -> "_Lags":
        extra = -(-(max_lag - 1) // 8)
        return _Lags(BLOCK_T + 8 * extra, extra, pad)

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


def _window_elems(stream_kernels, bd: int) -> int:
    """Elements of one slot's lag window (``_Lags``), for the shared-memory counts."""
    lags = _Lags.of(max([1, *stream_kernels]))
    return lags.smem_rows() * lags.width(bd)


def _fetch_partial(plgpu, x_ref, bank_ref, xs, bs, b, t0, front, c, bd, slot, bar, lags: _Lags, n_lags: int):
    """TMA copies of chunk ``c``'s lag windows of the partial (``lags``: where each lag goes; see
    the module docstring) and of its conv taps."""
    cs, xcs = pl.ds(c * bd, bd), lags.columns(c, bd)
    lags.fetch(plgpu, lambda lag, rows: x_ref.at[b, pl.ds(t0 + front - lag, rows), xcs], xs, slot, bar.at[slot],
               n_lags)
    if bank_ref is not None:
        plgpu.copy_gmem_to_smem(bank_ref.at[:, cs], bs.at[slot], bar.at[slot])


def _state_rows(state, t_pad: int):
    """``[m, B, T, d]`` -> ``[m, B * Tp, d]`` (T padded): a tile's rows of every stream are then
    one 3D box (``[m, 64, bd]``), which TMA takes in one copy. (With the batch row as a fourth,
    squeezed dimension, Mosaic GPU's tiled shared-memory view of the box needs 6 dimensions,
    one more than TMA has.)"""
    m, batch, _, d = state.shape
    return _pad_t(state, 2, t_pad).reshape(m, batch * t_pad, d)


def _copy_state(plgpu, acc_ref, accs, rows, cs, slot, bar):
    """The TMA copy of the state's chunk ``acc[:, rows, cs]`` (``[m, 64, bd]``, one 3D box;
    ``acc`` as ``_state_rows`` lays it out) into ``accs[slot]``."""
    plgpu.copy_gmem_to_smem(acc_ref.at[:, rows, cs], accs.at[slot], bar)


def _store_group(plgpu, pairs):
    """TMA stores ``(src, dst)`` from shared to global memory, committed as one bulk-copy group
    after the last (Nsight Compute put 5% of the mixing pass's warp samples on the commits of its
    8 stores per chunk and stream when each was its own group); only for stores that are awaited
    together (``wait_smem_to_gmem(0)``), since the groups are what a wait counts."""
    pairs = list(pairs)
    for k, (src, dst) in enumerate(pairs):
        plgpu.copy_smem_to_gmem(src, dst, commit_group=k == len(pairs) - 1)


def _pipelined(plgpu, fetch, bar, nc, heads, per_chunk, carry, before_refill=None, n_slots=2, head_end=None,
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


def _lag_masks_of(plgpu, bits_s, max_lag, bt, bd):
    """``masks[delta]`` (``[bt, bd]`` float32, None where nothing is masked) from the tile's lag
    bits in shared memory (``lag_bits``), or all None without segments (the rows before token 0
    are zeros: TMA's fill, or the interpreted pad)."""
    if bits_s is None:
        return [None] * max_lag
    bits = plgpu.load(bits_s, (), layout=plgpu.Layout.WGMMA.reduce(1))
    return [None] + [_rows(((bits >> delta) & 1).astype(F32), bt, bd) for delta in range(1, max_lag)]


def _expand_all(plgpu, xs, bs, slot, layout, masks, bt, bd, lags: _Lags):
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
                term = _cols(plgpu.load(bs, (slot, off + delta), layout=col), bt, bd) * masked
                es[r] = term if es[r] is None else es[r] + term
    return es


def _expand_item(plgpu, lags: "_Lags", xs, taps_s, slot, kernel: int, masks, bt, bd, window=None):
    """``E_r`` (Eq. 10) of one pipeline item: a stream of ``kernel`` taps from the lag windows in
    ``xs[slot]`` (``xs[window]`` when given) and its taps in ``taps_s[slot]`` (``[kernel, bd]``;
    None: the taps are zero); ``_expand_all``'s sums for one stream, in the same order."""
    window = slot if window is None else window
    if kernel == 0:
        return lags.load(plgpu, xs, window, 0).astype(F32)
    col = plgpu.Layout.WGMMA.reduce(0)
    e = None
    for delta in range(kernel):
        xl = lags.load(plgpu, xs, window, delta).astype(F32)
        if masks[delta] is not None:
            xl = xl * masks[delta]
        tap = _cols(plgpu.load(taps_s, (slot, delta), layout=col), bt, bd) if taps_s is not None else 0.0
        term = tap * xl
        e = term if e is None else e + term
    return e


def _valid_first(valid, n: int):
    """The valid sources first (their order kept), then their count, as ``[n + 1, 64]`` int32
    rows (one TMA copy): a kernel loops over the valid ones only."""
    live = jnp.ones((n,), jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32).reshape(n)
    order = jnp.argsort(1 - live, stable=True).astype(jnp.int32)
    return jnp.broadcast_to(jnp.concatenate([order, jnp.sum(live, keepdims=True)])[:, None], (n + 1, 64))


class _Shape(NamedTuple):
    """What both kernels' wrappers derive from their inputs (``_shape``)."""

    batch: int
    t_len: int
    d: int
    block_d: int
    max_lag: int
    has_bank: bool
    has_seg: bool
    t_pad: int
    front: int  # rows padded in front of the partial (interpret mode: see the module docstring)
    x: jax.Array  # the partial, T padded to whole tiles (and the front rows)
    bits: jax.Array | None  # ``lag_bits`` of the segment ids, T padded


def _shape(name, partial, segment_ids, *, stream_kernels, heads, block_d, interpret, smem,
           choices: Sequence[int] | None = None, **dtypes) -> _Shape:
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
    front = 8 * -(-(max_lag - 1) // 8) if interpret else 0  # rows a "single" window reaches back: whole 8s
    x = _pad_t(partial, 1, t_pad)
    if interpret:  # rows before token 0 and the "padded" windows' channels past d: zeros, as TMA fills them
        x = jnp.pad(x, ((0, 0), (front, 0), (0, WINDOW_PAD)))
    bits = _pad_t(lag_bits(segment_ids, t_len, max_lag), 1, t_pad) if has_seg else None
    return _Shape(batch, t_len, d, bd, max_lag, any(stream_kernels), has_seg, t_pad, front, x, bits)


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
    sh = _shape("phase2_fused_forward", partial, segment_ids, stream_kernels=stream_kernels, heads=heads,
                block_d=block_d, interpret=interpret, smem=smem_bytes,
                x_dtype=partial.dtype, acc_dtype=state.acc.dtype, out_dtype=out_dtype, gate=gate)
    batch, t_len, d, bd, t_pad, x = sh.batch, sh.t_len, sh.d, sh.block_d, sh.t_pad, sh.x
    front, has_bank, has_seg, mh = sh.front, sh.has_bank, sh.has_seg, m * heads

    def pad_t(a, axis, value=0.0):
        return _pad_t(a, axis, t_pad, value)

    banks = (jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32))
    q = jnp.asarray(query, F32)
    acc = _state_rows(state.acc, t_pad)
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
    cfg = _Config(batch=batch, t_pad=t_pad, d=d, stream_kernels=tuple(stream_kernels), heads=heads,
                  block_d=bd, gate=gate, has_seg=has_seg, front=front, eps=float(eps),
                  gate_eps=float(gate_eps), x_dtype=jnp.dtype(x.dtype), acc_dtype=jnp.dtype(acc.dtype),
                  out_dtype=jnp.dtype(out_dtype), n_consts=consts.shape[0], gate_stats=gate_stats, passes="all",
                  interpret=bool(interpret))
    if split:
        dots, sumsq = _kernel(cfg._replace(passes="scores"))(*inputs)
        (h,) = _kernel(cfg._replace(passes="merge"))(*inputs, dots, sumsq)
    else:
        h, dots, sumsq = _kernel(cfg)(*inputs)
    dots = jnp.moveaxis(dots.reshape(m, heads, batch, t_pad), 1, -1)[:, :, :t_len]
    return h[:, :t_len], (dots, sumsq[:, :, :t_len])


class _LanePlgpu:
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


def _tile_smem(plgpu, shape, dtype):
    """``plgpu.SMEM(shape, dtype)`` for a buffer of ``[.., 64, bd]`` tiles (the state's chunk,
    dh, the outputs' staging): where its rows are 32, 64 or 128 bytes, with the (8, bd) tiling and
    the swizzle that Warpgroup semantics would infer, so that its loads and stores stay free of
    bank conflicts in Lane semantics (the lag window stays unswizzled: its loads start at any row)."""
    row_bytes = shape[-1] * jnp.dtype(dtype).itemsize
    if row_bytes in (32, 64, 128):
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, shape[-1])),
                                                    plgpu.SwizzleTransform(row_bytes)))
    return plgpu.SMEM(shape, dtype)


def _lane_plgpu():
    """The ``plgpu`` a kernel body uses: the Lane-semantics wrapper (``_LanePlgpu``; interpreted
    too, so that the CPU tests run its buffers' transforms and unoptimized loads)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return _LanePlgpu(plgpu)


def named_body(body, name: str):
    """``body`` renamed ``name``: Pallas names a Mosaic GPU kernel after its body function (in
    Nsight, ``<name>_mosaic_gpu_kernel``) and Mosaic GPU names its dumps after it
    (``MOSAIC_GPU_DUMP_TO``: ``<name>_<k>.ptxas`` ...), where every kernel was ``body``."""
    body.__name__ = body.__qualname__ = name
    return body


def _jitted_kernel(plgpu, body, out_type, scratch_types, *, name, batch, t_pad, interpret, streams=None):
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


class _Config(NamedTuple):
    """Everything the kernel's code depends on (hashable: ``_kernel`` builds it once per value)."""

    batch: int
    t_pad: int
    d: int
    stream_kernels: tuple
    heads: int
    block_d: int
    gate: bool
    has_seg: bool
    front: int  # rows padded in front of the partial (interpret mode)
    eps: float
    gate_eps: float
    x_dtype: jnp.dtype
    acc_dtype: jnp.dtype
    out_dtype: jnp.dtype
    n_consts: int
    gate_stats: str  # GATE_STATS
    passes: str  # FORWARD_PASSES
    interpret: bool


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
def _kernel(cfg: _Config):
    """The kernel for ``cfg`` as a jitted function of ``phase2_fused_forward``'s inputs. Built and
    jitted once per configuration, so that every call site of a model traces the same function:
    JAX then lowers it once per program instead of once per call (the Mosaic GPU lowering of this
    kernel takes about 15 s on the CPU; a `base` step has 56 call sites of one configuration)."""
    plgpu = _lane_plgpu()

    batch, t_pad, d, heads, bd, gate, has_seg, front = (cfg.batch, cfg.t_pad, cfg.d, cfg.heads, cfg.block_d,
                                                        cfg.gate, cfg.has_seg, cfg.front)
    eps, gate_eps, stream_kernels = cfg.eps, cfg.gate_eps, cfg.stream_kernels
    m, bt = len(stream_kernels), BLOCK_T
    layout = _stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    has_bank = any(stream_kernels)
    nc = d // bd
    mh = m * heads
    n_taps = max(1, sum(stream_kernels))
    row = plgpu.Layout.WGMMA.reduce(1)  # one value per token row
    col = plgpu.Layout.WGMMA.reduce(0)  # one value per channel
    tile = plgpu.Layout.WGMMA
    lags = _Lags.of(max_lag)
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
        accs=_tile_smem(plgpu, (2, m, bt, bd), cfg.acc_dtype) if merge_pass or fused_stats else None,
        ws=plgpu.SMEM((2, m * m, bd), F32) if gate and (merge_pass or fused_stats) else None,
        rows_s=plgpu.SMEM((2, mh, bt), F32) if merge_pass else None,
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        scal_s=plgpu.SMEM((cfg.n_consts, bt), F32) if merge_pass else None,
        dots_s=plgpu.SMEM((mh, bt), F32),
        ss_s=plgpu.SMEM((m, bt), F32),
        h_s=_tile_smem(plgpu, (2, bt, bd), cfg.out_dtype) if merge_pass else None,
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
                _fetch_partial(plgpu, x_ref, bank_ref if has_bank else None, xs, bs, b, t0, front, c, bd, slot,
                               bar, lags, max_lag)
                cs = pl.ds(c * bd, bd)
                if with_state:
                    _copy_state(plgpu, acc_ref, accs, pl.ds(b * t_pad + t0, bt), cs, slot, bar.at[slot])
                    if gate:
                        plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws.at[slot], bar.at[slot])
                if with_query:
                    plgpu.copy_gmem_to_smem(q_ref.at[:, cs], qs.at[slot], bar.at[slot])

            return issue

        def pipelined(bar, with_state, per_chunk, carry, with_query=False, reverse=False):
            return _pipelined(plgpu, fetch(bar, with_state, with_query), bar, nc, heads, per_chunk, carry,
                              reverse=reverse)

        if n_in:
            plgpu.barrier_wait(bar_in.at[0])
        masks = _lag_masks_of(plgpu, bits_s, max_lag, bt, bd)

        def expand(slot):
            return _expand_all(plgpu, xs, bs, slot, layout, masks, bt, bd, lags)

        def w_col(slot, r, j):
            return _cols(plgpu.load(ws, (slot, r * m + j), layout=col), bt, bd)

        # ---- A: per-head dots and the keys' sums of squares; with ``fused_stats`` also, per stream
        # and head, the sums that give the gate's statistics once a and b are known:
        # sum z^2 = a^2 A.A + 2 a b A.E + b^2 E.E and z . W_j = a A.W_j + b E.W_j (z = a A + b E)
        def scores_chunk(c, slot, head, carry):
            dots, sqs = [list(v) for v in carry[0]], list(carry[1])
            if fused_stats:
                aa, ae, ee = ([list(v) for v in sums] for sums in carry[2])
                aw, ew = ([[list(u) for u in v] for v in sums] for sums in carry[3])
            for r, e in enumerate(expand(slot)):
                qr = _cols(plgpu.load(qs, (slot, r), layout=col), bt, bd)
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
            return _rows(coef_a[r][head], bt, bd) * a_state + _rows(coef_b[r][head], bt, bd) * e

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
                term = z * (1.0 / m) if mix[r] is None else _rows(mix[r], bt, bd) * z
                h = term if h is None else h + term
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that last read this slot is done
            h_s[slot] = h.astype(h_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(h_s.at[slot], h_ref.at[b, pl.ds(t0, bt), pl.ds(c * bd, bd)])
            return carry

        # with the gate, the state's second read (pass B, or with ``fused_stats`` pass A, read it
        # first), in reverse (``_pipelined`` says why)
        pipelined(bar_bc, True, fuse_chunk, 0, reverse=gate)
        plgpu.wait_smem_to_gmem(0)

    out_type = ([jax.ShapeDtypeStruct((batch, t_pad, d), cfg.out_dtype)] if merge_pass else []) + (
        [jax.ShapeDtypeStruct((mh, batch, t_pad), F32), jax.ShapeDtypeStruct((m, batch, t_pad), F32)]
        if scores_pass else [])
    name = {"all": "depth_attention_phase2_mosaic", "scores": "depth_attention_phase2_scores_mosaic",
            "merge": "depth_attention_phase2_merge_mosaic"}[cfg.passes]
    return _jitted_kernel(plgpu, body, tuple(out_type), [scratch[k] for k in scratch_names],
                          name=name, batch=batch, t_pad=t_pad, interpret=cfg.interpret)


# --------------------------------------------------------------------------- backward


def _dh_operand(dh):
    """``h``'s cotangent as the backward kernels read it: bf16 as it comes (a model with bf16
    activations casts ``h`` to bf16, so its cotangent is bf16 and exact; the kernels widen it in
    registers, half the bytes of a float32 copy), any other dtype as float32."""
    dh = jnp.asarray(dh)
    return dh if dh.dtype == jnp.bfloat16 else dh.astype(F32)


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
    ``acc[m, B, T, d]``; ``dh[B, T, d]`` (bf16 or float32: ``_dh_operand``); ``gate_params =
    (w, scale, bias)`` or None. Returns ``d_acc`` (``acc``'s dtype), ``(S1, Sm, Ss)`` each ``[m, B, T, H]``, and for the gate
    ``(g, dy, coef, d_scale, d_bias)`` (``[B, T, m]``, ``[B, T, m]``, ``[B, T]``, the scale's
    and bias's gradients) or None. On the H200 at `base` the whole Pallas backward ran 5.40 ms
    per call with it against 6.19 with the two Triton passes (docs/kernels.md), so ``gpu_kernels="auto"`` takes it wherever it takes the forward. With the gate, pass 2 reads
    the chunks in reverse (``_pipelined`` says why)."""
    m, bt = len(stream_kernels), BLOCK_T
    gate = gate_params is not None
    sh = _shape("phase2_backward_state", partial, segment_ids, stream_kernels=stream_kernels, heads=heads,
                block_d=block_d, interpret=interpret,
                smem=functools.partial(state_smem_bytes, dh_dtype=dh.dtype),
                x_dtype=partial.dtype, acc_dtype=acc.dtype, out_dtype=F32, gate=gate)
    batch, t_len, d, bd, t_pad, x = sh.batch, sh.t_len, sh.d, sh.block_d, sh.t_pad, sh.x
    front, has_bank, has_seg, mh = sh.front, sh.has_bank, sh.has_seg, m * heads

    def pad_t(v, axis, value=0.0):
        return _pad_t(v, axis, t_pad, value)

    def head_rows(v, value=0.0):  # [m, B, T, H] -> [m H, B, Tp]
        return pad_t(jnp.moveaxis(jnp.asarray(v, F32), -1, 1).reshape(mh, batch, t_len), 2, value)

    dh = _dh_operand(dh)
    inputs = [x, jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32), head_rows(a), head_rows(b),
              head_rows(dold, 1.0), _state_rows(acc, t_pad), pad_t(dh, 1)]
    if gate:
        w, scale, bias = gate_params
        inputs.append(jnp.asarray(w, F32).reshape(m, d, m).transpose(0, 2, 1).reshape(m * m, d))  # [(r, j), c]
        consts = jnp.stack([jnp.asarray(scale, F32).reshape(()), *jnp.asarray(bias, F32).reshape(m)])
        inputs.append(jnp.broadcast_to(consts[:, None], (1 + m, bt)))
    if has_seg:
        inputs.append(sh.bits)
    call = _state_kernel(_StateConfig(batch=batch, t_pad=t_pad, t_len=t_len, d=d, stream_kernels=tuple(stream_kernels),
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
    them (``g``, ``dy``, ``coef``, ``dlogit``, ``dlogit . y rz``). Shared by the one-CTA kernel and
    ``mosaic_gpu_cluster``'s."""
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


class _StateConfig(NamedTuple):
    """Everything ``phase2_backward_state``'s kernel code depends on (see ``_Config``)."""

    batch: int
    t_pad: int
    t_len: int
    d: int
    stream_kernels: tuple
    heads: int
    block_d: int
    gate: bool
    has_seg: bool
    front: int
    gate_eps: float
    x_dtype: jnp.dtype
    acc_dtype: jnp.dtype
    dh_dtype: jnp.dtype
    interpret: bool


@functools.lru_cache(maxsize=None)
def _state_kernel(cfg: _StateConfig):
    """``phase2_backward_state``'s kernel for ``cfg``, built and jitted once (``_kernel`` says why)."""
    plgpu = _lane_plgpu()

    batch, t_pad, d, heads, bd, gate, has_seg, front = (cfg.batch, cfg.t_pad, cfg.d, cfg.heads, cfg.block_d,
                                                        cfg.gate, cfg.has_seg, cfg.front)
    stream_kernels = cfg.stream_kernels
    m, bt = len(stream_kernels), BLOCK_T
    layout = _stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    lags = _Lags.of(max_lag)
    has_bank = any(stream_kernels)
    nc, mh = d // bd, m * heads
    n_taps = max(1, sum(stream_kernels))
    row, col, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA
    n_gate_rows = 3 * m + 2  # g, dy, coef, dlogit, dlogit . rz y
    scratch = dict(
        xs=plgpu.SMEM((2, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((2, n_taps, bd), F32) if has_bank else None,
        accs=_tile_smem(plgpu, (2, m, bt, bd), cfg.acc_dtype),  # the state's chunk; d_acc's, stored in place
        dhs=_tile_smem(plgpu, (2, bt, bd), cfg.dh_dtype),
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
            _fetch_partial(plgpu, x_ref, bank_ref if has_bank else None, xs, bs, bi, t0, front, c, bd, slot, bar,
                           lags, max_lag)
            cs = pl.ds(c * bd, bd)
            _copy_state(plgpu, acc_ref, accs, state_rows, cs, slot, bar.at[slot])
            plgpu.copy_gmem_to_smem(dh_ref.at[bi, rows, cs], dhs.at[slot], bar.at[slot])
            if gate:
                plgpu.copy_gmem_to_smem(w_ref.at[:, cs], ws.at[slot], bar.at[slot])

        plgpu.barrier_wait(bar_in.at[0])
        masks = _lag_masks_of(plgpu, bits_s, max_lag, bt, bd)
        coef_a, coef_b, dold = ([[plgpu.load(rows_s, i * mh + r * heads + h, layout=row) for h in range(heads)]
                                 for r in range(m)] for i in range(3))

        def expand(slot):
            return _expand_all(plgpu, xs, bs, slot, layout, masks, bt, bd, lags)

        def chunk_values(slot, r, head, e):
            """``A_r`` and ``z_r = a A_r + b E_r`` of the chunk in ``slot``."""
            acc = plgpu.load(accs, (slot, r), layout=tile).astype(F32)
            return acc, _rows(coef_a[r][head], bt, bd) * acc + _rows(coef_b[r][head], bt, bd) * e

        def w_col(slot, r, j):
            return _cols(plgpu.load(ws, (slot, r * m + j), layout=col), bt, bd)

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

            sq, y, dg = _pipelined(plgpu, fetch, bar, nc, heads, stats_chunk, (zero, [zero] * m, [zero] * m))
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
                    dz = _rows(g[r], bt, bd) * dh + _rows(coef, bt, bd) * z
                    for j in range(m):
                        dz = dz + w_col(slot, r, j) * _rows(dy[j], bt, bd)
                k = r * heads + head
                s1[k] = s1[k] + jnp.sum(dz * z, axis=1)
                sm[k] = sm[k] + jnp.sum(dz * (acc - e * _rows(dold[r][head], bt, bd)), axis=1)
                ss[k] = ss[k] + jnp.sum(dz * (e - z), axis=1)
                # d_acc over the state's chunk in shared memory, read by this thread alone (same layout)
                accs[slot, r] = (_rows(coef_a[r][head], bt, bd) * dz).astype(accs.dtype)
            plgpu.commit_smem()
            cs = pl.ds(c * bd, bd)
            plgpu.copy_smem_to_gmem(accs.at[slot], dacc_ref.at[:, state_rows, cs])
            return s1, sm, ss

        def stores_done():  # d_acc's stores from this slot have read it before the slot is refilled
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        # with the gate, the state's second read (pass 1 read it first), in reverse (``_pipelined``)
        s1, sm, ss = _pipelined(plgpu, fetch, bar, nc, heads, state_chunk, ([zero] * mh,) * 3,
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
    return _jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names],
                          name="depth_attention_phase2_bwd_state_mosaic", batch=batch, t_pad=t_pad,
                          interpret=cfg.interpret)


# --------------------------------------------------------------------------- phase 1's scoring pass


def scores_smem_bytes(*, block_d: int, stream_kernels: Sequence[int], heads: int, x_dtype, n_targets: int,
                      n_sources: int, n_slots: int | None = None, **_unused) -> int:
    """Shared memory of one program of ``phase1_scores`` (its scratch list, ``_smem_sum``)."""
    bt, bd, m = BLOCK_T, block_d, len(stream_kernels)
    n_taps, slots = max(1, sum(stream_kernels)), n_slots or SCORES_SLOTS
    return _smem_sum(
        slots * _window_elems(stream_kernels, bd) * jnp.dtype(x_dtype).itemsize,
        slots * n_taps * bd * 4, slots * n_targets * m * bd * 4, n_sources * 64 * 4, bt * 4,
        n_targets * m * heads * bt * 4, m * bt * 4, barriers=slots + 1, reduces=True)


# Channel chunks in flight in ``phase1_scores``'s TMA pipeline (the one being reduced and the next
# ``SCORES_SLOTS - 1``). 3 or 4 gave nothing on the H200 (within 5% either way).
SCORES_SLOTS = 2
# ``phase1_scores``'s channel chunks, first choice first (``choose_block_d``), for one stream and for
# several. Wider chunks mean fewer copies and fewer per-chunk reductions: on the H200
# one stream took 0.387 / 0.299 / 0.262 ms with 32 / 64 / 128 channels at `base` (0.448 /
# 0.346 / 0.292 at the bench shape); MSAR's four streams 1.787 / 1.676 (1.947 / 1.870), and 128
# channels would hold four [64, 128] float32 streams in registers (256 per thread) before any sum.
SCORES_BLOCK_D_CHOICES = {"one_stream": (128, 64, 32), "several": (64, 32)}


def scores_block_d_choices(n_streams: int) -> tuple:
    """The channel chunks ``phase1_scores`` tries, first choice first."""
    return SCORES_BLOCK_D_CHOICES["one_stream" if n_streams == 1 else "several"]


def phase1_scores(sources, banks, queries, segment_ids, valid, *, stream_kernels, heads: int,
                  block_d: int | None = None, n_slots: int | None = None, interpret: bool = False):
    """Phase 1's scoring pass (``fused.scores_call``'s sums) as one Mosaic GPU kernel: per
    (batch row, 64-token tile), for each valid source, the chunks of its lag windows stream
    through a double-buffered TMA pipeline, its streams are built in registers (Eq. 10) and
    reduced against every target's query and against themselves.

    ``sources[n, B, T, d]``, ``banks[n, K, d]`` or None, ``queries[S, m, d]``, ``segment_ids
    [B, T]`` or None, ``valid[n]`` (bool, may be traced) or None. Returns float32 ``dots[S, n,
    m, B, T, H]`` (``q_{s,r} . E_{i,r}`` per head) and ``sumsq[n, m, B, T]`` (``sum E_{i,r}^2``
    over all ``d``), zeros for a source ``valid`` rules out (not computed). ``n_slots``: channel chunks in flight (None: ``SCORES_SLOTS``; at least 2)."""
    n, batch, t_len, d = sources.shape
    n_targets, m = queries.shape[:2]
    n_slots = SCORES_SLOTS if n_slots is None else n_slots
    if n_slots < 2:
        raise ValueError(f"mosaic_gpu.phase1_scores: n_slots={n_slots}: must be at least 2 (one chunk reduced "
                         "while the next is copied)")
    if queries.shape[-1] != d or m != len(stream_kernels):
        raise ValueError(f"queries {queries.shape}: want [S, {len(stream_kernels)}, {d}]")
    smem = functools.partial(scores_smem_bytes, n_targets=n_targets, n_sources=n, n_slots=n_slots)
    sh = _shape("phase1_scores", sources.reshape(n * batch, t_len, d), segment_ids, stream_kernels=stream_kernels,
                heads=heads, block_d=block_d, interpret=interpret, smem=smem, x_dtype=sources.dtype, acc_dtype=F32,
                out_dtype=F32, choices=scores_block_d_choices(m))
    has_bank = sh.has_bank and banks is not None
    live = jnp.ones((n,), jnp.int32) if valid is None else jnp.asarray(valid, jnp.int32).reshape(n)
    inputs = [sh.x, jnp.asarray(banks, F32) if has_bank else jnp.zeros((n, 1, d), F32),
              jnp.asarray(queries, F32).reshape(n_targets * m, d), jnp.broadcast_to(live[:, None], (n, 64))]
    if sh.has_seg:
        inputs.append(sh.bits)
    call = _scores_kernel(_ScoresConfig(n=n, batch=batch, t_pad=sh.t_pad, d=d, stream_kernels=tuple(stream_kernels),
                                        heads=heads, n_targets=n_targets, block_d=sh.block_d, has_bank=has_bank,
                                        has_seg=sh.has_seg, front=sh.front, x_dtype=jnp.dtype(sh.x.dtype),
                                        interpret=bool(interpret), n_slots=n_slots))
    dots, sumsq = call(*inputs)  # [n, S m H, B, Tp], [n, m, B, Tp]
    dots = dots.reshape(n, n_targets, m, heads, batch, sh.t_pad).transpose(1, 0, 2, 4, 5, 3)
    return dots[:, :, :, :, :t_len], sumsq[..., :t_len]


class _ScoresConfig(NamedTuple):
    """Everything ``phase1_scores``'s kernel code depends on (see ``_Config``)."""

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
    interpret: bool
    n_slots: int = 2


@functools.lru_cache(maxsize=None)
def _scores_kernel(cfg: _ScoresConfig):
    """``phase1_scores``'s kernel for ``cfg``, built and jitted once (``_kernel`` says why)."""
    plgpu = _lane_plgpu()

    n, batch, d, heads, bd, n_targets = cfg.n, cfg.batch, cfg.d, cfg.heads, cfg.block_d, cfg.n_targets
    stream_kernels, has_bank, has_seg, front = cfg.stream_kernels, cfg.has_bank, cfg.has_seg, cfg.front
    m, bt = len(stream_kernels), BLOCK_T
    layout = _stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    lags, n_taps = _Lags.of(max_lag), max(1, sum(stream_kernels))
    nc, smh = d // bd, n_targets * m * heads
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
    slots = cfg.n_slots
    scratch = dict(
        xs=plgpu.SMEM((slots, lags.count, lags.rows, lags.width(bd)), cfg.x_dtype),
        bs=plgpu.SMEM((slots, n_taps, bd), F32) if has_bank else None,
        qs=plgpu.SMEM((slots, n_targets * m, bd), F32),
        live_s=plgpu.SMEM((n, 64), jnp.int32),
        bits_s=plgpu.SMEM((bt,), jnp.int32) if has_seg else None,
        dots_s=plgpu.SMEM((smh, bt), F32),
        ss_s=plgpu.SMEM((m, bt), F32),
        bar=plgpu.Barrier(num_arrivals=lags.count + has_bank + 1, num_barriers=slots),
        bar_in=plgpu.Barrier(num_arrivals=1 + has_seg, num_barriers=1),
    )
    names = [k for k, v in scratch.items() if v is not None]

    def body(*refs):
        it = iter(refs)
        x_ref, bank_ref, q_ref, live_ref = (next(it) for _ in range(4))
        bits_ref = next(it) if has_seg else None
        dots_ref, ss_ref = next(it), next(it)
        sc = dict(zip(names, it))
        xs, bs, qs, live_s, bits_s, dots_s, ss_s = (sc.get(k) for k in ("xs", "bs", "qs", "live_s", "bits_s",
                                                                        "dots_s", "ss_s"))
        bar, bar_in = sc["bar"], sc["bar_in"]
        b, t0 = lax.axis_index("b"), lax.axis_index("t") * bt
        plgpu.copy_gmem_to_smem(live_ref, live_s, bar_in.at[0])
        if has_seg:
            plgpu.copy_gmem_to_smem(bits_ref.at[b, pl.ds(t0, bt)], bits_s, bar_in.at[0])
        plgpu.barrier_wait(bar_in.at[0])
        masks = _lag_masks_of(plgpu, bits_s, max_lag, bt, bd)
        zero = plgpu.layout_cast(jnp.zeros((bt,), F32), row)

        def staging_free():  # the last source's stores have read the staging buffers
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def stage_head(head, dots):  # one head's [S m] dots -> their rows of the staging buffer
            for sr in range(n_targets * m):
                dots_s[sr * heads + head] = dots[sr]

        def store(i, sqs):
            for r in range(m):
                ss_s[r] = sqs[r]
            plgpu.commit_smem()
            _store_group(plgpu, ((dots_s, dots_ref.at[i, :, b, pl.ds(t0, bt)]),
                                 (ss_s, ss_ref.at[i, :, b, pl.ds(t0, bt)])))

        def source_body(i, carry):
            def fetch(c, slot):
                _fetch_partial(plgpu, x_ref, bank_ref.at[i] if has_bank else None, xs, bs, i * batch + b, t0,
                               front, c, bd, slot, bar, lags, max_lag)
                plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(c * bd, bd)], qs.at[slot], bar.at[slot])

            # The loop carries the current head's S m dots only: each head's go to the staging
            # buffer when its chunks are done (``head_end``). Carried through every head's loop,
            # MHAR's 8 heads x 8 targets made 64 live accumulators: the pass alone 0.733 -> 0.602
            # ms at `base` with this (AttnRes's one head: 0.281).
            def chunk(c, slot, head, carry):
                dots, sqs = list(carry[0]), list(carry[1])
                for r, e in enumerate(_expand_all(plgpu, xs, bs, slot, layout, masks, bt, bd, lags)):
                    sqs[r] = sqs[r] + jnp.sum(e * e, axis=1)
                    for s in range(n_targets):
                        q = _cols(plgpu.load(qs, (slot, s * m + r), layout=col), bt, bd)
                        dots[s * m + r] = dots[s * m + r] + jnp.sum(e * q, axis=1)
                return dots, sqs

            def head_end(head, carry):
                dots, sqs = carry
                if head == 0:
                    staging_free()
                stage_head(head, dots)
                return ([zero] * (n_targets * m) if head + 1 < heads else dots), sqs

            @pl.when(live_s[i, 0] != 0)
            def _():
                _, sqs = _pipelined(plgpu, fetch, bar, nc, heads, chunk, ([zero] * (n_targets * m), [zero] * m),
                                    n_slots=slots, head_end=head_end)
                store(i, sqs)

            @pl.when(live_s[i, 0] == 0)
            def _():
                staging_free()
                for head in range(heads):
                    stage_head(head, [zero] * (n_targets * m))
                store(i, [zero] * m)

            return carry

        lax.fori_loop(0, n, source_body, 0)
        plgpu.wait_smem_to_gmem(0)

    out_type = (jax.ShapeDtypeStruct((n, smh, batch, cfg.t_pad), F32),
                jax.ShapeDtypeStruct((n, m, batch, cfg.t_pad), F32))
    return _jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names], name="depth_attention_scores_mosaic",
                          batch=batch, t_pad=cfg.t_pad, interpret=cfg.interpret)


# --------------------------------------------------------------------------- phase 1's mixing pass

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
    """Shared memory of one program of ``phase1_mix`` (its scratch list, ``_smem_sum``; ``n_slots``:
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
    window = _window_elems(stream_kernels, bd) * jnp.dtype(x_dtype).itemsize
    return _smem_sum(n_windows * window, *(n_slots * kernel * bd * 4 for kernel in stream_kernels),
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
    reaches (``_Lags.copies``), its taps and its ``p`` rows. The valid sources are listed
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
                           out_dtype=out_dtype, n_targets=p.shape[0], n_slots=n_slots, window_fetch=fetch, n_sources=n) <= SMEM_BYTES
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
    sh = _shape("phase1_mix", sources.reshape(n * batch, t_len, d), segment_ids, stream_kernels=stream_kernels,
                heads=heads, block_d=block_d, interpret=interpret, smem=smem, choices=MIX_BLOCK_D_CHOICES,
                x_dtype=sources.dtype, acc_dtype=F32, out_dtype=out_dtype)
    has_bank = sh.has_bank and banks is not None
    meta = _valid_first(valid, n)  # the kernel loops over the valid sources only
    # [S, n, m, B, T', H] -> [n, m, S H, B, Tp]: one TMA copy per (source, stream) brings a tile's p rows
    p_rows = _pad_t(jnp.asarray(p, F32)[:, :, :, :, :t_len], 4, sh.t_pad)
    p_rows = p_rows.transpose(1, 2, 0, 5, 3, 4).reshape(n, m, n_targets * heads, batch, sh.t_pad)
    inputs = [sh.x, jnp.asarray(banks, F32) if has_bank else jnp.zeros((n, 1, d), F32), p_rows, meta]
    if sh.has_seg:
        inputs.append(sh.bits)
    call = _mix_kernel(_MixConfig(n=n, batch=batch, t_pad=sh.t_pad, d=d, stream_kernels=tuple(stream_kernels),
                                  heads=heads, n_targets=n_targets, block_d=sh.block_d, has_bank=has_bank,
                                  has_seg=sh.has_seg, front=sh.front, x_dtype=jnp.dtype(sh.x.dtype),
                                  out_dtype=jnp.dtype(out_dtype), per_target=bool(per_target), n_slots=n_slots,
                                  interpret=bool(interpret), window_fetch=window_fetch))
    out = call(*inputs)
    cut = lambda a: a[..., :t_len, :]  # noqa: E731
    return [cut(a) for a in out] if per_target else cut(out)


class _MixConfig(NamedTuple):
    """Everything ``phase1_mix``'s kernel code depends on (see ``_Config``)."""

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
    out_dtype: jnp.dtype
    per_target: bool
    n_slots: int
    interpret: bool
    window_fetch: str = "per_item"


@functools.lru_cache(maxsize=None)
def _mix_kernel(cfg: _MixConfig):
    """``phase1_mix``'s kernel for ``cfg``, built and jitted once (``_kernel`` says why)."""
    plgpu = _lane_plgpu()

    n, batch, d, heads, bd, n_targets = cfg.n, cfg.batch, cfg.d, cfg.heads, cfg.block_d, cfg.n_targets
    stream_kernels, has_bank, has_seg, front, n_slots = (cfg.stream_kernels, cfg.has_bank, cfg.has_seg, cfg.front,
                                                         cfg.n_slots)
    m, bt = len(stream_kernels), BLOCK_T
    layout = _stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    nc, nch = d // bd, d // bd // heads
    row, tile = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA
    lags = _Lags.of(max_lag)
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
        out_s=_tile_smem(plgpu, (staged, bt, bd), cfg.out_dtype),
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
        plgpu.copy_gmem_to_smem(meta_ref, meta_s, bar_in.at[0])
        if has_seg:
            plgpu.copy_gmem_to_smem(bits_ref.at[b, rows], bits_s, bar_in.at[0])
        plgpu.barrier_wait(bar_in.at[0])
        masks = _lag_masks_of(plgpu, bits_s, max_lag, bt, bd)
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
                return _expand_item(plgpu, lags, xs, taps_s, slot, stream_kernels[r], masks, bt, bd, window=j)
            return _expand_item(plgpu, lags, xs, taps_s, slot, stream_kernels[r], masks, bt, bd)

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
                        accs = [accs[s] + _rows(plgpu.load(ps, (slot, s * heads + head), layout=row), bt, bd) * e
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
                        _store_group(plgpu, ((out_s.at[s - s0], outs[s].at[r, b, rows, cs] if cfg.per_target
                                              else outs[0].at[s, r, b, rows, cs]) for s in group))
                return unused

            unused = lax.fori_loop(head * nch, (head + 1) * nch, chunk_body, unused)
        plgpu.wait_smem_to_gmem(0)

    if cfg.per_target:
        out_type = [jax.ShapeDtypeStruct((m, batch, cfg.t_pad, d), cfg.out_dtype)] * n_targets
    else:
        out_type = jax.ShapeDtypeStruct((n_targets, m, batch, cfg.t_pad, d), cfg.out_dtype)
    return _jitted_kernel(plgpu, body, out_type, [scratch[k] for k in names], name="depth_attention_mix_mosaic",
                          batch=batch, t_pad=cfg.t_pad, interpret=cfg.interpret)


# --------------------------------------------------------------------------- phase 2's input kernel

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


def _rows4(n: int) -> int:
    return -(-n // 4) * 4


def _pad_rows4(w):
    """``w[n, ...]`` with zero rows appended up to a multiple of 4 (``_rows4``)."""
    return jnp.pad(w, ((0, _rows4(w.shape[0]) - w.shape[0]),) + ((0, 0),) * (w.ndim - 1))


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
    (Lane semantics, as the ``"single"`` windows). The token sums ``d_query_r = sum_t u E_r``,
    ``d_bank[delta] = sum_t mask_delta d_E_r x[t - delta]`` and ``d_W[r, :, j] = sum_t z_r
    dy_j`` ride in the loop carry as whole tiles and are reduced over rows once per program.

    ``a, b, u``: ``[m, B, T, H]``; ``v``: ``[m, B, T]``; ``acc[m, B, T, d]``; ``dh[B, T, d]``
    (bf16 or float32: ``_dh_operand``); ``gate_in``: ``(g[B, T, m], dy[B, T, m], coef[B, T], w3[m, d, m])``
    (``fused.gate_cols``) or None (mean fusion). Returns what ``fused_bwd_phase2._dinput_call``
    does, except that the token sums come per program, not per batch row: ``d_x[B, T, d]``
    in ``dx_dtype`` (float32 or bf16: each element is written once, so bf16 is the float32 value
    rounded once, as a cast after the kernel would give) and the partials ``d_query[P, m, d]``, ``d_bank[P, K, d]`` (None without a bank) and
    ``d_W[P, m, d, m]`` (None without the gate), ``P = B / inputs_rows_per_program(B)``;
    their sum over the first axis is the gradient."""
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
    lags = _Lags.of(max_lag, pad=0)
    front = 8 * lags.extra if interpret else 0
    x = _pad_t(partial, 1, t_pad)
    if interpret:  # the rows before token 0: zeros, as TMA fills them on the GPU
        x = jnp.pad(x, ((0, 0), (front, 0), (0, 0)))
    pad_t = lambda w, axis: _pad_t(jnp.asarray(w, F32), axis, t_pad)  # noqa: E731

    # per-token rows [H, R, B, Tp]: a, b, u, v per stream (v repeated per head), then g, dy, coef
    per_head = [jnp.moveaxis(pad_t(w, 2), -1, 0) for w in (a, b, u)]  # [H, m, B, Tp] each
    per_head.append(jnp.broadcast_to(pad_t(v, 2)[None], (heads, m, batch, t_pad)))
    if gate:
        g, dy, coef, w3 = gate_in
        for w in (g, dy):
            per_head.append(jnp.broadcast_to(jnp.moveaxis(pad_t(w, 1), -1, 0)[None], (heads, m, batch, t_pad)))
        per_head.append(jnp.broadcast_to(pad_t(coef, 1)[None, None], (heads, 1, batch, t_pad)))
    rows = jnp.concatenate(per_head, axis=1)
    inputs = [x, _pad_rows4(jnp.asarray(bank, F32) if has_bank else jnp.zeros((1, d), F32)),
              _pad_rows4(jnp.asarray(query, F32)), rows, _state_rows(acc, t_pad), _pad_t(_dh_operand(dh), 1, t_pad)]
    if gate:
        inputs.append(_pad_rows4(jnp.asarray(w3, F32).transpose(0, 2, 1).reshape(m * m, d)))  # [(r, j), c]
    if has_seg:  # each tile's window: its rows and the next tile's first ones (zeros past the end)
        bits = _pad_t(lag_bits(segment_ids, t_len, max_lag), 1, t_pad)
        inputs.append(jnp.pad(bits, ((0, 0), (0, INPUTS_BITS_ROWS - bt))))
    call = _inputs_kernel(_InputsConfig(batch=batch, t_pad=t_pad, d=d, stream_kernels=stream_kernels, heads=heads,
                                        gate=gate, has_bank=has_bank, has_seg=has_seg, front=front,
                                        x_dtype=jnp.dtype(x.dtype), acc_dtype=jnp.dtype(acc.dtype),
                                        dh_dtype=jnp.dtype(_dh_operand(dh).dtype), dx_dtype=jnp.dtype(dx_dtype),
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
    if len(_stream_groups(_stream_layout(stream_kernels), gate, INPUTS_WARPGROUPS)) == 1:
        return "per_use"
    return "per_program"


class _InputsConfig(NamedTuple):
    """Everything ``phase2_backward_inputs``' kernel code depends on (see ``_Config``)."""

    batch: int
    t_pad: int
    d: int
    stream_kernels: tuple
    heads: int
    gate: bool
    has_bank: bool
    has_seg: bool
    front: int
    x_dtype: jnp.dtype
    acc_dtype: jnp.dtype
    dh_dtype: jnp.dtype
    dx_dtype: jnp.dtype
    rows_per_program: int
    constants: str  # INPUTS_CONSTANTS_CHOICES
    interpret: bool


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
def _inputs_kernel(cfg: _InputsConfig):
    """``phase2_backward_inputs``' kernel for ``cfg``, built and jitted once (``_kernel`` says why).

    With ``INPUTS_WARPGROUPS > 1`` each program runs that many warpgroups, each with its own streams
    (``_stream_groups``) and so its share of the carried token sums: with one warpgroup the 44
    sums of kernels (0, 4, 8, 12) with the gate take 176 registers per thread and ptxas spills;
    more warpgroups also give each scheduler more warps to issue from (Nsight Compute: the
    kernel is issue-bound at two). The streams meet only in ``d_x``: the other
    warpgroups hand their parts over through shared memory (``dx1s``, one buffer each per slot,
    a barrier per slot that all of them arrive at); the first adds them, stores ``d_x`` and
    issues every TMA copy."""
    from jax.experimental.pallas import mosaic_gpu as plgpu_module

    plgpu = _LanePlgpu(plgpu_module)
    batch, t_pad, d, heads, gate, has_seg, front = (cfg.batch, cfg.t_pad, cfg.d, cfg.heads, cfg.gate, cfg.has_seg,
                                                    cfg.front)
    stream_kernels = cfg.stream_kernels
    m, bt, bd = len(stream_kernels), BLOCK_T, INPUTS_BLOCK_D
    layout = _stream_layout(stream_kernels)
    max_lag = max([1, *stream_kernels])
    lags = _Lags.of(max_lag, pad=0)
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
        consts=plgpu.SMEM((_rows4(max(1, n_taps)) + _rows4(m) + (_rows4(m * m) if gate else 0), bd), F32),
        des=plgpu.SMEM((max(1, len(convs)), 2 * bt, bd), F32),  # d_E: this tile's rows, then the next tile's
        dxs=plgpu.SMEM((n_slots, bt, bd), cfg.dx_dtype),
        dx1s=plgpu.SMEM((n_wg - 1, n_slots, bt, bd), F32) if n_wg > 1 else None,  # the other warpgroups' parts of d_x
        sums_s=plgpu.SMEM((_rows4(n_sums), bd), F32),
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
        taps_at, q_at = 0, _rows4(max(1, n_taps))
        w_at = q_at + _rows4(m)

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
                    masks = [None] + [_rows(((bits >> delta) & 1).astype(F32), bt, bd) for delta in range(1, max_lag)]

                loaded = {}  # this tile's values, loaded at their first use

                def once(key, load):
                    if key not in loaded:
                        loaded[key] = load()
                    return loaded[key]

                def rows_of(j):
                    return once(("rows", j), lambda: _rows(plgpu.load(rows_s, (slot, j), layout=row), bt, bd))

                def x_lag(delta):
                    return once(("x", delta), lambda: to_f32(lags.load(plgpu, xs, slot, delta)))

                def const(k):  # row ``k`` of ``consts`` (a tap, a query, a column of W), per ``cfg.constants``
                    if k in held:
                        return _cols(held[k], bt, bd)
                    return _cols(plgpu.load(consts, k, layout=col), bt, bd)

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
                            term = term * _rows(((nbits >> delta) & 1).astype(F32), bt, bd)
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
                jax.ShapeDtypeStruct((batch // rows_per_program, _rows4(n_sums), d), F32))
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
