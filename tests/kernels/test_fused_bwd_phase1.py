"""The Pallas phase-1 backward kernels (``fused_bwd_phase1``) against the closed-form XLA
backward (``xla_streaming.phase1_backward``, itself tested against autodiff of the reference).

On CPU the kernels run in interpret mode with the TPU/interpret halo (previous-tile
concatenate); one test forces the Triton row shift (0/1 matrix product) through the same
path. The compiled Triton kernels are checked by the GPU-marked test.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import fused_bwd_phase1 as fb
from pallas_kernels.depth_attention import reference as ref
from pallas_kernels.depth_attention import tiling
from pallas_kernels.depth_attention import xla_streaming as xs

TOL = 2e-5
# CPU compile about 2x faster (as msar_jax.train.step.FAST_COMPILE); the kernels are interpreted.
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit(fn, **static):
    return jax.jit(functools.partial(fn, **static), compiler_options=FAST if jax.default_backend() == "cpu" else None)

# As in test_xla_streaming.py: stream_kernels, heads, segments, valid pattern.
CASES = [
    ((0, 4, 8, 12), 1, True, (1, 1, 1, 0)),
    ((0,), 1, False, (1, 1, 1, 1)),
    ((0,), 4, True, (1, 0, 1, 1)),
    ((0, 0, 0), 2, False, (1, 1, 0, 0)),
    ((0, 3), 1, True, (1, 1, 1, 1)),
]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite gradient"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _inputs(kernels, heads, segments, valid, *, n, b, t, d, s, seed=0):
    """The inputs of test_xla_streaming's phase-1 test (drawn with numpy: each new shape of
    ``jax.random.normal`` costs a CPU compile of seconds), the forward's running max and a
    random (non-zero) state cotangent."""
    rng = np.random.default_rng(sum(kernels) + heads + seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    m = len(kernels)
    sources = normal(n, b, t, d)
    banks = 0.4 * normal(n, sum(kernels), d) if sum(kernels) else None
    queries = normal(s, m, d)
    ok = jnp.asarray(valid[:n], bool)
    cut = min(4, t)
    seg = jnp.asarray([[0] * cut + [1] * (t - cut)] + [[0] * t] * (b - 1), jnp.int32) if segments else None
    smax = _jit(ref.phase1, stream_kernels=kernels, heads=heads)(sources, banks, queries, ok, segment_ids=seg).max
    g = ref.SoftmaxState(max=jnp.zeros_like(smax), denom=normal(*smax.shape), acc=normal(s, m, b, t, d))  # max: ignored
    return sources, banks, queries, ok, seg, smax, g


def _check(kernels, heads, segments, valid, *, n, t, d, tiles=None, b=2, s=3, backend="interpret", interpret=True,
           tol=TOL, shift=None, form=fb.DEFAULT_FORM):
    sources, banks, queries, ok, seg, smax, g = _inputs(kernels, heads, segments, valid, n=n, b=b, t=t, d=d, s=s)
    bank_arr = jnp.zeros((n, 0, d), jnp.float32) if banks is None else banks
    want = _jit(xs.phase1_backward, stream_kernels=kernels, heads=heads, eps=1e-6)(
        sources, bank_arr, queries, ok, seg, smax, g)[:3]
    if tiles is None:
        tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max([1, *kernels]), n_targets=s, backend="tpu")
    got = _jit(fb.phase1_backward, stream_kernels=kernels, heads=heads, eps=1e-6, tiles=tiles, backend=backend,
               interpret=interpret, shift=shift, form=form)(sources, banks, queries, ok, seg, smax, g)
    d_x, d_banks, d_q = got
    assert d_x.shape == sources.shape and d_q.shape == queries.shape
    assert _rel(d_x, want[0]) < tol, ("sources", _rel(d_x, want[0]))
    assert _rel(d_q, want[2]) < tol, ("queries", _rel(d_q, want[2]))
    if banks is None:
        assert d_banks is None
    else:
        assert d_banks.shape == banks.shape
        assert _rel(d_banks, want[1]) < tol, ("banks", _rel(d_banks, want[1]))
    # invalid sources get exactly zero gradient; the valid ones a non-trivial one
    for i, v in enumerate(valid[:n]):
        if not v:
            assert not np.any(np.asarray(d_x[i]))
    assert float(jnp.max(jnp.abs(d_x))) > 0 and float(jnp.max(jnp.abs(d_q))) > 0


# (case, n, T, tiles): tiles None = choose_tiles(backend="tpu"); explicit small tiles make T
# span several token tiles (the reverse walk and the spill of the transposed conv) and a
# head several channel chunks.
PARAMS = [
    pytest.param(CASES[0], 4, 21, tiling.Tiles(16, 4, 4), id="msar_T21_2tiles_chunks"),
    pytest.param(CASES[1], 1, 9, None, id="attnres_n1"),
    pytest.param(CASES[2], 4, 13, tiling.Tiles(4, 2, 2), id="mhar_heads4_4tiles"),
    pytest.param(CASES[3], 4, 9, None, id="noconv_heads2"),
    pytest.param(CASES[4], 1, 13, tiling.Tiles(4, 4, 4), id="conv3_n1_4tiles"),
    pytest.param(CASES[0], 1, 13, None, id="msar_n1"),
    pytest.param(CASES[1], 4, 13, tiling.Tiles(8, 8, 8), id="attnres_n4", marks=pytest.mark.slow),
    pytest.param(CASES[2], 1, 9, None, id="mhar_n1", marks=pytest.mark.slow),
    pytest.param(CASES[3], 1, 13, tiling.Tiles(4, 2, 2), id="noconv_n1", marks=pytest.mark.slow),
    pytest.param(CASES[4], 4, 9, None, id="conv3_n4"),
]


@pytest.mark.parametrize("case,n,t,tiles", PARAMS)
def test_phase1_backward_matches_xla(case, n, t, tiles):
    """The default (``wide``) form."""
    kernels, heads, segments, valid = case
    d = 16 if heads == 4 else 8
    _check(kernels, heads, segments, valid, n=n, t=t, d=d, tiles=tiles)


@pytest.mark.parametrize("case,n,t,tiles", [
    PARAMS[2],
    pytest.param(*PARAMS[0].values, id="msar_T21_2tiles_chunks", marks=pytest.mark.slow),
    pytest.param(*PARAMS[4].values, id="conv3_n1_4tiles", marks=pytest.mark.slow),
])
def test_reverse_t_form_matches_xla(case, n, t, tiles):
    """The ``reverse_t`` form (one program per source walking the tokens backwards, the
    transposed conv's spill carried): MHAR with 4 heads; in the slow suite MSAR over two token
    tiles and one conv stream of 3 over 4 tiles. (The row-shift tests below run this form with
    conv streams, two heads, segments and an invalid source by default.)"""
    kernels, heads, segments, valid = case
    d = 16 if heads == 4 else 8
    _check(kernels, heads, segments, valid, n=n, t=t, d=d, tiles=tiles, form="reverse_t")


@pytest.mark.parametrize("case,n,t,tiles", [PARAMS[2], PARAMS[3]])
def test_all_heads_query_products_match_xla(monkeypatch, case, n, t, tiles):
    """The wide form with the query gradient's products over all heads' channels at once
    (``QUERY_GRADS_HEADS``): MHAR with 4 heads over 4 token tiles, two heads without conv."""
    monkeypatch.setattr(fb, "DEFAULT_QUERY_GRADS_HEADS", "all_heads")
    kernels, heads, segments, valid = case
    _check(kernels, heads, segments, valid, n=n, t=t, d=16 if heads == 4 else 8, tiles=tiles)


def test_query_grads_rejects_unknown_heads_form():
    x = jnp.zeros((1, 1, 8, 8), jnp.float32)
    with pytest.raises(ValueError, match="heads_form='diagonal': must be one of"):
        fb._query_grads(x, None, jnp.zeros((1, 1, 1, 1, 8, 2)), None, None, stream_kernels=(0,), heads=2,
                        heads_form="diagonal")


def test_rejects_unknown_form():
    with pytest.raises(ValueError, match="form='diagonal': must be one of"):
        _check((0,), 1, False, (1,), n=1, t=4, d=8, form="diagonal")


@pytest.mark.parametrize("kernels, t, d, tiles", [
    ((0, 2, 5), 13, 16, tiling.Tiles(4, 4, 4)),
    # tiles of 16: the query gradient's token sums become [S_pad, bt] @ [bt, bd] products too
    ((0, 4, 12), 37, 32, tiling.Tiles(16, 16, 16)),
], ids=["small_tiles", "tiles16_dq_dot"])
def test_triton_row_shift_in_interpret(monkeypatch, kernels, t, d, tiles):
    """The Triton formulation on the interpret path: the transposed conv's rows shifted by a 0/1
    matrix product with the spill carried, and (tiles >= 16) the query gradient as products over
    the tile's tokens; two heads, segments, an invalid source, T ragged over 3-4 tiles."""
    monkeypatch.setattr(fb, "_dot_shift", lambda backend: True)
    _check(kernels, 2, True, (1, 1, 0), n=3, t=t, d=d, tiles=tiles, form="reverse_t")


@pytest.mark.parametrize("slots", [1, pytest.param(4, marks=pytest.mark.slow)], ids=["1_slot_11_rounds", "4_slots_3_rounds"])
def test_buffer_row_shift_in_interpret(slots):
    """The Triton row shift through a per-program scratch (``row_shift.shift_rows_via_buffer``)
    on the interpret path, in rounds of ``slots`` lags: kernels up to 12 (11 lags), two heads,
    segments, an invalid source, T ragged over 3 tiles."""
    tiles = tiling.Tiles(16, 8, 8, shift_slots=slots)
    _check((0, 4, 12), 2, True, (1, 1, 0), n=3, t=37, d=16, tiles=tiles, shift="buffer", form="reverse_t")


def test_bf16_parts_sum_to_the_float32_value():
    """The three bfloat16 terms of ``_bf16_parts`` sum back to their float32 input bit for bit,
    compiled (XLA may drop a float32 -> bfloat16 -> float32 round trip, which would keep only
    the first term's 8 bits), over 12 orders of magnitude and both signs."""
    rng = np.random.default_rng(3)
    a = jnp.asarray(10.0 ** rng.uniform(-6, 6, 4096) * rng.choice([-1, 1], 4096), jnp.float32)
    parts = jax.jit(fb._bf16_parts)(a)
    assert parts.dtype == jnp.bfloat16 and parts.shape == (3, 4096)
    total = jax.jit(lambda p: p[0].astype(jnp.float32) + p[1].astype(jnp.float32) + p[2].astype(jnp.float32))(parts)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(a))
    assert np.any(np.asarray(parts[2], np.float32) != 0)  # the third term carries bits


@pytest.mark.parametrize("heads_form", fb.QUERY_GRADS_HEADS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kernels, heads", [((0, 4, 8, 12), 1), ((0, 3), 2), ((0,), 4)],
                         ids=["msar", "conv3_heads2", "mhar_heads4"])
def test_query_grads_exact(kernels, heads, dtype, heads_form):
    """The query gradient's products over the tokens with bfloat16 sources (the model's dtype)
    run on bfloat16 inputs, the float32 ``DSR`` split into three bfloat16 terms: against the
    direct definition ``sum_{i,b,t} DSR E_r[x_i]`` in float64, float32 accuracy. ``DSR`` spans
    six orders of magnitude, so one bfloat16 term (8 bits, about 4e-3) would fail this; segments,
    an invalid source (NaN rows, zero ``DSR``), T not a multiple of anything. Also float32
    sources, and both forms of the products with several heads (``QUERY_GRADS_HEADS``)."""
    n, b, t, d, s = 3, 2, 19, 16, 3
    m = len(kernels)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((n, b, t, d)), dtype)
    x = x.at[2].set(jnp.nan)  # the invalid source (an empty buffer slot): must not reach dq
    banks = jnp.asarray(0.4 * rng.standard_normal((n, sum(kernels), d)), jnp.float32)
    scale = 10.0 ** rng.uniform(-3, 3, (s, n, m, b, t, heads))
    dsr = jnp.asarray(scale * rng.standard_normal((s, n, m, b, t, heads)), jnp.float32)
    valid = jnp.asarray([True, True, False])
    dsr = dsr * valid[None, :, None, None, None, None]
    seg = jnp.asarray([[0] * 5 + [1] * (t - 5), [0] * t], jnp.int32)
    got = jax.jit(functools.partial(fb._query_grads, stream_kernels=kernels, heads=heads, heads_form=heads_form))(
        x, banks, dsr, seg, valid)
    # the definition, in float64: E_r[x_i] expanded by the reference, then summed against DSR
    e = np.asarray(ref.expand(x, banks, kernels, seg), np.float64)  # [n, m, B, T, d]
    e = np.where(np.asarray(valid)[:, None, None, None, None, None], e.reshape(n, m, b, t, heads, d // heads), 0.0)
    want = np.einsum("sirbth,irbthe->srhe", np.asarray(dsr, np.float64), e).reshape(s, m, d)
    assert got.shape == (s, m, d) and got.dtype == jnp.float32
    assert _rel(got, want) < 1e-5, _rel(got, want)


@pytest.mark.gpu
def test_gpu_triton_matches_xla():
    """On a GPU: the compiled Triton kernels (masked halo loads, dot row shifts) at a medium
    shape against the XLA backward."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kernels, heads, s, d = (0, 4, 8, 12), 2, 4, 256
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=12, n_targets=s, backend="triton")
    with jax.default_matmul_precision("highest"):
        for shift in ("dot", "buffer"):
            _check(kernels, heads, True, (1, 0, 1), n=3, b=2, t=200, d=d, s=s, tiles=tiles, backend="triton",
                   interpret=False, tol=1e-4, shift=shift, form="reverse_t")
        _check(kernels, heads, True, (1, 0, 1), n=3, b=2, t=200, d=d, s=s, tiles=tiles, backend="triton",
               interpret=False, tol=1e-4, form="wide")
        for form in fb.FORMS:
            _check((0,), 1, False, (1,), n=1, b=2, t=77, d=128, s=2, backend="triton", interpret=False, tol=1e-4,
                   tiles=tiling.choose_tiles(d=128, heads=1, max_kernel=1, n_targets=2, backend="triton"), form=form)
