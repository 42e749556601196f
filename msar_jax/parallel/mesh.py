"""Device mesh, the one logical-axis rules table, and sharded parameters and train state.

The mesh has four named axes, ``data``, ``stage``, ``fsdp`` and ``tensor``, with degrees from the
config's ``parallel.mesh``. ``RULES`` maps the logical axis names that parameters and activations
carry to mesh axes, ``spec_for`` turns one array's names into a ``PartitionSpec``, ``use_mesh``
installs the mesh and the rules together, and ``init_sharded_state`` creates the train state
already sharded. What each axis means and the rules table: docs/parallelism.md section 1.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from msar_jax.parallel import logical_axes as sharding_lib
from msar_jax.config import ConfigError
from msar_jax.parallel.config import MESH_AXES, check_degrees, parallel_config  # noqa: F401 (re-exported)

# The one rules table: logical name -> mesh axes (MaxText's logical_axis_rules).
RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "stage", "fsdp")),  # without a pipeline the stage axis is data parallel
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("experts", None),
    ("layers", None),
    ("sublayers", None),
    ("streams", None),
    ("stream_features", None),
    ("taps", None),
    ("sources", None),
    ("stage", "stage"),
)

# Under a pipeline the batch is split into microbatches that flow through the stages: the
# stage axis no longer splits the batch.
PIPELINE_RULES: tuple[tuple[str, Any], ...] = tuple(
    (name, ("data", "fsdp")) if name == "batch" else (name, axes) for name, axes in RULES
)


def rules_for(parallel_cfg: ml_collections.ConfigDict | None) -> tuple:
    """The rules table for a parallel config (pipeline rules when it has stages > 1)."""
    if parallel_cfg is not None and parallel_cfg.pipeline.stages > 1:
        return PIPELINE_RULES
    return RULES


def mesh_degrees(mesh_cfg, n_devices: int) -> tuple[int, ...]:
    """Per-axis degrees in ``MESH_AXES`` order with ``-1`` resolved; raises ``ConfigError``."""
    degrees = list(check_degrees(mesh_cfg))
    auto = [i for i, v in enumerate(degrees) if v == -1]
    fixed = math.prod(v for v in degrees if v != -1)
    if auto:
        if n_devices % fixed:
            raise ConfigError(f"parallel.mesh.{MESH_AXES[auto[0]]}", -1,
                              f"the other degrees multiply to {fixed}, which does not divide {n_devices} devices")
        degrees[auto[0]] = n_devices // fixed
    if math.prod(degrees) != n_devices:
        raise ConfigError("parallel.mesh", dict(zip(MESH_AXES, degrees)),
                          f"degrees multiply to {math.prod(degrees)} but there are {n_devices} devices")
    return tuple(degrees)


def select_devices(mesh_cfg, devices: Sequence | None = None) -> list:
    """The devices a run with these degrees uses (default pool ``jax.devices()``): all of them
    when an axis is ``-1`` or the degrees multiply to their number; the first ``prod(degrees)``
    when that is smaller and this is a single process; ``ConfigError`` naming ``parallel.mesh``
    when the degrees need more devices than there are, or leave some of a multi-process run out."""
    devices = list(jax.devices() if devices is None else devices)
    degrees = check_degrees(mesh_cfg)
    if -1 in degrees:
        return devices
    n = math.prod(degrees)
    given = dict(zip(MESH_AXES, degrees))
    if n > len(devices):
        raise ConfigError("parallel.mesh", given, f"degrees multiply to {n} but there are only {len(devices)} devices")
    if n < len(devices) and jax.process_count() > 1:
        raise ConfigError("parallel.mesh", given,
                          f"degrees multiply to {n} but a run of {jax.process_count()} processes must use all "
                          f"{len(devices)} devices (set one axis to -1)")
    return devices[:n]


def make_mesh(mesh_cfg, devices: Sequence | None = None) -> jax.sharding.Mesh:
    """``jax.make_mesh`` over ``devices`` (default all) with ``MESH_AXES`` and Auto axis types
    (sharding is propagated by XLA from the parameter/batch shardings and ``constrain``)."""
    devices = list(jax.devices() if devices is None else devices)
    degrees = mesh_degrees(mesh_cfg, len(devices))
    return jax.make_mesh(degrees, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules=RULES):
    """Activate ``mesh`` (``jax.set_mesh``) and the logical rules (``constrain``) together."""
    with jax.set_mesh(mesh), sharding_lib.axis_rules(rules):
        yield


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh: jax.sharding.Mesh,
             rules=RULES) -> PartitionSpec:
    """The ``PartitionSpec`` of one array from its logical axis names.

    Mesh axes of size 1 are left out, and so is any axis whose size does not divide the
    dimension (e.g. ``kv_heads = 1`` under ``tensor = 2``: that dimension is replicated).
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    return sharding_lib.fit_spec(sharding_lib.logical_to_spec(names, rules), shape, dict(mesh.shape))


def logical_sharding(names, shape, mesh, rules=RULES) -> NamedSharding:
    return NamedSharding(mesh, spec_for(names, shape, mesh, rules))


def param_shardings(model_cfg, mesh: jax.sharding.Mesh, rules=RULES) -> dict:
    """A pure dict (the structure of ``nnx.to_pure_dict`` of the params) of ``NamedSharding``s
    built from every parameter's ``logical_axes`` through the rules table."""
    from msar_jax.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)

    def one(var):
        axes = var.get_metadata().get("logical_axes")
        shape = var.value.shape
        if axes is None:  # an unannotated parameter is replicated
            axes = (None,) * len(shape)
        return logical_sharding(axes, shape, mesh, rules)

    return nnx.to_pure_dict(jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def _path_names(path) -> tuple:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(getattr(k, attr))
                break
    return tuple(out)


def state_shardings(abstract_state: Any, params_sh: dict, mesh: jax.sharding.Mesh) -> Any:
    """Shardings of a train state: every leaf whose key path ends with a parameter's path
    and has its shape (params, AdamW moments, ...) gets that parameter's sharding; the rest
    (step counters, scalars) is replicated."""
    by_path = {_path_names(p): s for p, s in jax.tree_util.tree_flatten_with_path(params_sh)[0]}
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(path, leaf):
        names = _path_names(path)
        for i in range(len(names)):
            sh = by_path.get(names[i:])
            if sh is not None and len(sh.spec) <= len(getattr(leaf, "shape", ())):
                return sh
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_state)


def batch_sharding(mesh: jax.sharding.Mesh, batch_size: int, rules=RULES) -> NamedSharding:
    """Sharding of a ``[B, T]`` token batch: rows over the rules table's batch axes."""
    return logical_sharding(("batch", "length"), (batch_size, 1), mesh, rules)


def init_sharded_state(model_cfg, tx, mesh: jax.sharding.Mesh, seed: int, rules=RULES):
    """``(model_def, state, state_shardings)``: the train state created directly in its
    shardings (``jax.jit(out_shardings=...)``), never whole on one device."""
    from msar_jax.train.step import abstract_model, init_model, init_state

    model_def, abstract_params = abstract_model(model_cfg)
    psh = param_shardings(model_cfg, mesh, rules)
    abstract = jax.eval_shape(lambda p: init_state(p, tx), abstract_params)
    ssh = state_shardings(abstract, psh, mesh)
    with use_mesh(mesh, rules):
        state = jax.jit(lambda: init_state(init_model(model_cfg, seed)[1], tx), out_shardings=ssh)()
    return model_def, state, ssh


def describe(mesh: jax.sharding.Mesh) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh.shape.items())


def local_batch_rows(global_batch: int) -> int:
    """Rows of a global batch this process feeds (``make_global_batch`` assembles them)."""
    if global_batch % jax.process_count():
        raise ConfigError("train.batch_size", global_batch,
                          f"must be divisible by the process count {jax.process_count()}")
    return global_batch // jax.process_count()


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


def sharded_abstract(abstract_tree: Any, shardings: Any) -> Any:
    """``ShapeDtypeStruct``s carrying ``shardings``: an orbax restore target that loads a
    checkpoint straight into this mesh's layout (whatever mesh it was saved from)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)
