"""``benchmarks/mgpu/ncu_census.py``: Nsight Compute's CSV read into per-kernel floors (the
issue floor from the instructions per scheduler and the clock, the DRAM floor from the bytes and
the copy bandwidth), on a hand-made CSV whose answers are worked out here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "mgpu"))
import ncu_census  # noqa: E402

HEADER = '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",' \
         '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'


def kernel_rows(kid, name, duration_ns, inst_avg, clock_hz, read, write, issue_pct):
    values = (("gpu__time_duration.sum", "nsecond", duration_ns), ("smsp__inst_executed.avg", "inst", inst_avg),
              ("smsp__cycles_elapsed.avg.per_second", "cycle/second", clock_hz),
              ("dram__bytes_read.sum", "byte", read), ("dram__bytes_write.sum", "byte", write),
              ("smsp__issue_active.avg.pct_of_peak_sustained_active", "%", issue_pct))
    return [f'"{kid}","1","python3","host","{name}","1","7","(128, 1, 1)","(32, 8, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value:,}"' for metric, unit, value in values]


def csv_lines():
    # the program's own output and ncu's notes come first, as in a real run
    return ["1 scores: 2 outputs, all finite: True", "==PROF== Disconnected from process 1", HEADER,
            *kernel_rows(0, "depth_attention_scores_mosaic_mosaic_gpu_kernel", 2_000_000, 1_000_000, 2e9, 4e9, 0, 50),
            *kernel_rows(1, "depth_attention_mix_mosaic_mosaic_gpu_kernel", 4_000_000, 2_000_000, 2e9, 2e9, 8e9, 30),
            *kernel_rows(2, "depth_attention_mix_mosaic_mosaic_gpu_kernel", 3_000_000, 2_000_000, 2e9, 2e9, 4e9, 35),
            *kernel_rows(3, "depth_attention_phase2_mosaic_mosaic_gpu_kernel", 500_000, 100_000, 2e9, 1e9, 0.2e9, 20)]


def test_census_floors_and_per_sublayer_sums():
    rows = ncu_census.census(ncu_census.parse(csv_lines()), copy_bytes_per_s=4e12)
    assert [r["name"] for r in rows] == ["scores", "mix", "mix#2", "phase2"]
    scores, mix, _, phase2 = rows
    # 1e6 instructions per scheduler at 2 GHz: 0.5 ms; 4 GB at 4 TB/s: 1 ms
    assert scores["ms"] == pytest.approx(2.0) and scores["issue_ms"] == pytest.approx(0.5)
    assert scores["dram_ms"] == pytest.approx(1.0) and scores["bound"] == pytest.approx(0.5)
    assert mix["gb"] == pytest.approx(10.0) and mix["dram_ms"] == pytest.approx(2.5) and mix["issue_pct"] == 30
    assert phase2["issue_ms"] == pytest.approx(0.05) and phase2["dram_ms"] == pytest.approx(0.3)
    text = ncu_census.table([r for r in rows if r["name"] != "mix#2"], per_sublayer=2)
    last = text.splitlines()[-1]
    # per sublayer: (2 + 4) / 2 + 0.5 = 3.5 ms; issue floors (0.5 + 1) / 2 + 0.05 = 0.8; DRAM (1 + 2.5) / 2 + 0.3
    assert last.startswith("| per sublayer (phase 1 / 2) | 3.500 | 0.800 |")
    assert "| 2.050 |" in last and "sum of the larger floors 2.050 ms" in last


def test_main_prints_the_table(capsys, tmp_path):
    path = tmp_path / "p1.csv"
    path.write_text("\n".join(csv_lines()) + "\n")
    ncu_census.main([str(path), "--copy-tbps", "4", "--skip", "mix#2", "--per-sublayer", "8"])
    out = capsys.readouterr().out
    assert out.startswith("copy bandwidth 4.00 TB/s") and "| mix | 4.000 |" in out and "mix#2" not in out


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="no Nsight Compute CSV header"):
        ncu_census.parse(["1 scores: finite"])
    lines = csv_lines()
    lines[3] = lines[3].replace('"nsecond"', '"fortnight"')
    with pytest.raises(ValueError, match="unit 'fortnight'"):
        ncu_census.parse(lines)
    partial = [line for line in csv_lines() if "dram__bytes_write" not in line]
    with pytest.raises(ValueError, match="dram__bytes_write.sum"):
        ncu_census.census(ncu_census.parse(partial), 1e12)
    with pytest.raises(SystemExit):
        ncu_census.main(["x.csv"])  # neither --copy-tbps nor --measure-copy


def test_per_sublayer_stacks_split_forward_and_backward():
    rows = ncu_census.census(ncu_census.parse(csv_lines()), copy_bytes_per_s=4e12)
    rows.append(dict(rows[0], name="gdots", ms=3.0, issue_ms=0.5, dram_ms=2.0))  # a backward kernel of phase 1
    stacks = ncu_census.per_sublayer_stacks(rows, per_sublayer=2)
    # phase 1's kernels halved, phase 2's as they are; mix#2 (a variant) left out; gdots only in fwd + bwd
    assert stacks["forward"] == [("scores", 1.0, 0.5), ("mix", 2.0, 1.25), ("phase2", 0.5, pytest.approx(0.3))]
    assert [name for name, _, _ in stacks["forward + backward"]] == ["scores", "mix", "phase2", "gdots"]
    assert stacks["forward + backward"][-1] == ("gdots", 1.5, 1.0)


def test_main_draws_the_plot(tmp_path, capsys):
    path = tmp_path / "p1.csv"
    path.write_text("\n".join(csv_lines()) + "\n")
    png = tmp_path / "census.png"
    ncu_census.main([str(path), "--copy-tbps", "4", "--per-sublayer", "8", "--plot", str(png), "--targets",
                     "0.45,2.0", "--design-floors", "0.4,1.0", "--title", "hand-made"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in capsys.readouterr().out
    for bad in (["--targets", "0.45"], ["--targets", "a,b"], ["--design-floors", "0,1"]):
        with pytest.raises(SystemExit):
            ncu_census.main([str(path), "--copy-tbps", "4", "--per-sublayer", "8", "--plot", str(png), *bad])
    assert "must be two positive ms values" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu_census.main([str(path), "--copy-tbps", "4", "--targets", "0.45,2.0"])
    assert "--targets goes with --plot and --per-sublayer" in capsys.readouterr().err
