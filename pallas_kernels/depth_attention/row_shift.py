"""Row shifts of a register tile, for the transposed causal conv of the backward kernels.

The transpose of the depthwise conv (Eq. 10) sends ``H_delta[u]`` to row ``u - delta``: inside a
``block_t`` tile, or, for its first ``delta`` rows, into the previous tile (the "spill" the
reverse-T loops carry). The tile is a value in registers, not a ref, so the shift cannot be a
load at an offset.

* ``"concat"`` (interpret mode, Mosaic TPU): a concatenate with zero tiles and a static slice.
* ``"dot"`` (Triton, which lowers neither value concatenates nor value slices): a product with
  a 0/1 shift matrix built from iotas, at HIGHEST precision, which lowers to an IEEE float32
  ``tl.dot``: exact, since each output row selects one input row. Measured alternative:
  three bfloat16 tensor-core dots of an exact
  ``hi + mid + lo`` split were exact too but slower on the H200 (phase 2 + gate fwd+bwd 9.7
  against 6.8 ms, phase 1 161 against 154 ms), so the single float32 dot stays.
* ``"buffer"`` (Triton, the default of both reverse-T kernels there):
  ``shift_rows_via_buffer`` stores the lag tiles in a small per-program scratch in global
  memory and reads them back at row offsets, as the forward reads its halo, with CTA barriers
  around the stores. The 11 ``[16, 16] @ [16, 16]`` float32 dot pairs per tile were 1.8 of phase
  2's 3.0 ms input kernel at the bench shape on the H200; through the buffer it took 1.92 ms.
"""

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
