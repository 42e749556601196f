"""A training run's checkpoint, config and tokenizer, loaded for sampling and evaluation.

``load_run(workdir, step)`` reads ``<workdir>/config.json`` (the config the run trained with and,
under ``data_used``, the prepared data folder and tokenizer it read), picks the newest checkpoint
that verifies or the named ``step`` (``msar_jax.train.checkpoint``, read-only: a broken one is
warned about and skipped, never moved), checks that its saved parameter shapes are those of the
config, restores the params, and rebuilds the tokenizer the data was encoded with, checking it is
that one. Every problem a user can cause is a ``RunError``, one line naming the file and the
rule (a ``ConfigError``, so ``msar_jax.cli.run_cli`` prints it without a traceback). Layout of a
run folder: docs/training.md §3-4.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import ml_collections

from msar_jax.config import ConfigError
from msar_jax.data import tokenizers as tokenizers_lib
from msar_jax.data.prepare import sha256_file

TOKENIZER_FILE = "tokenizer.json"


class RunError(ConfigError):
    """A run folder, checkpoint, tokenizer or data file this command cannot use (one line)."""

    def __init__(self, message: str):
        super().__init__(message)


@dataclasses.dataclass
class LoadedRun:
    """A restored checkpoint: ``config`` (the run's, from ``config.json``), ``model_def`` and
    float32 ``params`` (``msar_jax.train.step.ModelDef``), its ``step``, the ``tokenizer`` of its
    data, and ``data_used`` (``config.json``'s record of the data, or ``{}`` for a run without one)."""

    workdir: Path
    config: ml_collections.ConfigDict
    model_def: Any
    params: dict
    step: int
    tokenizer: Any
    data_used: dict

    def model(self):
        """The ``Transformer`` with the restored params."""
        return self.model_def.merge(self.params)


def read_run_config(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
    """``<workdir>/config.json`` as a ConfigDict (``RunError`` if the folder or file is unusable)."""
    workdir = Path(workdir)
    if not workdir.is_dir():
        raise RunError(f"--workdir={workdir}: no such folder")
    path = workdir / "config.json"
    if not path.is_file():
        raise RunError(f"--workdir={workdir}: no config.json, so not a training run folder "
                       "(python -m msar_jax.train --workdir=... writes one)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["model"]["residual"]["kernel_sizes"] = tuple(raw["model"]["residual"]["kernel_sizes"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise RunError(f"{path}: not a run's config.json ({type(e).__name__}: {e})") from None
    return ml_collections.ConfigDict(raw)


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
    """The steps of the checkpoint folders in ``<workdir>/checkpoints`` (unverified), ascending."""
    folder = Path(workdir) / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.is_dir() and p.name.isdigit())


def data_record(config) -> dict:
    """``config.json``'s ``data_used`` as a plain dict (``{}`` for a run written without one)."""
    used = config.get("data_used")
    if used is None:
        return {}
    return used.to_dict() if isinstance(used, ml_collections.ConfigDict) else dict(used)


def _describe_tokenizer(kind: str, vocab: int, sha: str | None) -> str:
    return f"{kind} tokens (vocab {vocab}" + (f", {TOKENIZER_FILE} sha256 {sha[:12]}...)" if sha else ")")


def run_tokenizer(config, workdir: str | os.PathLike):
    """The tokenizer the run's data was encoded with, checked against ``config.json``'s record.

    Bytes: the fixed 256-id byte tokenizer. BPE: ``tokenizer.json`` of the recorded data folder,
    whose SHA-256 must be the recorded one (a folder prepared again holds another vocabulary:
    every id would mean other text)."""
    used = data_record(config)
    kind = used.get("tokenizer") or config.data.tokenizer
    vocab = int(used.get("vocab_size") or (256 if kind == "bytes" else config.data.vocab_size or 0))
    if kind == "bytes":
        tok = tokenizers_lib.ByteTokenizer()
    elif kind == "bpe":
        folder = Path(used.get("dir") or config.data.dir or ".")
        path = folder / TOKENIZER_FILE
        want = (used.get("files_sha256") or {}).get("tokenizer")
        if not path.is_file():
            raise RunError(f"{path}: missing; the checkpoint's BPE tokenizer is that file of its data folder "
                           f"(config.json data_used.dir), so its token ids cannot be read without it")
        have = sha256_file(path)
        if want and have != want:
            raise RunError(f"tokenizer {path} does not match the checkpoint's data: the folder holds "
                           f"{_describe_tokenizer(kind, vocab, have)}, the run trained on "
                           f"{_describe_tokenizer(kind, vocab, want)} (config.json data_used); the folder "
                           "was prepared again since, so the ids would decode to other text")
        try:
            tok = tokenizers_lib.load_tokenizer(folder)
        except (OSError, ValueError) as e:
            raise RunError(f"{folder}: the checkpoint's tokenizer does not load ({e})") from None
    else:
        raise RunError(f"{Path(workdir) / 'config.json'}: data_used.tokenizer = {kind!r}: not 'bytes' or 'bpe'")
    if tok.vocab_size != vocab:
        raise RunError(f"tokenizer {tok!r} does not match the checkpoint's data: config.json data_used "
                       f"records vocab {vocab}")
    if tok.vocab_size > config.model.vocab_size:
        raise RunError(f"tokenizer vocab {tok.vocab_size} exceeds the model's model.vocab_size = "
                       f"{config.model.vocab_size} (config.json)")
    return tok


def check_data_tokenizer(data_dir: str | os.PathLike, meta: dict, config) -> None:
    """``RunError`` unless the prepared folder ``data_dir`` (its ``meta``) holds tokens of the
    tokenizer the run trained with (kind, vocabulary and, for BPE, ``tokenizer.json``'s SHA-256)."""
    used = data_record(config)
    kind = used.get("tokenizer") or config.data.tokenizer
    vocab = int(used.get("vocab_size") or (256 if kind == "bytes" else 0))
    want = (used.get("files_sha256") or {}).get("tokenizer")
    info = meta.get("tokenizer", {})
    have_kind, have_vocab = info.get("kind"), int(info.get("vocab_size") or 0)
    have = (meta.get("files", {}).get(TOKENIZER_FILE) or {}).get("sha256")
    if (have_kind, have_vocab) != (kind, vocab) or (kind == "bpe" and want and have != want):
        raise RunError(f"data folder {data_dir} does not match the checkpoint's tokenizer: it holds "
                       f"{_describe_tokenizer(have_kind, have_vocab, have)}, the run trained on "
                       f"{_describe_tokenizer(kind, vocab, want)} (config.json data_used)")


def _checkpoint_model(ckpt, step: int) -> dict | None:
    """The model section saved in checkpoint ``step``'s meta (``None`` if it has none)."""
    import orbax.checkpoint as ocp

    try:
        meta = ckpt.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception:  # noqa: BLE001 - an unreadable meta: the shape listing names the params instead
        return None
    return meta.get("model") if isinstance(meta, dict) and isinstance(meta.get("model"), dict) else None


def _check_shapes(ckpt, step: int, config, abstract_params: dict, workdir: Path) -> None:
    import jax

    from msar_jax.train.checkpoint import saved_param_shapes
    from msar_jax.train.train import config_diff

    try:
        saved = saved_param_shapes(ckpt.step_dir(step))
    except Exception:  # noqa: BLE001 - unreadable metadata: the restore names the fault
        return
    wanted = {jax.tree_util.keystr(p): tuple(leaf.shape)
              for p, leaf in jax.tree_util.tree_leaves_with_path(abstract_params)}
    if saved == wanted:
        return
    old = _checkpoint_model(ckpt, step)
    diff = config_diff(old, json.loads(config.model.to_json_best_effort())) if old else []
    if not diff:
        diff = [f"params{k}: {saved.get(k, '(absent)')} -> {wanted.get(k, '(absent)')}"
                for k in sorted(saved.keys() | wanted.keys()) if saved.get(k) != wanted.get(k)]
        diff = diff[:6] + ([f"... {len(diff) - 6} more"] if len(diff) > 6 else [])
    raise RunError(f"checkpoint {step} in {ckpt.directory} is of another model config than "
                   f"{workdir / 'config.json'} (checkpoint -> config.json): {', '.join(diff)}; "
                   "its params do not fit that model")


def load_run(workdir: str | os.PathLike, step: int | None = None) -> LoadedRun:
    """Restore ``workdir``'s checkpoint ``step`` (default: the newest that verifies) with its
    config and tokenizer; ``RunError`` for a folder without config.json or checkpoints, a
    missing or broken named step, a checkpoint of another model config, a tokenizer that is not
    the one of the run's data."""
    from msar_jax.train.checkpoint import Checkpointer
    from msar_jax.train.optim import make_optimizer
    from msar_jax.train.step import abstract_model, abstract_state

    workdir = Path(workdir).resolve()
    config = read_run_config(workdir)
    if not checkpoint_steps(workdir):
        raise RunError(f"--workdir={workdir}: no checkpoint in {workdir / 'checkpoints'} (a run saves one every "
                       "checkpoint.every steps and when it ends)")
    tokenizer = run_tokenizer(config, workdir)
    model_def, abstract_params = abstract_model(config.model)
    tx, _ = make_optimizer(config.optim, config.train.steps)
    target = abstract_state(config.model, tx)
    ckpt = Checkpointer(workdir, async_save=False)
    try:
        chosen = ckpt.select(step, with_data=False, move_broken=False)
        if chosen is None:
            raise RunError(f"--workdir={workdir}: no checkpoint in {ckpt.directory} verifies (each is named above)")
        _check_shapes(ckpt, chosen, config, abstract_params, workdir)
        out = ckpt.restore(target, None, chosen, move_broken=False)
    finally:
        ckpt.close()
    state, _, at = out
    return LoadedRun(workdir, config, model_def, state["params"], int(at), tokenizer, data_record(config))
