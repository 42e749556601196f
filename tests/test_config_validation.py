"""Config errors are caught up front, and each message names the field, the value and the rule."""

import pytest

from msar_jax import config as config_lib
from msar_jax.configs import load_config


def _model(**changes):
    cfg = config_lib.model_config()
    for key, value in changes.items():
        node = cfg
        *path, leaf = key.split(".")
        for p in path:
            node = node[p]
        node[leaf] = value
    return cfg


CASES = [
    ({"residual.name": "densenet"}, "model.residual.name", "unknown residual mechanism"),
    ({"residual.streams": 3}, "model.residual.kernel_sizes", "streams - 1 = 2"),
    ({"residual.kernel_sizes": (4, 8)}, "model.residual.kernel_sizes", "streams - 1 = 3"),
    ({"residual.kernel_sizes": (4, 0, 12)}, "model.residual.kernel_sizes", "positive integer"),
    ({"d_model": 0}, "model.d_model", "positive integer"),
    ({"n_layers": -2}, "model.n_layers", "positive integer"),
    ({"n_heads": 4, "n_kv_heads": 3}, "model.n_kv_heads", "must divide n_heads"),
    ({"residual.name": "mhar", "residual.heads": 5}, "model.residual.heads", "must divide d_model"),
    ({"residual.heads": 0}, "model.residual.heads", "positive integer"),
    ({"moe.enabled": True, "moe.top_k": 9, "moe.n_routed_experts": 8}, "model.moe.top_k", "<= moe.n_routed_experts"),
    ({"max_seq_len": 0}, "model.max_seq_len", "positive integer"),
    ({"residual.block_size": 3}, "model.residual.block_size", "1 (Full mode) or even"),
    ({"residual.block_size": 0}, "model.residual.block_size", "positive integer"),
    ({"residual.eps": 0.0}, "model.residual.eps", "> 0"),
    ({"residual.fusion": "max"}, "model.residual.fusion", "one of"),
    ({"dtype": "int8"}, "model.dtype", "one of"),
    ({"residual.read_chunks": 0}, "model.residual.read_chunks", "positive integer"),
    ({"residual.kernel_backward": "triton"}, "model.residual.kernel_backward", "must be 'xla', 'pallas', 'hybrid' or 'auto'"),
    ({"residual.state_dtype": "float16"}, "model.residual.state_dtype", "must be 'float32' or 'bfloat16'"),
    ({"residual.gpu_kernels": "cuda"}, "model.residual.gpu_kernels", "must be 'auto', 'mosaic', 'triton', 'triton_forward' or 'split_forward'"),
    ({"save_read_outputs": None}, "model.save_read_outputs", "must be True or False"),
]


@pytest.mark.parametrize("changes,field,rule", CASES, ids=[c[1] + ":" + str(list(c[0].values())[-1]) for c in CASES])
def test_bad_values_name_field_value_and_rule(changes, field, rule):
    with pytest.raises(config_lib.ConfigError) as err:
        config_lib.validate(_model(**changes))
    message = str(err.value)
    assert err.value.field == field
    assert field in message and rule in message
    assert repr(err.value.value) in message


def test_default_and_shipped_configs_are_valid():
    config_lib.validate(config_lib.model_config())
    for name in ("vanilla", "mhc", "attnres", "msar", "mhar", "attnres_mhc"):
        for size in ("tiny", "paper_18b", "scaling_2"):
            cfg = load_config(f"configs/{name}.py:size={size}")
            assert cfg.model.residual.name == name


def test_config_argument_errors():
    with pytest.raises(config_lib.ConfigError, match="unknown key"):
        load_config("configs/msar.py:sise=tiny")
    with pytest.raises(config_lib.ConfigError, match="must be one of"):
        load_config("configs/msar.py:size=enormous")
    with pytest.raises(config_lib.ConfigError, match="must be a int"):
        load_config("configs/msar.py:block_size=four")
    with pytest.raises(config_lib.ConfigError, match="no such config field"):
        load_config("configs/msar.py", {"model.dmodel": 3})
    # A valid override still goes through validation.
    with pytest.raises(config_lib.ConfigError, match="model.residual.block_size"):
        load_config("configs/msar.py", {"model.residual.block_size": 5})


def test_sequence_shorter_than_one_is_rejected():
    from flax import nnx
    import jax.numpy as jnp

    from msar_jax.model.transformer import Transformer

    model = Transformer(config_lib.model_config(), nnx.Rngs(0))
    with pytest.raises(ValueError, match="sequence length"):
        model(jnp.zeros((2, 0), jnp.int32))


def test_saved_read_outputs_need_the_unpipelined_stack():
    """The pipeline's stages rematerialise every layer from the hop and cannot reuse the reads'
    outputs, so ``model.save_read_outputs`` with a pipeline is an error, not a silent no-op."""
    from msar_jax.train.train import validate

    over = {"model.save_read_outputs": True, "parallel.mesh.stage": 2, "parallel.mesh.data": 1,
            "parallel.mesh.fsdp": 1, "parallel.pipeline.stages": 2, "parallel.pipeline.microbatches": 2}
    with pytest.raises(config_lib.ConfigError) as err:
        validate(load_config("configs/msar.py:smoke=1", over))
    assert err.value.field == "model.save_read_outputs" and "2-stage pipeline" in str(err.value)
    over["parallel.pipeline.stages"] = 1
    validate(load_config("configs/msar.py:smoke=1", over))
