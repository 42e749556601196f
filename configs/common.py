"""Shared pieces of every config file: sizes, the argument parser and ``make_config``.

Each config file in this folder defines ``get_config(arg)``; ``arg`` is the text after
the ``:`` in ``--config=configs/msar.py:size=small,block_size=8`` (big_vision style):
comma-separated ``key=value`` pairs from ``ARG_SPEC``. ``size=tiny`` shrinks any config
to a CPU smoke run. Any field can then be overridden on the command line with
``--config.model.d_model=128`` (the config is locked, so a typo is an error).
"""

from __future__ import annotations

import ml_collections

from msar_jax import config as config_lib

# Backbone sizes. tiny: CPU in minutes; small: ~25-50M parameters; base: ~350M.
# paper_*: Table 3 (10B ablation model, 18B and 28B main models); scaling_*: Table 4.
_PAPER_COMMON = dict(
    vocab_size=152064, n_heads=16, n_kv_heads=8, head_dim=128, mlp_dim=6144,
    rope_theta=50000.0, norm_eps=1e-5, max_seq_len=8192, dtype="bfloat16",
)


def _moe(n_dense, experts, top_k, expert_dim, shared=1):
    return dict(enabled=True, n_dense_layers=n_dense, n_routed_experts=experts, n_shared_experts=shared,
                top_k=top_k, expert_dim=expert_dim, shared_expert_dim=expert_dim)


SIZES = {
    "tiny": dict(model=dict(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=192,
                            vocab_size=256, max_seq_len=128), seq_len=128, block_size=4),
    "small": dict(model=dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_dim=1536,
                             vocab_size=256, max_seq_len=512, dtype="bfloat16"), seq_len=512, block_size=4),
    "base": dict(model=dict(d_model=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=64, mlp_dim=2816,
                            vocab_size=256, max_seq_len=1024, dtype="bfloat16"), seq_len=1024, block_size=8),
    # Table 3 (Appendix A). Block size S: 4 for the 10B ablations, 8 at 18B/28B.
    "paper_10b": dict(model=dict(_PAPER_COMMON, d_model=2080, n_layers=15, moe=_moe(1, 144, 8, 704)),
                      seq_len=8192, block_size=4),
    "paper_18b": dict(model=dict(_PAPER_COMMON, d_model=2112, n_layers=28, moe=_moe(1, 144, 8, 672)),
                      seq_len=8192, block_size=8),
    "paper_28b": dict(model=dict(_PAPER_COMMON, d_model=2560, n_layers=32, n_heads=20, n_kv_heads=10,
                                 moe=_moe(1, 144, 8, 768)), seq_len=8192, block_size=8),
    # Table 4 (Appendix B): 2, 3, 2, 4 transformer layers per block -> S = 4, 6, 4, 8.
    "scaling_1": dict(model=dict(_PAPER_COMMON, d_model=1024, n_layers=15, n_heads=8, n_kv_heads=4, mlp_dim=3104,
                                 moe=_moe(1, 144, 8, 320)), seq_len=8192, block_size=4),
    "scaling_2": dict(model=dict(_PAPER_COMMON, d_model=1040, n_layers=23, n_heads=8, n_kv_heads=4, mlp_dim=3072,
                                 moe=_moe(1, 144, 8, 352)), seq_len=8192, block_size=6),
    "scaling_3": dict(model=dict(_PAPER_COMMON, d_model=2080, n_layers=15, mlp_dim=6144,
                                 moe=_moe(1, 144, 8, 704)), seq_len=8192, block_size=4),
    "scaling_4": dict(model=dict(_PAPER_COMMON, d_model=2112, n_layers=28, mlp_dim=6144,
                                 moe=_moe(1, 144, 8, 672)), seq_len=8192, block_size=8),
}

# Keys accepted in the config argument string, with their types.
ARG_SPEC = {
    "size": str,
    "block_size": int,
    "streams": int,
    "kernel_sizes": str,  # e.g. "4-8-12"
    "heads": int,
    "seq_len": int,
    "conv": int,
    "fusion": str,
    "dtype": str,
}


def parse_arg(arg: str | None) -> dict:
    """``"size=small,block_size=8"`` -> ``{"size": "small", "block_size": 8}``; strict."""
    out: dict = {}
    if not arg:
        return out
    for item in arg.split(","):
        if not item:
            continue
        if "=" not in item:
            raise config_lib.ConfigError("config argument", item, f"must be key=value with key in {sorted(ARG_SPEC)}")
        key, value = item.split("=", 1)
        if key not in ARG_SPEC:
            raise config_lib.ConfigError("config argument", key, f"unknown key; known keys: {sorted(ARG_SPEC)}")
        try:
            out[key] = ARG_SPEC[key](value)
        except ValueError:
            raise config_lib.ConfigError(f"config argument {key}", value, f"must be a {ARG_SPEC[key].__name__}") from None
    return out


def make_config(mechanism: str, arg: str | None = None, default_size: str = "tiny", **residual) -> ml_collections.ConfigDict:
    """The full config for ``mechanism`` at the size and overrides given in ``arg``."""
    args = parse_arg(arg)
    size = args.pop("size", default_size)
    if size not in SIZES:
        raise config_lib.ConfigError("config argument size", size, f"must be one of {sorted(SIZES)}")
    spec = SIZES[size]
    model = config_lib.model_config()
    overrides = dict(spec["model"])
    moe = overrides.pop("moe", None)
    model.update(overrides)
    if moe:
        model.moe.update(moe)
    model.residual.name = mechanism
    model.residual.block_size = spec["block_size"]
    model.residual.update(residual)
    for key in ("block_size", "streams", "heads", "fusion"):
        if key in args:
            model.residual[key] = args.pop(key)
    if "kernel_sizes" in args:
        text = args.pop("kernel_sizes")
        model.residual.kernel_sizes = tuple(int(k) for k in text.split("-") if k)
    if "conv" in args:
        model.residual.conv = bool(args.pop("conv"))
    if "dtype" in args:
        model.dtype = args.pop("dtype")
    seq_len = args.pop("seq_len", spec["seq_len"])
    model.max_seq_len = max(model.max_seq_len, seq_len)

    config = ml_collections.ConfigDict()
    config.size = size
    config.model = model
    config.seq_len = seq_len
    config_lib.validate(config.model)
    return config
