"""Compile for an NVIDIA GPU this machine does not have, and read what XLA holds in memory.

``gpu_devices("h200")`` gives a device of an H200 topology (``GPU_TARGETS``; ``"h200x8"``: the eight
GPUs of one host, for a sharded step), on which
``jax.jit(f).lower(...).compile()`` runs XLA:GPU's whole pipeline and the kernels' compilers on
the CPU; nothing runs. ``compile_with_buffers``, ``read_buffer_assignment`` and ``format_buffers``
show the largest allocations of the compiled buffer assignment. Needs JAX's CUDA plugin (not a
dependency). Imports jax only inside its functions, as ``compile_check`` sets flags first.
Why it works, the install and a command: docs/parallelism.md section 6.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

# XLA's GpuTargetConfig for an H200 SXM: the fields a GPU reports to XLA
# (``CudaExecutor::CreateDeviceDescription``) that steer compilation: compute capability 9.0,
# 132 SMs at 1.98 GHz, 232448 bytes of opt-in shared memory per block, 64K registers per SM, a
# 50 MB L2, the datasheet's 4.8 TB/s; memory 140 GiB (the lent H200 offers about 139 GiB). The
# CUDA and cuDNN versions are the device image's majors (13 and 9). The phase-1 reads' compiled
# temporaries at the bench shape (``benchmarks/mgpu/aot_reads.py``) come out as the H200 measured
# them (docs/performance.md).
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150323855360
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""

GPU_TARGETS = {"h200": H200_TARGET_CONFIG}
PLUGIN_INSTALL = "python -m pip install --target .aot_site 'jax-cuda13-plugin[with-cuda]==0.11.2'"


def parse_gpu_target(name: str) -> tuple[str, int] | None:
    """``"h200"`` -> ``("h200", 1)``, ``"h200x8"`` -> ``("h200", 8)`` (GPUs of one host); None when
    ``name`` names no GPU target (a TPU topology, say)."""
    key, sep, count = name.lower().partition("x")
    if key not in GPU_TARGETS or (sep and not (count.isdigit() and int(count) >= 1)):
        return None
    return key, int(count or 1)


def is_gpu_target(name: str) -> bool:
    return parse_gpu_target(name) is not None


def prepare_gpu_environment() -> None:
    """Call before jax is imported: the CUDA plugin checks its libraries against a driver at
    start-up and, finding none, registers nothing; the check is skipped so that its deviceless
    topology is there. (Without a GPU, jax then runs on the CPU as usual.)"""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":  # the plugin is not even initialised then
        del os.environ["JAX_PLATFORMS"]


def gpu_mesh(name: str, axis: str = "x"):
    """A one-device mesh of ``gpu_devices(name)``. Trace under ``jax.sharding.use_abstract_mesh(
    mesh.abstract_mesh)`` (or ``jax.set_mesh``): Pallas' Triton lowering reads the target GPU's
    kind from the abstract mesh when there is no GPU to ask."""
    import jax

    return jax.sharding.Mesh(gpu_devices(name), (axis,))


def gpu_devices(name: str) -> list:
    """The devices of ``name``: a key of ``GPU_TARGETS`` (one GPU) or ``"<key>x<N>"`` (the ``N``
    GPUs of one host: one process, so a mesh over them compiles the sharded step as one host of
    that many GPUs would run it, its collectives included), for ``ShapeDtypeStruct(...,
    sharding=...)``. Raises ``SystemExit`` with the install command when JAX's CUDA plugin is
    missing."""
    parsed = parse_gpu_target(name)
    if parsed is None:
        raise ValueError(f"GPU target {name!r}: must be one of {sorted(GPU_TARGETS)}, or one of them "
                         f"followed by x<GPUs per host> (h200x8)")
    key, count = parsed
    from jax.experimental import topologies

    try:
        # "1x1xN": one process with N devices ("1x8x1" makes eight processes of one GPU each)
        topo = topologies.get_topology_desc(platform="cuda", topology_name=key, target_config=GPU_TARGETS[key],
                                            topology=f"1x1x{count}")
    except Exception as e:  # noqa: BLE001 - the plugin missing shows up as several error types
        raise SystemExit(f"deviceless compile for {name!r} needs JAX's CUDA plugin on PYTHONPATH "
                         f"({type(e).__name__}: {e}); install it with: {PLUGIN_INSTALL}; "
                         f"then run with PYTHONPATH=.aot_site") from None
    return list(topo.devices)


class Value(NamedTuple):
    """One HLO value placed in an allocation."""

    instruction: str  # the HLO instruction that defines it
    size: int  # bytes
    offset: int  # in the allocation
    shape: str


class Allocation(NamedTuple):
    index: int
    size: int  # bytes
    kind: str  # "preallocated-temp", "maybe-live-out", "parameter 0, shape |...| at ShapeIndex {}", ...
    values: tuple[Value, ...]

    @property
    def is_temp(self) -> bool:
        return "temp" in self.kind

    @property
    def is_parameter(self) -> bool:
        return self.kind.startswith("parameter")

    @property
    def is_output(self) -> bool:
        return "live-out" in self.kind


_ALLOC_RE = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE_RE = re.compile(r"^\s*value: <\d+ ([^ >]+)[^>]*> \(size=(\d+),offset=(\d+)\): (.*)$")


def parse_buffer_assignment(text: str) -> list[Allocation]:
    """The allocations of one ``*buffer-assignment.txt`` dump, largest first."""
    out, current = [], None
    for line in text.splitlines():
        m = _ALLOC_RE.match(line)
        if m:
            index, size, rest = int(m.group(1)), int(m.group(2)), m.group(3)
            kind = re.sub(r"^page \d+, ", "", rest).strip()  # "page N, " where XLA writes one
            current = [index, size, kind, []]
            out.append(current)
            continue
        m = _VALUE_RE.match(line)
        if m and current is not None:
            current[3].append(Value(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4).strip()))
        elif line and not line.startswith(" "):
            current = None  # the statistics after the allocations
    allocs = [Allocation(i, s, k, tuple(sorted(v, key=lambda x: -x.size))) for i, s, k, v in out]
    return sorted(allocs, key=lambda a: -a.size)


def read_buffer_assignment(dump_dir: str | os.PathLike, module: str | None = None) -> list[Allocation]:
    """The allocations of the last compiled module under ``dump_dir`` (``module``: a substring its
    file name must contain, e.g. ``"jit_train_step"``)."""
    files = sorted(Path(dump_dir).glob("*after_optimizations-buffer-assignment.txt"))
    if module is not None:
        files = [f for f in files if module in f.name]
    if not files:
        raise FileNotFoundError(f"no buffer-assignment dump under {dump_dir}"
                                + (f" for a module named *{module}*" if module else ""))
    return parse_buffer_assignment(files[-1].read_text())


def compile_with_buffers(lowered, compiler_options: dict | None = None):
    """``(lowered.compile(), its allocations)``: compiled with XLA's dumps written to a temporary
    folder, read back (``read_buffer_assignment``) and removed."""
    with tempfile.TemporaryDirectory(prefix="xla_dump_") as dump_dir:
        compiled = lowered.compile(compiler_options={**(compiler_options or {}), "xla_dump_to": dump_dir})
        return compiled, read_buffer_assignment(dump_dir)


_OP_NAME_RE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"')


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` metadata (the JAX scopes and primitive that made it)."""
    return {m.group(1): m.group(2) for m in map(_OP_NAME_RE.match, hlo_text.splitlines()) if m}


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def format_buffers(allocs: list[Allocation], top: int, names: dict[str, str] | None = None,
                   values_per_allocation: int = 3) -> str:
    """The ``top`` largest allocations, each with its largest values (and, given ``names``
    from ``op_names``, the op that defines each, cut to its last 100 characters)."""
    names = names or {}
    lines = [f"{len(allocs)} allocations; parameters {_gib(sum(a.size for a in allocs if a.is_parameter))}, "
             f"outputs {_gib(sum(a.size for a in allocs if a.is_output))}, "
             f"temporaries {_gib(sum(a.size for a in allocs if a.is_temp))}"]
    for a in allocs[:top]:
        lines.append(f"  allocation {a.index}: {_gib(a.size)}  {a.kind[:90]}")
        for v in a.values[:values_per_allocation]:
            op = names.get(v.instruction, "")
            lines.append(f"      {_gib(v.size)} at {v.offset}: {v.shape.split('{')[0]}  {v.instruction}"
                         + (f"  <- ...{op[-100:]}" if op else ""))
    return "\n".join(lines)
