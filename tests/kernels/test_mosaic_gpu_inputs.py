"""Phase 2's backward input kernel in Mosaic GPU (``mosaic_gpu.phase2_backward_inputs``: pass 3
of ``fused_bwd_phase2``'s reverse-T form, the transposed conv and the token sums of the bank,
query and gate-weight gradients) against the Pallas pass it replaces (``_dinput_call``, itself
checked against the XLA closed form through the whole backward) on random non-zero inputs:
interpreted on the CPU, compiled in the GPU-marked test. The model-level check (forward and
every gradient of ``api.phase2_fused`` against the oracle, with ``gpu_kernels="mosaic"``, which
takes this kernel) is ``test_mosaic_gpu_phase2.test_interpreted_forward_and_grads_match_reference``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import fused, fused_bwd_phase2, heuristics, mosaic_gpu, reference, tiling
from pallas_kernels.depth_attention.mosaic_gpu import phase2_inputs

pytest.importorskip("jax.experimental.pallas.mosaic_gpu")

CASES = [
    # name, B, T, d, kernels, heads, gate, segment cut: three 64-token tiles (the reverse loop
    # and the next tile's rows), two heads, a segment boundary inside the lag windows; mean
    # fusion, without segments, and two batch rows of whole tiles in one program (the second row
    # must not see the first's d_E past its end: no segment mask hides it); one identity stream
    # without a bank (AttnRes) and a ragged last tile; T under the kernel
    ("msar_gate_segments_heads2", 2, 150, 32, (0, 4, 8, 12), 2, True, 37),
    ("msar_mean", 2, 128, 16, (0, 4, 8, 12), 1, False, None),
    ("attnres_m1", 1, 70, 16, (0,), 1, True, None),
    ("T_shorter_than_kernel", 1, 7, 8, (0, 4, 8, 12), 1, True, 3),
]


def _inputs(batch, t_len, d, kernels, heads, gate, cut, dtype=jnp.bfloat16):
    m = len(kernels)
    ks = jax.random.split(jax.random.key(0), 13)
    x = jax.random.normal(ks[0], (batch, t_len, d), dtype)
    bank = 0.3 * jax.random.normal(ks[1], (sum(kernels), d)) if any(kernels) else None
    q = jax.random.normal(ks[2], (m, d))
    a, b, u = (jax.random.uniform(ks[3 + i], (m, batch, t_len, heads), minval=0.1) for i in range(3))
    v = jax.random.normal(ks[6], (m, batch, t_len))
    acc = jax.random.normal(ks[7], (m, batch, t_len, d))
    dh = jax.random.normal(ks[8], (batch, t_len, d))
    gate_in = None
    if gate:
        gate_in = (jax.random.uniform(ks[9], (batch, t_len, m)), jax.random.normal(ks[10], (batch, t_len, m)),
                   jax.random.normal(ks[11], (batch, t_len)), jax.random.normal(ks[12], (m, d, m)))
    seg = None
    if cut is not None:
        seg = np.zeros((batch, t_len), np.int32)
        seg[0, cut:] = 1
        seg[-1, cut // 2:] = 2
        seg = jnp.asarray(seg)
    return (x, bank, q, a, b, u, v, acc, dh, gate_in, seg)


def _pass3(args, kernels, heads, backend):
    """``_dinput_call`` (T padded to its tiles) with its partials summed over the batch."""
    x, bank, q, a, b, u, v, acc, dh, gate_in, seg = args
    t_len, d, m = x.shape[1], x.shape[2], len(kernels)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1,
                                backend="tpu" if backend == "interpret" else "triton", n_streams=m)
    tiles = dataclasses.replace(tiles, block_t=max(tiles.block_t, tiling._next_pow2(max(kernels) - 1), 8))
    t_pad = -(-t_len // tiles.block_t) * tiles.block_t
    pad = lambda w, axis: fused.pad_tokens(w, axis, t_pad)  # noqa: E731
    gate_p = None if gate_in is None else (pad(gate_in[0], 1), pad(gate_in[1], 1), pad(gate_in[2], 1), gate_in[3])
    out = fused_bwd_phase2._dinput_call(
        pad(x, 1), bank, q, pad(a, 2), pad(b, 2), pad(u, 2), pad(v, 2), pad(acc, 2), pad(dh, 1), gate_p,
        None if seg is None else pad(seg, 1), stream_kernels=kernels, heads=heads, tiles=tiles, backend=backend,
        interpret=backend == "interpret", shift="concat" if backend == "interpret" else "buffer")
    return _summed(out, t_len)


def _summed(out, t_len):
    dx, dq, dbank, dw = out
    return dx[:, :t_len], jnp.sum(dq, 0), None if dbank is None else jnp.sum(dbank, 0), (
        None if dw is None else jnp.sum(dw, 0))


def _mosaic(args, kernels, heads, interpret=True):
    return _summed(mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, interpret=interpret),
                   args[0].shape[1])


def _check(got, want, tol):
    for name, g, w in zip(("d_x", "d_query", "d_bank", "d_W"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.shape == w.shape, (name, g.shape, w.shape)
            assert np.any(np.asarray(w)), name
            err = float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
            assert err < tol, (name, err)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_interpreted_inputs_kernel_matches_the_pallas_pass(case):
    """Two warpgroups per program with the streams split between them (for one stream, one:
    ``_stream_groups`` drops the empty groups), their parts of ``d_x`` and their token sums
    meeting in the first."""
    _, batch, t_len, d, kernels, heads, gate, cut = case
    args = _inputs(batch, t_len, d, kernels, heads, gate, cut)
    got = _mosaic(args, kernels, heads)
    _check(got, _pass3(args, kernels, heads, "interpret"), 1e-5)
    if cut is not None:  # the segment boundaries reach the kernel: without them d_x differs
        no_seg = _mosaic(args[:-1] + (None,), kernels, heads)
        assert float(jnp.max(jnp.abs(no_seg[0] - got[0]))) > 1e-3


def test_one_warpgroup_programs_load_their_constants_per_use(monkeypatch):
    """Each warpgroup's constants are held in registers (``"per_program"``); a program of one
    warpgroup (one stream) loads them at every use (``"per_use"``)."""
    seen = []
    real = phase2_inputs._inputs_kernel
    monkeypatch.setattr(phase2_inputs, "_inputs_kernel", lambda cfg: seen.append(cfg.constants) or real(cfg))
    for kernels in ((0, 4, 8, 12), (0,)):
        args = _inputs(1, 64, 8, kernels, 1, len(kernels) > 1, None)
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=1, interpret=True)
    assert seen == ["per_program", "per_use"], seen


@pytest.mark.slow  # case 0's two rows already share a program in the default suite
@pytest.mark.parametrize("batch", [4, 3])
def test_interpreted_inputs_kernel_with_rows_per_program_matches(batch):
    """Four (three) batch rows in one program: each row's transposed conv starts from zeros past
    its end (not the previous row's first tile), and the token sums of all the rows add up."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(batch, 128, 16, kernels, heads, True, None)  # whole tiles: the last rows reach past the end
    got = mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, interpret=True)
    assert got[1].shape[0] == 1  # per-program partial sums
    _check(_summed(got, 128), _pass3(args, kernels, heads, "interpret"), 1e-5)


def test_rows_per_program_is_the_largest_divisor_of_the_batch():
    assert phase2_inputs.INPUTS_ROWS_PER_PROGRAM == 4
    assert phase2_inputs.inputs_rows_per_program(64) == 4
    assert phase2_inputs.inputs_rows_per_program(6) == 3
    assert phase2_inputs.inputs_rows_per_program(5) == 1
    assert phase2_inputs.inputs_rows_per_program(2) == 2


def test_stream_groups_balance_the_carried_sums():
    layout = fused.stream_layout((0, 4, 8, 12))
    assert phase2_inputs._stream_groups(layout, True, 2) == ((0, 3), (1, 2))  # 22 carried sums each
    assert phase2_inputs._stream_groups(layout, True, 1) == ((0, 1, 2, 3),)
    assert phase2_inputs._stream_groups(layout, True, 3) == ((3,), (2,), (0, 1))  # 17, 13 and 14
    assert phase2_inputs._stream_groups(layout, True, 4) == ((3,), (2,), (1,), (0,))
    assert phase2_inputs._stream_groups(fused.stream_layout((0,)), True, 2) == ((0,),)


def test_inputs_kernel_refuses_shapes_it_does_not_take():
    args = _inputs(1, 70, 12, (0, 4), 1, True, None)  # a head of 12 channels: not whole 8-channel chunks
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=(0, 4), heads=1, interpret=True)
    with pytest.raises(NotImplementedError, match="kernels up to 17 taps"):
        mosaic_gpu.check_inputs_shape(d=64, heads=1, stream_kernels=(0, 20))


@pytest.mark.parametrize("choice", ["auto", "mosaic", "triton", "split_forward"])
@pytest.mark.parametrize("auto_inputs", [False, True])
def test_which_choice_takes_the_inputs_kernel(monkeypatch, choice, auto_inputs):
    """``heuristics.mosaic_phase2(kernel="inputs")`` for a compiled GPU call at `base`'s shape:
    ``"auto"`` (and ``"split_forward"``) as ``heuristics.AUTO_INPUTS`` says, ``"mosaic"`` always
    (an error for a shape the kernel does not take), never on the TPU back end or interpreted."""
    monkeypatch.setattr(heuristics, "AUTO_INPUTS", auto_inputs)

    def takes(choice, backend="triton", d=1024, interpret=False):
        return heuristics.mosaic_phase2(choice, "inputs", backend=backend, fuse="gate", stream_kernels=(0, 4, 8, 12),
                                        heads=1, d=d, dtype=jnp.bfloat16, acc_dtype=jnp.float32,
                                        out_dtype=jnp.float32, interpret=interpret)

    want = choice == "mosaic" or (choice in ("auto", "split_forward") and auto_inputs)
    assert takes(choice) is want
    assert not takes(choice, backend="tpu")
    assert not takes("auto", interpret=True)
    if choice == "mosaic":
        with pytest.raises(ValueError, match="multiple of 8"):
            takes(choice, d=1020)
    else:
        assert not takes(choice, d=1020)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, t_len", [(4, 300), (4, 320), (3, 320), (4, -320), (2, -320)])
def test_gpu_inputs_kernel_matches_the_triton_pass(batch, t_len):
    """On a GPU: the compiled kernel (TMA's zero fill before token 0 and past the last tile, at
    each row of a program) against Triton's reverse-T pass (bf16 partial, segments, two heads,
    the gate; four, three and two batch rows in a program; ragged T, and whole tiles, whose last
    rows reach past the end; ``-t_len``: without segments, whose masks would hide a row's reach
    into the next one)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    kernels, heads = (0, 4, 8, 12), 2
    args = _inputs(batch, abs(t_len), 256, kernels, heads, True, 77 if t_len > 0 else None)
    got = jax.jit(lambda *a: _mosaic(a, kernels, heads, interpret=False))(*args)
    want = jax.jit(lambda *a: _pass3(a, kernels, heads, "triton"))(*args)
    _check(got, want, 1e-5)


@pytest.mark.parametrize("t_len", [64, 128, 200])
@pytest.mark.parametrize("segments", [False, True], ids=["no_segments", "segments"])
def test_inputs_kernel_lowers_for_sm90(t_len, segments):
    """The compiled (not interpreted) kernel lowers for the H200 in Lane semantics for one, two
    and more token tiles: its first tile's window starts 16 rows before token 0, a start that
    must stay traced (TMA fills those rows; a static negative start fails on the GPU with two
    tiles)."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(2, t_len, 64, kernels, heads, True, 30 if segments else None)
    text = jax.jit(lambda *a: mosaic_gpu.phase2_backward_inputs(*a, stream_kernels=kernels, heads=heads)).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1
