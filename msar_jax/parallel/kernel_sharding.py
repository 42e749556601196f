"""The depth-read kernels under a mesh: a ``jax.shard_map`` over the batch axes.

XLA cannot partition a Pallas kernel: a Mosaic TPU custom call lowered where some mesh axis is
still automatic fails ("Mosaic kernels cannot be automatically partitioned"), and a Triton or
Mosaic GPU kernel has no partitioning rule either. Every depth read is independent per batch
row (docs/design.md §5), so under a mesh each kernel-running read runs inside a ``shard_map``
that is manual over every axis the active mesh still leaves automatic:

- its activations' batch dimension is split over the mesh axes the active logical rules give
  ``"batch"`` (``msar_jax.parallel.mesh.RULES``: ``data``, ``stage``, ``fsdp``; under a pipeline
  ``PIPELINE_RULES``: ``data``, ``fsdp``), leaving out axes of size 1 and any axis whose size
  does not divide the rows (as ``mesh.spec_for`` does); those rows are then read whole on each
  device of that axis;
- everything else (the ``tensor`` axis, where the activations are replicated, and the
  parameters: queries, conv banks, gate weights) goes in replicated (``P()``), so each device
  runs the kernel on its own rows with the whole parameters, and the parameters' cotangents are
  summed over the batch axes by the ``shard_map``'s transpose;
- inside the pipeline's own ``shard_map`` (``msar_jax.parallel.pipeline``, manual over ``stage``)
  only the axes still automatic there are made manual: Mosaic TPU lowers a kernel only where
  every mesh axis is manual. That ``shard_map`` is unchecked (``check_vma=False``): the kernels'
  outputs and ``custom_vjp`` cotangents carry no varying type, which a checked body refuses.

Outside a mesh, on one device, or where every axis is already manual, the read runs as is.
docs/parallelism.md, "The kernels under a mesh".
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax.sharding import AxisType, PartitionSpec

from msar_jax.parallel import logical_axes
from msar_jax.parallel import mesh as mesh_lib


def _free_axes(mesh) -> tuple[str, ...]:
    """The mesh axes that are not manual already (all of them outside any ``shard_map``)."""
    return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != AxisType.Manual)


def needs_shard_map() -> bool:
    """Whether a kernel traced here must be wrapped: a mesh of more than one device is active and
    some of its axes are still automatic."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1 and bool(_free_axes(mesh))


def batch_mesh_axes(mesh, rows: int) -> tuple[str, ...]:
    """The mesh axes ``rows`` batch rows are split over: those the active rules map ``"batch"``
    to (``mesh.RULES``' when no rules are active), that are still automatic in ``mesh``, of size
    above 1, and whose sizes, multiplied in rule order, divide ``rows``."""
    rule = logical_axes.logical_to_spec(("batch",))[0]
    if rule is None:
        rule = logical_axes.logical_to_spec(("batch",), mesh_lib.RULES)[0]
    free = set(_free_axes(mesh))
    keep, prod = [], 1
    for name in (rule,) if isinstance(rule, str) else tuple(rule or ()):
        size = mesh.shape.get(name, 1)
        if name in free and size > 1 and rows % (prod * size) == 0:
            keep.append(name)
            prod *= size
    return tuple(keep)


def leaf_batch_axes(args: Sequence[Any], batch_axes: Sequence[Any]) -> list[int | None]:
    """One batch axis (or ``None``: no batch dimension) per leaf of ``args``: an ``int`` or
    ``None`` applies to every leaf of its argument, a tuple gives one per leaf."""
    axes: list[int | None] = []
    for arg, ax in zip(args, batch_axes, strict=True):
        n_leaves = len(jax.tree.leaves(arg))
        per_leaf = list(ax) if isinstance(ax, tuple) else [ax] * n_leaves
        if len(per_leaf) != n_leaves:
            raise ValueError(f"batch axes {ax!r} for an argument of {n_leaves} arrays")
        axes += per_leaf
    return axes


def _spec(axis: int | None, mesh_axes: tuple[str, ...]) -> PartitionSpec:
    if axis is None or not mesh_axes:
        return PartitionSpec()
    return PartitionSpec(*([None] * axis), mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)


def over_batch(fn: Callable, args: Sequence[Any], batch_axes: Sequence[Any], out_batch_axes: Any,
               manual_batch_axes_only: bool = False) -> Any:
    """``fn(*args)``, inside a ``shard_map`` over the active mesh's automatic axes when
    ``needs_shard_map()``, else called as is.

    ``batch_axes``: per argument, its batch axis (``leaf_batch_axes``); at least one leaf has
    one. ``out_batch_axes``: the batch axis of the output's leaves, an ``int`` for all of them or
    a pytree prefix of the output of ``int``s (``None``: no batch dimension, replicated).
    ``manual_batch_axes_only``: make only the batch's mesh axes manual (and call ``fn`` as is
    where there are none), leaving the others (``tensor``) to XLA inside ``fn``: for plain XLA
    code that is exact per row but whose global gathers XLA would replicate on every device
    (the MoE dispatch, ``layers.moe_mlp``).
    """
    if not needs_shard_map():
        return fn(*args)
    mesh = jax.sharding.get_abstract_mesh()
    leaves, treedef = jax.tree.flatten(tuple(args))
    axes = leaf_batch_axes(args, batch_axes)
    rows = {x.shape[ax] for x, ax in zip(leaves, axes) if ax is not None}
    if len(rows) != 1:
        raise ValueError(f"over_batch: the arguments' batch dimensions disagree or are missing: {sorted(rows)}")
    mesh_axes = batch_mesh_axes(mesh, rows.pop())
    if manual_batch_axes_only and not mesh_axes:
        return fn(*args)
    in_specs = jax.tree.unflatten(treedef, [_spec(ax, mesh_axes) for ax in axes])
    out_specs = jax.tree.map(lambda ax: _spec(ax, mesh_axes), out_batch_axes, is_leaf=lambda ax: ax is None)
    # ``check_vma=False``: the kernels' ``out_shape``s carry no varying-axes type (under
    # ``check_vma=True`` ``pallas_call`` refuses them), and the kernels stay free of mesh code.
    # The transpose then sums the replicated parameters' cotangents over the batch axes itself.
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs,
                         axis_names=set(mesh_axes if manual_batch_axes_only else _free_axes(mesh)),
                         check_vma=False)(*args)
