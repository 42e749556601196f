"""The training loop's multi-process path, for real: two processes on localhost (2 fake CPU
devices each, ``jax.distributed`` through ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID``, cross-process collectives over gloo) run ``python -m msar_jax.train`` with an
FSDP mesh spanning both processes (params and batch rows sharded across them, each process
reading its half of every global batch), and log the losses and the val loss of the same
config run as one process on 4 fake devices; the checkpoint both processes wrote together holds
the same parameters.

About 50 s on 2 CPU cores (three start-ups and compiles, vanilla smoke model, 4 steps; no
FAST_COMPILE: the children run the real command line).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from msar_jax import data
from msar_jax.config import REPO_ROOT, load_config
from msar_jax.train import optim, step
from msar_jax.train.checkpoint import restore_params
from msar_jax.train.metrics import JSONL_NAME, read_jsonl

STEPS, BATCH, PROCESSES, DEVICES_PER_PROCESS = 4, 8, 2, 2
TIMEOUT_S = 300  # per launch; a hang (e.g. a collective waiting for a dead peer) fails the test
OVERRIDES = {
    "model.dtype": "float32", "train.steps": STEPS, "train.batch_size": BATCH, "train.eval_every": 0,
    "train.eval_batches": 1, "train.progress": False, "train.tensorboard": False, "train.depth_weights": False,
    "checkpoint.every": 2, "parallel.mesh.fsdp": -1,  # fsdp = all 4 devices, across both processes
}
CONFIG = "configs/vanilla.py:smoke=1,seq_len=16"
MESH = "mesh: data=1 x stage=1 x fsdp=4 x tensor=1 on 4 of 4 cpu devices"
# Variables that would make a child join (or detect) some other cluster.
_CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS",
                 "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_NUM_SLICES")


def _command(workdir):
    return ([sys.executable, "-m", "msar_jax.train", f"--config={CONFIG}", f"--workdir={workdir}"]
            + [f"--config.{k}={v}" for k, v in OVERRIDES.items()])


def _env(devices, **extra):
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    flags = f"--xla_force_host_platform_device_count={devices} {os.environ.get('MSAR_TEST_XLA_FLAGS', '')}"
    env.update(XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(workdir, envs, logdir, name):
    """Run one ``msar_jax.train`` process per env and wait for all; return their (stdout,
    stderr). If one fails or the launch runs past ``TIMEOUT_S``, the others are killed and the
    test fails with the output of each."""
    procs, files = [], []
    for i, env in enumerate(envs):
        out, err = open(logdir / f"{name}{i}.out", "w+"), open(logdir / f"{name}{i}.err", "w+")
        files.append((out, err))
        procs.append(subprocess.Popen(_command(workdir), cwd=REPO_ROOT, env=env, stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    texts = []
    for out, err in files:
        out.seek(0), err.seek(0)
        texts.append((out.read(), err.read()))
        out.close(), err.close()
    codes = [p.returncode for p in procs]
    report = "\n".join(f"--- {name} process {i}: exit {c}\n{e[-3000:]}" for i, (c, (_, e)) in enumerate(zip(codes, texts)))
    assert codes == [0] * len(procs), f"{name} failed or timed out after {TIMEOUT_S} s:\n{report}"
    return texts


def _summary(stdout):
    return json.loads(stdout[stdout.index("{"):])


def _train_losses(workdir):
    return np.array([r["loss"] for r in read_jsonl(workdir, "train")])


@pytest.mark.slow  # three training processes, 30-55 s on 2 cores; CI runs the slow suite too
def test_two_processes_match_one_process(tmp_path):
    data.ensure_prepared()  # built here once, not raced by the children
    logs = tmp_path / "logs"
    logs.mkdir()

    single_dir = tmp_path / "single"
    [(out, err)] = _launch(single_dir, [_env(PROCESSES * DEVICES_PER_PROCESS)], logs, "single")
    assert f"{MESH}\n" in err, err[-2000:]  # one process
    single = _summary(out)

    multi_dir = tmp_path / "multi"
    cluster = dict(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES=str(PROCESSES))
    results = _launch(multi_dir, [_env(DEVICES_PER_PROCESS, JAX_PROCESS_ID=str(i), **cluster)
                                  for i in range(PROCESSES)], logs, "multi")
    assert f"{MESH}, {PROCESSES} processes" in results[0][1], results[0][1][-2000:]
    summaries = [_summary(out) for out, _ in results]
    for s in summaries:  # every process ran every step and read the same replicated metrics
        assert s["step"] == STEPS and s["stopped"] == "done" and s["mesh"] == single["mesh"]
        assert s["final_loss"] == summaries[0]["final_loss"] and s["val_loss"] == summaries[0]["val_loss"]

    # Process 0 alone wrote the logs: one record per step, no duplicates from process 1.
    lines = [json.loads(line) for line in (multi_dir / JSONL_NAME).read_text().splitlines() if line.strip()]
    assert sorted((r["kind"], r["step"]) for r in lines) == sorted(
        [("train", s) for s in range(1, STEPS + 1)] + [("eval", STEPS)])

    # The same global batches, the same steps: the single-process trajectory.
    np.testing.assert_allclose(_train_losses(multi_dir), _train_losses(single_dir), rtol=1e-5, atol=1e-6)
    [multi_eval], [single_eval] = read_jsonl(multi_dir, "eval"), read_jsonl(single_dir, "eval")
    np.testing.assert_allclose(multi_eval["val_loss"], single_eval["val_loss"], rtol=1e-5)

    # The checkpoint written jointly (each process its shards) restores whole, to the same params.
    cfg = load_config(CONFIG, {k: v for k, v in OVERRIDES.items() if not k.startswith("parallel.")})
    tx, _ = optim.make_optimizer(cfg.optim, cfg.train.steps)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # a target on this process's devices
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                            step.abstract_state(cfg.model, tx))
    params, at = restore_params(multi_dir, abstract)
    ref_params, ref_at = restore_params(single_dir, abstract)
    assert at == ref_at == STEPS
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(ref_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6, err_msg=jax.tree_util.keystr(path))
