"""Logical axis names for parameters and activations (MaxText style).

Every parameter carries ``logical_axes`` metadata (e.g. ``("layers", "embed", "mlp")``)
and activations are tagged with ``constrain(x, names)``. Without an active rules
table ``constrain`` is the identity; the scale-out code installs a table mapping
logical names to mesh axes with ``axis_rules(...)``.

Logical names used: ``batch``, ``length``, ``embed``, ``mlp``, ``heads``, ``kv_heads``,
``head_dim``, ``vocab``, ``layers``, ``sublayers``, ``streams``, ``taps``,
``experts``, ``sources``, ``stream_features``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Sequence

import jax
from jax.sharding import PartitionSpec

_RULES: contextvars.ContextVar = contextvars.ContextVar("msar_logical_axis_rules", default=None)


@contextlib.contextmanager
def axis_rules(rules: Sequence[tuple[str, str | tuple[str, ...] | None]]):
    """Activate a logical-name -> mesh-axis rules table for ``constrain``."""
    token = _RULES.set(tuple(rules))
    try:
        yield
    finally:
        _RULES.reset(token)


def logical_to_spec(names: Sequence[str | None], rules=None) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec`` with the first matching rule."""
    rules = _RULES.get() if rules is None else rules
    table = dict(rules or ())
    used: set = set()
    out = []
    for name in names:
        axis = table.get(name) if name is not None else None
        flat = (axis,) if isinstance(axis, str) else tuple(axis or ())
        if any(a in used for a in flat):
            axis = None  # a mesh axis may shard one array dimension only
        else:
            used.update(flat)
        out.append(axis)
    return PartitionSpec(*out)


def fit_spec(spec: PartitionSpec, shape: Sequence[int], axis_sizes: dict) -> PartitionSpec:
    """``spec`` without the mesh axes of size 1 and those whose size does not divide what is left
    of their dimension (in order: ``batch -> (data, stage, fsdp)`` keeps ``data`` alone for 2 rows
    on data=2, fsdp=2)."""
    out = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        flat = (axes,) if isinstance(axes, str) else tuple(axes or ())
        keep, prod = [], 1
        for a in flat:
            size = axis_sizes.get(a, 1)
            if size > 1 and dim % (prod * size) == 0:
                keep.append(a)
                prod *= size
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Tag activation ``x`` with logical axis names (identity when no rules are active).

    A dimension is split only over the mesh axes that divide it (``fit_spec``): XLA accepts an
    uneven split of an activation, and with 2 rows split 4 ways (data=2, fsdp=2) the embedding's
    gradient came out wrong on the XLA path (64.0 where one device gives 0)."""
    rules = _RULES.get()
    if not rules:
        return x
    spec = logical_to_spec(names, rules)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec = fit_spec(spec, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)
