"""benchmarks/compile_cost.py: the op count of a lowered train step, and a guard on the MSAR
smoke step's size (the suite is compile-bound; the conv's taps written one by one took it to
16k StableHLO ops, their CPU loop form to under 9k)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_cost.py"


@pytest.fixture(scope="module")
def cost():
    spec = importlib.util.spec_from_file_location("compile_cost_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_count_ops(cost):
    text = "%0 = stablehlo.add %a, %b\n%1 = stablehlo.add %0, %b\n%2 = chlo.square %1\nfunc.return %2"
    assert cost.count_ops(text) == {"stablehlo.add": 2, "chlo.square": 1}


def test_msar_smoke_step_stays_small(cost):
    """Lowered only (no compile): MSAR's smoke train step within 12k ops and within 7x Vanilla's."""
    msar = cost.measure("configs/msar.py:smoke=1", {}, repeats=1, full_opt=False, compile=False)
    vanilla = cost.measure("configs/vanilla.py:smoke=1", {}, repeats=1, full_opt=False, compile=False)
    assert msar["compile_s"] is None and msar["lower_s"] > 0
    assert 0 < vanilla["ops"] < msar["ops"] < min(12_000, 7 * vanilla["ops"]), (msar["ops"], vanilla["ops"])


def test_cli(cost, capsys):
    rows = cost.main(["configs/vanilla.py:smoke=1", "--repeats", "1"])
    assert rows[0]["compile_s"] > 0 and rows[0]["ops"] > 0
    assert "| configs/vanilla.py:smoke=1 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cost.main(["configs/vanilla.py:smoke=1", "--repeats", "0"])
