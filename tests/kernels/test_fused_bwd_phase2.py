"""The Pallas phase-2 fused backward (``fused_bwd_phase2``) against the XLA closed form
``xla_streaming._phase2_fused_bwd`` (itself tested against autodiff of the reference):
every gradient (state max/denom/acc, partial, bank, query, gate W/scale/bias) on random
non-zero inputs, float32 ~2e-5 relative.

On CPU the kernels run in interpret mode (``backend="interpret"``); the transposed conv's
row shift is checked both as the interpret path's concatenate and as the Triton path's
shift-matrix product. The compiled Triton path is the GPU-marked test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import fused_bwd_phase2 as fb
from pallas_kernels.depth_attention import reference as ref
from pallas_kernels.depth_attention import tiling
from pallas_kernels.depth_attention import xla_streaming as xs

TOL = 2e-5
# Interpret-mode kernels make large XLA programs: compile them without the expensive CPU
# passes (about 3x faster to compile, same numbers; as msar_jax.train.step.FAST_COMPILE).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

CASES = [
    # stream_kernels, heads, segments, include the partial, gate (False = mean fusion), T, d, tiles, shift
    # (the five cases of test_xla_streaming's phase-2 test, the excluded-partial one on the
    # cheaper-to-compile (0, 3); T ragged against block_t)
    ((0, 4, 8, 12), 1, True, True, True, 9, 8, None, "concat"),
    ((0, 3), 1, False, False, True, 9, 8, None, "concat"),  # excluded partial: d(partial path) = 0
    ((0, 3), 2, True, True, False, 9, 8, None, "concat"),  # block_t 8: two tiles, carry across a segment
    ((0,), 1, False, True, False, 9, 8, None, "concat"),  # AttnRes: m = 1, no bank
    ((0, 0, 0), 4, False, True, True, 9, 8, None, "concat"),  # no-conv ablation, 4 channel heads
    # The Triton formulation of the row shift (shift-matrix dots), several tiles with a conv
    # halo crossing tile and segment boundaries, two channel chunks per head.
    ((0, 3), 2, True, True, True, 13, 16, tiling.Tiles(4, 4, 4), "dot"),
    ((0, 4, 8, 12), 2, True, True, False, 20, 16, tiling.Tiles(16, 8, 8), "dot"),
    # Triton's default: the shift through a per-program scratch buffer (barriers on Triton), in
    # one round (4 lags, 4 slots) and in rounds of 2 slots (11 lags: 6 rounds).
    ((0, 3, 5), 2, True, True, True, 13, 16, tiling.Tiles(8, 4, 4), "buffer"),
    ((0, 4, 12), 1, True, True, True, 37, 8, tiling.Tiles(16, 8, 8, shift_slots=2), "buffer"),
]


def _inputs(kernels, heads, segments, gated, t, d, seed):
    key = jax.random.split(jax.random.PRNGKey(seed), 9)
    b, m = 2, len(kernels)
    # A random (not phase-1-consistent) state: every term of the merge is exercised.
    state = ref.SoftmaxState(
        max=jax.random.normal(key[0], (m, b, t, heads)),
        denom=1.0 + 2.0 * jax.random.uniform(key[1], (m, b, t, heads)),
        acc=jax.random.normal(key[2], (m, b, t, d)),
    )
    partial = jax.random.normal(key[3], (b, t, d))
    bank = 0.4 * jax.random.normal(key[4], (sum(kernels), d)) if sum(kernels) else None
    query = jax.random.normal(key[5], (m, d))
    seg = jnp.asarray([[0] * 4 + [1] * (t - 4), [0] * t], jnp.int32) if segments else None
    gate = None
    if gated:
        gate = (jax.random.normal(key[6], (m * d, m)) / (m * d) ** 0.5, jnp.float32(0.7),
                0.3 * jax.random.normal(key[7], (m,)))
    dh = jax.random.normal(key[8], (b, t, d))
    return state, partial, bank, query, seg, gate, dh


def _flat(d_state, d_partial, d_bank, d_query, d_gate):
    out = [("max", d_state.max), ("denom", d_state.denom), ("acc", d_state.acc), ("partial", d_partial),
           ("bank", d_bank), ("query", d_query)]
    if d_gate is not None:
        out += list(zip(("W", "scale", "bias"), d_gate))
    return out


def _compare(got, want, tol=TOL):
    scale = max(float(jnp.max(jnp.abs(w))) for _, w in want if w is not None and w.size)
    for (name, g), (_, w) in zip(got, want, strict=True):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == w.dtype, (name, g.shape, w.shape)
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.all(np.isfinite(g)), name
        if not np.any(w) or not np.any(g):
            # Analytically zero (the max's gradient and the whole partial path of an
            # excluded partial): both sides exactly 0 in closed form.
            assert not np.any(g) and float(np.max(np.abs(w))) < tol * scale, name
            continue
        denom = np.max(np.abs(w))
        if w.size == 1:
            # d_scale: one sum over all B*T*m gate logits with heavy cancellation (|d_scale| can
            # be ~1% of its terms); reduction order alone moves it by ~1e-5 relative (the XLA
            # closed form differs that much between its own jit modes). Measure it against the
            # magnitude of the gradients around it instead.
            denom = max(denom, 0.05 * scale)
        err = float(np.max(np.abs(g - w)) / denom)
        assert err < tol, (name, err)


def _reference(state, partial, bank, query, include, gate, seg, dh, kernels, heads):
    """``(d_state, d_partial, d_bank, d_query, d_gate)`` of the XLA closed form."""
    bank_arr = jnp.zeros((0, partial.shape[-1]), jnp.float32) if bank is None else bank
    d_state, d_x, d_b, d_q, _, d_gate, _ = xs._phase2_fused_bwd(
        kernels, heads, 1e-6, 1e-6, (state, partial, bank_arr, query, include, gate, seg), dh)
    return d_state, d_x, None if bank is None else d_b, d_q, d_gate


@pytest.mark.parametrize("kernels,heads,segments,include,gated,t,d,tiles,shift", CASES)
def test_phase2_fused_backward_matches_xla(kernels, heads, segments, include, gated, t, d, tiles, shift):
    """Every gradient of the interpret-mode kernels against the XLA closed form (both in one jit)."""
    state, partial, bank, query, seg, gate, dh = _inputs(kernels, heads, segments, gated, t, d,
                                                         seed=7 * sum(kernels) + heads + include)
    inc = jnp.asarray(include)
    if tiles is None:
        tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1, backend="tpu")
    kw = dict(stream_kernels=kernels, heads=heads, eps=1e-6, gate_eps=1e-6, tiles=tiles, backend="interpret",
              interpret=True)
    # The public entry point picks the concatenate shift off Triton; "dot" is forced through _backward.
    fn = functools.partial(fb.phase2_fused_backward, **kw) if shift == "concat" else functools.partial(
        fb._backward, shift=shift, **kw)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(state, partial, bank, query, inc, gate, seg, dh):
        want = _reference(state, partial, bank, query, inc, gate, seg, dh, kernels, heads)
        return fn(state, partial, bank, query, inc, gate, seg, dh), want

    got, want = both(state, partial, bank, query, inc, gate, seg, dh)
    _compare(_flat(*got), _flat(*want))
    assert float(jnp.max(jnp.abs(got[0].acc))) > 0  # the state path is exercised
    if not include:
        assert not jnp.any(got[1]) and not jnp.any(got[0].max)


@pytest.mark.parametrize("kernels,heads,gated", [((0,), 2, False), ((0, 0, 0), 2, True)])
def test_input_pass_split_over_token_groups(monkeypatch, kernels, heads, gated):
    """Streams without a conv: the input pass splits T over programs (``INPUTS_GROUP_ROWS``,
    here 8 rows: 5 groups of two 4-row tiles over a ragged T = 37), each writing its rows of
    ``d_partial`` and its own partials of ``d_query`` and ``d_W``; against the XLA closed form."""
    monkeypatch.setattr(fb, "INPUTS_GROUP_ROWS", 8)
    t, d = 37, 16
    state, partial, bank, query, seg, gate, dh = _inputs(kernels, heads, True, gated, t, d, seed=5 + len(kernels))
    inc = jnp.asarray(True)
    kw = dict(stream_kernels=kernels, heads=heads, eps=1e-6, gate_eps=1e-6, tiles=tiling.Tiles(4, 8, 8),
              backend="interpret", interpret=True)
    calls = []
    real = fb._dinput_call
    monkeypatch.setattr(fb, "_dinput_call", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(state, partial, bank, query, inc, gate, seg, dh):
        want = _reference(state, partial, bank, query, inc, gate, seg, dh, kernels, heads)
        return fb.phase2_fused_backward(state, partial, bank, query, inc, gate, seg, dh, **kw), want

    got, want = both(state, partial, bank, query, inc, gate, seg, dh)
    assert calls and calls[0][1].shape[0] == 2 * 5  # (batch x groups) partials of d_query
    _compare(_flat(*got), _flat(*want))


@pytest.mark.gpu
@pytest.mark.parametrize("kernels,gated", [((0,), False), ((0, 0, 0), True)])
def test_gpu_triton_one_stream_groups_match_xla(kernels, gated):
    """On a GPU: the Triton input pass split over token groups (streams without a conv) against
    the XLA closed form at a medium shape (T = 200 in 16-row tiles, groups of 32 rows)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    heads, t, d = 2, 200, 256
    state, partial, bank, query, seg, gate, dh = _inputs(kernels, heads, True, gated, t, d, seed=13)
    inc = jnp.asarray(True)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=1, n_targets=1, backend="triton",
                                n_streams=len(kernels))
    old = fb.INPUTS_GROUP_ROWS
    fb.INPUTS_GROUP_ROWS = 32
    try:
        fn = jax.jit(functools.partial(fb.phase2_fused_backward, stream_kernels=kernels, heads=heads, eps=1e-6,
                                       gate_eps=1e-6, tiles=tiles, backend="triton", interpret=False))
        with jax.default_matmul_precision("highest"):
            want = jax.jit(lambda *a: _reference(*a, kernels, heads))(state, partial, bank, query, inc, gate, seg, dh)
            got = fn(state, partial, bank, query, inc, gate, seg, dh)
    finally:
        fb.INPUTS_GROUP_ROWS = old
    _compare(_flat(*got), _flat(*want), 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("gated,include,shift", [(True, True, "buffer"), (False, False, "buffer"), (True, True, "dot")])
def test_gpu_triton_matches_xla(gated, include, shift):
    """On a GPU: the compiled Triton kernels (masked halo loads; the scratch-buffer row shift with
    barriers, the default, or the shift-matrix dots) against the XLA closed form at a medium
    shape, several T tiles, two heads, segments. Run with
    ``JAX_PLATFORMS=cuda python -m pytest -m gpu tests/kernels/test_fused_bwd_phase2.py``
    (conftest.py defaults JAX to the CPU)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kernels, heads, t, d = (0, 4, 8, 12), 2, 200, 256
    state, partial, bank, query, _, gate, dh = _inputs(kernels, heads, False, gated, t, d, seed=11)
    seg = jnp.asarray(np.repeat([[0] * 77 + [1] * (t - 77)], 2, axis=0), jnp.int32)
    inc = jnp.asarray(include)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1, backend="triton")
    fn = jax.jit(functools.partial(fb._backward, stream_kernels=kernels, heads=heads, eps=1e-6,
                                   gate_eps=1e-6, tiles=tiles, backend="triton", interpret=False, shift=shift))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: _reference(*a, kernels, heads))(state, partial, bank, query, inc, gate, seg, dh)
        got = fn(state, partial, bank, query, inc, gate, seg, dh)
    _compare(_flat(*got), _flat(*want), 1e-4)


@pytest.mark.parametrize("case", [
    pytest.param(CASES[0], id="msar_gate_segments"),
    pytest.param(CASES[4], id="no_conv_heads4"),
    # the slow suite: the rest (each about 25 s of CPU compile in interpret mode)
    pytest.param(CASES[1], id="excluded_partial", marks=pytest.mark.slow),
    pytest.param(CASES[3], id="attnres", marks=pytest.mark.slow),
    pytest.param(CASES[6], id="msar_mean_2tiles_chunks", marks=pytest.mark.slow),
])
def test_wide_form_matches_xla(case):
    """Pass 3 in the ``wide`` form (the stream cotangents written, then ``conv_transpose``):
    every gradient against the XLA closed form."""
    kernels, heads, segments, include, gated, t, d, tiles, _ = case
    state, partial, bank, query, seg, gate, dh = _inputs(kernels, heads, segments, gated, t, d,
                                                         seed=7 * sum(kernels) + heads + include)
    inc = jnp.asarray(include)
    if tiles is None:
        tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1, backend="tpu")
    fn = functools.partial(fb.phase2_fused_backward, stream_kernels=kernels, heads=heads, eps=1e-6, gate_eps=1e-6,
                           tiles=tiles, backend="interpret", interpret=True, form="wide")

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(state, partial, bank, query, inc, gate, seg, dh):
        return fn(state, partial, bank, query, inc, gate, seg, dh), _reference(
            state, partial, bank, query, inc, gate, seg, dh, kernels, heads)

    got, want = both(state, partial, bank, query, inc, gate, seg, dh)
    _compare(_flat(*got), _flat(*want))
    if not include:
        assert not jnp.any(got[1]) and not jnp.any(got[0].max)


def test_rejects_unknown_form():
    state, partial, bank, query, seg, gate, dh = _inputs((0,), 1, False, False, 4, 8, seed=0)
    with pytest.raises(ValueError, match="form='diagonal': must be one of"):
        fb.phase2_fused_backward(state, partial, bank, query, jnp.asarray(True), gate, seg, dh, stream_kernels=(0,),
                                 heads=1, eps=1e-6, gate_eps=1e-6, tiles=tiling.Tiles(8, 8, 8), backend="interpret",
                                 interpret=True, form="diagonal")


@pytest.mark.gpu
def test_gpu_wide_form_matches_xla():
    """On a GPU: the wide form's compiled kernels at the medium shape of the test above."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kernels, heads, t, d = (0, 4, 8, 12), 2, 200, 256
    state, partial, bank, query, _, gate, dh = _inputs(kernels, heads, False, True, t, d, seed=11)
    seg = jnp.asarray(np.repeat([[0] * 77 + [1] * (t - 77)], 2, axis=0), jnp.int32)
    inc = jnp.asarray(True)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1, backend="triton")
    fn = jax.jit(functools.partial(fb.phase2_fused_backward, stream_kernels=kernels, heads=heads, eps=1e-6,
                                   gate_eps=1e-6, tiles=tiles, backend="triton", interpret=False, form="wide"))
    with jax.default_matmul_precision("highest"):
        want = jax.jit(lambda *a: _reference(*a, kernels, heads))(state, partial, bank, query, inc, gate, seg, dh)
        got = fn(state, partial, bank, query, inc, gate, seg, dh)
    _compare(_flat(*got), _flat(*want), 1e-4)
