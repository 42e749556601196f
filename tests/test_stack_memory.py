"""The depth stack's backward holds one layer's residuals at a time (docs/design.md §12).

The append-only scan's backward walks a unit's layers in reverse, re-running each from the carry
that entered it. A unit of a Block variant has S/2 layers; re-running the whole unit at once held
all of their residuals (at `base`, S = 8: four layers' attention scores, 42.2 GiB of temporaries for
AttnRes against 22.6 with the walk, H200 compile). Here a toy sublayer keeps one large [B, T, F]
residual (F = 64 d), so the compiled temporaries show how many layers' residuals are live at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import oracles
from msar_jax.model.layers import SequenceContext
from msar_jax.residuals.base import make_mechanism
from msar_jax.stack import DepthStack

B, T, D, F, LAYERS = 2, 64, 16, 1024, 8
RESIDUAL_BYTES = B * T * F * 4  # one sublayer's [B, T, F] float32 hidden activation


def _wide_sublayer(kind, params, h, ctx):
    """``tanh(h W1) W2`` with ``W1: [d, F]``: its backward needs the ``[B, T, F]`` activation."""
    return jnp.tanh(h @ params["w1"]) @ params["w2"], jnp.zeros((), jnp.float32)


def _temporaries(name: str, block_size: int) -> int:
    cfg = oracles.library_config(name, LAYERS, D, block_size=block_size)
    mech = make_mechanism(cfg, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    mech_params = oracles.randomize_params(nnx.to_pure_dict(nnx.state(mech, nnx.Param)), rng, D)
    layer_params = {k: {"w1": rng.standard_normal((LAYERS, D, F)).astype(np.float32) / np.sqrt(D),
                        "w2": rng.standard_normal((LAYERS, F, D)).astype(np.float32) / np.sqrt(F)}
                    for k in ("attn", "dense")}
    stack = DepthStack(mech, _wide_sublayer, ("dense",) * LAYERS)
    ctx = SequenceContext(jnp.broadcast_to(jnp.arange(T), (B, T)), None)
    e = rng.standard_normal((B, T, D)).astype(np.float32)

    def loss(mp, lp, x):
        return jnp.sum(stack(mp, lp, x, ctx)[0] ** 2)

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(mech_params, layer_params, e).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", ["attnres", "msar"])
def test_backward_holds_one_layer_of_residuals(name):
    """S = 8 (units of four layers) needs about the temporaries of S = 2 (units of one layer):
    a re-run of the whole unit would add three layers' residuals (six [B, T, F] activations)."""
    four, one = _temporaries(name, 8), _temporaries(name, 2)
    assert four - one < 2 * RESIDUAL_BYTES, (name, four, one, RESIDUAL_BYTES)
