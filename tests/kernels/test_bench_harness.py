"""The timing harness (``pallas_kernels.depth_attention.bench``) runs end to end on the CPU at
its ``--small`` shapes (interpret mode), so a broken sweep shows up here and not in a device
call. Slow (about 2.5 minutes on 2 cores): run it before spending device time on the bench,
``.venv/bin/python -m pytest -m slow tests/kernels/test_bench_harness.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, *flags):
    env = dict(os.environ, OUT=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pallas_kernels.depth_attention.bench", "--small", *flags],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "bench_log.jsonl").read_text().splitlines()]
    errors = [{k: v for k, v in r.items() if "error" in k} for r in rows]
    assert not any(errors), errors
    return rows, out.stdout


@pytest.mark.slow
def test_main_table_runs_and_matches_the_reference(tmp_path):
    rows, stdout = _bench(tmp_path)
    assert "per-sublayer amortised" in stdout
    checked = [r for r in rows if "p1_max_abs_err" in r]
    assert checked and all(r["p1_max_abs_err"] <= 1e-4 * max(1.0, r["p1_ref_max"]) for r in checked)


@pytest.mark.slow
def test_main_table_with_a_bf16_state(tmp_path):
    rows, stdout = _bench(tmp_path, "--state_dtype", "bfloat16", "--backward", "pallas")
    assert "state=bf16" in stdout
    checked = [r for r in rows if "p1_max_abs_err" in r]
    assert checked and all(r["p1_max_abs_err"] <= 1e-2 * max(1.0, r["p1_ref_max"]) for r in checked)


@pytest.mark.slow
def test_sweeps_run(tmp_path):
    rows, _ = _bench(tmp_path, "--per_target", "--per_target_tiles", "--p2_forms", "--p1_backwards", "--sweeps_only")
    merged = {k: v for r in rows for k, v in r.items()}
    for key in ("p1_fb_stacked_ms", "p1_fb_per_target_ms", "mix_acc_per_target_bt32_bd64_w8_ms", "p1_fb_pallas_wide_ms",
                "transpose_one_source_kernel_ms"):
        assert isinstance(merged.get(key), float), key
