"""Block-size heuristics of the fused depth-attention kernels (``fused.py``): ``block_t``, tokens per
program (the TPU / interpret halo comes from the previous tile, so ``block_t >= max_kernel - 1``
there), and ``block_d``, channels per chunk (it divides the head width, a power of two on Triton;
wide scoring chunks spill). The reasons and figures: docs/kernels.md §4, "Techniques the kernels
share"."""

from __future__ import annotations

import dataclasses


MIX_MODES = ("acc", "mean", "gate", "stats")  # fused.mix_call's modes


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_t: int  # tokens per program (all kernels)
    block_d_scores: int  # channel chunk of the scoring loop
    block_d_mix: int  # channel chunk (grid axis) of the mixing kernel
    num_warps: int = 4  # Triton only
    num_stages: int = 1  # Triton only
    # channel chunk of the reverse-T backward kernels (``fused_bwd_phase1.grads_call``,
    # ``fused_bwd_phase2._dinput_call``); None: ``block_d_mix``. They keep ``max_kernel``
    # transposed-conv tiles and the lag-shifted source tiles live per stream.
    block_d_bwd: int | None = None
    # Triton's row shift through memory (``row_shift.shift_rows_via_buffer``): scratch slots per
    # program (a power of two); fewer slots, less scratch, more rounds of two CTA barriers.
    shift_slots: int = 16
    # Tokens per program of the scoring kernel (``fused.scores_call``) and of the expansion's
    # transpose (``conv_transpose``); None: ``block_t``. They must divide ``block_t``, the unit T
    # is padded to. The transpose carries one whole ``[block_t, block_d_bwd]`` bank-gradient tile
    # per tap (24 for kernels (4, 8, 12)), so it wants fewer rows than the mixing kernel.
    block_t_scores: int | None = None
    block_t_transpose: int | None = None
    # ``(mode, tokens, channels)``: the tile per program of ``fused.mix_call`` in ``mode`` (``"acc"``:
    # phase 1's mixing pass; ``"mean"``: phase 2's output without a gate); a mode not listed takes
    # ``(block_t, block_d_mix)``. Its own so that it can differ from the kernels sharing those.
    mix_tiles: tuple[tuple[str, int, int], ...] = ()
    # Cap on the token block of the Mosaic TPU forward kernels (``tpu_tile``); None: the VMEM
    # budget and T decide. Small caps make tests span several tiles.
    tpu_block_t: int | None = None

    def __post_init__(self):
        for name in ("block_t_scores", "block_t_transpose"):
            bt = getattr(self, name)
            if bt is not None and (bt <= 0 or self.block_t % bt):
                raise ValueError(f"Tiles.{name}={bt} must be a positive divisor of block_t={self.block_t}")
        for entry in self.mix_tiles:
            mode, bt, bd = entry
            if mode not in MIX_MODES or bt <= 0 or self.block_t % bt or bd <= 0:
                raise ValueError(f"Tiles.mix_tiles entry {entry}: want (mode, tokens, channels) with a mode of "
                                 f"{MIX_MODES}, tokens a positive divisor of block_t={self.block_t}, channels positive")
        if len({mode for mode, _, _ in self.mix_tiles}) != len(self.mix_tiles):
            raise ValueError(f"Tiles.mix_tiles={self.mix_tiles}: one entry per mode")

    @property
    def block_d_grads(self) -> int:
        return self.block_d_mix if self.block_d_bwd is None else self.block_d_bwd

    def mix_tile(self, mode: str) -> tuple[int, int]:
        """``(tokens, channels)`` per program of ``fused.mix_call`` in ``mode``."""
        for entry_mode, bt, bd in self.mix_tiles:
            if entry_mode == mode:
                return bt, bd
        return self.block_t, self.block_d_mix

    @property
    def bt_scores(self) -> int:
        return self.block_t if self.block_t_scores is None else self.block_t_scores

    @property
    def bt_transpose(self) -> int:
        return self.block_t if self.block_t_transpose is None else self.block_t_transpose

    def with_min_block_t(self, rows: int) -> "Tiles":
        """These tiles with every token tile at least ``rows`` (a power of two)."""
        up = lambda bt: bt if bt is None or bt >= rows else rows  # noqa: E731
        return dataclasses.replace(self, block_t=up(self.block_t), block_t_scores=up(self.block_t_scores),
                                   block_t_transpose=up(self.block_t_transpose))


def sublanes(itemsize: int) -> int:
    """Rows of one TPU vreg tile for a dtype of ``itemsize`` bytes: 8 (32-bit), 16 (16-bit),
    32 (8-bit). Token blocks of the Mosaic TPU kernels are multiples of it."""
    return 8 * max(1, 4 // itemsize)


def halo_rows(max_kernel: int, itemsize: int = 4) -> int:
    """Rows of the conv halo block of the tiled TPU kernels (``fused.halo_spec``): the largest
    lag ``max_kernel - 1`` (at least 1) rounded up to the sublane tile of the widest-packed dtype
    read through a halo (``itemsize`` bytes), e.g. 16 rows for kernels up to 12 (Eq. 10)."""
    unit = sublanes(itemsize)
    return -(-max(max_kernel - 1, 1) // unit) * unit


def _next_pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


def _pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides ``n`` and is at most ``cap``."""
    p = 1
    while p * 2 <= cap and n % (p * 2) == 0:
        p *= 2
    return p


def choose_tiles(*, d: int, heads: int, max_kernel: int, n_targets: int, backend: str, n_streams: int = 0) -> Tiles:
    """Tile sizes for one call. ``backend`` is ``"triton"`` or ``"tpu"`` (also interpret);
    ``n_streams`` the number of streams (0: unknown)."""
    if d % heads:
        raise ValueError(f"d={d} is not divisible by heads={heads}")
    dh = d // heads
    halo = max(max_kernel - 1, 1)
    if backend == "triton" and n_streams == 1 and max_kernel <= 1:
        # A single identity stream (AttnRes, MHAR) takes its own tiles. With them the AttnRes read
        # took 0.308 ms per sublayer forward on the H200 (phase 1 1.566, phase 2 0.112 ms),
        # against 0.365 (1.702 / 0.152) with the MSAR-tuned tiles below. Phase 1's mixing pass (S > 1 targets) takes 8 x 128 tiles: of 17 tilings
        # timed alone it was the fastest, 0.945 against 1.038 ms with 16 x 64 at `base`, 0.730
        # against 0.777 at the bench shape. Phase 2's output pass
        # without a gate takes 16 x 128: its forward 0.197 against 0.216 ms at `base`, 0.116
        # against 0.118 at the bench shape.
        wide = _pow2_divisor(dh, 128)
        mix = (("acc", 8, wide),) if n_targets > 1 else (("mean", 16, wide),)
        return Tiles(16, _pow2_divisor(dh, 128), _pow2_divisor(dh, 64), num_warps=4, num_stages=1, mix_tiles=mix)
    if backend == "triton":
        # Best of 6 tilings timed on the H200 at the bench shape:
        # phase 1 (S = 8 targets) 16 x 64 scoring chunks, 16 x 128 mixing chunks, 8 warps;
        # phase 2 (one target) 16 x 32 chunks, 4 warps, 2 stages.
        # Phase 1's reverse-T backward chunk: 64 channels (H200, fwd + Pallas bwd per
        # block: 32 / 64 / 128 -> 237 / 144 / 161 ms, timed with a bf16x3 row shift, since
        # taken out; with the float32 one 128 took 154 ms, 64 untimed).
        # Phase 2's reverse-T input kernel (the backward): 16 channels. It carries its token
        # sums as whole tiles (44 for kernels (0, 4, 8, 12) with the gate), so narrower chunks
        # hold fewer registers per thread (H200, bench shape, that kernel alone:
        # 16 x 16 / 4 warps 3.00 ms, 16 x 32 / 4 warps 3.85, 16 x 32 / 8 warps 3.07).
        # Phase 1: 32-row tiles with 64-channel chunks for the mixing kernel and
        # the wide backward's <g_A, E> and stream-cotangent kernels, which write or read each
        # target's state as its own array (``per_target``): at 128 channels those ran up to 71%
        # slower per target than stacked, at 32 x 64 as fast and faster than 16 x 128 stacked
        # (H200, `base` shape). The scoring kernel and the expansion's transpose
        # keep 16 rows: at 32 the transpose's 24 carried bank-gradient tiles spill (31.0 against
        # 5.8 ms per call at `base`) and scoring went 0.94 -> 1.03 ms.
        if n_targets > 1:
            return Tiles(32, _pow2_divisor(dh, 64), _pow2_divisor(dh, 64), num_warps=8, num_stages=1,
                         block_d_bwd=_pow2_divisor(dh, 64), block_t_scores=16, block_t_transpose=16)
        return Tiles(16, _pow2_divisor(dh, 32), _pow2_divisor(dh, 32), num_warps=4, num_stages=2,
                     block_d_bwd=_pow2_divisor(dh, 16))
    block_t = max(8, _next_pow2(halo))
    return Tiles(
        block_t=block_t,
        block_d_scores=_pow2_divisor(dh, 512),
        block_d_mix=_pow2_divisor(dh, 512),
    )


# --------------------------------------------------------------------------- Mosaic TPU tiles
#
# The TPU forward kernels (``fused.scores_call`` / ``mix_call`` with ``backend="tpu"``) map
# ``[block_t, ...]`` token blocks plus a ``halo_rows`` block before them (``fused.halo_spec``),
# never whole T. Their tiles are chosen here from a VMEM budget of the target chip, and the call's
# ``vmem_limit_bytes`` is set from the same estimate. docs/kernels.md §4, "Mosaic TPU tiling".

LANES = 128
# VMEM per TensorCore by generation, as jax._src.tpu_info lists it (pltpu.get_tpu_info): v4 16 MiB,
# v5e 128 MiB, v5p 64 MiB, v6e 128 MiB.
DEFAULT_VMEM_BYTES = 16 << 20  # unknown chip (CPU interpret, no TPU in the mesh): the smallest of those
MAX_BLOCK_T = 256  # tokens per program: past this the per-step overhead (~0.35 us) is already amortised
MAX_BLOCK_D = 512  # channels per chunk


def tpu_vmem_bytes() -> tuple[str, int]:
    """``(chip, VMEM bytes per core)`` of the TPU being traced for: the abstract mesh's device kind
    (ahead-of-time compiles under ``jax.sharding.use_abstract_mesh``) or the default device's;
    ``("unknown", DEFAULT_VMEM_BYTES)`` off TPU."""
    try:
        from jax.experimental.pallas import tpu as pltpu

        info = pltpu.get_tpu_info()
        return str(info.chip_version.value), int(info.vmem_capacity_bytes)
    except Exception:  # noqa: BLE001 - no TPU in this trace: CPU interpret mode, tests
        return "unknown", DEFAULT_VMEM_BYTES


def vmem_budget(capacity: int) -> int:
    """Bytes the tiles of one TPU kernel may take: 40% of VMEM (double-buffered blocks plus the
    kernel's live values), leaving room for Mosaic's own scratch and the limit's margin."""
    return int(capacity * 0.4)


def padded_head_width(d: int, heads: int) -> int:
    """Channels per head in the TPU kernels: the head width rounded up to 128 lanes (the op
    wrappers pad each head with zero channels, which add nothing to a dot, a sum of squares or a
    mixed stream, and slice the outputs back). ``d = 2080`` -> 2176; MHAR's 64 -> 128."""
    dh = d // heads
    return -(-dh // LANES) * LANES


def _block_bytes(shape: tuple, itemsize: int) -> int:
    """VMEM bytes of one block: the last two dims padded to the (sublane, lane) tile."""
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    count = 1
    for s in lead:
        count *= s
    unit = sublanes(itemsize)
    return count * (-(-rows // unit) * unit) * (-(-cols // LANES) * LANES) * itemsize


@dataclasses.dataclass(frozen=True)
class TpuTile:
    """One TPU forward kernel's tile: ``block_t`` tokens (a power-of-two multiple of ``halo``),
    ``block_d`` channels (a multiple of 128 dividing the padded head width), the conv halo's
    rows, the estimated VMEM need and the ``vmem_limit_bytes`` the call sets."""

    block_t: int
    block_d: int
    halo: int
    vmem_need: int
    vmem_limit: int
    chip: str


def _choose(need, *, halo: int, t_len: int, dh_pad: int, cap_t, capacity: int, chip: str, kernel: str) -> TpuTile:
    """Largest ``block_t * block_d`` tile (larger ``block_d`` first) whose ``need(bt, bd)`` fits
    the budget, else ``halo x 128`` if it fits 75% of VMEM; ``ValueError`` naming the kernel when
    not even that does."""
    budget = vmem_budget(capacity)
    top = halo * _next_pow2(-(-t_len // halo))
    top = min(top, max(MAX_BLOCK_T, halo), *([max(cap_t, halo)] if cap_t else []))
    bts = [halo]
    while bts[-1] * 2 <= top:
        bts.append(bts[-1] * 2)
    bds = [bd for bd in range(LANES, min(dh_pad, MAX_BLOCK_D) + 1, LANES) if dh_pad % bd == 0]
    best = None
    for bt in bts:
        for bd in bds:
            if need(bt, bd) <= budget and (best is None or (bt * bd, bd) > (best[0] * best[1], best[1])):
                best = (bt, bd)
    if best is None and need(halo, LANES) <= int(capacity * 0.75):
        best = (halo, LANES)  # the smallest tile over the budget: still well inside the chip (v4's 16 MiB)
    if best is None:
        raise ValueError(f"{kernel}: no TPU tile fits the VMEM budget of {budget >> 20} MiB ({chip}): "
                         f"{halo} x 128 needs {need(halo, LANES) >> 20} MiB")
    got = need(*best)
    limit = min(int(got * 1.5) + (4 << 20), int(capacity * 0.9))
    return TpuTile(best[0], best[1], halo, got, max(limit, min(16 << 20, int(capacity * 0.9))), chip)


def tpu_scores_tile(*, t_len: int, d_pad: int, dh_pad: int, heads: int, n_targets: int, n_streams: int,
                    max_kernel: int, n_taps: int, x_itemsize: int, cap_t: int | None = None, vmem=None) -> TpuTile:
    """The scoring kernel's tile (``fused.scores_call``, one source per program): its
    ``[block_t, d]`` source block and halo, the bank and queries, the dots (``[S, m, block_t,
    H]``, H padded to 128 lanes) and sums of squares, all double-buffered, plus the window's live
    ``[block_t, block_d]`` shifts (one per lag)."""
    chip, capacity = vmem or tpu_vmem_bytes()
    halo = halo_rows(max_kernel, x_itemsize)

    def need(bt, bd):
        blocks = (_block_bytes((bt, d_pad), x_itemsize) + _block_bytes((halo, d_pad), x_itemsize)
                  + _block_bytes((max(n_taps, 1), d_pad), 4) + _block_bytes((n_targets * n_streams, d_pad), 4)
                  + 2 * _block_bytes((bt, 1), 4)  # segment ids and their halo (bound)
                  + _block_bytes((n_targets * n_streams * bt, heads), 4) + _block_bytes((n_streams * bt, 1), 4))
        live = (max_kernel + 3) * _block_bytes((bt + halo, bd), 4)
        return 2 * blocks + live

    return _choose(need, halo=halo, t_len=t_len, dh_pad=dh_pad, cap_t=cap_t, capacity=capacity, chip=chip,
                   kernel="scores")


def tpu_mix_tile(mode: str, *, t_len: int, d_pad: int, dh_pad: int, heads: int, n_sources: int, n_targets: int,
                 n_streams: int, max_kernel: int, n_taps: int, x_itemsize: int, out_itemsize: int,
                 base_itemsize: int | None = None, cap_t: int | None = None, vmem=None) -> TpuTile:
    """The mixing kernel's tile (``fused.mix_call`` in ``mode``): all ``n`` sources' ``[block_t,
    block_d]`` blocks and halos, the weights ``p`` (``[S, n, m, block_t, H]``, H padded to 128
    lanes: the largest block at phase 1's sizes), phase 2's base state and its weight, the gate
    or its ``W`` chunk, the outputs, all double-buffered, plus ``S`` float32 accumulators and the
    window's shifts."""
    chip, capacity = vmem or tpu_vmem_bytes()
    item = min(x_itemsize, out_itemsize, base_itemsize or 4)
    halo = halo_rows(max_kernel, item)
    s, n, m = n_targets, n_sources, n_streams

    def need(bt, bd):
        blocks = (_block_bytes((n * bt, bd), x_itemsize) + _block_bytes((n * halo, bd), x_itemsize)
                  + _block_bytes((n * max(n_taps, 1), bd), 4) + _block_bytes((s * n * m * bt, heads), 4)
                  + 2 * _block_bytes((bt, 1), 4))
        if base_itemsize is not None:
            blocks += _block_bytes((s * m * bt, bd), base_itemsize) + _block_bytes((s * m * bt, heads), 4)
        if mode == "gate":
            blocks += _block_bytes((bt, m), 4)
        if mode == "stats":
            blocks += _block_bytes((m * m, bd), 4) + _block_bytes((bt, 1), 4) + _block_bytes((bt, m), 4)
        elif mode == "acc":
            blocks += _block_bytes((s * m * bt, bd), out_itemsize)
        else:
            blocks += _block_bytes((bt, bd), out_itemsize)
        live = (s + max_kernel + 4) * _block_bytes((bt + halo, bd), 4)
        return 2 * blocks + live

    return _choose(need, halo=halo, t_len=t_len, dh_pad=dh_pad, cap_t=cap_t, capacity=capacity, chip=chip,
                   kernel=f"mix ({mode})")
