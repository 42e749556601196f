"""Phase 2's forward with the state read once by a cluster of CTAs (``mosaic_gpu_cluster``)
against the one-CTA kernel (``mosaic_gpu.phase2_fused_forward``, the state read twice), MSAR
(kernels (0, 4, 8, 12), gate, float32 state, bf16 partial and ``h``) at `base`'s shape (B x T =
64 x 1024, d = 1024) and the bench shape (8 x 2048, d = 2048). Per variant (cluster size, exchange,
warpgroups per CTA, one cluster per tile or a cluster per group of SMs walking the tiles):
the largest difference of ``h`` and of the scores from the one-CTA kernel's, relative to their
largest magnitude (the one-CTA kernel is the one the tests hold to the oracle; the sums differ
only in their grouping), then the median of 21 timings of 5 calls and the fraction of each
design's floor (bytes over the copy bandwidth measured in the same run: the partial's windows
about 1.25x, the state once or twice, ``h`` once).

``--backward`` does the same for the backward's state pass (``phase2_cluster_backward_state``
against ``mosaic_gpu.phase2_backward_state``: every output's difference; the floor: the partial's
windows, the state once or twice, ``d_acc`` once, a bf16 ``dh`` once).

Run on the GPU: ``python benchmarks/mgpu/time_cluster_forward.py [--backward] [--base-only] [--only TEXT]``; ``--aot``
compiles every variant for an H200 on a machine without one (JAX's CUDA plugin on
``PYTHONPATH``, ``msar_jax.deviceless_gpu``): Mosaic GPU's lowering and ptxas, not the launch. The ``st.async``
exchanges (``"all"``, ``"butterfly"``) fail at launch on an H100 and leave the process's GPU unusable, so
run them one per process (``--only``). On an H100 the pull forms are exact and slower than the
one-CTA kernels (docs/kernels.md)."""
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # time_phase2's inputs
if "--aot" in sys.argv:  # before jax starts: the CUDA plugin's deviceless topology
    from msar_jax import deviceless_gpu

    deviceless_gpu.prepare_gpu_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.depth_attention import mosaic_gpu, mosaic_gpu_cluster  # noqa: E402

KERNELS = (0, 4, 8, 12)
SHAPES = (("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048)))
KW = dict(stream_kernels=KERNELS, heads=1, eps=1e-6, gate_eps=1e-6, out_dtype=jnp.bfloat16)


def inputs(batch, t_len, d, key=0):
    """Random non-zero inputs (``time_phase2.inputs``)."""
    from time_phase2 import inputs as phase2_inputs

    return phase2_inputs(batch, t_len, d, KERNELS, key)


def variants(d, n_tiles):
    """(label, fn) per variant: the one-CTA kernel, then each cluster size that fits and exchange,
    one cluster per tile or ``persistent_programs`` clusters walking the ``n_tiles`` tiles."""
    out = [("one CTA (state twice)", lambda st, x, b, q, g: mosaic_gpu.phase2_fused_forward(
        st, x, b, q, True, g, None, fuse="gate", **KW))]
    for cluster in (8, 16):
        if d % (cluster * 2 * mosaic_gpu_cluster.BLOCK_D):
            continue
        most = mosaic_gpu_cluster.persistent_programs(n_tiles, cluster)
        for exchange in mosaic_gpu_cluster.EXCHANGES:
            for warpgroups in mosaic_gpu_cluster.WARPGROUPS:
                if mosaic_gpu_cluster.smem_bytes(d=d, cluster=cluster, stream_kernels=KERNELS, x_dtype=jnp.bfloat16,
                                                 acc_dtype=jnp.float32, out_dtype=jnp.bfloat16, exchange=exchange,
                                                 warpgroups=warpgroups) > mosaic_gpu.SMEM_BYTES:
                    continue
                for programs in (None, most):  # one cluster per tile, or one per group of G SMs walking them
                    label = f"cluster {cluster:2d} {exchange:9s} {warpgroups} wg" + (
                        f", {programs} walking" if programs else "")
                    out.append((label, (lambda c, e, p, w: lambda st, x, b, q, g: (
                        mosaic_gpu_cluster.phase2_cluster_forward(
                            st, x, b, q, True, g, None, cluster=c, exchange=e, programs=p, warpgroups=w,
                            unverified_exchange=True, **KW)))(cluster, exchange, programs, warpgroups)))
    return out


def floor_bytes(batch, t_len, d, state_reads: int) -> int:
    tok, m = batch * t_len, len(KERNELS)
    return tok * d * 2 * 1.25 + state_reads * m * tok * d * 4 + tok * d * 2 + 2 * m * tok * 4


def backward_inputs(batch, t_len, d, key=0):
    """The state pass's inputs: the forward's (``inputs``), random merge coefficients and a bf16 ``dh``."""
    state, partial, bank, _, gate = inputs(batch, t_len, d, key)
    keys = jax.random.split(jax.random.key(key + 1), 4)
    coef = [jax.random.uniform(k, (len(KERNELS), batch, t_len, 1), minval=0.1) for k in keys[:3]]
    dh = jax.random.normal(keys[3], (batch, t_len, d), jnp.bfloat16)
    return partial, bank, *coef, state.acc, dh, gate, None  # no segment ids, as the model's `base` step


def backward_variants(d, n_tiles):
    """(label, fn) per variant of the backward's state pass: the one-CTA kernel, then each cluster
    (the pull exchange) that fits, with one or two warpgroups, one cluster per tile or walking."""
    kw = dict(stream_kernels=KERNELS, heads=1, gate_eps=1e-6)
    out = [("one CTA (state twice)", lambda *a: mosaic_gpu.phase2_backward_state(*a, **kw))]
    cluster = mosaic_gpu_cluster.cluster_size(d)
    most = mosaic_gpu_cluster.persistent_programs(n_tiles, cluster)
    for warpgroups in mosaic_gpu_cluster.BWD_WARPGROUPS:
        if d % (cluster * warpgroups * mosaic_gpu_cluster.BLOCK_D) or mosaic_gpu_cluster.backward_smem_bytes(
                d=d, cluster=cluster, stream_kernels=KERNELS, x_dtype=jnp.bfloat16, acc_dtype=jnp.float32,
                dh_dtype=jnp.bfloat16, warpgroups=warpgroups) > mosaic_gpu.SMEM_BYTES:
            continue
        for programs in (None, most):
            label = f"cluster {cluster:2d} pull      {warpgroups} wg" + (f", {programs} walking" if programs else "")
            out.append((label, (lambda p, w: lambda *a: mosaic_gpu_cluster.phase2_cluster_backward_state(
                *a, cluster=cluster, programs=p, warpgroups=w, **kw))(programs, warpgroups)))
    return out


def backward_floor_bytes(batch, t_len, d, state_reads: int) -> int:
    tok, m = batch * t_len, len(KERNELS)
    return tok * d * 2 * 1.25 + (state_reads + 1) * m * tok * d * 4 + tok * d * 2 + 6 * m * tok * 4


def compile_variants(shapes, make_inputs, make_variants) -> int:
    """Compiles ``make_variants(d, n_tiles)``'s functions on ``make_inputs(batch, t_len, d)``'s
    shapes for an H200 (deviceless, ``msar_jax.deviceless_gpu``); returns the number that failed."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from msar_jax import deviceless_gpu

    mesh = deviceless_gpu.gpu_mesh("h200")
    failures = 0
    for name, (batch, t_len, d) in shapes:
        args = jax.eval_shape(lambda: make_inputs(batch, t_len, d))
        for label, fn in make_variants(d, batch * t_len // 64):
            try:
                with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                    jax.jit(fn, out_shardings=NamedSharding(mesh, P())).lower(*args).compile()
                print(f"{name} {label}: compiled for the H200", flush=True)
            except Exception as e:  # noqa: BLE001
                failures += 1
                print(f"{name} {label}: FAILED {type(e).__name__}: {str(e)[:600]}", flush=True)
    return failures


def time_variants(shapes, make_inputs, make_variants, floor_ms, title="", what="h, dots, sumsq", only=None):
    """Per shape, each of ``make_variants(d, n_tiles)``'s functions (the first is the baseline):
    every output's largest difference from the baseline's, relative to its largest magnitude,
    the median of 21 timings of 5 calls, and ``floor_ms(batch, t_len, d, label)`` as a fraction
    of it. ``only``: the baseline and the variants whose label holds it."""
    from pallas_kernels.depth_attention import bench

    for name, (batch, t_len, d) in shapes:
        args = make_inputs(batch, t_len, d)
        all_variants = make_variants(d, batch * t_len // 64)
        want = jax.tree.leaves(jax.jit(all_variants[0][1])(*args))
        scale = lambda a: float(jnp.max(jnp.abs(a.astype(jnp.float32))))  # noqa: E731
        print(f"## {name}{title}: B x T = {batch} x {t_len}, d = {d}", flush=True)
        for k, (label, fn) in enumerate(all_variants):
            if only and only not in label and k:
                continue
            try:
                f = jax.jit(fn)
                got = jax.tree.leaves(f(*args))
                errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32)))) / max(scale(w), 1e-30)
                        for g, w in zip(got, want)]
                ms = bench.timeit(f, *args, reps=21, inner=5)[0] * 1e3
                floor = floor_ms(batch, t_len, d, label)
                print(f"{label:40s} {ms:8.4f} ms  floor {floor:.4f} ({floor / ms:6.1%})  rel diff ({what}) "
                      + " ".join(f"{e:.1e}" for e in errs), flush=True)
            except Exception:  # noqa: BLE001
                print(f"{label:40s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)


def main(argv):
    """``--base-only``: `base`'s shape alone; ``--only TEXT``: the one-CTA kernel and the variants
    whose label holds TEXT (a failed launch leaves the process's GPU unusable: one per process)."""
    shapes = SHAPES[:1] if "--base-only" in argv else SHAPES
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    backward = "--backward" in argv
    make_inputs = backward_inputs if backward else inputs
    make_variants = backward_variants if backward else variants
    if "--aot" in argv:
        return 1 if compile_variants(shapes, make_inputs, make_variants) else 0
    from pallas_kernels.depth_attention import bench

    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {jax.devices()[0].device_kind}", flush=True)

    def floor_ms(batch, t_len, d, label):
        reads = 2 if label.startswith("one") else 1
        return (backward_floor_bytes if backward else floor_bytes)(batch, t_len, d, reads) / bw * 1e3

    time_variants(shapes, make_inputs, make_variants, floor_ms, " backward state pass" if backward else "",
                  "every output" if backward else "h, dots, sumsq", only)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
