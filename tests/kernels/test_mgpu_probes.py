"""The Mosaic GPU probes (``benchmarks/mgpu/expand_sources.py``,
``benchmarks/mgpu/tma_rate.py``; docs/kernels.md) in Pallas' Mosaic GPU interpret mode: the expansion from TMA windows, from loads straight from global memory (at row
offsets that are not multiples of 8) and the fetch-only form each give the plain-jnp sums of
squares of the streams, and the copy-rate harness runs every variant (each program's marker row
written), the one-window form, with static and runtime row offsets, and the
shared-memory offset probe of ``offset_loads.py`` (exact when interpreted: the swizzle it
exposes on the GPU is not emulated). The ``tma_wgmma`` form is not here: the interpret mode cannot run a WGMMA whose left
operand is in registers (it lowers for sm_90; ``expand_sources.py --wgmma`` runs it on the
GPU). In the slow suite (CI runs it): probes outside the package, about 40 s. The
cluster probe (``cluster_probe.py``) cannot be interpreted; its test compiles it for the H200
(``-m aot``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "mgpu"))
pytest.importorskip("jax.experimental.pallas.mosaic_gpu")


@pytest.mark.slow
@pytest.mark.parametrize("source, bd", [("tma", 32), ("gmem", 32), ("gmem", 64), ("tma_fetch", 32), ("tma_single", 32),
                                        ("tma_single_dyn", 32), ("tma_single_pad", 32)])
def test_interpreted_expansion_sources(source, bd):
    import expand_sources as es

    batch, t_len, d = 1, 128, 128  # 2 token tiles, several chunks: both pipeline slots turn over
    keys = jax.random.split(jax.random.key(4), 2)
    x = jax.random.normal(keys[0], (batch, 2 * es.FRONT + t_len, d), jnp.float32)
    x = x.at[:, :es.FRONT].set(0).at[:, es.FRONT + t_len:].set(0).astype(jnp.bfloat16)
    bank = 0.3 * jax.random.normal(keys[1], (sum(es.KERNELS), d), jnp.float32)
    xin = jnp.pad(x, ((0, 0), (0, 0), (0, es.PAD))) if source == "tma_single_pad" else x  # rows PAD wider
    got = es.build(source, batch, t_len, d, bd=bd, interpret=True)(xin, bank)
    want = es.reference_sumsq(x, bank, t_len)
    if source == "tma_fetch":  # no conv: every stream is the partial itself
        want = jnp.broadcast_to(want[0], want.shape)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)


@pytest.mark.slow
def test_interpreted_global_memory_loads_at_any_offset():
    import expand_sources as es

    for dtype in (jnp.float32, jnp.bfloat16):
        assert es.gmem_offset_probe(dtype, interpret=True) == []


@pytest.mark.slow
def test_interpreted_copy_rate_harness_runs_every_variant():
    import tma_rate

    x = jnp.ones((1, 128 + 32, 2048), jnp.bfloat16)
    acc = jnp.ones((4, 1, 128, 2048), jnp.float32)
    for name, (steps, boxes) in tma_rate.variants().items():
        out = tma_rate.build(min(steps, 3), boxes, batch=1, t_len=128, d=2048, interpret=True)(x, acc)
        assert out.shape == (1, 2, 128) and float(jnp.min(out)) == 1.0, name


@pytest.mark.slow
def test_interpreted_shared_memory_offset_probe():
    import offset_loads

    for dtype in (jnp.float32, jnp.bfloat16):
        res = offset_loads.probe_runtime_offsets(dtype, interpret=True)
        assert res == {"static": ([], None), "dynamic": ([], None)}, dtype


@pytest.mark.aot
def test_cluster_probe_compiles_for_the_h200():
    """``benchmarks/mgpu/cluster_probe.py --aot``: clusters of 2-16 CTAs exchanging per-token sums
    (pushed with ``async_store_smem`` or pulled through ``cluster_ref``; tiles of 8, 16 and 32
    columns; 0-2 rounds) lower and compile for an H200 on this machine, all 72 but the one whose
    receive buffers exceed a CTA's shared memory (needs JAX's CUDA plugin, ``msar_jax.deviceless_gpu``; the
    interpreter cannot run the exchange, the GPU run tests it)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="JAX's CUDA plugin (msar_jax.deviceless_gpu) is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "benchmarks/mgpu/cluster_probe.py", "--aot"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.count("compiled for the H200") == 71, out.stdout
    assert out.stdout.count("skipped") == 1 and "push cols=32 G=16 rounds=2: skipped" in out.stdout, out.stdout
