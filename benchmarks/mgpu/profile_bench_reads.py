"""Device time per op of the bench's reads (``pallas_kernels.depth_attention.bench``), as its main
table times them: phase 1 of a block and one phase-2 call, forward alone and forward + Pallas
backward in a form of ``bench.FB_FORMS`` (default: the outputs and the pullback of a cotangent
in their dtypes), at the bench shape (``--base_shape``: `base`'s) for AttnRes and MSAR.

Each function runs ``--calls`` times under ``jax.profiler`` after a warm-up; per op, its kind
from the compiled HLO (``pallas`` for a Triton or Mosaic GPU kernel, ``elementwise``, ``copy``,
``matmul``: ``profile_step.kind_of``) and its device time per call. The sum of the ops is busy
time, not a wall clock (it leaves out launch gaps). Run on the GPU:

    python benchmarks/mgpu/profile_bench_reads.py [--configs attnres,msar] [--form vjp]

CPU smoke (interpret mode, a tiny shape): ``--small``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile

if "xla_gpu_enable_command_buffer" not in os.environ.get("XLA_FLAGS", ""):  # profile_step.py says why
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from profile_step import device_op_events, kind_of, parse_hlo  # noqa: E402

CONFIGS = {"attnres": ((0,), 1), "msar": ((0, 4, 8, 12), 1), "mhar": ((0,), 8)}


def profile(fn, args, calls: int):
    """``({op: (kind, ms per call)}, summary)`` of ``fn(*args)`` over ``calls`` traced calls,
    back to back; ``summary``: device ops per call and the span per call (first op's start to
    the last op's end, over the calls), which also counts the gaps between ops."""
    hlo = parse_hlo(fn.lower(*args).compile().as_text())
    jax.block_until_ready(fn(*args))
    trace_dir = tempfile.mkdtemp(prefix="trace_reads_")
    with jax.profiler.trace(trace_dir):
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    per_op = collections.Counter()
    events = device_op_events(trace_dir, with_start=True)
    for _, op, ns, _ in events:
        per_op[op] += ns / calls / 1e6
    span = (max(t + ns for _, _, ns, t in events) - min(t for *_, t in events)) / calls / 1e6 if events else 0.0
    summary = {"ops_per_call": len(events) / calls, "span_ms_per_call": span}
    return {op: (kind_of(hlo.get(op), hlo["__computations__"]), ms) for op, ms in per_op.most_common()}, summary


def report(title: str, profiled, min_ms: float) -> None:
    ops, summary = profiled
    total = sum(ms for _, ms in ops.values())
    kinds = collections.Counter()
    for kind, ms in ops.values():
        kinds[kind] += ms
    print(f"## {title}: {total:.3f} ms busy per call ("
          + ", ".join(f"{k} {v:.3f}" for k, v in kinds.most_common())
          + f"); {summary['ops_per_call']:.0f} ops per call, span {summary['span_ms_per_call']:.3f} ms per call",
          flush=True)
    for op, (kind, ms) in ops.items():
        if ms >= min_ms:
            print(f"  {ms:8.3f} ms  {kind:<11} {op}", flush=True)


def inner_sweep(title: str, fn, args, inners, reps: int) -> None:
    """``bench.timeit``'s median per call with ``inner`` calls dispatched per timed repetition:
    what the host's dispatch and the per-repetition wait add to a call's time."""
    cells = [f"inner {k}: {bench.timeit(fn, *args, reps=reps, inner=k)[0] * 1e3:.3f}" for k in inners]
    print(f"## {title}, ms per call (median of {reps}): " + ", ".join(cells), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="attnres,msar")
    ap.add_argument("--form", default="vjp", choices=bench.FB_FORMS)
    ap.add_argument("--p1_form", default="model", choices=bench.P1_FORMS,
                    help="how phase 1 hands its state to phase 2 (bench.P1_FORMS; model: as the model's reads)")
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--base_shape", action="store_true")
    ap.add_argument("--small", action="store_true", help="a tiny shape, interpret mode (CPU smoke)")
    ap.add_argument("--min_ms", type=float, default=0.005, help="list ops above this many ms per call")
    ap.add_argument("--inners", default="",
                    help="comma-separated: also time each function with this many calls per repetition "
                         "(bench.timeit; the bench uses 5 for the forwards, 2 for forward + backward)")
    args = ap.parse_args(argv)
    names = args.configs.split(",")
    if any(c not in CONFIGS for c in names):
        ap.error(f"--configs={args.configs!r}: each must be one of {sorted(CONFIGS)}")
    shape = dict(n=9, batch=8, t_len=2048, d=2048, n_targets=8)
    if args.base_shape:
        shape = dict(n=8, batch=64, t_len=1024, d=1024, n_targets=8)
    if args.small:
        shape, args.calls, args.min_ms = dict(n=3, batch=1, t_len=32, d=64, n_targets=2), 1, 0.0
    print(f"device {jax.devices()[0].device_kind}, shape {shape}, form {args.form}", flush=True)
    for name in names:
        kernels, heads = CONFIGS[name]
        sources, banks, queries, partial, bank, query, gate = bench.make_inputs(
            *(shape[k] for k in ("n", "batch", "t_len", "d", "n_targets")), kernels, heads, jnp.bfloat16)
        gate = gate if len(kernels) > 1 else None
        opts = dict(backward="pallas")
        p1_form = bench.model_p1_form(kernels) if args.p1_form == "model" else args.p1_form
        read = functools.partial(bench.read_op, impl="pallas_gpu", kernels=kernels, heads=heads, opts=opts,
                                 p1_form=p1_form)
        p1, p2 = read(1), read(2)
        a1 = (sources, banks, queries)
        state = jax.tree.map(lambda a: a[1], bench.read_op(1, "pallas_gpu", kernels=kernels, heads=heads,
                                                           opts=opts)(*a1))
        a2, p2_args = bench.phase2_inputs(state, partial, bank, query, gate, p1_form)
        p1_args = (0, 1, 2) if banks is not None else (0, 2)
        inners = [int(k) for k in args.inners.split(",") if k]
        runs = [(f"{name} phase 1 forward (one block)", bench.forward_only(p1), a1),
                (f"{name} phase 2 forward (one call)", p2, a2)]
        aux = p1_form == "value_channel"
        for label, f, a, argnums, has_aux in (("phase 1", p1, a1, p1_args, aux), ("phase 2", p2, a2, p2_args, False)):
            runs.append((f"{name} {label} forward + backward ({args.form}, phase 1 {p1_form})",
                         bench.fwd_bwd(f, argnums, args.form, has_aux=has_aux),
                         (*a, bench.cotangent(f, a, args.form, has_aux=has_aux))))
        for title, fn, fn_args in runs:
            report(title, profile(fn, fn_args, args.calls), args.min_ms)
            if inners:
                inner_sweep(title, fn, fn_args, inners, reps=3 if args.small else 21)


if __name__ == "__main__":
    main()
