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


def test_the_lowering_rules_live_in_heuristics_only():
    """Which kernels run in Mosaic GPU or Triton is decided by ``heuristics.mosaic_phase1`` and
    ``mosaic_phase2`` alone: ``_backend`` keeps none of the choices or flags, and ``GPU_KERNELS``
    is defined once."""
    from pallas_kernels.depth_attention import _backend

    for name in ("GPU_KERNELS", "AUTO_INPUTS", "AUTO_PHASE1_BWD", "AUTO_TRANSPOSE", "SINGLE_STREAM_MOSAIC_PHASE1"):
        assert hasattr(heuristics, name) and not hasattr(_backend, name), name


@pytest.mark.parametrize("choice, kernels, d, interpret, platform_backend, phase1, phase2", [
    ("auto", MSAR, 1024, False, "triton", set(heuristics.PHASE1_KERNELS), set(heuristics.PHASE2_KERNELS)),
    ("auto", MSAR, 1024, True, "triton", set(), set()),  # interpret mode (the CPU tests): Triton
    ("auto", MSAR, 1024, False, "tpu", set(), set()),
    ("auto", ONE_STREAM, 1024, False, "triton", {"scores", "gdots", "dstreams"}, set()),
    ("triton", MSAR, 1024, False, "triton", set(), set()),
    ("auto", MSAR, 1020, False, "triton", set(), set()),  # no Mosaic kernel takes d = 1020: Triton
])
def test_lowering_per_kernel_from_shapes_dtypes_platform(choice, kernels, d, interpret, platform_backend, phase1,
                                                         phase2):
    """The rules as plain functions of shapes, dtypes and platform, at `base`'s shape (7 bf16
    sources, 8 targets, a float32 state)."""
    got1 = {k for k in heuristics.PHASE1_KERNELS
            if heuristics.mosaic_phase1(choice, k, backend=platform_backend, stream_kernels=kernels, heads=1, d=d,
                                        n_sources=7, n_targets=8, dtype="bfloat16",
                                        interpret=interpret)}
    got2 = {k for k in heuristics.PHASE2_KERNELS
            if heuristics.mosaic_phase2(choice, k, backend=platform_backend, fuse="gate", stream_kernels=kernels,
                                        heads=1, d=d, dtype="bfloat16", acc_dtype="float32", out_dtype="bfloat16",
                                        interpret=interpret)}
    assert (got1, got2) == (phase1, phase2)


def test_bad_gpu_kernels_and_kernel_names_are_errors():
    with pytest.raises(ValueError, match=r"gpu_kernels='fast': must be one of"):
        heuristics.check_gpu_kernels("fast", "triton")
    with pytest.raises(ValueError, match="this is the tpu back end"):
        heuristics.check_gpu_kernels("mosaic", "tpu")
    with pytest.raises(ValueError, match="kernel='score': must be one of"):
        heuristics.mosaic_phase1("auto", "score", backend="triton", stream_kernels=MSAR, heads=1, d=64, n_sources=3,
                                 n_targets=2, dtype="bfloat16", interpret=False)
    with pytest.raises(ValueError, match="kernel='state': must be one of"):
        heuristics.mosaic_phase2("auto", "state", backend="triton", fuse="gate", stream_kernels=MSAR, heads=1, d=64,
                                 dtype="bfloat16", acc_dtype="float32", out_dtype="float32", interpret=False)
