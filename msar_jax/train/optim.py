"""AdamW, global-norm clipping and the learning-rate schedules of Table 3.

``make_optimizer(optim_cfg, total_steps) -> (tx, schedule)``: ``clip_by_global_norm`` then optax
``adamw`` with decoupled, learning-rate-scaled decay masked by ``decay_mask``. ``schedule_fn``:
warmup then ``wsd`` (Table 3), ``cosine`` or ``constant``. Weight decay groups by parameter name:
the backbone's here (``BACKBONE_DECAY``, ``BACKBONE_NO_DECAY``), each mechanism's declared by its
class; a parameter in neither group is an error. Formulas and reasons: docs/training.md §7.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from msar_jax.config import ConfigError

SCHEDULES = ("wsd", "cosine", "constant")

# Leaf names of the backbone's parameters (nnx.to_pure_dict of Transformer's nnx.Param state).
BACKBONE_NO_DECAY = frozenset({"norm", "final_norm"})
BACKBONE_DECAY = frozenset({
    "wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down",
    "router", "experts_gate", "experts_up", "experts_down", "shared_gate", "shared_up", "shared_down",
    "embedding", "lm_head",
})


def validate_optim(optim, prefix: str = "optim") -> None:
    """Raise ``ConfigError`` naming the first bad field of the optimizer config."""
    f = lambda name: f"{prefix}.{name}"  # noqa: E731
    if not (isinstance(optim.lr, (int, float)) and math.isfinite(optim.lr) and optim.lr > 0):
        raise ConfigError(f("lr"), optim.lr, "must be a finite number > 0")
    if optim.schedule not in SCHEDULES:
        raise ConfigError(f("schedule"), optim.schedule, f"must be one of {SCHEDULES}")
    if not isinstance(optim.warmup_steps, int) or optim.warmup_steps < 0:
        raise ConfigError(f("warmup_steps"), optim.warmup_steps, "must be an integer >= 0")
    if not 0.0 <= optim.decay_fraction <= 1.0:
        raise ConfigError(f("decay_fraction"), optim.decay_fraction, "must be in [0, 1]")
    if not 0.0 < optim.min_lr_ratio <= 1.0:
        raise ConfigError(f("min_lr_ratio"), optim.min_lr_ratio, "must be in (0, 1]")
    for name in ("b1", "b2"):
        if not 0.0 <= optim[name] < 1.0:
            raise ConfigError(f(name), optim[name], "must be in [0, 1)")
    if not optim.eps > 0:
        raise ConfigError(f("eps"), optim.eps, "must be > 0")
    if not optim.weight_decay >= 0:
        raise ConfigError(f("weight_decay"), optim.weight_decay, "must be >= 0")
    if not optim.grad_clip >= 0:
        raise ConfigError(f("grad_clip"), optim.grad_clip, "must be >= 0 (0 = no clipping)")


def decay_steps(optim, total_steps: int) -> int:
    """Length D of the wsd decay phase."""
    return max(1, int(round(optim.decay_fraction * total_steps)))


def schedule_fn(optim, total_steps: int) -> optax.Schedule:
    """The learning rate as a function of the 0-based step (jit-friendly)."""
    peak, floor = float(optim.lr), float(optim.lr) * float(optim.min_lr_ratio)
    warmup = int(optim.warmup_steps)
    total = int(total_steps)

    def warm(step):
        return peak * jnp.minimum(1.0, (step + 1.0) / max(warmup, 1))

    if optim.schedule == "wsd":
        d = decay_steps(optim, total)
        start = total - d

        def lr(step):
            step = jnp.asarray(step, jnp.float32)
            progress = jnp.clip((step - start + 1.0) / d, 0.0, 1.0)
            decayed = peak * jnp.power(float(optim.min_lr_ratio), progress)
            return jnp.where(step < warmup, warm(step), jnp.where(step < start, peak, decayed))
    elif optim.schedule == "cosine":
        anchor = max(warmup - 1, 0)  # the step at the peak
        span = max(total - 1 - anchor, 1)

        def lr(step):
            step = jnp.asarray(step, jnp.float32)
            progress = jnp.clip((step - anchor) / span, 0.0, 1.0)
            cos = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
            return jnp.where(step < warmup, warm(step), cos)
    else:

        def lr(step):
            step = jnp.asarray(step, jnp.float32)
            return jnp.where(step < warmup, warm(step), peak)

    return lr


def _leaf_name(path) -> str:
    key = path[-1]
    return str(getattr(key, "key", getattr(key, "name", key)))


def decay_groups() -> tuple[frozenset, frozenset]:
    """``(decayed, not decayed)`` parameter names: the backbone's and every registered
    mechanism's declarations. A name two groups claim is an error."""
    from msar_jax import residuals

    decayed, undecayed = set(BACKBONE_DECAY), set(BACKBONE_NO_DECAY)
    for name in residuals.registered():
        cls = residuals.mechanism_class(name)
        decayed |= cls.decayed_params
        undecayed |= cls.undecayed_params
    both = decayed & undecayed
    if both:
        raise ValueError(f"parameter names {sorted(both)} are declared both decayed and not decayed "
                         "(ResidualMechanism.decayed_params / undecayed_params)")
    return frozenset(decayed), frozenset(undecayed)


def decay_mask(params):
    """Pytree of bools, True where weight decay applies (see the module docstring)."""
    decayed, undecayed = decay_groups()

    def decide(path, _):
        name = _leaf_name(path)
        if name in undecayed:
            return False
        if name in decayed:
            return True
        raise ValueError(
            f"parameter {jax.tree_util.keystr(path)} ({name!r}) takes no side on weight decay: declare it "
            "in its mechanism's decayed_params or undecayed_params (or optim.BACKBONE_* for the backbone)"
        )

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(optim, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)``: clip, then AdamW with the schedule and the decay mask."""
    validate_optim(optim)
    schedule = schedule_fn(optim, total_steps)
    parts = []
    if optim.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(float(optim.grad_clip)))
    parts.append(optax.adamw(schedule, b1=float(optim.b1), b2=float(optim.b2), eps=float(optim.eps),
                             weight_decay=float(optim.weight_decay), mask=decay_mask))
    return optax.chain(*parts), schedule
