"""Loss, perplexity and bits per byte of a trained checkpoint on held-out text, and its mean
depth-attention weights per source and stream.

    python -m msar_jax.evaluate --workdir=runs/msar_tiny [--checkpoint=STEP] [--data=PATH]
        [--batches=N] [--json]

``--data``: a prepared data folder (its val split; its tokenizer must be the run's), a folder of
``.txt`` files or one text file (UTF-8; each file one document, normalised and joined as
``msar_jax.data.prepare`` does, encoded with the run's tokenizer). Default: the val split of the
data the run trained on (config.json ``data_used``). The tokens are cut into windows of
``seq_len + 1`` tokens with stride ``seq_len``, so every token after the first is a target once:
full batches of ``train.eval_batch_size`` windows, then the remaining full windows as one batch
and the last partial window alone (exact: no padding enters a loss or a weight). ``--batches=N``
takes only the first N full batches, as training's evaluation does with ``train.eval_batches``
(the loss is then the one the run logged at that step).

Bits per byte: the summed loss in nats / ln 2 / the UTF-8 bytes the target tokens decode to (a
document separator counted as the two bytes of the blank line it stands for, as in prepare's
``bytes_per_token``); byte tokens are one byte each. Depth weights: the model's
``collect_weights`` forward (docs/training.md §8), averaged over every evaluated token and then
over the sublayer reads: ``[sources, streams]``; Vanilla and mHC have none. Usage and output:
docs/training.md §9.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from msar_jax.cli import non_negative_int, positive_int, run_cli
from msar_jax.inference.loading import RunError


def stream_labels(model_cfg, n_streams: int) -> list[str]:
    """Column names of the depth weights: MSAR's ``identity``, ``conv-4``, ...; MHAR's heads."""
    res = model_cfg.residual
    if res.name == "msar" and tuple(res.kernel_sizes):
        return ["identity", *[f"conv-{k}" for k in res.kernel_sizes]][:n_streams]
    if res.name == "mhar":
        return [f"head-{r + 1}" for r in range(n_streams)]
    if n_streams == 1:
        return ["weight"]
    return [f"stream-{r + 1}" for r in range(n_streams)]


# ---------------------------------------------------------------- held-out tokens


def encode_documents(texts: list[str], tokenizer) -> np.ndarray:
    """Documents as one token array, joined as ``msar_jax.data.prepare`` joins a split: bytes with
    a blank line between documents, BPE with its end-of-text token."""
    from msar_jax.data.prepare import DOC_SEPARATOR

    if tokenizer.kind == "bytes":
        return np.frombuffer(DOC_SEPARATOR.join(texts).encode("utf-8"), np.uint8).astype(np.int64)
    ids: list[int] = []
    for i, part in enumerate(tokenizer.encode_batch(texts)):
        if i:
            ids.append(int(tokenizer.eot_id))
        ids.extend(part)
    return np.asarray(ids, np.int64)


def token_bytes(tokenizer, ids) -> int:
    """UTF-8 bytes the tokens ``ids`` decode to; a BPE end-of-text counts as the two-byte
    document separator it replaces. Byte-level BPE pieces cut through a character only at the
    ends of ``ids`` (the data is whole text), where the decoder's U+FFFD may count up to 2 bytes
    more than the cut character had."""
    from msar_jax.data.prepare import DOC_SEPARATOR

    ids = np.asarray(ids, np.int64).reshape(-1)
    if tokenizer.kind == "bytes":
        return int(ids.size)
    eot = tokenizer.eot_id
    cuts = np.flatnonzero(ids == eot) if eot is not None else np.array([], np.int64)
    pieces = np.split(ids, cuts)
    total = sum(len(tokenizer.decode(p[1:] if k else p).encode("utf-8")) for k, p in enumerate(pieces))
    return int(total + len(cuts) * len(DOC_SEPARATOR.encode("utf-8")))


def _prepared_tokens(folder: Path, run) -> np.ndarray:
    from msar_jax import data
    from msar_jax.inference.loading import check_data_tokenizer

    try:
        meta = data.read_meta(folder)
        check_data_tokenizer(folder, meta, run.config)
        recorded = (run.data_used.get("files_sha256") or {}).get("val")
        now = (meta.get("files", {}).get("val.bin") or {}).get("sha256")
        if recorded and now and recorded != now and Path(run.data_used.get("dir", "")) == folder:
            print(f"warning: the val split in {folder} is not the one the run evaluated on (val.bin sha256 "
                  f"{now[:12]}..., config.json data_used records {recorded[:12]}...): the folder was prepared "
                  "again since", file=sys.stderr)
        return np.asarray(data.open_tokens(folder, "val"), np.int64)
    except (OSError, ValueError) as e:
        if isinstance(e, RunError):
            raise
        raise RunError(f"data folder {folder}: {e}") from None


def held_out_tokens(path: str | None, run) -> tuple[np.ndarray, str]:
    """``(tokens, description)`` of ``--data`` (module docstring); ``RunError`` for a path that
    does not exist, holds no text, is not UTF-8 text, or holds another tokenizer's tokens."""
    from msar_jax.data.prepare import BadTextFile, decode_text, load_text_dir, normalize_text

    if path is None:
        recorded = run.data_used.get("dir")
        if recorded and (Path(recorded) / "meta.json").is_file():
            folder = Path(recorded)
        else:  # the recorded folder is gone: prepare the run's data again (train.prepare_data)
            from msar_jax.train.train import prepare_data

            folder, _ = prepare_data(run.config)
        return _prepared_tokens(folder, run), f"val split of {folder}"
    p = Path(path)
    if p.is_dir() and (p / "meta.json").is_file():
        return _prepared_tokens(p, run), f"val split of {p}"
    if p.is_dir():
        try:
            docs, _ = load_text_dir(p)
        except BadTextFile as e:
            raise RunError(f"--data={path}: {e.path} is not text: {e.reason} (evaluate reads UTF-8 .txt files)") from None
        except ValueError as e:
            raise RunError(f"--data={path}: {e}") from None
        texts = [d["text"] for d in docs]
        what = f"{len(texts)} .txt files under {p}"
    elif p.is_file():
        try:
            text, _ = decode_text(p.read_bytes(), p)
        except BadTextFile as e:
            raise RunError(f"--data={path}: not a text file: {e.reason} (evaluate reads UTF-8 text)") from None
        texts = [normalize_text(text)]
        what = str(p)
    else:
        raise RunError(f"--data={path}: no such file or folder")
    tokens = encode_documents([t for t in texts if t], run.tokenizer)
    return tokens, what


# ---------------------------------------------------------------- evaluation

_FORWARD: dict = {}


def _forward(model_def):
    """Jitted ``(params, windows[b, t+1]) -> (summed nll, token-averaged depth weights or None)``."""
    if model_def.graphdef not in _FORWARD:
        import jax
        import jax.numpy as jnp

        _FORWARD.clear()

        def forward(params, windows):
            logits, aux = model_def.merge(params)(windows[:, :-1], collect_weights=True)
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]
            return jnp.sum(nll), aux.get("depth_weights")

        _FORWARD[model_def.graphdef] = jax.jit(forward)
    return _FORWARD[model_def.graphdef]


def window_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None):
    """The ``[b, t+1]`` int32 windows (module docstring): full batches, then (without
    ``max_batches``) the leftover full windows as one batch and the last partial window."""
    n_full = (tokens.size - 1) // seq_len
    n_batches = n_full // batch_size if max_batches is None else min(max_batches, n_full // batch_size)
    if max_batches is not None and n_batches == 0:
        raise RunError(f"--batches={max_batches}: the data has {tokens.size} tokens, {n_full} windows of "
                       f"{seq_len + 1}, less than one batch of {batch_size}")

    def windows(first, count):
        idx = (first + np.arange(count))[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
        return tokens[idx].astype(np.int32)

    for b in range(n_batches):
        yield windows(b * batch_size, batch_size)
    if max_batches is not None:
        return
    left = n_full - n_batches * batch_size
    if left:
        yield windows(n_batches * batch_size, left)
    tail = tokens.size - 1 - n_full * seq_len
    if tail:
        yield tokens[None, n_full * seq_len:].astype(np.int32)


def evaluate_tokens(run, tokens: np.ndarray, max_batches: int | None = None) -> dict:
    """Loss, perplexity, bits per byte and mean depth weights of ``run`` on ``tokens``."""
    import jax

    config = run.config
    tokens = np.asarray(tokens, np.int64).reshape(-1)
    if tokens.size < 2:
        raise RunError(f"the held-out data is {tokens.size} token(s); a loss needs at least 2")
    vocab = int(config.model.vocab_size)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise RunError(f"the held-out data holds token id {int(tokens.max())}, outside the model's vocabulary "
                       f"[0, {vocab})")
    batch_size = int(config.train.eval_batch_size or config.train.batch_size)
    forward = _forward(run.model_def)
    nats, n_targets, weight_sum, batches = 0.0, 0, None, 0
    for windows in window_batches(tokens, batch_size, int(config.seq_len), max_batches):
        total, weights = jax.device_get(forward(run.params, windows))
        count = windows.shape[0] * (windows.shape[1] - 1)
        nats += float(total)
        n_targets += count
        batches += 1
        if weights is not None:
            w = np.asarray(weights, np.float64) * count
            weight_sum = w if weight_sum is None else weight_sum + w
    n_bytes = token_bytes(run.tokenizer, tokens[1:1 + n_targets])
    loss = nats / n_targets
    out = {
        "workdir": str(run.workdir), "step": run.step, "mechanism": config.model.residual.name,
        "tokenizer": run.tokenizer.kind, "batches": batches, "tokens": n_targets, "bytes": n_bytes,
        "loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "bits_per_byte": nats / math.log(2) / n_bytes if n_bytes else None, "depth_weights": None,
    }
    if weight_sum is not None:
        from msar_jax.train.introspection import read_labels, source_labels

        per_read = weight_sum / n_targets  # [L, sources, streams], token-averaged
        mean = per_read.mean(axis=0)
        out["depth_weights"] = {
            "sources": source_labels(config.model, mean.shape[0]),
            "streams": stream_labels(config.model, mean.shape[1]),
            "reads": read_labels(config.model),
            "mean": np.round(mean, 6).tolist(),
            "per_read": np.round(per_read, 6).tolist(),
        }
    return out


def format_report(result: dict) -> str:
    """The human-readable report: the figures, then the depth-weight table."""
    r = result
    lines = [
        f"checkpoint {r['step']} of {r['workdir']} ({r['mechanism']}, {r['tokenizer']} tokens)",
        f"data        {r['data']}",
        f"evaluated   {r['tokens']:,} target tokens ({r['bytes']:,} bytes) in {r['batches']} batches",
        f"loss        {r['loss']:.4f} nats/token",
        f"perplexity  {r['perplexity']:.3f}",
        f"bits/byte   {r['bits_per_byte']:.4f}" if r["bits_per_byte"] is not None else "bits/byte   n/a",
    ]
    dw = r["depth_weights"]
    if dw is None:
        lines.append(f"depth weights: none ({r['mechanism']} has no depth attention)")
        return "\n".join(lines)
    n_reads = len(dw["reads"])
    lines += ["", f"mean depth weights over the {n_reads} sublayer reads (rows: sources, columns: streams)"]
    width = max(9, *(len(s) + 1 for s in dw["streams"]))
    head = max(8, *(len(s) + 1 for s in dw["sources"]))
    lines.append("source".ljust(head) + "".join(s.rjust(width) for s in dw["streams"]))
    for name, row in zip(dw["sources"], dw["mean"]):
        lines.append(name.ljust(head) + "".join(f"{v:{width}.4f}" for v in row))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workdir", required=True, help="a training run's folder (config.json, checkpoints/)")
    ap.add_argument("--checkpoint", type=non_negative_int, default=None,
                    help="checkpoint step (default: the newest that verifies)")
    ap.add_argument("--data", default=None,
                    help="prepared data folder, folder of .txt files or text file (default: the run's val split)")
    ap.add_argument("--batches", type=positive_int, default=None,
                    help="only the first N full batches (default: all of the data)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    return ap.parse_args(argv)


def main(argv=None, out=None) -> dict:
    """Run the command line; returns the result dict (tests call it in-process)."""
    from msar_jax.inference.loading import load_run

    args = parse_args(argv)
    out = sys.stdout if out is None else out
    if args.data is not None and not Path(args.data).exists():
        raise RunError(f"--data={args.data}: no such file or folder")
    run = load_run(args.workdir, args.checkpoint)
    tokens, description = held_out_tokens(args.data, run)
    result = {"data": description, **evaluate_tokens(run, tokens, args.batches)}
    if args.json:
        out.write(json.dumps(result, indent=1) + "\n")
    else:
        out.write(format_report(result) + "\n")
    return result


if __name__ == "__main__":
    run_cli(main)  # a user error: one line, exit status 1
