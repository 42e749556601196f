"""Standard residual: h_{l+1} = h_l + v_l, h_1 = e (the MSAR paper, Eq. 1-2; docs/design.md §1)."""

from __future__ import annotations

import jax

from msar_jax.residuals.base import DepthState, ResidualMechanism, register


def vanilla_read(h: jax.Array) -> jax.Array:
    """The functional read of a standard residual: the running sum itself."""
    return h


@register("vanilla")
class Vanilla(ResidualMechanism):
    """No parameters; the carry is the running hidden state."""

    def start(self, g, e, ctx):
        return DepthState(sources=None, carry=e)

    def read(self, g, p, state, bctx, pos, ctx, want_weights=False):
        return vanilla_read(state.carry), None

    def write(self, g, p, state, v, aux, pos, ctx):
        return DepthState(sources=None, carry=state.carry + v)

    def finish(self, g, state, ctx):
        return state.carry

    @classmethod
    def carry_vectors(cls, res_cfg):
        return 1  # the running hidden state

    @classmethod
    def extra_params(cls, model_cfg):
        return dict(value=0, formula="0")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase):
        # The backbone's residual adds are not counted (Appendix C lists only the projections,
        # causal attention and the LM head), so Vanilla is the zero of every overhead.
        return dict(total=0.0)

    @classmethod
    def memory_access(cls, model_cfg):
        return "3d", 3.0, "Table 6"
