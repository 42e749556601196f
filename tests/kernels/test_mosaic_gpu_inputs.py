"""Phase 2's backward input kernel in Mosaic GPU (``mosaic_gpu.phase2_backward_inputs``: pass 3
of ``fused_bwd_phase2``'s reverse-T form, the transposed conv and the token sums of the bank,
query and gate-weight gradients) against the Pallas pass it replaces (``_dinput_call``, itself
checked against the XLA closed form through the whole backward) on random non-zero inputs:
interpreted on the CPU, compiled in the GPU-marked test. The model-level check (forward and
every gradient of ``api.phase2_fused`` against the oracle, with ``gpu_kernels="mosaic"``, which
takes this kernel) is ``test_mosaic_gpu_phase2.test_interpreted_forward_and_grads_match_reference``."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import _backend, fused, fused_bwd_phase2, mosaic_gpu, reference, tiling

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
    pad = lambda w, axis: fused._pad_t(w, axis, t_pad)  # noqa: E731
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


def _mosaic(args, kernels, heads, interpret=True, warpgroups=None, rows_per_program=None):
    return _summed(mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, warpgroups=warpgroups,
                                                     rows_per_program=rows_per_program, interpret=interpret),
                   args[0].shape[1])


def _check(got, want, tol):
    for name, g, w in zip(("d_x", "d_query", "d_bank", "d_W"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert g.shape == w.shape, (name, g.shape, w.shape)
            assert np.any(np.asarray(w)), name
            err = float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w)))
            assert err < tol, (name, err)


def _case_params():
    """Every case with two warpgroups (the default) in the default suite; with one, three and four
    (options) in the slow one (the suite's time on 2 cores)."""
    fast = {1: None, 3: None, 4: None}
    slow = lambda c, wg: wg != 2 and c[0] != fast[wg]  # noqa: E731
    return [pytest.param(c, wg, id=f"{c[0]}-{wg}wg", marks=(pytest.mark.slow,) if slow(c, wg) else ())
            for wg in (2, 1, 3, 4) for c in CASES]


@pytest.mark.parametrize("case, warpgroups", _case_params())
def test_interpreted_inputs_kernel_matches_the_pallas_pass(case, warpgroups):
    """One warpgroup per program, or two to four with the streams split between them (for one
    stream, one: ``_stream_groups`` drops the empty groups); with three or four the other
    warpgroups' parts of ``d_x`` and their token sums meet in the first."""
    _, batch, t_len, d, kernels, heads, gate, cut = case
    args = _inputs(batch, t_len, d, kernels, heads, gate, cut)
    got = _mosaic(args, kernels, heads, warpgroups=warpgroups)
    _check(got, _pass3(args, kernels, heads, "interpret"), 1e-5)
    if cut is not None:  # the segment boundaries reach the kernel: without them d_x differs
        no_seg = _mosaic(args[:-1] + (None,), kernels, heads, warpgroups=warpgroups)
        assert float(jnp.max(jnp.abs(no_seg[0] - got[0]))) > 1e-3


@pytest.mark.slow  # an option against the default
@pytest.mark.parametrize("case", [CASES[1], CASES[0]], ids=lambda c: c[0])
def test_interpreted_inputs_kernel_loading_at_every_use_matches(monkeypatch, case):
    """``INPUTS_REUSE_LOADS`` off: each lag and per-token row loaded at every use (the other
    tests run the default, once per tile) gives the same gradients."""
    monkeypatch.setattr(mosaic_gpu, "INPUTS_REUSE_LOADS", False)
    _, batch, t_len, d, kernels, heads, gate, cut = case
    args = _inputs(batch, t_len, d, kernels, heads, gate, cut)
    _check(_mosaic(args, kernels, heads), _pass3(args, kernels, heads, "interpret"), 1e-5)


# the default's place (per program) in the default suite, the option (per tile) in the slow one
@pytest.mark.parametrize("constants", [pytest.param("per_tile", marks=pytest.mark.slow), "per_program"])
@pytest.mark.parametrize("warpgroups", [2, *(pytest.param(wg, marks=pytest.mark.slow) for wg in (1, 3))])
def test_interpreted_inputs_kernel_constants_held_give_the_same_bits(constants, warpgroups):
    """``INPUTS_CONSTANTS``: the taps, queries and W's columns loaded once per tile, or once per
    program and held in registers, give the same bits as loading them at every use (the values
    loaded are the same; only where they come from changes), for each warpgroup's share of them."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(2, 200, 16, kernels, heads, True, 77)
    run = lambda c: _summed(mosaic_gpu.phase2_backward_inputs(  # noqa: E731
        *args, stream_kernels=kernels, heads=heads, warpgroups=warpgroups, constants=c, interpret=True), 200)
    want, got = run("per_use"), run(constants)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert bool(jnp.all(g == w)), constants
    _check(got, _pass3(args, kernels, heads, "interpret"), 1e-5)


def test_one_warpgroup_programs_load_their_constants_per_use(monkeypatch):
    """The default ``"per_program"`` holds each warpgroup's constants in registers; a program of
    one warpgroup (all four streams: it spills more) or of one stream takes ``"per_use"``."""
    seen = []
    real = mosaic_gpu._inputs_kernel
    monkeypatch.setattr(mosaic_gpu, "_inputs_kernel", lambda cfg: seen.append((cfg.warpgroups, cfg.constants))
                        or real(cfg))
    monkeypatch.setattr(mosaic_gpu, "INPUTS_CONSTANTS", "per_program")
    for kernels, warpgroups in (((0, 4, 8, 12), 2), ((0, 4, 8, 12), 1), ((0,), 2)):
        args = _inputs(1, 64, 8, kernels, 1, len(kernels) > 1, None)
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=1, warpgroups=warpgroups,
                                          interpret=True)
    mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=(0,), heads=1, constants="per_program", interpret=True)
    assert seen == [(2, "per_program"), (1, "per_use"), (2, "per_use"), (2, "per_program")], seen


def test_inputs_kernel_refuses_an_unknown_constants_option(monkeypatch):
    kernels, heads = (0, 4), 1
    args = _inputs(1, 64, 8, kernels, heads, False, None)
    with pytest.raises(ValueError, match="constants='per_block': must be one of .*per_use"):
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, constants="per_block",
                                          interpret=True)
    monkeypatch.setattr(mosaic_gpu, "INPUTS_CONSTANTS", "per_block")
    with pytest.raises(ValueError, match="INPUTS_CONSTANTS='per_block'.*per_use"):
        _mosaic(args, kernels, heads)


@pytest.mark.slow  # an option against the default (case 0's two rows already share a program there)
@pytest.mark.parametrize("rows_per_program", [1, 2, 4])
def test_interpreted_inputs_kernel_with_rows_per_program_matches(rows_per_program):
    """Four batch rows in programs of one, two or four rows: each row's transposed conv starts
    from zeros past its end (not the previous row's first tile), and the token sums of all the
    rows add up."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(4, 128, 16, kernels, heads, True, None)  # whole tiles: the last rows reach past the end
    got = mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads,
                                            rows_per_program=rows_per_program, interpret=True)
    assert got[1].shape[0] == 4 // rows_per_program  # per-program partial sums
    _check(_summed(got, 128), _pass3(args, kernels, heads, "interpret"), 1e-5)


@pytest.mark.parametrize("warpgroups, slots", [(2, 3), pytest.param(3, 3, marks=pytest.mark.slow),
                                               pytest.param(2, 4, marks=pytest.mark.slow)])
def test_interpreted_inputs_kernel_with_more_slots_gives_the_same_bits(warpgroups, slots):
    """``INPUTS_SLOTS`` 3 or 4: more tiles in flight (buffers, fetch barriers and the handoff of
    ``d_x``'s parts per slot; the other warpgroups may run ``slots - 1`` tiles ahead) change when
    the copies come, not the values: the same bits as two, over two rows of four tiles per program."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(2, 200, 16, kernels, heads, True, 77)
    run = lambda slots: _summed(mosaic_gpu.phase2_backward_inputs(  # noqa: E731
        *args, stream_kernels=kernels, heads=heads, warpgroups=warpgroups, slots=slots, interpret=True), 200)
    want, got = run(2), run(slots)
    for g, w in zip(got, want):
        assert bool(jnp.all(g == w))
    with pytest.raises(ValueError, match="slots=5 .*must be one of"):
        run(5)


def test_widen_bits_lowers_and_the_interpreter_converts(monkeypatch):
    """``INPUTS_WIDEN="bits"``: the compiled kernel widens its bf16 lags and ``dh`` with
    ``widen_bits`` (inline Mosaic GPU code, lowered for the H200 here; its values are checked
    on the GPU: ``test_gpu_inputs_kernel_matches_the_triton_pass``), an interpreted one converts
    (the interpreter does not run inline code); a bad value names the field and the choices."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(2, 128, 64, kernels, heads, True, 30)
    args = args[:8] + (args[8].astype(jnp.bfloat16),) + args[9:]
    seen, configs = [], []
    real_widen, real_kernel = mosaic_gpu.widen_bits, mosaic_gpu._inputs_kernel
    monkeypatch.setattr(mosaic_gpu, "widen_bits", lambda plgpu, x: seen.append(x.dtype) or real_widen(plgpu, x))
    monkeypatch.setattr(mosaic_gpu, "_inputs_kernel", lambda cfg: configs.append(cfg.widen) or real_kernel(cfg))
    lower = lambda widen: jax.jit(lambda *a: mosaic_gpu.phase2_backward_inputs(  # noqa: E731
        *a, stream_kernels=kernels, heads=heads, widen=widen)).trace(*args).lower(lowering_platforms=("cuda",))
    assert lower("extf").as_text().count("custom_call @mosaic_gpu_v2") == 1 and not seen
    assert lower("bits").as_text().count("custom_call @mosaic_gpu_v2") == 1
    # per warpgroup: the lags its streams reach (0-11 and 0-7) and dh, all bf16
    assert len(seen) == 12 + 8 + 2 and set(seen) == {jnp.dtype(jnp.bfloat16)}, seen
    mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, widen="bits", interpret=True)
    assert configs == ["extf", "bits", "extf"]
    with pytest.raises(ValueError, match="widen='fast': must be one of .*extf"):
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, widen="fast", interpret=True)
    monkeypatch.setattr(mosaic_gpu, "INPUTS_WIDEN", "fast")
    with pytest.raises(ValueError, match="INPUTS_WIDEN='fast'.*extf"):
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=kernels, heads=heads, interpret=True)


def test_rows_per_program_is_the_largest_divisor_of_the_batch():
    assert mosaic_gpu.inputs_rows_per_program(64, 4) == 4
    assert mosaic_gpu.inputs_rows_per_program(6, 4) == 3
    assert mosaic_gpu.inputs_rows_per_program(7, 8) == 7
    assert mosaic_gpu.inputs_rows_per_program(5, 4) == 1
    assert mosaic_gpu.inputs_rows_per_program(2) == min(2, mosaic_gpu.INPUTS_ROWS_PER_PROGRAM)
    with pytest.raises(ValueError, match="rows_per_program=3: must be one of"):
        mosaic_gpu.inputs_rows_per_program(6, 3)


def test_stream_groups_balance_the_carried_sums():
    layout = fused._stream_layout((0, 4, 8, 12))
    assert mosaic_gpu._stream_groups(layout, True, 2) == ((0, 3), (1, 2))  # 22 carried sums each
    assert mosaic_gpu._stream_groups(layout, True, 1) == ((0, 1, 2, 3),)
    assert mosaic_gpu._stream_groups(layout, True, 3) == ((3,), (2,), (0, 1))  # 17, 13 and 14
    assert mosaic_gpu._stream_groups(layout, True, 4) == ((3,), (2,), (1,), (0,))
    assert mosaic_gpu._stream_groups(fused._stream_layout((0,)), True, 2) == ((0,),)


def test_inputs_kernel_refuses_shapes_it_does_not_take():
    args = _inputs(1, 70, 12, (0, 4), 1, True, None)  # a head of 12 channels: not whole 8-channel chunks
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        mosaic_gpu.phase2_backward_inputs(*args, stream_kernels=(0, 4), heads=1, interpret=True)
    with pytest.raises(NotImplementedError, match="kernels up to 17 taps"):
        mosaic_gpu.check_inputs_shape(d=64, heads=1, stream_kernels=(0, 20))
    with pytest.raises(ValueError, match="warpgroups=5"):
        mosaic_gpu.phase2_backward_inputs(*_inputs(1, 70, 16, (0, 4), 1, True, None), stream_kernels=(0, 4), heads=1,
                                          warpgroups=5, interpret=True)


@pytest.mark.parametrize("choice", ["auto", "mosaic", "triton", "split_forward"])
@pytest.mark.parametrize("auto_inputs", [False, True])
def test_which_choice_takes_the_inputs_kernel(monkeypatch, choice, auto_inputs):
    """``_backend._mosaic_phase2(kernel="inputs")`` for a compiled GPU call at `base`'s shape:
    ``"auto"`` (and ``"split_forward"``) as ``_backend.AUTO_INPUTS`` says, ``"mosaic"`` always
    (an error for a shape the kernel does not take), never on the TPU back end or interpreted."""
    monkeypatch.setattr(_backend, "AUTO_INPUTS", auto_inputs)
    static = types.SimpleNamespace(fuse="gate", stream_kernels=(0, 4, 8, 12), heads=1)
    partial = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.bfloat16)
    state = reference.SoftmaxState(None, None, jax.ShapeDtypeStruct((4, 64, 1024, 1024), jnp.float32))
    want = choice == "mosaic" or (choice in ("auto", "split_forward") and auto_inputs)
    assert _backend._mosaic_phase2(choice, "triton", static, partial, state, jnp.float32, False, kernel="inputs") is want
    assert not _backend._mosaic_phase2(choice, "tpu", static, partial, state, jnp.float32, False, kernel="inputs")
    assert not _backend._mosaic_phase2("auto", "triton", static, partial, state, jnp.float32, True, kernel="inputs")
    odd = jax.ShapeDtypeStruct((64, 1024, 1020), jnp.bfloat16)
    if choice == "mosaic":
        with pytest.raises(ValueError, match="multiple of 8"):
            _backend._mosaic_phase2(choice, "triton", static, odd, state, jnp.float32, False, kernel="inputs")
    else:
        assert not _backend._mosaic_phase2(choice, "triton", static, odd, state, jnp.float32, False, kernel="inputs")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "warpgroups, reuse_loads, rows_per_program, t_len, constants, widen",
    [(2, False, 4, 300, "per_use", "extf"), (3, False, 4, 300, "per_use", "extf"), (4, False, 4, 300, "per_use", "extf"),
     (2, True, 4, 300, "per_use", "extf"), (2, True, 4, 320, "per_use", "extf"), (2, True, 1, 320, "per_use", "extf"),
     (3, True, 2, 320, "per_use", "extf"), (2, True, 4, -320, "per_use", "extf"), (2, True, 4, 300, "per_tile", "extf"),
     (2, True, 4, 300, "per_program", "extf"), (3, True, 2, -320, "per_program", "extf"),
     (1, True, 4, 320, "per_program", "extf"), (2, True, 4, 300, "per_program", "bits")])
def test_gpu_inputs_kernel_matches_the_triton_pass(monkeypatch, warpgroups, reuse_loads, rows_per_program, t_len,
                                                   constants, widen):
    """On a GPU: the compiled kernel (TMA's zero fill before token 0 and past the last tile, at
    each row of a program) against Triton's reverse-T pass (bf16 partial, segments, two heads,
    the gate; four batch rows; ragged T, and whole tiles, whose last rows reach past the end;
    ``-t_len``: without segments, whose masks would hide a row's reach into the next one; bf16
    widened by Mosaic GPU's conversion or in place)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    monkeypatch.setattr(mosaic_gpu, "INPUTS_REUSE_LOADS", reuse_loads)
    monkeypatch.setattr(mosaic_gpu, "INPUTS_CONSTANTS", constants)
    monkeypatch.setattr(mosaic_gpu, "INPUTS_WIDEN", widen)
    kernels, heads = (0, 4, 8, 12), 2
    args = _inputs(4, abs(t_len), 256, kernels, heads, True, 77 if t_len > 0 else None)
    got = jax.jit(lambda *a: _mosaic(a, kernels, heads, interpret=False, warpgroups=warpgroups,
                                     rows_per_program=rows_per_program))(*args)
    want = jax.jit(lambda *a: _pass3(a, kernels, heads, "triton"))(*args)
    _check(got, want, 1e-5)


@pytest.mark.parametrize("warpgroups", [2, *(pytest.param(wg, marks=pytest.mark.slow) for wg in (1, 3))])
@pytest.mark.parametrize("t_len", [64, 128, 200])
@pytest.mark.parametrize("segments", [False, True], ids=["no_segments", "segments"])
@pytest.mark.parametrize("slots", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_inputs_kernel_lowers_for_sm90(t_len, segments, warpgroups, slots):
    """The compiled (not interpreted) kernel lowers for the H200 in Lane semantics for one, two
    and more token tiles, with two to four in flight: its first tile's window starts 16 rows before token 0, a start that
    must stay traced (TMA fills those rows; a static negative start fails on the GPU with two
    tiles)."""
    kernels, heads = (0, 4, 8, 12), 1
    args = _inputs(2, t_len, 64, kernels, heads, True, 30 if segments else None)
    text = jax.jit(lambda *a: mosaic_gpu.phase2_backward_inputs(*a, stream_kernels=kernels, heads=heads,
                                                                warpgroups=warpgroups, slots=slots)).trace(
        *args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1
