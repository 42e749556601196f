"""Compiling for a device this machine lacks: the platform the depth-attention ops are traced for
(``pallas_kernels.depth_attention.platform``), reading XLA's buffer assignment (``msar_jax.deviceless_gpu``)
and ``compile_check --buffers``. The deviceless H200 compiles themselves need JAX's CUDA plugin
(not a dependency): the ``aot``-marked test runs them where it is installed (``-m aot``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from msar_jax import deviceless_gpu
from pallas_kernels.depth_attention import api, platform, reference

ROOT = Path(__file__).resolve().parents[1]
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu_v2"
TRITON_CALL = "__gpu$xla.gpu.triton"

DUMP = """\
BufferAssignment:
allocation 0: size 4096, page 0, maybe-live-out:
 value: <3 add.1 @0> (size=4096,offset=0): f32[32,32]{1,0}
 value: <1 big.2 @0> (size=2048,offset=0): f32[16,32]{1,0}
allocation 1: size 1024, parameter 0, shape |f32[16,16]| at ShapeIndex {}:
 value: <0 p0 @0> (size=1024,offset=0): f32[16,16]{1,0}
allocation 2: size 8192, page 0, preallocated-temp:
 value: <4 fusion.7{} @0> (size=16,offset=8176): (f32[2]{0}, f32[2]{0})
 value: <5 custom-call.3 @0> (size=8000,offset=0): bf16[4,1000]{1,0}

Total bytes used: 13312 (13.0KiB)

Used values:
<0 p0 @0>
 positions:
  p0
"""


def test_parse_buffer_assignment():
    allocs = deviceless_gpu.parse_buffer_assignment(DUMP)
    assert [a.index for a in allocs] == [2, 0, 1]  # largest first
    temp, out, param = allocs
    assert temp.is_temp and not temp.is_output and temp.size == 8192
    assert out.is_output and not out.is_parameter and out.kind == "maybe-live-out"
    assert param.is_parameter and param.kind.startswith("parameter 0, shape |f32[16,16]|")
    assert [v.instruction for v in temp.values] == ["custom-call.3", "fusion.7{}"]  # largest value first
    assert temp.values[0] == deviceless_gpu.Value("custom-call.3", 8000, 0, "bf16[4,1000]{1,0}")
    assert [v.size for v in out.values] == [4096, 2048]  # nothing after the allocations is read as a value


def test_read_buffer_assignment_takes_the_last_module(tmp_path):
    (tmp_path / "module_0001.jit_a.after_optimizations-buffer-assignment.txt").write_text(DUMP)
    (tmp_path / "module_0002.jit_b.after_optimizations-buffer-assignment.txt").write_text(
        "allocation 0: size 8, page 0, preallocated-temp:\n value: <0 x @0> (size=8,offset=0): f32[2]{0}\n")
    assert deviceless_gpu.read_buffer_assignment(tmp_path)[0].size == 8
    assert deviceless_gpu.read_buffer_assignment(tmp_path, module="jit_a")[0].size == 8192
    with pytest.raises(FileNotFoundError, match="jit_c"):
        deviceless_gpu.read_buffer_assignment(tmp_path, module="jit_c")


def test_op_names_and_format():
    hlo = ('  %custom-call.3 = bf16[4,1000]{1,0} custom-call(f32[2]{0} %p), custom_call_target="x", '
           'metadata={op_name="jit(f)/depth_attention_mix/pallas_call" source_file="a.py"}\n'
           '  ROOT %add.1 = f32[32,32]{1,0} add(%a, %b), metadata={op_name="jit(f)/add"}\n  %nometa = f32[] constant(0)\n')
    names = deviceless_gpu.op_names(hlo)
    assert names == {"custom-call.3": "jit(f)/depth_attention_mix/pallas_call", "add.1": "jit(f)/add"}
    text = deviceless_gpu.format_buffers(deviceless_gpu.parse_buffer_assignment(DUMP), top=2, names=names)
    assert "3 allocations; parameters 0.000 GiB" in text
    lines = text.splitlines()
    assert lines[1].startswith("  allocation 2:") and "preallocated-temp" in lines[1]
    assert "bf16[4,1000]  custom-call.3  <- ...jit(f)/depth_attention_mix/pallas_call" in lines[2]
    assert not any("allocation 1:" in line for line in lines)  # top=2


def test_gpu_targets_and_errors():
    assert deviceless_gpu.is_gpu_target("h200") and deviceless_gpu.is_gpu_target("H200") and not deviceless_gpu.is_gpu_target("v5e:2x2")
    assert "core_count: 132" in deviceless_gpu.GPU_TARGETS["h200"]
    with pytest.raises(ValueError, match="'a100'.*h200"):
        deviceless_gpu.gpu_devices("a100")
    # the GPUs of one host: "h200x8"
    assert deviceless_gpu.parse_gpu_target("H200x8") == ("h200", 8)
    assert deviceless_gpu.parse_gpu_target("h200") == ("h200", 1)
    for bad in ("h200x0", "h200x", "h200xa", "a100x8", "v5e:2x2"):
        assert deviceless_gpu.parse_gpu_target(bad) is None and not deviceless_gpu.is_gpu_target(bad)
    with pytest.raises(ValueError, match="x<GPUs per host>"):
        deviceless_gpu.gpu_devices("h200x0")


def test_platform_target_switches_the_ops_choices():
    assert platform.current() == jax.default_backend() == "cpu"
    assert not api.runs_a_kernel() and reference._conv_form() == "loop"
    with platform.target("gpu"):
        assert platform.current() == "gpu"
        assert api.runs_a_kernel() and reference._conv_form() == "unrolled"
        with platform.target("tpu"):
            assert platform.current() == "tpu"
        assert platform.current() == "gpu"  # restored
    assert platform.current() == "cpu"
    with pytest.raises(ValueError, match="'cuda'.*'gpu'"):
        with platform.target("cuda"):
            pass


@pytest.fixture
def h200(monkeypatch):
    """Pallas' Triton lowering asks the local GPU for its compute capability; answer sm_90."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))


def test_target_gpu_lowers_compiled_kernels(h200):
    """``implementation=None`` traced for the GPU picks the kernels and compiles them (not
    interpret mode); traced for the CPU (the default here) it picks the XLA path."""
    n, batch, t_len, d, n_targets, kernels = 3, 2, 64, 64, 2, (0, 4, 8, 12)
    keys = jax.random.split(jax.random.key(0), 3)
    sources = jax.random.normal(keys[0], (n, batch, t_len, d), jnp.bfloat16)
    banks = 0.5 * jax.random.normal(keys[1], (n, sum(kernels), d))
    queries = jax.random.normal(keys[2], (n_targets, len(kernels), d))

    def read(x, b, q):
        return api.phase1(x, b, q, stream_kernels=kernels, per_target=True)[0].acc

    def lowered_text():
        return jax.jit(read).trace(sources, banks, queries).lower(lowering_platforms=("cuda",)).as_text()

    with platform.target("gpu"):
        on_gpu = lowered_text()
    assert on_gpu.count(MOSAIC_GPU_CALL) + on_gpu.count(TRITON_CALL) >= 2  # the scores and mixing passes
    jax.clear_caches()  # the trace above is cached for these arguments (see platform's docstring)
    on_cpu = lowered_text()
    assert MOSAIC_GPU_CALL not in on_cpu and TRITON_CALL not in on_cpu


def test_compile_check_buffers_on_cpu():
    """``--buffers`` on the fake CPU devices: XLA:CPU writes the same dump format."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-m", "msar_jax.compile_check", "--config=configs/vanilla.py:size=tiny",
                          "--buffers=2", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["platform"] == "cpu"
    big = report["largest_allocations"]
    assert len(big) == 2 and big[0]["size"] >= big[1]["size"] > 0
    assert any("temp" in a["kind"] or "parameter" in a["kind"] or "live-out" in a["kind"] for a in big)
    assert all(v["size"] <= a["size"] for a in big for v in a["values"])


@pytest.mark.aot
def test_compile_check_h200_deviceless():
    """The ``smoke`` MSAR step compiled for an H200 on this machine, with the kernels the GPU runs
    (needs JAX's CUDA plugin on ``PYTHONPATH``, see ``msar_jax.deviceless_gpu``)."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="JAX's CUDA plugin (msar_jax.deviceless_gpu) is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    hlo = ROOT / ".pytest_aot_h200.hlo.txt"
    try:
        out = subprocess.run([sys.executable, "-m", "msar_jax.compile_check", "--config=configs/msar.py:smoke=1",
                              "--topology=h200", "--config.model.residual.implementation=auto", "--buffers=3",
                              "--json", f"--hlo={hlo}"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=1200)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        text = hlo.read_text()
    finally:
        hlo.unlink(missing_ok=True)
    assert report["platform"] == "gpu" and report["memory_per_device"]["temp_size_in_bytes"] > 0
    # the kernels as the H200 runs them (custom calls; at this size "auto" takes the Triton ones),
    # not interpret mode's loops
    calls = text.count('custom_call_target="__gpu$xla.gpu.triton"') + text.count('custom_call_target="mosaic_gpu_v2"')
    assert calls >= 10, calls
    assert len(report["largest_allocations"]) == 3


@pytest.mark.aot
@pytest.mark.parametrize("mesh", ["data=8", "fsdp=8"])
def test_compile_check_eight_h200_host_sharded_kernels(mesh):
    """The ``smoke`` MSAR step with the kernels compiled for one host of eight H200s under data
    parallelism and FSDP (``--topology=h200x8``): the kernels run inside the reads' ``shard_map``
    (``msar_jax.parallel.kernel_sharding``), and memory is reported per GPU."""
    pytest.importorskip("jax_plugins.xla_cuda13", reason="JAX's CUDA plugin (msar_jax.deviceless_gpu) is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    hlo = ROOT / f".pytest_aot_h200x8_{mesh.replace('=', '')}.hlo.txt"
    try:
        out = subprocess.run([sys.executable, "-m", "msar_jax.compile_check", "--config=configs/msar.py:smoke=1",
                              "--topology=h200x8", f"--mesh={mesh}", "--batch_size=8", "--json", f"--hlo={hlo}"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.strip().splitlines()[-1])
        text = hlo.read_text()
    finally:
        hlo.unlink(missing_ok=True)
    assert report["platform"] == "gpu" and report["memory_per_device"]["temp_size_in_bytes"] > 0
    assert "num_partitions=8" in text
    calls = text.count('custom_call_target="__gpu$xla.gpu.triton"') + text.count('custom_call_target="mosaic_gpu_v2"')
    assert calls >= 10, calls
