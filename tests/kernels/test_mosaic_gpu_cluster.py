"""Phase 2's forward with the state read once by a cluster of CTAs
(``pallas_kernels/depth_attention/mosaic_gpu_cluster.py``) against the oracle and the one-CTA
kernel. On the CPU it runs interpreted with a cluster of one (the Mosaic GPU interpreter of jax
0.11.2 has no rule for the exchange's ``async_store_smem``), and its clusters of 8 and 16 are
lowered for the H200 to check the shared-memory count; the GPU-marked tests run clusters of 1, 8
and 16 with the pull exchange (they pass on an H100). The ``st.async`` exchanges, whose
launches fail, are refused unless asked for (``unverified_exchange``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_cluster, reference
from tests.kernels.test_depth_attention_fused import F32_TOL, _phase2_inputs, _rel
from tests.kernels.test_mosaic_gpu_phase2 import _segments

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

KERNELS = (0, 4, 8, 12)
BF16 = jnp.bfloat16
EPS = dict(eps=1e-6, gate_eps=1e-6)


def _inputs(batch, t_len, d, cut, state_dtype=jnp.float32):
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, KERNELS, 1)
    seg = None if cut is None else _segments(batch, t_len, cut)
    return state._replace(acc=state.acc.astype(state_dtype)), partial.astype(BF16), bank, query, gate, seg


def _cluster(args, include, **opts):
    state, partial, bank, query, gate, seg = args
    return mosaic_gpu_cluster.phase2_cluster_forward(state, partial, bank, query, include, gate, seg,
                                                     stream_kernels=KERNELS, heads=1, **EPS, **opts)


def _one_cta(args, include, **opts):
    state, partial, bank, query, gate, seg = args
    return mosaic_gpu.phase2_fused_forward(state, partial, bank, query, include, gate, seg, fuse="gate",
                                           stream_kernels=KERNELS, heads=1, **EPS, **opts)


def _oracle(args, include):
    state, partial, bank, query, gate, seg = args
    return reference.phase2_fused(state, partial, bank, query, include, gate, stream_kernels=KERNELS, heads=1,
                                  segment_ids=seg, **EPS)


@pytest.mark.parametrize("include, cut, state_dtype, programs, warpgroups", [
    # the cluster kernels are kept for comparison only: one case in the default suite
    pytest.param(True, 37, jnp.float32, None, 1, id="segments_ragged_T", marks=pytest.mark.slow),
    pytest.param(True, 37, jnp.float32, 2, 2, id="two_programs_walk_the_tiles_two_warpgroups"),
    pytest.param(True, 37, jnp.float32, None, 2, id="two_warpgroups", marks=pytest.mark.slow),
    pytest.param(False, None, BF16, 1, 1, id="partial_excluded_bf16_state_one_program", marks=pytest.mark.slow),
])
def test_interpreted_forward_matches_oracle_and_one_cta_kernel(include, cut, state_dtype, programs, warpgroups):
    """A cluster of one (interpreted): ``h`` against the oracle; ``h`` and the scores against the
    one-CTA kernel, which with one warpgroup sums the same chunks in the same order (the scores
    to the bit; two warpgroups add their halves' sums). Four token tiles (two rows of a full and
    a ragged one), four channel chunks, segment boundaries inside the lag windows; one program
    per tile, or programs that walk 2 or 4 tiles and fetch each next tile's chunks into the
    buffers the last pass frees."""
    args = _inputs(2, 100, 128, cut, state_dtype)
    h, (dots, sumsq) = _cluster(args, include, cluster=1, programs=programs, warpgroups=warpgroups, interpret=True)
    want_h, (want_dots, want_sumsq) = _one_cta(args, include, interpret=True)
    assert h.shape == (2, 100, 128) and dots.shape == want_dots.shape and sumsq.shape == want_sumsq.shape
    assert np.any(np.asarray(h))
    assert _rel(h, _oracle(args, include)) < F32_TOL
    assert _rel(h, want_h) < F32_TOL
    if warpgroups == 1:
        np.testing.assert_array_equal(np.asarray(dots), np.asarray(want_dots))
        np.testing.assert_array_equal(np.asarray(sumsq), np.asarray(want_sumsq))
    assert _rel(dots, want_dots) < F32_TOL and _rel(sumsq, want_sumsq) < F32_TOL


@pytest.mark.parametrize("d, cluster, exchange, warpgroups", [(1024, 8, "all", 1), (1024, 8, "butterfly", 1),
                                                              (2048, 16, "butterfly", 1), (2048, 16, "butterfly", 2),
                                                              (2048, 16, "pull", 2)])
def test_shared_memory_count_is_the_allocation(monkeypatch, d, cluster, exchange, warpgroups):
    """``smem_bytes`` is what Mosaic GPU allocates for one CTA lowered for the H200 (with segment
    ids and taps: every buffer present; a bf16 ``h``, as the models write it), and under the
    H200's limit at `base` (d = 1024, a cluster of 8) and the bench shape (d = 2048, 16, the
    butterfly exchange)."""
    seen, real = [], mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: seen.append(real(tree)) or seen[-1])
    args = _inputs(1, 64, d, 30)
    jax.jit(lambda *a: _cluster(a, True, cluster=cluster, exchange=exchange, out_dtype=BF16, warpgroups=warpgroups,
                                unverified_exchange=True)).trace(*args).lower(lowering_platforms=("cuda",))
    want = mosaic_gpu_cluster.smem_bytes(d=d, cluster=cluster, stream_kernels=KERNELS, x_dtype=BF16,
                                         acc_dtype=jnp.float32, out_dtype=BF16, exchange=exchange,
                                         warpgroups=warpgroups)
    assert seen == [want]
    assert want <= mosaic_gpu.SMEM_BYTES


def test_exchange_default_and_refusals():
    """The ``"all"`` exchange's receive tiles do not fit at the bench shape; bad clusters,
    exchanges and shapes are refused with what was asked (the ``st.async`` exchanges, whose
    launches fail, unless asked for)."""
    kw = dict(stream_kernels=KERNELS, x_dtype=BF16, acc_dtype=jnp.float32, out_dtype=BF16)
    assert mosaic_gpu_cluster.smem_bytes(d=1024, cluster=8, exchange="all", **kw) <= mosaic_gpu.SMEM_BYTES
    assert mosaic_gpu_cluster.smem_bytes(d=2048, cluster=16, exchange="all", **kw) > mosaic_gpu.SMEM_BYTES
    assert mosaic_gpu_cluster.cluster_size(1024) == 8 and mosaic_gpu_cluster.cluster_size(2048) == 16
    args = _inputs(1, 64, 64, None)
    with pytest.raises(ValueError, match="cluster=3"):
        _cluster(args, True, cluster=3, interpret=True)
    with pytest.raises(ValueError, match="exchange='ring'"):
        _cluster(args, True, cluster=1, exchange="ring", interpret=True)
    with pytest.raises(ValueError, match="programs=3: must divide the 1 token tiles"):
        _cluster(args, True, cluster=1, programs=3, interpret=True)
    assert mosaic_gpu_cluster.persistent_programs(256, 16) == 8
    assert mosaic_gpu_cluster.persistent_programs(1024, 8) == 16
    assert mosaic_gpu_cluster.persistent_programs(96, 16) == 8 and mosaic_gpu_cluster.persistent_programs(7, 8) == 7
    with pytest.raises(ValueError, match="warpgroups=3"):
        _cluster(args, True, cluster=1, warpgroups=3, interpret=True)
    for exchange in ("all", "butterfly"):  # their launches fail on an H100
        with pytest.raises(NotImplementedError, match=f"exchange='{exchange}': the st.async exchange"):
            jax.eval_shape(lambda *a: _cluster(a, True, cluster=2, exchange=exchange), *args)
    jax.eval_shape(lambda *a: _cluster(a, True, cluster=2), *args)  # the pull exchange, the default
    with pytest.raises(NotImplementedError, match="interpreter"):
        _cluster(args, True, cluster=2, interpret=True)
    with pytest.raises(NotImplementedError, match="multiple of cluster"):  # 64 channels: not 4 x 32
        jax.eval_shape(lambda *a: _cluster(a, True, cluster=4), *args)
    with pytest.raises(NotImplementedError, match="shared memory"):
        jax.eval_shape(lambda *a: _cluster(_inputs(1, 64, 2048, None), True, cluster=8), *args)
    state, partial, bank, query, gate, seg = _phase2_inputs(1, 64, 64, KERNELS, 2) + (None,)
    with pytest.raises(NotImplementedError, match="one head"):
        mosaic_gpu_cluster.phase2_cluster_forward(state, partial, bank, query, True, gate, None,
                                                  stream_kernels=KERNELS, heads=2, cluster=1, interpret=True, **EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("programs, warpgroups", [(None, 1), (4, 2)])
def test_gpu_one_cta_cluster_matches_one_cta_kernel(programs, warpgroups):
    """On a GPU, a cluster of one (every pass but the exchange; 128 channels, the slice a CTA
    of a cluster would hold): ``h`` and the scores against the one-CTA kernel and the oracle
    (float32 state, bf16 partial, segments, a ragged tile; one program per tile, or 4 walking
    the 8 tiles with two warpgroups); both cases pass on an H100. Clusters of 8 and
    16: ``test_gpu_pull_cluster_matches_one_cta_kernel``, in a process of its own."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args = _inputs(2, 200, 128, 77)
    with jax.default_matmul_precision("highest"):
        h, (dots, sumsq) = jax.jit(lambda *a: _cluster(a, True, cluster=1, programs=programs, warpgroups=warpgroups,
                                                       out_dtype=jnp.float32))(*args)
        want_h, (want_dots, want_sumsq) = jax.jit(lambda *a: _one_cta(a, True))(*args)
        oracle = jax.jit(lambda *a: _oracle(a, True))(*args)
    assert _rel(h, oracle) < 1e-4
    assert _rel(h, want_h) < 1e-5
    assert _rel(dots, want_dots) < 1e-5 and _rel(sumsq, want_sumsq) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("d, cluster, programs", [(1024, 8, None), (1024, 8, 4), (2048, 16, None)])
def test_gpu_pull_cluster_matches_one_cta_kernel(d, cluster, programs):
    """On a GPU, clusters of 8 and 16 CTAs with the pull exchange (``exchange="pull"``, one
    warpgroup per CTA: two do not fit beside the segments' bits): ``h`` and the scores against
    the one-CTA kernel and the oracle (float32 state, bf16 partial, segments, a ragged tile; one
    cluster per tile or 4 walking the 8 tiles); the first case passes on an H100. Run it in a process of its own (``-k pull_cluster``): a failed cluster launch leaves
    the process's GPU unusable for what follows."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args = _inputs(2, 200, d, 77)
    with jax.default_matmul_precision("highest"):
        h, (dots, sumsq) = jax.jit(lambda *a: _cluster(
            a, True, cluster=cluster, exchange="pull", programs=programs, out_dtype=jnp.float32))(*args)
        want_h, (want_dots, want_sumsq) = jax.jit(lambda *a: _one_cta(a, True, out_dtype=jnp.float32))(*args)
        oracle = jax.jit(lambda *a: _oracle(a, True))(*args)
    assert _rel(h, oracle) < 1e-4
    assert _rel(h, want_h) < 1e-5
    assert _rel(dots, want_dots) < 1e-5 and _rel(sumsq, want_sumsq) < 1e-5


def _bwd_inputs(batch, t_len, d, cut, dh_dtype=BF16, state_dtype=jnp.float32):
    """The state kernel's inputs: random merge coefficients, a random ``dh`` (non-zero gate
    parameters, taps and state: ``_phase2_inputs``)."""
    state, partial, bank, _, gate = _phase2_inputs(batch, t_len, d, KERNELS, 1)
    coef = [jax.random.uniform(jax.random.key(20 + k), (len(KERNELS), batch, t_len, 1), minval=0.1)
            for k in range(3)]
    dh = jax.random.normal(jax.random.key(31), (batch, t_len, d)).astype(dh_dtype)
    seg = None if cut is None else _segments(batch, t_len, cut)
    return partial.astype(BF16), bank, *coef, state.acc.astype(state_dtype), dh, gate, seg


def _cluster_bwd(args, **opts):
    return mosaic_gpu_cluster.phase2_cluster_backward_state(*args, stream_kernels=KERNELS, heads=1, gate_eps=1e-6,
                                                            **opts)


def _one_cta_bwd(args, **opts):
    return mosaic_gpu.phase2_backward_state(*args, stream_kernels=KERNELS, heads=1, gate_eps=1e-6, **opts)


@pytest.mark.parametrize("cut, dh_dtype, programs, warpgroups", [
    pytest.param(37, BF16, None, 1, id="segments_ragged_T", marks=pytest.mark.slow),  # comparison only
    pytest.param(37, jnp.float32, 2, 2, id="two_programs_walk_the_tiles_two_warpgroups_f32_dh"),
    pytest.param(None, BF16, 1, 1, id="one_program", marks=pytest.mark.slow),
])
def test_interpreted_backward_state_matches_one_cta_kernel(cut, dh_dtype, programs, warpgroups):
    """The backward's state pass on a cluster of one (interpreted) against the one-CTA kernel
    (``mosaic_gpu.phase2_backward_state``, itself tested against the reference's gradients):
    ``d_acc``, the per-token sums and the gate's rows and gradients at float32 rounding (the
    sums are added per warpgroup, then over them). Four token tiles (two rows of a full and a
    ragged one), four channel chunks, segment boundaries inside the lag windows; one program per
    tile, or programs that walk 2 or 4 tiles and fetch each next tile's chunks into the buffers
    the last pass (or its ``d_acc`` store) frees."""
    args = _bwd_inputs(2, 100, 128, cut, dh_dtype)
    got = _cluster_bwd(args, cluster=1, programs=programs, warpgroups=warpgroups, interpret=True)
    want = _one_cta_bwd(args, interpret=True)
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) == 9  # d_acc, S1, Sm, Ss, g, dy, coef, d_scale, d_bias
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert np.any(np.asarray(w))
        assert _rel(g, w) < F32_TOL


@pytest.mark.parametrize("d, cluster, warpgroups, dh_dtype", [(1024, 8, 1, BF16), (2048, 16, 1, BF16),
                                                               (1024, 8, 1, jnp.float32), (1024, 8, 2, BF16)])
def test_backward_shared_memory_count_is_the_allocation(monkeypatch, d, cluster, warpgroups, dh_dtype):
    """``backward_smem_bytes`` is what Mosaic GPU allocates for one CTA lowered for the H200
    (segment ids and taps: every buffer present), and whether it fits the H200."""
    seen, real = [], mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: seen.append(real(tree)) or seen[-1])
    want = mosaic_gpu_cluster.backward_smem_bytes(d=d, cluster=cluster, stream_kernels=KERNELS, x_dtype=BF16,
                                                  acc_dtype=jnp.float32, dh_dtype=dh_dtype, warpgroups=warpgroups)
    args = _bwd_inputs(1, 64, d, 30, dh_dtype)
    run = jax.jit(lambda *a: _cluster_bwd(a, cluster=cluster, warpgroups=warpgroups))
    if want > mosaic_gpu.SMEM_BYTES:
        with pytest.raises(NotImplementedError, match="bytes of shared memory per CTA"):
            run.trace(*args)
        return
    run.trace(*args).lower(lowering_platforms=("cuda",))
    assert seen == [want]


def test_backward_refusals():
    """Bad clusters, warpgroups, programs and shapes are refused with what was asked."""
    args = _bwd_inputs(1, 64, 64, None)
    with pytest.raises(ValueError, match="cluster=3"):
        _cluster_bwd(args, cluster=3, interpret=True)
    with pytest.raises(ValueError, match="warpgroups=3"):
        _cluster_bwd(args, cluster=1, warpgroups=3, interpret=True)
    with pytest.raises(ValueError, match="programs=3: must divide the 1 token tiles"):
        _cluster_bwd(args, cluster=1, programs=3, interpret=True)
    with pytest.raises(NotImplementedError, match="interpreter"):
        _cluster_bwd(args, cluster=2, interpret=True)
    with pytest.raises(NotImplementedError, match="the H_pre gate"):
        _cluster_bwd(args[:-2] + (None, None), cluster=1, interpret=True)
    with pytest.raises(NotImplementedError, match="multiple of cluster"):
        jax.eval_shape(lambda *a: _cluster_bwd(a, cluster=4), *args)


@pytest.mark.gpu
@pytest.mark.parametrize("d, cluster, programs", [(128, 1, None), (1024, 8, None), (1024, 8, 4), (2048, 16, None)])
def test_gpu_backward_state_cluster_matches_one_cta_kernel(d, cluster, programs):
    """On a GPU, the backward's state pass on clusters of 1, 8 and 16 CTAs (pull exchange)
    against the one-CTA kernel (bf16 ``dh``, segments, a ragged tile). Run it in a process of its
    own (``-k backward_state_cluster``): a failed cluster launch leaves the GPU unusable. All
    four cases pass on an H100."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args = _bwd_inputs(2, 200, d, 77)
    got = jax.jit(lambda *a: _cluster_bwd(a, cluster=cluster, programs=programs))(*args)
    want = jax.jit(lambda *a: _one_cta_bwd(a))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert _rel(g, w) < 1e-5
