"""What a TMA copy costs on the H200: per copy, or per byte / row? The measurement behind the
lag windows' placement (``mosaic_gpu.KERNEL_WINDOWS``; docs/kernels.md): copies cost bytes, not
copies.

The Mosaic GPU kernels with one window per lag are bound by their small TMA copies (about 0.17-0.21 us
per copy per SM, whatever the copy's size: 16-channel chunks ran no faster per item than 32).
Whether the cost is per copy (then merging copies pays: the state's ``m`` streams in one 3D box,
two chunks' windows in one box) or per row / byte (then only fewer rows pay) decides what to
build. This script times copies alone: a grid of (8 batch rows x 32 token tiles), one
warpgroup per program as in the kernels, each program streaming ``steps`` groups of copies
through a 2-slot ring of shared memory (wait on a slot's barrier, then refill it), nothing
computed. Each variant is a list of boxes per step; every variant moves the same rows and
bytes per program as the kernels' chunk loops do, or says it does not.

Prints per variant: the median time of 20 runs, copies and bytes per program, the time per
copy per SM (time x 132 SMs / programs / copies per program) and the bandwidth.
Run: ``python benchmarks/mgpu/tma_rate.py`` (GPU); ``--interpret`` runs each variant once in
Pallas' Mosaic GPU interpret mode on tiny shapes (a smoke test of the harness)."""
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.depth_attention import bench

SMS = 132  # the H200's streaming multiprocessors


def variants():
    """name -> (steps, [(array, box rows, box channels, leading dim or None)] per step). ``array``:
    "x" (bf16 ``[B, T + 32, d]``) or "acc" (f32 ``[4, B, T, d]``). The steps are chosen so that
    variants meant to be compared move the same bytes."""
    win = [("x", 72, 32, None)] * 4 + [("x", 64, 32, None)] * 4  # aligned windows of one 32-channel chunk
    return {
        # the phase-2 / scoring-pass lag windows: 8 copies of 32 channels per chunk, 64 chunks
        "windows 8 x [72|64, 32] bf16, 64 chunks": (64, win),
        # the same bytes in half the copies: two chunks' windows per copy
        "windows 8 x [72|64, 64] bf16, 32 chunk pairs": (32, [(a, r, 64, n) for a, r, _, n in win]),
        # the same rows per copy, half the bytes (16 channels): per-row cost would show as no gain
        "windows 8 x [72|64, 16] bf16, 64 chunks": (64, [(a, r, 16, n) for a, r, _, n in win]),
        # one window of all 75 rows (what unaligned loads would allow), 1 copy per chunk
        "window 1 x [80, 32] bf16, 64 chunks": (64, [("x", 80, 32, None)]),
        # the state's chunk: one copy per stream, or one 3D box for all 4 streams
        "state 4 x [64, 32] f32, 64 chunks": (64, [("acc", 64, 32, None)] * 4),
        "state 1 x [4, 64, 32] f32, 64 chunks": (64, [("acc", 64, 32, 4)]),
        # a phase-2 chunk of passes B / C: windows + taps-like + state, as now and with the 3D state box
        "windows + 4 state copies, 64 chunks": (64, win + [("acc", 64, 32, None)] * 4),
        "windows + 1 state box, 64 chunks": (64, win + [("acc", 64, 32, 4)]),
    }


def build(steps, boxes, *, batch, t_len, d, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bt = 64
    n_t = t_len // bt
    shapes = []
    for arr, rows, cols, lead in boxes:
        dtype = jnp.bfloat16 if arr == "x" else jnp.float32
        shapes.append(((lead, rows, cols) if lead else (rows, cols), dtype))

    def body(x_ref, acc_ref, out_ref, *scratch):
        bufs, bar, done_s = scratch[:-2], scratch[-2], scratch[-1]
        b, t = jax.lax.axis_index("b"), jax.lax.axis_index("t")
        t0 = t * bt

        def fetch(step, slot):
            for k, ((arr, rows, cols, lead), buf) in enumerate(zip(boxes, bufs)):
                cs = pl.ds(step * cols, cols)
                if arr == "x":
                    src = x_ref.at[b, pl.ds(t0 + 8 * (k % 3), rows), cs]  # rows start at various offsets
                elif lead:
                    src = acc_ref.at[pl.ds(0, lead), b, pl.ds(t0, rows), cs]
                else:
                    src = acc_ref.at[k % 4, b, pl.ds(t0, rows), cs]
                plgpu.copy_gmem_to_smem(src, buf.at[slot], bar.at[slot])

        fetch(0, 0)
        if steps > 1:
            fetch(1, 1)

        def step(i, carry):
            slot = jax.lax.rem(i, 2)
            plgpu.barrier_wait(bar.at[slot])

            @pl.when(i + 2 < steps)
            def _():
                fetch(i + 2, slot)

            return carry

        jax.lax.fori_loop(0, steps, step, 0)
        done_s[...] = jnp.full((128,), 1.0, jnp.float32)  # a row per program, so the copies are not dead code
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(done_s, out_ref.at[b, t])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((2, *shape), dtype) for shape, dtype in shapes]
    scratch += [plgpu.Barrier(num_arrivals=len(boxes), num_barriers=2), plgpu.SMEM((128,), jnp.float32)]
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((batch, n_t, 128), jnp.float32), grid=(batch, n_t),
                          grid_names=("b", "t"), scratch_types=scratch,
                          interpret=plgpu.InterpretGPUParams() if interpret else False)
    return jax.jit(kernel)


def main():
    interpret = "--interpret" in sys.argv
    batch, t_len, d = (1, 128, 2048) if interpret else (8, 2048, 2048)
    x = jnp.ones((batch, t_len + 32, d), jnp.bfloat16)
    acc = jnp.ones((4, batch, t_len, d), jnp.float32)
    programs = batch * (t_len // 64)
    print(f"{'variant':50s} {'ms':>8s} {'copies':>7s} {'KB/prog':>8s} {'us/copy/SM':>11s} {'GB/s':>7s}", flush=True)
    for name, (steps, boxes) in variants().items():
        if interpret:
            steps = min(steps, 3)
        run = build(steps, boxes, batch=batch, t_len=t_len, d=d, interpret=interpret)
        out = run(x, acc)
        out.block_until_ready()
        assert float(jnp.min(out)) == 1.0
        ms = bench.timeit(run, x, acc, reps=1 if interpret else 20, inner=1, warmup=0)[0] * 1e3
        copies = steps * len(boxes)
        nbytes = steps * sum(r * c * (lead or 1) * (2 if a == "x" else 4) for a, r, c, lead in boxes)
        per_copy = ms * 1e3 * SMS / programs / copies
        print(f"{name:50s} {ms:8.3f} {copies:7d} {nbytes / 1024:8.0f} {per_copy:11.3f} "
              f"{programs * nbytes / ms / 1e6:7.0f}", flush=True)


if __name__ == "__main__":
    main()
