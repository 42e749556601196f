"""``make demo``: build the default tiny Block MSAR, run it on real text, print the accounting.

Prepares the bundled public-domain corpus (byte level) if needed, takes a validation
batch of real text, runs the forward pass of the default model, prints its loss beside
the unigram-entropy baseline of the same data and the depth-attention weights of the
first reads, then the exact accounting table of the config.

    python -m msar_jax.demo [--config=configs/msar.py:size=tiny]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from msar_jax import accounting, data
from msar_jax.configs import load_config
from msar_jax.model.transformer import Transformer, cross_entropy


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/msar.py:size=tiny")
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args(argv)

    config = load_config(args.config)
    meta = data.ensure_prepared()
    data_dir = data.default_cache_dir()
    print(f"data: {data_dir} ({meta['tokens']['train']:,} train / {meta['tokens']['val']:,} val byte tokens)")
    seq_len = config.seq_len
    batch = next(iter(data.make_eval_batches(data_dir, args.batch, seq_len, max_batches=1)))
    print(f"text: {bytes(np.asarray(batch[0, :72], np.uint8)).decode('utf-8', 'replace')!r} ...")

    t0 = time.perf_counter()
    model = Transformer(config.model, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def forward(params, window):
        logits, aux = nnx.merge(graphdef, params)(window[:, :-1], collect_weights=True)
        return cross_entropy(logits, window[:, 1:]), aux

    loss, aux = forward(params, jnp.asarray(batch))
    jax.block_until_ready(loss)
    res = config.model.residual
    print(f"model: {res.name} (S={res.block_size}, m={res.streams}), {config.model.n_layers} layers, "
          f"d={config.model.d_model}; forward on [{args.batch}, {seq_len}] in {time.perf_counter() - t0:.1f}s "
          f"(incl. compile)")
    entropy = meta["unigram_entropy"]["val_nats_per_token"]
    print(f"loss at initialisation: {float(loss):.4f} nats/token  (uniform over 256 bytes: {np.log(256):.4f}; "
          f"unigram entropy of the val data: {entropy:.4f})")
    if "depth_weights" in aux:
        w = np.asarray(aux["depth_weights"])  # [L, sources, streams]
        print("depth-attention weights of stream 0 at initialisation (rows: sublayers 1..4, cols: sources):")
        for l in range(min(4, w.shape[0])):
            print(f"  l={l + 1}: " + " ".join(f"{x:.2f}" for x in w[l, :, 0]))
    print()
    print(accounting.format_table(accounting.account(config)))


if __name__ == "__main__":
    main()
