"""Ahead-of-time compiles of the Mosaic TPU backward kernels at the model's shapes, on a CPU machine
with libtpu (``PYTHONPATH=/path/to/libtpu python benchmarks/tpu_backward_cases.py [--chips v5e,v5p]
[--only SUBSTRING]``). ``BACKWARD_CASES`` lists every backward the model runs with
``implementation="pallas_tpu"`` (``heuristics.choose``: phase 1's ``wide`` form and phase 2's
``reverse_t`` form of the Pallas backward, mean fusion with one stream, the gate with several)
at ``small``, ``base``, ``paper_10b``, ``paper_18b`` and ``paper_28b`` widths, T = 2048, 4096 and
8192, m = 2, 4 and 8 streams, MHAR with 8 and 16 heads and AttnRes; ``compile_case`` compiles
one for one chip and prints its status, the VMEM limit and the tiles' VMEM estimates of each
kernel, and the compiled module's memory and bytes accessed (``memory_analysis``,
``cost_analysis``). docs/kernels.md §4, "Mosaic TPU backward tiles"."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.depth_attention import fused_bwd_phase1, fused_bwd_phase2, reference, tiling, tpu_blocks  # noqa: E402

# (name, d, layers, block size): configs/common.py's sizes
SIZES = {"small": (512, 8, 4), "base": (1024, 28, 8), "paper_10b": (2080, 15, 4), "paper_18b": (2112, 28, 8),
         "paper_28b": (2560, 32, 8)}
MSAR_KERNELS = {2: (0, 4), 4: (0, 4, 8, 12), 8: (0, 2, 4, 6, 8, 10, 12, 14)}
CHIPS = {"v5e": "v5e:1x1", "v5p": "v5p:1x1x1", "v6e": "v6e:1x1"}


@dataclasses.dataclass(frozen=True)
class Case:
    mechanism: str  # "msar", "mhar", "attnres"
    size: str
    t_len: int
    streams: int = 1
    heads: int = 1
    batch: int = 1  # rows per chip: the kernels' grid, not their tiles

    @property
    def name(self) -> str:
        extra = f" m={self.streams}" if self.mechanism == "msar" else f" H={self.heads}" if self.heads > 1 else ""
        return f"{self.mechanism} {self.size} T={self.t_len}{extra}"

    @property
    def stream_kernels(self) -> tuple[int, ...]:
        return MSAR_KERNELS[self.streams] if self.mechanism == "msar" else (0,)

    @property
    def shapes(self):
        d, layers, block = SIZES[self.size]
        return d, 2 * layers // block + 1, block  # d, source slots n, targets S


BACKWARD_CASES = (
    [Case("msar", size, t, streams=4) for size in SIZES for t in (2048, 4096, 8192)]
    + [Case("msar", "base", t, streams=m) for t in (2048, 8192) for m in (2, 8)]
    + [Case("mhar", size, t, heads=h) for size in ("small", "base", "paper_28b") for t in (2048, 8192) for h in (8, 16)]
    + [Case("attnres", size, t) for size in SIZES for t in (2048, 8192)]
)


def _topology(chip: str):
    from jax.experimental import topologies

    return topologies.get_topology_desc(CHIPS[chip], platform="tpu", chips_per_host_bounds=(1, 1, 1))


def _functions(case: Case):
    """``(name, fn, args)`` of the case's phase 1 and phase 2 backwards (as the model's ``pallas_tpu``
    reads run them: the phase 2 backward takes the forward's scores)."""
    d, n, n_targets = case.shapes
    kernels, heads, m, batch, t = case.stream_kernels, case.heads, len(case.stream_kernels), case.batch, case.t_len
    k = sum(kernels)
    sds = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max([1, *kernels]), n_targets=n_targets, backend="tpu",
                                n_streams=m)
    eps = dict(eps=1e-6)
    seg = sds((batch, t), jnp.int32)
    one_stream = m == 1

    def p1(sources, banks, queries, valid, segment_ids, smax, g_denom, g_acc, scale):
        g = reference.SoftmaxState(max=jnp.zeros_like(smax), denom=g_denom, acc=g_acc)
        return fused_bwd_phase1.phase1_backward(
            sources, banks, queries, valid, segment_ids, smax, g, stream_kernels=kernels, heads=heads, tiles=tiles,
            backend="tpu", interpret=False, value_scale=scale, **eps)

    acc_shape = (n_targets, m, batch, t, d)
    p1_args = (sds((n, batch, t, d), bf), sds((n, k, d), f32) if k else None, sds((n_targets, m, d), f32),
               sds((n,), jnp.bool_), seg, sds((n_targets, m, batch, t, heads), f32),
               sds((n_targets, m, batch, t, heads), f32),
               sds(acc_shape, bf if one_stream else f32),  # one stream: the factored cotangent, bf16 dh
               sds((n_targets, m, batch, t, heads), f32) if one_stream else None)

    def p2(state, partial, bank, query, gate, segment_ids, dh, scores):
        return fused_bwd_phase2.phase2_fused_backward(
            state, partial, bank, query, True, gate, segment_ids, dh, stream_kernels=kernels, heads=heads,
            gate_eps=1e-6, tiles=tiles, backend="tpu", interpret=False, scores=scores, value_channel=one_stream,
            **eps)

    state = reference.SoftmaxState(sds((m, batch, t, heads), f32), sds((m, batch, t, heads), f32),
                                   sds((m, batch, t, d), f32))
    gate = None if one_stream else (sds((m * d, m), f32), sds((), f32), sds((m,), f32))
    p2_args = (state, sds((batch, t, d), bf), sds((k, d), f32) if k else None, sds((m, d), f32), gate, seg,
               sds((batch, t, d), bf), (sds((m, batch, t, heads), f32), sds((m, batch, t), f32)))
    return [("phase 1 backward", p1, p1_args), ("phase 2 backward", p2, p2_args)]


def compile_case(case: Case, chip: str, only: str | None = None) -> int:
    """Compile ``case``'s backwards for one ``chip``; print one line each. Returns the failures."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    topo = _topology(chip)
    mesh = jax.sharding.Mesh([topo.devices[0]], ("x",))
    rep = NamedSharding(mesh, P())
    failures = 0
    for name, fn, args in _functions(case):
        if only and only not in f"{case.name} {name}":
            continue
        args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), args)
        t0 = time.time()
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tpu_blocks.limits(
                    vmem_limit=tpu_blocks.vmem_limit_for(topo.devices[0].device_kind)):
                compiled = jax.jit(fn).trace(*args).lower().compile()
            mem = compiled.memory_analysis()
            cost = compiled.cost_analysis() or {}
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            print(f"{chip} {case.name} {name}: ok {time.time() - t0:.1f} s; temp {mem.temp_size_in_bytes / 2**20:.1f} MiB, "
                  f"args {mem.argument_size_in_bytes / 2**20:.1f} MiB, out {mem.output_size_in_bytes / 2**20:.1f} MiB, "
                  f"bytes accessed {cost.get('bytes accessed', float('nan')) / 2**30:.2f} GiB", flush=True)
        except Exception as e:  # noqa: BLE001 - report every case
            failures += 1
            print(f"{chip} {case.name} {name}: FAIL {type(e).__name__}: {str(e)[:600]}", flush=True)
    return failures


def kernel_vmem(case: Case, chip: str) -> dict:
    """The tiles and VMEM estimates the TPU backward kernels choose for ``case`` on ``chip``."""
    d, n, n_targets = case.shapes
    kernels, heads, m = case.stream_kernels, case.heads, len(case.stream_kernels)
    with tpu_blocks.limits(vmem_limit=tpu_blocks.vmem_limit_for(_topology(chip).devices[0].device_kind)):
        return fused_bwd_phase1.tpu_tiles(n=n, n_targets=n_targets, stream_kernels=kernels, heads=heads, d=d,
                                          t_len=case.t_len, acc_itemsize=2 if m == 1 else 4) | \
            fused_bwd_phase2.tpu_tiles(stream_kernels=kernels, heads=heads, d=d, t_len=case.t_len,
                                       gate=m > 1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", default="v5e,v5p")
    parser.add_argument("--only", default=None, help="compile the cases whose name contains this")
    opts = parser.parse_args(argv)
    failures = 0
    for case in BACKWARD_CASES:
        for chip in opts.chips.split(","):
            failures += compile_case(case, chip, opts.only)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
