"""Block-size heuristics of the fused depth-attention kernels (``fused.py``): ``block_t``, tokens per
program (the interpret halo comes from the previous tile, so ``block_t >= max_kernel - 1``
there), and ``block_d``, channels per chunk (it divides the head width, a power of two on Triton;
wide scoring chunks spill). The Mosaic TPU kernels' tiles come from a VMEM budget
(``tpu_blocks.choose``). The reasons and figures: docs/kernels.md §4, "Techniques the kernels
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
    # Caps on the token / channel block of the Mosaic TPU kernels, forward and backward
    # (``tpu_blocks.choose``); None: the VMEM budget, T and the head width decide. Small caps make
    # tests span several tiles and the conv halo cross their edges.
    tpu_block_t: int | None = None
    tpu_block_d: int | None = None

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
