"""Row shifts of a register tile, for the transposed causal conv of the backward kernels: the
transpose (Eq. 10) sends ``H_delta[u]`` to row ``u - delta``, inside a ``block_t`` tile or, for its
first ``delta`` rows, into the previous one (the spill the reverse-T loops carry). ``"concat"``
(interpret mode, Mosaic TPU): a concatenate with zero tiles and a static slice. ``"dot"`` (Triton,
which lowers neither value concatenates nor value slices; phase 1's reverse-T default there): an
exact float32 product with a 0/1 shift matrix. ``"buffer"`` (phase 2's Triton default,
``shift_rows_via_buffer``): the tiles through a per-program scratch with CTA barriers, read back
at row offsets. Figures: docs/kernels.md §4, "Techniques the kernels share", and §7."""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


SHIFTS = ("concat", "dot", "buffer")


def scratch_rows(bt: int) -> int:
    """Rows of one scratch slot of ``shift_rows_via_buffer``: the tile at ``[bt, 2 bt)`` and
    zeros around it, reads up to ``2 bt + bt - 1``, rounded to a power of two (a Triton block)."""
    return 4 * bt


def scratch_slots(max_kernel: int, slots: int) -> int:
    """Slots of the scratch: ``slots`` (a power of two), at most one per lag ``1..max_kernel-1``."""
    lags = max(1, max_kernel - 1)
    if slots < 1 or slots & (slots - 1):
        raise ValueError(f"scratch slots={slots}: must be a power of two >= 1")
    return min(slots, 1 << (lags - 1).bit_length())


def shift_rows_via_buffer(buf_ref, lagged: dict, bt: int, backend: str) -> dict:
    """``{delta: shift_rows(tap, delta, bt)}`` for every ``lagged[delta] = tap`` through memory.

    ``buf_ref``: this program's scratch ``[slots, scratch_rows(bt), bd]`` float32, zeroed once
    before the loop over tiles. Each round stores up to ``slots`` lag tiles at rows
    ``[bt, 2 bt)`` of their slots and reads back ``within = rows [bt + delta, 2 bt + delta)`` and
    ``spill = rows [delta, bt + delta)``; rows outside ``[bt, 2 bt)`` are never written, so they
    stay zero. On Triton the threads of a program trade rows through global memory (L1/L2): a
    CTA barrier before the stores (the previous round's reads are done) and one after (every
    row is written before any is read). Fewer slots, less scratch, more rounds (two barriers
    each)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    barrier = pltriton.debug_barrier if backend == "triton" else (lambda: None)
    slots = buf_ref.shape[0]
    deltas = list(lagged)
    out = {}
    for start in range(0, len(deltas), slots):
        group = deltas[start : start + slots]
        barrier()
        for slot, delta in enumerate(group):
            buf_ref[slot, pl.ds(bt, bt), :] = lagged[delta]
        barrier()
        for slot, delta in enumerate(group):
            out[delta] = (buf_ref[slot, pl.ds(bt + delta, bt), :], buf_ref[slot, pl.ds(delta, bt), :])
    return out


def shift_rows(g: jax.Array, delta: int, bt: int, how: str) -> tuple[jax.Array, jax.Array]:
    """``(within, spill)`` of a float32 ``[bt, bd]`` tile: ``within[i] = g[i + delta]`` (0 past
    the tile's end) and ``spill[i] = g[i + delta - bt]`` (the rows that land in the PREVIOUS
    tile; 0 where ``i + delta < bt``). ``how`` is ``"concat"`` or ``"dot"`` (module docstring)."""
    if how == "concat":
        zero = jnp.zeros_like(g)
        cat = jnp.concatenate([zero, g, zero], axis=0)
        return cat[bt + delta : 2 * bt + delta], cat[delta : bt + delta]
    if how != "dot":
        raise ValueError(f"row shift how={how!r}: must be 'concat' or 'dot'")
    row = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (bt, bt), 1)
    up = (col == row + delta).astype(F32)
    back = (col == row + delta - bt).astype(F32)
    hi = jax.lax.Precision.HIGHEST
    return (jnp.dot(up, g, precision=hi, preferred_element_type=F32),
            jnp.dot(back, g, precision=hi, preferred_element_type=F32))
