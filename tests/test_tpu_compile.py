"""TPU compiles with libtpu on this CPU machine: ``compile_check``'s TPU topologies (one chip,
one host, several hosts, slices), the depth-read kernels at the model's shapes and the train step
with ``implementation="auto"`` beside the XLA path, for TPU v5e and v5p (docs/parallelism.md
section 3).

The topology parsing and the one-line errors run in the default suite. The compiles are ``slow``
and ``tpu``: they need libtpu in ``MSAR_TPU_SITE`` (default ``.tpu_site``; ``make tpu-site``
installs it, and ``make test-slow`` depends on that). Without it they FAIL, so a CI that lost
libtpu cannot pass them by skipping; ``MSAR_TPU_CHECKS=0`` is the one way to skip them. Each
compile runs in a subprocess with ``PYTHONPATH`` on that folder (libtpu never loads into the
test process) and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1`` (two pytest workers may load it at once).

Cost: the Mosaic compiler takes about 6 s of CPU per kernel call and a train step holds 43 of
them at any depth (the blocks are scanned), so one step with the kernels costs about 4 minutes
of CPU, one kernel case (forward + backward) about 15 s. By default the suite compiles what
shows each kind of program once: ten kernel cases per generation (``KERNEL_CASES_CI``: MSAR at
`base`, the paper widths 2080 and 2560 and m = 8, MHAR with 16 heads, AttnRes at 2560, all at
T = 8192) and three steps (`small` under FSDP 2x2 and under a 2-stage pipeline on v5e, `base` on
one v5p chip), each beside the XLA path: about 20 minutes of CPU. ``MSAR_TPU_FULL=1`` compiles
every case: the whole kernel table at its longest T and both sizes under every layout on both
generations (about 2 hours of CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from msar_jax import compile_check

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(os.environ.get("MSAR_TPU_SITE") or ROOT / ".tpu_site")
if not SITE.is_absolute():
    SITE = ROOT / SITE
GENERATIONS = ("v5e", "v5p")
REPORT = ROOT / "build" / "tpu_compile_report.jsonl"


# --- default suite: no libtpu needed ------------------------------------------------------------

@pytest.mark.parametrize("text, name, kwargs", [
    ("v5e:1x1", "v5e:1x1", dict(chips_per_host_bounds=(1, 1, 1))),
    ("v5e:2x1", "v5e:2x1", dict(chips_per_host_bounds=(2, 1, 1))),
    ("v5e:2x2", "v5e:2x2", dict(chips_per_host_bounds=(2, 2, 1))),
    ("v5p:1x1x1", "v5p:1x1x1", dict(chips_per_host_bounds=(1, 1, 1))),
    ("v5p:4x4x4", "v5p:4x4x4", {}),
    ("v5p:2x2x4,slices=2", "v5p:2x2x4", dict(num_slices=2)),
    ("v6e:4x4", "v6e:4x4", {}),
])
def test_parse_tpu_topology(text, name, kwargs):
    assert compile_check.parse_tpu_topology(text) == (name, kwargs)


@pytest.mark.parametrize("text", ["v5e", "v5e:2x2x2", "v5p:4x4", "v7:2x2", "v5e:0x2", "v5p:2x2x2,slices=0",
                                  "v5p:2x2x2,hosts=2", "V5E:2x2", "v5e:2x2 "])
def test_malformed_topology_is_one_line(text):
    with pytest.raises(ValueError, match="must be GEN:AxB"):
        compile_check.parse_tpu_topology(text)


def test_compile_check_topology_errors_before_jax():
    """The CLI: a malformed name exits 2 with one line, before jax or the config load."""
    out = subprocess.run([sys.executable, "-m", "msar_jax.compile_check", "--config=configs/msar.py:size=small",
                          "--topology=v5e:2x2x2"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: flag '--topology' = 'v5e:2x2x2': must be GEN:AxB"), out.stderr


def test_missing_libtpu_names_the_install(monkeypatch, capsys):
    monkeypatch.setattr(compile_check, "libtpu_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        compile_check.tpu_devices("v5e:1x1")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs libtpu" in err[0] and "make tpu-site" in err[0], err


def test_memory_report_total():
    class Mem:
        argument_size_in_bytes, output_size_in_bytes, alias_size_in_bytes = 100, 60, 40
        temp_size_in_bytes, generated_code_size_in_bytes = 30, 7

    class Compiled:
        def memory_analysis(self):
            return Mem()

    mem = compile_check.memory_report(Compiled())
    assert mem["total_bytes"] == 100 + 60 - 40 + 30 + 7
    text = compile_check.format_memory(mem, "chip")
    assert text.startswith("memory per chip") and "generated code" in text and "total" in text


# --- slow, with libtpu ----------------------------------------------------------------------------

def _libtpu_env() -> dict:
    """The subprocess environment with libtpu on the path; fails (or skips under
    ``MSAR_TPU_CHECKS=0``) when the folder lacks it."""
    if not (SITE / "libtpu").is_dir():
        message = f"libtpu not found in {SITE}: run `make tpu-site` (or set MSAR_TPU_CHECKS=0 to skip the TPU compiles)"
        if os.environ.get("MSAR_TPU_CHECKS") == "0":
            pytest.skip(message)
        pytest.fail(message)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(SITE)]), ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the suite's fake-device and fast-compile flags are the CPU's
    return env


def _run(args, timeout=1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=_libtpu_env(), capture_output=True, text=True,
                          timeout=timeout)


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.tpu
def test_topologies_one_chip_hosts_and_slices():
    script = textwrap.dedent("""
        import json
        from msar_jax import compile_check
        for text in ("v5e:1x1", "v5p:1x1x1", "v6e:1x1", "v5e:2x2", "v5p:4x4x4", "v5p:2x2x2,slices=2"):
            devices = compile_check.tpu_devices(text)
            print(json.dumps(dict(text=text, chips=len(devices), kind=devices[0].device_kind,
                                  hosts=len({d.process_index for d in devices}),
                                  slices=len({getattr(d, "slice_index", 0) for d in devices}))))
    """)
    out = _run(["-c", script], timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = {r["text"]: r for r in _json_lines(out.stdout)}
    assert {t: (r["chips"], r["hosts"], r["slices"]) for t, r in got.items()} == {
        "v5e:1x1": (1, 1, 1), "v5p:1x1x1": (1, 1, 1), "v6e:1x1": (1, 1, 1), "v5e:2x2": (4, 1, 1),
        "v5p:4x4x4": (64, 16, 1), "v5p:2x2x2,slices=2": (16, 4, 2)}
    assert got["v5e:1x1"]["kind"] == "TPU v5 lite" and got["v5p:1x1x1"]["kind"] == "TPU v5"


# The kernel cases: benchmarks/tpu_kernels_aot.py's table at its largest T per mechanism and size.
def _kernel_table():
    spec = importlib.util.spec_from_file_location("tpu_kernels_aot", ROOT / "benchmarks" / "tpu_kernels_aot.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


FULL = os.environ.get("MSAR_TPU_FULL") == "1"
KERNEL_CASES_CI = (
    "msar/base/T=8192/m=4/H=1/phase 1", "msar/base/T=8192/m=4/H=1/phase 2 gate",
    "msar/paper_10b/T=8192/m=4/H=1/phase 1", "msar/paper_28b/T=8192/m=4/H=1/phase 1",
    "msar/paper_28b/T=8192/m=4/H=1/phase 2 gate", "msar/base/T=8192/m=8/H=1/phase 1",
    "mhar/base/T=8192/m=1/H=16/phase 1", "mhar/base/T=8192/m=1/H=16/phase 2 mean",
    "attnres/paper_28b/T=8192/m=1/H=1/phase 1", "attnres/paper_28b/T=8192/m=1/H=1/phase 2 mean")


def _kernel_case_names() -> list[str]:
    """The table's cases at its longest T per mechanism, size, streams, heads and phase (all of
    them under ``MSAR_TPU_FULL=1``, else ``KERNEL_CASES_CI``); a missing table is one case that
    fails with its error."""
    try:
        cases = _kernel_table().KERNEL_CASES
    except Exception as e:  # noqa: BLE001 - the table's absence is this test's failure, not collection's
        return [f"KERNEL_CASES unavailable: {type(e).__name__}: {e}"]
    longest = {}
    for c in cases:
        key = (c.mechanism, c.size, c.streams, c.heads, c.phase, c.fuse)
        longest[key] = max(longest.get(key, 0), c.t_len)
    names = [c.name for c in cases if c.t_len == longest[(c.mechanism, c.size, c.streams, c.heads, c.phase, c.fuse)]]
    return names if FULL else [n for n in names if n in KERNEL_CASES_CI] + [
        f"{n} (not in the table)" for n in KERNEL_CASES_CI if n not in names]


KERNEL_SCRIPT = """
import importlib.util, json, sys, time
import jax, jax.numpy as jnp
from jax.experimental import topologies
from pallas_kernels.depth_attention import api, heuristics, reference

spec = importlib.util.spec_from_file_location("tpu_kernels_aot", "benchmarks/tpu_kernels_aot.py")
table = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = table
spec.loader.exec_module(table)
generation, names = sys.argv[1], set(sys.argv[2:])
chip = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}[generation]
device = topologies.get_topology_desc(chip, platform="tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
mesh = jax.sharding.Mesh([device], ("x",))
rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
for case in table.KERNEL_CASES:
    if case.name not in names:
        continue
    fn, args = table.kernel_function(case)  # the forward as the model calls it, abstract arguments
    op = "phase1" if case.phase == 1 else "phase2_fused"
    config = heuristics.choose(op, stream_kernels=case.stream_kernels, implementation="pallas_tpu")
    diff = (0, 2) if case.phase == 1 else (0, 1, 3)

    def fwd_bwd(*a):  # forward + the pullback of ones: every forward and backward kernel of the read
        out, pull = jax.vjp(lambda *d: fn(*[d[diff.index(i)] if i in diff else x for i, x in enumerate(a)]),
                            *[a[i] for i in diff])
        return pull(jax.tree.map(jnp.ones_like, out))

    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), args)
    t0 = time.time()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            lowered = jax.jit(fwd_bwd).trace(*args).lower()
            compiled = lowered.compile()
        mem = compiled.memory_analysis()
        row = dict(name=case.name, ok=True, temp=mem.temp_size_in_bytes,
                   custom_calls=lowered.as_text().count("stablehlo.custom_call @tpu_custom_call"))
    except Exception as e:
        row = dict(name=case.name, ok=False, error=type(e).__name__ + ": " + " ".join(str(e).split())[:600])
    row["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(row), flush=True)
"""

_kernel_results: dict = {}


def _kernel_results_for(generation: str) -> dict:
    """One subprocess per generation compiles every selected case; the tests read its rows."""
    if generation not in _kernel_results:
        out = _run(["-c", KERNEL_SCRIPT, generation, *_kernel_case_names()])
        rows = {r["name"]: r for r in _json_lines(out.stdout)}
        _kernel_results[generation] = (rows, out)
    return _kernel_results[generation]


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("name", _kernel_case_names())
def test_kernel_forward_and_backward_compile(generation, name):
    """The read's forward and its backward (``heuristics.choose``'s, as the model runs it),
    compiled by Mosaic for one chip; a failure names the compiler's error."""
    rows, out = _kernel_results_for(generation)
    assert name in rows, f"{generation} {name}: no result (exit {out.returncode}): {out.stderr[-1500:]}"
    row = rows[name]
    assert row["ok"], f"{generation} {name}: {row['error']}"
    assert row["custom_calls"] >= 2  # Mosaic kernels, not the XLA path


# The train step: (size, layout) -> (topology by generation, --mesh, --pipeline).
LAYOUTS = {
    "one chip": (dict(v5e="v5e:1x1", v5p="v5p:1x1x1"), "", ""),
    "fsdp 2x2": (dict(v5e="v5e:2x2", v5p="v5p:2x2x1"), "fsdp=4", ""),
    "pipeline 2 stages": (dict(v5e="v5e:2x1", v5p="v5p:2x1x1"), "stage=2", "stages=2,microbatches=2"),
}
STEP_CASES_CI = (("v5e", "small", "fsdp 2x2"), ("v5e", "small", "pipeline 2 stages"), ("v5p", "base", "one chip"))
STEP_CASES = [(g, s, l) for g in GENERATIONS for s in ("small", "base") for l in LAYOUTS] if FULL else STEP_CASES_CI


def compile_step(generation: str, size: str, layout: str, implementation: str) -> dict:
    topologies, mesh, pipeline = LAYOUTS[layout]
    args = ["-m", "msar_jax.compile_check", f"--config=configs/msar.py:size={size}", f"--topology={topologies[generation]}",
            f"--mesh={mesh}", f"--pipeline={pipeline}", "--json", f"--config.model.residual.implementation={implementation}"]
    out = _run(args)
    rows = _json_lines(out.stdout)
    assert out.returncode == 0 and rows, (f"{generation} {size} {layout} {implementation}: exit {out.returncode}: "
                                          f"{(out.stdout + out.stderr)[-1500:]}")
    return rows[-1]


@pytest.mark.slow
@pytest.mark.tpu
@pytest.mark.parametrize("generation, size, layout", STEP_CASES)
def test_train_step_compiles_with_the_kernels(generation, size, layout):
    """``implementation="auto"`` compiles to Mosaic kernels on the TPU under each layout; its memory
    per chip is recorded beside the XLA path's (``build/tpu_compile_report.jsonl``)."""
    auto = compile_step(generation, size, layout, "auto")
    xla = compile_step(generation, size, layout, "xla")
    assert auto["platform"] == "tpu" and auto["device_kind"].startswith("TPU v5")
    assert xla["kernel_calls"] == 0
    assert auto["kernel_calls"] > 0, f"{generation} {size} {layout}: auto compiled no Mosaic kernel (the XLA path)"
    row = dict(generation=generation, size=size, layout=layout,
               batch=auto["batch_size"], seq_len=auto["seq_len"], mesh=auto["mesh_text"],
               auto=auto["memory_per_device"], xla=xla["memory_per_device"],
               kernel_calls=auto["kernel_calls"], compile_s=dict(auto=auto["compile_s"], xla=xla["compile_s"]))
    REPORT.parent.mkdir(exist_ok=True)
    with REPORT.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"{generation} {size} {layout}: total per chip auto {auto['memory_per_device']['total_bytes'] / 2**20:.1f} MiB, "
          f"xla {xla['memory_per_device']['total_bytes'] / 2**20:.1f} MiB")
    for mem in (auto["memory_per_device"], xla["memory_per_device"]):
        assert mem["total_bytes"] > mem["argument_size_in_bytes"] > 0
