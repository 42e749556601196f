"""The GPU kernels the depth reads lower to (sm_90) equal the stored digest: a refactor of
``pallas_kernels`` that changes no kernel proves it here, without a GPU (``benchmarks/kernel_digest.py``;
after an intended change, time old and new on a GPU and store the new digest with ``--write``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("kernel_digest", ROOT / "benchmarks" / "kernel_digest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_names_each_difference():
    tool = _tool()
    call = {"target": "mosaic_gpu_v2", "kernel": "ab", "params": {"grid": "1"}, "operands": [], "results": []}
    assert tool.compare({"c": [call]}, {"c": [dict(call)]}) == []
    changed = tool.compare({"c": [call]}, {"c": [dict(call, kernel="cd")], "d": []})
    assert any("kernel differs" in line for line in changed) and any("only in the new" in line for line in changed)


@pytest.mark.slow
def test_lowered_kernels_equal_the_stored_digest():
    tool = _tool()
    stored = json.loads(tool.DIGEST.read_text())
    new = tool.digest()
    assert sum(map(len, new.values())) > 100  # the bench's reads and three `base` steps
    diff = tool.compare(stored, new)
    assert not diff, "the lowered kernels changed:\n" + "\n".join(diff[:30])
