"""The XLA path of phase 1 and of the direct read, streaming over sources.

``reference.phase1`` expands all ``n`` sources at once (``[n, m, B, T, d]`` float32) and
autodiff stores the expansions and normalised keys for the backward pass: ``O(n m)``
times one source of transient memory per read. This module computes the same function
with one source in flight at a time:

* forward: a ``lax.scan`` over sources folds each expanded source into the online-softmax
  state (``reference.merge``), so only ``m`` streams of one source exist at once;
* backward (``jax.custom_vjp``): a second scan over sources recomputes each source's
  expansion and key norm (nothing but the inputs and the ``[S, m, B, T, H]`` running max
  is kept) and forms its gradients in closed form.

Backward of the state ``(M, D, A)`` with ``M = max_i s_i``, ``p_i = exp(s_i - M)``,
``D = sum_i p_i``, ``A = sum_i p_i v_i`` (per head): every consumer is invariant to a
common shift of ``M`` together with ``(D, A)`` scaled by ``exp(-shift)``, so
``g_M = g_A . A + g_D D`` and the max's own path cancels exactly; what is left is
``ds_i = p_i (g_D + g_A . v_i)`` and ``dv_i = p_i g_A``. The key is ``k = rms(E) =
E r``; ``dE = r (dk - k mean(k dk))`` plus the value path; the expansion's own vjp gives
the source and bank gradients.
"""

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


def _forward(sources, banks, queries, valid, segment_ids, stream_kernels, heads, eps):
    s_len, m, d = queries.shape
    b, t = sources.shape[1], sources.shape[2]
    q = queries.astype(jnp.float32)

    def fold(state, inp):
        x, bank, ok = inp
        e = ref.expand(x, bank, stream_kernels, segment_ids)  # [m, B, T, d]
        k, _ = _keys(e, eps)
        s = jnp.where(ok, _scores(k, q, heads), ref.NEG_LARGE)  # [S, m, B, T, H]
        new_max = jnp.maximum(state.max, s)
        keep = jnp.exp(state.max - new_max)
        p = jnp.where(ok, jnp.exp(s - new_max), 0.0)
        acc = _split(state.acc, heads) * keep[..., None] + p[..., None] * _split(e, heads)[None]
        return ref.SoftmaxState(new_max, state.denom * keep + p, acc.reshape(state.acc.shape)), None

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


def _phase1_bwd(stream_kernels, heads, eps, res, g):
    sources, banks, queries, valid, segment_ids, smax = res
    g_denom, g_acc = g.denom, _split(g.acc, heads)  # [S, m, B, T, H], [S, m, B, T, H, dh]
    q = queries.astype(jnp.float32)
    qh = _split(q, heads)  # [S, m, H, dh]

    def body(dq, inp):
        x, bank, ok = inp

        def expand(xx, bb):
            return ref.expand(xx, bb, stream_kernels, segment_ids)

        e, expand_vjp = jax.vjp(expand, x, bank)
        k, r = _keys(e, eps)
        s = _scores(k, q, heads)
        p = jnp.where(ok, jnp.exp(s - smax), 0.0)  # [S, m, B, T, H]
        eh = _split(e, heads)  # [m, B, T, H, dh]
        ds = p * (g_denom + jnp.einsum("smbthe,mbthe->smbth", g_acc, eh))
        d_e = jnp.einsum("smbth,smbthe->mbthe", p, g_acc)  # value path
        dk = jnp.einsum("smbth,smhe->mbthe", ds, qh).reshape(e.shape)
        d_e = d_e.reshape(e.shape) + r * (dk - k * jnp.mean(k * dk, axis=-1, keepdims=True))
        dq = dq + jnp.einsum("smbth,mbthe->smhe", ds, _split(k, heads)).reshape(q.shape)
        dx, dbank = expand_vjp(d_e)
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
