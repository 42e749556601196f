"""The XLA path of phase 1 and of the direct read, streaming over sources: the same function as
``reference.phase1`` with one source in flight. The forward is a ``lax.scan`` over sources that
folds each expanded source into the online-softmax state (``reference.merge``); the backward
(``jax.custom_vjp``) recomputes each source's expansion and key norm in a second scan, keeping
only the inputs and the running max, and forms its gradients in closed form. ``phase2_fused``
is phase 2 and the gate as one op whose backward keeps only its inputs. The formulas and the
memory it saves: docs/kernels.md §4, "The XLA path" and "Phase 1 backward"."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import reference as ref


def _split(x, heads):
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def _keys(expanded, eps):
    """rms-normalised keys and the inverse rms, ``[m, B, T, d]`` and ``[m, B, T, 1]``."""
    r = jax.lax.rsqrt(jnp.mean(expanded * expanded, axis=-1, keepdims=True) + eps)
    return expanded * r, r


def _scores(keys, q, heads):
    """``[S, m, B, T, H]`` from keys ``[m, B, T, d]`` and queries ``[S, m, d]``."""
    return jnp.einsum("mbthe,smhe->smbth", _split(keys, heads), _split(q, heads))


def _if_valid(ok, live, dead, operand):
    """``live(operand)`` for a valid source, else ``dead(operand)`` (the same value ``live`` gives
    an invalid source, without its work): a ``lax.cond`` on a traced flag; a batched flag
    (under ``vmap``) computes both and selects. Inside ``shard_map`` (a pipeline stage) it always
    runs ``live``, which masks an invalid source's weights to zero: there the branches would
    disagree on the manual axes their outputs vary over, and casting them breaks under the
    stage's transformations."""
    if isinstance(ok, bool):
        return live(operand) if ok else dead(operand)
    if jax.sharding.get_abstract_mesh().manual_axes:
        return live(operand)
    return jax.lax.cond(ok, live, dead, operand)


def _forward(sources, banks, queries, valid, segment_ids, stream_kernels, heads, eps):
    s_len, m, d = queries.shape
    b, t = sources.shape[1], sources.shape[2]
    q = queries.astype(jnp.float32)

    def fold(state, inp):
        x, bank, ok = inp

        def live(state):
            e = ref.expand(x, bank, stream_kernels, segment_ids)  # [m, B, T, d]
            k, _ = _keys(e, eps)
            s = jnp.where(ok, _scores(k, q, heads), ref.NEG_LARGE)  # [S, m, B, T, H]
            new_max = jnp.maximum(state.max, s)
            keep = jnp.exp(state.max - new_max)
            p = jnp.where(ok, jnp.exp(s - new_max), 0.0)
            acc = _split(state.acc, heads) * keep[..., None] + p[..., None] * _split(e, heads)[None]
            return ref.SoftmaxState(new_max, state.denom * keep + p, acc.reshape(state.acc.shape))

        # An invalid source leaves the state unchanged (its p is 0): skip its expansion (the
        # model's phase 1 runs on the whole source buffer, half of it not yet written).
        return _if_valid(ok, live, lambda st: st, state), None

    empty = ref.SoftmaxState(
        max=jnp.full((s_len, m, b, t, heads), ref.NEG_LARGE, jnp.float32),
        denom=jnp.zeros((s_len, m, b, t, heads), jnp.float32),
        acc=jnp.zeros((s_len, m, b, t, d), jnp.float32),
    )
    # The first source is folded outside the scan so the carry takes the sharding /
    # manual-axis ("varying") type of the data, as scans inside shard_map require.
    state, _ = fold(empty, (sources[0], banks[0], valid[0]))
    if sources.shape[0] > 1:
        state, _ = jax.lax.scan(fold, state, (sources[1:], banks[1:], valid[1:]))
    return state


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _phase1(sources, banks, queries, valid, segment_ids, stream_kernels, heads, eps):
    return _forward(sources, banks, queries, valid, segment_ids, stream_kernels, heads, eps)


def _phase1_fwd(sources, banks, queries, valid, segment_ids, stream_kernels, heads, eps):
    state = _forward(sources, banks, queries, valid, segment_ids, stream_kernels, heads, eps)
    return state, (sources, banks, queries, valid, segment_ids, state.max)


def ordered_after_cotangent(res, ct):
    """``(res, ct)`` behind an optimization barrier: the backward's recomputation from the
    inputs cannot start before the cotangent exists. Without it XLA may hoist that
    cotangent-free work (expansions, keys, softmax weights) of every read to the start of the
    backward and keep it all alive at once, as a ``jax.checkpoint`` around the op would have
    prevented (+146 MiB on the CPU memory bench without the barrier)."""
    return jax.lax.optimization_barrier((res, ct))


def _phase1_bwd(stream_kernels, heads, eps, res, g):
    res, g = ordered_after_cotangent(res, g)
    sources, banks, queries, valid, segment_ids, smax = res
    return phase1_backward(sources, banks, queries, valid, segment_ids, smax, g,
                           stream_kernels=stream_kernels, heads=heads, eps=eps)


def phase1_backward(sources, banks, queries, valid, segment_ids, smax, g, *, stream_kernels, heads, eps,
                    expansion_transpose=None):
    """Closed-form gradients ``(d sources, d banks, d queries, None, None)`` of phase 1, one
    source at a time; ``smax`` is the forward's running max, ``g`` the cotangent of the state
    (its ``max`` part is ignored: the max carries no gradient). ``expansion_transpose(d_e, x,
    bank) -> (d x, d bank)``: the vjp of the expansion (Eq. 10) as a kernel
    (``conv_transpose.expansion_transpose``, the ``backward="hybrid"`` option); None: XLA's
    autodiff of ``reference.expand``."""
    g_denom, g_acc = g.denom, _split(g.acc, heads)  # [S, m, B, T, H], [S, m, B, T, H, dh]
    q = queries.astype(jnp.float32)
    qh = _split(q, heads)  # [S, m, H, dh]

    def body(dq, inp):
        x, bank, ok = inp

        def dead(dq):  # an invalid source: p = 0, so its gradients are exactly zero
            return dq, (jnp.zeros_like(x), jnp.zeros_like(bank))

        return _if_valid(ok, functools.partial(live, x=x, bank=bank, ok=ok), dead, dq)

    def live(dq, *, x, bank, ok):
        def expand(xx, bb):
            return ref.expand(xx, bb, stream_kernels, segment_ids)

        e, expand_vjp = jax.vjp(expand, x, bank)
        k, r = _keys(e, eps)
        s = _scores(k, q, heads)
        p = jnp.where(ok, jnp.exp(s - smax), 0.0)  # [S, m, B, T, H]
        eh = _split(e, heads)  # [m, B, T, H, dh]
        ds = p * (g_denom + jnp.einsum("smbthe,mbthe->smbth", g_acc, eh))
        # The two sums over the S targets are broadcast products reduced over s, not einsums:
        # as K = S dots XLA:GPU runs them on the tensor cores in TF32 by default, here they
        # are exact float32 sums. (Measured on the H200: no
        # change in step time; the transposing copy of this dE in the base profile comes from
        # the layout XLA picks for the conv's tap reduction, not from these dots.)
        d_e = jnp.sum(p[..., None] * g_acc, axis=0)  # value path
        dk = jnp.sum(ds[..., None] * qh[:, :, None, None], axis=0).reshape(e.shape)
        d_e = d_e.reshape(e.shape) + r * (dk - k * jnp.mean(k * dk, axis=-1, keepdims=True))
        dq = dq + jnp.einsum("smbth,mbthe->smhe", ds, _split(k, heads)).reshape(q.shape)
        if expansion_transpose is None or not any(stream_kernels):
            dx, dbank = expand_vjp(d_e)
        else:
            dx, dbank = expansion_transpose(d_e, x, bank)
            dbank = dbank.astype(bank.dtype)
        return dq, (dx, dbank)

    # As in the forward, the first source is peeled off so the scan carry has the data's type.
    dq, (dx0, dbank0) = body(jnp.zeros_like(q), (sources[0], banks[0], valid[0]))
    dx, dbanks = dx0[None], dbank0[None]
    if sources.shape[0] > 1:
        dq, (dx_rest, dbanks_rest) = jax.lax.scan(body, dq, (sources[1:], banks[1:], valid[1:]))
        dx = jnp.concatenate([dx, dx_rest], axis=0)
        dbanks = jnp.concatenate([dbanks, dbanks_rest], axis=0)
    return (dx.astype(sources.dtype), None if banks is None else dbanks.astype(banks.dtype),
            dq.astype(queries.dtype), None, None)


_phase1.defvjp(_phase1_fwd, _phase1_bwd)


def phase1(
    sources: jax.Array,
    banks: jax.Array | None,
    queries: jax.Array,
    valid: jax.Array | None = None,
    *,
    stream_kernels: Sequence[int],
    heads: int = 1,
    segment_ids: jax.Array | None = None,
    eps: float = 1e-6,
) -> ref.SoftmaxState:
    """``reference.phase1`` computed one source at a time (same arguments and result)."""
    n = sources.shape[0]
    ok = jnp.ones((n,), bool) if valid is None else jnp.asarray(valid, bool)
    if banks is None:
        banks = jnp.zeros((n, 0, sources.shape[-1]), jnp.float32)
    return _phase1(sources, banks, queries, ok, segment_ids, tuple(stream_kernels), heads, eps)


def depth_read(
    sources: jax.Array,
    banks: jax.Array | None,
    query: jax.Array,
    valid: jax.Array | None = None,
    *,
    stream_kernels: Sequence[int],
    heads: int = 1,
    segment_ids: jax.Array | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """``reference.depth_read`` as a one-target phase 1 (weights: use the reference)."""
    if return_weights:
        raise NotImplementedError("the streaming read does not materialise the depth weights")
    state = phase1(sources, banks, query[None], valid, stream_kernels=stream_kernels, heads=heads,
                   segment_ids=segment_ids, eps=eps)
    return ref.finalize(jax.tree.map(lambda a: a[0], state))


# ----------------------------------------------------------------------------------------
# Phase 2 with the stream fusion, closed-form recomputing backward.
#
# Forward (per head; c, q, D', acc' as in ``reference.merge``):
#   e = expand(partial), k = rms(e), s = q_r . k (per head), M' = max(M, s),
#   c = exp(M - M'), p = exp(s - M') (0 when the partial is excluded),
#   D' = c D + p, acc' = c A + p e, z = acc' / D', h = sum_r g_r z_r with
#   g = sigmoid(a * rms_{m d}(Z) @ W + b) (Eq. 13-14) or g_r = 1/m (mean fusion).
# Backward from dh:
#   gate:    dg = dh . z_r, dlogit = dg g (1 - g), dy = a r_z dlogit, d r_z = a sum(dlogit y),
#            dz_r = g_r dh + [W dy]_r - d r_z r_z^3 z_r / (m d)   (r_z = rms over all m d entries)
#   finalize: dacc' = dz / D', dD' = -sum_d(dz z) / D'
#   merge:   dA = c dacc', dD = c dD', dM = sum(dA A) + dD D = c p sum(dz (A - e D)) / D'^2,
#            ds = p (dD' + sum_d dacc' e), de = p dacc'
#   keys:    de += r (dk - k mean_d(k dk)) with dk = ds q (per head)
#   expand:  its own vjp gives d partial and d bank.
# Only the inputs are kept between forward and backward; the backward holds a handful of
# [m, B, T, d] float32 arrays at once (autodiff of the reference keeps about twice as many,
# plus the gate's transposed copies).
# ----------------------------------------------------------------------------------------


def _gate_forward(z, gate, gate_eps):
    """``(h, saved)`` for ``z[m, B, T, d]``; ``gate=None`` is mean fusion."""
    m, d = z.shape[0], z.shape[-1]
    if gate is None:
        return jnp.mean(z, axis=0), None
    w, scale, bias = gate
    w3 = w.astype(jnp.float32).reshape(m, d, m)  # rows of W in flatten(Z) order: stream-major
    rz = jax.lax.rsqrt(jnp.sum(z * z, axis=(0, 3)) / (m * d) + gate_eps)  # [B, T]
    y = jnp.einsum("mbtd,mdk->btk", z, w3)  # [B, T, m], before the rms
    g = jax.nn.sigmoid(scale * rz[..., None] * y + bias)
    h = jnp.einsum("btm,mbtd->btd", g, z)
    return h, (w3, scale, rz, y, g)


def _gate_backward(z, dh, gate, saved):
    """``(dz, d_gate)`` of ``_gate_forward``."""
    m, d = z.shape[0], z.shape[-1]
    if gate is None:
        return jnp.broadcast_to(dh / m, z.shape), None
    w3, scale, rz, y, g = saved
    dg = jnp.einsum("btd,mbtd->btm", dh, z)
    dlogit = dg * g * (1.0 - g)  # [B, T, m]
    d_bias = jnp.sum(dlogit, axis=(0, 1))
    d_scale = jnp.sum(dlogit * rz[..., None] * y)
    dy = scale * rz[..., None] * dlogit  # through logit = a * rz * y
    d_rz = scale * jnp.sum(dlogit * y, axis=-1)  # [B, T]
    # rz = (sum z^2 / (m d) + eps)^(-1/2): d rz / d z = -rz^3 z / (m d)
    coef = -d_rz * rz**3 / (m * d)  # [B, T]
    w_dy = jnp.sum(dy[None, :, :, None, :] * w3[:, None, None], axis=-1)  # [W dy]_r, exact f32 (a K = m dot: TF32)
    dz = g.transpose(2, 0, 1)[..., None] * dh[None] + w_dy + coef[..., None] * z
    d_w = jnp.einsum("mbtd,btk->mdk", z, dy).reshape(m * d, m)
    return dz, (d_w, d_scale.reshape(jnp.shape(gate[1])), d_bias)


def _merge_and_gate(state, e, query, include, gate, heads, eps, gate_eps):
    """From the partial's expansion ``e[m, B, T, d]``: ``h`` and what the backward needs."""
    k, r = _keys(e, eps)
    qh = _split(query.astype(jnp.float32), heads)
    s = jnp.where(include, jnp.einsum("mbthe,mhe->mbth", _split(k, heads), qh), ref.NEG_LARGE)
    new_max = jnp.maximum(state.max, s)
    keep = jnp.exp(state.max - new_max)
    p = jnp.where(include, jnp.exp(s - new_max), 0.0)
    denom = state.denom * keep + p
    acc = _split(state.acc, heads) * keep[..., None] + p[..., None] * _split(e, heads)
    z = (acc / denom[..., None]).reshape(e.shape)
    h, saved = _gate_forward(z, gate, gate_eps)
    return h, (k, r, qh, keep, p, denom, z, saved)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _phase2_fused(state, partial, bank, query, include, gate, segment_ids, stream_kernels, heads, eps, gate_eps):
    e = ref.expand(partial, bank, stream_kernels, segment_ids)  # [m, B, T, d]
    return _merge_and_gate(state, e, query, include, gate, heads, eps, gate_eps)[0]


def _phase2_fused_fwd(state, partial, bank, query, include, gate, segment_ids, stream_kernels, heads, eps, gate_eps):
    h = _phase2_fused(state, partial, bank, query, include, gate, segment_ids, stream_kernels, heads, eps, gate_eps)
    return h, (state, partial, bank, query, include, gate, segment_ids)


def _phase2_fused_bwd(stream_kernels, heads, eps, gate_eps, res, dh):
    res, dh = ordered_after_cotangent(res, dh)
    state, partial, bank, query, include, gate, segment_ids = res
    dh = dh.astype(jnp.float32)

    def expand(xx, bb):
        return ref.expand(xx, bb, stream_kernels, segment_ids)

    e, expand_vjp = jax.vjp(expand, partial, bank)
    _, (k, r, qh, keep, p, denom, z, saved) = _merge_and_gate(state, e, query, include, gate, heads, eps, gate_eps)
    eh = _split(e, heads)
    dz, d_gate = _gate_backward(z, dh, gate, saved)
    d_acc_new = _split(dz, heads) / denom[..., None]  # [m, B, T, H, dh]
    d_denom_new = -jnp.sum(_split(dz * z, heads), axis=-1) / denom  # [m, B, T, H]
    d_acc = (d_acc_new * keep[..., None]).reshape(e.shape)
    d_denom = d_denom_new * keep
    # dM = sum(dA A) + dD D (shift invariance) = c p sum(dz (A - e D)) / D'^2: the same value
    # without the cancellation, so it is exactly 0 when the partial is excluded (p = 0).
    a_minus_ed = _split(state.acc, heads) - eh * state.denom[..., None]
    d_max = keep * p * jnp.sum(_split(dz, heads) * a_minus_ed, axis=-1) / (denom * denom)
    ds = p * (d_denom_new + jnp.sum(d_acc_new * eh, axis=-1))  # [m, B, T, H]
    d_e = (p[..., None] * d_acc_new).reshape(e.shape)
    dk = (ds[..., None] * qh[:, None, None]).reshape(e.shape)
    d_e = d_e + r * (dk - k * jnp.mean(k * dk, axis=-1, keepdims=True))
    d_query = jnp.einsum("mbth,mbthe->mhe", ds, _split(k, heads)).reshape(query.shape)
    d_partial, d_bank = expand_vjp(d_e)
    d_state = ref.SoftmaxState(d_max, d_denom, d_acc)
    return (d_state, d_partial.astype(partial.dtype), d_bank.astype(bank.dtype), d_query.astype(query.dtype), None, d_gate, None)


_phase2_fused.defvjp(_phase2_fused_fwd, _phase2_fused_bwd)


def phase2_fused(
    state: ref.SoftmaxState,
    partial: jax.Array,
    bank: jax.Array | None,
    query: jax.Array,
    include_partial: jax.Array | bool = True,
    gate: tuple | None = None,
    *,
    stream_kernels: Sequence[int],
    heads: int = 1,
    segment_ids: jax.Array | None = None,
    eps: float = 1e-6,
    gate_eps: float = 1e-6,
) -> jax.Array:
    """``reference.phase2_fused`` with a closed-form, recomputing backward (same arguments and result)."""
    state = ref.SoftmaxState(*(jnp.asarray(a, jnp.float32) for a in state))
    if bank is None:
        bank = jnp.zeros((0, partial.shape[-1]), jnp.float32)
    if gate is not None:
        gate = tuple(jnp.asarray(a, jnp.float32) for a in gate)
    include = jnp.asarray(include_partial, bool)
    return _phase2_fused(state, partial, bank, query, include, gate, segment_ids, tuple(stream_kernels), heads,
                         float(eps), float(gate_eps))
