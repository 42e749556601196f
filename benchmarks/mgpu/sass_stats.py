"""Registers, spills and SASS instruction counts of the Mosaic GPU kernels, on a machine without a GPU.

A deviceless compile for an H200 (``msar_jax.deviceless_gpu``) compiles the Mosaic GPU kernels too: XLA
instantiates each custom call for the target's compute capability, which runs Mosaic GPU's
pipeline and ptxas. With ``MOSAIC_GPU_DUMP_TO=DIR MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1``
(and ``nvdisasm`` on ``PATH``: the ``nvidia-cuda-nvdisasm`` wheel) each kernel leaves
``<name>_<k>.ptxas`` (ptxas's report: registers, spills) and ``<name>_<k>.sass_ctrl`` (its SASS)
in ``DIR``; kernels are named after their Pallas body (``mosaic_gpu.named_body``). This reads
them back: per kernel the registers and spill bytes, the SASS instructions in all and by kind,
and its innermost loops (the code between a backward branch and its target, holding no other
loop), each with its instruction mix: the work per pipeline item, where the kernels spend their
issue slots. Static counts, not a profile: a loop's instructions include branches that do not
run on every pass (the mix's loops hold the next item's fetch once per stream, one of which runs),
and a loop's share of the time also depends on how often it runs and on what it waits for.

Usage (needs JAX's CUDA plugin, ``msar_jax.deviceless_gpu``, and nvdisasm)::

    PYTHONPATH=.aot_site python benchmarks/mgpu/sass_stats.py --compile "--configs msar --p1_forms per_target"
    python benchmarks/mgpu/sass_stats.py --dump DIR          # a dump written before
    PYTHONPATH=.aot_site python benchmarks/mgpu/sass_stats.py --compile "--configs msar" \\
        --against "--configs msar --set mosaic_gpu.phase2_inputs.INPUTS_SLOTS=2"   # two variants, side by side
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

# opcode (without modifiers) -> what it is, for the summary columns
KINDS = {
    "FFMA": "fp32", "FMUL": "fp32", "FADD": "fp32", "FMNMX": "fp32", "FSEL": "fp32", "FSETP": "fp32",
    "MUFU": "fp32",
    "HFMA2": "half", "HMUL2": "half", "HADD2": "half",
    "F2FP": "convert", "F2F": "convert", "PRMT": "convert", "I2F": "convert", "F2I": "convert",
    "LDS": "smem", "STS": "smem", "LDSM": "smem",
    "LDG": "gmem", "STG": "gmem", "LDL": "local", "STL": "local",
    "UTMALDG": "tma", "UTMASTG": "tma", "UBLKCP": "tma", "UTMACMDFLUSH": "tma", "UTMAPF": "tma",
    "SYNCS": "barrier", "BAR": "barrier", "DEPBAR": "barrier", "WARPSYNC": "barrier", "MEMBAR": "barrier",
    "FENCE": "barrier",
    "HGMMA": "tensor", "WARPGROUP": "tensor",
    "BRA": "control", "BSSY": "control", "BSYNC": "control", "EXIT": "control", "CALL": "control",
    "RET": "control", "ELECT": "control",
}
KIND_ORDER = ("fp32", "convert", "smem", "int", "tma", "barrier", "control", "local", "other")

_INSTR_RE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]+)?\s*(.*?)\s*;?\s*$")
_LABEL_RE = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET_RE = re.compile(r"`\((\.L_x_\d+)\)")


class Instr(NamedTuple):
    address: int
    opcode: str  # without modifiers
    text: str  # opcode with its modifiers and operands


def kind_of(opcode: str) -> str:
    if opcode in KINDS:
        return KINDS[opcode]
    if opcode[:1] in "IUSLP" or opcode in ("MOV", "SHF", "LEA", "LOP3", "SEL", "ISETP", "VOTE", "SHFL", "R2UR",
                                           "S2R", "S2UR", "CS2R", "POPC", "FLO", "BREV", "LDC", "ULDC"):
        return "int"  # integer, uniform, predicate and special-register work: addresses, counters, masks
    return "other"


def parse_sass(text: str) -> tuple[list[Instr], dict[str, int]]:
    """The instructions of one kernel's ``.sass_ctrl`` / ``.sass`` dump, in address order, and
    its labels' addresses."""
    instrs, labels, pending = [], {}, []
    for line in text.splitlines():
        m = _LABEL_RE.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _INSTR_RE.search(line)
        if not m:
            continue
        address = int(m.group(1), 16)
        for label in pending:
            labels[label] = address
        pending = []
        opcode = m.group(3)
        instrs.append(Instr(address, opcode, (opcode + (m.group(4) or "") + " " + m.group(5)).strip()))
    return instrs, labels


class Loop(NamedTuple):
    start: int  # address of the first instruction (the branch target)
    end: int  # address of the backward branch
    instrs: tuple[Instr, ...]

    def kinds(self) -> collections.Counter:
        return collections.Counter(kind_of(i.opcode) for i in self.instrs)


def innermost_loops(instrs: list[Instr], labels: dict[str, int]) -> list[Loop]:
    """The loops that contain no other loop, as ``[target, backward branch]`` address ranges."""
    spans = set()
    for ins in instrs:
        if ins.opcode != "BRA":
            continue
        m = _TARGET_RE.search(ins.text)
        if m and m.group(1) in labels and labels[m.group(1)] <= ins.address:
            spans.add((labels[m.group(1)], ins.address))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    return [Loop(a, b, tuple(i for i in instrs if a <= i.address <= b)) for a, b in sorted(inner)]


class KernelStats(NamedTuple):
    name: str
    registers: int | None
    spill_stores: int
    spill_loads: int
    instrs: list[Instr]
    loops: list[Loop]


_REGS_RE = re.compile(r"Used (\d+) registers")
_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def read_kernel(ptxas: Path) -> KernelStats:
    """The stats of the kernel whose ptxas report is ``ptxas`` (its SASS beside it)."""
    report = ptxas.read_text()
    regs = _REGS_RE.search(report)
    spill = _SPILL_RE.search(report)
    sass_file = next((p for p in (ptxas.with_suffix(".sass_ctrl"), ptxas.with_suffix(".sass")) if p.exists()), None)
    instrs, labels = parse_sass(sass_file.read_text()) if sass_file else ([], {})
    return KernelStats(ptxas.stem, int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else 0,
                       int(spill.group(2)) if spill else 0, instrs, innermost_loops(instrs, labels))


def read_dump(dump_dir: str | os.PathLike) -> list[KernelStats]:
    return [read_kernel(p) for p in sorted(Path(dump_dir).glob("*.ptxas"))]


def _mix(counter: collections.Counter) -> str:
    return " ".join(f"{k} {counter[k]}" for k in KIND_ORDER if counter[k])


def report(kernels: list[KernelStats], loops_per_kernel: int = 6, top_opcodes: int = 8) -> str:
    lines = []
    for k in kernels:
        total = collections.Counter(kind_of(i.opcode) for i in k.instrs)
        spill = f", spills {k.spill_stores} B stored / {k.spill_loads} B loaded" if k.spill_stores or k.spill_loads else ""
        lines.append(f"{k.name}: {k.registers} registers{spill}; {len(k.instrs)} SASS instructions ({_mix(total)})")
        for loop in sorted(k.loops, key=lambda lp: -len(lp.instrs))[:loops_per_kernel]:
            ops = collections.Counter(i.opcode for i in loop.instrs).most_common(top_opcodes)
            lines.append(f"    loop {loop.start:#07x}-{loop.end:#07x}: {len(loop.instrs):5d} instructions  "
                         f"[{_mix(loop.kinds())}]  top: " + ", ".join(f"{o} {c}" for o, c in ops))
    return "\n".join(lines)


def _base_name(name: str) -> str:
    """A dump's kernel name without Mosaic GPU's running number (``mix_mosaic_1`` -> ``mix_mosaic``)."""
    return re.sub(r"_\d+$", "", name)


def compare(before: list[KernelStats], after: list[KernelStats], loops_per_kernel: int = 6) -> str:
    """``before`` against ``after``, kernel by kernel (paired in dump order within each name) and,
    in each, loop by loop from the largest down: instructions, registers and spills, and the
    change in per cent. A static count: where the loops are the kernel's work per pipeline item,
    the share that an issue-bound kernel can lose."""
    lines, groups = [], collections.defaultdict(list)
    for k in after:
        groups[_base_name(k.name)].append(k)
    pct = lambda a, b: f"{100.0 * (b - a) / a:+.1f}%" if a else "n/a"  # noqa: E731
    for k in before:
        mates = groups.get(_base_name(k.name))
        if not mates:
            lines.append(f"{k.name}: not in the second compile")
            continue
        other = mates.pop(0)
        lines.append(f"{k.name} -> {other.name}: {len(k.instrs)} -> {len(other.instrs)} instructions "
                     f"({pct(len(k.instrs), len(other.instrs))}), registers {k.registers} -> {other.registers}, "
                     f"spills {k.spill_stores}/{k.spill_loads} -> {other.spill_stores}/{other.spill_loads} B")
        big = lambda ks: sorted(ks.loops, key=lambda lp: -len(lp.instrs))[:loops_per_kernel]  # noqa: E731
        for a, b in zip(big(k), big(other)):
            if max(len(a.instrs), len(b.instrs)) < 16:  # barrier spins, not work
                continue
            lines.append(f"    loop {len(a.instrs):5d} -> {len(b.instrs):5d} ({pct(len(a.instrs), len(b.instrs))})  "
                         f"[{_mix(a.kinds())}] -> [{_mix(b.kinds())}]")
    for name, rest in groups.items():
        lines.extend(f"{k.name}: not in the first compile" for k in rest)
    return "\n".join(lines)


def compile_and_dump(aot_reads_args: str, dump_dir: str) -> None:
    """Run ``aot_reads.py`` with Mosaic GPU's dumps into ``dump_dir`` (a subprocess: the dump
    variables are read when a kernel is compiled, but the process must also find nvdisasm)."""
    env = dict(os.environ, MOSAIC_GPU_DUMP_TO=dump_dir, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_SASS="1")
    script = Path(__file__).with_name("aot_reads.py")
    out = subprocess.run([sys.executable, str(script), *shlex.split(aot_reads_args)], env=env, capture_output=True,
                         text=True)
    if out.returncode != 0:
        raise SystemExit(f"aot_reads.py failed:\n{out.stderr[-3000:]}")
    if "nvdisasm invocation failed" in out.stderr + out.stdout:
        print("warning: nvdisasm was not found, so there is no SASS (pip download nvidia-cuda-nvdisasm and put "
              "its bin/ on PATH)", file=sys.stderr)


def _kernels(args_or_dir: str, compiled: bool) -> list[KernelStats]:
    if compiled:
        with tempfile.TemporaryDirectory(prefix="mosaic_dump_") as dump_dir:
            compile_and_dump(args_or_dir, dump_dir)
            kernels = read_dump(dump_dir)
    else:
        kernels = read_dump(args_or_dir)
    if not kernels:
        raise SystemExit("no <kernel>.ptxas files: were MOSAIC_GPU_DUMP_TO and MOSAIC_GPU_DUMP_PTXAS set?")
    return kernels


def main(argv=None) -> list[KernelStats]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="a MOSAIC_GPU_DUMP_TO folder written before")
    ap.add_argument("--compile", help="arguments for aot_reads.py: compile those reads now and read their dump")
    ap.add_argument("--against", help="a second compile (aot_reads.py arguments with --compile, a dump folder "
                    "with --dump) to compare with the first, kernel by kernel and loop by loop")
    ap.add_argument("--loops", type=int, default=6, help="innermost loops listed per kernel, largest first")
    args = ap.parse_args(argv)
    if bool(args.dump) == bool(args.compile):
        ap.error("give exactly one of --dump DIR and --compile ARGS")
    kernels = _kernels(args.compile or args.dump, bool(args.compile))
    if args.against is None:
        print(report(kernels, args.loops))
        return kernels
    print(compare(kernels, _kernels(args.against, bool(args.compile)), args.loops))
    return kernels


if __name__ == "__main__":
    main()
