"""Peak temporary memory of one training step versus depth (BENCHMARKS.md, memory against depth).

Compiles ``value_and_grad`` of the LM loss on CPU for Vanilla, Block AttnRes, Block
MSAR and Full MSAR at d = 256, T = 256 and L in {8, 16, 32, 64} sublayers, and reads
``compiled.memory_analysis().temp_size_in_bytes`` (nothing is executed). Targets: MSAR
Block temporary memory grows linearly in L, and is at most 1.3x Vanilla at L = 32.

    python benchmarks/bench_memory.py [--depths 8,16,32,64] [--batch 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx

from msar_jax import config as config_lib
from msar_jax.model.transformer import Transformer, lm_loss

VARIANTS = {
    "vanilla": dict(name="vanilla"),
    "attnres_block": dict(name="attnres", block_size=4),
    "msar_block": dict(name="msar", block_size=4),
    "msar_full": dict(name="msar", block_size=1),
}


def model_cfg(variant: str, n_sublayers: int, d: int, seq_len: int, remat: str, read_chunks: int = 1):
    cfg = config_lib.model_config()
    cfg.update(dict(d_model=d, n_layers=n_sublayers // 2, n_heads=4, n_kv_heads=2, head_dim=d // 4,
                    mlp_dim=4 * d, vocab_size=256, max_seq_len=seq_len, remat_policy=remat))
    cfg.residual.update(VARIANTS[variant])
    cfg.residual.kernel_overrides.read_chunks = read_chunks
    return cfg


def step_memory(cfg, batch: int, seq_len: int) -> dict:
    abstract = nnx.eval_shape(lambda: Transformer(cfg, nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)

    def loss(p, tokens):
        return lm_loss(nnx.merge(graphdef, p), tokens)[0]

    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    mem = compiled.memory_analysis()
    return dict(
        temp_bytes=int(mem.temp_size_in_bytes),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        compile_s=time.perf_counter() - t0,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="8,16,32,64", help="sublayer counts L")
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--remat", default="none", help="remat policy inside a block (model.remat_policy)")
    ap.add_argument("--read_chunks", type=int, default=1, help="model.residual.kernel_overrides.read_chunks (XLA depth reads)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    variants = args.variants.split(",")
    rows = {}
    for L in depths:
        for v in variants:
            r = step_memory(model_cfg(v, L, args.d, args.seq_len, args.remat, args.read_chunks), args.batch, args.seq_len)
            rows[(v, L)] = r
            print(f"{v:>14} L={L:<3} temp={r['temp_bytes'] / 2**20:9.2f} MiB  (compile {r['compile_s']:.1f}s)", flush=True)
    print()
    print(f"Peak temporary memory (MiB) of one training step; d={args.d}, T={args.seq_len}, B={args.batch}, "
          f"float32, CPU, remat_policy={args.remat}, read_chunks={args.read_chunks}")
    print("| L | " + " | ".join(variants) + " | " + " | ".join(f"{v}/vanilla" for v in variants if v != "vanilla") + " |")
    print("|---" * (1 + 2 * len(variants) - 1) + "|")
    for L in depths:
        base = rows.get(("vanilla", L), {}).get("temp_bytes")
        cells = [f"{rows[(v, L)]['temp_bytes'] / 2**20:.1f}" for v in variants]
        ratios = [f"{rows[(v, L)]['temp_bytes'] / base:.2f}" if base else "-" for v in variants if v != "vanilla"]
        print(f"| {L} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{v}@{L}": r for (v, L), r in rows.items()}, f, indent=1)


if __name__ == "__main__":
    main()
