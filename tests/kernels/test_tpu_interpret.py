"""The Mosaic TPU kernels (``implementation="pallas_tpu"``) in TPU interpret mode against the reference.

With ``interpret=pltpu.InterpretParams(...)`` the kernels take their TPU code path (``_backend``'s
``setup``: the ``"tpu"`` window and halo, ``pltpu.CompilerParams``, phase 1's source mask in scalar
memory, ``fused.token_inputs``), and Pallas runs that path on the CPU with VMEM, SMEM and the
block DMAs simulated; ``interpret=True`` runs Pallas' generic interpreter on the generic path instead.
Every check is float32 against ``reference`` (Eqs. 9-13, docs/design.md §5), forward and gradients
at random cotangents, on random non-zero inputs: an MSAR read (stream kernels (0, 2, 4), m = 3,
S = 2 targets) and the one-stream reads of AttnRes (1 head) and MHAR (2 heads), d = 128 (one TPU
lane tile). Phase 1's invalid source holds NaN: the kernels must skip it (the SMEM branch), where
the reference, which reads and masks it, is given zeros there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.depth_attention import api, conv_transpose, fused, fused_bwd_phase1, fused_bwd_phase2, \
    reference, tiling

TOL = 1e-5
TPU_INTERPRET = pltpu.InterpretParams()
MSAR, ATTNRES, MHAR = dict(stream_kernels=(0, 2, 4), heads=1), dict(stream_kernels=(0,), heads=1), \
    dict(stream_kernels=(0,), heads=2)
N, B, T, D, S = 3, 2, 16, 128, 2
VALID = (True, False, True)


def _rnd(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def _segments(cut=5):
    seg = np.zeros((B, T), np.int32)
    seg[0, cut:] = 1  # a boundary in the first row, none in the second
    return jnp.asarray(seg)


def _vjp(f, args, seed=99):
    """``f(*args)`` and its vjp at a random cotangent of every output leaf, as one program."""
    shapes = jax.eval_shape(f, *args)
    ct = jax.tree.map(lambda a: _rnd(seed + a.ndim, a.shape), shapes)

    @jax.jit
    def run(args, ct):
        out, pull = jax.vjp(f, *args)
        return out, pull(ct)

    return run(args, ct)


def _check(got, want, what):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, (what, i)
        assert np.all(np.isfinite(g)), f"{what} leaf {i}: non-finite"
        err = np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)
        assert err < TOL, f"{what} leaf {i}: relative error {err:.2e}"


# The kernel entry points ``_backend`` calls, each with the code path (``backend=``) it takes.
ENTRY_POINTS = ((fused, "phase1_forward"), (fused, "phase2_forward"), (fused_bwd_phase1, "phase1_backward"),
                (fused_bwd_phase2, "phase2_fused_backward"), (conv_transpose, "expansion_transpose"))


class PallasCalls:
    """The keyword arguments of every ``pl.pallas_call`` and the ``backend`` of every kernel entry
    point traced while installed."""

    def __init__(self, monkeypatch):
        self.calls, self.paths = [], []

        def spy(record, original):
            def call(*args, **kwargs):
                record(kwargs)
                return original(*args, **kwargs)
            return call

        monkeypatch.setattr(pl, "pallas_call", spy(self.calls.append, pl.pallas_call))
        for module, name in ENTRY_POINTS:
            original = getattr(module, name)
            monkeypatch.setattr(module, name, spy(lambda kw, name=name: self.paths.append((name, kw["backend"])),
                                                  original))

    def assert_tpu_interpret(self, params):
        """Every kernel took the TPU code path and ran in TPU interpret mode with ``params`` and
        the TPU compiler params."""
        assert self.calls, "no Pallas kernel was traced"
        assert self.paths and all(path == "tpu" for _, path in self.paths), self.paths
        for kw in self.calls:
            assert kw["interpret"] is params
            assert isinstance(kw["compiler_params"], pltpu.CompilerParams)

    def smem_inputs(self) -> int:
        return sum(getattr(spec, "memory_space", None) == pltpu.SMEM for kw in self.calls
                   for spec in jax.tree.leaves(kw.get("in_specs", ()), is_leaf=lambda s: isinstance(s, pl.BlockSpec)))


@pytest.fixture
def pallas_calls(monkeypatch):
    return PallasCalls(monkeypatch)


# ------------------------------------------------------------------------------------- phase 1


def _phase1_inputs(kernels, seed=0):
    k = reference.bank_size(kernels)
    sources = _rnd(seed, (N, B, T, D))
    banks = _rnd(seed + 1, (N, k, D), 0.5) if k else None
    queries = _rnd(seed + 2, (S, len(kernels), D))
    return sources, banks, queries


# 8-token tiles: T = 16 spans two, so the TPU halo crosses a tile edge
TILED = tiling.Tiles(8, 128, 128, tpu_block_t=8)
SLOW = (pytest.mark.slow,)  # 20-50 s each on two busy cores; the default suite keeps one case per kernel
PHASE1_CASES = [
    # id, read, options, segments, marks
    ("msar_tiled_pallas_bwd", MSAR, dict(backward="pallas", tiles=TILED), True, ()),
    ("msar_pallas_bwd", MSAR, dict(backward="pallas"), True, SLOW),
    ("msar_reverse_t_bwd", MSAR, dict(backward="pallas", phase1_backward_form="reverse_t"), True, SLOW),
    ("msar_per_target_pallas_bwd", MSAR, dict(backward="pallas", per_target=True), False, SLOW),
    ("msar_per_target_default_bwd", MSAR, dict(per_target=True), True, ()),
    ("msar_hybrid_bwd", MSAR, dict(backward="hybrid"), True, SLOW),
    ("attnres_pallas_bwd", ATTNRES, dict(backward="pallas"), True, ()),
    ("attnres_default_bwd", ATTNRES, dict(), False, SLOW),
    ("mhar_pallas_bwd", MHAR, dict(backward="pallas"), True, ()),
    ("mhar_per_target_default_bwd", MHAR, dict(per_target=True), True, SLOW),
]


@pytest.mark.parametrize("read,opts,segments", [pytest.param(*c[1:4], id=c[0], marks=c[4]) for c in PHASE1_CASES])
def test_phase1(read, opts, segments, pallas_calls):
    sources, banks, queries = _phase1_inputs(read["stream_kernels"])
    valid = jnp.asarray(VALID)
    kw = dict(read, segment_ids=_segments() if segments else None)
    per_target = opts.get("per_target", False)

    def kernels(x, bk, q):
        return api.phase1(x, bk, q, valid, implementation="pallas_tpu", interpret=TPU_INTERPRET, **opts, **kw)

    def oracle(x, bk, q):
        state = reference.phase1(x, bk, q, valid, **kw)
        return reference.split_targets(state) if per_target else state

    # The invalid source holds NaN for the kernels (never read: the scalar-memory skip) and zeros
    # for the reference (read, then masked); its gradients are zero either way.
    poison = lambda a, v: None if a is None else a.at[1].set(v)  # noqa: E731
    got, got_grads = _vjp(kernels, (poison(sources, jnp.nan), poison(banks, jnp.nan), queries))
    want, want_grads = _vjp(oracle, (poison(sources, 0.0), poison(banks, 0.0), queries))
    _check(got, want, "state")
    _check(got_grads, want_grads, "gradients (sources, banks, queries)")
    assert pallas_calls.smem_inputs() >= 1  # the forward's source mask went to scalar memory
    pallas_calls.assert_tpu_interpret(TPU_INTERPRET)


# ------------------------------------------------------------------------------------- phase 2


def _phase2_inputs(kernels, heads, seed=10):
    m, k = len(kernels), reference.bank_size(kernels)
    sources, banks, queries = _phase1_inputs(kernels, seed)
    state = jax.tree.map(lambda a: a[0], reference.phase1(sources, banks, queries, stream_kernels=kernels,
                                                          heads=heads))
    partial = _rnd(seed + 3, (B, T, D))
    bank = _rnd(seed + 4, (k, D), 0.5) if k else None
    query = _rnd(seed + 5, (m, D))
    gate = (_rnd(seed + 6, (m * D, m), 1.0 / np.sqrt(m * D)), jnp.float32(0.7), _rnd(seed + 7, (m,), 0.3))
    return state, partial, bank, query, gate


PHASE2_CASES = [
    # id, read, fuse (None: phase2's streams), options, segments, marks
    ("msar_streams", MSAR, None, dict(), True, SLOW),
    ("msar_mean_pallas_bwd", MSAR, "mean", dict(backward="pallas"), False, ()),
    ("msar_gate_pallas_bwd", MSAR, "gate", dict(backward="pallas"), True, ()),
    ("msar_gate_tiled_pallas_bwd", MSAR, "gate", dict(backward="pallas", tiles=TILED), True, SLOW),
    ("msar_gate_wide_bwd", MSAR, "gate", dict(backward="pallas", phase2_backward_form="wide"), True, SLOW),
    ("msar_gate_default_bwd", MSAR, "gate", dict(), True, SLOW),
    ("attnres_gate_pallas_bwd", ATTNRES, "gate", dict(backward="pallas"), True, SLOW),
    ("mhar_streams", MHAR, None, dict(), False, ()),
    ("mhar_gate_pallas_bwd", MHAR, "gate", dict(backward="pallas"), True, ()),
    ("mhar_mean_default_bwd", MHAR, "mean", dict(), True, ()),
]


@pytest.mark.parametrize("read,fuse,opts,segments", [pytest.param(*c[1:5], id=c[0], marks=c[5])
                                                     for c in PHASE2_CASES])
def test_phase2(read, fuse, opts, segments, pallas_calls):
    state, partial, bank, query, gate = _phase2_inputs(read["stream_kernels"], read["heads"])
    kw = dict(read, segment_ids=_segments(11) if segments else None)
    include = True
    if fuse is None:
        kernels = lambda st, x, b, q, g: api.phase2(st, x, b, q, include, implementation="pallas_tpu",  # noqa: E731
                                                    interpret=TPU_INTERPRET, **opts, **kw)
        oracle = lambda st, x, b, q, g: reference.phase2(st, x, b, q, include, **kw)  # noqa: E731
    else:
        kernels = lambda st, x, b, q, g: api.phase2_fused(  # noqa: E731
            st, x, b, q, include, g, implementation="pallas_tpu", interpret=TPU_INTERPRET, **opts, **kw)
        oracle = lambda st, x, b, q, g: reference.phase2_fused(st, x, b, q, include, g, **kw)  # noqa: E731
    args = (state, partial, bank, query, gate if fuse == "gate" else None)
    got, got_grads = _vjp(kernels, args)
    want, want_grads = _vjp(oracle, args)
    _check(got, want, "output")
    # the state (max, denom, acc), partial, bank, query and the gate's (w, scale, bias)
    _check(got_grads, want_grads, "gradients")
    pallas_calls.assert_tpu_interpret(TPU_INTERPRET)


# --------------------------------------------------------------------------- race detection

RACES = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, random_seed=3)


def _racy_sum(x):
    """A kernel whose output block every program of its ``"parallel"`` grid axis writes: a race
    when that axis is split over two cores."""

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(body, grid=(4,), in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
                          out_shape=jax.ShapeDtypeStruct((8, 128), x.dtype),
                          compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
                          interpret=RACES)(x)


def test_race_detector_sees_a_race(capsys):
    """The detector the test below relies on reports a race it is shown (not a vacuous check)."""
    jax.block_until_ready(_racy_sum(jnp.ones((32, 128), jnp.float32)))
    assert "RACE DETECTED" in capsys.readouterr().out


@pytest.mark.slow  # ~40 s on two cores: race detection tracks every simulated memory access
@pytest.mark.parametrize("op", ["phase1", "phase2_fused"])
def test_no_races_across_two_cores(op, capsys):
    """Each kernel's ``"parallel"`` grid axes split over two simulated cores, visited in a random
    order, with the race detector on: no program reads or writes what another core writes, and
    the results still match the reference."""
    if op == "phase1":
        sources, banks, queries = _phase1_inputs(MSAR["stream_kernels"])
        kw = dict(MSAR, segment_ids=_segments())
        valid = jnp.asarray((True, True, True))
        got = _vjp(lambda x, bk, q: api.phase1(x, bk, q, valid, implementation="pallas_tpu", interpret=RACES,
                                              backward="pallas", **kw), (sources, banks, queries))
        want = _vjp(lambda x, bk, q: reference.phase1(x, bk, q, valid, **kw), (sources, banks, queries))
    else:
        state, partial, bank, query, gate = _phase2_inputs(MSAR["stream_kernels"], MSAR["heads"])
        kw = dict(MSAR, segment_ids=_segments(11))
        args = (state, partial, bank, query, gate)
        got = _vjp(lambda *a: api.phase2_fused(*a[:4], True, a[4], implementation="pallas_tpu", interpret=RACES,
                                               backward="pallas", **kw), args)
        want = _vjp(lambda *a: reference.phase2_fused(*a[:4], True, a[4], **kw), args)
    _check(got, want, op)
    assert "RACE DETECTED" not in capsys.readouterr().out


def test_interpret_params_are_for_the_tpu_kernels():
    """The GPU kernels have no TPU interpret mode: one line saying so, not a silent generic run."""
    sources, banks, queries = _phase1_inputs(MSAR["stream_kernels"])
    with pytest.raises(TypeError, match="InterpretParams.*interpret=True"):
        api.phase1(sources, banks, queries, implementation="pallas_gpu", interpret=TPU_INTERPRET, **MSAR)

