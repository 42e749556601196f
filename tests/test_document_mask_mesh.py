"""``data.document_mask`` under a mesh (8 fake CPU devices, float32): a train step on a dict batch
``{tokens, segment_ids}`` gives the single-device loss and gradients under data = 2 x fsdp = 2
and under data = 8, with the segment ids placed and consumed in the tokens' sharding.

The step is the training loop's (``Layout.train_step`` on batches placed by
``Layout.global_batch``, as ``msar_jax.train.train`` does) with plain SGD at learning rate 1, so
``params - new_params`` is the gradient itself. The vanilla model runs by default, MSAR (its
depth-wise attention over block summaries sharded too) with ``-m slow``. Mesh layouts:
docs/parallelism.md section 1; the document mask: docs/training.md §6.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from msar_jax.config import load_config
from msar_jax.parallel import layout as layout_lib
from msar_jax.train import step

pytestmark = pytest.mark.usefixtures("fast_train_compile")

BATCH, SEQ_LEN = 8, 16
MESHES = {"data2_fsdp2": dict(data=2, fsdp=2), "data8": dict(data=8)}


def _config(mechanism: str, mesh=None):
    over = {"model.dtype": "float32", "train.batch_size": BATCH}
    over |= {f"parallel.mesh.{k}": v for k, v in (mesh or {}).items()}
    return load_config(f"configs/{mechanism}.py:smoke=1,seq_len={SEQ_LEN}", over)


def _batch(vocab_size: int) -> dict[str, np.ndarray]:
    """Rows of the loader's form: int32 ``[B, T+1]`` tokens and segment ids counting the document
    starts inside each window (0 to 3 of them per row, so some rows hold one document)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab_size, size=(BATCH, SEQ_LEN + 1)).astype(np.int32)
    starts = np.zeros((BATCH, SEQ_LEN + 1), np.int32)
    for row in range(BATCH):
        starts[row, rng.choice(np.arange(1, SEQ_LEN + 1), size=row % 4, replace=False)] = 1
    return {"tokens": tokens, "segment_ids": np.cumsum(starts, axis=1).astype(np.int32)}


def _sgd_step(model_def, layout=None, model_cfg=None, params=None):
    """``(train_step, state)`` with ``optax.sgd(1.0)``: plain, or the layout's sharded step."""
    tx, schedule = optax.sgd(1.0), optax.constant_schedule(1.0)
    if layout is None:
        return step.make_train_step(model_def, tx, schedule), step.init_state(jax.tree.map(jnp.array, params), tx)
    _, _, ssh = layout.abstract_state(model_cfg, tx)
    state = jax.device_put(step.init_state(jax.tree.map(jnp.array, params), tx), ssh)
    return layout.train_step(model_def, tx, schedule, model_cfg, ssh, step.COMPILER_OPTIONS), state


_REFERENCE: dict = {}


def reference(mechanism: str):
    """The single-device step of ``mechanism``: ``(params, batch, metrics, gradients)``, once each."""
    if mechanism not in _REFERENCE:
        cfg = _config(mechanism)
        model_def, params = step.init_model(cfg.model, 0)
        batch = _batch(cfg.model.vocab_size)
        train_step, state = _sgd_step(model_def, params=params)
        new, metrics = train_step(state, jax.tree.map(jnp.asarray, batch))
        grads = jax.tree.map(lambda p, n: np.asarray(p) - np.asarray(n), params, new["params"])
        unmasked = step.make_eval_step(model_def)(params, jnp.asarray(batch["tokens"]))
        assert abs(float(unmasked) - float(metrics["cross_entropy"])) > 1e-3  # the mask changes the loss
        _REFERENCE[mechanism] = params, batch, jax.device_get(metrics), grads
    return _REFERENCE[mechanism]


# The vanilla model compiles in ~3 s per mesh on 2 CPUs; the MSAR smoke model in ~12 s.
@pytest.mark.parametrize("mechanism,name", [
    ("vanilla", "data2_fsdp2"), ("vanilla", "data8"),
    pytest.param("msar", "data2_fsdp2", marks=pytest.mark.slow)])
def test_document_mask_step_matches_one_device(mechanism, name):
    params, batch, ref_metrics, ref_grads = reference(mechanism)
    cfg = _config(mechanism, MESHES[name])
    layout = layout_lib.make_layout(cfg.parallel, cfg.model, BATCH)
    assert dict(layout.mesh.shape) == {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1} | MESHES[name]
    model_def, _ = step.init_model(cfg.model, 0)
    train_step, state = _sgd_step(model_def, layout, cfg.model, params)

    placed = jax.tree.map(layout.global_batch, batch)  # what the training loop passes
    tokens_sharding = placed["tokens"].sharding
    assert placed["segment_ids"].sharding == tokens_sharding
    assert tokens_sharding.spec[0] is not None and tokens_sharding.spec[1] is None  # rows split, not time
    assert {s.index for s in placed["segment_ids"].addressable_shards} == \
        {s.index for s in placed["tokens"].addressable_shards}
    assert len({s.index for s in placed["tokens"].addressable_shards}) == layout.mesh.size  # rows split 4 or 8 ways
    with layout.context():  # compiled once, ahead of time, to read its input shardings
        compiled = train_step.lower(state, placed).compile()
        batch_in = compiled.input_shardings[0][1]  # the step consumes segment ids in the tokens' sharding
        assert batch_in["segment_ids"].is_equivalent_to(tokens_sharding, 2)
        assert batch_in["tokens"].is_equivalent_to(tokens_sharding, 2)
        new, metrics = compiled(state, placed)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["cross_entropy"]), float(ref_metrics["cross_entropy"]), rtol=1e-5)
    grads = jax.tree.map(lambda p, n: np.asarray(p) - np.asarray(jax.device_get(n)), params, new["params"])
    scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        want = ref_grads
        for key in path:
            want = want[key.key]
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
