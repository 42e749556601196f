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


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Tag activation ``x`` with logical axis names (identity when no rules are active)."""
    rules = _RULES.get()
    if not rules:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))
