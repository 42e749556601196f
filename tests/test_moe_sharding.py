"""The MoE dispatch under a mesh (``layers.moe_mlp``): 8 fake CPU devices, float32.

Under a mesh whose batch axes split the rows, the router, the grouping by expert, the experts'
``ragged_dot``s and the scatter back run per row shard in a ``shard_map`` over those axes
(``kernel_sharding.over_batch(..., manual_batch_axes_only=True)``); the tensor axis stays
XLA's. Loss, load-balance loss and every gradient equal one device's, and the compiled step
holds no ``[B*T*k, d]`` array: the gather over the global batch's assignments that XLA makes
when it partitions the dispatch itself.
"""

from __future__ import annotations

import functools
import re

import jax
import numpy as np
import pytest

from msar_jax.config import load_config
from msar_jax.model.transformer import lm_loss
from msar_jax.parallel import kernel_sharding
from msar_jax.parallel import mesh as mesh_lib
from msar_jax.train import step as step_lib

T, ROWS, TOP_K, D = 8, 8, 2, 24  # D: a width no other array of the smoke model has
ONE = dict(data=1, stage=1, fsdp=1, tensor=1)
LAYOUTS = {
    "fsdp4": dict(ONE, fsdp=4),
    "data2_fsdp2": dict(ONE, data=2, fsdp=2),
    "fsdp2_tensor2": dict(ONE, fsdp=2, tensor=2),
}


def _config(mechanism, layout):
    """Two MoE layers (no leading dense layer), 4 experts, top-2, one shared expert; the
    load-balance loss at weight 1 so its gradients weigh as much as the cross entropy's."""
    overrides = {"model.dtype": "float32", "model.d_model": D, "model.moe.enabled": True,
                 "model.moe.n_dense_layers": 0, "model.moe.n_routed_experts": 4, "model.moe.top_k": TOP_K,
                 "model.moe.expert_dim": 16, "model.moe.shared_expert_dim": 16, "model.moe.aux_loss_weight": 1.0,
                 **{f"parallel.mesh.{k}": v for k, v in layout.items()}}
    return load_config(f"configs/{mechanism}.py:smoke=1,seq_len={T}", overrides)


def _compiled(mechanism, layout):
    """``(compiled value_and_grad of (loss, metrics), params, batch)`` on ``layout``'s mesh, the
    parameters and batch in training's shardings; parameters moved off their init by noise of
    scale 0.3 so the router spreads tokens over every expert."""
    cfg = _config(mechanism, layout)
    model_def, params = step_lib.init_model(cfg.model, seed=3)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(treedef, [p + 0.3 * jax.random.normal(k, p.shape, p.dtype)
                                          for p, k in zip(leaves, keys)])
    batch = jax.random.randint(jax.random.key(2), (ROWS, T + 1), 0, cfg.model.vocab_size)
    degrees = [cfg.parallel.mesh[a] for a in mesh_lib.MESH_AXES]
    mesh = mesh_lib.make_mesh(cfg.parallel.mesh, jax.devices()[: int(np.prod(degrees))])
    rules = mesh_lib.rules_for(cfg.parallel)
    in_shardings = (mesh_lib.param_shardings(cfg.model, mesh, rules), mesh_lib.batch_sharding(mesh, ROWS, rules))
    fn = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(model_def.merge(p), b), has_aux=True),
                 in_shardings=in_shardings)
    with mesh_lib.use_mesh(mesh, rules):
        return fn.lower(params, batch).compile(step_lib.FAST_COMPILE), params, batch


@functools.lru_cache(maxsize=None)
def _loss_and_grads(mechanism, layout):
    compiled, params, batch = _compiled(mechanism, dict(layout))
    (loss, metrics), grads = compiled(params, batch)
    return jax.device_get((loss, metrics["aux_loss"], grads))


def _key(layout):
    return tuple(sorted(layout.items()))


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=str)
def test_sharded_moe_equals_one_device(layout):
    loss, aux, grads = _loss_and_grads("vanilla", _key(LAYOUTS[layout]))
    want_loss, want_aux, want_grads = _loss_and_grads("vanilla", _key(ONE))
    assert want_aux > 1.0  # two layers' E * sum_e f_e P_e, each 1 for a uniform router
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(aux, want_aux, rtol=1e-5)
    paths = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), w in zip(paths, jax.tree.leaves(want_grads), strict=True):
        scale = float(np.max(np.abs(w)))
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def _assignment_shapes(hlo: str) -> set[str]:
    """Every ``f32[N, D]`` shape in ``hlo`` with N a multiple of ``T * TOP_K`` rows' worth of
    assignments: the grouped tokens the experts read, ``[rows * T * k, d]``."""
    return {m for m in re.findall(rf"f32\[(\d+),{D}\]", hlo) if int(m) % (T * TOP_K) == 0 and int(m) > T}


def test_dispatch_holds_only_its_shard_of_the_assignments(monkeypatch):
    """Under fsdp = 4 each device groups its own 2 rows: ``[2 * T * k, d]``, never the global
    ``[8 * T * k, d]``. Without the ``shard_map`` XLA gathers the global batch's assignments on
    every device (the MoE sublayer's 5 GiB buffers of paper_28b on 64 v5p chips)."""
    layout = LAYOUTS["fsdp4"]
    global_rows, local_rows = str(ROWS * T * TOP_K), str(ROWS // 4 * T * TOP_K)
    shapes = _assignment_shapes(_compiled("vanilla", layout)[0].as_text())
    assert local_rows in shapes and global_rows not in shapes, shapes
    monkeypatch.setattr(kernel_sharding, "needs_shard_map", lambda: False)
    unsharded = _assignment_shapes(_compiled("vanilla", layout)[0].as_text())
    assert global_rows in unsharded, unsharded
