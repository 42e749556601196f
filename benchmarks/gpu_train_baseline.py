"""Train a config for a fixed number of steps and report throughput and memory (GPU baselines).

The GPU baselines of BENCHMARKS.md's train-step table (XLA depth-attention path)::

    python benchmarks/gpu_train_baseline.py --steps 120 \
        configs/vanilla.py:size=small configs/attnres.py:size=small configs/msar.py:size=small

For each config: trains in a fresh workdir, then reports the median step time and tokens/s over
the steps after ``--skip`` (compile and warm-up excluded), the mean MFU over the same steps (from
``msar_jax.accounting`` FLOPs per token and the device's bf16 peak), the final training loss and
the device's peak memory (``memory_stats()['peak_bytes_in_use']``, where the backend reports it).
Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import jax

from msar_jax import accounting
from msar_jax.config import load_config, parse_overrides
from msar_jax.cli import run_cli
from msar_jax.train import train


def run(spec: str, steps: int, skip: int, workroot: Path, overrides: dict) -> dict:
    config = load_config(spec, {"train.steps": steps, "train.eval_every": 0, "train.eval_batches": 2,
                                "checkpoint.every": 0, **overrides})
    config.optim.warmup_steps = min(config.optim.warmup_steps, steps)
    workdir = workroot / spec.replace("/", "_").replace(":", "_").replace("=", "-")
    result = train(config, workdir, handle_signals=False)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if "step_time_s" in r and r.get("step", 0) > skip]
    step_times = [r["step_time_s"] for r in records]
    mfus = [r["mfu"] for r in records if r.get("mfu") is not None]
    tokens_per_step = config.train.batch_size * config.seq_len
    stats = jax.devices()[0].memory_stats() or {}
    acc = accounting.account(config)
    median = statistics.median(step_times) if step_times else float("nan")
    return {
        "config": spec,
        "params": acc["params"]["total"],
        "tokens_per_step": tokens_per_step,
        "median_step_s": median,
        "tokens_per_s": tokens_per_step / median,
        "mfu": statistics.mean(mfus) if mfus else None,
        "final_loss": result["final_loss"],
        "val_loss": result["val_loss"],
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "steps_timed": len(step_times),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--skip", type=int, default=20, help="steps excluded from the timing (compile, warm-up)")
    ap.add_argument("--workroot", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every config, e.g. model.residual.implementation=auto (repeatable)")
    args = ap.parse_args()
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        ap.error(str(e))
    workroot = Path(args.workroot or tempfile.mkdtemp(prefix="baseline_"))
    rows = []
    for spec in args.configs:
        rows.append(run(spec, args.steps, args.skip, workroot, overrides))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\ndevice: {jax.devices()[0].device_kind}; steps={args.steps}, timed steps {args.skip + 1}..{args.steps}")
    print("| config | params | tokens/step | median step (ms) | tokens/s | MFU | final train loss | peak memory (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] else "n/a"
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        print(f"| `{r['config']}` | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} | {1e3 * r['median_step_s']:.1f} | "
              f"{r['tokens_per_s']:,.0f} | {mfu} | {r['final_loss']:.3f} | {peak} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
