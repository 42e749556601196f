"""Row shifts of a register tile, for the transposed causal conv of the backward kernels.

The transpose of the depthwise conv (Eq. 10) sends ``H_delta[u]`` to row ``u - delta``: inside a
``block_t`` tile, or, for its first ``delta`` rows, into the previous tile (the "spill" the
reverse-T loops carry). The tile is a value in registers, not a ref, so the shift cannot be a
load at an offset.

* ``"concat"`` (interpret mode, Mosaic TPU): a concatenate with zero tiles and a static slice.
* ``"dot"`` (Triton, which lowers neither value concatenates nor value slices): a product with
  a 0/1 shift matrix built from iotas. Session 4 did it as one IEEE float32 ``tl.dot``: exact,
  but Triton runs that on the CUDA cores, ``2 block_t`` FMAs per element and lag, and the
  phase-2 reverse-T kernel spent ~8.8 ms per call at the ``base`` shape (BENCHMARKS.md,
  session 5). Here the float32 tile is split into three bfloat16 parts, ``g = hi + mid + lo``
  exactly (each part takes the next 8 significant bits of the 24; the rounding residuals are
  exact in float32), and each part goes through a bfloat16 tensor-core dot with float32
  accumulation. A 0/1 row with one 1 selects one product ``1 * part``, exact in float32, so
  each dot returns its part shifted exactly and ``(hi + mid) + lo`` rebuilds ``g`` bit for bit
  (the sum of an 8- and a 16-bit significand fits in 24 bits). Exactness fails only where a
  part underflows bfloat16's normal range (``|g|`` below about ``1e-33``) or ``g`` is not
  finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
BF16 = jnp.bfloat16


def split_bf16x3(g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(hi, mid, lo)`` in bfloat16 with ``hi + mid + lo == g`` exactly (float32 ``g``)."""
    hi = g.astype(BF16)
    rest = g - hi.astype(F32)
    mid = rest.astype(BF16)
    lo = (rest - mid.astype(F32)).astype(BF16)
    return hi, mid, lo


def _select_rows(a: jax.Array, parts) -> jax.Array:
    """``a @ g`` for a 0/1 ``a`` with at most one 1 per row, exact, from ``g``'s three parts."""
    hi, mid, lo = (jnp.dot(a, p, preferred_element_type=F32) for p in parts)
    return (hi + mid) + lo


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
    up = (col == row + delta).astype(BF16)
    back = (col == row + delta - bt).astype(BF16)
    parts = split_bf16x3(g)
    return _select_rows(up, parts), _select_rows(back, parts)
