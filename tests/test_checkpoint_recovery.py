"""Checkpoint recovery: a broken newest checkpoint is named, moved aside and the one before it
used; an explicit ``checkpoint_step``; a config of another model shape stops before writing;
the divergence message without a checkpoint; the progress bar's clock.

One smoke run (checkpoints at steps 5 and 10) is trained once for the module; each case breaks
a copy of it and resumes for one step, so the train step compiles once for the whole file.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from msar_jax.config import REPO_ROOT, load_config
from msar_jax.train import NonFiniteLossError, train
from msar_jax.train.checkpoint import MANIFEST_NAME, CheckpointError, Checkpointer, verify_step_dir
from msar_jax.train.metrics import ProgressClock

pytestmark = pytest.mark.usefixtures("fast_train_compile")


def smoke_config(**overrides):
    base = {"train.steps": 20, "checkpoint.every": 5, "train.eval_every": 0, "train.eval_batches": 1,
            "train.progress": False, "train.tensorboard": False, "train.depth_weights": False}
    return load_config("configs/msar.py:smoke=1,block_size=2", base | overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, fast_train_compile):
    workdir = tmp_path_factory.mktemp("trained")
    result = train(smoke_config(), workdir, max_steps=10)
    assert result["step"] == 10
    for step in (5, 10):  # every finished save got its manifest
        assert verify_step_dir(workdir / "checkpoints" / str(step)) is True
    return workdir


@pytest.fixture
def run_copy(trained, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(trained, workdir)
    return workdir


def _largest_chunk(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
               key=lambda p: p.stat().st_size)


def _truncate_chunk(step_dir):
    chunk = _largest_chunk(step_dir)
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])


def _flip_bytes(step_dir):
    chunk = _largest_chunk(step_dir)
    raw = bytearray(chunk.read_bytes())
    middle = len(raw) // 2
    for i in range(middle, middle + 64):
        raw[i] ^= 0xFF
    chunk.write_bytes(bytes(raw))  # same size: only the checksum can tell


BREAKS = {
    "truncated chunk": (_truncate_chunk, "size-mismatch"),
    "deleted _METADATA": (lambda d: (d / "state" / "_METADATA").unlink(), "missing-file"),
    "deleted data-iterator file": (lambda d: next((d / "data").glob("process_*.json")).unlink(), "missing-file"),
    "missing state/": (lambda d: shutil.rmtree(d / "state"), "missing-state"),
    "64 flipped bytes": (_flip_bytes, "checksum-mismatch"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_broken_newest_checkpoint_falls_back_and_is_moved_aside(run_copy, case, capfd):
    breaker, reason = BREAKS[case]
    breaker(run_copy / "checkpoints" / "10")
    result = train(smoke_config(), run_copy, max_steps=6)
    assert result["resumed_from"] == 5 and result["step"] == 6
    moved = run_copy / "checkpoints_broken" / f"10-{reason}"
    assert moved.is_dir() and (moved / MANIFEST_NAME).is_file()  # moved whole, never deleted
    assert not (run_copy / "checkpoints" / "10").exists()
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning: checkpoint 10")]
    assert len(warnings) == 1 and str(moved) in warnings[0] and "trying step 5" in warnings[0]


def test_checkpoint_without_manifest_restores_unverified(run_copy, capfd):
    for step in (5, 10):  # as written before manifests existed
        (run_copy / "checkpoints" / str(step) / MANIFEST_NAME).unlink()
    result = train(smoke_config(), run_copy, max_steps=11)
    assert result["resumed_from"] == 10
    err = capfd.readouterr().err
    assert err.count("cannot be verified") == 1 and "checkpoint 10" in err
    assert verify_step_dir(run_copy / "checkpoints" / "11") is True  # new saves get one


def test_explicit_checkpoint_step(run_copy):
    result = train(smoke_config(), run_copy, max_steps=6, checkpoint_step=5)
    assert result["resumed_from"] == 5 and result["step"] == 6
    with pytest.raises(CheckpointError, match=r"checkpoint step 7: no such checkpoint .*saved steps: 5, 6, 10"):
        train(smoke_config(), run_copy, max_steps=8, checkpoint_step=7)
    _flip_bytes(run_copy / "checkpoints" / "10")
    with pytest.raises(CheckpointError, match=r"checkpoint step 10 .* fails verification .*SHA-256.*left in place"):
        train(smoke_config(), run_copy, max_steps=11, checkpoint_step=10)
    assert (run_copy / "checkpoints" / "10").is_dir() and not (run_copy / "checkpoints_broken").exists()


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def test_another_model_shape_stops_before_writing(run_copy):
    config_json = (run_copy / "config.json").read_bytes()
    before = _snapshot(run_copy)
    wider = smoke_config(**{"model.d_model": 64, "model.mlp_dim": 128})
    with pytest.raises(CheckpointError) as err:
        train(wider, run_copy, max_steps=11)
    message = str(err.value)
    assert "\n" not in message
    assert "model.d_model: 32 -> 64" in message and "model.mlp_dim: 64 -> 128" in message
    assert "step 10" in message and "--workdir" in message
    assert (run_copy / "config.json").read_bytes() == config_json
    assert _snapshot(run_copy) == before  # nothing written, nothing moved


def test_divergence_without_a_checkpoint_says_so(tmp_path):
    def poison(step_number, batch):
        if step_number == 2:
            batch = batch.copy()
            batch[0, 3] = 10**6  # out-of-range token: the embedding gather fills NaN
        return batch

    with pytest.raises(NonFiniteLossError) as err:
        train(smoke_config(**{"checkpoint.every": 0}), tmp_path, batch_hook=poison)
    assert "no checkpoint saved yet" in str(err.value) and "None" not in str(err.value)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == []
    ckpt.close()


def test_progress_clock_leaves_out_the_first_step():
    now = [0.0]
    clock = ProgressClock(end_step=101, clock=lambda: now[0])
    assert clock.describe() == "compiling"
    now[0] = 300.0  # step 1 ends after a 300 s compile
    assert clock.tick(1) == (None, None) and clock.describe() == "timing"
    for step in range(2, 12):  # then 0.5 s a step
        now[0] += 0.5
        rate, remaining = clock.tick(step)
    assert rate == pytest.approx(2.0) and remaining == pytest.approx(45.0)  # 90 steps left at 2 / s
    assert clock.describe() == "2 step/s, 0:00:45 left"
    # Counted from the start, the rate would be 11 / 305 s: 41 minutes left instead of 45 s.
    resumed = ProgressClock(end_step=20, clock=lambda: now[0])
    resumed.tick(15)  # a resumed run's first step compiles too
    now[0] += 1.0
    assert resumed.tick(16) == (pytest.approx(1.0), pytest.approx(4.0))
    # The first evaluation's compile (between pause and resume) is left out as well.
    resumed.pause()
    now[0] += 60.0
    resumed.resume()
    now[0] += 1.0
    assert resumed.tick(17) == (pytest.approx(1.0), pytest.approx(3.0))


def test_cli_checkpoint_flag_and_shape_change_print_one_line(run_copy):
    before = _snapshot(run_copy)
    cmd = [sys.executable, "-m", "msar_jax.train", "--config=configs/msar.py:smoke=1,block_size=2",
           f"--workdir={run_copy}", "--checkpoint=5", "--config.model.d_model=64", "--config.model.mlp_dim=128",
           "--config.train.progress=False"]
    out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "(step 5)" in errors[0] and "model.d_model: 32 -> 64" in errors[0]
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr
    assert _snapshot(run_copy) == before
