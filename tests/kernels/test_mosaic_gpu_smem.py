"""The Mosaic GPU kernels' shared-memory counts against what Mosaic GPU allocates when it lowers
them for the H200.

The counts (``mosaic_gpu.smem_bytes``, ``state_smem_bytes``, ``scores_smem_bytes``,
``mix_smem_bytes``, ``phase1_backward.smem_bytes``) decide before any compile which channel chunk
a kernel takes and whether a form with a window or rows per source (``phase1_mix``'s
``window_fetch="per_chunk"``, ``phase1_dstreams``' ``rows_fetch="per_stream"``) fits or falls
back; Mosaic GPU refuses a program above ``mosaic_gpu.SMEM_BYTES``. Each count lays out the kernel's scratch list as Pallas does (``common.smem_sum``: every buffer from a
1 KiB boundary, then the barriers), so with segment ids and conv taps (buffers the counts
include whether present or not) it is the allocation to the byte; without a conv (one stream:
no taps, no segment bits) it is 2 KiB above. Summing the buffers alone would be 1-7 KB short,
and a valid-source list one row short per source goes unseen without these tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

from pallas_kernels.depth_attention import mosaic_gpu
from pallas_kernels.depth_attention.mosaic_gpu import common, phase1_backward, phase1_mixing
from tests.kernels.test_depth_attention_fused import _phase1_inputs, _phase2_inputs
from tests.kernels.test_mosaic_gpu_bwd1 import _inputs
from tests.kernels.test_mosaic_gpu_phase1 import _segments

KERNELS = (0, 4, 8, 12)
BF16 = jnp.bfloat16


def _absent(kernels) -> int:
    """Bytes a count holds for buffers a kernel without a conv leaves out (its taps, its bits)."""
    return 0 if any(kernels) else 2 * common.SMEM_ALIGNMENT


@pytest.fixture
def allocated(monkeypatch):
    """The shared memory Mosaic GPU allocates for each kernel lowered while the test runs."""
    seen, real = [], mgpu_core._smem_tree_size
    monkeypatch.setattr(mgpu_core, "_smem_tree_size", lambda tree: seen.append(real(tree)) or seen[-1])
    return seen


def _lower(fn, *args):
    jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


CASES = [(9, 8), pytest.param(3, 2, marks=pytest.mark.slow), pytest.param(20, 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize("n, n_targets", CASES)
@pytest.mark.parametrize("window_fetch", phase1_mixing.MIX_WINDOW_FETCHES)
def test_mix_count(allocated, n, n_targets, window_fetch):
    sources, banks, _ = _phase1_inputs(n, 1, 64, 64, n_targets, KERNELS, dtype=BF16)
    p = jnp.ones((n_targets, n, len(KERNELS), 1, 64, 1))
    _lower(lambda x, b, w: mosaic_gpu.phase1_mix(x, b, w, _segments(1, 64, 30), None, stream_kernels=KERNELS,
                                                 heads=1, window_fetch=window_fetch), sources, banks, p)
    assert allocated == [mosaic_gpu.mix_smem_bytes(block_d=32, stream_kernels=KERNELS, heads=1, x_dtype=BF16,
                                                   out_dtype=jnp.float32, n_targets=n_targets, n_sources=n,
                                                   window_fetch=window_fetch)]


@pytest.mark.parametrize("n, n_targets", CASES[:2])
@pytest.mark.parametrize("mode, rows_fetch", [("gdots", "per_item"), ("dstreams", "per_item"),
                                              ("dstreams", "per_stream")])
def test_phase1_backward_counts(allocated, n, n_targets, mode, rows_fetch):
    sources, banks, queries, g_acc, p, dsr, w, seg, _ = _inputs(n, 1, 64, 64, n_targets, 1, None, 30, BF16,
                                                                jnp.float32, True)
    kw = dict(stream_kernels=KERNELS, heads=1)
    if mode == "gdots":
        _lower(lambda x, b, ga, sg: mosaic_gpu.phase1_gdots(x, b, ga, sg, None, **kw), sources, banks, g_acc, seg)
    else:
        _lower(lambda *a: mosaic_gpu.phase1_dstreams(*a, None, out_dtype=BF16, rows_fetch=rows_fetch, **kw),
               sources, banks, queries, g_acc, p, dsr, w, seg)
    assert allocated == [phase1_backward.smem_bytes(block_d=32, stream_kernels=KERNELS, heads=1, x_dtype=BF16,
                                                    acc_dtype=jnp.float32, n_targets=n_targets, n_sources=n,
                                                    mode=mode, rows_fetch=rows_fetch)]


@pytest.mark.parametrize("kernels, heads, n", [(KERNELS, 1, 9), pytest.param((0,), 1, 3, marks=pytest.mark.slow),
                                               pytest.param(KERNELS, 2, 20, marks=pytest.mark.slow)])
def test_scores_count(allocated, kernels, heads, n):
    sources, banks, queries = _phase1_inputs(n, 1, 64, 128, 8, kernels, dtype=BF16)
    _lower(lambda x, b, q: mosaic_gpu.phase1_scores(x, b, q, _segments(1, 64, 30), None, stream_kernels=kernels,
                                                    heads=heads), sources, banks, queries)
    bd = mosaic_gpu.scores_block_d_choices(len(kernels))[0]
    counted = mosaic_gpu.scores_smem_bytes(block_d=bd, stream_kernels=kernels, heads=heads, x_dtype=BF16,
                                           n_targets=8, n_sources=n)
    assert allocated == [counted - _absent(kernels)]


@pytest.mark.parametrize("kernels, heads, acc_dtype", [
    (KERNELS, 1, jnp.float32), pytest.param(KERNELS, 2, BF16, marks=pytest.mark.slow),
    pytest.param((0,), 1, jnp.float32, marks=pytest.mark.slow)])
def test_phase2_counts(allocated, kernels, heads, acc_dtype):
    state, partial, bank, query, gate = _phase2_inputs(1, 64, 128, kernels, heads)
    state = state._replace(acc=state.acc.astype(acc_dtype))
    partial, seg, m = partial.astype(BF16), _segments(1, 64, 30), len(kernels)
    _lower(lambda s, x, b, q, g: mosaic_gpu.phase2_fused_forward(
        s, x, b, q, True, g, seg, fuse="gate", stream_kernels=kernels, heads=heads, eps=1e-6, gate_eps=1e-6,
        out_dtype=BF16), state, partial, bank, query, gate)
    coef = [jnp.ones((m, 1, 64, heads)) for _ in range(3)]
    _lower(lambda x, b, c0, c1, c2, acc, dh, g: mosaic_gpu.phase2_backward_state(
        x, b, c0, c1, c2, acc, dh, g, seg, stream_kernels=kernels, heads=heads, gate_eps=1e-6),
        partial, bank, *coef, state.acc, jnp.ones((1, 64, 128), acc_dtype), gate)
    kw = dict(block_d=32, stream_kernels=kernels, heads=heads, x_dtype=BF16, acc_dtype=acc_dtype)
    counted = [mosaic_gpu.smem_bytes(**kw, out_dtype=BF16), mosaic_gpu.state_smem_bytes(**kw, dh_dtype=acc_dtype)]
    assert allocated == [c - _absent(kernels) for c in counted]
