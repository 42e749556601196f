"""Phase 2's gated Mosaic kernels with the state's second read in the same chunk order as the
first or in reverse (``mosaic_gpu.REREAD_ORDERS``): the fused forward
(``phase2_fused_forward``: pass B reads the state for the gate's statistics, pass C again for
``h``) and the backward's state kernel (``phase2_backward_state``: pass 1 for the gate's
statistics, pass 2 for ``d_acc``). Reversed, the chunks a program read last are the first it
reads again, while they may still be in L2. MSAR's kernels (0, 4, 8, 12), gate, bf16 partial
(and ``h`` / ``dh``), float32 state; `base`'s shape (B x T = 64 x 1024, d = 1024) and the
bench shape (8 x 2048, d = 2048).

Per kernel and shape the two orders run alternately, ``--rounds`` times (default 3), each a
median of 21 timings of 5 calls, so that drift between timings falls on both; printed: each
timing, each order's median over its rounds, the reverse's ratio to the same order, whether
the outputs are the same bits (the forward's ``h`` and scores, the state kernel's ``d_acc`` and
gate rows; its per-token sums add their chunks in the other order: their largest relative
difference), and the floors: the bytes the kernel moves with the state read twice and read once,
over the copy bandwidth measured in the same run. Also the device's L2 size (the CUDA driver's
attribute).

Run on the GPU: ``python benchmarks/mgpu/time_reread_order.py [--base-only] [--rounds N]
[--forward-only | --state-only]``; ``--aot`` compiles both orders of both kernels for an H200 on a
machine without one (JAX's CUDA plugin on ``PYTHONPATH``, ``msar_jax.deviceless_gpu``)."""

from __future__ import annotations

import ctypes
import statistics
import sys

if "--aot" in sys.argv:  # before jax starts: the CUDA plugin's deviceless topology
    from msar_jax import deviceless_gpu

    deviceless_gpu.prepare_gpu_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.depth_attention import mosaic_gpu, reference  # noqa: E402

KERNELS = (0, 4, 8, 12)
SHAPES = (("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048)))
KW = dict(stream_kernels=KERNELS, heads=1)


def operands(batch, t_len, d):
    """Random non-zero operands of both kernels: the state, the partial, its bank, the query, the
    gate, the merge's coefficients (a, b, the phase-1 denominator) and ``h``'s cotangent."""
    m = len(KERNELS)
    k = jax.random.split(jax.random.key(0), 12)
    x = jax.random.normal(k[0], (batch, t_len, d), jnp.bfloat16)
    bank = 0.3 * jax.random.normal(k[1], (sum(KERNELS), d))
    q = jax.random.normal(k[2], (m, d))
    state = reference.SoftmaxState(jax.random.normal(k[3], (m, batch, t_len, 1)),
                                   jnp.exp(jax.random.normal(k[4], (m, batch, t_len, 1))),
                                   jax.random.normal(k[5], (m, batch, t_len, d)))
    gate = (jax.random.normal(k[6], (m * d, m)) / (m * d) ** 0.5, jnp.float32(0.7), jax.random.normal(k[7], (m,)))
    coef = tuple(jax.random.uniform(k[8 + i], (m, batch, t_len, 1), minval=0.1) for i in range(3))
    dh = jax.random.normal(k[11], (batch, t_len, d), jnp.bfloat16)
    return state, x, bank, q, gate, coef, dh


def forward(order):
    def run(state, x, bank, q, gate, coef, dh):
        h, scores = mosaic_gpu.phase2_fused_forward(state, x, bank, q, True, gate, None, fuse="gate", eps=1e-6,
                                                    gate_eps=1e-6, out_dtype=jnp.bfloat16, reread_order=order, **KW)
        return (h, scores), ()

    return run


def state_kernel(order):
    def run(state, x, bank, q, gate, coef, dh):
        d_acc, sums, gate_rows = mosaic_gpu.phase2_backward_state(x, bank, *coef, state.acc, dh, gate, None,
                                                                  gate_eps=1e-6, reread_order=order, **KW)
        return (d_acc, gate_rows), sums

    return run


def floor_bytes(kernel: str, batch, t_len, d, state_reads: int) -> int:
    """The bytes ``kernel`` moves with the state read ``state_reads`` times: the forward reads the
    partial three times (passes A-C) and writes ``h``; the state kernel reads the partial and
    ``dh`` twice and writes ``d_acc`` (float32) and its per-token rows."""
    tok, m = batch * t_len, len(KERNELS)
    state, x = m * tok * d * 4, tok * d * 2
    if kernel == "forward":
        return state_reads * state + 3 * x + x
    return state_reads * state + 2 * (x + x) + state + tok * (3 * m + 3 * m + 2) * 4


def l2_bytes() -> int | None:
    """The first device's L2 size from the CUDA driver (``CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE``)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, value = ctypes.c_int(), ctypes.c_int()
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
            return None
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), 38, dev):
            return None
        return value.value
    except OSError:
        return None


KERNEL_BUILDERS = {"forward": forward, "state kernel": state_kernel}


def main(argv) -> int:
    shapes = SHAPES[:1] if "--base-only" in argv else SHAPES
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    kernels = dict(KERNEL_BUILDERS)
    if "--forward-only" in argv:
        kernels.pop("state kernel")
    if "--state-only" in argv:
        kernels.pop("forward")
    if "--aot" in argv:
        from time_cluster_forward import compile_variants

        variants = lambda d, n_tiles: [(f"{k} {o}", lambda *a, k=k, o=o: kernels[k](o)(*a))  # noqa: E731
                                       for k in kernels for o in mosaic_gpu.REREAD_ORDERS]
        return 1 if compile_variants(shapes, operands, variants) else 0
    from pallas_kernels.depth_attention import bench

    bw = bench.copy_bandwidth()
    l2 = l2_bytes()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {jax.devices()[0].device_kind}; L2 "
          + (f"{l2 / 2**20:.1f} MiB" if l2 else "unknown"), flush=True)
    for name, (batch, t_len, d) in shapes:
        args = operands(batch, t_len, d)
        for kernel, build in kernels.items():
            fns = {order: jax.jit(build(order)) for order in mosaic_gpu.REREAD_ORDERS}
            outs = {order: fn(*args) for order, fn in fns.items()}
            (same_exact, same_sums), (rev_exact, rev_sums) = outs["same"], outs["reverse"]
            bits = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(same_exact),
                                                                     jax.tree.leaves(rev_exact)))
            sums_diff = max([float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(a)), 1e-30))
                             for a, b in zip(jax.tree.leaves(same_sums), jax.tree.leaves(rev_sums))] or [0.0])
            times = {order: [] for order in fns}
            for _ in range(rounds):
                for order, fn in fns.items():
                    times[order].append(bench.timeit(fn, *args, reps=21, inner=5)[0] * 1e3)
            floors = [floor_bytes(kernel, batch, t_len, d, reads) / bw * 1e3 for reads in (2, 1)]
            med = {order: statistics.median(t) for order, t in times.items()}
            print(f"## {name} {kernel}: B x T = {batch} x {t_len}, d = {d}; floor {floors[0]:.4f} ms (state "
                  f"read twice), {floors[1]:.4f} (once)", flush=True)
            for order, t in times.items():
                print(f"{order:8s} " + " ".join(f"{v:.4f}" for v in t) + f"  median {med[order]:.4f} ms "
                      f"({floors[0] / med[order]:.1%} of the two-read floor)", flush=True)
            print(f"reverse / same {med['reverse'] / med['same']:.4f}; same bits: {bits}; per-token sums' "
                  f"largest relative difference {sums_diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    sys.exit(main(sys.argv[1:]))
