"""Phase 1 skips invalid sources instead of computing and masking them.

The model runs phase 1 on its whole source buffer with only the completed blocks valid (half of
the buffer's slots over a step), so computing the others doubled phase 1's work. An invalid
source filled with NaN shows the skip: a computed-and-masked source would turn every output and
gradient into NaN (``0 * NaN``); a skipped one is never read. Checked for the XLA path
(``xla_streaming``: forward fold and closed-form backward under ``lax.cond``) and the Pallas
kernels in interpret mode with each backward (Triton and Mosaic TPU skip the same way, the TPU
reading the mask from scalar memory: ``benchmarks/tpu_kernels_aot.py`` compiles that path).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, reference, tiling

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
KERNELS, N, B, T, D, S = (0, 4, 8), 3, 2, 19, 16, 2


def _inputs():
    rng = np.random.default_rng(7)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    sources = normal(N, B, T, D)
    banks = 0.4 * normal(N, sum(KERNELS), D)
    queries = normal(S, len(KERNELS), D)
    ct_acc, ct_denom = normal(S, len(KERNELS), B, T, D), normal(S, len(KERNELS), B, T, 1)
    return sources, banks, queries, ct_acc, ct_denom


def _loss_and_grads(sources, banks, queries, ct_acc, ct_denom, **kw):
    valid = jnp.asarray([True, False, True])

    def loss(x, bk, q):
        state = api.phase1(x, bk, q, valid, stream_kernels=KERNELS, **kw)
        return jnp.sum(state.acc * ct_acc) + jnp.sum(state.denom * ct_denom)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=FAST)(sources, banks, queries)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(implementation="xla"), id="xla"),
    # the forward kernels skip in every kernel case; the XLA backward's skip is the XLA path's
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="xla", tiles=tiling.Tiles(8, 8, 8)),
                 id="kernels_xla_bwd", marks=pytest.mark.slow),
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="pallas", tiles=tiling.Tiles(8, 8, 8)),
                 id="kernels_pallas_bwd"),
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="pallas", tiles=tiling.Tiles(8, 8, 8),
                      phase1_backward_form="reverse_t"), id="kernels_pallas_reverse_t_bwd", marks=pytest.mark.slow),
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="hybrid", tiles=tiling.Tiles(8, 8, 8)),
                 id="kernels_hybrid_bwd"),
])
def test_invalid_source_is_never_read(kw):
    sources, banks, queries, ct_acc, ct_denom = _inputs()
    want_loss, want = _loss_and_grads(sources, banks, queries, ct_acc, ct_denom, implementation="xla")
    poisoned = sources.at[1].set(jnp.nan)
    got_loss, got = _loss_and_grads(poisoned, banks.at[1].set(jnp.nan), queries, ct_acc, ct_denom, **kw)
    assert np.isfinite(got_loss)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for name, g, w in zip(("sources", "banks", "queries"), got, want):
        assert np.all(np.isfinite(g)), name
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(w))), err_msg=name)
    assert not np.any(np.asarray(got[0][1])) and not np.any(np.asarray(got[1][1]))


def test_reference_masks_but_reads():
    """The direct definition computes every source and masks its weight: the NaN source reaches
    its output. (The test above would pass vacuously if nothing ever read invalid sources.)"""
    sources, banks, queries, *_ = _inputs()
    state = jax.jit(functools.partial(reference.phase1, stream_kernels=KERNELS))(
        sources.at[1].set(jnp.nan), banks, queries, jnp.asarray([True, False, True]))
    assert not np.all(np.isfinite(state.acc))
