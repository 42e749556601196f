"""Mosaic TPU tiling of the depth-read kernels, forward (``fused``) and backward
(``fused_bwd_phase1``, ``fused_bwd_phase2``, ``conv_transpose``), with ``backend="tpu"``: every
token-indexed array goes into VMEM one ``[block_t, block_d]`` tile at a time, never whole T; the
causal conv's halo (the transposed conv's look-ahead) is a ``halo``-row block of the previous
(next) tile of the same array (``halo_spec``, read through ``fused.TokenWindow``'s tiled form);
heads are zero-padded to whole 128-lane vregs (``pad_heads``); each kernel's tile is the largest
whose VMEM estimate fits half of the call's ``vmem_limit_bytes``, 3/4 of the chip's VMEM
(``choose``). docs/kernels.md §4, "Mosaic TPU tiling"."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference

F32 = jnp.float32
LANES = 128
# VMEM per TensorCore (pltpu.get_tpu_info): v4 16 MiB, v5e 128 MiB, v5p 64 MiB, v6e 128 MiB. A trace
# with no TPU (CPU interpret mode) assumes the smallest.
DEFAULT_VMEM_BYTES = 16 << 20
MAX_BLOCK_T = 512  # tokens per program: past 256 the per-step overhead (~0.35 us) is already amortised
MAX_BLOCK_D = 512  # channels per chunk


# --------------------------------------------------------------------------- chip and budget


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


def vmem_limit(capacity: int) -> int:
    """The ``vmem_limit_bytes`` every tiled call sets: 3/4 of the chip's VMEM (v5e 96 MiB, v5p 48
    MiB; Mosaic's default scoped limit, 16 MiB, is below `base` phase 1's 21.4 MB). A tile's
    estimate may take half of it; the rest is Mosaic's own scratch and the estimate's error."""
    return capacity * 3 // 4


def sublanes(itemsize: int) -> int:
    """Rows of one vreg tile for a dtype of ``itemsize`` bytes: 8 (32-bit), 16 (16-bit), 32 (8-bit)."""
    return 8 * max(1, 4 // itemsize)


def halo_rows(max_kernel: int, itemsize: int = 2) -> int:
    """Rows of the conv halo block: the largest lag ``max_kernel - 1`` rounded up to the sublane
    tile of the narrowest dtype (``itemsize`` bytes) read through it, 16 rows for MSAR's kernels
    (0, 4, 8, 12) in bf16 (Eq. 10); 0 without a conv (no halo block)."""
    unit = sublanes(itemsize)
    return 0 if max_kernel <= 1 else -(-(max_kernel - 1) // unit) * unit


def block_bytes(shape: tuple, itemsize: int) -> int:
    """VMEM bytes of one block: the last two dims padded to the (sublane, 128-lane) tile."""
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    count = 1
    for s in lead:
        count *= s
    unit = sublanes(itemsize)
    return count * (-(-rows // unit) * unit) * (-(-cols // LANES) * LANES) * itemsize


@dataclasses.dataclass(frozen=True)
class TpuTile:
    """One kernel's tile: ``block_t`` tokens (a power-of-two multiple of the sublane / halo unit),
    ``block_d`` channels (a multiple of 128 dividing the padded head width), the halo's rows, the
    estimated VMEM need and the ``vmem_limit_bytes`` the call sets."""

    block_t: int
    block_d: int
    halo: int
    vmem_need: int
    vmem_limit: int
    chip: str


def choose(need: Callable[[int, int], int], *, name: str, dhp: int, t_len: int, max_kernel: int, itemsize: int = 2,
           cap_t: int | None = None, cap_d: int | None = None, vmem: tuple[str, int] | None = None) -> TpuTile:
    """The largest ``block_t x block_d`` tile (ties: the wider chunk) whose ``need(bt, bd)`` fits
    half of ``vmem_limit``. ``block_t``: powers of two times ``max(halo, sublanes(itemsize))`` up to
    ``MAX_BLOCK_T``, T and ``cap_t``; ``block_d``: multiples of 128 dividing ``dhp`` up to
    ``MAX_BLOCK_D`` and ``cap_d``. ``cap_t`` / ``cap_d`` (``Tiles.tpu_block_t`` / ``tpu_block_d``) let
    tests span several tiles; ``vmem``: ``(chip, bytes)``, default the traced-for chip's.
    ``ValueError`` naming the kernel when no tile fits."""
    chip, capacity = vmem or tpu_vmem_bytes()
    limit = vmem_limit(capacity)
    budget = limit // 2
    halo = halo_rows(max_kernel, itemsize)
    unit = max(halo, sublanes(itemsize))
    top = min(MAX_BLOCK_T, unit * (1 << max(0, (-(-t_len // unit) - 1).bit_length())), *([cap_t] if cap_t else []))
    bts = [unit]
    while bts[-1] * 2 <= top:
        bts.append(bts[-1] * 2)
    bds = [bd for bd in range(LANES, min(dhp, MAX_BLOCK_D, cap_d or dhp) + 1, LANES) if dhp % bd == 0] or [LANES]
    best = None
    for bt in bts:
        for bd in bds:
            if need(bt, bd) <= budget and (best is None or (bt * bd, bd) > (best[0] * best[1], best[1])):
                best = (bt, bd)
    if best is None:
        raise ValueError(f"{name}: no TPU tile fits the VMEM budget of {budget / 2**20:.1f} MiB ({chip}, half the "
                         f"{limit / 2**20:.0f} MiB limit): {unit} x {LANES} needs {need(unit, LANES) / 2**20:.1f} MiB")
    return TpuTile(best[0], best[1], halo, need(*best), limit, chip)


def compiler_params(semantics: tuple[str, ...], tile: TpuTile):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=tile.vmem_limit)


# --------------------------------------------------------------------------- lanes


def padded_head_width(dh: int) -> int:
    """A head's channels rounded up to whole 128-lane vregs: d = 2080 and 2112 -> 2176, 1040 -> 1152,
    MHAR's 64 -> 128."""
    return -(-dh // LANES) * LANES


def pad_heads(a, heads: int, axis: int = -1):
    """``a[..., d, ...]`` with each head's ``d / heads`` channels zero-padded to
    ``padded_head_width``: exact for every dot, sum of squares, mixed stream and ``z @ W`` (the
    pads hold zeros); the means (the keys' RMS norm, the gate's) keep the real ``d``."""
    if a is None:
        return a
    axis = axis % a.ndim
    d = a.shape[axis]
    dh = d // heads
    dhp = padded_head_width(dh)
    if dhp == dh:
        return a
    split = a.reshape(*a.shape[:axis], heads, dh, *a.shape[axis + 1:])
    pad = [(0, 0)] * split.ndim
    pad[axis + 1] = (0, dhp - dh)
    return jnp.pad(split, pad).reshape(*a.shape[:axis], heads * dhp, *a.shape[axis + 1:])


def unpad_heads(a, heads: int, d: int, axis: int = -1):
    """The inverse of ``pad_heads``: the real ``d`` channels."""
    axis = axis % a.ndim
    dhp = a.shape[axis] // heads
    dh = d // heads
    if dhp == dh:
        return a
    split = a.reshape(*a.shape[:axis], heads, dhp, *a.shape[axis + 1:])
    split = jax.lax.slice_in_dim(split, 0, dh, axis=axis + 1)
    return split.reshape(*a.shape[:axis], d, *a.shape[axis + 1:])


# --------------------------------------------------------------------------- halo blocks


def halo_spec(block: tuple, index_map, axis: int, bt: int, halo: int, side: str = "prev", n_rows: int | None = None):
    """The BlockSpec of the ``halo`` rows just before (``side="prev"``) or just after
    (``side="next"``, needs ``n_rows``, the padded row count) a ``[bt]``-row token block:
    ``block`` and ``index_map`` are the token block's own, its token axis ``axis`` (counted in
    ``block``, ``None`` entries included). ``halo`` divides ``bt``, so the halo is whole blocks of
    the same array and Pallas pipelines its DMA like any input. The index is clamped into the
    array (tile 0's ``prev``, the last tile's ``next``); ``fused.TokenWindow`` masks those rows."""
    if bt % halo:
        raise ValueError(f"halo_spec: the halo of {halo} rows must divide the token block of {bt}")
    per = bt // halo
    last = None if n_rows is None else n_rows // halo - 1
    if side == "next" and last is None:
        raise ValueError("halo_spec(side='next') needs n_rows")

    def halo_map(*g):
        idx = list(index_map(*g))
        if side == "prev":
            idx[axis] = jnp.maximum(idx[axis] * per - 1, 0)
        else:
            idx[axis] = jnp.minimum((idx[axis] + 1) * per, last)
        return tuple(idx)

    shape = list(block)
    shape[axis] = halo
    return pl.BlockSpec(tuple(shape), halo_map)


def token_specs(spec, axis: int, bt: int, halo: int, *, prev: bool = True, next: bool = False,
                n_rows: int | None = None) -> list:
    """``spec`` (a token block) followed by its ``prev`` and / or ``next`` halo specs (none
    when ``halo`` is 0): the BlockSpecs of one token-tiled array read through a window."""
    out = [spec]
    if halo and prev:
        out.append(halo_spec(spec.block_shape, spec.index_map, axis, bt, halo))
    if halo and next:
        out.append(halo_spec(spec.block_shape, spec.index_map, axis, bt, halo, "next", n_rows))
    return out


def segment_masks(segment_ids, max_lag: int, *, ahead: bool = False):
    """``[B, Tp, max_lag]`` float32 from the padded segment ids ``[B, Tp]``: column ``delta`` is 1
    where token ``t - delta`` (``ahead``: ``t + delta``) shares ``t``'s segment, and, behind, exists.
    Built in XLA once per call and read per tile (``tile_masks``) with no halo: ``max_lag``
    lanes against the tile's ``block_d``."""
    if not ahead:
        return jnp.moveaxis(reference.segment_lag_masks(segment_ids, segment_ids.shape[1], max_lag,
                                                        segment_ids.shape[0]), 0, -1)
    t_pad = segment_ids.shape[1]
    padded = jnp.pad(segment_ids, ((0, 0), (0, max_lag - 1)), constant_values=-1)
    later = jnp.stack([padded[:, delta:delta + t_pad] for delta in range(max_lag)], axis=-1)
    return (later == segment_ids[..., None]).astype(F32)


def tile_masks(mask_ref, t0, bt: int, max_lag: int, *, ahead: bool = False):
    """``masks[delta]`` ``[bt, 1]`` float32 of one token tile: the columns of ``mask_ref`` (a
    ``[bt, max_lag]`` block of ``segment_masks``), or without segments token ``t - delta >= 0``
    (``ahead``: None, every later token counts)."""
    if mask_ref is not None:
        return [mask_ref[:, pl.ds(delta, 1)] for delta in range(max_lag)]
    if ahead:
        return None
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    return [(rows >= delta).astype(F32) for delta in range(max_lag)]
