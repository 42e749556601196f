"""Fused depth-attention kernels (pallas_kernels.depth_attention) against the oracle.

On CPU both Pallas implementations run in interpret mode: the kernel bodies, the
halo handling, tiling of ragged T, segments, heads and the custom_vjp plumbing are
checked here; the Triton-only masked halo load is checked by the GPU-marked test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels.depth_attention import api, reference

IMPLS = ["pallas_tpu", "pallas_gpu"]
F32_TOL = 1e-5
BF16_TOL = 2e-2


def _rnd(key, shape, scale=1.0, dtype=jnp.float32):
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def jit_vjp(f, args, cotangent):
    """``f(*args)`` and its vjp at ``cotangent(out)`` (a function of the output's shapes), as
    ONE compiled program. Run eagerly, every XLA op around the kernels (the custom_vjp's glue,
    the reference) is compiled on its own: about 200 small compiles, two thirds of a phase-1
    test's time on the CPU."""
    ct = cotangent(jax.eval_shape(f, *args))

    @jax.jit
    def run(args, ct):
        out, pull = jax.vjp(f, *args)
        return out, pull(ct)

    return run(args, ct)


def _check_tree(got, want, tol):
    leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    scale = max(float(np.max(np.abs(np.asarray(w, np.float64)))) for _, w in leaves)
    for g, w in leaves:
        assert g.shape == w.shape
        if not np.any(np.asarray(g)):
            # A gradient that is zero analytically (the max of an excluded partial's merge)
            # comes out exactly 0 in closed form and as rounding noise from autodiff.
            assert float(np.max(np.abs(np.asarray(w, np.float64)))) < tol * scale
            continue
        assert _rel(g, w) < tol, _rel(g, w)


def _segments(batch, t_len, cut):
    seg = np.zeros((batch, t_len), np.int32)
    seg[0, cut:] = 1  # first row has a boundary, the others none
    return jnp.asarray(seg)


def _phase1_vjp(fn, sources, banks, queries, valid, **kw):
    """``fn(sources, banks, queries, valid, **kw)`` (a phase-1 op) and its vjp at a random
    cotangent of every output leaf, as one compiled program (``jit_vjp``)."""
    return jit_vjp(lambda x, b, q: fn(x, b, q, valid, **kw), (sources, banks, queries),
                   lambda out: jax.tree.map(lambda a: _rnd(9, a.shape), out))


def _phase1_inputs(n, batch, t_len, d, n_targets, kernels, seed=0, dtype=jnp.float32):
    m, k = len(kernels), reference.bank_size(kernels)
    sources = _rnd(seed, (n, batch, t_len, d), dtype=dtype)
    banks = _rnd(seed + 1, (n, k, d), 0.5) if k else None
    queries = _rnd(seed + 2, (n_targets, m, d))
    return sources, banks, queries


PHASE1_CASES = [
    # name, n, B, T, d, S, kernels, heads, valid, segments
    ("msar_ragged_T_segments_valid", 3, 2, 20, 64, 2, (0, 4, 8, 12), 2, (True, False, True), 7),
    ("attnres_n1_m1", 1, 1, 5, 32, 1, (0,), 1, None, None),
    ("mhar_heads4", 4, 2, 16, 64, 3, (0,), 4, None, 3),
    ("T_shorter_than_kernel", 2, 1, 7, 32, 2, (0, 4, 8, 12), 1, None, None),
    ("no_conv_ablation", 2, 1, 9, 32, 2, (0, 0, 0), 1, None, None),
]


def _impl_params(cases):
    """Each case runs with one implementation by default (they share the kernel body and
    differ in tiling), alternating; the other combination is marked slow."""
    out = []
    for j, case in enumerate(cases):
        for k, impl in enumerate(IMPLS):
            marks = () if (j + k) % 2 == 0 else (pytest.mark.slow,)
            out.append(pytest.param(impl, case, marks=marks, id=f"{case[0]}-{impl}"))
    return out


@pytest.mark.parametrize("impl,case", _impl_params(PHASE1_CASES))
def test_phase1_forward_and_grads(impl, case):
    _, n, batch, t_len, d, n_targets, kernels, heads, valid, cut = case
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, kernels)
    seg = None if cut is None else _segments(batch, t_len, cut)
    valid = None if valid is None else jnp.asarray(valid)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    got, got_grads = _phase1_vjp(lambda *a, **k: api.phase1(*a, implementation=impl, **k),
                                 sources, banks, queries, valid, **kw)
    want, want_grads = _phase1_vjp(reference.phase1, sources, banks, queries, valid, **kw)
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, F32_TOL)  # sources, banks, queries


def _phase2_inputs(batch, t_len, d, kernels, heads, seed=10):
    m, k = len(kernels), reference.bank_size(kernels)
    # a real phase-1 state of two sources
    srcs, banks, q = _phase1_inputs(2, batch, t_len, d, 1, kernels, seed)
    state = jax.tree.map(lambda a: a[0], reference.phase1(srcs, banks, q, stream_kernels=kernels, heads=heads))
    partial = _rnd(seed + 3, (batch, t_len, d))
    bank = _rnd(seed + 4, (k, d), 0.5) if k else None
    query = _rnd(seed + 5, (m, d))
    gate = (_rnd(seed + 6, (m * d, m), 1.0 / np.sqrt(m * d)), jnp.float32(0.7), _rnd(seed + 7, (m,), 0.3))
    return state, partial, bank, query, gate


PHASE2_CASES = [
    # name, B, T, d, kernels, heads, include, segments, fuse
    ("msar_gate_segments", 2, 20, 64, (0, 4, 8, 12), 1, True, 11, "gate"),
    ("msar_streams_heads2", 1, 18, 64, (0, 4, 8, 12), 2, True, None, None),
    ("msar_mean_no_partial", 1, 16, 32, (0, 4, 8, 12), 1, False, None, "mean"),
    ("attnres_m1", 2, 6, 32, (0,), 1, True, 2, "gate"),
    ("mhar_streams", 1, 9, 64, (0,), 4, True, None, None),
]


@pytest.mark.parametrize("impl,case", _impl_params(PHASE2_CASES))
def test_phase2_forward_and_grads(impl, case):
    _, batch, t_len, d, kernels, heads, include, cut, fuse = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = None if cut is None else _segments(batch, t_len, cut)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    if fuse is None:
        fn = lambda st, x, b, q, g, **k: api.phase2(st, x, b, q, include, implementation=impl, **k)  # noqa: E731
        ref = lambda st, x, b, q, g, **k: reference.phase2(st, x, b, q, include, **k)  # noqa: E731
    else:
        g_or_none = (lambda g: g) if fuse == "gate" else (lambda g: None)
        fn = lambda st, x, b, q, g, **k: api.phase2_fused(  # noqa: E731
            st, x, b, q, include, g_or_none(g), implementation=impl, **k
        )
        ref = lambda st, x, b, q, g, **k: reference.phase2_fused(st, x, b, q, include, g_or_none(g), **k)  # noqa: E731
    args = (state, partial, bank, query, gate if fuse == "gate" else None)

    def run(f):
        return jit_vjp(lambda *a: f(*a, **kw), args, lambda out: _rnd(99, out.shape))

    got, got_grads = run(fn)
    want, want_grads = run(ref)
    _check_tree(got, want, F32_TOL)
    # state (max, denom, acc), partial, bank, query and the gate's (w, scale, bias)
    _check_tree(got_grads, want_grads, F32_TOL)


@pytest.mark.parametrize("impl", [IMPLS[1], pytest.param(IMPLS[0], marks=pytest.mark.slow)])
def test_bf16_sources(impl):
    kernels = (0, 4, 8, 12)
    sources, banks, queries = _phase1_inputs(3, 1, 24, 64, 2, kernels, dtype=jnp.bfloat16)
    kw = dict(stream_kernels=kernels, heads=1)
    got = jax.jit(lambda *a: api.phase1(*a, implementation=impl, **kw))(sources, banks, queries)
    want = jax.jit(lambda *a: reference.phase1(*a, **kw))(sources.astype(jnp.float32), banks, queries)
    _check_tree(got, want, BF16_TOL)
    state = jax.tree.map(lambda a: a[0], want)
    partial = _rnd(3, (1, 24, 64), dtype=jnp.bfloat16)
    h = jax.jit(lambda st, x: api.phase2_fused(st, x, banks[0], queries[1], True, None, implementation=impl,
                                               out_dtype=jnp.bfloat16, **kw))(state, partial)
    assert h.dtype == jnp.bfloat16
    h_ref = jax.jit(lambda st, x: reference.phase2_fused(st, x, banks[0], queries[1], True, None, **kw))(
        state, partial.astype(jnp.float32))
    _check_tree(h, h_ref, BF16_TOL)


def test_two_phase_equals_direct_read():
    """Phase 1 over completed sources then phase 2 with the partial == depth_read over all."""
    kernels, heads = (0, 4, 8), 2
    sources, banks, queries = _phase1_inputs(3, 1, 19, 32, 2, kernels)
    seg = _segments(1, 19, 5)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    @jax.jit
    def two_phase(sources, banks, queries):
        state = api.phase1(sources[:2], banks[:2], queries, implementation="pallas_tpu", **kw)
        return api.phase2(jax.tree.map(lambda a: a[1], state), sources[2, ...], banks[2], queries[1], True,
                          implementation="pallas_tpu", **kw)

    z = two_phase(sources, banks, queries)
    direct = jax.jit(lambda *a: reference.depth_read(*a, **kw))(sources, banks, queries[1])
    assert _rel(z, direct) < F32_TOL


def test_dispatch_falls_back_to_xla_on_cpu():
    kernels = (0, 4)
    sources, banks, queries = _phase1_inputs(2, 1, 8, 32, 1, kernels)
    kw = dict(stream_kernels=kernels)
    got = api.phase1(sources, banks, queries, **kw)  # implementation=None on CPU -> xla
    # The XLA path streams over sources (xla_streaming.py): the same state up to float32 rounding.
    _check_tree(got, reference.phase1(sources, banks, queries, **kw), 1e-5)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 3),
    t_len=st.integers(1, 40),
    heads=st.sampled_from([1, 2]),
    kernels=st.sampled_from([(0,), (0, 3), (0, 4, 8, 12), (2, 5)]),
    n_targets=st.integers(1, 2),
    cut=st.integers(0, 40),
    seed=st.integers(0, 1000),
)
def test_random_shapes(n, t_len, heads, kernels, n_targets, cut, seed):
    d, batch = 32, 2
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, kernels, seed)
    seg = _segments(batch, t_len, min(cut, t_len))
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    want = jax.jit(lambda *a: reference.phase1(*a, **kw))(sources, banks, queries)
    _check_tree(jax.jit(lambda *a: api.phase1(*a, implementation="pallas_gpu", **kw))(sources, banks, queries),
                want, F32_TOL)
    state = jax.tree.map(lambda a: a[-1], want)
    partial = _rnd(seed + 50, (batch, t_len, d))
    args = (state, partial, None if banks is None else banks[0], queries[0])
    _check_tree(jax.jit(lambda *a: api.phase2(*a, True, implementation="pallas_tpu", **kw))(*args),
                jax.jit(lambda *a: reference.phase2(*a, True, **kw))(*args), F32_TOL)


@pytest.mark.gpu
def test_gpu_triton_matches_reference():
    """On a GPU: the compiled Triton kernels (masked halo loads) against the oracle."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kernels = (0, 4, 8, 12)
    sources, banks, queries = _phase1_inputs(3, 2, 200, 256, 2, kernels)
    seg = _segments(2, 200, 77)
    kw = dict(stream_kernels=kernels, heads=2, segment_ids=seg)
    with jax.default_matmul_precision("highest"):
        want = reference.phase1(sources, banks, queries, **kw)
        got = api.phase1(sources, banks, queries, implementation="pallas_gpu", **kw)
        _check_tree(got, want, 1e-4)
        state, partial, bank, query, gate = _phase2_inputs(2, 200, 256, kernels, 2)
        h = api.phase2_fused(state, partial, bank, query, True, gate, implementation="pallas_gpu", **kw)
        _check_tree(h, reference.phase2_fused(state, partial, bank, query, True, gate, **kw), 1e-4)


# The routing is the same for every case; the MSAR one runs in the slow suite (20 s on 2 cores): the
# model-level test (test_model_kernel_path.py, kernel_overrides.backward="pallas") takes MSAR's phase 1
# through this backward, and test_fused_bwd_phase1.py checks the kernels on MSAR shapes.
@pytest.mark.parametrize("case", [pytest.param(PHASE1_CASES[0], marks=pytest.mark.slow), PHASE1_CASES[1]],
                         ids=lambda c: c[0])
def test_phase1_pallas_backward_through_the_op(case):
    """``backward="pallas"`` routes the custom_vjp's backward to ``fused_bwd_phase1``: the op's
    gradients equal autodiff of the reference (the kernels alone: test_fused_bwd_phase1.py)."""
    _, n, batch, t_len, d, n_targets, kernels, heads, valid, cut = case
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, kernels)
    seg = None if cut is None else _segments(batch, t_len, cut)
    valid = None if valid is None else jnp.asarray(valid)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)

    def run(fn):
        return _phase1_vjp(fn, sources, banks, queries, valid, **kw)

    got, got_grads = run(lambda *a, **k: api.phase1(*a, implementation="pallas_tpu", backward="pallas", **k))
    want, want_grads = run(reference.phase1)
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, F32_TOL)
    with pytest.raises(ValueError, match="backward='fast'"):
        run(lambda *a, **k: api.phase1(*a, implementation="pallas_tpu", backward="fast", **k))


# Mean fusion with the partial excluded: slow suite (15 s); the kernels alone are checked in that
# case by test_fused_bwd_phase2.py, and the routing by the gated case.
@pytest.mark.parametrize("case", [PHASE2_CASES[0], pytest.param(PHASE2_CASES[2], marks=pytest.mark.slow)],
                         ids=lambda c: c[0])
def test_phase2_fused_pallas_backward_through_the_op(case):
    """``backward="pallas"`` routes phase 2 + gate's backward to ``fused_bwd_phase2``: the op's
    gradients (state, partial, bank, query, gate) equal autodiff of the reference."""
    _, batch, t_len, d, kernels, heads, include, cut, fuse = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = None if cut is None else _segments(batch, t_len, cut)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    gate = gate if fuse == "gate" else None

    def run(f):
        return jit_vjp(lambda st, x, b, q, g: f(st, x, b, q, include, g, **kw), (state, partial, bank, query, gate),
                       lambda out: _rnd(99, out.shape))

    got, got_grads = run(lambda *a, **k: api.phase2_fused(*a, implementation="pallas_tpu", backward="pallas", **k))
    want, want_grads = run(reference.phase2_fused)
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, 2e-5)


@pytest.mark.parametrize("case", [PHASE1_CASES[0], pytest.param(PHASE1_CASES[2], marks=pytest.mark.slow)],
                         ids=lambda c: c[0])
def test_channel_sums_as_whole_tiles(monkeypatch, case):
    """The whole-tile form of the scoring kernel's and the gate statistics' channel sums
    (``fused._whole_tile_sums``: Triton's when the tiles fit its register budget; interpret mode
    and Mosaic reduce per chunk, the form every other test here runs) forced through the
    interpret path with several channel chunks per head, for phase 1 too: phase 1's forward and
    gradients and the gated phase 2 against the reference, heads, segments, ragged T."""
    from pallas_kernels.depth_attention import fused, tiling

    monkeypatch.setattr(fused, "_whole_tile_sums", lambda backend, n_acc, bt, bd: True)
    _, n, batch, t_len, d, n_targets, kernels, heads, valid, cut = case
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, kernels)
    seg = None if cut is None else _segments(batch, t_len, cut)
    valid = None if valid is None else jnp.asarray(valid)
    tiles = tiling.Tiles(16, 8, 8)  # 2-4 chunks per head
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)

    def run(fn):
        return jit_vjp(lambda x, b, q: fn(x, b, q, valid, **kw), (sources, banks, queries),
                       lambda out: jax.tree.map(lambda a: _rnd(9, a.shape), out))

    got = run(lambda *a, **k: api.phase1(*a, implementation="pallas_gpu", tiles=tiles, backward="pallas", **k))
    want = run(reference.phase1)
    _check_tree(got, want, F32_TOL)

    state = jax.tree.map(lambda a: a[0], want[0])
    partial, query = sources[0], queries[0]
    bank = None if banks is None else banks[0]
    m = len(kernels)
    gate = (_rnd(31, (m * d, m), 1.0 / d), jnp.float32(0.7), _rnd(32, (m,), 0.3))

    def run2(fn):
        return jit_vjp(lambda st, x, q, g: fn(st, x, bank, q, True, g, **kw), (state, partial, query, gate),
                       lambda out: _rnd(33, out.shape))

    got = run2(lambda *a, **k: api.phase2_fused(*a, implementation="pallas_gpu", tiles=tiles, backward="pallas", **k))
    want = run2(reference.phase2_fused)
    _check_tree(got, want, F32_TOL)


def test_whole_tile_sums_budget():
    """Triton carries whole tiles for phase 2's one target (4 streams at 16 x 32: 8 dot and
    square accumulators; 5 for the gate statistics), not for phase 1's 8 targets."""
    from pallas_kernels.depth_attention import fused

    assert fused._whole_tile_sums("triton", (1 + 1) * 4, 16, 32)
    assert fused._whole_tile_sums("triton", 1 + 4, 16, 32)
    assert not fused._whole_tile_sums("triton", (8 + 1) * 4, 16, 64)
    assert not fused._whole_tile_sums("interpret", 2, 16, 32)


@pytest.mark.parametrize("kernels, heads", [((0,), 2), ((0, 4), 1)], ids=["one_stream_heads2", "conv4"])
def test_mixing_passes_with_their_own_tiles(kernels, heads):
    """Phase 1's mixing pass and phase 2's ungated output pass on tiles of their own
    (``Tiles.mix_tiles``: 8 tokens x 16 channels against the other kernels' 16 x 8; on Triton
    ``choose_tiles`` gives one stream's phase 1 8 x 128 and its phase 2 16 x 128) against the
    reference, forward and gradients, through the ops: segments, ragged T, a source ruled out;
    and the tiles' checks."""
    from pallas_kernels.depth_attention import fused, tiling

    n, batch, t_len, d, n_targets = 3, 2, 21, 64, 3
    sources, banks, queries = _phase1_inputs(n, batch, t_len, d, n_targets, kernels)
    valid = jnp.asarray([True, False, True])
    tiles = tiling.Tiles(16, 8, 8, mix_tiles=(("acc", 8, 16), ("mean", 8, 16)))
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=_segments(batch, t_len, 9))
    got = _phase1_vjp(lambda *a, **k: api.phase1(*a, implementation="pallas_gpu", tiles=tiles, backward="pallas",
                                                 **k), sources, banks, queries, valid, **kw)
    want = _phase1_vjp(reference.phase1, sources, banks, queries, valid, **kw)
    _check_tree(got, want, F32_TOL)
    state = jax.tree.map(lambda a: a[0], want[0])
    bank = None if banks is None else banks[0]

    def run2(fn):
        return jit_vjp(lambda st, x, q: fn(st, x, bank, q, True, None, **kw), (state, sources[0], queries[0]),
                       lambda out: _rnd(33, out.shape))

    got = run2(lambda *a, **k: api.phase2_fused(*a, implementation="pallas_gpu", tiles=tiles, backward="pallas", **k))
    _check_tree(got, run2(reference.phase2_fused), F32_TOL)

    one = tiling.choose_tiles(d=1024, heads=1, max_kernel=1, n_targets=8, backend="triton", n_streams=1)
    assert one.mix_tile("acc") == (8, 128) and one.mix_tile("mean") == (16, 64)
    one = tiling.choose_tiles(d=1024, heads=1, max_kernel=1, n_targets=1, backend="triton", n_streams=1)
    assert one.mix_tile("mean") == (16, 128) and one.mix_tile("stats") == (16, 64)
    with pytest.raises(ValueError, match=r"entry \('acc', 3, 16\)"):
        tiling.Tiles(16, 8, 8, mix_tiles=(("acc", 3, 16),))
    with pytest.raises(ValueError, match=r"entry \('sum', 8, 16\)"):
        tiling.Tiles(16, 8, 8, mix_tiles=(("sum", 8, 16),))
    with pytest.raises(ValueError, match="one entry per mode"):
        tiling.Tiles(16, 8, 8, mix_tiles=(("acc", 8, 16), ("acc", 16, 8)))
    p = jnp.zeros((n_targets, n, len(kernels), batch, 32, heads))
    with pytest.raises(ValueError, match="a 8 x 24 tile must divide"):
        fused.mix_call(jnp.zeros((n, batch, 32, d)), banks, p, None, mode="acc", stream_kernels=kernels, heads=heads,
                       tiles=tiling.Tiles(16, 8, 8, mix_tiles=(("acc", 8, 24),)), backend="interpret", interpret=True)
