"""Multi-Head Attention Residuals (MHAR, seed 004; SPEC 8).

AttnRes with the query and the sources split into ``H`` contiguous channel heads of
width ``d/H``: the key is the rms over the full ``d`` (no learnable weight, for
parameter parity), then sliced; each head has its own softmax over sources and
mixes only its slice. ``H = 1`` is exactly AttnRes. Same final read as AttnRes.
"""

from __future__ import annotations

from msar_jax.residuals.attnres import AttnRes
from msar_jax.residuals.base import register


@register("mhar")
class MHAR(AttnRes):
    @property
    def heads(self) -> int:  # type: ignore[override]
        return self.res_cfg.heads
