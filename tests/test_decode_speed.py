"""benchmarks/decode_speed.py at CPU smoke sizes: every field of its JSON, the measured cache pytree
equal to ``decode.cache_bytes`` (docs/design.md §10), and its one-line flag errors."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import pytest

from msar_jax.config import ConfigError

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_speed.py"
SMOKE = ["--configs", "configs/msar.py:smoke=1", "--batch", "2", "--prompt", "16", "--steps", "4", "--repeats", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("decode_speed_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_msar_smoke_json(bench, tmp_path):
    path = tmp_path / "decode.json"
    bench.main([*SMOKE, "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["device"] and out["platform"] == "cpu" and out["date"]
    (row,) = out["rows"]
    assert (row["config"], row["mechanism"], row["batch"], row["prompt"], row["steps"]) == (
        "configs/msar.py:smoke=1", "msar", 2, 16, 4)
    assert row["max_len"] == 20 and row["prefill_rows"] == 2
    for key in ("prefill_ms", "forward_ms", "prefill_over_forward"):
        assert math.isfinite(row[key]) and row[key] > 0, key
    for form in ("decode_checked", "decode_pure"):
        step = row[form]
        assert step["ms_per_step"] > 0
        assert step["tokens_per_s"] == pytest.approx(2 / (step["ms_per_step"] / 1e3))
    formula, measured = row["cache_formula"], row["cache_measured"]
    assert measured["total"] == formula["total"] and measured["per_sequence"] == formula["per_sequence"]
    # MSAR keeps the conv windows: L sublayers x (kappa_max - 1 = 11) tokens x d = 32, float32 (Eq. 10).
    assert measured["conv_windows"] == formula["conv_windows"] == 4 * 2 * 11 * 32 * 4
    assert row["cache_matches_formula"] is True
    assert row["peak_bytes_in_use"] is None  # the CPU backend reports no memory stats


def test_chunked_prefill_and_vanilla_without_windows(bench):
    (row,) = bench.main(["--configs", "configs/vanilla.py:smoke=1", "--batch", "4", "--prompt", "8",
                         "--steps", "2", "--repeats", "1", "--prefill_batch", "2"])
    assert row["prefill_rows"] == 2
    assert row["cache_measured"]["conv_windows"] == row["cache_formula"]["conv_windows"] == 0
    assert row["cache_matches_formula"]


def test_prefill_batch_must_divide_the_batch(bench):
    with pytest.raises(ConfigError, match="--prefill_batch.*must divide the batch size 3"):
        bench.main(["--configs", "configs/vanilla.py:smoke=1", "--batch", "3", "--prompt", "4", "--steps", "1",
                    "--prefill_batch", "2"])


def test_prefill_out_of_memory_goes_in_fewer_rows(bench, monkeypatch, capsys):
    real_prefill = bench.decode.prefill

    def prefill_of_two_rows_at_most(model, tokens, lengths, **kwargs):
        if tokens.shape[0] > 2:  # what XLA raises when the buffers do not fit
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
        return real_prefill(model, tokens, lengths, **kwargs)

    monkeypatch.setattr(bench.decode, "prefill", prefill_of_two_rows_at_most)
    (row,) = bench.main(["--configs", "configs/vanilla.py:smoke=1", "--batch", "6", "--prompt", "4", "--steps", "1",
                         "--repeats", "1"])
    assert row["prefill_rows"] == 2 and row["cache_matches_formula"]
    assert "prefill of 6 rows is out of device memory; 3 rows at a time" in capsys.readouterr().out
