"""Plain-jnp multi-stream depth attention: the oracle of every kernel and of the XLA path, in
float32 whatever the input dtype (docs/design.md §1, precision).

One op family serves every depth-attention residual of the MSAR paper: the expansion of a source
into ``m`` streams, the identity or a causal depthwise conv along tokens (Eq. 9-10, ``expand``);
per-stream depth attention with the weightless RMS norm of each expanded source as the key, per
channel head for MHAR (Eq. 11-12, 17; docs/design.md §8); and the two-phase computation
(``phase1``, ``phase2``, ``merge``; the MSAR paper's Sec. 3.4, docs/design.md §5). AttnRes is
``stream_kernels=(0,)``, ``heads=1``; MHAR ``(0,)`` with ``heads=H``; MSAR e.g. ``(0, 4, 8, 12)``;
the no-conv ablation ``(0, 0, 0, 0)``. docs/kernels.md §1-2 has the read and its phases."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import platform

# A finite stand-in for -inf: exp(NEG_LARGE - finite) underflows to exactly 0 and,
# unlike -inf, never produces inf - inf = NaN inside a masked merge (NaN would leak
# into gradients through jnp.where).
NEG_LARGE = -1e30


class SoftmaxState(NamedTuple):
    """Online-softmax state per (stream, token, head); leading axes are free.

    ``max`` and ``denom`` are ``[..., m, B, T, H]``; ``acc`` is ``[..., m, B, T, d]``
    holding ``sum_i exp(s_i - max) * value_i`` (head ``h`` owns channels
    ``h*d/H:(h+1)*d/H``).
    """

    max: jax.Array
    denom: jax.Array
    acc: jax.Array


def split_targets(state: SoftmaxState) -> tuple[SoftmaxState, ...]:
    """Phase 1's state ``[S, ...]`` as ``S`` per-target states (``phase1(per_target=True)``).

    Split with ``jnp.split``, whose transpose is one concatenate of the ``S`` cotangents;
    indexing each target (``a[i]``) transposes to ``S`` zero-padded full-size arrays summed,
    which on the H200 took 80.8 against 29.5 ms per MSAR `base` step."""
    n_targets = state.acc.shape[0]
    parts = [[jnp.squeeze(p, 0) for p in jnp.split(a, n_targets)] for a in state]
    return tuple(SoftmaxState(*(p[i] for p in parts)) for i in range(n_targets))


class ValueChannel(NamedTuple):
    """A zero-valued companion of one target's phase-1 state whose COTANGENT carries the
    state's value cotangent in factored form (``api.phase1(value_channel=True)``)::

        d acc[r, b, t, c] = scale[r, b, t, head(c)] * values[b, t, c]

    ``values[B, T, d]`` (the dtype of the read's output ``h``) and ``scale[m, B, T, H]`` (float32).
    With mean fusion the fused phase 2's value cotangent has this form exactly (docs/design.md §5's merge:
    ``z_r = a_r A_r + b_r E_r``, ``h = (1/m) sum_r z_r``, so ``d A_r = (a_r / m) dh``): the
    backward then hands phase 1 the cotangent ``dh`` it already has and ``m H`` floats per
    token instead of writing the ``[m, B, T, d]`` float32 ``d acc`` for phase 1 to read. Its
    forward value is zeros that nothing reads (XLA removes them)."""

    values: jax.Array
    scale: jax.Array


def zero_value_channel(state: SoftmaxState, values_dtype) -> ValueChannel:
    """The channel of one target's state (``max[m, B, T, H]``, ``acc[m, B, T, d]``)."""
    return ValueChannel(jnp.zeros(state.acc.shape[1:], values_dtype), jnp.zeros(state.max.shape, jnp.float32))


def channel_value_cotangent(channel: ValueChannel) -> jax.Array:
    """``d acc[m, B, T, d]`` (float32) from a channel cotangent (the definition above)."""
    values = channel.values.astype(jnp.float32)
    heads = channel.scale.shape[-1]
    per_channel = jnp.repeat(channel.scale, values.shape[-1] // heads, axis=-1)  # [m, B, T, d]
    return per_channel * values[None]


def stack_targets(states) -> SoftmaxState:
    """The inverse of ``split_targets``."""
    return SoftmaxState(*(jnp.stack(a) for a in zip(*states)))


def bank_size(stream_kernels: Sequence[int]) -> int:
    """Number of ``d``-vectors in one conv bank: the sum of the conv kernel sizes."""
    return int(sum(stream_kernels))


def key_rms(x: jax.Array, eps: float) -> jax.Array:
    """Weightless RMS norm over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def segment_lag_masks(segment_ids: jax.Array | None, t_len: int, max_lag: int, batch: int) -> jax.Array:
    """``masks[delta, b, t]`` (``[max_lag, B, T]`` float32) is 1 where token ``t - delta`` is in
    the same sequence segment as ``t`` (and exists).

    Segment ids must be contiguous runs with an id that is not reused later in the row
    (what packing produces): membership is decided by equal ids, as in the attention
    mask, so a reused id would let the convolution reach across the segments between.
    Built for all lags at once (a handful of ops, not a handful per lag: the model calls
    this in every expansion, and each op costs compile time).
    """
    valid = jnp.arange(t_len)[None, None, :] >= jnp.arange(max_lag)[:, None, None]  # [K, 1, T]
    valid = jnp.broadcast_to(valid, (max_lag, batch, t_len))
    if segment_ids is not None and max_lag > 1:
        padded = jnp.pad(segment_ids, ((0, 0), (max_lag - 1, 0)), constant_values=-1)
        earlier = jnp.stack([padded[:, max_lag - 1 - delta : max_lag - 1 - delta + t_len]
                             for delta in range(max_lag)])  # [K, B, T]: the id of token t - delta
        valid = valid & (earlier == segment_ids[None])
    return valid.astype(jnp.float32)


def expand(
    x: jax.Array,
    bank: jax.Array | None,
    stream_kernels: Sequence[int],
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Expand sources into streams (Eq. 10). ``x[..., B, T, d]``, ``bank[..., K, d]``.

    Returns ``[..., m, B, T, d]`` in float32, with the leading axes of ``x`` and
    ``bank`` broadcast together (one bank per source).
    """
    x = x.astype(jnp.float32)
    batch, t_len = x.shape[-3], x.shape[-2]
    max_lag = max([0, *stream_kernels])
    masks = segment_lag_masks(segment_ids, t_len, max_lag, batch) if max_lag else None
    streams = []
    offset = 0
    for kernel in stream_kernels:
        if kernel == 0:
            streams.append(x)
            continue
        taps = bank[..., offset : offset + kernel, :].astype(jnp.float32)
        offset += kernel
        streams.append(causal_conv(x, taps, masks[:kernel]))
    return jnp.stack(streams, axis=-4)


def _shift(x: jax.Array, delta: int) -> jax.Array:
    """``out[..., t, :] = x[..., t - delta, :]`` (zero for t < delta)."""
    if delta == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[-2] = (delta, 0)
    return jnp.pad(x, pad)[..., : x.shape[-2], :]


def _unshift(x: jax.Array, delta: int) -> jax.Array:
    """The transpose of ``_shift``: ``out[..., t, :] = x[..., t + delta, :]`` (zero past the end)."""
    if delta == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[-2] = (0, delta)
    return jnp.pad(x, pad)[..., delta:, :]


# How the conv's taps are written: "unrolled" (one shifted product per tap, which XLA fuses into
# one pass over x on a GPU or TPU) or "loop" (a fori_loop over the taps: the same sum in the same
# order, so the same bits, but a constant number of ops whatever the kernel size). None: "loop" on
# the CPU, where compile time dominates (the smoke MSAR train step: about 16k StableHLO ops
# unrolled), "unrolled" elsewhere.
CONV_FORM: str | None = None


def _conv_form() -> str:
    if CONV_FORM is not None:
        if CONV_FORM not in ("unrolled", "loop"):
            raise ValueError(f"CONV_FORM={CONV_FORM!r}: must be 'unrolled', 'loop' or None")
        return CONV_FORM
    return "loop" if platform.current() == "cpu" else "unrolled"


def _lag_view(padded: jax.Array, delta, t_len: int, front: int) -> jax.Array:
    """Rows ``front - delta ... front - delta + t_len - 1`` (axis -2) of ``padded`` (``delta`` may
    be traced): ``_shift(x, delta)`` of an ``x`` padded with ``front`` zero rows in front, or
    ``_unshift(x, delta)`` of one padded behind (``front = 0``, ``delta`` negated by the caller)."""
    return jax.lax.dynamic_slice_in_dim(padded, front - delta, t_len, axis=padded.ndim - 2)


def _pad_rows(x: jax.Array, before: int, after: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[-2] = (before, after)
    return jnp.pad(x, pad)


def _tap(taps: jax.Array, delta) -> jax.Array:
    """``taps[..., delta, None, None, :]`` for a traced ``delta``."""
    return jax.lax.dynamic_index_in_dim(taps, delta, axis=taps.ndim - 2, keepdims=False)[..., None, None, :]


def _mask(masks: jax.Array, delta) -> jax.Array:
    """``masks[delta][..., None]`` for a traced ``delta`` (no negative-index wrap to lower)."""
    return jax.lax.dynamic_index_in_dim(masks, delta, axis=0, keepdims=False)[..., None]


@jax.custom_vjp
def causal_conv(x: jax.Array, taps: jax.Array, masks: jax.Array) -> jax.Array:
    """Causal depthwise conv ``y_t = sum_delta taps[delta] * mask_delta[t] * x[t - delta]``.

    ``x[..., B, T, d]``, ``taps[..., k, d]`` (lag-indexed, leading axes broadcast with
    ``x``'s), ``masks[k, B, T]`` (1 where token ``t - delta`` is in ``t``'s segment).
    The custom backward keeps only the inputs: autodiff of the sum of shifted
    products would store the k shifted copies of ``x``. ``CONV_FORM`` says how the taps
    are written (the same values either way).
    """
    k = taps.shape[-2]
    if _conv_form() == "unrolled":
        y = 0.0
        for delta in range(k):
            y = y + taps[..., delta, None, None, :] * (masks[delta][..., None] * _shift(x, delta))
        return y
    t_len, padded = x.shape[-2], _pad_rows(x, k - 1, 0)

    def add_tap(delta, y):
        return y + _tap(taps, delta) * (_mask(masks, delta) * _lag_view(padded, delta, t_len, k - 1))

    # Lag 0 outside the loop, as the unrolled form writes it: the carry then takes the data's type,
    # manual axes included (inside a pipeline stage's shard_map a fresh zeros carry would not).
    y = 0.0 + taps[..., 0, None, None, :] * (masks[0][..., None] * x)
    return jax.lax.fori_loop(1, k, add_tap, y)


def _causal_conv_fwd(x, taps, masks):
    return causal_conv(x, taps, masks), (x, taps, masks)


def _causal_conv_bwd(res, dy):
    x, taps, masks = res
    k, t_len = taps.shape[-2], x.shape[-2]
    dx = jnp.zeros(jnp.broadcast_shapes(x.shape, dy.shape), dy.dtype)
    lead = taps.ndim - 2  # leading (per-source) axes of taps
    prod_shape = jnp.broadcast_shapes(dy.shape, (*masks.shape[1:], 1), x.shape)
    extra = len(prod_shape) - 3 - lead  # broadcast axes of x not in taps
    reduced = tuple(range(extra)) + (-3, -2)
    if _conv_form() == "unrolled":
        dtaps = []
        for delta in range(k):
            masked = dy * masks[delta][..., None]
            dx = dx + _unshift(taps[..., delta, None, None, :] * masked, delta)
            prod = masked * _shift(x, delta)  # [..., B, T, d]
            dtaps.append(jnp.sum(prod, axis=reduced))
        dtaps = jnp.stack(dtaps, axis=-2)
    else:
        padded = _pad_rows(x, k - 1, 0)

        def add_tap(delta, carry):
            dx, dtaps = carry
            masked = dy * _mask(masks, delta)
            dx = dx + _lag_view(_pad_rows(_tap(taps, delta) * masked, 0, k - 1), -delta, t_len, 0)
            prod = masked * _lag_view(padded, delta, t_len, k - 1)
            return dx, jax.lax.dynamic_update_index_in_dim(dtaps, jnp.sum(prod, axis=reduced), delta, axis=-2)

        # Lag 0 outside the loop (the carry takes the data's manual-axis type, as in the forward);
        # its tap gradient fills every slot of the carry, and the loop overwrites lags 1 ... k-1.
        masked = dy * masks[0][..., None]
        dx = dx + taps[..., 0, None, None, :] * masked
        first = jnp.sum(masked * x, axis=reduced)
        dtaps = jnp.broadcast_to(first[..., None, :], (*first.shape[:-1], k, first.shape[-1]))
        dx, dtaps = jax.lax.fori_loop(1, k, add_tap, (dx, dtaps))
    dx = jnp.sum(dx, axis=tuple(range(dx.ndim - x.ndim))) if dx.ndim > x.ndim else dx
    dtaps = jnp.sum(dtaps, axis=tuple(range(dtaps.ndim - taps.ndim))) if dtaps.ndim > taps.ndim else dtaps
    return dx.reshape(x.shape), dtaps.reshape(taps.shape), jnp.zeros_like(masks)


causal_conv.defvjp(_causal_conv_fwd, _causal_conv_bwd)


def _split_heads(x: jax.Array, heads: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], heads, x.shape[-1] // heads)


def scores(expanded: jax.Array, queries: jax.Array, heads: int, eps: float) -> jax.Array:
    """Scores of expanded sources ``[..., m, B, T, d]`` against ``queries[m, d]``.

    ``s = w . rms(E_r[x])`` per head slice (no 1/sqrt(d), Eq. 8; docs/design.md §3); ``[..., m, B, T, H]``.
    """
    keys = _split_heads(key_rms(expanded, eps), heads)
    q = _split_heads(queries.astype(jnp.float32), heads)  # [m, H, dh]
    return jnp.einsum("...mbthe,mhe->...mbth", keys, q)


def empty_state(shape_mbt: tuple, d: int, heads: int) -> SoftmaxState:
    """The state of a softmax over no sources yet."""
    m_b_t = tuple(shape_mbt)
    return SoftmaxState(
        max=jnp.full((*m_b_t, heads), NEG_LARGE, jnp.float32),
        denom=jnp.zeros((*m_b_t, heads), jnp.float32),
        acc=jnp.zeros((*m_b_t, d), jnp.float32),
    )


def merge(state: SoftmaxState, s: jax.Array, value: jax.Array, include: jax.Array | bool = True) -> SoftmaxState:
    """Fold one source (scores ``s[..., H]``, value ``[..., d]``) into ``state``.

    ``include`` (a boolean, may be traced) leaves the state unchanged when false:
    an empty partial is omitted from the sum and the denominator (docs/design.md §2).
    """
    heads = s.shape[-1]
    s = jnp.where(include, s, NEG_LARGE)
    new_max = jax.lax.stop_gradient(jnp.maximum(state.max, s))  # a shift: no gradient (see phase1)
    keep = jnp.exp(state.max - new_max)
    p = jnp.where(include, jnp.exp(s - new_max), 0.0)
    acc = _split_heads(state.acc, heads) * keep[..., None] + p[..., None] * _split_heads(value, heads)
    return SoftmaxState(
        max=new_max,
        denom=state.denom * keep + p,
        acc=acc.reshape(state.acc.shape),
    )


def finalize(state: SoftmaxState) -> jax.Array:
    """Retrieved streams ``z = acc / denom`` (Eq. 11), ``[..., m, B, T, d]`` float32."""
    heads = state.denom.shape[-1]
    z = _split_heads(state.acc, heads) / state.denom[..., None]
    return z.reshape(state.acc.shape)


def _source_valid(n: int, valid) -> jax.Array:
    if valid is None:
        return jnp.ones((n,), bool)
    return jnp.asarray(valid, bool)


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
) -> SoftmaxState:
    """Phase 1 (the MSAR paper, Sec. 3.4): all completed sources against all targets' queries.

    Args:
      sources: ``[n, B, T, d]`` completed single-stream sources.
      banks: ``[n, K, d]`` the conv bank of each source (``None`` if no conv stream).
      queries: ``[S, m, d]`` the queries of the block's ``S`` targets.
      valid: optional ``[n]`` booleans (may be traced); invalid sources are left out
        of every softmax (a preallocated buffer not yet filled).
    Returns:
      A ``SoftmaxState`` with leading axis ``S``: ``max/denom [S, m, B, T, H]``,
      ``acc [S, m, B, T, d]``. The expanded streams exist only transiently.
    """
    n = sources.shape[0]
    ok = _source_valid(n, valid)
    expanded = expand(sources, banks, stream_kernels, segment_ids)  # [n, m, B, T, d]
    keys = _split_heads(key_rms(expanded, eps), heads)  # [n, m, B, T, H, dh]
    q = _split_heads(queries.astype(jnp.float32), heads)  # [S, m, H, dh]
    s = jnp.einsum("nmbthe,smhe->snmbth", keys, q)
    s = jnp.where(ok[None, :, None, None, None, None], s, NEG_LARGE)
    # The max is a stabilising shift with no gradient (as in flash attention): every consumer
    # of the state is invariant to it, and the closed-form backwards rely on that convention.
    smax = jax.lax.stop_gradient(jnp.max(s, axis=1))
    p = jnp.exp(s - smax[:, None])
    p = jnp.where(ok[None, :, None, None, None, None], p, 0.0)
    denom = jnp.sum(p, axis=1)
    acc = jnp.einsum("snmbth,nmbthe->smbthe", p, _split_heads(expanded, heads))
    return SoftmaxState(max=smax, denom=denom, acc=acc.reshape(*acc.shape[:-2], -1))


def phase2(
    state: SoftmaxState,
    partial: jax.Array,
    bank: jax.Array | None,
    query: jax.Array,
    include_partial: jax.Array | bool = True,
    *,
    stream_kernels: Sequence[int],
    heads: int = 1,
    segment_ids: jax.Array | None = None,
    eps: float = 1e-6,
) -> jax.Array:
    """Phase 2: merge one target's partial source into its phase-1 state.

    ``state`` has no target axis (``[m, B, T, ...]``); ``partial[B, T, d]``,
    ``bank[K, d]``, ``query[m, d]``. Returns the retrieved streams ``[m, B, T, d]``
    (float32). With ``include_partial`` false (the first target of a block) the
    result is phase 1 alone.
    """
    expanded = expand(partial, bank, stream_kernels, segment_ids)  # [m, B, T, d]
    s = scores(expanded, query, heads, eps)
    return finalize(merge(state, s, expanded, include_partial))


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
    """The direct definition (Eq. 11-12): one target's read over ``sources[n, B, T, d]``.

    Returns the retrieved streams ``z[m, B, T, d]`` (float32) and, with
    ``return_weights``, the depth-attention weights ``alpha[n, m, B, T, H]``
    (zero for invalid sources; each (stream, token, head) sums to one).
    """
    n = sources.shape[0]
    ok = _source_valid(n, valid)
    expanded = expand(sources, banks, stream_kernels, segment_ids)  # [n, m, B, T, d]
    s = scores(expanded, query, heads, eps)  # [n, m, B, T, H]
    s = jnp.where(ok[:, None, None, None, None], s, NEG_LARGE)
    alpha = jax.nn.softmax(s, axis=0)
    alpha = jnp.where(ok[:, None, None, None, None], alpha, 0.0)
    z = jnp.einsum("nmbth,nmbthe->mbthe", alpha, _split_heads(expanded, heads))
    z = z.reshape(*z.shape[:-2], -1)
    return (z, alpha) if return_weights else z


def fuse_gate(z: jax.Array, w: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    """mHC-style H_pre stream fusion (Eq. 13-14): ``h = sum_r g_r z^{(r)}``.

    ``g = sigmoid(scale * (rms(flatten(Z)) @ w) + bias)`` with ``z[m, B, T, d]``,
    ``w[m*d, m]``, scalar ``scale``, ``bias[m]``; the rms runs over all ``m*d``
    entries. Returns ``[B, T, d]`` float32.
    """
    m = z.shape[0]
    flat = jnp.moveaxis(z, 0, -2).reshape(*z.shape[1:-1], m * z.shape[-1])  # [B, T, m*d]
    g = jax.nn.sigmoid(scale * (key_rms(flat, eps) @ w.astype(jnp.float32)) + bias)  # [B, T, m]
    return jnp.einsum("btm,mbtd->btd", g, z)


def stream_gate(z: jax.Array, w: jax.Array, scale: jax.Array, bias: jax.Array, eps: float = 1e-6) -> jax.Array:
    """The gate values ``g[B, T, m]`` of ``fuse_gate`` (for introspection)."""
    m = z.shape[0]
    flat = jnp.moveaxis(z, 0, -2).reshape(*z.shape[1:-1], m * z.shape[-1])
    return jax.nn.sigmoid(scale * (key_rms(flat, eps) @ w.astype(jnp.float32)) + bias)


def fuse_mean(z: jax.Array) -> jax.Array:
    """Mean fusion (the w/o H_pre ablation, Table 2 row 7)."""
    return jnp.mean(z, axis=0)


def phase2_fused(
    state: SoftmaxState,
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
    """Phase 2 followed by stream fusion: ``h[B, T, d]`` float32.

    ``gate = (w, scale, bias)`` applies ``fuse_gate`` (H_pre, Eq. 13-14); ``gate=None``
    applies ``fuse_mean``. The fused kernels compute this without writing the ``m``
    retrieved streams.
    """
    z = phase2(
        state, partial, bank, query, include_partial,
        stream_kernels=stream_kernels, heads=heads, segment_ids=segment_ids, eps=eps,
    )
    if gate is None:
        return fuse_mean(z)
    w, scale, bias = gate
    return fuse_gate(z, w, scale, bias, gate_eps)
