"""SPMD pipeline parallelism over the ``stage`` mesh axis (GPipe and circular), MaxText style.

``pipelined_lm_loss`` splits the layers into ``stages x repeats`` virtual stages, views the
canonical ``[n_layers, ...]`` parameters as ``[repeats, stages, Lps, ...]`` sharded on ``stage``,
and runs one rematerialised scan (``buffered_scan``) whose iterations pass each stage's hop on with
``lax.ppermute`` inside a ``jax.shard_map`` manual over ``stage`` only. The hop is described by the
mechanism class, never by its name; ``Plan`` holds the schedule and the analytic hop sizes, with
optional cross-stage caching of block summaries. Design, memory and limits: docs/parallelism.md
sections 2 and 5, docs/design.md §13.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from msar_jax import config as config_lib
from msar_jax.config import ConfigError
from msar_jax.model import layers
from msar_jax.model.layers import SequenceContext
from msar_jax.model.transformer import cross_entropy, layer_kinds, pure
from msar_jax.residuals.base import DepthState, ResidualMechanism, mechanism_class, position
from msar_jax.parallel.logical_axes import constrain

AXIS = "stage"


# --------------------------------------------------------------------------------------
# The plan: static structure and the analytic hop size.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    stages: int
    repeats: int
    microbatches: int
    n_layers: int
    block_size: int  # S in sublayers (mechanisms without sources: 2, unused)
    n_sources: int  # N + 1 buffer entries (0 without sources)
    cache: bool
    mechanism: type[ResidualMechanism]  # what crosses a stage: its uses_sources, *_carry, carry_vectors
    residual: Any = dataclasses.field(repr=False, hash=False)  # model.residual, for carry_vectors
    first_layer: int = 0  # leading layers run before the pipeline (an MoE model's dense layers)

    @property
    def uses_sources(self) -> bool:
        return self.mechanism.uses_sources

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.repeats

    @property
    def layers_per_stage(self) -> int:
        return (self.n_layers - self.first_layer) // self.virtual_stages

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def caching(self) -> bool:
        return self.cache and self.repeats > 1 and self.uses_sources

    def completed_before(self, v: int) -> int:
        """Index of the newest completed block summary when virtual stage ``v`` starts."""
        return (2 * (self.first_layer + self.layers_per_stage * v)) // self.block_size

    @property
    def window(self) -> int:
        """Block summaries per hop (``W``)."""
        if not self.uses_sources:
            return 0
        V, S = self.virtual_stages, self.stages
        hi = self.completed_before
        if not self.caching:
            return max((hi(v) for v in range(1, V)), default=0)
        return max((hi(v) - (hi(v - S + 1) if v >= S else 0) for v in range(1, V)), default=0)

    @property
    def send_partial(self) -> bool:
        """True when some stage boundary falls inside a block (the ``block_carry`` leaves, e.g.
        the partial, are not empty there)."""
        return bool(self.mechanism.block_carry) and any(
            (2 * (self.first_layer + self.layers_per_stage * v)) % self.block_size
            for v in range(1, self.virtual_stages)
        )

    def hop_vectors(self) -> int:
        """Vectors of ``d`` numbers per token in one hop (the analytic count): the carry that
        crosses every boundary, the ``block_carry`` leaves when ``send_partial``, the window."""
        block = len(self.mechanism.block_carry) * int(self.send_partial) + self.window
        return self.mechanism.carry_vectors(self.residual) + block


def make_plan(pcfg, model_cfg) -> Plan:
    p = pcfg.pipeline
    mechanism = mechanism_class(model_cfg.residual.name)
    S = mechanism.sublayers_per_block(model_cfg.residual)
    n_sources = -(-config_lib.n_sublayers(model_cfg) // S) + 1 if mechanism.uses_sources else 0  # N + 1
    return Plan(stages=p.stages, repeats=p.repeats, microbatches=p.microbatches, n_layers=model_cfg.n_layers,
                block_size=S, n_sources=n_sources, cache=bool(p.cache), mechanism=mechanism,
                residual=model_cfg.residual, first_layer=leading_layers(model_cfg))


def leading_layers(model_cfg) -> int:
    """Layers run before the pipeline: an MoE model's leading dense layers (every pipelined
    layer then has the same MLP kind); 0 when every layer has one kind."""
    kinds = layer_kinds(model_cfg)
    return 0 if len(set(kinds)) == 1 else kinds.index(kinds[-1])


def validate(pcfg, model_cfg, batch_size: int, mesh: jax.sharding.Mesh | None = None) -> None:
    """Check the pipeline config against the model, the batch and the mesh (``ConfigError``)."""
    p = pcfg.pipeline
    for name in ("stages", "repeats", "microbatches"):
        v = p[name]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"parallel.pipeline.{name}", v, "must be a positive integer")
    if p.stages == 1:
        if p.repeats != 1:
            raise ConfigError("parallel.pipeline.repeats", p.repeats, "must be 1 without a pipeline (stages = 1)")
        return
    lead = leading_layers(model_cfg)
    if (model_cfg.n_layers - lead) % (p.stages * p.repeats):
        what = f"minus its {lead} leading dense layers (run before the pipeline) " if lead else ""
        raise ConfigError("model.n_layers", model_cfg.n_layers,
                          f"{what}must divide into pipeline.stages x pipeline.repeats = {p.stages} x {p.repeats} "
                          "equal virtual stages")
    if p.microbatches % p.stages:
        raise ConfigError("parallel.pipeline.microbatches", p.microbatches,
                          f"must be a multiple of pipeline.stages = {p.stages}")
    if batch_size % p.microbatches:
        raise ConfigError("train.batch_size", batch_size,
                          f"must be divisible by parallel.pipeline.microbatches = {p.microbatches}")
    if mesh is not None:
        degree = mesh.shape[AXIS]
        if p.stages % degree:
            raise ConfigError("parallel.mesh.stage", degree, f"must divide parallel.pipeline.stages = {p.stages}")
        rows = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
        mb = batch_size // p.microbatches
        if mb % rows:
            raise ConfigError("train.batch_size", batch_size,
                              f"a microbatch of {mb} rows must be divisible by data x fsdp = {rows}")


# --------------------------------------------------------------------------------------
# Hops: which parts of the depth state cross a stage boundary.
# --------------------------------------------------------------------------------------

def _carry_key(path) -> str:
    return jax.tree_util.keystr(path)


def _leaf_name(path) -> str | None:
    last = path[-1] if path else None
    return getattr(last, "key", None)


def hop_carry(plan: Plan, carry) -> dict:
    """The part of a mechanism's carry that crosses a stage boundary, keyed by tree path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(carry)[0]:
        name = _leaf_name(path)
        if name in plan.mechanism.stage_local_carry or (name in plan.mechanism.block_carry and not plan.send_partial):
            continue
        out[_carry_key(path)] = leaf
    return out


def merge_carry(template, received: dict):
    """``template`` (a fresh carry) with the received leaves put back in place."""
    leaves = [received.get(_carry_key(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]]
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def _pad_front(buf, w):
    return jnp.concatenate([jnp.zeros((w, *buf.shape[1:]), buf.dtype), buf], axis=0)


def read_window(sources, hi, w: int):
    """Summaries ``hi - w + 1 .. hi`` of ``sources`` (rows before 0 read as zeros)."""
    return jax.lax.dynamic_slice_in_dim(_pad_front(sources, w), hi + 1, w, axis=0)


def write_window(sources, window, hi):
    """Put ``window`` (summaries ``hi - w + 1 .. hi``) into ``sources``; ``b_0`` is kept."""
    w = window.shape[0]
    out = jax.lax.dynamic_update_slice_in_dim(_pad_front(sources, w), window, hi + 1, axis=0)[w:]
    return out.at[0].set(sources[0])


# --------------------------------------------------------------------------------------
# The stage program.
# --------------------------------------------------------------------------------------


def _select(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), tree)


def _set(tree, i, value, pred):
    return jax.tree.map(
        lambda a, x: jax.lax.dynamic_update_index_in_dim(
            a, jnp.where(pred, x, jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False)), i, 0), tree, value)


# --------------------------------------------------------------------------------------
# A scan whose big state is restorable from its final value (memory linear in depth).
# --------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def buffered_scan(step, restore, small0, bufs0, consts, xs, ids, statics):
    """``lax.scan`` of ``step(small, bufs, consts, x, id, statics) -> (small, bufs, y)`` over
    ``(xs, ids)``, returning ``(small, bufs, ys)``; differentiable in ``small0``, ``bufs0``,
    ``consts`` and ``xs`` (``ids`` and ``statics`` are integer data).

    ``bufs`` is the big part of the loop state: ``restore(bufs_final, id, statics)`` must give
    ``bufs`` as they were when the step with ``id`` started (e.g. an append-only buffer
    masked to the rows written so far). The backward pass then keeps one copy of ``bufs``
    (the final one) plus ``small`` once per step, instead of the whole state per step, and
    rematerialises each step from the restored state in reverse (``stack._append_only_scan``
    generalised). ``bufs`` may be ``None``: a rematerialised scan that saves ``small`` only."""

    def body(carry, inp):
        small, bufs = carry
        small, bufs, y = step(small, bufs, consts, inp[0], inp[1], statics)
        return (small, bufs), y

    (small, bufs), ys = jax.lax.scan(body, (small0, bufs0), (xs, ids))
    return small, bufs, ys


def _buffered_fwd(step, restore, small0, bufs0, consts, xs, ids, statics):
    def body(carry, inp):
        small, bufs = carry
        new_small, bufs, y = step(small, bufs, consts, inp[0], inp[1], statics)
        return (new_small, bufs), (y, small)

    (small, bufs), (ys, smalls_in) = jax.lax.scan(body, (small0, bufs0), (xs, ids))
    return (small, bufs, ys), (smalls_in, bufs, consts, xs, ids, statics)


def _buffered_bwd(step, restore, res, cotangents):
    smalls_in, bufs_final, consts, xs, ids, statics = res
    d_small, d_bufs, d_ys = cotangents

    def body(acc, inp):
        d_small, d_bufs, d_consts = acc
        small_in, x, i, d_y = inp
        bufs_in = restore(bufs_final, i, statics)
        _, vjp = jax.vjp(lambda sm, bf, cs, xx: step(sm, bf, cs, xx, i, statics), small_in, bufs_in, consts, x)
        d_sm, d_bf, d_cs, d_x = vjp((d_small, d_bufs, d_y))
        return (d_sm, d_bf, jax.tree.map(jnp.add, d_consts, d_cs)), d_x

    init = (d_small, d_bufs, jax.tree.map(jnp.zeros_like, consts))
    (d_small0, d_bufs0, d_consts), d_xs = jax.lax.scan(body, init, (smalls_in, xs, ids, d_ys), reverse=True)
    return d_small0, d_bufs0, d_consts, d_xs, None, None


buffered_scan.defvjp(_buffered_fwd, _buffered_bwd)


def _rows_below(buf, count, axis=0):
    """``buf`` with the rows ``>= count`` along ``axis`` zeroed (``count`` broadcasts over the
    leading dims)."""
    rows = jnp.arange(buf.shape[axis]).reshape(-1, *([1] * (buf.ndim - axis - 1)))
    count = jnp.reshape(count, (*jnp.shape(count), *([1] * (buf.ndim - jnp.ndim(count)))))
    return jnp.where(rows < count, buf, jnp.zeros_like(buf))


@dataclasses.dataclass(frozen=True)
class _Stage:
    """Runs one virtual stage's layers on a depth state (same program for every stage)."""

    plan: Plan
    mech: Any
    sublayer_fn: Any
    kind: str
    n_sublayers: int

    def run_layers(self, g, params, state, first_layer, ctx):
        mech, S, L = self.mech, self.plan.block_size, self.n_sublayers
        has_blocks = type(mech).end_block is not ResidualMechanism.end_block
        n = jax.tree.leaves(params["attn"])[0].shape[0]
        layer_ids = first_layer + jnp.arange(n, dtype=jnp.int32)

        def layer(carry, sources, g, inp, layer_id, ctx):
            attn_p, mlp_p, mech_p = inp
            state = DepthState(sources, carry)
            aux_losses = []
            for sub, (kind, sp) in enumerate((("attn", attn_p), (self.kind, mlp_p))):
                l = 2 * layer_id + sub + 1
                pos = position(l, S)
                p = jax.tree.map(lambda a: a[sub], mech_p)
                # Each sublayer is its own one-target block (as the depth stack's Full mode):
                # phase 1 of its one query over the completed summaries, then phase 2 with the
                # partial (docs/design.md §5), which equals the direct read and runs the Pallas
                # kernels where the implementation has them (``depth_read`` has none).
                b = mech.begin_block(g, jax.tree.map(lambda a: a[None], p), state, pos, ctx)
                h, aux = mech.read(g, p, state, None if b is None else b[0], pos, ctx)
                h = jax.ad_checkpoint.checkpoint_name(h, "sublayer_input")
                v, aux_loss = self.sublayer_fn(kind, sp, h, ctx)
                state = mech.write(g, p, state, v, aux, pos, ctx)
                if has_blocks:  # a block ends here (possibly in the middle of a stage)
                    ends = (pos.index_in_block == S - 1) | (l == L)
                    state = _select(ends, mech.end_block(g, state, pos), state)
                aux_losses.append(aux_loss)
            return state.carry, state.sources, jnp.stack(aux_losses)

        def restore(sources, layer_id, ctx):  # the summaries completed before layer_id
            return None if sources is None else _rows_below(sources, 1 + (2 * layer_id) // S)

        # The summary buffer is append-only: the backward keeps the stage's final buffer and
        # one carry per layer, and rematerialises each layer in reverse.
        xs = (params["attn"], params["mlp"], params["mech"])
        carry, sources, aux = buffered_scan(layer, restore, state.carry, state.sources, g, xs, layer_ids, ctx)
        return DepthState(sources, carry), jnp.sum(aux)

    def visit(self, s, i, hop_in, circ, cache, stage_params, g, e_all, ctx_all, prefix=None):
        """Stage ``s`` in iteration ``i``: returns (hop out, circ, cache, final hidden, aux loss).

        ``circ[k]`` (stage 0, circular): the hop the last stage sent for visit ``k`` (written
        once, in iteration ``k + stages``; read by visit ``k + M``). ``cache[mb]``: the
        summaries this stage holds for microbatch ``mb`` after its latest visit (rows past the
        newest completed summary are zero). Both are written so that ``restore_buffers``
        rebuilds them, at any iteration, from their final values."""
        plan, mech = self.plan, self.mech
        M, R, n_stages = plan.microbatches, plan.repeats, plan.stages
        k = i - s
        valid = (k >= 0) & (k < M * R)
        kc = jnp.clip(k, 0, M * R - 1)
        mb, r = kc % M, kc // M
        v = r * n_stages + s
        if circ is not None:  # stage 0 banks what the last stage sent round the ring
            kp = i - n_stages
            store = (s == 0) & (kp >= 0) & (kp < M * (R - 1))
            circ = _set(circ, jnp.clip(kp, 0, M * (R - 1) - 1), hop_in, store)
            hop_in = _select(s == 0, _index(circ, jnp.clip(kc - M, 0, M * (R - 1) - 1)), hop_in)
        e = _index(e_all, mb)
        ctx = SequenceContext(*_index(tuple(ctx_all), mb))
        fresh = v == 0
        start = mech.start(g, e, ctx)
        if prefix is not None:  # the state after the layers run before the pipeline
            pre = _index(prefix, mb)
            start = DepthState(None if start.sources is None else start.sources.at[: pre.sources.shape[0]].set(pre.sources),
                               pre.carry)
        sources = start.sources
        if plan.uses_sources:
            if cache is not None:
                sources = _index(cache, mb).at[0].set(e)
            if plan.window:
                sources = write_window(sources, hop_in["summaries"], plan_hi(plan, v))
            sources = jnp.where(fresh, start.sources, sources)
        carry = _select(fresh, start.carry, merge_carry(start.carry, hop_in["carry"]))
        state = DepthState(sources, carry)
        params = _index(stage_params, r)
        state, aux_loss = self.run_layers(g, params, state, plan.first_layer + v * plan.layers_per_stage, ctx)
        hop_out = {"carry": hop_carry(plan, state.carry)}
        if plan.uses_sources and plan.window:
            hop_out["summaries"] = read_window(state.sources, plan_hi(plan, v + 1), plan.window)
        if cache is not None:
            cache = _set(cache, mb, _rows_below(state.sources, plan_hi(plan, v + 1) + 1), valid)
        last = valid & (v == plan.virtual_stages - 1)
        final = jnp.where(last, mech.finish(g, state, ctx), 0)
        return hop_out, circ, cache, final, jnp.where(valid, aux_loss, 0.0)


def restore_buffers(plan: Plan, bufs: dict, i, s_ids) -> dict:
    """``_Stage.visit``'s buffers (final values, ``[local, ...]``) as they were when iteration
    ``i`` started, for the local stages ``s_ids``."""
    M, R, n_stages = plan.microbatches, plan.repeats, plan.stages
    out = dict(bufs)
    if bufs.get("circ") is not None:  # visits k < i - stages have been banked
        count = jnp.broadcast_to(jnp.clip(i - n_stages, 0, M * (R - 1)), s_ids.shape)
        out["circ"] = jax.tree.map(lambda a: _rows_below(a, count, axis=1), bufs["circ"])
    if bufs.get("cache") is not None:  # after visit r of (s, mb), in iteration s + mb + r M
        mb = jnp.arange(M, dtype=jnp.int32)
        r_last = jnp.minimum((i - s_ids[:, None] - mb[None, :] - 1) // M, R - 1)  # [local, M]
        count = jnp.where(r_last >= 0, plan_hi(plan, r_last * n_stages + s_ids[:, None] + 1) + 1, 0)
        out["cache"] = _rows_below(bufs["cache"], count, axis=2)
    return out


def plan_hi(plan: Plan, v):
    return (2 * (plan.first_layer + plan.layers_per_stage * v)) // plan.block_size


def run_pipeline(plan: Plan, mech, sublayer_fn, kind, g, stage_params, e_mb, ctx_mb, mesh, prefix=None):
    """The pipelined depth stack: ``e_mb[M, mb, T, d]`` -> (final hidden ``[M, mb, T, d]``,
    summed aux loss). ``stage_params`` leaves are ``[repeats, stages, Lps, ...]``. ``prefix``
    (with ``plan.first_layer``): the ``DepthState`` after the leading layers, per microbatch
    (``[M, ...]``; its sources hold only the summaries completed so far)."""
    degree = mesh.shape[AXIS]
    local = plan.stages // degree
    perm = [(j, (j + 1) % degree) for j in range(degree)]
    stage = _Stage(plan, mech, sublayer_fn, kind, 2 * plan.n_layers)

    def shift(x):  # the last local stage's output goes to the next device's first stage
        moved = jax.lax.ppermute(x[local - 1:], AXIS, perm)
        return moved if local == 1 else jnp.concatenate([moved, x[: local - 1]], axis=0)

    def body(stage_params, g, e_mb, ctx_mb, prefix):
        stage_params = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), stage_params)  # [local, R, Lps, ...]
        s_ids = jax.lax.axis_index(AXIS) * local + jnp.arange(local, dtype=jnp.int32)
        ctx0 = SequenceContext(*_index(tuple(ctx_mb), 0))
        template = stage_hop_template(plan, mech, g, e_mb[0], ctx0)
        zeros = lambda tree, lead: jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), tree)  # noqa: E731
        hop0 = zeros(template, (local,))
        bufs0 = {"circ": zeros(template, (local, plan.microbatches * (plan.repeats - 1))) if plan.repeats > 1 else None,
                 "cache": (jnp.zeros((local, plan.microbatches, plan.n_sources, *e_mb.shape[1:]), e_mb.dtype)
                           if plan.caching else None)}

        def iteration(hop, bufs, consts, _, i, statics):
            stage_params, g, e_mb, prefix = consts
            ctx_mb, s_ids = statics
            visit = jax.vmap(stage.visit, in_axes=(0, None, 0, 0, 0, 0, None, None, None, None))
            hop, circ, cache, final, aux = visit(s_ids, i, hop, bufs["circ"], bufs["cache"],
                                                 stage_params, g, e_mb, ctx_mb, prefix)
            hop = jax.tree.map(shift, hop)
            return hop, {"circ": circ, "cache": cache}, (jnp.sum(final, axis=0), jnp.sum(aux))

        def restore(bufs, i, statics):
            return restore_buffers(plan, bufs, i, statics[1])

        # The per-microbatch buffers are rebuilt from their final values in the backward: per
        # iteration only the hop is saved (memory linear in depth and in microbatches).
        _, _, (finals, aux) = buffered_scan(iteration, restore, hop0, bufs0, (stage_params, g, e_mb, prefix), None,
                                            jnp.arange(plan.iterations, dtype=jnp.int32), (ctx_mb, s_ids))
        finals = finals[(plan.repeats - 1) * plan.microbatches + plan.stages - 1:]
        # One row per device, summed over ``stage`` outside (below): the sum's transpose hands
        # each device its cotangent with no collective (a ``psum`` here, unchecked, would
        # transpose to a second all-reduce of the final hidden).
        return finals[None], jnp.sum(aux)[None]

    stage_spec = jax.tree.map(lambda _: P(None, AXIS), stage_params)
    rep = lambda tree: jax.tree.map(lambda _: P(), tree)  # noqa: E731
    # ``check_vma=False``: the Pallas depth-read kernels (``kernel_sharding``) type their outputs
    # and their ``custom_vjp`` cotangents as varying over no axis, which a checked body refuses
    # (docs/parallelism.md, "The depth-read kernels under a mesh"). Unchecked is exact here:
    # every replicated input (``P()``) gets its cotangent summed over ``stage`` once, by the
    # transpose of this ``shard_map``; ``ppermute`` transposes to the reverse permutation; the
    # outputs are per device (``P(stage)``) and reduced outside.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(stage_spec, rep(g), P(), rep(tuple(ctx_mb)), rep(prefix)),
                       out_specs=(P(AXIS), P(AXIS)), axis_names={AXIS}, check_vma=False)
    finals, aux = fn(stage_params, g, e_mb, tuple(ctx_mb), prefix)
    # Only the last stage's rows are non-zero, so a float32 sum is exact; it also avoids an XLA
    # CPU compiler crash on bfloat16 all-reduces ("Invalid binary opcode copy").
    return jnp.sum(finals.astype(jnp.float32), axis=0).astype(finals.dtype), jnp.sum(aux)


def stage_hop_template(plan, mech, g, e, ctx):
    start = mech.start(g, e, ctx)
    hop = {"carry": hop_carry(plan, start.carry)}
    if plan.uses_sources and plan.window:
        hop["summaries"] = jnp.zeros((plan.window, *e.shape), e.dtype)
    return hop


# --------------------------------------------------------------------------------------
# The pipelined model and train step.
# --------------------------------------------------------------------------------------


def _to_microbatches(x, M):
    """``[B, ...] -> [M, B/M, ...]``; microbatch m holds rows m, m + M, ... (a contiguous
    data-parallel shard of the batch keeps rows of every microbatch)."""
    return jnp.swapaxes(x.reshape(x.shape[0] // M, M, *x.shape[1:]), 0, 1)


def _from_microbatches(x):
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def stage_params(model, plan: Plan) -> tuple[dict, dict, str, dict | None]:
    """(global mechanism params, stage-stacked params ``[R, stages, Lps, ...]``, their MLP
    kind, the leading layers' params ``[first_layer, ...]`` or ``None``)."""
    R, S_p, Lps, K = plan.repeats, plan.stages, plan.layers_per_stage, plan.first_layer
    kind = layer_kinds(model.cfg)[-1]
    mlp = model.dense if kind == "dense" else model.moe
    g, per_sub = model.residual.split_params(pure(model.residual))
    per_layer = jax.tree.map(lambda a: a.reshape(plan.n_layers, 2, *a.shape[1:]), per_sub)
    attn = pure(model.attn)
    lead = None
    if K:  # the leading dense layers: model.dense holds exactly them, model.moe the rest
        lead = {"attn": jax.tree.map(lambda a: a[:K], attn), "mlp": pure(model.dense),
                "mech": jax.tree.map(lambda a: a[:K], per_layer)}
        attn, per_layer = jax.tree.map(lambda a: a[K:], (attn, per_layer))
    stacked = {"attn": attn, "mlp": pure(mlp), "mech": per_layer}
    stacked = jax.tree.map(lambda a: a.reshape(R, S_p, Lps, *a.shape[1:]), stacked)
    stacked = jax.tree.map(lambda a: constrain(a, (None, "stage", *([None] * (a.ndim - 2)))), stacked)
    return g, stacked, kind, lead


def pipelined_forward(model, tokens, plan: Plan, mesh, segment_ids=None, positions=None):
    """Logits ``[B, T, V]`` and ``{"aux_loss"}``, like ``Transformer.__call__``, with the
    depth stack run as the pipeline."""
    cfg = model.cfg
    dtype = jnp.dtype(cfg.dtype)
    b, t = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    e = constrain(jnp.take(model.embedding[...], tokens, axis=0).astype(dtype), layers.ACT)
    M = plan.microbatches
    e_mb = _to_microbatches(e, M)
    ctx_mb = SequenceContext(_to_microbatches(positions, M),
                             None if segment_ids is None else _to_microbatches(segment_ids, M))
    g, stacked, kind, lead = stage_params(model, plan)
    prefix, lead_aux = None, 0.0
    if lead is not None:  # the leading dense layers, on the whole batch, before the pipeline
        mech = model.residual
        ctx = SequenceContext(positions, segment_ids)
        runner = _Stage(plan, mech, model._sublayer, "dense", 2 * plan.n_layers)
        state, lead_aux = runner.run_layers(g, lead, mech.start(g, e, ctx), 0, ctx)
        if state.sources is not None:  # only the summaries completed so far travel
            state = DepthState(state.sources[: plan_hi(plan, 0) + 1], state.carry)
        prefix = DepthState(None if state.sources is None else jax.vmap(_to_microbatches, (0, None), 1)(state.sources, M),
                            jax.tree.map(lambda a: _to_microbatches(a, M), state.carry))
    final, aux_loss = run_pipeline(plan, model.residual, model._sublayer, kind, g, stacked, e_mb, ctx_mb, mesh,
                                   prefix)
    # The MoE load-balance loss is a function of the batch a layer routes: the pipeline gets
    # it per microbatch and averages (as gradient accumulation would); the leading layers
    # run on the whole batch.
    aux_loss = aux_loss / M + lead_aux
    hidden = constrain(_from_microbatches(final), layers.ACT)
    x = layers.rms_norm(hidden, model.final_norm[...], cfg.norm_eps)
    head = model.embedding[...].T if model.lm_head is None else model.lm_head[...]
    logits = jnp.einsum("btd,dv->btv", x, head.astype(dtype), preferred_element_type=jnp.float32)
    aux = {"aux_loss": cfg.moe.aux_loss_weight * aux_loss if cfg.moe.enabled else 0.0}
    return logits, aux


def pipelined_lm_loss(plan: Plan, mesh):
    """``loss(model, batch[B, T+1]) -> (loss, parts)`` through the pipeline (cf. ``lm_loss``)."""

    def loss(model, batch, segment_ids=None):
        seg = None if segment_ids is None else segment_ids[:, :-1]
        logits, aux = pipelined_forward(model, batch[:, :-1], plan, mesh, segment_ids=seg)
        ce = cross_entropy(logits, batch[:, 1:])
        return ce + aux["aux_loss"], {"cross_entropy": ce, "aux_loss": aux["aux_loss"]}

    return loss


def train_step_fn(model_def, tx, schedule, pcfg, mesh, model_cfg, grad_accum: int = 1):
    """The unjitted train step (``msar_jax.train.step``) with the pipelined loss when
    ``pcfg.pipeline.stages > 1``. ``grad_accum > 1`` is refused with a pipeline: the
    pipeline already splits the batch (``parallel.pipeline.microbatches``)."""
    from msar_jax.train.step import make_train_step

    loss = None
    if pcfg is not None and pcfg.pipeline.stages > 1:
        if grad_accum != 1:
            raise ValueError(f"train.grad_accum = {grad_accum} with a {pcfg.pipeline.stages}-stage pipeline: "
                             "must be 1; set parallel.pipeline.microbatches instead")
        loss = pipelined_lm_loss(make_plan(pcfg, model_cfg), mesh)
    return make_train_step(model_def, tx, schedule, loss=loss, grad_accum=grad_accum).__wrapped__


# --------------------------------------------------------------------------------------
# Reading hops back from compiled HLO.
# --------------------------------------------------------------------------------------

_HLO_SHAPE = r"\b(f32|bf16|f16|f64|s32|u32|pred)\[([0-9,]*)\]"
_HLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}


def collective_permutes(hlo: str) -> list[dict]:
    """Every collective-permute of compiled HLO text: ``{"shapes": [(dtype, shape), ...],
    "pairs": source_target_pairs, "op_name": the jax op it came from}``. Its result shapes
    equal its operand shapes (an asynchronous ``-start`` op is read from its result tuple)."""
    import re

    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s+collective-permute(-start)?\(", line)
        if m is None:
            continue
        shapes = [(t, tuple(int(x) for x in dims.split(",") if x)) for t, dims in re.findall(_HLO_SHAPE, m.group(1))]
        if m.group(2):  # start ops return (operand, result, ...): keep the operand
            shapes = shapes[:1]
        pairs = re.search(r"source_target_pairs=(\{[0-9{},]*\})", line)
        name = re.search(r'op_name="([^"]*)"', line)
        out.append({"shapes": shapes, "pairs": pairs.group(1) if pairs else "",
                    "op_name": name.group(1) if name else ""})
    return out


def hlo_hop_bytes(hlo: str) -> list[int]:
    """Bytes per device of each hop in compiled HLO: the collective-permutes of one
    ``ppermute`` of the hop pytree (same jax op, same direction) summed; the forward hop and
    its transpose in the backward pass are separate entries."""
    groups: dict = {}
    for op in collective_permutes(hlo):
        key = (op["op_name"], op["pairs"])
        groups[key] = groups.get(key, 0) + sum(_HLO_BYTES[t] * math.prod(s) for t, s in op["shapes"])
    return list(groups.values())


_MLIR_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "ui32": 4, "i1": 1}


def lowered_hop_bytes(stablehlo: str) -> list[int]:
    """Bytes per device of each ``stablehlo.collective_permute`` of a *lowered* program, in
    the program's own dtypes (a backend may widen them when compiling: XLA:CPU sends bf16
    collective-permutes as f32)."""
    import re

    out = []
    for line in stablehlo.splitlines():
        if "stablehlo.collective_permute" not in line:
            continue
        m = re.search(r":\s*\(tensor<([0-9x]*)x?([a-z0-9]+)>\)\s*->", line)
        if m:
            dims = [int(x) for x in m.group(1).split("x") if x]
            out.append(_MLIR_BYTES[m.group(2)] * math.prod(dims))
    return out
