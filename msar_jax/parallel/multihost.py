"""Multi-host start-up and input: ``jax.distributed.initialize`` when the environment names
a cluster, grain input sharded by process, global batches from process-local rows.

Every process runs the same program (SPMD). Process ``i`` of ``P`` reads rows
``[i B/P, (i+1) B/P)`` of every global batch (``msar_jax.data.make_train_iterator`` with
``process_index/process_count``) and ``global_batch`` assembles the ``[B, T+1]`` array whose
rows are sharded over the mesh's batch axes (``jax.make_array_from_process_local_data``).
Launch recipes (TPU pod slice, multi-node GPU with SLURM or by hand): docs/parallelism.md.
"""

from __future__ import annotations

import os
from typing import Mapping

import jax

from msar_jax.config import ConfigError

# Variables that say this process is one of several (what jax.distributed's cluster
# detection reads, plus the explicit coordinator form).
_EXPLICIT = ("JAX_COORDINATOR_ADDRESS",)
_CLUSTER_HINTS = {
    "SLURM_NTASKS": lambda v: int(v) > 1,  # SLURM, one task per host (or per GPU)
    "OMPI_COMM_WORLD_SIZE": lambda v: int(v) > 1,  # Open MPI / mpirun
    "TPU_WORKER_HOSTNAMES": lambda v: len([h for h in v.split(",") if h]) > 1,  # Cloud TPU pod slice VM
    "MEGASCALE_NUM_SLICES": lambda v: int(v) > 1,  # multislice TPU
}


def cluster_detected(environ: Mapping[str, str] | None = None) -> str | None:
    """The variable that shows a multi-process launch, or ``None`` for a single process."""
    environ = os.environ if environ is None else environ
    for name in _EXPLICIT:
        if environ.get(name):
            return name
    for name, test in _CLUSTER_HINTS.items():
        value = environ.get(name)
        if value:
            try:
                if test(value):
                    return name
            except ValueError:
                continue
    return None


def maybe_initialize(mode: str = "auto", environ: Mapping[str, str] | None = None) -> bool:
    """Call ``jax.distributed.initialize`` per ``parallel.distributed.initialize``:
    ``"auto"`` when ``cluster_detected``, ``"always"``, or ``"never"``. Must run before
    anything touches the devices. Returns whether it initialised (``False`` also when
    ``jax.distributed`` already is).

    With ``JAX_COORDINATOR_ADDRESS`` (host:port), ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
    set, those are passed explicitly (a hand-launched GPU cluster); otherwise JAX's cluster
    detection (TPU pod metadata, SLURM, Open MPI) fills them in.
    """
    if mode not in ("auto", "always", "never"):
        raise ConfigError("parallel.distributed.initialize", mode, "must be 'auto', 'always' or 'never'")
    environ = os.environ if environ is None else environ
    if mode == "never" or (mode == "auto" and cluster_detected(environ) is None):
        return False
    if jax.distributed.is_initialized():  # a second run in the same processes (a notebook, a sweep)
        return False
    kwargs = {}
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        kwargs["coordinator_address"] = environ["JAX_COORDINATOR_ADDRESS"]
        if environ.get("JAX_NUM_PROCESSES"):
            kwargs["num_processes"] = int(environ["JAX_NUM_PROCESSES"])
        if environ.get("JAX_PROCESS_ID"):
            kwargs["process_id"] = int(environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kwargs)
    return True


def train_iterator(data_dir, batch_size: int, seq_len: int, seed: int = 0, **kwargs):
    """This process's share of the training stream: ``[batch_size / process_count, seq_len + 1]``."""
    from msar_jax import data

    if batch_size % jax.process_count():
        raise ConfigError("train.batch_size", batch_size,
                          f"must be divisible by the process count {jax.process_count()}")
    return data.make_train_iterator(data_dir, "train", batch_size=batch_size, seq_len=seq_len, seed=seed,
                                    process_index=jax.process_index(), process_count=jax.process_count(), **kwargs)


def global_batch(local_rows, mesh: jax.sharding.Mesh, rules=None) -> jax.Array:
    """The global ``[B, T+1]`` batch from each process's rows, sharded over the batch axes."""
    from msar_jax import data
    from msar_jax.parallel import mesh as mesh_lib

    rows = local_rows.shape[0] * jax.process_count()
    sharding = mesh_lib.batch_sharding(mesh, rows, mesh_lib.RULES if rules is None else rules)
    return data.make_global_batch(local_rows, sharding=sharding)
