"""Where a train step's device time goes: a profiler trace of N steps, grouped by model part.

Runs each config's real train step, traces ``--steps`` steps after ``--warmup`` and attributes every
device op to a model part (named scope), a pass (forward, recompute, backward) and a kernel kind,
then prints the step time, a part x pass table, the Pallas kernels by name and the top ops.

Usage (GPU)::

    python benchmarks/profile_step.py configs/vanilla.py:size=base configs/attnres.py:size=base \\
        configs/msar.py:size=base --steps 3 --warmup 2 --json prof.json --top 25 [--hlo_dir hlo/]

CPU smoke (the test suite runs this)::

    python benchmarks/profile_step.py configs/attnres.py:size=tiny --steps 2 --warmup 1

``--kernel-option MODULE.NAME=VALUE`` (repeatable) sets a default of a
``pallas_kernels.depth_attention`` module first (e.g. ``heuristics.AUTO_INPUTS=False``). With
``configs/vanilla.py`` among the configs it ends with each config's step over Vanilla's, timed in
the same process (BENCHMARKS.md's step ratios). On a GPU, command buffers are switched off so the
trace shows kernels. Method: docs/methods.md §4.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):  # see the docstring
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msar_jax.config import load_config, parse_overrides  # noqa: E402

from msar_jax.cli import run_cli
from msar_jax.parallel import layout as layout_lib  # noqa: E402
from msar_jax.parallel import mesh as mesh_lib  # noqa: E402
from msar_jax.train.optim import make_optimizer  # noqa: E402

PARTS = ("embed", "depth_begin_block", "depth_read", "sublayer_attn", "sublayer_dense", "sublayer_moe",
         "depth_write", "depth_end_block", "lm_head", "cross_entropy", "optimizer")
PASSES = ("forward", "recompute", "backward", "other")
CONTAINER_OPCODES = ("while", "conditional", "call")
# A scope shows up bare ("/depth_read/") or wrapped by a transformation ("jvp(depth_read)",
# "transpose(jvp(depth_read))").
_PART_RE = re.compile(r"(?:^|[/(])(" + "|".join(PARTS) + r")(?=[/)]|$)")
_WRAP_RE = re.compile(r"(?:^|/)(transpose|jvp)\(")  # a path component's outermost wrapper
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE_RE = re.compile(r"\s([a-z][\w\-]*)\(")
_COMP_RE = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


# --------------------------------------------------------------------------------------------
# Attribution
# --------------------------------------------------------------------------------------------


def part_of(op_name: str) -> str:
    """Innermost known named scope in an ``op_name`` path, else ``"other"``."""
    found = _PART_RE.findall(op_name or "")
    return found[-1] if found else "other"


# A Pallas kernel's name (``pallas_call(name=...)``) is the ``op_name`` component above
# ``pallas_call`` on a GPU/TPU; in interpret mode (CPU) it is a plain scope over the emulating
# loop, found by the prefix every kernel of ``pallas_kernels.depth_attention`` carries.
_KERNEL_RE = re.compile(r"(?:^|/)([\w.\-]+)/pallas_call(?=/|$)|(?:^|/)(depth_attention_[\w.\-]+)(?=/|$)")


def kernel_of(op_name: str) -> str | None:
    """The name of the Pallas kernel an op belongs to, or ``None``."""
    found = [a or b for a, b in _KERNEL_RE.findall(op_name or "")]
    return found[-1] if found else None


def pass_of(op_name: str) -> str:
    """``forward`` / ``recompute`` / ``backward`` from JAX's autodiff wrappers in ``op_name``.

    Each path component counts by its outermost wrapper (``transpose(jvp(x))`` is a
    transpose); the last wrapped component decides, and a ``jvp`` below a ``transpose`` is a
    forward re-run inside the backward."""
    wraps = _WRAP_RE.findall(op_name or "")
    if not wraps:  # under value_and_grad every model op is inside a jvp: this is the update etc.
        return "other"
    if wraps[-1] == "transpose":
        return "backward"
    return "recompute" if "transpose" in wraps else "forward"


def parse_hlo(text: str) -> dict[str, dict]:
    """Instruction name -> ``{"opcode", "op_name", "calls", "target"}`` over every computation,
    plus ``"__computations__"``: computation name -> set of opcodes in it."""
    instrs, comps, current = {}, collections.defaultdict(set), None
    for line in text.splitlines():
        m = _COMP_RE.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        op = _OPCODE_RE.search(" " + rhs)
        opcode = op.group(1) if op else "?"
        meta = re.search(r'op_name="([^"]*)"', rhs)
        calls = re.search(r"calls=%?([\w.\-]+)", rhs)
        target = re.search(r'custom_call_target="([^"]*)"', rhs)
        instrs[name] = {"opcode": opcode, "op_name": meta.group(1) if meta else "",
                        "calls": calls.group(1) if calls else None, "target": target.group(1) if target else ""}
        if current is not None:
            comps[current].add(opcode)
    instrs["__computations__"] = comps
    return instrs


def kind_of(info: dict | None, comps: dict) -> str:
    if info is None:
        return "other"
    opcode, target = info["opcode"], info["target"].lower()
    if opcode in ("dot", "convolution") or "gemm" in target or "cublas" in target or "matmul" in target:
        return "matmul"
    if opcode == "custom-call" and ("triton" in target or "pallas" in target or "mosaic" in target):
        return "pallas"
    if "pallas_call" in info["op_name"]:
        return "pallas"
    if any(c in opcode for c in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")):
        return "collective"
    if opcode == "fusion":
        inner = comps.get(info["calls"], set())
        if inner & {"dot", "convolution"}:
            return "matmul"
        if inner and inner <= {"parameter", "copy", "transpose", "bitcast", "dynamic-update-slice",
                               "dynamic-slice", "slice", "concatenate", "tuple", "get-tuple-element"}:
            return "copy"
        return "elementwise"
    if opcode in ("copy", "transpose", "dynamic-update-slice", "dynamic-slice", "slice", "concatenate"):
        return "copy"
    return "other"


# --------------------------------------------------------------------------------------------
# The trace
# --------------------------------------------------------------------------------------------


def device_op_events(trace_dir: str, with_start: bool = False) -> list[tuple]:
    """``(hlo_module, hlo_op, duration_ns)`` of every op execution in the trace (with
    ``with_start``, ``start_ns`` appended).

    Device planes (``/device:GPU:k``, ``/device:TPU:k``) when the trace has them, else the
    host plane (XLA:CPU runs ops on host threads). Events carrying an ``hlo_op`` stat are
    kernels; the derived ``XLA Ops`` / ``XLA Modules`` lines repeat them and are skipped
    unless no raw line has any (then ``XLA Ops`` events, named by op, are used)."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))
    if not paths:
        raise FileNotFoundError(f"no *.xplane.pb under {trace_dir}: the profiler wrote no trace")
    data = ProfileData.from_file(paths[-1])
    planes = list(data.planes)
    device = [p for p in planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
    chosen = device or [p for p in planes if p.name.startswith("/host:CPU")]
    raw, derived = [], []
    for plane in chosen:
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                start = (float(ev.start_ns),) if with_start else ()
                if line.name == "XLA Ops":
                    derived.append((str(stats.get("hlo_module", "")), ev.name, float(ev.duration_ns), *start))
                elif line.name.startswith("XLA"):
                    continue
                elif "hlo_op" in stats:
                    raw.append((str(stats.get("hlo_module", "")), str(stats["hlo_op"]), float(ev.duration_ns),
                                *start))
    return raw or derived


def attribute(events, hlo: dict, module_hint: str, steps: int) -> dict:
    """Fold op events into part x pass and kind tables (ms per step) and a top-op list."""
    comps = hlo["__computations__"]
    modules = collections.Counter()
    for mod, _, dur in events:
        modules[mod] += dur
    # The train step's module: the one named like the step, else the busiest.
    step_mods = [m for m in modules if module_hint in m] or ([modules.most_common(1)[0][0]] if modules else [])
    by_part = collections.defaultdict(float)
    by_kind = collections.defaultdict(float)
    by_op = collections.defaultdict(float)
    by_kernel = collections.defaultdict(lambda: [0.0, 0])  # Pallas kernel name -> [ns, executions]
    unknown = 0.0
    for mod, op, dur in events:
        if mod not in step_mods:
            continue
        info = hlo.get(op)
        if info is not None and info["opcode"] in CONTAINER_OPCODES:
            continue  # XLA:CPU times a loop as one event around its body's events
        if info is None:
            unknown += dur
        op_name = info["op_name"] if info else ""
        by_part[(part_of(op_name), pass_of(op_name))] += dur
        by_kind[kind_of(info, comps)] += dur
        by_op[(op, kind_of(info, comps), part_of(op_name), pass_of(op_name))] += dur
        kernel = kernel_of(op_name)
        if kernel is not None:
            by_kernel[kernel][0] += dur
            by_kernel[kernel][1] += 1
    busy = sum(by_kind.values())
    ms = lambda ns: ns / 1e6 / steps  # noqa: E731
    return {
        "modules": step_mods,
        "busy_ms_per_step": ms(busy),
        "unmatched_share": unknown / busy if busy else 0.0,
        "parts": {f"{p}|{q}": ms(v) for (p, q), v in sorted(by_part.items(), key=lambda kv: -kv[1])},
        "kinds": {k: ms(v) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "pallas_kernels": {name: {"ms_per_step": ms(ns), "calls_per_step": calls / steps, "ms_per_call": ns / calls / 1e6}
                           for name, (ns, calls) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])},
        "top_ops": [{"op": o, "kind": k, "part": p, "pass": q, "ms_per_step": ms(v)}
                    for (o, k, p, q), v in sorted(by_op.items(), key=lambda kv: -kv[1])],
    }


# --------------------------------------------------------------------------------------------
# Running a config
# --------------------------------------------------------------------------------------------


def profile_config(spec: str, steps: int, warmup: int, trace_root: Path, overrides: dict,
                   hlo_dir: Path | None = None) -> dict:
    config = load_config(spec, {"train.steps": max(steps + warmup, 2), **overrides})
    config.optim.warmup_steps = min(config.optim.warmup_steps, config.train.steps)
    pcfg = mesh_lib.parallel_config()
    pcfg.mesh.update(dict(data=1, stage=1, fsdp=1, tensor=1))
    B, T = config.train.batch_size, config.seq_len
    layout = layout_lib.make_layout(pcfg, config.model, B, devices=jax.devices()[:1])
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    model_def, state, ssh = layout.init_state(config.model, tx, 0)
    step = layout.train_step(model_def, tx, schedule, config.model, ssh)
    rng = np.random.default_rng(1)
    batches = [layout.global_batch(rng.integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32))
               for _ in range(2)]
    t0 = time.perf_counter()
    with layout.context():
        compiled = step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp_gib = None if mem is None else mem.temp_size_in_bytes / 2**30
    hlo_text = compiled.as_text()
    if hlo_dir is not None:  # the compiled module, to look up the ops the report names
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec).strip("_")
        with gzip.open(hlo_dir / f"{slug}.hlo.txt.gz", "wt", encoding="utf-8") as fh:
            fh.write(hlo_text)
    hlo = parse_hlo(hlo_text)
    wall = []
    for i in range(warmup + steps):  # timed without the profiler
        t0 = time.perf_counter()
        state, metrics = compiled(state, batches[i % 2])
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            wall.append(time.perf_counter() - t0)
    trace_dir = tempfile.mkdtemp(prefix="trace_", dir=trace_root)
    with jax.profiler.trace(trace_dir):
        for i in range(steps):
            state, metrics = compiled(state, batches[i % 2])
            jax.block_until_ready((state, metrics))
    events = device_op_events(trace_dir)
    stats = jax.devices()[0].memory_stats() or {}  # None on the CPU
    peak = stats.get("peak_bytes_in_use")
    row = {"config": spec, "device": jax.devices()[0].device_kind, "batch_size": B, "seq_len": T,
           "compile_s": round(compile_s, 2), "median_step_ms": 1e3 * statistics.median(wall),
           "temp_gib": temp_gib, "peak_gib": None if peak is None else peak / 2**30,
           "steps": steps, "trace_dir": trace_dir, "loss": float(metrics["loss"])}
    row.update(attribute(events, hlo, "train_step", steps))
    return row


def set_kernel_options(options: list[str]) -> dict:
    """``MODULE.NAME=VALUE`` items: sets ``pallas_kernels.depth_attention.MODULE.NAME`` (a module
    default the kernels read when they are built, e.g. ``heuristics.AUTO_INPUTS=False``) to
    VALUE, a Python literal or else the string. Raises ``ValueError`` (naming the item) for a
    malformed item, an unknown module or a name the module does not have (so a typo cannot time
    the defaults under another label). Returns ``{item's name: value}``."""
    import ast
    import importlib

    done = {}
    for item in options:
        name, sep, text = item.partition("=")
        module_name, dot, attr = name.strip().rpartition(".")
        if not sep or not dot or not attr:
            raise ValueError(f"--kernel-option {item!r}: must be MODULE.NAME=VALUE (e.g. heuristics.AUTO_INPUTS=False)")
        try:
            module = importlib.import_module(f"pallas_kernels.depth_attention.{module_name}")
        except ImportError as e:
            raise ValueError(f"--kernel-option {item!r}: no module pallas_kernels.depth_attention.{module_name}") from e
        if not hasattr(module, attr):
            raise ValueError(f"--kernel-option {item!r}: {module_name} has no {attr}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        setattr(module, attr, value)
        done[name.strip()] = value
    return done


def is_vanilla(spec: str) -> bool:
    """Whether a config spec (``configs/vanilla.py:size=base``) is the Vanilla baseline."""
    return Path(spec.split(":", 1)[0]).stem == "vanilla"


def step_ratios(rows: list[dict]) -> str:
    """The step table of BENCHMARKS.md's "Train steps at `base`": each config's median wall step
    and peak memory, and its step over Vanilla's timed in the same process (the first Vanilla
    row; clocks and contention move absolute figures between machines). Empty without a
    Vanilla row."""
    vanilla = next((r for r in rows if is_vanilla(r["config"])), None)
    if vanilla is None:
        return ""
    out = [f"step against Vanilla ({vanilla['config']}, {vanilla['median_step_ms']:.1f} ms) on {vanilla['device']}:",
           "", "| config | step (ms) | / Vanilla | peak (GiB) |", "|---|---|---|---|"]
    for r in rows:
        peak = "n/a" if r.get("peak_gib") is None else f"{r['peak_gib']:.2f}"
        out.append(f"| {r['config']} | {r['median_step_ms']:.1f} | {r['median_step_ms'] / vanilla['median_step_ms']:.3f} "
                   f"| {peak} |")
    return "\n".join(out)


def _gib(x) -> str:
    return "n/a" if x is None else f"{x:.2f} GiB"


def report(row: dict, top: int) -> str:
    busy = row["busy_ms_per_step"] or float("nan")
    out = [f"### {row['config']} on {row['device']} (batch {row['batch_size']} x {row['seq_len']})",
           f"median wall step {row['median_step_ms']:.1f} ms; device busy {busy:.1f} ms/step; "
           f"compile {row['compile_s']:.1f} s; ops not found in the HLO: {row['unmatched_share']:.1%}",
           f"memory: step temporaries {_gib(row.get('temp_gib'))} (compiled), device peak {_gib(row.get('peak_gib'))}", "",
           "| part | " + " | ".join(PASSES) + " | total | share |", "|---" * (len(PASSES) + 3) + "|"]
    parts = collections.defaultdict(dict)
    for key, v in row["parts"].items():
        p, q = key.split("|")
        parts[p][q] = v
    for p, d in sorted(parts.items(), key=lambda kv: -sum(kv[1].values())):
        tot = sum(d.values())
        out.append(f"| {p} | " + " | ".join(f"{d.get(q, 0.0):.2f}" for q in PASSES) + f" | {tot:.2f} | {tot / busy:.1%} |")
    out += ["", "| kind | ms/step | share |", "|---|---|---|"]
    out += [f"| {k} | {v:.2f} | {v / busy:.1%} |" for k, v in row["kinds"].items()]
    if row.get("pallas_kernels"):
        out += ["", "| Pallas kernel | ms/step | calls/step | ms/call |", "|---|---|---|---|"]
        out += [f"| {k} | {v['ms_per_step']:.2f} | {v['calls_per_step']:g} | {v['ms_per_call']:.3f} |"
                for k, v in row["pallas_kernels"].items()]
    out += ["", f"Top {top} ops:", "", "| op | kind | part | pass | ms/step |", "|---|---|---|---|---|"]
    out += [f"| {o['op']} | {o['kind']} | {o['part']} | {o['pass']} | {o['ms_per_step']:.3f} |"
            for o in row["top_ops"][:top]]
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--steps", type=int, default=3, help="steps traced (and timed without the trace)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--trace_root", default=None, help="where the raw traces go (default: a temp dir)")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--kernel-option", action="append", default=[],
                    help="MODULE.NAME=VALUE: a pallas_kernels.depth_attention module default set before "
                         "the step is built (repeatable), e.g. heuristics.AUTO_INPUTS=False")
    ap.add_argument("--json", default=None)
    ap.add_argument("--hlo_dir", default=None,
                    help="also write each config's compiled HLO here (<config>.hlo.txt.gz): the report's op names")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        ap.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    try:
        overrides = parse_overrides(args.set)
        kernel_options = set_kernel_options(args.kernel_option)
    except ValueError as e:
        ap.error(str(e))
    if kernel_options:
        print(f"kernel options: {kernel_options}", flush=True)
    trace_root = Path(args.trace_root or tempfile.mkdtemp(prefix="profile_"))
    trace_root.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec in args.configs:
        print(f"[{time.strftime('%H:%M:%S')}] profiling {spec}", flush=True)
        hlo_dir = None
        if args.hlo_dir:
            hlo_dir = Path(args.hlo_dir)
            hlo_dir.mkdir(parents=True, exist_ok=True)
        rows.append(profile_config(spec, args.steps, args.warmup, trace_root, overrides, hlo_dir))
        print(report(rows[-1], args.top), flush=True)
        if args.json:  # after every config: a later failure or timeout keeps the earlier rows
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if len(rows) > 1 and (table := step_ratios(rows)):
        print("\n" + table, flush=True)
    return rows


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
