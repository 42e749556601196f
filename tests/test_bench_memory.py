"""benchmarks/bench_memory.py: compiled training memory per device against Vanilla."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_memory.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_memory_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_configs_on_this_cpu(bench, capsys, tmp_path):
    """Two `tiny` configs compiled here: one row each, in order, with ratios against Vanilla's."""
    rows = bench.main(["--size", "tiny", "--mechanisms", "vanilla,msar", "--json", str(tmp_path / "m.json")])
    out = capsys.readouterr().out
    assert [r["config"] for r in rows] == ["configs/vanilla.py:size=tiny", "configs/msar.py:size=tiny"]
    assert "| configs/vanilla.py:size=tiny | " in out and "| 1.000 |" in out
    temps = [r["memory_per_device"]["temp_size_in_bytes"] for r in rows]
    assert all(t > 0 for t in temps) and (tmp_path / "m.json").is_file()
    ratio = f"{temps[1] / temps[0]:.3f}"
    assert f"| {ratio} |" in out


def test_unknown_mechanism_is_one_line(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--mechanisms", "vanilla,msra"])
    assert "no configs/msra.py" in capsys.readouterr().err
