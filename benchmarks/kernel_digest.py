"""A digest of the GPU kernels the depth reads lower to (sm_90: H100, H200), made on this machine.

Proves without a GPU that a refactor of ``pallas_kernels`` changes no kernel: each case below is
lowered for CUDA on the CPU (no plugin needed: lowering stops before XLA compiles) and every
Triton and Mosaic GPU custom call is recorded with its kernel (the serialized module re-printed
without source locations, so moving code does not change it, and without the per-process counter
Mosaic GPU puts in its dump name, so tests lowered before do not), its launch parameters and its
operand and result types. The cases: the bench's reads (``benchmarks/reads.py``'s table: phase 1
and phase 2 with the gate, forward + backward, at the bench shape) and the `base` train step of
MSAR, AttnRes and MHAR with ``model.residual.implementation=auto``.

    python benchmarks/kernel_digest.py --check   # against the stored digest
    python benchmarks/kernel_digest.py --write   # after an intended change, timed on a GPU

The stored digest is ``tests/kernels/kernel_digest.json``; ``tests/kernels/test_kernel_digest.py``
checks it (slow suite).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DIGEST = REPO / "tests" / "kernels" / "kernel_digest.json"
KERNEL_TARGETS = ("mosaic_gpu_v2", "__gpu$xla.gpu.triton")
READS = ("msar", "attnres", "mhar")
STEP_CONFIGS = ("configs/msar.py:size=base", "configs/attnres.py:size=base", "configs/mhar.py:size=base")


def _ops(op):
    """Every operation nested in ``op`` (regions, blocks), depth first, in program order."""
    for region in op.regions:
        for block in region:
            for inner in block:
                yield inner
                yield from _ops(inner)


def _kernel_text(data: bytes, target: str) -> str:
    """The kernel module serialized in a custom call, printed without debug locations."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    ctx = mlir.make_ir_context()
    if target == "mosaic_gpu_v2":
        from jax.experimental.mosaic.gpu import dialect as mgpu_dialect

        mgpu_dialect.register_dialect(ctx)
    else:
        from jax._src.lib.triton import dialect as tt_dialect

        tt_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    with ctx:
        text = ir.Module.parse(data).operation.get_asm(enable_debug_info=False)
    # Mosaic GPU names each kernel's dump file with a counter of the kernels lowered so far in the
    # process, which depends on what ran before (the slow suite lowers others first)
    return _DUMP_COUNTER.sub(r'\1"', text)


_DUMP_COUNTER = re.compile(r'(mosaic_gpu\.dump_basename = "[^"]*?)_\d+"')


def kernel_calls(module) -> list[dict]:
    """The Triton and Mosaic GPU custom calls of a lowered StableHLO ``module``, in program order."""
    from jax._src.lib.mlir import ir

    calls = []
    for op in _ops(module.operation):
        if op.name != "stablehlo.custom_call":
            continue
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if target not in KERNEL_TARGETS:
            continue
        attrs = {a.name: a.attr for a in (op.attributes[i] for i in range(len(op.attributes)))}
        config = next(ir.DictAttr(attrs[k]) for k in ("mhlo.backend_config", "backend_config")
                      if k in attrs and isinstance(attrs[k], ir.DictAttr))
        blob = "module" if target == "mosaic_gpu_v2" else "ir"
        # the call's own attributes (aliases, layouts) and the launch parameters of its config
        params = {k: str(v) for k, v in attrs.items()
                  if k not in ("call_target_name", "backend_config", "mhlo.backend_config")}
        for i in range(len(config)):
            named = config[i]
            if named.name in (blob, "kernel_hash"):  # the hash covers source locations
                continue
            params[named.name] = str(named.attr)
        text = _kernel_text(ir.StringAttr(config[blob]).value_bytes, target)
        calls.append({
            "target": target,
            "kernel": hashlib.sha256(text.encode()).hexdigest()[:20],
            "params": params,
            "operands": [str(v.type) for v in op.operands],
            "results": [str(r.type) for r in op.results],
        })
    return calls


def bench_cases():
    """``name -> (jitted fn, args)``: the bench's main-table reads, forward + backward."""
    import functools

    import jax
    import jax.numpy as jnp

    from benchmarks import reads as bench

    shape = bench.BENCH_SHAPE
    for read in READS:
        _, kernels, heads = bench.TABLE_CONFIGS[read]
        sources, banks, queries, partial, bank, query, gate = jax.eval_shape(
            functools.partial(bench.make_inputs, **shape, kernels=kernels, heads=heads, dtype=jnp.bfloat16))
        gate = gate if len(kernels) > 1 else None
        p1_form = bench.model_p1_form(kernels)
        channel = p1_form == "value_channel"
        opts = {"backward": "pallas"}
        r1 = bench.read_op(1, "pallas_gpu", kernels=kernels, heads=heads, opts=opts, p1_form=p1_form)
        r2 = bench.read_op(2, "pallas_gpu", kernels=kernels, heads=heads, opts=opts, p1_form=p1_form,
                           out_dtype=jnp.bfloat16)
        a1 = (sources, banks, queries)
        state = jax.eval_shape(lambda *a: jax.tree.map(lambda x: x[1], bench.read_op(1, "xla", kernels=kernels,
                                                                                     heads=heads)(*a)), *a1)
        a2, args2 = bench.phase2_inputs(state, partial, bank, query, gate, p1_form)
        p1_args = (0, 1, 2) if banks is not None else (0, 2)
        ct1 = jax.eval_shape(lambda *a: bench.cotangent(r1, a, "vjp", has_aux=channel), *a1)
        ct2 = jax.eval_shape(lambda *a: bench.cotangent(r2, a, "vjp"), *a2)
        yield f"bench/{read}/phase1", bench.fwd_bwd(r1, p1_args, "vjp", has_aux=channel), (*a1, ct1)
        yield f"bench/{read}/phase2", bench.fwd_bwd(r2, args2, "vjp"), (*a2, ct2)


def step_cases(devices):
    """``name -> (jitted train step, abstract args)``: the `base` steps on one H200."""
    import jax

    from msar_jax.config import load_config
    from msar_jax.parallel import mesh as mesh_lib
    from msar_jax.parallel import pipeline as pipeline_lib
    from msar_jax.train import step as step_lib
    from msar_jax.train.optim import make_optimizer

    for spec in STEP_CONFIGS:
        config = load_config(spec, {"model.residual.implementation": "auto"})
        pcfg = mesh_lib.parallel_config()
        mesh = mesh_lib.make_mesh(pcfg.mesh, devices)
        rules = mesh_lib.rules_for(pcfg)
        tx, schedule = make_optimizer(config.optim, config.train.steps)
        model_def, abstract_params = step_lib.abstract_model(config.model)
        abstract = jax.eval_shape(lambda p: step_lib.init_state(p, tx), abstract_params)
        batch = jax.ShapeDtypeStruct((config.train.batch_size, config.seq_len + 1), jax.numpy.int32)
        step = jax.jit(pipeline_lib.train_step_fn(model_def, tx, schedule, pcfg, mesh, config.model))
        yield f"step/{spec}", step, (abstract, batch), (mesh, rules)


def digest() -> dict:
    """``case -> kernel calls`` for every case, lowered for CUDA on this machine."""
    import jax

    from jax._src.pallas.triton import gpu_info
    from msar_jax.parallel import mesh as mesh_lib
    from pallas_kernels.depth_attention import platform

    # Pallas' Triton lowering asks the local GPU for its compute capability: answer the H100's
    # and H200's sm_90 (Mosaic GPU assumes sm_90 when there is no GPU).
    gpu_info.get_gpu_info = lambda: types.SimpleNamespace(compute_capability=90)
    lower = lambda fn, args: fn.trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")  # noqa: E731
    out = {}
    with platform.target("gpu"):
        for name, fn, args in bench_cases():
            t0 = time.time()
            out[name] = kernel_calls(lower(fn, args))
            print(f"{name}: {len(out[name])} kernels ({time.time() - t0:.0f} s)", flush=True)
        for name, fn, args, (mesh, rules) in step_cases(jax.devices()[:1]):
            t0 = time.time()
            with mesh_lib.use_mesh(mesh, rules):
                out[name] = kernel_calls(lower(fn, args))
            print(f"{name}: {len(out[name])} kernels ({time.time() - t0:.0f} s)", flush=True)
    return out


def compare(stored: dict, new: dict) -> list[str]:
    """One line per difference between two digests (empty: identical)."""
    lines = []
    for name in sorted(set(stored) | set(new)):
        a, b = stored.get(name), new.get(name)
        if a is None or b is None:
            lines.append(f"{name}: only in the {'new' if a is None else 'stored'} digest")
        elif len(a) != len(b):
            lines.append(f"{name}: {len(a)} kernels stored, {len(b)} now")
        else:
            for i, (x, y) in enumerate(zip(a, b)):
                for field in x:
                    if x[field] != y.get(field):
                        lines.append(f"{name} kernel {i} ({x['target']}): {field} differs: {x[field]} -> {y.get(field)}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare with the stored digest; exit 1 on a difference")
    mode.add_argument("--write", action="store_true", help="store the digest")
    ap.add_argument("--digest", type=Path, default=DIGEST)
    args = ap.parse_args(argv)
    new = digest()
    if args.write:
        args.digest.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.digest} ({sum(map(len, new.values()))} kernels in {len(new)} cases)")
        return 0
    diff = compare(json.loads(args.digest.read_text()), new)
    for line in diff:
        print(line)
    print("identical" if not diff else f"{len(diff)} differences")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
