"""Properties of the residual mechanisms (docs/design.md §2-8) and of the Transformer built on them.

Cheap checks run the plain-jnp depth-attention ops eagerly against the float64 oracle
of ``tests/oracles.py`` (expansion by a direct loop over Eq. 10, reads, fusion,
Sinkhorn); the Transformer checks (causality, packed segments, the initial depth
weights, gradients, bfloat16) use one tiny model per mechanism and cache every
compiled function at module level.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import oracles
from msar_jax.model.layers import SequenceContext
from msar_jax.model.transformer import Transformer, cross_entropy
from msar_jax.residuals import attnres_read, make_mechanism, msar_read
from msar_jax.residuals.mhc import mhc_coefficients, sinkhorn
from msar_jax.stack import DepthStack
from pallas_kernels.depth_attention import reference as ref

KERNELS = (0, 4, 8, 12)


def _rng(seed):
    return np.random.default_rng(seed)


def _f32(x):
    return np.asarray(x, np.float32)


def _rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got))
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _segments(batch, t_len):
    seg = np.zeros((batch, t_len), np.int32)
    seg[0, t_len // 2 :] = 1
    seg[1, : t_len // 3] = 5
    seg[1, t_len // 3 :] = 6
    return seg


# ======================================================================================
# Expansion (Eq. 10): lag-indexed taps, zero padding, segment restart, zero init.
# ======================================================================================


@pytest.fixture(params=["unrolled", "loop"])
def conv_form(request, monkeypatch):
    """Each of ``reference.causal_conv``'s two ways of writing the taps (the CPU default is
    ``"loop"``; GPUs and TPUs run ``"unrolled"``)."""
    monkeypatch.setattr(ref, "CONV_FORM", request.param)
    return request.param


@pytest.mark.parametrize("use_seg", [False, True])
def test_expand_matches_direct_loop(use_seg, conv_form):
    """T = 6 is shorter than the kernels 8 and 12."""
    rng = _rng(0)
    b, t, d = 2, 6, 4
    x = _f32(rng.standard_normal((b, t, d)))
    bank = _f32(rng.standard_normal((sum(KERNELS), d)))
    seg = _segments(b, t) if use_seg else None
    got = ref.expand(x, bank, KERNELS, None if seg is None else jnp.asarray(seg))
    want = oracles.expand_full(x.astype(np.float64), bank.astype(np.float64), KERNELS, seg)
    assert _rel(got, want) < 1e-6


# x shape, bank shape: one source; sources with their own banks; an x axis the bank broadcasts
# over (its tap gradient sums over it).
_CONV_SHAPES = {"one": ((2, 19, 8), (24, 8)), "per_source": ((3, 2, 19, 8), (3, 24, 8)),
                "x_axis": ((3, 2, 19, 8), (24, 8))}


@pytest.mark.parametrize("shapes", list(_CONV_SHAPES.values()), ids=list(_CONV_SHAPES))
def test_conv_forms_give_the_same_bits(shapes, monkeypatch):
    """``"loop"`` (the CPU default: a constant op count, a quarter less compile time for the
    smoke MSAR train step) and ``"unrolled"`` (one fused pass on a GPU or TPU) add the same
    products in the same order: the expansion and its gradients (the custom backward) agree bit
    for bit, compiled, with segments and T shorter than the kernel of 12 in one segment."""
    x_shape, bank_shape = shapes
    rng = _rng(5)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    bank = jnp.asarray(rng.standard_normal(bank_shape), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(jnp.broadcast_shapes(x_shape[:-3], bank_shape[:-2]) + (4, *x_shape[-3:])),
                     jnp.float32)
    seg = jnp.asarray(_segments(2, 19))
    results = {}
    for form in ("unrolled", "loop"):
        monkeypatch.setattr(ref, "CONV_FORM", form)

        def f(xx, bb):
            y, vjp = jax.vjp(lambda a, b: ref.expand(a, b, KERNELS, seg), xx, bb)
            return y, vjp(dy)

        results[form] = jax.tree.map(np.asarray, jax.jit(f)(x, bank))
    jax.tree.map(np.testing.assert_array_equal, results["loop"], results["unrolled"])
    assert np.any(results["loop"][1][1] != 0) and np.any(results["loop"][1][0] != 0)


def test_conv_form_rejects_unknown(monkeypatch):
    monkeypatch.setattr(ref, "CONV_FORM", "scan")
    with pytest.raises(ValueError, match="CONV_FORM='scan': must be 'unrolled', 'loop' or None"):
        ref.expand(jnp.ones((1, 4, 2)), jnp.ones((4, 2)), (0, 4))


def test_expand_lag_direction_and_segment_restart():
    """A single tap at lag 2 delays the sequence by two tokens, zero before the start
    and before every segment start (explicit expected values, no oracle)."""
    b, t, d = 1, 7, 3
    x = np.arange(1, b * t * d + 1, dtype=np.float32).reshape(b, t, d)
    bank = np.zeros((4, d), np.float32)
    bank[2] = 1.0  # stream kernel 4, lag 2
    seg = np.array([[0, 0, 0, 1, 1, 1, 1]], np.int32)
    y = np.asarray(ref.expand(x, bank, (0, 4), jnp.asarray(seg)))
    np.testing.assert_array_equal(y[0], x)  # the identity stream
    want = np.zeros_like(x)
    want[0, 2] = x[0, 0]  # token 2 sees token 0 (same segment)
    want[0, 5] = x[0, 3]  # token 5 sees token 3 (first of segment 1)
    want[0, 6] = x[0, 4]
    np.testing.assert_array_equal(y[1], want)
    y_noseg = np.asarray(ref.expand(x, bank, (0, 4), None))
    want_noseg = np.zeros_like(x)
    want_noseg[0, 2:] = x[0, :-2]
    np.testing.assert_array_equal(y_noseg[1], want_noseg)


def test_zero_bank_gives_exactly_zero_conv_streams():
    rng = _rng(1)
    x = _f32(rng.standard_normal((2, 9, 8)))
    y = np.asarray(ref.expand(x, np.zeros((sum(KERNELS), 8), np.float32), KERNELS, None))
    np.testing.assert_array_equal(y[0], x)
    assert np.all(y[1:] == 0.0)


# ======================================================================================
# Reads: direct vs oracle, two-phase vs direct, weights, ablations, MHAR H = 1.
# ======================================================================================


def _read_inputs(seed, n, b, t, d, kernels, n_targets):
    rng = _rng(seed)
    sources = _f32(rng.standard_normal((n, b, t, d)))
    banks = _f32(0.5 * rng.standard_normal((n, sum(kernels), d))) if sum(kernels) else None
    queries = _f32(0.7 * rng.standard_normal((n_targets, len(kernels), d)))
    return sources, banks, queries


READ_MODES = [
    pytest.param((0,), 1, id="attnres"),
    pytest.param((0,), 4, id="mhar_H4"),
    pytest.param(KERNELS, 1, id="msar"),
    pytest.param((0, 0, 0), 1, id="msar_noconv"),
]


@pytest.mark.parametrize("kernels,heads", READ_MODES)
def test_depth_read_matches_oracle_and_weights_normalised(kernels, heads):
    n, b, t, d = 4, 2, 6, 8
    sources, banks, queries = _read_inputs(2, n, b, t, d, kernels, 1)
    valid = np.array([True, True, False, True])  # an unfilled buffer entry holds garbage
    seg = _segments(b, t)
    z, alpha = ref.depth_read(
        sources, banks, queries[0], jnp.asarray(valid), stream_kernels=kernels, heads=heads,
        segment_ids=jnp.asarray(seg), return_weights=True,
    )
    srcs = [(sources[i].astype(np.float64), None if banks is None else banks[i].astype(np.float64)) for i in range(n) if valid[i]]
    z_want, alpha_want = oracles.depth_read(srcs, queries[0].astype(np.float64), kernels, heads, seg, return_weights=True)
    assert _rel(z, z_want) < 1e-5
    alpha = np.asarray(alpha)
    assert np.all(alpha[~valid] == 0.0)
    np.testing.assert_allclose(alpha[valid], alpha_want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(alpha.sum(axis=0), 1.0, atol=1e-6)


@pytest.mark.parametrize("kernels,heads", READ_MODES)
@pytest.mark.parametrize("n_valid", [1, 3])
def test_two_phase_equals_direct(kernels, heads, n_valid):
    """Phase 1 over the completed sources of a block, phase 2 per target with its
    partial (or none, for the block's first target), equal the direct read (docs/design.md §5)."""
    n, b, t, d, S = 4, 2, 6, 8, 3
    sources, banks, queries = _read_inputs(3, n, b, t, d, kernels, S)
    rng = _rng(4)
    partials = _f32(rng.standard_normal((S, b, t, d)))
    pbanks = _f32(0.5 * rng.standard_normal((S, sum(kernels), d))) if banks is not None else None
    valid = np.arange(n) < n_valid
    seg = jnp.asarray(_segments(b, t))
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    state = ref.phase1(sources, banks, queries, jnp.asarray(valid), **kw)
    for j in range(S):
        include = j > 0
        pb = None if pbanks is None else pbanks[j]
        got = ref.phase2(jax.tree.map(lambda a: a[j], state), partials[j], pb, queries[j], include, **kw)
        all_src = np.concatenate([sources, partials[j][None]], 0)
        all_banks = None if banks is None else np.concatenate([banks, pb[None]], 0)
        all_valid = np.concatenate([valid, [include]])
        want = ref.depth_read(all_src, all_banks, queries[j], jnp.asarray(all_valid), **kw)
        assert _rel(got, want) < 1e-5, (j, _rel(got, want))


def test_no_conv_is_identity_streams_and_delta_conv_equals_no_conv():
    """w/o Conv: every stream is the identity (m copies of each source, m queries kept);
    a conv whose every stream is a unit tap at lag 0 gives the same read."""
    n, b, t, d, m = 3, 2, 6, 8, 4
    sources, banks, queries = _read_inputs(5, n, b, t, d, KERNELS, 1)
    q = queries[0]
    rng = _rng(6)
    gate = (_f32(rng.standard_normal((m * d, m)) / np.sqrt(m * d)), np.float32(0.8), _f32(0.5 * rng.standard_normal(m)))
    h_noconv, _, z_noconv = msar_read(sources, banks, q, gate, conv=False, return_weights=True)
    srcs = [(sources[i].astype(np.float64), None) for i in range(n)]
    z_want = oracles.depth_read(srcs, q.astype(np.float64), (0,) * m)
    assert _rel(z_noconv, z_want) < 1e-5
    g64 = tuple(np.asarray(a, np.float64) for a in gate)
    assert _rel(h_noconv, oracles.fuse_gate(z_want, *g64)) < 1e-5
    delta = np.zeros_like(banks)
    off = 0
    for k in KERNELS[1:]:
        delta[:, off] = 1.0
        off += k
    h_delta = msar_read(sources, delta, q, gate, kernel_sizes=KERNELS[1:], conv=True)
    assert _rel(h_delta, h_noconv) < 1e-6


def test_mean_fusion_is_mean_of_streams_and_gate_matches_oracle():
    n, b, t, d, m = 3, 2, 5, 8, 4
    sources, banks, queries = _read_inputs(7, n, b, t, d, KERNELS, 1)
    h_mean, _, z = msar_read(sources, banks, queries[0], None, return_weights=True)
    np.testing.assert_allclose(np.asarray(h_mean), np.asarray(z).mean(axis=0), rtol=1e-6, atol=1e-6)
    rng = _rng(8)
    w, a, bias = _f32(rng.standard_normal((m * d, m)) / np.sqrt(m * d)), np.float32(-1.3), _f32(rng.standard_normal(m))
    got = ref.fuse_gate(z, w, a, bias)
    want = oracles.fuse_gate(np.asarray(z, np.float64), w.astype(np.float64), float(a), bias.astype(np.float64))
    assert _rel(got, want) < 1e-5


def test_attnres_read_is_single_stream_depth_read():
    n, b, t, d = 3, 2, 5, 8
    sources, _, queries = _read_inputs(9, n, b, t, d, (0,), 1)
    got = attnres_read(sources, queries[0, 0], heads=2)
    srcs = [(sources[i].astype(np.float64), None) for i in range(n)]
    assert _rel(got, oracles.depth_read(srcs, queries[0].astype(np.float64), (0,), heads=2)[0]) < 1e-5


@functools.cache
def _stack_forward(name, **res):
    cfg = oracles.library_config(name, 2, 8, **res)
    mech = make_mechanism(cfg, nnx.Rngs(0))
    stack = DepthStack(mech, oracles.toy_sublayer_fn, ("dense", "dense"))

    def f(mp, lp, e):
        pos = jnp.broadcast_to(jnp.arange(e.shape[1], dtype=jnp.int32), e.shape[:2])
        return stack(mp, lp, e, SequenceContext(pos, None))[0]

    return mech, jax.jit(f, compiler_options=oracles.FAST_COMPILE)


def test_mhar_with_one_head_equals_attnres():
    rng = _rng(10)
    mech_a, f_a = _stack_forward("attnres", block_size=2)
    _, f_h = _stack_forward("mhar", block_size=2, heads=1)
    params = oracles.randomize_params(nnx.to_pure_dict(nnx.state(mech_a, nnx.Param)), rng, 8)
    lp = oracles.toy_layer_params(rng, 2, 8)
    e = _f32(rng.standard_normal((2, 5, 8)))
    np.testing.assert_allclose(np.asarray(f_h(params, lp, e)), np.asarray(f_a(params, lp, e)), rtol=0, atol=1e-6)


# ======================================================================================
# mHC coefficients and Sinkhorn (docs/design.md §6).
# ======================================================================================


def test_sinkhorn_doubly_stochastic_and_matches_oracle():
    rng = _rng(11)
    logits = _f32(rng.standard_normal((3, 5, 4, 4)))
    c = np.asarray(sinkhorn(jnp.asarray(logits), 20), np.float64)
    assert np.all(c >= 0)
    np.testing.assert_allclose(c.sum(axis=-2), 1.0, atol=1e-5)  # columns of C
    h_res = np.swapaxes(c, -1, -2)  # H_res = C^T
    np.testing.assert_allclose(h_res.sum(axis=-1), 1.0, atol=1e-5)  # rows of H_res
    np.testing.assert_allclose(c.sum(axis=-1), 1.0, atol=1e-3)  # nearly doubly stochastic
    for idx in np.ndindex(3, 5):
        want = oracles.sinkhorn(logits[idx].astype(np.float64), 20)
        np.testing.assert_allclose(c[idx], want, rtol=1e-5, atol=1e-6)


def test_mhc_coefficients_match_oracle():
    rng = _rng(12)
    m, d = 4, 8
    x_state = _f32(rng.standard_normal((2, 3, m, d)))
    p = {
        "phi": _f32(2.0 * rng.standard_normal((m * d, m * m + 2 * m)) / np.sqrt(m * d)),
        "bias": _f32(0.5 * rng.standard_normal(m * m + 2 * m)),
        "scale": _f32(rng.uniform(0.5, 1.5, 3)),
    }
    h_pre, h_post, c = (np.asarray(a) for a in mhc_coefficients(p, jnp.asarray(x_state), 20))
    assert np.all((h_pre > 0) & (h_pre < 1)) and np.all((h_post > 0) & (h_post < 2))
    p64 = {k: v.astype(np.float64) for k, v in p.items()}
    for bi, ti in np.ndindex(2, 3):
        pre, post, cc = oracles.mhc_coefficients_token(x_state[bi, ti].astype(np.float64), p64["phi"], p64["bias"], p64["scale"])
        np.testing.assert_allclose(h_pre[bi, ti], pre, rtol=1e-5)
        np.testing.assert_allclose(h_post[bi, ti], post, rtol=1e-5)
        np.testing.assert_allclose(c[bi, ti], cc, rtol=1e-5, atol=1e-6)


# ======================================================================================
# Initialisation and parameter counts (docs/design.md §3, §4, §6; Appendix C Eq. 19-20).
# ======================================================================================


def _pure(mech):
    return nnx.to_pure_dict(nnx.state(mech, nnx.Param))


def _count(tree):
    return sum(int(np.size(v)) for v in jax.tree.leaves(tree))


def test_fresh_parameters_and_counts():
    d, n_layers = 16, 3
    L = 2 * n_layers
    p = _pure(make_mechanism(oracles.library_config("msar", n_layers, d, block_size=2), nnx.Rngs(0)))
    assert np.all(np.asarray(p["queries"]) == 0) and np.all(np.asarray(p["conv_banks"]) == 0)
    assert np.all(np.asarray(p["gate_b"]) == 0) and np.allclose(np.asarray(p["gate_a"]), 0.01)
    assert np.asarray(p["conv_banks"]).shape == (L, 24, d)
    assert _count(p) == L * (44 * d + 5)  # Eq. 20 at m = 4, kernels (4, 8, 12)
    p = _pure(make_mechanism(oracles.library_config("msar", n_layers, d, block_size=2, fusion="mean"), nnx.Rngs(0)))
    assert _count(p) == L * (4 * d + 24 * d)  # queries and conv only
    p = _pure(make_mechanism(oracles.library_config("mhc", n_layers, d, streams=4), nnx.Rngs(0)))
    assert _count(p) == L * (96 * d + 27)  # Eq. 19 at m = 4
    assert np.allclose(np.asarray(p["scale"]), 0.01) and np.all(np.asarray(p["bias"]) == 0)
    p = _pure(make_mechanism(oracles.library_config("attnres", n_layers, d, block_size=2), nnx.Rngs(0)))
    assert _count(p) == (L + 1) * d and all(np.all(np.asarray(v) == 0) for v in jax.tree.leaves(p))


# ======================================================================================
# The Transformer: causality, packed segments, initial depth weights, grads, bf16.
# ======================================================================================

MODEL_MECHS = {
    "vanilla": {},
    "mhc": dict(streams=4),
    "attnres": dict(block_size=2),
    "mhar": dict(block_size=2, heads=4),
    "msar": dict(block_size=2),
    "attnres_mhc": dict(block_size=2, streams=4),
}
V, T_MODEL, D_MODEL = 32, 10, 16


def _model_cfg(name, dtype="float32"):
    cfg = oracles.library_config(name, 2, D_MODEL, **MODEL_MECHS[name])
    cfg.dtype = dtype
    cfg.init_std = 0.2
    return cfg


DEPTH_MECHS = ("attnres", "mhar", "msar", "attnres_mhc")  # mechanisms with depth-attention weights
GRAD_MECHS = ["msar", "attnres_mhc"]  # every mechanism's gradients are also checked in
# test_mechanisms_oracle.py against the float64 oracle; here through the real sublayers.


@functools.cache
def _model(name, dtype="float32"):
    """A tiny Transformer with random non-zero mechanism parameters (float32 model
    parameters shared between dtypes) and its jitted functions."""
    model = Transformer(_model_cfg(name, dtype), nnx.Rngs(0))
    st = nnx.state(model.residual, nnx.Param)
    nnx.replace_by_pure_dict(st, oracles.randomize_params(nnx.to_pure_dict(st), _rng(13), D_MODEL))
    nnx.update(model.residual, st)
    graphdef, params = nnx.split(model, nnx.Param)
    if dtype != "float32":  # the same parameters as the float32 model
        params = _model(name)[1]

    @functools.partial(jax.jit, compiler_options=oracles.FAST_COMPILE)
    def loss_grad(params, tokens, targets):
        def loss_fn(p):
            logits, _ = nnx.merge(graphdef, p)(tokens)
            return cross_entropy(logits, targets), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return loss, logits, grads

    @functools.partial(jax.jit, compiler_options=oracles.FAST_COMPILE)
    def logits_seg(params, tokens, seg):
        """Logits and the token-averaged depth weights (None for vanilla / mHC). With
        ``collect_weights`` the reads take the direct path (equal to the two-phase one, docs/design.md §5)."""
        logits, aux = nnx.merge(graphdef, params)(tokens, segment_ids=seg, collect_weights=name in DEPTH_MECHS)
        return logits, aux.get("depth_weights")

    return graphdef, params, loss_grad, logits_seg


def _tokens(seed, b=2, t=T_MODEL):
    return _rng(seed).integers(0, V, (b, t)).astype(np.int32)


def _one_segment(tokens):
    return np.zeros_like(tokens)


@functools.cache
def _base_logits(name):
    _, params, _, logits_seg = _model(name)
    tokens = _tokens(20)
    return tokens, np.asarray(logits_seg(params, tokens, _one_segment(tokens))[0])


@pytest.mark.parametrize("name", list(MODEL_MECHS))
def test_causality(name):
    """Changing tokens after position t changes no logit at or before t (the MSAR conv
    included); the later logits do change."""
    _, params, _, logits_seg = _model(name)
    tokens, logits = _base_logits(name)
    for t in (0, 3, 6):
        other = tokens.copy()
        other[:, t + 1 :] = (other[:, t + 1 :] + 1 + _rng(t).integers(0, V - 1, other[:, t + 1 :].shape)) % V
        logits2 = np.asarray(logits_seg(params, other, _one_segment(other))[0])
        np.testing.assert_allclose(logits2[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-5, err_msg=f"{name} t={t}")
        assert np.max(np.abs(logits2[:, t + 1 :] - logits[:, t + 1 :])) > 1e-3


@pytest.mark.parametrize("name", list(MODEL_MECHS))
def test_packed_segments_are_independent(name):
    """With segment ids, each packed sequence's logits depend only on its own tokens,
    in both directions (the conv restarts at a segment boundary, docs/design.md §4.1)."""
    _, params, _, logits_seg = _model(name)
    tokens, _ = _base_logits(name)
    cut = 4
    seg = np.zeros_like(tokens)
    seg[0, cut:] = 1  # row 0: two packed sequences; row 1: one
    base = np.asarray(logits_seg(params, tokens, seg)[0])
    second = tokens.copy()
    second[0, cut:] = (second[0, cut:] + 7) % V
    out = np.asarray(logits_seg(params, second, seg)[0])
    np.testing.assert_allclose(out[0, :cut], base[0, :cut], rtol=0, atol=1e-5, err_msg=f"{name}: segment 1 saw segment 2")
    first = tokens.copy()
    first[0, :cut] = (first[0, :cut] + 7) % V
    out = np.asarray(logits_seg(params, first, seg)[0])
    np.testing.assert_allclose(out[0, cut:], base[0, cut:], rtol=0, atol=1e-5, err_msg=f"{name}: segment 2 saw segment 1")
    assert np.max(np.abs(out[0, :cut] - base[0, :cut])) > 1e-3


@pytest.mark.parametrize("name", list(MODEL_MECHS))
def test_collect_weights_works_for_every_mechanism(name):
    """``Transformer.__call__(collect_weights=True)`` is part of the model's API for any
    mechanism (docs/design.md §12: the transformer never looks at a mechanism's name): depth
    mechanisms return ``[L, N+2, m]`` weights, the others none. Traced only (eval_shape)."""
    cfg = _model_cfg(name)
    graphdef, params = nnx.split(Transformer(cfg, nnx.Rngs(0)), nnx.Param)
    tokens = jnp.asarray(_tokens(41))
    logits, aux = jax.eval_shape(lambda p, t: nnx.merge(graphdef, p)(t, collect_weights=True), params, tokens)
    assert logits.shape == (*tokens.shape, V)
    if name in DEPTH_MECHS:
        L, S = 2 * cfg.n_layers, cfg.residual.block_size
        m = cfg.residual.streams if name == "msar" else 1
        assert aux["depth_weights"].shape == (L, -(-L // S) + 2, m)
    else:
        assert "depth_weights" not in aux


@pytest.mark.parametrize("name", DEPTH_MECHS)
def test_fresh_model_depth_weights_uniform(name):
    """Zero-initialised queries: every read's depth weights are uniform over the sources
    that exist (b_0..b_n, plus the partial unless l is first in its block), zero for the
    others, and each stream's weights sum to one."""
    cfg = _model_cfg(name)
    _, fresh = nnx.split(Transformer(cfg, nnx.Rngs(1)), nnx.Param)  # the same structure as _model(name)
    tokens = _tokens(40)
    weights = np.asarray(_model(name)[3](fresh, tokens, _one_segment(tokens))[1])
    L, S = 2 * cfg.n_layers, cfg.residual.block_size
    N = -(-L // S)
    m = cfg.residual.streams if name == "msar" else 1
    assert weights.shape == (L, N + 2, m)
    for l in range(1, L + 1):
        n, first = (l - 1) // S, (l - 1) % S == 0
        want = np.zeros((N + 2, m))
        valid = list(range(n + 1)) + ([] if first else [N + 1])
        want[valid] = 1.0 / len(valid)
        np.testing.assert_allclose(weights[l - 1], want, rtol=1e-6, atol=1e-7, err_msg=f"{name} l={l}")


@functools.cache
def _base_run(name):
    _, params, loss_grad, _ = _model(name)
    tokens, targets = _tokens(20), _tokens(21)
    loss, logits, grads = loss_grad(params, tokens, targets)
    return tokens, targets, float(loss), np.asarray(logits), grads


@pytest.mark.parametrize("name", GRAD_MECHS)
def test_model_gradients_finite_and_match_finite_differences(name):
    """Directional derivatives of the loss along random directions in the mechanism's
    and the backbone's parameters: autodiff vs float32 central differences. The logits
    without segment ids equal those with one segment per row."""
    _, params, loss_grad, _ = _model(name)
    tokens, targets, loss, logits, grads = _base_run(name)
    np.testing.assert_allclose(logits, _base_logits(name)[1], rtol=0, atol=1e-5)
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    rng = _rng(50)
    flat_p, treedef = jax.tree.flatten(params)
    flat_g = jax.tree.leaves(grads)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    groups = {
        "mechanism": [i for i, p in enumerate(paths) if "residual" in p],
        "backbone": [i for i, p in enumerate(paths) if "residual" not in p],
    }
    eps = 2e-3
    for group, idx in groups.items():
        # Half the autodiff gradient's direction (so the derivative stands well above the
        # float32 noise of the differences), half a random direction (so an error along
        # the gradient's orthogonal complement shows too).
        gnorm = np.sqrt(sum(float(np.sum(np.asarray(flat_g[i], np.float64) ** 2)) for i in idx))
        r = {i: rng.standard_normal(np.shape(flat_p[i])) for i in idx}
        rnorm = np.sqrt(sum(float(np.sum(x * x)) for x in r.values()))
        u = [np.zeros(np.shape(p), np.float32) for p in flat_p]
        for i in idx:
            u[i] = (np.asarray(flat_g[i], np.float64) / gnorm + r[i] / rnorm).astype(np.float32)
        norm = np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in u))
        u = [x / np.float32(norm) for x in u]
        ad = sum(float(np.sum(np.asarray(g, np.float64) * x)) for g, x in zip(flat_g, u))
        shifted = lambda s: jax.tree.unflatten(treedef, [p + s * x for p, x in zip(flat_p, u)])  # noqa: E731
        fd = (float(loss_grad(shifted(eps), tokens, targets)[0]) - float(loss_grad(shifted(-eps), tokens, targets)[0])) / (2 * eps)
        assert abs(ad) > 0.3 * gnorm, f"{name}/{group}: degenerate direction"
        assert abs(ad - fd) <= 3e-3 * abs(ad) + 1e-4, f"{name}/{group}: autodiff {ad:.6e} vs finite differences {fd:.6e}"


@pytest.mark.parametrize("name", ["mhc", "msar", "attnres_mhc"])
def test_bfloat16_forward_close_to_float32(name):
    _, params, _, logits_seg = _model(name, "bfloat16")
    tokens, logits32 = _base_logits(name)
    targets = _tokens(21)
    loss32 = float(cross_entropy(jnp.asarray(logits32), jnp.asarray(targets)))
    logits16 = np.asarray(logits_seg(params, tokens, _one_segment(tokens))[0], np.float32)
    assert np.all(np.isfinite(logits16))
    scale = max(1.0, float(np.max(np.abs(logits32))))
    assert np.max(np.abs(logits16 - logits32)) < 5e-2 * scale
    loss16 = float(cross_entropy(jnp.asarray(logits16), jnp.asarray(targets)))
    assert abs(loss16 - loss32) < 1e-2 * abs(loss32)
