"""Builds the registered ops of one Pallas back end from ``fused.py`` and ``vjp.py``."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.depth_attention import (conv_transpose, fused, fused_bwd_phase1, fused_bwd_phase2, mosaic_gpu,
                                            platform, tiling, vjp)
from pallas_kernels.depth_attention.mosaic_gpu import phase1_backward


GPU_KERNELS = ("auto", "mosaic", "triton", "split_forward")
# whether "auto" takes phase 2's backward input kernel in Mosaic GPU (``mosaic_gpu.phase2_backward_inputs``):
# 1.63 against Triton's 3.10 ms per call in the `base` step on the H200 (two warpgroups per program), the
# step 1530.1 -> 1445.1 ms
AUTO_INPUTS = True
# whether "auto" takes phase 1's backward passes 2 and 4 (wide form) in Mosaic GPU (``mosaic_gpu.phase1_backward``):
# 4.25 and 4.81 against Triton's 7.72 and 7.94 ms per call at `base` on the H200, the step 1445.1 -> 1415.3 ms
AUTO_PHASE1_BWD = True
# whether "auto" takes the wide form's transpose in Mosaic GPU (``mosaic_gpu.sources_transpose``):
# 3.20 against Triton's 6.30 ms per call at `base` on the H200, 2.98 in the step, which went 1415.3 -> 1384.9 ms;
# its GPU test against Triton's passes
AUTO_TRANSPOSE = True
# phase 1's passes that "auto" takes in Mosaic GPU for one stream (AttnRes and MHAR: kernels (0,), no
# conv), per call in AttnRes's `base` step on the H200: the scoring pass 0.28 against Triton's
# 0.57 ms (0.50 against 0.96 at the bench shape), gdots 0.79 against 1.21, dstreams 1.01 against 2.13;
# in MHAR's (8 heads): the scoring pass 0.42 against 0.73, gdots 0.96 against 1.21, dstreams
# 1.08 against 2.54; MHAR's step 1072.4 -> 1065.4 ms. The mixing pass stays in Triton: 0.91 against Mosaic's 1.01 ms (0.80
# against 0.88 at the bench shape; MHAR 1.08 against 1.12); 0.83 on its own 8 x 128 tile. Phase 2 keeps Triton for one stream too:
# its forward 0.21 (scores + mix) against Mosaic's 0.24 (MHAR 0.23 against 0.25), its backward's input
# pass 0.19 against 0.41 (0.20 against 0.43), its state pass 0.263 against 0.262 (0.285 against 0.270).
SINGLE_STREAM_MOSAIC_PHASE1 = frozenset({"scores", "gdots", "dstreams"})


def _mosaic_phase2(choice: str, backend: str, static, partial, state, out_dtype, interpret: bool,
                   kernel: str = "forward") -> bool:
    """Whether phase 2's fused ``kernel`` runs in Mosaic GPU (``mosaic_gpu``) rather than in
    Triton: ``"forward"`` (``mosaic_gpu.phase2_fused_forward`` against the three Triton calls of
    ``fused.phase2_forward``) or ``"backward_state"`` (the backward's statistics and ``d_acc``
    passes, ``mosaic_gpu.phase2_backward_state``, against two Triton calls with XLA between).

    ``"auto"``: on a GPU (not in interpret mode), with several streams and a 16-bit partial (as
    timed), whenever the kernel takes the shape. Measured on the H200 at `base` (docs/kernels.md): MSAR's
    forward 1.42 against 1.80 ms per call, its `base` step 1735.3 against 1764.4 ms; the whole
    Pallas backward 5.40 against 6.19 ms per call with the backward's kernel. A single stream
    (AttnRes) ran the forward 0.235 against 0.209 ms, so it keeps Triton. ``"mosaic"``: always
    (interpreted off the GPU, as the tests run it; an error for a shape it does not take);
    ``"triton"``: never; ``"split_forward"``: as ``"auto"``, with a Mosaic forward split in two kernels,
    the scores and then the rest (``mosaic_gpu.phase2_fused_forward(split=True)``: what a model
    saving its reads' outputs wants, whose re-run then runs the first alone). The unfused
    ``phase2`` (``fuse=None``) has the Triton kernels only."""
    if choice == "split_forward":
        choice = "auto"
    if choice == "triton" or backend != "triton" or static.fuse is None:
        return False
    if choice == "auto" and (interpret or len(static.stream_kernels) == 1 or jnp.dtype(partial.dtype).itemsize > 2):
        return False  # a float32 partial: untimed in Mosaic (it fits shared memory with the padded windows)
    if kernel == "inputs":
        if choice == "auto" and not AUTO_INPUTS:
            return False
        try:
            mosaic_gpu.check_inputs_shape(d=partial.shape[-1], heads=static.heads, stream_kernels=static.stream_kernels)
        except NotImplementedError as e:
            if choice == "mosaic":
                raise ValueError(f"gpu_kernels='mosaic': {e}") from None
            return False
        return True
    smem = {"forward": mosaic_gpu.smem_bytes, "backward_state": mosaic_gpu.state_smem_bytes}[kernel]
    bd = mosaic_gpu.choose_block_d(d=partial.shape[-1], heads=static.heads, stream_kernels=static.stream_kernels,
                                   x_dtype=partial.dtype, acc_dtype=state.acc.dtype, out_dtype=out_dtype,
                                   gate=static.fuse == "gate", smem_limit=None if interpret else mosaic_gpu.SMEM_BYTES,
                                   smem=smem)
    if choice == "mosaic" and bd is None:
        raise ValueError(f"gpu_kernels='mosaic': the Mosaic GPU phase 2 ({kernel}) does not take d={partial.shape[-1]}, "
                         f"heads={static.heads}, kernels {static.stream_kernels}, a {partial.dtype} partial "
                         f"(no channel chunk divides the head with a program in shared memory: "
                         f"mosaic_gpu.choose_block_d)")
    return bd is not None


def _mosaic_phase1(choice: str, backend: str, static, sources, n_targets: int, interpret: bool, *,
                   kernel: str = "scores", state_dtype=jnp.float32) -> bool:
    """Whether phase 1's ``kernel`` runs in Mosaic GPU rather than Triton: ``"scores"`` (the
    scoring pass of the forward and of the Pallas backward, ``mosaic_gpu.phase1_scores``, against
    ``fused.scores_call``) or ``"mix"`` (the forward's mixing pass, ``mosaic_gpu.phase1_mix``,
    against ``fused.mix_call(mode="acc")``; ``state_dtype`` is what it writes), ``"gdots"`` or
    ``"dstreams"`` (the Pallas backward's pass 2 and the wide form's pass 4,
    ``mosaic_gpu.phase1_backward``, against ``fused_bwd_phase1.gdots_call`` and ``dstreams_call``;
    ``state_dtype`` is the state cotangent's, which they read; ``AUTO_PHASE1_BWD``) or
    ``"transpose"`` (the wide form's transpose, ``mosaic_gpu.sources_transpose``, against
    ``conv_transpose.sources_transpose``; ``AUTO_TRANSPOSE``).

    ``"auto"`` (and ``"split_forward"``, which concerns phase 2's forward): on a GPU (not in
    interpret mode), with several streams and 16-bit sources (as timed; float32 sources double
    the kernels' shared memory), whenever the kernel takes the shape. Measured on the H200 (docs/kernels.md): the scoring
    pass 3.18 against 4.82 ms per call at `base`'s shape (4 of 7 sources valid, 8 targets), 3.95
    against 5.38 at the bench shape; the MSAR `base` step 1692.0 -> 1651.8 ms. The mixing pass with
    a float32 state 5.74-5.77 against 6.86-6.91 ms at `base`, 5.29 against 5.78 at the bench
    shape (step 1644.4-1648.4 ms). With a bf16 state Triton's was faster with the aligned windows (4.45
    against 5.03-5.21 ms); with the padded ones Mosaic's is, 3.81
    against 4.42 ms at `base` (float32 state: 4.04 against 6.79). One stream (AttnRes): the
    kernels of ``SINGLE_STREAM_MOSAIC_PHASE1`` only. ``"mosaic"``: always (an error for a shape
    it does not take); ``"triton"``: never."""
    if choice == "split_forward":
        choice = "auto"
    if choice == "triton" or backend != "triton":
        return False
    if choice == "auto" and (interpret or jnp.dtype(sources.dtype).itemsize > 2):
        return False
    if choice == "auto" and len(static.stream_kernels) == 1 and kernel not in SINGLE_STREAM_MOSAIC_PHASE1:
        return False
    if choice == "auto" and kernel in phase1_backward.MODES and not AUTO_PHASE1_BWD:
        return False
    if kernel == "transpose":
        if (choice == "auto" and not AUTO_TRANSPOSE) or not any(static.stream_kernels):
            return False  # no conv: the transpose is a sum over the streams (conv_transpose does it in XLA)
        try:
            mosaic_gpu.check_transpose_shape(d=sources.shape[-1], stream_kernels=static.stream_kernels)
        except NotImplementedError as e:
            if choice == "mosaic":
                raise ValueError(f"gpu_kernels='mosaic': {e}") from None
            return False
        return True
    acc_dtype, out_dtype = jnp.float32, state_dtype
    if kernel in phase1_backward.MODES:  # they read the state's cotangent and write dE in the sources' dtype
        acc_dtype, out_dtype = state_dtype, jnp.promote_types(sources.dtype, jnp.bfloat16)
        smem = functools.partial(phase1_backward.smem_bytes, mode=kernel, n_sources=sources.shape[0])
    else:
        smem = functools.partial({"scores": mosaic_gpu.scores_smem_bytes, "mix": mosaic_gpu.mix_smem_bytes}[kernel],
                                 n_sources=sources.shape[0])
    bd = mosaic_gpu.choose_block_d(d=sources.shape[-1], heads=static.heads, stream_kernels=static.stream_kernels,
                                   x_dtype=sources.dtype, acc_dtype=acc_dtype, out_dtype=out_dtype,
                                   smem_limit=None if interpret else mosaic_gpu.SMEM_BYTES,
                                   smem=functools.partial(smem, n_targets=n_targets),
                                   choices={"scores": mosaic_gpu.scores_block_d_choices(len(static.stream_kernels)),
                                            "mix": mosaic_gpu.MIX_BLOCK_D_CHOICES}.get(
                                                kernel, phase1_backward.BLOCK_D_CHOICES))
    if choice == "mosaic" and bd is None:
        what = {"scores": "scoring", "mix": "mixing", "gdots": "backward's value-dot",
                "dstreams": "backward's stream-cotangent"}[kernel]
        raise ValueError(f"gpu_kernels='mosaic': the Mosaic GPU phase-1 {what} pass does not take "
                         f"d={sources.shape[-1]}, heads={static.heads}, kernels {static.stream_kernels}, "
                         f"{n_targets} targets, {sources.dtype} sources (mosaic_gpu.choose_block_d)")
    return bd is not None


def build(backend: str, native_platform: str):
    """``backend``: ``"triton"`` or ``"tpu"`` (tile heuristics and the halo load).

    Off ``native_platform`` the kernels run in Pallas interpret mode (CPU tests);
    then the halo is always built from the previous tile (see ``fused.py``).
    Keyword options accepted by every op: ``interpret`` (bool), ``tiles`` (a
    ``tiling.Tiles``) and ``backward`` (``"xla"``, the default, ``"pallas"`` or ``"hybrid"``: see
    ``vjp.py``), ``phase1_backward_form`` (``fused_bwd_phase1.FORMS``) and
    ``phase2_backward_form`` (``fused_bwd_phase2.FORMS``), ``gpu_kernels`` (``GPU_KERNELS``:
    which GPU lowering runs the ops that have two; see ``_mosaic_phase2``); ``phase2_fused`` also
    ``out_dtype``; ``phase1`` also ``per_target`` (``api.phase1``).
    """

    def setup(d, heads, stream_kernels, n_targets, opts):
        opts = dict(opts)
        opts.pop("backward", None)  # read by vjp.py's backward
        opts.pop("phase1_backward_form", None)  # read by p1_backward
        opts.pop("phase2_backward_form", None)  # read by p2_backward
        opts.pop("value_channel", None)  # read by vjp.py (phase 1's outputs, phase 2's backward)
        gpu_kernels = opts.pop("gpu_kernels", "auto")
        if gpu_kernels not in GPU_KERNELS:
            raise ValueError(f"gpu_kernels={gpu_kernels!r}: must be one of {GPU_KERNELS}")
        if gpu_kernels == "mosaic" and backend != "triton":
            raise ValueError(f"gpu_kernels='mosaic' asks for Mosaic GPU kernels; this is the {backend} back end")
        interpret = opts.pop("interpret", platform.current() != native_platform)
        tiles = opts.pop("tiles", None) or tiling.choose_tiles(
            d=d, heads=heads, max_kernel=max([1, *stream_kernels]), n_targets=n_targets, backend=backend,
            n_streams=len(stream_kernels),
        )
        window = backend if not interpret else "interpret"
        if window != "triton":  # the TPU / interpret halo comes from the previous tile only
            tiles = tiles.with_min_block_t(tiling._next_pow2(max([1, *stream_kernels]) - 1))
        return dict(tiles=tiles, backend=window, interpret=interpret), dict(opts, gpu_kernels=gpu_kernels)

    def p1_forward(sources, banks, queries, valid, segment_ids, static):
        kw, rest = setup(sources.shape[-1], static.heads, static.stream_kernels, queries.shape[0], static.kernel_opts)
        choice = rest.pop("gpu_kernels")
        per_target = rest.pop("per_target", False)
        state_dtype = jnp.dtype(rest.pop("state_dtype", "float32"))
        mosaic = functools.partial(_mosaic_phase1, choice, backend, static, sources, queries.shape[0], kw["interpret"])
        if rest:
            raise TypeError(f"phase1: unknown options {sorted(rest)}")
        return fused.phase1_forward(
            sources, banks, queries, valid, stream_kernels=static.stream_kernels, heads=static.heads,
            segment_ids=segment_ids, eps=static.eps, per_target=per_target, state_dtype=state_dtype,
            mosaic_scores=mosaic(kernel="scores"), mosaic_mix=mosaic(kernel="mix", state_dtype=state_dtype), **kw,
        )

    def p2_forward(state, partial, bank, query, include, gate, segment_ids, static, return_scores=False):
        kw, rest = setup(partial.shape[-1], static.heads, static.stream_kernels, 1, static.kernel_opts)
        out_dtype = rest.pop("out_dtype", jnp.float32)
        gpu_kernels = rest.pop("gpu_kernels")
        if rest:
            raise TypeError(f"phase2: unknown options {sorted(rest)}")
        if _mosaic_phase2(gpu_kernels, backend, static, partial, state, out_dtype, kw["interpret"]):
            gate_args = gate if static.fuse == "gate" else None
            out, scores = mosaic_gpu.phase2_fused_forward(
                state, partial, bank, query, include, gate_args, segment_ids, fuse=static.fuse,
                stream_kernels=static.stream_kernels, heads=static.heads, eps=static.eps, gate_eps=static.gate_eps,
                out_dtype=out_dtype, split=gpu_kernels == "split_forward", interpret=kw["interpret"],
            )
            return (out, scores) if return_scores else out
        return fused.phase2_forward(
            state, partial, bank, query, include, gate, fuse=static.fuse, stream_kernels=static.stream_kernels,
            heads=static.heads, segment_ids=segment_ids, eps=static.eps, gate_eps=static.gate_eps,
            out_dtype=out_dtype, return_scores=return_scores, **kw,
        )

    def p1_backward(sources, banks, queries, valid, segment_ids, smax, ct, static, value_scale=None):
        kw, rest = setup(sources.shape[-1], static.heads, static.stream_kernels, queries.shape[0], static.kernel_opts)
        form = dict(static.kernel_opts).get("phase1_backward_form", fused_bwd_phase1.DEFAULT_FORM)
        acc = ct.acc[0] if isinstance(ct.acc, (list, tuple)) else ct.acc
        mosaic = functools.partial(_mosaic_phase1, rest["gpu_kernels"], backend, static, sources, queries.shape[0],
                                   kw["interpret"], state_dtype=acc.dtype)
        return fused_bwd_phase1.phase1_backward(
            sources, banks, queries, valid, segment_ids, smax, ct, stream_kernels=static.stream_kernels,
            heads=static.heads, eps=static.eps, form=form, **kw, mosaic_scores=mosaic(kernel="scores"),
            mosaic_gdots=mosaic(kernel="gdots"), mosaic_dstreams=form == "wide" and mosaic(kernel="dstreams"),
            mosaic_transpose=form == "wide" and mosaic(kernel="transpose"), value_scale=value_scale,
        )

    def expansion_transpose(d_e, x, bank, segment_ids, static, n_targets):
        kw, _ = setup(x.shape[-1], static.heads, static.stream_kernels, n_targets, static.kernel_opts)
        return conv_transpose.expansion_transpose(d_e, x, bank, segment_ids, stream_kernels=static.stream_kernels,
                                                  **kw)

    def p2_backward(state, partial, bank, query, include, gate, segment_ids, dh, static, scores=None,
                    value_channel=False):
        kw, rest = setup(partial.shape[-1], static.heads, static.stream_kernels, 1, static.kernel_opts)
        form = dict(static.kernel_opts).get("phase2_backward_form", fused_bwd_phase2.DEFAULT_FORM)
        return fused_bwd_phase2.phase2_fused_backward(
            state, partial, bank, query, include, gate if static.fuse == "gate" else None, segment_ids,
            dh, stream_kernels=static.stream_kernels, heads=static.heads, eps=static.eps,
            gate_eps=static.gate_eps, scores=scores, form=form, value_channel=value_channel, **kw,
            mosaic_state=_mosaic_phase2(rest["gpu_kernels"], backend, static, partial, state, jnp.float32,
                                        kw["interpret"], kernel="backward_state"),
            mosaic_inputs=form == "reverse_t" and _mosaic_phase2(rest["gpu_kernels"], backend, static, partial, state,
                                                                 jnp.float32, kw["interpret"], kernel="inputs"),
        )

    return (
        vjp.make_phase1(p1_forward, p1_backward, expansion_transpose),
        vjp.make_phase2(p2_forward, fused=False),
        vjp.make_phase2(p2_forward, fused=True, kernel_backward=p2_backward),
    )
