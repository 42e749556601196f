"""Phase 2 in Mosaic GPU (``pallas_kernels/depth_attention/mosaic_gpu/``) against the oracle:
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
from pallas_kernels.depth_attention.mosaic_gpu import common
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
    masks = np.asarray(reference.segment_lag_masks(seg, 40, 12, 3))
    for delta in range(12):
        np.testing.assert_array_equal((bits >> delta) & 1, masks[delta])


def test_block_d_choice_and_shared_memory():
    kw = dict(stream_kernels=(0, 4, 8, 12), x_dtype=jnp.bfloat16, acc_dtype=jnp.float32, out_dtype=jnp.bfloat16)
    choose = functools.partial(mosaic_gpu.choose_block_d, smem=mosaic_gpu.smem_bytes)
    assert choose(d=1024, heads=1, **kw) == 32
    # a float32 partial fits one padded window per chunk (``"auto"`` still runs a float32 partial
    # on Triton: untimed in Mosaic)
    assert choose(d=1024, heads=1, **dict(kw, x_dtype=jnp.float32)) == 32
    assert choose(d=1024, heads=1, **dict(kw, x_dtype=jnp.float32, stream_kernels=(0,))) == 32
    assert choose(d=48, heads=1, **kw) is None  # no chunk divides the head
    # MSAR at `base` with a float32 state fits both kernels (the H200's 227 KiB per block; the
    # backward's with the model's bf16 output cotangent)
    for smem in (mosaic_gpu.smem_bytes, functools.partial(mosaic_gpu.state_smem_bytes, dh_dtype=jnp.bfloat16)):
        assert 90_000 < smem(block_d=32, **dict(kw, heads=1)) <= mosaic_gpu.SMEM_BYTES


@pytest.mark.parametrize("max_lag, extra", [(12, 2), (9, 1), (8, 1), (1, 0), (17, 2), (18, 3)])
def test_lag_window_geometry(max_lag, extra):
    """One window per chunk: ``64 + 8 extra`` rows (the lags above the tile, in whole 8s), brought
    by one TMA copy whatever the stream's kernel, ``WINDOW_PAD`` channels wider than the chunk."""
    lags = common.LagWindow.of(max_lag)
    assert (lags.rows, lags.extra, lags.count) == (64 + 8 * extra, extra, 1)
    for n_lags in (0, 1, max_lag):
        assert lags.copies(n_lags) == [(0, 0, 64 + 8 * extra, 8 * extra)]
    assert lags.width(32) == 32 + mosaic_gpu.WINDOW_PAD and common.LagWindow.of(max_lag, pad=0).width(8) == 8


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
    """``heuristics.mosaic_phase2``'s choice for a compiled (not interpreted) GPU call at `base`'s
    shape (d = 1024, a bf16 partial, a float32 state); the ``"fuse=None"`` phase 2 and the TPU
    back end never take Mosaic GPU."""
    import functools

    from pallas_kernels.depth_attention import heuristics

    takes = functools.partial(heuristics.mosaic_phase2, choice, stream_kernels=kernels, heads=1, d=1024,
                              interpret=False)
    base = dict(backend="triton", fuse="gate", dtype=jnp.bfloat16, acc_dtype=jnp.float32, out_dtype=jnp.bfloat16)
    got = [takes(k, **base) for k in ("forward", "backward_state")]
    assert got == [forward, backward_state]
    # a float32 partial with a bf16 state fits shared memory but is untimed in Mosaic:
    # "auto" keeps Triton; "mosaic" takes it
    assert takes(**dict(base, dtype=jnp.float32, acc_dtype=jnp.bfloat16)) is (choice == "mosaic")
    assert not takes(**dict(base, backend="tpu"))
    assert not takes(**dict(base, fuse=None, out_dtype=jnp.float32))


GPU_CASES = [  # each configuration's two Mosaic GPU lowerings take 15-35 s of CPU each
    (("msar", 2, 300, 256, (0, 4, 8, 12), 2, True, 77, "gate"), jnp.float32),
    (("msar_mean_excluded", 3, 128, 512, (0, 4, 8, 12), 1, False, 40, "mean"), jnp.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case, state_dtype", GPU_CASES, ids=[c[0][0] for c in GPU_CASES])
def test_gpu_mosaic_matches_reference(monkeypatch, case, state_dtype):
    """On a GPU: the compiled forward and the backward's kernel, both taken by
    ``gpu_kernels="auto"``, against the oracle (bf16 partial; a float32 and a bf16 state;
    segments, two heads, ragged T, an excluded partial, mean fusion)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
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
    """``split=True`` (the scores kernel, then the merge kernel from the scores it wrote, which
    sums the gate's statistics in a pass of its own) gives the scores of the one-kernel forward
    (whose scoring pass sums them) to the last bit and its ``h`` to float32 rounding, both the
    reference's (interpreted; segments and a ragged tile; two heads with the partial excluded)."""
    _, batch, t_len, d, kernels, heads, include, cut, fuse = case
    (h, scores), (h_default, scores_default) = _forward(case, True, interpret=True), _forward(case, False,
                                                                                            interpret=True)
    assert _rel(h_default, h) < F32_TOL
    for got, want in zip(scores_default, scores, strict=True):
        assert np.any(np.asarray(want))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = None if cut is None else _segments(batch, t_len, cut)
    want = reference.phase2_fused(state, partial.astype(jnp.bfloat16), bank, query, include, gate, segment_ids=seg,
                                  eps=1e-6, gate_eps=1e-6, stream_kernels=kernels, heads=heads)
    assert _rel(h, want) < F32_TOL


@pytest.mark.slow  # two Mosaic GPU lowerings (about 30 s of CPU)
def test_split_forward_lowers_for_sm90():
    """Both kernels of the split forward lower for the H200; the scores kernel holds no state,
    gate or output buffers."""
    case = ("msar", 2, 128, 64, (0, 4, 8, 12), 1, True, 30, "gate")
    text = jax.jit(lambda: _forward(case, True)).trace().lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 2


@pytest.mark.parametrize("reverse", [False, True])
def test_pipelined_walks_chunks_and_heads_in_order(reverse):
    """``common.pipeline_chunks`` (outside a kernel, its barrier waits and copies stubbed): every chunk once,
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

    walked, k = common.pipeline_chunks(Stub, fetch, Bar(), nc, heads, per_chunk,
                                      (jnp.full((nc,), -1, jnp.int32), 0), n_slots=n_slots, reverse=reverse)
    chunks = list(range(nc))[::-1] if reverse else list(range(nc))
    assert int(k) == nc
    assert [int(v) for v in walked] == [c * 10 + c // (nc // heads) for c in chunks]
    assert issued == [(chunks[s], s) for s in range(n_slots)]
