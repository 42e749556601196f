"""Phase 1's backward passes 2 and 4 in Mosaic GPU (``mosaic_gpu_bwd1.phase1_gdots`` and
``phase1_dstreams``) and its transpose (``mosaic_gpu_bwd1.sources_transpose``) against the Pallas
kernels they replace (``fused_bwd_phase1.gdots_call``, ``dstreams_call`` and
``conv_transpose.sources_transpose``, themselves checked against the XLA closed form through the
whole backward) on random non-zero inputs: interpreted on the CPU, compiled in the GPU-marked test. The model-level
check (phase 1's state and every gradient against the oracle with ``gpu_kernels="mosaic"``, which
takes all three) is ``test_mosaic_gpu_phase1.test_phase1_op_with_mosaic_kernels_matches_reference``."""

from __future__ import annotations

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import (
    _backend, conv_transpose, fused, fused_bwd_phase1, mosaic_gpu, mosaic_gpu_bwd1, tiling,
)
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
    t_pad, seg_p = fused._prepare(t_len, seg, tiles)
    pad = fused._pad_t
    kw = dict(stream_kernels=KERNELS, tiles=tiles, backend=backend, interpret=backend == "interpret")
    ga = [pad(a, 2, t_pad) for a in g_acc] if isinstance(g_acc, list) else pad(g_acc, 3, t_pad)
    x = pad(sources, 2, t_pad)
    gd = fused_bwd_phase1.gdots_call(x, banks, ga, seg_p, valid=valid, **kw)
    gd = jnp.sum(gd.reshape(*gd.shape[:-1], heads, -1), axis=-1)[..., :t_len, :]
    de = fused_bwd_phase1.dstreams_call(x, banks, queries, ga, pad(p, 4, t_pad), pad(dsr, 4, t_pad),
                                        pad(w, 3, t_pad)[..., None], seg_p, heads=heads, out_dtype=jnp.float32,
                                        valid=valid, **kw)
    return gd, de[:, :, :, :t_len]


def _mosaic(args, heads, interpret=True, slots=(None, None), window_fetch=None):
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    kw = dict(stream_kernels=KERNELS, heads=heads, interpret=interpret, n_slots=slots[0], group_slots=slots[1])
    gd = mosaic_gpu_bwd1.phase1_gdots(sources, banks, g_acc, seg, valid, **kw)
    de = mosaic_gpu_bwd1.phase1_dstreams(sources, banks, queries, g_acc, p, dsr, w, seg, valid,
                                         out_dtype=jnp.float32, window_fetch=window_fetch, **kw)
    return gd, de


def _dstreams(args, heads, **kw):
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    return mosaic_gpu_bwd1.phase1_dstreams(sources, banks, queries, g_acc, p, dsr, w, seg, valid,
                                           stream_kernels=KERNELS, heads=heads, out_dtype=jnp.float32, **kw)


def _lowered(mode, args, **kw):
    """``mode``'s kernel (``mosaic_gpu_bwd1.MODES``) on ``_inputs``' ``args`` with the keywords
    ``kw``, lowered for the H200: the StableHLO text."""
    sources, banks, queries, g_acc, p, dsr, w, seg, valid = args
    if mode == "gdots":
        fn, inputs = (lambda *a: mosaic_gpu_bwd1.phase1_gdots(*a, **kw)), (sources, banks, g_acc, seg, valid)
    else:
        fn = lambda *a: mosaic_gpu_bwd1.phase1_dstreams(*a, out_dtype=jnp.bfloat16, **kw)  # noqa: E731
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


# an option against the default (19 s on 2 cores): every case in the slow suite
@pytest.mark.slow
@pytest.mark.parametrize("valid", [(True, False, False), pytest.param((True, True, True), marks=pytest.mark.slow),
                                   pytest.param((False, False, False), marks=pytest.mark.slow)],
                         ids=["one_valid", "all_valid", "none_valid"])
def test_item_decodes_agree(monkeypatch, valid):
    """Both kernels with the next item carried through their loops write bitwise what they write
    decoding it from its flat index (``DEFAULT_ITEM_DECODE``): one valid source (every refill
    crosses a group), two heads over two channel chunks each, segments."""
    args = _inputs(3, 1, 70, 128, 2, 2, valid, 30, jnp.bfloat16, jnp.float32, True)

    def run(decode):
        monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_ITEM_DECODE", decode)
        return [np.asarray(a) for a in _mosaic(args, 2)]

    (want_gd, want_de), (got_gd, got_de) = run("divide"), run("carried")
    live = _live(args[-1], 3)
    np.testing.assert_array_equal(got_gd, want_gd)
    np.testing.assert_array_equal(got_de[live], want_de[live])  # the ruled-out sources' dE is not written
    assert np.any(want_gd) == any(valid)
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_ITEM_DECODE", "guess")
    with pytest.raises(ValueError, match="DEFAULT_ITEM_DECODE='guess': must be one of"):
        _mosaic(args, 2)


@pytest.mark.parametrize("valid", [(True, False, True), pytest.param((True, False, False), marks=pytest.mark.slow),
                                   pytest.param((False, False, False), marks=pytest.mark.slow)],
                         ids=["ruled_out", "one_valid", "none_valid"])
def test_dstreams_window_fetches_agree(valid):
    """``dstreams`` with a chunk's lag windows brought once for all its streams (``"per_chunk"``:
    groups ordered (head, chunk, stream), a buffer per valid source refilled as the last stream
    is done with it) writes bitwise what it writes with each item bringing its own: two heads of
    two channel chunks each (the refill crosses into the next head), segments, a source ruled
    out, one valid source, none."""
    args = _inputs(3, 1, 70, 128, 2, 2, valid, 30, jnp.bfloat16, jnp.float32, True)
    want, got = (np.asarray(_dstreams(args, 2, interpret=True, window_fetch=wf)) for wf in mosaic_gpu_bwd1.WINDOW_FETCHES)
    live = _live(args[-1], 3)
    np.testing.assert_array_equal(got[live], want[live])
    assert np.all(np.isfinite(want[live])) and (np.abs(want[live]).max() > 1 if live.any() else True)


@pytest.mark.parametrize("valid, d, heads", [((True, False, True), 128, 2), ((True, True, False), 32, 1),
                                             pytest.param((True, False, False), 128, 2, marks=pytest.mark.slow),
                                             pytest.param((False, False, False), 128, 2, marks=pytest.mark.slow)],
                         ids=["ruled_out", "one_group", "one_valid", "none_valid"])
def test_stream_programs_give_the_same_bits(valid, d, heads):
    """Both kernels with a program per stream (``stream_programs="split"``: a leading grid axis,
    each program one stream's (head, chunk) groups and its own item numbering) write bitwise what
    one program walking every stream writes: two heads of two channel chunks each, segments, a
    source ruled out, one valid source, none; and one chunk, one head, so a program has fewer
    groups than group buffers (the model's smoke shape)."""
    args = _inputs(3, 1, 70, d, 2, heads, valid, 30, jnp.bfloat16, jnp.float32, True)
    sources, banks, queries, g_acc, p, dsr, w, seg, ok = args
    out = {}
    for programs in mosaic_gpu_bwd1.STREAM_PROGRAMS:
        kw = dict(interpret=True, stream_programs=programs)
        out[programs] = (np.asarray(mosaic_gpu_bwd1.phase1_gdots(sources, banks, g_acc, seg, ok, stream_kernels=KERNELS,
                                                                 heads=heads, **kw)),
                         np.asarray(_dstreams(args, heads, **kw)))
    live = _live(ok, 3)
    np.testing.assert_array_equal(out["split"][0], out["joint"][0])
    np.testing.assert_array_equal(out["split"][1][live], out["joint"][1][live])
    assert np.any(out["joint"][0]) == any(valid)


def _recorded_programs(monkeypatch):
    seen, real = [], mosaic_gpu_bwd1._kernel
    monkeypatch.setattr(mosaic_gpu_bwd1, "_kernel",
                        lambda cfg: seen.append((cfg.mode, cfg.window_fetch, cfg.stream_split)) or real(cfg))
    return seen


def test_stream_programs_choice_and_its_errors(monkeypatch):
    """``stream_programs`` given wins; None takes ``DEFAULT_STREAM_PROGRAMS``, or "joint" beside an
    explicit ``window_fetch="per_chunk"`` (which shares windows across one program's streams); a
    split ``dstreams`` falls back to "per_item" where the default window fetch is "per_chunk";
    "split" with an explicit "per_chunk", an unknown value and an unknown default raise."""
    seen = _recorded_programs(monkeypatch)
    args = _inputs(3, 1, 64, 64, 2, 1, None, None, jnp.bfloat16, jnp.float32, True)

    def lower(mode, **kw):
        _lowered(mode, args, stream_kernels=KERNELS, heads=1, **kw)

    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_STREAM_PROGRAMS", {"gdots": "split", "dstreams": "joint"})
    lower("gdots")
    lower("gdots", stream_programs="joint")
    lower("dstreams")
    lower("dstreams", stream_programs="split")
    lower("dstreams", window_fetch="per_chunk")
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_STREAM_PROGRAMS", {"gdots": "split", "dstreams": "split"})
    lower("dstreams", window_fetch="per_chunk")  # the explicit fetch takes one program for all streams
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_DSTREAMS_WINDOW_FETCH", "per_chunk")
    lower("dstreams")  # the default fetch gives way to the split
    assert seen == [("gdots", "per_item", True), ("gdots", "per_item", False), ("dstreams", "per_item", False),
                    ("dstreams", "per_item", True), ("dstreams", "per_chunk", False),
                    ("dstreams", "per_chunk", False), ("dstreams", "per_item", True)], seen
    with pytest.raises(ValueError, match="stream_programs='split' takes window_fetch='per_item'"):
        lower("dstreams", stream_programs="split", window_fetch="per_chunk")
    with pytest.raises(ValueError, match="phase1_gdots: stream_programs='sometimes': must be one of"):
        lower("gdots", stream_programs="sometimes")
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_STREAM_PROGRAMS", {"gdots": "halves"})
    with pytest.raises(ValueError, match=r"DEFAULT_STREAM_PROGRAMS\['gdots'\]='halves': must be one of"):
        lower("gdots")


@pytest.mark.parametrize("mode", mosaic_gpu_bwd1.MODES)
def test_split_stream_programs_lower_for_sm90(mode):
    """A program per stream lowers for the H200 (three grid axes), segments and several tiles."""
    args = _inputs(3, 2, 200, 64, 2, 1, (True, True, False), 30, jnp.bfloat16, jnp.float32, True)
    text = _lowered(mode, args, stream_kernels=KERNELS, heads=1, stream_programs="split")
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.parametrize("valid, programs", [((True, False, True), "joint"),
                                             pytest.param((True, False, True), "split", marks=pytest.mark.slow),
                                             pytest.param((True, False, False), "joint", marks=pytest.mark.slow),
                                             pytest.param((False, False, False), "joint", marks=pytest.mark.slow)],
                         ids=["ruled_out", "ruled_out_split", "one_valid", "none_valid"])
def test_dstreams_rows_fetches_agree(valid, programs):
    """``dstreams`` with each valid source's per-token rows brought once per (head, stream)
    (``rows_fetch="per_stream"``: a buffer per source, refilled between the runs) writes bitwise
    what it writes with each item bringing its own: two heads of two channel chunks each (three
    refills, one across heads), segments, a source ruled out, one valid source, none; and with a
    program per stream."""
    args = _inputs(3, 1, 70, 128, 2, 2, valid, 30, jnp.bfloat16, jnp.float32, True)
    want, got = (np.asarray(_dstreams(args, 2, interpret=True, rows_fetch=rf, stream_programs=programs))
                 for rf in mosaic_gpu_bwd1.ROWS_FETCHES)
    live = _live(args[-1], 3)
    np.testing.assert_array_equal(got[live], want[live])
    assert np.all(np.isfinite(want[live])) and (np.abs(want[live]).max() > 1 if live.any() else True)


def test_dstreams_rows_fetch_choice_and_its_errors(monkeypatch):
    """``rows_fetch`` given wins; the default's "per_stream" (several streams) is taken with per-item
    windows where it fits (the bench shape's 9 sources and 8 targets at 32 channels) and gives way to
    "per_item" with per-chunk windows; one stream takes its own default ("per_item", untimed with
    the rows per stream); an explicit "per_stream" with per-chunk windows, an unknown value and an
    unknown default raise."""
    seen, real = [], mosaic_gpu_bwd1._kernel
    monkeypatch.setattr(mosaic_gpu_bwd1, "_kernel", lambda cfg: seen.append((cfg.window_fetch, cfg.rows_fetch))
                        or real(cfg))
    smem = functools.partial(mosaic_gpu_bwd1.smem_bytes, block_d=32, stream_kernels=KERNELS, heads=1,
                             x_dtype=jnp.bfloat16, acc_dtype=jnp.float32, n_targets=8, n_sources=9, mode="dstreams")
    align = lambda b: -(-b // 1024) * 1024  # noqa: E731  (each buffer from a 1 KiB boundary)
    assert smem(rows_fetch="per_stream") <= mosaic_gpu.SMEM_BYTES
    assert smem(rows_fetch="per_stream") - smem() == align(9 * 17 * 64 * 4) - align(3 * 17 * 64 * 4) + 8 * 9
    args = _inputs(3, 1, 64, 64, 2, 1, None, None, jnp.bfloat16, jnp.float32, True)

    def lower(**kw):
        jax.jit(lambda *a: _dstreams(a, 1, **kw)).trace(*args).lower(lowering_platforms=("cuda",))

    monkeypatch.setitem(mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH, "several", "per_item")
    lower()
    lower(rows_fetch="per_stream")
    monkeypatch.setitem(mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH, "several", "per_stream")
    lower()
    lower(window_fetch="per_chunk")
    lower(rows_fetch="per_item")
    assert seen == [("per_item", "per_item"), ("per_item", "per_stream"), ("per_item", "per_stream"),
                    ("per_chunk", "per_item"), ("per_item", "per_item")], seen
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", (0,))  # one stream, as the value channel hands it
    one = _inputs(3, 1, 64, 128, 2, 1, None, None, jnp.bfloat16, jnp.bfloat16, True)
    seen.clear()
    jax.jit(lambda *a: _dstreams((a[0], None, *a[2:]), 1)).trace(*one).lower(lowering_platforms=("cuda",))
    assert seen == [("per_item", "per_stream")], seen
    monkeypatch.setitem(mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH, "one_stream", "per_item")
    seen.clear()
    jax.jit(lambda *a: _dstreams((a[0], None, *a[2:]), 1)).trace(*one).lower(lowering_platforms=("cuda",))
    assert seen == [("per_item", "per_item")], seen
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", (0, 4, 8, 12))
    with pytest.raises(ValueError, match="rows_fetch='per_stream' takes window_fetch='per_item'"):
        lower(rows_fetch="per_stream", window_fetch="per_chunk")
    with pytest.raises(ValueError, match="rows_fetch='per_token': must be one of"):
        lower(rows_fetch="per_token")
    monkeypatch.setitem(mosaic_gpu_bwd1.DEFAULT_DSTREAMS_ROWS_FETCH, "several", "sometimes")
    with pytest.raises(ValueError, match=r"DEFAULT_DSTREAMS_ROWS_FETCH\['several'\]='sometimes': must be one of"):
        lower()


@pytest.mark.parametrize("programs", mosaic_gpu_bwd1.STREAM_PROGRAMS)
def test_dstreams_rows_per_stream_lower_for_sm90(programs):
    """``dstreams`` with its rows per (head, stream) lowers for the H200, two heads, segments,
    several tiles, one program for all streams and one per stream."""
    args = _inputs(3, 2, 200, 128, 2, 2, (True, True, False), 30, jnp.bfloat16, jnp.float32, True)
    fn = lambda *a: _dstreams(a, 2, rows_fetch="per_stream", stream_programs=programs)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.slow
def test_dstreams_per_chunk_matches_the_pallas_pass_with_one_group_buffer():
    """``"per_chunk"`` against the Triton pass with one group buffer and two items in flight (the
    ring turns over within a group), a bf16 state's cotangent and T under a tile."""
    args = _inputs(2, 1, 50, 32, 2, 1, None, 20, jnp.bfloat16, jnp.bfloat16, True)
    got = _dstreams(args, 1, interpret=True, window_fetch="per_chunk", n_slots=2, group_slots=1)
    _check_tree(got, _triton_form(args, 1)[1], F32_TOL)


def _recorded_fetches(monkeypatch):
    seen, real = [], mosaic_gpu_bwd1._kernel
    monkeypatch.setattr(mosaic_gpu_bwd1, "_kernel", lambda cfg: seen.append((cfg.mode, cfg.window_fetch)) or real(cfg))
    return seen


def test_dstreams_window_fetch_choice_and_its_errors(monkeypatch):
    """The default's ``"per_chunk"`` holds a window per source: taken where one program's shared
    memory holds them (the bench shape's 9 sources at 32 channels with a bf16 ``dE``; 8 with the
    float32 ``dE`` these tests ask for), ``"per_item"`` where it does not (12); asked for
    explicitly where it does not fit, it raises, as an unknown value does. ``gdots`` always takes
    ``"per_item"``. (A program per stream takes ``"per_item"``: ``dstreams``' one program for all
    streams here.)"""
    seen = _recorded_fetches(monkeypatch)
    monkeypatch.setitem(mosaic_gpu_bwd1.DEFAULT_STREAM_PROGRAMS, "dstreams", "joint")
    smem = functools.partial(mosaic_gpu_bwd1.smem_bytes, block_d=32, stream_kernels=KERNELS, heads=1,
                             x_dtype=jnp.bfloat16, acc_dtype=jnp.float32, n_targets=8, mode="dstreams")
    assert smem(n_sources=9, window_fetch="per_chunk") <= mosaic_gpu.SMEM_BYTES < smem(n_sources=12,
                                                                                        window_fetch="per_chunk")
    align = lambda b: -(-b // 1024) * 1024  # noqa: E731  (each buffer from a 1 KiB boundary)
    assert smem(n_sources=9, window_fetch="per_chunk") - smem(n_sources=9) == align(9 * 6400) - align(3 * 6400) + 8 * 9

    def lower(n, **kw):
        args = _inputs(n, 1, 64, 64, 8, 1, None, None, jnp.bfloat16, jnp.float32, True)
        fn = lambda *a: _dstreams(a, 1, **kw)  # noqa: E731
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))

    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_DSTREAMS_WINDOW_FETCH", "per_chunk")
    lower(8)
    lower(12)
    assert seen == [("dstreams", "per_chunk"), ("dstreams", "per_item")], seen
    with pytest.raises(NotImplementedError, match="phase1_dstreams: no channel chunk"):
        lower(12, window_fetch="per_chunk")
    with pytest.raises(ValueError, match="window_fetch='per_lag': must be one of"):
        lower(2, window_fetch="per_lag")
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_DSTREAMS_WINDOW_FETCH", "sometimes")
    with pytest.raises(ValueError, match="DEFAULT_DSTREAMS_WINDOW_FETCH='sometimes': must be one of"):
        lower(2)
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_DSTREAMS_WINDOW_FETCH", "per_chunk")
    seen.clear()
    args = _inputs(3, 1, 64, 64, 2, 1, None, None, jnp.bfloat16, jnp.float32, True)
    jax.jit(lambda *a: _mosaic(a, 1, interpret=False)).trace(*args).lower(lowering_platforms=("cuda",))
    assert seen == [("gdots", "per_item"), ("dstreams", "per_chunk")], seen


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
        mosaic_gpu_bwd1.phase1_gdots(sources, banks, g_acc[:, :3], seg, valid, **kw)
    with pytest.raises(ValueError, match=r"dsr \(2, 2, 4, 1, 8, 2\): want \[2, 2, 4, 1, >= 8, 1\]"):
        mosaic_gpu_bwd1.phase1_dstreams(sources, banks, queries, g_acc, p, jnp.concatenate([dsr, dsr], -1), w, seg,
                                        valid, out_dtype=jnp.float32, **kw)
    with pytest.raises(ValueError, match=r"queries \(1, 4, 32\): want \[2, 4, 32\]"):
        mosaic_gpu_bwd1.phase1_dstreams(sources, banks, queries[:1], g_acc, p, dsr, w, seg, valid,
                                        out_dtype=jnp.float32, **kw)
    with pytest.raises(ValueError, match="group_slots=3 must be 1 or 2"):
        mosaic_gpu_bwd1.phase1_gdots(sources, banks, g_acc, seg, valid, group_slots=3, **kw)
    with pytest.raises(NotImplementedError, match="no channel chunk"):
        mosaic_gpu_bwd1.phase1_gdots(sources[..., :24], banks[..., :24], g_acc[..., :24], seg, valid, **kw)


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
    got = mosaic_gpu_bwd1.sources_transpose(*args, stream_kernels=KERNELS, out_dtype=jnp.float32, interpret=True)
    tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(KERNELS), n_targets=1, backend="tpu",
                                n_streams=len(KERNELS)).with_min_block_t(16)
    want = conv_transpose.sources_transpose(*args, stream_kernels=KERNELS, tiles=tiles, backend="interpret",
                                            interpret=True, out_dtype=jnp.float32)
    _check_tree(got, want, F32_TOL)
    if valid is not None:
        live = np.asarray(valid)
        assert not np.any(np.asarray(got[0][~live])) and not np.any(np.asarray(got[1][~live]))


def test_interpreted_transpose_taps_held_per_source_give_the_same_bits():
    """``taps="per_source"`` (held in registers through a source's tiles, copied a source ahead)
    changes where the taps come from, not their values: the same bits as ``"per_tile"``, three
    valid sources of four (the taps' double buffer and its barriers go round more than once, past
    a ruled-out source), segments, a ragged end."""
    args = _transpose_inputs(4, 2, 150, 16, (True, False, True, True), 37)
    want, got = (mosaic_gpu_bwd1.sources_transpose(*args, stream_kernels=KERNELS, out_dtype=jnp.float32, taps=taps,
                                                   interpret=True) for taps in ("per_tile", "per_source"))
    for g, w in zip(got, want):
        assert np.any(np.asarray(w))
        assert bool(jnp.all(g == w))


def test_transpose_refuses_bad_inputs():
    d_streams, x, banks, seg, valid = _transpose_inputs(2, 1, 8, 8, None, None)
    kw = dict(stream_kernels=KERNELS, interpret=True)
    with pytest.raises(ValueError, match="do not match 4 streams"):
        mosaic_gpu_bwd1.sources_transpose(d_streams[:, :3], x, banks, seg, valid, **kw)
    with pytest.raises(ValueError, match=r"banks \(2, 23, 8\): want \(2, 24, 8\)"):
        mosaic_gpu_bwd1.sources_transpose(d_streams, x, banks[:, 1:], seg, valid, **kw)
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        mosaic_gpu_bwd1.sources_transpose(d_streams[..., :4], x[..., :4], banks[..., :4], seg, valid, **kw)
    with pytest.raises(NotImplementedError, match="kernels up to 17 taps"):
        mosaic_gpu_bwd1.check_transpose_shape(d=8, stream_kernels=(0, 20))
    with pytest.raises(ValueError, match="taps='per_block': must be one of"):
        mosaic_gpu_bwd1.sources_transpose(d_streams, x, banks, seg, valid, taps="per_block", **kw)
    with pytest.raises(ValueError, match="widen='fast': must be one of"):
        mosaic_gpu_bwd1.sources_transpose(d_streams, x, banks, seg, valid, widen="fast", **kw)


@pytest.mark.parametrize("choice, auto_bwd, interpret, want", [
    ("auto", True, False, True),
    ("auto", False, False, False),  # AUTO_PHASE1_BWD off: Triton's passes
    ("auto", True, True, False),  # interpret mode: the Triton kernels (the default suite's path)
    ("mosaic", False, True, True),
    ("triton", True, False, False),
])
def test_which_choice_takes_the_kernels(monkeypatch, choice, auto_bwd, interpret, want):
    """``_backend._mosaic_phase1`` for both kernels at `base`'s shape (float32 and bf16 state);
    ``"mosaic"`` is an error for a shape they do not take."""
    monkeypatch.setattr(_backend, "AUTO_PHASE1_BWD", auto_bwd)
    monkeypatch.setattr(_backend, "AUTO_TRANSPOSE", auto_bwd)
    static = types.SimpleNamespace(stream_kernels=KERNELS, heads=1)
    src = jax.ShapeDtypeStruct((7, 64, 1024, 1024), jnp.bfloat16)
    for kernel in (*mosaic_gpu_bwd1.MODES, "transpose"):
        for state_dtype in (jnp.float32, jnp.bfloat16):
            assert _backend._mosaic_phase1(choice, "triton", static, src, 8, interpret, kernel=kernel,
                                           state_dtype=state_dtype) is want
        assert not _backend._mosaic_phase1(choice, "tpu", static, src, 8, interpret, kernel=kernel)
        if choice == "mosaic":
            odd = jax.ShapeDtypeStruct((7, 64, 1024, 1004), jnp.bfloat16)
            with pytest.raises(ValueError, match="does not take|must be a multiple of 8"):
                _backend._mosaic_phase1("mosaic", "triton", static, odd, 8, False, kernel=kernel)
    # no conv: the transpose is a sum over the streams, no kernel (also under "mosaic")
    no_conv = types.SimpleNamespace(stream_kernels=(0, 0), heads=1)
    assert not _backend._mosaic_phase1(choice, "triton", no_conv, src, 8, interpret, kernel="transpose")


@pytest.mark.parametrize("mode", mosaic_gpu_bwd1.MODES)
@pytest.mark.parametrize("t_len, segments, group_slots", [pytest.param(64, False, 2, marks=pytest.mark.slow),
                                                          (200, True, 2), (200, True, 1)])
def test_kernels_lower_for_sm90(mode, t_len, segments, group_slots):
    """The compiled (not interpreted) kernels lower for the H200 in Lane semantics for one and
    several token tiles, with and without segments, with one and two group buffers."""
    args = _inputs(3, 2, t_len, 64, 2, 1, (True, True, False), 30 if segments else None, jnp.bfloat16,
                   jnp.float32, True)
    text = _lowered(mode, args, stream_kernels=KERNELS, heads=1, group_slots=group_slots)
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.parametrize("t_len, segments, group_slots", [(200, True, 2), pytest.param(64, False, 1,
                                                                                     marks=pytest.mark.slow)])
def test_dstreams_per_chunk_lowers_for_sm90(t_len, segments, group_slots):
    """``dstreams`` with its windows per chunk lowers for the H200 (compiled for sm_90a, ptxas
    included, it takes 255 registers, no spills)."""
    args = _inputs(3, 2, t_len, 128, 2, 2, (True, True, False), 30 if segments else None, jnp.bfloat16,
                   jnp.float32, True)
    fn = lambda *a: _dstreams(a, 2, window_fetch="per_chunk", group_slots=group_slots)  # noqa: E731
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.parametrize("mode", mosaic_gpu_bwd1.MODES)
def test_divided_item_decode_lowers_for_sm90(monkeypatch, mode):
    """The kernels with the next item decoded from its flat index (the option; the default
    carries it through the loops) lower for the H200 (``benchmarks/mgpu/sass_stats.py``
    compiles both forms for sm_90a, ptxas included)."""
    monkeypatch.setattr(mosaic_gpu_bwd1, "DEFAULT_ITEM_DECODE", "divide")
    args = _inputs(3, 2, 200, 64, 2, 1, (True, True, False), 30, jnp.bfloat16, jnp.float32, True)
    text = _lowered(mode, args, stream_kernels=KERNELS, heads=1)
    assert text.count("custom_call @mosaic_gpu_v2") == 1


def _single_stream_bf16_configs(monkeypatch):
    """Set one stream (``KERNELS``), record each kernel's ``_Config``: ``[(mode, block_d, n_slots,
    group_slots, ga_registers)]``."""
    monkeypatch.setattr(sys.modules[__name__], "KERNELS", (0,))
    seen, real = [], mosaic_gpu_bwd1._kernel
    monkeypatch.setattr(mosaic_gpu_bwd1, "_kernel", lambda cfg: seen.append(
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
    assert seen == [(mode, *cfg[3:], *cfg[:3]) for mode, cfg in mosaic_gpu_bwd1.SINGLE_STREAM_BF16_GA.items()], seen
    want_gd, want_de = _triton_form(args, heads)
    _check_tree(got_gd, want_gd, F32_TOL)
    live = _live(args[-1], 3)
    _check_tree(got_de[live], want_de[live], F32_TOL)
    seen.clear()
    _mosaic(_inputs(2, 1, 64, 128, 2, 4, None, None, jnp.bfloat16, jnp.bfloat16, True), 4)
    assert [c[1:] for c in seen] == [(32, 2, 1, True), (32, 3, 2, True)], seen


@pytest.mark.parametrize("mode", mosaic_gpu_bwd1.MODES)
def test_single_stream_bf16_ga_lowers_for_sm90(monkeypatch, mode):
    """The compiled kernels of ``SINGLE_STREAM_BF16_GA`` lower for the H200."""
    seen = _single_stream_bf16_configs(monkeypatch)
    args = _inputs(3, 2, 200, 128, 2, 1, (True, True, False), None, jnp.bfloat16, jnp.bfloat16, True)
    text = _lowered(mode, (args[0], None, *args[2:]), stream_kernels=(0,), heads=1)  # no conv: no bank
    assert text.count("custom_call @mosaic_gpu_v2") == 1
    assert seen == [(mode, 64, 2, 1, False)], seen


@pytest.mark.parametrize("t_len, segments, taps, widen", [pytest.param(64, False, None, None, marks=pytest.mark.slow),
                                                         (200, True, None, None), (200, True, "per_tile", None),
                                                         (200, True, None, "bits")])
def test_transpose_lowers_for_sm90(monkeypatch, t_len, segments, taps, widen):
    """The compiled transpose lowers for the H200 (one and several tiles: its x window starts 16
    rows before token 0, its cotangents' window reaches 16 rows past the tile), with its taps per
    source (the default) and per tile, and with its bf16 rows widened in place (``widen_bits`` on
    each lag row it reads: per conv stream of K taps, K of its ``dE`` and K of the source's; the
    identity stream's ``dE``)."""
    seen, real = [], mosaic_gpu_bwd1.widen_bits
    monkeypatch.setattr(mosaic_gpu_bwd1, "widen_bits", lambda plgpu, x: seen.append(x.dtype) or real(plgpu, x))
    inputs = _transpose_inputs(3, 2, t_len, 64, (True, True, False), 30 if segments else None)
    text = jax.jit(lambda *a: mosaic_gpu_bwd1.sources_transpose(*a, stream_kernels=KERNELS, taps=taps,
                                                                widen=widen)).trace(
        *inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1
    assert len(seen) == (0 if widen is None else 1 + 2 * sum(KERNELS)), seen


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
    for fetch in mosaic_gpu_bwd1.WINDOW_FETCHES:  # dstreams with its lag windows per item and per chunk
        got_de = jax.jit(lambda *a: _dstreams(a, heads, window_fetch=fetch))(*args)  # noqa: B023
        _check_tree(got_de[live], want[1][live], 1e-5)
    for programs in mosaic_gpu_bwd1.STREAM_PROGRAMS:  # both kernels with a program per stream, and one for all
        got = jax.jit(lambda *a: (  # noqa: B023
            mosaic_gpu_bwd1.phase1_gdots(*a[:2], a[3], *a[7:], stream_kernels=KERNELS, heads=heads,
                                         stream_programs=programs),  # noqa: B023
            _dstreams(a, heads, stream_programs=programs)))(*args)  # noqa: B023
        _check_tree(got[0], want[0], 1e-5)
        _check_tree(got[1][live], want[1][live], 1e-5)
        for rows in mosaic_gpu_bwd1.ROWS_FETCHES:  # dstreams' rows per item and per (head, stream)
            got_de = jax.jit(lambda *a: _dstreams(a, heads, rows_fetch=rows, stream_programs=programs))(  # noqa: B023
                *args)
            _check_tree(got_de[live], want[1][live], 1e-5)
    # the transpose (bf16 cotangents and sources, float32 outputs)
    t_args = _transpose_inputs(4, 3, 300, 256, (True, True, False, True), 77)
    got = jax.jit(lambda *a: mosaic_gpu_bwd1.sources_transpose(*a, stream_kernels=KERNELS,
                                                               out_dtype=jnp.float32))(*t_args)
    tiles = tiling.choose_tiles(d=256, heads=1, max_kernel=max(KERNELS), n_targets=1, backend="triton",
                                n_streams=len(KERNELS))
    want = jax.jit(lambda *a: conv_transpose.sources_transpose(*a, stream_kernels=KERNELS, tiles=tiles,
                                                               backend="triton", interpret=False,
                                                               out_dtype=jnp.float32))(*t_args)
    _check_tree(got, want, 1e-5)
    other = jax.jit(lambda *a: mosaic_gpu_bwd1.sources_transpose(*a, stream_kernels=KERNELS, out_dtype=jnp.float32,
                                                                 taps="per_tile"))(*t_args)
    for o, g in zip(other, got):  # the taps per tile give the default's (per source) bits
        assert bool(jnp.all(o == g))
    widened = jax.jit(lambda *a: mosaic_gpu_bwd1.sources_transpose(*a, stream_kernels=KERNELS, out_dtype=jnp.float32,
                                                                   widen="bits"))(*t_args)
    _check_tree(widened, want, 1e-5)  # bf16 widened in place (ptxas may order the sums differently)
