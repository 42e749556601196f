"""The depth stack: an outer scan over blocks and an unrolled loop over each block's layers.

``DepthStack`` runs the L sublayers under any residual mechanism through its protocol
(``msar_jax.residuals.base``). The outer ``lax.scan`` runs over units (one block of ``S/2`` layers,
or one layer in Full mode), whose layers are unrolled; ``_append_only_scan`` keeps one copy of the
append-only summary buffer for the backward, so memory is linear in depth, and re-runs one layer
at a time there (``_UnitFn.backward``), so it holds one layer's residuals; ``save_read_outputs`` lets the backward's re-run reuse each read's output (``_reuse_saved``).
``prefill`` (the same forward, recording what decoding keeps) and ``decode`` (one token against a
cache) serve inference (docs/design.md §10). Design and reasons: docs/design.md §12.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from msar_jax.model.layers import SequenceContext
from msar_jax.residuals.base import DepthState, ResidualMechanism, position

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_layer_inputs": jax.checkpoint_policies.save_only_these_names("sublayer_input"),
}


@dataclasses.dataclass(frozen=True)
class Unit:
    """A run of consecutive transformer layers [first_layer, first_layer + len(kinds))."""

    index: int
    first_layer: int
    kinds: tuple[str, ...]  # MLP kind of each layer ("dense" or "moe")

    def signature(self):
        return self.kinds


def plan_units(layer_kinds: tuple[str, ...], block_size: int) -> list[Unit]:
    """Split the layers into scan units (one block, or one layer in Full mode)."""
    per_unit = 1 if block_size == 1 else block_size // 2
    units = []
    for u, start in enumerate(range(0, len(layer_kinds), per_unit)):
        units.append(Unit(u, start, tuple(layer_kinds[start : start + per_unit])))
    return units


def group_units(units: list[Unit]) -> list[list[Unit]]:
    """Consecutive units with identical layer kinds form one homogeneous scan."""
    groups: list[list[Unit]] = []
    for unit in units:
        if groups and groups[-1][-1].signature() == unit.signature():
            groups[-1].append(unit)
        else:
            groups.append([unit])
    return groups


def _segments(kinds: tuple[str, ...]) -> tuple[tuple[str, int, int], ...]:
    """Runs of equal kinds inside a unit: (kind, offset, count)."""
    out = []
    for i, k in enumerate(kinds):
        if out and out[-1][0] == k:
            out[-1] = (k, out[-1][1], out[-1][2] + 1)
        else:
            out.append((k, i, 1))
    return tuple(out)


def _take(stack, index: np.ndarray):
    """Rows ``index`` (any shape) of every leaf of ``stack``; a reshape when contiguous."""
    flat = index.reshape(-1)
    if flat.size and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
        sl = slice(int(flat[0]), int(flat[0]) + flat.size)
        return jax.tree.map(lambda a: a[sl].reshape(*index.shape, *a.shape[1:]), stack)
    return jax.tree.map(lambda a: jnp.take(a, jnp.asarray(index), axis=0), stack)


# --------------------------------------------------------------------------------------
# The append-only scan (linear memory in depth).
# --------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _append_only_scan(unit_fn, valid_count, state0, xs, consts, ctx, unit_ids):
    def body(state, inp):
        x, u = inp
        new_state, y, _ = unit_fn(state, x, consts, ctx, u)
        return new_state, y

    return jax.lax.scan(body, state0, (xs, unit_ids))


def _append_only_fwd(unit_fn, valid_count, state0, xs, consts, ctx, unit_ids):
    start_carry = unit_fn.block_start_carry

    def body(state, inp):
        x, u = inp
        new_state, y, kept, layer_carries = unit_fn(state, x, consts, ctx, u, layer_carries=True)
        return new_state, (y, None if start_carry is not None else state.carry, kept, layer_carries)

    final, (ys, carries_in, kept, layer_carries) = jax.lax.scan(body, state0, (xs, unit_ids))
    # Only the final buffer is kept: every earlier buffer is a masked prefix of it. The
    # carry entering each unit is kept only when it is not known in advance; ``kept`` holds
    # the read outputs (``DepthStack.save_read_outputs``), None otherwise; ``layer_carries``
    # the carry entering each of a unit's later layers, for the backward's walk layer by layer.
    return (final, ys), (final.sources, carries_in, layer_carries, xs, consts, ctx, unit_ids, state0.carry, kept)


def _append_only_bwd(unit_fn, valid_count, res, cotangents):
    sources_final, carries_in, layer_carries, xs, consts, ctx, unit_ids, carry0, kept = res
    if unit_fn.block_start_carry is not None:
        n_units = unit_ids.shape[0]
        known = unit_fn.block_start_carry(carry0)
        carries_in = jax.tree.map(lambda a: jnp.broadcast_to(a, (n_units, *a.shape)), known)
    d_final, d_ys = cotangents
    rows = jnp.arange(sources_final.shape[0]).reshape(-1, *([1] * (sources_final.ndim - 1)))

    def body(acc, inp):
        d_sources, d_carry, d_consts = acc
        carry_in, carries_u, x, u, d_y, kept_u = inp
        # The buffer as it was when unit u started: entries written later are zeroed.
        sources_in = jnp.where(rows < valid_count(u), sources_final, jnp.zeros_like(sources_final))
        d_state, d_x, d_c = unit_fn.backward(DepthState(sources_in, carry_in), carries_u, x, consts, ctx, u, kept_u,
                                             DepthState(d_sources, d_carry), d_y)
        d_consts = jax.tree.map(jnp.add, d_consts, d_c)
        return (d_state.sources, d_state.carry, d_consts), d_x

    init = (d_final.sources, d_final.carry, jax.tree.map(jnp.zeros_like, consts))
    (d_sources0, d_carry0, d_consts), d_xs = jax.lax.scan(
        body, init, (carries_in, layer_carries, xs, unit_ids, d_ys, kept), reverse=True
    )
    return DepthState(d_sources0, d_carry0), d_xs, d_consts, None, None


_append_only_scan.defvjp(_append_only_fwd, _append_only_bwd)


def _float0_like(a):
    return np.zeros(a.shape, jax.dtypes.float0)


class _UnitFn:
    """One unit of the depth stack (``DepthStack._unit``), callable as a whole, plus the
    backward of the append-only scan: a walk over the unit's layers in reverse.

    The walk re-runs one layer at a time under ``jax.vjp``, from the carry that entered it in
    the forward pass (``layer_carries``), so the backward holds one layer's residuals (at
    `base`, the attention's [B, H, T, T] scores and weights, about 8 GiB) instead of the whole
    unit's, and still runs each sublayer's forward once more, as a re-run of the whole unit
    did (docs/design.md §12)."""

    def __init__(self, stack: "DepthStack", segments, *, collect_weights: bool, keep: bool, record=None):
        self.stack, self.segments = stack, segments
        self.collect_weights, self.keep, self.record = collect_weights, keep, record
        mechanism = stack.mechanism
        probe = mechanism.block_start_carry
        self.block_start_carry = None if type(mechanism).block_start_carry is ResidualMechanism.block_start_carry else probe
        self.n_layers = sum(cnt for _, _, cnt in segments)

    def __call__(self, state, x, g, ctx, u, known=None, layer_carries=False):
        return self.stack._unit(state, x, g, ctx, u, known, segments=self.segments, collect_weights=self.collect_weights,
                                keep=self.keep, record=self.record, layer_carries=layer_carries)

    def restored_carry(self, stored, template):
        """A carry ``_stored_carry`` kept, with the leaves it left out as zeros (``template``'s)."""
        drop = self.stack.mechanism.sublayer_written_carry
        if drop and isinstance(template, dict):
            return {k: stored[k] if k in stored else jnp.zeros_like(template[k]) for k in template}
        return stored

    def backward(self, state_in, carries_u, x, g, ctx, u, kept_u, d_state_out, d_y):
        """Cotangents ``(d_state_in, d_x, d_g)`` of one unit, given those of its outputs."""
        stack, segments, P = self.stack, self.segments, self.n_layers
        full_mode = stack.mechanism.block_size == 1
        bctx = None
        if not full_mode:
            bctx, pull_begin = jax.vjp(lambda st, mech_x, cc: stack.mechanism.cut_rerouted_cotangents(
                stack._unit_begin(st, x["layer"], mech_x, cc, ctx)), state_in, x["mech"], g)
        d_state = d_state_out
        d_g = jax.tree.map(jnp.zeros_like, g)
        d_rows = [None] * P
        d_bctx = [None] * (2 * P)
        for k in reversed(range(P)):
            carry_k = state_in.carry if k == 0 else self.restored_carry(
                jax.tree.map(lambda a: a[k - 1], carries_u), state_in.carry)
            kind, row_x = _layer_row(x, segments, k)
            b_k = None if bctx is None else tuple(bctx[2 * k : 2 * k + 2])
            known_k = None if kept_u is None else kept_u[2 * k : 2 * k + 2]

            def layer(st, xk, cc, b, k=k, kind=kind):
                st, y, _ = stack._unit_layer(st, (*xk, x["layer"][k : k + 1]), cc, ctx, b, known_k, kind=kind, row=0,
                                             collect_weights=self.collect_weights, record=None)
                if k == P - 1 and not full_mode:
                    st = stack._unit_end(st, x["layer"], cc)
                return st, y

            # Tie the layer's inputs to the cotangent the layer above produced: the re-run
            # depends on nothing computed in this backward otherwise, and XLA's scheduler then
            # ran every layer's re-run first and held all their residuals at once (`base`
            # AttnRes: 44.5 GiB of temporaries against 42.2 for a re-run of the whole unit).
            (carry_k, row_x, b_k), d_state = jax.lax.optimization_barrier(((carry_k, row_x, b_k), d_state))
            _, pull = jax.vjp(layer, DepthState(state_in.sources, carry_k), row_x, g, b_k)
            d_state, d_rows[k], d_gk, d_b = pull((d_state, jax.tree.map(lambda a: a[k], d_y)))
            d_g = jax.tree.map(jnp.add, d_g, d_gk)
            if b_k is not None:
                d_bctx[2 * k : 2 * k + 2] = d_b
        d_mech = jax.tree.map(lambda *a: jnp.concatenate(a), *[r[2] for r in d_rows])
        if bctx is not None:
            d_st_b, d_mech_b, d_g_b = pull_begin(d_bctx if isinstance(bctx, list) else type(bctx)(d_bctx))
            d_state = DepthState(d_state.sources + d_st_b.sources, jax.tree.map(jnp.add, d_state.carry, d_st_b.carry))
            d_mech = jax.tree.map(jnp.add, d_mech, d_mech_b)
            d_g = jax.tree.map(jnp.add, d_g, d_g_b)
        d_x = {
            "mech": d_mech,
            "attn": jax.tree.map(lambda *a: jnp.concatenate(a), *[r[0] for r in d_rows]),
            "mlp": tuple(jax.tree.map(lambda *a: jnp.concatenate(a), *[d_rows[k][1] for k in range(off, off + cnt)])
                         for _, off, cnt in segments),
            "layer": _float0_like(x["layer"]),
        }
        return d_state, d_x, d_g


def _stored_carry(mechanism, carry):
    """``carry`` without the leaves every sublayer writes before reading them
    (``ResidualMechanism.sublayer_written_carry``): their incoming value never matters."""
    drop = mechanism.sublayer_written_carry
    if drop and isinstance(carry, dict):
        return {k: v for k, v in carry.items() if k not in drop}
    return carry


def _layer_row(x, segments, k):
    """Layer ``k`` of a unit's stacked inputs ``x``: its MLP kind and ``(attention, MLP,
    mechanism)`` parameters, each with a leading axis of 1."""
    for seg_i, (kind, off, cnt) in enumerate(segments):
        if off <= k < off + cnt:
            one = lambda a, r: a[r : r + 1]  # noqa: E731
            return kind, (jax.tree.map(lambda a: one(a, k), x["attn"]),
                          jax.tree.map(lambda a: one(a, k - off), x["mlp"][seg_i]),
                          jax.tree.map(lambda a: one(a, k), x["mech"]))
    raise ValueError(f"layer {k} is in no segment of {segments}")


def _remat_scan(unit_fn, state0, xs, consts, ctx, unit_ids, policy=None):
    @functools.partial(jax.checkpoint, policy=policy)
    def body(state, inp):
        x, u = inp
        return unit_fn(state, x, consts, ctx, u)[:2]

    return jax.lax.scan(body, state0, (xs, unit_ids))


@jax.custom_vjp
def _reuse_saved(recomputed, saved):
    """``saved`` as the value, ``recomputed``'s gradient path: in a unit's rematerialisation
    the read's output comes from the forward pass, while its cotangent still flows back
    through the re-run read's VJP (which keeps only the read's inputs, so the re-run read's
    forward work is dead code and XLA drops it)."""
    del recomputed
    return saved


def _reuse_saved_fwd(recomputed, saved):
    del recomputed
    return saved, None


def _reuse_saved_bwd(_, ct):
    return ct, None


_reuse_saved.defvjp(_reuse_saved_fwd, _reuse_saved_bwd)


# --------------------------------------------------------------------------------------
# The stack.
# --------------------------------------------------------------------------------------

SublayerFn = Callable[[str, Any, jax.Array, SequenceContext], tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class DepthStack:
    """Runs L sublayers under a residual mechanism.

    ``sublayer_fn(kind, params, h, ctx) -> (v, aux_loss)`` applies one sublayer
    ``f_l`` (kind ``"attn"``, ``"dense"`` or ``"moe"``) to its input ``h``.
    """

    mechanism: ResidualMechanism
    sublayer_fn: SublayerFn
    layer_kinds: tuple[str, ...]
    remat_policy: str = "none"
    # False: a plain rematerialised scan over units (saves the buffer per unit: quadratic
    # memory in depth). Kept as the reference the append-only scan is tested against.
    memory_lean: bool = True
    # True: each sublayer's input h_l (the read's output, [B, T, d]) is saved in the forward
    # pass, and the block's rematerialisation in the backward reuses it instead of running the
    # read's forward again (the read's backward still runs). Costs L activations of [B, T, d].
    save_read_outputs: bool = False

    def __call__(self, mech_params: dict, layer_params: dict, e: jax.Array, ctx: SequenceContext, collect_weights=False):
        """Returns ``(final_hidden, per_sublayer)``; ``per_sublayer["aux_loss"]`` is ``[L]``
        and, with ``collect_weights``, ``per_sublayer["depth_weights"]`` holds each read's
        token-averaged depth weights ``[L, sources, streams]``."""
        mech = self.mechanism
        g, per_sub = mech.split_params(mech_params)
        n_layers = len(self.layer_kinds)
        # Per-sublayer mechanism parameters as [n_layers, 2, ...] (attention, MLP).
        per_layer = jax.tree.map(lambda a: a.reshape(n_layers, 2, *a.shape[1:]), per_sub)
        state = mech.start(g, e, ctx)
        ys_all = []
        for group in group_units(plan_units(self.layer_kinds, mech.block_size)):
            state, ys = self._run_group(group, g, per_layer, layer_params, state, ctx, collect_weights)
            ys_all.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), ys))  # [units*layers*2, ...]
        per_sublayer = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *ys_all)
        return mech.finish(g, state, ctx), per_sublayer

    # ----- one homogeneous group of units -----
    def _run_group(self, group, g, per_layer, layer_params, state, ctx, collect_weights, record=None):
        mech = self.mechanism
        kinds = group[0].kinds
        segments = _segments(kinds)
        first = np.array([u.first_layer for u in group])
        layer_idx = first[:, None] + np.arange(len(kinds))[None, :]  # [U, P]
        kind_offset = {k: self.layer_kinds.index(k) for k in set(self.layer_kinds)}
        xs = {
            "mech": _take(per_layer, layer_idx),
            "attn": _take(layer_params["attn"], layer_idx),
            "mlp": tuple(
                _take(layer_params[k], layer_idx[:, off : off + cnt] - kind_offset[k]) for k, off, cnt in segments
            ),
            "layer": jnp.asarray(layer_idx, jnp.int32),
        }
        unit_ids = jnp.asarray([u.index for u in group], jnp.int32)
        S = mech.block_size
        blocks_per_unit = 2 if S == 1 else 1
        unit_fn = _UnitFn(self, segments, collect_weights=collect_weights,
                          keep=self.save_read_outputs and record is None, record=record)
        if record is not None:  # a prefill: the forward alone, no backward to prepare for
            return jax.lax.scan(lambda st, inp: unit_fn(st, inp[0], g, ctx, inp[1])[:2], state, (xs, unit_ids))
        if state.sources is None or not self.memory_lean:
            policy = jax.checkpoint_policies.save_only_these_names("sublayer_input") if self.save_read_outputs else None
            return _remat_scan(unit_fn, state, xs, g, ctx, unit_ids, policy)
        valid_count = lambda u: 1 + u * blocks_per_unit  # noqa: E731  (buffer entries filled at unit start)
        return _append_only_scan(unit_fn, valid_count, state, xs, g, ctx, unit_ids)

    def _unit(self, state, x, g, ctx, u, known=None, *, segments, collect_weights, keep, record=None,
              layer_carries=False):
        """One unit: phase 1 for the block (S even), then its layers, unrolled.

        Returns ``(state, ys, kept)``: ``kept`` is the unit's read outputs ``[2P, B, T, d]``
        with ``keep`` (else None); ``known``, the same array from the forward pass, makes
        the reads' outputs come from it (``_reuse_saved``). With ``layer_carries``, also the
        carry entering each layer after the first (``_UnitFn.stored_carry``, stacked ``[P - 1,
        ...]``, None for one layer), which the backward's walk starts each layer from."""
        full_mode = self.mechanism.block_size == 1
        bctx = None if full_mode else self._unit_begin(state, x["layer"], x["mech"], g, ctx)
        ys, kept, carries = [], [], []
        for seg_i, (kind, off, cnt) in enumerate(segments):
            sl = lambda a: a[off : off + cnt]  # noqa: E731
            inner_xs = (
                jax.tree.map(sl, x["attn"]),
                x["mlp"][seg_i],
                jax.tree.map(sl, x["mech"]),
                x["layer"][off : off + cnt],
            )
            # A Python loop, not a scan: a unit has only S/2 layers, and differentiating a scan
            # stacks every layer's residuals (the attention probabilities, [B, H, T, T]) into
            # [P, ...] buffers with a dynamic-update-slice, a transposed copy and a zeroed
            # cotangent per layer. On the H200 that bookkeeping was ~0.5 s of the `base` step
            # (docs/kernels.md); unrolled, each layer's residuals stay where
            # its forward wrote them. Each layer takes the whole stacked inputs and picks its row
            # inside (``row``), so a rematerialised layer keeps a reference to the shared
            # arrays, not a sliced copy of its own; the block context comes per target
            # (layer j of the unit reads targets 2j and 2j + 1), each its own array.
            for i in range(cnt):
                j = 2 * (off + i)
                if off + i > 0:
                    carries.append(state.carry)
                known_hs = None if known is None else known[j : j + 2]
                state, y, hs = self._unit_layer(state, inner_xs, g, ctx, None if bctx is None else tuple(bctx[j : j + 2]),
                                                known_hs, kind=kind, row=i, collect_weights=collect_weights, record=record)
                ys.append(y)
                kept.extend(hs)
        if not full_mode:
            state = self._unit_end(state, x["layer"], g)
        ys = jax.tree.map(lambda *a: jnp.stack(a), *ys)
        out = (state, ys, jnp.stack(kept) if keep else None)
        if layer_carries:
            stored = [_stored_carry(self.mechanism, c) for c in carries]
            out += (jax.tree.map(lambda *a: jnp.stack(a), *stored) if stored else None,)
        return out

    def _unit_begin(self, state, layer_ids, mech_x, g, ctx):
        """Phase 1 of the unit's block (``mechanism.begin_block``): one context per target."""
        first_l = 2 * layer_ids[0] + 1
        p_block = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), mech_x)  # [2P, ...]
        with jax.named_scope("depth_begin_block"):
            return self.mechanism.begin_block(g, p_block, state, position(first_l, self.mechanism.block_size), ctx)

    def _unit_end(self, state, layer_ids, g):
        last_l = 2 * layer_ids[-1] + 2
        with jax.named_scope("depth_end_block"):
            return self.mechanism.end_block(g, state, position(last_l, self.mechanism.block_size))

    def _unit_layer(self, state, inner_xs, g, ctx, bctx, known_hs, *, kind, row, collect_weights, record):
        """Layer ``row`` of the stacked ``inner_xs`` (``_layer``), under the remat policy."""
        step = functools.partial(self._layer, g=g, ctx=ctx, kind=kind, collect_weights=collect_weights, row=row,
                                 record=record)
        if self.remat_policy != "none":
            step = jax.checkpoint(step, policy=REMAT_POLICIES[self.remat_policy])
        return step(state, inner_xs, bctx, known_hs)

    def _layer(self, state, inp, bctx, known_hs, *, g, ctx, kind, collect_weights, row, record=None):
        """One transformer layer (row ``row`` of the stacked ``inp``): the attention sublayer,
        then the MLP sublayer; ``bctx``: the block contexts of its two targets, or None;
        ``known_hs``: its two sublayer inputs from the forward pass, or None; ``record``: a
        prefill's ``PrefillRecord``, or None. Returns ``(state, y, (h_attn, h_mlp))``."""
        attn_p, mlp_p, mech_p, layer = jax.tree.map(lambda a: a[row], inp)
        mech = self.mechanism
        S = mech.block_size
        aux_losses, weights, hs, cached, history = [], [], [], [], []
        for sub, (sub_kind, params) in enumerate((("attn", attn_p), (kind, mlp_p))):
            pos = position(2 * layer + sub + 1, S)
            p = jax.tree.map(lambda a: a[sub], mech_p)
            b = None if bctx is None else bctx[sub]
            # The named scopes label the profile (benchmarks/profile_step.py); no numeric effect.
            with jax.named_scope("depth_read"):
                if S == 1:
                    b = mech.begin_block(g, jax.tree.map(lambda a: a[None], p), state, pos, ctx)
                    b = None if b is None else b[0]  # the one target of the block
                h, aux = mech.read(g, p, state, b, pos, ctx, want_weights=collect_weights)
                if known_hs is not None:
                    h = _reuse_saved(h, known_hs[sub])
            hs.append(h)
            h = jax.ad_checkpoint.checkpoint_name(h, "sublayer_input")
            if record is not None:
                source = mech.history_source(g, state, pos)
                if source is not None:
                    history.append(record.window(source))
            with jax.named_scope(f"sublayer_{sub_kind}"):
                if record is None:
                    v, aux_loss = self.sublayer_fn(sub_kind, params, h, ctx)
                else:
                    v, aux_loss, entry = record.sublayer_fn(sub_kind, params, h, ctx)
                    cached.append(entry)
            with jax.named_scope("depth_write"):
                state = mech.write(g, p, state, v, aux, pos, ctx)
                if S == 1:
                    state = mech.end_block(g, state, pos)
            aux_losses.append(aux_loss)
            if collect_weights and isinstance(aux, dict) and aux.get("weights") is not None:
                weights.append(aux["weights"])
        y = {"aux_loss": jnp.stack(aux_losses)}
        if weights:
            y["depth_weights"] = jnp.stack(weights)
        if record is not None:
            y["layer_cache"] = cached[0]  # the attention sublayer's; the MLP caches nothing
            if history:
                y["history"] = jnp.stack(history)  # [2, B, W, d]
        return state, y, tuple(hs)

    # ----- inference: a prefill, and one-token decoding steps (docs/design.md §10) -----
    def prefill(self, mech_params: dict, layer_params: dict, e: jax.Array, ctx: SequenceContext,
                record: "PrefillRecord"):
        """The forward pass of ``__call__`` (the same units, block reads and kernels) that also
        returns what decoding keeps: ``(final_hidden, layer_cache, history)``. ``layer_cache`` is
        each layer's ``record.sublayer_fn`` entry of its attention sublayer, stacked ``[n_layers,
        ...]``; ``history`` is ``[L, B, W, d]``, slot ``l - 1`` the window ``record.window`` cuts
        from the source ``mechanism.history_source`` names at sublayer ``l`` (None when the
        mechanism keeps no history)."""
        mech = self.mechanism
        g, per_sub = mech.split_params(mech_params)
        n_layers = len(self.layer_kinds)
        per_layer = jax.tree.map(lambda a: a.reshape(n_layers, 2, *a.shape[1:]), per_sub)
        state = mech.start(g, e, ctx)
        caches, histories = [], []
        for group in group_units(plan_units(self.layer_kinds, mech.block_size)):
            state, ys = self._run_group(group, g, per_layer, layer_params, state, ctx, False, record)
            caches.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), ys["layer_cache"]))  # [U*P, ...]
            if "history" in ys:
                histories.append(ys["history"].reshape(-1, *ys["history"].shape[3:]))  # [U*P*2, B, W, d]
        layer_cache = jax.tree.map(lambda *a: jnp.concatenate(a, axis=0), *caches)
        history = jnp.concatenate(histories, axis=0) if histories else None
        return mech.finish(g, state, ctx), layer_cache, history

    def decode(self, mech_params: dict, layer_params: dict, e: jax.Array, ctx: SequenceContext, sublayer_fn,
               layer_cache, history):
        """One decoding step: ``e[B, 1, d]`` the new tokens' embeddings, ``ctx`` their positions.

        ``sublayer_fn(kind, params, h, ctx, layer_cache_of_the_layer) -> (v, aux_loss, entry)``;
        ``layer_cache`` has a leading ``[n_layers]`` axis; ``history`` is the mechanism's
        ``[L, B, W, d]`` (or None), read only. Returns ``(final_hidden, entries, new_values)``:
        each layer's attention entry stacked ``[n_layers, ...]``, and ``[L, B, 1, d]`` the new
        token's value of each history slot's source (None without history). The reads take no
        block context: with one token, phase 1 would save nothing (docs/design.md §10). The
        layers are unrolled: a step is small, and static slices of the cache need no copy."""
        mech = self.mechanism
        g, per_sub = mech.split_params(mech_params)
        S, n_sub = mech.block_size, 2 * len(self.layer_kinds)
        kind_offset = {k: self.layer_kinds.index(k) for k in set(self.layer_kinds)}
        state = mech.start(g, e, ctx)
        entries, new_values = [], []
        for layer, kind in enumerate(self.layer_kinds):
            mlp_p = jax.tree.map(lambda a: a[layer - kind_offset[kind]], layer_params[kind])
            attn_p = jax.tree.map(lambda a: a[layer], layer_params["attn"])
            cache_l = jax.tree.map(lambda a: a[layer], layer_cache)
            for sub, (sub_kind, params) in enumerate((("attn", attn_p), (kind, mlp_p))):
                l = 2 * layer + sub + 1
                pos = position(l, S)
                p = jax.tree.map(lambda a: a[l - 1], per_sub)
                source = mech.history_source(g, state, pos)
                if source is not None:
                    new_values.append(source)
                h, aux = mech.decode_read(g, p, state, pos, ctx, history)
                v, _, entry = sublayer_fn(sub_kind, params, h, ctx, cache_l if sub == 0 else None)
                if sub == 0:
                    entries.append(entry)
                state = mech.write(g, p, state, v, aux, pos, ctx)
                if l % S == 0 or l == n_sub:  # the block's last sublayer (every sublayer when S = 1)
                    state = mech.end_block(g, state, pos)
        entries = jax.tree.map(lambda *a: jnp.stack(a), *entries)
        return mech.finish(g, state, ctx), entries, jnp.stack(new_values) if new_values else None


class PrefillRecord(NamedTuple):
    """What ``DepthStack.prefill`` records besides the forward pass.

    ``sublayer_fn(kind, params, h, ctx) -> (v, aux_loss, entry)``: the sublayer, and what a
    decoding cache keeps of it; ``window(source[B, T, d]) -> [B, W, d]``: the history a decoding
    step needs of one source (each row's last ``W`` real tokens)."""

    sublayer_fn: Callable
    window: Callable
