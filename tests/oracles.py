"""Independent numpy float64 oracles of every residual mechanism, written from the papers'
equations as docs/design.md §2-8 states them.

Nothing here imports the library: these are deliberately slow, explicit loops over
tokens, sources, streams and heads, transcribing those sections literally, so a
vectorisation mistake in the library cannot be reproduced here by construction.

Conventions:
  * ``e`` is the embedding ``[B, T, d]`` (float64).
  * ``fs`` is a list of ``L`` callables ``f_l(h[B, T, d]) -> v[B, T, d]`` (sublayers
    1..L, ``fs[l-1]`` is ``f_l``); the mechanism treats them as black boxes.
  * ``params`` is a dict of numpy arrays with the library's names and shapes (see each
    function), but the oracle only ever indexes them per sublayer / per bank.
  * ``segment_ids`` is ``None`` or ``[B, T]`` ints; a conv never reaches back across
    a change of segment id (docs/design.md §4.1's decision: a boundary is treated like a sequence start).

Every function returns the final hidden ``[B, T, d]`` (what goes to the final RMSNorm).
"""

from __future__ import annotations

import math

import numpy as np

RMS_EPS = 1e-6
MHC_EPS = 1e-6


# --------------------------------------------------------------------------------------
# Scalar / per-token helpers.
# --------------------------------------------------------------------------------------


def rms(x: np.ndarray, eps: float = RMS_EPS) -> np.ndarray:
    """Weightless RMS norm of one vector."""
    x = np.asarray(x, np.float64)
    return x / math.sqrt(float(np.mean(x * x)) + eps)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def softmax_list(scores: list[float]) -> list[float]:
    """Softmax of a Python list, max-subtracted."""
    mx = max(scores)
    ex = [math.exp(s - mx) for s in scores]
    tot = sum(ex)
    return [x / tot for x in ex]


# --------------------------------------------------------------------------------------
# Expansion (Eq. 10; docs/design.md §4.1): a direct loop over lags.
# --------------------------------------------------------------------------------------


def conv_token(x: np.ndarray, taps: np.ndarray, b: int, t: int, segment_ids=None) -> np.ndarray:
    """``E[x]_t = sum_{delta=0}^{k-1} c_delta * x_{t-delta}``, zero before t = 0 and,
    walking back from ``t``, zero from the first token of another segment on.

    ``x[B, T, d]``, ``taps[k, d]`` indexed by lag.
    """
    d = x.shape[-1]
    y = np.zeros(d)
    for delta in range(taps.shape[0]):
        s = t - delta
        if s < 0:
            break
        if segment_ids is not None and segment_ids[b][s] != segment_ids[b][t]:
            break
        y = y + taps[delta] * x[b, s]
    return y


def expand_token(x, bank, stream_kernels, b, t, segment_ids=None) -> list[np.ndarray]:
    """The ``m`` streams of source ``x`` at token ``(b, t)``: kernel 0 = identity.

    ``bank[sum(kernels), d]`` holds the conv streams' taps concatenated in stream order.
    """
    out = []
    offset = 0
    for k in stream_kernels:
        if k == 0:
            out.append(np.array(x[b, t], np.float64))
        else:
            out.append(conv_token(x, bank[offset : offset + k], b, t, segment_ids))
            offset += k
    return out


def expand_full(x, bank, stream_kernels, segment_ids=None) -> np.ndarray:
    """``[m, B, T, d]`` by looping ``expand_token`` (for property tests)."""
    B, T, d = x.shape
    out = np.zeros((len(stream_kernels), B, T, d))
    for b in range(B):
        for t in range(T):
            for r, y in enumerate(expand_token(x, bank, stream_kernels, b, t, segment_ids)):
                out[r, b, t] = y
    return out


# --------------------------------------------------------------------------------------
# One depth-attention read (docs/design.md §3, §4, §8): per token, per stream, per head, per source.
# --------------------------------------------------------------------------------------


def depth_read(sources, queries, stream_kernels, heads=1, segment_ids=None, eps=RMS_EPS, return_weights=False):
    """One target's read.

    Args:
      sources: list of ``(x[B, T, d], bank[K, d] or None)`` - only the sources that exist.
      queries: ``[m, d]``, one pseudo-query per stream.
      stream_kernels: length-m tuple, 0 = identity stream.
    Returns:
      ``z[m, B, T, d]`` retrieved streams; with ``return_weights`` also
      ``alpha[n, m, B, T, H]``.
    """
    x0 = sources[0][0]
    B, T, d = x0.shape
    m = len(stream_kernels)
    n = len(sources)
    dh = d // heads
    z = np.zeros((m, B, T, d))
    alpha_all = np.zeros((n, m, B, T, heads))
    for b in range(B):
        for t in range(T):
            expanded = [expand_token(x, bank, stream_kernels, b, t, segment_ids) for x, bank in sources]  # [n][m]
            for r in range(m):
                keys = [rms(expanded[i][r], eps) for i in range(n)]  # rms over the full d, then sliced
                for hd in range(heads):
                    sl = slice(hd * dh, (hd + 1) * dh)
                    scores = [float(np.dot(queries[r][sl], keys[i][sl])) for i in range(n)]
                    alpha = softmax_list(scores)
                    acc = np.zeros(dh)
                    for i in range(n):
                        acc = acc + alpha[i] * expanded[i][r][sl]
                        alpha_all[i, r, b, t, hd] = alpha[i]
                    z[r, b, t, sl] = acc
    return (z, alpha_all) if return_weights else z


def fuse_gate(z, w, a, bias, eps=RMS_EPS) -> np.ndarray:
    """H_pre stream fusion (Eq. 13-14) per token: ``g = sigmoid(a (rms(flat Z) @ W) + b)``."""
    m, B, T, d = z.shape
    h = np.zeros((B, T, d))
    for b in range(B):
        for t in range(T):
            flat = np.concatenate([z[r, b, t] for r in range(m)])  # stream-major, m*d
            g = sigmoid(a * (rms(flat, eps) @ w) + bias)
            for r in range(m):
                h[b, t] = h[b, t] + g[r] * z[r, b, t]
    return h


def fuse_mean(z) -> np.ndarray:
    m = z.shape[0]
    return sum(z[r] for r in range(m)) / m


# --------------------------------------------------------------------------------------
# Mechanisms: full recursions over L sublayers.
# --------------------------------------------------------------------------------------


def vanilla(e, fs, params=None, **_):
    h = np.array(e, np.float64)
    for f in fs:
        h = h + f(h)
    return h


def _blocks(L, S):
    """Sublayer -> (block index n (0-based), first in block, last in block)."""
    out = {}
    for l in range(1, L + 1):
        n = (l - 1) // S
        first = (l - 1) % S == 0
        last = l % S == 0 or l == L
        out[l] = (n, first, last)
    return out


def attnres(e, fs, params, *, block_size, heads=1, eps=RMS_EPS, return_reads=False):
    """Block AttnRes / MHAR (docs/design.md §2, §3, §8).

    ``params``: ``queries[L, 1, d]``, ``final_query[d]``.
    """
    L = len(fs)
    e = np.array(e, np.float64)
    summaries = [e]  # b_0, b_1, ...
    partial = None
    reads = []
    for l in range(1, L + 1):
        n, first, last = _blocks(L, block_size)[l]
        assert len(summaries) == n + 1
        srcs = [(s, None) for s in summaries]
        if not first:
            srcs.append((partial, None))
        z = depth_read(srcs, params["queries"][l - 1][:1], (0,), heads=heads, eps=eps)
        h = z[0]
        reads.append(h)
        v = fs[l - 1](h)
        partial = v if partial is None else partial + v
        if last:
            summaries.append(partial)
            partial = None
    final = depth_read([(s, None) for s in summaries], params["final_query"][None], (0,), heads=heads, eps=eps)[0]
    return (final, reads) if return_reads else final


def msar(
    e, fs, params, *, block_size, kernel_sizes=(4, 8, 12), streams=None, conv=True, fusion="gate",
    segment_ids=None, eps=RMS_EPS, final_merge="residual", return_reads=False,
):
    """MSAR (docs/design.md §2, §4): conv-bank assignment of Appendix C, per-stream softmax, H_pre gate.

    ``params``: ``queries[L, m, d]``, ``conv_banks[L, sum(kernels), d]`` (if conv),
    ``gate_w[L, m*d, m]``, ``gate_a[L]``, ``gate_b[L, m]`` (if fusion == "gate").
    Banks: b_0 -> bank 0, completed b_j -> bank max(B_j) = j*S, partial p_l -> bank l-1.
    """
    L = len(fs)
    S = block_size
    e = np.array(e, np.float64)
    m = params["queries"].shape[1] if streams is None else streams
    kernels = (0, *kernel_sizes) if conv else (0,) * m
    assert len(kernels) == m
    banks = params.get("conv_banks") if conv else None

    def bank(i):
        return None if banks is None else banks[i]

    summaries = [(e, bank(0))]
    partial = None
    h = v = None
    reads = []
    for l in range(1, L + 1):
        n, first, last = _blocks(L, S)[l]
        srcs = list(summaries)
        if not first:
            srcs.append((partial, bank(l - 1)))
        z = depth_read(srcs, params["queries"][l - 1], kernels, heads=1, segment_ids=segment_ids, eps=eps)
        if fusion == "gate":
            h = fuse_gate(z, params["gate_w"][l - 1], params["gate_a"][l - 1], params["gate_b"][l - 1], eps)
        else:
            h = fuse_mean(z)
        reads.append(h)
        v = fs[l - 1](h)
        partial = v if partial is None else partial + v
        if last:
            j = n + 1  # this completes b_j, j = 1..N; its bank is max(B_j) = j*S (0..L-1 range: j*S < L)
            summaries.append((partial, bank(j * S) if j * S < L else None))
            partial = None
    if final_merge == "sum":
        final = sum(s for s, _ in summaries)
    else:
        final = h + v
    return (final, reads) if return_reads else final


def sinkhorn(logits: np.ndarray, iters: int = 20, eps: float = MHC_EPS) -> np.ndarray:
    """Sinkhorn as docs/design.md §6 and DeepSeek's reference implementation run it, one token, explicit loops. ``logits[m, m]``.

    Pass 1: max-subtracted row softmax, + eps, then column normalisation; passes
    2..iters: row normalisation then column normalisation; eps in every denominator.
    """
    m = logits.shape[0]
    c = np.zeros((m, m))
    for i in range(m):
        row = softmax_list([float(logits[i, j]) for j in range(m)])
        for j in range(m):
            c[i, j] = row[j] + eps

    def cols(c):
        out = c.copy()
        for j in range(m):
            s = sum(c[i, j] for i in range(m))
            for i in range(m):
                out[i, j] = c[i, j] / (s + eps)
        return out

    def rows(c):
        out = c.copy()
        for i in range(m):
            s = sum(c[i, j] for j in range(m))
            for j in range(m):
                out[i, j] = c[i, j] / (s + eps)
        return out

    c = cols(c)
    for _ in range(iters - 1):
        c = cols(rows(c))
    return c


def mhc_coefficients_token(X, phi, bias, scale, iters=20):
    """One token: ``X[m, d]`` -> (H_pre[m], H_post[m], C[m, m])."""
    m, d = X.shape
    x = X.reshape(m * d)  # stream-major flatten
    mix = (x @ phi) / math.sqrt(float(np.mean(x * x)) + 1e-6)
    pre = scale[0] * mix[0:m] + bias[0:m]
    post = scale[1] * mix[m : 2 * m] + bias[m : 2 * m]
    res = np.zeros((m, m))
    for i in range(m):
        for j in range(m):
            k = 2 * m + i * m + j
            res[i, j] = scale[2] * mix[k] + bias[k]
    return sigmoid(pre), 2.0 * sigmoid(post), sinkhorn(res, iters)


class MHCState:
    """mHC's m-stream state ``X[B, T, m, d]`` (docs/design.md §6), stepped per token."""

    def __init__(self, e, m):
        e = np.array(e, np.float64)
        self.X = np.repeat(e[:, :, None, :], m, axis=2)
        self.m = m

    def read(self, phi, bias, scale, iters=20):
        B, T, m, d = self.X.shape
        h = np.zeros((B, T, d))
        coeffs = {}
        for b in range(B):
            for t in range(T):
                h_pre, h_post, c = mhc_coefficients_token(self.X[b, t], phi, bias, scale, iters)
                for i in range(m):
                    h[b, t] = h[b, t] + h_pre[i] * self.X[b, t, i]
                coeffs[b, t] = (h_post, c)
        return h, coeffs

    def write(self, v, coeffs):
        B, T, m, d = self.X.shape
        new = np.zeros_like(self.X)
        for b in range(B):
            for t in range(T):
                h_post, c = coeffs[b, t]
                for i in range(m):
                    acc = h_post[i] * v[b, t]
                    for j in range(m):
                        acc = acc + c[j, i] * self.X[b, t, j]  # H_res = C^T: X'_i = sum_j C[j, i] X_j
                    new[b, t, i] = acc
        self.X = new

    def final(self):
        return self.X.sum(axis=2)


def mhc(e, fs, params, *, streams=4, iters=20, **_):
    """mHC (docs/design.md §6). ``params``: ``phi[L, m*d, m^2+2m]``, ``bias[L, m^2+2m]``, ``scale[L, 3]``."""
    st = MHCState(e, streams)
    for l in range(1, len(fs) + 1):
        h, coeffs = st.read(params["phi"][l - 1], params["bias"][l - 1], params["scale"][l - 1], iters)
        v = fs[l - 1](h)
        st.write(v, coeffs)
    return st.final()


def attnres_mhc(e, fs, params, *, block_size, streams=4, iters=20, eps=RMS_EPS, **_):
    """AttnRes + mHC hybrid (docs/design.md §7): input = AttnRes read + H_pre read; v goes to both;
    final = AttnRes final read + sum_i X_i. ``params = {"attnres": ..., "mhc": ...}``."""
    pa, pm = params["attnres"], params["mhc"]
    L = len(fs)
    e = np.array(e, np.float64)
    st = MHCState(e, streams)
    summaries = [e]
    partial = None
    for l in range(1, L + 1):
        n, first, last = _blocks(L, block_size)[l]
        srcs = [(s, None) for s in summaries] + ([] if first else [(partial, None)])
        h_a = depth_read(srcs, pa["queries"][l - 1][:1], (0,), eps=eps)[0]
        h_m, coeffs = st.read(pm["phi"][l - 1], pm["bias"][l - 1], pm["scale"][l - 1], iters)
        v = fs[l - 1](h_a + h_m)
        partial = v if partial is None else partial + v
        st.write(v, coeffs)
        if last:
            summaries.append(partial)
            partial = None
    final_a = depth_read([(s, None) for s in summaries], pa["final_query"][None], (0,), eps=eps)[0]
    return final_a + st.final()


def run(name, e, fs, params, **kw):
    """Dispatch by mechanism name (the library's registry names)."""
    if name == "vanilla":
        return vanilla(e, fs)
    if name == "attnres":
        return attnres(e, fs, params, block_size=kw["block_size"], heads=1)
    if name == "mhar":
        return attnres(e, fs, params, block_size=kw["block_size"], heads=kw["heads"])
    if name == "msar":
        return msar(
            e, fs, params, block_size=kw["block_size"], kernel_sizes=kw.get("kernel_sizes", (4, 8, 12)),
            streams=kw.get("streams"), conv=kw.get("conv", True), fusion=kw.get("fusion", "gate"),
            segment_ids=kw.get("segment_ids"), final_merge=kw.get("final_merge", "residual"),
        )
    if name == "mhc":
        return mhc(e, fs, params, streams=kw.get("streams", 4))
    if name == "attnres_mhc":
        return attnres_mhc(e, fs, params, block_size=kw["block_size"], streams=kw.get("streams", 4))
    raise ValueError(name)


# --------------------------------------------------------------------------------------
# The toy sublayers used to plug the oracle against ``msar_jax.stack.DepthStack``.
# --------------------------------------------------------------------------------------


def toy_sublayers(layer_params, layer_kinds=None) -> list:
    """``f_l(h) = tanh(h @ W_l)`` per token; odd l use ``attn.w[(l-1)//2]``, even l the MLP
    of layer ``i = (l-2)//2``: ``<kind>.w[i - first layer of that kind]`` (the stack's
    attention/MLP interleaving; MLP parameters are stacked per kind)."""
    wa = np.asarray(layer_params["attn"]["w"], np.float64)
    n_layers = wa.shape[0]
    kinds = tuple(layer_kinds) if layer_kinds is not None else ("dense",) * n_layers
    fs = []
    for layer in range(n_layers):
        k = kinds[layer]
        wm = np.asarray(layer_params[k]["w"][layer - kinds.index(k)], np.float64)
        fs.append(lambda h, w=wa[layer]: np.tanh(h @ w))
        fs.append(lambda h, w=wm: np.tanh(h @ w))
    return fs


# --------------------------------------------------------------------------------------
# Glue to the library (kept apart: the oracle above never imports it).
# --------------------------------------------------------------------------------------

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def library_config(name, n_layers=2, d=8, **residual):
    """A validated tiny model config with ``residual`` overrides."""
    from msar_jax import config

    cfg = config.model_config()
    cfg.d_model = d
    cfg.n_layers = n_layers
    cfg.n_heads = 2
    cfg.n_kv_heads = 1
    cfg.head_dim = max(2, d // 2)
    cfg.mlp_dim = 2 * d
    cfg.vocab_size = 32
    cfg.max_seq_len = 64
    cfg.residual.name = name
    for k, v in residual.items():
        cfg.residual[k] = v
    config.validate(cfg)
    return cfg


def _rand_leaf(name: str, shape, rng, d: int) -> np.ndarray:
    """Random non-zero values for a mechanism parameter, scaled so every term matters."""
    if name in ("queries", "final_query"):
        x = 0.7 * rng.standard_normal(shape)
    elif name == "conv_banks":
        x = 0.5 * rng.standard_normal(shape)
    elif name in ("gate_w", "phi"):
        x = 2.0 * rng.standard_normal(shape) / math.sqrt(shape[-2])
    elif name in ("gate_a", "scale"):
        x = rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)
    elif name in ("gate_b", "bias"):
        x = 0.5 * rng.standard_normal(shape)
    else:
        x = 0.5 * rng.standard_normal(shape)
    return x.astype(np.float32)


def randomize_params(tree, rng, d):
    """Replace every leaf of a (nested) pure parameter dict with random non-zero values."""
    out = {}
    for k, v in tree.items():
        out[k] = randomize_params(v, rng, d) if isinstance(v, dict) else _rand_leaf(k, np.shape(v), rng, d)
    return out


def toy_sublayer_fn(kind, params, h, ctx):
    """The library-side twin of ``toy_sublayers``: ``tanh(h @ W)``, no aux loss."""
    import jax.numpy as jnp

    return jnp.tanh(h @ params["w"]), jnp.zeros((), jnp.float32)


def toy_layer_params(rng, n_layers, d, layer_kinds=None):
    kinds = tuple(layer_kinds) if layer_kinds is not None else ("dense",) * n_layers
    out = {"attn": {"w": (rng.standard_normal((n_layers, d, d)) / math.sqrt(d)).astype(np.float32)}}
    for k in dict.fromkeys(kinds):
        out[k] = {"w": (rng.standard_normal((kinds.count(k), d, d)) / math.sqrt(d)).astype(np.float32)}
    return out


def to_f64(tree):
    if isinstance(tree, dict):
        return {k: to_f64(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)


def oracle_kwargs(cfg, segment_ids=None) -> dict:
    """The oracle's keyword arguments for a library config."""
    r = cfg.residual
    return dict(
        block_size=r.block_size, heads=r.heads, streams=r.streams, kernel_sizes=tuple(r.kernel_sizes),
        conv=r.conv, fusion=r.fusion, final_merge=r.final_merge,
        segment_ids=None if segment_ids is None else np.asarray(segment_ids),
    )
