"""Multi-Head Attention Residuals (MHAR, from the MHAR paper; docs/design.md §8).

AttnRes with the query and the sources split into ``H`` contiguous channel heads of
width ``d/H``: the key is the rms over the full ``d`` (no learnable weight, for
parameter parity), then sliced; each head has its own softmax over sources and
mixes only its slice. ``H = 1`` is exactly AttnRes. Same final read as AttnRes.
"""

from __future__ import annotations

from msar_jax.config import ConfigError
from msar_jax.residuals.attnres import AttnRes
from msar_jax.residuals.base import register


@register("mhar")
class MHAR(AttnRes):
    @property
    def heads(self) -> int:  # type: ignore[override]
        return self.res_cfg.heads

    @classmethod
    def validate_config(cls, model_cfg, prefix="model"):
        heads = model_cfg.residual.heads
        if model_cfg.d_model % heads:
            raise ConfigError(f"{prefix}.residual.heads", heads,
                              f"must divide d_model = {model_cfg.d_model} (MHAR channel heads)")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase, heads=None):
        # The H heads split the dot products (the same 2d per source in all) and multiply the
        # softmax scalars by H.
        return super().forward_flops(model_cfg, two_phase, heads=model_cfg.residual.heads)

    @classmethod
    def memory_access(cls, model_cfg):
        symbolic, value, note = super().memory_access(model_cfg)
        return symbolic, value, note + "; MHAR: same traffic as AttnRes (heads split channels)"
