"""Manifold-constrained Hyper-Connections (mHC; Xie et al. 2025; the MSAR paper, Eq. 3-5; docs/design.md §6).

State ``X[B, T, m, d]`` per token starts as m copies of the embedding. Per sublayer::

    x = flatten(X);  mix = (x @ phi) / sqrt(mean(x^2) + 1e-6)
    H_pre = sigmoid(a_pre mix[:m] + b[:m]);  H_post = 2 sigmoid(a_post mix[m:2m] + b[m:2m])
    C = SinkhornKnopp(a_res mix[2m:] + b[2m:]) (20 passes);  H_res = C^T
    h = sum_i H_pre_i X_i;  X' = H_res X + H_post v^T

Final hidden = sum_i X_i (docs/design.md §6, a decision the papers leave open). Parameters per sublayer:
``md(m^2+2m) + m^2+2m + 3`` (Appendix C Eq. 19). All coefficient maths in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from msar_jax import accounting
from msar_jax import config as config_lib
from msar_jax.residuals.base import DepthState, ResidualMechanism, register

SINKHORN_EPS = 1e-6


def sinkhorn(logits: jax.Array, iters: int, eps: float = SINKHORN_EPS) -> jax.Array:
    """Sinkhorn-Knopp as in DeepSeek's reference (docs/design.md §6); ``logits[..., m, m]``.

    Pass 1: a max-subtracted row softmax (+eps), then a column normalisation; passes
    2..iters: row then column normalisation, ``eps`` in every denominator. The
    returned ``C`` has columns summing to one (up to eps); apply ``H_res = C^T``.
    Rematerialised: unrolled autodiff would store ~40 m^2 floats per token.

    Passes 2..iters run in a ``fori_loop``, not a Python loop: each normalisation reads ``c``
    twice (numerator and sum), so an unrolled chain of 40 of them invites XLA:GPU's fusion to
    duplicate producers into huge kernels. With the unrolled form the first ``small`` mHC
    train step did not finish within 7 minutes on the H200 (twice; compiles in 15 s on CPU);
    with the loop the whole 300-step run takes 55 s there. The loop body is a fusion
    boundary and the trip count is static, so reverse mode still works.
    """

    def one_pass(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    @jax.checkpoint
    def run(x):
        c = jax.nn.softmax(x, axis=-1) + eps
        c = c / (jnp.sum(c, axis=-2, keepdims=True) + eps)
        return jax.lax.fori_loop(0, iters - 1, one_pass, c)

    return run(logits.astype(jnp.float32))


def mhc_coefficients(p: dict, x_state: jax.Array, iters: int):
    """H_pre ``[B,T,m]``, H_post ``[B,T,m]`` and C ``[B,T,m,m]`` from the state ``X[B,T,m,d]``."""
    b, t, m, d = x_state.shape
    x = x_state.astype(jnp.float32).reshape(b, t, m * d)
    inv_rms = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    mix = (x @ p["phi"]) * inv_rms  # [B, T, m^2 + 2m]
    a_pre, a_post, a_res = p["scale"][0], p["scale"][1], p["scale"][2]
    h_pre = jax.nn.sigmoid(a_pre * mix[..., :m] + p["bias"][:m])
    h_post = 2.0 * jax.nn.sigmoid(a_post * mix[..., m : 2 * m] + p["bias"][m : 2 * m])
    res = (a_res * mix[..., 2 * m :] + p["bias"][2 * m :]).reshape(b, t, m, m)
    return h_pre, h_post, sinkhorn(res, iters)


def mhc_read(p: dict, x_state: jax.Array, iters: int = 20):
    """Functional mHC read: ``h = sum_i H_pre_i X_i`` plus (H_post, C) for the write."""
    h_pre, h_post, c = mhc_coefficients(p, x_state, iters)
    h = jnp.einsum("btm,btmd->btd", h_pre, x_state.astype(jnp.float32))
    return h.astype(x_state.dtype), (h_post, c)


def mhc_write(x_state: jax.Array, v: jax.Array, coeffs) -> jax.Array:
    """``X'_i = sum_j C[j, i] X_j + H_post_i v`` (H_res = C^T)."""
    h_post, c = coeffs
    xf = x_state.astype(jnp.float32)
    new = jnp.einsum("btji,btjd->btid", c, xf) + h_post[..., None] * v.astype(jnp.float32)[:, :, None, :]
    return new.astype(x_state.dtype)


def mhc_flops(L: int, d: int, m: int, iters: int) -> dict:
    """Forward FLOPs per token of mHC by component (``msar_jax.accounting``'s conventions):
    per sublayer the ``md`` rms, the projection, the coefficient affines, sigmoids and Sinkhorn
    passes, and applying ``H_pre``, ``H_res`` and ``H_post`` (``252 d`` plus scalars at m = 4);
    the final ``sum_i X_i`` adds ``(m-1) d``."""
    w = m * m + 2 * m
    per = dict(
        norm=3 * m * d,
        projection=2 * m * d * w,
        coefficients=2 * w + accounting.SIGMOID * 2 * m + m * m + iters * 4 * m * m,  # affine, sigmoids, Sinkhorn
        apply_pre=2 * m * d,
        apply_res=2 * m * m * d,
        apply_post=2 * m * d,
    )
    out = {k: float(L * v) for k, v in per.items()}
    out["final"] = float((m - 1) * d)
    out["total"] = sum(out.values())
    return out


@register("mhc")
class MHC(ResidualMechanism):
    per_sublayer = ("phi", "bias", "scale")
    decayed_params = frozenset({"phi"})
    undecayed_params = frozenset({"bias", "scale"})

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        super().__init__(model_cfg, rngs)
        m, d, L = self.res_cfg.streams, self.d, self.n_sublayers
        self.m = m
        width = m * m + 2 * m
        self.phi = nnx.Param(
            jax.random.normal(rngs.params(), (L, m * d, width), jnp.float32) / jnp.sqrt(m * d),
            logical_axes=("sublayers", "stream_features", None),
        )
        self.bias = nnx.Param(jnp.zeros((L, width), jnp.float32), logical_axes=("sublayers", None))
        self.scale = nnx.Param(
            jnp.full((L, 3), self.res_cfg.gate_scale_init, jnp.float32), logical_axes=("sublayers", None)
        )

    def start(self, g, e, ctx):
        return DepthState(sources=None, carry=jnp.repeat(e[:, :, None, :], self.m, axis=2))

    def read(self, g, p, state, bctx, pos, ctx, want_weights=False):
        return mhc_read(p, state.carry, self.res_cfg.sinkhorn_iters)

    def write(self, g, p, state, v, aux, pos, ctx):
        return DepthState(sources=None, carry=mhc_write(state.carry, v, aux))

    def finish(self, g, state, ctx):
        return jnp.sum(state.carry.astype(jnp.float32), axis=2).astype(state.carry.dtype)

    @classmethod
    def carry_vectors(cls, res_cfg):
        return res_cfg.streams  # the m-stream state X

    @classmethod
    def extra_params(cls, model_cfg):
        L, d, m = config_lib.n_sublayers(model_cfg), model_cfg.d_model, model_cfg.residual.streams
        w = m * m + 2 * m
        return dict(value=L * (m * d * w + w + 3), formula="L [md(m^2+2m) + m^2+2m + 3]  [Eq. 19]")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase):
        res = model_cfg.residual
        return mhc_flops(config_lib.n_sublayers(model_cfg), model_cfg.d_model, res.streams, res.sinkhorn_iters)

    @classmethod
    def memory_access(cls, model_cfg):
        return "(8m + 2)d", 8.0 * model_cfg.residual.streams + 2.0, "Table 6"
