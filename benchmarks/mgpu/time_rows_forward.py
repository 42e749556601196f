"""Phase 2's forward with whole channel rows per program (``rows_forward``, the state read once)
against the one-CTA Mosaic GPU kernel (``mosaic_gpu.phase2_fused_forward``, the state read twice),
MSAR (kernels (0, 4, 8, 12), gate, float32 or bf16 state, bf16 partial and ``h``) at `base`'s shape
(B x T = 64 x 1024, d = 1024) and the bench shape (8 x 2048, d = 2048). Per variant (tokens per
program x warps): the largest difference of ``h`` and of the scores from the Mosaic kernel's,
relative to their largest magnitude (the Mosaic kernel is the one the tests hold to the oracle),
then the median of 21 timings of 5 calls and the fraction of each design's floor (bytes over the
copy bandwidth measured in the same run: the partial about 1.25x, the state once or twice, ``h``
once).

Run on the GPU: ``python benchmarks/mgpu/time_rows_forward.py [--base-only] [--bf16-state] [--mean]
[--kernels 0,0,0,0]``;
``--aot`` compiles every variant for an H200 on a machine without one (JAX's CUDA plugin on
``PYTHONPATH``, ``msar_jax.deviceless_gpu``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # time_phase2's inputs
if "--aot" in sys.argv:  # before jax starts: the CUDA plugin's deviceless topology
    from msar_jax import deviceless_gpu

    deviceless_gpu.prepare_gpu_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import time_cluster_forward  # noqa: E402  (its compile and timing loops)
from pallas_kernels.depth_attention import mosaic_gpu, rows_forward  # noqa: E402

KERNELS = (0, 4, 8, 12)
SHAPES = (("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048)))
KW = dict(stream_kernels=KERNELS, heads=1, eps=1e-6, gate_eps=1e-6, out_dtype=jnp.bfloat16)
FUSE = "gate"
TILES = ((1, 1), (1, 2), (2, 1), (2, 2), (2, 4), (4, 2), (4, 4), (8, 4), (8, 8))  # (tokens, warps) per program


def inputs(batch, t_len, d, key=0, bf16_state=False):
    """Random non-zero inputs (``time_phase2.inputs``); ``bf16_state``: the state's ``acc`` in bf16."""
    from time_phase2 import inputs as phase2_inputs

    state, x, bank, q, gate = phase2_inputs(batch, t_len, d, KERNELS, key)
    if bf16_state:
        state = state._replace(acc=state.acc.astype(jnp.bfloat16))
    return state, x, bank, q, gate


def variants(d):
    """(label, fn) per variant: the Mosaic kernel, then each rows tile whose z fits 255 registers."""
    label = "mosaic one CTA" + (" (state twice)" if FUSE == "gate" else "")  # mean fusion reads it once
    out = [(label, lambda st, x, b, q, g: mosaic_gpu.phase2_fused_forward(
        st, x, b, q, True, g if FUSE == "gate" else None, None, fuse=FUSE, **KW))]
    for bt, warps in TILES:
        for early in (False, True):
            if (1 + early) * len(KERNELS) * bt * d // (32 * warps) > 160:  # z (and acc) past 160 registers: spills
                continue
            out.append((f"rows {bt:2d} tokens {warps:2d} warps{' early' if early else ''}",
                        (lambda bt, w, e: lambda st, x, b, q, g: rows_forward.phase2_rows_forward(
                            st, x, b, q, True, g if FUSE == "gate" else None, None, fuse=FUSE, block_t=bt,
                            num_warps=w, early_state=e,
                            **KW))(bt, warps, early)))
    return out


def floor_bytes(batch, t_len, d, state_reads: int, state_bytes: int = 4) -> int:
    tok, m = batch * t_len, len(KERNELS)
    return tok * d * 2 * 1.25 + state_reads * m * tok * d * state_bytes + tok * d * 2 + 2 * m * tok * 4


def main(argv):
    """``--base-only``: `base`'s shape alone; ``--only TEXT``: the Mosaic kernel and the variants
    whose label holds TEXT; ``--mean``: mean fusion (no gate, so no ``W``);
    ``--kernels 0,0,0,0``: other streams (all identity: no taps, no lag rows). The last two
    take the per-channel constants out one by one (to find what holds the rows kernel back)."""
    global KERNELS, FUSE
    shapes = SHAPES[:1] if "--base-only" in argv else SHAPES
    if "--kernels" in argv:
        KERNELS = tuple(int(k) for k in argv[argv.index("--kernels") + 1].split(","))
        KW["stream_kernels"] = KERNELS
    FUSE = "mean" if "--mean" in argv else "gate"
    if "--aot" in argv:
        rows_only = lambda d, n_tiles: variants(d)[1:]  # noqa: E731  (the Mosaic kernel: time_phase2)
        return 1 if time_cluster_forward.compile_variants(shapes, inputs, rows_only) else 0
    from pallas_kernels.depth_attention import bench

    bf16_state = "--bf16-state" in argv
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {jax.devices()[0].device_kind}; state "
          f"{'bf16' if bf16_state else 'float32'}; kernels {KERNELS}, fuse={FUSE}", flush=True)

    def floor_ms(batch, t_len, d, label):
        reads = 2 if label.startswith("mosaic") and FUSE == "gate" else 1  # mean fusion: no gate pass
        return floor_bytes(batch, t_len, d, reads, 2 if bf16_state else 4) / bw * 1e3

    time_cluster_forward.time_variants(
        shapes, lambda batch, t_len, d: inputs(batch, t_len, d, bf16_state=bf16_state),
        lambda d, n_tiles: variants(d), floor_ms, only=argv[argv.index("--only") + 1] if "--only" in argv else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
