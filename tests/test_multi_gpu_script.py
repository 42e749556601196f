"""benchmarks/multi_gpu.py runs at smoke size on fake CPU devices: the layouts give
the single-device loss, pipeline rows carry HLO hop bytes and the bubble, the table prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "multi_gpu.py"


@pytest.fixture(scope="module")
def multi_gpu():
    spec = importlib.util.spec_from_file_location("multi_gpu_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_layout_configs(multi_gpu):
    pcfg, n = multi_gpu.layout_config("single", 8, 2)
    assert n == 1 and dict(pcfg.mesh) == dict(data=1, stage=1, fsdp=1, tensor=1)
    pcfg, n = multi_gpu.layout_config("fsdp2", 8, 2)
    assert n == 2 and pcfg.mesh.fsdp == 2 and pcfg.pipeline.stages == 1
    pcfg, n = multi_gpu.layout_config("pp2_gpipe", 8, 2)
    assert (pcfg.mesh.stage, pcfg.pipeline.stages, pcfg.pipeline.repeats, pcfg.pipeline.microbatches) == (2, 2, 1, 8)
    pcfg, _ = multi_gpu.layout_config("pp2_circular", 8, 2)
    assert (pcfg.pipeline.repeats, pcfg.pipeline.cache) == (2, False)
    pcfg, _ = multi_gpu.layout_config("pp2_circular_cache", 8, 2)
    assert (pcfg.pipeline.repeats, pcfg.pipeline.cache) == (2, True)
    pcfg, n = multi_gpu.layout_config("pp4_circular_cache", 8, 2)
    assert n == 4 and (pcfg.mesh.stage, pcfg.pipeline.stages, pcfg.pipeline.repeats, pcfg.pipeline.cache) == (4, 4, 2, True)
    pcfg, n = multi_gpu.layout_config("accum", 8, 2)
    assert n == 1 and pcfg.mesh.data == 1 and pcfg.pipeline.stages == 1
    pcfg, n = multi_gpu.layout_config("dp8", 8, 2)
    assert n == 8 and pcfg.mesh.data == 8 and pcfg.mesh.fsdp == 1
    for bad in ("tp2", "pp2_zigzag", "dp1", "pp0_gpipe", "fsdp"):
        with pytest.raises(ValueError, match="must be 'single'"):
            multi_gpu.layout_config(bad, 8, 2)


# The slow suite (CI runs it after the default one): the script end to end, about 60-85 s on 2
# cores. Its layouts are checked against one device in test_pipeline.py and
# test_train_parallel.py, its parts (layout_config, summarise) by the tests around it.
@pytest.mark.slow
def test_smoke_run(multi_gpu, monkeypatch, capsys, tmp_path):
    from pallas_kernels.depth_attention import api

    monkeypatch.setattr(api, "xla_streaming", api.xla_streaming)  # restored after the test
    rows = multi_gpu.main([
        "--config=configs/msar.py:smoke=1,block_size=2", "--override=model.n_layers=4", "--batch_size=4",
        "--microbatches=2", "--steps=2", "--skip=1", "--fast_compile",
        "--layouts=single,pp2_circular_cache", f"--json={tmp_path / 'out.json'}"])
    # (The accum layout is the same step with grad_accum = 2: test_layout_configs checks its
    # config and test_grad_accum.py that step; left out here, it was a third of this test's time.)
    assert [r["layout"] for r in rows] == ["single", "pp2_circular_cache"]
    assert rows[0]["grad_accum"] == 1
    single = rows[0]
    for r in rows:
        assert r["median_step_s"] > 0 and r["tokens_per_s"] > 0
        assert abs(r["final_loss"] - single["final_loss"]) < 1e-4, r["layout"]  # fp32 smoke model
        assert r["scaling_efficiency"] == pytest.approx(r["speedup"] / r["devices"])
    pp = rows[1]
    assert "bubble_measured_vs_accum" not in pp  # needs the accum layout (test_summarise_against_accum)
    assert pp["hop_bytes"] > 0 and pp["hlo_hop_bytes"] and pp["lowered_hop_bytes"]
    assert pp["bubble_theory"] == pytest.approx(1 / 5)  # (S-1)/(R M + S-1), S = R = M = 2
    assert "bubble_measured_upper" in pp and pp["caching"]
    out = capsys.readouterr().out
    assert "| pp2_circular_cache | 2 |" in out
    assert (tmp_path / "out.json").exists()


def test_summarise_against_accum(multi_gpu):
    """The bubble against the accum layout (same microbatch size, one device) and the scaling
    figures, from step times alone (the smoke run above leaves accum out)."""
    rows = [
        {"layout": "single", "devices": 1, "median_step_s": 1.0, "final_loss": 2.0},
        {"layout": "accum", "devices": 1, "median_step_s": 1.2, "final_loss": 2.0},
        {"layout": "pp2_gpipe", "devices": 2, "median_step_s": 0.8, "final_loss": 2.5,
         "bubble_theory": 0.2, "pipeline": {"stages": 2}},
    ]
    multi_gpu.summarise(rows)
    pp = rows[2]
    assert pp["speedup"] == pytest.approx(1.25) and pp["scaling_efficiency"] == pytest.approx(0.625)
    assert pp["loss_delta_vs_single"] == pytest.approx(0.5)
    assert pp["bubble_measured_upper"] == pytest.approx(1 - 0.5 / 0.8)
    assert pp["bubble_measured_vs_accum"] == pytest.approx(1 - 0.6 / 0.8)
    assert "bubble_measured_vs_accum" not in rows[1]
