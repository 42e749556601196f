"""The training loop under the ``parallel`` config section (8 fake CPU devices, float32):
data parallel, FSDP and a 2-stage pipeline give the single-device loss trajectory and val loss;
a bad mesh is a ``ConfigError`` naming the field before anything runs; a run checkpointed under
one mesh resumes under another and ends where the uninterrupted run ends.

Fast by design (vanilla smoke model, T = 16, 4 steps, fast XLA compile); the MSAR pipeline run
(block summaries crossing the stage boundary) and the command line are marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from msar_jax.config import ConfigError
from msar_jax.config import REPO_ROOT, load_config
from msar_jax.parallel import pipeline as pl
from msar_jax.train import optim, step, train
from msar_jax.train.checkpoint import Checkpointer, restore_params

pytestmark = pytest.mark.usefixtures("fast_train_compile")

STEPS, BATCH = 4, 8
BASE = {"train.steps": STEPS, "train.batch_size": BATCH, "model.dtype": "float32", "checkpoint.every": 0,
        "train.eval_every": 0, "train.eval_batches": 1, "train.progress": False, "train.tensorboard": False,
        "train.depth_weights": False}

ONE = dict(data=1, stage=1, fsdp=1, tensor=1)
LAYOUTS = {
    "dp4": dict(ONE, data=4),
    "pp2_dp2": dict(ONE, stage=2, data=2),  # 2 stages, each stage's microbatch split over data = 2
    "fsdp4": dict(ONE, fsdp=4),
    "dp2": dict(ONE, data=2),
}
PIPELINE = {"parallel.pipeline.stages": 2, "parallel.pipeline.microbatches": 2}


def config(mechanism="vanilla", mesh=None, **overrides):
    mesh_over = {f"parallel.mesh.{k}": v for k, v in (mesh or {}).items()}
    if (mesh or {}).get("stage", 1) > 1:
        mesh_over |= PIPELINE
    return load_config(f"configs/{mechanism}.py:smoke=1,seq_len=16", BASE | mesh_over | overrides)


_REFERENCE: dict = {}


def reference(mechanism="vanilla", tmp_root=None):
    """The single-device run (computed once per mechanism and worker)."""
    if mechanism not in _REFERENCE:
        result = train(config(mechanism), tmp_root / f"reference_{mechanism}", handle_signals=False)
        assert result["mesh"] == ONE and result["pipeline"] is None
        _REFERENCE[mechanism] = result
    return _REFERENCE[mechanism]


def losses(result):
    return np.array([loss for _, loss in result["losses"]])


def assert_same_run(result, ref, steps=range(1, STEPS + 1)):
    assert [s for s, _ in result["losses"]] == list(steps)
    ref_losses = losses(ref)[[s - 1 for s in steps]]
    np.testing.assert_allclose(losses(result), ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(result["val_loss"], ref["val_loss"], rtol=1e-5)


def saved_param_spec(workdir, *path):
    """The ``PartitionSpec`` a parameter was saved with (orbax sharding metadata)."""
    import orbax.checkpoint as ocp

    step_dir = Checkpointer(workdir, async_save=False)
    try:
        state_dir = step_dir.directory / str(step_dir.latest_step()) / "state"
    finally:
        step_dir.close()
    leaf = ocp.StandardCheckpointer().metadata(state_dir).item_metadata["params"]
    for key in path:
        leaf = leaf[key]
    return tuple(leaf.sharding.partition_spec)


@pytest.mark.parametrize("name", ["dp4", "pp2_dp2", "fsdp4"])  # fsdp4 last: test_resume reuses its compile
def test_layout_matches_single_device(name, tmp_path_factory, capsys, monkeypatch):
    ref = reference(tmp_root=tmp_path_factory.mktemp("ref"))
    assert losses(ref)[-1] < losses(ref)[0] - 0.1  # it learns: the numbers compared below are not constants
    traced = []  # the pipelined loss is what the train step traces (not the sequential one)
    make_loss = pl.pipelined_lm_loss
    monkeypatch.setattr(pl, "pipelined_lm_loss",
                        lambda plan, mesh: (lambda *a, **k: traced.append(plan) or make_loss(plan, mesh)(*a, **k)))
    workdir = tmp_path_factory.mktemp(name)
    capsys.readouterr()
    result = train(config(mesh=LAYOUTS[name]), workdir, handle_signals=False)
    assert [(p.stages, p.microbatches) for p in traced] == ([(2, 2)] if name.startswith("pp") else [])
    assert result["mesh"] == LAYOUTS[name]
    assert (result["pipeline"] is not None) == name.startswith("pp")
    assert_same_run(result, ref)
    err = capsys.readouterr().err
    mesh_lines = [line for line in err.splitlines() if line.startswith("mesh: ")]
    assert len(mesh_lines) == 1 and " x ".join(f"{k}={v}" for k, v in LAYOUTS[name].items()) in mesh_lines[0]
    if name == "fsdp4":  # the state really was sharded the way the rules say (d_model split 4 ways)
        assert "fsdp" in saved_param_spec(workdir, "attn", "wq")
        assert "fsdp" in saved_param_spec(workdir, "embedding")
    if name == "pp2_dp2":
        assert "pipeline: 2 stages" in mesh_lines[0]


def test_resume_under_another_mesh(tmp_path_factory):
    """Two steps under fsdp = 4 (4 devices), resumed under data = 2 (2 devices): the same
    losses, val loss and final parameters as the uninterrupted single-device run."""
    ref = reference(tmp_root=tmp_path_factory.mktemp("ref"))
    workdir = tmp_path_factory.mktemp("resume")
    first = train(config(mesh=LAYOUTS["fsdp4"]), workdir, max_steps=2, handle_signals=False)
    assert first["stopped"] == "max_steps" and first["step"] == 2
    second = train(config(mesh=LAYOUTS["dp2"]), workdir, handle_signals=False)
    assert second["resumed_from"] == 2 and second["mesh"] == LAYOUTS["dp2"]
    assert_same_run(second, ref, steps=range(3, STEPS + 1))
    np.testing.assert_allclose(losses(first), losses(ref)[:2], rtol=1e-5, atol=1e-6)

    cfg = config()
    tx, _ = optim.make_optimizer(cfg.optim, cfg.train.steps)
    abstract = step.abstract_state(cfg.model, tx)
    params, at = restore_params(workdir, abstract)
    ref_params, ref_at = restore_params(ref["workdir"], abstract)
    assert at == ref_at == STEPS
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("overrides,field,rule", [
    ({"parallel.mesh.fsdp": 16}, "parallel.mesh", "only 8 devices"),
    ({"parallel.mesh.fsdp": 0}, "parallel.mesh.fsdp", "positive integer or -1"),
    ({"parallel.mesh.data": -1, "parallel.mesh.tensor": 3}, "parallel.mesh.data", "does not divide 8 devices"),
    ({"parallel.mesh.data": -1, "parallel.mesh.fsdp": -1}, "parallel.mesh", "at most one axis may be -1"),
    ({"parallel.mesh.data": 3}, "train.batch_size", "data x stage x fsdp = 3"),
    ({"parallel.mesh.data": 4, "train.eval_batch_size": 6}, "train.eval_batch_size", "data x stage x fsdp = 4"),
    ({"parallel.mesh.stage": 2, "parallel.pipeline.stages": 2, "parallel.pipeline.microbatches": 3},
     "parallel.pipeline.microbatches", "multiple of pipeline.stages = 2"),
    ({"parallel.mesh.stage": 2, "parallel.pipeline.stages": 4, "parallel.pipeline.microbatches": 4},
     "model.n_layers", "stages x pipeline.repeats = 4 x 1"),
    ({"parallel.mesh.stage": 2, "parallel.mesh.fsdp": 4, "parallel.pipeline.stages": 2,
      "parallel.pipeline.microbatches": 4}, "train.batch_size", "divisible by data x fsdp = 4"),
    ({"parallel.distributed.initialize": "sometimes"}, "parallel.distributed.initialize", "must be one of"),
])
def test_bad_parallel_config_names_the_field(tmp_path, overrides, field, rule):
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        train(config(**overrides), workdir, handle_signals=False)
    message = str(info.value)
    assert f"'{field}'" in message and rule in message, message
    assert not workdir.exists()  # checked up front: nothing was written, prepared or compiled


@pytest.mark.slow
def test_msar_pipeline_with_fsdp_matches_single_device(tmp_path_factory):
    """MSAR (block summaries and the partial sum cross the stage boundary) in 2 stages x fsdp 2."""
    ref = reference("msar", tmp_root=tmp_path_factory.mktemp("ref"))
    result = train(config("msar", mesh=dict(ONE, stage=2, fsdp=2)), tmp_path_factory.mktemp("pp"),
                   handle_signals=False)
    assert result["pipeline"]["stages"] == 2
    assert_same_run(result, ref)


@pytest.mark.slow
def test_cli_trains_under_fsdp(tmp_path):
    cmd = [sys.executable, "-m", "msar_jax.train", "--config=configs/vanilla.py:smoke=1", f"--workdir={tmp_path}",
           "--config.train.progress=False", "--config.train.batch_size=4", "--config.parallel.mesh.fsdp=4"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "mesh: data=1 x stage=1 x fsdp=4 x tensor=1" in out.stderr
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    assert summary["mesh"] == dict(ONE, fsdp=4) and summary["step"] == 4
    bad = subprocess.run(cmd[:-1] + ["--config.parallel.mesh.fsdp=3"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and "'train.batch_size'" in bad.stderr
