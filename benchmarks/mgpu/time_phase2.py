"""Phase 2's fused forward (merge + gate) on the GPU: the Triton form (``fused.phase2_forward``:
scoring, gate-statistics and gate calls with XLA between them) against the Mosaic GPU kernel
(``mosaic_gpu.phase2_fused_forward``) with each way of building the streams
(``mosaic_gpu.EXPANDS``) and, for the shared one, each placement of the lag windows
(``mosaic_gpu.WINDOWS``), at `base`'s shape (B x T = 64 x
1024, d = 1024) and the bench shape (8 x 2048, d = 2048); MSAR (kernels (0, 4, 8, 12), gate, float32
state) and AttnRes (kernels (0,), one stream). Median of 21 timings of 5 calls each after warm-up
(``bench.timeit``); the error of each output against the plain-jnp reference, relative to its
largest magnitude; the floor is the bytes the design must move (the partial read three times,
the state twice, ``h`` written) at the measured copy bandwidth. Run on the GPU:
``python benchmarks/mgpu/time_phase2.py``; with ``--profile``, the device time per op of phase
2's forward + Pallas backward at `base` with each ``gpu_kernels`` instead; with ``--backward``,
the whole Pallas backward with its passes 1-2 in Triton and in Mosaic GPU, with each
``mosaic_gpu.EXPANDS`` and ``mosaic_gpu.WINDOWS`` (``time_backward``;
``--backward-smoke`` runs that on the CPU in interpret mode at a tiny shape; with ``--rows`` or
``--inputs`` it can hang on a 2-core machine: one simulated warpgroup of the input kernel can wait at a
barrier forever while the other's jitted step never runs, in any of the forms). ``--base-only``:
`base`'s shape only; ``--msar-only``: no AttnRes rows. ``--state-boxes``: forward or backward,
only the Mosaic default (shared, aligned) with each ``mosaic_gpu.STATE_BOXES`` (the state's
chunk as one TMA copy per stream or one 3D box). ``--gate-stats``: the forward only, the Mosaic
default with each ``mosaic_gpu.GATE_STATS`` (the gate's statistics in their own pass or summed
in the scoring pass; with the default windows: ``mosaic_gpu.DEFAULT_GATE_STATS`` says why the
choice depends on them). ``--single``: forward or backward, the Mosaic default's aligned windows
against one window per chunk (``"single"``, Lane semantics), with its tile buffers
swizzled (``LANE_TILE_SWIZZLE``) and plain. ``--wide``: the backward, Mosaic passes 1-2 with
each ``fused_bwd_phase2.FORMS`` of pass 3 (the reverse-T input kernel, or the stream cotangents
written and transposed by ``conv_transpose``). ``--chunks``: forward or backward, the padded
windows with 32- and 64-channel chunks (``block_d``; for one stream also 128).
``--triton-tiles`` (with ``--attnres-only``): the forward's Triton form with its tiles and seven others (block_t x
scoring / mixing chunk, warps, stages). ``--attnres-only``: no MSAR rows.
``--attnres`` with ``--backward``: AttnRes's one stream (kernels ``(0,)``, mean fusion) instead of MSAR. ``--inputs``: the backward with pass 3 (the
reverse-T input kernel) in Triton and in Mosaic GPU (``mosaic_gpu.phase2_backward_inputs``, one
to four warpgroups per program; with ``--reuse`` two and three warpgroups loading each lag and
per-token row once per tile, ``INPUTS_REUSE_LOADS``). ``--rows``: the backward with pass 3 in Mosaic GPU (two
warpgroups, loads reused) walking 1, 2, 4 and 8 batch rows per program (``INPUTS_ROWS_PER_PROGRAM``).
``--split``: the forward as one Mosaic kernel, as the split form's two (``split=True``), and its
scores kernel alone (``h`` unused: XLA drops the second; the floor printed is the whole forward's).
``--state-rows``: the backward, all three passes in Mosaic GPU,
with the state kernel's sums stored through their own buffer and through its rows' buffer
(``mosaic_gpu.STATE_SUMS_IN_ROWS``: one or two programs per SM)."""
import collections
import os
import sys
import tempfile
import traceback

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import api, bench, fused, mosaic_gpu, reference, tiling

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from profile_step import device_op_events  # noqa: E402


def set_lane_tile_swizzle(on: bool):
    """``mosaic_gpu.LANE_TILE_SWIZZLE`` for the kernels built from now on (the built ones are
    dropped: the flag is not part of their cache keys)."""
    mosaic_gpu.LANE_TILE_SWIZZLE = on
    for build in (mosaic_gpu._kernel, mosaic_gpu._state_kernel, mosaic_gpu._scores_kernel, mosaic_gpu._mix_kernel):
        build.cache_clear()


def set_store_groups(on: bool):
    """``mosaic_gpu.STORE_GROUPS`` for phase 1's kernels built from now on (the built ones are
    dropped: the flag is not part of their cache keys)."""
    from pallas_kernels.depth_attention import mosaic_gpu_bwd1

    mosaic_gpu.STORE_GROUPS = on
    for build in (mosaic_gpu._scores_kernel, mosaic_gpu._mix_kernel, mosaic_gpu_bwd1._kernel):
        build.cache_clear()


PLAIN = "single, plain tiles"  # windows="single" with LANE_TILE_SWIZZLE off (a label, not a WINDOWS value)


def inputs(batch, t_len, d, kernels, key=0):
    m = len(kernels)
    k = jax.random.split(jax.random.key(key), 8)
    x = jax.random.normal(k[0], (batch, t_len, d), jnp.bfloat16)
    bank = 0.3 * jax.random.normal(k[1], (max(1, sum(kernels)), d), jnp.float32) if any(kernels) else None
    q = jax.random.normal(k[2], (m, d), jnp.float32)
    state = reference.SoftmaxState(jax.random.normal(k[3], (m, batch, t_len, 1)),
                                   jnp.exp(jax.random.normal(k[4], (m, batch, t_len, 1))),
                                   jax.random.normal(k[5], (m, batch, t_len, d)))
    gate = (jax.random.normal(k[6], (m * d, m)) / (m * d) ** 0.5, jnp.float32(0.7), jax.random.normal(k[7], (m,)))
    return state, x, bank, q, gate


def profile_fwd_bwd(shape=(64, 1024, 1024), kernels=(0, 4, 8, 12), steps=5):
    """Device time per op of phase 2 + gate, forward and Pallas backward through ``api.phase2_fused``
    (what the model runs), with each ``gpu_kernels``: ms per call, ops over 20 us."""
    batch, t_len, d = shape
    state, x, bank, q, gate = inputs(batch, t_len, d, kernels)
    ct = jnp.ones((batch, t_len, d), jnp.float32)
    for gpu_kernels in ("triton", "auto", "mosaic"):
        def loss(st, x, b, q, g, gk=gpu_kernels):
            h = api.phase2_fused(st, x, b, q, True, g, implementation="pallas_gpu", backward="pallas",
                                 stream_kernels=kernels, gpu_kernels=gk, out_dtype=jnp.bfloat16)
            return jnp.sum(h.astype(jnp.float32) * ct)

        # value_and_grad: the forward's outputs kept, as a model needs them (bench.run_config says why)
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        jax.block_until_ready(grad(state, x, bank, q, gate))
        trace_dir = tempfile.mkdtemp(prefix="trace_p2_")
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                out = grad(state, x, bank, q, gate)
            jax.block_until_ready(out)
        per_op = collections.Counter()
        for _, op, ns in device_op_events(trace_dir):
            per_op[op] += ns / steps / 1e6
        print(f"## fwd + bwd per op, gpu_kernels={gpu_kernels}: total {sum(per_op.values()):.3f} ms per call",
              flush=True)
        for op, ms in per_op.most_common():
            if ms > 0.02:
                print(f"  {ms:8.3f} ms  {op}", flush=True)


def time_backward(shapes=(("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048))), kernels=(0, 4, 8, 12),
                  interpret=False, reps=21, state_boxes=False):
    """Phase 2 + gate's whole Pallas backward (``fused_bwd_phase2.phase2_fused_backward``, from the
    forward's scores) with its statistics and ``d_acc`` passes in Triton (two kernels and XLA
    between them) and in Mosaic GPU (``mosaic_gpu.phase2_backward_state``); the rest (the
    reverse-T input kernel) is the same. Median ms per call and the largest difference between
    the two forms' gradients, relative to each gradient's largest magnitude. ``interpret``: a
    CPU smoke of this script at a tiny shape (no timing)."""
    from pallas_kernels.depth_attention import fused_bwd_phase2

    for name, (batch, t_len, d) in shapes:
        m = len(kernels)
        state, x, bank, q, gate = inputs(batch, t_len, d, kernels)
        gate = gate if m > 1 else None  # one stream (AttnRes): the mean of one stream, no gate
        dh = jax.random.normal(jax.random.key(7), (batch, t_len, d), jnp.float32)
        kw = dict(stream_kernels=kernels, heads=1, eps=1e-6, gate_eps=1e-6)
        _, scores = mosaic_gpu.phase2_fused_forward(state, x, bank, q, True, gate, None,
                                                    fuse="gate" if gate is not None else "mean",
                                                    interpret=interpret, **kw)
        tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(kernels), n_targets=1,
                                    backend="tpu" if interpret else "triton", n_streams=m)
        grads = {}
        forms = [("triton passes 1-2", False, None, None, None),
                 ("mosaic passes 1-2, shared windows, aligned", True, "shared", "aligned", None),
                 ("mosaic passes 1-2, shared windows, per lag", True, "shared", "per_lag", None),
                 ("mosaic passes 1-2, windows per stream, aligned", True, "per_stream", "aligned", None)]
        pass3 = {}  # label -> fused_bwd_phase2.FORMS value (default: its DEFAULT_FORM)
        if state_boxes:
            forms = [(f"mosaic passes 1-2, state boxes {sb}", True, "shared", "aligned", sb)
                     for sb in mosaic_gpu.STATE_BOXES]
        if "--single" in sys.argv:
            forms = [(f"mosaic passes 1-2, windows {w}", True, "shared", w, None) for w in ("aligned", "single", PLAIN)]
        if "--padded" in sys.argv:
            forms = [(f"mosaic passes 1-2, windows {w}", True, "shared", w, None) for w in ("single", "padded")]
        if "--wide" in sys.argv:
            forms = [(f"mosaic passes 1-2, pass 3 {form}", True, "shared", "padded", None)
                     for form in fused_bwd_phase2.FORMS]
            pass3 = {label: label.rsplit(" ", 1)[1] for label, *_ in forms}
        inputs_kernel = {}  # label -> pass 3's reverse-T input kernel in Mosaic GPU
        reuse_loads = {}  # label -> mosaic_gpu.INPUTS_REUSE_LOADS while it is traced
        if "--inputs" in sys.argv:  # pass 3 in Triton and in Mosaic GPU with 1-4 warpgroups
            kinds = ("triton", "mosaic 1 wg", "mosaic 2 wg", "mosaic 3 wg", "mosaic 4 wg")
            if "--reuse" in sys.argv:  # each lag and per-token row loaded once per tile
                kinds = ("mosaic 2 wg", "mosaic 2 wg reuse", "mosaic 3 wg reuse")
            forms = [(f"mosaic passes 1-2, pass 3 {k}", True, "shared", "padded", None) for k in kinds]
            inputs_kernel = {label: int(label.split(" wg")[0].split()[-1]) for label, *_ in forms if " wg" in label}
            reuse_loads = {label: label.endswith("reuse") for label, *_ in forms}
        rows_per_program = {}  # label -> mosaic_gpu.INPUTS_ROWS_PER_PROGRAM while it is traced
        if "--rows" in sys.argv:  # batch rows per program of the input kernel
            forms = [(f"mosaic passes 1-2, pass 3 mosaic 2 wg reuse, {k} rows per program", True, "shared", "padded",
                      None) for k in mosaic_gpu.INPUTS_ROWS_PER_PROGRAM_CHOICES]
            inputs_kernel = {label: 2 for label, *_ in forms}
            reuse_loads = {label: True for label, *_ in forms}
            rows_per_program = {label: int(label.rsplit(" rows", 1)[0].rsplit(" ", 1)[1]) for label, *_ in forms}
        chunks = {}  # label -> mosaic_gpu.BLOCK_D_CHOICES while it is traced
        if "--chunks" in sys.argv:  # 32- against 64-channel (and for one stream 128-) chunks
            forms = forms[:1] + [(f"mosaic passes 1-2, padded, bd={bd}", True, "shared", "padded", None)
                                 for bd in ((32, 64, 128) if m == 1 else (32, 64))]
            chunks = {label: (int(label.rsplit("=", 1)[1]),) for label, *_ in forms if "bd=" in label}
        sums_in_rows = {}  # label -> mosaic_gpu.STATE_SUMS_IN_ROWS while it is traced
        if "--state-rows" in sys.argv:  # the state kernel's sums in their own buffer or its rows'
            forms = [(f"mosaic passes 1-3, sums in rows {flag}", True, "shared", "padded", None)
                     for flag in (False, True)]
            sums_in_rows = {label: label.endswith("True") for label, *_ in forms}
            inputs_kernel = {label: 2 for label, *_ in forms}
        rows_default = mosaic_gpu.STATE_SUMS_IN_ROWS
        module_defaults = (mosaic_gpu.INPUTS_WARPGROUPS, mosaic_gpu.INPUTS_REUSE_LOADS,
                           mosaic_gpu.INPUTS_ROWS_PER_PROGRAM)
        for label, mosaic_state, expand, windows, boxes in forms:
            mosaic_gpu.STATE_SUMS_IN_ROWS = sums_in_rows.get(label, rows_default)
            set_lane_tile_swizzle(windows != PLAIN)
            windows = "single" if windows == PLAIN else windows
            # read when the kernel is traced (below)
            mosaic_gpu.DEFAULT_EXPAND, mosaic_gpu.DEFAULT_WINDOWS = expand or "shared", windows or "aligned"
            mosaic_gpu.DEFAULT_STATE_BOXES = boxes or "one"
            mosaic_gpu.BLOCK_D_CHOICES = chunks.get(label, (32,))
            form = pass3.get(label, fused_bwd_phase2.DEFAULT_FORM)
            mi = label in inputs_kernel
            mosaic_gpu.INPUTS_WARPGROUPS = inputs_kernel.get(label, 1)  # read when the kernel is traced
            mosaic_gpu.INPUTS_REUSE_LOADS = reuse_loads.get(label, False)
            mosaic_gpu.INPUTS_ROWS_PER_PROGRAM = rows_per_program.get(label, 1)
            f = jax.jit(lambda st, x, b, q, g, dh, sc, ms=mosaic_state, form=form, mi=mi: fused_bwd_phase2.phase2_fused_backward(
                st, x, b, q, True, g, None, dh, tiles=tiles, backend="interpret" if interpret else "triton",
                interpret=interpret, scores=sc, mosaic_state=ms, form=form, mosaic_inputs=mi, **kw))
            args = (state, x, bank, q, gate, dh, scores)
            grads[label] = f(*args)
            ms = float("nan") if interpret else bench.timeit(f, *args, reps=reps, inner=2)[0] * 1e3
            print(f"## {name} backward, {label}: {ms:.3f} ms per call", flush=True)
        mosaic_gpu.DEFAULT_EXPAND, mosaic_gpu.DEFAULT_WINDOWS, mosaic_gpu.DEFAULT_STATE_BOXES = "shared", None, "one"
        mosaic_gpu.BLOCK_D_CHOICES, mosaic_gpu.STATE_SUMS_IN_ROWS = (32,), rows_default
        (mosaic_gpu.INPUTS_WARPGROUPS, mosaic_gpu.INPUTS_REUSE_LOADS,
         mosaic_gpu.INPUTS_ROWS_PER_PROGRAM) = module_defaults
        first, *others = grads.items()
        for label, other in others:
            a, b = jax.tree.leaves(first[1]), jax.tree.leaves(other)
            errs = [(str(v.dtype), float(jnp.max(jnp.abs(u.astype(jnp.float32) - v.astype(jnp.float32))) /
                                         jnp.maximum(jnp.max(jnp.abs(v.astype(jnp.float32))), 1e-30)))
                    for u, v in zip(a, b)]
            print(f"   relative difference, {first[0]} against {label}, per gradient (dtype: largest): "
                  + ", ".join(f"{dt}: {e:.1e}" for dt, e in errs), flush=True)


def main():
    if "--profile" in sys.argv:
        profile_fwd_bwd()
        return
    shapes = (("base", (64, 1024, 1024)), ("issue", (8, 2048, 2048)))
    if "--base-only" in sys.argv:  # a shorter device call
        shapes = shapes[:1]
    if "--backward" in sys.argv:
        time_backward(shapes=shapes, state_boxes="--state-boxes" in sys.argv,
                      kernels=(0,) if "--attnres" in sys.argv else (0, 4, 8, 12))
        return
    if "--backward-smoke" in sys.argv:  # CPU, interpret mode
        time_backward(shapes=(("tiny", (1, 70, 64)),), interpret=True, state_boxes="--state-boxes" in sys.argv)
        return
    bw = bench.copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written)", flush=True)
    mechs = (("msar", (0, 4, 8, 12)), ("attnres", (0,)))
    if "--msar-only" in sys.argv or "--attnres-only" in sys.argv:
        mechs = mechs[:1] if "--msar-only" in sys.argv else mechs[1:]
    for name, (batch, t_len, d) in shapes:
        for mech, kernels in mechs:
            m = len(kernels)
            state, x, bank, q, gate = inputs(batch, t_len, d, kernels)
            gate = gate if m > 1 else None
            fuse = "gate" if gate is not None else "mean"
            kw = dict(stream_kernels=kernels, heads=1, eps=1e-6, gate_eps=1e-6)
            n_read = 3 if gate is not None else 2
            nbytes = n_read * x.size * 2 + (n_read - 1) * state.acc.size * 4 + x.size * 2
            floor_ms = nbytes / bw * 1e3  # the copy bandwidth counts bytes read + written, as bench.py
            want = jax.jit(lambda st, x, b, q, g: reference.phase2_fused(st, x, b, q, True, g, **kw))(
                state, x, bank, q, gate)
            tiles = tiling.choose_tiles(d=d, heads=1, max_kernel=max(kernels), n_targets=1, backend="triton",
                                        n_streams=m)

            def triton(st, x, b, q, g):
                return fused.phase2_forward(st, x, b, q, True, g, fuse=fuse, segment_ids=None, tiles=tiles,
                                            backend="triton", interpret=False, out_dtype=jnp.bfloat16, **kw)

            variants = {"triton (3 calls + XLA)": (triton, None)}
            # 16-channel chunks: slower, and crashed with m = 1 on the H200 (mosaic_gpu.BLOCK_D_CHOICES)
            forms = [(ex, "per_lag", None, None) for ex in mosaic_gpu.EXPANDS] + [("shared", "aligned", None, None)]
            if "--state-boxes" in sys.argv:
                variants, forms = {}, [("shared", "aligned", sb, None) for sb in mosaic_gpu.STATE_BOXES]
            if "--gate-stats" in sys.argv:  # with the default windows
                variants, forms = {}, [("shared", None, None, gs) for gs in mosaic_gpu.GATE_STATS]
            if "--single" in sys.argv:
                variants, forms = {}, [("shared", w, None, None) for w in ("aligned", "single", PLAIN)]
            if "--padded" in sys.argv:  # the one window with 80-byte rows
                variants, forms = {}, [("shared", w, None, None) for w in ("aligned", "single", "padded")]
            if "--chunks" in sys.argv:  # 32- against 64-channel (one stream: and 128-) chunks
                variants, forms = {k: v for k, v in variants.items() if k.startswith("triton")}, []
                for bd in ((32, 64, 128) if m == 1 else (32, 64)):
                    variants[f"mosaic padded bd={bd}"] = ((lambda bd: lambda st, x, b, q, g: mosaic_gpu.phase2_fused_forward(
                        st, x, b, q, True, g, None, fuse=fuse, out_dtype=jnp.bfloat16, windows="padded", block_d=bd,
                        **kw)[0])(bd), None)
            if "--triton-tiles" in sys.argv:  # Triton's forward with other tiles (one stream)
                variants, forms = {k: v for k, v in variants.items() if k.startswith("triton")}, []
                for bt, bds, bdm, warps, stages in ((8, 128, 128, 4, 1), (16, 128, 128, 4, 1), (8, 128, 64, 4, 1),
                                                    (16, 128, 64, 4, 2), (32, 128, 64, 8, 1), (16, 128, 32, 4, 2),
                                                    (8, 128, 128, 2, 1)):
                    alt = tiling.Tiles(bt, bds, bdm, num_warps=warps, num_stages=stages)
                    variants[f"triton {bt}x{bds}/{bdm} w{warps} s{stages}"] = ((lambda alt: lambda st, x, b, q, g: (
                        fused.phase2_forward(st, x, b, q, True, g, fuse=fuse, segment_ids=None, tiles=alt,
                                             backend="triton", interpret=False, out_dtype=jnp.bfloat16, **kw)))(alt),
                        None)
            if "--split" in sys.argv:  # one kernel against the split form, and its scores kernel alone
                variants, forms = {}, []
                for label, split, scores_only in (("mosaic one kernel", False, False), ("mosaic split", True, False),
                                                  ("mosaic split, scores only", True, True)):
                    variants[label] = ((lambda split, scores_only: lambda st, x, b, q, g: (lambda out: (
                        out[1][0] if scores_only else out[0]))(mosaic_gpu.phase2_fused_forward(
                            st, x, b, q, True, g, None, fuse=fuse, out_dtype=jnp.bfloat16, split=split, **kw)))(
                        split, scores_only), None)
            for expand, windows, boxes, stats in forms:
                label = f"mosaic {expand} {windows or 'default windows'}" + (f" state {boxes}" if boxes else "") + (
                    f" gate stats {stats}" if stats else "")
                variants[label] = ((lambda ex, w, gs: lambda st, x, b, q, g: (mosaic_gpu.phase2_fused_forward(
                    st, x, b, q, True, g, None, fuse=fuse, out_dtype=jnp.bfloat16, expand=ex,
                    windows="single" if w == PLAIN else w, gate_stats=gs, **kw)[0]))(expand, windows, stats), boxes)
            print(f"## {name} {mech}: B x T = {batch} x {t_len}, d = {d}; floor {floor_ms:.4f} ms", flush=True)
            for label, (fn, boxes) in variants.items():
                try:
                    set_lane_tile_swizzle(PLAIN not in label)
                    mosaic_gpu.DEFAULT_STATE_BOXES = boxes or "one"  # read when the kernel is traced
                    f = jax.jit(fn)
                    got = f(state, x, bank, q, gate)
                    if got.shape != want.shape:  # the scores alone: checked against the one-kernel forward's
                        ref = jax.jit(lambda st, x, b, q, g: mosaic_gpu.phase2_fused_forward(
                            st, x, b, q, True, g, None, fuse=fuse, out_dtype=jnp.bfloat16, **kw)[1][0])(
                            state, x, bank, q, gate)
                        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                    else:
                        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
                    ms = bench.timeit(f, state, x, bank, q, gate, reps=21, inner=5)[0] * 1e3
                    print(f"{label:28s} {ms:8.4f} ms  {floor_ms / ms:6.1%} of floor  rel err {err:.1e}", flush=True)
                except Exception:  # noqa: BLE001
                    print(f"{label:28s} FAILED: {traceback.format_exc()[-1500:]}", flush=True)


if __name__ == "__main__":
    main()
