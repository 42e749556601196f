"""Timing harness of the depth-attention reads: the fused kernels against the XLA reference.

Usage (on the GPU machine): ``python3 -m pallas_kernels.depth_attention.bench`` (``--small`` for a
CPU smoke run of the harness itself, interpret mode). It prints the per-sublayer amortised time,
``(phase 1 of a block + S phase-2 calls) / S``, forward and forward + backward; the device's copy
bandwidth measured in the same process with the bytes and arithmetic floors (``design_bytes``,
``design_flops``); and the compiled peak temporary memory. How a call is timed:
docs/performance.md; the floors: docs/kernels.md §5."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.depth_attention import api, fused_bwd_phase1, reference, xla_streaming


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


def table6_bytes(n, batch, t_len, d, m, n_targets, elem_bytes=2):
    """Table 6's (N/S + 4m + 5) d per token per sublayer, in elements of ``elem_bytes``."""
    return (n / n_targets + 4 * m + 5) * d * batch * t_len * elem_bytes


# The per-sublayer time targets at the bench shape (``ISSUE_SHAPE``), ms: forward, forward + backward
# (docs/kernels.md, "What the per-sublayer targets ask").
ISSUE_TARGETS_MS = (0.45, 2.0)


def target_budgets(bandwidths_tbps, *, n, batch, t_len, d, n_targets, targets_ms=ISSUE_TARGETS_MS,
                   configs=("msar",), state_bytes=(4, 2)):
    """What the per-sublayer targets (``ISSUE_TARGETS_MS``) ask of the memory system: per config, phase-1 state
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


def print_target_budgets(rows, targets_ms=ISSUE_TARGETS_MS):
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
    """``tree`` with each ``reference.ValueChannel`` replaced by its ``scale``. What the bench
    returns from a read with a value channel: phase 1's channel outputs are zeros the model never
    materialises (nothing reads them) and phase 2's channel cotangent's ``values`` are its input
    ``dh``, which the model hands straight to phase 1's backward; a jitted function returning
    either would write them out (at the bench shape, 8 x 67 MB of zeros per block and a 67 MB
    copy per read)."""
    is_channel = lambda x: isinstance(x, reference.ValueChannel)  # noqa: E731
    return jax.tree.map(lambda x: x.scale if is_channel(x) else x, tree, is_leaf=is_channel)


def fwd_bwd(f, argnums, form="vjp", has_aux=False):
    """A jitted forward + backward of ``f`` taking ``(*primals, ct)``, in one of ``FB_FORMS``.

    ``"vjp"`` (the bench's default): returns ``f``'s outputs and ``jax.vjp``'s
    pullback of ``ct`` (given in the outputs' dtypes, as the model hands the reads their
    cotangents: phase 2's ``h`` is bf16 and so is its cotangent); returning the outputs keeps
    every forward pass. ``"loss"`` (the older form): ``value_and_grad`` of ``sum(out * ct)``
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
# ``"stacked"`` (one ``[S, m, B, T, d]`` state, the older main table), ``"per_target"``
# (``api.phase1(per_target=True)``, as the model runs reads of several streams),
# ``"value_channel"`` (per target, each paired with its ``reference.ValueChannel``, which the phase-2
# read takes: its value cotangent goes back factored; the model's single-stream reads), ``"model" (the model's: ``value_channel`` for one stream, ``per_target`` for several).
P1_FORMS = ("model", "stacked", "per_target", "value_channel")


# the main table's rows: name -> (row name, stream kernels, heads); MHAR: one stream, 8 channel
# heads (configs/mhar.py)
TABLE_CONFIGS = {"msar": ("msar_m4_k4-8-12", (0, 4, 8, 12), 1), "attnres": ("attnres", (0,), 1),
                 "mhar": ("mhar_h8", (0,), 8)}
# the bench shape (``n`` sources, S = ``n_targets`` reads per block; docs/kernels.md) and
# configs/*.py:size=base's
ISSUE_SHAPE = dict(n=9, batch=8, t_len=2048, d=2048, n_targets=8)
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


def run_config(name, *, n, batch, t_len, d, n_targets, kernels, heads, dtype, impl, bw, log, reps, inner, inner_fb,
               with_bwd=True, check=True, p1_opts=None, p2_opts=None, time_xla=True, state_dtype="float32",
               fb_forms=("vjp",), p1_forms=("model",)):
    """One row of the main table. ``state_dtype``: the kernels' phase-1 state (``api.phase1``);
    the XLA reference row keeps its float32 state. ``fb_forms``: how forward + backward is
    timed (``"vjp"``, ``"loss"``: see ``fwd_bwd``); ``p1_forms``: how the kernels' phase 1 hands
    the state to phase 2 (``P1_FORMS``; the XLA reference: stacked). The first of each names the
    main keys (``*_fwd_ms``, ``*_fb_ms``), the others add ``_<form>`` (``*_fb_loss_ms``,
    ``*_fb_stacked_ms``, ``*_p1_stacked_ms``)."""
    m = len(kernels)
    sources, banks, queries, partial, bank, query, gate = make_inputs(
        n, batch, t_len, d, n_targets, kernels, heads, dtype
    )
    gate = gate if m > 1 else None  # AttnRes / MHAR: no stream fusion (mean of one stream)
    kw = dict(stream_kernels=kernels, heads=heads)
    out_dtype = dtype

    p1 = functools.partial(read_op, 1, kernels=kernels, heads=heads, state_dtype=state_dtype, opts=p1_opts)
    p2 = functools.partial(read_op, 2, kernels=kernels, heads=heads, out_dtype=out_dtype, opts=p2_opts)

    p1_args = (0, 1, 2) if banks is not None else (0, 2)

    res = {"name": name, "impl": impl, "p1_opts": str(p1_opts), "p2_opts": str(p2_opts)}
    state_ref = p1("xla")(sources, banks, queries)
    state1 = jax.tree.map(lambda a: a[1], state_ref)
    if check:  # the reference at "highest": default GPU f32 dots are TF32, off by ~1e-3 in the logits
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
        r1 = functools.partial(p1, p1_form=p1_form)(who)
        r2 = functools.partial(p2, p1_form=p1_form)(who)
        a1 = (sources, banks, queries)
        a2, args2 = phase2_inputs(state1, partial, bank, query, gate, p1_form if who != "xla" else "stacked")
        p1_sfx = "" if who == "xla" or p1_form == p1_forms[0] else f"_{p1_form}"
        t1, _ = timeit(forward_only(r1), *a1, reps=reps, inner=inner)
        t2, _ = timeit(r2, *a2, reps=reps, inner=inner)
        res[f"{who}_p1{p1_sfx}_ms"], res[f"{who}_p2{p1_sfx}_ms"] = t1 * 1e3, t2 * 1e3
        res[f"{who}_fwd{p1_sfx}_ms"] = (t1 + n_targets * t2) / n_targets * 1e3
        for form in fb_forms if with_bwd else ():
            if who != "xla" and p1_form != "stacked" and form != "vjp":  # the loss form reads one stacked acc
                continue
            # the first form's keys are the main table's
            sfx = ("" if form == fb_forms[0] else f"_{form}") + p1_sfx
            ct1, ct2 = cotangent(r1, a1, form, has_aux=channel), cotangent(r2, a2, form)
            g1, g2 = fwd_bwd(r1, p1_args, form, has_aux=channel), fwd_bwd(r2, args2, form)
            t1b, _ = timeit(g1, *a1, ct1, reps=reps, inner=inner_fb)
            t2b, _ = timeit(g2, *a2, ct2, reps=reps, inner=inner_fb)
            res[f"{who}_p1_fb{sfx}_ms"], res[f"{who}_p2_fb{sfx}_ms"] = t1b * 1e3, t2b * 1e3
            res[f"{who}_fb{sfx}_ms"] = (t1b + n_targets * t2b) / n_targets * 1e3
            try:
                m1 = g1.lower(*a1, ct1).compile().memory_analysis()
                m2 = g2.lower(*a2, ct2).compile().memory_analysis()
                res[f"{who}_p1_fb{sfx}_temp_GiB"] = m1.temp_size_in_bytes / 2**30
                res[f"{who}_p2_fb{sfx}_temp_GiB"] = m2.temp_size_in_bytes / 2**30
            except Exception as e:  # noqa: BLE001
                res[f"{who}_mem_error"] = repr(e)[:200]
        log(json.dumps(res))
    fwd_b, fb_b = design_bytes(n, batch, t_len, d, m, n_targets, heads, jnp.dtype(dtype).itemsize,
                               jnp.dtype(out_dtype).itemsize, jnp.dtype(state_dtype).itemsize)
    res["floor_fwd_ms"] = fwd_b / bw * 1e3
    res["floor_fb_ms"] = fb_b / bw * 1e3
    fwd_f, fb_f = design_flops(n, batch, t_len, d, m, n_targets, kernels, gate=gate is not None)
    res["flop_floor_fwd_ms"] = fwd_f / FP32_PEAK_FLOPS * 1e3
    res["flop_floor_fb_ms"] = fb_f / FP32_PEAK_FLOPS * 1e3
    res["table6_fwd_ms"] = table6_bytes(n, batch, t_len, d, m, n_targets) / bw * 1e3
    log(json.dumps(res))
    return res


def sweep(log, shapes, kernels=(0, 4, 8, 12), heads=1, dtype=jnp.bfloat16):
    """Each kernel of the fused reads alone, for several tile choices (ms, median)."""
    from pallas_kernels.depth_attention import fused
    from pallas_kernels.depth_attention.tiling import Tiles

    n, batch, t_len, d, n_targets = (shapes[k] for k in ("n", "batch", "t_len", "d", "n_targets"))
    m = len(kernels)
    sources, banks, queries, partial, bank, query, gate = make_inputs(n, batch, t_len, d, n_targets, kernels, heads,
                                                                      dtype)
    ks = jax.random.split(jax.random.key(7), 4)
    p1w = jax.nn.softmax(jax.random.normal(ks[0], (n_targets, n, m, batch, t_len, heads)), axis=1)
    p2b = jax.random.uniform(ks[1], (1, 1, m, batch, t_len, heads))
    p2a = jax.random.uniform(ks[2], (1, m, batch, t_len, heads))
    base = jax.random.normal(ks[3], (1, m, batch, t_len, d), jnp.float32)
    g = jax.random.uniform(ks[0], (batch, t_len, m))
    w = gate[0].reshape(m, d, m)
    x2, b2 = partial[None], bank[None]
    variants = [
        Tiles(16, 128, 64, 4, 1), Tiles(16, 32, 64, 4, 1), Tiles(16, 32, 32, 4, 2),
        Tiles(32, 32, 64, 8, 1), Tiles(16, 64, 128, 8, 1), Tiles(8, 32, 128, 4, 2),
    ]
    rows = []
    for tiles in variants:
        kw = dict(stream_kernels=kernels, heads=heads, tiles=tiles, backend="triton", interpret=False)
        fns = {
            "p1_scores": (jax.jit(lambda x, b, q: fused.scores_call(x, b, q, None, **kw)), (sources, banks, queries)),
            "p1_mix": (jax.jit(lambda x, b, p: fused.mix_call(x, b, p, None, mode="acc", **kw)), (sources, banks, p1w)),
            "p2_scores": (jax.jit(lambda x, b, q: fused.scores_call(x, b, q, None, **kw)), (x2, b2, query[None])),
            "p2_stats": (jax.jit(lambda x, b, p, bs, a, w: fused.mix_call(x, b, p, None, base=bs, a=a, w=w,
                                                                            mode="stats", **kw)),
                         (x2, b2, p2b, base, p2a, w)),
            "p2_gate": (jax.jit(lambda x, b, p, bs, a, g: fused.mix_call(x, b, p, None, base=bs, a=a, gate=g,
                                                                           mode="gate", out_dtype=dtype, **kw)),
                        (x2, b2, p2b, base, p2a, g)),
        }
        row = {"tiles": str(tiles)}
        for name, (fn, args) in fns.items():
            try:
                row[name] = timeit(fn, *args, reps=21, inner=3)[0] * 1e3
            except Exception as e:  # noqa: BLE001
                row[name] = repr(e)[:300]
        log(json.dumps(row))
        row["_tiles"] = tiles
        rows.append(row)
    return rows


def sweep_bwd_chunks(log, shapes, chunks, kernels=(0, 4, 8, 12), heads=1, dtype=jnp.bfloat16, reps=21):
    """Phase 1's forward + Pallas backward (one block) for several reverse-T chunk widths
    (``Tiles.block_d_bwd``), the rest of the tiles as ``choose_tiles`` picks them."""
    from pallas_kernels.depth_attention import tiling

    n, batch, t_len, d, n_targets = (shapes[k] for k in ("n", "batch", "t_len", "d", "n_targets"))
    sources, banks, queries, *_ = make_inputs(n, batch, t_len, d, n_targets, kernels, heads, dtype)
    base = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=n_targets, backend="triton")
    ct = None
    rows = []
    for c in chunks:
        tiles = dataclasses.replace(base, block_d_bwd=c)

        def loss(x, b, q, ct, tiles=tiles):
            out = api.phase1(x, b, q, implementation="pallas_gpu", stream_kernels=kernels, heads=heads,
                             tiles=tiles, backward="pallas")
            return jnp.sum(out.acc * ct) + jnp.sum(out.denom)

        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        if ct is None:
            ct = jnp.ones((n_targets, len(kernels), batch, t_len, d), jnp.float32)
        row = {"p1_bwd_chunk": c, "tiles": str(tiles)}
        try:
            row["pallas_gpu_p1_fb_ms"] = timeit(g, sources, banks, queries, ct, reps=reps, inner=1)[0] * 1e3
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:500]
        log(json.dumps(row))
        rows.append(row)
    return rows


P2_BWD_TILES = (  # phase 2 + gate, fwd + Pallas bwd: (block_t, block_d_mix, block_d_bwd, warps, stages)
    (16, 32, 32, 4, 2), (32, 32, 32, 4, 2), (32, 32, 16, 4, 2), (16, 32, 16, 4, 2), (16, 32, 64, 4, 2),
    (16, 32, 32, 8, 2), (16, 32, 32, 2, 2),
    # for `base`'s d = 1024 (the ones above were timed at d = 2048; (16, 32, 16, 4, 2) is
    # the heuristic's): wider and narrower mixing chunks, 32 rows at 8 warps, one stage
    (16, 64, 16, 4, 2), (16, 64, 16, 8, 2), (32, 32, 16, 8, 2), (16, 16, 16, 4, 2), (16, 32, 16, 4, 1),
)
# Phase 2's reverse-T input kernel alone: (block_t, block_d_bwd, warps) besides the default.
P2_DINPUT_TILES = ((16, 32, 4), (16, 32, 8), (16, 8, 4))
# Phase 2 for several stream sets, with and without the gate (default tiles): how its cost grows
# with the conv taps (bank-gradient reductions, transposed-conv shifts) and the streams (gate).
P2_STREAM_CASES = (
    ((0,), False), ((0, 0, 0, 0), False), ((0, 0, 0, 0), True), ((0, 4), False), ((0, 12), False),
    ((0, 4, 8, 12), False), ((0, 4, 8, 12), True),
)


def _time_p2(log, shapes, cases, dtype=jnp.bfloat16, heads=1, reps=21):
    """Phase 2 (+ gate) forward, and forward + Pallas backward, for each ``(kernels, gated,
    tiles or None[, other op options])`` of ``cases``; the phase-1 state comes from the XLA
    reference."""
    batch, t_len, d, n = shapes["batch"], shapes["t_len"], shapes["d"], shapes["n"]
    rows = []
    for kernels, gated, tiles, *more in cases:
        sources, banks, queries, partial, bank, query, gate = make_inputs(n, batch, t_len, d, 1, kernels, heads,
                                                                          dtype)
        state = jax.tree.map(lambda a: a[0], reference.phase1(sources, banks, queries, stream_kernels=kernels,
                                                              heads=heads))
        gate = gate if gated else None
        opts = dict(stream_kernels=kernels, heads=heads, backward="pallas", out_dtype=dtype, **(more[0] if more else {}))
        if tiles is not None:
            opts["tiles"] = tiles

        def fwd(st, x, b, q, g, opts=opts):
            return api.phase2_fused(st, x, b, q, True, g, implementation="pallas_gpu", **opts)

        def loss(st, x, b, q, g, ct, fwd=fwd):
            return jnp.sum(fwd(st, x, b, q, g).astype(jnp.float32) * ct)

        argnums = tuple(i for i, a in enumerate((state, partial, bank, query, gate)) if a is not None)
        grad = jax.jit(jax.value_and_grad(loss, argnums=argnums))  # the value keeps h (run_config says why)
        ct = jnp.ones((batch, t_len, d), jnp.float32)
        row = {"p2_streams": str(kernels), "gate": gated, "tiles": str(tiles), "opts": str(more[0] if more else {})}
        try:
            row["pallas_gpu_p2_ms"] = timeit(jax.jit(fwd), state, partial, bank, query, gate, reps=reps,
                                             inner=2)[0] * 1e3
            row["pallas_gpu_p2_fb_ms"] = timeit(grad, state, partial, bank, query, gate, ct, reps=reps,
                                                inner=2)[0] * 1e3
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:500]
        log(json.dumps(row))
        rows.append(row)
    return rows


def sweep_p2_bwd(log, shapes, kernels=(0, 4, 8, 12), reps=21):
    """Phase 2 + gate for the tilings of ``P2_BWD_TILES``."""
    from pallas_kernels.depth_attention import tiling

    cases = [(kernels, True, tiling.Tiles(bt, bdm, bdm, w, st, block_d_bwd=bdb))
             for bt, bdm, bdb, w, st in P2_BWD_TILES]
    return _time_p2(log, shapes, cases, reps=reps)


def p2_forms(log, shapes, kernels=(0, 4, 8, 12), reps=21):
    """Phase 2 + gate with its Pallas backward in each form (``fused_bwd_phase2.FORMS``)."""
    from pallas_kernels.depth_attention import fused_bwd_phase2

    return _time_p2(log, shapes, [(kernels, True, None, {"phase2_backward_form": f}) for f in fused_bwd_phase2.FORMS],
                    reps=reps)


def p2_gpu_kernels(log, shapes, reps=21):
    """Phase 2 fwd and fwd + Pallas bwd with each ``gpu_kernels``: ``"triton"`` (every pass),
    ``"auto"`` (for MSAR on a GPU: the Mosaic GPU forward, the Triton backward) and ``"mosaic"``
    (also the backward's statistics and ``d_acc`` passes in Mosaic GPU); MSAR with the gate and
    AttnRes."""
    return _time_p2(log, shapes, [(k, k != (0,), None, {"gpu_kernels": g}) for k in ((0, 4, 8, 12), (0,))
                                  for g in ("triton", "auto", "mosaic")], reps=reps)


def sweep_p2_streams(log, shapes, reps=21):
    """Phase 2 for the stream sets of ``P2_STREAM_CASES`` (default tiles)."""
    return _time_p2(log, shapes, [(k, g, None) for k, g in P2_STREAM_CASES], reps=reps)


class _NoRowSums:
    """``jnp`` with ``sum(x, axis=0)`` and ``dot`` (a reverse-T kernel's reductions over tokens:
    per-tile sums, the sums of the carried tiles, phase 1's query-gradient products) replaced by
    zeros: a leave-one-out variant for attribution only (its gradients are wrong)."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def sum(x, axis=None, **kw):
        return jnp.zeros(x.shape[1:], x.dtype) if axis == 0 else jnp.sum(x, axis=axis, **kw)

    @staticmethod
    def dot(a, b, **kw):
        return jnp.zeros((a.shape[0], b.shape[1]), jnp.float32)


def _no_row_shift(g, delta, bt, how):
    return g, g


def _no_buffer_shift(buf_ref, lagged, bt, backend):
    return {delta: (tap, tap) for delta, tap in lagged.items()}


@contextlib.contextmanager
def _patched(module, **attrs):
    """``module``'s attributes set to ``attrs`` inside the block (a kernel traced inside keeps them)."""
    old = {k: getattr(module, k) for k in attrs}
    for k, v in attrs.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _capture_calls(run, targets):
    """Run ``run()`` with each ``targets[name] = (module, attribute)`` function wrapped so that its
    last call's ``(fn, args, kwargs)`` is recorded; returns them by name."""
    calls = {}

    def capture(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] = (fn, args, kwargs)
            return fn(*args, **kwargs)
        return wrapped

    with contextlib.ExitStack() as stack:
        for name, (module, attr) in targets.items():
            stack.enter_context(_patched(module, **{attr: capture(name, getattr(module, attr))}))
        jax.block_until_ready(run())
    return calls


def _time_parts(calls, row, reps):
    """Each captured call timed alone (ms, median), and their sum."""
    total = 0.0
    for name, (fn, args, kwargs) in calls.items():
        row[f"{name}_ms"] = timeit(jax.jit(functools.partial(fn, **kwargs)), *args, reps=reps, inner=2)[0] * 1e3
        total += row[f"{name}_ms"]
    row["sum_of_calls_ms"] = total


def _time_variants(row, prefix, call, module, variants, reps):
    """``call = (fn, args, kwargs)`` re-traced with ``module``'s attributes patched as each
    ``variants[label]`` says (``dict``) or with other keyword arguments (``("kwargs", dict)``)."""
    fn, args, kwargs = call
    for label, change in variants.items():
        try:
            if isinstance(change, tuple):
                f = jax.jit(functools.partial(fn, **{**kwargs, **change[1]}))
                jax.block_until_ready(f(*args))
            else:
                with _patched(module, **change):  # the compiled kernel keeps the variant
                    f = jax.jit(functools.partial(fn, **kwargs))
                    jax.block_until_ready(f(*args))
            row[f"{prefix}_{label}_ms"] = timeit(f, *args, reps=reps, inner=2)[0] * 1e3
        except Exception as e:  # noqa: BLE001
            row[f"{prefix}_{label}_error"] = repr(e)[:300]


_NO_SHIFT = dict(shift_rows=_no_row_shift, shift_rows_via_buffer=_no_buffer_shift)
_LEAVE_ONE_OUT = {
    "without_row_shift": _NO_SHIFT,
    "without_token_sums": dict(jnp=_NoRowSums()),
    "without_both": dict(**_NO_SHIFT, jnp=_NoRowSums()),
}


def _on_gpu():
    """Backend keywords of the kernels: compiled Triton on a GPU, interpret mode elsewhere
    (the ``--small`` smoke run)."""
    on_gpu = jax.default_backend() == "gpu"
    return dict(backend="triton" if on_gpu else "interpret", interpret=not on_gpu)


def parts_p2_bwd(log, shapes, kernels=(0, 4, 8, 12), heads=1, dtype=jnp.bfloat16, reps=21):
    """Phase 2's Pallas backward (with the gate) taken apart: each of its ``pallas_call``s
    timed alone on the arguments it gets inside ``fused_bwd_phase2._backward``, then the
    reverse-T input kernel with one stage left out (the transposed conv's row shift, the token
    reductions of the bank, query and gate-weight gradients, both), for other tiles, with fewer
    scratch slots for the buffer row shift (the default) and with the dot row shift. The
    leave-one-out variants compute wrong gradients: their times only say where the time goes."""
    from pallas_kernels.depth_attention import fused_bwd_phase2 as p2b
    from pallas_kernels.depth_attention import tiling

    batch, t_len, d, n = shapes["batch"], shapes["t_len"], shapes["d"], shapes["n"]
    sources, banks, queries, partial, bank, query, gate = make_inputs(n, batch, t_len, d, 1, kernels, heads, dtype)
    state = jax.tree.map(lambda a: a[0], reference.phase1(sources, banks, queries, stream_kernels=kernels,
                                                          heads=heads))
    dh = jax.random.normal(jax.random.key(11), (batch, t_len, d), jnp.float32)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=1, backend="triton",
                                n_streams=len(kernels))
    calls = _capture_calls(
        lambda: p2b._backward(state, partial, bank, query, True, gate, None, dh, stream_kernels=kernels, heads=heads,
                              eps=1e-6, gate_eps=1e-6, tiles=tiles, shift="buffer", **_on_gpu()),
        {name: (p2b, name) for name in ("scores_call", "_stats_call", "_dstate_call", "_dinput_call")})
    row = {"p2_bwd_parts": str(kernels), "tiles": str(tiles)}
    _time_parts(calls, row, reps)
    variants = {f"bt{bt}_bd{bd}_w{w}": ("kwargs", {"tiles": dataclasses.replace(tiles, block_t=bt, block_d_bwd=bd,
                                                                                num_warps=w)})
                for bt, bd, w in P2_DINPUT_TILES}
    for slots in (4, 1):
        variants[f"buffer_slots{slots}"] = ("kwargs", {"tiles": dataclasses.replace(tiles, shift_slots=slots)})
    variants["shift_dot"] = ("kwargs", {"shift": "dot"})
    _time_variants(row, "dinput", calls["_dinput_call"], p2b, {**variants, **_LEAVE_ONE_OUT}, reps)
    log(json.dumps(row))
    return row


def parts_p1_bwd(log, shapes, kernels=(0, 4, 8, 12), heads=1, dtype=jnp.bfloat16, reps=21):
    """Phase 1's Pallas backward taken apart as ``parts_p2_bwd`` does phase 2's: its scores,
    ``<g_A, E>`` and reverse-T gradient kernels each timed alone (one block, S targets), the
    ``wide`` form's stream-cotangent kernel, transpose and query products alone, then
    the reverse-T kernel with the buffer row shift (16, 4, 1 scratch slots) instead of its
    default dot shift, and without its row shift, without its token reductions (bank and query
    gradients), without both."""
    from pallas_kernels.depth_attention import fused, tiling
    from pallas_kernels.depth_attention import fused_bwd_phase1 as p1b

    n, batch, t_len, d, n_targets = (shapes[k] for k in ("n", "batch", "t_len", "d", "n_targets"))
    sources, banks, queries, *_ = make_inputs(n, batch, t_len, d, n_targets, kernels, heads, dtype)
    smax = reference.phase1(sources, banks, queries, stream_kernels=kernels, heads=heads).max
    ks = jax.random.split(jax.random.key(12), 2)
    m = len(kernels)
    ct = reference.SoftmaxState(jnp.zeros_like(smax), jax.random.normal(ks[0], smax.shape),
                                jax.random.normal(ks[1], (n_targets, m, batch, t_len, d)))
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=n_targets, backend="triton",
                                n_streams=m)
    calls = _capture_calls(
        lambda: p1b.phase1_backward(sources, banks, queries, None, None, smax, ct, stream_kernels=kernels,
                                    heads=heads, eps=1e-6, tiles=tiles, form="reverse_t", **_on_gpu()),
        {"scores_call": (fused, "scores_call"), "gdots_call": (p1b, "gdots_call"),
         "grads_call": (p1b, "grads_call")})
    row = {"p1_bwd_parts": str(kernels), "tiles": str(tiles)}
    _time_parts(calls, row, reps)
    from pallas_kernels.depth_attention import conv_transpose

    wide = _capture_calls(  # the wide form's own passes (passes 1-3 are the same)
        lambda: p1b.phase1_backward(sources, banks, queries, None, None, smax, ct, stream_kernels=kernels,
                                    heads=heads, eps=1e-6, tiles=tiles, form="wide", **_on_gpu()),
        {"dstreams_call": (p1b, "dstreams_call"), "sources_transpose": (conv_transpose, "sources_transpose"),
         "query_grads": (p1b, "_query_grads")})
    wide_row = {}
    _time_parts(wide, wide_row, reps)
    row.update({f"wide_{k}": v for k, v in wide_row.items()})
    variants = {f"buffer_slots{slots}": ("kwargs", {"shift": "buffer",
                                                     "tiles": dataclasses.replace(tiles, shift_slots=slots)})
                for slots in (16, 4, 1)}
    _time_variants(row, "grads", calls["grads_call"], p1b, {**variants, **_LEAVE_ONE_OUT}, reps)
    log(json.dumps(row))
    return row


def p1_backwards(log, shapes, kernels=(0, 4, 8, 12), heads=1, dtype=jnp.bfloat16, reps=21):
    """Phase 1 forward + backward (one block) with each backward: the closed-form XLA one
    (``xla``), with the ``conv_transpose`` kernel (``hybrid``), and the Pallas kernels in both
    forms (``pallas`` ``reverse_t`` / ``wide``, ``fused_bwd_phase1.FORMS``); then the
    expansion's transpose of one source alone, by XLA's autodiff and by the kernel (ms)."""
    from pallas_kernels.depth_attention import conv_transpose, fused_bwd_phase1, tiling

    n, batch, t_len, d, n_targets = (shapes[k] for k in ("n", "batch", "t_len", "d", "n_targets"))
    sources, banks, queries, *_ = make_inputs(n, batch, t_len, d, n_targets, kernels, heads, dtype)
    ks = jax.random.split(jax.random.key(12), 2)
    m = len(kernels)
    ct = jax.random.normal(ks[0], (n_targets, m, batch, t_len, d))
    row = {"p1_backwards": str(kernels)}
    variants = {"xla": dict(backward="xla"), "hybrid": dict(backward="hybrid")}
    variants.update({f"pallas_{form}": dict(backward="pallas", phase1_backward_form=form)
                     for form in fused_bwd_phase1.FORMS})
    for label, opts in variants.items():
        def loss(x, b, q, g, opts=opts):
            state = api.phase1(x, b, q, stream_kernels=kernels, heads=heads, implementation="pallas_gpu", **opts)
            return jnp.sum(state.acc * g) + jnp.sum(state.denom)

        try:
            f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            row[f"p1_fb_{label}_ms"] = timeit(f, sources, banks, queries, ct, reps=reps, inner=2)[0] * 1e3
        except Exception as e:  # noqa: BLE001 - keep timing the others
            row[f"p1_fb_{label}_error"] = repr(e)[:300]
        log(json.dumps({label: row.get(f"p1_fb_{label}_ms")}))  # each as it comes (a run may be cut short)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=n_targets, backend="triton",
                                n_streams=m)
    transpose = functools.partial(conv_transpose.expansion_transpose, stream_kernels=kernels, tiles=tiles,
                                  **_on_gpu())
    d_streams = jax.random.normal(ks[1], (m, batch, t_len, d))
    x, bank = sources[0], banks[0]
    _, vjp = jax.vjp(lambda a, b: reference.expand(a, b, kernels), x, bank)
    row["transpose_one_source_autodiff_ms"] = timeit(jax.jit(lambda g: vjp(g)), d_streams, reps=reps)[0] * 1e3
    row["transpose_one_source_kernel_ms"] = timeit(jax.jit(lambda g, a, b: transpose(g, a, b)), d_streams, x, bank,
                                                   reps=reps)[0] * 1e3
    log(json.dumps(row))
    return row


def per_target(log, shapes, kernels=(0, 4, 8, 12), heads=1, dtype=jnp.bfloat16, reps=21, tile_variants=()):
    """Phase 1 forward, and forward + Pallas backward (wide form), with the state stacked
    (one ``[S, m, B, T, d]`` array) and per target (``api.phase1(per_target=True)``: ``S``
    arrays out of the mixing kernel, ``S`` cotangent inputs into the backward's kernels), each
    per-target output read (ms)."""
    n, batch, t_len, d, n_targets = (shapes[k] for k in ("n", "batch", "t_len", "d", "n_targets"))
    sources, banks, queries, *_ = make_inputs(n, batch, t_len, d, n_targets, kernels, heads, dtype)
    ct = jax.random.normal(jax.random.key(13), (n_targets, len(kernels), batch, t_len, d))
    row = {"per_target": str(kernels)}
    kw = dict(stream_kernels=kernels, heads=heads, implementation="pallas_gpu", backward="pallas")
    for split in (False, True):
        label = "per_target" if split else "stacked"

        def states(x, b, q, split=split):
            out = api.phase1(x, b, q, per_target=split, **kw)
            return out if split else reference.split_targets(out)

        def fwd(x, b, q):  # every target's state read once, as the phase-2 reads would
            return sum(jnp.sum(st.acc[:, :, :8]) for st in states(x, b, q))

        def loss(x, b, q, g):
            return sum(jnp.sum(st.acc * g[i]) + jnp.sum(st.denom) for i, st in enumerate(states(x, b, q)))

        row[f"p1_fwd_{label}_ms"] = timeit(jax.jit(fwd), sources, banks, queries, reps=reps, inner=2)[0] * 1e3
        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        row[f"p1_fb_{label}_ms"] = timeit(f, sources, banks, queries, ct, reps=reps, inner=2)[0] * 1e3
        log(json.dumps({k: v for k, v in row.items() if label in k}))
    # the kernels that take the state apart, alone: the mixing kernel's outputs, the backward's
    # <g_A, E> and stream-cotangent kernels' inputs; with the heuristic's tiles, then (``tiles``)
    # the mixing and stream-cotangent kernels with narrower chunks or more rows
    from pallas_kernels.depth_attention import fused, fused_bwd_phase1, tiling

    m = len(kernels)
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=max(kernels), n_targets=n_targets, backend="triton",
                                n_streams=m)
    kk = dict(stream_kernels=kernels, tiles=tiles, **_on_gpu())
    p = jax.nn.softmax(jax.random.normal(jax.random.key(14), (n_targets, n, m, batch, t_len, heads)), axis=1)
    w = jax.random.normal(jax.random.key(15), (n, m, batch, t_len, 1))
    for t in tile_variants:
        kt = dict(kk, tiles=t)
        for split in (False, True):
            label = f"{'per_target' if split else 'stacked'}_bt{t.block_t}_bd{t.block_d_mix}_w{t.num_warps}"
            g = [ct[i] for i in range(n_targets)] if split else ct
            mix = jax.jit(lambda x, b, p, split=split, kt=kt: fused.mix_call(
                x, b, p, None, mode="acc", heads=heads, split_targets=split, **kt))
            ds = jax.jit(lambda x, b, q, g, p, w, kt=kt: fused_bwd_phase1.dstreams_call(
                x, b, q, g, p, p, w, None, heads=heads, out_dtype=dtype, **kt))
            try:
                row[f"mix_acc_{label}_ms"] = timeit(mix, sources, banks, p, reps=reps)[0] * 1e3
                row[f"dstreams_{label}_ms"] = timeit(ds, sources, banks, queries, g, p, w, reps=reps)[0] * 1e3
            except Exception as e:  # noqa: BLE001 - keep timing the others
                row[f"{label}_error"] = repr(e)[:200]
            log(json.dumps({k: v for k, v in row.items() if label in k}))
    for split in (False, True):
        label = "per_target" if split else "stacked"
        mix = jax.jit(lambda x, b, p, split=split: fused.mix_call(x, b, p, None, mode="acc", heads=heads,
                                                                  split_targets=split, **kk))
        row[f"mix_acc_{label}_ms"] = timeit(mix, sources, banks, p, reps=reps)[0] * 1e3
        g = [ct[i] for i in range(n_targets)] if split else ct
        gd = jax.jit(lambda x, b, g: fused_bwd_phase1.gdots_call(x, b, g, None, **kk))
        row[f"gdots_{label}_ms"] = timeit(gd, sources, banks, g, reps=reps)[0] * 1e3
        ds = jax.jit(lambda x, b, q, g, p, w: fused_bwd_phase1.dstreams_call(
            x, b, q, g, p, p, w, None, heads=heads, out_dtype=dtype, **kk))
        row[f"dstreams_{label}_ms"] = timeit(ds, sources, banks, queries, g, p, w, reps=reps)[0] * 1e3
        log(json.dumps({k: v for k, v in row.items() if label in k and not k.startswith("p1_")}))
    log(json.dumps(row))
    return row


def set_kernel_options(options: list[str]) -> dict:
    """``MODULE.NAME=VALUE`` items: sets ``pallas_kernels.depth_attention.MODULE.NAME`` (a module
    default the kernels read when they are built, e.g. ``mosaic_gpu.REREAD_ORDER=reverse``) to
    VALUE, a Python literal or else the string. Raises ``ValueError`` (naming the item) for a
    malformed item, an unknown module or a name the module does not have (so a typo cannot time
    the defaults under another label). Returns ``{item's name: value}``."""
    import ast
    import importlib

    done = {}
    for item in options:
        name, sep, text = item.partition("=")
        module_name, dot, attr = name.strip().rpartition(".")
        if not sep or not dot or not attr:
            raise ValueError(f"--kernel-option {item!r}: must be MODULE.NAME=VALUE (e.g. mosaic_gpu.REREAD_ORDER=reverse)")
        try:
            module = importlib.import_module(f"pallas_kernels.depth_attention.{module_name}")
        except ImportError as e:
            raise ValueError(f"--kernel-option {item!r}: no module pallas_kernels.depth_attention.{module_name}") from e
        if not hasattr(module, attr):
            raise ValueError(f"--kernel-option {item!r}: {module_name} has no {attr}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        setattr(module, attr, value)
        done[name.strip()] = value
    return done


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="CPU smoke run of the harness")
    ap.add_argument("--kernel-option", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module default the kernels read when built (set_kernel_options), e.g. "
                         "mosaic_gpu.INPUTS_SLOTS=2; repeatable")
    ap.add_argument("--budgets", default=None, metavar="TBPS,...",
                    help="print what the per-sublayer targets ask of each bandwidth (TB/s, comma-"
                         "separated: MSAR's bytes floors with a float32 and a bf16 state and "
                         "the fraction of the bandwidth each target needs) and exit; runs on any machine")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="time each kernel alone for several tilings")
    ap.add_argument("--backward", default="xla",
                    help="the kernels' backward, or several comma-separated: xla (closed form), pallas (the "
                         "Pallas backward kernels), hybrid (phase 1's closed form with the conv_transpose "
                         "kernel); both = xla,pallas")
    ap.add_argument("--bwd_chunks", default="",
                    help="comma-separated channel chunks: time phase 1 fwd + Pallas bwd for each (Tiles.block_d_bwd)")
    ap.add_argument("--p2_bwd_sweep", action="store_true",
                    help="time phase 2 + gate fwd + Pallas bwd for the tilings of P2_BWD_TILES")
    ap.add_argument("--p2_stream_sweep", action="store_true",
                    help="time phase 2 fwd and fwd + Pallas bwd for the stream sets of P2_STREAM_CASES")
    ap.add_argument("--p2_bwd_parts", action="store_true",
                    help="time each pallas_call of phase 2's Pallas backward alone, and its input kernel with "
                         "one stage left out (attribution)")
    ap.add_argument("--p1_bwd_parts", action="store_true",
                    help="the same for phase 1's Pallas backward (one block)")
    ap.add_argument("--p2_forms", action="store_true",
                    help="phase 2 + gate fwd + Pallas bwd in each form of its backward (reverse_t, wide)")
    ap.add_argument("--p2_gpu_kernels", action="store_true",
                    help="phase 2 fwd and fwd + Pallas bwd with gpu_kernels triton, auto and mosaic")
    ap.add_argument("--p1_backwards", action="store_true",
                    help="phase 1 fwd + bwd with each backward (xla, hybrid, pallas in both forms), and the "
                         "expansion's transpose alone (autodiff, kernel)")
    ap.add_argument("--base_shape", action="store_true",
                    help="the shape of the base config's reads (n=8, B=64, T=1024, d=1024, S=8) instead of the bench shape "
                         "(n=9, B=8, T=2048, d=2048, S=8)")
    ap.add_argument("--per_target", action="store_true",
                    help="phase 1 fwd and fwd + Pallas bwd with the state stacked and per target (api.phase1)")
    ap.add_argument("--per_target_tiles", action="store_true",
                    help="with --per_target: also the mixing and stream-cotangent kernels at three other tilings")
    ap.add_argument("--sweeps_only", action="store_true", help="run the requested sweeps, skip the main table")
    ap.add_argument("--state_dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the kernels' phase-1 state in the main table (api.phase1; the floor counts it)")
    ap.add_argument("--gpu_kernels", default="auto", choices=("auto", "mosaic", "triton"),
                    help="the main table's GPU lowering (api's gpu_kernels): auto (per kernel, the faster as "
                         "timed), mosaic (every kernel that has a Mosaic GPU form), triton")
    ap.add_argument("--fb_forms", default="vjp",
                    help="how forward + backward is timed, comma-separated, the first in the table: vjp (the "
                         "outputs and the pullback of a cotangent in their dtypes, as the model calls the reads), "
                         "loss (value_and_grad of sum(out * ct), float32 ct)")
    ap.add_argument("--p1_forms", default="model",
                    help="how the kernels' phase 1 hands its state to phase 2, comma-separated, the first in the "
                         "table: model (the model's: value_channel for one stream, per_target for several), "
                         "stacked (one [S, m, B, T, d] state), per_target, value_channel (P1_FORMS)")
    ap.add_argument("--inner", type=int, default=20,
                    help="the main table's calls per timed repetition, forwards; each "
                         "repetition also pays the host's dispatch before its first call and the wait after "
                         "its last, 0.1-0.25 ms on the H200, which more calls amortise")
    ap.add_argument("--inner_fb", type=int, default=20,
                    help="the same for forward + backward")
    ap.add_argument("--configs", default="msar,attnres",
                    help="the main table's rows, comma-separated: msar, attnres, mhar (one stream, 8 heads)")
    ap.add_argument("--no_bwd_barrier", action="store_true",
                    help="trace the XLA backwards without their optimization barrier on (residuals, cotangent) "
                         "(xla_streaming.ordered_after_cotangent): what the barrier costs a read (the Pallas "
                         "backwards run without it)")
    ap.add_argument("--query_grads_heads", default=None, choices=fused_bwd_phase1.QUERY_GRADS_HEADS,
                    help="how phase 1's backward runs the query gradient's products with several heads "
                         "(fused_bwd_phase1.QUERY_GRADS_HEADS; default: its DEFAULT_QUERY_GRADS_HEADS)")
    args = ap.parse_args()
    try:
        kernel_options = set_kernel_options(args.kernel_option)
    except ValueError as e:
        ap.error(str(e))
    if args.budgets is not None:
        try:
            tbps = [float(b) for b in args.budgets.split(",")]
            rows = target_budgets(tbps, **ISSUE_SHAPE)  # MSAR: AttnRes's target is 1.5x its floor
        except ValueError as e:
            ap.error(f"--budgets={args.budgets!r}: comma-separated bandwidths in TB/s, each > 0 ({e})")
        print_target_budgets(rows)
        return
    if args.query_grads_heads:  # read when the backward is traced
        fused_bwd_phase1.DEFAULT_QUERY_GRADS_HEADS = args.query_grads_heads
    backwards = ("xla", "pallas") if args.backward == "both" else tuple(args.backward.split(","))
    if not backwards or any(b not in ("xla", "pallas", "hybrid") for b in backwards):
        ap.error(f"--backward={args.backward!r}: each must be xla, pallas or hybrid (or 'both')")
    table_configs = TABLE_CONFIGS
    configs = tuple(args.configs.split(","))
    if not configs or any(c not in table_configs for c in configs):
        ap.error(f"--configs={args.configs!r}: each must be one of {sorted(table_configs)}")
    if args.inner < 1 or args.inner_fb < 1:
        ap.error(f"--inner={args.inner}, --inner_fb={args.inner_fb}: each must be at least 1")
    fb_forms = tuple(args.fb_forms.split(","))
    if not fb_forms or any(f not in FB_FORMS for f in fb_forms) or len(set(fb_forms)) < len(fb_forms):
        ap.error(f"--fb_forms={args.fb_forms!r}: each must be vjp or loss, once")
    p1_forms = tuple(args.p1_forms.split(","))
    if not p1_forms or any(f not in P1_FORMS for f in p1_forms) or len(set(p1_forms)) < len(p1_forms):
        ap.error(f"--p1_forms={args.p1_forms!r}: each must be one of {P1_FORMS}, once")
    if args.no_bwd_barrier:  # read by vjp.py and xla_streaming at trace time
        xla_streaming.ordered_after_cotangent = lambda res, ct: (res, ct)
    out_dir = os.environ.get("OUT", ".")
    log_path = os.path.join(out_dir, "bench_log.jsonl")

    def log(line):
        print(line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    log(json.dumps({"device": str(jax.devices()[0]), "kind": jax.devices()[0].device_kind, "jax": jax.__version__,
                    "bwd_barrier": not args.no_bwd_barrier, "kernel_options": repr(kernel_options)}))
    if args.small:
        shapes = dict(n=3, batch=1, t_len=32, d=64, n_targets=2)
        impl, reps, args.inner, args.inner_fb = "pallas_gpu", 3, 1, 1
        bw = 1e10
        args.sweep = False
    else:
        shapes = BASE_SHAPE if args.base_shape else ISSUE_SHAPE  # base: 8 buffer slots, 64 x 1024 tokens, d 1024
        impl, reps = "pallas_gpu", 25
        bw = copy_bandwidth()
    log(json.dumps({"copy_bandwidth_TBps": bw / 1e12}))
    opts = {}
    if args.sweep:
        srows = sweep(log, shapes)
        print("\n== kernels alone, ms (median of 21 reps) ==")
        for r in srows:
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                           if k != "_tiles"))

        def cost(r, keys):
            v = [r[k] for k in keys]
            return sum(v) if all(isinstance(x, float) for x in v) else float("inf")

        b1 = min(srows, key=lambda r: cost(r, ("p1_scores", "p1_mix")))
        b2 = min(srows, key=lambda r: cost(r, ("p2_scores", "p2_stats", "p2_gate")))
        opts = dict(p1_opts={"tiles": b1["_tiles"]}, p2_opts={"tiles": b2["_tiles"]})
        log(json.dumps({"best_p1": b1["tiles"], "best_p2": b2["tiles"]}))
    if args.bwd_chunks:
        sweep_bwd_chunks(log, shapes, [int(c) for c in args.bwd_chunks.split(",")], reps=3 if args.small else 21)
    if args.p2_bwd_sweep:
        sweep_p2_bwd(log, shapes, reps=3 if args.small else 21)
    if args.p2_stream_sweep:
        sweep_p2_streams(log, shapes, reps=3 if args.small else 21)
    if args.p2_bwd_parts:
        parts_p2_bwd(log, shapes, reps=3 if args.small else 21)
    if args.p1_bwd_parts:
        parts_p1_bwd(log, shapes, reps=3 if args.small else 21)
    if args.p1_backwards:
        p1_backwards(log, shapes, reps=3 if args.small else 21)
    if args.p2_gpu_kernels:
        p2_gpu_kernels(log, shapes, reps=3 if args.small else 21)
    if args.p2_forms:
        p2_forms(log, shapes, reps=3 if args.small else 21)
    if args.per_target:
        from pallas_kernels.depth_attention.tiling import Tiles

        variants = [Tiles(16, 64, 64, 8, 1), Tiles(16, 64, 32, 4, 1), Tiles(32, 64, 64, 8, 1)] if args.per_target_tiles \
            else []
        per_target(log, shapes, reps=3 if args.small else 21, tile_variants=variants)
    if args.sweeps_only:
        return
    rows = []
    gpu_opts = {} if args.gpu_kernels == "auto" else {"gpu_kernels": args.gpu_kernels}
    for name, kernels, heads in (table_configs[c] for c in configs):
        xla_row = None
        for backward in backwards:
            run_opts = {k: dict(v, backward=backward, **gpu_opts) for k, v in
                        {"p1_opts": opts.get("p1_opts", {}), "p2_opts": opts.get("p2_opts", {})}.items()}
            try:
                state = "" if args.state_dtype == "float32" else ",state=bf16"
                state += "" if args.gpu_kernels == "auto" else f",{args.gpu_kernels}"
                row = run_config(f"{name}[bwd={backward}{state}]", kernels=kernels, heads=heads, dtype=jnp.bfloat16,
                                 impl=impl, bw=bw, log=log, reps=reps, inner=args.inner, inner_fb=args.inner_fb,
                                 with_bwd=not args.no_bwd,
                                 time_xla=xla_row is None, state_dtype=args.state_dtype, fb_forms=fb_forms,
                                 p1_forms=p1_forms, **shapes, **run_opts)
            except Exception as e:  # noqa: BLE001 - keep measuring the other configs
                log(json.dumps({"name": name, "backward": backward, "error": repr(e)[:2000]}))
                continue
            if xla_row is None:
                xla_row = row
            else:  # the XLA reference was timed once per config
                row.update({k: v for k, v in xla_row.items() if k.startswith("xla_")})
            rows.append(row)
    print("\n== per-sublayer amortised, ms (median of >= 20 reps) ==")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; shapes {shapes}")
    for r in rows:
        forms = r["p1_forms"].split(",")
        p1_sfx = [""] + [f"_{f}" for f in forms[1:]]  # the XLA reference has one (stacked) form
        modes = [(f"fwd{p}", f"fwd{p}_ms", "fwd_ms") for p in p1_sfx]
        modes += [(f"fb{f}{p}", f"fb{f}{p}_ms", f"fb{f}_ms") for f in [""] + [f"_{f}" for f in fb_forms[1:]]
                  for p in p1_sfx]
        print(f"{r['name']:>16} phase 1 forms: {', '.join(forms)}")
        for mode, key, xla_key in modes:
            k, x = f"{impl}_{key}", f"xla_{xla_key}"
            if k not in r:
                continue
            fwd_mode = mode.startswith("fwd")
            floor = r["floor_fwd_ms" if fwd_mode else "floor_fb_ms"]
            flops = r.get("flop_floor_fwd_ms" if fwd_mode else "flop_floor_fb_ms", float("nan"))
            if x not in r:  # a form of the XLA path not timed
                continue
            print(f"{r['name']:>16} {mode:>8}: kernel {r[k]:8.3f}  xla {r[x]:8.3f}  floor {floor:7.3f}  "
                  f"kernel/xla {r[k] / r[x]:5.2f}  floor/kernel {floor / r[k]:5.2f}  "
                  f"flop floor {flops:6.3f} ({flops / r[k]:4.2f})")
        print(f"{r['name']:>16} parts: " + ", ".join(f"{k}={v:.3f}" for k, v in r.items()
                                                      if isinstance(v, float) and ("p1" in k or "p2" in k)))


if __name__ == "__main__":
    main()
