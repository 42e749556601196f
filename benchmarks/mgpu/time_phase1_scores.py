"""Phase 1's scoring pass on the GPU: Triton's ``fused.scores_call`` (the tiles
``tiling.choose_tiles`` gives it) against the Mosaic GPU kernel ``mosaic_gpu.phase1_scores``
with each way of building the streams (``mosaic_gpu.EXPANDS``) and, for the shared one, each
placement of the lag windows (``mosaic_gpu.WINDOWS``). Shapes: `base`'s last block
(B x T = 64 x 1024, d = 1024, S = 8 targets, 7 stacked sources of which ``--live`` (default 4)
are valid, as the model's blocks run it) and the bench shape (8 x 2048, d = 2048, S = 8, all 9
sources). MSAR's kernels (0, 4, 8, 12), one head, bf16 sources. Median of 21 timings of 3 calls
each after warm-up (``bench.timeit``); the error of the Mosaic outputs against Triton's,
relative to their largest magnitude; the floor: the live sources read once at the measured
copy bandwidth (the pass is compute-bound well above it). Run on the GPU:
``python benchmarks/mgpu/time_phase1_scores.py [--base-only]``; ``--chunks``: the padded
windows with 32- and 64-channel chunks; ``--bd16``: with 32- and 16-channel chunks; ``--attnres``:
AttnRes's single stream (kernels ``(0,)``, no bank), Triton against the Mosaic default and the
Mosaic kernel with its sums reduced per chunk and deferred (``defer_sums``);
``--slots``: the Mosaic kernel with 2, 3 and 4 channel chunks in flight (``n_slots``) and
32-, 64- (and for one stream 128-) channel chunks; ``--wide`` (with ``--attnres``):
128- against 256-channel chunks; ``--store-groups``: the default with its two stores per source committed once and once each
(``mosaic_gpu.STORE_GROUPS``). ``--heads H``: H channel heads (MHAR: ``--attnres --heads 8``)."""
import sys
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import bench, fused, mosaic_gpu, tiling
from time_phase2 import set_store_groups  # this folder, on the path when run as a script

KERNELS = (0,) if "--attnres" in sys.argv else (0, 4, 8, 12)
HEADS = int(sys.argv[sys.argv.index("--heads") + 1]) if "--heads" in sys.argv else 1  # MHAR: --attnres --heads 8


def phase1_inputs(n, n_live, batch, t_len, d, n_targets):
    """Random ``(sources[n, B, T, d] bf16, banks[n, K, d], queries[S, m, d], valid[n])`` with the
    first ``n_live`` sources valid (the model's blocks stack all their sources and rule out the
    later ones)."""
    k = jax.random.split(jax.random.key(0), 3)
    sources = jax.random.normal(k[0], (n, batch, t_len, d), jnp.bfloat16)
    banks = 0.3 * jax.random.normal(k[1], (n, sum(KERNELS), d), jnp.float32) if any(KERNELS) else None
    queries = jax.random.normal(k[2], (n_targets, len(KERNELS), d), jnp.float32)
    return sources, banks, queries, jnp.arange(n) < n_live


def main():
    live = int(sys.argv[sys.argv.index("--live") + 1]) if "--live" in sys.argv else 4
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    shapes = (("base", (7, live, 64, 1024, 1024, 8)), ("issue", (9, 9, 8, 2048, 2048, 8)))
    for name, (n, n_live, batch, t_len, d, n_targets) in shapes[:1] if "--base-only" in sys.argv else shapes:
        m = len(KERNELS)
        sources, banks, queries, valid = phase1_inputs(n, n_live, batch, t_len, d, n_targets)
        floor_ms = n_live * batch * t_len * d * 2 / bw * 1e3
        tiles = tiling.choose_tiles(d=d, heads=HEADS, max_kernel=max([1, *KERNELS]), n_targets=n_targets, backend="triton",
                                    n_streams=m)
        t_pad, _ = fused._prepare(t_len, None, tiles)

        def triton(x, b, q, v):
            dots, sumsq = fused.scores_call(fused._pad_t(x, 2, t_pad), b, q, None, stream_kernels=KERNELS, heads=HEADS,
                                            tiles=tiles, backend="triton", interpret=False, valid=v)
            return dots[..., :t_len, :], sumsq[..., :t_len]

        variants = {"triton": triton}
        forms = [(ex, "per_lag") for ex in mosaic_gpu.EXPANDS] + [("shared", "aligned")]
        if "--single" in sys.argv:  # aligned against one window per chunk (Lane semantics)
            variants, forms = {}, [("shared", "aligned"), ("shared", "single")]  # no tile buffers here
        if "--padded" in sys.argv:  # the one window with 80-byte rows
            variants, forms = {}, [("shared", "aligned"), ("shared", "padded")]
        chunk_sizes = (None,)
        if "--chunks" in sys.argv:  # the padded window with 32- and 64-channel chunks
            variants, forms, chunk_sizes = {}, [("shared", "padded")], (32, 64)
        if "--bd16" in sys.argv:  # the padded windows with 32- and 16-channel chunks
            variants, forms, chunk_sizes = {}, [("shared", "padded")], (32, 16)
        if "--attnres" in sys.argv:  # one stream: Triton, the Mosaic default, and with its sums deferred
            forms = []  # the default windows ("padded") and expansion ("shared")
            for defer in (False, True):
                variants[f"mosaic padded defer_sums={defer}"] = (lambda df: lambda x, b, q, v: mosaic_gpu.phase1_scores(
                    x, b, q, None, v, stream_kernels=KERNELS, heads=HEADS, defer_sums=df))(defer)
        if "--slots" in sys.argv:  # chunks in flight x channel chunk; Triton first as the baseline
            forms = []
            chunks = (32, 64, 128) if KERNELS == (0,) else (32, 64)  # 4 streams of 128: 256 registers of E alone
            for bd in chunks:
                for slots in (2, 3, 4):
                    variants[f"mosaic slots={slots} bd={bd}"] = (lambda ns, b_d: lambda x, b, q, v: (
                        mosaic_gpu.phase1_scores(x, b, q, None, v, stream_kernels=KERNELS, heads=HEADS, n_slots=ns,
                                                 block_d=b_d)))(slots, bd)
        if "--wide" in sys.argv:  # one stream: 128- against 256-channel chunks, 2 slots
            variants, forms = {k: v for k, v in variants.items() if k == "triton"}, []
            for bd in (128, 256):
                variants[f"mosaic bd={bd}"] = (lambda b_d: lambda x, b, q, v: mosaic_gpu.phase1_scores(
                    x, b, q, None, v, stream_kernels=KERNELS, heads=HEADS, block_d=b_d))(bd)
        if "--store-groups" in sys.argv:
            variants, forms = {}, []
            for grouped in (True, False):
                variants[f"mosaic stores {'grouped' if grouped else 'one by one'}"] = (
                    lambda g: lambda x, b, q, v: (set_store_groups(g), mosaic_gpu.phase1_scores(
                        x, b, q, None, v, stream_kernels=KERNELS, heads=HEADS))[1])(grouped)
        for expand, windows in forms:
            for bd in chunk_sizes:
                label = f"mosaic {expand} {windows}" + (f" bd={bd}" if bd else "")
                variants[label] = (lambda ex, w, bd: lambda x, b, q, v: mosaic_gpu.phase1_scores(
                    x, b, q, None, v, stream_kernels=KERNELS, heads=HEADS, expand=ex, windows=w, block_d=bd))(
                    expand, windows, bd)
        print(f"## {name}: {n} sources ({n_live} valid), S = {n_targets}, B x T = {batch} x {t_len}, d = {d}; "
              f"floor {floor_ms:.4f} ms", flush=True)
        want = None
        for label, fn in variants.items():
            try:
                f = jax.jit(fn)
                got = f(sources, banks, queries, valid)
                if want is None:
                    want, err = got, 0.0
                else:
                    err = max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in zip(got, want))
                ms = bench.timeit(f, sources, banks, queries, valid, reps=21, inner=3)[0] * 1e3
                print(f"{label:28s} {ms:8.3f} ms  {floor_ms / ms:6.1%} of floor  rel err vs triton {err:.1e}",
                      flush=True)
            except Exception:  # noqa: BLE001
                print(f"{label:28s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
