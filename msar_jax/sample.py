"""Continue a prompt with a trained checkpoint, printing the new text as it is drawn.

    python -m msar_jax.sample --workdir=runs/msar_tiny --prompt="Call me Ishmael." \
        [--checkpoint=STEP] [--max_new_tokens=N] [--temperature=1.0] [--top_k=0] [--top_p=1.0] \
        [--seed=0] [--stop=TEXT ...]

Loads the newest checkpoint of the run folder that verifies (or ``--checkpoint``) with the run's
config.json and the tokenizer of the data it trained on (``msar_jax.inference.loading``), encodes
the prompt, and runs ``msar_jax.inference.sampling.generate``: one prefill over the prompt, then
one cached decoding step per token. The continuation goes to stdout, a one-line summary of what
was loaded to stderr. ``--max_new_tokens`` defaults to what fits in the model's context (at most
200). ``--stop`` (repeatable) is a text of one token that ends the continuation; a BPE tokenizer's
``<|endoftext|>`` always does. Every user error is one line (``error: ...``). Sampling rules:
docs/training.md §9.
"""

from __future__ import annotations

import argparse
import math
import sys

from msar_jax.cli import non_negative_int, positive_int, run_cli
from msar_jax.inference.loading import RunError

DEFAULT_MAX_NEW_TOKENS = 200


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number in (0, 1]")
    return value


class StreamDecoder:
    """Turns a growing list of token ids into the text to print next.

    A token may end inside a character (a byte of a multi-byte UTF-8 character, or a byte-level
    BPE piece), so the text decoded so far is held back while it ends in U+FFFD, the mark of an
    incomplete character; ``flush`` prints whatever is left."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown):], text
        return new

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        new = text[len(self.shown):] if text.startswith(self.shown) else ""
        self.shown = text
        return new


def stop_token_ids(stops, tokenizer) -> list[int]:
    """The ids of ``--stop`` texts (each must encode to exactly one token), plus BPE's end-of-text."""
    ids = []
    for text in stops:
        encoded = tokenizer.encode(text)
        if len(encoded) != 1:
            raise RunError(f"--stop={text!r}: encodes to {len(encoded)} tokens with the checkpoint's "
                           f"{tokenizer.kind} tokenizer; a stop must be exactly one token")
        ids.append(encoded[0])
    if tokenizer.eot_id is not None:
        ids.append(int(tokenizer.eot_id))
    return ids


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workdir", required=True, help="a training run's folder (config.json, checkpoints/)")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--checkpoint", type=non_negative_int, default=None,
                    help="checkpoint step (default: the newest that verifies)")
    ap.add_argument("--max_new_tokens", type=positive_int, default=None,
                    help=f"tokens to add (default: as many as fit in the context, at most {DEFAULT_MAX_NEW_TOKENS})")
    ap.add_argument("--temperature", type=_non_negative_float, default=1.0, help="0 = greedy")
    ap.add_argument("--top_k", type=non_negative_int, default=0, help="keep the k most likely tokens (0 = all)")
    ap.add_argument("--top_p", type=_probability, default=1.0, help="nucleus probability (1 = all)")
    ap.add_argument("--seed", type=non_negative_int, default=0, help="PRNG seed (same seed, same text)")
    ap.add_argument("--stop", action="append", default=[], help="a one-token text that ends the continuation")
    return ap.parse_args(argv)


def main(argv=None, out=None):
    """Run the command line; returns the ``Generation`` (tests call it in-process)."""
    args = parse_args(argv)
    out = sys.stdout if out is None else out
    if not args.prompt:
        raise RunError("--prompt is empty: give the text to continue (at least one character)")

    from msar_jax.inference import loading, sampling

    run = loading.load_run(args.workdir, args.checkpoint)
    tok, model_cfg = run.tokenizer, run.config.model
    prompt = tok.encode(args.prompt)
    context = int(model_cfg.max_seq_len)
    if len(prompt) >= context:
        raise RunError(f"--prompt is {len(prompt)} tokens ({tok.kind} tokenizer), longer than the model's context "
                       f"allows: model.max_seq_len = {context} holds at most {context - 1} prompt tokens and the "
                       "first new one")
    room = context - len(prompt)
    if args.max_new_tokens is None:
        max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
    elif args.max_new_tokens > room:
        raise RunError(f"--max_new_tokens={args.max_new_tokens}: the prompt's {len(prompt)} tokens plus "
                       f"{args.max_new_tokens} new ones exceed the model's context of {context} tokens "
                       f"(model.max_seq_len); at most {room} fit")
    else:
        max_new = args.max_new_tokens
    stops = stop_token_ids(args.stop, tok)
    print(f"checkpoint {run.step} of {run.workdir} ({model_cfg.residual.name}, {model_cfg.n_layers} layers, "
          f"d={model_cfg.d_model}; {tok.kind} tokenizer): prompt {len(prompt)} tokens, up to {max_new} new; "
          f"temperature {args.temperature:g}, top_k {args.top_k}, top_p {args.top_p:g}, seed {args.seed}",
          file=sys.stderr, flush=True)

    stream = StreamDecoder(tok)

    def show(row, token):
        text = stream.push(token)
        if text:
            out.write(text)
            out.flush()

    result = sampling.generate(run.model(), [prompt], max_new_tokens=max_new, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_tokens=stops,
                               max_len=len(prompt) + max_new, on_token=show)
    out.write(stream.flush() + "\n")
    out.flush()
    return result


if __name__ == "__main__":
    run_cli(main)  # a user error: one line, exit status 1
