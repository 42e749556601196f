"""Phase 1's scoring pass in Mosaic GPU (``mosaic_gpu.phase1_scores``) against Triton's
(``fused.scores_call``, interpreted), its mixing pass (``mosaic_gpu.phase1_mix``) against the
direct sum of Eq. 11 over the reference's streams, and, through the op with
``gpu_kernels="mosaic"`` (its forward scores and mixes, its Pallas backward scores and runs
passes 2 and 4 and the transpose in ``mosaic_gpu.phase1_backward`` and ``mosaic_gpu.transpose``), phase 1's
forward and gradients against the oracle (``"auto"`` takes both on a GPU for several streams,
the mixing pass for a float32 state). On the CPU the kernel runs in
Pallas' Mosaic GPU interpret mode; the GPU-marked test
runs it compiled (TMA's zero fill before token 0 instead of the interpreted pad)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, fused, mosaic_gpu, reference, tiling
from pallas_kernels.depth_attention.mosaic_gpu import phase1_mixing
from tests.kernels.test_depth_attention_fused import F32_TOL, _check_tree, _phase1_inputs, _phase1_vjp
from tests.kernels.test_mosaic_gpu_phase2 import _check_grads

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

KERNELS = (0, 4, 8, 12)


def _segments(batch, t_len, cut):
    seg = np.zeros((batch, t_len), np.int32)
    seg[0, cut:] = 1
    seg[-1, cut // 2:] = 2  # a boundary inside the first lag window of row -1 too
    return jnp.asarray(seg)


def _triton_scores(sources, banks, queries, seg, valid, heads):
    """``fused.scores_call`` (interpreted) on the same inputs, cut back to T."""
    n, batch, t_len, d = sources.shape
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(KERNELS), n_targets=queries.shape[0],
                                backend="tpu", n_streams=len(KERNELS)).with_min_block_t(16)
    t_pad, seg_p = fused.prepare_tokens(t_len, seg, tiles)
    dots, sumsq = fused.scores_call(fused.pad_tokens(sources, 2, t_pad), banks, queries, seg_p, stream_kernels=KERNELS,
                                    heads=heads, tiles=tiles, backend="interpret", interpret=True, valid=valid)
    return dots[..., :t_len, :], sumsq[..., :t_len]


@pytest.mark.parametrize("n, batch, t_len, d, n_targets, heads, valid, cut, dtype, slots, bd", [
    # two 64-token tiles and a ragged end, a source ruled out, segments, two heads, bf16 sources
    (3, 2, 100, 64, 2, 2, (True, False, True), 37, jnp.bfloat16, None, None),
    # T shorter than the largest kernel, float32 sources, one target, no mask
    (2, 1, 7, 32, 1, 1, None, None, jnp.float32, None, None),
    # 3 chunks in flight over 8 chunks (the slots wrap around), a source ruled out
    (2, 1, 70, 256, 2, 1, (True, False), 30, jnp.bfloat16, 3, 32),
    # 4 slots over 2 chunks of 64 channels (fewer chunks than slots)
    (2, 1, 70, 128, 2, 1, None, 30, jnp.bfloat16, 4, 64),
    # 4 heads of 2 chunks each, 3 slots (the copies run ahead across the heads' ends, where each
    # head's dots leave the loop), the second source ruled out
    (2, 1, 70, 256, 2, 4, (True, False), None, jnp.bfloat16, 3, 32),
])
def test_interpreted_scores_match_triton(n, batch, t_len, d, n_targets, heads, valid, cut, dtype, slots, bd):
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=dtype)
    seg = None if cut is None else _segments(batch, t_len, cut)
    valid = None if valid is None else jnp.asarray(valid)
    got = mosaic_gpu.phase1_scores(sources, banks, queries, seg, valid, stream_kernels=KERNELS, heads=heads,
                                   n_slots=slots, block_d=bd, interpret=True)
    want = _triton_scores(sources, banks, queries, seg, valid, heads)
    _check_tree(got, want, F32_TOL)
    if valid is not None:  # a ruled-out source is not computed: zeros, as the Triton kernel gives
        assert not np.any(np.asarray(got[0][:, 1])) and not np.any(np.asarray(got[1][1]))


def test_option_errors():
    sources, banks, queries = _phase1_inputs(2, 1, 8, 32, 1, KERNELS)
    with pytest.raises(ValueError, match="n_slots=1: must be at least 2"):
        mosaic_gpu.phase1_scores(sources, banks, queries, None, None, stream_kernels=KERNELS, heads=1, n_slots=1,
                                 interpret=True)
    with pytest.raises(ValueError, match="want \\[S, 4, 32\\]"):
        mosaic_gpu.phase1_scores(sources, banks, queries[:, :2], None, None, stream_kernels=KERNELS, heads=1,
                                 interpret=True)
    sources, banks, queries = _phase1_inputs(2, 1, 8, 48, 1, KERNELS)
    with pytest.raises(NotImplementedError, match="no channel chunk"):  # 48 channels: no 32-channel chunk
        mosaic_gpu.phase1_scores(sources, banks, queries, None, None, stream_kernels=KERNELS, heads=1,
                                 interpret=True)


def _direct_mix(sources, banks, p, seg, heads):
    """``acc[s, r] = sum_i p[s, i, r] E_r[x_i]`` with the reference's streams (Eq. 10-11)."""
    n, batch, t_len, d = sources.shape
    streams = reference.expand(sources, banks, KERNELS, seg)  # [n, m, B, T, d]
    weights = jnp.repeat(p[..., :t_len, :], d // heads, axis=-1)  # [S, n, m, B, T, d]
    return jnp.einsum("sirbtc,irbtc->srbtc", weights, streams, precision="highest")


@pytest.mark.parametrize("n, batch, t_len, d, n_targets, heads, valid, cut, dtype, out_dtype, per_target, slots, bd", [
    # two 64-token tiles and a ragged end, a source ruled out, segments, two heads, bf16 sources
    (3, 2, 100, 64, 2, 2, (True, False, True), 37, jnp.bfloat16, jnp.float32, False, 2, None),
    # T shorter than the largest kernel, float32 sources, one output per target, a bf16 state,
    # 3 slots, 16-channel chunks
    (2, 1, 7, 32, 3, 1, None, None, jnp.float32, jnp.bfloat16, True, 3, 16),
    # every source ruled out (a block's first read of an empty stack): zeros
    (2, 1, 70, 32, 2, 1, (False, False), None, jnp.bfloat16, jnp.float32, False, 2, None),
])
@pytest.mark.parametrize("window_fetch", phase1_mixing.MIX_WINDOW_FETCHES)
def test_interpreted_mix_matches_direct_sum(n, batch, t_len, d, n_targets, heads, valid, cut, dtype, out_dtype,
                                            per_target, slots, bd, window_fetch):
    sources, banks, _ = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=dtype)
    seg = None if cut is None else _segments(batch, t_len, cut)
    # non-zero weights on every source, zero where ``valid`` rules one out (as phase 1 gives them);
    # T padded past the tokens, as Triton's tiles leave it
    p = jax.random.uniform(jax.random.key(7), (n_targets, n, len(KERNELS), batch, t_len + 29, heads), minval=0.1)
    if valid is not None:
        p = p * jnp.asarray(valid)[None, :, None, None, None, None]
    got = mosaic_gpu.phase1_mix(sources, banks, p, seg, None if valid is None else jnp.asarray(valid),
                                stream_kernels=KERNELS, heads=heads, out_dtype=out_dtype, per_target=per_target,
                                n_slots=slots, block_d=bd, interpret=True, window_fetch=window_fetch)
    want = _direct_mix(sources, banks, p, seg, heads)
    if per_target:
        assert isinstance(got, list) and len(got) == n_targets
        got = jnp.stack(got)
    assert got.shape == want.shape and got.dtype == out_dtype
    if valid is not None and not any(valid):
        assert not np.any(np.asarray(got)) and not np.any(np.asarray(want))
    else:
        _check_tree(got.astype(jnp.float32), want, 1e-2 if out_dtype == jnp.bfloat16 else F32_TOL)


def _interpreted_mix(valid, slots, *, n_targets, batch, seed, cut, t_len=70, d=128, heads=2):
    """``run(**options)``: the interpreted mixing pass on fixed random inputs (bf16 sources,
    segments cut every ``cut`` tokens, non-zero weights on the ``valid`` sources), as numpy."""
    n = len(valid)
    sources, banks, _ = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=jnp.bfloat16)
    p = jax.random.uniform(jax.random.key(seed), (n_targets, n, len(KERNELS), batch, t_len, heads), minval=0.1)
    p = p * jnp.asarray(valid)[None, :, None, None, None, None]

    def run(**options):
        return np.asarray(mosaic_gpu.phase1_mix(sources, banks, p, _segments(batch, t_len, cut), jnp.asarray(valid),
                                                stream_kernels=KERNELS, heads=heads, n_slots=slots, interpret=True,
                                                **options))

    return run


@pytest.mark.parametrize("valid, slots, n_targets", [
    ((True, False, True, True, True), 3, 5), ((False, True, False, False, False), 2, 8),
    pytest.param((True,) * 5, 3, 8, marks=pytest.mark.slow),
    pytest.param((False,) * 5, 3, 3, marks=pytest.mark.slow)],
    ids=["four_valid_odd_targets", "one_valid_2_slots", "all_valid", "none_valid"])
def test_mix_window_fetches_agree(valid, slots, n_targets):
    """A chunk's windows brought once for all streams (``"per_chunk"``) write bitwise the states of
    each item bringing its own (``MIX_WINDOW_FETCHES``): one valid source (a window is refilled
    for the next chunk right after the last stream used it), more valid sources than slots, an
    odd number of targets (the stores' staging in halves of 3 and 2), two heads, segments, several
    chunks and a ragged end."""
    mix = _interpreted_mix(valid, slots, n_targets=n_targets, batch=2, seed=5, cut=41)
    run = lambda fetch: mix(window_fetch=fetch)  # noqa: E731
    want = run("per_item")
    np.testing.assert_array_equal(run("per_chunk"), want)
    assert np.any(want) == any(valid)
    with pytest.raises(ValueError, match="window_fetch='twice': must be one of"):
        run("twice")


def test_mix_window_fetch_smem():
    """``"per_chunk"`` holds a window per source slot and stages half the targets: at the bench
    shape (9 sources, 8 targets) two programs still fit on an SM, as with ``"per_item"``."""
    kw = dict(block_d=32, stream_kernels=KERNELS, heads=1, x_dtype=jnp.bfloat16, out_dtype=jnp.float32, n_targets=8,
              n_sources=9)
    per_item = mosaic_gpu.mix_smem_bytes(**kw, window_fetch="per_item")
    per_chunk = mosaic_gpu.mix_smem_bytes(**kw, window_fetch="per_chunk")
    assert mosaic_gpu.mix_smem_bytes(**kw) == per_chunk  # the default's count, where it fits
    window = 80 * 40 * 2  # 64 + 16 rows of 32 + 8 bf16 channels
    align = lambda b: -(-b // 1024) * 1024  # noqa: E731  (each buffer from a 1 KiB boundary)
    # 9 windows instead of 3, 4 staged targets fewer, a barrier per source
    assert per_chunk - per_item == align(9 * window) - align(3 * window) - 4 * 64 * 32 * 4 + 9 * 8
    # two programs per SM (228 KiB), 1 KiB of it reserved per program
    assert 2 * (per_chunk + 1024) <= 233472 and 2 * (per_item + 1024) <= 233472


def test_mix_default_window_fetch_falls_back_where_it_does_not_fit(monkeypatch):
    """By default (``"per_chunk"``) a block with more sources than one program's shared memory
    holds windows for (at 32 channels and 2 targets: 32) takes ``"per_item"``; asked for
    explicitly there, ``"per_chunk"`` raises."""
    seen, real = [], phase1_mixing._mix_kernel
    monkeypatch.setattr(phase1_mixing, "_mix_kernel", lambda cfg: seen.append(cfg.window_fetch) or real(cfg))
    kw = dict(block_d=32, stream_kernels=KERNELS, heads=1, x_dtype=jnp.bfloat16, out_dtype=jnp.float32, n_targets=2,
              window_fetch="per_chunk")
    most = max(n for n in range(1, 64) if mosaic_gpu.mix_smem_bytes(**kw, n_sources=n) <= mosaic_gpu.SMEM_BYTES)
    assert most == 31, most

    def lower(n, **kw):
        sources, banks, _ = _phase1_inputs(n, 1, 64, 64, 2, KERNELS, dtype=jnp.bfloat16)
        p = jnp.ones((2, n, len(KERNELS), 1, 64, 1))
        fn = lambda x, b, w: mosaic_gpu.phase1_mix(x, b, w, None, None, stream_kernels=KERNELS, heads=1, **kw)  # noqa: E731
        jax.jit(fn).trace(sources, banks, p).lower(lowering_platforms=("cuda",))

    lower(most)
    lower(most + 1)
    assert seen == ["per_chunk", "per_item"], seen
    del kw["window_fetch"]  # the count of what the default takes: the same fallback
    assert mosaic_gpu.mix_smem_bytes(**kw, n_sources=most) == mosaic_gpu.mix_smem_bytes(
        **kw, n_sources=most, window_fetch="per_chunk")
    assert mosaic_gpu.mix_smem_bytes(**kw, n_sources=most + 1) == mosaic_gpu.mix_smem_bytes(
        **kw, n_sources=most + 1, window_fetch="per_item")
    with pytest.raises(NotImplementedError, match="phase1_mix: no channel chunk"):
        lower(most + 1, window_fetch="per_chunk")


@pytest.mark.parametrize("window_fetch", phase1_mixing.MIX_WINDOW_FETCHES)
def test_mix_lowers_for_sm90(window_fetch):
    """The compiled mixing pass lowers for the H200 with either window fetch."""
    sources, banks, _ = _phase1_inputs(3, 2, 200, 64, 2, KERNELS, dtype=jnp.bfloat16)
    p = jnp.ones((2, 3, len(KERNELS), 2, 200, 1))
    fn = lambda x, b, w, v: mosaic_gpu.phase1_mix(x, b, w, _segments(2, 200, 30), v, stream_kernels=KERNELS,  # noqa: E731
                                                  heads=1, per_target=True, window_fetch=window_fetch)
    text = jax.jit(fn).trace(sources, banks, p, jnp.asarray([True, False, True])).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


def test_mix_errors():
    sources, banks, _ = _phase1_inputs(2, 1, 8, 32, 1, KERNELS)
    p = jnp.ones((1, 2, 4, 1, 8, 1))
    with pytest.raises(ValueError, match="want \\[S, 2, 4, 1, >= 8, H\\]"):
        mosaic_gpu.phase1_mix(sources, banks, p[:, :, :2], None, None, stream_kernels=KERNELS, heads=1,
                              interpret=True)
    with pytest.raises(ValueError, match="last axis is the 2 heads"):
        mosaic_gpu.phase1_mix(sources, banks, p, None, None, stream_kernels=KERNELS, heads=2, interpret=True)
    sources, banks, _ = _phase1_inputs(2, 1, 8, 48, 1, KERNELS)
    with pytest.raises(NotImplementedError, match="phase1_mix: no channel chunk"):
        mosaic_gpu.phase1_mix(sources, banks, p, None, None, stream_kernels=KERNELS, heads=1, interpret=True)


def _op_and_oracle(gpu_kernels, *, n=3, batch=2, t_len=70, d=64, n_targets=2, heads=2, dtype=jnp.bfloat16,
                   valid=(True, False, True), cut=23):
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=dtype)
    seg = None if cut is None else _segments(batch, t_len, cut)
    valid = None if valid is None else jnp.asarray(valid)
    kw = dict(stream_kernels=KERNELS, heads=heads, segment_ids=seg)
    got = _phase1_vjp(lambda *a, **k: api.phase1(*a, implementation="pallas_gpu", backward="pallas",
                                                 gpu_kernels=gpu_kernels, **k), sources, banks, queries, valid, **kw)
    return got, _phase1_vjp(reference.phase1, sources, banks, queries, valid, **kw)


def test_phase1_op_with_mosaic_kernels_matches_reference(monkeypatch):
    """``gpu_kernels="mosaic"``: phase 1's forward scores and mixes with the Mosaic GPU kernels
    and its Pallas backward scores and runs passes 2 and 4 and the transpose with the Mosaic ones
    (interpreted here); state and every gradient (sources, banks, queries) match."""
    calls = {"phase1_scores": 0, "phase1_mix": 0, "phase1_gdots": 0, "phase1_dstreams": 0, "sources_transpose": 0}
    for name in calls:
        real = getattr(mosaic_gpu, name)
        monkeypatch.setattr(mosaic_gpu, name, lambda *a, _real=real, _name=name, **k: calls.__setitem__(
            _name, calls[_name] + 1) or _real(*a, **k))
    (got, got_grads), (want, want_grads) = _op_and_oracle("mosaic", dtype=jnp.float32)
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, F32_TOL)
    assert calls["phase1_scores"] >= 2, "the forward and the backward should both take the Mosaic GPU scoring pass"
    assert calls["phase1_mix"] >= 1, "the forward should take the Mosaic GPU mixing pass"
    assert calls["phase1_gdots"] >= 1 and calls["phase1_dstreams"] >= 1 and calls["sources_transpose"] >= 1, (
        "the Pallas backward should take the Mosaic GPU passes 2 and 4 and the transpose (mosaic_gpu.phase1_backward, "
        "mosaic_gpu.transpose)")


@pytest.mark.parametrize("choice, kernels, interpret, want", [
    ("auto", KERNELS, False, True),
    ("auto", KERNELS, True, False),  # interpret mode: the Triton kernels (the default suite's path)
    ("split_forward", KERNELS, False, True),  # concerns phase 2's forward only
    ("triton", KERNELS, False, False),
    ("mosaic", (0,), True, True),
])
def test_which_scoring_pass_each_choice_takes(choice, kernels, interpret, want):
    """``heuristics.mosaic_phase1`` (the scoring pass) at `base`'s shape (7 bf16 sources of d =
    1024, 8 targets); the TPU back end never takes it and ``"mosaic"`` is an error for a shape it
    does not take."""
    import functools

    from pallas_kernels.depth_attention import heuristics

    takes = functools.partial(heuristics.mosaic_phase1, choice, stream_kernels=kernels, heads=1, n_sources=7,
                              n_targets=8)
    base = dict(backend="triton", d=1024, dtype=jnp.bfloat16, interpret=interpret)
    assert takes(**base) is want
    assert not takes(**dict(base, backend="tpu"))
    if choice == "auto" and want:  # float32 sources: untimed, Triton
        assert not takes(**dict(base, dtype=jnp.float32))
    # the mixing pass: as the scoring pass, for a float32 and a bf16 state (with the padded windows
    # Mosaic's is the faster for both on the H200)
    assert takes("mix", **base) is want
    assert takes("mix", **base, state_dtype=jnp.bfloat16) is want
    if choice == "mosaic":
        with pytest.raises(ValueError, match="phase-1 mixing pass does not take"):
            takes("mix", **dict(base, d=1000, interpret=False))
        with pytest.raises(ValueError, match="phase-1 scoring pass does not take"):
            takes(**dict(base, d=1000, interpret=False))


@pytest.mark.gpu
def test_gpu_phase1_scores_match_triton():
    """On a GPU: the compiled kernel against the compiled Triton kernel (bf16 sources, a source
    ruled out, segments, two heads, ragged T), and the op's state and gradients against the
    oracle with ``gpu_kernels="mosaic"``."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    n, batch, t_len, d, n_targets, heads = 4, 3, 300, 256, 8, 2
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=jnp.bfloat16)
    seg, valid = _segments(batch, t_len, 77), jnp.asarray([True, True, False, True])
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda *a: mosaic_gpu.phase1_scores(*a, stream_kernels=KERNELS, heads=heads))(
            sources, banks, queries, seg, valid)
        tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=12, n_targets=n_targets, backend="triton",
                                    n_streams=4)
        t_pad, seg_p = fused.prepare_tokens(t_len, seg, tiles)
        want = jax.jit(lambda x, b, q, s, v: fused.scores_call(
            fused.pad_tokens(x, 2, t_pad), b, q, s, stream_kernels=KERNELS, heads=heads, tiles=tiles, backend="triton",
            interpret=False, valid=v))(sources, banks, queries, seg_p, valid)
        _check_tree(got, (want[0][..., :t_len, :], want[1][..., :t_len]), 1e-5)
        (g, g_grads), (w, w_grads) = _op_and_oracle("mosaic", t_len=300, d=256, heads=2)
    _check_tree(g, w, 1e-4)
    # Per leaf (sources, banks, queries). The sources' gradient is bf16: within one bf16 rounding
    # (3.6e-3 on the H200, one ulp apart). The banks' is float32 but sums the stream
    # cotangents, which the wide backward writes in the sources' dtype (``fused_bwd_phase1``,
    # "wide"): bf16 inputs, so bf16's tolerance (2.2e-3 on the H200). The queries' is
    # exact (``_query_grads`` splits its operand into bf16 parts).
    for got_leaf, want_leaf, tol in zip(g_grads, w_grads, (1e-2, 1e-2, 1e-4), strict=True):
        _check_grads(got_leaf, want_leaf, tol)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype, window_fetch", [(jnp.float32, "per_item"), (jnp.bfloat16, "per_item"),
                                                       (jnp.float32, "per_chunk")])
def test_gpu_phase1_mix_matches_triton(state_dtype, window_fetch):
    """On a GPU: the compiled mixing kernel against the compiled Triton one (bf16 sources, a
    source ruled out, segments, two heads, ragged T, one output per target), with either window
    fetch (``"per_chunk"``: also bitwise against ``"per_item"``)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    n, batch, t_len, d, n_targets, heads = 4, 3, 300, 256, 8, 2
    sources, banks, _ = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=jnp.bfloat16)
    seg, valid = _segments(batch, t_len, 77), jnp.asarray([True, True, False, True])
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=12, n_targets=n_targets, backend="triton", n_streams=4)
    t_pad, seg_p = fused.prepare_tokens(t_len, seg, tiles)
    p = jax.random.uniform(jax.random.key(7), (n_targets, n, 4, batch, t_pad, heads), minval=0.1)
    p = p * valid[None, :, None, None, None, None]
    mix = lambda fetch: jax.jit(lambda *a: mosaic_gpu.phase1_mix(  # noqa: E731
        *a, stream_kernels=KERNELS, heads=heads, out_dtype=state_dtype, per_target=True, window_fetch=fetch))
    got = mix(window_fetch)(sources, banks, p, seg, valid)
    if window_fetch != "per_item":
        for g, w in zip(got, mix("per_item")(sources, banks, p, seg, valid), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    want = jax.jit(lambda x, b, pp, s, v: fused.mix_call(
        fused.pad_tokens(x, 2, t_pad), b, pp, s, mode="acc", stream_kernels=KERNELS, heads=heads, tiles=tiles,
        backend="triton", interpret=False, out_dtype=state_dtype, valid=v, split_targets=True))(
        sources, banks, p, seg_p, valid)
    tol = 1e-2 if state_dtype == jnp.bfloat16 else 1e-5
    _check_tree([g.astype(jnp.float32) for g in got], [w[..., :t_len, :].astype(jnp.float32) for w in want], tol)
    _check_tree(jnp.stack(got).astype(jnp.float32), _direct_mix(sources, banks, p, seg, heads), tol)
