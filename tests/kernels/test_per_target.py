"""Phase 1 with one state per target (``api.phase1(per_target=True)``).

The model reads each target's state on its own, so the kernels write the ``S`` states as
separate arrays and take their cotangents as separate inputs: nothing slices a stacked
``[S, m, B, T, d]`` state for the phase-2 reads or stacks their cotangents back. The values and
gradients must be those of the stacked op, split (``reference.split_targets``), on random
non-zero inputs with a conv bank, an invalid source and a ragged T; interpret mode, float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, reference, tiling

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
KERNELS, N, B, T, D, S = (0, 4, 8), 3, 2, 19, 16, 3


def _inputs():
    rng = np.random.default_rng(11)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    m = len(KERNELS)
    return (normal(N, B, T, D), 0.4 * normal(N, sum(KERNELS), D), normal(S, m, D),
            normal(S, m, B, T, D), normal(S, m, B, T, 1))


def _loss_and_grads(per_target, **kw):
    sources, banks, queries, ct_acc, ct_denom = _inputs()
    valid = jnp.asarray([True, False, True])

    def loss(x, bk, q):
        out = api.phase1(x, bk, q, valid, stream_kernels=KERNELS, per_target=per_target, **kw)
        states = out if per_target else reference.split_targets(out)
        assert len(states) == S and all(st.acc.shape == (len(KERNELS), B, T, D) for st in states)
        return sum(jnp.sum(st.acc * ct_acc[i]) + jnp.sum(st.denom * ct_denom[i]) for i, st in enumerate(states))

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), compiler_options=FAST)
    return fn(sources, banks, queries)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(implementation="xla"), id="xla"),
    # The wide form: its kernels take the S cotangents apart. With Triton's phase-1 tiles of
    # choose_tiles in kind: the scoring kernel and the expansion's transpose on fewer rows
    # than the mixing and backward kernels (T = 19 padded to 32 for 16-row tiles).
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="pallas",
                      tiles=tiling.Tiles(16, 8, 8, block_t_scores=8, block_t_transpose=8)), id="triton_pallas_bwd"),
    pytest.param(dict(implementation="pallas_tpu", interpret=True, backward="pallas", tiles=tiling.Tiles(8, 8, 8)),
                 id="mosaic_pallas_bwd", marks=pytest.mark.slow),
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="pallas", tiles=tiling.Tiles(8, 8, 8),
                      phase1_backward_form="reverse_t"), id="triton_reverse_t_bwd", marks=pytest.mark.slow),
    pytest.param(dict(implementation="pallas_gpu", interpret=True, backward="hybrid", tiles=tiling.Tiles(8, 8, 8)),
                 id="triton_hybrid_bwd", marks=pytest.mark.slow),  # stacks them for the closed form
])
def test_per_target_equals_the_stacked_state_split(kw):
    want_loss, want = _loss_and_grads(False, implementation="xla")
    got_loss, got = _loss_and_grads(True, **kw)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))


def test_tiles_per_kernel_rows():
    tiles = tiling.Tiles(32, 8, 8, block_t_scores=16)
    assert (tiles.bt_scores, tiles.bt_transpose) == (16, 32)
    assert tiles.with_min_block_t(8) == tiles
    up = tiles.with_min_block_t(64)
    assert (up.block_t, up.bt_scores, up.bt_transpose) == (64, 64, 64)
    with pytest.raises(ValueError, match="Tiles.block_t_scores=24 must be a positive divisor of block_t=32"):
        tiling.Tiles(32, 8, 8, block_t_scores=24)
    with pytest.raises(ValueError, match="Tiles.block_t_transpose=0"):
        tiling.Tiles(32, 8, 8, block_t_transpose=0)


def test_per_target_forward_matches_the_reference():
    sources, banks, queries, _, _ = _inputs()
    kw = dict(stream_kernels=KERNELS, segment_ids=jnp.asarray(np.repeat([[0] * 12 + [1] * 7], B, 0)))
    want = reference.split_targets(reference.phase1(sources, banks, queries, **kw))
    got = api.phase1(sources, banks, queries, implementation="pallas_gpu", interpret=True,
                     tiles=tiling.Tiles(8, 8, 8), per_target=True, **kw)
    assert isinstance(got, tuple) and len(got) == S
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_per_target_equals_the_stacked_state_split():
    """On a GPU: the compiled kernels (Triton), Pallas backward, at a medium shape."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(3)
    kernels, n, b, t, d, s = (0, 4, 8, 12), 5, 2, 200, 256, 4
    m = len(kernels)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    x, banks, q = normal(n, b, t, d), 0.3 * normal(n, sum(kernels), d), normal(s, m, d)
    ct_acc, ct_den = normal(s, m, b, t, d), normal(s, m, b, t, 1)
    valid = jnp.asarray([True, True, True, False, False])

    def loss(per_target, x, bk, q):
        out = api.phase1(x, bk, q, valid, stream_kernels=kernels, implementation="pallas_gpu", backward="pallas",
                         per_target=per_target)
        states = out if per_target else reference.split_targets(out)
        return sum(jnp.sum(st.acc * ct_acc[i]) + jnp.sum(st.denom * ct_den[i]) for i, st in enumerate(states))

    want = jax.jit(jax.value_and_grad(lambda *a: loss(False, *a), argnums=(0, 1, 2)))(x, banks, q)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(True, *a), argnums=(0, 1, 2)))(x, banks, q)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(w))))
