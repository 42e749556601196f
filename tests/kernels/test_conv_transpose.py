"""The expansion's transpose kernel (``conv_transpose``) against autodiff of
``reference.expand``, and phase 1's ``backward="hybrid"`` (the closed-form XLA backward with
that kernel) against the closed-form XLA backward.

On CPU the kernel runs in interpret mode (next-tile concatenate for the rows ahead, previous-
tile concatenate for the rows behind); the compiled Triton kernel (masked loads) is checked
by the GPU-marked test and its lowering by ``test_triton_lowering.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, conv_transpose, tiling
from pallas_kernels.depth_attention import reference as ref

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite gradient"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _segments(rng, b, t):
    starts = rng.random((b, t)) < 0.15
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def _check(kernels, *, b, t, d, tiles, segments, rows=None, dtype=jnp.float32, backend="interpret",
           interpret=True, tol=1e-5, seed=0):
    rng = np.random.default_rng(seed + t + d)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    m, k = len(kernels), sum(kernels)
    x = normal(b, t, d).astype(dtype)
    bank = normal(k, d)
    d_streams = normal(m, b, t, d)
    seg = _segments(rng, b, t) if segments else None
    _, vjp = jax.vjp(lambda xx, bb: ref.expand(xx, bb, kernels, seg), x, bank)
    want_x, want_bank = vjp(d_streams)
    fn = jax.jit(functools.partial(conv_transpose.expansion_transpose, stream_kernels=kernels, tiles=tiles,
                                   backend=backend, interpret=interpret, rows=rows),
                 compiler_options=FAST if jax.default_backend() == "cpu" else None)
    got_x, got_bank = fn(d_streams, x, bank, seg)
    assert got_x.shape == x.shape and got_x.dtype == x.dtype
    assert got_bank.shape == bank.shape
    assert _rel(got_x.astype(jnp.float32), want_x.astype(jnp.float32)) < tol
    assert _rel(got_bank, want_bank) < tol
    return got_x, got_bank


@pytest.mark.parametrize("kernels, b, t, d, tiles, segments, rows", [
    # T ragged over 3 tiles of 16, one program per batch row, segments
    ((0, 4, 8, 12), 2, 40, 16, tiling.Tiles(16, 8, 8), True, None),
    # several programs along T (rows = 2 tiles), tiles of 8 with a halo of 7
    ((0, 4, 8), 1, 64, 8, tiling.Tiles(8, 8, 8), True, 16),
    # T shorter than the largest kernel, no segments, one stream
    ((12,), 2, 5, 8, tiling.Tiles(16, 8, 8), False, None),
], ids=["msar_ragged_segments", "several_programs", "T_shorter_than_kernel"])
def test_matches_autodiff_of_expand(kernels, b, t, d, tiles, segments, rows):
    _check(kernels, b=b, t=t, d=d, tiles=tiles, segments=segments, rows=rows)


def test_bf16_sources():
    """bf16 sources: the kernel's float32 sums, cast once; the reference's gradient in bf16."""
    _check((0, 4, 8, 12), b=1, t=24, d=16, tiles=tiling.Tiles(16, 16, 16), segments=True, dtype=jnp.bfloat16,
           tol=1e-2)


def test_identity_streams_need_no_kernel():
    x = jnp.ones((1, 4, 8))
    d_streams = jnp.arange(2 * 32, dtype=jnp.float32).reshape(2, 1, 4, 8)
    dx, dbank = conv_transpose.expansion_transpose(d_streams, x, None, stream_kernels=(0, 0),
                                                   tiles=tiling.Tiles(8, 8, 8), backend="interpret", interpret=True)
    np.testing.assert_array_equal(dx, d_streams[0] + d_streams[1])
    assert dbank.shape == (0, 8)


@pytest.mark.parametrize("kwargs, message", [
    (dict(rows=24), "rows=24"),  # not dividing the padded length 32
    (dict(tiles=tiling.Tiles(4, 8, 8)), "block_t=4 < max_kernel - 1 = 7"),
    (dict(tiles=tiling.Tiles(8, 8, 3)), "block_d=3 must divide d=8"),
])
def test_rejects_bad_tiles(kwargs, message):
    opts = dict(stream_kernels=(0, 8), tiles=tiling.Tiles(8, 8, 8), backend="interpret", interpret=True)
    opts.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        conv_transpose.expansion_transpose(jnp.zeros((2, 1, 32, 8)), jnp.zeros((1, 32, 8)), jnp.zeros((8, 8)), **opts)


def test_rows_per_program():
    assert conv_transpose.rows_per_program(2048, 16) == 128
    assert conv_transpose.rows_per_program(48, 16) == 48
    assert conv_transpose.rows_per_program(80, 16) == 80  # 5 tiles: 5 divides 5
    assert conv_transpose.rows_per_program(16 * 9, 16) == 48  # at most 8 tiles: 3 divides 9


def test_hybrid_phase1_backward_matches_xla():
    """Phase 1 through the registered GPU kernels in interpret mode: ``backward="hybrid"``
    gives the gradients of ``backward="xla"`` (sources, banks, queries; two heads, segments,
    an invalid source, T ragged over 3 tiles)."""
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    kernels, n, b, t, d, s, heads = (0, 4, 8, 12), 3, 2, 37, 16, 2, 2
    sources, banks, queries = normal(n, b, t, d), 0.4 * normal(n, 24, d), normal(s, 4, d)
    seg = _segments(rng, b, t)
    valid = jnp.asarray([True, False, True])
    ct_acc, ct_denom = normal(s, 4, b, t, d), normal(s, 4, b, t, heads)

    def loss(x, bk, q, backward):
        state = api.phase1(x, bk, q, valid, stream_kernels=kernels, heads=heads, segment_ids=seg,
                           implementation="pallas_gpu", interpret=True, backward=backward,
                           tiles=tiling.Tiles(16, 8, 8))
        return jnp.sum(state.acc * ct_acc) + jnp.sum(state.denom * ct_denom)

    grad = lambda backward: jax.jit(jax.grad(functools.partial(loss, backward=backward), argnums=(0, 1, 2)),  # noqa: E731
                                    compiler_options=FAST)(sources, banks, queries)
    want, got = grad("xla"), grad("hybrid")
    for name, a, w in zip(("sources", "banks", "queries"), got, want):
        assert _rel(a, w) < 1e-5, (name, _rel(a, w))
    assert not np.any(np.asarray(got[0][1]))  # the invalid source
    assert float(jnp.max(jnp.abs(got[1]))) > 0


@pytest.mark.gpu
def test_gpu_triton_matches_autodiff():
    """On a GPU: the compiled Triton kernel (masked loads ahead and behind) at a medium shape,
    with phase 1's Triton tiles, several programs along T and segments."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    tiles = tiling.choose_tiles(d=256, heads=1, max_kernel=12, n_targets=8, backend="triton")
    with jax.default_matmul_precision("highest"):
        _check((0, 4, 8, 12), b=2, t=300, d=256, tiles=tiles, segments=True, backend="triton", interpret=False,
               tol=1e-5)
        _check((0, 4, 8, 12), b=2, t=256, d=256, tiles=tiles, segments=False, backend="triton", interpret=False,
               tol=1e-2, dtype=jnp.bfloat16)
