"""Gradient accumulation (``train.grad_accum``): M strided microbatches give the full batch's
loss and gradient (float32, plain SGD so the update is the gradient), alone and under data
parallelism through the training loop; bad settings are ``ConfigError``s naming the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from msar_jax.config import ConfigError
from msar_jax.config import load_config
from msar_jax.train import step, train

pytestmark = pytest.mark.usefixtures("fast_train_compile")

BASE = {"model.dtype": "float32", "checkpoint.every": 0, "train.eval_every": 0, "train.eval_batches": 1,
        "train.progress": False, "train.tensorboard": False, "train.depth_weights": False}


def sgd_step_result(mechanism, grad_accum, batch):
    # Two blocks of two sublayers: the MSAR step compiles faster than in one block of four.
    cfg = load_config(f"configs/{mechanism}.py:smoke=1,seq_len=16,block_size=2", BASE)
    model_def, params = step.init_model(cfg.model, seed=3)
    tx = optax.sgd(1.0)  # params_new = params - grad: compares gradients directly
    state = step.init_state(params, tx)
    fn = step.make_train_step(model_def, tx, lambda s: 1.0, grad_accum=grad_accum)
    before = jax.tree.map(np.asarray, state["params"])
    new, metrics = fn(state, batch)
    grads = jax.tree.map(lambda b, a: b - np.asarray(a), before, new["params"])
    return float(metrics["loss"]), float(metrics["cross_entropy"]), grads


# Vanilla in the slow suite: the accumulation does not depend on the mechanism, and MSAR's
# depth state is the case that could go wrong.
@pytest.mark.parametrize("mechanism", [pytest.param("vanilla", marks=pytest.mark.slow), "msar"])
def test_accumulated_equals_full_batch(mechanism):
    rng = np.random.default_rng(0)
    batch = jnp.asarray(rng.integers(0, 256, (8, 17), dtype=np.int32))
    loss1, ce1, g1 = sgd_step_result(mechanism, 1, batch)
    # The accumulation loop does not depend on the mechanism: two microbatch counts for Vanilla,
    # one for MSAR (each count is another CPU compile of the MSAR step, about 20 s).
    for m in ((2, 4) if mechanism == "vanilla" else (4,)):
        loss_m, ce_m, g_m = sgd_step_result(mechanism, m, batch)
        np.testing.assert_allclose(loss_m, loss1, rtol=1e-5)
        np.testing.assert_allclose(ce_m, ce1, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g_m), jax.tree.leaves(g1)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    # Not vacuous: every parameter group gets a gradient, and (Vanilla: the data path is the same for
    # every mechanism, and each batch shape is another CPU compile of the step) a microbatch alone
    # gives another one.
    for name, grads in g1.items():
        assert max(float(np.max(np.abs(g))) for g in jax.tree.leaves(grads)) > 1e-6, name
    if mechanism == "vanilla":
        loss_half, _, g_half = sgd_step_result(mechanism, 1, batch[::2])
        assert abs(loss_half - loss1) > 1e-4
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(g_half), jax.tree.leaves(g1))) > 1e-4


def test_training_loop_dp2_with_accumulation_matches_plain(tmp_path):
    over = BASE | {"train.steps": 3, "train.batch_size": 8}
    plain = train(load_config("configs/vanilla.py:smoke=1,seq_len=16", over), tmp_path / "plain",
                  handle_signals=False)
    dp_accum = train(load_config("configs/vanilla.py:smoke=1,seq_len=16",
                                 over | {"train.grad_accum": 2, "parallel.mesh.data": 2,
                                         "parallel.mesh.fsdp": 1, "parallel.mesh.stage": 1,
                                         "parallel.mesh.tensor": 1}),
                     tmp_path / "dp_accum", handle_signals=False)
    np.testing.assert_allclose([l for _, l in dp_accum["losses"]], [l for _, l in plain["losses"]],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, value, rule", [
    ({"train.grad_accum": 0}, 0, "positive integer"),
    ({"train.grad_accum": 3, "train.batch_size": 8}, 3, "must divide train.batch_size"),
    ({"train.grad_accum": 2, "train.batch_size": 8, "parallel.mesh.stage": 2, "parallel.mesh.data": 1,
      "parallel.mesh.fsdp": 1, "parallel.pipeline.stages": 2, "parallel.pipeline.microbatches": 2}, 2, "pipeline"),
    ({"train.grad_accum": 4, "train.batch_size": 8, "parallel.mesh.data": 4, "parallel.mesh.fsdp": 1,
      "parallel.mesh.stage": 1}, 4, "each microbatch"),
])
def test_bad_grad_accum(tmp_path, overrides, value, rule):
    cfg = load_config("configs/vanilla.py:smoke=1,seq_len=16", BASE | {"train.steps": 2} | overrides)
    with pytest.raises(ConfigError, match=rule) as err:
        train(cfg, tmp_path / "run", handle_signals=False)
    assert err.value.field == "train.grad_accum" and err.value.value == value
