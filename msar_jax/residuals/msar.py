"""Multi-Stream Attention Residuals (MSAR; the MSAR paper, §3.2-3.4, Eq. 9-17, Appendix C; docs/design.md §4).

Every single-stream source (embedding, completed block summaries, the current block's partial) is
expanded on demand into ``m`` streams by causal depthwise convolutions along tokens (Eq. 9-10);
each stream has its own zero-initialised query and softmax over sources (Eq. 11-12, 17), and an
mHC-style ``H_pre`` gate fuses the retrieved streams (Eq. 13-14). Conv banks, the final merge
``h_L + v_L``, the parameter count (Eq. 20) and the Table 2 ablations by config: docs/design.md
§4.1-§4.6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from msar_jax import config as config_lib
from msar_jax.config import ConfigError
from msar_jax.residuals.attnres import BlockDepthAttention, depth_attention_flops
from msar_jax.residuals.base import DepthState, register
from pallas_kernels.depth_attention import reference as depth_ref


def msar_read(
    sources, banks, queries, gate=None, valid=None, *, kernel_sizes=(4, 8, 12), conv=True,
    segment_ids=None, eps=1e-6, return_weights=False,
):
    """Functional MSAR read of one target (Eq. 10-14) for use inside any model.

    Args:
      sources: ``[n, B, T, d]`` single-stream sources (embedding, summaries, partial).
      banks: ``[n, sum(kernel_sizes), d]`` each source's conv bank (ignored if ``conv=False``).
      queries: ``[m, d]`` the target's per-stream pseudo-queries.
      gate: ``(W[m*d, m], a, b[m])`` for the H_pre gate, or ``None`` for mean fusion.
      valid: optional ``[n]`` mask of the sources that exist.
    Returns:
      ``h[B, T, d]`` (sources' dtype), and with ``return_weights`` the depth weights
      ``alpha[n, m, B, T]`` and the retrieved streams ``z[m, B, T, d]``.
    """
    m = queries.shape[0]
    kernels = (0, *kernel_sizes) if conv else (0,) * m
    z, alpha = depth_ref.depth_read(
        sources, banks if conv else None, queries, valid, stream_kernels=kernels, heads=1,
        segment_ids=segment_ids, eps=eps, return_weights=True,
    )
    h = depth_ref.fuse_mean(z) if gate is None else depth_ref.fuse_gate(z, *gate, eps=eps)
    h = h.astype(sources.dtype)
    return (h, alpha[..., 0], z) if return_weights else h


@register("msar")
class MSAR(BlockDepthAttention):
    # ``last`` (h_l + v_l) is written by every sublayer before the final merge reads it, so it
    # never crosses a stage: the m expanded streams are never formed outside a read either,
    # and a hop carries only single-stream summaries and the partial.
    stage_local_carry = ("last",)
    sublayer_written_carry = ("last",)
    decayed_params = frozenset({"gate_w", "conv_banks"})
    undecayed_params = frozenset({"queries", "gate_a", "gate_b"})

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        super().__init__(model_cfg, rngs)
        cfg, L, d = self.res_cfg, self.n_sublayers, self.d
        m = self.n_streams = cfg.streams
        self.kernel_sizes = tuple(cfg.kernel_sizes) if cfg.conv else ()
        names = ["queries"]
        self.queries = nnx.Param(jnp.zeros((L, m, d), jnp.float32), logical_axes=("sublayers", "streams", "embed"))
        if cfg.fusion == "gate":
            names += ["gate_w", "gate_a", "gate_b"]
            w = jax.random.normal(rngs.params(), (L, m * d, m), jnp.float32) / jnp.sqrt(m * d)
            self.gate_w = nnx.Param(w, logical_axes=("sublayers", "stream_features", "streams"))
            self.gate_a = nnx.Param(jnp.full((L,), cfg.gate_scale_init, jnp.float32), logical_axes=("sublayers",))
            self.gate_b = nnx.Param(jnp.zeros((L, m), jnp.float32), logical_axes=("sublayers", "streams"))
        if self.kernel_sizes:
            k = sum(self.kernel_sizes)
            self.conv_banks = nnx.Param(jnp.zeros((L, k, d), jnp.float32), logical_axes=("sublayers", "taps", "embed"))
        self.per_sublayer = tuple(names)

    @property
    def stream_kernels(self):
        return (0, *self.kernel_sizes) if self.kernel_sizes else (0,) * self.n_streams

    def init_carry(self, e):
        return {"partial": jnp.zeros_like(e), "last": jnp.zeros_like(e)}

    def gate(self, p):
        if self.res_cfg.fusion == "mean":
            return None
        return p["gate_w"], p["gate_a"], p["gate_b"]

    def write(self, g, p, state, v, aux, pos, ctx):
        carry = {**state.carry, "partial": state.carry["partial"] + v, "last": aux["h"] + v}
        return DepthState(state.sources, carry)

    def finish(self, g, state, ctx):
        if self.res_cfg.final_merge == "sum":
            return jnp.sum(state.sources.astype(jnp.float32), axis=0).astype(state.sources.dtype)
        return state.carry["last"]

    @classmethod
    def history_tokens(cls, model_cfg):
        """A conv stream of kernel kappa reads kappa - 1 earlier tokens of its source (Eq. 10),
        so a decoding step keeps, per bank, the last kappa_max - 1 values of the one source the
        bank expands (docs/design.md §10)."""
        res = model_cfg.residual
        return max(res.kernel_sizes) - 1 if res.conv and res.kernel_sizes else 0

    @classmethod
    def validate_config(cls, model_cfg, prefix="model"):
        res, field = model_cfg.residual, f"{prefix}.residual.kernel_sizes"
        kernels = tuple(res.kernel_sizes)
        if not res.conv:
            return
        if len(kernels) != res.streams - 1:
            raise ConfigError(
                field, kernels,
                f"must hold streams - 1 = {res.streams - 1} kernel sizes (one per conv stream; stream 0 is the identity)",
            )
        if kernels and max(kernels) > model_cfg.max_seq_len:
            raise ConfigError(field, kernels, f"a kernel may not exceed max_seq_len = {model_cfg.max_seq_len}")

    @classmethod
    def extra_params(cls, model_cfg):
        """Eq. 20, generalised to the Table 2 ablations: the mixer term is dropped for mean
        fusion and the conv term without convs."""
        res, L, d = model_cfg.residual, config_lib.n_sublayers(model_cfg), model_cfg.d_model
        m = res.streams
        kap = sum(res.kernel_sizes) if res.conv else 0
        mixer = (m * m * d + m + 1) if res.fusion == "gate" else 0
        value = L * (m * d + mixer + kap * d)
        parts = ["m d"]
        parts.append("(m^2 d + m + 1)" if res.fusion == "gate" else "0 [mean fusion]")
        parts.append("d sum(kappa)" if res.conv else "0 [no conv]")
        formula = "L [" + " + ".join(parts) + "]"
        if res.conv and res.fusion == "gate":
            formula += "  = L[(m^2+m+sum kappa) d + m + 1]  [Eq. 20]"
        return dict(value=value, formula=formula)

    @classmethod
    def forward_flops(cls, model_cfg, two_phase):
        res = model_cfg.residual
        return depth_attention_flops(
            config_lib.n_sublayers(model_cfg), model_cfg.d_model, res.block_size, m=res.streams,
            conv_kernels=tuple(res.kernel_sizes) if res.conv else (),
            # without convs the m streams are copies of one source: one key rms per source
            distinct_keys=res.streams if res.conv else 1, heads=1,
            fusion=res.fusion, two_phase=two_phase, final=res.final_merge,
        )

    @classmethod
    def memory_access(cls, model_cfg):
        res = model_cfg.residual
        note = "Table 6 Block MSAR (fused expansion)"
        if not res.conv or res.fusion != "gate":
            note += "; ablation costed with the MSAR formula at its m (m streams still written and read)"
        return "(N/S + 4m + 5)d", cls.summary_reads(model_cfg) + 4.0 * res.streams + 5.0, note
