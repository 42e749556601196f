"""The depth reads per sublayer: the Pallas kernels against the bytes floor and the XLA path.

One command prints the table of BENCHMARKS.md's "Depth-attention reads per sublayer" for MSAR,
MHAR and AttnRes at the bench shape (``BENCH_SHAPE``): per read, ``(phase 1 of a block + S
phase-2 calls with the gate) / S``, forward and forward + backward (the outputs and the pullback
of a cotangent in their dtypes, as the model calls a read), against the bytes floor
(``design_bytes`` over the copy bandwidth measured in the same process), the arithmetic floor
(``design_flops``) and the plain-XLA reference (``reference.py``) under autodiff::

    python benchmarks/reads.py                                  # GPU: msar, mhar, attnres
    python benchmarks/reads.py --configs msar --state_dtype bfloat16
    python benchmarks/reads.py --budgets 2.92,4.27              # any machine: what the targets ask
    python benchmarks/reads.py --small                          # CPU smoke run (interpret mode)

Each row is also printed as a JSON line as it completes. How a read is timed: docs/performance.md
§4; the floors: docs/kernels.md §5. ``make_inputs``, ``read_op``, ``phase2_inputs``,
``fwd_bwd`` and ``cotangent`` build the reads for ``benchmarks/kernel_digest.py`` and
``benchmarks/mgpu/aot_reads.py`` too."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.depth_attention import api, reference  # noqa: E402


def timeit(fn, *args, reps=25, inner=5, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times), times


def copy_bandwidth(nbytes=2 << 30):
    x = jax.random.normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.bfloat16(1))
    t, _ = timeit(f, x, reps=21)
    return 2 * nbytes / t  # bytes read + written per second


def design_bytes(n, batch, t_len, d, m, n_targets, heads, src_bytes=2, out_bytes=2, state_bytes=4):
    """Fewest bytes per sublayer of this design (each input read once, each output
    written once): phase 1 reads n sources and writes S states (acc in ``state_bytes``, max +
    denom in float32), amortised over S; phase 2 reads one state and the partial and writes h."""
    tok = batch * t_len
    state = m * tok * (d * state_bytes + 2 * heads * 4)
    p1 = n * tok * d * src_bytes + n_targets * state
    p2 = state + tok * d * src_bytes + tok * d * out_bytes
    fwd = p1 / n_targets + p2
    # backward (recomputing): p1 reads sources + d_state, writes d_sources;
    # p2 reads d_h, partial and state, writes d_state and d_partial.
    b1 = 2 * n * tok * d * src_bytes + n_targets * state
    b2 = tok * d * out_bytes + tok * d * src_bytes + 2 * state + tok * d * src_bytes
    return fwd, fwd + b1 / n_targets + b2


# The H200 SXM's float32 rate on its CUDA cores (datasheet: 67 TFLOP/s, no tensor cores): what the
# reads' arithmetic runs on (the conv taps, dots, softmax sums and mixing are FFMAs on float32).
FP32_PEAK_FLOPS = 67e12


def design_flops(n, batch, t_len, d, m, n_targets, stream_kernels, gate=True):
    """Fewest float32 FLOPs per sublayer of the definition (Eq. 10-14), forward and forward +
    backward: each expansion computed once, one FMA = 2 FLOPs, per-token scalar work left out.

    Per source element, phase 1 (amortised over S): the conv taps ``K = sum(stream_kernels)``,
    per stream the key's sum of squares and S query dots, and S weighted sums: ``K + m (2 S + 1)``
    FMAs. Phase 2, per element of the partial: its taps ``K``; per stream the sum of squares, the
    query dot, the merge with the state (2) and its term of the output; with the ``gate`` (Eq.
    13-14) also ``z.z`` and ``m`` dots with W: ``K + 5 m + m (m + 1)``. The backward of an FMA is
    two FMAs (one per operand), so forward + backward is 3x the forward. The kernels run more:
    they re-expand a source in every pass that reads it (phase 1's scoring and mixing passes,
    phase 2's three passes, the backward's re-runs), and each tap also costs a shared-memory load
    and a widening to float32."""
    k = sum(stream_kernels)
    elems = batch * t_len * d
    p1 = n * elems * (k + m * (2 * n_targets + 1))
    p2 = elems * (k + 5 * m + (m * (m + 1) if gate else 0))
    fwd = 2 * (p1 / n_targets + p2)
    return fwd, 3 * fwd



# The per-sublayer time targets at the bench shape (``BENCH_SHAPE``), ms: forward, forward + backward
# (docs/kernels.md, "What the per-sublayer targets ask").
SUBLAYER_TARGETS_MS = (0.45, 2.0)


def target_budgets(bandwidths_tbps, *, n, batch, t_len, d, n_targets, targets_ms=SUBLAYER_TARGETS_MS,
                   configs=("msar",), state_bytes=(4, 2)):
    """What the per-sublayer targets (``SUBLAYER_TARGETS_MS``) ask of the memory system: per config, phase-1 state
    width and bandwidth, the bytes floor (``design_bytes`` over the bandwidth) of the forward and
    of forward + backward, and the fraction of that bandwidth a read meeting each target must
    sustain (floor / target: above 1 no kernel of this design can meet it; memory-bound kernels
    here reach 0.8-0.9 at best in Nsight Compute's census, docs/kernels.md). One dict per row."""
    rows = []
    for config in configs:
        _, kernels, heads = TABLE_CONFIGS[config]
        for sb in state_bytes:
            fwd_b, fb_b = design_bytes(n, batch, t_len, d, len(kernels), n_targets, heads, state_bytes=sb)
            for tbps in bandwidths_tbps:
                if tbps <= 0:
                    raise ValueError(f"target_budgets: bandwidth {tbps!r} TB/s must be > 0")
                floors = [b / (tbps * 1e12) * 1e3 for b in (fwd_b, fb_b)]
                rows.append(dict(config=config, state_bytes=sb, tbps=tbps, floor_fwd_ms=floors[0],
                                 floor_fb_ms=floors[1], need_fwd=floors[0] / targets_ms[0],
                                 need_fb=floors[1] / targets_ms[1]))
    return rows


def print_target_budgets(rows, targets_ms=SUBLAYER_TARGETS_MS):
    print(f"per sublayer at the bench shape; targets {targets_ms[0]} / {targets_ms[1]} ms; 'needs': the floor "
          "over the target, the fraction of the bandwidth a read meeting the target sustains")
    print("| config | state | TB/s | forward floor, ms | needs | fwd + bwd floor, ms | needs |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        state = {4: "float32", 2: "bfloat16"}.get(r["state_bytes"], f"{r['state_bytes']} B")
        print(f"| {r['config']} | {state} | {r['tbps']:.2f} | {r['floor_fwd_ms']:.3f} | {r['need_fwd']:.0%} "
              f"| {r['floor_fb_ms']:.3f} | {r['need_fb']:.0%} |")


def make_inputs(n, batch, t_len, d, n_targets, kernels, heads, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 10)
    m, k = len(kernels), reference.bank_size(kernels)
    sources = jax.random.normal(ks[0], (n, batch, t_len, d), dtype)
    banks = 0.3 * jax.random.normal(ks[1], (n, max(k, 1), d), jnp.float32) if k else None
    queries = jax.random.normal(ks[2], (n_targets, m, d), jnp.float32)
    partial = jax.random.normal(ks[3], (batch, t_len, d), dtype)
    bank = 0.3 * jax.random.normal(ks[4], (max(k, 1), d), jnp.float32) if k else None
    query = jax.random.normal(ks[5], (m, d), jnp.float32)
    gate = (
        jax.random.normal(ks[6], (m * d, m), jnp.float32) / (m * d) ** 0.5,
        jnp.float32(0.01),
        jnp.zeros((m,), jnp.float32),
    )
    return sources, banks, queries, partial, bank, query, gate



FB_FORMS = ("vjp", "loss")


def drop_channel_values(tree):
    """``tree`` with each ``reference.ValueChannel`` replaced by its ``scale``. What the harness
    returns from a read with a value channel: phase 1's channel outputs are zeros the model never
    materialises (nothing reads them) and phase 2's channel cotangent's ``values`` are its input
    ``dh``, which the model hands straight to phase 1's backward; a jitted function returning
    either would write them out (at the bench shape, 8 x 67 MB of zeros per block and a 67 MB
    copy per read)."""
    is_channel = lambda x: isinstance(x, reference.ValueChannel)  # noqa: E731
    return jax.tree.map(lambda x: x.scale if is_channel(x) else x, tree, is_leaf=is_channel)


def fwd_bwd(f, argnums, form="vjp", has_aux=False):
    """A jitted forward + backward of ``f`` taking ``(*primals, ct)``, in one of ``FB_FORMS``.

    ``"vjp"`` (what the table times): returns ``f``'s outputs and ``jax.vjp``'s
    pullback of ``ct`` (given in the outputs' dtypes, as the model hands the reads their
    cotangents: phase 2's ``h`` is bf16 and so is its cotangent); returning the outputs keeps
    every forward pass. ``"loss"`` (a cross-check of its gradients): ``value_and_grad`` of ``sum(out * ct)``
    with a float32 ``ct`` (phase 1: ``sum(acc * ct) + sum(max) + sum(denom)``); the loss reads
    every output and ``ct`` once more (phase 1 at the bench shape: the 8 float32 states and
    as many cotangents, 2.15 GB a block for AttnRes) and phase 2's backward casts the float32
    ``ct`` to bf16 first: bytes the model never moves. (With ``grad`` alone XLA drops the forward
    passes that only compute the outputs, so neither form times ``grad`` alone.)

    ``has_aux`` (``"vjp"`` only): ``f`` returns ``(outputs, aux)``; ``aux`` is returned too but
    gets no cotangent, which reaches a ``custom_vjp`` as a symbolic zero (phase 1's ``acc`` when
    its value cotangent comes through the value channel, ``P1_FORMS``). The vjp form returns
    through ``drop_channel_values``."""
    if form not in FB_FORMS:
        raise ValueError(f"form={form!r}: must be one of {FB_FORMS}")
    if has_aux and form != "vjp":
        raise ValueError(f"has_aux: only with form='vjp' (got {form!r})")
    if form == "loss":
        def loss(*a):
            *primals, ct = a
            out = f(*primals)
            if isinstance(out, tuple):  # phase 1's state
                return jnp.sum(out.acc * ct) + jnp.sum(out.max) + jnp.sum(out.denom)
            return jnp.sum(out.astype(jnp.float32) * ct)

        return jax.jit(jax.value_and_grad(loss, argnums=argnums))

    def run(*a):
        *primals, ct = a

        def at(*diff):
            full = list(primals)
            for i, v in zip(argnums, diff):
                full[i] = v
            return f(*full)

        if has_aux:
            out, pullback, aux = jax.vjp(at, *(primals[i] for i in argnums), has_aux=True)
            return drop_channel_values(((out, aux), pullback(ct)))
        out, pullback = jax.vjp(at, *(primals[i] for i in argnums))
        return drop_channel_values((out, pullback(ct)))

    return jax.jit(run)


def cotangent(f, args, form="vjp", has_aux=False):
    """The ``ct`` of ``fwd_bwd(f, .., form, has_aux)``: ones, in the outputs' shapes and dtypes,
    or for ``"loss"`` one float32 array shaped as the output (phase 1: its ``acc``)."""
    out = jax.eval_shape(f, *args)
    out = out[0] if has_aux else out
    if form == "loss":
        return jnp.ones((out.acc if isinstance(out, tuple) else out).shape, jnp.float32)
    return jax.tree.map(lambda o: jnp.ones(o.shape, o.dtype), out)


# How the kernels' phase 1 hands its state to the phase-2 reads (``run_config(p1_forms=...)``):
# ``"stacked"`` (one ``[S, m, B, T, d]`` state), ``"per_target"``
# (``api.phase1(per_target=True)``, as the model runs reads of several streams),
# ``"value_channel"`` (per target, each paired with its ``reference.ValueChannel``, which the phase-2
# read takes: its value cotangent goes back factored; the model's single-stream reads), ``"model"``
# (the model's: ``value_channel`` for one stream, ``per_target`` for several).
P1_FORMS = ("model", "stacked", "per_target", "value_channel")


# the table's reads: name -> (row name, stream kernels, heads); MHAR: one stream, 8 channel
# heads (configs/mhar.py)
TABLE_CONFIGS = {"msar": ("msar_m4_k4-8-12", (0, 4, 8, 12), 1), "attnres": ("attnres", (0,), 1),
                 "mhar": ("mhar_h8", (0,), 8)}
# the bench shape (``n`` sources, S = ``n_targets`` reads per block; docs/kernels.md) and
# configs/*.py:size=base's
BENCH_SHAPE = dict(n=9, batch=8, t_len=2048, d=2048, n_targets=8)
BASE_SHAPE = dict(n=8, batch=64, t_len=1024, d=1024, n_targets=8)


def model_p1_form(kernels) -> str:
    """The form of phase 1 the model's reads use (``attnres.BlockDepthAttention._value_channel``)."""
    return "value_channel" if len(kernels) == 1 else "per_target"


def read_op(phase, impl, *, kernels, heads, out_dtype=jnp.bfloat16, state_dtype="float32", opts=None,
            p1_form="stacked"):
    """The jitted read the bench times: phase 1 ``(sources, banks, queries) -> state`` or
    phase 2 + stream fusion ``(state, partial, bank, query, gate) -> h`` in ``out_dtype``;
    ``impl`` ``"xla"`` (the plain-jnp reference, float32 state) or an ``api`` implementation
    with ``state_dtype`` (phase 1) and the keyword ``opts``. ``p1_form`` (``P1_FORMS``, the
    kernels only): ``"per_target"``: phase 1 returns the per-target states; ``"value_channel"``:
    phase 1 returns ``(per target (max, denom, channel), per target acc)`` (``fwd_bwd``'s
    ``has_aux``: the value cotangent comes through the channel alone) and phase 2 takes ``(max,
    denom, acc, partial, bank, query, gate, channel)``."""
    if p1_form not in P1_FORMS[1:]:
        raise ValueError(f"p1_form={p1_form!r}: must be one of {P1_FORMS[1:]} ('model': model_p1_form)")
    kw = dict(stream_kernels=kernels, heads=heads)
    channel = impl != "xla" and p1_form == "value_channel"
    if phase == 1:
        if impl == "xla":
            return jax.jit(lambda x, b, q: reference.phase1(x, b, q, **kw))
        if p1_form == "stacked":
            return jax.jit(lambda x, b, q: api.phase1(x, b, q, implementation=impl, state_dtype=state_dtype, **kw,
                                                      **(opts or {})))

        def per_target(x, b, q):
            out = api.phase1(x, b, q, implementation=impl, state_dtype=state_dtype, per_target=True,
                             value_channel=channel, **kw, **(opts or {}))
            if not channel:
                return out
            return tuple((st.max, st.denom, ch) for st, ch in out), tuple(st.acc for st, _ in out)

        return jax.jit(per_target)
    if impl == "xla":
        return jax.jit(lambda st, x, b, q, g: reference.phase2_fused(st, x, b, q, True, g, **kw).astype(out_dtype))
    if channel:
        return jax.jit(lambda mx, den, acc, x, b, q, g, ch: api.phase2_fused(
            reference.SoftmaxState(mx, den, acc), x, b, q, True, g, implementation=impl, out_dtype=out_dtype,
            value_channel=ch, **kw, **(opts or {})))
    return jax.jit(lambda st, x, b, q, g: api.phase2_fused(st, x, b, q, True, g, implementation=impl,
                                                            out_dtype=out_dtype, **kw, **(opts or {})))


def phase2_inputs(state, partial, bank, query, gate, p1_form="stacked"):
    """``(args, argnums)`` of ``read_op(2, .., p1_form)``: with ``"value_channel"`` the state's
    leaves are arguments of their own and ``acc`` is not differentiated (its cotangent goes
    through the channel, the last argument: a pullback of the whole state would build ``acc``'s
    zero cotangent, a ``[B, T, d]`` float32 array the model never writes)."""
    has_bank = bank is not None
    if p1_form != "value_channel":
        return (state, partial, bank, query, gate), ((0, 1, 2, 3, 4) if has_bank else (0, 1, 3, 4))
    channel = reference.zero_value_channel(state, partial.dtype)
    return ((*state, partial, bank, query, gate, channel),
            (0, 1, 3, 4, 5, 6, 7) if has_bank else (0, 1, 3, 5, 6, 7))


def forward_only(read):
    """``read`` (jitted) as the bench times its forward: without the value channel's zeros
    (``drop_channel_values``)."""
    return jax.jit(lambda *a: drop_channel_values(read(*a)))



def run_config(name, *, n, batch, t_len, d, n_targets, kernels, heads, impl, bw, log, reps, inner, inner_fb,
               backward="pallas", with_bwd=True, time_xla=True, state_dtype="float32", p1_forms=("model",),
               dtype=jnp.bfloat16):
    """One read of the table: its errors against the reference (at "highest" matmul precision:
    default GPU float32 dots are TF32, off by about 1e-3 in the logits), then per phase-1 form of
    ``p1_forms`` (``P1_FORMS``; the XLA reference: stacked, float32 state, timed once with
    ``time_xla``) phase 1 of a block and one phase-2 call, forward and forward + backward, and the
    compiled temporaries of forward + backward. ``impl`` is an ``api`` implementation,
    ``backward`` its ``backward`` option, ``state_dtype`` its phase-1 state. Keys: ``<who>_fwd_ms``,
    ``<who>_fb_ms`` (per sublayer) and their phase parts ``<who>_p1*`` / ``<who>_p2*``; a second
    form adds ``_<form>``."""
    m = len(kernels)
    sources, banks, queries, partial, bank, query, gate = make_inputs(
        n, batch, t_len, d, n_targets, kernels, heads, dtype
    )
    gate = gate if m > 1 else None  # AttnRes / MHAR: no stream fusion (mean of one stream)
    kw = dict(stream_kernels=kernels, heads=heads)
    opts = {"backward": backward}
    p1 = functools.partial(read_op, 1, kernels=kernels, heads=heads, state_dtype=state_dtype, opts=opts)
    p2 = functools.partial(read_op, 2, kernels=kernels, heads=heads, out_dtype=dtype, opts=opts)
    p1_args = (0, 1, 2) if banks is not None else (0, 2)

    res = {"name": name, "impl": impl, "backward": backward, "state_dtype": state_dtype}
    state_ref = p1("xla")(sources, banks, queries)
    state1 = jax.tree.map(lambda a: a[1], state_ref)
    with jax.default_matmul_precision("highest"):
        state_hi = jax.jit(lambda x, b, q: reference.phase1(x, b, q, **kw))(sources, banks, queries)
        h_ref = p2("xla")(state1, partial, bank, query, gate).astype(jnp.float32)
    st = p1(impl)(sources, banks, queries)
    res["p1_max_abs_err"] = float(jnp.max(jnp.abs(st.acc / st.denom[..., :1] - state_hi.acc / state_hi.denom[..., :1])))
    res["p1_ref_max"] = float(jnp.max(jnp.abs(state_hi.acc / state_hi.denom[..., :1])))
    h = p2(impl)(state1, partial, bank, query, gate).astype(jnp.float32)
    res["p2_max_abs_err"] = float(jnp.max(jnp.abs(h - h_ref)))
    res["p2_ref_max"] = float(jnp.max(jnp.abs(h_ref)))
    p1_forms = tuple(model_p1_form(kernels) if f == "model" else f for f in p1_forms)
    res["p1_forms"] = ",".join(p1_forms)
    for who, p1_form in [("xla", "stacked")] * time_xla + [(impl, f) for f in p1_forms]:
        state1 = jax.tree.map(lambda a: a[1], state_ref)  # the kernels' phase 2 reads their own state dtype
        state1 = state1 if who == "xla" else state1._replace(acc=state1.acc.astype(state_dtype))
        channel = who != "xla" and p1_form == "value_channel"
        r1 = p1(who, p1_form=p1_form)
        r2 = p2(who, p1_form=p1_form)
        a1 = (sources, banks, queries)
        a2, args2 = phase2_inputs(state1, partial, bank, query, gate, p1_form if who != "xla" else "stacked")
        sfx = "" if who == "xla" or p1_form == p1_forms[0] else f"_{p1_form}"
        t1, _ = timeit(forward_only(r1), *a1, reps=reps, inner=inner)
        t2, _ = timeit(r2, *a2, reps=reps, inner=inner)
        res[f"{who}_p1{sfx}_ms"], res[f"{who}_p2{sfx}_ms"] = t1 * 1e3, t2 * 1e3
        res[f"{who}_fwd{sfx}_ms"] = (t1 + n_targets * t2) / n_targets * 1e3
        if with_bwd:
            ct1, ct2 = cotangent(r1, a1, has_aux=channel), cotangent(r2, a2)
            g1, g2 = fwd_bwd(r1, p1_args, has_aux=channel), fwd_bwd(r2, args2)
            t1b, _ = timeit(g1, *a1, ct1, reps=reps, inner=inner_fb)
            t2b, _ = timeit(g2, *a2, ct2, reps=reps, inner=inner_fb)
            res[f"{who}_p1_fb{sfx}_ms"], res[f"{who}_p2_fb{sfx}_ms"] = t1b * 1e3, t2b * 1e3
            res[f"{who}_fb{sfx}_ms"] = (t1b + n_targets * t2b) / n_targets * 1e3
            m1 = g1.lower(*a1, ct1).compile().memory_analysis()
            m2 = g2.lower(*a2, ct2).compile().memory_analysis()
            if m1 is not None and m2 is not None:
                res[f"{who}_p1_fb{sfx}_temp_GiB"] = m1.temp_size_in_bytes / 2**30
                res[f"{who}_p2_fb{sfx}_temp_GiB"] = m2.temp_size_in_bytes / 2**30
    fwd_b, fb_b = design_bytes(n, batch, t_len, d, m, n_targets, heads, jnp.dtype(dtype).itemsize,
                               jnp.dtype(dtype).itemsize, jnp.dtype(state_dtype).itemsize)
    res["floor_fwd_ms"], res["floor_fb_ms"] = fwd_b / bw * 1e3, fb_b / bw * 1e3
    fwd_f, fb_f = design_flops(n, batch, t_len, d, m, n_targets, kernels, gate=gate is not None)
    res["flop_floor_fwd_ms"] = fwd_f / FP32_PEAK_FLOPS * 1e3
    res["flop_floor_fb_ms"] = fb_f / FP32_PEAK_FLOPS * 1e3
    log(json.dumps(res))
    return res


def print_table(rows, impl, bw, shapes):
    """The per-sublayer table, ms: each read (and each further phase-1 form) against the bytes
    floor, the XLA path and the arithmetic floor; ``xN`` is the read over its bytes floor."""
    print(f"\nper sublayer, ms (median of the repetitions); copy bandwidth {bw / 1e12:.2f} TB/s; shapes {shapes}")
    print("| read | forward | floor | XLA | fwd + bwd | floor | XLA | flop floors | error p1 / p2 (of max) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    cell = lambda r, k: f"{r[k]:.3f}" if k in r else "n/a"  # noqa: E731
    for r in rows:
        forms = r["p1_forms"].split(",")
        for i, form in enumerate(forms):
            sfx = "" if i == 0 else f"_{form}"
            fwd, fb = f"{impl}_fwd{sfx}_ms", f"{impl}_fb{sfx}_ms"
            over = lambda k, floor: f" ({r[k] / r[floor]:.2f}x)" if k in r else ""  # noqa: E731
            err = (f"{r['p1_max_abs_err']:.1e} ({r['p1_ref_max']:.1f}) / {r['p2_max_abs_err']:.1e} "
                   f"({r['p2_ref_max']:.1f})")
            print(f"| {r['name']}, {form} | {cell(r, fwd)}{over(fwd, 'floor_fwd_ms')} | {r['floor_fwd_ms']:.3f} "
                  f"| {cell(r, 'xla_fwd_ms')} | {cell(r, fb)}{over(fb, 'floor_fb_ms')} | {r['floor_fb_ms']:.3f} "
                  f"| {cell(r, 'xla_fb_ms')} | {r['flop_floor_fwd_ms']:.3f} / {r['flop_floor_fb_ms']:.3f} | {err} |")
    temps = [f"{r['name']} {r[k]:.3f} (XLA {r.get('xla_p1_fb_temp_GiB', float('nan')):.3f})"
             for r in rows for k in [f"{impl}_p1_fb_temp_GiB"] if k in r]
    if temps:
        print("phase 1 forward + backward, compiled temporaries, GiB: " + "; ".join(temps))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="msar,mhar,attnres",
                    help=f"the reads, comma-separated, of {sorted(TABLE_CONFIGS)} (MHAR: one stream, 8 heads)")
    ap.add_argument("--backward", default="pallas",
                    help="the kernels' backward, or several comma-separated: pallas (the Pallas backward kernels, "
                         "as the model's default), xla (closed form), hybrid (phase 1's closed form with the "
                         "conv_transpose kernel)")
    ap.add_argument("--state_dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the kernels' phase-1 state (api.phase1; the floor counts it)")
    ap.add_argument("--p1_forms", default="model",
                    help="how the kernels' phase 1 hands its state to phase 2, comma-separated, the first in the "
                         "table: model (the model's: value_channel for one stream, per_target for several), "
                         "stacked (one [S, m, B, T, d] state), per_target, value_channel")
    ap.add_argument("--base_shape", action="store_true",
                    help="configs/*.py:size=base's reads (n=8, B=64, T=1024, d=1024, S=8) instead of the bench shape")
    ap.add_argument("--no-bwd", action="store_true", help="forwards only")
    ap.add_argument("--inner", type=int, default=20,
                    help="calls per timed repetition of a forward; each repetition also pays the host's dispatch "
                         "before its first call and the wait after its last (0.1-0.25 ms on the H200)")
    ap.add_argument("--inner_fb", type=int, default=20, help="the same for forward + backward")
    ap.add_argument("--budgets", default=None, metavar="TBPS,...",
                    help="print what the per-sublayer targets ask of each bandwidth (TB/s, comma-separated: "
                         "MSAR's bytes floors with a float32 and a bf16 state and the fraction of the bandwidth "
                         "each target needs) and exit; runs on any machine")
    ap.add_argument("--small", action="store_true", help="CPU smoke run of the harness at a tiny shape")
    args = ap.parse_args(argv)
    if args.budgets is not None:
        try:
            tbps = [float(b) for b in args.budgets.split(",")]
            rows = target_budgets(tbps, **BENCH_SHAPE)  # MSAR: AttnRes's target is 1.5x its floor
        except ValueError as e:
            ap.error(f"--budgets={args.budgets!r}: comma-separated bandwidths in TB/s, each > 0 ({e})")
        print_target_budgets(rows)
        return []
    backwards = tuple(args.backward.split(","))
    if any(b not in ("xla", "pallas", "hybrid") for b in backwards):
        ap.error(f"--backward={args.backward!r}: each must be xla, pallas or hybrid")
    configs = tuple(args.configs.split(","))
    if any(c not in TABLE_CONFIGS for c in configs):
        ap.error(f"--configs={args.configs!r}: each must be one of {sorted(TABLE_CONFIGS)}")
    p1_forms = tuple(args.p1_forms.split(","))
    if any(f not in P1_FORMS for f in p1_forms) or len(set(p1_forms)) < len(p1_forms):
        ap.error(f"--p1_forms={args.p1_forms!r}: each must be one of {P1_FORMS}, once")
    if args.inner < 1 or args.inner_fb < 1:
        ap.error(f"--inner={args.inner}, --inner_fb={args.inner_fb}: each must be at least 1")

    def log(line):
        print(line, flush=True)

    log(json.dumps({"device": str(jax.devices()[0]), "kind": jax.devices()[0].device_kind, "jax": jax.__version__}))
    if args.small:
        shapes, reps, inner, inner_fb, bw = dict(n=3, batch=1, t_len=32, d=64, n_targets=2), 3, 1, 1, 1e10
    else:
        shapes, reps, inner, inner_fb = BASE_SHAPE if args.base_shape else BENCH_SHAPE, 25, args.inner, args.inner_fb
        bw = copy_bandwidth()
    log(json.dumps({"copy_bandwidth_TBps": bw / 1e12}))
    impl, rows, failed = "pallas_gpu", [], []
    for name, kernels, heads in (TABLE_CONFIGS[c] for c in configs):
        xla_row = None
        for backward in backwards:
            state = "" if args.state_dtype == "float32" else ", bf16 state"
            label = f"{name} [bwd={backward}{state}]"
            try:
                row = run_config(label, kernels=kernels, heads=heads, impl=impl, bw=bw, log=log, reps=reps,
                                 inner=inner, inner_fb=inner_fb, backward=backward, with_bwd=not args.no_bwd,
                                 time_xla=xla_row is None, state_dtype=args.state_dtype, p1_forms=p1_forms, **shapes)
            except Exception as e:  # noqa: BLE001 - keep measuring the other reads; the exit status says so
                log(json.dumps({"name": label, "error": repr(e)[:2000]}))
                failed.append(label)
                continue
            if xla_row is None:
                xla_row = row
            else:  # the XLA reference was timed once per read
                row.update({k: v for k, v in xla_row.items() if k.startswith("xla_")})
            rows.append(row)
    print_table(rows, impl, bw, shapes)
    if failed:
        sys.exit(f"reads that failed (their error is in the JSON line above): {', '.join(failed)}")
    return rows


if __name__ == "__main__":
    main()
