"""Row shifts of a register tile, for the transposed causal conv of the backward kernels.

The transpose of the depthwise conv (Eq. 10) sends ``H_delta[u]`` to row ``u - delta``: inside a
``block_t`` tile, or, for its first ``delta`` rows, into the previous tile (the "spill" the
reverse-T loops carry). The tile is a value in registers, not a ref, so the shift cannot be a
load at an offset.

* ``"concat"`` (interpret mode, Mosaic TPU): a concatenate with zero tiles and a static slice.
* ``"dot"`` (Triton, which lowers neither value concatenates nor value slices): a product with
  a 0/1 shift matrix built from iotas, at HIGHEST precision, which lowers to an IEEE float32
  ``tl.dot``: exact, since each output row selects one input row. Measured alternative
  (BENCHMARKS.md, kernels, session 5): three bfloat16 tensor-core dots of an exact
  ``hi + mid + lo`` split were exact too but slower on the H200 (phase 2 + gate fwd+bwd 9.7
  against 6.8 ms, phase 1 161 against 154 ms), so the single float32 dot stays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


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
