"""The SPMD pipeline equals the sequential model (loss and every gradient, fp32), its
collective-permutes carry exactly the analytic hop (no MSAR stream axis), config errors,
and checkpoints across meshes. 8 fake CPU devices; tiny models (d=16, T=8, 4-8 layers)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msar_jax.config import ConfigError
from msar_jax.config import load_config
from msar_jax.model.transformer import lm_loss
from msar_jax.parallel import mesh as mesh_lib
from msar_jax.parallel import pipeline as pl
from msar_jax.train import step as step_lib

T, D = 8, 16
FAST = step_lib.FAST_COMPILE


def _model(mechanism, n_layers, **residual):
    overrides = {"model.n_layers": n_layers, "model.d_model": D}
    overrides.update({f"model.residual.{k}": v for k, v in residual.items()})
    cfg = load_config(f"configs/{mechanism}.py:smoke=1,seq_len={T}", overrides)
    model_def, params = step_lib.init_model(cfg.model, 0)
    # Move off the init (zero queries, zero convs) so every path carries signal.
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), params)
    return cfg, model_def, params


def _pcfg(stages, microbatches, repeats=1, cache=True):
    pcfg = mesh_lib.parallel_config()
    pcfg.pipeline.update(dict(stages=stages, microbatches=microbatches, repeats=repeats, cache=cache))
    pcfg.mesh.update(dict(data=-1, stage=stages))
    return pcfg


@functools.lru_cache(maxsize=None)
def _reference(mechanism, n_layers, batch):
    cfg, model_def, params = _model(mechanism, n_layers)
    tokens = np.random.default_rng(0).integers(0, 256, (batch, T + 1)).astype(np.int32)
    fn = jax.jit(jax.value_and_grad(lambda p: lm_loss(model_def.merge(p), tokens)[0]), compiler_options=FAST)
    return tokens, fn(params)


def _pipelined(mechanism, n_layers, stages, microbatches, repeats=1, cache=True, data=1):
    """(loss, grads, compiled HLO text, plan, mesh) of the pipelined model."""
    cfg, model_def, params = _model(mechanism, n_layers)
    tokens, _ = _reference(mechanism, n_layers, 2 * microbatches * data)
    pcfg = _pcfg(stages, microbatches, repeats, cache)
    pcfg.mesh.update(dict(data=data))
    mesh = mesh_lib.make_mesh(pcfg.mesh, jax.devices()[: stages * data])
    pl.validate(pcfg, cfg.model, tokens.shape[0], mesh)
    plan = pl.make_plan(pcfg, cfg.model)
    loss = pl.pipelined_lm_loss(plan, mesh)
    with mesh_lib.use_mesh(mesh, mesh_lib.PIPELINE_RULES):
        fn = jax.jit(jax.value_and_grad(lambda p: loss(model_def.merge(p), tokens)[0]))
        compiled = fn.lower(params).compile(FAST)
        value, grads = compiled(params)
    return value, grads, compiled.as_text(), plan, mesh


def _assert_equal(mechanism, n_layers, out, batch):
    _, (ref_loss, ref_grads) = _reference(mechanism, n_layers, batch)
    loss, grads = out[0], out[1]
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        scale = max(1.0, float(jnp.max(jnp.abs(r))))
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


# (mechanism, n_layers, stages, microbatches, repeats, cache)
DEFAULT_CASES = [
    ("msar", 4, 2, 4, 2, True),  # circular (2 repeats), stage boundaries inside blocks, caching
    ("mhc", 4, 2, 2, 1, True),  # GPipe, m-stream state crosses
]
SLOW_CASES = [  # the slow suite, which CI runs after the default one
    ("vanilla", 4, 4, 4, 1, True),  # GPipe, 4 stages, M = S
    ("attnres", 4, 2, 4, 1, True),  # GPipe, 2 stages, M = 2S, block boundary = stage boundary
    ("msar", 4, 2, 2, 1, True),
    ("msar", 4, 4, 4, 1, True),
    ("msar", 8, 4, 8, 1, True),
    ("msar", 8, 2, 2, 2, False),
    ("msar", 8, 4, 4, 2, True),
    ("attnres", 8, 4, 4, 2, True),
    ("attnres", 8, 2, 4, 2, False),
    ("vanilla", 8, 2, 4, 2, True),
    ("mhc", 8, 4, 8, 1, True),
    ("mhc", 8, 2, 2, 2, True),
    ("mhar", 4, 2, 2, 1, True),
    ("attnres_mhc", 4, 2, 4, 2, True),
]

_COMPILED: dict = {}


def _run(case):
    if case not in _COMPILED:
        mechanism, n_layers, stages, microbatches, repeats, cache = case
        _COMPILED[case] = _pipelined(mechanism, n_layers, stages, microbatches, repeats, cache)
    return _COMPILED[case]


@pytest.mark.parametrize("case", DEFAULT_CASES + [pytest.param(c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=lambda c: "-".join(map(str, c)))
def test_pipeline_equals_sequential(case):
    mechanism, n_layers, stages, microbatches = case[:4]
    _assert_equal(mechanism, n_layers, _run(case), 2 * microbatches)


# ----- MoE with a leading dense layer (run before the pipeline) -----

MOE = {"model.moe.enabled": True, "model.moe.n_dense_layers": 1, "model.moe.n_routed_experts": 4,
       "model.moe.top_k": 2, "model.moe.expert_dim": 16, "model.moe.shared_expert_dim": 16}


@pytest.mark.slow  # ~90 s on 2 CPU cores (two compiles of an MoE model)
def test_moe_with_leading_dense_layer_equals_sequential():
    """1 dense + 4 MoE layers, 2 stages of 2 MoE layers (the first stage boundary falls inside
    a block), 2 microbatches. The pipeline averages the load-balance loss over microbatches,
    so the reference is the full-batch cross entropy plus the mean of the microbatches' aux
    losses; loss, both parts and every gradient must match (fp32)."""
    n_layers, stages, M = 5, 2, 2
    cfg = load_config(f"configs/msar.py:smoke=1,seq_len={T}", {"model.n_layers": n_layers, "model.d_model": D, **MOE})
    model_def, params = step_lib.init_model(cfg.model, 0)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), params)
    tokens = np.random.default_rng(0).integers(0, 256, (2 * M, T + 1)).astype(np.int32)

    def reference(p):
        model = model_def.merge(p)
        ce = lm_loss(model, tokens)[1]["cross_entropy"]
        aux = jnp.mean(jnp.stack([lm_loss(model, tokens[m::M])[1]["aux_loss"] for m in range(M)]))
        return ce + aux, {"cross_entropy": ce, "aux_loss": aux}

    (ref_loss, ref_parts), ref_grads = jax.jit(jax.value_and_grad(reference, has_aux=True),
                                               compiler_options=FAST)(params)
    pcfg = _pcfg(stages, M)
    mesh = mesh_lib.make_mesh(pcfg.mesh, jax.devices()[:stages])
    pl.validate(pcfg, cfg.model, tokens.shape[0], mesh)
    plan = pl.make_plan(pcfg, cfg.model)
    assert plan.first_layer == 1 and plan.layers_per_stage == 2 and plan.send_partial
    loss = pl.pipelined_lm_loss(plan, mesh)
    with mesh_lib.use_mesh(mesh, mesh_lib.PIPELINE_RULES):
        fn = jax.jit(jax.value_and_grad(lambda p: loss(model_def.merge(p), tokens), has_aux=True))
        (value, parts), grads = fn.lower(params).compile(FAST)(params)
    assert float(ref_parts["aux_loss"]) > 0
    for key in ("cross_entropy", "aux_loss"):
        np.testing.assert_allclose(parts[key], ref_parts[key], rtol=1e-6, atol=1e-6, err_msg=key)
    np.testing.assert_allclose(value, ref_loss, rtol=1e-6, atol=1e-6)
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(ref_grads)):
        scale = max(1.0, float(jnp.max(jnp.abs(r))))
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


# ----- the collective-permutes of the compiled HLO -----


def test_msar_collective_permutes_carry_no_stream_axis_and_analytic_bytes():
    _, _, hlo, plan, mesh = _run(DEFAULT_CASES[0])
    m, mb = 4, 2
    ops = pl.collective_permutes(hlo)
    assert ops, "no collective-permute in the compiled pipeline"
    expected_vectors = plan.hop_vectors()  # window + partial
    assert expected_vectors == plan.window + 1 and plan.send_partial
    shapes = {shape for op in ops for _, shape in op["shapes"]}
    # Per-device operands: the partial [1, mb, T, d] and the summaries [1, W, mb, T, d];
    # no axis of size m (d = 16, T = 8, mb = 2, W = 1 here).
    assert shapes == {(1, mb, T, D), (1, plan.window, mb, T, D)}, shapes
    assert all(m not in shape for shape in shapes)
    # Each hop (the forward ppermute and its transpose in the backward) moves exactly the
    # analytic bytes.
    assert pl.hlo_hop_bytes(hlo) == [4 * expected_vectors * mb * T * D] * 2


def test_mhc_hop_carries_its_streams():
    _, _, hlo, plan, _ = _run(DEFAULT_CASES[1])
    shapes = {s for op in pl.collective_permutes(hlo) for _, s in op["shapes"]}
    assert shapes == {(1, 2, T, 4, D)}, shapes
    assert set(pl.hlo_hop_bytes(hlo)) == {4 * plan.hop_vectors() * 2 * T * D}


def test_hop_window_with_and_without_cache():
    # The 28B layout with dense MLPs (its MoE's leading dense layer would run before the pipeline).
    cfg = load_config("configs/msar.py:size=paper_28b", {"model.moe.enabled": False})
    rows = {}
    for stages, repeats in ((4, 1), (4, 2), (8, 1), (8, 2), (8, 4)):
        for cache in (False, True):
            plan = pl.make_plan(_pcfg(stages, stages, repeats, cache), cfg.model)
            rows[stages, repeats, cache] = (plan.window, plan.send_partial)
    # 32 layers, S = 8 sublayers (N = 8 blocks): 4 stages of 8 layers end 2 blocks each.
    assert rows[4, 1, False] == (6, False)
    assert rows[4, 1, True] == (6, False)  # GPipe: each stage is visited once, nothing to cache
    assert rows[4, 2, False] == (7, False) and rows[4, 2, True] == (3, False)
    assert rows[8, 2, False] == (7, True) and rows[8, 2, True] == (4, True)
    # With caching a hop never carries more than the previous stages - 1 stages' summaries.
    for (stages, repeats, cache), (w, _) in rows.items():
        if cache and repeats > 1:
            per_stage = max(1, -(-2 * (32 // (stages * repeats)) // 8))
            assert w <= (stages - 1) * per_stage


# ----- config validation -----


def test_pipeline_config_errors():
    cfg, _, _ = _model("msar", 4)
    mesh = mesh_lib.make_mesh(dict(data=4, stage=2, fsdp=1, tensor=1))
    with pytest.raises(ConfigError, match="model.n_layers"):
        pl.validate(_pcfg(2, 4, repeats=4), cfg.model, 8, mesh)  # 4 layers into 2 x 4
    with pytest.raises(ConfigError, match="microbatches"):
        pl.validate(_pcfg(2, 3), cfg.model, 6, mesh)
    with pytest.raises(ConfigError, match="train.batch_size"):
        pl.validate(_pcfg(2, 4), cfg.model, 6, mesh)  # 6 rows into 4 microbatches
    with pytest.raises(ConfigError, match="data x fsdp"):
        pl.validate(_pcfg(2, 2), cfg.model, 4, mesh)  # microbatch of 2 rows over data = 4
    with pytest.raises(ConfigError, match="parallel.mesh.stage"):
        pl.validate(_pcfg(3, 3), load_config("configs/msar.py:smoke=1", {"model.n_layers": 3}).model, 6, mesh)
    with pytest.raises(ConfigError, match="parallel.mesh"):
        mesh_lib.make_mesh(dict(data=3, stage=2, fsdp=1, tensor=1))
    # MoE: the leading dense layers run before the pipeline; the rest must split evenly.
    moe4 = load_config("configs/msar.py:smoke=1", {"model.n_layers": 4, **MOE}).model
    with pytest.raises(ConfigError, match="model.n_layers.*1 leading dense"):
        pl.validate(_pcfg(2, 2), moe4, 4, mesh)  # 3 MoE layers into 2 stages
    moe5 = load_config("configs/msar.py:smoke=1", {"model.n_layers": 5, **MOE}).model
    pl.validate(_pcfg(2, 2), moe5, 16, mesh)
    assert pl.make_plan(_pcfg(2, 2), moe5).first_layer == 1
    all_moe = load_config("configs/msar.py:smoke=1", {"model.n_layers": 4, **MOE, "model.moe.n_dense_layers": 0}).model
    assert pl.make_plan(_pcfg(2, 2), all_moe).first_layer == 0
