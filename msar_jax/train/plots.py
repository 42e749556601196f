"""PNG plots of a run: the loss curve and the depth-attention heatmaps (Figure 4 style).

``plot_loss(workdir_or_jsonl, out, baseline=None)``: train loss per step (and a smoothed
curve), validation loss at its evaluations, and an optional horizontal baseline (e.g. the
unigram entropy of the val data).

``plot_depth_weights(weights[L, N+2, m], out, config)``: one heatmap per (read kind, stream):
rows = transformer layers, columns = sources (embedding, block summaries, partial); the top row of
panels is the pre-attention reads, the bottom row the pre-MLP reads, one column per stream.
"""

from __future__ import annotations

import os

import numpy as np

from msar_jax.train.introspection import source_labels
from msar_jax.train.metrics import read_jsonl


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    return plt


def plot_loss(source: str | os.PathLike, out: str | os.PathLike, baseline: float | None = None,
              baseline_label: str = "unigram entropy (val)", title: str | None = None) -> str:
    plt = _pyplot()
    train = [r for r in read_jsonl(source, "train") if isinstance(r.get("loss"), (int, float))]
    evals = [r for r in read_jsonl(source, "eval") if isinstance(r.get("val_loss"), (int, float))]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        steps = np.array([r["step"] for r in train])
        loss = np.array([r["loss"] for r in train])
        ax.plot(steps, loss, color="tab:blue", alpha=0.3, lw=0.8, label="train loss")
        k = max(1, len(loss) // 25)
        if k > 1:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            ax.plot(steps[k // 2: k // 2 + len(smooth)], smooth, color="tab:blue", lw=1.5,
                    label=f"train loss ({k}-step centred mean)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color="tab:orange",
                label="validation loss")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"{baseline_label} {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = str(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_depth_weights(weights: np.ndarray, out: str | os.PathLike, config, step: int | None = None) -> str:
    plt = _pyplot()
    model_cfg = config.model if "model" in config else config
    weights = np.asarray(weights)
    n_reads, n_src, m = weights.shape
    labels = source_labels(model_cfg, n_src)
    n_layers = n_reads // 2
    fig, axes = plt.subplots(2, m, figsize=(1.2 + 0.35 * n_src * m + 0.6 * m, 1.6 + 0.45 * n_layers * 2),
                             squeeze=False, constrained_layout=True)
    vmax = float(weights.max()) if weights.size else 1.0
    im = None
    for row, (offset, kind) in enumerate(((0, "pre-attn"), (1, "pre-MLP"))):
        for r in range(m):
            ax = axes[row][r]
            w = weights[offset::2, :, r]  # [layers, sources]
            im = ax.imshow(w, cmap="viridis", vmin=0.0, vmax=vmax, aspect="auto")
            ax.set_title(f"{kind}, stream {r}", fontsize=9)
            ax.set_xticks(range(n_src))
            ax.set_xticklabels(labels, rotation=90, fontsize=7)
            ax.set_yticks(range(n_layers))
            ax.set_yticklabels([f"L{i + 1}" for i in range(n_layers)], fontsize=7)
            if r == 0:
                ax.set_ylabel("layer")
    res = model_cfg.residual
    fig.suptitle(f"{res.name} depth-attention weights (token-averaged, S={res.block_size}, m={m}"
                 + (f", step {step}" if step is not None else "") + ")", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=0.8, label="weight")
    out = str(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
