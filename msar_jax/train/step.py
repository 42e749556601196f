"""The train state, the jitted train step and the eval step.

The state is a plain dict of arrays (``step``, ``params``, ``opt_state``); the model is rebuilt
inside the jitted functions from its static ``graphdef``, so each step is a pure function of
arrays. ``train_step(state, batch) -> (state, metrics)`` is jitted with the state donated, keeps
the old state when the loss or an update is not finite, and accumulates gradients over
``train.grad_accum`` microbatches. A batch is a ``[B, T+1]`` token array, or with
``data.document_mask`` a dict of ``tokens`` and ``segment_ids`` (the model then attends within
documents only). Details: docs/training.md sections 2, 5 and 6.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from msar_jax.model.transformer import Transformer, cross_entropy, lm_loss

# XLA options for every jit made here; tests set FAST_COMPILE (CPU compile about 2x faster).
COMPILER_OPTIONS: dict | None = None
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@dataclass(frozen=True)
class ModelDef:
    """What turns a params dict back into a ``Transformer`` (static; safe to close over)."""

    graphdef: Any
    template: Any  # abstract nnx.State with the param structure

    def merge(self, params) -> Transformer:
        state = jax.tree.map(lambda x: x, self.template)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)


def init_model(model_cfg: ml_collections.ConfigDict, seed: int) -> tuple[ModelDef, dict]:
    """Build the model with ``nnx.Rngs(seed)``; return its definition and float32 params."""
    model = Transformer(model_cfg, nnx.Rngs(seed))
    graphdef, state = nnx.split(model, nnx.Param)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return ModelDef(graphdef, template), nnx.to_pure_dict(state)


def abstract_model(model_cfg: ml_collections.ConfigDict) -> tuple[ModelDef, dict]:
    """Like ``init_model`` but allocates nothing (params are ``ShapeDtypeStruct``)."""
    model = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    graphdef, state = nnx.split(model, nnx.Param)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return ModelDef(graphdef, template), nnx.to_pure_dict(template)


def init_state(params, tx: optax.GradientTransformation) -> dict:
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params)}


def abstract_state(model_cfg, tx: optax.GradientTransformation) -> dict:
    """``ShapeDtypeStruct`` tree of the train state (the orbax restore target)."""
    _, params = abstract_model(model_cfg)
    return jax.eval_shape(lambda p: init_state(p, tx), params)


def make_train_step(model_def: ModelDef, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, loss: Callable | None = None, grad_accum: int = 1) -> Callable:
    """The jitted, state-donating train step.

    ``loss(model, batch) -> (loss, {"cross_entropy", "aux_loss"})`` replaces ``lm_loss``
    (the pipelined loss of ``msar_jax.parallel.pipeline`` uses it); the unjitted step is
    ``make_train_step(...).__wrapped__`` (to re-jit with explicit shardings).
    ``grad_accum``: microbatches per step (module docstring)."""
    model_loss = lm_loss if loss is None else loss
    if not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum = {grad_accum!r}: must be a positive integer")

    def loss_fn(params, batch):
        model = model_def.merge(params)
        if isinstance(batch, dict):  # data.document_mask: {"tokens", "segment_ids"}, both [B, T+1]
            if loss is not None:
                raise ValueError("a custom loss (the pipelined loss) takes [B, T+1] token batches only; "
                                 "data.document_mask needs parallel.pipeline.stages = 1")
            return lm_loss(model, batch["tokens"], segment_ids=batch["segment_ids"])
        return model_loss(model, batch)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulated_grad(params, batch):
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % grad_accum:
            raise ValueError(f"batch of {rows} rows does not split into grad_accum = {grad_accum} microbatches")
        micro = jax.tree.map(lambda x: x.reshape(rows // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
                             batch)

        def body(acc, mb):
            (loss, parts), grads = grad_fn(params, mb)
            out = (loss, parts, jax.tree.map(lambda g: g.astype(jnp.float32), grads))
            return jax.tree.map(jnp.add, acc, out), None

        zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
            lambda: (lambda o: (o[0][0], o[0][1], jax.tree.map(lambda g: g.astype(jnp.float32), o[1])))(
                grad_fn(params, jax.tree.map(lambda x: x[0], micro)))))
        (loss, parts, grads), _ = jax.lax.scan(body, zeros, micro)
        mean = lambda x: x / grad_accum  # noqa: E731
        grads = jax.tree.map(lambda g, p: mean(g).astype(p.dtype), grads, params)
        return (mean(loss), jax.tree.map(mean, parts)), grads

    def train_step(state, batch):
        if grad_accum == 1:
            (loss, parts), grads = grad_fn(state["params"], batch)
        else:
            (loss, parts), grads = accumulated_grad(state["params"], batch)
        with jax.named_scope("optimizer"):  # labels profiles (benchmarks/profile_step.py)
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.global_norm(grads)
        update_norm = optax.global_norm(updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
        new = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        # Never let a non-finite update through: keep the old state (select, fused by XLA).
        new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
        metrics = {
            "loss": loss,
            "cross_entropy": parts["cross_entropy"],
            "aux_loss": jnp.asarray(parts["aux_loss"], jnp.float32),
            "grad_norm": grad_norm,
            "update_norm": update_norm,
            "param_norm": optax.global_norm(new["params"]),
            "lr": schedule(state["step"]),
            "finite": finite,
        }
        return new, metrics

    return jax.jit(train_step, donate_argnums=0, compiler_options=COMPILER_OPTIONS)


def make_eval_step(model_def: ModelDef) -> Callable:
    """Jitted ``(params, batch[B, T+1]) -> mean next-token cross entropy`` (nats); a dict batch
    (``data.document_mask``) passes its ``segment_ids`` to the model."""

    def eval_step(params, batch):
        seg = None
        if isinstance(batch, dict):
            batch, seg = batch["tokens"], batch["segment_ids"][:, :-1]
        logits, _ = model_def.merge(params)(batch[:, :-1], segment_ids=seg)
        return cross_entropy(logits, batch[:, 1:])

    return jax.jit(eval_step, compiler_options=COMPILER_OPTIONS)


_CACHE: dict = {}


def compiled_steps(config, model_def: ModelDef, tx, schedule, layout=None) -> tuple[Callable, Callable]:
    """``(train_step, eval_step)`` for ``config``, shared by every run in this process with the
    same model, optimizer, step count and layout (a notebook or a test that trains twice
    compiles once).

    ``layout`` (``msar_jax.parallel.layout.Layout``): ``None`` or a single-device layout gives
    the plain jitted steps above (arrays on the default device); any other layout gives its
    sharded steps (``Layout.train_step`` / ``Layout.eval_step``), each called inside the layout's
    mesh and rules table. Both take ``(state, batch)`` / ``(params, batch)`` with the batch a
    device array (``Layout.global_batch`` / ``global_eval_batch``; ``jax.device_put`` for the plain
    steps)."""
    sharded = layout is not None and not layout.single_device
    accum = int(config.train.get("grad_accum", 1))
    key = (config.model.to_json(), config.optim.to_json(), int(config.train.steps), accum, str(COMPILER_OPTIONS),
           layout.key if sharded else None)
    if key not in _CACHE:
        _CACHE.clear()  # keep one: compiled executables hold memory
        if sharded:
            _, _, ssh = layout.abstract_state(config.model, tx)
            train_step = layout.bind(layout.train_step(model_def, tx, schedule, config.model, ssh, COMPILER_OPTIONS,
                                                       grad_accum=accum))
            eval_step = layout.bind(layout.eval_step(model_def, config.model, COMPILER_OPTIONS), layout.eval_rules)
            _CACHE[key] = (train_step, eval_step)
        else:
            _CACHE[key] = (make_train_step(model_def, tx, schedule, grad_accum=accum), make_eval_step(model_def))
    return _CACHE[key]
