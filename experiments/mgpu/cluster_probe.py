"""Can a cluster of CTAs share per-token sums on the H200 through Pallas' Mosaic GPU (jax 0.11.2)?
The question behind BENCHMARKS.md, kernels, "What remains 3": phase 2's forward reads its
float32 state twice (once for the gate's statistics, once for the output) because a 64-token
tile's whole state (m = 4 streams x d channels x 4 bytes x 64 tokens: 1 MB at `base`, 2 MB at the
issue's shape) does not fit in one SM. Split over a cluster of G CTAs along the channels, each
CTA's slice (d / G channels: 128 KB at G = 8 for `base`, at G = 16 for the issue's shape) fits in
shared memory; the CTAs then need only to add up a few row vectors of per-token sums (the scores'
dots, the gate's statistics) twice per tile.

This script answers, for G in 2, 4, 8, 16 (16 is above CUDA's portable cluster size):
  1. does a kernel with ``cluster=(G,)`` launch and compile (``launch``)?
  2. do the CTAs' row sums come out right when each CTA sends its [64, 8] float32 tile of row
     vectors (column j: the j-th per-token sum) to every peer's shared memory with
     ``plgpu.async_store_smem`` (st.async, counted on the peer's barrier), Lane semantics as the
     kernels use (``exchange``)?
  3. how long that exchange takes: the kernel run with ``rounds`` exchanges per tile against the
     same kernel with none (``time``), over (8 batch rows x 32 token tiles) clusters.

Session 37 (an H100, ``experiments/results/kernels_h200_s37/call1b``), after the barrier fix
below: G = 2 with one round completed but its sums were off by 2 (each value from the column pair
next to it: ``async_store_smem``'s stores and the receiving WGMMA-layout loads disagree on the
tile's layout); with no exchange the kernel took 95.1 us per call; with two rounds it faulted
(unspecified launch failure), which left the GPU unusable for G = 4-16.

Run: ``python experiments/mgpu/cluster_probe.py`` (GPU); ``--interpret`` tries the exchange in
Pallas' Mosaic GPU interpret mode (jax 0.11.2's interpreter has no rule for ``async_store_smem``:
it says so); ``--aot`` compiles every variant for an H200 on a machine without one (JAX's CUDA
plugin on ``PYTHONPATH``, ``msar_jax.aot``): Mosaic GPU's lowering and ptxas, not the launch."""
import sys
import time
from pathlib import Path

if "--aot" in sys.argv:  # before jax starts: the CUDA plugin's deviceless topology
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from msar_jax import aot

    aot.prepare_gpu_environment()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

BT, COLS = 64, 8  # one [64, 8] float32 tile of per-token sums (column j: sum j)
F32 = jnp.float32


def build(g_size: int, rounds: int, batch: int, tiles: int, interpret: bool):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    # one receive buffer per round, so no round overwrites a slot a peer may still read
    recv_type = plgpu.SMEM((max(rounds, 1), g_size, BT, COLS), F32,
                           transforms=(plgpu.TilingTransform((8, COLS)), plgpu.SwizzleTransform(COLS * 4)))

    def body(out_ref, recv, out_s, bar):
        g = lax.axis_index("g")
        b, t = lax.axis_index("b"), lax.axis_index("t")
        layout = plgpu.Layout.WGMMA
        rows = plgpu.broadcasted_iota(jnp.int32, (BT, COLS), 0, layout=layout)
        cols = plgpu.broadcasted_iota(jnp.int32, (BT, COLS), 1, layout=layout)
        mine = (rows * COLS + cols + 1000 * g + 100000 * (b * tiles + t)).astype(F32)
        total = None
        for k in range(rounds):
            val = mine + float(k)
            for j in range(g_size):  # every CTA sends its tile to slot g of every CTA (itself too)
                plgpu.async_store_smem(val, recv.at[k, g], bar.at[k], cluster_idx=jnp.int32(j), cluster_dim="g")
            plgpu.barrier_wait(bar.at[k])
            got = sum(plgpu.load(recv.at[k, j], layout=layout) for j in range(g_size))
            total = got if total is None else total + got
        if total is None:
            total = mine
        out_s[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_ref.at[b, t, g])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((batch, tiles, g_size, BT, COLS), F32),
        scratch_types=[recv_type, plgpu.SMEM((BT, COLS), F32),
                       # one arrival per store: each of a sender's 128 threads arrives once per store
                       # (Lane semantics), and Pallas multiplies a Lane kernel's num_arrivals by the
                       # warpgroup's 128 threads itself (``lowering._get_barrier``). Session 34 wrote
                       # 128 * G here, which no store count reaches: session 36's run hung silently
                       plgpu.Barrier(num_arrivals=g_size, num_barriers=max(rounds, 1))],
        grid=(batch, tiles), grid_names=("b", "t"), cluster=(g_size,), cluster_names=("g",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False)


def expected(g_size, rounds, batch, tiles):
    rows, cols = np.meshgrid(np.arange(BT), np.arange(COLS), indexing="ij")
    base = rows * COLS + cols
    out = np.zeros((batch, tiles, g_size, BT, COLS), np.float64)
    for b in range(batch):
        for t in range(tiles):
            s = sum(base + 1000 * j + 100000 * (b * tiles + t) for j in range(g_size))
            tot = sum(s + g_size * k for k in range(rounds))
            out[b, t] = tot
    return out


def compile_for_h200() -> int:
    """Compiles each variant the GPU run times for an H200, deviceless; returns the failures."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = aot.gpu_mesh("h200")
    failures = 0
    for g_size in (2, 4, 8, 16):
        for rounds in (0, 1, 2):
            try:
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    jax.jit(build(g_size, rounds, 8, 32, False), out_shardings=NamedSharding(mesh, P())).lower().compile()
                print(f"G={g_size} rounds={rounds}: compiled for the H200", flush=True)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"G={g_size} rounds={rounds}: compile failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
    return failures


def main(argv):
    if "--aot" in argv:
        return 1 if compile_for_h200() else 0
    interpret = "--interpret" in argv
    sizes = (2, 4) if interpret else (2, 4, 8, 16)
    batch, tiles = (1, 2) if interpret else (8, 32)
    for g_size in sizes:
        try:
            f = jax.jit(build(g_size, 1, batch, tiles, interpret))
            out = np.asarray(f())
            err = float(np.abs(out - expected(g_size, 1, batch, tiles)).max())
            print(f"G={g_size}: exchange max abs error {err:g} ({'right' if err == 0 else 'WRONG'})", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report what failed and go on
            print(f"G={g_size}: exchange failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        if interpret:
            continue
        for rounds in (0, 2):
            try:
                f = jax.jit(build(g_size, rounds, batch, tiles, False))
                jax.block_until_ready(f())
                ts = []
                for _ in range(21):
                    t0 = time.perf_counter()
                    for _ in range(5):
                        out = f()
                    jax.block_until_ready(out)
                    ts.append((time.perf_counter() - t0) / 5)
                print(f"G={g_size} rounds={rounds}: {1e6 * float(np.median(ts)):.1f} us per call "
                      f"({batch * tiles} clusters of {g_size} CTAs)", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"G={g_size} rounds={rounds}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
