"""Prefill and decoding speed, cache bytes and device memory per config (docs/design.md §10).

For each config and batch size, on the local device: random parameters, a batch of ``--prompt``-
token prompts, then

- prefill: ``decode.prefill`` of the prompts against a plain jitted forward (``model(tokens)``) of
  the same tokens, median of ``--repeats`` runs after a warm-up, each ended by
  ``block_until_ready``;
- decoding: ``--steps`` one-token steps after the prefill, the cache donated, in two forms:
  ``decode.jit_decode_step`` (it reads ``cache.lengths`` on the host before every step to refuse
  a full cache, so each step waits for the previous one) and the same jitted ``decode_step``
  without that check (steps queue back to back); ms per step and tokens/s = batch / step time;
- the cache: ``decode.cache_bytes`` (the formula: KV and, for MSAR, the conv windows of Eq. 10)
  against the bytes of the prefilled cache pytree, per sequence;
- peak device memory (``memory_stats()["peak_bytes_in_use"]``, where the backend reports it): the
  process's running peak, so a config's figure also covers the configs run before it.

Usage (GPU; the default grid is Vanilla, mHC, AttnRes and MSAR at ``size=base``, batch 1 and 64,
prompt 2048, 128 steps)::

    python benchmarks/decode_speed.py --json decode.json

CPU smoke (the test suite runs this)::

    python benchmarks/decode_speed.py --configs configs/msar.py:smoke=1 --batch 2 --prompt 16 --steps 4

The model's context (``model.max_seq_len``, 1024 at ``base``) is raised to ``prompt + steps`` when
shorter: attention uses RoPE, so no parameter depends on it. ``--prefill_batch P`` prefills (and
times) ``P`` rows at a time and concatenates the caches for decoding; a prefill or forward that runs
out of device memory is retried with fewer rows (the next divisor of the batch). The table's
"prefill rows" column says how many rows the prefill and forward times are for.
Parameters are cast to the activations' dtype (``model.dtype``, bfloat16 at ``base``);
``--param_dtype float32`` keeps them as training stores them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msar_jax.cli import run_cli  # noqa: E402
from msar_jax.config import ConfigError, load_config, parse_overrides  # noqa: E402
from msar_jax.inference import decode  # noqa: E402
from msar_jax.model.transformer import Transformer  # noqa: E402

DEFAULT_CONFIGS = tuple(f"configs/{name}.py:size=base" for name in ("vanilla", "mhc", "attnres", "msar"))
GIB = 2 ** 30


def build_model(model_cfg, param_dtype: str, seed: int = 0) -> Transformer:
    """The model of ``model_cfg`` with random parameters made on the device in one jitted call
    (never whole on the host), floating ones cast to ``param_dtype``."""
    dtype = jnp.dtype(param_dtype)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(model_cfg, nnx.Rngs(seed))))

    def make():
        state = nnx.split(Transformer(model_cfg, nnx.Rngs(seed)))[1]
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

    return nnx.merge(graphdef, jax.jit(make)())


def tree_bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def copy_tree(tree):
    """A fresh copy (a donated cache is consumed by the step it is given to)."""
    return jax.tree.map(jnp.copy, tree)


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (which blocks on its own result)."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def pure_decode_step(model):
    """``decode.decode_step`` jitted with the cache donated, as ``decode.jit_decode_step``
    compiles it, minus the host-side check of ``cache.lengths`` before each step (the caller
    guarantees room: the cache has ``prompt + steps`` positions)."""
    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda st, cache, tokens: decode.decode_step(nnx.merge(graphdef, st), cache, tokens),
                       donate_argnums=(1,))
    return lambda cache, tokens: compiled(state, cache, tokens)


def prefill_in_chunks(model, tokens, lengths, max_len, rows: int):
    """``decode.prefill`` of ``rows`` prompts at a time, the caches joined along the batch axis."""
    caches, logits = [], []
    for lo in range(0, tokens.shape[0], rows):
        out, cache = decode.prefill(model, tokens[lo:lo + rows], lengths[lo:lo + rows], max_len=max_len)
        logits.append(out)
        caches.append(cache)
    if len(caches) == 1:
        return logits[0], caches[0]
    def join(field, axis):
        parts = [getattr(c, field) for c in caches]
        return None if parts[0] is None else jnp.concatenate(parts, axis=axis)

    joined = decode.Cache(keys=join("keys", 1), values=join("values", 1), history=join("history", 1),
                          lengths=join("lengths", 0), segment_start=join("segment_start", 0))
    return jnp.concatenate(logits), joined


def measure(spec: str, batch: int, prompt: int, steps: int, repeats: int, prefill_batch: int,
            param_dtype: str, overrides: dict) -> dict:
    config = load_config(spec, overrides)
    max_len = prompt + steps
    raised = {}
    if config.model.max_seq_len < max_len:
        raised = {"model.max_seq_len": max_len}
        config = load_config(spec, {**overrides, **raised})
        print(f"  {spec}: model.max_seq_len raised to {max_len} (prompt + steps)", flush=True)
    cfg = config.model
    dtype = cfg.dtype if param_dtype == "activations" else param_dtype
    rows = min(prefill_batch or batch, batch)
    if batch % rows:
        raise ConfigError("--prefill_batch", prefill_batch, f"must divide the batch size {batch}", subject="flag")
    model = build_model(cfg, dtype)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lengths = np.full((batch,), prompt, np.int32)

    # (a) prefill of one chunk of rows against the plain forward of the same tokens.
    chunk, chunk_lengths = tokens[:rows], lengths[:rows]
    forward = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x)[0])
    run_forward = lambda: forward(state, chunk).block_until_ready()  # noqa: E731
    run_prefill = lambda: jax.block_until_ready(decode.prefill(model, chunk, chunk_lengths, max_len=max_len))  # noqa: E731
    while True:  # compile and warm up; a prefill or forward that does not fit goes in fewer rows
        try:
            run_forward(), run_prefill()
            break
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e) or rows == 1:
                raise
            smaller = max(r for r in range(1, rows) if batch % r == 0)
            print(f"  {spec} B={batch}: prefill of {rows} rows is out of device memory; {smaller} rows at a time",
                  flush=True)
            rows = smaller
            chunk, chunk_lengths = tokens[:rows], lengths[:rows]
    forward_s = statistics.median(timed(run_forward, repeats))
    prefill_s = statistics.median(timed(run_prefill, repeats))

    # (c) the formula against the prefilled batch's cache.
    _, cache = prefill_in_chunks(model, tokens, lengths, max_len, rows)
    jax.block_until_ready(cache)
    formula = decode.cache_bytes(cfg, batch, max_len)
    measured = tree_bytes(cache)
    conv_measured = 0 if cache.history is None else cache.history.nbytes

    # (b) decoding: steps tokens after the prefill, each form from a fresh copy of the cache.
    step_tokens = [jnp.asarray(rng.integers(0, cfg.vocab_size, (batch,)), jnp.int32) for _ in range(steps)]

    def decode_run(step):
        def run():
            c = copy_tree(cache)
            jax.block_until_ready(c)
            start = time.perf_counter()
            for t in step_tokens:
                logits, c = step(c, t)
            jax.block_until_ready((logits, c))
            return time.perf_counter() - start
        return run

    results = {}
    for name, step in (("checked", decode.jit_decode_step(model)), ("pure", pure_decode_step(model))):
        warm = copy_tree(cache)
        jax.block_until_ready(step(warm, step_tokens[0]))  # compile
        del warm
        per_step = statistics.median(decode_run(step)() for _ in range(repeats)) / steps
        results[name] = {"ms_per_step": 1e3 * per_step, "tokens_per_s": batch / per_step}

    stats = jax.devices()[0].memory_stats() or {}  # None on the CPU
    return {
        "config": spec, "mechanism": cfg.residual.name, "overrides": {**overrides, **raised},
        "batch": batch, "prompt": prompt, "steps": steps, "repeats": repeats, "max_len": max_len,
        "dtype": cfg.dtype, "param_dtype": str(jnp.dtype(dtype)),
        "params": int(sum(x.size for x in jax.tree.leaves(state))),
        "prefill_rows": rows,
        "prefill_ms": 1e3 * prefill_s, "forward_ms": 1e3 * forward_s, "prefill_over_forward": prefill_s / forward_s,
        "decode_checked": results["checked"], "decode_pure": results["pure"],
        "cache_formula": formula,
        "cache_measured": {"total": measured, "per_sequence": measured // batch, "conv_windows": conv_measured},
        "cache_matches_formula": measured == formula["total"] and conv_measured == formula["conv_windows"],
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_in_use": stats.get("bytes_in_use"),
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'config':<34} {'B':>3} {'prefill rows':>12} {'prefill ms':>10} {'forward ms':>10} {'ratio':>6} "
            f"{'ms/step':>8} {'tok/s':>9} {'ms/step*':>8} {'tok/s*':>9} {'cache/seq MiB':>13} {'conv KiB':>9} "
            f"{'formula':>7} {'peak GiB':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        peak = "-" if r["peak_bytes_in_use"] is None else f"{r['peak_bytes_in_use'] / GIB:.1f}"
        lines.append(
            f"{r['config']:<34} {r['batch']:>3} {r['prefill_rows']:>12} {r['prefill_ms']:>10.2f} "
            f"{r['forward_ms']:>10.2f} {r['prefill_over_forward']:>6.2f} "
            f"{r['decode_checked']['ms_per_step']:>8.3f} {r['decode_checked']['tokens_per_s']:>9.1f} "
            f"{r['decode_pure']['ms_per_step']:>8.3f} {r['decode_pure']['tokens_per_s']:>9.1f} "
            f"{r['cache_measured']['per_sequence'] / 2 ** 20:>13.3f} "
            f"{r['cache_formula']['conv_windows'] / r['batch'] / 1024:>9.2f} "
            f"{'equal' if r['cache_matches_formula'] else 'DIFFER':>7} {peak:>8}")
    lines.append("ms/step, tok/s: decode.jit_decode_step (reads cache.lengths on the host before each step); "
                 "*: the same jitted step without that check. Prefill and forward: one batch of 'prefill rows' "
                 "prompts. Peak: the process's running peak.")
    return "\n".join(lines)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    ap.add_argument("--batch", nargs="+", type=positive, default=[1, 64])
    ap.add_argument("--prompt", type=positive, default=2048, help="prompt tokens per sequence")
    ap.add_argument("--steps", type=positive, default=128, help="decoding steps timed after the prefill")
    ap.add_argument("--repeats", type=positive, default=3, help="timed runs after the warm-up (median)")
    ap.add_argument("--prefill_batch", type=int, default=0,
                    help="prefill this many rows at a time (must divide each batch); 0 = the whole batch")
    ap.add_argument("--param_dtype", default="activations", choices=("activations", "float32", "bfloat16"),
                    help="parameters' dtype; 'activations' = model.dtype")
    ap.add_argument("--set", action="append", default=[], help="config override key=value (repeatable)")
    ap.add_argument("--json", default=None, help="write the rows, device and date here")
    args = ap.parse_args(argv)
    overrides = parse_overrides(args.set)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    rows = []
    for spec in args.configs:
        for batch in args.batch:
            row = measure(spec, batch, args.prompt, args.steps, args.repeats, args.prefill_batch,
                          args.param_dtype, overrides)
            rows.append(row)
            print(f"  {spec} B={batch}: prefill {row['prefill_ms']:.2f} ms ({row['prefill_rows']} rows), "
                  f"decode {row['decode_pure']['ms_per_step']:.3f} ms/step", flush=True)
    print(format_table(rows))
    if args.json:
        out = {"device": device.device_kind, "platform": device.platform, "jax": jax.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    run_cli(main)  # a config error: one line, exit status 1
