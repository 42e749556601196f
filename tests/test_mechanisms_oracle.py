"""Every residual mechanism, run through ``msar_jax.stack.DepthStack``, against the
independent numpy float64 oracle of ``tests/oracles.py`` (docs/design.md §1-8).

The sublayers are a toy per-token ``f_l(h) = tanh(h @ W_l)`` so that only the residual
mechanism is under test. Every mechanism parameter is replaced with random non-zero
values (zero queries / convs / gate biases would hide most mistakes).

* forward: the final hidden at float32 tolerance against the float64 oracle;
* gradients (one config per mechanism family): jax's vjp (default memory-lean
  custom-vjp scan) against central finite differences of the float64 oracle along a
  random direction in each parameter leaf, the layer weights and the embedding;
* the memory-lean custom-vjp scan against the plain rematerialised scan
  (``memory_lean=False``): identical values and gradients.

Compiled functions are cached per case; compile options favour compile speed.
"""

from __future__ import annotations

import functools
import zlib

import jax
import numpy as np
import pytest
from flax import nnx

import oracles
from msar_jax.model.layers import SequenceContext
from msar_jax.residuals import make_mechanism
from msar_jax.stack import DepthStack

B, D = 2, 8
FWD_RTOL = 2e-5  # max |lib - oracle| / max |oracle|, float32 vs float64
GRAD_RTOL = 2e-4  # directional derivative, float32 autodiff vs float64 central differences


class Case:
    def __init__(self, cid, name, n_layers=2, T=7, seg=False, grad=False, lean_check=False, kinds=None, **res):
        self.id, self.name, self.n_layers, self.T, self.seg = cid, name, n_layers, T, seg
        self.kinds = tuple(kinds) if kinds else ("dense",) * n_layers
        self.grad, self.lean_check, self.res = grad, lean_check, res

    def __repr__(self):
        return self.id


CASES = [
    Case("vanilla", "vanilla", n_layers=3, grad=True),
    Case("mhc", "mhc", grad=True, streams=4),
    # AttnRes: blocks of 2 and 4, Full, L = 6 not divisible by S = 4.
    Case("attnres_S2_L6", "attnres", n_layers=3, block_size=2),
    Case("attnres_S1_full", "attnres", block_size=1),
    Case("attnres_S4_L6", "attnres", n_layers=3, grad=True, block_size=4),
    Case("attnres_S4_L6_direct", "attnres", n_layers=3, block_size=4, two_phase=False),
    # MHAR.
    Case("mhar_H2_S2", "mhar", block_size=2, heads=2),
    Case("mhar_H2_S2_direct", "mhar", block_size=2, heads=2, two_phase=False),
    Case("mhar_H4_S4", "mhar", block_size=4, heads=4),
    Case("mhar_H4_S1_full", "mhar", block_size=1, heads=4),
    # MSAR: default, Full, S = 2, ablations, m = 2 / 8, short sequences, packed segments.
    Case("msar_S4_L8_seg", "msar", n_layers=4, T=9, seg=True, grad=True, lean_check=True, block_size=4),
    Case("msar_S4_L8_seg_direct", "msar", n_layers=4, T=9, seg=True, block_size=4, two_phase=False),
    Case("msar_S1_full_seg", "msar", T=9, seg=True, grad=True, lean_check=True, block_size=1),
    Case("msar_S2", "msar", block_size=2),
    Case("msar_S8_one_block", "msar", block_size=8),  # S > L: N = 1, only b_0 completed
    Case("msar_S4_L6", "msar", n_layers=3, block_size=4),
    Case("msar_S4_L6_direct", "msar", n_layers=3, block_size=4, two_phase=False),
    Case("msar_noconv", "msar", block_size=2, conv=False),
    Case("msar_mean", "msar", block_size=4, fusion="mean"),
    Case("msar_m2", "msar", T=9, seg=True, block_size=2, streams=2, kernel_sizes=(4,)),
    Case("msar_m8_short", "msar", T=9, seg=True, block_size=4, streams=8, kernel_sizes=(2, 4, 6, 8, 10, 12, 16)),
    Case("msar_T5_short", "msar", T=5, block_size=2),
    Case("msar_final_sum", "msar", block_size=2, final_merge="sum"),
    # A dense leading layer then "moe" layers (same toy sublayer): the stack splits units
    # by MLP kind and slices each kind's parameter stack from its first layer.
    Case("msar_S4_mixed_kinds", "msar", n_layers=4, kinds=("dense", "moe", "moe", "moe"), block_size=4,
         lean_check=True),
    # AttnRes + mHC hybrid.
    Case("attnres_mhc_S2", "attnres_mhc", grad=True, block_size=2, streams=4),
    Case("attnres_mhc_S4_direct", "attnres_mhc", block_size=4, streams=4, two_phase=False, lean_check=True),
    Case("attnres_mhc_S1_full", "attnres_mhc", block_size=1, streams=4),
]


def _segments(T):
    """Row 0: three packed segments (ids not starting at 0); row 1: one sequence."""
    seg = np.zeros((B, T), np.int32)
    a, b = max(1, T // 3), max(2, (2 * T) // 3)
    seg[0, :a], seg[0, a:b], seg[0, b:] = 3, 4, 7
    seg[1, :] = 1
    return seg


class Built:
    """A case's mechanism, random parameters, inputs and oracle."""

    def __init__(self, case: Case):
        self.case = case
        self.cfg = oracles.library_config(case.name, case.n_layers, D, **case.res)
        self.mech = make_mechanism(self.cfg, nnx.Rngs(0))
        rng = np.random.default_rng(zlib.crc32(case.id.encode()))
        pure = nnx.to_pure_dict(nnx.state(self.mech, nnx.Param))
        self.mech_params = oracles.randomize_params(pure, rng, D)
        self.layer_params = oracles.toy_layer_params(rng, case.n_layers, D, case.kinds)
        self.e = rng.standard_normal((B, case.T, D)).astype(np.float32)
        self.seg = _segments(case.T) if case.seg else None
        self.cot = rng.standard_normal((B, case.T, D)).astype(np.float32)
        self.positions = np.broadcast_to(np.arange(case.T, dtype=np.int32), (B, case.T)).copy()
        self.okw = oracles.oracle_kwargs(self.cfg, self.seg)

    def oracle(self, mech_params=None, layer_params=None, e=None):
        mp = oracles.to_f64(self.mech_params if mech_params is None else mech_params)
        lp = oracles.to_f64(self.layer_params if layer_params is None else layer_params)
        e = np.asarray(self.e if e is None else e, np.float64)
        return oracles.run(self.case.name, e, oracles.toy_sublayers(lp, self.case.kinds), mp, **self.okw)

    def stack(self, memory_lean=True):
        return DepthStack(self.mech, oracles.toy_sublayer_fn, self.case.kinds, "none", memory_lean)

    @functools.cached_property
    def forward_fn(self):
        stack = self.stack()

        def f(mp, lp, e, positions, seg):
            return stack(mp, lp, e, SequenceContext(positions, seg))[0]

        return jax.jit(f, compiler_options=oracles.FAST_COMPILE)

    def vjp_fn(self, memory_lean=True):
        stack = self.stack(memory_lean)

        def f(mp, lp, e, positions, seg, cot):
            out, pull = jax.vjp(lambda a, b, c: stack(a, b, c, SequenceContext(positions, seg))[0], mp, lp, e)
            return out, pull(cot)

        return jax.jit(f, compiler_options=oracles.FAST_COMPILE)

    def args(self):
        return (self.mech_params, self.layer_params, self.e, self.positions, self.seg)


_BUILT: dict[str, Built] = {}
_VJP: dict[tuple[str, bool], tuple] = {}


def built(case) -> Built:
    if case.id not in _BUILT:
        _BUILT[case.id] = Built(case)
    return _BUILT[case.id]


def lean_vjp(case, memory_lean=True):
    """``(final_hidden, (d_mech, d_layers, d_e))`` as numpy, cached per case."""
    key = (case.id, memory_lean)
    if key not in _VJP:
        b = built(case)
        out, grads = b.vjp_fn(memory_lean)(*b.args(), b.cot)
        _VJP[key] = (np.asarray(out), jax.tree.map(np.asarray, grads))
    return _VJP[key]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.all(np.isfinite(got)), "non-finite library output"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_forward_matches_oracle(case):
    b = built(case)
    if case.grad or case.lean_check:
        out = lean_vjp(case)[0]
    else:
        out = np.asarray(b.forward_fn(*b.args()))
    want = b.oracle()
    err = rel_err(out, want)
    assert err < FWD_RTOL, f"{case.id}: final hidden differs from the float64 oracle, rel err {err:.3e}"


def _leaves_with_paths(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves_with_paths(v, (*prefix, k))
    else:
        yield prefix, tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


@pytest.mark.parametrize("case", [c for c in CASES if c.grad], ids=lambda c: c.id)
def test_gradients_match_oracle_finite_differences(case):
    """d/dt <R, final(x + t u)> at t = 0 for a random direction u in each parameter leaf
    (mechanism, layer weights, embedding): jax vjp vs float64 central differences."""
    b = built(case)
    _, (g_mech, g_layers, g_e) = lean_vjp(case)
    rng = np.random.default_rng(1234)
    R = np.asarray(b.cot, np.float64)
    eps = 1e-5
    failures = []
    groups = [("mech", b.mech_params, g_mech), ("layers", b.layer_params, g_layers)]
    targets = [(g, path, leaf, _get(gtree, path)) for g, tree, gtree in groups for path, leaf in _leaves_with_paths(tree)]
    targets.append(("e", (), b.e, g_e))
    for group, path, leaf, grad in targets:
        u = rng.standard_normal(np.shape(leaf))
        base = np.asarray(leaf, np.float64)

        def at(t):
            x = base + t * u
            if group == "mech":
                return b.oracle(mech_params=_set(b.mech_params, path, x))
            if group == "layers":
                return b.oracle(layer_params=_set(b.layer_params, path, x))
            return b.oracle(e=x)

        fd = float(np.sum(R * (at(eps) - at(-eps))) / (2 * eps))
        ad = float(np.sum(np.asarray(grad, np.float64) * u))
        scale = float(np.sum(np.abs(np.asarray(grad, np.float64) * u))) + 1e-6
        if not abs(ad - fd) <= GRAD_RTOL * max(abs(fd), scale):
            failures.append(f"{group}/{'/'.join(path)}: autodiff {ad:.6e} vs finite differences {fd:.6e}")
    assert not failures, f"{case.id}: " + "; ".join(failures)


# Full mode's case runs in the slow suite only (about 30 s of CPU compile): its lean-scan
# gradients are already checked against finite differences of the oracle (``grad=True``).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.id == "msar_S1_full_seg" else c
                                  for c in CASES if c.lean_check], ids=lambda c: c.id)
def test_memory_lean_scan_equals_plain_scan(case):
    """The append-only custom-vjp scan must give the plain scan's values and gradients."""
    out_lean, g_lean = lean_vjp(case, True)
    out_plain, g_plain = lean_vjp(case, False)
    # float32 rounding: the two scans fuse differently (the hybrid's Sinkhorn steps: 3.6e-6)
    np.testing.assert_allclose(out_lean, out_plain, rtol=1e-5, atol=1e-6)
    flat_lean = dict(_leaves_with_paths({"g": g_lean[0], "l": g_lean[1], "e": g_lean[2]}))
    flat_plain = dict(_leaves_with_paths({"g": g_plain[0], "l": g_plain[1], "e": g_plain[2]}))
    assert flat_lean.keys() == flat_plain.keys()
    for k in flat_lean:
        a, p = flat_lean[k], flat_plain[k]
        err = float(np.max(np.abs(a - p)) / max(np.max(np.abs(p)), 1e-30))
        assert err < 1e-5, f"{case.id}: gradient {'/'.join(k)} differs between the scans, rel err {err:.3e}"


@pytest.mark.parametrize("cid", ["msar_S4_L8_seg", "mhc"])
def test_saved_read_outputs_give_the_same_values_and_gradients(cid, monkeypatch):
    """``DepthStack.save_read_outputs``: the backward's re-run of each block takes every
    sublayer's input from the forward pass instead of the re-run read (``stack._reuse_saved``
    on the append-only scan; a ``save_only_these_names("sublayer_input")`` checkpoint policy on
    the plain scan of mHC). The values are the same arrays, so the results must match the
    default stack's; a read output fed to the wrong sublayer would not."""
    from msar_jax import stack as stack_lib

    case = {c.id: c for c in CASES}[cid]
    b = built(case)
    calls = []
    reuse = stack_lib._reuse_saved
    monkeypatch.setattr(stack_lib, "_reuse_saved", lambda r, k: (calls.append(k.shape), reuse(r, k))[1])
    stack = DepthStack(b.mech, oracles.toy_sublayer_fn, case.kinds, "none", True, save_read_outputs=True)

    def f(mp, lp, e, positions, seg, cot):
        out, pull = jax.vjp(lambda x, y, z: stack(x, y, z, SequenceContext(positions, seg))[0], mp, lp, e)
        return out, pull(cot)

    out, grads = jax.jit(f, compiler_options=oracles.FAST_COMPILE)(*b.args(), b.cot)
    want_out, want_grads = lean_vjp(case)
    # the append-only scan reuses one saved input per sublayer of a unit (a block of S
    # sublayers; the unit is traced once for the backward's scan); mHC has no buffer
    assert len(calls) == (case.res["block_size"] if cid.startswith("msar") else 0), calls
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-6, atol=1e-6)
    for (path, got), (_, want) in zip(_leaves_with_paths({"g": grads[0], "l": grads[1], "e": grads[2]}),
                                     _leaves_with_paths({"g": want_grads[0], "l": want_grads[1], "e": want_grads[2]})):
        err = rel_err(got, want)
        assert err < 1e-6, f"{cid}: gradient {'/'.join(path)} differs with saved read outputs, rel err {err:.3e}"


TWO_PHASE_PAIRS = [
    ("attnres_S4_L6", "attnres_S4_L6_direct"),
    ("mhar_H2_S2", "mhar_H2_S2_direct"),
    ("msar_S4_L6", "msar_S4_L6_direct"),
    ("msar_S4_L8_seg", "msar_S4_L8_seg_direct"),
]


@pytest.mark.parametrize("pair", TWO_PHASE_PAIRS, ids=lambda p: p[0])
def test_two_phase_stack_equals_direct_stack(pair):
    """docs/design.md §5: the two-phase path gives the direct path's final hidden to float32
    rounding, with the same parameters (reuses both cases' compiled functions)."""
    by_id = {c.id: c for c in CASES}
    tp, direct = built(by_id[pair[0]]), built(by_id[pair[1]])
    out_tp = lean_vjp(tp.case)[0] if (tp.case.grad or tp.case.lean_check) else np.asarray(tp.forward_fn(*tp.args()))
    out_direct = np.asarray(direct.forward_fn(*tp.args()))
    err = rel_err(out_tp, out_direct)
    assert err < 1e-5, f"{pair}: two-phase vs direct rel err {err:.3e}"
