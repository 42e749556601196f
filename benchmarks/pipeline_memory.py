"""Temporary memory of the pipelined training gradient versus depth and microbatches (BENCHMARKS.md, pipeline memory).

Compiles ``value_and_grad`` of the pipelined LM loss (``msar_jax.parallel.pipeline``) on fake
CPU devices from abstract parameters (nothing is executed) and prints
``compiled.memory_analysis().temp_size_in_bytes`` per device for every (n_layers, microbatches)
pair. The model is ``configs/<mechanism>.py:smoke=1`` with the given depth, width and length,
fp32.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/pipeline_memory.py --mechanism=msar --layers=4,8,16 --microbatches=4,8 \\
        --stages=2 --repeats=2
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from msar_jax.config import load_config  # noqa: E402

from msar_jax.cli import run_cli
from msar_jax.model.transformer import Transformer  # noqa: E402
from msar_jax.parallel import mesh as mesh_lib  # noqa: E402
from msar_jax.parallel import pipeline as pl  # noqa: E402


def measure(mechanism, n_layers, stages, microbatches, repeats, cache, d, seq_len, rows, overrides=(), fast=False):
    ov = {"model.n_layers": n_layers, "model.d_model": d, "model.max_seq_len": seq_len, "model.dtype": "float32"}
    ov.update(dict(overrides))
    cfg = load_config(f"configs/{mechanism}.py:smoke=1,seq_len={seq_len}", ov)
    pcfg = mesh_lib.parallel_config()
    pcfg.pipeline.update(dict(stages=stages, microbatches=microbatches, repeats=repeats, cache=cache))
    pcfg.mesh.update(dict(data=1, stage=stages))
    mesh = mesh_lib.make_mesh(pcfg.mesh, jax.devices()[:stages])
    batch = rows * microbatches
    pl.validate(pcfg, cfg.model, batch, mesh)
    plan = pl.make_plan(pcfg, cfg.model)
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    loss = pl.pipelined_lm_loss(plan, mesh)
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    t0 = time.perf_counter()
    with mesh_lib.use_mesh(mesh, mesh_lib.PIPELINE_RULES):
        fn = jax.jit(jax.value_and_grad(lambda p, t: loss(nnx.merge(graphdef, p), t)[0]))
        opts = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True} if fast else None
        compiled = fn.lower(params, tokens).compile(opts)
    mem = compiled.memory_analysis()
    return dict(temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
                iterations=plan.iterations, window=plan.window, n_sources=plan.n_sources,
                compile_s=round(time.perf_counter() - t0, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mechanism", default="msar")
    ap.add_argument("--layers", default="4,8,16")
    ap.add_argument("--microbatches", default="4")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cache", type=int, default=1)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--rows", type=int, default=2, help="rows per microbatch")
    ap.add_argument("--block_size", type=int, default=None)
    ap.add_argument("--fast", action="store_true", help="FAST_COMPILE options (XLA:CPU opt level 0)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    overrides = {} if args.block_size is None else {"model.residual.block_size": args.block_size}
    out = {}
    print(f"{args.mechanism}: stages={args.stages} repeats={args.repeats} cache={args.cache} d={args.d} "
          f"T={args.seq_len} rows/microbatch={args.rows} fp32, CPU compile only")
    print("| n_layers | microbatches | iterations | temp MiB | compile s |")
    print("|---|---|---|---|---|")
    for L in (int(x) for x in args.layers.split(",")):
        for M in (int(x) for x in args.microbatches.split(",")):
            r = measure(args.mechanism, L, args.stages, M, args.repeats, bool(args.cache), args.d, args.seq_len,
                        args.rows, overrides, args.fast)
            out[f"L{L}_M{M}"] = r
            print(f"| {L} | {M} | {r['iterations']} | {r['temp_bytes'] / 2**20:.2f} | {r['compile_s']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
