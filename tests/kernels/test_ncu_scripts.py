"""The Nsight Compute drivers of ``benchmarks/mgpu`` (``ncu_phase1.py``: phase 1's six Mosaic GPU
kernels, each called alone; ``ncu_phase2.py``: phase 2's three) run end to end in Mosaic GPU
interpret mode at their tiny ``--interpret`` shapes, every output finite. On the H200 they run
under ``ncu`` (docs/performance.md, "Hardware counters"); this keeps them from rotting between
device calls. In the slow suite (CI runs it): about 40 s on two cores."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "mgpu"))
pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@pytest.mark.slow
@pytest.mark.parametrize("script, lines", [("ncu_phase1", 6), ("ncu_phase2", 1)])
def test_interpreted_ncu_driver_runs(monkeypatch, capsys, script, lines):
    module = __import__(script)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--interpret"])
    module.main()
    out = [line for line in capsys.readouterr().out.splitlines() if "finite" in line]
    assert len(out) == lines, out
    assert all(line.endswith("True") for line in out), out
