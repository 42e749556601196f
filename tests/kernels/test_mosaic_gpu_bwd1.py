"""Phase 1's backward passes 2 and 4 in Mosaic GPU (``mosaic_gpu.phase1_gdots`` and
``phase1_dstreams``) and its transpose (``mosaic_gpu.sources_transpose``) against the Pallas
kernels they replace (``fused_bwd_phase1.gdots_call``, ``dstreams_call`` and
``conv_transpose.sources_transpose``, themselves checked against the XLA closed form through the
whole backward) on random non-zero inputs: interpreted on the CPU, compiled in the GPU-marked test. The model-level
check (phase 1's state and every gradient against the oracle with ``gpu_kernels="mosaic"``, which
takes all three) is ``test_mosaic_gpu_phase1.test_phase1_op_with_mosaic_kernels_matches_reference``."""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import conv_transpose, fused, fused_bwd_phase1, heuristics, mosaic_gpu, tiling
from pallas_kernels.depth_attention.mosaic_gpu import phase1_backward
from tests.kernels.test_depth_attention_fused import F32_TOL, _check_tree, _phase1_inputs
from tests.kernels.test_mosaic_gpu_phase1 import _segments

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

KERNELS = (0, 4, 8, 12)

CASES = [
    # name, n, B, T, d, S, heads, valid, segment cut, sources' dtype, g_A's dtype, g_A per target,
    # (n_slots, group_slots): two 64-token tiles and a ragged end, two heads (a chunk each),
    # a source ruled out, segment boundaries inside the lag windows, g_A as the model hands it
    # over (one array per target); T under the largest kernel, float32 sources, one array;
    # a bf16 state's cotangent with one group buffer and two items in flight
    ("segments_heads2_ruled_out", 3, 2, 100, 64, 2, 2, (True, False, True), 37, jnp.bfloat16, jnp.float32, True,
     (None, None)),
    ("T_shorter_than_kernel", 2, 1, 7, 32, 1, 1, None, None, jnp.float32, jnp.float32, False, (None, None)),
    ("bf16_state_one_group_slot", 2, 1, 64, 32, 2, 1, None, 20, jnp.bfloat16, jnp.bfloat16, True, (2, 1)),
]


def _inputs(n, batch, t_len, d, n_targets, heads, valid, cut, dtype, acc_dtype, per_target):
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, KERNELS, dtype=dtype)
    m = len(KERNELS)
    ks = jax.random.split(jax.random.key(11), 4)
    g_acc = jax.random.normal(ks[0], (n_targets, m, batch, t_len, d)).astype(acc_dtype)
    g_acc = [g_acc[s] for s in range(n_targets)] if per_target else g_acc
    p = jax.random.uniform(ks[1], (n_targets, n, m, batch, t_len, heads), minval=0.1)
    dsr = jax.random.normal(ks[2], (n_targets, n, m, batch, t_len, heads))
    w = jax.random.normal(ks[3], (n, m, batch, t_len))
    seg = None if cut is None else _segments(batch, t_len, cut)
    valid = None if valid is None else jnp.asarray(valid)
    return sources, banks, queries, g_acc, p, dsr, w, seg, valid


def _triton_form(args, heads, backend="interpret"):
    """``gdots_call`` (its chunk partials summed into heads) and ``dstreams_call`` on the same
    inputs, T padded to their tiles and cut back."""
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    n, batch, t_len, d = sources.shape
    n_targets = queries.shape[0]
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(KERNELS), n_targets=n_targets,
                                backend="tpu" if backend == "interpret" else backend,
                                n_streams=len(KERNELS))
    if backend == "interpret":
        tiles = tiles.with_min_block_t(16)
    t_pad, seg_p = fused.prepare_tokens(t_len, seg, tiles)
    pad = fused.pad_tokens
    kw = dict(stream_kernels=KERNELS, tiles=tiles, backend=backend, interpret=backend == "interpret")
    ga = [pad(a, 2, t_pad) for a in g_acc] if isinstance(g_acc, list) else pad(g_acc, 3, t_pad)
    x = pad(sources, 2, t_pad)
    gd = fused_bwd_phase1.gdots_call(x, banks, ga, seg_p, valid=valid, **kw)
    gd = jnp.sum(gd.reshape(*gd.shape[:-1], heads, -1), axis=-1)[..., :t_len, :]
    de = fused_bwd_phase1.dstreams_call(x, banks, queries, ga, pad(p, 4, t_pad), pad(dsr, 4, t_pad),
                                        pad(w, 3, t_pad)[..., None], seg_p, heads=heads, out_dtype=jnp.float32,
                                        valid=valid, **kw)
    return gd, de[:, :, :, :t_len]


def _mosaic(args, heads, interpret=True, slots=(None, None)):
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    kw = dict(stream_kernels=KERNELS, heads=heads, interpret=interpret, n_slots=slots[0], group_slots=slots[1])
    gd = mosaic_gpu.phase1_gdots(sources, banks, g_acc, seg, valid, **kw)
    de = mosaic_gpu.phase1_dstreams(sources, banks, queries, g_acc, p, dsr, w, seg, valid,
                                         out_dtype=jnp.float32, **kw)
    return gd, de


def _dstreams(args, heads, **kw):
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    return mosaic_gpu.phase1_dstreams(sources, banks, queries, g_acc, p, dsr, w, seg, valid,
                                           stream_kernels=KERNELS, heads=heads, out_dtype=jnp.float32, **kw)


def _lowered(mode, args, **kw):
    """``mode``'s kernel (``phase1_backward.MODES``) on ``_inputs``' ``args`` with the keywords
    ``kw``, lowered for the H200: the StableHLO text."""
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    if mode == "gdots":
        fn, inputs = (lambda *a: mosaic_gpu.phase1_gdots(*a, **kw)), (sources, banks, g_acc, seg, valid)
    else:
        fn = lambda *a: mosaic_gpu.phase1_dstreams(*a, out_dtype=jnp.bfloat16, **kw)  # noqa: E731
        inputs = (sources, banks, queries, g_acc, p, dsr, w, seg, valid)
    return jax.jit(fn).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()


def _live(valid, n):
    return np.ones(n, bool) if valid is None else np.asarray(valid)


@pytest.mark.parametrize("case", [CASES[0], *(pytest.param(c, marks=pytest.mark.slow) for c in CASES[1:])],
                         ids=[c[0] for c in CASES])
def test_interpreted_kernels_match_the_pallas_passes(case):
    _, n, batch, t_len, d, n_targets, heads, valid, cut, dtype, acc_dtype, per_target, slots = case
    args = _inputs(n, batch, t_len, d, n_targets, heads, valid, cut, dtype, acc_dtype, per_target)
    got_gd, got_de = _mosaic(args, heads, slots=slots)
    want_gd, want_de = _triton_form(args, heads)
    _check_tree(got_gd, want_gd, F32_TOL)
    live = _live(args[-1], n)
    _check_tree(got_de[live], want_de[live], F32_TOL)  # the ruled-out sources' dE is not written
    if not live.all():  # a ruled-out source is not computed: zeros, as the Triton pass gives
        assert not np.any(np.asarray(got_gd[:, ~live]))


@pytest.mark.parametrize("valid", [(True, False, True), pytest.param((True, False, False), marks=pytest.mark.slow),
                                   pytest.param((False, False, False), marks=pytest.mark.slow)],
                         ids=["ruled_out", "one_valid", "none_valid"])
def test_dstreams_rows_fetches_agree(valid):
    """``dstreams`` with each valid source's per-token rows brought once per (head, stream)
    (``rows_fetch="per_stream"``: a buffer per source, refilled between the heads) writes bitwise
    what it writes with each item bringing its own: two heads of two channel chunks each,
    segments, a source ruled out, one valid source, none."""
    args = _inputs(3, 1, 70, 128, 2, 2, valid, 30, jnp.bfloat16, jnp.float32, True)
    want, got = (np.asarray(_dstreams(args, 2, interpret=True, rows_fetch=rf)) for rf in phase1_backward.ROWS_FETCHES)
    live = _live(args[-1], 3)
    np.testing.assert_array_equal(got[live], want[live])
    assert np.all(np.isfinite(want[live])) and (np.abs(want[live]).max() > 1 if live.any() else True)


def test_dstreams_rows_fetch_choice_and_its_errors(monkeypatch):
    """``rows_fetch`` given wins; by default "per_stream" is taken where it fits (the bench shape's
    9 sources and 8 targets at 32 channels; one stream too) and "per_item" where it does not (50
    sources); an unknown value raises."""
    seen, real = [], phase1_backward._kernel
    monkeypatch.setattr(phase1_backward, "_kernel", lambda cfg: seen.append(cfg.rows_fetch) or real(cfg))
    smem = functools.partial(phase1_backward.smem_bytes, block_d=32, stream_kernels=KERNELS, heads=1,
                             x_dtype=jnp.bfloat16, acc_dtype=jnp.float32, n_targets=8, mode="dstreams")
    align = lambda b: -(-b // 1024) * 1024  # noqa: E731  (each buffer from a 1 KiB boundary)
    assert smem(n_sources=9, rows_fetch="per_stream") <= mosaic_gpu.SMEM_BYTES
    assert smem(n_sources=9, rows_fetch="per_stream") - smem(n_sources=9) == (
        align(9 * 17 * 64 * 4) - align(3 * 17 * 64 * 4) + 8 * 9)
    assert smem(n_sources=50, rows_fetch="per_stream") > mosaic_gpu.SMEM_BYTES >= smem(n_sources=50)

    def lower(n=3, n_targets=2, **kw):
        args = _inputs(n, 1, 64, 64, n_targets, 1, None, None, jnp.bfloat16, jnp.float32, True)
        jax.jit(lambda *a: _dstreams(a, 1, **kw)).trace(*args).lower(lowering_platforms=("cuda",))

    lower()
    lower(rows_fetch="per_item")
    lower(50, 8)
    assert seen == ["per_stream", "per_item", "per_item"], seen
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", (0,))  # one stream, as the value channel hands it
    one = _inputs(3, 1, 64, 128, 2, 1, None, None, jnp.bfloat16, jnp.bfloat16, True)
    seen.clear()
    jax.jit(lambda *a: _dstreams((a[0], None, *a[2:]), 1)).trace(*one).lower(lowering_platforms=("cuda",))
    assert seen == ["per_stream"], seen
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", (0, 4, 8, 12))
    with pytest.raises(ValueError, match="rows_fetch='per_token': must be one of"):
        lower(rows_fetch="per_token")


def test_dstreams_rows_per_stream_lower_for_sm90():
    """``dstreams`` with its rows per (head, stream) lowers for the H200, two heads, segments,
    several tiles."""
    args = _inputs(3, 2, 200, 128, 2, 2, (True, True, False), 30, jnp.bfloat16, jnp.float32, True)
    fn = lambda *a: _dstreams(a, 2, rows_fetch="per_stream")  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.slow
def test_segments_matter():
    """The conv restarts at a segment start inside the kernels: dropping the ids changes both
    outputs (so the cases above check the masks, not a no-op)."""
    args = _inputs(2, 1, 64, 32, 1, 1, None, 20, jnp.float32, jnp.float32, False)
    with_seg = _mosaic(args, 1)
    without = _mosaic(args[:-2] + (None, args[-1]), 1)
    for a, b in zip(with_seg, without):
        assert float(jnp.max(jnp.abs(a - b))) > 1e-3


def test_kernels_refuse_bad_inputs():
    args = _inputs(2, 1, 8, 32, 2, 1, None, None, jnp.float32, jnp.float32, False)
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    kw = dict(stream_kernels=KERNELS, heads=1, interpret=True)
    with pytest.raises(ValueError, match=r"g_acc per target \(3, 1, 8, 32\): want \[4, 1, >= 8, 32\]"):
        mosaic_gpu.phase1_gdots(sources, banks, g_acc[:, :3], seg, valid, **kw)
    with pytest.raises(ValueError, match=r"dsr \(2, 2, 4, 1, 8, 2\): want \[2, 2, 4, 1, >= 8, 1\]"):
        mosaic_gpu.phase1_dstreams(sources, banks, queries, g_acc, p, jnp.concatenate([dsr, dsr], -1), w, seg,
                                        valid, out_dtype=jnp.float32, **kw)
    with pytest.raises(ValueError, match=r"queries \(1, 4, 32\): want \[2, 4, 32\]"):
        mosaic_gpu.phase1_dstreams(sources, banks, queries[:1], g_acc, p, dsr, w, seg, valid,
                                        out_dtype=jnp.float32, **kw)
    with pytest.raises(ValueError, match="group_slots=3 must be 1 or 2"):
        mosaic_gpu.phase1_gdots(sources, banks, g_acc, seg, valid, group_slots=3, **kw)
    with pytest.raises(NotImplementedError, match="no channel chunk"):
        mosaic_gpu.phase1_gdots(sources[..., :24], banks[..., :24], g_acc[..., :24], seg, valid, **kw)


TRANSPOSE_CASES = [
    # name, n, B, T, d, valid, segment cut: two tiles and a ragged end (rows ahead past T), two
    # channel chunks, a source ruled out, segments; T under the largest kernel, one chunk
    ("segments_ruled_out", 3, 2, 100, 16, (True, False, True), 37),
    ("T_shorter_than_kernel", 2, 1, 7, 8, None, None),
]


def _transpose_inputs(n, batch, t_len, d, valid, cut):
    ks = jax.random.split(jax.random.key(5), 3)
    d_streams = jax.random.normal(ks[0], (n, len(KERNELS), batch, t_len, d), jnp.bfloat16)
    x = jax.random.normal(ks[1], (n, batch, t_len, d), jnp.bfloat16)
    banks = jax.random.normal(ks[2], (n, sum(KERNELS), d))
    return d_streams, x, banks, None if cut is None else _segments(batch, t_len, cut), (
        None if valid is None else jnp.asarray(valid))


@pytest.mark.parametrize("case", [TRANSPOSE_CASES[0], pytest.param(TRANSPOSE_CASES[1], marks=pytest.mark.slow)],
                         ids=[c[0] for c in TRANSPOSE_CASES])
def test_interpreted_transpose_matches_the_pallas_kernel(case):
    """``d x`` (zeros for a ruled-out source) and the bank gradient against the Pallas kernel."""
    _, n, batch, t_len, d, valid, cut = case
    args = _transpose_inputs(n, batch, t_len, d, valid, cut)
    got = mosaic_gpu.sources_transpose(*args, stream_kernels=KERNELS, out_dtype=jnp.float32, interpret=True)
    tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(KERNELS), n_targets=1, backend="tpu",
                                n_streams=len(KERNELS)).with_min_block_t(16)
    want = conv_transpose.sources_transpose(*args, stream_kernels=KERNELS, tiles=tiles, backend="interpret",
                                            interpret=True, out_dtype=jnp.float32)
    _check_tree(got, want, F32_TOL)
    if valid is not None:
        live = np.asarray(valid)
        assert not np.any(np.asarray(got[0][~live])) and not np.any(np.asarray(got[1][~live]))


def test_transpose_refuses_bad_inputs():
    d_streams, x, banks, seg, valid = _transpose_inputs(2, 1, 8, 8, None, None)
    kw = dict(stream_kernels=KERNELS, interpret=True)
    with pytest.raises(ValueError, match="do not match 4 streams"):
        mosaic_gpu.sources_transpose(d_streams[:, :3], x, banks, seg, valid, **kw)
    with pytest.raises(ValueError, match=r"banks \(2, 23, 8\): want \(2, 24, 8\)"):
        mosaic_gpu.sources_transpose(d_streams, x, banks[:, 1:], seg, valid, **kw)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        mosaic_gpu.sources_transpose(d_streams[..., :4], x[..., :4], banks[..., :4], seg, valid, **kw)
    with pytest.raises(NotImplementedError, match="kernels up to 17 taps"):
        mosaic_gpu.check_transpose_shape(d=8, stream_kernels=(0, 20))


@pytest.mark.parametrize("choice, auto_bwd, interpret, want", [
    ("auto", True, False, True),
    ("auto", False, False, False),  # AUTO_PHASE1_BWD off: Triton's passes
    ("auto", True, True, False),  # interpret mode: the Triton kernels (the default suite's path)
    ("mosaic", False, True, True),
    ("triton", True, False, False),
])
def test_which_choice_takes_the_kernels(monkeypatch, choice, auto_bwd, interpret, want):
    """``heuristics.mosaic_phase1`` for both kernels and the transpose at `base`'s shape (7 bf16
    sources of d = 1024, 8 targets; float32 and bf16 state); ``"mosaic"`` is an error for a shape
    they do not take."""
    monkeypatch.setattr(heuristics, "AUTO_PHASE1_BWD", auto_bwd)
    monkeypatch.setattr(heuristics, "AUTO_TRANSPOSE", auto_bwd)

    def takes(choice, kernel, backend="triton", stream_kernels=KERNELS, d=1024, interpret=interpret, **kw):
        return heuristics.mosaic_phase1(choice, kernel, backend=backend, stream_kernels=stream_kernels, heads=1, d=d,
                                        n_sources=7, n_targets=8, dtype=jnp.bfloat16, interpret=interpret, **kw)

    for kernel in (*phase1_backward.MODES, "transpose"):
        for state_dtype in (jnp.float32, jnp.bfloat16):
            assert takes(choice, kernel, state_dtype=state_dtype) is want
        assert not takes(choice, kernel, backend="tpu")
        if choice == "mosaic":
            with pytest.raises(ValueError, match="does not take|must be a multiple of 8"):
                takes("mosaic", kernel, d=1004, interpret=False)
    # no conv: the transpose is a sum over the streams, no kernel (also under "mosaic")
    assert not takes(choice, "transpose", stream_kernels=(0, 0))


@pytest.mark.parametrize("mode", phase1_backward.MODES)
@pytest.mark.parametrize("t_len, segments, group_slots", [pytest.param(64, False, 2, marks=pytest.mark.slow),
                                                          (200, True, 2), (200, True, 1)])
def test_kernels_lower_for_sm90(mode, t_len, segments, group_slots):
    """The compiled (not interpreted) kernels lower for the H200 in Lane semantics for one and
    several token tiles, with and without segments, with one and two group buffers."""
    args = _inputs(3, 2, t_len, 64, 2, 1, (True, True, False), 30 if segments else None, jnp.bfloat16,
                   jnp.float32, True)
    text = _lowered(mode, args, stream_kernels=KERNELS, heads=1, group_slots=group_slots)
    assert text.count("custom_call @mosaic_gpu_v2") == 1


def _single_stream_bf16_configs(monkeypatch):
    """Set one stream (``KERNELS``), record each kernel's ``_Config``: ``[(mode, block_d, n_slots,
    group_slots, ga_registers)]``."""
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", (0,))
    seen, real = [], phase1_backward._kernel
    monkeypatch.setattr(phase1_backward, "_kernel", lambda cfg: seen.append(
        (cfg.mode, cfg.block_d, cfg.n_slots, cfg.group_slots, cfg.ga_registers)) or real(cfg))
    return seen


@pytest.mark.parametrize("heads", [1, 2])
def test_single_stream_bf16_ga_takes_its_config_and_matches_the_pallas_passes(monkeypatch, heads):
    """One stream with a bf16 ``g_A`` (the value channel's ``dh``): the kernels take
    ``SINGLE_STREAM_BF16_GA`` (64-channel chunks, ``g_A`` from shared memory) and give the Triton
    passes' values; 64 channels that do not divide a head (d = 128, 4 heads) keep the defaults."""
    seen = _single_stream_bf16_configs(monkeypatch)
    args = _inputs(3, 2, 100, 128, 2, heads, (True, False, True), 37, jnp.bfloat16, jnp.bfloat16, True)
    got_gd, got_de = _mosaic(args, heads)
    assert seen == [(mode, *cfg[3:], *cfg[:3]) for mode, cfg in phase1_backward.SINGLE_STREAM_BF16_GA.items()], seen
    want_gd, want_de = _triton_form(args, heads)
    _check_tree(got_gd, want_gd, F32_TOL)
    live = _live(args[-1], 3)
    _check_tree(got_de[live], want_de[live], F32_TOL)
    seen.clear()
    _mosaic(_inputs(2, 1, 64, 128, 2, 4, None, None, jnp.bfloat16, jnp.bfloat16, True), 4)
    assert [c[1:] for c in seen] == [(32, 2, 1, True), (32, 3, 2, True)], seen


@pytest.mark.parametrize("mode", phase1_backward.MODES)
def test_single_stream_bf16_ga_lowers_for_sm90(monkeypatch, mode):
    """The compiled kernels of ``SINGLE_STREAM_BF16_GA`` lower for the H200."""
    seen = _single_stream_bf16_configs(monkeypatch)
    args = _inputs(3, 2, 200, 128, 2, 1, (True, True, False), None, jnp.bfloat16, jnp.bfloat16, True)
    text = _lowered(mode, (args[0], None, *args[2:]), stream_kernels=(0,), heads=1)  # no conv: no bank
    assert text.count("custom_call @mosaic_gpu_v2") == 1
    assert seen == [(mode, 64, 2, 1, False)], seen


@pytest.mark.parametrize("t_len, segments", [pytest.param(64, False, marks=pytest.mark.slow), (200, True)])
def test_transpose_lowers_for_sm90(t_len, segments):
    """The compiled transpose lowers for the H200 (one and several tiles: its x window starts 16
    rows before token 0, its cotangents' window reaches 16 rows past the tile)."""
    inputs = _transpose_inputs(3, 2, t_len, 64, (True, True, False), 30 if segments else None)
    text = jax.jit(lambda *a: mosaic_gpu.sources_transpose(*a, stream_kernels=KERNELS)).trace(
        *inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.gpu
def test_gpu_kernels_match_the_triton_passes():
    """On a GPU: the compiled kernels against the compiled Triton passes (bf16 sources, a source
    ruled out, segments, two heads, ragged T, g_A per target), and the transpose against Triton's."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    heads = 2
    args = _inputs(4, 3, 300, 256, 8, heads, (True, True, False, True), 77, jnp.bfloat16, jnp.float32, True)
    got = jax.jit(lambda *a: _mosaic(a, heads, interpret=False))(*args)
    want = jax.jit(lambda *a: _triton_form(a, heads, backend="triton"))(*args)
    live = _live(args[-1], 4)
    _check_tree(got[0], want[0], 1e-5)
    _check_tree(got[1][live], want[1][live], 1e-5)
    for rows in phase1_backward.ROWS_FETCHES:  # dstreams' rows per item and per (head, stream)
        got_de = jax.jit(lambda *a: _dstreams(a, heads, rows_fetch=rows))(*args)  # noqa: B023
        _check_tree(got_de[live], want[1][live], 1e-5)
    # the transpose (bf16 cotangents and sources, float32 outputs)
    t_args = _transpose_inputs(4, 3, 300, 256, (True, True, False, True), 77)
    got = jax.jit(lambda *a: mosaic_gpu.sources_transpose(*a, stream_kernels=KERNELS,
                                                               out_dtype=jnp.float32))(*t_args)
    tiles = tiling.choose_tiles(d=256, heads=1, max_kernel=max(KERNELS), n_targets=1, backend="triton",
                                n_streams=len(KERNELS))
    want = jax.jit(lambda *a: conv_transpose.sources_transpose(*a, stream_kernels=KERNELS, tiles=tiles,
                                                               backend="triton", interpret=False,
                                                               out_dtype=jnp.float32))(*t_args)
    _check_tree(got, want, 1e-5)
