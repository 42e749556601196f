"""Token-tiled blocks of the Mosaic TPU backward kernels (``fused_bwd_phase1``, ``fused_bwd_phase2``,
``conv_transpose`` with ``backend="tpu"``): every array is mapped into VMEM one ``[block_t,
block_d]`` tile at a time, the causal conv's halo (and the transposed conv's look-ahead) comes
from a ``halo``-row block of the previous (next) tile of the same array, channels are padded per
head to a multiple of 128 lanes, and the tiles are the largest whose double-buffered blocks and
live temporaries fit a VMEM budget per TPU generation, which each call also sets as its
``vmem_limit_bytes``. docs/kernels.md §4, "Mosaic TPU backward tiles"."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import reference, tiling

F32 = jnp.float32
LANES = 128
# Rows of a halo block: a whole bf16 sublane tile (16 rows; float32 tiles are 8), at least the
# conv's reach ``max_kernel - 1`` (11 for MSAR's kernels (0, 4, 8, 12)).
HALO_ALIGN = 16
BLOCK_T_CHOICES = (512, 256, 128, 64, 32, 16)
BLOCK_D_CHOICES = (512, 384, 256, 128)

# VMEM per TensorCore by ``device_kind`` prefix, as ``pltpu.get_tpu_info`` lists it (and
# ``tiling.tpu_vmem_bytes`` reads it): v4 16 MiB, v5e and v6e 128 MiB, v5p 64 MiB. A call asks for
# 3/4 of it (Mosaic's default scoped limit is 16 MiB, which `base`'s phase 1 already exceeded) and
# its tiles take half of that, the rest left to Mosaic's own temporaries. Off a TPU the generation
# is unknown: 48 MiB fits v5e, v5p and v6e.
VMEM_BYTES = {"TPU v4": 16 << 20, "TPU v5 lite": 128 << 20, "TPU v5e": 128 << 20, "TPU v5p": 64 << 20,
              "TPU v5": 64 << 20, "TPU v6": 128 << 20}
UNKNOWN_LIMIT = 48 << 20


@dataclasses.dataclass(frozen=True)
class _Limits:
    block_t: int | None = None
    block_d: int | None = None
    vmem_limit: int | None = None


_limits = _Limits()


@contextlib.contextmanager
def limits(*, block_t: int | None = None, block_d: int | None = None, vmem_limit: int | None = None) -> Iterator[None]:
    """Cap the TPU backward's tiles (``block_t`` rows, ``block_d`` lanes) or set the VMEM limit
    while tracing inside this block: the tests make T span several tiles and the halo cross
    their edges; an ahead-of-time compile names the chip's limit (``vmem_limit_for``)."""
    global _limits
    old, _limits = _limits, _Limits(block_t, block_d, vmem_limit)
    try:
        yield
    finally:
        _limits = old


def vmem_limit_for(device_kind: str | None) -> int:
    """The ``vmem_limit_bytes`` a call asks for on ``device_kind`` (None: ``UNKNOWN_LIMIT``)."""
    for prefix in sorted(VMEM_BYTES, key=len, reverse=True):
        if device_kind and device_kind.startswith(prefix):
            return VMEM_BYTES[prefix] * 3 // 4
    return UNKNOWN_LIMIT


def vmem_limit() -> int:
    """This trace's VMEM limit: ``limits(vmem_limit=)``, else 3/4 of the traced-for TPU's VMEM
    (``tiling.tpu_vmem_bytes``: the abstract mesh's chip or the local one), else ``UNKNOWN_LIMIT``."""
    if _limits.vmem_limit:
        return _limits.vmem_limit
    chip, capacity = tiling.tpu_vmem_bytes()
    return UNKNOWN_LIMIT if chip == "unknown" else capacity * 3 // 4


def compiler_params(semantics: tuple[str, ...]):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit())


# --------------------------------------------------------------------------- lanes


def padded_head_width(dh: int) -> int:
    """A head's channels rounded up to whole 128-lane vregs."""
    return -(-dh // LANES) * LANES


def pad_heads(a, heads: int, axis: int = -1):
    """``a[..., d, ...]`` with each head's ``d / heads`` channels zero-padded to
    ``padded_head_width``: exact for every sum over channels (the pads hold zeros), and the means
    keep the real ``d``."""
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


# --------------------------------------------------------------------------- tiles


def halo_rows(max_kernel: int) -> int:
    """Rows of the halo block (0: no conv, no halo)."""
    reach = max_kernel - 1
    return 0 if reach <= 0 else -(-reach // HALO_ALIGN) * HALO_ALIGN


def lane_padded(shape) -> int:
    """Elements of a VMEM block of ``shape``: the last dim padded to 128 lanes, the one before to 8
    sublanes (float32 tiles; a bf16 block is counted at float32 size, an upper bound)."""
    *lead, rows, cols = (1, *shape) if len(shape) == 1 else shape
    n = 1
    for s in lead:
        n *= s
    return n * (-(-rows // 8) * 8) * (-(-cols // LANES) * LANES)


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """One TPU backward kernel's tile: ``block_t`` tokens, ``block_d`` channels, ``halo`` rows."""

    block_t: int
    block_d: int
    halo: int
    vmem_bytes: int  # the budget estimate of the chosen tile (double-buffered blocks + temporaries)


def choose(bytes_of: Callable[[int, int], int], *, dhp: int, t_len: int, max_kernel: int,
           name: str = "kernel") -> TpuTiles:
    """The largest ``block_t x block_d`` tile (``block_t`` from ``BLOCK_T_CHOICES``, ``block_d`` a
    multiple of 128 dividing the padded head width ``dhp``) whose ``bytes_of(block_t, block_d)``
    fits half the VMEM limit; ties go to the wider chunk (fewer programs re-expanding the halo)."""
    halo = halo_rows(max_kernel)
    budget = vmem_limit() // 2
    cap_t = min(_limits.block_t or BLOCK_T_CHOICES[0], max(HALO_ALIGN, 1 << max(0, (t_len - 1).bit_length())))
    cap_d = _limits.block_d or BLOCK_D_CHOICES[0]
    best = None
    for bt in BLOCK_T_CHOICES:
        if bt > cap_t or bt < max(halo, HALO_ALIGN):
            continue
        for bd in BLOCK_D_CHOICES:
            if bd > cap_d or dhp % bd:
                continue
            need = bytes_of(bt, bd)
            if need <= budget and (best is None or bt * bd > best.block_t * best.block_d):
                best = TpuTiles(bt, bd, halo, need)
    if best is None:
        raise ValueError(f"{name}: no {min(BLOCK_T_CHOICES)} x 128 tile fits the VMEM budget of {budget} bytes "
                         f"(head width {dhp}); raise the limit (tpu_blocks.limits(vmem_limit=...))")
    return best


# --------------------------------------------------------------------------- halo blocks


def behind_index(t, bt: int, halo: int):
    """Block index (in ``halo``-row blocks) of the ``halo`` rows before token tile ``t`` (tile 0:
    its own first rows, masked out by ``HaloWindow``)."""
    return jnp.maximum(t * (bt // halo) - 1, 0)


def ahead_index(t, bt: int, halo: int, n_rows: int):
    """Block index of the ``halo`` rows after token tile ``t`` (the last tile: its own last rows,
    masked out)."""
    return jnp.minimum((t + 1) * (bt // halo), n_rows // halo - 1)


class HaloWindow:
    """Lag-shifted ``[bt, w]`` float32 views of one token tile: ``shift(delta)`` rows ``t0 - delta
    ...`` (the ``behind`` block's last rows for the first ``delta``; ``fill`` before row 0),
    ``ahead(delta)`` rows ``t0 + delta ...`` (the ``ahead`` block's first rows; ``fill`` past
    the padded end). ``cur``, ``behind``, ``ahead``: loaders of ``[bt, w]`` / ``[halo, w]``
    values; ``first`` / ``last``: whether this is the first / last tile (traced)."""

    def __init__(self, cur, behind=None, ahead=None, *, first=None, last=None, fill=0.0, dtype=F32):
        self._cur_load, self._behind_load, self._ahead_load = cur, behind, ahead
        self.first, self.last, self.fill, self.dtype = first, last, fill, dtype
        self._cache = {}

    def _get(self, key, make):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _cur(self):
        return self._get("cur", lambda: self._cur_load().astype(self.dtype))

    def shift(self, delta: int):
        if delta == 0:
            return self._cur()

        def cat():
            behind = self._behind_load().astype(self.dtype)
            behind = jnp.where(self.first, jnp.asarray(self.fill, self.dtype), behind)
            return jnp.concatenate([behind, self._cur()], axis=0)

        rows = self._cur().shape[0]
        both = self._get("behind", cat)
        halo = both.shape[0] - rows
        return self._get(("shift", delta), lambda: both[halo - delta: halo - delta + rows])

    def ahead(self, delta: int):
        if delta == 0:
            return self._cur()

        def cat():
            ahead = self._ahead_load().astype(self.dtype)
            ahead = jnp.where(self.last, jnp.asarray(self.fill, self.dtype), ahead)
            return jnp.concatenate([self._cur(), ahead], axis=0)

        rows = self._cur().shape[0]
        both = self._get("ahead", cat)
        return self._get(("ahead", delta), lambda: both[delta: delta + rows])


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


def token_specs(block: tuple, index: Callable, *, token_axis: int, bt: int, halo: int, n_rows: int,
                tile: Callable, behind: bool = True, ahead: bool = False) -> list:
    """BlockSpecs of one token-tiled array: its tile, then (with ``halo``) the ``halo`` rows
    behind and / or ahead of it. ``block``: the tile's block shape (``bt`` at ``token_axis``);
    ``index(*grid ids, tile=block index along tokens)`` the block indices; ``tile(*grid ids)``
    the token tile a program works on."""
    specs = [pl.BlockSpec(block, lambda *g: index(*g, tile=tile(*g)))]
    if not halo:
        return specs
    hblock = tuple(halo if k == token_axis else s for k, s in enumerate(block))
    if behind:
        specs.append(pl.BlockSpec(hblock, lambda *g: index(*g, tile=behind_index(tile(*g), bt, halo))))
    if ahead:
        specs.append(pl.BlockSpec(hblock, lambda *g: index(*g, tile=ahead_index(tile(*g), bt, halo, n_rows))))
    return specs
