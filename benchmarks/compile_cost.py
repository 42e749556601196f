"""What a config's train step costs to compile: StableHLO ops, lowering and XLA compile time.

The test suite is compile-bound (each test builds a small model and compiles its step once), so
this is the number to watch when a change adds ops to the plain-jnp path. For each config spec it
lowers the training step (``msar_jax.train.step.make_train_step``) ``--repeats`` times after
``jax.clear_caches()``, counts the StableHLO ops of the lowered module by kind, and compiles it
(with the tests' fast XLA:CPU options unless ``--full_opt``). Prints the best of the repeats.

Usage::

    python benchmarks/compile_cost.py configs/msar.py:smoke=1 configs/vanilla.py:smoke=1 [--repeats 3]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from msar_jax.config import load_config, parse_overrides  # noqa: E402

from msar_jax.cli import run_cli
from msar_jax.train import optim, step, validate  # noqa: E402

_OP = re.compile(r"= ([a-z_]+\.[a-z_]+)")


def count_ops(module_text: str) -> collections.Counter:
    """StableHLO (and chlo / func) ops of a lowered module's text, by name."""
    return collections.Counter(_OP.findall(module_text))


def measure(spec: str, overrides: dict, repeats: int, full_opt: bool, compile: bool = True) -> dict:
    """Ops and the best lowering / compile time of ``spec``'s train step (``compile=False``:
    lower only; ``compile_s`` is then None)."""
    config = validate(load_config(spec, overrides))
    tx, schedule = optim.make_optimizer(config.optim, config.train.steps)
    model_def, params = step.init_model(config.model, 0)
    old = step.COMPILER_OPTIONS
    step.COMPILER_OPTIONS = step.COMPILER_OPTIONS if full_opt else step.FAST_COMPILE
    try:
        train_step = step.make_train_step(model_def, tx, schedule)
        batch = np.zeros((config.train.batch_size, config.seq_len + 1), np.int32)
        state = step.init_state(params, tx)
        lower_s, compile_s = [], []
        for _ in range(repeats):
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered = train_step.lower(state, batch)
            lower_s.append(time.perf_counter() - t0)
            if compile:
                t0 = time.perf_counter()
                lowered.compile()
                compile_s.append(time.perf_counter() - t0)
    finally:
        step.COMPILER_OPTIONS = old
    ops = count_ops(lowered.as_text())
    return dict(config=spec, ops=sum(ops.values()), top=ops.most_common(5), lower_s=min(lower_s),
                compile_s=min(compile_s) if compile else None)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="config specs, e.g. configs/msar.py:smoke=1")
    ap.add_argument("--repeats", type=int, default=3, help="lower and compile this many times; the best counts")
    ap.add_argument("--full_opt", action="store_true", help="XLA's default optimisation passes (the tests turn them off)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats={args.repeats}: must be >= 1")
    overrides = parse_overrides(args.set)
    print("| config | StableHLO ops | lower (s) | compile (s) | most common ops |")
    print("|---|---|---|---|---|")
    rows = []
    for spec in args.configs:
        row = measure(spec, overrides, args.repeats, args.full_opt)
        top = ", ".join(f"{name} {n}" for name, n in row["top"])
        print(f"| {spec} | {row['ops']} | {row['lower_s']:.1f} | {row['compile_s']:.1f} | {top} |", flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
