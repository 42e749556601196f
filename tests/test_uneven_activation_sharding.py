"""An activation dimension is split only over the mesh axes that divide it (``logical_axes.fit_spec``).

With 2 rows on data=2, fsdp=2 the rules' batch axes ``(data, stage, fsdp)`` would split the rows 4
ways; XLA accepted that uneven split and the embedding's gradient came out wrong (64.0 where one
device gives 0). ``constrain`` now keeps ``data`` alone there, as ``spec_for`` does for arrays.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from msar_jax.config import load_config
from msar_jax.model.transformer import lm_loss
from msar_jax.parallel import logical_axes
from msar_jax.parallel import mesh as mesh_lib
from msar_jax.train import step as step_lib

T = 8


def test_fit_spec_keeps_the_axes_that_divide():
    sizes = {"data": 2, "stage": 1, "fsdp": 2, "tensor": 2}
    spec = P(("data", "stage", "fsdp"), None, "tensor")
    assert logical_axes.fit_spec(spec, (2, 8, 6), sizes) == P("data", None, "tensor")
    assert logical_axes.fit_spec(spec, (4, 8, 6), sizes) == P(("data", "fsdp"), None, "tensor")
    assert logical_axes.fit_spec(spec, (3, 8, 5), sizes) == P(None, None, None)


def _loss_and_grads(layout, rows=2):
    cfg = load_config(f"configs/vanilla.py:smoke=1,seq_len={T}",
                      {"model.dtype": "float32", **{f"parallel.mesh.{k}": v for k, v in layout.items()}})
    model_def, params = step_lib.init_model(cfg.model, seed=5)
    batch = jax.random.randint(jax.random.key(2), (rows, T + 1), 0, cfg.model.vocab_size)
    n = int(np.prod(list(layout.values())))
    mesh = mesh_lib.make_mesh(cfg.parallel.mesh, jax.devices()[:n])
    rules = mesh_lib.rules_for(cfg.parallel)
    shardings = (mesh_lib.param_shardings(cfg.model, mesh, rules), mesh_lib.batch_sharding(mesh, rows, rules))
    fn = jax.jit(jax.value_and_grad(lambda p, b: lm_loss(model_def.merge(p), b)[0]), in_shardings=shardings)
    with mesh_lib.use_mesh(mesh, rules):
        return jax.device_get(fn.lower(params, batch).compile(step_lib.FAST_COMPILE)(params, batch))


def test_two_rows_on_four_batch_shards_equal_one_device():
    one = _loss_and_grads(dict(data=1, stage=1, fsdp=1, tensor=1))
    got = _loss_and_grads(dict(data=2, stage=1, fsdp=2, tensor=2))
    np.testing.assert_allclose(got[0], one[0], rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(one[1]), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(w))) + 1e-7,
                                   err_msg=jax.tree_util.keystr(path))
