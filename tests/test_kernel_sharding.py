"""The depth-read kernels under a mesh (``msar_jax.parallel.kernel_sharding``): 8 fake CPU
devices, the kernels in Pallas interpret mode, float32.

Every Pallas kernel of a sharded train step sits inside a ``shard_map`` manual over every mesh
axis (without it a Mosaic TPU kernel does not lower: "Mosaic kernels cannot be automatically
partitioned"); the loss and gradients of the kernel path on each layout equal the one-device
kernel path and the XLA path. Tiny models: MSAR with two streams (identity and a width-4
convolution) and the H_pre gate, MHAR with two heads; two layers in two blocks of two sublayers;
random non-zero parameters (zero-initialised queries and convolutions would hide errors).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from msar_jax.config import load_config
from msar_jax.model.transformer import lm_loss
from msar_jax.parallel import kernel_sharding
from msar_jax.parallel import mesh as mesh_lib
from msar_jax.parallel import pipeline as pl
from msar_jax.train import step as step_lib
from pallas_kernels.depth_attention import api as depth_api

T = 8
ONE = dict(data=1, stage=1, fsdp=1, tensor=1)
MODELS = {  # mechanism -> (kernel implementation, overrides)
    "msar": ("pallas_tpu", {"model.residual.streams": 2, "model.residual.kernel_sizes": (4,)}),
    "mhar": ("pallas_gpu", {"model.residual.heads": 2}),
}


PIPELINE = {"parallel.pipeline.stages": 2, "parallel.pipeline.microbatches": 2}


def _config(mechanism, implementation, mesh=None, pipeline=False):
    """``pipeline``: the depth stack runs as a 2-stage pipeline of 2 microbatches (one layer a
    stage; ``msar_jax.parallel.pipeline``)."""
    overrides = {"model.dtype": "float32", "model.n_layers": 2, "model.residual.implementation": implementation,
                 **MODELS[mechanism][1], **{f"parallel.mesh.{k}": v for k, v in (mesh or ONE).items()},
                 **(PIPELINE if pipeline else {})}
    if implementation != "xla":  # the kernels' own backward, whose kernels need the shard_map too
        overrides["model.residual.kernel_overrides.backward"] = "pallas"
    return load_config(f"configs/{mechanism}.py:smoke=1,seq_len={T},block_size=2", overrides)


def _inputs(cfg, rows):
    """``(model_def, params, batch)``: parameters moved off their init by normal noise of scale 0.3."""
    model_def, params = step_lib.init_model(cfg.model, seed=5)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    params = jax.tree.unflatten(treedef, [p + 0.3 * jax.random.normal(k, p.shape, p.dtype)
                                          for p, k in zip(leaves, keys)])
    batch = jax.random.randint(jax.random.key(2), (rows, T + 1), 0, cfg.model.vocab_size)
    return model_def, params, batch


def _sharded_loss(cfg, rows):
    """``(value_and_grad of the loss, params, batch, mesh, rules)`` on ``cfg``'s mesh, the
    parameters and batch in the layout training gives them (``param_shardings``, ``batch_sharding``);
    the pipelined loss where ``cfg`` has pipeline stages (as ``pipeline.train_step_fn`` picks it)."""
    model_def, params, batch = _inputs(cfg, rows)
    degrees = [cfg.parallel.mesh[a] for a in mesh_lib.MESH_AXES]
    mesh = mesh_lib.make_mesh(cfg.parallel.mesh, jax.devices()[: int(np.prod(degrees))])
    rules = mesh_lib.rules_for(cfg.parallel)
    loss = lm_loss
    if cfg.parallel.pipeline.stages > 1:
        pl.validate(cfg.parallel, cfg.model, rows, mesh)
        loss = pl.pipelined_lm_loss(pl.make_plan(cfg.parallel, cfg.model), mesh)
    in_shardings = (mesh_lib.param_shardings(cfg.model, mesh, rules), mesh_lib.batch_sharding(mesh, rows, rules))
    fn = jax.jit(jax.value_and_grad(lambda p, b: loss(model_def.merge(p), b)[0]), in_shardings=in_shardings)
    return fn, params, batch, mesh, rules


@functools.lru_cache(maxsize=None)
def _loss_and_grads(mechanism, implementation, layout=None, rows=4, pipeline=False):
    cfg = _config(mechanism, implementation, dict(layout) if layout else None, pipeline)
    fn, params, batch, mesh, rules = _sharded_loss(cfg, rows)
    with mesh_lib.use_mesh(mesh, rules):
        return jax.device_get(fn.lower(params, batch).compile(step_lib.FAST_COMPILE)(params, batch))


def _assert_close(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got[1])[0], jax.tree.leaves(want[1]), strict=True):
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


# ----- the structure: every kernel inside a shard_map manual over every mesh axis -----

def _sub_jaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def kernel_placements(jaxpr, manual=frozenset()) -> list[frozenset]:
    """For every ``pallas_call`` in ``jaxpr`` (nested jaxprs included), the mesh axes manual
    where it runs (the union of the ``shard_map``s around it)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append(manual)
            continue
        inner = manual | frozenset(eqn.params["newly_manual_axes"]) if eqn.primitive.name == "shard_map" else manual
        for sub in _sub_jaxprs(eqn.params):
            out += kernel_placements(sub, inner)
    return out


def _placements(layout, mechanism="msar", pipeline=False):
    cfg = _config(mechanism, MODELS[mechanism][0], layout, pipeline)
    fn, params, batch, mesh, rules = _sharded_loss(cfg, 4)
    with mesh_lib.use_mesh(mesh, rules):
        return kernel_placements(jax.make_jaxpr(fn)(params, batch).jaxpr), set(mesh.axis_names)


def test_every_kernel_runs_inside_a_shard_map_over_every_axis(monkeypatch):
    """The traced step's forward and backward kernels all run where every mesh axis is manual,
    which is what lets Mosaic lower them; without the ``shard_map`` (``needs_shard_map`` off)
    they would run where XLA partitions automatically."""
    layout = dict(ONE, data=2, fsdp=2, tensor=2)
    placements, axes = _placements(layout)
    assert len(placements) >= 8, placements  # phase 1, phase 2 + gate, forward and backward, each block
    assert all(p == axes for p in placements), placements
    monkeypatch.setattr(kernel_sharding, "needs_shard_map", lambda: False)
    unwrapped, _ = _placements(layout)
    assert len(unwrapped) == len(placements) and not any(unwrapped), unwrapped


def test_pipelined_kernels_run_inside_the_pipeline_and_a_shard_map_over_the_other_axes():
    """A 2-stage pipeline under fsdp = 2: each sublayer reads as a one-target block (phase 1, then
    phase 2 with the gate), so its forward and backward kernels run inside the pipeline's
    ``shard_map`` (manual over ``stage``) and ``kernel_sharding``'s (manual over the rest). With
    direct reads (``depth_read``, no kernel) the pipeline ran none."""
    placements, axes = _placements(dict(ONE, stage=2, fsdp=2), pipeline=True)
    assert len(placements) >= 8, placements  # 4 sublayers: phase 1 and phase 2 + gate, forward and backward
    assert all(p == axes for p in placements), placements


def _shard_map_operand_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The shapes of every ``shard_map``'s operands and results in ``jaxpr`` (nested ones too)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            out += [tuple(v.aval.shape) for v in (*eqn.invars, *eqn.outvars)]
        for sub in _sub_jaxprs(eqn.params):
            out += _shard_map_operand_shapes(sub)
    return out


def test_phase1_banks_enter_and_leave_the_shard_map_without_the_zero_bank():
    """The phase-1 read's conv banks cross the ``shard_map`` as ``[N, K, d]`` (``b_0..b_{N-1}``),
    the zero bank of ``b_N`` appended inside. Appended outside, the summed ``[N + 1, K, d]``
    cotangent is cut to N rows after the sum, and under FSDP the TPU compiler (libtpu 0.0.48) fuses
    that cut with the FSDP slice into a reduce-scatter of the wrong shape (``RET_CHECK ...
    CompatibleIgnoringFpPrecision``; ``tests/test_tpu_compile.py``'s `small` step on v5e:2x2)."""
    cfg = _config("msar", MODELS["msar"][0], dict(data=1, stage=1, fsdp=4, tensor=1))
    fn, params, batch, mesh, rules = _sharded_loss(cfg, 4)
    sublayers, taps, d = params["residual"]["conv_banks"].shape
    n_blocks = sublayers // cfg.model.residual.block_size
    with mesh_lib.use_mesh(mesh, rules):
        shapes = _shard_map_operand_shapes(jax.make_jaxpr(fn)(params, batch).jaxpr)
    assert (n_blocks, taps, d) in shapes, shapes
    assert (n_blocks + 1, taps, d) not in shapes, shapes


def test_batch_mesh_axes_follow_the_rules_and_leave_out_what_does_not_divide():
    mesh = mesh_lib.make_mesh(dict(data=2, stage=2, fsdp=2, tensor=1))
    with mesh_lib.use_mesh(mesh, mesh_lib.RULES):
        abstract = jax.sharding.get_abstract_mesh()
        assert kernel_sharding.batch_mesh_axes(abstract, 8) == ("data", "stage", "fsdp")
        assert kernel_sharding.batch_mesh_axes(abstract, 4) == ("data", "stage")  # fsdp would need 8 rows
        assert kernel_sharding.batch_mesh_axes(abstract, 6) == ("data",)
        assert kernel_sharding.needs_shard_map()
    with mesh_lib.use_mesh(mesh, mesh_lib.PIPELINE_RULES):  # the pipeline's stage axis splits no batch
        assert kernel_sharding.batch_mesh_axes(jax.sharding.get_abstract_mesh(), 8) == ("data", "fsdp")
    assert not kernel_sharding.needs_shard_map()  # no mesh: nothing to wrap


def test_the_direct_read_has_no_kernel():
    """``BlockDepthAttention.retrieve`` passes ``kernel=False`` for ``depth_read`` because no
    back end registers one: a kernel registered for it must be wrapped like phase 1 and 2. (The
    pipeline's sublayers read as one-target blocks, phase 1 then phase 2, not directly.)"""
    for implementation in ("pallas_tpu", "pallas_gpu"):
        with pytest.raises(ExceptionGroup, match="no implementation could run"):
            depth_api.depth_read(None, None, None, implementation=implementation)


# ----- the numbers: each layout equals one device and the XLA path -----

LAYOUTS = {
    "data2_fsdp2_tensor2": dict(ONE, data=2, fsdp=2, tensor=2),
    "fsdp4": dict(ONE, fsdp=4),
    "stage2_data2": dict(ONE, stage=2, data=2),  # no pipeline: the stage axis splits the batch
    "data8": dict(ONE, data=8),
}
CASES = [
    ("msar", "data2_fsdp2_tensor2", 4, True),  # about 60 s of CPU: three compiles
    ("msar", "fsdp4", 4, True),
    ("msar", "stage2_data2", 4, True),
    ("msar", "data8", 8, True),
    ("mhar", "data2_fsdp2_tensor2", 4, True),
    ("mhar", "fsdp4", 4, True),
]


@pytest.mark.parametrize("mechanism, layout, rows", [
    pytest.param(m, layout, rows, id=f"{m}-{layout}-{rows}rows", marks=[pytest.mark.slow] if slow else [])
    for m, layout, rows, slow in CASES])
def test_sharded_kernel_path_equals_one_device_and_xla(mechanism, layout, rows):
    implementation = MODELS[mechanism][0]
    got = _loss_and_grads(mechanism, implementation, tuple(LAYOUTS[layout].items()), rows)
    _assert_close(got, _loss_and_grads(mechanism, implementation, rows=rows))
    _assert_close(got, _loss_and_grads(mechanism, "xla", rows=rows))


# ----- the pipeline: the kernels inside its shard_map equal one device and the XLA path -----

PIPELINE_LAYOUTS = {
    "pp2_fsdp2": dict(ONE, stage=2, fsdp=2),  # each microbatch of 2 rows split over fsdp
    "pp2_data2_fsdp2": dict(ONE, stage=2, data=2, fsdp=2),
}


@pytest.mark.slow  # about 60 s of CPU each: three compiles
@pytest.mark.parametrize("mechanism, layout, rows", [
    pytest.param("msar", "pp2_fsdp2", 4, id="msar-pp2_fsdp2"),
    pytest.param("msar", "pp2_data2_fsdp2", 8, id="msar-pp2_data2_fsdp2"),
    pytest.param("mhar", "pp2_fsdp2", 4, id="mhar-pp2_fsdp2"),
])
def test_pipelined_kernel_path_equals_one_device_and_xla(mechanism, layout, rows):
    implementation = MODELS[mechanism][0]
    got = _loss_and_grads(mechanism, implementation, tuple(PIPELINE_LAYOUTS[layout].items()), rows, pipeline=True)
    _assert_close(got, _loss_and_grads(mechanism, implementation, rows=rows))
    _assert_close(got, _loss_and_grads(mechanism, "xla", rows=rows))
