"""The benchmark's depth reads compiled for an H200 on this machine, GPU or not: what each holds in memory.

Builds each read exactly as ``benchmarks/reads.py`` times it (``reads.run_config``: phase 1
and phase 2 + stream fusion, forward + backward in the vjp form, per phase-1 form of
``reads.P1_FORMS``, and the plain-XLA reference), compiles it for an H200
without one (``msar_jax.deviceless_gpu``: XLA:GPU's own fusion, scheduling and buffer assignment), and prints
``memory_analysis()`` (temporaries, arguments, outputs) and the largest values XLA placed in the
temporary allocation and in the outputs, with the ops that define them. The bench run on an
H200 compiles the same temporaries for phase 1 at the bench shape: 0.094 GiB stacked and
2.270 GiB per target, which this reproduces.

Usage (needs JAX's CUDA plugin, ``msar_jax.deviceless_gpu``)::

    PYTHONPATH=.aot_site python benchmarks/mgpu/aot_reads.py [--configs msar,attnres,mhar]
        [--p1_forms per_target,stacked] [--base_shape] [--xla] [--top 3] [--query_grads_heads all_heads]
        [--set MODULE.CONSTANT=VALUE]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks, msar_jax, pallas_kernels

from msar_jax import deviceless_gpu  # noqa: E402  (imports no jax)

deviceless_gpu.prepare_gpu_environment()  # before jax starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks import reads as bench  # noqa: E402
from pallas_kernels.depth_attention import fused_bwd_phase1, platform, reference  # noqa: E402


def compile_report(name: str, fn, args, top: int) -> dict:
    """Compile ``fn(*args)`` (abstract ``args`` on the H200; traced under ``platform.target("gpu")``)
    and print its memory."""
    t0 = time.time()
    compiled, allocs = deviceless_gpu.compile_with_buffers(fn.lower(*args))
    mem = compiled.memory_analysis()
    names = deviceless_gpu.op_names(compiled.as_text())
    gib = lambda b: b / 2**30  # noqa: E731
    print(f"{name}: temp {gib(mem.temp_size_in_bytes):.3f} GiB, arguments {gib(mem.argument_size_in_bytes):.3f}, "
          f"outputs {gib(mem.output_size_in_bytes):.3f} (compiled in {time.time() - t0:.1f} s)", flush=True)
    for kind, pick in (("temporaries", lambda a: a.is_temp), ("outputs", lambda a: a.is_output)):
        values = sorted((v for a in allocs if pick(a) for v in a.values), key=lambda v: -v.size)[:top]
        for v in values:
            if v.size < 2**26:  # nothing under 64 MiB is worth a line
                break
            op = names.get(v.instruction, "")
            print(f"    {kind[:4]} {gib(v.size):7.3f} GiB  {v.shape.split('{')[0]:32s} {v.instruction}"
                  + (f"  <- ...{op[-90:]}" if op else ""), flush=True)
    return {"name": name, "temp_gib": gib(mem.temp_size_in_bytes)}


def set_constant(ap, item: str) -> None:
    """``--set MODULE.NAME=VALUE``: an existing upper-case constant of a module of
    ``pallas_kernels.depth_attention``."""
    key, sep, text = item.partition("=")
    module_name, _, name = key.rpartition(".")
    if not sep or not module_name or not name.isupper():
        ap.error(f"--set {item!r}: want MODULE.NAME=VALUE with NAME an upper-case constant")
    try:
        module = importlib.import_module(f"pallas_kernels.depth_attention.{module_name}")
    except ImportError:
        ap.error(f"--set {item!r}: no module pallas_kernels.depth_attention.{module_name}")
    if not hasattr(module, name):
        ap.error(f"--set {item!r}: {module_name} has no constant {name}")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = text
    setattr(module, name, value)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="msar,attnres,mhar", help=f"rows of {sorted(bench.TABLE_CONFIGS)}")
    ap.add_argument("--p1_forms", default="model,stacked", help=f"phase 1's forms, of {bench.P1_FORMS}")
    ap.add_argument("--base_shape", action="store_true", help="configs/*.py:size=base's shape, not the bench shape")
    ap.add_argument("--xla", action="store_true", help="also the plain-XLA reference (its phase 1 compiles slowly)")
    ap.add_argument("--top", type=int, default=3, help="values listed per allocation kind")
    ap.add_argument("--target", default="h200", help=f"one of {sorted(deviceless_gpu.GPU_TARGETS)}")
    ap.add_argument("--query_grads_heads", default=None, choices=fused_bwd_phase1.QUERY_GRADS_HEADS,
                    help="as the bench's flag: how phase 1's backward runs the query gradient's products")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant of pallas_kernels.depth_attention before tracing, e.g. "
                         "mosaic_gpu.phase2_inputs.INPUTS_SLOTS=2 (repeatable; VALUE a Python literal or a string)")
    args = ap.parse_args(argv)
    if args.query_grads_heads:  # read when the backward is traced
        fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS = args.query_grads_heads
    for item in args.set:
        set_constant(ap, item)
    configs = args.configs.split(",")
    forms = args.p1_forms.split(",")
    if any(c not in bench.TABLE_CONFIGS for c in configs):
        ap.error(f"--configs={args.configs!r}: each must be one of {sorted(bench.TABLE_CONFIGS)}")
    if any(f not in bench.P1_FORMS for f in forms):
        ap.error(f"--p1_forms={args.p1_forms!r}: each must be one of {bench.P1_FORMS}")
    mesh = deviceless_gpu.gpu_mesh(args.target)
    device = mesh.devices.flat[0]
    on = lambda tree: jax.tree.map(  # noqa: E731
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())), tree)
    shapes = bench.BASE_SHAPE if args.base_shape else bench.BENCH_SHAPE
    print(f"{device.device_kind} (deviceless), shapes {shapes}", flush=True)
    rows = []
    # everything traced for the GPU, the shape-only traces too: a jitted read traced once for the CPU
    # would come back from JAX's cache, CPU choices and all, when the compiled program traces it.
    # The abstract mesh tells Pallas' Triton lowering which GPU it lowers for.
    with platform.target("gpu"), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        for config in configs:
            rows += compile_config(config, forms, args, on, shapes)
    return rows


def compile_config(config, forms, args, on, shapes) -> list[dict]:
    """The reads of one row of ``bench.TABLE_CONFIGS``, compiled (``compile_report``)."""
    rows = []
    row_name, kernels, heads = bench.TABLE_CONFIGS[config]
    inputs = jax.eval_shape(lambda: bench.make_inputs(**shapes, kernels=kernels, heads=heads,
                                                      dtype=jnp.bfloat16))
    sources, banks, queries, partial, bank, query, gate = on(inputs)
    gate = gate if len(kernels) > 1 else None  # as run_config: one stream has no fusion gate
    a1, p1_args = (sources, banks, queries), ((0, 1, 2) if banks is not None else (0, 2))
    state = on(jax.eval_shape(lambda x, b, q: jax.tree.map(lambda a: a[1], reference.phase1(
        x, b, q, stream_kernels=kernels, heads=heads)), *a1))
    who_forms = [("xla", "stacked")] * args.xla + [
        ("pallas_gpu", bench.model_p1_form(kernels) if f == "model" else f) for f in forms]
    for who, form in who_forms:
        opts = None if who == "xla" else {"backward": "pallas"}
        channel = who != "xla" and form == "value_channel"
        r1 = bench.read_op(1, who, kernels=kernels, heads=heads, opts=opts, p1_form=form)
        ct1 = on(jax.eval_shape(lambda *a: bench.cotangent(r1, a, "vjp", has_aux=channel), *a1))
        g1 = bench.fwd_bwd(r1, p1_args, "vjp", has_aux=channel)
        rows.append(compile_report(f"{row_name} {who} phase 1 fwd+bwd ({form})", g1, (*a1, ct1), args.top))
        r2 = bench.read_op(2, who, kernels=kernels, heads=heads, out_dtype=jnp.bfloat16, opts=opts,
                           p1_form=form)
        argnums = {}

        def phase2_args(st, x, b, q, g, form=form):
            a2, argnums["p2"] = bench.phase2_inputs(st, x, b, q, g, form if who != "xla" else "stacked")
            return a2

        a2 = on(jax.eval_shape(phase2_args, state, partial, bank, query, gate))
        ct2 = on(jax.eval_shape(lambda *a: bench.cotangent(r2, a, "vjp"), *a2))
        g2 = bench.fwd_bwd(r2, argnums["p2"], "vjp")
        rows.append(compile_report(f"{row_name} {who} phase 2 fwd+bwd ({form})", g2, (*a2, ct2), args.top))
    return rows


if __name__ == "__main__":
    main()
