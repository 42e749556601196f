"""Which kernels run: per op a frozen ``OpConfig``, and ``choose``, the rules that pick it from the
op's shapes, the model's facts and the platform, each with the measurement behind it.

A caller (the model, ``msar_jax/residuals/attnres.py``) passes what it is (the streams' conv
kernels, the heads, the implementation, whether it saves its reads' outputs, its read slices)
and never kernel policy; ``choose`` returns the op's config, whose ``options()`` are the op's
keyword options. An experiment overrides fields per op (``OpConfig`` directly, or
``model.residual.kernel_overrides``, every field of which is ``None`` = this module's choice).
The XLA path ignores the config: it has one backward and no lowering to pick.

Inside the GPU kernels, which lowering runs each kernel ("auto": Mosaic GPU or Triton, per
kernel and shape) is decided at trace time from the arrays' shapes and dtypes
(``_backend._mosaic_phase1`` and ``_mosaic_phase2``). Figures: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pallas_kernels.depth_attention import api, fused_bwd_phase1, fused_bwd_phase2, tiling, vjp

OPS = ("phase1", "phase2", "phase2_fused", "depth_read")
BACKWARDS = vjp.BACKWARDS
# Which GPU lowering runs the kernels that have two (Triton and Mosaic GPU): "auto" per kernel the
# one measured faster (``_backend._mosaic_phase1``, ``_mosaic_phase2``), "mosaic" every one that
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
