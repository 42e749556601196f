"""``api.phase2_fused(..., out_dtype=bfloat16)``: ``h`` stored in bf16 and its cotangent taken in
bf16 by every implementation (the XLA path, the Triton and Mosaic GPU kernels in interpret mode,
the TPU kernels' interpret mode), against ``reference.phase2_fused(...).astype(bfloat16)``. The
cotangent is the same bf16 values either way (a bf16 ``h``'s cotangent is bf16), so every float32
gradient agrees to float32 rounding; only ``h`` itself and the bf16 partial's gradient carry one
bf16 rounding. The kernels read the bf16 cotangent as it is and write the bf16 partial's gradient
in bf16 (half the bytes of float32 copies of them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, reference
from tests.kernels.test_depth_attention_fused import _phase2_inputs, _rel, _rnd, jit_vjp

# name, B, T, d, kernels, heads, include, segment cut, fuse
MSAR = ("msar_gate_segments_ragged_T", 2, 100, 96, (0, 4, 8, 12), 1, True, 37, "gate")
ATTNRES = ("attnres_heads2", 2, 40, 64, (0,), 2, True, None, "mean")
IMPLEMENTATIONS = {
    "xla": dict(implementation="xla"),
    "triton": dict(implementation="pallas_gpu", backward="pallas", gpu_kernels="triton"),
    "mosaic": dict(implementation="pallas_gpu", backward="pallas", gpu_kernels="mosaic"),
    "tpu": dict(implementation="pallas_tpu", backward="pallas"),
    "auto": dict(implementation="pallas_gpu", backward="pallas"),  # on a GPU: Mosaic for MSAR, Triton for one stream
}


def _run(case, impl):
    _, batch, t_len, d, kernels, heads, include, cut, fuse = case
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, heads)
    partial = partial.astype(jnp.bfloat16)
    seg = None
    if cut is not None:
        seg = np.zeros((batch, t_len), np.int32)
        seg[0, cut:] = 1
        seg = jnp.asarray(seg)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    gate = gate if fuse == "gate" else None
    if impl is None:
        fn = lambda st, x, b, q, g: reference.phase2_fused(st, x, b, q, include, g, **kw).astype(jnp.bfloat16)  # noqa: E731
    else:
        fn = lambda st, x, b, q, g: api.phase2_fused(st, x, b, q, include, g, out_dtype=jnp.bfloat16,  # noqa: E731
                                                     **IMPLEMENTATIONS[impl], **kw)
    args = (state, partial, bank, query, gate)
    return jit_vjp(fn, args, lambda out: _rnd(99, out.shape, dtype=jnp.bfloat16)), args


def _check(case, impl, tol=2e-5):
    (got, got_grads), args = _run(case, impl)
    (want, want_grads), _ = _run(case, None)
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    assert _rel(got, want) < 2**-8  # h computed in float32 both ways, rounded once to bf16
    leaves = jax.tree.leaves(got_grads)
    assert len(leaves) == len(jax.tree.leaves(want_grads)) == len(jax.tree.leaves(args))
    for g, w, a in zip(leaves, jax.tree.leaves(want_grads), jax.tree.leaves(args), strict=True):
        assert g.dtype == a.dtype and g.shape == a.shape
        if not np.any(np.asarray(w)):  # the partial's max cotangent: zero in closed form
            assert not np.any(np.asarray(g)) or float(np.max(np.abs(np.asarray(g)))) < 1e-6
            continue
        # the bf16 partial's gradient: written in bf16 by the kernels, the same float32 value
        # rounded once (up to one bf16 step where the float32 values straddle a rounding edge)
        assert _rel(g, w) < (tol if g.dtype == jnp.float32 else 2**-8), (g.shape, g.dtype, _rel(g, w))


@pytest.mark.parametrize("impl, case", [
    ("mosaic", MSAR),  # the backward's Mosaic state and input kernels with a bf16 cotangent (about 20 s)
    ("triton", ATTNRES),  # one stream's kernels on a GPU (gpu_kernels="auto")
    ("tpu", ATTNRES),
    pytest.param("xla", MSAR, marks=pytest.mark.slow),
    pytest.param("triton", MSAR, marks=pytest.mark.slow),
    pytest.param("mosaic", ATTNRES, marks=pytest.mark.slow),
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_bf16_h_and_cotangent_match_reference(impl, case):
    _check(case, impl)


def test_out_dtype_is_validated():
    state, partial, bank, query, _ = _phase2_inputs(1, 8, 32, (0,), 1)
    for bad in (jnp.int32, "float64", jnp.float16):
        with pytest.raises(ValueError, match=r"out_dtype=.*must be one of \('float32', 'bfloat16'\)"):
            api.phase2_fused(state, partial, None, query, True, None, stream_kernels=(0,), out_dtype=bad,
                             implementation="xla")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [MSAR, ATTNRES], ids=lambda c: c[0])
def test_gpu_bf16_h_and_cotangent_match_reference(case):
    """On the H200: ``"auto"`` (MSAR: Mosaic forward, state and input kernels; one stream: Triton)
    with a bf16 ``h`` and cotangent, compiled, against the reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    with jax.default_matmul_precision("highest"):
        _check(case, "auto", tol=1e-4)
