"""Block attention residuals: AttnRes (Kimi Team 2026; the MSAR paper, Eq. 6-8; docs/design.md §2, §3, §5).

``BlockDepthAttention`` is the shared machinery of every depth-attention residual
(AttnRes, MHAR, MSAR and the AttnRes half of the hybrid): the preallocated buffer
of block summaries ``b_0..b_N``, the current block's partial sum, the direct read
and the two-phase read (docs/design.md §5) through ``pallas_kernels.depth_attention`` (the
seam where the Pallas kernels plug in). Subclasses choose the streams
(``stream_kernels``), the channel heads and the stream fusion.

AttnRes: one zero-initialised pseudo-query per sublayer, ``score_i = w_l . rms(k_i)``
(no 1/sqrt(d)), softmax over sources, ``h_l = sum_i alpha_i source_i``; a final
read with query ``w_{L+1}`` over ``[b_0..b_N]`` gives the final hidden (docs/design.md §3).
Parameters: ``(L+1) d`` (Appendix C Eq. 19).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from msar_jax import accounting
from msar_jax import config as config_lib
from msar_jax.parallel import kernel_sharding
from msar_jax.residuals.base import DepthState, Position, ResidualMechanism, register
from pallas_kernels.depth_attention import api as depth_api
from pallas_kernels.depth_attention import heuristics as depth_heuristics
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


def _with_zero_bank(banks: jax.Array | None) -> jax.Array | None:
    """``banks[N, K, d]`` with a zero bank appended for ``b_N`` (never expanded); ``None`` stays ``None``."""
    return None if banks is None else jnp.concatenate([banks, jnp.zeros_like(banks[:1])], axis=0)


def _recomputed(read_fn, *args, batch_axes, out_batch_axis, chunks: int = 1, segment_ids=None,
                lean_vjp: bool = False, kernel: bool = False):
    """Run a depth read so the backward pass recomputes it instead of storing its
    expanded streams and normalised keys (m times the sources): the XLA path's
    counterpart of the kernels' recomputing backward (§3.4 of the MSAR paper).

    ``batch_axes``: each argument's batch axis (an ``int``, ``None`` or one per leaf;
    ``kernel_sharding.leaf_batch_axes``); ``out_batch_axis``: the output's, an ``int`` or a
    pytree prefix of the output; ``segment_ids`` (``[B, T]``) has it first.

    ``kernel``: ``read_fn`` runs a Pallas kernel (``depth_api.runs_a_kernel``). Under a mesh the
    read then runs inside a ``shard_map`` over the batch axes (``kernel_sharding.over_batch``):
    XLA cannot partition a kernel. The chunks below are then slices of each device's rows.

    ``lean_vjp``: ``read_fn``'s own ``custom_vjp`` already keeps only its inputs (and a few
    floats per token; ``depth_api.keeps_only_inputs``), so with one chunk it runs as is: a
    ``jax.checkpoint`` around it would add nothing but a third run of its forward kernels in the
    backward of the block (the block's own re-run, ``stack._append_only_bwd``, is the second).

    With ``chunks > 1`` the batch is processed in that many sequential slices, each
    rematerialised on its own, which bounds the transient memory of the read to
    ``1 / chunks`` (``model.residual.kernel_overrides.read_chunks``; reads are independent per row).
    """
    if kernel and kernel_sharding.needs_shard_map():
        local = functools.partial(_recomputed, read_fn, batch_axes=batch_axes, out_batch_axis=out_batch_axis,
                                  chunks=chunks, lean_vjp=lean_vjp)
        return kernel_sharding.over_batch(lambda seg, *a: local(*a, segment_ids=seg), (segment_ids, *args),
                                          (0, *batch_axes), out_batch_axis)
    remat = lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)  # noqa: E731
    if chunks == 1:
        if lean_vjp:
            return read_fn(*args, segment_ids=segment_ids)
        return remat(lambda *a: read_fn(*a, segment_ids=segment_ids))(*args)
    if not isinstance(out_batch_axis, int):
        raise ValueError(f"read_chunks = {chunks} needs one output batch axis, not {out_batch_axis!r}")
    leaves, treedef = jax.tree.flatten(args)
    axes = kernel_sharding.leaf_batch_axes(args, batch_axes)
    batch = next(x.shape[ax] for x, ax in zip(leaves, axes) if ax is not None)
    if batch % chunks:
        raise ValueError(f"model.residual.kernel_overrides.read_chunks = {chunks}: must divide the batch rows "
                         f"each device reads, {batch}")

    def split(x, ax):
        x = jnp.moveaxis(x, ax, 0)
        return x.reshape(chunks, x.shape[0] // chunks, *x.shape[1:])

    chunked = [split(x, ax) for x, ax in zip(leaves, axes) if ax is not None]
    seg = None if segment_ids is None else split(segment_ids, 0)

    def one(inp):
        sliced, seg_c = inp
        it = iter(sliced)
        rebuilt = [next(it) if ax is not None else x for x, ax in zip(leaves, axes)]
        a = jax.tree.unflatten(treedef, [jnp.moveaxis(x, 0, ax) if ax is not None else x for x, ax in zip(rebuilt, axes)])
        return read_fn(*a, segment_ids=seg_c)

    out = jax.lax.map(remat(one), (chunked, seg))

    def merge(y):
        y = jnp.moveaxis(y, 0, out_batch_axis)  # [.., chunks, B/chunks, ..]
        return y.reshape(*y.shape[:out_batch_axis], -1, *y.shape[out_batch_axis + 2 :])

    return jax.tree.map(merge, out)


def depth_attention_flops(
    L: int, d: int, S: int, *, m: int, conv_kernels: tuple[int, ...], distinct_keys: int, heads: int,
    fusion: str, two_phase: bool, final: str,
) -> dict:
    """Forward FLOPs per token of a block depth-attention residual (AttnRes, MHAR, MSAR) by
    component, under ``msar_jax.accounting``'s conventions (its module docstring gives every
    term). ``final``: ``"read"`` (AttnRes's final read over ``b_0..b_N``), ``"residual"``
    (``h_L + v_L``) or ``"sum"`` (the sum of the N+1 sources)."""
    expand = 2 * d * sum(conv_kernels)  # per source, all conv streams (identity free)
    key_rms = distinct_keys * 3 * d  # per source
    score = m * 2 * d  # per (target, source)
    aggregate = m * 2 * d
    softmax = m * heads * accounting.SOFTMAX
    out = dict(expansion=0.0, key_norm=0.0, scoring=0.0, softmax=0.0, aggregation=0.0, merge=0.0,
               fusion=0.0, accumulation=0.0, final=0.0)
    blocks = [(s, min(s + S - 1, L)) for s in range(1, L + 1, S)]
    for bi, (lo, hi) in enumerate(blocks):
        c = bi + 1  # completed sources b_0..b_bi
        n_targets = hi - lo + 1
        if two_phase:
            out["expansion"] += c * expand
            out["key_norm"] += c * key_rms
        for l in range(lo, hi + 1):
            partial = l != lo
            n_src = c + partial
            if not two_phase:
                out["expansion"] += c * expand
                out["key_norm"] += c * key_rms
            if partial:
                out["expansion"] += expand
                out["key_norm"] += key_rms
                if two_phase:
                    out["merge"] += m * d  # online-softmax rescale of the phase-1 accumulator
            out["scoring"] += n_src * score
            out["softmax"] += n_src * softmax
            out["aggregation"] += n_src * aggregate + m * d  # + divide by the denominator
            if m > 1:
                if fusion == "gate":
                    out["fusion"] += 3 * m * d + 2 * m * d * m + (2 + accounting.SIGMOID) * m + 2 * m * d
                else:
                    out["fusion"] += m * d
        out["accumulation"] += n_targets * d
    if final == "read":  # AttnRes final read over b_0..b_N (direct)
        n = len(blocks) + 1
        out["final"] = n * (key_rms + score + aggregate + softmax) + d
    elif final == "residual":
        out["final"] = d
    elif final == "sum":
        out["final"] = len(blocks) * d
    out["total"] = sum(out.values())
    return out


class BlockDepthAttention(ResidualMechanism):
    """Depth attention over block summaries with a partial of the current block."""

    uses_sources = True
    block_carry = ("partial",)
    n_streams: int = 1
    heads: int = 1

    @classmethod
    def sublayers_per_block(cls, res_cfg) -> int:
        return res_cfg.block_size

    @classmethod
    def carry_vectors(cls, res_cfg):
        return 0  # only the summaries and, inside a block, the partial cross a stage

    @classmethod
    def summary_reads(cls, model_cfg) -> float:
        """``N/S`` of Table 6: phase 1's read of the completed summaries, averaged over depth
        and amortised over the S targets of a block."""
        return config_lib.n_blocks(model_cfg) / model_cfg.residual.block_size

    @property
    def stream_kernels(self) -> tuple[int, ...]:
        return (0,)

    @property
    def implementation(self):
        impl = self.res_cfg.implementation
        return None if impl == "auto" else impl

    def _kw(self):
        return dict(stream_kernels=self.stream_kernels, heads=self.heads, eps=self.res_cfg.eps)

    def _read_chunks(self) -> int:
        """Batch slices of each read (``model.residual.kernel_overrides.read_chunks``, 1 unless an
        experiment sets it)."""
        return self.res_cfg.kernel_overrides.get("read_chunks") or 1

    def _config(self, op) -> depth_heuristics.OpConfig:
        """``op``'s kernel config, chosen from what this mechanism is (``heuristics.choose``)."""
        return depth_heuristics.choose(
            op.__name__, stream_kernels=self.stream_kernels, implementation=self.implementation,
            save_read_outputs=self.save_read_outputs, read_chunks=self._read_chunks(),
            overrides=self.res_cfg.kernel_overrides)

    def _lean_vjp(self, op) -> bool:
        """Run ``op`` without a checkpoint: it runs a Pallas kernel whose backward keeps only its
        inputs. That removes a third run of each read's forward kernels per step on the GPU
        (docs/kernels.md). The XLA path keeps its checkpoint: its ops keep
        only their inputs too, but without the checkpoint the CPU suite's model tests ran about
        20% slower (``test_grad_accum``'s MSAR case 65 -> 79 s), and it is untimed on the GPU."""
        return depth_api.runs_a_kernel(self.implementation) and depth_api.keeps_only_inputs(
            op.__name__, self.implementation)

    def _runs_a_kernel(self) -> bool:
        """Whether this mechanism's reads run Pallas kernels here (under a mesh they then run in a
        ``shard_map``, ``kernel_sharding``); the XLA path is partitioned by XLA itself."""
        return depth_api.runs_a_kernel(self.implementation)

    def _value_channel(self) -> bool:
        """Pair each target's phase-1 state with a ``ValueChannel`` (``depth_api.phase1``) for its
        phase-2 read, where ``heuristics.choose`` says it pays."""
        return self._config(depth_api.phase1).value_channel

    def cut_rerouted_cotangents(self, bctx):
        # With the value channel, phase 2's Pallas backward returns each state's value cotangent
        # through the channel and none to ``acc`` (one stream, mean fusion, ``h`` in the
        # channel's dtype: ``heuristics.choose`` turns the channel on only then). Phase 1's
        # backward takes the channel's factored form only when ``acc``'s cotangent is a symbolic
        # zero (``vjp._merge_channel_cotangents``), which a cotangent that crossed the stack's
        # per-layer ``jax.vjp`` no longer is.
        if bctx is None or not self._value_channel():
            return bctx
        return tuple((state._replace(acc=jax.lax.stop_gradient(state.acc)), channel) for state, channel in bctx)

    def _target(self, bctx):
        """One target's block context as ``(state, value channel or None)``."""
        return bctx if self._value_channel() else (bctx, None)

    def _op(self, op):
        kw = self._kw()
        if self.implementation != "xla":  # the kernels' options (the XLA path has none)
            kw.update(self._config(op).options())
        return functools.partial(op, implementation=self.implementation, **kw)

    # ----- banks: a source uses the bank of the newest output it contains (Appendix C) -----
    def source_banks(self, g) -> jax.Array | None:
        """Bank of every buffer entry: ``b_j`` uses bank ``j*S`` (``b_0`` bank 0); ``b_N`` is never expanded."""
        return _with_zero_bank(self.summary_banks(g))

    def summary_banks(self, g) -> jax.Array | None:
        """The banks of ``b_0..b_{N-1}``: ``source_banks`` less the zero bank of ``b_N``."""
        if "conv_banks" not in g:
            return None
        return g["conv_banks"][:: self.block_size][: self.n_blocks]

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
        # Full mode (S = 1) runs the same two phases: phase 1 of the one target over the
        # completed sources, phase 2 (partial empty) only finalises and fuses; that keeps the
        # fused gate's recomputing backward (``phase2_fused``) on every read.
        if not self.res_cfg.two_phase:
            return None
        # One state per target (``depth_api.phase1(per_target=True)``): the Pallas kernels write
        # and take each target's ``[m, B, T, d]`` state as its own array. A stacked
        # ``[S, m, B, T, d]`` state made XLA copy each target's slice out before its phase-2 read
        # and stack the cotangents back: on the H200, `base` step, MSAR 2175.1 ms stacked against
        # 2093.9 per target (same tiles), AttnRes 1075.1 against 1051.7 (docs/kernels.md; the
        # per-target mixing and stream-cotangent kernels need the 64-channel chunks of
        # ``tiling.choose_tiles``: at 128 they ran up to 71% slower).
        # A bf16 state (``model.residual.state_dtype``; "auto" with bf16 activations) stores the
        # weighted sums in half the bytes (``api.phase1``).
        channel = self._value_channel()
        # Per target: the state's leaves [m, B, T, ...], the value channel's values [B, T, d] and scale [m, B, T, H].
        out_axes = tuple((1, depth_ref.ValueChannel(0, 1)) for _ in range(p_block["queries"].shape[0])) if channel else 1
        phase1 = functools.partial(self._op(depth_api.phase1), per_target=True, value_channel=channel,
                                   state_dtype=self.state_dtype)
        # ``b_N``'s zero bank is appended inside the read (inside the kernels' ``shard_map`` under
        # a mesh), so the banks' cotangent that leaves it (summed over the batch devices) is
        # ``[N, K, d]``, not ``[N + 1, K, d]`` cut to its first N rows after the sum. Under FSDP
        # the TPU compiler (libtpu 0.0.48) fuses that cut with the FSDP slice of the summed
        # cotangent into a reduce-scatter of the wrong shape and fails (``RET_CHECK ...
        # CompatibleIgnoringFpPrecision``, `small` on v5e:2x2 with fsdp=4).
        return _recomputed(
            lambda sources, banks, *rest, **kw: phase1(sources, _with_zero_bank(banks), *rest, **kw), state.sources,
            self.summary_banks(g), p_block["queries"], self._completed_valid(pos), batch_axes=(1, None, None, None),
            out_batch_axis=out_axes, chunks=self._read_chunks(), segment_ids=ctx.segment_ids,
            lean_vjp=self._lean_vjp(depth_api.phase1), kernel=self._runs_a_kernel(),
        )

    def retrieve(self, g, p, state, bctx, pos, ctx, want_weights=False):
        """The ``m`` retrieved streams ``z[m, B, T, d]`` (float32) and optional weights."""
        partial = state.carry["partial"]
        include_partial = jnp.logical_not(pos.first_in_block)
        if bctx is not None and not want_weights:
            z = _recomputed(
                self._op(depth_api.phase2), self._target(bctx)[0], partial, self.partial_bank(g, pos), p["queries"], include_partial,
                batch_axes=((1, 1, 1), 0, None, None, None), out_batch_axis=1,
                chunks=self._read_chunks(), segment_ids=ctx.segment_ids, lean_vjp=self._lean_vjp(depth_api.phase2),
                kernel=self._runs_a_kernel(),
            )
            return z, None
        sources = jnp.concatenate([state.sources, partial[None]], axis=0)
        banks = self.source_banks(g)
        if banks is not None:
            banks = jnp.concatenate([banks, self.partial_bank(g, pos)[None]], axis=0)
        valid = jnp.concatenate([self._completed_valid(pos), include_partial[None]])
        if want_weights:
            z, alpha = depth_ref.depth_read(
                sources, banks, p["queries"], valid, return_weights=True, segment_ids=ctx.segment_ids, **self._kw()
            )
            return z, jnp.mean(alpha, axis=(2, 3, 4))  # [N+2, m]
        z = _recomputed(
            self._op(depth_api.depth_read), sources, banks, p["queries"], valid, batch_axes=(1, None, None, None),
            out_batch_axis=1, chunks=self._read_chunks(), segment_ids=ctx.segment_ids,
            lean_vjp=self._lean_vjp(depth_api.depth_read),
            # No kernel implements the direct read (``depth_api`` registers phase 1 and phase 2):
            # it is the XLA path on every platform, which XLA partitions itself.
            kernel=False,
        )
        return z, None

    def gate(self, p) -> tuple | None:
        """``(W, a, b)`` of the H_pre stream gate (Eq. 13-14), or ``None`` for the mean over
        streams (with one stream, AttnRes and MHAR, the mean is the stream itself)."""
        return None

    def fuse(self, p, z):
        gate = self.gate(p)
        if gate is None:
            return depth_ref.fuse_mean(z)
        return depth_ref.fuse_gate(z, *gate, eps=self.res_cfg.eps)

    def read(self, g, p, state, bctx, pos, ctx, want_weights=False):
        dtype = state.carry["partial"].dtype
        if bctx is not None and not want_weights:
            # Phase 2 and the stream fusion in one op: the m retrieved streams are never an
            # output, and its backward recomputes them in closed form (xla_streaming). ``h`` comes
            # out in the activations' dtype (computed in float32, rounded once, as the cast below
            # would): the kernels then write bf16 ``h`` and read a bf16 cotangent, not float32.
            target_state, channel = self._target(bctx)
            fused = functools.partial(self._op(depth_api.phase2_fused), gate_eps=self.res_cfg.eps, out_dtype=dtype)
            # The channel is an argument (not bound in the partial): its values [B, T, d] and
            # scale [m, B, T, H] are split over the batch with the state under a mesh.
            h = _recomputed(
                lambda st, pa, bank, q, inc, gate, chan, segment_ids: fused(
                    st, pa, bank, q, inc, gate, value_channel=chan, segment_ids=segment_ids),
                target_state, state.carry["partial"], self.partial_bank(g, pos), p["queries"],
                jnp.logical_not(pos.first_in_block), self.gate(p), channel,
                batch_axes=((1, 1, 1), 0, None, None, None, None, None if channel is None else (0, 1)),
                out_batch_axis=0, chunks=self._read_chunks(), segment_ids=ctx.segment_ids,
                lean_vjp=self._lean_vjp(depth_api.phase2_fused), kernel=self._runs_a_kernel(),
            ).astype(dtype)
            return h, {"h": h, "weights": None}
        z, weights = self.retrieve(g, p, state, bctx, pos, ctx, want_weights)
        h = self.fuse(p, z).astype(dtype)
        return h, {"h": h, "weights": weights}

    def write(self, g, p, state, v, aux, pos, ctx):
        return DepthState(state.sources, {**state.carry, "partial": state.carry["partial"] + v})

    def block_start_carry(self, carry):
        # Every block starts with an empty partial; MSAR's "last" is written before it is
        # read in every block, so its incoming value does not matter either.
        return jax.tree.map(jnp.zeros_like, carry)

    def end_block(self, g, state, pos):
        sources = jax.lax.dynamic_update_index_in_dim(state.sources, state.carry["partial"], pos.block + 1, axis=0)
        carry = {**state.carry, "partial": jnp.zeros_like(state.carry["partial"])}
        return DepthState(sources, carry)

    def weights_shape(self):
        return (self.n_blocks + 2, self.n_streams)

    # ----- decoding (docs/design.md §10) -----
    def history_source(self, g, state, pos):
        """Slot ``l - 1`` keeps the source bank ``l - 1`` expands (§4.1): at a block's first
        sublayer the newest summary ``b_n`` (bank ``nS``; ``b_0 = e``, bank 0), else the partial
        ``b_n^{<l}``. Only a mechanism with conv streams keeps history."""
        if max(self.stream_kernels) <= 1:  # no stream looks back a token
            return None
        summary = jax.lax.dynamic_index_in_dim(state.sources, pos.block, keepdims=False)
        return jnp.where(pos.first_in_block, summary, state.carry["partial"])

    def decode_read(self, g, p, state, pos, ctx, history):
        """The direct read (Eq. 11-12, 17) of one token over ``b_0..b_n`` and the partial, each
        source expanded at the new token from its history window (Eq. 10), then fused.

        A one-token read runs in XLA: ``T = 1`` leaves nothing for a tiled kernel to reuse."""
        partial = state.carry["partial"]
        dtype = partial.dtype
        sources = jnp.concatenate([state.sources, partial[None]], axis=0)  # [N+2, B, 1, d]
        valid = jnp.concatenate([self._completed_valid(pos), jnp.logical_not(pos.first_in_block)[None]])
        banks = self.source_banks(g)
        if banks is None:
            expanded = depth_ref.expand(sources, None, self.stream_kernels)  # [N+2, m, B, 1, d]
        else:
            banks = jnp.concatenate([banks, self.partial_bank(g, pos)[None]], axis=0)
            window = sources
            if history is not None:
                # Summary b_j's window is slot jS; b_N is never expanded (its bank is zero); the
                # partial's is slot l - 1.
                past = history[:: self.block_size][: self.n_blocks]
                past = jnp.concatenate([past, jnp.zeros_like(past[:1]),
                                        jax.lax.dynamic_index_in_dim(history, pos.sublayer - 1)], axis=0)
                window = jnp.concatenate([past.astype(dtype), sources], axis=2)
            expanded = expand_newest(window, banks, self.stream_kernels)
        s = depth_ref.scores(expanded, p["queries"], self.heads, self.res_cfg.eps)  # [N+2, m, B, 1, H]
        ok = valid[:, None, None, None, None]
        alpha = jnp.where(ok, jax.nn.softmax(jnp.where(ok, s, depth_ref.NEG_LARGE), axis=0), 0.0)
        heads = expanded.reshape(*expanded.shape[:-1], self.heads, -1)
        z = jnp.einsum("nmbth,nmbthe->mbthe", alpha, heads).reshape(expanded.shape[1:])
        h = self.fuse(p, z).astype(dtype)
        return h, {"h": h, "weights": None}


def expand_newest(window, banks, stream_kernels):
    """Eq. 10 at the newest token only: ``window[n, B, W + 1, d]`` holds each source's last
    ``W + 1`` token values, oldest first (zero before the sequence or document start),
    ``banks[n, K, d]``. Returns ``[n, m, B, 1, d]`` float32, what ``depth_ref.expand`` gives at
    the last token. Products and sums elementwise in float32 (no matmul: its precision would
    depend on the platform)."""
    x = window.astype(jnp.float32)
    lagged = x[..., ::-1, :]  # [n, B, W + 1, d], lag delta first
    streams, offset = [], 0
    for kernel in stream_kernels:
        if kernel == 0:
            streams.append(x[..., -1, :])
            continue
        taps = banks[:, offset : offset + kernel, :].astype(jnp.float32)  # [n, k, d], lag-indexed
        offset += kernel
        streams.append(jnp.sum(taps[:, None] * lagged[..., :kernel, :], axis=-2))
    return jnp.stack(streams, axis=1)[..., None, :]


@register("attnres")
class AttnRes(BlockDepthAttention):
    """Block AttnRes (S = block_size; S = 1 is Full AttnRes)."""

    per_sublayer = ("queries",)
    undecayed_params = frozenset({"queries", "final_query"})

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        super().__init__(model_cfg, rngs)
        L, d = self.n_sublayers, self.d
        self.queries = nnx.Param(jnp.zeros((L, 1, d), jnp.float32), logical_axes=("sublayers", "streams", "embed"))
        self.final_query = nnx.Param(jnp.zeros((d,), jnp.float32), logical_axes=("embed",))

    def finish(self, g, state, ctx):
        return attnres_read(state.sources, g["final_query"], heads=self.heads, eps=self.res_cfg.eps)

    @classmethod
    def extra_params(cls, model_cfg):
        L, d = config_lib.n_sublayers(model_cfg), model_cfg.d_model
        return dict(value=(L + 1) * d, formula="(L+1) d  [Eq. 19]")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase, heads: int = 1):
        return depth_attention_flops(
            config_lib.n_sublayers(model_cfg), model_cfg.d_model, model_cfg.residual.block_size, m=1,
            conv_kernels=(), distinct_keys=1, heads=heads, fusion="gate", two_phase=two_phase, final="read")

    @classmethod
    def memory_access(cls, model_cfg):
        return "(N/S + 5)d", cls.summary_reads(model_cfg) + 5.0, "Table 6 Block AttnRes"
