"""Configs: the model's defaults, their validation, and loading a config file.

Configs are ``ml_collections.ConfigDict`` trees built by the files in ``configs/``.
``model_config()`` returns the default model tree; ``validate(model)`` checks every rule up
front and raises ``ConfigError`` naming the field, the value and the rule.
``load_config("configs/msar.py:size=small", overrides)`` loads a file the way
``--config=path.py:arg`` does, without absl flags; ``parse_overrides(["optim.lr=1e-3"])`` builds
the overrides from command-line ``KEY=VALUE`` text.

Sizes follow docs/design.md §1: ``n_layers`` transformer layers, ``L = 2 * n_layers``
residual sublayers, ``block_size`` (S) counts sublayers per block.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import pathlib
import sys

import ml_collections

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

FUSIONS = ("gate", "mean")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_dots", "save_layer_inputs")


_MESSAGE_ONLY = object()


class ConfigError(ValueError):
    """A config value broke a rule: ``ConfigError(field, value, rule)``.

    The message is one line naming all three, ``config field 'model.d_model' = 0: must be a
    positive integer``; ``subject`` replaces "config field" for what is not a field of the tree
    (``"config argument"``: a key of the ``:key=value`` text, ``"flag"``: a command-line flag).
    ``ConfigError(message)`` is accepted too, because ml-collections' ``--config`` flag re-raises
    an error from ``get_config`` as ``type(e)(message)`` (and pickling rebuilds an exception from
    ``args``); ``field``, ``value`` and ``rule`` are then ``None``, and the original error is the
    new one's ``__context__`` (``msar_jax.cli.config_error_line`` finds it).
    """

    def __init__(self, field, value=_MESSAGE_ONLY, rule: str | None = None, *, subject: str = "config field"):
        self.subject = subject
        if value is _MESSAGE_ONLY and rule is None:
            self.field = self.value = self.rule = None
            super().__init__(str(field))
            return
        if value is _MESSAGE_ONLY or rule is None:
            raise TypeError("ConfigError takes (field, value, rule) or a single message")
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"{subject} {field!r} = {value!r}: {rule}")


def close_names(name: str, candidates, prefix: str = "") -> str:
    """The ``"; did you mean 'optim.lr'?"`` hint for a mistyped ``name`` (difflib's close matches
    among ``candidates``, each shown with ``prefix``); ``""`` when nothing is close."""
    matches = difflib.get_close_matches(name, [str(c) for c in candidates], n=3, cutoff=0.6)
    if not matches:
        return ""
    return "; did you mean " + " or ".join(repr(prefix + m) for m in matches) + "?"


def residual_config() -> ml_collections.ConfigDict:
    """Defaults of the residual mechanism (docs/design.md §1-8)."""
    return ml_collections.ConfigDict(
        dict(
            name="msar",  # a registered mechanism (msar_jax.residuals.registered())
            block_size=4,  # S, sublayers per block; 1 = Full mode (every output is a source)
            streams=4,  # m (MSAR streams; mHC residual streams for mhc / attnres_mhc)
            kernel_sizes=(4, 8, 12),  # MSAR conv kernel sizes, length m - 1 (Appendix A)
            conv=True,  # False = the w/o Conv ablation: every stream is the identity
            fusion="gate",  # "gate" (H_pre, Eq. 13-14) or "mean" (w/o H_pre ablation)
            heads=8,  # MHAR channel heads H (d % H == 0)
            eps=1e-6,  # weightless rms eps of every mechanism norm (> 0)
            gate_scale_init=0.01,  # alpha^pre / mHC a_* init (Appendix A)
            sinkhorn_iters=20,  # mHC Sinkhorn-Knopp iterations
            # block reads through phase 1 + phase 2 (docs/design.md §5); False reads every target
            # directly over all its sources (the reference form, the same values)
            two_phase=True,
            final_merge="residual",  # MSAR final: "residual" (h_L + v_L) or "sum" (all sources)
            # which code runs the depth reads: "auto" (the default: the platform's Pallas kernels on
            # GPU and TPU, under any mesh, and the XLA path elsewhere, the CPU included; the ops'
            # implementation=None), "xla" (plain jnp on any platform), "pallas_gpu" / "pallas_tpu"
            # (the kernels: MSAR's `base` step on the H200 1332.5 ms against 4494.0 on the XLA path,
            # BENCHMARKS.md; off their platform they run in interpret mode, for tests only)
            implementation="auto",
            # dtype of the phase-1 state's weighted sums: "auto" (the activations' dtype,
            # model.dtype), "float32" (exact to float32 rounding, docs/design.md §5) or "bfloat16"
            # (rounded once when stored, relative error about 2^-9; half the bytes of a block
            # read's largest arrays: MSAR's `base` step peak 33.19 -> 28.5 GiB on an H100,
            # BENCHMARKS.md "Training memory at `base`"; with bf16 activations the gradients'
            # error against a float32 model is the same with either state, docs/design.md §5)
            state_dtype="auto",
            # Experiments only: fields of the kernels' per-op config that pallas_kernels'
            # heuristics otherwise choose (pallas_kernels/depth_attention/heuristics.py,
            # docs/kernels.md §3): None = the heuristics' choice
            kernel_overrides=ml_collections.ConfigDict(
                dict(backward=None, gpu_kernels=None, phase1_backward_form=None, phase2_backward_form=None,
                     read_chunks=None)),
        )
    )


def moe_config() -> ml_collections.ConfigDict:
    """DeepSeekMoE-style MLPs (docs/design.md §9, Table 3). Off by default."""
    return ml_collections.ConfigDict(
        dict(
            enabled=False,
            n_dense_layers=1,  # leading dense transformer layers
            n_routed_experts=8,
            n_shared_experts=1,
            top_k=2,
            expert_dim=64,
            shared_expert_dim=64,
            aux_loss_weight=0.001,  # load-balance loss coefficient
        )
    )


def model_config() -> ml_collections.ConfigDict:
    """Defaults of the backbone (docs/design.md §9) with its residual mechanism."""
    return ml_collections.ConfigDict(
        dict(
            vocab_size=256,
            d_model=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            mlp_dim=192,  # dense SwiGLU hidden width
            tie_embeddings=False,
            rope_theta=50000.0,
            norm_eps=1e-5,
            dtype="float32",  # activation dtype; parameters are always float32
            init_std=0.02,
            remat_policy="none",  # inside a block; blocks themselves are always rematerialised
            # True: the blocks' rematerialisation reuses each sublayer's input (the depth read's
            # output) from the forward pass instead of running the read's forward again (the
            # kernels' re-run then runs only phase 2's scores); costs one [B, T, d] activation per
            # sublayer (DepthStack.save_read_outputs; MSAR's `base` step on the H200 with a bf16
            # state 1289.5 ms and 58.44 GiB against 1332.5 ms and 56.32 GiB with neither)
            save_read_outputs=False,
            max_seq_len=256,
            moe=moe_config(),
            residual=residual_config(),
        )
    )


def _positive(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field, value, "must be a positive integer")


def validate(model: ml_collections.ConfigDict, prefix: str = "model") -> ml_collections.ConfigDict:
    """Check every rule of the model config; raise ``ConfigError`` on the first broken one."""
    f = lambda name: f"{prefix}.{name}"  # noqa: E731
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "max_seq_len"):
        _positive(f(name), model[name])
    if model.n_heads % model.n_kv_heads:
        raise ConfigError(f("n_kv_heads"), model.n_kv_heads, f"must divide n_heads = {model.n_heads} (grouped-query attention)")
    if model.dtype not in DTYPES:
        raise ConfigError(f("dtype"), model.dtype, f"must be one of {DTYPES}")
    if model.remat_policy not in REMAT_POLICIES:
        raise ConfigError(f("remat_policy"), model.remat_policy, f"must be one of {REMAT_POLICIES}")
    if not isinstance(model.save_read_outputs, bool):
        raise ConfigError(f("save_read_outputs"), model.save_read_outputs, "must be True or False")
    if not model.rope_theta > 0:
        raise ConfigError(f("rope_theta"), model.rope_theta, "must be > 0")
    if not model.norm_eps > 0:
        raise ConfigError(f("norm_eps"), model.norm_eps, "must be > 0")

    moe = model.moe
    if moe.enabled:
        for name in ("n_routed_experts", "top_k", "expert_dim"):
            _positive(f(f"moe.{name}"), moe[name])
        if not isinstance(moe.n_dense_layers, int) or not 0 <= moe.n_dense_layers <= model.n_layers:
            raise ConfigError(f("moe.n_dense_layers"), moe.n_dense_layers, f"must be an integer in [0, n_layers = {model.n_layers}]")
        if moe.top_k > moe.n_routed_experts:
            raise ConfigError(f("moe.top_k"), moe.top_k, f"must be <= moe.n_routed_experts = {moe.n_routed_experts}")
        if moe.n_shared_experts < 0:
            raise ConfigError(f("moe.n_shared_experts"), moe.n_shared_experts, "must be >= 0")
        if moe.n_shared_experts:
            _positive(f("moe.shared_expert_dim"), moe.shared_expert_dim)

    res = model.residual
    r = lambda name: f(f"residual.{name}")  # noqa: E731
    # The registry lives with the mechanisms, which import this module.
    from msar_jax.residuals.base import mechanism_class

    mechanism = mechanism_class(res.name, field=r("name"))
    _positive(r("block_size"), res.block_size)
    if res.block_size != 1 and res.block_size % 2:
        raise ConfigError(
            r("block_size"), res.block_size,
            "must be 1 (Full mode) or even: block boundaries fall between transformer layers",
        )
    _positive(r("streams"), res.streams)
    kernels = tuple(res.kernel_sizes)
    if any((not isinstance(k, int)) or k <= 0 for k in kernels):
        raise ConfigError(r("kernel_sizes"), kernels, "every kernel size must be a positive integer")
    if res.fusion not in FUSIONS:
        raise ConfigError(r("fusion"), res.fusion, f"must be one of {FUSIONS}")
    _positive(r("heads"), res.heads)
    if not res.eps > 0:
        raise ConfigError(r("eps"), res.eps, "must be > 0 (conv streams start at exactly zero)")
    _positive(r("sinkhorn_iters"), res.sinkhorn_iters)
    if res.final_merge not in ("residual", "sum"):
        raise ConfigError(r("final_merge"), res.final_merge, "must be 'residual' or 'sum'")
    if res.implementation not in ("xla", "pallas_tpu", "pallas_gpu", "auto"):
        raise ConfigError(r("implementation"), res.implementation, "must be one of 'xla', 'pallas_tpu', 'pallas_gpu', 'auto'")
    from pallas_kernels.depth_attention import heuristics

    for key, value in (res.get("kernel_overrides") or {}).items():
        if (why := heuristics.override_error(key, value)) is not None:
            raise ConfigError(r(f"kernel_overrides.{key}"), value, why)
    if res.get("state_dtype", "auto") not in STATE_DTYPES:
        raise ConfigError(r("state_dtype"), res.state_dtype, f"must be one of {STATE_DTYPES}")
    mechanism.validate_config(model, prefix)  # the mechanism's own rules
    return model


STATE_DTYPES = ("auto", "float32", "bfloat16")


def state_dtype(model) -> str:
    """The phase-1 state's dtype ``model.residual.state_dtype`` names: ``"auto"`` is bfloat16 with
    bfloat16 activations (``model.dtype``), float32 otherwise (float16's range is too narrow for
    the weighted sums)."""
    dtype = model.residual.get("state_dtype", "auto")
    if dtype == "auto":
        return "bfloat16" if model.dtype == "bfloat16" else "float32"
    return dtype


def n_sublayers(model) -> int:
    """L: attention and MLP sublayers each count once."""
    return 2 * model.n_layers


def n_blocks(model) -> int:
    """N = ceil(L / S) (docs/design.md §2); the last block may be shorter."""
    s = model.residual.block_size
    return -(-n_sublayers(model) // s)


# Loading config files --------------------------------------------------------------------------


def config_file_path(path: str) -> pathlib.Path:
    """``path`` as given, else under the repository root; ``ConfigError`` naming both places."""
    file = pathlib.Path(path)
    if not file.is_absolute() and not file.is_file():
        file = REPO_ROOT / path
    if not file.is_file():
        places = dict.fromkeys([str(pathlib.Path.cwd()), str(REPO_ROOT)])
        error = ConfigError(f"config file {path!r}: no such file (looked in {' and '.join(places)})")
        error.field, error.value, error.rule = "config file", path, "no such file"
        raise error
    return file


def unlocked_config(spec: str) -> ml_collections.ConfigDict:
    """Run the config file's ``get_config(arg)`` for ``spec = "path.py[:arg]"`` (unlocked)."""
    path, _, arg = spec.partition(":")
    file = config_file_path(path)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # config files import configs.common
    module_spec = importlib.util.spec_from_file_location(f"_msar_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise ConfigError(f"config file {path!r}: defines no get_config(arg) (see configs/common.py)")
    return module.get_config(arg or None)


def check_field(config: ml_collections.ConfigDict, key: str, value=None) -> None:
    """``ConfigError`` unless the dotted ``key`` names a field of ``config``; the message gives
    the close names at the first unknown level (``optim.lrr`` -> "did you mean 'optim.lr'?")."""
    node, done = config, []
    for part in key.split("."):
        name = part.split("[", 1)[0]  # ml-collections paths may index a sequence: a.b[0]
        if not isinstance(node, (ml_collections.ConfigDict, dict)) or name not in node:
            prefix = "".join(f"{d}." for d in done)
            known = list(node.keys()) if isinstance(node, (ml_collections.ConfigDict, dict)) else []
            where = f"{prefix.rstrip('.')} has no field {name!r}" if done else f"no top-level field {name!r}"
            raise ConfigError(key, value, f"no such config field ({where})"
                                         + close_names(name, known, prefix))
        node = node[name]
        done.append(name)


def load_config(spec: str, overrides: dict | None = None) -> ml_collections.ConfigDict:
    """The locked config of ``spec = "path.py[:arg]"`` with ``overrides`` (``{"a.b": value}``) set
    and the model section validated; every error is a ``ConfigError`` naming the field."""
    config = unlocked_config(spec)
    config.lock()
    for key, value in (overrides or {}).items():
        check_field(config, key, value)
        try:
            config.update_from_flattened_dict({key: value})
        except (KeyError, AttributeError) as e:
            raise ConfigError(key, value, f"no such config field ({e})") from None
        except TypeError as e:  # ml_collections' type check: a bool field given a string, ...
            raise ConfigError(key, value, f"has the wrong type ({e})") from None
    validate(config.model)
    return config


def parse_overrides(items) -> dict:
    """``["optim.lr=1e-3", "model.residual.implementation=auto"]`` -> ``{key: value}``; values
    are JSON-parsed where they parse (numbers, booleans, lists), Python's ``True``, ``False``
    and ``None`` too, else kept as strings."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(item, None, "must be KEY=VALUE (e.g. train.batch_size=8)", subject="override")
        python_literals = {"True": True, "False": False, "None": None}
        try:
            out[key] = python_literals[value] if value in python_literals else json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
