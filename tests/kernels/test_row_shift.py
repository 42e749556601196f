"""The row shift of the backward kernels' transposed conv: the Triton form (a 0/1 matrix
product) must equal the concatenate form bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention.row_shift import shift_rows


def _tile(seed, bt=16, bd=32):
    """float32 values over 60 binades, both signs, with full 24-bit significands."""
    rng = np.random.default_rng(seed)
    mant = rng.uniform(1.0, 2.0, (bt, bd)) * rng.choice([-1.0, 1.0], (bt, bd))
    return jnp.asarray(mant * 2.0 ** rng.integers(-30, 30, (bt, bd)), jnp.float32)


@pytest.mark.parametrize("delta", [1, 3, 11, 15])
def test_dot_shift_equals_concat_bitwise(delta):
    g = _tile(delta)
    f = jax.jit(lambda g: (shift_rows(g, delta, 16, "dot"), shift_rows(g, delta, 16, "concat")))
    (within, spill), (want_within, want_spill) = f(g)
    np.testing.assert_array_equal(np.asarray(within), np.asarray(want_within))
    np.testing.assert_array_equal(np.asarray(spill), np.asarray(want_spill))
    # within + spill hold every row of g exactly once
    np.testing.assert_array_equal(np.asarray(want_within[: 16 - delta]), np.asarray(g[delta:]))
    np.testing.assert_array_equal(np.asarray(want_spill[16 - delta :]), np.asarray(g[:delta]))


def test_unknown_shift_is_an_error():
    with pytest.raises(ValueError, match="how='roll'"):
        shift_rows(jnp.zeros((16, 16)), 1, 16, "roll")
