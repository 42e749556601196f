"""Compile the Mosaic TPU depth-read kernels, forward and backward, ahead of time for a TPU
generation, on a CPU machine, at the shapes users train, and print each compile's status, the tiles
and VMEM the kernels chose (``tpu_blocks.choose``) and the compiled module's HBM figures.

Needs libtpu (``make tpu-site`` installs the version ``jax[tpu]`` pins into ``.tpu_site``)::

    PYTHONPATH=.tpu_site python benchmarks/tpu_kernels_aot.py --generation v5e --generation v5p

Each case is one phase of one read; ``--direction`` compiles its forward (the read as the model
calls it, ``api.phase1`` / ``phase2_fused``), its backward (the Pallas backward the model runs with
``implementation="pallas_tpu"``: phase 1's ``wide`` form, phase 2's reverse-T form, given the
forward's scores) or both (the default; a backward line's name ends in " backward").
``--filter SUBSTR`` (repeatable) keeps the compiles whose name contains one (e.g. ``msar/base/``).
Exits 1 if any compile fails. A test target imports ``KERNEL_CASES``, ``kernel_function(case)`` and
``compile_case(case, generation)`` (which returns a ``Result``). The tiling: docs/kernels.md §4,
"Mosaic TPU tiling".

Shapes (configs/common.py, msar_jax/config.py): ``n = blocks + 1`` sources and ``S = block_size``
targets in phase 1, one target in phase 2; bfloat16 sources, float32 state (the defaults), one
sequence per chip (the tiles do not depend on the batch; HBM bytes scale with it).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.depth_attention import (  # noqa: E402
    api, fused, fused_bwd_phase1, fused_bwd_phase2, reference, tiling)

# (d, transformer layers, block size) per size: configs/common.py
SIZES = {
    "small": (512, 8, 4),
    "base": (1024, 28, 8),
    "paper_10b": (2080, 15, 4),
    "paper_18b": (2112, 28, 8),
    "paper_28b": (2560, 32, 8),
}
# stream kernels per stream count: m = 4 is the model's default (kernel_sizes (4, 8, 12)); m = 2 and
# 8 the ends of the streams ablation (the largest lag, 13, still fits one 16-row halo)
STREAM_KERNELS = {1: (0,), 2: (0, 4), 4: (0, 4, 8, 12), 8: (0, 2, 4, 6, 8, 10, 12, 14)}
T_LENS = (2048, 4096, 8192)
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One phase of one read: ``phase`` 1 (scores + mixing, per-target state) or 2 (scores + mixing
    with the fusion ``fuse``: ``"gate"`` (H_pre: statistics and gate passes) or ``"mean"``)."""

    mechanism: str  # msar, mhar, attnres
    size: str
    t_len: int
    streams: int
    heads: int
    phase: int
    fuse: str | None = None

    @property
    def name(self) -> str:
        fuse = f" {self.fuse}" if self.phase == 2 else ""
        return f"{self.mechanism}/{self.size}/T={self.t_len}/m={self.streams}/H={self.heads}/phase {self.phase}{fuse}"

    @property
    def d(self) -> int:
        return SIZES[self.size][0]

    @property
    def n_sources(self) -> int:
        _, layers, block = SIZES[self.size]
        return -(-2 * layers // block) + 1

    @property
    def n_targets(self) -> int:
        return SIZES[self.size][2] if self.phase == 1 else 1

    @property
    def stream_kernels(self) -> tuple[int, ...]:
        return STREAM_KERNELS[self.streams]


def _cases() -> list[Case]:
    out = []
    for size in SIZES:
        for t_len in T_LENS:
            out += [Case("msar", size, t_len, 4, 1, 1), Case("msar", size, t_len, 4, 1, 2, "gate")]
        for m in (2, 8):
            out += [Case("msar", size, 8192, m, 1, 1), Case("msar", size, 8192, m, 1, 2, "gate")]
        out += [Case("msar", size, 8192, 4, 1, 2, "mean")]
        for t_len in (2048, 8192):
            out += [Case("attnres", size, t_len, 1, 1, 1), Case("attnres", size, t_len, 1, 1, 2, "mean")]
    for size, heads in (("small", 8), ("base", 16), ("base", 8), ("paper_28b", 16)):  # MHAR: 8 and 16 heads
        for t_len in T_LENS:
            out += [Case("mhar", size, t_len, 1, heads, 1), Case("mhar", size, t_len, 1, heads, 2, "mean")]
    return out


KERNEL_CASES: list[Case] = _cases()


@dataclasses.dataclass
class Result:
    """``ok``; ``error`` (one line) when not; ``tiles``: kernel -> (block_t, block_d, VMEM need,
    vmem_limit_bytes); ``hbm``: the compiled module's argument / output / temporary bytes
    (``memory_analysis``) and ``bytes_accessed`` (``cost_analysis``); ``seconds`` to compile."""

    case: Case
    generation: str
    ok: bool
    seconds: float
    tiles: dict
    hbm: dict
    error: str = ""


@functools.cache
def _device(generation: str):
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(TOPOLOGIES[generation], platform="tpu")
    return topo.devices[0]


def _tiles(case: Case, backward: bool, vmem: tuple[str, int]) -> dict:
    """The tiles the kernels choose for this case (``fused.phase1_forward`` / ``phase2_forward``,
    ``fused_bwd_phase1.tpu_tiles`` / ``fused_bwd_phase2.tpu_tiles``)."""
    kernels, m = case.stream_kernels, case.streams
    if backward and case.phase == 1:
        tiles = fused_bwd_phase1.tpu_tiles(n=case.n_sources, n_targets=case.n_targets, stream_kernels=kernels,
                                           heads=case.heads, d=case.d, t_len=case.t_len,
                                           acc_itemsize=2 if m == 1 else 4, vmem=vmem)
    elif backward:
        tiles = fused_bwd_phase2.tpu_tiles(stream_kernels=kernels, heads=case.heads, d=case.d, t_len=case.t_len,
                                           gate=case.fuse == "gate", vmem=vmem)
    else:
        shape = dict(t_len=case.t_len, d=case.d, heads=case.heads, n_targets=case.n_targets, n_streams=m,
                     max_kernel=max([1, *kernels]), n_taps=sum(kernels), x_itemsize=2, vmem=vmem)
        tiles = {"scores": fused.tpu_scores_tile(**shape)}
        if case.phase == 1:
            tiles["mix acc"] = fused.tpu_mix_tile("acc", n_sources=case.n_sources, out_itemsize=4, **shape)
        else:
            for mode in ("stats", "gate") if case.fuse == "gate" else ("mean",):
                tiles[f"mix {mode}"] = fused.tpu_mix_tile(mode, n_sources=1, out_itemsize=4 if mode == "stats" else 2,
                                                          base_itemsize=4, **shape)
    return {k: (t.block_t, t.block_d, t.vmem_need, t.vmem_limit) for k, t in tiles.items()}


def backward_function(case: Case):
    """The case's Pallas backward as the model's ``pallas_tpu`` read runs it, and its abstract
    arguments: phase 1's ``wide`` form from the state cotangent; phase 2's reverse-T form from the
    output cotangent and the forward's scores."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    d, m, kernels, heads, b, t = case.d, case.streams, case.stream_kernels, case.heads, 1, case.t_len
    k = sum(kernels)
    sds = jax.ShapeDtypeStruct
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max([1, *kernels]), n_targets=case.n_targets,
                                backend="tpu", n_streams=m)
    seg = sds((b, t), jnp.int32)
    one_stream = m == 1
    if case.phase == 1:
        n, s = case.n_sources, case.n_targets

        def p1(sources, banks, queries, valid, segment_ids, smax, g_denom, g_acc, scale):
            g = reference.SoftmaxState(max=jnp.zeros_like(smax), denom=g_denom, acc=g_acc)
            return fused_bwd_phase1.phase1_backward(
                sources, banks, queries, valid, segment_ids, smax, g, stream_kernels=kernels, heads=heads,
                tiles=tiles, backend="tpu", interpret=False, value_scale=scale, eps=1e-6)

        per_token = sds((s, m, b, t, heads), f32)
        return p1, (sds((n, b, t, d), bf16), sds((n, k, d), f32) if k else None, sds((s, m, d), f32),
                    sds((n,), jnp.bool_), seg, per_token, per_token,
                    sds((s, m, b, t, d), bf16 if one_stream else f32),  # one stream: the factored cotangent
                    per_token if one_stream else None)

    def p2(state, partial, bank, query, gate, segment_ids, dh, scores):
        return fused_bwd_phase2.phase2_fused_backward(
            state, partial, bank, query, True, gate, segment_ids, dh, stream_kernels=kernels, heads=heads,
            gate_eps=1e-6, tiles=tiles, backend="tpu", interpret=False, scores=scores, value_channel=one_stream,
            eps=1e-6)

    state = reference.SoftmaxState(sds((m, b, t, heads), f32), sds((m, b, t, heads), f32), sds((m, b, t, d), f32))
    gate = (sds((m * d, m), f32), sds((), f32), sds((m,), f32)) if case.fuse == "gate" else None
    return p2, (state, sds((b, t, d), bf16), sds((k, d), f32) if k else None, sds((m, d), f32), gate, seg,
                sds((b, t, d), bf16), (sds((m, b, t, heads), f32), sds((m, b, t), f32)))


def kernel_function(case: Case):
    """The forward read as the model calls it, and its abstract arguments."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    d, m, kernels, b = case.d, case.streams, case.stream_kernels, 1
    k = sum(kernels)
    kw = dict(stream_kernels=kernels, heads=case.heads, implementation="pallas_tpu", interpret=False)
    sds = jax.ShapeDtypeStruct
    if case.phase == 1:
        n, s = case.n_sources, case.n_targets
        args = (sds((n, b, case.t_len, d), bf16), sds((n, k, d), f32) if k else None, sds((s, m, d), f32),
                sds((n,), jnp.bool_))
        return (lambda x, bank, q, valid: api.phase1(x, bank, q, valid, per_target=True, **kw)), args
    state = reference.SoftmaxState(sds((m, b, case.t_len, case.heads), f32), sds((m, b, case.t_len, case.heads), f32),
                                   sds((m, b, case.t_len, d), f32))
    gate = (sds((m * d, m), f32), sds((), f32), sds((m,), f32)) if case.fuse == "gate" else None
    args = (state, sds((b, case.t_len, d), bf16), sds((k, d), f32) if k else None, sds((m, d), f32), gate)
    return (lambda st, x, bank, q, g: api.phase2_fused(st, x, bank, q, True, g, out_dtype=bf16, **kw)), args


def compile_case(case: Case, generation: str, backward: bool = False) -> Result:
    """Compile ``case``'s forward (``backward``: its backward) for one chip of ``generation``
    (``TOPOLOGIES``) with libtpu."""
    device = _device(generation)
    mesh = jax.sharding.Mesh([device], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    fn, args = backward_function(case) if backward else kernel_function(case)
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
    t0 = time.time()
    try:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            from jax.experimental.pallas import tpu as pltpu

            info = pltpu.get_tpu_info()
            tiles = _tiles(case, backward, (str(info.chip_version.value), int(info.vmem_capacity_bytes)))
            compiled = jax.jit(fn).trace(*args).lower().compile()
    except Exception as e:  # noqa: BLE001 - report every case
        msg = " ".join(str(e).split())
        return Result(case, generation, False, time.time() - t0, {}, {}, f"{type(e).__name__}: {msg[:400]}")
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hbm = dict(arguments=mem.argument_size_in_bytes, outputs=mem.output_size_in_bytes,
               temporaries=mem.temp_size_in_bytes, bytes_accessed=float((cost or {}).get("bytes accessed", 0.0)))
    return Result(case, generation, True, time.time() - t0, tiles, hbm)


def _mib(x) -> str:
    return f"{x / 2**20:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generation", action="append", choices=sorted(TOPOLOGIES),
                        help="TPU generation to compile for (repeatable; default v5e and v5p)")
    parser.add_argument("--filter", action="append", default=[],
                        help="keep the compiles whose name contains this (repeatable: any of them)")
    parser.add_argument("--direction", choices=("forward", "backward", "both"), default="both")
    opts = parser.parse_args(argv)
    directions = [False, True] if opts.direction == "both" else [opts.direction == "backward"]
    failures = 0
    for generation in opts.generation or ["v5e", "v5p"]:
        print(f"# {generation} ({_device(generation).device_kind}); VMEM in MiB: need / limit per kernel; "
              "HBM in MiB: arguments + outputs + temporaries, bytes accessed")
        for case in KERNEL_CASES:
            for backward in directions:
                name = case.name + (" backward" if backward else "")
                if opts.filter and not any(f in name for f in opts.filter):
                    continue
                r = compile_case(case, generation, backward)
                if not r.ok:
                    failures += 1
                    print(f"{generation} {name}: FAIL ({r.seconds:.1f} s) {r.error}", flush=True)
                    continue
                tiles = "; ".join(f"{k} {bt}x{bd} {_mib(need)}/{_mib(limit)}"
                                  for k, (bt, bd, need, limit) in r.tiles.items())
                h = r.hbm
                print(f"{generation} {name}: ok ({r.seconds:.1f} s) | {tiles} | HBM {_mib(h['arguments'])} + "
                      f"{_mib(h['outputs'])} + {_mib(h['temporaries'])}, accessed {_mib(h['bytes_accessed'])}",
                      flush=True)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
