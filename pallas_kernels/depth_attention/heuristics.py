"""Which kernels run: per op a frozen ``OpConfig``, and ``choose``, the rules that pick it from the
op's shapes, the model's facts and the platform, each with the measurement behind it.

A caller (the model, ``msar_jax/residuals/attnres.py``) passes what it is (the streams' conv
kernels, the heads, the implementation, whether it saves its reads' outputs, its read slices)
and never kernel policy; ``choose`` returns the op's config, whose ``options()`` are the op's
keyword options. An experiment overrides fields per op (``OpConfig`` directly, or
``model.residual.kernel_overrides``, every field of which is ``None`` = this module's choice).
The XLA path ignores the config: it has one backward and no lowering to pick.

Inside the GPU kernels, which lowering runs each kernel (``gpu_kernels``: Mosaic GPU or Triton,
per kernel and shape) is decided here too, at trace time, from the arrays' shapes and dtypes and
the platform: ``mosaic_phase1`` and ``mosaic_phase2``, which ``_backend`` asks. Figures:
docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax.numpy as jnp

from pallas_kernels.depth_attention import api, fused_bwd_phase1, fused_bwd_phase2, tiling, vjp

OPS = ("phase1", "phase2", "phase2_fused", "depth_read")
BACKWARDS = vjp.BACKWARDS
# Which GPU lowering runs the kernels that have two (Triton and Mosaic GPU): "auto" per kernel the
# one measured faster (``mosaic_phase1``, ``mosaic_phase2``), "mosaic" every one that
# has a Mosaic GPU kernel, "triton" none, "split_forward" as "auto" with phase 2's Mosaic forward
# as two kernels (the scores, then the rest).
GPU_KERNELS = ("auto", "mosaic", "triton", "split_forward")
# The fields of ``OpConfig`` that ``model.residual.kernel_overrides`` may set, with their values,
# and ``read_chunks`` (each read over that many batch slices: ``msar_jax.residuals.attnres``).
OPTION_FIELDS = ("backward", "gpu_kernels", "phase1_backward_form", "phase2_backward_form")
OVERRIDES = {"backward": BACKWARDS, "gpu_kernels": GPU_KERNELS, "phase1_backward_form": fused_bwd_phase1.FORMS,
             "phase2_backward_form": fused_bwd_phase2.FORMS, "read_chunks": "a positive integer"}


@dataclasses.dataclass(frozen=True)
class OpConfig:
    """How one op runs on a Pallas implementation. The defaults are the kernels' own (what an op
    called without a config runs); ``choose`` gives the measured choice for a model's op.

    * ``backward``: ``"xla"`` (the closed form of ``xla_streaming``), ``"pallas"`` (the backward
      kernels, ``fused_bwd_phase1`` / ``fused_bwd_phase2``) or ``"hybrid"`` (phase 1's closed
      form with the conv-transpose kernel); ``vjp.py``.
    * ``gpu_kernels``: one of ``GPU_KERNELS``.
    * ``value_channel``: whether the caller pairs each phase-1 state with a
      ``reference.ValueChannel`` for its phase-2 read (``api.phase1``). It changes the ops'
      outputs, so it is not a keyword option: the caller passes ``phase1(value_channel=...)``.
    * ``phase1_backward_form`` / ``phase2_backward_form``: ``fused_bwd_phase1.FORMS`` /
      ``fused_bwd_phase2.FORMS``; ``None``: the module's ``DEFAULT_FORM``.
    * ``tiles``: a ``tiling.Tiles``; ``None``: ``tiling.choose_tiles``.
    """

    backward: str = "xla"
    gpu_kernels: str = "auto"
    value_channel: bool = False
    phase1_backward_form: str | None = None
    phase2_backward_form: str | None = None
    tiles: tiling.Tiles | None = None

    def __post_init__(self):
        for name, allowed in (("backward", BACKWARDS), ("gpu_kernels", GPU_KERNELS),
                              ("phase1_backward_form", (None, *fused_bwd_phase1.FORMS)),
                              ("phase2_backward_form", (None, *fused_bwd_phase2.FORMS)),
                              ("value_channel", (False, True))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"OpConfig.{name}={getattr(self, name)!r}: must be one of {allowed}")

    def options(self) -> dict:
        """The op's keyword options (``api.phase1`` etc.): the fields that differ from the
        kernels' defaults, and always ``backward``."""
        out = {"backward": self.backward}
        if self.gpu_kernels != "auto":
            out["gpu_kernels"] = self.gpu_kernels
        for name in ("phase1_backward_form", "phase2_backward_form", "tiles"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


def override_error(key: str, value) -> str | None:
    """Why ``key = value`` is not a ``model.residual.kernel_overrides`` entry (``OVERRIDES``;
    ``None`` is every key's "choose"), or ``None`` when it is one."""
    import difflib

    if key not in OVERRIDES:
        close = difflib.get_close_matches(key, OVERRIDES, n=2, cutoff=0.6)
        return (f"no such kernel override (keys: {', '.join(OVERRIDES)})"
                + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ""))
    if value is None:
        return None
    if key == "read_chunks":
        ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    else:
        ok = value in OVERRIDES[key]
    return None if ok else f"must be None (choose) or {OVERRIDES[key] if key == 'read_chunks' else 'one of ' + repr(OVERRIDES[key])}"


def check_overrides(overrides: Mapping | None) -> dict:
    """``overrides`` (``model.residual.kernel_overrides``) without its ``None`` entries; a
    ``ValueError`` naming the key and value for a bad one (``override_error``)."""
    out = {}
    for key, value in (overrides or {}).items():
        if (why := override_error(key, value)) is not None:
            raise ValueError(f"kernel_overrides.{key}={value!r}: {why}")
        if value is not None:
            out[key] = value
    return out


def _backward(op: str, n_streams: int) -> str:
    """The backward measured faster on the H200 (docs/kernels.md):

    * one stream (AttnRes, MHAR): the Pallas backward for every op. AttnRes's `base` step 1110.0
      against 1173.9 ms with the XLA backward (with reverse-T kernels that do not reduce over rows
      per tile); MHAR's (4 heads) 1080.6 against 1112.9 ms;
    * several streams (MSAR), the fused phase 2 + stream fusion: Pallas, 7.1 against 10.4 ms per
      sublayer, 14x less temporary memory;
    * several streams, phase 1: Pallas, in its ``wide`` form: phase 1 forward + backward 35.8 ms
      per block at the bench shape against 57.7 for the closed-form XLA backward and 58.3 for
      ``"hybrid"``; `base` step 1994.7 ms against 2155.2 (``"hybrid"``) and 2212.4 (XLA);
    * several streams, the unfused phase 2 and the direct read: the closed-form XLA backward.
    """
    if n_streams == 1:
        return "pallas"
    return "pallas" if op in ("phase1", "phase2_fused") else "xla"


def choose(op: str, *, stream_kernels: tuple[int, ...], implementation: api.Implementation = None,
           save_read_outputs: bool = False, read_chunks: int = 1, overrides: Mapping | None = None) -> OpConfig:
    """The ``OpConfig`` of ``op`` (``OPS``) for a read over ``len(stream_kernels)`` streams, run
    with ``implementation`` (``None``: the platform's kernel, else XLA; ``api``), by a model that
    saves its reads' outputs (``model.save_read_outputs``) and runs each read over
    ``read_chunks`` batch slices. ``overrides``: fields to set instead of choosing
    (``check_overrides``; ``None`` values choose).

    ``gpu_kernels``: ``"auto"``, except ``"split_forward"`` under ``save_read_outputs``: the
    backward's re-run of a read then keeps only its scores (the output ``h`` is saved), so XLA
    drops the split forward's second kernel. Triton's scoring pass alone in the re-run cost 118.8
    ms per `base` step on the H200 against 103.6 for the one-kernel Mosaic forward run twice, and
    ``split_forward`` took the step 1357.6 -> 1300.1 ms (docs/kernels.md §7).

    ``value_channel`` (phase 1 and the fused phase 2): with one stream (mean fusion: AttnRes,
    MHAR) the Pallas backward then hands phase 1 the read's bf16 ``dh`` and one scale per token
    and head instead of the ``[B, T, d]`` float32 ``d acc`` (written once, read twice). Only where
    it pays: a kernel with the Pallas backward for both phases, each read run as is (one slice,
    no checkpoint around it, so the channel's cotangent stays symbolic where no read uses it).
    """
    if op not in OPS:
        raise ValueError(f"op={op!r}: must be one of {OPS}")
    overrides = check_overrides(overrides)
    read_chunks = overrides.pop("read_chunks", read_chunks)
    n_streams = len(stream_kernels)
    backward = {name: overrides.get("backward", _backward(name, n_streams)) for name in ("phase1", "phase2_fused")}
    # The reads' custom_vjps keep only their inputs on a kernel (``api.keeps_only_inputs``), so
    # the model runs them without a checkpoint, which the channel needs.
    lean = all(api.runs_a_kernel(implementation) and api.keeps_only_inputs(name, implementation)
               for name in ("phase1", "phase2_fused"))
    channel = (n_streams == 1 and read_chunks == 1 and lean and backward["phase1"] == "pallas"
               and backward["phase2_fused"] == "pallas")
    return OpConfig(
        backward=overrides.get("backward", _backward(op, n_streams)),
        gpu_kernels=overrides.get("gpu_kernels", "split_forward" if save_read_outputs else "auto"),
        value_channel=channel and op in ("phase1", "phase2_fused"),
        phase1_backward_form=overrides.get("phase1_backward_form"),
        phase2_backward_form=overrides.get("phase2_backward_form"),
    )


# Which GPU lowering runs each kernel that has two, Triton (Pallas' Triton lowering: ``fused``,
# ``fused_bwd_phase1``, ``fused_bwd_phase2``, ``conv_transpose``) or Mosaic GPU (the
# ``mosaic_gpu`` package). The functions below decide it from shapes, dtypes and the platform; the
# Mosaic GPU package is imported only when they run (on a Pallas op's trace).
#
# Phase 1's kernels (``mosaic_phase1``): the scoring pass, the forward's mixing pass, the Pallas
# backward's pass 2 and the wide form's pass 4, and the wide form's transpose.
PHASE1_KERNELS = ("scores", "mix", "gdots", "dstreams", "transpose")
# Phase 2's fused kernels (``mosaic_phase2``): the forward, the backward's statistics and ``d_acc``
# passes, and the backward's input pass (the ``reverse_t`` form).
PHASE2_KERNELS = ("forward", "backward_state", "inputs")
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


def check_gpu_kernels(gpu_kernels: str, backend: str) -> None:
    """A ``ValueError`` for a ``gpu_kernels`` that is not one of ``GPU_KERNELS``, or that asks for
    Mosaic GPU kernels on a back end other than ``"triton"`` (the GPU's)."""
    if gpu_kernels not in GPU_KERNELS:
        raise ValueError(f"gpu_kernels={gpu_kernels!r}: must be one of {GPU_KERNELS}")
    if gpu_kernels == "mosaic" and backend != "triton":
        raise ValueError(f"gpu_kernels='mosaic' asks for Mosaic GPU kernels; this is the {backend} back end")


def mosaic_phase2(gpu_kernels: str, kernel: str = "forward", *, backend: str, fuse: str | None,
                  stream_kernels: tuple[int, ...], heads: int, d: int, dtype, acc_dtype, out_dtype,
                  interpret: bool) -> bool:
    """Whether phase 2's fused ``kernel`` (``PHASE2_KERNELS``) runs in Mosaic GPU rather than in
    Triton: ``"forward"`` (``mosaic_gpu.phase2_fused_forward`` against the three Triton calls of
    ``fused.phase2_forward``), ``"backward_state"`` (the backward's statistics and ``d_acc``
    passes, ``mosaic_gpu.phase2_backward_state``, against two Triton calls with XLA between) or
    ``"inputs"`` (the backward's input pass, ``mosaic_gpu.phase2_backward_inputs``;
    ``AUTO_INPUTS``). ``backend``: ``"triton"`` or ``"tpu"``; ``fuse``: the read's stream fusion
    (``None``: the unfused ``phase2``); ``d``, ``dtype``: the partial's channels and dtype;
    ``acc_dtype``: the state's ``acc``; ``out_dtype``: ``h``'s; ``interpret``: Pallas interpret
    mode (off the GPU).

    ``"auto"``: on a GPU (not in interpret mode), with several streams and a 16-bit partial (as
    timed), whenever the kernel takes the shape. Measured on the H200 at `base` (docs/kernels.md): MSAR's
    forward 1.42 against 1.80 ms per call, its `base` step 1735.3 against 1764.4 ms; the whole
    Pallas backward 5.40 against 6.19 ms per call with the backward's kernel. A single stream
    (AttnRes) ran the forward 0.235 against 0.209 ms, so it keeps Triton. ``"mosaic"``: always
    (interpreted off the GPU, as the tests run it; a ``ValueError`` for a shape it does not take);
    ``"triton"``: never; ``"split_forward"``: as ``"auto"``, with a Mosaic forward split in two kernels,
    the scores and then the rest (``mosaic_gpu.phase2_fused_forward(split=True)``: what a model
    saving its reads' outputs wants, whose re-run then runs the first alone). The unfused
    ``phase2`` (``fuse=None``) has the Triton kernels only."""
    if kernel not in PHASE2_KERNELS:
        raise ValueError(f"kernel={kernel!r}: must be one of {PHASE2_KERNELS}")
    choice = "auto" if gpu_kernels == "split_forward" else gpu_kernels
    if choice == "triton" or backend != "triton" or fuse is None:
        return False
    if choice == "auto" and (interpret or len(stream_kernels) == 1 or jnp.dtype(dtype).itemsize > 2):
        return False  # a float32 partial: untimed in Mosaic (it fits shared memory with the padded windows)
    from pallas_kernels.depth_attention import mosaic_gpu  # only on a trace: importing the model loads no kernel

    if kernel == "inputs":
        if choice == "auto" and not AUTO_INPUTS:
            return False
        try:
            mosaic_gpu.check_inputs_shape(d=d, heads=heads, stream_kernels=stream_kernels)
        except NotImplementedError as e:
            if choice == "mosaic":
                raise ValueError(f"gpu_kernels='mosaic': {e}") from None
            return False
        return True
    smem = {"forward": mosaic_gpu.smem_bytes, "backward_state": mosaic_gpu.state_smem_bytes}[kernel]
    bd = mosaic_gpu.choose_block_d(d=d, heads=heads, stream_kernels=stream_kernels, x_dtype=dtype,
                                   acc_dtype=acc_dtype, out_dtype=out_dtype, gate=fuse == "gate",
                                   smem_limit=None if interpret else mosaic_gpu.SMEM_BYTES, smem=smem)
    if choice == "mosaic" and bd is None:
        raise ValueError(f"gpu_kernels='mosaic': the Mosaic GPU phase 2 ({kernel}) does not take d={d}, "
                         f"heads={heads}, kernels {stream_kernels}, a {jnp.dtype(dtype)} partial "
                         f"(no channel chunk divides the head with a program in shared memory: "
                         f"mosaic_gpu.choose_block_d)")
    return bd is not None


def mosaic_phase1(gpu_kernels: str, kernel: str = "scores", *, backend: str, stream_kernels: tuple[int, ...],
                  heads: int, d: int, n_sources: int, n_targets: int, dtype, interpret: bool,
                  state_dtype=jnp.float32) -> bool:
    """Whether phase 1's ``kernel`` (``PHASE1_KERNELS``) runs in Mosaic GPU rather than Triton:
    ``"scores"`` (the scoring pass of the forward and of the Pallas backward,
    ``mosaic_gpu.phase1_scores``, against ``fused.scores_call``) or ``"mix"`` (the forward's
    mixing pass, ``mosaic_gpu.phase1_mix``, against ``fused.mix_call(mode="acc")``;
    ``state_dtype`` is what it writes), ``"gdots"`` or ``"dstreams"`` (the Pallas backward's pass
    2 and the wide form's pass 4, ``mosaic_gpu.phase1_backward``, against
    ``fused_bwd_phase1.gdots_call`` and ``dstreams_call``; ``state_dtype`` is the state
    cotangent's, which they read; ``AUTO_PHASE1_BWD``) or ``"transpose"`` (the wide form's
    transpose, ``mosaic_gpu.sources_transpose``, against ``conv_transpose.sources_transpose``;
    ``AUTO_TRANSPOSE``). ``d``, ``n_sources``, ``dtype``: the sources' channels, count and dtype;
    ``n_targets``: the read's targets (queries); ``backend``, ``interpret``: as ``mosaic_phase2``.

    ``"auto"`` (and ``"split_forward"``, which concerns phase 2's forward): on a GPU (not in
    interpret mode), with several streams and 16-bit sources (as timed; float32 sources double
    the kernels' shared memory), whenever the kernel takes the shape. Measured on the H200 (docs/kernels.md): the scoring
    pass 3.18 against 4.82 ms per call at `base`'s shape (4 of 7 sources valid, 8 targets), 3.95
    against 5.38 at the bench shape; the MSAR `base` step 1692.0 -> 1651.8 ms. The mixing pass with
    a float32 state 5.74-5.77 against 6.86-6.91 ms at `base`, 5.29 against 5.78 at the bench
    shape (step 1644.4-1648.4 ms). With a bf16 state Triton's was faster with the aligned windows (4.45
    against 5.03-5.21 ms); with the padded ones Mosaic's is, 3.81
    against 4.42 ms at `base` (float32 state: 4.04 against 6.79). One stream (AttnRes): the
    kernels of ``SINGLE_STREAM_MOSAIC_PHASE1`` only. ``"mosaic"``: always (a ``ValueError`` for a
    shape it does not take); ``"triton"``: never."""
    if kernel not in PHASE1_KERNELS:
        raise ValueError(f"kernel={kernel!r}: must be one of {PHASE1_KERNELS}")
    choice = "auto" if gpu_kernels == "split_forward" else gpu_kernels
    if choice == "triton" or backend != "triton":
        return False
    if choice == "auto" and (interpret or jnp.dtype(dtype).itemsize > 2):
        return False
    if choice == "auto" and len(stream_kernels) == 1 and kernel not in SINGLE_STREAM_MOSAIC_PHASE1:
        return False
    if choice == "auto" and kernel in ("gdots", "dstreams") and not AUTO_PHASE1_BWD:
        return False
    from pallas_kernels.depth_attention import mosaic_gpu  # only on a trace: importing the model loads no kernel
    from pallas_kernels.depth_attention.mosaic_gpu import phase1_backward

    if kernel == "transpose":
        if (choice == "auto" and not AUTO_TRANSPOSE) or not any(stream_kernels):
            return False  # no conv: the transpose is a sum over the streams (conv_transpose does it in XLA)
        try:
            mosaic_gpu.check_transpose_shape(d=d, stream_kernels=stream_kernels)
        except NotImplementedError as e:
            if choice == "mosaic":
                raise ValueError(f"gpu_kernels='mosaic': {e}") from None
            return False
        return True
    acc_dtype, out_dtype = jnp.float32, state_dtype
    if kernel in phase1_backward.MODES:  # they read the state's cotangent and write dE in the sources' dtype
        acc_dtype, out_dtype = state_dtype, jnp.promote_types(dtype, jnp.bfloat16)
        smem = functools.partial(phase1_backward.smem_bytes, mode=kernel, n_sources=n_sources)
    else:
        smem = functools.partial({"scores": mosaic_gpu.scores_smem_bytes, "mix": mosaic_gpu.mix_smem_bytes}[kernel],
                                 n_sources=n_sources)
    bd = mosaic_gpu.choose_block_d(d=d, heads=heads, stream_kernels=stream_kernels, x_dtype=dtype,
                                   acc_dtype=acc_dtype, out_dtype=out_dtype,
                                   smem_limit=None if interpret else mosaic_gpu.SMEM_BYTES,
                                   smem=functools.partial(smem, n_targets=n_targets),
                                   choices={"scores": mosaic_gpu.scores_block_d_choices(len(stream_kernels)),
                                            "mix": mosaic_gpu.MIX_BLOCK_D_CHOICES}.get(
                                                kernel, phase1_backward.BLOCK_D_CHOICES))
    if choice == "mosaic" and bd is None:
        what = {"scores": "scoring", "mix": "mixing", "gdots": "backward's value-dot",
                "dstreams": "backward's stream-cotangent"}[kernel]
        raise ValueError(f"gpu_kernels='mosaic': the Mosaic GPU phase-1 {what} pass does not take "
                         f"d={d}, heads={heads}, kernels {stream_kernels}, "
                         f"{n_targets} targets, {jnp.dtype(dtype)} sources (mosaic_gpu.choose_block_d)")
    return bd is not None
