"""Phase 2 in Mosaic GPU (``pallas_kernels/depth_attention/mosaic_gpu.py``) against the oracle:
the fused forward (``phase2_fused_forward``), the backward's gate-statistics and ``d_acc``
passes (``phase2_backward_state``) and its input pass (``phase2_backward_inputs``; its own
tests are in ``test_mosaic_gpu_inputs.py``). On the CPU they run in Pallas' Mosaic GPU interpret
mode (``gpu_kernels="mosaic"`` takes all three; ``"auto"`` takes them on a GPU, for several streams); the forward's per-token scores feed the Pallas backward, so the
gradients check them too. The GPU-marked test runs the compiled kernels (TMA's zero fill
before token 0 instead of the interpreted pad)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, mosaic_gpu, reference
from tests.kernels.test_depth_attention_fused import F32_TOL, _check_tree, _phase2_inputs, _rel, _rnd, jit_vjp

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

CASES = [
    # name, B, T, d, kernels, heads, include, segment cut, fuse; two 64-token tiles and more
    # than two channel chunks per head where the interpreter's time allows
    ("msar_gate_segments_ragged_T", 2, 100, 96, (0, 4, 8, 12), 1, True, 37, "gate"),
    ("msar_gate_heads2_no_partial", 1, 70, 128, (0, 4, 8, 12), 2, False, 9, "gate"),
    ("msar_mean", 1, 64, 64, (0, 4, 8, 12), 1, True, None, "mean"),
    ("attnres_m1", 2, 20, 64, (0,), 1, True, None, "gate"),
    ("mhar_heads4_mean", 1, 30, 128, (0,), 4, True, 5, "mean"),
    ("T_shorter_than_kernel", 1, 7, 32, (0, 4, 8, 12), 1, True, None, "gate"),
]


def _segments(batch, t_len, cut):
    seg = np.zeros((batch, t_len), np.int32)
    seg[0, cut:] = 1
    seg[-1, cut // 2:] = 2  # a boundary inside the first lag window of row -1 too
    return jnp.asarray(seg)


def _run(case, gpu_kernels, dtype=jnp.float32, state_dtype=jnp.float32):
    _, batch, t_len, d, kernels, heads, include, cut, fuse = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    state = state._replace(acc=state.acc.astype(state_dtype))
    partial = partial.astype(dtype)
    seg = None if cut is None else _segments(batch, t_len, cut)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    gate = gate if fuse == "gate" else None
    impl = dict(implementation="pallas_gpu", backward="pallas", gpu_kernels=gpu_kernels)
    fn = (lambda st, x, b, q, g: api.phase2_fused(st, x, b, q, include, g, **impl, **kw)) if gpu_kernels else (
        lambda st, x, b, q, g: reference.phase2_fused(st, x, b, q, include, g, **kw))
    return jit_vjp(fn, (state, partial, bank, query, gate), lambda out: _rnd(99, out.shape))


def _params():
    fast = {"msar_gate_segments_ragged_T", "attnres_m1"}  # about 25 s together on 2 cores
    return [pytest.param(c, id=c[0], marks=() if c[0] in fast else (pytest.mark.slow,)) for c in CASES]


@pytest.mark.parametrize("case", _params())
def test_interpreted_forward_and_grads_match_reference(case):
    got, got_grads = _run(case, "mosaic")
    want, want_grads = _run(case, None)
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, 2e-5)  # the tolerance of the Triton path's same test


def _check_grads(got_grads, want_grads, tol):
    """Float32 gradients within ``tol``; the partial's and a bf16 state's, rounded to bf16 (2^-9
    relative), within 1e-2; an excluded partial's max gradient (0 in closed form) near 0."""
    leaves = list(zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True))
    scale = max(float(np.max(np.abs(np.asarray(w, np.float64)))) for _, w in leaves)
    for g, w in leaves:
        if not np.any(np.asarray(g)):
            assert float(np.max(np.abs(np.asarray(w, np.float64)))) < tol * scale
            continue
        assert _rel(g, w) < (tol if g.dtype == jnp.float32 else 1e-2), (g.shape, _rel(g, w))


@pytest.mark.slow
def test_interpreted_bf16_partial_and_state():
    case = CASES[0]
    got, got_grads = _run(case, "mosaic", jnp.bfloat16, jnp.bfloat16)
    want, want_grads = _run(case, None, jnp.bfloat16, jnp.bfloat16)
    _check_tree(got, want, F32_TOL)  # the same bf16 inputs, both computed in float32
    _check_grads(got_grads, want_grads, 2e-5)


def test_lag_bits_follow_the_reference_masks():
    seg = _segments(3, 40, 13)
    bits = np.asarray(mosaic_gpu.lag_bits(seg, 40, 12))
    masks = np.asarray(reference._lag_masks(seg, 40, 12, 3))
    for delta in range(12):
        np.testing.assert_array_equal((bits >> delta) & 1, masks[delta])


def test_block_d_choice_and_shared_memory():
    kw = dict(stream_kernels=(0, 4, 8, 12), x_dtype=jnp.bfloat16, acc_dtype=jnp.float32, out_dtype=jnp.bfloat16)
    assert mosaic_gpu.choose_block_d(d=1024, heads=1, **kw) == 32
    # a float32 partial doubles the aligned lag windows past the shared memory; one padded window
    # per chunk fits (``"auto"`` still runs a float32 partial on Triton: untimed in Mosaic)
    aligned = functools.partial(mosaic_gpu.smem_bytes, windows="aligned")
    assert mosaic_gpu.choose_block_d(d=1024, heads=1, **dict(kw, x_dtype=jnp.float32), smem=aligned) is None
    assert mosaic_gpu.choose_block_d(d=1024, heads=1, **dict(kw, x_dtype=jnp.float32)) == 32
    assert mosaic_gpu.choose_block_d(d=1024, heads=1, **dict(kw, x_dtype=jnp.float32, stream_kernels=(0,))) == 32
    assert mosaic_gpu.choose_block_d(d=48, heads=1, **kw) is None  # no chunk divides the head
    # MSAR at `base` with a float32 state fits both kernels (the H200's 227 KiB per block; the
    # backward's with the model's bf16 output cotangent)
    for smem, kernel in ((mosaic_gpu.smem_bytes, "forward"),
                         (functools.partial(mosaic_gpu.state_smem_bytes, dh_dtype=jnp.bfloat16), "backward_state")):
        by_windows = {w: smem(block_d=32, **dict(kw, heads=1), windows=w) for w in mosaic_gpu.WINDOWS}
        assert 150_000 < by_windows["aligned"] <= mosaic_gpu.SMEM_BYTES
        # windows=None counts the kernel's own placement
        assert smem(block_d=32, **dict(kw, heads=1)) == by_windows[mosaic_gpu.KERNEL_WINDOWS[kernel]]
        # the windows' buffer (two slots, bf16), from a 1 KiB boundary as Pallas places every buffer
        windows = lambda rows, width=32: -(-2 * rows * width * 2 // 1024) * 1024  # noqa: E731
        # one window per lag modulo 8: 8 windows of 72 rows instead of 12 of 64
        assert by_windows["per_lag"] - by_windows["aligned"] == windows(12 * 64) - windows(8 * 72)
        # one window of 64 + 16 rows per chunk: two programs fit an SM (228 KiB) where one did
        assert by_windows["aligned"] - by_windows["single"] == windows(8 * 72) - windows(80)
        assert 2 * (by_windows["single"] + 1024) <= 233472 < 2 * (by_windows["aligned"] + 1024)
        assert by_windows["padded"] - by_windows["single"] == windows(80, 32 + mosaic_gpu.WINDOW_PAD) - windows(80)


@pytest.mark.parametrize("max_lag, n_lags, want", [
    # (window, first row in it, rows, lag of its first row) per copy; lag w + 8 q at row 8 (extra - q)
    (12, 12, [(0, 0, 72, 8), (1, 0, 72, 9), (2, 0, 72, 10), (3, 0, 72, 11), (4, 8, 64, 4), (5, 8, 64, 5),
              (6, 8, 64, 6), (7, 8, 64, 7)]),
    (12, 4, [(0, 8, 64, 0), (1, 8, 64, 1), (2, 8, 64, 2), (3, 8, 64, 3)]),  # a short stream of the same tile
    (12, 0, [(0, 8, 64, 0)]),  # the identity stream: lag 0
    (4, 4, [(0, 0, 64, 0), (1, 0, 64, 1), (2, 0, 64, 2), (3, 0, 64, 3)]),
    (20, 20, [(w, 0, 80, w + 16) for w in range(4)] + [(w, 8, 72, w + 8) for w in range(4, 8)]),
])
def test_aligned_lag_windows(max_lag, n_lags, want):
    lags = mosaic_gpu._Lags.of(max_lag, "aligned")
    assert lags.copies(n_lags) == want
    assert lags.rows == 64 + 8 * ((max_lag - 1) // 8) and lags.count == min(8, max_lag)
    for w, first, rows, lag in want:  # every lag lands at a multiple of 8, inside its window
        for delta in range(lag % 8, lag + 1, 8):
            row = 8 * (lags.extra - delta // 8)
            assert row % 8 == 0 and first <= row and row + 64 <= first + rows and delta % 8 == w
    per_lag = mosaic_gpu._Lags.of(max_lag, "per_lag")
    assert per_lag.copies(n_lags) == [(k, 0, 64, k) for k in range(max(1, n_lags))]


def test_option_errors_and_auto_off_the_gpu(monkeypatch):
    case = CASES[3]
    with pytest.raises(ValueError, match="gpu_kernels='cuda'"):
        _run(case, "cuda")
    _, batch, t_len, _, kernels, heads, include, _, _ = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, 24, kernels, heads)
    with pytest.raises(ValueError, match="does not take d=24"):
        api.phase2_fused(state, partial, bank, query, True, None, implementation="pallas_gpu", gpu_kernels="mosaic",
                         stream_kernels=kernels)
    with pytest.raises(ValueError, match="tpu back end"):
        api.phase2_fused(state, partial, bank, query, True, None, implementation="pallas_tpu", gpu_kernels="mosaic",
                         stream_kernels=kernels)

    def refuse(*a, **k):
        raise AssertionError("interpret mode with gpu_kernels='auto' must keep the Triton kernels")

    monkeypatch.setattr(mosaic_gpu, "phase2_fused_forward", refuse)
    monkeypatch.setattr(mosaic_gpu, "phase2_backward_state", refuse)
    msar = CASES[5]  # several streams: what "auto" gives the Mosaic kernel on a GPU
    got, _ = _run(msar, "auto")
    want, _ = _run(msar, None)
    _check_tree(got, want, F32_TOL)


@pytest.mark.parametrize("choice, kernels, forward, backward_state", [
    ("auto", (0, 4, 8, 12), True, True),
    ("auto", (0,), False, False),  # one stream (AttnRes) keeps Triton
    ("mosaic", (0,), True, True),
    ("triton", (0, 4, 8, 12), False, False),
    ("split_forward", (0, 4, 8, 12), True, True),  # model.save_read_outputs: the forward as two kernels
    ("split_forward", (0,), False, False),
])
def test_which_kernels_each_choice_takes_on_a_gpu(choice, kernels, forward, backward_state):
    """``_backend._mosaic_phase2``'s choice for a compiled (not interpreted) GPU call at `base`'s
    shape; the ``"fuse=None"`` phase 2 and the TPU back end never take Mosaic GPU."""
    import types

    from pallas_kernels.depth_attention import _backend

    static = types.SimpleNamespace(fuse="gate", stream_kernels=kernels, heads=1)
    partial = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.bfloat16)
    state = reference.SoftmaxState(None, None, jax.ShapeDtypeStruct((len(kernels), 64, 1024, 1024), jnp.float32))
    got = [_backend._mosaic_phase2(choice, "triton", static, partial, state, jnp.bfloat16, False, kernel=k)
           for k in ("forward", "backward_state")]
    assert got == [forward, backward_state]
    # a float32 partial with a bf16 state fits shared memory but is untimed in Mosaic:
    # "auto" keeps Triton; "mosaic" takes it
    f32, bf16_state = jax.ShapeDtypeStruct(partial.shape, jnp.float32), state._replace(
        acc=jax.ShapeDtypeStruct(state.acc.shape, jnp.bfloat16))
    assert _backend._mosaic_phase2(choice, "triton", static, f32, bf16_state, jnp.bfloat16, False) is (
        choice == "mosaic")
    assert not _backend._mosaic_phase2(choice, "tpu", static, partial, state, jnp.bfloat16, False)
    assert not _backend._mosaic_phase2(choice, "triton", types.SimpleNamespace(fuse=None, stream_kernels=kernels,
                                                                                 heads=1), partial, state,
                                       jnp.float32, False)


GPU_CASES = [  # each configuration's two Mosaic GPU lowerings take 15-35 s of CPU each
    (("msar", 2, 300, 256, (0, 4, 8, 12), 2, True, 77, "gate"), jnp.float32, "same"),
    (("msar_reread_reverse", 2, 300, 256, (0, 4, 8, 12), 2, True, 77, "gate"), jnp.float32, "reverse"),
    (("msar_mean_excluded", 3, 128, 512, (0, 4, 8, 12), 1, False, 40, "mean"), jnp.bfloat16, "same"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case, state_dtype, reread_order", GPU_CASES, ids=[c[0][0] for c in GPU_CASES])
def test_gpu_mosaic_matches_reference(monkeypatch, case, state_dtype, reread_order):
    """On a GPU: the compiled forward and the backward's kernel, both taken by
    ``gpu_kernels="auto"``, against the oracle (bf16 partial; a float32 and a bf16 state;
    segments, two heads, ragged T, an excluded partial, mean fusion; the state's second read in
    each ``REREAD_ORDERS``)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    monkeypatch.setattr(mosaic_gpu, "REREAD_ORDER", reread_order)
    calls = []
    for name in ("phase2_fused_forward", "phase2_backward_state", "phase2_backward_inputs"):
        real = getattr(mosaic_gpu, name)
        monkeypatch.setattr(mosaic_gpu, name, lambda *a, real=real, name=name, **k: calls.append(name) or real(*a, **k))
    with jax.default_matmul_precision("highest"):
        got, got_grads = _run(case, "auto", jnp.bfloat16, state_dtype)
        want, want_grads = _run(case, None, jnp.bfloat16, state_dtype)
    _check_tree(got, want, 1e-4)  # h in float32 from the same bf16 inputs
    _check_grads(got_grads, want_grads, 1e-4)
    # the forward is traced once for the value and once for the VJP (jit_vjp)
    assert set(calls) == {"phase2_fused_forward", "phase2_backward_state", "phase2_backward_inputs"}, calls


def _forward(case, split, **opts):
    _, batch, t_len, d, kernels, heads, include, cut, fuse = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = None if cut is None else _segments(batch, t_len, cut)
    return mosaic_gpu.phase2_fused_forward(state, partial.astype(jnp.bfloat16), bank, query, include,
                                           gate if fuse == "gate" else None, seg, fuse=fuse, stream_kernels=kernels,
                                           heads=heads, eps=1e-6, gate_eps=1e-6, split=split, **opts)


@pytest.mark.parametrize("case", [pytest.param(CASES[0], id=CASES[0][0]),
                                  pytest.param(CASES[1], id=CASES[1][0], marks=pytest.mark.slow)])
def test_split_forward_gives_the_same_values(case):
    """``split=True`` (the scores kernel, then the merge kernel from the scores it wrote) gives
    ``h`` and the scores of the one-kernel forward with the gate's statistics in their own pass
    to the last bit, and those of the default one-kernel forward (``DEFAULT_GATE_STATS``,
    "in_scores": the scoring pass sums them) with the same scores and ``h`` to float32 rounding
    (interpreted; segments and a ragged tile; two heads with the partial excluded). Asked for
    "in_scores", the split form refuses (its scores kernel does not sum them)."""
    split = _forward(case, True, interpret=True)
    own, default = _forward(case, False, gate_stats="own_pass", interpret=True), _forward(case, False, interpret=True)
    for got, want in zip(jax.tree.leaves(split), jax.tree.leaves(own), strict=True):
        assert np.any(np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    (h, scores), (h_default, scores_default) = split, default
    assert _rel(h_default, h) < F32_TOL
    for got, want in zip(scores_default, scores, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="split=True"):
        _forward(case, True, gate_stats="in_scores", interpret=True)


@pytest.mark.slow  # two Mosaic GPU lowerings (about 30 s of CPU)
def test_split_forward_lowers_for_sm90():
    """Both kernels of the split forward lower for the H200; the scores kernel holds no state,
    gate or output buffers."""
    case = ("msar", 2, 128, 64, (0, 4, 8, 12), 1, True, 30, "gate")
    text = jax.jit(lambda: _forward(case, True)).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 2


@pytest.mark.slow  # options against the default (98 s on 2 cores); the default's oracle checks stay in the default suite
def test_window_placements_agree_in_every_kernel():
    """``windows="aligned"`` (one lag window per lag modulo 8, loads at multiples of 8 rows),
    ``"single"`` (one window, loads at any row offset), ``"padded"`` (the same with wider rows,
    their pad past d on the last chunk) and ``"per_lag"`` put the same rows in
    the same sums: the four Mosaic GPU kernels give the same values to the last bit
    (interpreted; segments, a ragged second tile, bf16 inputs)."""
    from tests.kernels.test_depth_attention_fused import _phase1_inputs

    kernels, batch, t_len, d, heads = (0, 4, 8, 12), 2, 100, 64, 2
    seg = _segments(batch, t_len, 37)
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    partial = partial.astype(jnp.bfloat16)
    m = len(kernels)
    coef = [jax.random.uniform(jax.random.key(k), (m, batch, t_len, heads), minval=0.1) for k in range(3)]
    dh = _rnd(5, (batch, t_len, d))
    sources, banks, queries = _phase1_inputs(3, batch, t_len, d, 2, kernels, dtype=jnp.bfloat16)
    valid = jnp.asarray([True, False, True])
    p = jax.random.uniform(jax.random.key(9), (2, 3, m, batch, t_len, heads), minval=0.1)
    runs = {
        "forward": lambda w: mosaic_gpu.phase2_fused_forward(
            state, partial, bank, query, True, gate, seg, fuse="gate", stream_kernels=kernels, heads=heads, eps=1e-6,
            gate_eps=1e-6, windows=w, interpret=True),
        "backward_state": lambda w: mosaic_gpu.phase2_backward_state(
            partial, bank, *coef, state.acc, dh, gate, seg, stream_kernels=kernels, heads=heads, gate_eps=1e-6,
            windows=w, interpret=True),
        "scores": lambda w: mosaic_gpu.phase1_scores(sources, banks, queries, seg, valid, stream_kernels=kernels,
                                                     heads=heads, windows=w, interpret=True),
        "mix": lambda w: mosaic_gpu.phase1_mix(sources, banks, p * valid[None, :, None, None, None, None], seg, valid,
                                               stream_kernels=kernels, heads=heads, windows=w, interpret=True),
    }
    for name, run in runs.items():
        want = jax.tree.leaves(run("per_lag"))
        assert any(np.any(np.asarray(w)) for w in want), name
        for windows in ("aligned", "single", "padded"):
            got = jax.tree.leaves(run(windows))
            assert len(got) == len(want), (name, windows)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{name}, {windows}")
    with pytest.raises(ValueError, match="windows='tall'"):
        runs["scores"]("tall")


def _state_kernel_inputs():
    """Inputs of phase 2's kernels for the option checks: segments, a ragged second tile, two heads."""
    kernels, batch, t_len, d, heads = (0, 4, 8, 12), 2, 100, 64, 2
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    coef = [jax.random.uniform(jax.random.key(k), (len(kernels), batch, t_len, heads), minval=0.1) for k in range(3)]
    return kernels, heads, _segments(batch, t_len, 37), state, partial, bank, query, gate, coef, _rnd(5, (batch, t_len, d))


@pytest.mark.slow  # an option against the default (33 s on 2 cores)
def test_state_boxes_agree(monkeypatch):
    """Phase 2's kernels move the state's chunk (and ``d_acc``'s) as one 3D TMA box
    (``STATE_BOXES = "one"``, the default) or one copy per stream: the same values to the last
    bit (interpreted; segments, a ragged second tile, two heads); an unknown choice is refused."""
    kernels, heads, seg, state, partial, bank, query, gate, coef, dh = _state_kernel_inputs()

    def run(boxes):
        monkeypatch.setattr(mosaic_gpu, "DEFAULT_STATE_BOXES", boxes)
        fwd = mosaic_gpu.phase2_fused_forward(state, partial, bank, query, True, gate, seg, fuse="gate",
                                              stream_kernels=kernels, heads=heads, eps=1e-6, gate_eps=1e-6,
                                              interpret=True)
        bwd = mosaic_gpu.phase2_backward_state(partial, bank, *coef, state.acc, dh, gate, seg, stream_kernels=kernels,
                                               heads=heads, gate_eps=1e-6, interpret=True)
        return jax.tree.leaves((fwd, bwd))

    got, want = run("one"), run("per_stream")
    assert len(got) == len(want) and all(np.any(np.asarray(w)) for w in want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="DEFAULT_STATE_BOXES='two'"):
        run("two")


@pytest.mark.slow  # an option against the default (14 s and more on 2 cores)
@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in (CASES[0], CASES[1], CASES[3])])
def test_gate_statistics_summed_in_the_scoring_pass(case):
    """``gate_stats="in_scores"`` (the default: pass A sums A.A, A.E, E.E, A.W_j
    and E.W_j per stream and head; the gate's ``sum z^2`` and ``z . W_j`` follow once a and b are
    known, so the forward expands twice, not three times) gives the reference's ``h`` and scores,
    and ``"own_pass"``'s (pass B re-expands the partial for them) to float32 rounding
    (interpreted; segments and a ragged tile, two heads with the partial excluded, AttnRes's one
    stream); an unknown choice is refused."""
    _, batch, t_len, d, kernels, heads, include, cut, _ = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = None if cut is None else _segments(batch, t_len, cut)
    kw = dict(stream_kernels=kernels, heads=heads)

    def run(gate_stats):
        return mosaic_gpu.phase2_fused_forward(state, partial, bank, query, include, gate, seg, fuse="gate", eps=1e-6,
                                               gate_eps=1e-6, gate_stats=gate_stats, interpret=True, **kw)

    (h, scores), (h_own, scores_own) = run("in_scores"), run("own_pass")
    want = reference.phase2_fused(state, partial, bank, query, include, gate, segment_ids=seg, eps=1e-6,
                                  gate_eps=1e-6, **kw)
    assert _rel(h, want) < F32_TOL and _rel(h, h_own) < F32_TOL
    for got, own in zip(scores, scores_own):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(own))  # pass A's own sums are unchanged
    with pytest.raises(ValueError, match="gate_stats='both'"):
        run("both")


@pytest.mark.slow
def test_state_sums_through_the_rows_buffer_agree(monkeypatch):
    """``STATE_SUMS_IN_ROWS``: the backward's state kernel stores its per-head sums through the
    buffer its per-token coefficients came in, or through their own: the same values to the last
    bit (interpreted; segments, a ragged second tile, two heads), and 3 * m * heads rows of 64
    floats less shared memory."""
    kernels, heads, seg, state, partial, bank, query, gate, coef, dh = _state_kernel_inputs()
    m = len(kernels)

    def run(flag):
        monkeypatch.setattr(mosaic_gpu, "STATE_SUMS_IN_ROWS", flag)
        return jax.tree.leaves(mosaic_gpu.phase2_backward_state(partial, bank, *coef, state.acc, dh, gate, seg,
                                                                stream_kernels=kernels, heads=heads, gate_eps=1e-6,
                                                                interpret=True))

    got, want = run(True), run(False)
    assert len(got) == len(want) and all(np.any(np.asarray(w)) for w in want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    smem = {flag: mosaic_gpu.state_smem_bytes(block_d=32, stream_kernels=kernels, heads=heads, x_dtype=jnp.bfloat16,
                                              acc_dtype=jnp.float32, sums_in_rows=flag) for flag in (True, False)}
    assert smem[False] - smem[True] == 3 * m * heads * 64 * 4


@pytest.mark.slow  # an option against the default (about 60 s on 2 cores)
def test_state_reread_in_reverse_agrees(monkeypatch):
    """``REREAD_ORDER = "reverse"``: the forward's output pass and the backward state kernel's
    ``d_acc`` pass walk the channel chunks (and heads) last to first, so that the chunks their
    first pass read last may still be in L2. Interpreted, with two heads of two chunks each (so
    both the heads' and the chunks' order turn), segments and a ragged second tile, the gate's
    statistics in their own pass and in the scoring pass (``GATE_STATS``): ``h``, the
    scores, ``d_acc`` and the gate's rows are the same bits as in the same order, the per-head
    sums (added in the other order) agree to float32 rounding; an unknown order is refused."""
    kernels, batch, t_len, d, heads = (0, 4, 8, 12), 2, 100, 128, 2
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    coef = [jax.random.uniform(jax.random.key(k), (len(kernels), batch, t_len, heads), minval=0.1) for k in range(3)]
    seg, dh = _segments(batch, t_len, 37), _rnd(5, (batch, t_len, d))
    assert d // mosaic_gpu.choose_block_d(d=d, heads=heads, stream_kernels=kernels, x_dtype=partial.dtype,
                                          acc_dtype=jnp.float32, out_dtype=jnp.float32, gate=True) == 2 * heads

    def run(order):
        monkeypatch.setattr(mosaic_gpu, "REREAD_ORDER", order)
        fwd = [mosaic_gpu.phase2_fused_forward(state, partial, bank, query, True, gate, seg, fuse="gate",
                                               stream_kernels=kernels, heads=heads, eps=1e-6, gate_eps=1e-6,
                                               gate_stats=stats, interpret=True) for stats in mosaic_gpu.GATE_STATS]
        d_acc, sums, gate_rows = mosaic_gpu.phase2_backward_state(
            partial, bank, *coef, state.acc, dh, gate, seg, stream_kernels=kernels, heads=heads, gate_eps=1e-6,
            interpret=True)
        return jax.tree.leaves((fwd, d_acc, gate_rows)), sums

    (got, got_sums), (want, want_sums) = run("reverse"), run("same")
    assert len(got) == len(want) and all(np.any(np.asarray(w)) for w in want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    for g, w in zip(got_sums, want_sums):
        assert _rel(g, w) < F32_TOL
    with pytest.raises(ValueError, match="REREAD_ORDER='backwards'"):
        run("backwards")
    with pytest.raises(ValueError, match="reread_order='up'"):
        mosaic_gpu.phase2_backward_state(partial, bank, *coef, state.acc, dh, gate, seg, stream_kernels=kernels,
                                         heads=heads, gate_eps=1e-6, reread_order="up", interpret=True)


@pytest.mark.parametrize("reverse", [False, True])
def test_pipelined_walks_chunks_and_heads_in_order(reverse):
    """``_pipelined`` (outside a kernel, its barrier waits and copies stubbed): every chunk once,
    each with its own head, first to last or (``reverse``) last to first, and the first copies
    issued for the first chunks walked, slot by slot."""
    nc, heads, n_slots = 6, 2, 2
    issued = []

    class Stub:
        @staticmethod
        def barrier_wait(_):
            pass

    class Bar:  # bar.at[slot] -> None
        at = property(lambda self: self)

        def __getitem__(self, _):
            return None

    def fetch(c, slot):
        if isinstance(c, int):  # the copies issued before the loop (the loop's are traced)
            issued.append((c, slot))

    def per_chunk(c, slot, head, carry):
        walked, k = carry
        return walked.at[k].set(c * 10 + head), k + 1

    walked, k = mosaic_gpu._pipelined(Stub, fetch, Bar(), nc, heads, per_chunk,
                                      (jnp.full((nc,), -1, jnp.int32), 0), n_slots=n_slots, reverse=reverse)
    chunks = list(range(nc))[::-1] if reverse else list(range(nc))
    assert int(k) == nc
    assert [int(v) for v in walked] == [c * 10 + c // (nc // heads) for c in chunks]
    assert issued == [(chunks[s], s) for s in range(n_slots)]
