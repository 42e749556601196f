"""Every shipped config builds, validates, and runs one train step at its smoke size.

Configs whose smoke model is the same (e.g. configs/scaling/msar.py and configs/msar.py) share
one compilation: the step's loss is cached by the model config.
"""

import pathlib

import numpy as np
import pytest

from msar_jax import accounting
from msar_jax.config import REPO_ROOT, load_config
from msar_jax.train import optim, step, validate

CONFIG_FILES = sorted(
    str(p.relative_to(REPO_ROOT))
    for pattern in ("configs/*.py", "configs/ablations/*.py", "configs/scaling/*.py")
    for p in REPO_ROOT.glob(pattern)
    if p.name not in ("common.py", "__init__.py")
)
_LOSSES: dict = {}


pytestmark = pytest.mark.usefixtures("fast_train_compile")


def test_every_family_is_shipped():
    names = {pathlib.Path(f).stem for f in CONFIG_FILES if f.count("/") == 1}
    assert {"vanilla", "mhc", "attnres", "msar", "mhar", "attnres_mhc"} <= names
    ablations = {pathlib.Path(f).stem for f in CONFIG_FILES if "/ablations/" in f}
    assert ablations == {"no_conv", "mean_fusion", "m2", "m8", "full", "s2", "s8"}
    scaling = {pathlib.Path(f).stem for f in CONFIG_FILES if "/scaling/" in f}
    assert scaling == {"vanilla", "mhc", "attnres", "msar"}


@pytest.mark.parametrize("path", CONFIG_FILES)
def test_default_size_builds_and_accounts(path):
    config = validate(load_config(path))
    report = accounting.account(config)
    assert report["flops"]["train"]["model_total"] > 0
    assert config.train.steps > 0 and config.optim.lr > 0


# Ablations train at smoke size in the slow suite only; their configs still build and validate
# above. Those that change MSAR's numbers (m, S) run msar.py's code; the others (Full mode, mean
# fusion, no conv) switch paths whose forward and gradients test_mechanisms_oracle.py checks
# against the oracle (msar_S1_full_seg, msar_mean, msar_noconv). (Keeps the default suite's time
# down: about 160 s of CPU compile.)
_SAME_CODE_AS_MSAR = {"configs/ablations/m2.py", "configs/ablations/m8.py", "configs/ablations/s2.py",
                      "configs/ablations/s8.py", "configs/ablations/full.py", "configs/ablations/mean_fusion.py",
                      "configs/ablations/no_conv.py"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p in _SAME_CODE_AS_MSAR else p
                                  for p in CONFIG_FILES])
def test_smoke_size_runs_one_train_step(path):
    config = validate(load_config(f"{path}:smoke=1"))
    assert config.smoke and config.seq_len == 32 and config.train.batch_size == 2
    key = config.model.to_json()
    if key not in _LOSSES:
        tx, schedule = optim.make_optimizer(config.optim, config.train.steps)
        model_def, params = step.init_model(config.model, 0)
        train_step = step.make_train_step(model_def, tx, schedule)
        batch = np.random.default_rng(0).integers(0, 256, (2, config.seq_len + 1), dtype=np.int32)
        state, metrics = train_step(step.init_state(params, tx), batch)
        assert bool(metrics["finite"]) and int(state["step"]) == 1
        _LOSSES[key] = float(metrics["loss"])
    assert np.isfinite(_LOSSES[key]) and abs(_LOSSES[key] - np.log(256)) < 1.0


def test_ablation_rows():
    get = lambda name: load_config(f"configs/ablations/{name}.py").model.residual  # noqa: E731
    assert get("no_conv").conv is False and get("no_conv").block_size == 4
    assert get("mean_fusion").fusion == "mean"
    assert (get("m2").streams, tuple(get("m2").kernel_sizes)) == (2, (4,))
    assert (get("m8").streams, tuple(get("m8").kernel_sizes)) == (8, (2, 4, 6, 8, 10, 12, 16))
    assert [get(n).block_size for n in ("full", "s2", "s8")] == [1, 2, 8]
    assert all(get(n).name == "msar" for n in ("no_conv", "mean_fusion", "m2", "m8", "full", "s2", "s8"))
    # The argument string still overrides a pinned value.
    assert load_config("configs/ablations/no_conv.py:block_size=8").model.residual.block_size == 8


def test_sizes_and_smoke_keep_residual_settings():
    counts = {s: accounting.param_counts(load_config(f"configs/msar.py:size={s}").model)["total"]
              for s in ("small", "base")}
    assert 25e6 <= counts["small"] <= 50e6
    assert 300e6 <= counts["base"] <= 400e6
    big = load_config("configs/msar.py:size=paper_28b,smoke=1")
    assert big.model.moe.enabled and big.model.d_model == 32 and big.model.residual.block_size == 8
    m8 = load_config("configs/ablations/m8.py:smoke=1").model.residual
    assert m8.streams == 8 and max(m8.kernel_sizes) == 16


def test_scaling_ladder_matches_budgets_across_mechanisms():
    for rung, blocks in zip(range(1, 5), (8, 8, 8, 7)):
        budgets = set()
        for mech in ("vanilla", "mhc", "attnres", "msar"):
            c = load_config(f"configs/scaling/{mech}.py:size=ladder_{rung}")
            budgets.add(c.train.steps * c.train.batch_size * c.seq_len)
            if mech in ("attnres", "msar"):
                s = c.model.residual.block_size
                assert -(-2 * c.model.n_layers // s) == blocks
        assert len(budgets) == 1
    layers = [load_config(f"configs/scaling/msar.py:size=ladder_{r}").model.n_layers for r in range(1, 5)]
    assert layers == [15, 23, 15, 28]  # Table 4 depths


def test_parse_overrides():
    from msar_jax.config import parse_overrides

    got = parse_overrides(["train.batch_size=8", "optim.lr=1e-3", "model.residual.implementation=auto",
                           "model.residual.kernel_sizes=[4, 8]", "train.progress=false",
                           "model.save_read_outputs=True", "data.dir=None"])
    assert got == {"train.batch_size": 8, "optim.lr": 1e-3, "model.residual.implementation": "auto",
                   "model.residual.kernel_sizes": [4, 8], "train.progress": False,
                   "model.save_read_outputs": True, "data.dir": None}
    for bad in ("train.batch_size", "=3"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_overrides([bad])
    # a value of the wrong type is a ConfigError naming the field, not ml_collections' TypeError
    from msar_jax.config import ConfigError
    from msar_jax.config import load_config

    with pytest.raises(ConfigError, match="wrong type") as err:
        load_config("configs/msar.py:smoke=1", {"model.save_read_outputs": "yes"})
    assert err.value.field == "model.save_read_outputs" and err.value.value == "yes"


@pytest.mark.parametrize("path", ["configs/msar.py", "configs/attnres.py", "configs/mhar.py"])
def test_default_implementation_is_the_platforms_kernels(path):
    """``auto`` by default: the Pallas kernels on GPU and TPU, the XLA path on the CPU."""
    import jax
    from flax import nnx

    from msar_jax.model.transformer import Transformer
    from pallas_kernels.depth_attention import api, platform

    cfg = load_config(path)
    assert cfg.model.residual.implementation == "auto"

    mechanism = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0))).residual
    assert mechanism.implementation is None  # the ops' "best available"
    assert not api.runs_a_kernel(mechanism.implementation) and jax.default_backend() == "cpu"
    for device in ("gpu", "tpu"):
        with platform.target(device):
            assert api.runs_a_kernel(mechanism.implementation)


def test_state_dtype_auto_follows_the_activations():
    """``model.residual.state_dtype="auto"`` (the default): a bf16 phase-1 state with bf16
    activations, float32 with float32 or float16 ones; an explicit dtype is kept."""
    from msar_jax.config import state_dtype

    for dtype, want in (("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32")):
        cfg = load_config("configs/msar.py:smoke=1", {"model.dtype": dtype})
        assert cfg.model.residual.state_dtype == "auto" and state_dtype(cfg.model) == want
    cfg = load_config("configs/msar.py:smoke=1", {"model.dtype": "bfloat16", "model.residual.state_dtype": "float32"})
    assert state_dtype(cfg.model) == "float32"
