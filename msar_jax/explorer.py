"""The logic behind ``notebooks/``: the MSAR read explainer, activation capture, depth patterns.

The notebooks stay thin; everything they compute lives here and is tested through them.
``explain`` takes one MSAR read (Eq. 10-12) apart per source row and token, with the library's
own ``msar_read`` and ``expand``, on a ``SyntheticScene`` or a ``CapturedScene`` (the real reads of
a trained Block MSAR); the rest trains tiny runs, restores checkpoints and plots depth patterns
(Figure 4). The formulas and every helper by notebook: notebooks/README.md, "The logic behind
them".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from msar_jax.residuals.msar import msar_read
from pallas_kernels.depth_attention import reference as depth_ref

STREAM_NAMES_DEFAULT = ("identity", "conv-4", "conv-8", "conv-12")


def stream_names(kernel_sizes: Sequence[int], m: int | None = None) -> list[str]:
    """``["identity", "conv-4", ...]``; ``kernel_sizes=()`` (no-conv ablation) gives m identities."""
    if not kernel_sizes:
        return ["identity"] * (m or 1)
    return ["identity", *[f"conv-{k}" for k in kernel_sizes]]


# --------------------------------------------------------------------------------------
# One read, and its explanation.
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class ReadInputs:
    """Everything one MSAR target read sees, for one sequence.

    ``sources[n, T, d]``, ``banks[n, sum(kernel_sizes), d]`` (``None`` without conv),
    ``queries[m, d]``, ``valid[n]`` (bool), ``gate`` ``(W[m*d, m], a, b[m])`` or ``None`` (mean
    fusion); ``h[T, d]`` is what the model itself computed for this read, if known.
    """

    sources: np.ndarray
    banks: np.ndarray | None
    queries: np.ndarray
    valid: np.ndarray
    gate: tuple | None = None
    kernel_sizes: tuple[int, ...] = (4, 8, 12)
    eps: float = 1e-6
    source_labels: list[str] | None = None
    target_label: str = ""
    tokens: np.ndarray | None = None  # [T] token ids (for labels)
    h: np.ndarray | None = None

    @property
    def n_sources(self) -> int:
        return self.sources.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.sources.shape[1]

    @property
    def stream_kernels(self) -> tuple[int, ...]:
        return (0, *self.kernel_sizes) if self.kernel_sizes else (0,) * self.queries.shape[0]

    @property
    def labels(self) -> list[str]:
        return self.source_labels or [f"v{i}" for i in range(self.n_sources)]

    def with_source(self, row: int, values: np.ndarray) -> "ReadInputs":
        """A copy with source ``row`` replaced (e.g. to show that no convolution crosses rows)."""
        sources = np.array(self.sources, copy=True)
        sources[row] = values
        return dataclasses.replace(self, sources=sources, h=None)


@dataclasses.dataclass
class Explanation:
    """One read at one target token and stream, per source row ``i`` and source token ``s``.

    ``weights[n]``: the depth-attention weights of the stream (0 for unavailable sources);
    ``terms[n, T, d]``: ``c_{i,r,t-s} (*) v_{i,s}`` inside the stream's window, else 0;
    ``magnitudes[n, T]``: ``M = ||weights_i * terms[i, s]||``; ``active[n, T]``: cells of the
    window of an available row; ``expanded[n, d]``: ``E_{i,r}(v_i)_t`` from ``expand``;
    ``retrieved[d]``: ``z^{(r)}_t`` from ``msar_read``; ``all_weights[n, m]``: every stream's
    weights at this token; ``gate[m]``: the H_pre gate values at this token (``None`` for mean
    fusion); ``h[d]``: the fused read ``msar_read`` returns.
    """

    stream: int
    token: int
    kernel: int
    weights: np.ndarray
    terms: np.ndarray
    magnitudes: np.ndarray
    active: np.ndarray
    expanded: np.ndarray
    retrieved: np.ndarray
    all_weights: np.ndarray
    gate: np.ndarray | None
    h: np.ndarray
    valid: np.ndarray
    labels: list[str]
    target_label: str
    stream_name: str


@functools.partial(jax.jit, static_argnames=("kernel_sizes", "eps"))
def _jit_read(sources, banks, queries, gate, valid, *, kernel_sizes, eps):
    return msar_read(sources, banks, queries, gate, valid, kernel_sizes=kernel_sizes, conv=bool(kernel_sizes),
                     eps=eps, return_weights=True)


@functools.partial(jax.jit, static_argnames=("stream_kernels",))
def _jit_expand(sources, banks, *, stream_kernels):
    return depth_ref.expand(sources, banks, stream_kernels)


def library_read(read: ReadInputs):
    """``msar_read`` of ``read`` (batch of one): ``h[T, d]``, ``alpha[n, m, T]``, ``z[m, T, d]``."""
    banks = None if read.banks is None else jnp.asarray(read.banks, jnp.float32)
    h, alpha, z = _jit_read(
        jnp.asarray(read.sources, jnp.float32)[:, None], banks, jnp.asarray(read.queries, jnp.float32),
        None if read.gate is None else tuple(jnp.asarray(x, jnp.float32) for x in read.gate),
        jnp.asarray(read.valid), kernel_sizes=tuple(read.kernel_sizes or ()), eps=float(read.eps),
    )
    return np.asarray(h[0]), np.asarray(alpha[:, :, 0]), np.asarray(z[:, 0])


def library_expand(read: ReadInputs) -> np.ndarray:
    """``expand`` of every source: ``[n, m, T, d]``."""
    banks = None if read.banks is None else jnp.asarray(read.banks, jnp.float32)
    return np.asarray(_jit_expand(jnp.asarray(read.sources, jnp.float32)[:, None], banks,
                                  stream_kernels=tuple(read.stream_kernels)))[:, :, 0]


def stream_taps(read: ReadInputs, stream: int) -> np.ndarray:
    """The coefficients ``c_{i,r,delta}`` of a stream, ``[n, kappa, d]`` (Identity: ``[n, 1, d]`` of ones)."""
    kernels = read.stream_kernels
    k = kernels[stream]
    if k == 0:
        return np.ones((read.n_sources, 1, read.sources.shape[-1]), np.float32)
    offset = sum(kernels[:stream])
    return np.asarray(read.banks[:, offset: offset + k], np.float32)


def _cell_terms(sources, taps, valid, token):
    """``terms[i, s] = c_{i,r,token-s} (*) v_{i,s}`` inside the window of available rows, and the window mask."""
    n, T, d = sources.shape
    terms = np.zeros((n, T, d), np.float32)
    active = np.zeros((n, T), bool)
    for delta in range(taps.shape[1]):
        s = token - delta
        if s < 0:
            break  # zero padding before the sequence start
        terms[:, s] = taps[:, delta] * sources[:, s]
        active[:, s] = valid
    terms[~valid] = 0.0
    return terms, active


def explain(read: ReadInputs, stream: int, token: int, check: bool = True) -> Explanation:
    """Take the read of ``stream`` at ``token`` apart per source row and source token (see module doc).

    With ``check`` (default) it asserts that the per-cell terms sum to ``expand``'s output, that
    ``sum_i alpha_i E_i`` is ``msar_read``'s ``z``, and, when the model's own ``h`` is known, that
    ``msar_read`` reproduces it.
    """
    n, T, d = read.sources.shape
    if not 0 <= token < T:
        raise ValueError(f"token {token} outside 0..{T - 1}")
    m = read.queries.shape[0]
    if not 0 <= stream < m:
        raise ValueError(f"stream {stream} outside 0..{m - 1}")
    h, alpha, z = library_read(read)
    expanded_all = library_expand(read)[:, stream, token]  # [n, d]
    taps = stream_taps(read, stream)
    valid = np.asarray(read.valid, bool)
    weights = np.where(valid, alpha[:, stream, token], 0.0)
    terms, active = _cell_terms(read.sources, taps, valid, token)
    magnitudes = np.linalg.norm(weights[:, None, None] * terms, axis=-1)
    gate = None
    if read.gate is not None:
        W, a, b = (jnp.asarray(x, jnp.float32) for x in read.gate)
        gate = np.asarray(depth_ref.stream_gate(jnp.asarray(z)[:, None], W, a, b, eps=read.eps))[0, token]
    if check:
        np.testing.assert_allclose(terms.sum(axis=1)[valid], expanded_all[valid], rtol=1e-5, atol=1e-5,
                                   err_msg="per-cell terms do not sum to expand()")
        np.testing.assert_allclose((weights[:, None] * expanded_all).sum(0), z[stream, token], rtol=1e-4, atol=1e-5,
                                   err_msg="sum_i alpha_i E_i differs from msar_read's z")
        if read.h is not None:
            np.testing.assert_allclose(h, read.h, rtol=1e-4, atol=1e-4, err_msg="msar_read differs from the model's h")
    names = stream_names(read.kernel_sizes, m)
    return Explanation(
        stream=stream, token=token, kernel=read.stream_kernels[stream], weights=weights, terms=terms,
        magnitudes=magnitudes, active=active, expanded=np.where(valid[:, None], expanded_all, 0.0),
        retrieved=z[stream, token], all_weights=np.where(valid[:, None], alpha[:, :, token], 0.0), gate=gate,
        h=h[token], valid=valid, labels=read.labels, target_label=read.target_label, stream_name=names[stream],
    )


# --------------------------------------------------------------------------------------
# Scenes: where reads come from.
# --------------------------------------------------------------------------------------


class SyntheticScene:
    """A synthetic toy: layer-level MSAR (Sec. 3.2) with fixed sine/cosine activations.

    Sources ``v_0`` (the embedding) .. ``v_{n-1}`` (sublayer outputs), ``[n, T, d]``; source
    ``i`` has its own depthwise coefficients per stream; each target layer ``l`` has its own
    query per stream; target ``l`` reads sources ``i < l`` (``targets = 1..n``). The same source
    activations serve every stream. RMSNorm: unit gain, eps 1e-6. No trained weights.
    """

    def __init__(self, n_tokens: int = 16, n_sources: int = 8, d: int = 6, kernel_sizes=(4, 8, 12)):
        self.n_tokens, self.n_sources, self.d = n_tokens, n_sources, d
        self.kernel_sizes = tuple(kernel_sizes)
        i = np.arange(n_sources)[:, None, None]
        t = np.arange(n_tokens)[None, :, None]
        c = np.arange(d)[None, None, :]
        # Signed activations: each row has its own frequency and phase, each channel its own phase.
        self.sources = (np.sin(0.55 * t * (1 + 0.17 * i) + 1.3 * c + 0.9 * i)
                        * (1.0 + 0.4 * np.cos(0.7 * i + 0.5 * c))).astype(np.float32)
        # Depthwise coefficients c_{i,r,delta}: source-specific, decaying with the lag.
        banks = []
        for r, k in enumerate(self.kernel_sizes, start=1):
            delta = np.arange(k)[None, :, None]
            ii = np.arange(n_sources)[:, None, None]
            cc = np.arange(d)[None, None, :]
            banks.append(np.cos(0.8 * delta + 0.6 * cc + 1.1 * ii + 0.7 * r) * np.exp(-delta / k) * (1.2 - 0.1 * r))
        self.banks = np.concatenate(banks, axis=1).astype(np.float32) if banks else None
        m = 1 + len(self.kernel_sizes)
        ll = np.arange(1, n_sources + 1)[:, None, None]
        rr = np.arange(m)[None, :, None]
        cc = np.arange(d)[None, None, :]
        # Independent per-(target, stream) queries w_l^{(r)}.
        self.queries = (1.6 * np.sin(1.7 * rr + 0.9 * cc + 0.5 * ll) + 0.8 * np.cos(2.3 * rr * cc + ll)).astype(np.float32)

    @property
    def targets(self) -> range:
        return range(1, self.n_sources + 1)

    @property
    def stream_names(self) -> list[str]:
        return stream_names(self.kernel_sizes)

    def read(self, target: int) -> ReadInputs:
        if target not in self.targets:
            raise ValueError(f"target layer {target} outside 1..{self.n_sources}")
        return ReadInputs(
            sources=self.sources, banks=self.banks, queries=self.queries[target - 1],
            valid=np.arange(self.n_sources) < target, gate=None, kernel_sizes=self.kernel_sizes,
            source_labels=["v0 (emb)", *[f"v{i}" for i in range(1, self.n_sources)]],
            target_label=f"target layer {target}",
        )


@dataclasses.dataclass
class Capture:
    """Every MSAR read of a model on a token batch (``capture``); arrays keep the batch axis."""

    reads: list[dict]  # per sublayer: sources [n,B,T,d], banks, queries [m,d], valid [n], gate, h [B,T,d], v
    logits: np.ndarray  # [B, T, V] from the captured forward
    tokens: np.ndarray  # [B, T]
    config: Any  # the full run config (or the model config)
    kernel_sizes: tuple[int, ...]
    eps: float
    source_labels: list[str]
    read_labels: list[str]


def capture(model_def, params, tokens, config=None) -> Capture:
    """Run a Block/Full MSAR model sublayer by sublayer and record each read's inputs.

    It drives the mechanism's own protocol (``start``, ``read``, ``write``, ``end_block``,
    ``finish``) and the transformer's own sublayers, in the stack's order, without the scans and
    without the two-phase split (which computes the same read); each read's sources, banks and
    valid mask are assembled exactly as ``BlockDepthAttention.retrieve`` assembles them.
    """
    from msar_jax.model import layers
    from msar_jax.model.transformer import layer_kinds, pure
    from msar_jax.residuals.base import position
    from msar_jax.residuals.msar import MSAR
    from msar_jax.train import introspection

    model = model_def.merge(params)
    mech, cfg = model.residual, model.cfg
    if not isinstance(mech, MSAR):
        raise TypeError(f"capture needs an MSAR model; this one is {cfg.residual.name!r}")
    if cfg.moe.enabled:
        raise NotImplementedError("capture supports dense MLP models (the tiny and small sizes)")

    def run(params, tokens):
        model = model_def.merge(params)
        mech = model.residual
        b, t = tokens.shape
        ctx = layers.SequenceContext(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                                     segment_ids=None)
        e = jnp.take(model.embedding[...], tokens, axis=0).astype(jnp.dtype(cfg.dtype))
        g, per_sub = mech.split_params(pure(mech))
        attn_p, mlp_p = pure(model.attn), pure(model.dense)
        kinds = layer_kinds(cfg)
        L, S = mech.n_sublayers, mech.block_size
        state = mech.start(g, e, ctx)
        reads = []
        for l in range(1, L + 1):
            pos = position(l, S)
            p = jax.tree.map(lambda a: a[l - 1], per_sub)
            partial = state.carry["partial"]
            sources = jnp.concatenate([state.sources, partial[None]], axis=0)
            banks = mech.source_banks(g)
            if banks is not None:
                banks = jnp.concatenate([banks, mech.partial_bank(g, pos)[None]], axis=0)
            valid = jnp.concatenate([mech._completed_valid(pos), jnp.logical_not(pos.first_in_block)[None]])
            h, aux = mech.read(g, p, state, None, pos, ctx)
            layer, sub = (l - 1) // 2, (l - 1) % 2
            kind = "attn" if sub == 0 else kinds[layer]
            lp = jax.tree.map(lambda a: a[layer], attn_p if sub == 0 else mlp_p)
            v, _ = model._sublayer(kind, lp, h, ctx)
            state = mech.write(g, p, state, v, aux, pos, ctx)
            if l % S == 0 or l == L:
                state = mech.end_block(g, state, pos)
            gate = tuple(p[k] for k in ("gate_w", "gate_a", "gate_b")) if "gate_w" in p else None
            reads.append(dict(sources=sources, banks=banks, queries=p["queries"], valid=valid, gate=gate, h=h, v=v))
        hidden = mech.finish(g, state, ctx)
        x = layers.rms_norm(hidden, model.final_norm[...], cfg.norm_eps)
        head = model.embedding[...].T if model.lm_head is None else model.lm_head[...]
        return reads, jnp.einsum("btd,dv->btv", x, head.astype(x.dtype), preferred_element_type=jnp.float32)

    # One compiled program: run op by op, the sublayer loop compiled every primitive on its own
    # (22 s on a 2-core CPU for the notebooks' tiny model, against a few seconds jitted).
    tokens = jnp.asarray(tokens)
    reads, logits = jax.jit(run)(params, tokens)

    def host(a, dtype=np.float32):
        return None if a is None else np.asarray(a, dtype)

    reads = [dict(sources=host(r["sources"]), banks=host(r["banks"]), queries=host(r["queries"]),
                  valid=host(r["valid"], bool), gate=None if r["gate"] is None else tuple(map(host, r["gate"])),
                  h=host(r["h"]), v=host(r["v"])) for r in reads]
    n_src = reads[0]["sources"].shape[0]
    return Capture(reads=reads, logits=np.asarray(logits), tokens=np.asarray(tokens), config=config or cfg,
                   kernel_sizes=tuple(mech.kernel_sizes), eps=float(cfg.residual.eps),
                   source_labels=introspection.source_labels(cfg, n_src), read_labels=introspection.read_labels(cfg))


class CapturedScene:
    """The reads of a trained Block MSAR model on one sequence (row ``batch_row`` of the capture).

    Sources per read: the embedding, the completed block summaries and the current block's
    partial sum (Sec. 3.3); a read sees the summaries completed before its block, and the
    partial unless it is the first sublayer of its block. ``targets = 1..L``.
    """

    def __init__(self, cap: Capture, batch_row: int = 0):
        self.capture, self.row = cap, batch_row
        self.n_tokens = cap.tokens.shape[1]
        self.kernel_sizes = cap.kernel_sizes

    @property
    def targets(self) -> range:
        return range(1, len(self.capture.reads) + 1)

    @property
    def stream_names(self) -> list[str]:
        return stream_names(self.kernel_sizes, self.capture.reads[0]["queries"].shape[0])

    def read(self, target: int) -> ReadInputs:
        r = self.capture.reads[target - 1]
        return ReadInputs(
            sources=r["sources"][:, self.row], banks=r["banks"], queries=r["queries"], valid=r["valid"],
            gate=r["gate"], kernel_sizes=self.kernel_sizes, eps=self.capture.eps,
            source_labels=self.capture.source_labels,
            target_label=f"sublayer {target} ({self.capture.read_labels[target - 1]} read)",
            tokens=self.capture.tokens[self.row], h=r["h"][self.row],
        )


def model_logits(model_def, params, tokens) -> np.ndarray:
    """The model's logits ``[B, T, V]`` on ``tokens [B, T]``, compiled as one program (called op
    by op, a forward of the notebooks' tiny model took 5-9 s on a 2-core CPU)."""
    return np.asarray(jax.jit(lambda p, t: model_def.merge(p)(t)[0])(params, jnp.asarray(tokens)))


def capture_checkpoint(workdir, batch=None, batch_size: int = 2) -> Capture:
    """``capture`` on a run's newest checkpoint, on ``batch`` (default: the first val windows)."""
    model_def, params, config, _ = restore(workdir)
    if batch is None:
        from msar_jax.train import introspection
        from msar_jax.train.train import prepare_data

        data_dir, _ = prepare_data(config)
        batch = np.asarray(introspection.default_batch(data_dir, config))[:batch_size]
    batch = np.asarray(batch)
    tokens = batch[:, :-1] if batch.shape[1] == config.seq_len + 1 else batch
    return capture(model_def, params, tokens, config)


# --------------------------------------------------------------------------------------
# Plots of the explainer.
# --------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib.pyplot as plt  # the notebook's backend (inline in Jupyter / Colab)

    return plt


def token_label(tok: int) -> str:
    ch = chr(int(tok)) if 32 <= int(tok) < 127 else f"\\x{int(tok):02x}"
    return repr(ch)[1:-1] if ch != " " else "␣"


def plot_grid(expl: Explanation, mode: str = "weights", ax=None, vmax: float | None = None,
              tokens: np.ndarray | None = None, columns: tuple[int, int] | None = None):
    """The token-by-source grid of one read (``SyntheticScene`` or ``CapturedScene``).

    ``mode="weights"``: each available row's token window is outlined and the right-hand column
    shows the row's depth-attention weight (one per source; the column sums to one).
    ``mode="contributions"``: each cell's colour is ``M`` on a square-root scale (``vmax``
    fixes the colour limit so that settings are comparable). Hatched: unavailable sources and
    tokens outside the window. ``columns=(first, last+1)`` shows a token range.
    """
    from matplotlib.patches import Rectangle

    plt = _pyplot()
    n, T = expl.magnitudes.shape
    c0, c1 = columns or (0, T)
    width = c1 - c0
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 0.42 * (width + 2), 1.2 + 0.42 * n))
    mags = expl.magnitudes[:, c0:c1]
    vmax = float(vmax if vmax is not None else max(mags.max(), 1e-12))
    ax.set_xlim(-0.5, width + 1.5)
    ax.set_ylim(-0.5, n - 0.5)
    cmap = plt.get_cmap("viridis")
    for i in range(n):
        for j, s in enumerate(range(c0, c1)):
            active = expl.active[i, s]
            if mode == "contributions" and active:
                colour = cmap(math.sqrt(expl.magnitudes[i, s] / vmax) if vmax > 0 else 0.0)
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=colour, edgecolor="white", lw=0.5))
            elif active:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#dde6f5", edgecolor="white", lw=0.5))
            else:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#f4f4f4", edgecolor="white",
                                       hatch="///" if not expl.valid[i] or s > expl.token else "", lw=0.5))
        if expl.valid[i]:
            lo = max(expl.token - max(expl.kernel, 1) + 1, 0)
            lo_j, hi_j = max(lo - c0, 0), min(expl.token - c0, width - 1)
            if hi_j >= lo_j:
                ax.add_patch(Rectangle((lo_j - 0.5, i - 0.5), hi_j - lo_j + 1, 1, fill=False, edgecolor="black", lw=1.3))
            w = expl.weights[i]
            ax.add_patch(Rectangle((width + 0.5, i - 0.5), 1, 1, facecolor=cmap(w), edgecolor="white"))
            ax.text(width + 1.0, i, f"{w:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if w < 0.6 else "black")
        else:
            ax.add_patch(Rectangle((width + 0.5, i - 0.5), 1, 1, facecolor="#f4f4f4", hatch="///", edgecolor="white"))
    if c0 <= expl.token < c1:
        ax.axvline(expl.token - c0, color="tab:red", lw=0.8, ls=":")
    xt = list(range(width)) + [width + 1]
    xl = [str(s) if tokens is None else f"{s}\n{token_label(tokens[s])}" for s in range(c0, c1)] + ["α"]
    ax.set_xticks(xt)
    ax.set_xticklabels(xl, fontsize=7)
    ax.set_yticks(range(n))
    ax.set_yticklabels(expl.labels, fontsize=8)
    ax.set_xlabel("source token  (right: depth-attention weight α of each source)")
    ax.set_ylabel("source")
    what = "depth-attention weights" if mode == "weights" else f"contribution magnitudes M (sqrt colour scale, max {vmax:.3g})"
    ax.set_title(f"{expl.target_label}, token {expl.token}, stream {expl.stream_name}: {what}", fontsize=9)
    ax.set_aspect("equal")
    return ax


def magnitude_limit(scene, streams: Sequence[int] | None = None) -> float:
    """The largest ``M`` over every target, stream and token of a scene (one colour limit)."""
    top = 0.0
    for target in scene.targets:
        read = scene.read(target)
        _, alpha, _ = library_read(read)
        valid = np.asarray(read.valid, bool)
        for stream in streams if streams is not None else range(read.queries.shape[0]):
            taps = stream_taps(read, stream)
            for token in range(read.n_tokens):
                terms, _ = _cell_terms(read.sources, taps, valid, token)
                weights = np.where(valid, alpha[:, stream, token], 0.0)
                top = max(top, float(np.linalg.norm(weights[:, None, None] * terms, axis=-1).max()))
    return top


def show(scene, stream: int = 0, target: int = 6, token: int = 11, mode: str = "weights",
         vmax: float | None = None, window: int | None = None, print_summary: bool = True) -> Explanation:
    """Explain one read and draw its grid; the plain-arguments counterpart of ``interactive``."""
    read = scene.read(target)
    expl = explain(read, stream, token)
    columns = None
    if window is not None and window < read.n_tokens:
        c0 = min(max(token - window + 4, 0), read.n_tokens - window)
        columns = (c0, c0 + window)
    plot_grid(expl, mode, vmax=vmax, tokens=read.tokens, columns=columns)
    _pyplot().show()
    if print_summary:
        print(summary(expl))
    return expl


def plot_streams(read: ReadInputs, token: int, mode: str = "contributions", vmax: float | None = None,
                 streams: Sequence[int] | None = None) -> list[Explanation]:
    """One grid per stream for the same target and token, stacked; returns the explanations."""
    plt = _pyplot()
    streams = list(streams if streams is not None else range(read.queries.shape[0]))
    n, T = read.n_sources, read.n_tokens
    fig, axes = plt.subplots(len(streams), 1, figsize=(1.6 + 0.42 * (T + 2), (1.0 + 0.42 * n) * len(streams)),
                             squeeze=False)
    out = []
    for ax, r in zip(axes[:, 0], streams):
        expl = explain(read, r, token)
        plot_grid(expl, mode, ax=ax, vmax=vmax, tokens=read.tokens)
        out.append(expl)
    fig.tight_layout()
    return out


def summary(expl: Explanation) -> str:
    lines = [f"{expl.target_label}, token {expl.token}, stream {expl.stream_name} (kernel {expl.kernel or 1}):"]
    lines.append(f"  {'source':>10}  {'alpha':>7}  {'||E_i||':>8}  {'sum M':>8}")
    for i, lab in enumerate(expl.labels):
        if expl.valid[i]:
            lines.append(f"  {lab:>10}  {expl.weights[i]:7.4f}  {np.linalg.norm(expl.expanded[i]):8.4f}  "
                         f"{expl.magnitudes[i].sum():8.4f}")
    lines.append(f"  sum of alpha = {expl.weights.sum():.6f};  ||z|| = {np.linalg.norm(expl.retrieved):.4f} vs "
                 f"sum of all M = {expl.magnitudes.sum():.4f}")
    if expl.gate is not None:
        lines.append("  H_pre gate g per stream at this token: " + ", ".join(f"{g:.3f}" for g in expl.gate))
    return "\n".join(lines)


def interactive(scene, vmax: float | None = None, window: int | None = None):
    """An ipywidgets explorer (stream, target, token, colour mode), or ``None`` without ipywidgets."""
    try:
        import ipywidgets as widgets
    except ImportError:
        return None
    read0 = scene.read(max(scene.targets))
    stream = widgets.Dropdown(options=[(name, r) for r, name in enumerate(scene.stream_names)], value=0,
                              description="stream")
    target = widgets.IntSlider(value=min(6, max(scene.targets)), min=min(scene.targets), max=max(scene.targets),
                               description="target ℓ")
    token = widgets.IntSlider(value=min(11, read0.n_tokens - 1), min=0, max=read0.n_tokens - 1, description="token t")
    mode = widgets.ToggleButtons(options=[("depth-attention weights", "weights"),
                                          ("contribution magnitudes", "contributions")], value="weights")
    out = widgets.interactive_output(
        lambda stream, target, token, mode: show(scene, stream, target, token, mode, vmax=vmax, window=window),
        dict(stream=stream, target=target, token=token, mode=mode))
    return widgets.VBox([widgets.HBox([stream, mode]), widgets.HBox([target, token]), out])


# --------------------------------------------------------------------------------------
# Training, checkpoints (quickstart, depth patterns).
# --------------------------------------------------------------------------------------


def fast_compile() -> None:
    """Use the test suite's faster XLA compile options for every step jitted from now on
    (CPU compile about 2x faster, steps somewhat slower): for tiny CI runs."""
    from msar_jax.train import step

    step.COMPILER_OPTIONS = step.FAST_COMPILE


def quick_config(mechanism: str, steps: int, batch_size: int = 16, seq_len: int = 128, size: str = "tiny",
                 **overrides):
    """``configs/<mechanism>.py:size=<size>,seq_len=<seq_len>`` for ``steps`` steps, with eval and
    checkpoints spread over the run (about three each) and a warmup of at most a sixth of it."""
    from msar_jax.config import load_config

    every = max(1, steps // 3)
    base = {"train.steps": steps, "train.batch_size": batch_size, "train.eval_every": every,
            "train.eval_batches": 4, "checkpoint.every": every,
            "optim.warmup_steps": min(50, max(1, steps // 6))}
    return load_config(f"configs/{mechanism}.py:size={size},seq_len={seq_len}", {**base, **overrides})


def default_runs_root() -> Path:
    """``<repo>/runs/notebooks`` (ignored by git)."""
    from msar_jax.config import REPO_ROOT

    return REPO_ROOT / "runs" / "notebooks"


def new_run_folder(root, name: str) -> Path:
    """``root/name/<time>``: a fresh folder (training in an old run folder would resume it, not retrain)."""
    return Path(root or default_runs_root()) / name / time.strftime("%Y%m%d-%H%M%S")


def plot_losses(results: dict, baseline: float | None = None, smooth: int | None = None):
    """Train loss (and validation loss at its evaluations) of several runs on one axis.

    ``results``: ``{label: train() result}``; validation points are read from each run's
    ``metrics.jsonl``."""
    from msar_jax.train.metrics import read_jsonl

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for colour, (label, res) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], results.items()):
        steps, loss = np.array(res["losses"]).T if res["losses"] else (np.array([]), np.array([]))
        k = smooth or max(1, len(loss) // 25)
        ax.plot(steps, loss, color=colour, alpha=0.3 if k > 1 else 1.0, lw=0.8)
        if k > 1 and len(loss) > k:
            ax.plot(steps[k // 2: k // 2 + len(loss) - k + 1], np.convolve(loss, np.ones(k) / k, "valid"),
                    color=colour, lw=1.6, label=f"{label} train ({k}-step mean)")
        else:
            ax.lines[-1].set_label(f"{label} train")
        evals = [r for r in read_jsonl(res["workdir"], "eval") if isinstance(r.get("val_loss"), (int, float))]
        if evals:
            ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o--", color=colour, ms=4,
                    label=f"{label} val")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls=":", lw=1, label=f"unigram entropy (val) {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def restore(workdir, step: int | None = None):
    """``(model_def, params, config, step)`` from a run's checkpoint (default: the newest)."""
    from msar_jax.train.checkpoint import restore_params
    from msar_jax.train.introspection import load_run_config
    from msar_jax.train.optim import make_optimizer
    from msar_jax.train.step import abstract_model, abstract_state

    config = load_run_config(workdir)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    params, step = restore_params(workdir, abstract_state(config.model, tx), step)
    model_def, _ = abstract_model(config.model)
    return model_def, params, config, step


def evaluate_restored(workdir, step: int | None = None) -> dict:
    """Validation loss of the params restored from ``workdir``'s checkpoint (same batches as training)."""
    model_def, params, config, step = restore(workdir, step)
    return {"step": step, **evaluate_params(model_def, params, config)}


def evaluate_params(model_def, params, config) -> dict:
    """``val_loss`` / ``val_bpb`` of ``params`` on the first ``train.eval_batches`` val batches
    (what ``train`` reports; the eval step is shared with the run when it is in this process)."""
    from msar_jax.train.optim import make_optimizer
    from msar_jax.train.step import compiled_steps
    from msar_jax.train.train import evaluate, prepare_data

    tx, schedule = make_optimizer(config.optim, config.train.steps)
    _, eval_step = compiled_steps(config, model_def, tx, schedule)
    data_dir, meta = prepare_data(config)
    return evaluate(eval_step, params, data_dir, config, meta)


def has_checkpoint(workdir) -> bool:
    ck = Path(workdir) / "checkpoints"
    return (Path(workdir) / "config.json").exists() and ck.is_dir() and any(p.name.isdigit() for p in ck.iterdir())


def find_checkpoint(roots: Sequence[str | os.PathLike], mechanism: str = "msar") -> Path | None:
    """The newest run folder under ``roots`` (searched recursively) with a checkpoint of ``mechanism``."""
    import json

    found = []
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            continue
        for cfg in root.rglob("config.json"):
            run = cfg.parent
            try:
                name = json.loads(cfg.read_text(encoding="utf-8"))["model"]["residual"]["name"]
            except (OSError, ValueError, KeyError):
                continue
            if name == mechanism and has_checkpoint(run):
                found.append((cfg.stat().st_mtime, run))
    return max(found)[1] if found else None


def ensure_checkpoint(roots: Sequence[str | os.PathLike], train_dir, steps: int, batch_size: int = 16,
                      seq_len: int = 128, mechanism: str = "msar") -> Path:
    """A run folder with a checkpoint of ``mechanism``: the newest under ``roots``, else one
    trained now (tiny size, ``steps`` steps) in ``train_dir``."""
    found = find_checkpoint(roots, mechanism)
    if found is not None:
        print(f"using the checkpoint in {found}")
        return found
    from msar_jax.train import train

    print(f"no {mechanism} checkpoint under {[str(r) for r in roots]}: training a tiny one ({steps} steps) in {train_dir}")
    train(quick_config(mechanism, steps, batch_size, seq_len), train_dir)
    return Path(train_dir)


# --------------------------------------------------------------------------------------
# Depth patterns.
# --------------------------------------------------------------------------------------


def plot_depth_heatmaps(weights: np.ndarray, config, step: int | None = None):
    """Figure 4: per stream, a layer x source heatmap of the token-averaged depth weights,
    pre-attention reads on top, pre-MLP reads below (``weights[L, N+2, m]``)."""
    from msar_jax.train.introspection import source_labels

    plt = _pyplot()
    model_cfg = config.model if "model" in config else config
    n_reads, n_src, m = weights.shape
    labels = source_labels(model_cfg, n_src)
    names = stream_names(tuple(model_cfg.residual.kernel_sizes) if model_cfg.residual.conv else (), m)
    n_layers = n_reads // 2
    fig, axes = plt.subplots(2, m, figsize=(1.5 + (0.45 * n_src + 0.5) * m, 1.8 + 0.5 * n_layers * 2),
                             squeeze=False, constrained_layout=True)
    im = None
    for row, (offset, kind) in enumerate(((0, "pre-attention"), (1, "pre-MLP"))):
        for r in range(m):
            ax = axes[row][r]
            w = weights[offset::2, :, r]
            im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            for (i, j), val in np.ndenumerate(w):
                if val > 0:
                    ax.text(j, i, f"{val:.2f}", ha="center", va="center", fontsize=6,
                            color="white" if val < 0.6 else "black")
            ax.set_title(f"{kind}, {names[r]}", fontsize=9)
            ax.set_xticks(range(n_src))
            ax.set_xticklabels(labels, rotation=90, fontsize=7)
            ax.set_yticks(range(n_layers))
            ax.set_yticklabels([f"L{i + 1}" for i in range(n_layers)], fontsize=7)
            if r == 0:
                ax.set_ylabel("layer")
    res = model_cfg.residual
    fig.suptitle(f"{res.name} depth-attention weights (token-averaged; S={res.block_size}, m={m}"
                 + (f", step {step}" if step is not None else "") + ")", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8, label="weight")
    return fig


def gate_values(cap: Capture) -> np.ndarray | None:
    """The H_pre stream-gate values ``g`` (Eq. 13) of every read, token-averaged: ``[L, m]``
    (``None`` for mean fusion). Computed with ``msar_read``'s retrieved streams and the
    library's ``stream_gate``."""
    out = []
    for r in cap.reads:
        if r["gate"] is None:
            return None
        banks = None if r["banks"] is None else jnp.asarray(r["banks"])
        _, _, z = msar_read(jnp.asarray(r["sources"]), banks, jnp.asarray(r["queries"]), None,
                            jnp.asarray(r["valid"]), kernel_sizes=cap.kernel_sizes or (),
                            conv=bool(cap.kernel_sizes), eps=cap.eps, return_weights=True)
        W, a, b = (jnp.asarray(x) for x in r["gate"])
        g = depth_ref.stream_gate(z, W, a, b, eps=cap.eps)  # [B, T, m]
        out.append(np.asarray(jnp.mean(g, axis=(0, 1))))
    return np.stack(out)


def capture_depth_weights(cap: Capture) -> np.ndarray:
    """Token-averaged depth weights ``[L, n_sources, m]`` of a capture, from ``msar_read``
    (the same quantity as ``msar_jax.train.introspection.depth_weights`` on the same batch)."""
    @jax.jit  # one program per source count (op by op it was 4 s for the smoke model)
    def weights(sources, banks, queries, valid):
        _, alpha, _ = msar_read(sources, banks, queries, None, valid, kernel_sizes=cap.kernel_sizes or (),
                                conv=bool(cap.kernel_sizes), eps=cap.eps, return_weights=True)
        return jnp.mean(alpha, axis=(2, 3))

    return np.stack([np.asarray(weights(r["sources"], r["banks"], r["queries"], r["valid"])) for r in cap.reads])


def plot_gates(gates: np.ndarray, read_labels: Sequence[str], names: Sequence[str]):
    """Gate value per read (x) and stream (one line each)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(read_labels)), 3.6))
    for r, name in enumerate(names):
        ax.plot(range(len(read_labels)), gates[:, r], "o-", label=name)
    ax.set_xticks(range(len(read_labels)))
    ax.set_xticklabels(read_labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("mean gate g_r (sigmoid)")
    ax.set_title("H_pre stream-gate values per sublayer read (token-averaged)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def js_divergence(p: np.ndarray, q: np.ndarray, axis: int = -1) -> np.ndarray:
    """Jensen-Shannon divergence in bits (0 = equal, 1 = disjoint supports) of distributions
    along ``axis`` (renormalised; zero entries allowed)."""
    p = np.asarray(p, np.float64)
    q = np.asarray(q, np.float64)
    p = p / p.sum(axis, keepdims=True)
    q = q / q.sum(axis, keepdims=True)
    mid = 0.5 * (p + q)

    def kl(a, b):
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(a > 0, a * np.log2(a / b), 0.0)
        return t.sum(axis)

    return 0.5 * kl(p, mid) + 0.5 * kl(q, mid)


def stream_divergence(weights: np.ndarray) -> np.ndarray:
    """Pairwise JS divergence (bits) between the streams' depth distributions per read:
    ``weights[L, n_sources, m] -> [L, m, m]`` (symmetric, zero diagonal)."""
    L, _, m = weights.shape
    out = np.zeros((L, m, m))
    for a in range(m):
        for b in range(m):
            out[:, a, b] = js_divergence(weights[:, :, a], weights[:, :, b], axis=1)
    return out


def plot_divergence(div: np.ndarray, read_labels: Sequence[str], names: Sequence[str]):
    """Left: mean pairwise JS divergence between streams per read; right: the stream x stream
    matrix averaged over reads."""
    plt = _pyplot()
    L, m, _ = div.shape
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw=dict(width_ratios=[2, 1]))
    iu = np.triu_indices(m, 1)
    for a, b in zip(*iu):
        ax1.plot(range(L), div[:, a, b], "o-", ms=3, lw=1, label=f"{names[a]} vs {names[b]}")
    ax1.set_xticks(range(L))
    ax1.set_xticklabels(read_labels, rotation=45, ha="right", fontsize=8)
    ax1.set_ylabel("JS divergence (bits)")
    ax1.set_title("how differently the streams distribute over depth, per read")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7, ncol=2)
    mean = div.mean(0)
    im = ax2.imshow(mean, cmap="magma")
    for (i, j), val in np.ndenumerate(mean):
        ax2.text(j, i, f"{val:.3f}", ha="center", va="center", fontsize=7, color="white" if val < mean.max() / 2 else "black")
    ax2.set_xticks(range(m))
    ax2.set_xticklabels(names, rotation=45, fontsize=8)
    ax2.set_yticks(range(m))
    ax2.set_yticklabels(names, fontsize=8)
    ax2.set_title("mean over reads", fontsize=9)
    fig.colorbar(im, ax=ax2, shrink=0.8)
    fig.tight_layout()
    return fig
