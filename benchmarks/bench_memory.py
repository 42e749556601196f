"""Training memory per device at the shapes users train, against Vanilla (BENCHMARKS.md, "Training
memory at `base`").

Compiles each config's train step (AdamW, donated state; ``msar_jax.compile_check``, one process
per config) for a deviceless target and reads ``compiled.memory_analysis()``: temporaries, and the
total per device (arguments + outputs - aliased + temporaries). Nothing executes; on the GPU the
measured device peak equals this total (``benchmarks/profile_step.py`` prints both).

    # one H200 (JAX's CUDA plugin in .aot_site, msar_jax.deviceless_gpu), the `base` configs:
    PYTHONPATH=.aot_site python benchmarks/bench_memory.py --topology h200 --full_batch
    # the per-chip shard of paper_28b on a v5p pod slice under FSDP (libtpu: make tpu-site):
    PYTHONPATH=.tpu_site python benchmarks/bench_memory.py --size paper_28b --topology v5p:4x4x4 \\
        --mesh fsdp=64

``--set KEY=VALUE`` overrides every config (e.g. ``model.residual.state_dtype=float32``);
``--json`` writes the rows. Vanilla comes first: the ratios are against it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MECHANISMS = ("vanilla", "mhc", "attnres", "mhar", "msar")
GIB = 2**30


# libtpu's error for a program that does not fit a chip
OUT_OF_MEMORY = re.compile(r"memory required for HLO temporaries \(([\d.]+[KMGT]?)\) exceeds available HBM \(([\d.]+[KMGT]?)\)")


def _bytes(text: str) -> int:
    """``"150.68G"`` -> bytes (libtpu's units are powers of 1024)."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    return int(float(text.rstrip("KMGT")) * scale.get(text[-1], 1))


def compile_memory(spec: str, topology: str | None, mesh: str | None, full_batch: bool, overrides: list[str],
                   batch_size: int = 0) -> dict:
    """``compile_check --json``'s report for one config, run in its own process (each target
    sets its environment before JAX loads)."""
    cmd = [sys.executable, "-m", "msar_jax.compile_check", f"--config={spec}", "--json"]
    if topology:
        cmd.append(f"--topology={topology}")
    if mesh:
        cmd.append(f"--mesh={mesh}")
    if full_batch:
        cmd.append("--full_batch")
    if batch_size:
        cmd.append(f"--batch_size={batch_size}")
    cmd += [f"--config.{o}" for o in overrides]
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if oom := OUT_OF_MEMORY.search(proc.stdout):
        # A TPU compile refuses a program whose temporaries exceed the chip: what it needed is the answer
        return {"config": spec, "fits": False, "needed_temporaries": _bytes(oom.group(1)),
                "available": _bytes(oom.group(2)), "message": oom.group(0)}
    if proc.returncode or not lines:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise RuntimeError(f"{spec}: compile_check exited with {proc.returncode}: " + " | ".join(tail))
    return json.loads(lines[-1])


def _temporaries(row: dict) -> int:
    return row["memory_per_device"]["temp_size_in_bytes"] if row.get("fits", True) else row["needed_temporaries"]


def table(rows: list[dict]) -> str:
    """Markdown: temporaries and total per device, each against the first row (Vanilla). A
    program the chip cannot hold shows the temporaries the compiler asked for."""
    base = rows[0]
    out = ["| config | temporaries (GiB) | / Vanilla | total per device (GiB) | / Vanilla | compile (s) |",
           "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        temp = f"{_temporaries(r) / GIB:.2f}" + ("" if r.get("fits", True) else
                                                  f" (does not fit: {r['available'] / GIB:.2f} available)")
        total = ratio = secs = "-"
        if r.get("fits", True) and base.get("fits", True):
            m, b = r["memory_per_device"], base["memory_per_device"]
            total, ratio = f"{m['total_bytes'] / GIB:.2f}", f"{m['total_bytes'] / b['total_bytes']:.3f}"
        if r.get("fits", True):
            secs = f"{r['lower_s'] + r['compile_s']:.0f}"
        out.append(f"| {r['config']} | {temp} | {_temporaries(r) / _temporaries(base):.3f} | {total} | {ratio} | {secs} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="base", help="the configs' size (configs/<mechanism>.py:size=SIZE)")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS),
                    help="comma-separated config names under configs/ (vanilla first: the ratios' reference)")
    ap.add_argument("--topology", default=None, help="compile_check's --topology (h200, v5p:4x4x4, ...); none: this CPU")
    ap.add_argument("--mesh", default=None, help="compile_check's --mesh, e.g. fsdp=64")
    ap.add_argument("--full_batch", action="store_true", help="the config's global batch (else one row per batch device)")
    ap.add_argument("--batch_size", type=int, default=0, help="a global batch instead")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every config")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = [n for n in args.mechanisms.split(",") if n]
    missing = [n for n in names if not (REPO / "configs" / f"{n}.py").is_file()]
    if missing or not names:
        ap.error(f"--mechanisms={args.mechanisms!r}: no configs/{missing[0] if missing else ''}.py; "
                 f"known: {', '.join(MECHANISMS)}")
    rows = []
    for name in names:
        spec = f"configs/{name}.py:size={args.size}"
        t0 = time.time()
        rows.append(compile_memory(spec, args.topology, args.mesh, args.full_batch, args.set, args.batch_size))
        print(f"[{time.time() - t0:5.0f} s] {spec}: temporaries {_temporaries(rows[-1]) / GIB:.2f} GiB"
              + ("" if rows[-1].get("fits", True) else " (does not fit)"), file=sys.stderr, flush=True)
    if r0 := next((r for r in rows if r.get("fits", True)), None):
        print(f"{r0['device_kind']} x {r0['devices']}, mesh {r0['mesh_text']}, batch {r0['batch_size']} x "
              f"{r0['seq_len']}" + (f", overrides {args.set}" if args.set else ""))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
