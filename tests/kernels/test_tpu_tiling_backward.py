"""The token-tiled Mosaic TPU backward kernels (``backend="tpu"``: ``fused_bwd_phase1``'s wide form,
``fused_bwd_phase2``'s reverse-T form, ``conv_transpose.sources_transpose_tpu``) against the XLA
closed forms, with tiles capped (``Tiles.tpu_block_t`` / ``tpu_block_d``) so that T spans several tiles, the conv's
halo and the transposed conv's look-ahead cross tile edges (and a segment start), d = 160 is padded
to 256 lanes and MHAR's 64-channel heads to 128 each. Under Pallas' generic interpreter here; under
TPU interpret mode (``pltpu.InterpretParams``: VMEM, SMEM and DMAs simulated) in the slow suite."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.depth_attention import conv_transpose, fused_bwd_phase1, fused_bwd_phase2, reference, tiling
from pallas_kernels.depth_attention import xla_streaming as xs
from tests.kernels.test_fused_bwd_phase1 import _inputs as _p1_inputs, _jit, _rel
from tests.kernels.test_fused_bwd_phase2 import FAST_COMPILE, _compare, _flat, _inputs as _p2_inputs, _reference

TOL = 2e-5
CAPS = dict(tpu_block_t=16, tpu_block_d=128)  # 16 x 128 tiles: T spans several, d = 160 two chunks
# stream_kernels, heads, segments, d, T: 40 tokens = 3 tiles of 16 (the last ragged), a segment
# starting at token 4; MSAR's kernels (11-row halo) in the slow suite (a minute to interpret)
CASES = [((0, 3), 1, True, 160, 40), ((0,), 2, True, 128, 40), ((0, 3), 1, False, 128, 40),
         pytest.param((0, 4, 8, 12), 1, True, 160, 72, marks=pytest.mark.slow)]


def _interpret(mode):
    if mode == "generic":
        return True
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()


def _phase1(kernels, heads, segments, d, t, mode):
    n, s = 3, 2
    sources, banks, queries, ok, seg, smax, g = _p1_inputs(kernels, heads, segments, (1, 1, 0, 1), n=n, b=2, t=t, d=d,
                                                           s=s)
    bank_arr = jnp.zeros((n, 0, d), jnp.float32) if banks is None else banks
    want = _jit(xs.phase1_backward, stream_kernels=kernels, heads=heads, eps=1e-6)(
        sources, bank_arr, queries, ok, seg, smax, g)[:3]
    tiles = dataclasses.replace(tiling.choose_tiles(d=d, heads=heads, max_kernel=max([1, *kernels]), n_targets=s,
                                                    backend="tpu"), **CAPS)
    got = _jit(fused_bwd_phase1.phase1_backward, stream_kernels=kernels, heads=heads, eps=1e-6, tiles=tiles,
               backend="tpu", interpret=_interpret(mode), form="wide")(sources, banks, queries, ok, seg, smax, g)
    assert got[0].shape == sources.shape and got[2].shape == queries.shape
    assert _rel(got[0], want[0]) < TOL, ("sources", _rel(got[0], want[0]))
    assert _rel(got[2], want[2]) < TOL, ("queries", _rel(got[2], want[2]))
    if banks is not None:
        assert _rel(got[1], want[1]) < TOL, ("banks", _rel(got[1], want[1]))


def _phase2(kernels, heads, segments, d, t, mode, gated=True):
    state, partial, bank, query, seg, gate, dh = _p2_inputs(kernels, heads, segments, gated, t, d, seed=3)
    tiles = dataclasses.replace(tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1,
                                                    backend="tpu"), **CAPS)
    fn = functools.partial(fused_bwd_phase2.phase2_fused_backward, stream_kernels=kernels, heads=heads, eps=1e-6,
                           gate_eps=1e-6, tiles=tiles, backend="tpu", interpret=_interpret(mode))

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def both(state, partial, bank, query, gate, seg, dh):
        inc = jnp.asarray(True)
        return fn(state, partial, bank, query, inc, gate, seg, dh), _reference(state, partial, bank, query, inc, gate,
                                                                                 seg, dh, kernels, heads)

    got, want = both(state, partial, bank, query, gate, seg, dh)
    _compare(_flat(*got), _flat(*want))


@pytest.mark.parametrize("kernels,heads,segments,d,t", CASES)
def test_phase1_backward_tiled(kernels, heads, segments, d, t):
    _phase1(kernels, heads, segments, d, t, "generic")


@pytest.mark.parametrize("kernels,heads,segments,d,t", CASES)
def test_phase2_backward_tiled(kernels, heads, segments, d, t):
    _phase2(kernels, heads, segments, d, t, "generic", gated=len(kernels) > 1)


def test_mhar_head_dim_64_pads_each_head():
    """MHAR's 64-channel heads: each padded to 128 lanes, per-head scores unchanged."""
    _phase1((0,), 2, False, 128, 40, "generic")
    _phase2((0,), 2, False, 128, 40, "generic", gated=False)


def test_transpose_lookahead_crosses_tiles():
    """``sources_transpose`` on the TPU path (d = 160 padded to 256) against the reference's vjp."""
    kernels = (0, 4, 8, 12)
    key = jax.random.split(jax.random.PRNGKey(1), 4)
    x = jax.random.normal(key[0], (2, 40, 160))
    bank = 0.4 * jax.random.normal(key[1], (24, 160))
    seg = jnp.asarray([[0] * 19 + [1] * 21, [0] * 40], jnp.int32)
    de = jax.random.normal(key[2], (4, 2, 40, 160))
    _, vjp = jax.vjp(lambda x, b: reference.expand(x, b, kernels, seg), x, bank)
    want = vjp(de)
    tiles = dataclasses.replace(tiling.choose_tiles(d=160, heads=1, max_kernel=12, n_targets=1, backend="tpu"), **CAPS)
    got = conv_transpose.expansion_transpose(de, x, bank, seg, stream_kernels=kernels, tiles=tiles, backend="tpu",
                                             interpret=True)
    assert _rel(got[0], want[0]) < TOL and _rel(got[1], want[1]) < TOL


def test_tiles_fit_the_vmem_budget():
    """`base` MSAR at T = 8192 on v5e's and v5p's VMEM: every kernel's tile fits half the limit (3/4
    of VMEM), lanes are whole vregs and sublanes whole bf16 tiles; a tiny VMEM is an error naming
    the kernel."""
    for capacity in (128 << 20, 64 << 20):
        vmem = ("chip", capacity)
        chosen = fused_bwd_phase1.tpu_tiles(n=8, n_targets=8, stream_kernels=(0, 4, 8, 12), heads=1, d=1024,
                                            t_len=8192, vmem=vmem) | fused_bwd_phase2.tpu_tiles(
            stream_kernels=(0, 4, 8, 12), heads=1, d=1024, t_len=8192, gate=True, vmem=vmem)
        for tt in chosen.values():
            assert tt.vmem_need <= tt.vmem_limit // 2 and tt.vmem_limit == capacity * 3 // 4
            assert tt.block_d % 128 == 0 and tt.block_t % 16 == 0 and tt.halo == 16
    with pytest.raises(ValueError, match="phase 1"):
        fused_bwd_phase1.tpu_tiles(n=8, n_targets=8, stream_kernels=(0, 4, 8, 12), heads=1, d=1024, t_len=8192,
                                   vmem=("chip", 1 << 20))


@pytest.mark.slow
@pytest.mark.parametrize("kernels,heads,segments,d,t", [CASES[0], CASES[3].values])
def test_tpu_interpret_mode(kernels, heads, segments, d, t):
    """The same kernels under TPU interpret mode (the Mosaic TPU code path simulated on the CPU)."""
    _phase1(kernels, heads, segments, d, t, "tpu")
    _phase2(kernels, heads, segments, d, t, "tpu", gated=len(kernels) > 1)
