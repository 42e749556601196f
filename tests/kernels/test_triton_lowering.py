"""Every GPU kernel (forward, and both backwards) lowers through Pallas' Triton lowering to a
Triton module for an H200 (sm_90), checked on this CPU machine: ``jit(grad(...)).lower(
lowering_platforms=("cuda",))`` runs the Pallas -> Triton IR lowering of each ``pallas_call``
without a GPU. It catches what interpret mode cannot (ops with no Triton lowering, bad block
shapes, value slicing on the Triton path); compiling the Triton IR to machine code, and the
numbers, are left to the GPU-marked tests."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.depth_attention import api, reference

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "custom_call @mosaic_gpu_v2"


@pytest.fixture
def h200(monkeypatch):
    """Pallas' Triton lowering asks the local GPU for its compute capability; answer sm_90."""
    from jax._src.pallas.triton import gpu_info

    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))


def _lower(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("kernels, heads, segments", [((0, 4, 8, 12), 1, True), ((0,), 1, False),
                                                      ((0, 0, 0), 2, False)], ids=["msar", "attnres", "no_conv_heads2"])
@pytest.mark.parametrize("backward, calls", [("xla", (2, 3)), ("pallas", (5, 6))], ids=["xla_bwd", "pallas_bwd"])
def test_kernels_lower_to_triton(h200, kernels, heads, segments, backward, calls):
    n, batch, t_len, d, n_targets, m = 3, 2, 40, 64, 2, len(kernels)
    keys = jax.random.split(jax.random.key(0), 6)
    sources = jax.random.normal(keys[0], (n, batch, t_len, d))
    banks = 0.5 * jax.random.normal(keys[1], (n, sum(kernels), d)) if sum(kernels) else None
    queries = jax.random.normal(keys[2], (n_targets, m, d))
    seg = jnp.asarray([[0] * 17 + [1] * (t_len - 17)] * batch, jnp.int32) if segments else None
    # the Triton kernels, also where "auto" would take phase 2's Mosaic GPU forward (see below)
    kw = dict(stream_kernels=kernels, heads=heads, segment_ids=seg, implementation="pallas_gpu", interpret=False,
              backward=backward, gpu_kernels="triton")

    def loss1(x, b, q):
        state = api.phase1(x, b, q, **kw)
        return jnp.sum(state.acc) + jnp.sum(state.denom)

    text = _lower(jax.grad(loss1, argnums=(0, 2) if banks is None else (0, 1, 2)), sources, banks, queries)
    # forward: scores + mix; the Pallas backward (its default "wide" form) adds scores, <g_A, E>,
    # the stream cotangents and, with conv streams, the expansion's transpose
    assert text.count(TRITON_CALL) == calls[0] + (backward == "pallas" and any(kernels))

    state = jax.tree.map(lambda a: a[0], reference.phase1(sources, banks, queries, stream_kernels=kernels, heads=heads))
    partial = jax.random.normal(keys[3], (batch, t_len, d))
    bank = None if banks is None else banks[0]
    gate = (jax.random.normal(keys[4], (m * d, m)) / (m * d) ** 0.5, jnp.float32(0.7), jnp.zeros((m,)))

    def loss2(st, x, b, q, g):
        return jnp.sum(api.phase2_fused(st, x, b, q, True, g, **kw))

    args = (state, partial, bank, queries[0], gate)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    text = _lower(jax.grad(loss2, argnums=argnums), *args)
    # forward: scores + gate stats + gated mix; the Pallas backward adds 3 passes (it starts
    # from the forward's scores, kept by the custom_vjp, instead of re-scoring: pass 0 is gone)
    assert text.count(TRITON_CALL) == calls[1]


@pytest.mark.parametrize("gpu_kernels, triton_calls, mosaic_calls", [("auto", 0, 3), ("triton", 6, 0)])
def test_phase2_mosaic_gpu_kernels_lower(h200, gpu_kernels, triton_calls, mosaic_calls):
    """Phase 2 + gate with the Pallas backward for an H200: ``"auto"`` takes the Mosaic forward
    and the backward's two Mosaic kernels (gate statistics and ``d_acc``; the reverse-T input
    pass) for several streams; ``"triton"`` keeps the forward's three calls and the
    backward's three passes in Triton. (The Mosaic GPU lowering
    compiles each kernel here: about 15-35 s of CPU each.)"""
    kernels, batch, t_len, d, m = (0, 4, 8, 12), 2, 100, 64, 4
    keys = jax.random.split(jax.random.key(0), 5)
    state = reference.SoftmaxState(jax.random.normal(keys[0], (m, batch, t_len, 1)),
                                   jnp.ones((m, batch, t_len, 1)), jax.random.normal(keys[1], (m, batch, t_len, d)))
    partial = jax.random.normal(keys[2], (batch, t_len, d), jnp.bfloat16)  # a float32 one overflows shared memory
    bank = jax.random.normal(keys[3], (sum(kernels), d))
    gate = (jax.random.normal(keys[4], (m * d, m)), jnp.float32(0.7), jnp.zeros((m,)))
    seg = jnp.asarray([[0] * 17 + [1] * (t_len - 17)] * batch, jnp.int32)

    def loss(st, x, b, q, g):
        return jnp.sum(api.phase2_fused(st, x, b, q, True, g, stream_kernels=kernels, segment_ids=seg,
                                        implementation="pallas_gpu", interpret=False, backward="pallas",
                                        gpu_kernels=gpu_kernels))

    text = _lower(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), state, partial, bank, jnp.ones((m, d)), gate)
    assert text.count(MOSAIC_GPU_CALL) == mosaic_calls
    assert text.count(TRITON_CALL) == triton_calls


@pytest.mark.parametrize("gpu_kernels, mosaic, mosaic_mix, mosaic_bwd", [
    ("auto", True, True, True), ("mosaic", True, True, True), ("triton", False, False, False)])
def test_phase1_mosaic_gpu_scores_lower(h200, gpu_kernels, mosaic, mosaic_mix, mosaic_bwd):
    """Phase 1 with the Pallas backward for an H200: ``"auto"`` and ``"mosaic"`` take the Mosaic
    GPU scoring pass in the forward and in the backward (the segment bits, a source ruled out,
    two heads), its mixing pass in the forward (a float32 state) and the backward's passes 2
    and 4 (``mosaic_gpu.phase1_backward``), and its transpose where ``heuristics.AUTO_TRANSPOSE`` (always for
    ``"mosaic"``); ``"triton"`` keeps Triton's."""
    kernels, n, batch, t_len, d, n_targets, m = (0, 4, 8, 12), 3, 2, 100, 64, 2, 4
    keys = jax.random.split(jax.random.key(0), 3)
    sources = jax.random.normal(keys[0], (n, batch, t_len, d), jnp.bfloat16)
    banks = 0.5 * jax.random.normal(keys[1], (n, sum(kernels), d))
    seg = jnp.asarray([[0] * 17 + [1] * (t_len - 17)] * batch, jnp.int32)

    def loss(x, b, q):
        st = api.phase1(x, b, q, jnp.asarray([True, False, True]), stream_kernels=kernels, heads=2, segment_ids=seg,
                        implementation="pallas_gpu", interpret=False, backward="pallas", gpu_kernels=gpu_kernels)
        return jnp.sum(st.acc) + jnp.sum(st.denom)

    # value_and_grad: the state's value is not needed for the gradient of this loss, so a gradient
    # alone would drop the (jitted) Mosaic mixing call from the program
    text = _lower(jax.value_and_grad(loss, argnums=(0, 1, 2)), sources, banks,
                  jax.random.normal(keys[2], (n_targets, m, d)))
    # the forward's and the backward's scoring calls share one jitted kernel: one function, two calls
    from pallas_kernels.depth_attention import heuristics

    mosaic_transpose = mosaic_bwd and (gpu_kernels == "mosaic" or heuristics.AUTO_TRANSPOSE)
    n_mosaic = mosaic + mosaic_mix + 2 * mosaic_bwd + mosaic_transpose
    assert text.count(MOSAIC_GPU_CALL) == n_mosaic
    assert len(re.findall(r"call @run", text)) == n_mosaic + mosaic  # the scoring kernel: two calls
    assert ('name = "depth_attention_scores"' in text) is not mosaic  # Triton's scoring kernel
    assert ('name = "depth_attention_mix_acc"' in text) is not mosaic_mix  # Triton's mixing kernel
    for name in ("depth_attention_bwd1_gdots", "depth_attention_bwd1_dstreams"):  # Triton's passes 2 and 4
        assert (f'name = "{name}"' in text) is not mosaic_bwd
    assert ('name = "depth_attention_expansion_transpose"' in text) is not mosaic_transpose


# the Pallas kernels each jitted gradient must contain (phase 1, phase 2 + fusion)
MOSAIC_KERNELS = {
    "xla": (("depth_attention_scores",), ("depth_attention_scores",)),
    "pallas": (("depth_attention_scores", "depth_attention_bwd1_gdots", "depth_attention_bwd1_dstreams"),
               ("depth_attention_scores", "depth_attention_phase2_bwd_state", "depth_attention_phase2_bwd_inputs")),
    "pallas_reverse_t": (("depth_attention_scores", "depth_attention_bwd1_gdots", "depth_attention_bwd1_grads"),
                         ("depth_attention_scores", "depth_attention_phase2_bwd_state",
                          "depth_attention_phase2_bwd_inputs")),
}


def _mosaic_params():
    """(mechanism case, backward): the reverse-T form's extra lowerings beyond MSAR's in the slow suite."""
    cases = [((0, 4, 8, 12), 1, True, "msar"), ((0,), 2, False, "mhar"), ((0, 0, 0), 2, True, "no_conv")]
    for backward in ("xla", "pallas", "pallas_reverse_t"):
        for kernels, heads, segments, name in cases:
            marks = (pytest.mark.slow,) if backward == "pallas_reverse_t" and name != "msar" else ()
            yield pytest.param(kernels, heads, segments, backward, marks=marks, id=f"{backward}_bwd-{name}")


@pytest.mark.parametrize("kernels, heads, segments, backward", list(_mosaic_params()))
def test_tpu_kernels_lower_for_mosaic(kernels, heads, segments, backward):
    """The TPU variant passes Pallas' Mosaic lowering for a TPU v5p (block shapes, aligned loads)
    under an abstract TPU mesh, on this CPU: the forward kernels with the default XLA backward,
    and with ``backward="pallas"`` also the Pallas backward kernels (phase 1: scores, ``<g_A, E>``,
    the stream cotangents of the ``wide`` form, or the ``reverse_t`` form's gradient pass; phase 2
    + gate: scores, gate statistics, ``d_state``, the reverse-T input pass). The full Mosaic compile needs libtpu:
    ``benchmarks/tpu_kernels_aot.py`` (BENCHMARKS.md gives the command and its result)."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5p", num_cores=1,
                                                                        platform="tpu"))
    n, batch, t_len, d, n_targets, m = 3, 2, 64, 256, 2, len(kernels)
    sds = jax.ShapeDtypeStruct
    seg = sds((batch, t_len), jnp.int32) if segments else None
    banks = sds((n, sum(kernels), d), jnp.float32) if sum(kernels) else None
    kw = dict(stream_kernels=kernels, heads=heads, implementation="pallas_tpu", interpret=False,
              backward=backward.removesuffix("_reverse_t"))
    if backward.endswith("_reverse_t"):
        kw["phase1_backward_form"] = "reverse_t"

    def loss1(x, b, q, v, sg):  # with a source mask, as the model's: read from SMEM, invalid sources skipped
        state = api.phase1(x, b, q, v, segment_ids=sg, **kw)
        return jnp.sum(state.acc) + jnp.sum(state.denom)

    def loss2(st, x, b, q, g, sg):
        return jnp.sum(api.phase2_fused(st, x, b, q, True, g, segment_ids=sg, **kw))

    f32 = lambda *shape: sds(shape, jnp.float32)  # noqa: E731
    state = reference.SoftmaxState(f32(m, batch, t_len, heads), f32(m, batch, t_len, heads), f32(m, batch, t_len, d))
    gate = (f32(m * d, m), f32(), f32(m))
    with jax.sharding.use_abstract_mesh(mesh):
        for fn, args, names in (
            (jax.grad(loss1, argnums=(0, 2)),
             (f32(n, batch, t_len, d), banks, f32(n_targets, m, d), sds((n,), jnp.bool_), seg),
             MOSAIC_KERNELS[backward][0]),
            (jax.grad(loss2, argnums=(0, 1, 3)),
             (state, f32(batch, t_len, d), None if banks is None else f32(sum(kernels), d), f32(m, d), gate, seg),
             MOSAIC_KERNELS[backward][1] + (("depth_attention_phase2_bwd_stats",) if backward != "xla" else ())),
        ):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
            for name in names:
                assert name in text, name


@pytest.mark.parametrize("shift", ["buffer", "dot"])
def test_row_shifts_lower_to_triton(h200, shift):
    """Both Triton row shifts of the reverse-T kernels lower: through a per-program scratch and
    CTA barriers (``row_shift.shift_rows_via_buffer``, the default) and by 0/1 matrix products
    (phase 2's input kernel with the gate; phase 1's gradient kernel). Their numbers are checked
    in interpret mode by test_fused_bwd_phase{1,2}; their speed is a GPU measurement."""
    from pallas_kernels.depth_attention import fused_bwd_phase1 as fb1
    from pallas_kernels.depth_attention import fused_bwd_phase2 as fb
    from pallas_kernels.depth_attention import tiling

    kernels, heads, batch, t_len, d = (0, 4, 8, 12), 1, 2, 40, 64
    m = len(kernels)
    keys = jax.random.split(jax.random.key(3), 6)
    state = reference.SoftmaxState(jax.random.normal(keys[0], (m, batch, t_len, heads)),
                                   1.0 + jax.random.uniform(keys[1], (m, batch, t_len, heads)),
                                   jax.random.normal(keys[2], (m, batch, t_len, d)))
    partial = jax.random.normal(keys[3], (batch, t_len, d))
    bank = jax.random.normal(keys[4], (sum(kernels), d))
    query = jax.random.normal(keys[5], (m, d))
    gate = (jnp.ones((m * d, m)) / (m * d), jnp.float32(0.7), jnp.zeros((m,)))
    tiles = tiling.choose_tiles(d=d, heads=heads, max_kernel=12, n_targets=1, backend="triton", n_streams=m)

    def grads(st, x, b, q, g, dh):
        return fb._backward(st, x, b, q, True, g, None, dh, stream_kernels=kernels, heads=heads, eps=1e-6,
                            gate_eps=1e-6, tiles=tiles, backend="triton", interpret=False, shift=shift)

    text = _lower(grads, state, partial, bank, query, gate, partial)
    assert text.count(TRITON_CALL) == 4  # scores, gate statistics, d_state, the input kernel

    sources = jnp.stack([partial] * 3)
    queries = jnp.stack([query] * 2)
    smax = reference.phase1(sources, jnp.stack([bank] * 3), queries, stream_kernels=kernels).max
    ct = reference.SoftmaxState(jnp.zeros_like(smax), jnp.ones_like(smax), jnp.ones((2, m, batch, t_len, d)))
    tiles1 = tiling.choose_tiles(d=d, heads=heads, max_kernel=12, n_targets=2, backend="triton", n_streams=m)

    def grads1(x, b, q):
        return fb1.phase1_backward(x, b, q, None, None, smax, ct, stream_kernels=kernels, heads=heads, eps=1e-6,
                                   tiles=tiles1, backend="triton", interpret=False, shift=shift, form="reverse_t")

    text = _lower(grads1, sources, jnp.stack([bank] * 3), queries)
    assert text.count(TRITON_CALL) == 3  # scores, <g_A, E>, the gradient kernel


def test_hybrid_backward_lowers(h200):
    """``backward="hybrid"``: phase 1's closed-form XLA backward with the expansion's transpose
    as a kernel, lowered through Triton (one kernel per source: the first source is peeled off
    the scan over sources) and through Mosaic for a TPU v5p."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    kernels, n, batch, t_len, d, n_targets = (0, 4, 8, 12), 3, 2, 64, 256, 2
    sds = jax.ShapeDtypeStruct
    f32 = lambda *shape: sds(shape, jnp.float32)  # noqa: E731
    args = (f32(n, batch, t_len, d), f32(n, sum(kernels), d), f32(n_targets, len(kernels), d),
            sds((batch, t_len), jnp.int32))

    def loss(impl):
        def f(x, b, q, sg):
            state = api.phase1(x, b, q, segment_ids=sg, stream_kernels=kernels, implementation=impl,
                               interpret=False, backward="hybrid")
            return jnp.sum(state.acc) + jnp.sum(state.denom)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2))).trace(*args)

    text = loss("pallas_gpu").lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON_CALL) == 4  # scores + mix forward, the transpose twice
    assert text.count('name = "depth_attention_expansion_transpose"') == 2
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5p", num_cores=1,
                                                                        platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = loss("pallas_tpu").lower(lowering_platforms=("tpu",)).as_text()
    assert "depth_attention_expansion_transpose" in text


def test_phase2_wide_form_lowers(h200):
    """Phase 2's backward in its ``wide`` form (``phase2_backward_form="wide"``: the partial's
    stream cotangents, then the expansion's transpose) lowers through Triton and Mosaic."""
    from jax._src.mesh import AbstractDevice, AbstractMesh

    kernels, batch, t_len, d, m = (0, 4, 8, 12), 2, 64, 256, 4
    sds = jax.ShapeDtypeStruct
    f32 = lambda *shape: sds(shape, jnp.float32)  # noqa: E731
    state = reference.SoftmaxState(f32(m, batch, t_len, 1), f32(m, batch, t_len, 1), f32(m, batch, t_len, d))
    args = (state, f32(batch, t_len, d), f32(sum(kernels), d), f32(m, d), (f32(m * d, m), f32(), f32(m)),
            sds((batch, t_len), jnp.int32))

    def lowered(impl, platform):
        def loss(st, x, b, q, g, sg):
            return jnp.sum(api.phase2_fused(st, x, b, q, True, g, segment_ids=sg, stream_kernels=kernels,
                                            implementation=impl, interpret=False, backward="pallas",
                                            phase2_backward_form="wide"))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).trace(*args).lower(
            lowering_platforms=(platform,)).as_text()

    text = lowered("pallas_gpu", "cuda")
    # forward: scores, gate statistics, gated mix; backward: statistics, d_state, the stream
    # cotangents, the expansion's transpose
    assert text.count(TRITON_CALL) == 7
    for name in ("depth_attention_phase2_bwd_dstreams", "depth_attention_expansion_transpose"):
        assert f'name = "{name}"' in text
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="TPU v5p", num_cores=1,
                                                                        platform="tpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        text = lowered("pallas_tpu", "tpu")
    assert "depth_attention_phase2_bwd_dstreams" in text and "depth_attention_expansion_transpose" in text


def test_mosaic_gpu_kernels_lower_in_lane_semantics(h200, monkeypatch):
    """The seven Mosaic GPU kernels of the reads (their lag windows: one per chunk, loads at any
    row offset) lower in Lane semantics, whose shared-memory refs carry no inferred swizzle
    (docs/kernels.md), with every explicit load unoptimized."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.depth_attention import heuristics
    from pallas_kernels.depth_attention.mosaic_gpu import (
        phase1_backward, phase1_mixing, phase1_scoring, phase2_forward, phase2_state, transpose,
    )

    semantics, loads = [], []
    kernel, load = plgpu.kernel, plgpu.load

    def spy_kernel(body, *args, **kwargs):
        params = kwargs.get("compiler_params")
        semantics.append(params.lowering_semantics if params is not None else None)
        return kernel(body, *args, **kwargs)

    def spy_load(*args, **kwargs):
        loads.append(kwargs.get("optimized", True))
        return load(*args, **kwargs)

    monkeypatch.setattr(plgpu, "kernel", spy_kernel)
    monkeypatch.setattr(plgpu, "load", spy_load)
    kernels, n, batch, t_len, d, m = (0, 4, 8, 12), 3, 2, 100, 64, 4
    keys = jax.random.split(jax.random.key(1), 6)
    seg = jnp.asarray([[0] * 17 + [1] * (t_len - 17)] * batch, jnp.int32)
    state = reference.SoftmaxState(jax.random.normal(keys[0], (m, batch, t_len, 1)),
                                   jnp.ones((m, batch, t_len, 1)), jax.random.normal(keys[1], (m, batch, t_len, d)))
    partial = jax.random.normal(keys[2], (batch, t_len, d), jnp.bfloat16)
    gate = (jax.random.normal(keys[3], (m * d, m)), jnp.float32(0.7), jnp.zeros((m,)))
    sources = jax.random.normal(keys[4], (n, batch, t_len, d), jnp.bfloat16)
    banks = 0.5 * jax.random.normal(keys[5], (n, sum(kernels), d))

    def loss2(st, x, b, q, g):
        return jnp.sum(api.phase2_fused(st, x, b, q, True, g, stream_kernels=kernels, segment_ids=seg,
                                        implementation="pallas_gpu", interpret=False, backward="pallas"))

    def loss1(x, b, q):
        st = api.phase1(x, b, q, jnp.asarray([True, False, True]), stream_kernels=kernels, heads=1,
                        segment_ids=seg, implementation="pallas_gpu", interpret=False, backward="pallas",
                        gpu_kernels="mosaic")
        return jnp.sum(st.acc) + jnp.sum(st.denom)

    # the backward's input kernel (its own test lowers it: test_mosaic_gpu_inputs.py) left out
    monkeypatch.setattr(heuristics, "AUTO_INPUTS", False)

    def lower_all():
        for cached in (phase2_forward._kernel, phase2_state._state_kernel, phase1_scoring._scores_kernel,
                       phase1_mixing._mix_kernel, phase1_backward._kernel, transpose._transpose_kernel):
            cached.cache_clear()  # each kernel built anew, so that the spies see all seven
        semantics.clear(), loads.clear()
        text = _lower(jax.grad(loss2, argnums=(0, 1, 2, 3, 4)), state, partial, banks[0], jnp.ones((m, d)), gate)
        text += _lower(jax.value_and_grad(loss1, argnums=(0, 1, 2)), sources, banks, jnp.ones((2, m, d)))
        # phase 2's two kernels, phase 1's scoring and mixing passes, its backward's passes 2 and 4,
        # its transpose (always Lane semantics, no placement)
        assert text.count(MOSAIC_GPU_CALL) == 7

    lower_all()
    assert semantics == [plgpu.LoweringSemantics.Lane] * 7, semantics
    assert loads and not any(loads)
