"""Backbone sublayers as pure functions of stacked parameters (docs/design.md §9).

Each ``f_l(h) = out_proj(op(RMSNorm_l(h)))`` includes its own pre-norm (notation of docs/design.md §1).
Parameters live in ``nnx.Param``s stacked over layers (leading ``layers`` axis,
see ``Backbone``); the stack code slices one layer's pure arrays and calls
``attention``, ``dense_mlp`` or ``moe_mlp`` on them. Intermediates are tagged with
``checkpoint_name`` so a remat policy can be chosen by name.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from msar_jax.parallel import kernel_sharding
from msar_jax.parallel.logical_axes import constrain

ACT = ("batch", "length", "embed")


class SequenceContext(NamedTuple):
    """Per-token integer metadata shared by every sublayer (a pytree)."""

    positions: jax.Array  # [B, T] int32
    segment_ids: jax.Array | None  # [B, T] int32, or None for one sequence per row


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with a weight, computed in float32, returned in ``x.dtype``."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (rotate-half form) on ``x[B, T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * freq  # [B, T, half]
    cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(p: dict, h: jax.Array, ctx: SequenceContext, cfg, return_kv: bool = False):
    """Grouped-query causal self-attention with RoPE; packed segments never attend across.

    With ``return_kv`` also the rotated keys and the values ``[B, T, kv_heads, head_dim]`` (a
    prefill fills the decoding cache with them, ``msar_jax.inference.decode``)."""
    dtype = h.dtype
    x = rms_norm(h, p["norm"], cfg.norm_eps)
    q = checkpoint_name(jnp.einsum("btd,dnh->btnh", x, p["wq"].astype(dtype)), "attn_q")
    k = checkpoint_name(jnp.einsum("btd,dkh->btkh", x, p["wk"].astype(dtype)), "attn_k")
    v = checkpoint_name(jnp.einsum("btd,dkh->btkh", x, p["wv"].astype(dtype)), "attn_v")
    q = rope(q, ctx.positions, cfg.rope_theta)
    k = rope(k, ctx.positions, cfg.rope_theta)
    mask = None
    if ctx.segment_ids is not None:
        same = ctx.segment_ids[:, :, None] == ctx.segment_ids[:, None, :]
        mask = same[:, None, :, :]  # [B, 1, T, T]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=1.0 / math.sqrt(q.shape[-1]))
    out = checkpoint_name(out, "attn_context")
    y = jnp.einsum("btnh,nhd->btd", out, p["wo"].astype(dtype))
    y = constrain(checkpoint_name(y, "attn_out"), ACT)
    return (y, (k, v)) if return_kv else y


def decode_attention(p: dict, h: jax.Array, ctx: SequenceContext, keys: jax.Array, values: jax.Array,
                     segment_start: jax.Array, cfg):
    """``attention`` of one new token per row against a cache.

    ``h[B, 1, d]``; ``ctx.positions[B, 1]`` the new token's position, which is also the number of
    cached tokens before it; ``keys``/``values[B, M, kv_heads, head_dim]`` the cache (rotated keys),
    of which the new token sees positions ``segment_start[b] <= s < positions[b]`` (its own
    document: the segment mask of ``attention``) and itself. Query head ``n`` reads kv head
    ``n // (heads / kv_heads)``, as ``jax.nn.dot_product_attention`` groups them. Returns the
    output ``[B, 1, d]`` and the new token's ``(k, v)`` ``[B, 1, kv_heads, head_dim]``; the
    caller writes them into the cache.
    """
    dtype = h.dtype
    x = rms_norm(h, p["norm"], cfg.norm_eps)
    q = jnp.einsum("btd,dnh->btnh", x, p["wq"].astype(dtype))
    k = jnp.einsum("btd,dkh->btkh", x, p["wk"].astype(dtype))
    v = jnp.einsum("btd,dkh->btkh", x, p["wv"].astype(dtype))
    q = rope(q, ctx.positions, cfg.rope_theta)
    k = rope(k, ctx.positions, cfg.rope_theta)
    b, _, n_heads, head_dim = q.shape
    n_kv, max_len = keys.shape[2], keys.shape[1]
    q = q.reshape(b, n_kv, n_heads // n_kv, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    # Scores in float32, probabilities rounded to the activations' dtype before the value
    # product: what jax.nn.dot_product_attention's XLA path does in the full forward.
    s_cache = jnp.einsum("bkgh,bskh->bkgs", q, keys.astype(dtype), preferred_element_type=jnp.float32) * scale
    s_self = jnp.einsum("bkgh,bkh->bkg", q, k[:, 0], preferred_element_type=jnp.float32)[..., None] * scale
    slot = jnp.arange(max_len)[None, :]
    seen = (slot >= segment_start[:, None]) & (slot < ctx.positions[:, :1])  # [B, M]
    logits = jnp.concatenate([jnp.where(seen[:, None, None, :], s_cache, -jnp.inf), s_self], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
    out = jnp.einsum("bkgs,bskh->bkgh", probs[..., :max_len], values.astype(dtype),
                     preferred_element_type=jnp.float32)
    out = (out + probs[..., max_len:].astype(jnp.float32) * v[:, 0, :, None, :].astype(jnp.float32)).astype(dtype)
    y = jnp.einsum("btnh,nhd->btd", out.reshape(b, 1, n_heads, head_dim), p["wo"].astype(dtype))
    return y, (k, v)


def _swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    dtype = x.dtype
    hidden = jax.nn.silu(x @ w_gate.astype(dtype)) * (x @ w_up.astype(dtype))
    hidden = checkpoint_name(hidden, "mlp_hidden")
    return hidden @ w_down.astype(dtype)


def dense_mlp(p: dict, h: jax.Array, cfg) -> jax.Array:
    """SwiGLU MLP sublayer."""
    x = rms_norm(h, p["norm"], cfg.norm_eps)
    return constrain(checkpoint_name(_swiglu(x, p["w_gate"], p["w_up"], p["w_down"]), "mlp_out"), ACT)


def _routed_experts(p: dict, x: jax.Array, moe) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The routed experts of ``moe_mlp`` on the rows ``x[b, t, d]`` (normed): the output and the
    rows' routing statistics, ``[1, E]`` each: assignments per expert and summed router
    probabilities (summed over row shards by the caller for the load-balance loss)."""
    dtype = x.dtype
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    probs = jax.nn.softmax(flat.astype(jnp.float32) @ p["router"], axis=-1)  # [bt, E]
    top_p, top_e = jax.lax.top_k(probs, moe.top_k)  # [bt, k]

    assign = top_e.reshape(-1)  # [bt*k]
    order = jnp.argsort(assign, stable=True)
    token_of = order // moe.top_k
    routed_in = flat[token_of]  # tokens grouped by expert
    group_sizes = jnp.bincount(assign, length=moe.n_routed_experts).astype(jnp.int32)
    gate = jax.lax.ragged_dot(routed_in, p["experts_gate"].astype(dtype), group_sizes)
    up = jax.lax.ragged_dot(routed_in, p["experts_up"].astype(dtype), group_sizes)
    hidden = checkpoint_name(jax.nn.silu(gate) * up, "moe_hidden")
    routed_out = jax.lax.ragged_dot(hidden, p["experts_down"].astype(dtype), group_sizes)  # [bt*k, d]
    weights = top_p.reshape(-1)[order].astype(dtype)
    out = jnp.zeros_like(flat).at[token_of].add(routed_out * weights[:, None])
    return out.reshape(b, t, d), group_sizes[None], jnp.sum(probs, axis=0)[None]


def moe_mlp(p: dict, h: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """DeepSeekMoE-style sublayer: shared experts plus top-k routed experts.

    Softmax router over all experts; the top-k probabilities (not renormalised) weight
    the routed experts (docs/design.md §9, a decision the papers leave open). Routed tokens
    are grouped by expert and run through ``jax.lax.ragged_dot``, so each token costs only
    its k experts. Returns the output and the load-balance loss ``E * sum_e f_e * P_e``
    (f_e: fraction of routed assignments to expert e, P_e: mean router probability of e).

    Routing is per token, so under a mesh whose batch axes split the rows the dispatch
    (router, grouping, experts, scatter back) runs per row shard in a ``shard_map`` over those
    axes (``kernel_sharding.over_batch``), the expert weights all-gathered as FSDP does for
    any layer. Left to XLA, the grouping's gather is over the global batch's ``B*T*k`` rows on
    every device: ``[1048576, 2560]`` bf16, 5 GiB a chip, for paper_28b's 64 rows x 2048 x
    top-8 on 64 chips. ``f_e`` and ``P_e`` are the global batch's: each shard's counts and
    probability sums are summed over the shards.
    """
    moe = cfg.moe
    b, t, d = h.shape
    x = rms_norm(h, p["norm"], cfg.norm_eps)
    experts = {name: p[name] for name in ("router", "experts_gate", "experts_up", "experts_down")}
    out, counts, prob_sums = kernel_sharding.over_batch(
        functools.partial(_routed_experts, moe=moe), (experts, x), (None, 0), 0, manual_batch_axes_only=True)

    if moe.n_shared_experts:
        flat = x.reshape(b * t, d)
        out = out + _swiglu(flat, p["shared_gate"], p["shared_up"], p["shared_down"]).reshape(b, t, d)

    frac = jnp.sum(counts, axis=0).astype(jnp.float32) / (b * t * moe.top_k)
    aux = moe.n_routed_experts * jnp.sum(frac * (jnp.sum(prob_sums, axis=0) / (b * t)))
    return constrain(checkpoint_name(out, "mlp_out"), ACT), aux


def _param(rngs: nnx.Rngs, shape, axes, std, fan_in_axis=None):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), logical_axes=axes)


class AttentionStack(nnx.Module):
    """Attention parameters of ``n`` layers, stacked on a leading ``layers`` axis."""

    def __init__(self, cfg, n: int, rngs: nnx.Rngs):
        d, nh, nk, hd, std = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.init_std
        self.norm = nnx.Param(jnp.ones((n, d)), logical_axes=("layers", "embed"))
        self.wq = _param(rngs, (n, d, nh, hd), ("layers", "embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (n, d, nk, hd), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (n, d, nk, hd), ("layers", "embed", "kv_heads", "head_dim"), std)
        self.wo = _param(rngs, (n, nh, hd, d), ("layers", "heads", "head_dim", "embed"), std)


class DenseMLPStack(nnx.Module):
    """SwiGLU MLP parameters of ``n`` layers."""

    def __init__(self, cfg, n: int, rngs: nnx.Rngs):
        d, f, std = cfg.d_model, cfg.mlp_dim, cfg.init_std
        self.norm = nnx.Param(jnp.ones((n, d)), logical_axes=("layers", "embed"))
        self.w_gate = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), std)
        self.w_up = _param(rngs, (n, d, f), ("layers", "embed", "mlp"), std)
        self.w_down = _param(rngs, (n, f, d), ("layers", "mlp", "embed"), std)


class MoEStack(nnx.Module):
    """MoE MLP parameters of ``n`` layers: router, routed experts, shared experts."""

    def __init__(self, cfg, n: int, rngs: nnx.Rngs):
        moe, d, std = cfg.moe, cfg.d_model, cfg.init_std
        e, fe = moe.n_routed_experts, moe.expert_dim
        self.norm = nnx.Param(jnp.ones((n, d)), logical_axes=("layers", "embed"))
        self.router = _param(rngs, (n, d, e), ("layers", "embed", "experts"), std)
        self.experts_gate = _param(rngs, (n, e, d, fe), ("layers", "experts", "embed", "mlp"), std)
        self.experts_up = _param(rngs, (n, e, d, fe), ("layers", "experts", "embed", "mlp"), std)
        self.experts_down = _param(rngs, (n, e, fe, d), ("layers", "experts", "mlp", "embed"), std)
        if moe.n_shared_experts:
            fs = moe.shared_expert_dim * moe.n_shared_experts
            self.shared_gate = _param(rngs, (n, d, fs), ("layers", "embed", "mlp"), std)
            self.shared_up = _param(rngs, (n, d, fs), ("layers", "embed", "mlp"), std)
            self.shared_down = _param(rngs, (n, fs, d), ("layers", "mlp", "embed"), std)
