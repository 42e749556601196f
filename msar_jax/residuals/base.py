"""The residual-mechanism protocol shared by every mechanism of the MSAR paper (docs/design.md §12).

A mechanism decides what each sublayer reads (``h_l``) and how its output ``v_l`` is recorded; the
stack (``msar_jax.stack``) drives it through pure functions of explicit arrays, per sublayer::

    bctx = begin_block(g, p_block, state, pos)   # at the first sublayer of each block
    h, aux = read(g, p, state, bctx[j], pos, ctx)  # the block's j-th target
    v = f_l(h)
    state = write(g, p, state, v, aux, pos, ctx)
    state = end_block(g, state, pos)              # after the last sublayer of each block

then ``finish(g, state, ctx)`` gives the final hidden state. A decoding step reads one token with
``decode_read``; ``history_tokens`` and ``history_source`` say what it keeps across tokens
(docs/design.md §10). ``DepthState`` holds the append-only
``[N+1, B, T, d]`` summary buffer ``sources`` and the mechanism's ``carry``. A class also states, with
nothing allocated, its config rules (``validate_config``), what crosses a pipeline stage
(``sublayers_per_block``, ``uses_sources``, ``carry_vectors``, ``block_carry``, ``stage_local_carry``;
docs/design.md §13), its closed-form costs (``extra_params``, ``forward_flops``, ``memory_access``;
docs/design.md §15) and its weight-decay groups; no module outside ``residuals/<mechanism>.py`` tests
its name. ``register(name)`` makes a class available as ``model.residual.name = name``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from msar_jax import config as config_lib
from msar_jax.model.layers import SequenceContext


class DepthState(NamedTuple):
    """What flows between sublayers: append-only ``sources`` and a per-step ``carry``."""

    sources: jax.Array | None  # [N+1, B, T, d] block summaries, or None
    carry: Any  # mechanism-specific pytree of float arrays


class Position(NamedTuple):
    """Where sublayer ``l`` sits in the block partition (docs/design.md §2). Values may be traced."""

    sublayer: jax.Array  # l, 1-based
    block: jax.Array  # n, 0-based index of the block B_{n+1} containing l
    index_in_block: jax.Array  # j, 0-based
    first_in_block: jax.Array  # bool: the partial is empty
    n_completed: jax.Array  # completed sources b_0..b_n available: n + 1


def position(l, block_size: int) -> Position:
    """The block position of 1-based sublayer ``l`` for block size ``S``."""
    l = jnp.asarray(l, jnp.int32)
    n = (l - 1) // block_size
    j = (l - 1) % block_size
    return Position(sublayer=l, block=n, index_in_block=j, first_in_block=j == 0, n_completed=n + 1)


class ResidualMechanism(nnx.Module):
    """Base class: holds the mechanism's ``nnx.Param``s and implements the protocol.

    Subclasses set ``per_sublayer`` (names of parameters stacked over the L sublayers;
    every other parameter is global) and override the protocol methods. The defaults
    implement a mechanism with no block structure.
    """

    name: str = ""  # set by ``register``
    per_sublayer: tuple[str, ...] = ()
    # Keeps the append-only buffer of block summaries ``DepthState.sources``.
    uses_sources: bool = False
    # Carry leaves (dict keys) that every block starts from zero, e.g. the partial sum of the
    # current block: a pipeline hop carries them only when a stage boundary falls inside a
    # block. Each is one ``[B, T, d]`` array.
    block_carry: tuple[str, ...] = ()
    # Carry leaves that never cross a pipeline stage: written before they are read in every
    # stage, or read only by ``finish`` on the last stage.
    stage_local_carry: tuple[str, ...] = ()
    # Carry leaves that every sublayer's ``write`` sets without ``read`` or ``write`` using their
    # earlier value (MSAR's ``last``, h_l + v_l): the depth stack's backward restarts each layer
    # from its incoming carry and keeps these out of it (docs/design.md §12).
    sublayer_written_carry: tuple[str, ...] = ()
    # Which of the mechanism's parameter names take weight decay (msar_jax.train.optim says why
    # matrices do and queries, scales and biases do not); every parameter must be in one.
    decayed_params: frozenset[str] = frozenset()
    undecayed_params: frozenset[str] = frozenset()

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        self.d = model_cfg.d_model
        self.n_sublayers = config_lib.n_sublayers(model_cfg)
        self.dtype = jnp.dtype(model_cfg.dtype)
        self.res_cfg = model_cfg.residual
        self.state_dtype = config_lib.state_dtype(model_cfg)  # phase 1's weighted sums (docs/design.md §5)
        # the depth stack keeps each read's output across the backward's re-run (DepthStack)
        self.save_read_outputs = bool(model_cfg.get("save_read_outputs", False))

    # ----- structure -----
    @classmethod
    def sublayers_per_block(cls, res_cfg) -> int:
        """Sublayers per block S; mechanisms without blocks use one transformer layer."""
        return 2

    @property
    def block_size(self) -> int:
        return self.sublayers_per_block(self.res_cfg)

    @property
    def n_blocks(self) -> int:
        return -(-self.n_sublayers // self.block_size)

    def split_params(self, params: dict) -> tuple[dict, dict]:
        """Split a pure parameter dict into (global, stacked-per-sublayer)."""
        glob = {k: v for k, v in params.items() if k not in self.per_sublayer}
        per = {k: v for k, v in params.items() if k in self.per_sublayer}
        return glob, per

    # ----- protocol -----
    def start(self, g: dict, e: jax.Array, ctx: SequenceContext) -> DepthState:
        raise NotImplementedError

    def begin_block(self, g: dict, p_block: dict, state: DepthState, pos: Position, ctx: SequenceContext):
        """Work shared by all targets of a block (two-phase phase 1): a sequence with one
        context per target of the block (``p_block``'s leading axis), or ``None`` if none."""
        return None

    def read(self, g, p, state: DepthState, bctx, pos: Position, ctx: SequenceContext, want_weights: bool = False):
        raise NotImplementedError

    def cut_rerouted_cotangents(self, bctx):
        """``begin_block``'s output as the depth stack's backward hands it to its layers one at a
        time (docs/design.md §12): leaves whose cotangent reaches ``begin_block`` by another route
        wrapped in ``lax.stop_gradient``, so that its backward sees their cotangents as symbolic
        zeros, as it does when the whole block is differentiated at once. The default cuts
        nothing."""
        return bctx

    def write(self, g, p, state: DepthState, v: jax.Array, aux, pos: Position, ctx: SequenceContext) -> DepthState:
        raise NotImplementedError

    def end_block(self, g, state: DepthState, pos: Position) -> DepthState:
        return state

    def block_start_carry(self, carry):
        """The carry every block starts from, if it is known without the data (e.g. an
        empty partial), else ``None``. When known, the stack does not store the carry of
        each block for the backward pass (one ``[B, T, d]`` per block saved)."""
        return None

    def finish(self, g, state: DepthState, ctx: SequenceContext) -> jax.Array:
        raise NotImplementedError

    def weights_shape(self) -> tuple[int, ...] | None:
        """Shape of the token-averaged depth weights ``read`` returns with ``want_weights``."""
        return None

    # ----- decoding: one new token per sequence (docs/design.md §10) -----
    @classmethod
    def history_tokens(cls, model_cfg) -> int:
        """Past token values of one source that each of the L history slots keeps between
        decoding steps; 0 when every depth source is a per-token vector (no depth cache)."""
        return 0

    def history_source(self, g, state: DepthState, pos: Position) -> jax.Array | None:
        """The source ``[B, T, d]`` whose token values history slot ``pos.sublayer - 1`` keeps,
        as it stands at sublayer ``pos.sublayer``'s read; ``None`` when ``history_tokens`` is 0."""
        return None

    def decode_read(self, g, p, state: DepthState, pos: Position, ctx: SequenceContext, history):
        """``read`` of one new token (``T = 1``) without a block context: ``history`` is
        ``[L, B, W, d]``, slot ``i`` the last ``W = history_tokens`` values of the source
        ``history_source`` names at sublayer ``i + 1`` (None when ``W = 0``). The default suits
        mechanisms whose reads never look along tokens."""
        return self.read(g, p, state, None, pos, ctx)

    # ----- what the rest of the library asks of a mechanism (from its config) -----
    @classmethod
    def validate_config(cls, model_cfg, prefix: str = "model") -> None:
        """Raise ``config.ConfigError`` naming ``{prefix}.residual.<field>`` if the residual
        config breaks one of this mechanism's rules. The fields every mechanism shares are
        checked by ``msar_jax.config.validate``, which calls this after them."""

    @classmethod
    def carry_vectors(cls, res_cfg) -> int:
        """``[B, T, d]`` arrays of the carry that cross every pipeline stage boundary (the
        ``block_carry`` and ``stage_local_carry`` leaves and the summaries not counted)."""
        raise NotImplementedError(f"{cls.__name__} does not state its pipeline carry (carry_vectors)")

    @classmethod
    def extra_params(cls, model_cfg) -> dict:
        """Closed-form parameter count of the mechanism: ``{"value": int, "formula": str}``.
        ``accounting.account`` checks it against the model's actual parameters."""
        raise config_lib.ConfigError("model.residual.name", cls.name, "no parameter formula for this mechanism")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase: bool) -> dict:
        """Forward FLOPs per token by component, with ``"total"``, under the conventions of
        ``msar_jax.accounting`` (``two_phase``: the block reads' two-phase form, S > 1)."""
        raise config_lib.ConfigError("model.residual.name", cls.name, "no FLOP estimator for this mechanism")

    @classmethod
    def memory_access(cls, model_cfg) -> tuple[str, float, str]:
        """Forward activation traffic per token per sublayer (Table 6's conventions,
        ``msar_jax.accounting``): ``(symbolic formula, value in units of d, note)``."""
        raise config_lib.ConfigError("model.residual.name", cls.name, "no memory-access model")


_REGISTRY: dict[str, type[ResidualMechanism]] = {}


def register(name: str):
    """Class decorator: make a mechanism available to configs under ``name``."""

    def wrap(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return wrap


def mechanism_class(name: str, field: str = "model.residual.name") -> type[ResidualMechanism]:
    """The class registered under ``name``; ``ConfigError`` naming ``field`` if there is none."""
    if name not in _REGISTRY:
        raise config_lib.ConfigError(field, name, f"unknown residual mechanism; must be one of {registered()}")
    return _REGISTRY[name]


def make_mechanism(model_cfg, rngs: nnx.Rngs) -> ResidualMechanism:
    """Build the mechanism named by ``model_cfg.residual.name``."""
    return mechanism_class(model_cfg.residual.name)(model_cfg, rngs)


def registered() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))
