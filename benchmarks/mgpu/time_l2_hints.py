"""Phase 1's mixing pass, ``gdots`` and ``dstreams`` with L2 eviction hints on their TMA copies
(``l2_hints.hinted``), against the same kernels without, in one process.

Each hint set is a comma-separated list of ``rule=policy`` (``l2_hints.RULES`` and ``POLICIES``;
``none`` for no hints). For each set the kernels are built again (the module caches and JAX's
cleared), checked bitwise against the first set's outputs (hints change no arithmetic), and timed
(``bench.timeit``: median of 21 timings of 3 calls; ``ncu_phase1.random_inputs``) at `base`'s last block (7 sources of which 4
valid, B x T = 64 x 1024, d = 1024) and the bench shape (9 valid, 8 x 2048, d = 2048); S = 8,
kernels (0, 4, 8, 12), bf16 sources, float32 state and ``g_A``. Run on the GPU::

    python benchmarks/mgpu/time_l2_hints.py none stores=evict_first,large_f32_loads=evict_first none

``--interpret``: the same on the CPU in Mosaic GPU interpret mode at a tiny shape, untimed (the
hints then lower to nothing: a smoke test of the script).
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import l2_hints  # this folder, on the path when run as a script
from ncu_phase1 import KERNELS, random_inputs
from pallas_kernels.depth_attention import bench, mosaic_gpu, mosaic_gpu_bwd1


def parse_set(text: str) -> dict:
    if text == "none":
        return {}
    rules = {}
    for item in text.split(","):
        rule, sep, policy = item.partition("=")
        if not sep or rule not in l2_hints.RULES or policy not in l2_hints.POLICIES:
            sys.exit(f"hint set {text!r}: {item!r} must be RULE=POLICY, rules {l2_hints.RULES}, "
                     f"policies {l2_hints.POLICIES}")
        rules[rule] = policy
    return rules


def main(argv: list[str]) -> None:
    interpret = "--interpret" in argv
    sets = [a for a in argv if not a.startswith("--")] or ["none"]
    rules = [parse_set(s) for s in sets]
    shapes = ((("tiny", (3, 2, 1, 70, 64, 2)),) if interpret else
              (("base", (7, 4, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8))))
    if not interpret:
        print(f"copy bandwidth {bench.copy_bandwidth() / 1e12:.2f} TB/s", flush=True)
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes:
        heads = 1
        sources, banks, queries, valid, p, g_acc, dsr, w = (
            random_inputs(n, n_live, batch, t_len, d, n_targets, heads)[name]
            for name in ("sources", "banks", "queries", "valid", "p", "g_acc", "dsr", "w"))
        kw = dict(stream_kernels=KERNELS, heads=heads, interpret=interpret)
        calls = {
            "mix": (lambda x, b, pp, v: mosaic_gpu.phase1_mix(x, b, pp, None, v, per_target=True, **kw),
                    (sources, banks, p, valid)),
            "gdots": (lambda x, b, ga, v: mosaic_gpu_bwd1.phase1_gdots(x, b, ga, None, v, **kw),
                      (sources, banks, g_acc, valid)),
            "dstreams": (lambda x, b, q, ga, pp, ds, ww, v: mosaic_gpu_bwd1.phase1_dstreams(
                x, b, q, ga, pp, ds, ww, None, v, out_dtype=jnp.bfloat16, **kw)[:n_live],
                (sources, banks, queries, g_acc, p, dsr, w, valid)),
        }
        print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}",
              flush=True)
        first = {}
        for text, hint in zip(sets, rules):
            jax.clear_caches()
            mosaic_gpu_bwd1._kernel.cache_clear()
            mosaic_gpu._mix_kernel.cache_clear()
            with l2_hints.hinted(hint):
                for kernel, (fn, args) in calls.items():
                    f = jax.jit(fn)
                    out = jax.block_until_ready(f(*args))  # compiled (and lowered with the hints) here
                    same = kernel not in first or all(
                        bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(first[kernel])))
                    first.setdefault(kernel, out)
                    ms = float("nan") if interpret else bench.timeit(f, *args, reps=21, inner=3)[0] * 1e3
                    print(f"{kernel:9s} {text:70s} {ms:8.3f} ms  same bits: {same}", flush=True)
                    del out


if __name__ == "__main__":
    main(sys.argv[1:])
