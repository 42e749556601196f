"""A bf16 phase-1 state (``api.phase1(state_dtype="bfloat16")``).

Phase 1 stores the weighted sums ``acc`` in bf16, phase 2 and the backwards compute in float32
from them, and the state's cotangent comes back in bf16. Checked on a whole block read (phase 1,
then a gated phase 2 per target, per-target state, a conv bank, an invalid source, a ragged T),
random non-zero parameters, float32 inputs:

* the Pallas kernels (interpret mode, Pallas backward) against the XLA path with the same bf16
  state: the same roundings, so within 1e-4 (float32 sums in another order can move a value
  across a bf16 rounding boundary);
* a bf16 state against the float32 one: within the bf16 tolerance, 2e-2;
* the stored ``acc`` is the float32 one rounded once: the kernel's bf16 output equals its float32
  output cast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, tiling

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
KERNELS, N, B, T, D, S = (0, 4, 8), 3, 2, 19, 16, 3
TILES = tiling.Tiles(16, 8, 8, block_t_scores=8, block_t_transpose=8)
PALLAS = dict(implementation="pallas_gpu", interpret=True, backward="pallas", tiles=TILES)


def _inputs():
    rng = np.random.default_rng(5)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    m = len(KERNELS)
    gate = (normal(m * D, m) / np.sqrt(m * D), jnp.float32(0.7), 0.1 * normal(m))
    return (normal(N, B, T, D), 0.4 * normal(N, sum(KERNELS), D), normal(S, m, D), normal(B, T, D),
            0.4 * normal(sum(KERNELS), D), normal(S, m, D), gate)


VALID = jnp.asarray([True, False, True])


def _block_read(state_dtype, **kw):
    """Loss and gradients (every input) of one block: phase 1, then phase 2 + gate per target."""

    def loss(x, banks, queries, partial, bank, p2_queries, gate):
        states = api.phase1(x, banks, queries, VALID, stream_kernels=KERNELS, per_target=True,
                            state_dtype=state_dtype, **kw)
        total = 0.0
        for i, st in enumerate(states):
            assert st.acc.dtype == jnp.dtype(state_dtype)
            h = api.phase2_fused(st, partial, bank, p2_queries[i], i > 0, gate, stream_kernels=KERNELS, **kw)
            total = total + jnp.sum(h * jnp.sin(jnp.arange(D, dtype=jnp.float32)))
        return total

    fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7))), compiler_options=FAST)
    return jax.tree.leaves(fn(*_inputs()))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.fixture(scope="module")
def xla_bf16():
    return _block_read("bfloat16", implementation="xla")


def test_pallas_matches_xla_with_a_bf16_state(xla_bf16):
    got = _block_read("bfloat16", **PALLAS)
    assert len(got) == len(xla_bf16) == 10  # loss, six arrays, the gate's three
    for g, w in zip(got, xla_bf16):
        assert _rel(g, w) < 1e-4


def test_bf16_state_is_close_to_float32(xla_bf16):
    want = _block_read("float32", implementation="xla")
    errs = [_rel(g, w) for g, w in zip(xla_bf16, want)]
    assert max(errs) < 2e-2
    assert max(errs) > 0  # the rounding is really there: acc was stored in bf16


def test_kernel_stores_the_float32_sums_rounded_once():
    x, banks, queries = _inputs()[:3]
    kw = dict(stream_kernels=KERNELS, per_target=True, **PALLAS)
    f32 = api.phase1(x, banks, queries, VALID, state_dtype="float32", **kw)
    bf16 = api.phase1(x, banks, queries, VALID, state_dtype=jnp.bfloat16, **kw)
    for a, b in zip(f32, bf16):
        np.testing.assert_array_equal(np.asarray(b.acc), np.asarray(a.acc.astype(jnp.bfloat16)))
        np.testing.assert_array_equal(b.max, a.max)  # the statistics stay float32
        assert b.denom.dtype == jnp.float32


def test_rejects_other_state_dtypes():
    x, banks, queries = _inputs()[:3]
    with pytest.raises(ValueError, match="state_dtype='float16': must be one of"):
        api.phase1(x, banks, queries, stream_kernels=KERNELS, state_dtype="float16")


@pytest.mark.gpu
def test_gpu_bf16_state():
    """On a GPU, the compiled Triton kernels at a medium shape: the bf16 state is the float32
    one rounded once, and a block read's gradients stay within the bf16 tolerance of the
    float32 state's."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(3)
    kernels, n, b, t, d, s = (0, 4, 8, 12), 5, 2, 200, 256, 4
    m = len(kernels)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    x, banks, q = normal(n, b, t, d).astype(jnp.bfloat16), 0.3 * normal(n, sum(kernels), d), normal(s, m, d)
    partial, bank, q2 = normal(b, t, d).astype(jnp.bfloat16), 0.3 * normal(sum(kernels), d), normal(s, m, d)
    gate = (normal(m * d, m) / np.sqrt(m * d), jnp.float32(0.7), 0.1 * normal(m))
    valid = jnp.asarray([True, True, True, False, False])
    kw = dict(stream_kernels=kernels, implementation="pallas_gpu", backward="pallas")

    def read(state_dtype, x, banks, q, partial, bank, q2, gate):
        states = api.phase1(x, banks, q, valid, per_target=True, state_dtype=state_dtype, **kw)
        hs = [api.phase2_fused(st, partial, bank, q2[i], i > 0, gate, out_dtype=jnp.bfloat16, **kw)
              for i, st in enumerate(states)]
        return states, hs

    f32 = jax.jit(lambda *a: read("float32", *a)[0])(x, banks, q, partial, bank, q2, gate)
    bf16 = jax.jit(lambda *a: read("bfloat16", *a)[0])(x, banks, q, partial, bank, q2, gate)
    for a, c in zip(f32, bf16):
        np.testing.assert_array_equal(np.asarray(c.acc), np.asarray(a.acc.astype(jnp.bfloat16)))

    def loss(state_dtype, *args):
        return sum(jnp.sum(h.astype(jnp.float32) * jnp.cos(jnp.arange(d, dtype=jnp.float32)))
                   for h in read(state_dtype, *args)[1])

    grads = {sd: jax.jit(jax.grad(lambda *a, sd=sd: loss(sd, *a), argnums=tuple(range(7))))(
        x, banks, q, partial, bank, q2, gate) for sd in ("float32", "bfloat16")}
    for g, w in zip(jax.tree.leaves(grads["bfloat16"]), jax.tree.leaves(grads["float32"])):
        assert _rel(np.asarray(g, np.float32), np.asarray(w, np.float32)) < 2e-2
