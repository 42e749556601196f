"""The reads benchmark (``benchmarks/reads.py``) runs end to end on the CPU at its ``--small``
shapes (interpret mode), so a broken harness shows up here and not in a device call, and its
floors and forward + backward forms count what they say. The end-to-end runs are slow (about a
minute each on 2 cores): run them before spending device time on the benchmark,
``.venv/bin/python -m pytest -m slow tests/kernels/test_reads_benchmark.py``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "benchmarks" / "reads.py"


def _reads():
    spec = importlib.util.spec_from_file_location("reads_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*flags):
    out = subprocess.run([sys.executable, str(SCRIPT), "--small", *flags], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return rows, out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("flags, shown, p1_tol", [
    (("--configs", "msar,attnres"), "| msar_m4_k4-8-12 [bwd=pallas], per_target |", 1e-4),
    (("--configs", "msar", "--state_dtype", "bfloat16", "--backward", "pallas,xla"), "bf16 state", 1e-2),
    # 8 channel heads; phase 1 as the model runs it (value channel), stacked and per target
    (("--configs", "mhar", "--p1_forms", "model,stacked,per_target"), "| mhar_h8 [bwd=pallas], per_target |", 1e-4),
], ids=["default", "bf16_state", "mhar"])
def test_table_runs_and_matches_the_reference(flags, shown, p1_tol):
    rows, stdout = _run(*flags)
    assert shown in stdout
    assert not [r for r in rows if "error" in r]
    checked = [r for r in rows if "p1_max_abs_err" in r]
    assert checked and all(r["p1_max_abs_err"] <= p1_tol * max(1.0, r["p1_ref_max"]) for r in checked)
    assert all(r["p2_max_abs_err"] <= 1e-2 * max(1.0, r["p2_ref_max"]) for r in checked)
    assert all(isinstance(r.get("pallas_gpu_fb_ms"), float) for r in checked)
    assert any(isinstance(r.get("xla_fb_ms"), float) for r in checked)  # timed once per read


def test_unknown_read_is_one_line_error(capsys):
    with pytest.raises(SystemExit):
        _reads().main(["--configs", "msar,hc"])
    assert "--configs='msar,hc': each must be one of ['attnres', 'mhar', 'msar']" in capsys.readouterr().err


@pytest.mark.parametrize("phase", [1, 2])
def test_fwd_bwd_forms_give_the_outputs_and_the_same_gradients(phase):
    """The "vjp" form (the benchmark's) returns the op's outputs and the gradients its
    "loss" form returns, on random non-zero inputs; the vjp form's phase-2 cotangent is bf16,
    as the model's is."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.depth_attention import reference

    reads = _reads()

    kernels, heads = (0, 2, 3), 1
    sources, banks, queries, partial, bank, query, gate = reads.make_inputs(3, 2, 8, 16, 2, kernels, heads,
                                                                            jnp.bfloat16)
    kw = dict(stream_kernels=kernels, heads=heads)
    if phase == 1:
        f = lambda x, b, q: reference.phase1(x, b, q, **kw)  # noqa: E731
        args, argnums = (sources, banks, queries), (0, 1, 2)
    else:
        state = jax.tree.map(lambda a: a[1], reference.phase1(sources, banks, queries, **kw))
        f = lambda st, x, b, q, g: reference.phase2_fused(st, x, b, q, True, g, **kw).astype(jnp.bfloat16)  # noqa: E731
        args, argnums = (state, partial, bank, query, gate), (0, 1, 2, 3, 4)
    ct = reads.cotangent(f, args)
    if phase == 2:
        assert ct.dtype == jnp.bfloat16
    out, grads = reads.fwd_bwd(f, argnums)(*args, ct)
    _, grads_loss = reads.fwd_bwd(f, argnums, "loss")(*args, reads.cotangent(f, args, "loss"))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(jax.jit(f)(*args))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    leaves, leaves_loss = jax.tree.leaves(grads), jax.tree.leaves(grads_loss)
    assert len(leaves) == len(leaves_loss) and any(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
    for a, b in zip(leaves, leaves_loss):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def test_fwd_bwd_rejects_an_unknown_form():
    reads = _reads()

    with pytest.raises(ValueError, match="form='grad'"):
        reads.fwd_bwd(lambda x: x, (0,), "grad")


def test_design_flops_counts_the_definitions_arithmetic():
    """The flop floor at the bench shape (N = 9, B = 8, T = d = 2048, S = 8), counted by hand:
    per source element 24 taps + 4 streams x (1 sum of squares + 8 dots + 8 weighted sums) = 92
    FMAs in phase 1, amortised over 8 targets; per partial element 24 taps + 4 x (4 + 6) = 64
    FMAs in phase 2. AttnRes (one identity stream, no gate): 17 and 1 + 1 + 2 + 1 = 5."""
    reads = _reads()

    elems = 8 * 2048 * 2048
    fwd, fb = reads.design_flops(9, 8, 2048, 2048, 4, 8, (0, 4, 8, 12))
    assert fwd == 2 * (9 * elems * 92 / 8 + elems * 64) == 11_240_734_720
    assert fb == 3 * fwd
    fwd1, _ = reads.design_flops(9, 8, 2048, 2048, 1, 8, (0,), gate=False)
    assert fwd1 == 2 * (9 * elems * 17 / 8 + elems * 5)
    # at the H200's float32 peak the MSAR forward's arithmetic takes 0.168 ms, under its 0.40 ms of bytes
    assert fwd / reads.FP32_PEAK_FLOPS * 1e3 == pytest.approx(0.1678, abs=1e-4)


def test_target_budgets_give_the_floor_over_the_target():
    """MSAR's forward at the bench shape moves 1.2845 GB (``design_bytes``: 9 bf16 sources and 8
    float32 states amortised over 8 targets, one state, the partial and h): at 2.92 TB/s (an H100's
    copy) 0.440 ms, 98% of the 0.45 ms target; at 4.27 TB/s 0.301 ms, 67%. A bf16 state: 0.748 GB."""
    reads = _reads()

    rows = reads.target_budgets((2.92, 4.27), **reads.BENCH_SHAPE)
    assert [(r["state_bytes"], r["tbps"]) for r in rows] == [(4, 2.92), (4, 4.27), (2, 2.92), (2, 4.27)]
    f32_h100, f32_h200, bf16_h100 = rows[0], rows[1], rows[2]
    assert f32_h100["floor_fwd_ms"] == pytest.approx(1.2845056e9 / 2.92e12 * 1e3)
    assert f32_h100["need_fwd"] == pytest.approx(0.9776, abs=1e-4)
    assert f32_h200["need_fwd"] == pytest.approx(0.6685, abs=1e-4)
    assert bf16_h100["floor_fwd_ms"] == pytest.approx(0.747634688e9 / 2.92e12 * 1e3)
    assert f32_h100["need_fb"] == pytest.approx(f32_h100["floor_fb_ms"] / 2.0)
    with pytest.raises(ValueError, match="must be > 0"):
        reads.target_budgets((0.0,), **reads.BENCH_SHAPE)


def test_budgets_print_without_a_device(capsys):
    assert _reads().main(["--budgets", "3"]) == []
    assert "| msar | float32 | 3.00 |" in capsys.readouterr().out
