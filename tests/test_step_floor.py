"""benchmarks/step_floor.py: the bytes of a step's depth reads against a hand count, and its
errors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from msar_jax.config import load_config

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "step_floor.py"
F32_STATE = {"model.residual.state_dtype": "float32"}


@pytest.fixture(scope="module")
def floor():
    spec = importlib.util.spec_from_file_location("step_floor_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_base_step_bytes_by_hand(floor):
    """`base`: 56 sublayers in 7 blocks of 8, unit u reads 1 + u sources; bf16 activations,
    a float32 state (a bf16 one, the default with bf16 activations, below). Per unit in E = B T d bytes: forward (2v + 8 x 16) + 8 (16 + 4) = 2v + 288,
    twice; backward 8 (6 + 32) + (4v + 128) = 4v + 432. Sum over v = 1..7: 7280 E for m = 4,
    and with m = 1 (state 4 bytes) 2v + 96 twice and 4v + 144: 2576 E."""
    elems = 64 * 1024 * 1024
    for spec, per_e in (("configs/msar.py:size=base", 7280), ("configs/attnres.py:size=base", 2576)):
        shape = floor.read_shape(load_config(spec, F32_STATE))
        assert (shape.n_sublayers, shape.block_size, shape.act_bytes) == (56, 8, 2)
        got = floor.step_bytes(shape)
        assert got["total"] == per_e * elems
        assert got["forward"] == got["recompute"]
    # A bf16 state halves every state term: MSAR forward 2v + 160 twice, backward 4v + 240.
    half = floor.step_bytes(floor.read_shape(load_config("configs/msar.py:size=base", F32_STATE)), state_bytes=2)
    assert half["total"] == (2 * (56 + 7 * 160) + 4 * 28 + 7 * 240) * elems
    bf16 = floor.read_shape(load_config("configs/msar.py:size=base", {"model.residual.state_dtype": "bfloat16"}))
    assert bf16.state_bytes == 2 and floor.step_bytes(bf16) == half
    # the default state_dtype="auto" follows base's bf16 activations
    assert floor.read_shape(load_config("configs/msar.py:size=base")) == bf16
    # model.save_read_outputs: phase 2's re-run reads only the partial (8 x 2 instead of
    # 8 x (16 + 4) per unit): the re-run is 2v + 128 + 16 per unit, the rest unchanged.
    saved = floor.step_bytes(floor.read_shape(load_config("configs/msar.py:size=base",
                                                          {"model.save_read_outputs": True, **F32_STATE})))
    assert saved["recompute"] == (2 * 28 + 7 * 144) * elems
    assert saved["total"] == (7280 - 7 * 144) * elems
    # the factored state cotangent (not built): backward 8 (6 + 16) + (4v + 128 + 32) = 4v + 336
    # per unit, 96 fewer than 4v + 432; m = 1: 8 (6 + 4) + (4v + 32 + 32), the same as 4v + 144 (one
    # stream's d_state, 4 bytes a token, costs what dh and the partial do)
    msar = floor.read_shape(load_config("configs/msar.py:size=base", F32_STATE))
    factored = floor.step_bytes(msar, factored_cotangent=True)
    assert factored["backward"] == (4 * 28 + 7 * 336) * elems
    assert factored["total"] == (7280 - 7 * 96) * elems
    one = floor.step_bytes(floor.read_shape(load_config("configs/attnres.py:size=base", F32_STATE)),
                           factored_cotangent=True)
    assert one["total"] == 2576 * elems


def test_shorter_last_block(floor):
    shape = floor.ReadShape(batch=1, t_len=1, d=1, n_sublayers=10, block_size=4, streams=2, act_bytes=2,
                            state_bytes=4)
    want = sum(2 * sum(floor.unit_bytes(v, s, 2, 2, 4)[k] for k in ("forward",)) + floor.unit_bytes(v, s, 2, 2, 4)[
        "backward"] for v, s in ((1, 4), (2, 4), (3, 2)))
    assert floor.step_bytes(shape)["total"] == want


@pytest.mark.parametrize("spec, message", [
    ("configs/vanilla.py:size=tiny", "no depth-attention read"),
    ("configs/msar.py:size=tiny,block_size=1", "two-phase block reads"),
])
def test_rejects_configs_without_block_reads(floor, spec, message):
    with pytest.raises(ValueError, match=message):
        floor.read_shape(load_config(spec))


def test_cli(floor, capsys):
    floor.main(["configs/msar.py:size=base", "--vanilla_ms", "935.3", "--bandwidth", "4.8", "--state_bytes", "4"])
    out = capsys.readouterr().out
    assert "| configs/msar.py:size=base | 64 x 1024, 1024 | 56 / 8 | 4 |" in out
    assert "| 488.6 | 101.8 | 1.109 |" in out
    floor.main(["configs/msar.py:size=base", "--vanilla_ms", "935.3", "--bandwidth", "4.8", "--state_bytes", "4",
                "--factored_cotangent"])
    assert "| 443.5 | 92.4 | 1.099 |" in capsys.readouterr().out
    floor.main(["configs/msar.py:size=base", "--vanilla_ms", "935.3", "--bandwidth", "4.8"])  # the bf16 default
    assert "| 278.1 | 57.9 | 1.062 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        floor.main(["configs/msar.py:size=base", "--bandwidth", "0"])
