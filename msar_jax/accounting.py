"""Parameter, training-FLOP and memory-access accounting (the MSAR paper, Appendix C, Tables 3, 5, 6;
docs/design.md §4-6, §11).

Usage::

    python -m msar_jax.accounting --config=configs/msar.py:size=paper_28b [--json] [--seq_len=N]
    python -m msar_jax.accounting --config=configs/mhc.py:size=paper_18b --config.model.residual.streams=4

Library use: ``account(config) -> dict`` and ``format_table(report) -> str`` (``config`` is the
full config with ``.model`` and ``.seq_len``, or a bare model config). Nothing is allocated:
parameter counts come from ``nnx.eval_shape`` of ``Transformer``; FLOPs and memory traffic are
closed-form estimates from the config. The per-mechanism closed forms below are stated by each
mechanism class (``extra_params``, ``forward_flops``, ``memory_access`` in
``msar_jax/residuals/<mechanism>.py``); this module holds the conventions, the backbone and the
report. ``mfu`` and ``peak_flops`` serve the training loop's MFU metric.

Conventions (every number this module prints follows them)
============================================================

Parameters
----------
* Counted from the abstract ``nnx.Param`` state of ``Transformer`` (float32 masters; count, not
  bytes). The mechanism's overhead is the parameter count of ``model.residual``; it is checked
  against the closed form below and ``account`` raises ``AssertionError`` if they differ.
* Closed forms (Appendix C Eq. 19-20, generalised to the Table 2 ablations):
  Vanilla 0; AttnRes and MHAR ``(L+1) d`` (MHAR's heads split the query, they add nothing);
  mHC ``L [md(m^2+2m) + m^2+2m + 3]``; MSAR ``L [m d + (m^2 d + m + 1) + d sum(kappa)]`` where the
  mixer term ``m^2 d + m + 1`` is dropped for ``fusion='mean'`` and the conv term for ``conv=False``
  (Eq. 20 is the default case: ``L (44 d + 5)`` at m = 4, kappa = (4, 8, 12)); the AttnRes+mHC
  hybrid is the sum of its two parts. L counts residual sublayers (2 x transformer layers).
* Activated parameters (Table 3 / Table 4 footnote "exclude input embeddings"): every parameter
  except that routed experts count ``top_k / n_routed_experts`` of their total (shared experts,
  router, attention, norms, LM head and the residual mechanism count fully). We report it
  without the input embedding (the paper's convention; the LM head *is* counted, which is what
  reproduces Table 4's 1.77B / 0.34B etc.) and with the whole embedding matrix added. With tied
  embeddings the one matrix is counted once, as the LM head. Table 5's ``Delta P / P_act`` uses
  the rounded 1.7B / 2.7B; we divide by the exact Vanilla activated count (1.766B / 2.722B), so
  our percentages are a little lower (e.g. mHC 18B 0.64% vs 0.67%).

Training FLOPs (Appendix C "Training FLOPs"; §4.3)
--------------------------------------------------
* A multiply-add is 2 FLOPs; training = 3 x forward; activation recomputation, the optimizer, the
  MoE auxiliary loss and the cross-entropy are excluded (Appendix C).
* Backbone forward per token: attention projections ``2 d (n_heads + 2 n_kv_heads) head_dim +
  2 n_heads head_dim d``; causal attention ``QK^T`` and ``AV``: ``2 x 2 n_heads head_dim T_eff``
  with **T_eff = T/2**: under a causal mask token t sees t+1 keys, mean (T+1)/2 ~ T/2, and
  flash-style kernels skip the masked half, so it is the work actually needed (the paper says
  "causal attention"; with full T every Table 5 percentage would come out ~15% lower, e.g. mHC
  28B 0.51% instead of 0.60%, so T/2 is also the convention consistent with the paper); dense
  SwiGLU ``6 d f``; MoE: router ``2 d E``, the top-k routed experts ``6 d f_e k`` and the shared
  experts ``6 d f_s``; LM head ``2 d V``. Norms, RoPE, SwiGLU activations, softmax of sequence
  attention and the residual adds of the backbone are not counted (Appendix C lists only the
  projections, causal attention and the LM head). Hence Vanilla's mechanism cost is 0 by
  convention (its ``L d`` adds are reported as a reference only).
* Overhead percentages are relative to Vanilla's training FLOPs on the same backbone: (a)
  including the LM head (Table 5's convention) and (b) excluding it (the scaling-law compute of
  §4.3: "excludes the LM head and includes method-specific residual overhead").
* Mechanism cost, counted literally as the equations are written (no algebraic shortcuts):
  elementwise op 1 FLOP per element; a weightless ``rms`` of an n-vector ``3n`` (square, sum,
  scale); a dot product / weighted-sum term ``2n``; a softmax 5 FLOPs per logit (max, subtract,
  exp, sum, divide); a sigmoid 4 FLOPs. Scalar-only terms (softmax, Sinkhorn, gate biases) are
  included but are O(1) per token per sublayer, i.e. negligible against the ``d`` terms.

  - Depth attention (AttnRes, MHAR, MSAR; docs/design.md §2-5) per target l in block n with ``c = n+1``
    completed sources ``b_0..b_n`` and the partial p_l if l is not first in its block: per
    (target, source, stream) scoring ``2d`` and value aggregation ``2d``; per (target, stream)
    the normalisation ``d`` (divide by the softmax denominator) and, in two-phase form, the
    online-softmax rescale ``d`` when a partial is merged into the phase-1 state; per source and
    distinct stream the key rms ``3d`` (no-conv: the m streams are identical copies so one rms
    per source); per source the conv expansion ``2 d sum(kappa)`` (MSAR only; the identity
    stream is free). Block accumulation ``p += v``: ``d`` per sublayer (Appendix C lists it).
  - **Two-phase form** (§3.4 of the MSAR paper; docs/design.md §5): completed sources are expanded and key-normalised
    **once per block** (phase 1 shares them between the block's S targets: "queries for all
    target layers in the block are batched against the completed sources"), so their cost is
    ``sum over blocks of c x (expansion + key rms)``, i.e. amortised over S targets; the partial
    is expanded (bank l-1) and normalised once per target (phase 2). Scoring and aggregation are
    per (target, source) in both forms. If ``residual.two_phase`` is False the direct form is
    costed (every target re-expands and re-normalises every source it reads); we also always
    report the direct-form overhead as ``overhead_direct`` for comparison. Full mode (S = 1) is
    the same formula with one target per block (no amortisation).
  - MSAR stream fusion (Eq. 13-14): ``rms`` over ``md`` (``3md``), the gate projection
    ``2 md m``, the per-stream affine + sigmoid (``6m``) and the weighted sum ``2md``; mean fusion
    ``md``. Final hidden: residual merge ``h_L + v_L`` = ``d`` (or the sum of the N+1 sources
    with ``final_merge='sum'``).
  - AttnRes / MHAR final read (docs/design.md §3): one more direct read over ``b_0..b_N`` (N+1 sources).
    MHAR's H heads split the dot products (same ``2d`` per source in total) and multiply the
    softmax scalars by H.
  - mHC per sublayer (docs/design.md §6): ``rms`` of the ``md`` state ``3md``; the projection
    ``2 md (m^2+2m)``; the coefficient affines ``2 (m^2+2m)``, sigmoids ``4 x 2m``; Sinkhorn: exp
    ``m^2`` then ``iters`` (row, column) passes of ``4 m^2``; apply ``H_pre`` ``2md``, ``H_res``
    ``2 m^2 d``, ``H_post`` (scale and add) ``2md``. Final ``sum_i X_i``: ``(m-1) d``. At m = 4 this
    is ``252 d`` per sublayer. Appendix C says the paper used "the training implementation's
    estimator" for mHC, which is not published; ours is the count above, and it lands within
    0.01 percentage points of Table 5 (see below).
  - AttnRes + mHC hybrid: the sum of both, plus ``d`` per sublayer to add the two reads and ``d``
    for the final sum.

Results against Table 5 (seq_len 8192; ``Delta F / F_Vanilla`` incl. LM head), this estimator
(forward overhead per sublayer in units of d in brackets):
  18B: MSAR 0.585% [221 d] (paper 0.51%), AttnRes 0.073% [27.5 d] (0.10%), mHC 0.668% [253 d] (0.66%).
  28B: MSAR 0.562% [233 d] (paper 0.48%), AttnRes 0.072% [29.7 d] (0.10%), mHC 0.610% [253 d] (0.60%).
mHC matches to 0.01 points; MSAR is ~0.08 points above and AttnRes ~0.03 below the paper. We did
not tune the counting to close the gap: the paper's MSAR/AttnRes estimators are not published.
Back-solving Table 5 with our Vanilla denominators gives ~200 d (MSAR) and ~41 d (AttnRes) per
sublayer. Plausible sources: MSAR - the paper may fold the rms normalisations into the scores /
gate logits (``2n`` rather than ``3n``) and omit the explicit normalise/rescale terms; our
breakdown at 28B is expansion 69 d, key rms 17 d, scoring 43 d, aggregation 47 d, merge 3.5 d,
fusion 52 d. AttnRes - the paper's 0.10% is what our *direct* form gives (key norms per (target,
source), no amortisation: 0.098% at both scales), so the paper probably did not amortise
AttnRes's key norm over a block. The ordering mHC > MSAR > AttnRes > 0, and MSAR ~ 0.5%, hold under
every convention here.

Memory access (Table 6; docs/design.md §5)
------------------------------------------
Forward activation I/O per token per residual sublayer, leading terms in units of d, parameter
traffic and f_l's internal I/O excluded, phase 1 averaged over depth and amortised over S:
Vanilla ``3``; mHC ``8m + 2``; Block AttnRes ``N/S + 5``; Block MSAR ``N/S + 4m + 5`` (expansion fused
with scoring, only the m retrieved streams written). Typical (N = 8, S = 16, m = 4): 3, 34, 5.5,
21.5. Our choices where Table 6 is silent: Full mode (S = 1) uses the same formulas with S = 1,
N = L (every target its own block, no amortisation: ``(L+5) d`` and ``(L+4m+5) d``); MHAR = Block
AttnRes (heads split channels, same traffic); MSAR ablations (no conv, mean fusion, other m) use
the MSAR formula with their m (the m retrieved streams are still written and read); the
AttnRes+mHC hybrid = AttnRes + mHC, ``(N/S + 8m + 7) d`` (both states are kept and read).
``N`` is ``ceil(L/S)`` of the config (the last block may be shorter).
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
