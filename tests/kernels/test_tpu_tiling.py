"""The Mosaic TPU forward kernels' tiling (docs/kernels.md §4, "Mosaic TPU tiling"): T in
``[block_t]`` blocks with the conv halo from a second BlockSpec (``tpu_blocks.halo_spec``), heads
padded to 128 lanes (``tpu_blocks.pad_heads``), tiles and ``vmem_limit_bytes`` from a VMEM budget
per chip (``fused.tpu_scores_tile`` / ``tpu_mix_tile``). Numbers against ``reference`` at float32 with T
over several tiles, the halo crossing tile edges and segment boundaries, d not a multiple of 128
and MHAR's 64-wide heads; under the generic interpreter (quick) and under TPU interpret mode
(``pltpu.InterpretParams``, the Mosaic code path with VMEM, SMEM and DMAs simulated; slow).
Compiles with libtpu: benchmarks/tpu_kernels_aot.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.depth_attention import fused, reference, tiling, tpu_blocks

TOL = 1e-5
# 40 tokens in 16-row tiles: three tiles, the 11-token lag of kernel 12 crosses both tile edges
T_LEN, BLOCK_T = 40, 16
TILES = tiling.Tiles(16, 128, 128, tpu_block_t=BLOCK_T)


def _rnd(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _segments(batch):
    seg = np.zeros((batch, T_LEN), np.int32)
    seg[0, 21:] = 1  # a boundary inside the second tile, 5 tokens after its start
    return jnp.asarray(seg)


CASES = [  # (d, heads, stream kernels): d = 160 pads to 256 lanes; MHAR-style 64-wide heads pad to 128
    (160, 1, (0, 4, 8, 12)),
    (128, 2, (0,)),
]


def _check_phase1(d, heads, kernels, interpret):
    n, batch, n_targets = 3, 2, 2
    m, k = len(kernels), sum(kernels)
    x = _rnd(0, (n, batch, T_LEN, d))
    banks = _rnd(1, (n, k, d), 0.5) if k else None
    q = _rnd(2, (n_targets, m, d))
    valid = jnp.array([True, False, True])  # the middle source is skipped (SMEM mask on the TPU)
    seg = _segments(batch)
    run = jax.jit(lambda x, b, q: fused.phase1_forward(
        x, b, q, valid, stream_kernels=kernels, heads=heads, segment_ids=seg, eps=1e-6, tiles=TILES, backend="tpu",
        interpret=interpret, per_target=True))
    got = run(x, banks, q)
    want = reference.split_targets(reference.phase1(x, banks, q, valid, stream_kernels=kernels, heads=heads,
                                                    segment_ids=seg))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape
        assert _rel(g, w) < TOL


def _check_phase2(d, heads, kernels, interpret):
    batch, m, k = 2, len(kernels), sum(kernels)
    state = reference.SoftmaxState(_rnd(3, (m, batch, T_LEN, heads)), jnp.exp(_rnd(4, (m, batch, T_LEN, heads))),
                                   _rnd(5, (m, batch, T_LEN, d)))
    part, q = _rnd(6, (batch, T_LEN, d)), _rnd(7, (m, d))
    bank = _rnd(8, (k, d), 0.5) if k else None
    gate = (_rnd(9, (m * d, m), 0.1), jnp.float32(1.3), _rnd(10, (m,)))
    seg = _segments(batch)
    ref_kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg)
    for fuse, params in ((None, None), ("mean", None), ("gate", gate)):
        run = jax.jit(lambda st, x, b, q, g, fuse=fuse: fused.phase2_forward(
            st, x, b, q, True, g, fuse=fuse, eps=1e-6, gate_eps=1e-6, tiles=TILES, backend="tpu", interpret=interpret,
            **ref_kw))
        got = run(state, part, bank, q, params)
        if fuse is None:
            want = reference.phase2(state, part, bank, q, True, **ref_kw)
        else:
            want = reference.phase2_fused(state, part, bank, q, True, params, **ref_kw)
        assert got.shape == want.shape
        assert _rel(got, want) < TOL, (fuse, _rel(got, want))


@pytest.mark.parametrize("d, heads, kernels", CASES)
def test_tiled_forward_generic_interpreter(d, heads, kernels):
    _check_phase1(d, heads, kernels, True)
    _check_phase2(d, heads, kernels, True)


@pytest.mark.slow
@pytest.mark.parametrize("d, heads, kernels", CASES)
def test_tiled_forward_tpu_interpret_mode(d, heads, kernels):
    _check_phase1(d, heads, kernels, pltpu.InterpretParams())
    _check_phase2(d, heads, kernels, pltpu.InterpretParams())


def _pallas_calls(fn, *args):
    return [e for e in jax.make_jaxpr(fn)(*args).eqns if e.primitive.name == "pallas_call"]


def test_tpu_blocks_tile_tokens_and_lanes():
    """No TPU forward block spans T: every token block is ``BLOCK_T`` rows or a halo of 16, every
    channel block a multiple of 128 lanes (d = 160 -> 256), and each call sets vmem_limit_bytes."""
    n, d, t_len, kernels = 3, 160, 64, (0, 4, 8, 12)
    x, banks, q = jnp.zeros((n, 1, t_len, d)), jnp.zeros((n, 24, d)), jnp.zeros((2, 4, d))
    calls = _pallas_calls(lambda x, b, q: fused.phase1_forward(
        x, b, q, None, stream_kernels=kernels, heads=1, segment_ids=None, eps=1e-6, tiles=TILES, backend="tpu",
        interpret=True), x, banks, q)
    assert len(calls) == 2
    for eqn in calls:
        assert eqn.params["compiler_params"].vmem_limit_bytes > 0
        x_block, halo_block = eqn.params["grid_mapping"].block_mappings[:2]
        sizes = [getattr(b, "block_size", None) for b in x_block.block_shape]
        assert sizes[2] == BLOCK_T and sizes[3] % 128 == 0
        assert [getattr(b, "block_size", None) for b in halo_block.block_shape][2] == tpu_blocks.halo_rows(12)


def test_tile_choice_fits_the_chip():
    """The chosen tiles fit half the limit, the limit is 3/4 of each generation's VMEM, and a
    bigger VMEM never gives a smaller tile (paper_28b, m = 8, T = 8192)."""
    shape = dict(t_len=8192, d=2560, heads=1, n_targets=8, n_streams=8, max_kernel=14, n_taps=56, x_itemsize=2)
    last = 0
    for capacity in (64 << 20, 128 << 20):
        mix = fused.tpu_mix_tile("acc", n_sources=9, out_itemsize=4, vmem=("chip", capacity), **shape)
        scores = fused.tpu_scores_tile(vmem=("chip", capacity), **shape)
        for tile in (mix, scores):
            assert tile.vmem_need <= tile.vmem_limit // 2 and tile.vmem_limit == capacity * 3 // 4
            assert tile.block_t % tile.halo == 0 and tile.block_d % 128 == 0 and 2560 % tile.block_d == 0
        assert mix.block_t * mix.block_d >= last
        last = mix.block_t * mix.block_d


def test_lane_and_halo_sizes():
    assert [tpu_blocks.padded_head_width(d // h) for d, h in ((2080, 1), (2112, 1), (1040, 1), (512, 8), (2560, 20))
            ] == [2176, 2176, 1152, 128, 128]
    halos = [tpu_blocks.halo_rows(k, size) for k, size in ((12, 4), (12, 2), (4, 4), (4, 2), (1, 4))]
    assert halos == [16, 16, 8, 16, 0]  # no conv, no halo block
    a = _rnd(0, (3, 128))
    padded = tpu_blocks.pad_heads(a, 2)
    assert padded.shape == (3, 256) and not np.any(np.asarray(padded[:, 64:128]))
    np.testing.assert_array_equal(np.asarray(tpu_blocks.unpad_heads(padded, 2, 128)), np.asarray(a))


def test_no_tile_fits_names_the_kernel():
    with pytest.raises(ValueError, match=r"mix \(acc\): no TPU tile fits the VMEM budget"):
        fused.tpu_mix_tile("acc", t_len=8192, d=128, heads=1, n_sources=64, n_targets=64, n_streams=8, max_kernel=12,
                           n_taps=24, x_itemsize=2, out_itemsize=4, vmem=("chip", 1 << 20))
