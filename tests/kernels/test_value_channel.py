"""Phase 1's value channel (``api.phase1(value_channel=True)``, ``reference.ValueChannel``).

With mean fusion the fused phase 2's value cotangent is ``d acc = (a / m) dh``; through the
channel the Pallas backward hands phase 1 ``dh`` and the per-token, per-head scale instead of
writing ``d acc``, and phase 1's kernels take it factored. Values and gradients must be those
of the same reads without the channel, for every consumer of the state: a phase-2 read that
passes the channel, one that does not (the ``acc`` cotangent comes whole), both on one target,
a gated read (the kernels return ``d acc`` whole), and the XLA path (zero channels). Random
non-zero inputs, a ragged T, an invalid source; interpret mode, float32 and bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, fused_bwd_phase1, reference, tiling

FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
N, B, T, D, S = 3, 2, 19, 16, 3
TRITON = dict(implementation="pallas_gpu", interpret=True, backward="pallas",
              tiles=tiling.Tiles(16, 8, 8, block_t_scores=8, block_t_transpose=8))


def _inputs(kernels, dtype, seed=5, shape=(N, B, T, D, S)):
    n, b, t, d, s = shape
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    m = len(kernels)
    return dict(sources=normal(n, b, t, d).astype(dtype), banks=0.4 * normal(n, max(1, sum(kernels)), d),
                queries=normal(s, m, d), partials=normal(s, b, t, d).astype(dtype), q2=normal(s, m, d),
                bank2=0.4 * normal(max(1, sum(kernels)), d), ct=normal(s, b, t, d),
                ct_denom=normal(s, m, b, t, 1), gate=(0.1 * normal(m * d, m), normal(), normal(m)))


def _loss(inp, *, kernels, heads, channel, uses, gated=False, **kw):
    """Sum over targets of <phase2_fused(target), ct> (+ a direct use of target 0's state for
    ``uses="both"``); ``uses``: ``"channel"`` (every read passes its channel), ``"plain"``
    (none does), ``"both"``."""
    n, _, _, d = inp["sources"].shape
    valid = jnp.arange(n) != 1  # source 1 invalid
    dtype = inp["sources"].dtype
    banks = inp["banks"] if any(kernels) else None

    def loss(x, bk, q, p, q2):
        out = api.phase1(x, bk, q, valid, stream_kernels=kernels, heads=heads, per_target=True,
                         value_channel=channel, **kw)
        total = 0.0
        for s in range(len(out)):
            st, ch = out[s] if channel else (out[s], None)
            assert st.acc.shape == (len(kernels), *inp["partials"].shape[1:])
            if ch is not None:
                assert ch.values.shape == inp["partials"].shape[1:] and ch.values.dtype == dtype
                assert ch.scale.shape == st.max.shape
            h = api.phase2_fused(st, p[s], inp["bank2"] if any(kernels) else None, q2[s], s > 0,
                                 inp["gate"] if gated else None, stream_kernels=kernels, heads=heads,
                                 out_dtype=dtype, value_channel=ch if uses != "plain" else None, **kw)
            total = total + jnp.sum(h.astype(jnp.float32) * inp["ct"][s])
            if uses == "both" and s == 0:  # a second consumer of acc: its cotangent comes whole too
                total = total + jnp.sum(jnp.sin(st.acc.astype(jnp.float32))) + jnp.sum(st.denom * inp["ct_denom"][0])
        return total

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), compiler_options=FAST)
    return fn(inp["sources"], banks, inp["queries"], inp["partials"], inp["q2"])


def _check(got, want, rtol):
    (gl, gg), (wl, wg) = got, want
    np.testing.assert_allclose(gl, wl, rtol=rtol)
    for g, w in zip(gg, wg):
        if w is None:
            assert g is None
            continue
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(np.max(np.abs(w))))


CASES = [  # kernels, heads, dtype, rtol, uses (the second consumer of acc in one default case)
    pytest.param((0,), 1, jnp.float32, 1e-5, "channel", id="attnres_f32"),
    pytest.param((0,), 2, jnp.float32, 1e-5, "channel", id="mhar_f32"),
    pytest.param((0,), 1, jnp.bfloat16, 1e-2, "channel", id="attnres_bf16"),
    pytest.param((0,), 1, jnp.float32, 1e-5, "both", id="attnres_f32_both"),
    pytest.param((0,), 2, jnp.float32, 1e-5, "both", id="mhar_f32_both", marks=pytest.mark.slow),
    pytest.param((0,), 1, jnp.bfloat16, 1e-2, "both", id="attnres_bf16_both", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kernels, heads, dtype, rtol, uses", CASES)
def test_channel_gives_the_same_gradients(kernels, heads, dtype, rtol, uses, monkeypatch):
    """Against the same reads without the channel; with ``"channel"`` phase 1's kernels must get
    the cotangent factored (``value_scale``), with ``"both"`` whole (a second consumer of acc)."""
    inp = _inputs(kernels, dtype)
    want = _loss(inp, kernels=kernels, heads=heads, channel=False, uses=uses, **TRITON)
    seen = []
    real = fused_bwd_phase1.phase1_backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("value_scale") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(fused_bwd_phase1, "phase1_backward", spy)
    got = _loss(inp, kernels=kernels, heads=heads, channel=True, uses=uses, **TRITON)
    assert seen == [uses == "channel"]
    _check(got, want, rtol)


def test_channel_unused_or_xla_keeps_acc_whole():
    """Reads that do not pass the channel and the XLA path (zero channels): the gradients without
    the channel. (The second consumer of ``acc``: ``uses="both"`` above.)"""
    inp = _inputs((0,), jnp.float32)
    want = _loss(inp, kernels=(0,), heads=1, channel=False, uses="plain", **TRITON)
    _check(_loss(inp, kernels=(0,), heads=1, channel=True, uses="plain", **TRITON), want, 1e-5)
    _check(_loss(inp, kernels=(0,), heads=1, channel=True, uses="channel", implementation="xla"), want, 1e-5)


@pytest.mark.slow
def test_gated_read_keeps_acc_whole():
    """A gated read with several streams: its kernels return ``d acc`` whole (the gate's ``d acc``
    does not factor), the channel's cotangent stays zero."""
    inp = _inputs((0, 4), jnp.float32)
    want = _loss(inp, kernels=(0, 4), heads=1, channel=False, uses="plain", gated=True, **TRITON)
    _check(_loss(inp, kernels=(0, 4), heads=1, channel=True, uses="channel", gated=True, **TRITON), want, 1e-5)


@pytest.mark.slow
def test_mean_fusion_with_several_streams_merges_the_channel():
    """Mean fusion of two streams: phase 2 factors ``d acc`` (scale ``a / m`` per stream), phase
    1's kernels take one stream's ``g_A`` only, so the rule rebuilds ``d acc`` whole."""
    inp = _inputs((0, 4), jnp.float32)
    want = _loss(inp, kernels=(0, 4), heads=1, channel=False, uses="plain", **TRITON)
    _check(_loss(inp, kernels=(0, 4), heads=1, channel=True, uses="channel", **TRITON), want, 1e-5)


def test_channel_value_cotangent_is_the_definition():
    rng = np.random.default_rng(0)
    values = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((2, B, T, 4)), jnp.float32)
    got = reference.channel_value_cotangent(reference.ValueChannel(values, scale))
    want = np.einsum("rbth,bthc->rbthc", np.asarray(scale), np.asarray(values).reshape(B, T, 4, D // 4))
    np.testing.assert_allclose(got, want.reshape(2, B, T, D), rtol=1e-6)


def test_value_channel_needs_per_target():
    inp = _inputs((0,), jnp.float32)
    with pytest.raises(ValueError, match="value_channel=True needs per_target=True"):
        api.phase1(inp["sources"], None, inp["queries"], stream_kernels=(0,), value_channel=True)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [1, 8])
def test_gpu_channel_gives_the_same_gradients(heads, monkeypatch):
    """On a GPU, the compiled kernels the model picks for one stream (Mosaic GPU scoring, value-dot
    and stream-cotangent passes, Triton's phase 2), bf16 sources and output: with and without the
    channel (the value cotangent factored or whole) at a medium shape, several tiles per axis."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kw = dict(implementation="pallas_gpu", backward="pallas")
    inp = _inputs((0,), jnp.bfloat16, shape=(5, 2, 200, 512, 4))
    want = _loss(inp, kernels=(0,), heads=heads, channel=False, uses="plain", **kw)
    seen = []
    real = fused_bwd_phase1.phase1_backward
    monkeypatch.setattr(fused_bwd_phase1, "phase1_backward",
                        lambda *a, **k: seen.append(k.get("value_scale") is not None) or real(*a, **k))
    got = _loss(inp, kernels=(0,), heads=heads, channel=True, uses="channel", **kw)
    assert seen == [True]
    _check(got, want, 1e-2)
