"""Compile-only check of a config on a mesh: lower and compile the train step, print memory.

    python -m msar_jax.compile_check --config=configs/msar.py:size=paper_28b --mesh=data=2,fsdp=4
    PYTHONPATH=.tpu_site python -m msar_jax.compile_check --config=configs/msar.py:size=base --topology=v5e:1x1
    PYTHONPATH=.tpu_site python -m msar_jax.compile_check --config=configs/msar.py:size=paper_28b \
        --topology=v5p:4x4x4 --mesh=fsdp=64

Nothing is allocated or run: the state and batch are sharded ``ShapeDtypeStruct``s and the bytes
per device come from ``compiled.memory_analysis()``, on fake CPU devices, a TPU topology (needs
libtpu: ``make tpu-site``) or one H200 (``--topology=h200``, JAX's CUDA plugin;
``msar_jax.deviceless_gpu``). A TPU topology is ``GEN:AxB[xC][,slices=N]``: one chip
(``v5e:1x1``), one host (up to 4 chips) or several hosts (``v5p:4x4x4``: 64 chips, 16 hosts),
and ``slices=N`` copies of it joined over the data-centre network. Flags, targets and what the
28B config needs: docs/parallelism.md section 3.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import sys
import time

from msar_jax import deviceless_gpu
from msar_jax import config as config_lib
from msar_jax.config import parse_overrides  # no jax: XLA_FLAGS are set first
from msar_jax.cli import exit_with_error, run_cli

GIB = 1024**3
LIBTPU_INSTALL = "make tpu-site (pip install --target .tpu_site libtpu==0.0.48.1), then PYTHONPATH=.tpu_site"
# The generations libtpu 0.0.48.1 names, with the number of torus dimensions each topology has.
TPU_GENERATIONS = {"v4": 3, "v5e": 2, "v5p": 3, "v6e": 2}
TOPOLOGY_RULE = ("must be GEN:AxB[xC][,slices=N] with GEN one of v4, v5e, v5p, v6e (2 dimensions for v5e and v6e, "
                 "3 for v4 and v5p), e.g. v5e:1x1, v5e:2x2, v5p:4x4x4, v5p:2x2x4,slices=2")
# libtpu's default host is 2x2x1 chips; a smaller topology is one host of exactly its chips
# (chips_per_host_bounds), else libtpu refuses it as "not divisible" by 2x2x1.
HOST_CHIPS = 4
# A Pallas kernel's call in the lowered StableHLO: Mosaic TPU, Mosaic GPU, Triton.
KERNEL_CALL = re.compile(r"stablehlo\.custom_call @(?:tpu_custom_call|mosaic_gpu_v2|__gpu\$xla\.gpu\.triton)\b")
MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes")


def _parse_kv(text: str | None, flag: str) -> dict:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}``; a malformed item exits with one line."""
    out: dict = {}
    for item in (text or "").split(","):
        if not item:
            continue
        k, sep, v = item.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            sep = ""
        if not sep or not k:
            exit_with_error(f"flag {flag!r} = {text!r}: item {item!r} must be name=integer", 2)
    return out


def parse_tpu_topology(text: str) -> tuple[str, dict]:
    """``"v5p:4x4x4"`` -> (the name libtpu takes, keyword arguments of ``get_topology_desc``).

    ``,slices=N`` becomes ``num_slices=N``; a topology of at most ``HOST_CHIPS`` chips is one
    host (``chips_per_host_bounds`` = its dimensions), so ``v5e:1x1`` is one chip. Raises
    ``ValueError`` with the rule for anything else."""
    match = re.fullmatch(r"([a-z0-9]+):([0-9]+(?:x[0-9]+)*)(?:,slices=([0-9]+))?", text)
    dims = tuple(int(x) for x in match.group(2).split("x")) if match else ()
    if (not match or match.group(1) not in TPU_GENERATIONS or len(dims) != TPU_GENERATIONS[match.group(1)]
            or min(dims) < 1 or (match.group(3) is not None and int(match.group(3)) < 1)):
        raise ValueError(f"flag '--topology' = {text!r}: {TOPOLOGY_RULE}")
    kwargs: dict = {}
    if match.group(3) is not None:
        kwargs["num_slices"] = int(match.group(3))
    if math.prod(dims) <= HOST_CHIPS:
        kwargs["chips_per_host_bounds"] = (dims + (1, 1))[:3]
    return f"{match.group(1)}:{match.group(2)}", kwargs


def libtpu_available() -> bool:
    """Whether JAX can load libtpu: the ``libtpu`` package on the path or ``TPU_LIBRARY_PATH``."""
    return importlib.util.find_spec("libtpu") is not None or bool(os.environ.get("TPU_LIBRARY_PATH"))


def tpu_devices(text: str) -> list:
    """The compile-only devices of the TPU topology ``text`` (``parse_tpu_topology``); a malformed
    name, a missing libtpu or libtpu's refusal exits with one line."""
    try:
        name, kwargs = parse_tpu_topology(text)
    except ValueError as e:
        exit_with_error(str(e), 2)
    if not libtpu_available():
        exit_with_error(f"flag '--topology' = {text!r}: compiling for a TPU needs libtpu, which is not importable; "
                        f"install it with: {LIBTPU_INSTALL}", 2)
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(name, platform="tpu", **kwargs).devices)
    except Exception as e:  # libtpu refuses the shape: its first line says why
        first = (str(e).strip().splitlines() or [""])[0]
        exit_with_error(f"flag '--topology' = {text!r}: libtpu refused it ({type(e).__name__}: {first})", 2)


def memory_report(compiled) -> dict | None:
    """``compiled.memory_analysis()`` per device as a dict of ``MEMORY_FIELDS`` plus
    ``total_bytes`` = arguments + outputs - aliased + temporaries + generated code (what the
    program holds at its peak: XLA's buffer assignment already overlaps the temporaries)."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    out = {f: int(getattr(mem, f, 0) or 0) for f in MEMORY_FIELDS}
    out["total_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"] - out["alias_size_in_bytes"]
                          + out["temp_size_in_bytes"] + out["generated_code_size_in_bytes"])
    return out


def _count(text: str) -> int:
    """argparse type of the size flags: an integer >= 0 (0 = the default)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 0 (0 = the default)")
    return value


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m msar_jax.compile_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--mesh", default="", help="e.g. data=2,fsdp=4 (unnamed axes 1)")
    ap.add_argument("--pipeline", default="", help="e.g. stages=4,microbatches=8,repeats=2,cache=1")
    ap.add_argument("--batch_size", type=_count, default=0)
    ap.add_argument("--full_batch", action="store_true", help="use the config's global batch size")
    ap.add_argument("--seq_len", type=_count, default=0)
    ap.add_argument("--devices", type=_count, default=0)
    ap.add_argument("--topology", default="",
                    help="AOT target: a TPU topology GEN:AxB[xC][,slices=N] (needs libtpu: make tpu-site, then "
                         "PYTHONPATH=.tpu_site), e.g. v5e:1x1 (one chip), v5e:2x2 (one host), v5p:4x4x4 (64 chips, "
                         "16 hosts), v5p:2x2x4,slices=2; or a GPU: h200 (needs JAX's CUDA plugin, see "
                         "msar_jax.deviceless_gpu)")
    ap.add_argument("--buffers", type=_count, default=0,
                    help="print the N largest allocations of XLA's buffer assignment and what they hold")
    ap.add_argument("--hlo", default="", help="write the compiled HLO text here")
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    ap.add_argument("--hop_table", action="store_true",
                    help="instead: bytes per pipeline hop per token from compiled HLO (4 and 8 stages, "
                         "GPipe and circular, with and without caching) for the config's stage/block structure")
    args, rest = ap.parse_known_args(argv)
    for item in rest:
        if not item.startswith("--config.") or "=" not in item:
            ap.error(f"unrecognized argument {item!r} (config overrides are --config.KEY=VALUE)")
    return args, parse_overrides(item[len("--config."):] for item in rest)


MESH_AXES = ("data", "stage", "fsdp", "tensor")  # = msar_jax.parallel.mesh.MESH_AXES (jax not yet imported)


def mesh_dict(text: str) -> dict:
    given = _parse_kv(text, "--mesh")
    unknown = set(given) - set(MESH_AXES)
    if unknown:
        exit_with_error(f"flag '--mesh' = {text!r}: unknown axes {sorted(unknown)}; axes are {MESH_AXES}", 2)
    return {a: given.get(a, 1) for a in MESH_AXES}


def main(argv=None) -> dict:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    if args.hop_table:
        return hop_table(args, overrides)
    mesh_cfg = mesh_dict(args.mesh)
    n_dev = args.devices or (math.prod(mesh_cfg.values()) if -1 not in mesh_cfg.values() else 8)
    gpu_target = deviceless_gpu.is_gpu_target(args.topology)
    if not gpu_target and args.topology:
        try:
            parse_tpu_topology(args.topology)  # a malformed name says so before jax loads
        except ValueError as e:
            exit_with_error(str(e), 2)
    if "jax" not in sys.modules:
        if not args.topology:
            flags = os.environ.get("XLA_FLAGS", "")
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_dev}".strip()
        if gpu_target:
            deviceless_gpu.prepare_gpu_environment()
        else:  # a TPU topology loads libtpu itself; JAX's default backend stays the CPU
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from msar_jax.config import load_config

    config = load_config(args.config, overrides)
    if gpu_target:
        devices = deviceless_gpu.gpu_devices(args.topology)
    elif args.topology:
        devices = tpu_devices(args.topology)
    else:
        devices = jax.devices()[:n_dev]
    pipeline = _parse_kv(args.pipeline, "--pipeline")
    t0 = time.time()
    try:
        report, compiled, allocs = compile_train_step(
            config, devices, mesh_cfg, pipeline, batch_size=args.batch_size, full_batch=args.full_batch,
            seq_len=args.seq_len, buffers=args.buffers)
    except (SystemExit, config_lib.ConfigError):
        raise
    except Exception as e:  # e.g. RESOURCE_EXHAUSTED against a TPU chip's memory: the answer we came for
        print(f"compile failed after {time.time() - t0:.1f} s: {type(e).__name__}: {e}")
        raise SystemExit(3)
    report = {"config": args.config, "topology": args.topology or None, **report}
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(compiled.as_text())
    buffers = None
    if args.buffers:
        buffers = deviceless_gpu.format_buffers(allocs, args.buffers, deviceless_gpu.op_names(compiled.as_text()))
        report["largest_allocations"] = [dict(size=a.size, kind=a.kind, values=[v._asdict() for v in a.values[:3]])
                                         for a in allocs[:args.buffers]]
    if args.json:
        print(json.dumps(report))
        return report
    mem, unit = report["memory_per_device"], "chip" if report["platform"] == "tpu" else "device"
    hosts = f" over {report['hosts']} hosts" if report["hosts"] > 1 else ""
    print(f"config   {args.config}  ({report['params'] / 1e9:.3f} B params)")
    print(f"mesh     {report['mesh_text']} on {len(devices)} {report['device_kind']} {unit}s{hosts}; "
          f"pipeline {report['pipeline']}")
    print(f"batch    {report['batch_size']} x {report['seq_len']} tokens; lower {report['lower_s']:.1f} s, "
          f"compile {report['compile_s']:.1f} s; {report['kernel_calls']} Pallas kernel calls in the lowered program "
          f"(implementation={report['implementation']!r})")
    if mem is None:
        print("memory_analysis() returned None on this backend")
    else:
        print(format_memory(mem, unit))
    if buffers:
        print("XLA's buffer assignment, largest allocations:")
        print(buffers)
    return report


def format_memory(mem: dict, unit: str = "device") -> str:
    """``memory_report``'s dict as the table ``main`` prints, in GiB."""
    names = {"argument_size_in_bytes": "arguments", "output_size_in_bytes": "outputs",
             "alias_size_in_bytes": "aliased (outputs in arguments)", "temp_size_in_bytes": "temporaries",
             "generated_code_size_in_bytes": "generated code",
             "total_bytes": "total (args + out - aliased + temp + code)"}
    lines = [f"memory per {unit} (compiled.memory_analysis()):"]
    lines += [f"  {names[f]:42s} {mem[f] / GIB:10.3f} GiB" for f in names]
    return "\n".join(lines)


def compile_train_step(config, devices, mesh_cfg: dict, pipeline: dict | None = None, *, batch_size: int = 0,
                       full_batch: bool = False, seq_len: int = 0, buffers: int = 0):
    """Lower and compile ``config``'s train step (AdamW, donated state) for ``devices`` under the
    mesh degrees ``mesh_cfg`` and the ``parallel.pipeline`` fields ``pipeline``, from sharded
    ``ShapeDtypeStruct``s; the model is traced for the devices' platform, so a TPU topology's
    program holds the Mosaic kernels ``implementation="auto"`` picks there. Returns (report dict,
    the compiled executable, XLA's buffer allocations when ``buffers``); lowering and compile
    errors propagate."""
    import jax

    from msar_jax.parallel import mesh as mesh_lib
    from msar_jax.parallel import pipeline as pipeline_lib
    from msar_jax.train import step as step_lib
    from msar_jax.train.optim import make_optimizer
    from pallas_kernels.depth_attention import platform

    model_cfg = config.model
    pcfg = mesh_lib.parallel_config()
    pcfg.mesh.update(mesh_cfg)
    pipeline = dict(pipeline or {})
    unknown = sorted(set(pipeline) - set(pcfg.pipeline))
    if unknown:
        exit_with_error(f"flag '--pipeline' = {pipeline}: unknown keys {unknown}; keys are {sorted(pcfg.pipeline)}", 2)
    pcfg.pipeline.update(pipeline)
    mesh = mesh_lib.make_mesh(pcfg.mesh, devices)
    rules = mesh_lib.rules_for(pcfg)
    seq_len = seq_len or config.seq_len
    batch_axes = mesh.shape["data"] * mesh.shape["fsdp"] * (1 if pcfg.pipeline.stages > 1 else mesh.shape["stage"])
    min_batch = batch_axes * max(1, pcfg.pipeline.microbatches)
    batch = batch_size or (config.train.batch_size if full_batch else min_batch)
    pipeline_lib.validate(pcfg, model_cfg, batch, mesh)

    tx, schedule = make_optimizer(config.optim, config.train.steps)
    model_def, abstract_params = step_lib.abstract_model(model_cfg)
    psh = mesh_lib.param_shardings(model_cfg, mesh, rules)
    abstract = jax.eval_shape(lambda p: step_lib.init_state(p, tx), abstract_params)
    ssh = mesh_lib.state_shardings(abstract, psh, mesh)
    bsh = mesh_lib.batch_sharding(mesh, batch, rules)
    state_in = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, ssh)
    batch_in = jax.ShapeDtypeStruct((batch, seq_len + 1), jax.numpy.int32, sharding=bsh)
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(abstract_params))

    raw_step = pipeline_lib.train_step_fn(model_def, tx, schedule, pcfg, mesh, model_cfg)
    step = jax.jit(raw_step, in_shardings=(ssh, bsh), out_shardings=(ssh, None), donate_argnums=0)
    t0 = time.time()
    with mesh_lib.use_mesh(mesh, rules), platform.target(devices[0].platform):
        lowered = step.lower(state_in, batch_in)
    t1 = time.time()
    allocs = None
    if buffers:
        compiled, allocs = deviceless_gpu.compile_with_buffers(lowered)
    else:
        compiled = lowered.compile()
    t2 = time.time()
    report = {
        "mesh": dict(mesh.shape),
        "mesh_text": mesh_lib.describe(mesh),
        "pipeline": dict(pcfg.pipeline),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "hosts": len({getattr(d, "process_index", 0) for d in devices}),
        "batch_size": batch,
        "seq_len": seq_len,
        "params": n_params,
        "implementation": model_cfg.residual.implementation,
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        "memory_per_device": memory_report(compiled),
        "kernel_calls": len(KERNEL_CALL.findall(lowered.as_text())),
    }
    return report, compiled, allocs


def hop_table(args, overrides) -> list[dict]:
    """Bytes per hop per token, read from the compiled HLO's collective-permutes, beside the
    analytic count, for Vanilla, mHC, AttnRes and MSAR at the config's depth, width, block
    size and dtype split into 4 and 8 stages (GPipe and 2-repeat circular, caching on/off).

    A proxy keeps what decides the hop (layers, block size, d, m, dtype) and shrinks the
    rest (2 heads of 16, MLP width 64, vocabulary 256, dense MLPs instead of MoE, T = 16,
    one row per microbatch), so the forward compiles in seconds on CPU. Hop bytes per token
    do not depend on what was shrunk. MSAR "naive" (sending the m expanded streams) is
    analytic only."""
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from msar_jax.config import load_config
    from msar_jax.parallel import mesh as mesh_lib
    from msar_jax.parallel import pipeline as pipeline_lib
    from msar_jax.train import step as step_lib

    load_config(args.config, overrides)  # the asked-for config must load (its errors first)
    seq, rows = 16, []
    proxy = {"model.n_heads": 2, "model.n_kv_heads": 1, "model.head_dim": 16, "model.mlp_dim": 64,
             "model.vocab_size": 256, "model.moe.enabled": False, "model.max_seq_len": max(seq, 16)}
    spec = args.config.partition(":")[2]
    for mech in ("vanilla", "mhc", "attnres", "msar"):
        cfg = load_config(f"configs/{mech}.py:{spec}", {**overrides, **proxy}).model
        m, d = cfg.residual.streams, cfg.d_model
        itemsize = np.dtype(jax.numpy.dtype(cfg.dtype)).itemsize
        model_def, params = step_lib.abstract_model(cfg)
        for stages, repeats, cache in ((4, 1, True), (4, 2, False), (4, 2, True), (8, 1, True), (8, 2, False),
                                       (8, 2, True)):
            if mech in ("vanilla", "mhc") and repeats > 1 and cache:
                continue  # nothing to cache
            pcfg = mesh_lib.parallel_config()
            pcfg.pipeline.update(dict(stages=stages, repeats=repeats, microbatches=stages, cache=cache))
            pcfg.mesh.update(dict(data=1, stage=stages))
            mesh = mesh_lib.make_mesh(pcfg.mesh, jax.devices()[:stages])
            plan = pipeline_lib.make_plan(pcfg, cfg)
            loss = pipeline_lib.pipelined_lm_loss(plan, mesh)
            tokens = jax.ShapeDtypeStruct((stages, seq + 1), jax.numpy.int32)
            with mesh_lib.use_mesh(mesh, mesh_lib.PIPELINE_RULES):
                lowered = jax.jit(lambda p, b: loss(model_def.merge(p), b)[0]).lower(params, tokens)
                hlo = lowered.compile().as_text()
            hops = pipeline_lib.hlo_hop_bytes(hlo)
            low_ops = pipeline_lib.lowered_hop_bytes(lowered.as_text())
            analytic = plan.hop_vectors() * d * itemsize
            row = dict(mechanism=mech, stages=stages, repeats=repeats, cache=cache and plan.caching,
                       window=plan.window, partial=plan.send_partial,
                       hlo_bytes_per_token=(max(hops) / seq if hops else 0),
                       lowered_bytes_per_token=sum(low_ops) / seq, analytic_bytes_per_token=analytic,
                       # sending MSAR's m expanded streams instead of single-stream sources
                       naive_msar_bytes_per_token=(m * plan.hop_vectors() * d * itemsize
                                                   if mech == "msar" else None))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
