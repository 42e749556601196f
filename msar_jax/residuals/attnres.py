"""Block attention residuals: AttnRes (Kimi Team 2026; seed 000 Eq. 6-8; SPEC 2-3, 5).

``BlockDepthAttention`` is the shared machinery of every depth-attention residual
(AttnRes, MHAR, MSAR and the AttnRes half of the hybrid): the preallocated buffer
of block summaries ``b_0..b_N``, the current block's partial sum, the direct read
and the two-phase read (SPEC 5) through ``pallas_kernels.depth_attention`` (the
seam where the Pallas kernels plug in). Subclasses choose the streams
(``stream_kernels``), the channel heads and the stream fusion.

AttnRes: one zero-initialised pseudo-query per sublayer, ``score_i = w_l . rms(k_i)``
(no 1/sqrt(d)), softmax over sources, ``h_l = sum_i alpha_i source_i``; a final
read with query ``w_{L+1}`` over ``[b_0..b_N]`` gives the final hidden (SPEC 3).
Parameters: ``(L+1) d`` (Appendix C Eq. 19).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from msar_jax.residuals.base import DepthState, Position, ResidualMechanism, register
from pallas_kernels.depth_attention import api as depth_api
from pallas_kernels.depth_attention import reference as depth_ref


def attnres_read(sources, query, valid=None, *, heads=1, eps=1e-6, return_weights=False):
    """Functional AttnRes/MHAR read (Eq. 6-8): ``sources[n, B, T, d]``, ``query[d]``.

    Returns ``h[B, T, d]`` in the sources' dtype (and ``alpha[n, B, T, H]``).
    """
    out = depth_ref.depth_read(
        sources, None, query[None], valid, stream_kernels=(0,), heads=heads, eps=eps, return_weights=return_weights
    )
    z, alpha = out if return_weights else (out, None)
    h = z[0].astype(sources.dtype)
    return (h, alpha[:, 0]) if return_weights else h


class BlockDepthAttention(ResidualMechanism):
    """Depth attention over block summaries with a partial of the current block."""

    uses_sources = True
    n_streams: int = 1
    heads: int = 1

    @property
    def block_size(self) -> int:
        return self.res_cfg.block_size

    @property
    def stream_kernels(self) -> tuple[int, ...]:
        return (0,)

    @property
    def implementation(self):
        impl = self.res_cfg.implementation
        return None if impl == "auto" else impl

    def _kw(self, ctx):
        return dict(stream_kernels=self.stream_kernels, heads=self.heads, segment_ids=ctx.segment_ids, eps=self.res_cfg.eps)

    # ----- banks: a source uses the bank of the newest output it contains (Appendix C) -----
    def source_banks(self, g) -> jax.Array | None:
        """Bank of every buffer entry: ``b_j`` uses bank ``j*S`` (``b_0`` bank 0); ``b_N`` is never expanded."""
        if "conv_banks" not in g:
            return None
        banks = g["conv_banks"][:: self.block_size][: self.n_blocks]
        return jnp.concatenate([banks, jnp.zeros_like(banks[:1])], axis=0)

    def partial_bank(self, g, pos: Position) -> jax.Array | None:
        """The partial ``p_l`` uses bank ``l - 1``."""
        if "conv_banks" not in g:
            return None
        return jax.lax.dynamic_index_in_dim(g["conv_banks"], pos.sublayer - 1, keepdims=False)

    # ----- protocol -----
    def init_carry(self, e):
        return {"partial": jnp.zeros_like(e)}

    def start(self, g, e, ctx):
        sources = jnp.zeros((self.n_blocks + 1, *e.shape), e.dtype).at[0].set(e)
        return DepthState(sources=sources, carry=self.init_carry(e))

    def _completed_valid(self, pos: Position) -> jax.Array:
        return jnp.arange(self.n_blocks + 1) < pos.n_completed

    def begin_block(self, g, p_block, state, pos, ctx):
        if not self.res_cfg.two_phase or self.block_size == 1:
            return None
        return depth_api.phase1(
            state.sources, self.source_banks(g), p_block["queries"], self._completed_valid(pos),
            implementation=self.implementation, **self._kw(ctx),
        )

    def retrieve(self, g, p, state, bctx, pos, ctx, want_weights=False):
        """The ``m`` retrieved streams ``z[m, B, T, d]`` (float32) and optional weights."""
        partial = state.carry["partial"]
        include_partial = jnp.logical_not(pos.first_in_block)
        if bctx is not None and not want_weights:
            z = depth_api.phase2(
                bctx, partial, self.partial_bank(g, pos), p["queries"], include_partial,
                implementation=self.implementation, **self._kw(ctx),
            )
            return z, None
        sources = jnp.concatenate([state.sources, partial[None]], axis=0)
        banks = self.source_banks(g)
        if banks is not None:
            banks = jnp.concatenate([banks, self.partial_bank(g, pos)[None]], axis=0)
        valid = jnp.concatenate([self._completed_valid(pos), include_partial[None]])
        z, alpha = depth_ref.depth_read(sources, banks, p["queries"], valid, return_weights=True, **self._kw(ctx))
        weights = jnp.mean(alpha, axis=(2, 3, 4)) if want_weights else None  # [N+2, m]
        return z, weights

    def fuse(self, p, z):
        return z[0]

    def read(self, g, p, state, bctx, pos, ctx, want_weights=False):
        z, weights = self.retrieve(g, p, state, bctx, pos, ctx, want_weights)
        h = self.fuse(p, z).astype(state.carry["partial"].dtype)
        return h, {"h": h, "weights": weights}

    def write(self, g, p, state, v, aux, pos, ctx):
        return DepthState(state.sources, {**state.carry, "partial": state.carry["partial"] + v})

    def end_block(self, g, state, pos):
        sources = jax.lax.dynamic_update_index_in_dim(state.sources, state.carry["partial"], pos.block + 1, axis=0)
        carry = {**state.carry, "partial": jnp.zeros_like(state.carry["partial"])}
        return DepthState(sources, carry)

    def weights_shape(self):
        return (self.n_blocks + 2, self.n_streams)


@register("attnres")
class AttnRes(BlockDepthAttention):
    """Block AttnRes (S = block_size; S = 1 is Full AttnRes)."""

    per_sublayer = ("queries",)

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        super().__init__(model_cfg, rngs)
        L, d = self.n_sublayers, self.d
        self.queries = nnx.Param(jnp.zeros((L, 1, d), jnp.float32), logical_axes=("sublayers", "streams", "embed"))
        self.final_query = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=("embed",))

    def finish(self, g, state, ctx):
        return attnres_read(state.sources, g["final_query"], heads=self.heads, eps=self.res_cfg.eps)
