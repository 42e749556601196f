"""Prefill plus one-token decoding steps give the full-sequence forward's logits (docs/design.md §10).

Every case: right-padded prompts of different lengths (padding filled with other tokens), prefilled
into a cache, then decoded one token at a time; the logits at every decoded position must equal
the full forward pass's (float32, 1e-5 relative to the largest logit). Parameters are random and
non-zero everywhere: zero-initialised queries, gates and conv banks would hide a wrong window or
a wrong bank. The quick cases run by default, the full matrix of mechanisms and ablations in the
slow suite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from msar_jax import config as config_lib
from msar_jax.inference import decode
from msar_jax.model.transformer import Transformer

RTOL = 1e-5


def make_model(spec: str, **overrides) -> Transformer:
    """The model of ``configs/<spec>`` in float32 with every parameter perturbed."""
    flat = {"model.dtype": "float32", **{f"model.{k}": v for k, v in overrides.items()}}
    cfg = config_lib.load_config(f"configs/{spec}", flat).model
    model = Transformer(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    key = jax.random.PRNGKey(7)
    leaves = [x + 0.2 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
              if jnp.issubdtype(x.dtype, jnp.floating) else x for i, x in enumerate(leaves)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def check_decode(model, lengths, steps, *, segment_ids=None, max_len=None, seed=0, compiled=None):
    """Prefill ``lengths`` prompts, decode ``steps`` tokens each, compare with the full forward.
    ``compiled``: a dict that keeps the jitted forward and decoding step across calls on the same
    model (calls with the same shapes then compile once)."""
    compiled = {} if compiled is None else compiled
    lengths = np.asarray(lengths)
    b, width = len(lengths), int(lengths.max()) + steps
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, model.cfg.vocab_size, (b, width)).astype(np.int32)
    seg = None if segment_ids is None else jnp.asarray(segment_ids)
    graphdef, state = nnx.split(model)
    if "forward" not in compiled:
        compiled["forward"] = jax.jit(lambda st, x, ids: nnx.merge(graphdef, st)(x, segment_ids=ids)[0])
    full = np.asarray(compiled["forward"](state, jnp.asarray(tokens), seg))
    prompts = rng.integers(0, model.cfg.vocab_size, (b, int(lengths.max()))).astype(np.int32)  # padding
    for row, n in enumerate(lengths):
        prompts[row, :n] = tokens[row, :n]
    prompt_seg = None if segment_ids is None else np.asarray(segment_ids)[:, : int(lengths.max())]
    logits, cache = decode.prefill(model, prompts, lengths, max_len=max_len or width, segment_ids=prompt_seg)
    scale = np.abs(full).max()
    rows = np.arange(b)
    np.testing.assert_allclose(np.asarray(logits), full[rows, lengths - 1], rtol=0, atol=RTOL * scale)
    if "step" not in compiled:
        compiled["step"] = decode.jit_decode_step(model)
    step = compiled["step"]
    for i in range(steps):
        logits, cache = step(cache, tokens[rows, lengths + i])
        np.testing.assert_allclose(np.asarray(logits), full[rows, lengths + i], rtol=0, atol=RTOL * scale,
                                   err_msg=f"decoding step {i}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths + steps)
    return cache


def two_documents(lengths, steps, split):
    """Segment ids: each row's first ``split`` tokens one document, the rest (decoding too) another."""
    width = int(np.max(lengths)) + steps
    ids = np.ones((len(lengths), width), np.int32)
    ids[:, :split] = 0
    return ids


# ----- quick cases (default suite) -----

def test_vanilla_ragged_batch():
    check_decode(make_model("vanilla.py:smoke=1"), [7, 3], steps=3)


def test_msar_across_a_depth_block_and_a_document_boundary():
    # 3 layers, S = 4: L = 6 sublayers in blocks {1..4}, {5, 6}; kappa_max = 12: the 14-token
    # prompt is longer than the windows, the 5-token one shorter; the document starts at token 4.
    model = make_model("msar.py:smoke=1", n_layers=3)
    lengths, steps = [14, 5], 3
    cache = check_decode(model, lengths, steps, segment_ids=two_documents(lengths, steps, 4))
    assert cache.history.shape == (6, 2, 11, model.cfg.d_model)
    np.testing.assert_array_equal(np.asarray(cache.segment_start), [4, 4])


@pytest.mark.slow
def test_full_msar_one_token_prompt():
    check_decode(make_model("ablations/full.py:smoke=1"), [1, 4], steps=2)


@pytest.mark.slow
def test_attnres_and_mhc_decode():
    check_decode(make_model("attnres.py:smoke=1", n_layers=3), [6, 2], steps=2)
    check_decode(make_model("mhc.py:smoke=1"), [6, 2], steps=2)


def test_cache_bytes_formula_matches_the_pytree():
    for spec in ("msar.py:smoke=1", "vanilla.py:smoke=1", "ablations/no_conv.py:smoke=1", "mhc.py:smoke=1"):
        model = make_model(spec, n_layers=3)
        cache = decode.init_cache(model, batch=3, max_len=20)
        counted = decode.cache_bytes(model.cfg, batch=3, max_len=20)
        leaves = jax.tree.leaves(cache)
        assert counted["total"] == sum(x.nbytes for x in leaves), spec
        assert counted["kv"] == cache.keys.nbytes + cache.values.nbytes
        conv = 0 if cache.history is None else cache.history.nbytes
        assert counted["conv_windows"] == conv, spec
    # MSAR's windows: L (kappa_max - 1) d values per sequence (L = 6, kappa_max = 12, d = 32).
    msar = config_lib.load_config("configs/msar.py:smoke=1", {"model.n_layers": 3}).model
    assert decode.cache_bytes(msar, 1, 20)["conv_windows"] == 6 * 11 * msar.d_model * 4


def test_errors_name_the_value_and_the_rule():
    model = make_model("vanilla.py:smoke=1")
    tokens = np.zeros((2, 4), np.int32)
    with pytest.raises(ValueError, match=r"lengths\[1\] = 0: an empty prompt"):
        decode.prefill(model, tokens, [4, 0], max_len=8)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 4: the prompt is longer than max_len = 3"):
        decode.prefill(model, tokens, [4, 2], max_len=3)
    with pytest.raises(ValueError, match=r"max_len = 33 exceeds the model's context, model.max_seq_len = 32"):
        decode.prefill(model, tokens, [4, 2], max_len=33)
    with pytest.raises(ValueError, match=r"lengths\[0\] = 5 exceeds the 4 columns"):
        decode.prefill(model, tokens, [5, 2], max_len=8)
    _, cache = decode.prefill(model, tokens, [4, 2], max_len=5)
    step = decode.jit_decode_step(model)
    _, cache = step(cache, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"cache.lengths\[0\] = 5: the cache is full \(max_len = 5\)"):
        step(cache, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"cache.lengths\[0\] = 5: the cache is full"):
        decode.decode_step(model, cache, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"one token per sequence, \[2\]"):
        step(cache, np.zeros((2, 1), np.int32))


# ----- the full matrix (slow suite) -----

MATRIX = [
    "vanilla.py", "mhc.py", "attnres.py", "mhar.py", "attnres_mhc.py", "msar.py",
    "ablations/full.py", "ablations/s2.py", "ablations/s8.py", "ablations/m2.py", "ablations/m8.py",
    "ablations/no_conv.py", "ablations/mean_fusion.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("spec", MATRIX)
def test_every_mechanism_and_ablation(spec):
    # 5 layers: L = 10 crosses block boundaries at S = 2, 4 and 8 (and a shorter last block);
    # prompts of 15, 6 and 1 tokens lie either side of kappa_max = 12 (m = 8: 16; m = 2: 4).
    # Both checks take the same shapes (one document given as segment ids 0), so each of the
    # forward, the prefill and the decoding step compiles once.
    model = make_model(f"{spec}:smoke=1", n_layers=5)
    steps, compiled = 4, {}
    check_decode(model, [15, 1], steps, max_len=24, segment_ids=np.zeros((2, 19), np.int32), compiled=compiled)
    lengths = [15, 6]
    check_decode(model, lengths, steps, max_len=24, segment_ids=two_documents(lengths, steps, 3), seed=1,
                 compiled=compiled)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["vanilla.py", "msar.py", "attnres_mhc.py"])
def test_moe_backbone(spec):
    model = make_model(f"{spec}:size=paper_10b,smoke=1", n_layers=3)
    assert model.moe is not None
    check_decode(model, [9, 4], steps=3)
