"""``benchmarks/mgpu/profile_bench_reads.py`` (the device time per op of the bench's reads) runs
end to end at its ``--small`` shape in interpret mode: four profiled functions per config, each
with its busy time, ops and span per call and the ``--inners`` timings. In the slow suite (about
30 s on two cores); on a GPU it runs at the bench shape (docs/performance.md)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "mgpu"))


@pytest.mark.slow
def test_profile_bench_reads_small(capsys):
    import profile_bench_reads

    profile_bench_reads.main(["--small", "--configs", "attnres", "--inners", "1,2"])
    out = capsys.readouterr().out
    profiled = re.findall(r"^## attnres (.+?): ([0-9.]+) ms busy per call .*; (\d+) ops per call, span ([0-9.]+) ms",
                          out, flags=re.M)
    # one stream: phase 1 as the model hands it over, with the value channel (--p1_form model)
    assert [p[0] for p in profiled] == ["phase 1 forward (one block)", "phase 2 forward (one call)",
                                        "phase 1 forward + backward (vjp, phase 1 value_channel)",
                                        "phase 2 forward + backward (vjp, phase 1 value_channel)"], out
    assert all(float(busy) > 0 and int(ops) > 0 and float(span) > 0 for _, busy, ops, span in profiled), profiled
    assert len(re.findall(r"ms per call \(median of 3\): inner 1: [0-9.]+, inner 2: [0-9.]+$", out, flags=re.M)) == 4


def test_profile_bench_reads_rejects_an_unknown_config():
    import profile_bench_reads

    with pytest.raises(SystemExit):
        profile_bench_reads.main(["--configs", "mhc"])
