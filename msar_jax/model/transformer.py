"""The pre-norm decoder with a pluggable residual mechanism (docs/design.md §1, §9).

``Transformer`` is an ``nnx.Module`` that owns every parameter (float32, each with
``logical_axes`` metadata) and whose ``__call__`` is a pure function of them: the
embedding ``e = v_0``, the depth stack of L sublayers driven by the residual
mechanism named in the config, the final RMSNorm (with weight) and the LM head.
Use it functionally at jit boundaries: ``graphdef, params = nnx.split(model, nnx.Param)``
outside, ``nnx.merge(graphdef, params)(tokens)`` inside.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from msar_jax import config as config_lib
from msar_jax.model import layers
from msar_jax.model.layers import SequenceContext
from msar_jax.residuals import make_mechanism
from msar_jax.parallel.logical_axes import constrain
from msar_jax.stack import DepthStack


def pure(module: nnx.Module) -> dict:
    """The module's parameters as a plain nested dict of arrays."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def layer_kinds(cfg) -> tuple[str, ...]:
    """MLP kind of every transformer layer: leading dense layers, then MoE (docs/design.md §9)."""
    if not cfg.moe.enabled:
        return ("dense",) * cfg.n_layers
    k = cfg.moe.n_dense_layers
    return ("dense",) * k + ("moe",) * (cfg.n_layers - k)


class Transformer(nnx.Module):
    def __init__(self, cfg: ml_collections.ConfigDict, rngs: nnx.Rngs):
        config_lib.validate(cfg)
        self.cfg = ml_collections.FrozenConfigDict(cfg)
        cfg = self.cfg
        d, v, std = cfg.d_model, cfg.vocab_size, cfg.init_std
        kinds = layer_kinds(cfg)
        self.embedding = nnx.Param(std * jax.random.normal(rngs.params(), (v, d)), logical_axes=("vocab", "embed"))
        self.attn = layers.AttentionStack(cfg, cfg.n_layers, rngs)
        n_dense, n_moe = kinds.count("dense"), kinds.count("moe")
        self.dense = nnx.data(layers.DenseMLPStack(cfg, n_dense, rngs) if n_dense else None)
        self.moe = nnx.data(layers.MoEStack(cfg, n_moe, rngs) if n_moe else None)
        self.residual = make_mechanism(cfg, rngs)
        self.final_norm = nnx.Param(jnp.ones((d,)), logical_axes=("embed",))
        self.lm_head = nnx.data(None)
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(std * jax.random.normal(rngs.params(), (d, v)), logical_axes=("embed", "vocab"))

    def _sublayer(self, kind, params, h, ctx):
        cfg = self.cfg
        if kind == "attn":
            return layers.attention(params, h, ctx, cfg), jnp.zeros((), jnp.float32)
        if kind == "dense":
            return layers.dense_mlp(params, h, cfg), jnp.zeros((), jnp.float32)
        return layers.moe_mlp(params, h, cfg)

    def _sublayer_prefill(self, kind, params, h, ctx):
        """``_sublayer`` that also returns what a decoding cache keeps of it: the attention's
        rotated keys and values ``[B, T, kv_heads, head_dim]``; None for an MLP."""
        if kind == "attn":
            y, kv = layers.attention(params, h, ctx, self.cfg, return_kv=True)
            return y, jnp.zeros((), jnp.float32), kv
        v, aux = self._sublayer(kind, params, h, ctx)
        return v, aux, None

    def decode_sublayer(self, segment_start):
        """The sublayer function of a one-token decoding step, ``(kind, params, h, ctx, kv) ->
        (v, aux_loss, new_kv)``: attention reads its layer's cache ``kv = (keys, values)``
        (``layers.decode_attention``, the new token seeing positions from ``segment_start[B]``)
        and returns the new token's ``(k, v)``; an MLP returns None."""
        def sublayer(kind, params, h, ctx, kv):
            if kind == "attn":
                y, new_kv = layers.decode_attention(params, h, ctx, *kv, segment_start, self.cfg)
                return y, jnp.zeros((), jnp.float32), new_kv
            v, aux = self._sublayer(kind, params, h, ctx)
            return v, aux, None

        return sublayer

    def stack(self) -> DepthStack:
        return DepthStack(self.residual, self._sublayer, layer_kinds(self.cfg), self.cfg.remat_policy,
                          save_read_outputs=self.cfg.save_read_outputs)

    def __call__(self, tokens, segment_ids=None, positions=None, collect_weights: bool = False):
        """Logits ``[B, T, V]`` (float32) and a dict with ``aux_loss`` (MoE load balance,
        already weighted) and, with ``collect_weights``, per-sublayer depth weights."""
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, sequence length]; got shape {tokens.shape}")
        b, t = tokens.shape
        if t < 1:
            raise ValueError(f"sequence length {t}: must be >= 1")
        if t > cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len = {cfg.max_seq_len}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids shape {segment_ids.shape} must equal tokens shape {tokens.shape}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ctx = SequenceContext(positions=positions, segment_ids=segment_ids)
        hidden, per_sublayer = self.stack()(pure(self.residual), self.layer_params(), self.embed(tokens), ctx,
                                            collect_weights)
        logits = self.head(hidden)
        aux = {"aux_loss": cfg.moe.aux_loss_weight * jnp.sum(per_sublayer["aux_loss"]) if cfg.moe.enabled else 0.0}
        if collect_weights and "depth_weights" in per_sublayer:
            aux["depth_weights"] = per_sublayer["depth_weights"]
        return logits, aux


    def embed(self, tokens) -> jax.Array:
        """The embedding ``e = v_0`` of ``tokens[B, T]``, ``[B, T, d]`` in the activations' dtype."""
        with jax.named_scope("embed"):  # scopes label profiles (benchmarks/profile_step.py)
            e = jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.dtype(self.cfg.dtype))
            return constrain(e, layers.ACT)

    def layer_params(self) -> dict:
        """The backbone's stacked sublayer parameters as pure arrays: ``attn``, ``dense``, ``moe``."""
        out = {"attn": pure(self.attn)}
        if self.dense is not None:
            out["dense"] = pure(self.dense)
        if self.moe is not None:
            out["moe"] = pure(self.moe)
        return out

    def head(self, hidden) -> jax.Array:
        """Final RMSNorm and LM head: float32 logits ``[..., V]`` of ``hidden[..., d]``."""
        with jax.named_scope("lm_head"):
            x = layers.rms_norm(hidden, self.final_norm[...], self.cfg.norm_eps)
            head = self.embedding[...].T if self.lm_head is None else self.lm_head[...]
            return jnp.einsum("...d,dv->...v", x, head.astype(x.dtype), preferred_element_type=jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean next-token cross entropy in nats (float32)."""
    with jax.named_scope("cross_entropy"):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lm_loss(model: Transformer, batch: jax.Array, segment_ids=None) -> tuple[jax.Array, dict]:
    """Loss of a ``[B, T+1]`` token window: next-token cross entropy plus the MoE aux loss."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    seg = None if segment_ids is None else segment_ids[:, :-1]
    logits, aux = model(inputs, segment_ids=seg)
    ce = cross_entropy(logits, targets)
    return ce + aux["aux_loss"], {"cross_entropy": ce, "aux_loss": aux["aux_loss"]}
