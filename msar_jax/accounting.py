"""Parameter, training-FLOP and memory-access accounting (the MSAR paper, Appendix C, Tables 3, 5, 6).

Usage::

    python -m msar_jax.accounting --config=configs/msar.py:size=paper_28b [--json] [--seq_len=N]
    python -m msar_jax.accounting --config=configs/mhc.py:size=paper_18b --config.model.residual.streams=4

Library use: ``account(config) -> dict`` and ``format_table(report) -> str`` (``config`` is the full
config with ``.model`` and ``.seq_len``, or a bare model config); ``mfu`` and ``peak_flops`` serve the
training loop's MFU metric. Nothing is allocated: parameters come from ``nnx.eval_shape``, FLOPs and
memory traffic are closed forms, each mechanism's stated by its class (``extra_params``,
``forward_flops``, ``memory_access``). The conventions and the comparison with Table 5 are in
docs/design.md §15.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import ml_collections

from msar_jax import config as config_lib

# --------------------------------------------------------------------------------------------
# Peak FLOPs / MFU
# --------------------------------------------------------------------------------------------

# Dense (no sparsity) bf16 peak per chip, from the vendors' datasheets. Matched in order against
# the lower-cased ``device_kind`` (or the string given), first hit wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("h200", 989e12),  # H200 SXM: 1,979 TFLOPS with sparsity -> 989 dense
    ("h100 pcie", 756e12),
    ("h100", 989e12),  # H100 SXM
    ("a100", 312e12),
    ("b200", 2250e12),
    ("tpu v4", 275e12),
    ("tpu v5 lite", 197e12),  # v5e's device_kind
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p's device_kind is "TPU v5"
    ("tpu v6 lite", 918e12),  # v6e (Trillium)
    ("tpu v6e", 918e12),
)


def peak_flops(device: Any) -> float | None:
    """Peak dense bf16 FLOP/s of one chip, or ``None`` (CPU / unknown).

    ``device`` is a ``jax.Device`` or a string such as ``"NVIDIA H200"`` or ``"TPU v5 lite"``.
    """
    if device is None:
        return None
    if not isinstance(device, str):
        if getattr(device, "platform", None) == "cpu":
            return None
        device = getattr(device, "device_kind", str(device))
    kind = device.lower()
    if kind == "cpu" or kind.startswith("cpu"):
        return None
    for key, value in PEAK_BF16_FLOPS:
        if key in kind:
            return value
    return None


def mfu(flops_per_token: float, tokens_per_second: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation = ``flops_per_token * tokens_per_second / peak_flops``.

    Use training FLOPs per token (``report["flops"]["train"]["model_total"]``) and the same scope for
    throughput and peak (per chip with per-chip peak, or global throughput with ``n_chips x peak``).
    Returns ``None`` when the peak is unknown.
    """
    if not peak_flops:
        return None
    return flops_per_token * tokens_per_second / peak_flops


# --------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------


def _model_cfg(config) -> ml_collections.ConfigDict:
    return config.model if "model" in config else config


def _group(path: tuple) -> str:
    head = path[0]
    last = path[-1]
    if head in ("embedding", "lm_head", "final_norm", "residual"):
        return {"final_norm": "norms"}.get(head, head)
    if last == "norm":
        return "norms"
    if head == "attn":
        return "attention"
    if head == "dense":
        return "dense_ffn"
    if head == "moe":
        if last == "router":
            return "router"
        if last.startswith("experts_"):
            return "routed_experts"
        if last.startswith("shared_"):
            return "shared_experts"
    return "other"


def param_counts(model_cfg) -> dict:
    """Parameter counts by group from ``nnx.eval_shape`` of ``Transformer`` (nothing allocated)."""
    import jax
    from flax import nnx

    from msar_jax.model.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(0)))
    groups: dict[str, int] = {}
    pure = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
        name = _group(tuple(str(getattr(k, "key", k)) for k in path))
        groups[name] = groups.get(name, 0) + math.prod(leaf.shape)
    groups = dict(sorted(groups.items()))
    total = sum(groups.values())
    moe = model_cfg.moe
    routed = groups.get("routed_experts", 0)
    routed_active = routed * moe.top_k // moe.n_routed_experts if routed else 0
    emb = groups.get("embedding", 0)
    residual = groups.get("residual", 0)
    activated = total - routed + routed_active
    return dict(
        groups=groups,
        total=total,
        total_excl_embedding=total - emb,
        activated=activated - emb,  # Table 3 convention: exclude input embeddings
        activated_incl_embedding=activated,
        backbone_total=total - residual,
        backbone_activated=activated - emb - residual,  # Vanilla's P_act (Table 5 denominator)
        residual=residual,
    )


def _mechanism(model_cfg):
    """The registered class of ``model_cfg.residual.name`` (it states its own closed forms)."""
    from msar_jax.residuals import mechanism_class

    return mechanism_class(model_cfg.residual.name)


def residual_params_analytic(model_cfg) -> dict:
    """Closed-form parameter count of the mechanism (Eq. 19-20 and their ablation variants):
    ``{"value", "formula"}`` from the mechanism's ``extra_params``."""
    return _mechanism(model_cfg).extra_params(model_cfg)


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------


def backbone_forward_flops(model_cfg, seq_len: int) -> dict:
    """Forward FLOPs per token of the backbone by component (multiply-add = 2)."""
    c = model_cfg
    d, nh, nk, hd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    from msar_jax.model.transformer import layer_kinds

    kinds = layer_kinds(c)
    n_dense, n_moe = kinds.count("dense"), kinds.count("moe")
    attn_proj = c.n_layers * (2 * d * (nh + 2 * nk) * hd + 2 * nh * hd * d)
    t_eff = seq_len / 2  # causal: mean visible keys (T+1)/2 ~ T/2
    attn_scores = c.n_layers * 2 * (2 * nh * hd * t_eff)  # QK^T and AV
    ffn = n_dense * 6 * d * c.mlp_dim
    router = 0
    if n_moe:
        moe = c.moe
        ffn += n_moe * 6 * d * moe.expert_dim * moe.top_k
        if moe.n_shared_experts:
            ffn += n_moe * 6 * d * moe.shared_expert_dim * moe.n_shared_experts
        router = n_moe * 2 * d * moe.n_routed_experts
    lm_head = 2 * d * c.vocab_size
    out = dict(attn_proj=attn_proj, attn_scores=attn_scores, ffn=ffn, router=router, lm_head=lm_head)
    out["total"] = sum(out.values())
    out["total_excl_lm_head"] = out["total"] - lm_head
    return {k: float(v) for k, v in out.items()}


# Per-element costs the mechanisms' ``forward_flops`` use (module docstring, "Mechanism cost").
SOFTMAX = 5  # FLOPs per logit
SIGMOID = 4


def mechanism_forward_flops(model_cfg, two_phase: bool | None = None) -> dict:
    """Forward FLOPs per token of the residual mechanism by component (see module docstring),
    from the mechanism's ``forward_flops``; the two-phase form applies only at S > 1."""
    res = model_cfg.residual
    if two_phase is None:
        two_phase = bool(res.two_phase)
    two_phase = two_phase and res.block_size > 1
    return _mechanism(model_cfg).forward_flops(model_cfg, two_phase)


# --------------------------------------------------------------------------------------------
# Memory access (Table 6)
# --------------------------------------------------------------------------------------------

TABLE6_TYPICAL = dict(N=8, S=16, m=4)
TABLE6_TYPICAL_VALUES = {"Vanilla": 3.0, "mHC": 34.0, "Block AttnRes": 5.5, "Block MSAR": 21.5}


def table6_coefficients(N: float, S: float, m: int) -> dict:
    """Table 6 leading terms (units of d) per token per residual sublayer."""
    return {
        "Vanilla": 3.0,
        "mHC": 8.0 * m + 2.0,
        "Block AttnRes": N / S + 5.0,
        "Block MSAR": N / S + 4.0 * m + 5.0,
    }


def memory_access(model_cfg) -> dict:
    """Table 6's forward activation traffic per token per sublayer of the config's mechanism
    (its ``memory_access``), beside every Table 6 method at the same N, S, m."""
    res = model_cfg.residual
    L = config_lib.n_sublayers(model_cfg)
    S, N, m = res.block_size, config_lib.n_blocks(model_cfg), res.streams
    coef = table6_coefficients(N, S, m)
    mechanism = _mechanism(model_cfg)
    symbolic, value, note = mechanism.memory_access(model_cfg)
    if S == 1 and mechanism.uses_sources:
        note += f"; Full mode: S = 1, N = L = {L} (no amortisation)"
    typical = table6_coefficients(**TABLE6_TYPICAL)
    return dict(
        symbolic=symbolic, per_sublayer_d=value, per_sublayer_elements=value * model_cfg.d_model,
        N=N, S=S, m=m, note=note, all_methods_at_config=coef, typical=dict(TABLE6_TYPICAL, values=typical),
    )


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------


def account(config, seq_len: int | None = None) -> dict:
    """The full report for a config (``ConfigDict`` with ``.model`` [and ``.seq_len``], or a model config)."""
    model_cfg = _model_cfg(config)
    config_lib.validate(model_cfg)
    if seq_len is None:
        seq_len = config.get("seq_len", model_cfg.max_seq_len) if "model" in config else model_cfg.max_seq_len
    res = model_cfg.residual
    L = config_lib.n_sublayers(model_cfg)

    params = param_counts(model_cfg)
    analytic = residual_params_analytic(model_cfg)
    if params["residual"] != analytic["value"]:
        raise AssertionError(
            f"residual parameters from eval_shape ({params['residual']:,}) != closed form "
            f"{analytic['formula']} = {analytic['value']:,} for {res.name}"
        )
    params["residual_analytic"] = analytic["value"]
    params["residual_formula"] = analytic["formula"]
    params["residual_pct_of_vanilla_activated"] = 100.0 * params["residual"] / params["backbone_activated"]

    backbone = backbone_forward_flops(model_cfg, seq_len)
    mech = mechanism_forward_flops(model_cfg)
    mech_direct = mechanism_forward_flops(model_cfg, two_phase=False)
    vanilla_train = 3 * backbone["total"]
    vanilla_train_excl = 3 * backbone["total_excl_lm_head"]
    overhead = 3 * mech["total"]
    overhead_direct = 3 * mech_direct["total"]
    flops = dict(
        seq_len=int(seq_len),
        causal_convention="T/2",
        two_phase=bool(res.two_phase and res.block_size > 1),
        forward=dict(backbone=backbone, mechanism=mech),
        train=dict(
            vanilla_total=vanilla_train,
            vanilla_excl_lm_head=vanilla_train_excl,
            overhead=overhead,
            overhead_direct=overhead_direct,
            model_total=vanilla_train + overhead,
            model_excl_lm_head=vanilla_train_excl + overhead,
        ),
        overhead_pct_incl_lm_head=100.0 * overhead / vanilla_train,
        overhead_pct_excl_lm_head=100.0 * overhead / vanilla_train_excl,
        overhead_direct_pct_incl_lm_head=100.0 * overhead_direct / vanilla_train,
        overhead_per_sublayer_d=mech["total"] / (L * model_cfg.d_model),
        vanilla_residual_adds_forward=float(L * model_cfg.d_model),
    )
    return dict(
        mechanism=res.name,
        size=config.get("size") if "model" in config else None,
        dims=dict(
            d_model=model_cfg.d_model, n_layers=model_cfg.n_layers, L=L, block_size=res.block_size,
            n_blocks=config_lib.n_blocks(model_cfg), streams=res.streams,
            kernel_sizes=list(res.kernel_sizes), conv=bool(res.conv), fusion=res.fusion, heads=res.heads,
            vocab_size=model_cfg.vocab_size, moe=bool(model_cfg.moe.enabled),
        ),
        params=params,
        flops=flops,
        memory=memory_access(model_cfg),
    )


def _n(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.4g}{unit}"
    return f"{x:.4g}"


def format_table(report: dict) -> str:
    p, f, mem, dims = report["params"], report["flops"], report["memory"], report["dims"]
    lines = []
    w = lines.append
    w(f"== {report['mechanism']}  (size={report['size']}, L={dims['L']} sublayers, d={dims['d_model']}, "
      f"S={dims['block_size']}, N={dims['n_blocks']}, m={dims['streams']}, kernels={tuple(dims['kernel_sizes'])}, "
      f"conv={dims['conv']}, fusion={dims['fusion']})")
    w("-- parameters")
    w(f"  total                          {p['total']:>18,}")
    w(f"  total excl. input embedding    {p['total_excl_embedding']:>18,}")
    w(f"  activated (excl. input emb.)   {p['activated']:>18,}   [Table 3 convention]")
    w(f"  activated (incl. embedding)    {p['activated_incl_embedding']:>18,}")
    w(f"  Vanilla activated (excl. emb.) {p['backbone_activated']:>18,}")
    w(f"  residual mechanism (eval_shape){p['residual']:>18,}")
    w(f"  residual mechanism (analytic)  {p['residual_analytic']:>18,}   {p['residual_formula']}")
    w(f"  Delta P / P_act(Vanilla)       {p['residual_pct_of_vanilla_activated']:>17.3f}%")
    w("  by group: " + ", ".join(f"{k}={v:,}" for k, v in p["groups"].items()))
    tr = f["train"]
    w(f"-- training FLOPs per token (3 x forward, multiply-add = 2, causal attention at T/2, T={f['seq_len']})")
    bb = f["forward"]["backbone"]
    w("  backbone forward: " + ", ".join(f"{k}={_n(v)}" for k, v in bb.items()))
    w("  mechanism forward: " + ", ".join(f"{k}={_n(v)}" for k, v in f["forward"]["mechanism"].items()))
    w(f"  Vanilla total (incl. LM head)  {_n(tr['vanilla_total']):>12}")
    w(f"  Vanilla total (excl. LM head)  {_n(tr['vanilla_excl_lm_head']):>12}")
    form = ""
    from msar_jax.residuals import mechanism_class

    if mechanism_class(report["mechanism"]).uses_sources:  # block reads: two-phase or direct
        form = ", two-phase" if f["two_phase"] else ", direct"
    w(f"  mechanism overhead             {_n(tr['overhead']):>12}   ({f['overhead_per_sublayer_d']:.1f} d per sublayer, "
      f"forward{form})")
    w(f"  model total                    {_n(tr['model_total']):>12}")
    w(f"  overhead / Vanilla (incl. LM head, Table 5)  {f['overhead_pct_incl_lm_head']:.3f}%")
    w(f"  overhead / Vanilla (excl. LM head, Sec. 4.3) {f['overhead_pct_excl_lm_head']:.3f}%")
    w(f"  [direct form, no amortisation]               {f['overhead_direct_pct_incl_lm_head']:.3f}%")
    w("-- memory access per token per sublayer (Table 6, forward, leading terms)")
    w(f"  {mem['symbolic']} = {mem['per_sublayer_d']:.4g} d = {_n(mem['per_sublayer_elements'])} elements  "
      f"(N={mem['N']}, S={mem['S']}, m={mem['m']}; {mem['note']})")
    w("  all methods at this N, S, m: " + ", ".join(f"{k} {v:.4g}d" for k, v in mem["all_methods_at_config"].items()))
    t = mem["typical"]
    w(f"  Table 6 Typical (N={t['N']}, S={t['S']}, m={t['m']}): "
      + ", ".join(f"{k} {v:.4g}d" for k, v in t["values"].items()))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _cli() -> None:
    from absl import app, flags
    from ml_collections import config_flags

    from msar_jax.config import REPO_ROOT

    from msar_jax.cli import run_absl_cli

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # config files import configs.common
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/msar.py:size=paper_28b.", lock_config=True)
    flags.DEFINE_bool("json", False, "Print the report as JSON.")
    flags.DEFINE_integer("seq_len", None, "Sequence length T for causal attention (default: config.seq_len).",
                         lower_bound=1)
    flags.mark_flags_as_required(["config"])
    FLAGS = flags.FLAGS

    def main(argv):
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        config = FLAGS.config
        if "model" in config:  # a full config; a bare model config is accepted too (account)
            config_lib.validate(config.model)  # --config.model.* overrides come after get_config's check
            if FLAGS.seq_len is None and not (isinstance(config.get("seq_len"), int) and config.seq_len > 0):
                raise config_lib.ConfigError("seq_len", config.get("seq_len"), "must be a positive integer")
        else:
            config_lib.validate(config)
        report = account(config, seq_len=FLAGS.seq_len)
        print(json.dumps(report, indent=2) if FLAGS.json else format_table(report))

    run_absl_cli(main)  # config and flag errors: one line, no traceback (msar_jax/cli.py)


if __name__ == "__main__":
    _cli()
