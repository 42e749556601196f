"""AttnRes + mHC hybrid (Table 2 row 4; docs/design.md §7).

Keeps both states: the AttnRes block summaries (with its own block size) and the
mHC ``m``-stream state. Layer input = AttnRes read + mHC ``H_pre`` read; after the
sublayer, ``v_l`` is added to the AttnRes partial and written into the mHC state.
Final hidden = AttnRes final read + ``sum_i X_i`` (docs/design.md §7, a decision the papers leave open).
"""

from __future__ import annotations

from flax import nnx

from msar_jax import config as config_lib
from msar_jax.residuals.attnres import AttnRes
from msar_jax.residuals.base import DepthState, ResidualMechanism, register
from msar_jax.residuals.mhc import MHC


@register("attnres_mhc")
class AttnResMHC(ResidualMechanism):
    uses_sources = True
    block_carry = AttnRes.block_carry  # the AttnRes partial; mHC's X crosses every stage
    decayed_params = AttnRes.decayed_params | MHC.decayed_params
    undecayed_params = AttnRes.undecayed_params | MHC.undecayed_params

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        super().__init__(model_cfg, rngs)
        self.attnres = AttnRes(model_cfg, rngs)
        self.mhc = MHC(model_cfg, rngs)

    @classmethod
    def sublayers_per_block(cls, res_cfg):
        return AttnRes.sublayers_per_block(res_cfg)

    def split_params(self, params):
        ga, pa = self.attnres.split_params(params["attnres"])
        gm, pm = self.mhc.split_params(params["mhc"])
        return {"attnres": ga, "mhc": gm}, {"attnres": pa, "mhc": pm}

    @staticmethod
    def _parts(state):
        return DepthState(state.sources, state.carry[0]), DepthState(None, state.carry[1])

    def start(self, g, e, ctx):
        a, m = self.attnres.start(g["attnres"], e, ctx), self.mhc.start(g["mhc"], e, ctx)
        return DepthState(a.sources, (a.carry, m.carry))

    def begin_block(self, g, p_block, state, pos, ctx):
        a, _ = self._parts(state)
        return self.attnres.begin_block(g["attnres"], p_block["attnres"], a, pos, ctx)

    def cut_rerouted_cotangents(self, bctx):
        return self.attnres.cut_rerouted_cotangents(bctx)

    def read(self, g, p, state, bctx, pos, ctx, want_weights=False):
        a, m = self._parts(state)
        h_a, aux_a = self.attnres.read(g["attnres"], p["attnres"], a, bctx, pos, ctx, want_weights)
        h_m, aux_m = self.mhc.read(g["mhc"], p["mhc"], m, None, pos, ctx)
        return h_a + h_m, {"attnres": aux_a, "mhc": aux_m, "weights": aux_a["weights"]}

    def decode_read(self, g, p, state, pos, ctx, history):
        a, m = self._parts(state)
        h_a, aux_a = self.attnres.decode_read(g["attnres"], p["attnres"], a, pos, ctx, history)
        h_m, aux_m = self.mhc.decode_read(g["mhc"], p["mhc"], m, pos, ctx, history)
        return h_a + h_m, {"attnres": aux_a, "mhc": aux_m, "weights": aux_a["weights"]}

    def write(self, g, p, state, v, aux, pos, ctx):
        a, m = self._parts(state)
        a = self.attnres.write(g["attnres"], p["attnres"], a, v, aux["attnres"], pos, ctx)
        m = self.mhc.write(g["mhc"], p["mhc"], m, v, aux["mhc"], pos, ctx)
        return DepthState(a.sources, (a.carry, m.carry))

    def end_block(self, g, state, pos):
        a, m = self._parts(state)
        a = self.attnres.end_block(g["attnres"], a, pos)
        return DepthState(a.sources, (a.carry, m.carry))

    def finish(self, g, state, ctx):
        a, m = self._parts(state)
        return self.attnres.finish(g["attnres"], a, ctx) + self.mhc.finish(g["mhc"], m, ctx)

    def weights_shape(self):
        return self.attnres.weights_shape()

    @classmethod
    def carry_vectors(cls, res_cfg):
        return AttnRes.carry_vectors(res_cfg) + MHC.carry_vectors(res_cfg)

    @classmethod
    def extra_params(cls, model_cfg):
        a, m = AttnRes.extra_params(model_cfg), MHC.extra_params(model_cfg)
        return dict(value=a["value"] + m["value"], formula=f"{a['formula']} + {m['formula']}")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase):
        L, d = config_lib.n_sublayers(model_cfg), model_cfg.d_model
        out = {f"attnres.{k}": v for k, v in AttnRes.forward_flops(model_cfg, two_phase).items() if k != "total"}
        out.update({f"mhc.{k}": v for k, v in MHC.forward_flops(model_cfg, two_phase).items() if k != "total"})
        out["sum_reads"] = float(L * d + d)  # adding the two reads per sublayer, and the two finals
        out["total"] = sum(out.values())
        return out

    @classmethod
    def memory_access(cls, model_cfg):
        (sa, va, _), (sm, vm, _) = AttnRes.memory_access(model_cfg), MHC.memory_access(model_cfg)
        return f"{sa} + {sm}", va + vm, "hybrid = Block AttnRes + mHC (project decision; Table 6 has no row)"
