"""``make demo``: train the default tiny Block MSAR on the bundled corpus on CPU, then report.

Trains ``configs/msar.py:size=tiny`` with the full training stack in a fresh ``runs/demo/<time>/``,
prints the validation loss beside the unigram-entropy baseline of the same data, writes the loss
curve and the per-stream depth-attention heatmaps (PNGs), prints the config's accounting table
and ends with a short continuation of ``--prompt`` sampled from the trained checkpoint (the path of
``python -m msar_jax.sample``: prefill, then cached decoding steps). About 3 minutes on 2 idle
cores; what it does and measured figures: docs/training.md section 1, "The demo".

    python -m msar_jax.demo [--config=configs/msar.py:size=tiny] [--steps=240] [--workdir=DIR] [--prompt=TEXT]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from msar_jax import accounting, data
from msar_jax import sample
from msar_jax.config import REPO_ROOT, ConfigError, load_config
from msar_jax.cli import positive_int, run_cli
from msar_jax.inference import loading, sampling
from msar_jax.train import plots, train
from msar_jax.train.introspection import load as load_weights


SAMPLE_PROMPT = "Call me Ishmael. "
SAMPLE_TOKENS = 80  # about a line of text with the byte tokenizer


def sample_from(workdir, prompt: str, max_new_tokens: int = SAMPLE_TOKENS, temperature: float = 0.8,
                seed: int = 0) -> str:
    """The trained checkpoint's continuation of ``prompt`` (what ``python -m msar_jax.sample`` prints).

    Drawn from the 40 most likely tokens: a briefly trained byte model still gives the rare bytes
    (control characters) some probability, and the cut keeps them out of the printed text."""
    run = loading.load_run(workdir)
    ids = run.tokenizer.encode(prompt)
    room = int(run.config.model.max_seq_len) - len(ids)
    out = sampling.generate(run.model(), [ids], max_new_tokens=min(max_new_tokens, room), temperature=temperature,
                            top_k=40, seed=seed, stop_tokens=sample.stop_token_ids([], run.tokenizer))
    return run.tokenizer.decode(out.tokens[0])


def main(argv=None):
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/msar.py:size=tiny")
    ap.add_argument("--steps", type=positive_int, default=240, help="optimizer steps (the schedule spans them)")
    ap.add_argument("--workdir", default=None, help="default: runs/demo/<time> in the repository")
    ap.add_argument("--prompt", default=SAMPLE_PROMPT, help="the text the trained model continues at the end")
    args = ap.parse_args(argv)

    if not args.prompt:
        raise ConfigError("--prompt", args.prompt, "must not be empty (or leave the flag out)", subject="flag")
    every = max(1, args.steps // 3)
    config = load_config(args.config, {"train.steps": args.steps, "train.eval_every": every,
                                       "checkpoint.every": every,
                                       "optim.warmup_steps": min(50, max(1, args.steps // 6))})
    meta = data.ensure_prepared()
    print(f"data: {data.default_cache_dir()} ({meta['tokens']['train']:,} train / "
          f"{meta['tokens']['val']:,} val byte tokens)")
    res, m = config.model.residual, config.model
    print(f"model: {res.name} (S={res.block_size}, m={res.streams}, kernels {tuple(res.kernel_sizes)}), "
          f"{m.n_layers} layers, d={m.d_model}; {config.train.steps} steps of {config.train.batch_size} x "
          f"{config.seq_len} tokens, peak lr {config.optim.lr:g} ({config.optim.schedule})")
    context = config.model.max_seq_len
    if config.data.tokenizer == "bytes" and len(args.prompt.encode("utf-8")) >= context:
        raise ConfigError("--prompt", args.prompt, f"must be at most {context - 1} bytes (model.max_seq_len = "
                          f"{context}, one position left for the continuation)", subject="flag")
    workdir = Path(args.workdir) if args.workdir else REPO_ROOT / "runs" / "demo" / time.strftime("%Y%m%d-%H%M%S")

    result = train(config, workdir)

    entropy = result["unigram_val_nats"]
    xent = meta["unigram_entropy"]["train_to_val_xent_nats_per_token"]
    val = result["val_loss"]
    print()
    print(f"validation loss after {result['step']} steps: {val:.4f} nats/token ({result['val_bpb']:.3f} bits/byte)")
    print(f"unigram-entropy baseline of the val data:   {entropy:.4f} nats/token "
          f"(train-fit unigram cross-entropy {xent:.4f})")
    verdict = "beats" if val < entropy - 0.1 else "does NOT clearly beat"
    print(f"-> the model {verdict} the unigram baseline by {entropy - val:.3f} nats/token "
          f"({100 * (entropy - val) / entropy:.1f}%)")
    print(f"train throughput: {result['tokens_per_s']:,.0f} tokens/s; training wall time {result['wall_time_s']:.0f}s")

    loss_png = plots.plot_loss(workdir, workdir / "loss.png", baseline=entropy,
                               title=f"{res.name} tiny on the bundled corpus")
    print(f"loss curve: {loss_png}")
    if result["depth_weights"]:
        weights, info = load_weights(result["depth_weights"])
        depth_png = plots.plot_depth_weights(weights, workdir / "depth_weights.png", config, info.get("step"))
        print(f"depth-attention weights: {depth_png} (data: {result['depth_weights']}.npz/.json)")
    print(f"logs and checkpoints: {workdir}")
    print()
    print(accounting.format_table(accounting.account(config)))
    print()
    t_sample = time.perf_counter()
    text = sample_from(workdir, args.prompt)
    print(f"sample from checkpoint {result['step']} (temperature 0.8, top_k 40, seed 0; "
          f"{time.perf_counter() - t_sample:.1f}s, compiles included):")
    print(f"{args.prompt}{text}")
    print(f"(more: python -m msar_jax.sample --workdir={workdir} --prompt=\"...\"; "
          f"python -m msar_jax.evaluate --workdir={workdir})")
    print(f"\ndemo wall time: {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
