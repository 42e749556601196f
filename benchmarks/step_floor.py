"""The memory-bandwidth floor of a train step's depth reads, as this codebase runs them.

Counts the fewest DRAM bytes the two-phase block reads (docs/design.md §5) move in one step of a
config, each kernel reading its inputs once and writing its outputs once, and turns them into
milliseconds at given bandwidths: if the floor alone exceeds a target, no kernel can meet it.

Usage::

    python benchmarks/step_floor.py configs/msar.py:size=base configs/attnres.py:size=base \\
        --vanilla_ms 935.3 --bandwidth 3.16,4.8 [--state_bytes 2] [--factored_cotangent]

``--vanilla_ms`` prints ``(vanilla + floor) / vanilla``; ``--set model.save_read_outputs=true`` the
floor with the reads' outputs saved. The byte counts per phase: docs/methods.md §5.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flax import nnx  # noqa: E402

from msar_jax import config as config_lib  # noqa: E402
from msar_jax.config import load_config, parse_overrides  # noqa: E402

from msar_jax.cli import run_cli
from msar_jax.residuals.base import make_mechanism  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ReadShape:
    """What the byte count needs of a config's depth reads."""

    batch: int
    t_len: int
    d: int
    n_sublayers: int
    block_size: int
    streams: int
    act_bytes: int
    state_bytes: int  # of the phase-1 state's weighted sums (model.residual.state_dtype)
    save_read_outputs: bool = False  # model.save_read_outputs: the re-run reuses each h


def read_shape(config) -> ReadShape:
    """The shape of ``config``'s two-phase block reads; ValueError if it has none."""
    model = config.model
    mech = make_mechanism(model, nnx.Rngs(0))
    kernels = getattr(mech, "stream_kernels", None)
    name = model.residual.name
    if kernels is None:
        raise ValueError(f"model.residual.name={name!r}: no depth-attention read (no stream_kernels) to count")
    if not model.residual.two_phase or mech.block_size < 2:
        raise ValueError(f"model.residual of {name!r}: the floor models two-phase block reads (two_phase=True, "
                         f"block_size >= 2); got two_phase={model.residual.two_phase}, "
                         f"block_size={mech.block_size}")
    size = {"bfloat16": 2, "float16": 2, "float32": 4}
    return ReadShape(batch=config.train.batch_size, t_len=config.seq_len, d=model.d_model,
                     n_sublayers=2 * model.n_layers, block_size=mech.block_size, streams=len(kernels),
                     act_bytes=size[model.dtype], state_bytes=size[config_lib.state_dtype(model)],
                     save_read_outputs=bool(model.get("save_read_outputs", False)))


def unit_bytes(v: int, s: int, m: int, a: int, f: int, save_read_outputs: bool = False,
               factored_cotangent: bool = False) -> dict:
    """Bytes per ``E`` of one unit (``v`` valid sources, ``s`` targets), by pass."""
    phase1 = v * a + s * m * f
    fwd = phase1 + s * (m * f + 2 * a)
    rerun = phase1 + s * a if save_read_outputs else fwd
    if factored_cotangent:  # no d_state written; phase 1 reads the states, each target's dh and partial
        bwd = s * (3 * a + m * f) + (2 * v * a + s * m * f + 2 * s * a)
    else:
        bwd = s * (3 * a + 2 * m * f) + (2 * v * a + s * m * f)
    return {"forward": fwd, "recompute": rerun, "backward": bwd}


def step_bytes(shape: ReadShape, state_bytes: int | None = None, factored_cotangent: bool = False) -> dict:
    """Bytes per step of the depth reads, by pass and in total (``state_bytes``: default the
    config's; ``factored_cotangent``: the unbuilt design of the module docstring)."""
    state_bytes = shape.state_bytes if state_bytes is None else state_bytes
    elems = shape.batch * shape.t_len * shape.d
    out = {"forward": 0, "recompute": 0, "backward": 0}
    for u, first in enumerate(range(0, shape.n_sublayers, shape.block_size)):
        s = min(shape.block_size, shape.n_sublayers - first)
        for k, b in unit_bytes(1 + u, s, shape.streams, shape.act_bytes, state_bytes, shape.save_read_outputs,
                               factored_cotangent).items():
            out[k] += b * elems
    out["total"] = sum(out.values())
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="config specs, e.g. configs/msar.py:size=base")
    ap.add_argument("--bandwidth", default="3.16,4.8",
                    help="TB/s, comma-separated (default: the H200's measured copy bandwidth of BENCHMARKS.md, "
                         "kernels, and its 4.8 TB/s datasheet peak)")
    ap.add_argument("--vanilla_ms", type=float, default=None, help="a measured Vanilla step (ms) for the ratio")
    ap.add_argument("--state_bytes", type=int, default=None, choices=(2, 4),
                    help="bytes per phase-1 state value (default: the config's model.residual.state_dtype)")
    ap.add_argument("--factored_cotangent", action="store_true",
                    help="the floor of phase 2 handing phase 1 its state cotangent factored (not built)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)
    try:
        bandwidths = [float(b) for b in args.bandwidth.split(",")]
    except ValueError:
        ap.error(f"--bandwidth={args.bandwidth!r}: expected comma-separated numbers (TB/s)")
    if not bandwidths or any(b <= 0 for b in bandwidths):
        ap.error(f"--bandwidth={args.bandwidth!r}: every bandwidth must be > 0")
    if args.vanilla_ms is not None and args.vanilla_ms <= 0:
        ap.error(f"--vanilla_ms={args.vanilla_ms}: must be > 0")
    overrides = parse_overrides(args.set)
    head = "| config | B x T, d | sublayers / S | m | GB fwd / re-run / bwd | GB total |"
    head += "".join(f" floor ms @ {b:g} TB/s |" for b in bandwidths)
    if args.vanilla_ms:
        head += "".join(f" / Vanilla @ {b:g} |" for b in bandwidths)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for spec in args.configs:
        shape = read_shape(load_config(spec, overrides))
        b = step_bytes(shape, args.state_bytes, args.factored_cotangent)
        floors = [b["total"] / (bw * 1e12) * 1e3 for bw in bandwidths]
        row = (f"| {spec} | {shape.batch} x {shape.t_len}, {shape.d} | {shape.n_sublayers} / {shape.block_size} | "
               f"{shape.streams} | {b['forward'] / 1e9:.1f} / {b['recompute'] / 1e9:.1f} / {b['backward'] / 1e9:.1f} | "
               f"{b['total'] / 1e9:.1f} |" + "".join(f" {x:.1f} |" for x in floors))
        if args.vanilla_ms:
            row += "".join(f" {(args.vanilla_ms + x) / args.vanilla_ms:.3f} |" for x in floors)
        print(row)


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
