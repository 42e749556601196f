"""Learned depth-attention weights, averaged over tokens (the data of the paper's Figure 4).

``depth_weights(model_def, params, batch)`` gives a float32 ``[L, N+2, m]`` array (read, source,
stream), or ``None`` for mechanisms without depth attention; ``from_checkpoint``, ``save`` and
``load`` read and write it. Layout and files: docs/training.md section 8.

    python -m msar_jax.train.introspection --workdir=runs/msar_tiny [--out=PREFIX] [--png=PATH]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from msar_jax import config as config_lib


_FORWARD: dict = {}  # one compiled forward, reused for the same model (graphdef)


def depth_weights(model_def, params, batch) -> np.ndarray | None:
    """Token-averaged depth weights ``[L, N+2, m]`` of the model on ``batch`` ([B, T+1] or [B, T])."""
    tokens = jnp.asarray(batch)
    if model_def.merge(params).residual.weights_shape() is None:
        return None  # no depth attention (vanilla, mHC)
    key = model_def.graphdef
    if key not in _FORWARD:
        _FORWARD.clear()

        def forward(params, tokens):
            _, aux = model_def.merge(params)(tokens, collect_weights=True)
            return aux.get("depth_weights")

        _FORWARD[key] = jax.jit(forward)
    out = _FORWARD[key](params, tokens[:, :-1] if tokens.shape[1] > 1 else tokens)
    return None if out is None else np.asarray(jax.device_get(out), np.float32)


def default_batch(data_dir, config):
    """The batch a run's introspection uses: the first val windows (at most 8)."""
    from msar_jax import data

    bs = min(config.train.eval_batch_size or config.train.batch_size, 8)
    return next(iter(data.make_eval_batches(data_dir, bs, config.seq_len, max_batches=1)))


def source_labels(model_cfg, n_sources: int) -> list[str]:
    s = model_cfg.residual.block_size
    n = n_sources - 2
    blocks = [f"v{j}" if s == 1 else f"b{j}" for j in range(1, n + 1)]
    return ["emb", *blocks, "partial"]


def read_labels(model_cfg) -> list[str]:
    """``"L3 attn"``: the read before layer 3's attention (1-based layers)."""
    return [f"L{l // 2 + 1} {'attn' if l % 2 == 0 else 'mlp'}" for l in range(config_lib.n_sublayers(model_cfg))]


def save(weights: np.ndarray, prefix: str | os.PathLike, config, step: int | None = None) -> dict:
    model_cfg = config.model if "model" in config else config
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "mechanism": model_cfg.residual.name,
        "block_size": model_cfg.residual.block_size,
        "streams": weights.shape[2],
        "step": step,
        "shape": "[sublayer read, source, stream]",
        "reads": read_labels(model_cfg),
        "sources": source_labels(model_cfg, weights.shape[1]),
        "weights": np.round(weights.astype(np.float64), 6).tolist(),
    }
    np.savez(prefix.with_suffix(".npz"), weights=weights, reads=np.array(info["reads"]),
             sources=np.array(info["sources"]), meta=json.dumps({k: v for k, v in info.items() if k != "weights"}))
    prefix.with_suffix(".json").write_text(json.dumps(info), encoding="utf-8")
    return info


def load(prefix: str | os.PathLike) -> tuple[np.ndarray, dict]:
    with np.load(Path(prefix).with_suffix(".npz")) as f:
        return f["weights"], json.loads(str(f["meta"]))


def load_run_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
    """The config a run wrote to ``<workdir>/config.json``."""
    raw = json.loads((Path(workdir) / "config.json").read_text(encoding="utf-8"))
    raw["model"]["residual"]["kernel_sizes"] = tuple(raw["model"]["residual"]["kernel_sizes"])
    return ml_collections.ConfigDict(raw)


def from_checkpoint(workdir: str | os.PathLike, batch=None, step: int | None = None):
    """``(weights, config, step)`` from a run's checkpoint, on ``batch`` (default: the first val batch)."""
    from msar_jax.train.checkpoint import restore_params
    from msar_jax.train.optim import make_optimizer
    from msar_jax.train.step import abstract_model, abstract_state

    config = load_run_config(workdir)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    params, step = restore_params(workdir, abstract_state(config.model, tx), step)
    model_def, _ = abstract_model(config.model)
    if batch is None:
        from msar_jax.train.train import prepare_data

        data_dir, _ = prepare_data(config)
        batch = default_batch(data_dir, config)
    return depth_weights(model_def, params, batch), config, step


def _cli(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--step", type=int, default=None)
    ap.add_argument("--out", default=None, help="output prefix (default <workdir>/depth_weights)")
    ap.add_argument("--png", default=None, help="also plot the Figure-4 heatmaps to this PNG")
    args = ap.parse_args(argv)
    weights, config, step = from_checkpoint(args.workdir, step=args.step)
    if weights is None:
        print(f"{config.model.residual.name} has no depth attention")
        return
    prefix = args.out or str(Path(args.workdir) / "depth_weights")
    save(weights, prefix, config, step)
    print(f"wrote {prefix}.npz and {prefix}.json (step {step}, shape {weights.shape})")
    if args.png:
        from msar_jax.train import plots

        print(f"wrote {plots.plot_depth_weights(weights, args.png, config, step)}")


if __name__ == "__main__":
    _cli()
