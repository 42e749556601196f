"""Prefill and one-token decoding steps with a cache (docs/design.md §10).

``prefill(model, tokens, lengths, max_len=...)`` runs the model's forward pass over right-padded
prompts (the same units, two-phase block reads and kernels as training) and returns the logits at
each prompt's last token and a ``Cache``; ``decode_step(model, cache, tokens)`` feeds one new token
per sequence and returns its logits and the updated cache. ``jit_decode_step(model)`` compiles the
step once with the cache donated (updated in place). The cache holds each layer's attention keys
and values and, for MSAR, per conv bank the last ``kappa_max - 1`` token values of the one source
that bank expands (Eq. 10): ``L (kappa_max - 1) d`` numbers per sequence, independent of its
length; the other mechanisms read only the new token's own depth sources and keep nothing across
tokens (``ResidualMechanism.history_tokens``). ``cache_bytes`` is the size formula.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from msar_jax import config as config_lib
from msar_jax.model.layers import SequenceContext
from msar_jax.model.transformer import pure
from msar_jax.residuals import mechanism_class
from msar_jax.stack import PrefillRecord


class Cache(NamedTuple):
    """What a decoding step keeps per sequence (a pytree; every leaf has the batch axis).

    ``keys``/``values``: ``[n_layers, B, max_len, kv_heads, head_dim]`` in the activations' dtype,
    the rotated keys and the values of every position written so far (positions ``>= lengths``
    hold nothing a step reads). ``history``: ``[L, B, W, d]``, slot ``i`` the last
    ``W = history_tokens`` token values (oldest first, zero before the document start) of the
    source conv bank ``i`` expands, or None when the mechanism keeps none (docs/design.md §10).
    ``lengths``: ``int32[B]`` tokens so far, the position of each sequence's next token.
    ``segment_start``: ``int32[B]`` the first position of the document the next token continues
    (attention and the conv windows never look before it).
    """

    keys: jax.Array
    values: jax.Array
    history: jax.Array | None
    lengths: jax.Array
    segment_start: jax.Array

    @property
    def max_len(self) -> int:
        return self.keys.shape[2]

    @property
    def batch(self) -> int:
        return self.keys.shape[1]


def _history_tokens(model_cfg) -> int:
    return mechanism_class(model_cfg.residual.name).history_tokens(model_cfg)


def cache_bytes(model_config, batch: int, max_len: int) -> dict:
    """Bytes of a ``Cache`` for ``batch`` sequences of up to ``max_len`` tokens, by part:
    ``kv`` = ``2 n_layers B max_len kv_heads head_dim`` values, ``conv_windows`` =
    ``L B W d`` values (``W = kappa_max - 1`` for MSAR, 0 otherwise; Eq. 10), both in
    ``model.dtype``; ``lengths`` = the two ``int32[B]`` counters; ``total``; and
    ``per_sequence`` = ``total / batch``. ``model_config``: the ``model`` section."""
    cfg = model_config
    item = jnp.dtype(cfg.dtype).itemsize
    kv = 2 * cfg.n_layers * batch * max_len * cfg.n_kv_heads * cfg.head_dim * item
    conv = config_lib.n_sublayers(cfg) * batch * _history_tokens(cfg) * cfg.d_model * item
    counters = 2 * batch * 4
    total = kv + conv + counters
    return dict(kv=kv, conv_windows=conv, lengths=counters, total=total, per_sequence=total // batch)


def _check_max_len(cfg, max_len) -> int:
    if not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise ValueError(f"max_len = {max_len!r}: must be a positive int (the cache's positions)")
    if max_len > cfg.max_seq_len:
        raise ValueError(f"max_len = {max_len} exceeds the model's context, model.max_seq_len = {cfg.max_seq_len}")
    return int(max_len)


def init_cache(model, batch: int, max_len: int) -> Cache:
    """An empty cache (zeros; every length 0) for ``batch`` sequences of up to ``max_len`` tokens."""
    cfg = model.cfg
    max_len = _check_max_len(cfg, max_len)
    dtype = jnp.dtype(cfg.dtype)
    kv_shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.head_dim)
    w = _history_tokens(cfg)
    history = jnp.zeros((config_lib.n_sublayers(cfg), batch, w, cfg.d_model), dtype) if w else None
    zeros = jnp.zeros((batch,), jnp.int32)
    return Cache(jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype), history, zeros, zeros)


def _concrete(x) -> np.ndarray | None:
    """``x`` as numpy when its values are known here (not under a trace), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_prompts(cfg, tokens, lengths, max_len, segment_ids):
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens: shape {tokens.shape} dtype {tokens.dtype}; must be int [batch, prompt length]")
    b, t = tokens.shape
    if t < 1:
        raise ValueError("tokens has 0 columns: every prompt needs at least one token")
    if lengths.shape != (b,):
        raise ValueError(f"lengths: shape {lengths.shape}; must be [{b}], one per row of tokens")
    if segment_ids is not None and segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids: shape {segment_ids.shape}; must equal tokens' shape {tokens.shape}")
    known = _concrete(lengths)
    if known is None:
        return
    for row, n in enumerate(known.tolist()):
        if n < 1:
            raise ValueError(f"lengths[{row}] = {n}: an empty prompt; every prompt needs at least one token")
        if n > t:
            raise ValueError(f"lengths[{row}] = {n} exceeds the {t} columns of tokens")
        if n > max_len:
            raise ValueError(f"lengths[{row}] = {n}: the prompt is longer than max_len = {max_len}")


def prefill(model, tokens, lengths, *, max_len: int, segment_ids=None):
    """Run ``tokens[B, T]`` (right-padded prompts of ``lengths[B]`` tokens) through the model's
    forward pass and fill a cache for ``max_len`` positions.

    ``segment_ids[B, T]`` (optional) marks packed documents as in training: the next token
    continues the document of each prompt's last token. Returns ``(logits[B, V]`` float32 at each
    prompt's last token, ``Cache)``. Compiled once per shape.
    """
    cfg = model.cfg
    max_len = _check_max_len(cfg, max_len)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)
    segment_ids = None if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    _check_prompts(cfg, tokens, lengths, max_len, segment_ids)
    graphdef, state = nnx.split(model)
    return _prefill_jit(graphdef, state, tokens, lengths, segment_ids, max_len)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _prefill_jit(graphdef, state, tokens, lengths, segment_ids, max_len):
    return _prefill(nnx.merge(graphdef, state), tokens, lengths, segment_ids, max_len)


def _prefill(model, tokens, lengths, segment_ids, max_len):
    cfg = model.cfg
    b, t = tokens.shape
    columns = jnp.arange(t, dtype=jnp.int32)
    last = lengths - 1
    if segment_ids is None:
        start = jnp.zeros((b,), jnp.int32)
    else:  # documents are contiguous runs of one id (as packing writes them)
        last_id = jnp.take_along_axis(segment_ids, last[:, None], axis=1)
        start = jnp.min(jnp.where((segment_ids == last_id) & (columns <= last[:, None]), columns, t), axis=1)
    w = _history_tokens(cfg)
    index = last[:, None] - (w - 1) + jnp.arange(w, dtype=jnp.int32)  # [B, W]: the window's tokens, oldest first
    inside = index >= start[:, None]

    def window(source):  # [B, T, d] -> [B, W, d]
        taken = jnp.take_along_axis(source, jnp.clip(index, 0, t - 1)[:, :, None], axis=1)
        return jnp.where(inside[:, :, None], taken, jnp.zeros_like(taken))

    ctx = SequenceContext(positions=jnp.broadcast_to(columns, (b, t)), segment_ids=segment_ids)
    hidden, (k, v), history = model.stack().prefill(
        pure(model.residual), model.layer_params(), model.embed(tokens), ctx,
        PrefillRecord(model._sublayer_prefill, window))
    logits = model.head(jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0])
    cache = init_cache(model, b, max_len)
    n = min(t, max_len)  # columns past max_len are padding (lengths <= max_len)
    cache = cache._replace(
        keys=cache.keys.at[:, :, :n].set(k[:, :, :n].astype(cache.keys.dtype)),
        values=cache.values.at[:, :, :n].set(v[:, :, :n].astype(cache.values.dtype)),
        history=None if history is None else history.astype(cache.history.dtype),
        lengths=lengths, segment_start=start,
    )
    return logits, cache


def _check_step(cache: Cache, tokens):
    if tokens.shape != (cache.batch,):
        raise ValueError(f"tokens: shape {tokens.shape}; a decoding step takes one token per sequence, [{cache.batch}]")
    known = _concrete(cache.lengths)
    if known is not None and known.size and int(known.max()) >= cache.max_len:
        row = int(np.argmax(known))
        raise ValueError(f"cache.lengths[{row}] = {int(known[row])}: the cache is full (max_len = {cache.max_len}); "
                         "decoding another token needs a larger max_len")


def decode_step(model, cache: Cache, tokens):
    """Feed ``tokens[B]`` (one new token per sequence) and return ``(logits[B, V]`` float32 of
    the next token, the updated ``Cache)``. Traceable: ``jit_decode_step`` compiles it with the
    cache donated."""
    tokens = jnp.asarray(tokens)
    _check_step(cache, tokens)
    cfg = model.cfg
    b = cache.batch
    ctx = SequenceContext(positions=cache.lengths[:, None], segment_ids=None)
    hidden, (k, v), new_values = model.stack().decode(
        pure(model.residual), model.layer_params(), model.embed(tokens[:, None]), ctx,
        model.decode_sublayer(cache.segment_start), (cache.keys, cache.values), cache.history)
    logits = model.head(hidden[:, 0])
    rows = jnp.arange(b)
    keys = cache.keys.at[:, rows, cache.lengths].set(k[:, :, 0].astype(cache.keys.dtype))
    values = cache.values.at[:, rows, cache.lengths].set(v[:, :, 0].astype(cache.values.dtype))
    history = cache.history
    if history is not None:  # the windows slide by one token: drop the oldest, append the new
        history = jnp.concatenate([history[:, :, 1:], new_values.astype(history.dtype)], axis=2)
    del cfg
    return logits, Cache(keys, values, history, cache.lengths + 1, cache.segment_start)


def jit_decode_step(model):
    """``step(cache, tokens) -> (logits, cache)``: ``decode_step`` compiled once, the cache
    donated (its buffers are updated in place: use only the returned cache). Before each step it
    reads ``cache.lengths`` to refuse a full cache, which waits for the previous step."""
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def compiled(state, cache, tokens):
        return decode_step(nnx.merge(graphdef, state), cache, tokens)

    def step(cache: Cache, tokens):
        tokens = jnp.asarray(tokens)
        _check_step(cache, tokens)
        return compiled(state, cache, tokens)

    return step
