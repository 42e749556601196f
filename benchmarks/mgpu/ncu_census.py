"""What bounds each Mosaic GPU kernel, from Nsight Compute's counters: per kernel its duration,
the warp instructions each scheduler issued and the DRAM bytes it moved, and the two floors
they set: the **issue floor** (a Hopper scheduler issues at most one warp instruction per
cycle, so the busiest-on-average scheduler needs ``smsp__inst_executed.avg`` cycles at the
measured clock) and the **DRAM floor** (the bytes read and written over the copy bandwidth).
A kernel near its issue floor gains only from fewer instructions; one near its DRAM floor only
from fewer bytes; one far from both waits (latency, barriers, occupancy).

The counters come from ``ncu_phase1.py`` and ``ncu_phase2.py`` (``--issue`` for the bench
shape: 9 sources, S = 8, B x T = 8 x 2048, d = 2048) run under Nsight Compute with CSV output in base units::

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none -k regex:mosaic --csv \\
        --print-units base --metrics $(python3 benchmarks/mgpu/ncu_census.py --metrics) \\
        python3 benchmarks/mgpu/ncu_phase1.py --issue > p1.csv

then ``python3 benchmarks/mgpu/ncu_census.py p1.csv p2.csv --copy-tbps 3.2`` (or
``--measure-copy`` on the GPU: ``reads.copy_bandwidth``) prints the table. ``--per-sublayer S``
also sums the kernels per sublayer: phase 1's (the scoring, mixing, ``gdots``, ``dstreams`` and
transpose kernels) divided by ``S``, phase 2's as they are. ``--plot FILE.png`` draws both: each
kernel's time against its two floors, and (with ``--per-sublayer``) the forward and the forward +
backward per sublayer stacked by kernel beside the sums of their larger floors, with ``--targets
FWD,FB`` and ``--design-floors FWD,FB`` (ms: the design's bytes over the copy bandwidth,
``benchmarks/reads.py``'s ``design_bytes``) as lines."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

METRICS = ("gpu__time_duration.sum", "smsp__inst_executed.avg", "smsp__cycles_elapsed.avg.per_second",
           "dram__bytes_read.sum", "dram__bytes_write.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active")

# Nsight Compute's units -> SI factor (``--print-units base`` gave ns, byte, hz, inst and % in 2025.3.1)
UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "nsecond": 1e-9, "usecond": 1e-6, "msecond": 1e-3, "second": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6,
         "Gbyte": 1e9, "cycle/nsecond": 1e9, "cycle/usecond": 1e6, "cycle/second": 1.0, "hz": 1.0, "Khz": 1e3,
         "Mhz": 1e6, "Ghz": 1e9, "inst": 1.0, "warp": 1.0, "%": 1.0, "": 1.0}

# phase 1's kernels run once per block and are shared by its S reads (``--per-sublayer``)
PHASE1_KERNELS = ("scores", "mix", "gdots", "dstreams", "expansion_transpose")
# the kernels of a read's forward; every other kernel of the census is its backward's
FORWARD_KERNELS = ("scores", "mix", "phase2")


def parse(lines) -> list[dict]:
    """Nsight Compute's ``--csv`` rows (one per kernel and metric, after the program's own output)
    as one dict per launched kernel, in launch order: ``name`` and each metric in SI units."""
    rows = list(csv.reader(line for line in lines if line.startswith('"')))
    header = next((i for i, row in enumerate(rows) if row and row[0] == "ID"), None)
    if header is None:
        raise ValueError("no Nsight Compute CSV header (a row starting with \"ID\") in the input")
    cols = {name: k for k, name in enumerate(rows[header])}
    for need in ("ID", "Kernel Name", "Metric Name", "Metric Unit", "Metric Value"):
        if need not in cols:
            raise ValueError(f"Nsight Compute CSV without a {need!r} column: {rows[header]}")
    kernels: dict[str, dict] = {}
    for row in rows[header + 1:]:
        if len(row) != len(rows[header]) or row[0] == "ID":
            continue
        unit = row[cols["Metric Unit"]]
        if unit not in UNITS:
            raise ValueError(f"metric {row[cols['Metric Name']]}: unit {unit!r} is not one of {sorted(UNITS)}")
        kernel = kernels.setdefault(row[cols["ID"]], {"name": row[cols["Kernel Name"]]})
        value = row[cols["Metric Value"]].replace(",", "")
        kernel[row[cols["Metric Name"]]] = float(value) * UNITS[unit] if value not in ("", "n/a") else float("nan")
    return list(kernels.values())


def short_name(name: str) -> str:
    """``depth_attention_mix_mosaic_mosaic_gpu_kernel`` -> ``mix`` (the op's name, ``mosaic_gpu.named_body``)."""
    name = name.split("depth_attention_", 1)[-1]
    name = name[len("bwd1_"):] if name.startswith("bwd1_") else name
    return name.split("_mosaic")[0]


def census(kernels: list[dict], copy_bytes_per_s: float) -> list[dict]:
    """Per kernel, in launch order: ``name`` (``short_name``; the n-th launch of a name ``name#n``),
    ``ms``, ``issue_ms`` and ``dram_ms`` (the two floors), ``gb`` (DRAM bytes read + written),
    ``issue_pct`` (issue slots busy) and ``bound`` (the larger floor over the duration)."""
    out, seen = [], {}
    for k in kernels:
        missing = [m for m in METRICS if m not in k]
        if missing:
            raise ValueError(f"kernel {k['name']}: no {missing} (run ncu with --metrics {','.join(METRICS)})")
        seconds = k["gpu__time_duration.sum"]
        issue = k["smsp__inst_executed.avg"] / k["smsp__cycles_elapsed.avg.per_second"]
        nbytes = k["dram__bytes_read.sum"] + k["dram__bytes_write.sum"]
        dram = nbytes / copy_bytes_per_s
        name = short_name(k["name"])
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:  # a kernel launched again (a variant): ``mix#2``
            name = f"{name}#{seen[name]}"
        out.append(dict(name=name, ms=seconds * 1e3, issue_ms=issue * 1e3, dram_ms=dram * 1e3,
                        gb=nbytes / 1e9, issue_pct=k["smsp__issue_active.avg.pct_of_peak_sustained_active"],
                        bound=max(issue, dram) / seconds))
    return out


def table(rows: list[dict], per_sublayer: int | None = None) -> str:
    lines = ["| kernel | ms | issue floor, ms | DRAM GB | DRAM floor, ms | issue slots busy | larger floor / ms |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['ms']:.3f} | {r['issue_ms']:.3f} | {r['gb']:.2f} | {r['dram_ms']:.3f} | "
                     f"{r['issue_pct']:.0f}% | {r['bound']:.0%} |")
    if per_sublayer:
        def share(r):
            return 1.0 / per_sublayer if r["name"] in PHASE1_KERNELS else 1.0

        sums = {key: sum(r[key] * share(r) for r in rows) for key in ("ms", "issue_ms", "dram_ms")}
        both = sum(max(r["issue_ms"], r["dram_ms"]) * share(r) for r in rows)
        lines.append(f"| per sublayer (phase 1 / {per_sublayer}) | {sums['ms']:.3f} | {sums['issue_ms']:.3f} | | "
                     f"{sums['dram_ms']:.3f} | | {both / sums['ms']:.0%} (sum of the larger floors {both:.3f} ms) |")
    return "\n".join(lines)


def per_sublayer_stacks(rows: list[dict], per_sublayer: int) -> dict:
    """Per sublayer (phase 1's kernels over ``per_sublayer``), for ``"forward"`` (the
    ``FORWARD_KERNELS``) and ``"forward + backward"`` (every kernel): ``[(kernel, ms, larger
    floor ms), ...]`` in launch order. Variants (``name#n``) are left out."""
    stacks = {"forward": [], "forward + backward": []}
    for r in rows:
        if "#" in r["name"]:
            continue
        share = 1.0 / per_sublayer if r["name"] in PHASE1_KERNELS else 1.0
        item = (r["name"], r["ms"] * share, max(r["issue_ms"], r["dram_ms"]) * share)
        if r["name"] in FORWARD_KERNELS:
            stacks["forward"].append(item)
        stacks["forward + backward"].append(item)
    return stacks


def plot(rows: list[dict], path: str, *, per_sublayer: int | None = None, targets: tuple | None = None,
         design_floors: tuple | None = None, title: str = "") -> dict | None:
    """Draws the census into ``path`` (PNG): left, each kernel's time under Nsight Compute
    (bar) with its issue floor and DRAM floor (markers) and the larger floor's share of the
    time; right (with ``per_sublayer``), ``per_sublayer_stacks`` as stacked bars, measured
    beside the larger floors, and ``targets`` / ``design_floors`` ``(forward, forward +
    backward)`` ms as dashed / dotted lines. Returns the stacks (None without ``per_sublayer``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if per_sublayer else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 0.45 * len(rows) + 2.2), squeeze=False)
    ax = axes[0][0]
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [r["ms"] for r in rows], color="#9ecae1", label="measured (under ncu)")
    ax.scatter([r["issue_ms"] for r in rows], ys, marker="|", s=300, color="#d62728", zorder=3,
               label="issue floor (instructions)")
    ax.scatter([r["dram_ms"] for r in rows], ys, marker="|", s=300, color="#2ca02c", zorder=3,
               label="DRAM floor (bytes moved)")
    for y, r in zip(ys, rows):
        ax.text(r["ms"], y, f" {r['bound']:.0%}", va="center", fontsize=8)
    ax.set_yticks(ys, [r["name"] for r in rows])
    ax.set_xlabel("ms per call (label: larger floor / time)")
    ax.set_title("per kernel")
    ax.legend(loc="lower right", fontsize=8)
    stacks = None
    if per_sublayer:
        ax = axes[0][1]
        stacks = per_sublayer_stacks(rows, per_sublayer)
        colors = dict(zip(dict.fromkeys(name for items in stacks.values() for name, _, _ in items),
                          plt.get_cmap("tab10").colors))
        labels, x, short = [], 0, {"forward + backward": "fwd + bwd"}
        for kind, items in stacks.items():
            for what, pick in (("measured", 1), ("larger\nfloors", 2)):
                bottom = 0.0
                for item in items:
                    ax.bar(x, item[pick], bottom=bottom, color=colors[item[0]], alpha=1.0 if pick == 1 else 0.45,
                           edgecolor="white", label=item[0] if x == 0 or (x == 2 and item[0] not in FORWARD_KERNELS)
                           else None)
                    bottom += item[pick]
                ax.text(x, bottom, f"{bottom:.3f}", ha="center", va="bottom", fontsize=8)
                labels.append(f"{short.get(kind, kind)}\n{what}")
                x += 1
        # targets labelled above their line, design floors below theirs (the two may be close)
        for values, style, name, va in ((targets, "dashed", "target", "bottom"),
                                        (design_floors, "dotted", "design floor", "top")):
            for (lo, hi), value in zip(((-0.4, 1.4), (1.6, 3.4)), values or ()):
                ax.hlines(value, lo, hi, colors="black", linestyles=style)
                ax.text(hi, value, f" {name} {value:g}", va=va, ha="left", fontsize=8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel(f"ms per sublayer (phase 1 / {per_sublayer})")
        ax.set_title("per sublayer")
        ax.legend(fontsize=8, loc="upper left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return stacks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="Nsight Compute --csv --print-units base outputs")
    ap.add_argument("--metrics", action="store_true", help="print the --metrics list for ncu and exit")
    ap.add_argument("--copy-tbps", type=float, help="copy bandwidth, TB/s (bytes read + written)")
    ap.add_argument("--measure-copy", action="store_true", help="measure it here (benchmarks/reads.py copy_bandwidth, a GPU)")
    ap.add_argument("--per-sublayer", type=int, metavar="S", help="also sum per sublayer, phase 1's kernels / S")
    ap.add_argument("--skip", default="", help="comma-separated kernels (short names) to leave out, e.g. mix#2")
    ap.add_argument("--plot", metavar="FILE.png", help="also draw the census (and the per-sublayer sums) here")
    ap.add_argument("--targets", metavar="FWD,FB", help="with --plot and --per-sublayer: target ms per sublayer")
    ap.add_argument("--design-floors", metavar="FWD,FB",
                    help="with --plot and --per-sublayer: the design's bytes floors, ms per sublayer")
    ap.add_argument("--title", default="", help="the figure's title")
    args = ap.parse_args(argv)
    if args.metrics:
        print(",".join(METRICS))
        return
    if not args.files:
        ap.error("give the Nsight Compute CSV files (or --metrics)")
    if (args.copy_tbps is None) == (not args.measure_copy):
        ap.error("give exactly one of --copy-tbps and --measure-copy")
    if args.copy_tbps is not None and args.copy_tbps <= 0:
        ap.error(f"--copy-tbps={args.copy_tbps}: must be positive")
    if args.per_sublayer is not None and args.per_sublayer <= 0:
        ap.error(f"--per-sublayer={args.per_sublayer}: must be positive")
    lines = {}
    for flag, text in (("--targets", args.targets), ("--design-floors", args.design_floors)):
        if text is None:
            continue
        if not (args.plot and args.per_sublayer):
            ap.error(f"{flag} goes with --plot and --per-sublayer")
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            values = ()
        if len(values) != 2 or min(values) <= 0:
            ap.error(f"{flag}={text!r}: must be two positive ms values, FWD,FB (e.g. 0.45,2.0)")
        lines[flag] = values
    if args.measure_copy:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from benchmarks import reads

        copy = reads.copy_bandwidth()
    else:
        copy = args.copy_tbps * 1e12
    skip = {s for s in args.skip.split(",") if s}
    kernels = []
    for path in args.files:
        with open(path) as f:
            kernels += parse(f)
    rows = [r for r in census(kernels, copy) if r["name"] not in skip]
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s")
    print(table(rows, args.per_sublayer))
    if args.plot:
        plot(rows, args.plot, per_sublayer=args.per_sublayer, targets=lines.get("--targets"),
             design_floors=lines.get("--design-floors"), title=args.title)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
