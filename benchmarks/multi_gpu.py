"""Multi-GPU layouts of one config: data parallel, FSDP and the N-stage pipeline (BENCHMARKS.md, multi-GPU layouts).

Trains the same model from the same init on the same batches under each layout (``single``,
``accum``, ``dp<N>``, ``fsdp<N>``, ``pp<N>_gpipe``, ``pp<N>_circular``, ``pp<N>_circular_cache``) and
reports the median step time, tokens/s, scaling efficiency, the loss after N steps and, for
pipelines, the bytes per hop and a bubble estimate::

    python benchmarks/multi_gpu.py --config=configs/msar.py:size=small --steps=30 \
        --layouts=single,dp2,fsdp2,pp2_gpipe,pp2_circular,pp2_circular_cache --json=out.json

CPU smoke run (2 fake devices)::

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
    python benchmarks/multi_gpu.py --config=configs/msar.py:smoke=1 --override=model.n_layers=4 \
        --batch_size=4 --microbatches=2 --steps=2 --skip=1 --fast_compile

Layouts and method: docs/methods.md §6.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msar_jax.config import load_config, parse_overrides  # noqa: E402

from msar_jax.cli import run_cli
from msar_jax.parallel import layout as layout_lib  # noqa: E402
from msar_jax.parallel import mesh as mesh_lib  # noqa: E402
from msar_jax.parallel import pipeline as pl  # noqa: E402
from msar_jax.train import step as step_lib  # noqa: E402
from msar_jax.train.optim import make_optimizer  # noqa: E402

ALL_LAYOUTS = ("single", "accum", "dp2", "fsdp2", "pp2_gpipe", "pp2_circular", "pp2_circular_cache")
PIPELINE_KINDS = ("gpipe", "circular", "circular_cache")
LAYOUT_RULE = ("'single', 'accum', 'dp<N>', 'fsdp<N>' or 'pp<N>_<kind>' with N >= 2 devices and kind one of "
               + ", ".join(PIPELINE_KINDS) + " (e.g. pp4_circular_cache: 4 stages)")


def layout_config(name: str, microbatches: int, repeats: int):
    """(parallel config, number of devices) of a layout name: ``single``, ``dp<N>``,
    ``fsdp<N>``, ``pp<N>_gpipe``, ``pp<N>_circular`` (R = ``repeats``, no cache) or
    ``pp<N>_circular_cache``."""
    pcfg = mesh_lib.parallel_config()
    ones = dict(data=1, stage=1, fsdp=1, tensor=1)
    match = re.fullmatch(r"(single|accum)|(dp|fsdp)(\d+)|pp(\d+)_(\w+)", name)
    if match is None or (match.group(5) is not None and match.group(5) not in PIPELINE_KINDS):
        raise ValueError(f"unknown layout {name!r}: must be {LAYOUT_RULE}")
    if match.group(1):
        pcfg.mesh.update(ones)
        return pcfg, 1
    n = int(match.group(3) or match.group(4))
    if n < 2:
        raise ValueError(f"layout {name!r}: N = {n}; must be {LAYOUT_RULE}")
    if match.group(2):
        pcfg.mesh.update(dict(ones, **{"data" if match.group(2) == "dp" else "fsdp": n}))
        return pcfg, n
    kind = match.group(5)
    pcfg.mesh.update(dict(ones, stage=n))
    pcfg.pipeline.update(dict(stages=n, microbatches=microbatches,
                              repeats=1 if kind == "gpipe" else repeats, cache=kind == "circular_cache"))
    return pcfg, n


def use_reference_read() -> None:
    """Route the XLA path's ``phase1``/``depth_read`` to the vectorised reference instead of
    ``xla_streaming`` (``--read=reference``), for comparing the two reads in every layout."""
    from pallas_kernels.depth_attention import api

    api.xla_streaming = api.reference


def run_layout(name: str, config, batches: list, args) -> dict:
    pcfg, n_dev = layout_config(name, args.microbatches, args.repeats)
    if len(jax.devices()) < n_dev:
        raise RuntimeError(f"layout {name} needs {n_dev} devices, have {len(jax.devices())}")
    model_cfg = config.model
    B, T1 = batches[0].shape
    # The training loop's layout (msar_jax.parallel.layout): mesh, checks, sharded state and step.
    grad_accum = args.microbatches if name == "accum" else 1
    layout = layout_lib.make_layout(pcfg, model_cfg, B, devices=jax.devices()[:n_dev], grad_accum=grad_accum)
    mesh = layout.mesh
    tx, schedule = make_optimizer(config.optim, config.train.steps)
    model_def, state, ssh = layout.init_state(model_cfg, tx, args.seed)
    step = layout.train_step(model_def, tx, schedule, model_cfg, ssh, grad_accum=grad_accum)
    global_batches = [layout.global_batch(b) for b in batches]

    t0 = time.perf_counter()
    with layout.context():
        lowered = step.lower(state, global_batches[0])
        compiled = lowered.compile(step_lib.FAST_COMPILE if args.fast_compile else None)
    compile_s = time.perf_counter() - t0

    row = {"layout": name, "devices": n_dev, "mesh": dict(mesh.shape), "pipeline": dict(pcfg.pipeline),
           "grad_accum": grad_accum, "batch_size": B, "seq_len": T1 - 1, "compile_s": round(compile_s, 2)}
    if pcfg.pipeline.stages > 1:
        plan = pl.make_plan(pcfg, model_cfg)
        hops = pl.hlo_hop_bytes(compiled.as_text())
        low = pl.lowered_hop_bytes(lowered.as_text())
        mb_tokens = (B // plan.microbatches) * (T1 - 1)
        row.update(hlo_hop_bytes=hops, lowered_hop_bytes=low,
                   hop_bytes=max(hops) if hops else 0,
                   hop_bytes_per_token=(max(hops) / mb_tokens if hops else 0.0),
                   caching=plan.caching, iterations=plan.iterations,
                   bubble_theory=(plan.stages - 1) / (plan.repeats * plan.microbatches + plan.stages - 1))
    mem = compiled.memory_analysis()
    if mem is not None:
        row["peak_estimate_bytes"] = int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                                         - mem.alias_size_in_bytes + mem.temp_size_in_bytes)

    if args.compile_only:
        return row
    times, losses = [], []
    for gb in global_batches:
        t0 = time.perf_counter()
        state, metrics = compiled(state, gb)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
        losses.append(float(metrics["loss"]))
    timed = times[args.skip:]
    median = statistics.median(timed)
    row.update(step_times_s=[round(t, 6) for t in times], losses=losses, median_step_s=median,
               tokens_per_s=B * (T1 - 1) / median, final_loss=losses[-1], steps_timed=len(timed))
    del state, compiled
    return row


def summarise(rows: list[dict]) -> None:
    single = next((r for r in rows if r["layout"] == "single"), None)
    accum = next((r for r in rows if r["layout"] == "accum"), None)
    for r in rows:
        if single is None or "median_step_s" not in r or "median_step_s" not in single:
            continue
        r["speedup"] = single["median_step_s"] / r["median_step_s"]
        r["scaling_efficiency"] = r["speedup"] / r["devices"]
        r["loss_delta_vs_single"] = r["final_loss"] - single["final_loss"]
        if "bubble_theory" in r:
            stages = r["pipeline"]["stages"]
            r["bubble_measured_upper"] = 1.0 - (single["median_step_s"] / stages) / r["median_step_s"]
            if accum is not None and "median_step_s" in accum:  # against the same microbatch size
                r["bubble_measured_vs_accum"] = 1.0 - (accum["median_step_s"] / stages) / r["median_step_s"]


def table(rows: list[dict]) -> str:
    f = lambda x, fmt: "n/a" if x is None else format(x, fmt)  # noqa: E731
    out = ["| layout | devices | median step (ms) | tokens/s | speedup | scaling eff. | final loss | "
           "loss - single | bubble theory | bubble measured (upper) | bubble vs accum | hop bytes (HLO, max) | "
           "hop B/token | compile (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pp = "bubble_theory" in r
        if "median_step_s" not in r:  # --compile_only
            out.append(f"| {r['layout']} | {r['devices']} | - | - | - | - | - | - | "
                       f"{f(r.get('bubble_theory') if pp else None, '.3f')} | - | - | "
                       f"{f(r.get('hop_bytes') if pp else None, ',d')} | "
                       f"{f(r.get('hop_bytes_per_token') if pp else None, ',.0f')} | {r['compile_s']:.1f} |")
            continue
        out.append(
            f"| {r['layout']} | {r['devices']} | {1e3 * r['median_step_s']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{f(r.get('speedup'), '.2f')} | {f(r.get('scaling_efficiency'), '.1%')} | {r['final_loss']:.4f} | "
            f"{f(r.get('loss_delta_vs_single'), '+.4f')} | {f(r.get('bubble_theory') if pp else None, '.3f')} | "
            f"{f(r.get('bubble_measured_upper') if pp else None, '.3f')} | "
            f"{f(r.get('bubble_measured_vs_accum') if pp else None, '.3f')} | "
            f"{f(r.get('hop_bytes') if pp else None, ',d')} | {f(r.get('hop_bytes_per_token') if pp else None, ',.0f')} | "
            f"{r['compile_s']:.1f} |")
    return "\n".join(out)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/msar.py:size=small")
    ap.add_argument("--layouts", default=",".join(ALL_LAYOUTS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the median (warm-up)")
    ap.add_argument("--batch_size", type=int, default=None, help="global batch (default: the config's)")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="virtual stages per device of the circular layouts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data_seed", type=int, default=1)
    ap.add_argument("--override", action="append", default=[], help="key=value config override (repeatable)")
    ap.add_argument("--compile_only", action="store_true",
                    help="lower and compile each layout (hop bytes, memory) without training")
    ap.add_argument("--fast_compile", action="store_true", help="XLA CPU fast-compile options (tests)")
    ap.add_argument("--read", choices=("reference", "default"), default="default",
                    help="XLA depth read: 'reference' (vectorised) or 'default' (the api's dispatch: the "
                         "streaming scan on CPU, the Pallas kernels where the platform has them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.read == "reference":
        use_reference_read()
    if args.steps <= args.skip and not args.compile_only:
        ap.error(f"--steps ({args.steps}) must exceed --skip ({args.skip})")

    overrides = {"train.steps": args.steps, **parse_overrides(args.override)}
    config = load_config(args.config, overrides)
    config.optim.warmup_steps = min(config.optim.warmup_steps, args.steps)  # as gpu_train_baseline.py
    B = args.batch_size or config.train.batch_size
    T = config.seq_len
    rng = np.random.default_rng(args.data_seed)
    batches = [rng.integers(0, config.model.vocab_size, (B, T + 1), dtype=np.int32) for _ in range(args.steps)]

    devices = jax.devices()
    print(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); config {args.config}; "
          f"batch {B} x {T}; steps {args.steps} (median of {args.steps - args.skip}); "
          f"microbatches {args.microbatches}, repeats {args.repeats}", flush=True)
    rows = []
    for name in args.layouts.split(","):
        try:
            rows.append(run_layout(name, config, batches, args))
            brief = {k: v for k, v in rows[-1].items() if k not in ("step_times_s", "losses")}
            print(json.dumps(brief), flush=True)
        except Exception as e:  # record and go on: one failing layout must not lose the others
            print(json.dumps({"layout": name, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
    summarise(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print()
    print(table(rows))
    return rows


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
