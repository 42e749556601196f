"""A mechanism defined outside the library plugs in through the protocol alone.

``ScalarGate`` (``h_{l+1} = h_l + g_l v_l``, one learned scalar per sublayer, ``g_l = 1`` at
init) is registered here, in the test file: the config accepts its name, it trains through
``msar_jax.train``, a 2-stage pipeline equals the sequential model on it, and the accounting
reports its parameters, FLOPs and memory traffic from what the class states. Nothing outside
``msar_jax/residuals/<mechanism>.py`` may test a mechanism's name (checked on the source).
"""

from __future__ import annotations

import ast
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from msar_jax import accounting
from msar_jax import config as config_lib
from msar_jax.config import ConfigError
from msar_jax.config import REPO_ROOT, load_config
from msar_jax.model.transformer import lm_loss
from msar_jax.parallel import mesh as mesh_lib
from msar_jax.parallel import pipeline as pl
from msar_jax.residuals import DepthState, ResidualMechanism, register, registered
from msar_jax.train import step as step_lib
from msar_jax.train import train

NAME = "scalar_gate_test"
T, D = 8, 16


@register(NAME)
class ScalarGate(ResidualMechanism):
    """``h_{l+1} = h_l + g_l v_l``; the carry is the running hidden state."""

    per_sublayer = ("scale",)
    undecayed_params = frozenset({"scale"})  # a gate scale: decay would pull it towards shutting the branch

    def __init__(self, model_cfg, rngs: nnx.Rngs):
        super().__init__(model_cfg, rngs)
        self.scale = nnx.Param(jnp.ones((self.n_sublayers,), jnp.float32), logical_axes=("sublayers",))

    def start(self, g, e, ctx):
        return DepthState(sources=None, carry=e)

    def read(self, g, p, state, bctx, pos, ctx, want_weights=False):
        return state.carry, None

    def write(self, g, p, state, v, aux, pos, ctx):
        return DepthState(None, state.carry + p["scale"].astype(v.dtype) * v)

    def finish(self, g, state, ctx):
        return state.carry

    @classmethod
    def validate_config(cls, model_cfg, prefix="model"):
        if model_cfg.residual.streams != 1:
            raise ConfigError(f"{prefix}.residual.streams", model_cfg.residual.streams, "must be 1 (one stream)")

    @classmethod
    def carry_vectors(cls, res_cfg):
        return 1

    @classmethod
    def extra_params(cls, model_cfg):
        return dict(value=config_lib.n_sublayers(model_cfg), formula="L")

    @classmethod
    def forward_flops(cls, model_cfg, two_phase):
        gate = float(config_lib.n_sublayers(model_cfg) * model_cfg.d_model)  # g_l v_l
        return dict(gate=gate, total=gate)

    @classmethod
    def memory_access(cls, model_cfg):
        return "3d", 3.0, "as Vanilla: read h and v, write h"


def _config(spec="configs/vanilla.py:smoke=1", **overrides):
    return load_config(spec, {"model.residual.name": NAME, "model.residual.streams": 1, **overrides})


def test_the_config_accepts_a_registered_name_and_runs_its_rules():
    assert NAME in registered()
    assert _config().model.residual.name == NAME
    with pytest.raises(ConfigError, match="model.residual.streams"):
        _config(**{"model.residual.streams": 2})
    with pytest.raises(ConfigError, match=f"must be one of .*{NAME}"):
        _config(**{"model.residual.name": "scalar_gates_test"})


@pytest.mark.usefixtures("fast_train_compile")
def test_train_step(tmp_path):
    config = _config(**{"train.steps": 2, "train.eval_every": 0, "train.progress": False,
                        "train.tensorboard": False, "checkpoint.every": 0})
    out = train(config, tmp_path)
    assert out["step"] == 2 and all(math.isfinite(loss) for _, loss in out["losses"])
    # The gates are trained: one optimizer step moves every g_l off its init.
    model_def, params = step_lib.init_model(config.model, 0)
    tx = optax.sgd(0.1)
    fn = step_lib.make_train_step(model_def, tx, lambda s: 0.1)
    batch = np.random.default_rng(0).integers(0, 256, (2, config.seq_len + 1)).astype(np.int32)
    new, metrics = fn(step_lib.init_state(params, tx), batch)
    assert bool(metrics["finite"])
    gates = np.asarray(new["params"]["residual"]["scale"])
    assert gates.shape == (4,) and np.all(gates != 1.0)


def test_two_stage_pipeline_forward_equals_sequential():
    cfg = _config(f"configs/vanilla.py:smoke=1,seq_len={T}", **{"model.n_layers": 2, "model.d_model": D})
    model_def, params = step_lib.init_model(cfg.model, 0)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(next(keys), a.shape), params)
    stages, M = 2, 2
    tokens = np.random.default_rng(0).integers(0, 256, (2 * M, T)).astype(np.int32)
    reference = jax.jit(lambda p: model_def.merge(p)(tokens)[0], compiler_options=step_lib.FAST_COMPILE)(params)

    pcfg = mesh_lib.parallel_config()
    pcfg.pipeline.update(dict(stages=stages, microbatches=M, repeats=1, cache=True))
    pcfg.mesh.update(dict(data=-1, stage=stages))
    mesh = mesh_lib.make_mesh(pcfg.mesh, jax.devices()[:stages])
    pl.validate(pcfg, cfg.model, tokens.shape[0], mesh)
    plan = pl.make_plan(pcfg, cfg.model)
    assert plan.mechanism is ScalarGate and not plan.uses_sources and plan.hop_vectors() == 1
    with mesh_lib.use_mesh(mesh, mesh_lib.PIPELINE_RULES):
        fn = jax.jit(lambda p: pl.pipelined_forward(model_def.merge(p), tokens, plan, mesh)[0])
        compiled = fn.lower(params).compile(step_lib.FAST_COMPILE)
        logits = compiled(params)
    np.testing.assert_allclose(logits, reference, rtol=1e-5, atol=1e-5)
    # The one hop is the hidden state the class states (carry_vectors = 1).
    mb = tokens.shape[0] // M
    assert pl.hlo_hop_bytes(compiled.as_text()) == [4 * plan.hop_vectors() * mb * T * D]


def test_accounting_reports_what_the_class_states():
    config = _config(**{"model.n_layers": 3})
    report = accounting.account(config)
    model_def, params = step_lib.init_model(config.model, 0)
    actual = sum(math.prod(a.shape) for a in jax.tree.leaves(params["residual"]))
    assert actual == 6  # L = 2 x 3 sublayers
    assert report["mechanism"] == NAME
    assert report["params"]["residual"] == report["params"]["residual_analytic"] == actual
    L, d = 6, config.model.d_model
    assert report["flops"]["forward"]["mechanism"] == {"gate": L * d, "total": L * d}
    assert report["flops"]["train"]["overhead"] == 3 * L * d
    assert report["memory"]["symbolic"] == "3d" and report["memory"]["per_sublayer_d"] == 3.0
    assert NAME in accounting.format_table(report)


# The library modules that drive a mechanism: they ask the class, never compare its name.
DRIVERS = ["msar_jax/accounting.py", "msar_jax/config.py", "msar_jax/stack.py", "msar_jax/parallel/pipeline.py",
           "msar_jax/model/layers.py", "msar_jax/model/transformer.py", "msar_jax/train/step.py"]


def _name_tests(path: pathlib.Path, names: set[str]) -> list[str]:
    """``x == "msar"``, ``x in ("msar", ...)`` and the like in ``path``'s source."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        for operand in (node.left, *node.comparators):
            items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
            hits = [i.value for i in items if isinstance(i, ast.Constant) and i.value in names]
            found += [f"{path.name}:{node.lineno} {h!r}" for h in hits]
    return found


def test_no_driver_module_tests_a_mechanism_name(tmp_path):
    names = set(registered())
    assert {"vanilla", "mhc", "attnres", "msar", "mhar", "attnres_mhc"} <= names
    found = [hit for rel in DRIVERS for hit in _name_tests(REPO_ROOT / rel, names)]
    assert not found, found
    # The check sees each form of a name test.
    probe = tmp_path / "probe.py"
    probe.write_text('a = name == "msar"\nb = name in ("vanilla", "mhc")\nc = "mhar" != name\nd = dict(name="msar")\n')
    assert _name_tests(probe, names) == ["probe.py:1 'msar'", "probe.py:2 'vanilla'", "probe.py:2 'mhc'",
                                         "probe.py:3 'mhar'"]
