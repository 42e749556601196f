"""Residual mechanisms, one file each, behind the protocol in ``base.py``.

``register(name)`` adds a mechanism class under a config name; ``mechanism_class(name)`` looks
one up. Functional depth reads for use in any model: ``vanilla_read``, ``mhc_read``/``mhc_write``,
``attnres_read`` (also MHAR with ``heads``), ``msar_read``.
"""

from msar_jax.residuals import attnres, hybrid, mhar, mhc, msar, vanilla  # noqa: F401  (registration)
from msar_jax.residuals.attnres import AttnRes, BlockDepthAttention, attnres_read
from msar_jax.residuals.base import (
    DepthState, Position, ResidualMechanism, make_mechanism, mechanism_class, position, register, registered,
)
from msar_jax.residuals.hybrid import AttnResMHC
from msar_jax.residuals.mhar import MHAR
from msar_jax.residuals.mhc import MHC, mhc_read, mhc_write, sinkhorn
from msar_jax.residuals.msar import MSAR, msar_read
from msar_jax.residuals.vanilla import Vanilla, vanilla_read

__all__ = [
    "AttnRes", "AttnResMHC", "BlockDepthAttention", "DepthState", "MHAR", "MHC", "MSAR", "Position",
    "ResidualMechanism", "Vanilla", "attnres_read", "make_mechanism", "mechanism_class", "mhc_read", "mhc_write",
    "msar_read", "position", "register", "registered", "sinkhorn", "vanilla_read",
]
