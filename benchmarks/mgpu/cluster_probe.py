"""Can a cluster of CTAs share per-token sums on the H200 through Pallas' Mosaic GPU (jax 0.11.2)?
The question behind ``mosaic_gpu_cluster`` (docs/kernels.md): phase 2's forward reads its
float32 state twice (once for the gate's statistics, once for the output) because a 64-token
tile's whole state (m = 4 streams x d channels x 4 bytes x 64 tokens: 1 MB at `base`, 2 MB at the
bench shape) does not fit in one SM. Split over a cluster of G CTAs along the channels, each
CTA's slice (d / G channels: 128 KB at G = 8 for `base`, at G = 16 for the bench shape) fits in
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

Result (an H100), with the barrier count below: G = 2 with one round completed but its sums were off by 2 (each value from the column pair
next to it: ``async_store_smem``'s stores and the receiving WGMMA-layout loads disagree on the
tile's layout); with no exchange the kernel took 95.1 us per call; with two rounds it faulted
(unspecified launch failure), which left the GPU unusable for G = 4-16.

``--mode pull`` reads each CTA's tile from its peers' shared memory through
``plgpu.cluster_ref`` after a ``ClusterBarrier`` (the exchange ``mosaic_gpu_cluster`` uses, exact
on an H100); ``--cols`` takes tiles of 16 or 32 columns, and ``--only G`` runs one cluster size per
process. ``fence.acq_rel.cluster`` sits around the pull's barrier (``mosaic_gpu_cluster.cluster_fence``: the barrier alone orders at CTA
scope); ``--no-fence`` leaves it out.

Run: ``python benchmarks/mgpu/cluster_probe.py [--mode push|pull] [--cols 8|16|32] [--only G] [--no-fence]``
(GPU); ``--interpret`` tries the exchange in
Pallas' Mosaic GPU interpret mode (jax 0.11.2's interpreter has no rule for ``async_store_smem``:
it says so); ``--aot`` compiles every variant for an H200 on a machine without one (JAX's CUDA
plugin on ``PYTHONPATH``, ``msar_jax.deviceless_gpu``): Mosaic GPU's lowering and ptxas, not the launch."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: pallas_kernels, msar_jax
if "--aot" in sys.argv:  # before jax starts: the CUDA plugin's deviceless topology
    from msar_jax import deviceless_gpu

    deviceless_gpu.prepare_gpu_environment()

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.depth_attention.mosaic_gpu_cluster import cluster_fence

BT = 64
COLS = 8  # the default tile: [64, 8] float32 of per-token sums (column j: sum j); ``--cols`` changes it
MODES = ("push", "pull")
F32 = jnp.float32


def build(g_size: int, rounds: int, batch: int, tiles: int, interpret: bool, cols: int = COLS, mode: str = "push",
          fence: bool = True):
    """The probe kernel. ``mode="push"``: every CTA stores its tile into slot g of every CTA with
    ``plgpu.async_store_smem`` (``st.async``, counted on the receiver's barrier). ``"pull"``: every
    CTA writes its tile into its own shared memory, the cluster meets at a ``ClusterBarrier``, and
    each CTA loads every peer's tile through ``plgpu.cluster_ref`` (``ld.shared::cluster``);
    ``fence``: with ``mosaic_gpu_cluster.cluster_fence`` after the write and after the wait (the
    barrier alone orders at CTA scope)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: must be one of {MODES}")
    n_rounds = max(rounds, 1)
    swizzled = lambda *shape: plgpu.SMEM(shape, F32, transforms=(  # noqa: E731
        plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(min(128, cols * 4))))
    # push: one receive buffer per round and sender, so no round overwrites a slot a peer may still
    # read; pull: the CTA's own tile per round
    buf_type = swizzled(n_rounds, g_size, BT, cols) if mode == "push" else swizzled(n_rounds, BT, cols)
    if mode == "push":
        # one arrival per store: each of a sender's 128 threads arrives once per store (Lane
        # semantics), and Pallas multiplies a Lane kernel's num_arrivals by the warpgroup's 128
        # threads itself (``lowering._get_barrier``). 128 * G here is a count no store
        # reaches: the kernel then hangs silently
        bar_type = plgpu.Barrier(num_arrivals=g_size, num_barriers=n_rounds)
    else:  # each CTA's warpgroup arrives once at every CTA's barrier of the round
        bar_type = plgpu.ClusterBarrier(collective_axes=("g",), num_arrivals=1, num_barriers=n_rounds)

    def body(out_ref, buf, out_s, bar):
        g = lax.axis_index("g")
        b, t = lax.axis_index("b"), lax.axis_index("t")
        layout = plgpu.Layout.WGMMA
        rows = plgpu.broadcasted_iota(jnp.int32, (BT, cols), 0, layout=layout)
        col = plgpu.broadcasted_iota(jnp.int32, (BT, cols), 1, layout=layout)
        # integers that float32 holds exactly, summed too (under 2^24): tags of
        # 100000 * tile give sums that float32 rounds by a few units, which looks like an exchange fault
        mine = (rows * cols + col + 1000 * g + 20000 * lax.rem(b * tiles + t, 8)).astype(F32)
        total = None
        for k in range(rounds):
            val = mine + float(k)
            if mode == "push":
                for j in range(g_size):  # every CTA sends its tile to slot g of every CTA (itself too)
                    plgpu.async_store_smem(val, buf.at[k, g], bar.at[k], cluster_idx=jnp.int32(j), cluster_dim="g")
                plgpu.barrier_wait(bar.at[k])
                got = sum(plgpu.load(buf.at[k, j], (), layout=layout) for j in range(g_size))
            else:
                buf[k] = val
                if fence:
                    cluster_fence(plgpu)
                plgpu.commit_smem()  # a warpgroup barrier: the whole tile written before the arrival
                plgpu.barrier_arrive(bar.at[k])
                plgpu.barrier_wait(bar.at[k])
                if fence:
                    cluster_fence(plgpu)
                got = sum(plgpu.load(plgpu.cluster_ref(buf.at[k], {"g": jnp.int32(j)}), (), layout=layout)
                          for j in range(g_size))
            total = got if total is None else total + got
        if total is None:
            total = mine
        out_s[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_ref.at[b, t, g])
        plgpu.wait_smem_to_gmem(0)
        if mode == "pull" and rounds:  # no CTA leaves while a peer may still read its tiles
            plgpu.barrier_arrive(bar.at[0])
            plgpu.barrier_wait(bar.at[0])

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((batch, tiles, g_size, BT, cols), F32),
        scratch_types=[buf_type, plgpu.SMEM((BT, cols), F32), bar_type],
        grid=(batch, tiles), grid_names=("b", "t"), cluster=(g_size,), cluster_names=("g",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else False)


def expected(g_size, rounds, batch, tiles, n_cols=COLS):
    rows, cols = np.meshgrid(np.arange(BT), np.arange(n_cols), indexing="ij")
    base = rows * n_cols + cols
    out = np.zeros((batch, tiles, g_size, BT, n_cols), np.float64)
    for b in range(batch):
        for t in range(tiles):
            s = sum(base + 1000 * j + 20000 * ((b * tiles + t) % 8) for j in range(g_size))
            tot = sum(s + g_size * k for k in range(rounds))
            out[b, t] = tot
    return out


def _option(argv, name, default, cast=int):
    return cast(argv[argv.index(name) + 1]) if name in argv else default


def compile_for_h200(modes, widths) -> int:
    """Compiles each variant the GPU run takes for an H200, deviceless; returns the failures."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = deviceless_gpu.gpu_mesh("h200")
    failures = 0
    for mode in modes:
        for cols in widths:
            for g_size in (2, 4, 8, 16):
                for rounds in (0, 1, 2):
                    name = f"{mode} cols={cols} G={g_size} rounds={rounds}"
                    buf_bytes = max(rounds, 1) * (g_size if mode == "push" else 1) * BT * cols * 4
                    if buf_bytes > 227 * 1024:  # more than a CTA's shared memory: nothing to compile
                        print(f"{name}: skipped ({buf_bytes} bytes of receive buffers)", flush=True)
                        continue
                    try:
                        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                            jax.jit(build(g_size, rounds, 8, 32, False, cols, mode),
                                    out_shardings=NamedSharding(mesh, P())).lower().compile()
                        print(f"{name}: compiled for the H200", flush=True)
                    except Exception as e:  # noqa: BLE001
                        failures += 1
                        print(f"{name}: compile failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
    return failures


def main(argv):
    """``--mode push|pull`` (default push), ``--cols N`` (the tile's width, default 8), ``--only G``
    (one cluster size: a failed launch leaves the process's GPU unusable, so run one per process)."""
    modes = (argv[argv.index("--mode") + 1],) if "--mode" in argv else MODES
    widths = (_option(argv, "--cols", COLS),) if "--cols" in argv else (8, 16, 32)
    if "--aot" in argv:
        return 1 if compile_for_h200(modes, widths) else 0
    mode, cols = modes[0], widths[0]
    fence = "--no-fence" not in argv
    interpret = "--interpret" in argv
    sizes = (2, 4) if interpret else (2, 4, 8, 16)
    sizes = (_option(argv, "--only", None),) if "--only" in argv else sizes
    batch, tiles = (1, 2) if interpret else (8, 32)
    for g_size in sizes:
        tag = f"{mode} cols={cols} G={g_size}" + ("" if fence or mode == "push" else " no fence")
        try:
            f = jax.jit(build(g_size, 1, batch, tiles, interpret, cols, mode, fence))
            out = np.asarray(f())
            err = float(np.abs(out - expected(g_size, 1, batch, tiles, cols)).max())
            print(f"{tag}: exchange max abs error {err:g} ({'right' if err == 0 else 'WRONG'})", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report what failed and go on
            print(f"{tag}: exchange failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        if interpret:
            continue
        for rounds in (0, 2):
            try:
                f = jax.jit(build(g_size, rounds, batch, tiles, False, cols, mode, fence))
                jax.block_until_ready(f())
                ts = []
                for _ in range(21):
                    t0 = time.perf_counter()
                    for _ in range(5):
                        out = f()
                    jax.block_until_ready(out)
                    ts.append((time.perf_counter() - t0) / 5)
                print(f"{tag} rounds={rounds}: {1e6 * float(np.median(ts)):.1f} us per call "
                      f"({batch * tiles} clusters of {g_size} CTAs)", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"{tag} rounds={rounds}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
