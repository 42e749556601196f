"""``jax.custom_vjp`` wrappers of the fused reads. The residuals are the inputs only (sources, banks,
queries, state, gate parameters), phase 1's running max and, for phase 2's Pallas backward, the
forward's per-token scores; the backward recomputes expansions, key norms and softmax weights.
The ``backward`` option picks it: ``"xla"`` (the default here; ``xla_streaming``'s closed form),
``"pallas"`` (``fused_bwd_phase1``, ``fused_bwd_phase2``) or ``"hybrid"`` (phase 1's closed form
with ``conv_transpose``). The unfused ``phase2`` differentiates the reference. Which is faster per
op, and so which one a model's op takes (``heuristics.choose``): docs/kernels.md §2-3."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from pallas_kernels.depth_attention import reference, xla_streaming


class Static(NamedTuple):
    """Hashable static configuration of one read."""

    stream_kernels: tuple
    heads: int
    eps: float
    gate_eps: float
    fuse: str | None  # phase2 only: None (streams), "mean", "gate"
    kernel_opts: tuple  # forwarded to the forward kernel as keyword arguments


def _as_float(x):
    return None if x is None else jnp.asarray(x, jnp.float32)


BACKWARDS = ("xla", "pallas", "hybrid")


def backward_choice(static: Static) -> str:
    choice = dict(static.kernel_opts).get("backward", "xla")
    if choice not in BACKWARDS:
        raise ValueError(f"backward={choice!r}: must be one of {BACKWARDS}")
    return choice


def _instantiate(ct):
    """A cotangent leaf as an array (a symbolic zero becomes zeros)."""
    return jnp.zeros(ct.shape, ct.dtype) if isinstance(ct, SymbolicZero) else ct


def _with_channels(states, values_dtype):
    """Each per-target state paired with its zero ``reference.ValueChannel``."""
    return tuple((st, reference.zero_value_channel(st, values_dtype)) for st in states)


def _merge_channel_cotangents(ct, factor: bool):
    """``api.phase1(value_channel=True)``'s cotangent (per target ``(state ct, channel ct)``, with
    symbolic zeros) as ``(state cts per target, value_scale)``. With ``factor`` (the caller's
    kernels take it: one stream, whose ``g_A`` is ``values[None]``), ``value_scale`` (``[S, m, B,
    T, H]``) when every target's value cotangent came factored and nothing else reached its
    ``acc``; each ``acc`` is then the channel's ``values[None]``. Otherwise ``value_scale`` is None
    and each ``acc`` the whole cotangent (``reference.channel_value_cotangent`` added to any direct
    one), float32 where a channel contributed."""
    states, channels = zip(*ct)
    factored = [not isinstance(ch.values, SymbolicZero) and not isinstance(ch.scale, SymbolicZero)
                for ch in channels]
    if factor and all(factored) and all(isinstance(st.acc, SymbolicZero) for st in states):
        return (tuple(st._replace(acc=ch.values[None]) for st, ch in zip(states, channels)),
                jnp.stack([ch.scale for ch in channels]))
    merged = []
    for st, ch, has in zip(states, channels, factored):
        acc = st.acc
        if has:
            acc = reference.channel_value_cotangent(ch)
            acc = acc if isinstance(st.acc, SymbolicZero) else acc + st.acc.astype(jnp.float32)
        merged.append(st._replace(acc=acc))
    return tuple(merged), None


def make_phase1(forward: Callable, kernel_backward: Callable | None = None,
                expansion_transpose: Callable | None = None) -> Callable:
    """``forward(sources, banks, queries, valid, segment_ids, static) -> SoftmaxState``;
    ``kernel_backward(sources, banks, queries, valid, segment_ids, smax, ct, static,
    value_scale=None) -> (d sources, d banks, d queries)``, used with the ``backward="pallas"``
    option (``value_scale``: ``ct.acc`` is factored, ``fused_bwd_phase1.phase1_backward``);
    ``expansion_transpose(d_e, x, bank, segment_ids, static, n_targets) -> (d x, d bank)``, with
    ``backward="hybrid"``.

    With the ``value_channel`` option (and ``per_target``) the op returns per target ``(state,
    reference.ValueChannel)``; the rule sees which cotangents are symbolic zeros, so a value
    cotangent that arrives only through the channel reaches the kernels factored."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(static, sources, banks, queries, valid, segment_ids):
        out = forward(sources, banks, queries, valid, segment_ids, static)
        return _with_channels(out, sources.dtype) if value_channel(static) else out

    def per_target(static) -> bool:
        return bool(dict(static.kernel_opts).get("per_target", False))

    def value_channel(static) -> bool:
        return bool(dict(static.kernel_opts).get("value_channel", False))

    def fwd(static, *primals):
        sources, banks, queries, valid, segment_ids = custom_vjp_primal_tree_values(primals)
        out = forward(sources, banks, queries, valid, segment_ids, static)
        # The backward needs only the running max (a shift without gradient), not the [S, m, B,
        # T, d] state: keeping the max alone lets a caller drop its rematerialisation (it would
        # re-run the scores kernel just to get the max back).
        smax = jnp.stack([o.max for o in out]) if per_target(static) else out.max
        if value_channel(static):
            out = _with_channels(out, sources.dtype)
        return out, (sources, banks, queries, valid, segment_ids, smax)

    def cotangent(static, ct, split_acc: bool):
        """The state cotangent with a leading ``S`` axis, ``max`` and ``denom`` in float32;
        ``split_acc`` (the Pallas backward): ``acc`` stays in the state's dtype (the kernels load
        it as float32; converting a bf16 one first would write it out again in float32) and, with
        ``per_target``, a tuple of ``S`` arrays (stacking them is a copy of the whole ``[S, m, B,
        T, d]`` cotangent); otherwise float32."""
        f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
        acc_of = (lambda a: a) if split_acc else f32  # noqa: E731
        if not per_target(static):
            mx, den, acc = ct
            return reference.SoftmaxState(f32(mx), f32(den), acc_of(acc))
        mx, den, acc = zip(*ct)
        acc = tuple(acc_of(a) for a in acc)
        return reference.SoftmaxState(f32(jnp.stack(mx)), f32(jnp.stack(den)), acc if split_acc else jnp.stack(acc))

    def bwd(static, res, ct):
        value_scale = None
        if value_channel(static):  # only the kernels take the value cotangent factored, with one stream
            factor = backward_choice(static) == "pallas" and len(static.stream_kernels) == 1
            ct, value_scale = _merge_channel_cotangents(ct, factor)
        ct = jax.tree.map(_instantiate, ct, is_leaf=lambda c: isinstance(c, SymbolicZero))
        if backward_choice(static) == "pallas":
            if kernel_backward is None:
                raise ValueError("backward='pallas': this back end has no phase-1 backward kernel")
            sources, banks, queries, valid, segment_ids, smax = res
            ct = cotangent(static, ct, split_acc=True)
            dx, dbanks, dq = kernel_backward(sources, banks, queries, valid, segment_ids, smax, ct, static,
                                             value_scale=value_scale)
            return (dx.astype(sources.dtype), None if banks is None else dbanks.astype(banks.dtype),
                    dq.astype(queries.dtype), None, None)
        # Only the XLA backward waits behind the barrier: the kernels take the cotangent as an
        # input, so nothing of size d per token can be hoisted ahead of it, and the barrier cost
        # the Pallas backwards 5-15% in the bench on the H200.
        res, ct = xla_streaming.ordered_after_cotangent(res, ct)
        sources, banks, queries, valid, segment_ids, smax = res
        n, d = sources.shape[0], sources.shape[-1]
        ct = cotangent(static, ct, split_acc=False)
        ok = jnp.ones((n,), bool) if valid is None else valid
        bank_arr = jnp.zeros((n, 0, d), jnp.float32) if banks is None else banks
        transpose = None
        if backward_choice(static) == "hybrid":
            if expansion_transpose is None:
                raise ValueError("backward='hybrid': this back end has no expansion-transpose kernel")
            transpose = functools.partial(expansion_transpose, segment_ids=segment_ids, static=static,
                                          n_targets=queries.shape[0])
        dx, dbanks, dq, _, _ = xla_streaming.phase1_backward(
            sources, bank_arr, queries, ok, segment_ids, smax, ct,
            stream_kernels=static.stream_kernels, heads=static.heads, eps=static.eps,
            expansion_transpose=transpose,
        )
        return dx, None if banks is None else dbanks, dq, None, None

    op.defvjp(fwd, bwd, symbolic_zeros=True)

    def phase1(sources, banks, queries, valid=None, *, stream_kernels, heads=1, segment_ids=None, eps=1e-6,
               per_target=False, value_channel=False, **opts):
        if per_target:  # a static option the forward and the backward read (``api.phase1``)
            opts["per_target"] = True
        if value_channel:
            opts["value_channel"] = True
        static = Static(tuple(stream_kernels), heads, float(eps), 0.0, None, tuple(sorted(opts.items())))
        valid = None if valid is None else jnp.asarray(valid, bool)
        banks = banks if any(stream_kernels) else None
        return op(static, sources, banks, queries, valid, segment_ids)

    return phase1


def make_phase2(forward: Callable, *, fused: bool, kernel_backward: Callable | None = None) -> Callable:
    """``forward(state, partial, bank, query, include, gate, segment_ids, static,
    return_scores=False)`` (with ``return_scores``: ``(out, scores)``, the scoring pass's
    per-token scalars); ``kernel_backward(state, partial, bank, query, include, gate,
    segment_ids, dh, static, scores=None, value_channel=False) -> (d state, d partial, d bank,
    d query, d gate)`` (fused only, ``backward="pallas"``; it recomputes the scores when given
    none; with ``value_channel`` it may return ``d state.acc`` as a ``reference.ValueChannel``,
    which goes back through the op's ``value_channel`` argument).

    ``fused=False`` gives the ``reference.phase2`` signature (returns ``z[m, B, T, d]``);
    ``fused=True`` the ``reference.phase2_fused`` one (returns ``h[B, T, d]``).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(static, state, partial, bank, query, include, gate, segment_ids, channel):
        # ``channel``: the state's zero ``reference.ValueChannel`` or None; read by no forward, it
        # is only the way back for a factored value cotangent.
        return forward(state, partial, bank, query, include, gate, segment_ids, static)

    def pallas_backward(static):
        return static.fuse is not None and backward_choice(static) == "pallas"

    def fwd(static, state, partial, bank, query, include, gate, segment_ids, channel):
        scores = None
        if pallas_backward(static) and kernel_backward is not None:
            # The Pallas backward starts from the forward's per-token scores (m (H + 1) floats
            # per token): keeping them saves its scoring pass over the partial.
            out, scores = forward(state, partial, bank, query, include, gate, segment_ids, static, return_scores=True)
        else:
            out = forward(state, partial, bank, query, include, gate, segment_ids, static)
        return out, (state, partial, bank, query, include, gate, segment_ids, scores)

    def bwd(static, res, ct):
        if not pallas_backward(static):  # the kernels need no barrier (phase1's bwd says why)
            res, ct = xla_streaming.ordered_after_cotangent(res, ct)
        state, partial, bank, query, include, gate, segment_ids, scores = res
        if pallas_backward(static):
            if kernel_backward is None:
                raise ValueError("backward='pallas': this back end has no phase-2 backward kernel")
            # The value cotangent goes back factored through the channel when phase 1 gave one and
            # the channel's values can hold ``dh`` as it is (same dtype); the kernels decide whether
            # they can factor it (mean fusion) and return the ``d acc`` array otherwise.
            factor = dict(static.kernel_opts).get("value_channel") == str(jnp.dtype(ct.dtype))
            g_state, g_x, g_b, g_q, g_gate = kernel_backward(
                state, partial, bank, query, include, gate, segment_ids, ct, static, scores=scores,
                value_channel=factor)
            g_channel = None
            if isinstance(g_state.acc, reference.ValueChannel):
                g_state, g_channel = g_state._replace(acc=None), g_state.acc  # acc's cotangent: a zero
            return (g_state, g_x.astype(partial.dtype), None if bank is None else g_b.astype(bank.dtype),
                    g_q.astype(query.dtype), None, g_gate, None, g_channel)
        if static.fuse is not None:
            bank_arr = jnp.zeros((0, partial.shape[-1]), jnp.float32) if bank is None else bank
            g_state, g_x, g_b, g_q, _, g_gate, _ = xla_streaming._phase2_fused_bwd(
                static.stream_kernels, static.heads, static.eps, static.gate_eps,
                (state, partial, bank_arr, query, include, gate, segment_ids), ct,
            )
            g_state = g_state._replace(acc=g_state.acc.astype(state.acc.dtype))
            return g_state, g_x, None if bank is None else g_b, g_q, None, g_gate, None, None
        kw = dict(stream_kernels=static.stream_kernels, heads=static.heads, segment_ids=segment_ids, eps=static.eps)

        def f(st, x, b, q):
            return reference.phase2(st, x, b, q, include, **kw)

        _, vjp = jax.vjp(f, state, partial, bank, query)
        g_state, g_x, g_b, g_q = vjp(ct.astype(jnp.float32))
        return g_state, g_x, g_b, g_q, None, None, None, None

    op.defvjp(fwd, bwd)

    def prep(state, bank, include_partial, stream_kernels):
        # ``acc`` keeps a bf16 dtype (``api.phase1``'s ``state_dtype``): the kernels and the XLA
        # closed forms compute in float32 from it, and its cotangent comes back in bf16.
        mx, den, acc = state
        acc = acc if jnp.asarray(acc).dtype == jnp.bfloat16 else jnp.asarray(acc, jnp.float32)
        state = reference.SoftmaxState(jnp.asarray(mx, jnp.float32), jnp.asarray(den, jnp.float32), acc)
        bank = bank if any(stream_kernels) else None
        return state, bank, jnp.asarray(include_partial, bool)

    if not fused:

        def phase2(state, partial, bank, query, include_partial=True, *, stream_kernels, heads=1, segment_ids=None,
                   eps=1e-6, **opts):
            static = Static(tuple(stream_kernels), heads, float(eps), 0.0, None, tuple(sorted(opts.items())))
            state, bank, include = prep(state, bank, include_partial, stream_kernels)
            return op(static, state, partial, bank, query, include, None, segment_ids, None)

        return phase2

    def phase2_fused(state, partial, bank, query, include_partial=True, gate=None, *, stream_kernels, heads=1,
                     segment_ids=None, eps=1e-6, gate_eps=1e-6, value_channel=None, **opts):
        fuse = "mean" if gate is None else "gate"
        if value_channel is not None:  # the channel's values dtype: a static option of the backward
            opts["value_channel"] = str(jnp.dtype(value_channel.values.dtype))
        static = Static(tuple(stream_kernels), heads, float(eps), float(gate_eps), fuse, tuple(sorted(opts.items())))
        state, bank, include = prep(state, bank, include_partial, stream_kernels)
        if gate is not None:
            w, scale, bias = gate
            gate = (_as_float(w), _as_float(scale), _as_float(bias))
        return op(static, state, partial, bank, query, include, gate, segment_ids, value_channel)

    return phase2_fused
