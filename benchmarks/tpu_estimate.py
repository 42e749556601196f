"""An estimate of the MSAR depth-read kernels' time on TPU chips, from compiles on a CPU machine.

    make tpu-estimate
    PYTHONPATH=.tpu_site python benchmarks/tpu_estimate.py --json results/tpu_estimate.json

Nothing runs on a TPU. For each chip generation it compiles, with libtpu for one chip, the Mosaic
TPU kernels of the `base` MSAR read (``implementation="pallas_tpu"``, the backward
``heuristics.choose`` picks): phase 1 of a block (docs/design.md §5, Eq. 13-15) and phase 2 of a
sublayer with the gate (Eq. 16-17), each forward alone and forward + backward (the pullback of a
cotangent in the outputs' dtypes). A kernel's bytes are ``compiled.cost_analysis()["bytes
accessed"]`` of its module (the backward's: forward + backward less forward), which counts each
Mosaic call's operands and results once; the time is those bytes over the chip's datasheet HBM
bandwidth (``HBM_GBPS``), a floor, not a measurement: it ignores compute, the kernels' own
re-reads of a tile and the chip's achievable fraction of its peak. Figures are per `base` train
step (64 rows of 1024 tokens on one chip: 7 phase-1 and 56 phase-2 calls), beside the H100's
measured kernel time in that step (BENCHMARKS.md, "Train steps at `base`"). The compiles take
``ROWS`` rows; bytes scale linearly with the rows, as the kernels' grid runs over them.
Prints a markdown table; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.depth_attention import api, heuristics, reference  # noqa: E402

# Datasheet HBM bandwidth per chip, GB/s (cloud.google.com/tpu/docs: v5e, v5p, v6e system
# architecture pages).
HBM_GBPS = {"v5e": 819.0, "v5p": 2765.0, "v6e": 1638.0}
CHIPS = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}
# `base` MSAR (configs/common.py): d = 1024, 28 layers = 56 sublayers, S = 8 sublayers per block,
# so 7 blocks and n = 8 source slots (the embedding + 7 summaries); m = 4 streams, kernels (4, 8,
# 12) and the identity stream; T = 1024; bf16 sources, float32 phase-1 state.
D, N_SOURCES, N_TARGETS, STREAM_KERNELS, T_LEN = 1024, 8, 8, (0, 4, 8, 12), 1024
STEP_ROWS, ROWS = 64, 8
CALLS = {"phase 1": 7, "phase 2": 56}  # per step: one phase 1 per block, one phase 2 per sublayer
# H100, the `base` MSAR step's kernel table (BENCHMARKS.md): ms per step of each phase's kernels.
H100_STEP_MS = {("phase 1", "forward"): 21.4 + 62.8,  # scores + mix
                ("phase 1", "backward"): 30.9 + 36.2 + 24.8,  # gdots + dstreams + transpose
                ("phase 2", "forward"): 106.4,
                ("phase 2", "backward"): 81.1 + 63.5}  # state + inputs
KW = dict(stream_kernels=STREAM_KERNELS, heads=1, implementation="pallas_tpu", interpret=False)


def _phase1():
    m, k, bf16, f32 = len(STREAM_KERNELS), sum(STREAM_KERNELS), jnp.bfloat16, jnp.float32
    sds = jax.ShapeDtypeStruct
    config = heuristics.choose("phase1", stream_kernels=STREAM_KERNELS, implementation="pallas_tpu")
    args = (sds((N_SOURCES, ROWS, T_LEN, D), bf16), sds((N_SOURCES, k, D), f32), sds((N_TARGETS, m, D), f32),
            sds((N_SOURCES,), jnp.bool_))
    return (lambda x, bank, q, valid: api.phase1(x, bank, q, valid, per_target=True, config=config, **KW)), args, (0, 2)


def _phase2():
    m, k, bf16, f32 = len(STREAM_KERNELS), sum(STREAM_KERNELS), jnp.bfloat16, jnp.float32
    sds = jax.ShapeDtypeStruct
    config = heuristics.choose("phase2_fused", stream_kernels=STREAM_KERNELS, implementation="pallas_tpu")
    state = reference.SoftmaxState(sds((m, ROWS, T_LEN, 1), f32), sds((m, ROWS, T_LEN, 1), f32),
                                   sds((m, ROWS, T_LEN, D), f32))
    gate = (sds((m * D, m), f32), sds((), f32), sds((m,), f32))
    args = (state, sds((ROWS, T_LEN, D), bf16), sds((k, D), f32), sds((m, D), f32), gate)

    def fn(st, x, bank, q, g):
        return api.phase2_fused(st, x, bank, q, True, g, out_dtype=bf16, gate_eps=1e-6, config=config, **KW)

    return fn, args, (0, 1, 3)


def _with_backward(fn, argnums):
    """Forward + the pullback of ones in the outputs' dtypes (as the model's loss sends them)."""

    def fwd_bwd(*args):
        out, pullback = jax.vjp(lambda *diff: fn(*[diff[argnums.index(i)] if i in argnums else a
                                                  for i, a in enumerate(args)]), *[args[i] for i in argnums])
        return out, pullback(jax.tree.map(jnp.ones_like, out))

    return fwd_bwd


def bytes_accessed(fn, args, device) -> tuple[float, float]:
    """(``cost_analysis()["bytes accessed"]``, compile seconds) of ``fn`` compiled for ``device``."""
    mesh = jax.sharding.Mesh([device], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
    t0 = time.time()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(fn).trace(*args).lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["bytes accessed"]), time.time() - t0


def estimate(generations) -> list[dict]:
    """One row per (generation, phase, direction): bytes per step, ms per step, or the error."""
    from jax.experimental import topologies

    rows = []
    for gen in generations:
        device = topologies.get_topology_desc(CHIPS[gen], platform="tpu", chips_per_host_bounds=(1, 1, 1)).devices[0]
        for phase, build in (("phase 1", _phase1), ("phase 2", _phase2)):
            fn, args, argnums = build()
            scale = CALLS[phase] * STEP_ROWS / ROWS
            try:
                fwd, t_fwd = bytes_accessed(fn, args, device)
                both, t_both = bytes_accessed(_with_backward(fn, argnums), args, device)
            except Exception as e:  # noqa: BLE001 - a kernel that does not compile is a row too
                msg = " ".join(str(e).split())[:300]
                for direction in ("forward", "backward"):
                    rows.append(dict(generation=gen, phase=phase, direction=direction, error=f"{type(e).__name__}: {msg}"))
                print(f"{gen} {phase}: FAIL {type(e).__name__}: {msg}", file=sys.stderr, flush=True)
                continue
            for direction, nbytes, secs in (("forward", fwd, t_fwd), ("backward", both - fwd, t_both)):
                step_bytes = nbytes * scale
                rows.append(dict(generation=gen, phase=phase, direction=direction, bytes_per_call=nbytes,
                                 gb_per_step=step_bytes / 1e9, ms_per_step=step_bytes / (HBM_GBPS[gen] * 1e9) * 1e3,
                                 compile_s=round(secs, 1)))
            print(f"{gen} {phase}: compiled ({t_fwd:.1f} s + {t_both:.1f} s)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], generations) -> str:
    """Markdown: one line per phase and direction, GB and ms per step per generation, then the H100."""
    head = ["kernels", *[f"{g}: GB / ms per step" for g in generations], "H100 measured ms per step"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for phase in CALLS:
        for direction in ("forward", "backward"):
            cells = [f"{phase} {direction}"]
            for gen in generations:
                row = next(r for r in rows if (r["generation"], r["phase"], r["direction"]) == (gen, phase, direction))
                cells.append("does not compile" if "error" in row else f"{row['gb_per_step']:.1f} / {row['ms_per_step']:.1f}")
            cells.append(f"{H100_STEP_MS[(phase, direction)]:.1f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generations", default="v5e,v5p,v6e", help="comma-separated, of " + ", ".join(CHIPS))
    parser.add_argument("--json", default="", help="write the rows here")
    opts = parser.parse_args(argv)
    generations = [g for g in opts.generations.split(",") if g]
    unknown = [g for g in generations if g not in CHIPS]
    if unknown:
        parser.error(f"--generations: unknown {unknown}; known: {sorted(CHIPS)}")
    rows = estimate(generations)
    print(table(rows, generations))
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        meta = dict(date=datetime.date.today().isoformat(), jax=jax.__version__, shape=dict(
            d=D, sources=N_SOURCES, targets=N_TARGETS, stream_kernels=STREAM_KERNELS, t_len=T_LEN,
            step_rows=STEP_ROWS, compiled_rows=ROWS, calls_per_step=CALLS), hbm_gbps=HBM_GBPS)
        Path(opts.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
