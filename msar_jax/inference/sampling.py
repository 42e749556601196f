"""Choosing the next token from logits, and the generation loop over prefill and decoding steps.

``sample(logits, key, temperature, top_k, top_p)`` draws one token per row from the distribution
``filtered_log_probs`` describes: the logits divided by the temperature, cut to the ``top_k``
largest (exactly k; ties broken by the lower token id), then to the smallest nucleus of the most
likely tokens whose probability sums to at least ``top_p``. Temperature 0 is greedy (argmax).
Pure functions of arrays and a PRNG key: the same key gives the same tokens.

``generate(model, prompts, ...)`` runs ``msar_jax.inference.decode.prefill`` once over the prompts
(right-padded, each with its length) and then one jitted ``decode_step`` per new token, each row
stopping at its first stop token, streaming every kept token to ``on_token(row, token)``. What the
cache holds and why the step needs no depth cache for most mechanisms: docs/design.md §10.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; checked on construction (``ValueError`` naming the field).

    ``temperature``: 0 = greedy, else the logits are divided by it. ``top_k``: keep the k most
    likely tokens (0 = all). ``top_p``: keep the smallest set of most likely tokens whose
    probability sums to at least ``top_p`` (1 = all)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature = {t!r}: must be a finite number >= 0 (0 = greedy)")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise ValueError(f"top_k = {k!r}: must be an integer >= 0 (0 = no top-k cut)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p = {p!r}: must be in (0, 1] (1 = no nucleus cut)")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """``logits[B, V]`` (float32) of the distribution ``sample`` draws from: removed tokens are
    ``-inf``. Temperature 0 keeps only the argmax (the lowest id among equal maxima)."""
    cfg = Sampling(temperature, top_k, top_p)
    logits = jnp.asarray(logits, jnp.float32)
    rows, vocab = logits.shape
    if cfg.greedy:
        best = jnp.argmax(logits, axis=-1)
        return jnp.where(jnp.arange(vocab)[None, :] == best[:, None], 0.0, -jnp.inf)
    logits = logits / cfg.temperature
    k = cfg.top_k if 0 < cfg.top_k < vocab else 0
    if cfg.top_p >= 1.0 and k == 0:
        return logits
    if cfg.top_p >= 1.0:  # top-k alone: exactly k survive (lax.top_k breaks ties by the lower index)
        values, idx = jax.lax.top_k(logits, k)
        return jnp.full_like(logits, -jnp.inf).at[jnp.arange(rows)[:, None], idx].set(values)
    # Sorted descending (a stable sort of -logits: equal logits stay in id order), cut to k, then
    # to the nucleus: token i survives when the probability before it is still < top_p, so the
    # kept prefix is the shortest whose sum reaches top_p (the most likely token always stays).
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    if k:
        ranked = jnp.where(jnp.arange(vocab)[None, :] < k, ranked, -jnp.inf)
    probs = jax.nn.softmax(ranked, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    ranked = jnp.where(before < cfg.top_p, ranked, -jnp.inf)
    return jnp.full_like(logits, -jnp.inf).at[jnp.arange(rows)[:, None], order].set(ranked)


def filtered_log_probs(logits: jax.Array, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Log-probabilities ``[B, V]`` of the next token as ``sample`` draws it (``-inf``: never)."""
    return jax.nn.log_softmax(filtered_logits(logits, temperature, top_k, top_p), axis=-1)


def sample(logits: jax.Array, key: jax.Array, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
    """One token per row of ``logits[B, V]``: int32 ``[B]``. Greedy at temperature 0 (``key``
    unused), else a draw from ``filtered_logits`` with ``key``."""
    cfg = Sampling(temperature, top_k, top_p)
    if cfg.greedy:
        return jnp.argmax(jnp.asarray(logits, jnp.float32), axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, *dataclasses.astuple(cfg)), axis=-1).astype(jnp.int32)


@functools.lru_cache(maxsize=16)
def _jitted_sampler(cfg: Sampling) -> Callable:
    return jax.jit(functools.partial(sample, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p))


@dataclasses.dataclass
class Generation:
    """What ``generate`` returns: per prompt, the new tokens (a stop token that ended a row is
    not among them) and that stop token, or ``None`` where the row ran to ``max_new_tokens``."""

    tokens: list[list[int]]
    stopped_by: list[int | None]


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, context: int) -> list[list[int]]:
    """The prompts as lists of ints; ``ValueError`` for an empty prompt, an id outside the
    vocabulary, or a prompt that leaves no room for a new token in ``context`` positions."""
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in np.asarray(p, np.int64).reshape(-1)]
        if not ids:
            raise ValueError(f"prompt {i} is empty: a continuation needs at least one prompt token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} holds token id {bad[0]}, outside the model's vocabulary [0, {vocab_size})")
        if len(ids) >= context:
            raise ValueError(f"prompt {i} has {len(ids)} tokens; the context holds {context}, so a prompt may "
                             f"have at most {context - 1} (one position is left for the first new token)")
        out.append(ids)
    if not out:
        raise ValueError("no prompts given")
    return out


def generate(model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, stop_tokens: Sequence[int] = (),
             max_len: int | None = None, on_token: Callable[[int, int], None] | None = None) -> Generation:
    """Continue each of ``prompts`` (token-id lists of any lengths) by up to ``max_new_tokens``.

    ``model``: a ``msar_jax.model.transformer.Transformer``. ``max_len``: the cache's positions,
    default the longest prompt plus ``max_new_tokens``; at most ``model.cfg.max_seq_len``, and a
    row's prompt plus its new tokens must fit in it (``ValueError`` otherwise). The token after
    step ``i`` is drawn with ``jax.random.fold_in(jax.random.key(seed), i)``, so a seed fixes
    the output. ``on_token(row, token)`` is called for every kept token as soon as it is drawn;
    a row ends at the first token in ``stop_tokens`` (neither kept nor passed to ``on_token``)."""
    from msar_jax.inference import decode

    cfg = Sampling(temperature, top_k, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens = {max_new_tokens!r}: must be an integer >= 0")
    context = int(model.cfg.max_seq_len)
    prompts = check_prompts(prompts, int(model.cfg.vocab_size), context)
    longest = max(map(len, prompts))
    if max_len is None:
        max_len = min(context, longest + max(int(max_new_tokens), 1))
    if not 0 < max_len <= context:
        raise ValueError(f"max_len = {max_len}: must be in [1, model.max_seq_len = {context}]")
    if longest + max_new_tokens > max_len:
        raise ValueError(f"the longest prompt ({longest} tokens) plus max_new_tokens = {max_new_tokens} needs "
                         f"{longest + max_new_tokens} positions; max_len = {max_len} (model.max_seq_len = "
                         f"{context}) holds {max_len}")
    rows = len(prompts)
    result = Generation([[] for _ in range(rows)], [None] * rows)
    if max_new_tokens == 0:
        return result
    stops = {int(t) for t in stop_tokens}
    tokens = np.zeros((rows, longest), np.int32)
    for r, ids in enumerate(prompts):
        tokens[r, :len(ids)] = ids
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    draw = _jitted_sampler(cfg)
    graphdef, state = nnx.split(model)
    base_key = jax.random.key(seed)

    logits, cache = decode.prefill(model, jnp.asarray(tokens), jnp.asarray(lengths), max_len=max_len)
    done = np.zeros(rows, bool)
    for i in range(max_new_tokens):
        new = draw(logits, jax.random.fold_in(base_key, i))
        host = np.asarray(jax.device_get(new))
        for r in range(rows):
            if done[r]:
                continue
            t = int(host[r])
            if t in stops:
                done[r], result.stopped_by[r] = True, t
                continue
            result.tokens[r].append(t)
            if on_token is not None:
                on_token(r, t)
        if done.all() or i == max_new_tokens - 1:
            break
        logits, cache = _decode_step(graphdef, state, cache, new)
    return result


@functools.partial(jax.jit, static_argnums=0, donate_argnums=2)
def _decode_step(graphdef, state, cache, tokens):
    """``decode.decode_step`` compiled once per model structure and cache shape, the cache donated.

    ``decode.jit_decode_step(model)`` compiles a new function for every model object (a notebook
    or a test that generates several times would compile each time); keyed on the static graphdef
    with the params passed in, one compile serves every call. ``generate`` never feeds a full
    cache (the prompt plus the new tokens fit in ``max_len``), the check that wrapper adds."""
    from msar_jax.inference import decode

    return decode.decode_step(nnx.merge(graphdef, state), cache, tokens)
