"""Public entry points of depth attention, with ``implementation=`` dispatch.

``implementation``: ``"xla"`` (plain jnp, ``reference.py``), ``"pallas_tpu"``,
``"pallas_gpu"``, or ``None`` (the best available for the platform, falling back
to XLA; a config's ``implementation="auto"``). Kernels register themselves in ``_KERNELS``;
until one exists for an implementation, asking for it explicitly raises ``NotImplementedError``.

``config``: a ``heuristics.OpConfig`` (the backward, the GPU lowering, the backward forms, the
tiles), whose ``options()`` the kernels take as keyword options; ``heuristics.choose`` gives a
model's op its measured choice, and an op called without one runs the kernels' defaults
(``OpConfig()``: the XLA backward). The XLA path ignores it.
"""

from __future__ import annotations

from typing import Callable, Literal

import jax

from pallas_kernels.depth_attention import platform, reference, xla_streaming

Implementation = Literal["xla", "pallas_tpu", "pallas_gpu"] | None
_IMPLEMENTATIONS = ("xla", "pallas_tpu", "pallas_gpu")

# op name -> implementation -> callable with the reference signature.
_KERNELS: dict[str, dict[str, Callable]] = {"phase1": {}, "phase2": {}, "phase2_fused": {}, "depth_read": {}}


def register(op: str, implementation: str, fn: Callable) -> None:
    """Register a kernel for ``op`` under ``implementation`` (used by kernel modules)."""
    _KERNELS[op][implementation] = fn


def _candidates(implementation: Implementation) -> list[str]:
    if implementation is not None:
        if implementation not in _IMPLEMENTATIONS:
            raise ValueError(f"implementation={implementation!r}: must be one of {_IMPLEMENTATIONS} or None")
        return [implementation]
    preferred = {"tpu": ["pallas_tpu"], "gpu": ["pallas_gpu"]}.get(platform.current(), [])
    return [*preferred, "xla"]


def _load_kernels() -> None:
    """Import the kernel modules once (they register themselves); missing Pallas
    back ends are skipped, so the XLA path always works."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    import importlib

    for module in ("pallas_tpu", "pallas_gpu"):
        try:
            importlib.import_module(f"pallas_kernels.depth_attention.{module}")
        except ImportError:  # pragma: no cover - a jax build without that Pallas back end
            pass


_LOADED = False


# The kernels' keyword options (``heuristics.OpConfig.options``), which the XLA path has no use for.
_KERNEL_OPTIONS = ("backward", "gpu_kernels", "phase1_backward_form", "phase2_backward_form", "tiles")


def _dispatch(op: str, implementation: Implementation, *args, **kwargs):
    _load_kernels()
    config = kwargs.pop("config", None)
    if config is not None:
        for key, value in config.options().items():
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"{op}: {key}={kwargs[key]!r} and config.{key}={value!r}: give one of them")
            kwargs[key] = value
    errors = []
    for name in _candidates(implementation):
        if name == "xla":
            for key in _KERNEL_OPTIONS:  # the XLA path has one backward and no lowering to pick
                kwargs.pop(key, None)
            split = reference.split_targets if kwargs.pop("per_target", False) else (lambda out: out)
            if "out_dtype" in kwargs:  # phase 2: the XLA path computes h in float32, then casts it
                dtype, inner = kwargs.pop("out_dtype"), split
                split = lambda out: inner(out.astype(dtype))  # noqa: E731
            if "state_dtype" in kwargs:  # phase 1: the XLA path computes in float32, then stores acc
                dtype, inner = kwargs.pop("state_dtype"), split
                split = lambda out: inner(out._replace(acc=out.acc.astype(dtype)))  # noqa: E731
            channel = kwargs.pop("value_channel", None)  # phase 2: returns d acc whole (the channel's cotangent: 0)
            if op == "phase1" and channel:  # zero channels, which the XLA backward ignores
                inner, values_dtype = split, args[0].dtype
                split = lambda out: tuple(  # noqa: E731
                    (st, reference.zero_value_channel(st, values_dtype)) for st in inner(out))
            if op in ("phase1", "phase2_fused", "depth_read") and not kwargs.get("return_weights"):
                # One source in flight at a time, recomputing backward (xla_streaming.py).
                return split(getattr(xla_streaming, op)(*args, **kwargs))
            return split(getattr(reference, op)(*args, **kwargs))
        fn = _KERNELS[op].get(name)
        if fn is None:
            errors.append(NotImplementedError(f"{op}: no {name} kernel registered"))
            continue
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:  # a kernel may decline a shape; fall through
            errors.append(e)
    raise ExceptionGroup(f"{op}: no implementation could run", errors)


# Ops whose XLA path is a ``jax.custom_vjp`` that keeps only its inputs (``xla_streaming``); the
# unfused ``phase2`` differentiates the reference, whose autodiff keeps the expanded streams.
_XLA_KEEPS_ONLY_INPUTS = ("phase1", "phase2_fused", "depth_read")


def keeps_only_inputs(op: str, implementation: Implementation = None) -> bool:
    """Whether ``op``'s backward recomputes everything from the op's inputs on every
    implementation ``implementation`` may pick: its ``custom_vjp`` saves the inputs and at most
    a few floats per token (phase 1's running max, phase 2's scores), never an ``m d``-per-token
    temporary. A caller then gains nothing from wrapping the op in ``jax.checkpoint`` (the
    rematerialisation would only run the forward kernels once more); weights
    (``return_weights=True``) always come from the reference and are not covered.
    """
    if op not in _KERNELS:
        raise ValueError(f"op={op!r}: must be one of {tuple(_KERNELS)}")
    # Every kernel op is a custom_vjp of vjp.py (inputs, max, scores); the XLA path depends on the op.
    return all(name != "xla" or op in _XLA_KEEPS_ONLY_INPUTS for name in _candidates(implementation))


def runs_a_kernel(implementation: Implementation = None) -> bool:
    """Whether ops asked for with ``implementation`` run a Pallas kernel on this platform
    (``None`` picks the platform's kernel where one exists; the XLA path otherwise)."""
    return _candidates(implementation)[0] != "xla"


STATE_DTYPES = ("float32", "bfloat16")


def phase1(*args, implementation: Implementation = None, per_target: bool = False, state_dtype="float32",
           value_channel: bool = False, **kwargs):
    """Phase 1 of the two-phase read; see ``reference.phase1`` for the arguments.

    ``state_dtype``: the dtype of the state's weighted sum ``acc`` (``max`` and ``denom`` stay
    float32), ``"float32"`` (docs/design.md §5: exact to float32 rounding) or ``"bfloat16"``. Scores,
    weights and sums are computed in float32 either way; ``"bfloat16"`` rounds ``acc`` once
    when it is stored (relative error about 2^-9) and halves the bytes of the largest arrays of
    a block's reads: ``acc`` (``S m d`` values per token), which phase 1 writes, every phase 2
    reads, and whose cotangent phase 2's backward writes and phase 1's backward reads. Phase 2
    and the backwards take either dtype and return the cotangent in it.

    ``per_target=True`` returns one ``SoftmaxState`` per target (``reference.split_targets``:
    leaves ``[m, B, T, ...]``) instead of one with a leading ``S`` axis. The Pallas kernels then
    write each target's ``[m, B, T, d]`` state as its own array and take each one's cotangent as
    its own input, so no XLA op slices the stacked state for the ``S`` phase-2 reads or stacks
    their cotangents back (on the H200 those copies were about 86 ms of the MSAR `base` step;
    docs/kernels.md). The XLA path computes the stacked state and splits it.

    ``value_channel=True`` (with ``per_target``): each target comes as ``(state,
    reference.ValueChannel)``, a zero-valued companion to hand to that target's
    ``phase2_fused(value_channel=...)``. Values and gradients are unchanged; the channel only
    routes the state's value cotangent: with mean fusion (one stream: AttnRes, MHAR) the Pallas
    phase-2 backward returns it factored, ``dh`` (the values, in the sources' dtype: the read's
    ``h`` must come out in it) and a per-token, per-head scale, instead of writing the ``[B, T,
    d]`` float32 ``d acc`` that phase 1's backward reads twice (docs/kernels.md).
    Anything that does not use the channel leaves its cotangent zero and ``acc``'s whole.
    """
    dtype = str(jax.numpy.dtype(state_dtype)) if state_dtype is not None else None
    if dtype not in STATE_DTYPES:
        raise ValueError(f"phase1: state_dtype={state_dtype!r}: must be one of {STATE_DTYPES}")
    if value_channel and not per_target:
        raise ValueError("phase1: value_channel=True needs per_target=True (one channel per target's state)")
    if per_target:
        kwargs["per_target"] = True
    if value_channel:
        kwargs["value_channel"] = True
    if dtype != "float32":
        kwargs["state_dtype"] = dtype
    return _dispatch("phase1", implementation, *args, **kwargs)


def phase2(*args, implementation: Implementation = None, **kwargs) -> jax.Array:
    """Phase 2 of the two-phase read; see ``reference.phase2`` for the arguments."""
    return _dispatch("phase2", implementation, *args, **kwargs)


OUT_DTYPES = (jax.numpy.dtype("float32"), jax.numpy.dtype("bfloat16"))


def phase2_fused(*args, implementation: Implementation = None, **kwargs) -> jax.Array:
    """Phase 2 with the stream fusion folded in (``h[B, T, d]``); see ``reference.phase2_fused``.

    ``out_dtype`` (default float32): the dtype of ``h``, computed in float32 and rounded once when
    it is stored, as ``reference.phase2_fused(...).astype(out_dtype)``; its cotangent comes in
    that dtype. A model with bf16 activations passes bf16: the kernels then write ``h`` and read
    its cotangent in half the bytes (a float32 ``h`` cast by the caller costs a float32 write and
    read in the forward and a float32 cotangent in the backward, for the same values).

    ``value_channel``: the ``reference.ValueChannel`` that ``phase1(value_channel=True)`` paired
    with ``state`` (see there), or None."""
    if "out_dtype" in kwargs:
        dtype = jax.numpy.dtype(kwargs["out_dtype"])
        if dtype not in OUT_DTYPES:
            raise ValueError(f"phase2_fused: out_dtype={kwargs['out_dtype']!r}: must be one of "
                             f"{tuple(str(d) for d in OUT_DTYPES)} (h is computed in float32 and rounded once)")
        kwargs["out_dtype"] = dtype
    return _dispatch("phase2_fused", implementation, *args, **kwargs)


def depth_read(*args, implementation: Implementation = None, **kwargs):
    """The direct read; see ``reference.depth_read`` for the arguments."""
    return _dispatch("depth_read", implementation, *args, **kwargs)
