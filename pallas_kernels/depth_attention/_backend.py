"""Builds the registered ops of one Pallas back end from ``fused.py`` and ``vjp.py``. Which lowering
runs each GPU kernel (Triton or Mosaic GPU) is ``heuristics.mosaic_phase1`` / ``mosaic_phase2``'s
decision, asked at trace time with the op's shapes and dtypes."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.depth_attention import (conv_transpose, fused, fused_bwd_phase1, fused_bwd_phase2, heuristics,
                                            mosaic_gpu, platform, tiling, vjp)


def _mosaic_phase2(choice: str, backend: str, static, partial, state, out_dtype, interpret: bool,
                   kernel: str = "forward") -> bool:
    """``heuristics.mosaic_phase2`` for an op's arrays: whether phase 2's ``kernel`` runs in Mosaic GPU."""
    return heuristics.mosaic_phase2(choice, kernel, backend=backend, fuse=static.fuse, stream_kernels=static.stream_kernels,
                                    heads=static.heads, d=partial.shape[-1], dtype=partial.dtype,
                                    acc_dtype=state.acc.dtype, out_dtype=out_dtype, interpret=interpret)


def _mosaic_phase1(choice: str, backend: str, static, sources, n_targets: int, interpret: bool, *,
                   kernel: str = "scores", state_dtype=jnp.float32) -> bool:
    """``heuristics.mosaic_phase1`` for an op's arrays: whether phase 1's ``kernel`` runs in Mosaic GPU."""
    return heuristics.mosaic_phase1(choice, kernel, backend=backend, stream_kernels=static.stream_kernels,
                                    heads=static.heads, d=sources.shape[-1], n_sources=sources.shape[0],
                                    n_targets=n_targets, dtype=sources.dtype, interpret=interpret,
                                    state_dtype=state_dtype)


def _is_tpu_interpret(interpret) -> bool:
    """Whether ``interpret`` is a ``pltpu.InterpretParams``: Pallas' TPU interpret mode, which runs
    the Mosaic TPU code path on the CPU (VMEM, SMEM and DMAs simulated, races detectable)."""
    if isinstance(interpret, bool):
        return False
    from jax.experimental.pallas import tpu as pltpu

    return isinstance(interpret, pltpu.InterpretParams)


def build(backend: str, native_platform: str):
    """``backend``: ``"triton"`` or ``"tpu"`` (tile heuristics and the halo load).

    Off ``native_platform`` the kernels run in Pallas interpret mode (CPU tests);
    then the halo is always built from the previous tile (see ``fused.py``).
    Keyword options accepted by every op: ``interpret`` (bool, or for ``"tpu"`` a
    ``pltpu.InterpretParams``: TPU interpret mode, the kernels' TPU path on the CPU), ``tiles`` (a
    ``tiling.Tiles``) and ``backward`` (``"xla"``, the default, ``"pallas"`` or ``"hybrid"``: see
    ``vjp.py``), ``phase1_backward_form`` (``fused_bwd_phase1.FORMS``) and
    ``phase2_backward_form`` (``fused_bwd_phase2.FORMS``), ``gpu_kernels`` (``heuristics.GPU_KERNELS``:
    which GPU lowering runs the kernels that have two; ``heuristics.mosaic_phase1`` and
    ``mosaic_phase2``); ``phase2_fused`` also
    ``out_dtype``; ``phase1`` also ``per_target`` (``api.phase1``).
    """

    def setup(d, heads, stream_kernels, n_targets, opts):
        opts = dict(opts)
        opts.pop("backward", None)  # read by vjp.py's backward
        opts.pop("phase1_backward_form", None)  # read by p1_backward
        opts.pop("phase2_backward_form", None)  # read by p2_backward
        opts.pop("value_channel", None)  # read by vjp.py (phase 1's outputs, phase 2's backward)
        gpu_kernels = opts.pop("gpu_kernels", "auto")
        heuristics.check_gpu_kernels(gpu_kernels, backend)
        interpret = opts.pop("interpret", platform.current() != native_platform)
        tpu_interpret = _is_tpu_interpret(interpret)
        if tpu_interpret and backend != "tpu":
            raise TypeError(f"interpret=pltpu.InterpretParams(...): TPU interpret mode runs only the TPU kernels; "
                            f"the {backend} kernels take interpret=True")
        tiles = opts.pop("tiles", None) or tiling.choose_tiles(
            d=d, heads=heads, max_kernel=max([1, *stream_kernels]), n_targets=n_targets, backend=backend,
            n_streams=len(stream_kernels),
        )
        # TPU interpret mode simulates the chip's memories, so the kernels take their TPU code path
        window = backend if tpu_interpret or not interpret else "interpret"
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
