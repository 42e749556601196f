"""Phase 2's one-program form (``phase2_forward_form="rows"``, ``fused._phase2_rows_kernel``)
against the oracle and against the three-call form, forward and every gradient.

The rows form returns the scoring loop's per-token scores to the Pallas backward (as the passes
form does), so a wrong score there shows up in the gradients of ``backward="pallas"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, fused, reference, tiling

from .test_depth_attention_fused import F32_TOL, _check_tree, _phase2_inputs, _rnd, _segments

CASES = [
    # name, B, T, d, kernels, heads, include, segments, fuse, tiles
    ("msar_gate_segments_ragged", 2, 20, 64, (0, 4, 8, 12), 1, True, 11, "gate", tiling.Tiles(16, 16, 16)),
    ("msar_gate_heads2_chunks", 1, 18, 64, (0, 4, 8, 12), 2, True, None, "gate", tiling.Tiles(16, 8, 8)),
    ("msar_mean_no_partial", 1, 16, 32, (0, 4, 8, 12), 1, False, None, "mean", None),
    ("attnres_m1_gate", 2, 6, 32, (0,), 1, True, 2, "gate", None),
    ("T_shorter_than_kernel_no_partial_gate", 1, 5, 32, (0, 4, 8, 12), 1, False, None, "gate", None),
]


def _run(case, backward, form, whole=False, monkeypatch=None):
    _, batch, t_len, d, kernels, heads, include, cut, fuse, tiles = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = None if cut is None else _segments(batch, t_len, cut)
    gate = gate if fuse == "gate" else None
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    opts = dict(kw, implementation="pallas_gpu", backward=backward, phase2_forward_form=form)
    if tiles is not None:
        opts["tiles"] = tiles

    def run(f):
        out, vjp = jax.vjp(lambda st, x, b, q, g: f(st, x, b, q, include, g), state, partial, bank, query, gate)
        return out, vjp(_rnd(99, out.shape))

    got = run(lambda *a: api.phase2_fused(*a, **opts))
    want = run(lambda *a: reference.phase2_fused(*a, **kw))
    return got, want


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_rows_form_matches_reference(case):
    """Forward and the gradients of state, partial, bank, query and gate, Pallas backward."""
    (got, got_grads), (want, want_grads) = _run(case, "pallas", "rows")
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, 2e-5)


def test_rows_form_whole_tile_sums(monkeypatch):
    """The whole-tile channel sums (Triton's form; interpret mode reduces per chunk otherwise)
    forced through the interpret path, several chunks per head; the XLA backward."""
    monkeypatch.setattr(fused, "_whole_tile_sums", lambda backend, n_acc, bt, bd: True)
    (got, got_grads), (want, want_grads) = _run(CASES[1], "xla", "rows")
    _check_tree(got, want, F32_TOL)
    _check_tree(got_grads, want_grads, 2e-5)


def test_rows_form_equals_passes_form():
    """Same arithmetic as the three-call form: the outputs agree to a few float32 roundings
    (the gate's channel sums are added in another order), and so do the scores the forward
    hands to the Pallas backward."""
    _, batch, t_len, d, kernels, heads, include, cut, fuse, tiles = CASES[0]
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    seg = _segments(batch, t_len, cut)
    kw = dict(fuse="gate", stream_kernels=kernels, heads=heads, segment_ids=seg, eps=1e-6, gate_eps=1e-6,
              tiles=tiles, backend="interpret", interpret=True, return_scores=True)
    outs = {form: fused.phase2_forward(state, partial, bank, query, True, gate, form=form, **kw)
            for form in fused.PHASE2_FORMS}
    h_rows, (dots_rows, ss_rows) = outs["rows"]
    h_pass, (dots_pass, ss_pass) = outs["passes"]
    assert h_rows.shape == h_pass.shape == (batch, t_len, d)
    assert dots_rows.shape == dots_pass.shape and ss_rows.shape == ss_pass.shape
    np.testing.assert_allclose(np.asarray(dots_rows), np.asarray(dots_pass), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ss_rows), np.asarray(ss_pass), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h_rows), np.asarray(h_pass), rtol=1e-5, atol=1e-5)


def test_rows_form_rejects_bad_use():
    _, batch, t_len, d, kernels, heads, include, cut, fuse, tiles = CASES[2]
    state, partial, bank, query, _ = _phase2_inputs(batch, t_len, d, kernels, heads)
    kw = dict(stream_kernels=kernels, implementation="pallas_gpu")
    with pytest.raises(ValueError, match="form='columns'"):
        api.phase2_fused(state, partial, bank, query, True, None, phase2_forward_form="columns", **kw)
    with pytest.raises(ValueError, match="needs fuse='mean' or 'gate'"):
        api.phase2(state, partial, bank, query, True, phase2_forward_form="rows", **kw)


@pytest.mark.gpu
def test_gpu_rows_form_matches_reference():
    """On a GPU: the compiled Triton rows kernel (masked halo loads, whole-tile sums, several
    chunks per head) against the oracle, forward and the gradients through the Pallas backward."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kernels = (0, 4, 8, 12)
    state, partial, bank, query, gate = _phase2_inputs(2, 200, 256, kernels, 2)
    seg = _segments(2, 200, 77)
    kw = dict(stream_kernels=kernels, heads=2, segment_ids=seg)

    def run(f):
        out, vjp = jax.vjp(lambda st, x, b, q, g: f(st, x, b, q, True, g), state, partial, bank, query, gate)
        return out, vjp(_rnd(99, out.shape))

    with jax.default_matmul_precision("highest"):
        got = run(lambda *a: api.phase2_fused(*a, implementation="pallas_gpu", backward="pallas",
                                              phase2_forward_form="rows", **kw))
        want = run(lambda *a: reference.phase2_fused(*a, **kw))
    _check_tree(got[0], want[0], 1e-4)
    _check_tree(got[1], want[1], 1e-4)
    h = api.phase2_fused(state, partial.astype(jnp.bfloat16), bank, query, True, gate, implementation="pallas_gpu",
                         phase2_forward_form="rows", out_dtype=jnp.bfloat16, **kw)
    assert h.dtype == jnp.bfloat16
