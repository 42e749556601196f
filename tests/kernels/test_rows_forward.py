"""Phase 2's fused forward with whole channel rows per program
(``pallas_kernels/depth_attention/rows_forward.py``) against the oracle (``reference.phase2_fused``)
and, on a GPU, the Mosaic kernel. Interpreted on the CPU (the partial gets zero front rows there
instead of the GPU's masked loads); the GPU-marked test runs the compiled Triton kernel. The
kernel is not wired into the package: on the H100 and the H200 it is slower than the Mosaic kernel
(docs/kernels.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.depth_attention import reference, rows_forward
from tests.kernels.test_depth_attention_fused import BF16_TOL, F32_TOL, _phase2_inputs, _rel
from tests.kernels.test_mosaic_gpu_phase2 import _segments

KERNELS = (0, 4, 8, 12)
EPS = dict(eps=1e-6, gate_eps=1e-6)


def _inputs(batch, t_len, d, cut, kernels=KERNELS, dtype=jnp.float32):
    state, partial, bank, query, gate = _phase2_inputs(batch, t_len, d, kernels, 1)
    seg = None if cut is None else _segments(batch, t_len, cut)
    return state._replace(acc=state.acc.astype(dtype)), partial.astype(dtype), bank, query, gate, seg


def _rows(args, include, fuse, kernels=KERNELS, **opts):
    state, partial, bank, query, gate, seg = args
    return rows_forward.phase2_rows_forward(state, partial, bank, query, include, gate if fuse == "gate" else None,
                                            seg, fuse=fuse, stream_kernels=kernels, heads=1, **EPS, **opts)


def _oracle(args, include, fuse, kernels=KERNELS):
    state, partial, bank, query, gate, seg = args
    return reference.phase2_fused(state, partial, bank, query, include, gate if fuse == "gate" else None,
                                  stream_kernels=kernels, heads=1, segment_ids=seg, **EPS)


def _scores(args, kernels=KERNELS):
    """The oracle's raw dots ``[m, B, T, 1]`` and the keys' sums of squares ``[m, B, T]``."""
    _, partial, bank, query, _, seg = args
    e = reference.expand(partial, bank, kernels, seg)
    return jnp.einsum("mbtd,md->mbt", e, query)[..., None], jnp.sum(e * e, axis=-1)


@pytest.mark.parametrize("include, cut, fuse, block_t, t_len", [
    pytest.param(True, 37, "gate", 4, 70, id="segments_ragged_T_gate"),
    pytest.param(False, None, "gate", 2, 33, id="partial_excluded"),
    pytest.param(True, 9, "mean", 1, 19, id="mean_one_token_a_program"),
    pytest.param(True, None, "gate", 8, 5, id="T_shorter_than_the_largest_kernel"),
])
def test_interpreted_forward_matches_oracle(include, cut, fuse, block_t, t_len):
    """``h`` and the scores against the oracle at float32 (random non-zero state, taps, queries
    and gate: ``_phase2_inputs``), with segments whose boundaries fall inside lag windows, T not
    a multiple of the tile, and the first-in-block target (``include=False``)."""
    args = _inputs(2, t_len, 64, cut)
    h, (dots, sumsq) = jax.jit(lambda *a: _rows(a, include, fuse, block_t=block_t, num_warps=4,
                                                interpret=True))(*args)
    want_dots, want_sumsq = _scores(args)
    assert h.shape == (2, t_len, 64) and dots.shape == (4, 2, t_len, 1) and sumsq.shape == (4, 2, t_len)
    assert _rel(h, _oracle(args, include, fuse)) < F32_TOL
    assert _rel(dots, want_dots) < F32_TOL and _rel(sumsq, want_sumsq) < F32_TOL


def test_interpreted_forward_other_kernels_and_bf16():
    """Kernels (0, 3) (a stream without taps beside one with three, no front-row overlap) and a
    bf16 partial and state with a bf16 ``h`` against the oracle on the same bf16 inputs."""
    args = _inputs(1, 24, 32, 11, kernels=(0, 3), dtype=jnp.bfloat16)
    h, _ = jax.jit(lambda *a: _rows(a, True, "gate", kernels=(0, 3), block_t=4, out_dtype=jnp.bfloat16,
                                    interpret=True))(*args)
    assert h.dtype == jnp.bfloat16
    assert _rel(h, _oracle(args, True, "gate", kernels=(0, 3))) < BF16_TOL


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(heads=2), NotImplementedError, "one head"),
    (dict(d=96), NotImplementedError, "power of two"),
    (dict(fuse=None), NotImplementedError, "fuse=None"),
    (dict(stream_kernels=(0, 20)), NotImplementedError, "up to 17 taps"),
    (dict(block_t=3), ValueError, "block_t=3"),
    (dict(num_warps=32), ValueError, "num_warps=32"),
])
def test_refuses_what_it_does_not_take(kwargs, error, match):
    """Shapes and tiles the kernel does not take are refused with the rule, not run."""
    d = kwargs.pop("d", 32)
    kernels = kwargs.pop("stream_kernels", KERNELS)
    state, partial, bank, query, gate, _ = _inputs(1, 16, d, None, kernels=kernels)
    opts = dict(fuse="gate", heads=1, block_t=4, interpret=True)
    opts.update(kwargs)
    with pytest.raises(error, match=match):
        rows_forward.phase2_rows_forward(state, partial, bank, query, True, gate, None, stream_kernels=kernels,
                                         **EPS, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("block_t, num_warps", [(2, 4), (8, 8)])
def test_gpu_rows_forward_matches_mosaic_kernel_and_oracle(block_t, num_warps):
    """On a GPU, the compiled Triton kernel (masked lag loads, not the interpreter's front rows):
    ``h`` and the scores against the oracle and the Mosaic kernel (float32 state, bf16 partial,
    segments, a ragged tile)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from pallas_kernels.depth_attention import mosaic_gpu

    state, partial, bank, query, gate, seg = _inputs(2, 200, 256, 77)
    args = (state, partial.astype(jnp.bfloat16), bank, query, gate, seg)
    with jax.default_matmul_precision("highest"):
        h, (dots, sumsq) = jax.jit(lambda *a: _rows(a, True, "gate", block_t=block_t, num_warps=num_warps))(*args)
        want_h, (want_dots, want_sumsq) = jax.jit(lambda st, x, b, q, g, s: mosaic_gpu.phase2_fused_forward(
            st, x, b, q, True, g, s, fuse="gate", stream_kernels=KERNELS, heads=1, **EPS))(*args)
        oracle = jax.jit(lambda *a: _oracle(a, True, "gate"))(*args)
    assert _rel(h, oracle) < 1e-4
    assert _rel(h, want_h) < 1e-5
    assert _rel(dots, want_dots) < 1e-5 and _rel(sumsq, want_sumsq) < 1e-5
