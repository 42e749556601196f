"""A run's parallel layout: the mesh of its ``parallel`` config, checked against the model, the
batch and the devices, and the sharded state, batches and jitted steps built on it.

Shared by the training loop (``msar_jax.train``), ``benchmarks/multi_gpu.py`` and tests::

    layout = make_layout(config.parallel, config.model, batch_size=16)   # ConfigError if invalid

The train step (pipelined when ``parallel.pipeline.stages > 1``), the always-sequential eval step
and why the eval is not pipelined: docs/parallelism.md section 1, "A run's layout".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any, Callable, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from msar_jax.config import ConfigError
from msar_jax.parallel import config as pconfig
from msar_jax.parallel import mesh as mesh_lib
from msar_jax.parallel import multihost
from msar_jax.parallel import pipeline as pl


def validate(pcfg, model_cfg, batch_size: int, mesh: jax.sharding.Mesh | None = None,
             eval_batch_size: int | None = None, grad_accum: int = 1) -> None:
    """Check a ``parallel`` section against the model and the batch and, given a mesh, against
    the mesh: ``ConfigError(field, value, rule)``. Without a mesh only what needs no devices."""
    pconfig.check(pcfg)
    pl.validate(pcfg, model_cfg, batch_size, mesh)  # layers / stages / microbatches / MLP kinds
    pipelined = pcfg.pipeline.stages > 1
    if grad_accum != 1 and pipelined:
        raise ConfigError("train.grad_accum", grad_accum,
                          f"must be 1 with a {pcfg.pipeline.stages}-stage pipeline (it splits the batch itself: "
                          "parallel.pipeline.microbatches)")
    if pipelined and model_cfg.get("save_read_outputs", False):
        raise ConfigError("model.save_read_outputs", True,
                          f"must be False with a {pcfg.pipeline.stages}-stage pipeline (its stages rematerialise "
                          "every layer from the hop; parallel.pipeline.stages = 1 keeps the reads' outputs)")
    if mesh is None:
        return
    names = ("data", "fsdp") if pipelined else ("data", "stage", "fsdp")
    rows = math.prod(mesh.shape[n] for n in names)
    if batch_size % rows:
        raise ConfigError("train.batch_size", batch_size,
                          f"must be divisible by the batch axes {' x '.join(names)} = {rows} of the mesh "
                          f"{mesh_lib.describe(mesh)}")
    if (batch_size // grad_accum) % rows:
        raise ConfigError("train.grad_accum", grad_accum,
                          f"each microbatch (train.batch_size / grad_accum = {batch_size} / {grad_accum}) must be "
                          f"divisible by the batch axes {' x '.join(names)} = {rows} of the mesh "
                          f"{mesh_lib.describe(mesh)}")
    if eval_batch_size is not None:
        eval_rows = math.prod(mesh.shape[n] for n in ("data", "stage", "fsdp"))
        if eval_batch_size % eval_rows:
            raise ConfigError("train.eval_batch_size", eval_batch_size,
                              f"must be divisible by the eval batch axes data x stage x fsdp = {eval_rows} of the "
                              f"mesh {mesh_lib.describe(mesh)} (0 = train.batch_size)")
    for name, size in (("train.batch_size", batch_size), ("train.eval_batch_size", eval_batch_size)):
        if size is not None and size % jax.process_count():
            raise ConfigError(name, size, f"must be divisible by the process count {jax.process_count()}")


def make_layout(pcfg, model_cfg, batch_size: int, eval_batch_size: int | None = None,
                devices: Sequence | None = None, grad_accum: int = 1) -> "Layout":
    """The mesh of ``pcfg`` over ``devices`` (default: ``mesh.select_devices``), validated."""
    validate(pcfg, model_cfg, batch_size, grad_accum=grad_accum)  # the device-free checks first: clearer errors
    mesh = mesh_lib.make_mesh(pcfg.mesh, mesh_lib.select_devices(pcfg.mesh, devices))
    validate(pcfg, model_cfg, batch_size, mesh, eval_batch_size, grad_accum=grad_accum)
    return Layout(pcfg, mesh)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    pcfg: Any  # the ``parallel`` ConfigDict
    mesh: jax.sharding.Mesh

    @property
    def pipelined(self) -> bool:
        return self.pcfg.pipeline.stages > 1

    @property
    def rules(self) -> tuple:
        """The train step's rules table (the pipeline's when pipelined)."""
        return mesh_lib.rules_for(self.pcfg)

    eval_rules = mesh_lib.RULES

    @property
    def single_device(self) -> bool:
        """One device and no pipeline: nothing to shard (the training loop keeps its plain path)."""
        return self.mesh.size == 1 and not self.pipelined

    @property
    def key(self) -> str:
        """Identifies the compiled steps: the parallel config and the mesh's devices."""
        return json.dumps([self.pcfg.to_dict(), dict(self.mesh.shape), [d.id for d in self.mesh.devices.flat]],
                          sort_keys=True, default=str)

    def describe(self) -> str:
        devices = self.mesh.devices.flat[0]
        text = (f"{mesh_lib.describe(self.mesh)} on {self.mesh.size} of {jax.device_count()} "
                f"{devices.platform} devices")
        if jax.process_count() > 1:
            text += f", {jax.process_count()} processes"
        p = self.pcfg.pipeline
        if self.pipelined:
            text += (f"; pipeline: {p.stages} stages x {p.repeats} repeats, {p.microbatches} microbatches"
                     + (", cross-stage cache" if p.cache and p.repeats > 1 else ""))
        elif self.mesh.shape["stage"] > 1:
            text += "; no pipeline (parallel.pipeline.stages = 1): the stage axis is data parallel"
        return text

    # ---------------------------------------------------------------- context and batches

    def context(self, rules=None):
        """``jax.set_mesh`` + the rules table (the train step's by default)."""
        return mesh_lib.use_mesh(self.mesh, self.rules if rules is None else rules)

    def bind(self, fn: Callable, rules=None) -> Callable:
        """``fn`` called inside ``context(rules)`` (tracing needs the mesh and the rules)."""
        rules = self.rules if rules is None else rules

        @functools.wraps(fn)
        def call(*args, **kwargs):
            with mesh_lib.use_mesh(self.mesh, rules):
                return fn(*args, **kwargs)

        return call

    def batch_sharding(self, rows: int, rules=None) -> NamedSharding:
        return mesh_lib.batch_sharding(self.mesh, rows, self.rules if rules is None else rules)

    def global_batch(self, local_rows, rules=None) -> jax.Array:
        """The global ``[B, T+1]`` batch from this process's rows (``multihost.global_batch``)."""
        return multihost.global_batch(local_rows, self.mesh, self.rules if rules is None else rules)

    def global_eval_batch(self, local_rows) -> jax.Array:
        return self.global_batch(local_rows, self.eval_rules)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    # ---------------------------------------------------------------- state

    def abstract_state(self, model_cfg, tx) -> tuple[Any, Any, Any]:
        """``(model_def, abstract train state, its shardings)``; nothing is allocated."""
        from msar_jax.train.step import abstract_model, init_state

        model_def, abstract_params = abstract_model(model_cfg)
        abstract = jax.eval_shape(lambda p: init_state(p, tx), abstract_params)
        psh = mesh_lib.param_shardings(model_cfg, self.mesh, self.rules)
        return model_def, abstract, mesh_lib.state_shardings(abstract, psh, self.mesh)

    def restore_target(self, model_cfg, tx) -> tuple[Any, Any, Any]:
        """``(model_def, ShapeDtypeStructs with shardings, shardings)``: an orbax restore target
        that loads a checkpoint (saved under any mesh) straight into this layout."""
        model_def, abstract, ssh = self.abstract_state(model_cfg, tx)
        return model_def, mesh_lib.sharded_abstract(abstract, ssh), ssh

    def init_state(self, model_cfg, tx, seed: int) -> tuple[Any, Any, Any]:
        """``(model_def, state, shardings)``: the state created in its shardings."""
        return mesh_lib.init_sharded_state(model_cfg, tx, self.mesh, seed, self.rules)

    # ---------------------------------------------------------------- steps

    def train_step(self, model_def, tx, schedule, model_cfg, state_shardings,
                   compiler_options: dict | None = None, grad_accum: int = 1):
        """The train step jitted for this layout (not bound to the context: call it, or
        ``lower`` it, inside ``context()``, or wrap it with ``bind``). ``grad_accum``:
        microbatches per step (``msar_jax.train.step``; not with a pipeline)."""
        raw = pl.train_step_fn(model_def, tx, schedule, self.pcfg, self.mesh, model_cfg, grad_accum=grad_accum)
        bsh = self.batch_sharding(self.mesh.size)  # the spec does not depend on the (valid) row count
        return jax.jit(raw, in_shardings=(state_shardings, bsh), out_shardings=(state_shardings, self.replicated),
                       donate_argnums=0, compiler_options=compiler_options)

    def eval_step(self, model_def, model_cfg, compiler_options: dict | None = None):
        """``(params, batch) -> mean cross entropy``, the sequential forward (module docstring);
        call it inside ``context(eval_rules)``."""
        from msar_jax.train.step import make_eval_step

        psh = mesh_lib.param_shardings(model_cfg, self.mesh, self.eval_rules)
        bsh = self.batch_sharding(self.mesh.size, self.eval_rules)
        return jax.jit(make_eval_step(model_def).__wrapped__, in_shardings=(psh, bsh), out_shardings=self.replicated,
                       compiler_options=compiler_options)
