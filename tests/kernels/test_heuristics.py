"""``heuristics``: the one place that picks each op's kernel config (``OpConfig``) from what the
caller is, and the ops' ``config=`` argument."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, heuristics
from pallas_kernels.depth_attention.heuristics import OpConfig

MSAR, ONE_STREAM = (0, 4, 8, 12), (0,)


@pytest.mark.parametrize("op, kernels, backward", [
    ("phase1", MSAR, "pallas"), ("phase2_fused", MSAR, "pallas"), ("phase2", MSAR, "xla"),
    ("depth_read", MSAR, "xla"), ("phase1", ONE_STREAM, "pallas"), ("depth_read", ONE_STREAM, "pallas"),
])
def test_backward_per_op_and_streams(op, kernels, backward):
    got = heuristics.choose(op, stream_kernels=kernels, implementation="pallas_gpu")
    assert got.backward == backward and got.gpu_kernels == "auto"
    assert got.options() == {"backward": backward}  # "auto" and the default forms are no options


def test_saved_read_outputs_split_phase2s_forward():
    got = heuristics.choose("phase2_fused", stream_kernels=MSAR, implementation="pallas_gpu", save_read_outputs=True)
    assert got.options() == {"backward": "pallas", "gpu_kernels": "split_forward"}


@pytest.mark.parametrize("kernels, implementation, kw, channel", [
    (ONE_STREAM, "pallas_gpu", {}, True),
    (ONE_STREAM, "pallas_tpu", {}, True),
    (MSAR, "pallas_gpu", {}, False),  # the gate's cotangent does not factor
    (ONE_STREAM, "xla", {}, False),
    (ONE_STREAM, None, {}, False),  # this CPU: None falls back to XLA
    (ONE_STREAM, "pallas_gpu", {"read_chunks": 2}, False),  # reads in a lax.map
    (ONE_STREAM, "pallas_gpu", {"overrides": {"backward": "xla"}}, False),
    (ONE_STREAM, "pallas_gpu", {"overrides": {"read_chunks": 2}}, False),
])
def test_value_channel_only_where_it_pays(kernels, implementation, kw, channel):
    for op in ("phase1", "phase2_fused"):
        assert heuristics.choose(op, stream_kernels=kernels, implementation=implementation, **kw).value_channel is channel
    assert heuristics.choose("phase2", stream_kernels=kernels, implementation=implementation, **kw).value_channel is False


def test_overrides_replace_the_choice_and_none_chooses():
    got = heuristics.choose("phase2", stream_kernels=MSAR, implementation="pallas_gpu",
                            overrides={"backward": "hybrid", "gpu_kernels": None, "phase2_backward_form": "wide"})
    assert got.options() == {"backward": "hybrid", "phase2_backward_form": "wide"}


@pytest.mark.parametrize("overrides, message", [
    ({"backwards": "xla"}, "kernel_overrides.backwards='xla': no such kernel override .*did you mean 'backward'"),
    ({"gpu_kernels": "cuda"}, r"kernel_overrides.gpu_kernels='cuda': must be None \(choose\) or one of"),
    ({"read_chunks": 0}, "kernel_overrides.read_chunks=0: must be None"),
])
def test_bad_overrides_name_key_value_and_rule(overrides, message):
    with pytest.raises(ValueError, match=message):
        heuristics.choose("phase1", stream_kernels=MSAR, overrides=overrides)


def test_op_config_validates_its_fields():
    with pytest.raises(ValueError, match=r"OpConfig.backward='triton': must be one of \('xla', 'pallas', 'hybrid'\)"):
        OpConfig(backward="triton")
    with pytest.raises(ValueError, match="OpConfig.phase1_backward_form='tall'"):
        OpConfig(phase1_backward_form="tall")
    with pytest.raises(ValueError, match="op='phase3'"):
        heuristics.choose("phase3", stream_kernels=MSAR)


def _read_inputs():
    keys = jax.random.split(jax.random.key(0), 3)
    sources = jax.random.normal(keys[0], (3, 1, 8, 16))
    queries = jax.random.normal(keys[1], (2, 1, 16))  # [S, m, d]
    return sources, queries


def test_ops_take_a_config_and_the_xla_path_ignores_it():
    sources, queries = _read_inputs()
    kw = dict(stream_kernels=ONE_STREAM, heads=1)
    want = api.depth_read(sources, None, queries[0], implementation="xla", **kw)
    got = api.depth_read(sources, None, queries[0], implementation="xla", config=OpConfig(backward="pallas"), **kw)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="backward='xla' and config.backward='pallas': give one of them"):
        api.phase1(sources, None, queries, implementation="pallas_tpu", backward="xla",
                   config=OpConfig(backward="pallas"), **kw)
