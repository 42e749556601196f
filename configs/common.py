"""Shared pieces of every config file: sizes, the argument parser and ``make_config``.

Each config file in this folder defines ``get_config(arg)``; ``arg`` is the text after
the ``:`` in ``--config=configs/msar.py:size=small,block_size=8`` (big_vision style):
comma-separated ``key=value`` pairs from ``ARG_SPEC``. ``size=tiny`` shrinks any config
to a CPU smoke run of the default backbone; ``smoke=1`` shrinks *any* config (any size,
any mechanism, ablation or scaling rung) to a CPU smoke run that keeps its residual settings:
a 2-layer d=32 backbone, ``seq_len=32``, batch 2, 4 steps (``SMOKE``). Any field can then be
overridden on the command line with ``--config.model.d_model=128`` or ``--config.optim.lr=3e-4``
(the config is locked, so a typo is an error).

Top-level fields: ``size``, ``seq_len``, ``model`` (``msar_jax.config.model_config``), and the
training sections ``train``, ``optim``, ``data``, ``checkpoint`` (``train_config()`` etc. below;
their per-size defaults are in ``TRAIN_SIZES``; checked by ``msar_jax.train.validate``), and
``parallel`` (mesh degrees, pipeline, multi-host start-up: ``msar_jax.parallel.config``; one
device by default, e.g. ``--config.parallel.mesh.fsdp=4``).
"""

from __future__ import annotations

import ml_collections

from msar_jax import config as config_lib
from msar_jax.parallel.config import parallel_config

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

# Scaled-down scaling-law ladder (configs/scaling/): the four Table 4 backbones with their
# depth and layers-per-block kept (15/23/15/28 layers, 2/3/2/4 layers per block -> 8, 8, 8, 7
# blocks) and the width cut about 8x, dense SwiGLU (f = 3d, the activated FFN width of Table 4's
# MoE layers: 8 x 320 + 320 ~ 3 x 1024) in place of the MoE so a rung trains on one GPU in minutes.
_LADDER_COMMON = dict(vocab_size=256, n_heads=4, n_kv_heads=2, head_dim=32, max_seq_len=1024, dtype="bfloat16")
SIZES.update({
    "ladder_1": dict(model=dict(_LADDER_COMMON, d_model=128, n_layers=15, mlp_dim=384), seq_len=1024, block_size=4),
    "ladder_2": dict(model=dict(_LADDER_COMMON, d_model=128, n_layers=23, mlp_dim=384), seq_len=1024, block_size=6),
    "ladder_3": dict(model=dict(_LADDER_COMMON, d_model=256, n_layers=15, n_heads=8, n_kv_heads=4, mlp_dim=768),
                     seq_len=1024, block_size=4),
    "ladder_4": dict(model=dict(_LADDER_COMMON, d_model=256, n_layers=28, n_heads=8, n_kv_heads=4, mlp_dim=768),
                     seq_len=1024, block_size=8),
})


def train_config() -> ml_collections.ConfigDict:
    """The training loop (msar_jax.train). Step counts are optimizer steps."""
    return ml_collections.ConfigDict(dict(
        steps=500,  # total optimizer steps; the LR schedule is laid out over this many
        batch_size=16,  # global batch (sequences of seq_len + 1 tokens)
        grad_accum=1,  # microbatches per optimizer step (gradient accumulation): batch_size / grad_accum rows per pass
        seed=0,  # parameter init and data-order seed
        log_every=1,  # metrics record every K steps (JSONL / TensorBoard); the progress bar is live
        eval_every=100,  # validation loss (and bits per byte) every K steps and at the end; 0 = only at the end
        eval_batches=8,  # validation batches per evaluation (in order from the start of val)
        eval_batch_size=0,  # 0 = batch_size
        progress=True,  # tqdm progress bar
        tensorboard=True,  # also write TensorBoard events when tensorboardX is installed
        depth_weights=True,  # write the learned depth-attention weights (introspection) at the end
    ))


def optim_config() -> ml_collections.ConfigDict:
    """AdamW with clipping and a warmup-stable-decay schedule (Table 3)."""
    return ml_collections.ConfigDict(dict(
        lr=3e-3,  # peak learning rate
        schedule="wsd",  # "wsd" (warmup, stable, exponential decay), "cosine", "constant" (after warmup)
        warmup_steps=50,  # linear warmup from lr / warmup_steps to lr
        decay_fraction=0.2,  # wsd: the last fraction of the steps decays exponentially
        min_lr_ratio=0.1,  # the schedule ends at min_lr_ratio * lr (Table 3)
        b1=0.9,
        b2=0.95,
        eps=1e-15,  # Table 3
        weight_decay=0.1,  # decoupled, scaled by the LR (optax.adamw); groups: msar_jax.train.optim
        grad_clip=1.0,  # global-norm clipping; 0 = off
    ))


def data_config() -> ml_collections.ConfigDict:
    """Where tokens come from (msar_jax.data.ensure_prepared, or a token store) and how they are batched."""
    return ml_collections.ConfigDict(dict(
        dir="",  # a prepared folder or a token store (path or URL, gs://...); "" = the cache folder
        # of source/tokenizer (built if missing)
        source="bundled",  # "bundled", "stdlib" or a folder of *.txt
        tokenizer="bytes",  # "bytes" (vocab 256) or "bpe"
        vocab_size=0,  # BPE vocabulary size; 0 = the tokenizer's default
        # True: attention stays within documents and the convolution restarts at each document
        # start (segment ids from the data's document starts, docs/training.md §6)
        document_mask=False,
    ))


def checkpoint_config() -> ml_collections.ConfigDict:
    """orbax CheckpointManager in <workdir>/checkpoints."""
    return ml_collections.ConfigDict(dict(
        every=250,  # save every K steps (and at the end, and on SIGTERM / SIGINT); 0 = only those
        keep=3,  # keep the newest N checkpoints
        async_save=True,  # write in a background thread while training continues
        resume=True,  # resume from the newest checkpoint in the workdir if there is one
    ))


# Training defaults per size: {section: {field: value}}. Learning rates and batch sizes of the
# paper sizes are Table 3 / Table 4's; their step counts are placeholders (token budgets are not
# published). Ladder: Table 4's batch sizes / 4 at T = 1024 and twice Table 4's rates (widths are
# ~8x smaller); steps give ~5 tokens per non-embedding parameter at every rung (a quarter of
# Chinchilla's 20, so that each rung trains on one H200 in minutes: Vanilla small runs at ~600k
# tokens/s there, MSAR on the XLA path ~6x slower until the fused kernels land; BENCHMARKS.md),
# and the same budget for every mechanism at a rung (Appendix B: "matched training-token budgets").
# For longer budgets raise train.steps, by the same factor for every mechanism.
TRAIN_SIZES = {
    "tiny": dict(train=dict(steps=500, batch_size=16, eval_every=100, eval_batches=8),
                 optim=dict(lr=3e-3, warmup_steps=50), checkpoint=dict(every=250)),
    "small": dict(train=dict(steps=3000, batch_size=32, eval_every=250, eval_batches=20),
                  optim=dict(lr=1e-3, warmup_steps=150), checkpoint=dict(every=500)),
    "base": dict(train=dict(steps=10000, batch_size=64, eval_every=500, eval_batches=20),
                 optim=dict(lr=6e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "paper_10b": dict(train=dict(steps=20000, batch_size=288, eval_every=1000, eval_batches=20),
                      optim=dict(lr=4.82e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "paper_18b": dict(train=dict(steps=20000, batch_size=384, eval_every=1000, eval_batches=20),
                      optim=dict(lr=3.97e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "paper_28b": dict(train=dict(steps=20000, batch_size=768, eval_every=1000, eval_batches=20),
                      optim=dict(lr=3.5e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "scaling_1": dict(train=dict(steps=20000, batch_size=160, eval_every=1000, eval_batches=20),
                      optim=dict(lr=6.95e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "scaling_2": dict(train=dict(steps=20000, batch_size=208, eval_every=1000, eval_batches=20),
                      optim=dict(lr=5.74e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "scaling_3": dict(train=dict(steps=20000, batch_size=288, eval_every=1000, eval_batches=20),
                      optim=dict(lr=4.82e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    "scaling_4": dict(train=dict(steps=20000, batch_size=384, eval_every=1000, eval_batches=20),
                      optim=dict(lr=3.97e-4, warmup_steps=500), checkpoint=dict(every=1000)),
    # ~3.0M / 4.6M / 11.9M / 22.2M non-embedding parameters -> 16M / 24M / 61M / 113M tokens.
    "ladder_1": dict(train=dict(steps=390, batch_size=40, eval_every=100, eval_batches=20),
                     optim=dict(lr=1.39e-3, warmup_steps=30), checkpoint=dict(every=200)),
    "ladder_2": dict(train=dict(steps=450, batch_size=52, eval_every=150, eval_batches=20),
                     optim=dict(lr=1.15e-3, warmup_steps=40), checkpoint=dict(every=250)),
    "ladder_3": dict(train=dict(steps=830, batch_size=72, eval_every=200, eval_batches=20),
                     optim=dict(lr=9.6e-4, warmup_steps=60), checkpoint=dict(every=400)),
    "ladder_4": dict(train=dict(steps=1150, batch_size=96, eval_every=250, eval_batches=20),
                     optim=dict(lr=7.9e-4, warmup_steps=80), checkpoint=dict(every=500)),
}

# smoke=1: a CPU smoke run of any config. The residual settings (mechanism, S, m, kernels,
# fusion, conv) are kept; the backbone and the loop shrink. MoE stays on if the size has it.
SMOKE = dict(
    model=dict(d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, mlp_dim=64, vocab_size=256,
               max_seq_len=32, dtype="float32"),
    moe=dict(n_dense_layers=1, n_routed_experts=4, top_k=2, expert_dim=32, shared_expert_dim=32),
    seq_len=32,
    train=dict(steps=4, batch_size=2, eval_every=2, eval_batches=1, depth_weights=False),
    optim=dict(warmup_steps=1),
    checkpoint=dict(every=2),
)

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
    "smoke": int,  # 1 = shrink to a CPU smoke run (SMOKE)
}


_TYPE_RULES = {int: "must be an integer", str: "must be text"}
_FLAGS = ("smoke", "conv")  # 0 or 1


def _arg_error(key: str, value, rule: str) -> config_lib.ConfigError:
    return config_lib.ConfigError(key, value, rule, subject="config argument")


def parse_arg(arg: str | None) -> dict:
    """``"size=small,block_size=8"`` -> ``{"size": "small", "block_size": 8}``; strict: an unknown
    key names the close ones, a value of the wrong type names its type (``ConfigError``)."""
    out: dict = {}
    if not arg:
        return out
    for item in arg.split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise _arg_error(key, None, f"must be key=value, with key one of {sorted(ARG_SPEC)}")
        if key not in ARG_SPEC:
            hint = config_lib.close_names(key, ARG_SPEC)
            raise _arg_error(key, value, f"unknown key{hint} (keys: {', '.join(sorted(ARG_SPEC))})")
        try:
            out[key] = ARG_SPEC[key](value)
        except ValueError:
            raise _arg_error(key, value, _TYPE_RULES[ARG_SPEC[key]]) from None
        if key in _FLAGS and out[key] not in (0, 1):
            raise _arg_error(key, out[key], "must be 0 or 1")
        if key == "seq_len" and out[key] <= 0:  # the model fields are checked by config.validate
            raise _arg_error(key, out[key], "must be a positive integer")
    return out


def _kernel_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(k) for k in text.split("-") if k)
    except ValueError:
        sizes = ()
    if not sizes or any(k <= 0 for k in sizes):
        raise _arg_error("kernel_sizes", text, "must be positive integers joined by '-', e.g. 4-8-12")
    return sizes


def make_config(mechanism: str, arg: str | None = None, default_size: str = "tiny", **residual) -> ml_collections.ConfigDict:
    """The full config for ``mechanism`` at the size and overrides given in ``arg``."""
    args = parse_arg(arg)
    smoke = bool(args.pop("smoke", 0))
    size = args.pop("size", default_size)
    if size not in SIZES:
        hint = config_lib.close_names(size, SIZES)
        raise _arg_error("size", size, f"must be one of {', '.join(sorted(SIZES))}{hint}")
    spec = SIZES[size]
    model = config_lib.model_config()
    overrides = dict(spec["model"])
    moe = overrides.pop("moe", None)
    model.update(overrides)
    if moe:
        model.moe.update(moe)
    if smoke:
        model.update(SMOKE["model"])
        if model.moe.enabled:
            model.moe.update(SMOKE["moe"])
    model.residual.name = mechanism
    model.residual.block_size = spec["block_size"]
    model.residual.update(residual)
    for key in ("block_size", "streams", "heads", "fusion"):
        if key in args:
            model.residual[key] = args.pop(key)
    if "kernel_sizes" in args:
        model.residual.kernel_sizes = _kernel_sizes(args.pop("kernel_sizes"))
    if "conv" in args:
        model.residual.conv = bool(args.pop("conv"))
    if "dtype" in args:
        model.dtype = args.pop("dtype")
    seq_len = args.pop("seq_len", SMOKE["seq_len"] if smoke else spec["seq_len"])
    model.max_seq_len = max(model.max_seq_len, seq_len)

    config = ml_collections.ConfigDict()
    config.size = size
    config.smoke = smoke
    config.model = model
    config.seq_len = seq_len
    config.train = train_config()
    config.optim = optim_config()
    config.data = data_config()
    config.checkpoint = checkpoint_config()
    config.parallel = parallel_config()  # one device unless set (msar_jax/parallel/config.py)
    for section, values in TRAIN_SIZES.get(size, {}).items():
        config[section].update(values)
    if smoke:
        for section in ("train", "optim", "checkpoint"):
            config[section].update(SMOKE[section])
    config_lib.validate(config.model)
    return config
