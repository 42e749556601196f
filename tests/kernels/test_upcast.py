"""``mosaic_gpu.UPCASTS``: how the Mosaic GPU kernels widen bf16 tiles to float32 (session 33).

``"bits"`` widens each 32-bit register of two bf16 in place with inline Mosaic GPU code, which
Pallas' interpreter cannot run, so on this CPU machine the tests check that the option reaches
every kernel and lowers for the H200; the values are checked on the GPU (``gpu``-marked: the
same bits as ``"extf"``), the instruction counts in a deviceless H200 compile (``aot``-marked,
``experiments/mgpu/sass_stats.py``)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.depth_attention import api, mosaic_gpu, mosaic_gpu_bwd1, reference

ROOT = Path(__file__).resolve().parents[2]
KERNELS, HEADS = (0, 4, 8, 12), 2
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu_v2"


def test_upcast_form_and_errors(monkeypatch):
    """Interpreted kernels take "extf" whatever was asked (the interpreter does not run inline
    Mosaic GPU code); Pallas' own module (Warpgroup semantics) always converts; a bad default
    names the field, the value and the choices."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    assert mosaic_gpu._LanePlgpu(plgpu, True, "bits").widen == "extf"
    assert mosaic_gpu._LanePlgpu(plgpu, False, "bits").widen == "bits"
    assert mosaic_gpu._plgpu_for("padded", False, "bits").widen == "bits"
    assert mosaic_gpu._plgpu_for("aligned", False, "bits") is plgpu
    x = jnp.asarray([[1.5, -2.25], [3e-39, 7.0]], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(mosaic_gpu.upcast(plgpu, x)), np.asarray(x, np.float32))
    monkeypatch.setattr(mosaic_gpu, "DEFAULT_UPCAST", "fast")
    with pytest.raises(ValueError, match=r"mosaic_gpu.DEFAULT_UPCAST='fast': must be one of \('extf', 'bits'\)"):
        mosaic_gpu.default_upcast()


def test_ops_put_the_upcast_in_each_kernels_config(monkeypatch):
    """Each op reads ``DEFAULT_UPCAST`` when called and keys its kernel's cache on it (a kernel
    built before a change is not reused after it)."""
    seen = []
    for module, name in ((mosaic_gpu, "_mix_kernel"), (mosaic_gpu, "_scores_kernel")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda cfg, real=real: seen.append(cfg.upcast) or real(cfg))
    n, batch, t_len, d, n_targets, m = 2, 1, 16, 64, 1, len(KERNELS)
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (n, batch, t_len, d), jnp.bfloat16)
    banks = jax.random.normal(keys[1], (n, sum(KERNELS), d))
    p = jax.random.uniform(keys[2], (n_targets, n, m, batch, t_len, 1))
    for how in mosaic_gpu.UPCASTS:
        monkeypatch.setattr(mosaic_gpu, "DEFAULT_UPCAST", how)
        mosaic_gpu.phase1_mix(x, banks, p, None, None, stream_kernels=KERNELS, heads=1, interpret=True)
    assert seen == list(mosaic_gpu.UPCASTS)


def _phase1_loss(x, b, q, seg, interpret):
    st = api.phase1(x, b, q, jnp.asarray([True, False, True]), stream_kernels=KERNELS, heads=HEADS,
                    segment_ids=seg, implementation="pallas_gpu", interpret=interpret, backward="pallas",
                    gpu_kernels="mosaic")
    return jnp.sum(st.acc) + jnp.sum(st.denom)


def _phase2_loss(st, x, b, q, g, seg, interpret):
    return jnp.sum(api.phase2_fused(st, x, b, q, True, g, stream_kernels=KERNELS, heads=HEADS, segment_ids=seg,
                                    implementation="pallas_gpu", interpret=interpret, backward="pallas",
                                    gpu_kernels="auto"))


def _inputs(batch=2, t_len=100, d=128, n=3, n_targets=2):
    m = len(KERNELS)
    keys = jax.random.split(jax.random.key(3), 8)
    sources = jax.random.normal(keys[0], (n, batch, t_len, d), jnp.bfloat16)
    banks = 0.5 * jax.random.normal(keys[1], (n, sum(KERNELS), d))
    queries = jax.random.normal(keys[2], (n_targets, m, d))
    seg = jnp.asarray([[0] * 17 + [1] * (t_len - 17)] * batch, jnp.int32)
    state = reference.SoftmaxState(jax.random.normal(keys[3], (m, batch, t_len, HEADS)),
                                   1.0 + jax.random.uniform(keys[4], (m, batch, t_len, HEADS)),
                                   jax.random.normal(keys[5], (m, batch, t_len, d)))
    partial = jax.random.normal(keys[6], (batch, t_len, d), jnp.bfloat16)
    gate = (jax.random.normal(keys[7], (m * d, m)) / (m * d) ** 0.5, jnp.float32(0.7), jnp.zeros((m,)))
    return (sources, banks, queries, seg), (state, partial, banks[0], queries[0], gate, seg)


def _phase1_fn(interpret):
    # value_and_grad: the state's value is not needed for this loss' gradient, so a gradient
    # alone would drop the mixing pass from the program
    return jax.value_and_grad(lambda x, b, q, seg: _phase1_loss(x, b, q, seg, interpret), argnums=(0, 1, 2))


def _phase2_fn(interpret):
    return jax.value_and_grad(lambda st, x, b, q, g, seg: _phase2_loss(st, x, b, q, g, seg, interpret),
                              argnums=(0, 1, 2, 3, 4))


@pytest.mark.slow  # eight Mosaic GPU lowerings (about 2 min of CPU)
def test_bits_upcast_lowers_in_every_kernel(monkeypatch):
    """With "bits" every Mosaic GPU kernel of phase 1 (scores, mix, ``gdots``, ``dstreams``, the
    transpose) and of phase 2 (the forward, the backward's state and input kernels) lowers for
    the H200 and widens its bf16 tiles inline (each kernel's ``plgpu`` is seen by the inline code)."""
    monkeypatch.setattr(mosaic_gpu, "DEFAULT_UPCAST", "bits")
    widened, real = set(), mosaic_gpu._bits_upcast
    monkeypatch.setattr(mosaic_gpu, "_bits_upcast", lambda plgpu, x: widened.add(id(plgpu)) or real(plgpu, x))
    args1, args2 = _inputs()
    for fn, args, calls in ((_phase1_fn(False), args1, 5), (_phase2_fn(False), args2, 3)):
        widened.clear()
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count(MOSAIC_GPU_CALL) == calls
        assert len(widened) == calls, (len(widened), calls)


@pytest.mark.gpu
def test_bits_upcast_gives_the_same_bits_on_the_gpu(monkeypatch):
    """On the GPU: phase 1's and phase 2's values and gradients through every Mosaic GPU kernel
    are the same bits with "bits" as with "extf" (bf16 sources and partial, segments, a source
    ruled out, two heads)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    args1, args2 = _inputs(batch=2, t_len=200, d=256)
    for fn, args in ((_phase1_fn, args1), (_phase2_fn, args2)):
        outs = {}
        for how in mosaic_gpu.UPCASTS:
            monkeypatch.setattr(mosaic_gpu, "DEFAULT_UPCAST", how)
            outs[how] = jax.tree.map(np.asarray, jax.jit(fn(False))(*args))
        for got, want in zip(jax.tree.leaves(outs["bits"]), jax.tree.leaves(outs["extf"]), strict=True):
            assert np.any(want)
            np.testing.assert_array_equal(got, want)


@pytest.mark.aot
def test_bits_upcast_has_no_prmt_in_the_mixing_loops(tmp_path):
    """A deviceless H200 compile (ptxas included) of MSAR's per-target reads: with "bits" the
    mixing pass's per-item loops hold no PRMT and fewer instructions than with "extf" (needs
    JAX's CUDA plugin on ``PYTHONPATH`` and ``nvdisasm`` on ``PATH``: ``msar_jax.aot``)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="JAX's CUDA plugin (msar_jax.aot) is not installed")
    if shutil.which("nvdisasm") is None:
        pytest.skip("nvdisasm is not on PATH (the nvidia-cuda-nvdisasm wheel)")
    sys.path.insert(0, str(ROOT / "experiments" / "mgpu"))
    import sass_stats

    os.environ.pop("XLA_FLAGS", None)
    loops = {}
    for how in mosaic_gpu.UPCASTS:
        dump = tmp_path / how
        dump.mkdir()
        sass_stats.compile_and_dump(f"--configs msar --p1_forms per_target --set mosaic_gpu.DEFAULT_UPCAST={how}",
                                    str(dump))
        [mix] = [k for k in sass_stats.read_dump(dump) if k.name.startswith("depth_attention_mix_mosaic")]
        loops[how] = sorted((lp for lp in mix.loops if len(lp.instrs) > 100), key=lambda lp: len(lp.instrs))
    assert len(loops["bits"]) == len(loops["extf"]) == len(KERNELS)
    for old, new in zip(loops["extf"], loops["bits"]):
        assert not any(i.opcode == "PRMT" for i in new.instrs)
        assert len(new.instrs) < len(old.instrs)
    assert sum(i.opcode == "PRMT" for i in loops["extf"][-1].instrs) > 0
