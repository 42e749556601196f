"""Experiment figures (PNG): training curves of all rows, Figure 4 depth weights, Figure 5 mixing matrices.

    python -m msar_jax.experiments.plots --figure5=mixing.png [--train_steps=200]
    python -m msar_jax.experiments.plots --ablation_dir=W          # curves.png + depth_weights_*.png

``plot_training_curves(workdir, rows, seeds, out)``, ``plot_run_depth_weights(row_dir, seeds, out)``
(Figure 4, Appendix D) and ``mixing_matrices(mechanism, ...)`` / ``plot_mixing_matrices(out)``
(Figure 5, Appendix E.2, with mHC's unrolled coefficients of Eq. 21). What each figure shows and how
its parameters are chosen: docs/methods.md §3.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

FIG5_MECHANISMS = ("vanilla", "mhc", "attnres", "msar")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------------
# Training curves and Figure 4
# --------------------------------------------------------------------------------------------


def _mean_curve(run_dirs, kind: str, key: str):
    from msar_jax.train.metrics import read_jsonl

    curves = []
    for d in run_dirs:
        try:
            recs = [r for r in read_jsonl(d, kind) if isinstance(r.get(key), (int, float))]
        except OSError:
            continue
        if recs:
            curves.append({r["step"]: r[key] for r in recs})
    if not curves:
        return None, None
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return np.array(steps), np.array([np.mean([c[s] for c in curves]) for s in steps])


def plot_training_curves(workdir, rows, seeds, out, labels: dict | None = None) -> str | None:
    """Validation and training loss of every row (mean over finished seeds) on one figure."""
    from msar_jax.experiments.ablation import is_finished

    plt = _pyplot()
    workdir = Path(workdir)
    fig, (ax_v, ax_t) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = plt.get_cmap("tab10").colors
    drawn, late = 0, []
    for k, row in enumerate(rows):
        dirs = [workdir / row / f"seed{s}" for s in seeds if is_finished(workdir / row / f"seed{s}")]
        if not dirs:
            continue
        label = f"{(labels or {}).get(row, row)} (n={len(dirs)})"
        color, style = colors[k % 10], ("-", "--", ":")[(k // 10) % 3]
        steps, val = _mean_curve(dirs, "eval", "val_loss")
        if steps is not None:
            ax_v.plot(steps, val, marker="o", ls=style, ms=3, color=color, label=label)
        steps, tr = _mean_curve(dirs, "train", "loss")
        if steps is not None:
            w = max(1, len(tr) // 50)
            if w > 1:
                tr = np.convolve(tr, np.ones(w) / w, mode="valid")
                steps = steps[w - 1:]
            ax_t.plot(steps, tr, color=color, ls=style, lw=1.2, label=label)
            late.extend(tr[len(tr) // 4:])  # past the initial drop, where the rows differ
        drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax_v.set_title("validation loss (mean over seeds)")
    ax_t.set_title("training loss (moving mean, mean over seeds; y range fits the last 3/4)")
    if late:  # the first steps' drop from ~5 nats would flatten the differences between rows
        lo, hi = float(np.min(late)), float(np.max(late))
        ax_t.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    for ax in (ax_v, ax_t):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats / token)")
        ax.grid(alpha=0.3)
    ax_t.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)


def plot_run_depth_weights(row_dir, seeds, out) -> str | None:
    """Figure 4 heatmaps from the first seed of a row that wrote ``depth_weights.npz``."""
    from msar_jax.train import introspection
    from msar_jax.train import plots as train_plots

    for s in seeds:
        run = Path(row_dir) / f"seed{s}"
        if (run / "depth_weights.npz").is_file() and (run / "config.json").is_file():
            weights, meta = introspection.load(run / "depth_weights")
            config = introspection.load_run_config(run)
            return train_plots.plot_depth_weights(weights, out, config, meta.get("step"))
    return None


# --------------------------------------------------------------------------------------------
# Figure 5: structured depth-mixing matrices
# --------------------------------------------------------------------------------------------


def fig5_config(mechanism: str, n_layers: int = 2, block_size: int = 2, overrides: dict | None = None):
    """A small float32 model (L = 2 n_layers sublayers) for the mixing matrices (smoke backbone)."""
    from msar_jax.config import load_config

    spec = {"vanilla": "configs/vanilla.py", "mhc": "configs/mhc.py", "attnres": "configs/attnres.py",
            "msar": "configs/msar.py"}[mechanism]
    base = {"model.n_layers": n_layers, "model.residual.block_size": block_size, "model.dtype": "float32",
            "train.progress": False, "train.tensorboard": False, "train.depth_weights": False}
    return load_config(f"{spec}:smoke=1", {**base, **(overrides or {})})


def _perturb_mechanism(params: dict, seed: int, std: float | None = None) -> dict:
    """Replace the mechanism's zero-initialised queries / conv banks with seeded normal draws
    (std ``1/sqrt(d)`` by default, so a score ``w . rms(k)`` is about unit normal)."""
    import jax

    res = dict(params["residual"])
    if std is None:
        std = 1.0 / float(np.sqrt(res["queries"].shape[-1]))
    key = jax.random.PRNGKey(seed)
    for name in sorted(res):
        if name in ("queries", "final_query", "conv_banks"):
            key, sub = jax.random.split(key)
            res[name] = std * jax.random.normal(sub, res[name].shape, res[name].dtype)
    return {**params, "residual": res}


def _blocks(L: int, S: int) -> list[list[int]]:
    return [list(range(s, min(s + S - 1, L) + 1)) for s in range(1, L + 1, S)]


def mixing_matrices(model, tokens) -> dict:
    """Figure 5 data of ``model`` (a ``Transformer``) on ``tokens[B, T]``.

    Returns ``{"mechanism", "L", "S", "m", "matrix": [m_panels, L, L] (NaN where unavailable),
    "cells": [(panel, row, col_start, col_end, value, kind)], "h": [L, B, T, d], "v": [L, B, T, d],
    "per_token": [L, L, B, T] (mHC only)}``: row ``l-1`` is target ``h_l``, column ``i`` source
    ``v_i``; ``kind`` is ``"embedding"``, ``"block"`` (a completed block summary spanning
    ``col_start..col_end``), ``"partial"`` or ``"single"``.
    """
    import jax
    import jax.numpy as jnp

    from msar_jax import config as config_lib
    from msar_jax.model.layers import SequenceContext
    from msar_jax.model.transformer import layer_kinds, pure
    from msar_jax.residuals.base import position
    from msar_jax.residuals.mhc import mhc_coefficients
    from pallas_kernels.depth_attention import reference as depth_ref

    cfg = model.cfg
    mech = model.residual
    name = cfg.residual.name
    L = config_lib.n_sublayers(cfg)
    S = mech.block_size
    tokens = jnp.asarray(tokens)
    b, t = tokens.shape
    ctx = SequenceContext(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), segment_ids=None)
    e = jnp.take(model.embedding[...], tokens, axis=0).astype(jnp.float32)
    g, per_sub = mech.split_params(pure(mech))
    attn_p = pure(model.attn)
    mlp_p = {"dense": pure(model.dense) if model.dense is not None else None,
             "moe": pure(model.moe) if model.moe is not None else None}
    kinds = layer_kinds(cfg)
    offsets = {k: kinds.index(k) for k in set(kinds)}
    state = mech.start(g, e, ctx)
    hs, vs, coeffs, scores = [], [], [], []
    for l in range(1, L + 1):
        pos = position(l, S)
        p = jax.tree.map(lambda a: a[l - 1], per_sub)
        if name == "mhc":
            coeffs.append(mhc_coefficients(p, state.carry, cfg.residual.sinkhorn_iters))
        elif name in ("attnres", "msar"):
            n_done = l - 1 if S == 1 else (l - 1) // S  # completed blocks b_1..b_n before target l
            srcs = [state.sources[j] for j in range(n_done + 1)]
            banks_all = mech.source_banks(g)
            banks = None if banks_all is None else [banks_all[j] for j in range(n_done + 1)]
            if not bool(pos.first_in_block):
                srcs.append(state.carry["partial"])
                if banks is not None:
                    banks.append(mech.partial_bank(g, pos))
            x = jnp.stack(srcs)
            bk = None if banks is None else jnp.stack(banks)
            expanded = depth_ref.expand(x, bk, mech.stream_kernels)  # [n, m, B, T, d]
            s = depth_ref.scores(expanded, p["queries"], 1, cfg.residual.eps)[..., 0]  # [n, m, B, T]
            scores.append(np.asarray(jnp.mean(jnp.exp(s), axis=(2, 3))))  # [n, m]
        h, aux = mech.read(g, p, state, None, pos, ctx)
        layer, sub = (l - 1) // 2, (l - 1) % 2
        if sub == 0:
            v, _ = model._sublayer("attn", jax.tree.map(lambda a: a[layer], attn_p), h, ctx)
        else:
            k = kinds[layer]
            v, _ = model._sublayer(k, jax.tree.map(lambda a: a[layer - offsets[k]], mlp_p[k]), h, ctx)
        state = mech.write(g, p, state, v, aux, pos, ctx)
        if S == 1 or l % S == 0 or l == L:
            state = mech.end_block(g, state, pos)
        hs.append(np.asarray(h, np.float32))
        vs.append(np.asarray(v, np.float32))

    out = {"mechanism": name, "L": L, "S": S, "h": np.stack(hs), "v": np.stack([np.asarray(e), *vs[:-1]]),
           "cells": []}
    if name == "vanilla":
        mat = np.full((1, L, L), np.nan)
        for l in range(1, L + 1):
            mat[0, l - 1, :l] = 1.0
            out["cells"] += [(0, l - 1, i, i, 1.0, "single") for i in range(l)]
    elif name == "mhc":
        m = int(cfg.residual.streams)
        pre = [np.asarray(c[0], np.float64) for c in coeffs]  # [B, T, m]
        post = [np.asarray(c[1], np.float64) for c in coeffs]
        cmat = [np.asarray(c[2], np.float64) for c in coeffs]  # C [B, T, m, m]; H_res = C^T
        per_token = np.full((L, L, b, t), np.nan)
        for l in range(1, L + 1):
            for i in range(l):
                w = np.ones((b, t, m)) if i == 0 else post[i - 1]  # beta_i: stream write vector
                for k in range(i + 1, l):  # transitions H_res_{i+1} .. H_res_{l-1}, increasing depth
                    w = np.einsum("btji,btj->bti", cmat[k - 1], w)  # (H_res w)_i = sum_j C[j, i] w_j
                per_token[l - 1, i] = np.einsum("btm,btm->bt", pre[l - 1], w)  # alpha_l^T (...)
        out["per_token"] = per_token
        mat = np.where(np.isfinite(per_token), per_token, 0.0).mean(axis=(2, 3))[None]
        mat[np.isnan(per_token[..., 0, 0])[None]] = np.nan
        for l in range(1, L + 1):
            out["cells"] += [(0, l - 1, i, i, float(mat[0, l - 1, i]), "single") for i in range(l)]
        out["m"] = m
    else:
        m = scores[0].shape[1]
        mat = np.full((m, L, L), np.nan)
        blocks = [[i] for i in range(1, L + 1)] if S == 1 else _blocks(L, S)
        for l in range(1, L + 1):
            n_done = l - 1 if S == 1 else (l - 1) // S
            groups = [([0], "embedding")] + [(blocks[j], "block" if len(blocks[j]) > 1 else "single")
                                              for j in range(n_done)]
            start = 1 if S == 1 else n_done * S + 1
            if start <= l - 1:
                groups.append((list(range(start, l)), "partial"))
            assert len(groups) == scores[l - 1].shape[0], (l, len(groups), scores[l - 1].shape)
            for r in range(m):
                for (cols, kind), val in zip(groups, scores[l - 1][:, r]):
                    mat[r, l - 1, cols] = val
                    out["cells"].append((r, l - 1, cols[0], cols[-1], float(val), kind))
    out["matrix"] = mat
    out["m"] = mat.shape[0] if name != "mhc" else out["m"]
    return out


def _fig5_model(mechanism: str, train_steps: int, seed: int, workdir=None):
    """The L = 4, S = 2 model (trained ``train_steps`` steps, or perturbed init) and a val batch."""
    from msar_jax import data
    from msar_jax.train.step import init_model
    from msar_jax.train.train import prepare_data

    config = fig5_config(mechanism, overrides={"train.seed": seed})
    data_dir, _ = prepare_data(config)
    batch = next(iter(data.make_eval_batches(data_dir, 4, config.seq_len, max_batches=1)))[:, :-1]
    if train_steps > 0:
        import tempfile

        from msar_jax.train import train
        from msar_jax.train.checkpoint import restore_params
        from msar_jax.train.optim import make_optimizer
        from msar_jax.train.step import abstract_model, abstract_state

        with config.unlocked():
            config.train.steps = train_steps
            config.train.eval_every = 0
            config.checkpoint.every = 0
            config.optim.warmup_steps = min(config.optim.warmup_steps, train_steps)
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            train(config, tmp, handle_signals=False)
            tx, _ = make_optimizer(config.optim, config.train.steps)
            params, _ = restore_params(tmp, abstract_state(config.model, tx))
        model_def, _ = abstract_model(config.model)
        return model_def.merge(params), batch, f"trained {train_steps} steps"
    model_def, params = init_model(config.model, seed)
    if mechanism in ("attnres", "msar"):
        params = _perturb_mechanism(params, seed)
    return model_def.merge(params), batch, "init" + (", queries/convs ~ N(0, 1/d) (illustrative)"
                                                      if mechanism in ("attnres", "msar") else "")


def plot_mixing_matrices(out, train_steps: int = 0, seed: int = 0, results: dict | None = None) -> str:
    """Figure 5 PNG: Vanilla, mHC, Block AttnRes (top row) and Block MSAR per stream (bottom)."""
    import matplotlib.patches as mpatches

    plt = _pyplot()
    if results is None:
        results = {}
        for mech in FIG5_MECHANISMS:
            model, batch, how = _fig5_model(mech, train_steps, seed)
            results[mech] = {**mixing_matrices(model, batch), "how": how}
    m_msar = results["msar"]["matrix"].shape[0]
    ncols = max(3, m_msar)
    fig, axes = plt.subplots(2, ncols, figsize=(3.1 * ncols, 7.4), squeeze=False)
    panels = [("vanilla", 0, axes[0][0], "(a) Vanilla"), ("mhc", 0, axes[0][1], "(b) mHC (Eq. 21, token mean)"),
              ("attnres", 0, axes[0][2], "(c) Block AttnRes  φ")]
    panels += [("msar", r, axes[1][r], f"(d) Block MSAR  φ, stream {r}") for r in range(m_msar)]
    for j in range(3, ncols):
        axes[0][j].axis("off")
    for mech, r, ax, title in panels:
        res = results[mech]
        L = res["L"]
        mat = res["matrix"][r]
        vals = mat[np.isfinite(mat)]
        vmin, vmax = (float(vals.min()), float(vals.max())) if vals.size else (0, 1)
        if vmax - vmin < 1e-9:
            vmin, vmax = vmin - 0.5, vmax + 0.5
        cmap = plt.get_cmap("Blues")
        ax.set_xlim(-0.5, L - 0.5)
        ax.set_ylim(L - 0.5, -0.5)
        for (panel, row, c0, c1, val, kind) in res["cells"]:
            if panel != r:
                continue
            color = cmap(0.15 + 0.7 * (val - vmin) / (vmax - vmin))
            rect = mpatches.Rectangle((c0 - 0.45, row - 0.45), c1 - c0 + 0.9, 0.9, facecolor=color,
                                      edgecolor="k", lw=1.0, ls="--" if kind == "partial" else "-")
            ax.add_patch(rect)
            ax.text((c0 + c1) / 2, row, f"{val:.2f}", ha="center", va="center", fontsize=8)
        for row in range(L):  # unavailable sources (i >= l)
            for c in range(row + 1, L):
                ax.add_patch(mpatches.Rectangle((c - 0.45, row - 0.45), 0.9, 0.9, facecolor="none",
                                                edgecolor="0.8", hatch="//", lw=0.5))
        ax.set_xticks(range(L))
        ax.set_xticklabels([f"v{i}" for i in range(L)])
        ax.set_yticks(range(L))
        ax.set_yticklabels([f"h{l + 1}" for l in range(L)])
        ax.set_title(title, fontsize=9)
        ax.set_aspect("equal")
    hows = {res["how"] for res in results.values() if "how" in res}
    fig.suptitle(f"Depth mixing as structured matrices (L = {results['msar']['L']}, S = {results['msar']['S']}); "
                 f"params: {'; '.join(sorted(hows))}. Grouped cells: one completed block source; dashed: "
                 "current partial; hatched: unavailable.", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return str(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m msar_jax.experiments.plots", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--figure5", default=None, help="write the Figure 5 mixing matrices to this PNG")
    ap.add_argument("--train_steps", type=int, default=0, help="Figure 5: train each L=4 model this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ablation_dir", default=None, help="an ablation workdir: rewrite its curves / Figure 4 PNGs")
    args = ap.parse_args(argv)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    if args.figure5:
        print("wrote", plot_mixing_matrices(args.figure5, args.train_steps, args.seed))
    if args.ablation_dir:
        import json

        from msar_jax.experiments.ablation import ROWS

        d = Path(args.ablation_dir)
        res = json.loads((d / "results.json").read_text()) if (d / "results.json").is_file() else None
        seeds = res["seeds"] if res else sorted({int(p.name[4:]) for p in d.glob("*/seed*")})
        rows = list(res["rows"]) if res else [r for r in ROWS if (d / r).is_dir()]
        print("wrote", plot_training_curves(d, rows, seeds, d / "curves.png",
                                            labels={k: v[1] for k, v in ROWS.items()}))
        for row in rows:
            png = plot_run_depth_weights(d / row, seeds, d / f"depth_weights_{row}.png")
            if png:
                print("wrote", png)
    if not (args.figure5 or args.ablation_dir):
        ap.error("nothing to do: give --figure5=PNG and/or --ablation_dir=W")


if __name__ == "__main__":
    main()
