"""AttnRes's reads (one stream, no conv: ``stream_kernels=(0,)``) through every Mosaic GPU
kernel that takes them (``gpu_kernels="mosaic"``): phase 1's scoring and mixing passes and its
Pallas backward's passes 2 and 4 (``mosaic_gpu.phase1_backward``; no transpose without a conv), phase 2's
fused forward and its backward's state and input kernels. Forward and every gradient against
the oracle (``reference.py``), interpreted on the CPU and compiled in the GPU-marked test."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.depth_attention import api, mosaic_gpu, reference
from tests.kernels.test_depth_attention_fused import F32_TOL, _check_tree, _phase1_inputs, _phase1_vjp
from tests.kernels.test_mosaic_gpu_phase1 import _segments
from tests.kernels.test_mosaic_gpu_phase2 import _check_grads, _run

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

ONE_STREAM = (0,)
PHASE1_KERNELS = ((mosaic_gpu, "phase1_scores"), (mosaic_gpu, "phase1_mix"), (mosaic_gpu, "phase1_gdots"),
                  (mosaic_gpu, "phase1_dstreams"))


def _count_calls(monkeypatch, kernels):
    calls = {name: 0 for _, name in kernels}
    for module, name in kernels:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a, **k))
    return calls


@pytest.mark.parametrize("choice, heads, interpret, want", [
    ("auto", 1, False, {"scores", "gdots", "dstreams"}),  # as timed on the H200
    ("auto", 8, False, {"scores", "gdots", "dstreams"}),  # MHAR's heads, as timed
    ("auto", 1, True, set()),  # interpret mode: the Triton kernels (the default suite's path)
    ("mosaic", 1, True, {"scores", "mix", "gdots", "dstreams"}),
    ("triton", 1, False, set()),
])
def test_which_phase1_kernels_each_choice_takes_for_one_stream(choice, heads, interpret, want):
    """``heuristics.mosaic_phase1`` at AttnRes's `base` shape (bf16 sources, a float32 state): for
    one stream ``"auto"`` takes the Mosaic passes that were faster there and keeps Triton's
    mixing pass; no conv, so no transpose kernel under any choice."""
    from pallas_kernels.depth_attention import heuristics

    took = {k for k in heuristics.PHASE1_KERNELS
            if heuristics.mosaic_phase1(choice, k, backend="triton", stream_kernels=ONE_STREAM, heads=heads, d=1024,
                                        n_sources=7, n_targets=8, dtype=jnp.bfloat16, interpret=interpret)}
    assert took == want
    assert heuristics.SINGLE_STREAM_MOSAIC_PHASE1 <= {"scores", "mix", "gdots", "dstreams"}


@pytest.mark.parametrize("block_d", [pytest.param(32, marks=pytest.mark.slow), None])
def test_interpreted_scoring_pass_matches_direct_sums(block_d):
    """``mosaic_gpu.phase1_scores`` for one stream (``E = x``) against the direct dots and sums of
    squares: 8 targets, eight 32-channel chunks or the default's two of 128, a source ruled out
    (zeros), segments, ragged T."""
    n, batch, t_len, d, n_targets = 3, 2, 70, 256, 8
    sources, _, queries = _phase1_inputs(n, batch, t_len, d, n_targets, ONE_STREAM)
    valid = jnp.asarray([True, False, True])
    dots, sumsq = mosaic_gpu.phase1_scores(sources, None, queries, _segments(batch, t_len, 23), valid,
                                           stream_kernels=ONE_STREAM, heads=1, block_d=block_d, interpret=True)
    with jax.default_matmul_precision("highest"):
        want_dots = jnp.einsum("sd,nbtd->snbt", queries[:, 0], sources)[:, :, None, :, :, None]
    want_sumsq = jnp.sum(sources * sources, axis=-1)[:, None]
    live = valid[:, None, None, None]
    _check_tree((dots, sumsq), (want_dots * live[None, ..., None], want_sumsq * live), F32_TOL)


@pytest.mark.gpu
def test_gpu_scoring_pass_matches_direct_sums():
    """On a GPU, compiled: as the interpreted test, with bf16 sources and 2048 channels (16
    chunks of 128)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    n, batch, t_len, d, n_targets = 3, 2, 300, 2048, 8
    sources, _, queries = _phase1_inputs(n, batch, t_len, d, n_targets, ONE_STREAM, dtype=jnp.bfloat16)
    valid = jnp.asarray([True, False, True])
    dots, sumsq = jax.jit(lambda x, q, s, v: mosaic_gpu.phase1_scores(
        x, None, q, s, v, stream_kernels=ONE_STREAM, heads=1))(
        sources, queries, _segments(batch, t_len, 77), valid)
    x = sources.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        want_dots = jnp.einsum("sd,nbtd->snbt", queries[:, 0], x)[:, :, None, :, :, None]
    want_sumsq = jnp.sum(x * x, axis=-1)[:, None]
    live = valid[:, None, None, None]
    _check_tree((dots, sumsq), (want_dots * live[None, ..., None], want_sumsq * live), 1e-5)


def test_scoring_pass_channel_chunks():
    """One stream tries 128 channels first, several streams 64 (their registers)."""
    assert mosaic_gpu.scores_block_d_choices(1)[0] == 128 and mosaic_gpu.scores_block_d_choices(4)[0] == 64


def _phase1(gpu_kernels, *, n, batch, t_len, d, n_targets, dtype, valid, cut, heads=1):
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, ONE_STREAM, dtype=dtype)
    assert banks is None
    kw = dict(stream_kernels=ONE_STREAM, heads=heads, segment_ids=None if cut is None else _segments(batch, t_len, cut))
    valid = jnp.asarray(valid)
    got = _phase1_vjp(lambda *a, **k: api.phase1(*a, implementation="pallas_gpu", backward="pallas",
                                                 gpu_kernels=gpu_kernels, **k), sources, banks, queries, valid, **kw)
    return got, _phase1_vjp(reference.phase1, sources, banks, queries, valid, **kw)


def test_interpreted_phase1_takes_the_mosaic_kernels_and_matches_reference(monkeypatch):
    """Float32 sources, a source ruled out, a segment boundary, ragged T: the state and the
    sources' and queries' gradients within float32's tolerance, through all four Mosaic passes."""
    calls = _count_calls(monkeypatch, PHASE1_KERNELS)
    (got, got_grads), (want, want_grads) = _phase1("mosaic", n=3, batch=2, t_len=70, d=64, n_targets=2,
                                                   dtype=jnp.float32, valid=(True, False, True), cut=23)
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, F32_TOL)
    assert all(calls.values()), f"every Mosaic GPU pass of phase 1 should run for one stream: {calls}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads, d, fuse", [(1, 256, "gate"), (8, 512, "mean")], ids=["attnres", "mhar_heads8"])
def test_gpu_single_stream_reads_match_reference(monkeypatch, heads, d, fuse):
    """On a GPU, compiled: phase 1 (bf16 sources, a source ruled out, segments, ragged T, 8
    targets) and phase 2 (bf16 partial) with ``gpu_kernels="mosaic"`` against the oracle,
    forward and gradients, each Mosaic kernel counted; AttnRes (one head, gate fusion) and
    MHAR (8 channel heads, mean fusion)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    p2_kernels = tuple((mosaic_gpu, k) for k in ("phase2_fused_forward", "phase2_backward_state",
                                                  "phase2_backward_inputs"))
    calls = _count_calls(monkeypatch, PHASE1_KERNELS + p2_kernels)
    with jax.default_matmul_precision("highest"):
        (g, g_grads), (w, w_grads) = _phase1("mosaic", n=4, batch=3, t_len=300, d=d, n_targets=8, heads=heads,
                                             dtype=jnp.bfloat16, valid=(True, True, False, True), cut=77)
        case = ("one_stream", 2, 300, d, ONE_STREAM, heads, True, 77, fuse)
        h, h_grads = _run(case, "mosaic", jnp.bfloat16)
        h_want, h_want_grads = _run(case, None, jnp.bfloat16)
    _check_tree(g, w, 1e-4)
    # sources (bf16: one rounding), no banks (no conv), queries
    for got_leaf, want_leaf, tol in zip(g_grads, w_grads, (1e-2, None, 1e-4), strict=True):
        assert (got_leaf is None) == (want_leaf is None) == (tol is None)
        if tol is not None:
            _check_grads(got_leaf, want_leaf, tol)
    _check_tree(h, h_want, 1e-4)
    _check_grads(h_grads, h_want_grads, 1e-4)
    assert all(calls.values()), f"every Mosaic GPU kernel should run for one stream: {calls}"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 8], ids=["attnres", "mhar_heads8"])
def test_gpu_single_stream_auto_matches_reference(monkeypatch, heads):
    """On a GPU, compiled, what ``"auto"`` runs for one stream: phase 1's mixing pass in Triton on
    its own 8 x 128 tile (``tiling.Tiles.mix_tiles``), the other passes in Mosaic GPU
    (128-channel scoring chunks), against the oracle, forward and gradients (bf16 sources, a
    source ruled out, segments, ragged T, 8 targets, 1024 channels); phase 2 without a gate in
    Triton, its output pass on its own 16 x 128 tile."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    calls = _count_calls(monkeypatch, ((mosaic_gpu, "phase1_scores"), (mosaic_gpu, "phase1_mix")))
    with jax.default_matmul_precision("highest"):
        (g, g_grads), (w, w_grads) = _phase1("auto", n=4, batch=3, t_len=300, d=1024, n_targets=8, heads=heads,
                                             dtype=jnp.bfloat16, valid=(True, True, False, True), cut=77)
        case = ("one_stream", 2, 300, 1024, ONE_STREAM, heads, True, 77, "mean")
        h, h_grads = _run(case, "auto", jnp.bfloat16)
        h_want, h_want_grads = _run(case, None, jnp.bfloat16)
    _check_tree(h, h_want, 1e-4)
    _check_grads(h_grads, h_want_grads, 1e-4)
    _check_tree(g, w, 1e-4)
    for got_leaf, want_leaf, tol in zip(g_grads, w_grads, (1e-2, None, 1e-4), strict=True):
        assert (got_leaf is None) == (want_leaf is None) == (tol is None)
        if tol is not None:
            _check_grads(got_leaf, want_leaf, tol)
    assert calls["phase1_scores"] and not calls["phase1_mix"], calls
