"""The training loop: ``train(config, workdir) -> result dict`` and its command line.

    python -m msar_jax.train --config=configs/msar.py:size=tiny --workdir=runs/msar_tiny
    python -m msar_jax.train --config=configs/msar.py:size=small --workdir=W --config.parallel.mesh.fsdp=4

A run builds the mesh of its ``parallel`` config, prepares the data on first use, trains with the
jitted train step, evaluates every ``train.eval_every`` steps, logs ``<workdir>/metrics.jsonl``,
saves verified checkpoints and resumes from the newest good one, stops cleanly on SIGTERM / SIGINT
and with ``NonFiniteLossError`` on a NaN loss. What a run writes, resuming, faults and data:
docs/training.md.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import ml_collections
import numpy as np

from msar_jax import accounting, data
from msar_jax import config as config_lib
from msar_jax.config import ConfigError
from msar_jax.data import token_store
from msar_jax.parallel import layout as layout_lib
from msar_jax.parallel import multihost
from msar_jax.parallel.config import parallel_config
from msar_jax.train import introspection
from msar_jax.train.checkpoint import CheckpointError, Checkpointer, param_shapes, saved_param_shapes
from msar_jax.train.metrics import MetricsLogger, ProgressClock, Throughput
from msar_jax.train.optim import make_optimizer, validate_optim
from msar_jax.train.step import abstract_state, compiled_steps, init_model, init_state

TOKENIZERS = ("bytes", "bpe")


class NonFiniteLossError(RuntimeError):
    """A train step produced a NaN or Inf; ``step`` is the step that failed (1-based)."""

    def __init__(self, step: int, message: str):
        self.step = step
        super().__init__(message)


def _nonneg_int(field, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(field, value, "must be an integer >= 0")


def _pos_int(field, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(field, value, "must be a positive integer")


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Check the model and the training sections; raise ``ConfigError`` naming the field."""
    for section in ("model", "train", "optim", "data", "checkpoint"):
        if section not in config:
            raise ConfigError(section, None, "missing section (build configs with configs/common.make_config)")
    config_lib.validate(config.model)
    _pos_int("seq_len", config.seq_len)
    if config.seq_len > config.model.max_seq_len:
        raise ConfigError("seq_len", config.seq_len, f"must be <= model.max_seq_len = {config.model.max_seq_len}")
    t = config.train
    for name in ("steps", "batch_size", "log_every", "eval_batches"):
        _pos_int(f"train.{name}", t[name])
    for name in ("seed", "eval_every", "eval_batch_size"):
        _nonneg_int(f"train.{name}", t[name])
    grad_accum = t.get("grad_accum", 1)
    _pos_int("train.grad_accum", grad_accum)
    if t.batch_size % grad_accum:
        raise ConfigError("train.grad_accum", grad_accum,
                          f"must divide train.batch_size = {t.batch_size} (microbatches of equal size)")
    validate_optim(config.optim)
    if config.optim.warmup_steps > t.steps:
        raise ConfigError("optim.warmup_steps", config.optim.warmup_steps, f"must be <= train.steps = {t.steps}")
    if config.data.tokenizer not in TOKENIZERS:
        raise ConfigError("data.tokenizer", config.data.tokenizer, f"must be one of {TOKENIZERS}")
    _nonneg_int("data.vocab_size", config.data.vocab_size)
    document_mask = config.data.get("document_mask", False)
    if not isinstance(document_mask, bool):
        raise ConfigError("data.document_mask", document_mask, "must be True or False")
    stages = parallel_section(config).pipeline.stages
    if document_mask and stages > 1:
        raise ConfigError("data.document_mask", document_mask,
                          f"cannot be combined with parallel.pipeline.stages = {stages}: the pipelined loss "
                          "takes token batches only (set one of them off)")
    _nonneg_int("checkpoint.every", config.checkpoint.every)
    _pos_int("checkpoint.keep", config.checkpoint.keep)
    # The parallel section without devices (mesh degrees, pipeline vs layers / batch); the
    # mesh itself is checked against the devices in train() (layout.make_layout).
    layout_lib.validate(parallel_section(config), config.model, t.batch_size, grad_accum=grad_accum)
    return config


def parallel_section(config) -> ml_collections.ConfigDict:
    """``config.parallel``, or the defaults (one device) for a config made without one."""
    return config.parallel if "parallel" in config else parallel_config()


def make_layout(config) -> layout_lib.Layout:
    """The run's mesh (``parallel`` section) over this process's view of the devices, checked
    against the devices, the model and the batch (``ConfigError`` naming the field)."""
    t = config.train
    return layout_lib.make_layout(parallel_section(config), config.model, t.batch_size,
                                  eval_batch_size=t.eval_batch_size or t.batch_size,
                                  grad_accum=t.get("grad_accum", 1))


def prepare_data(config) -> tuple[Path | str, dict]:
    """The prepared data folder of ``config.data`` (built if missing) and its meta.

    ``data.dir`` a token store (a path or a URL, ``msar_jax.data.token_store``): used as is,
    with the store's meta (the root is returned as given, a string).

    ``data.dir`` empty: the cache folder of ``data.source`` (``data.default_out_dir``), prepared
    again whenever the source's content fingerprint changes. ``data.dir`` named: used as is when
    it was made from ``data.source`` as it is now; data made from anything else stops the run
    (``ConfigError``), as do a missing source and a source file that is not UTF-8 text.
    """
    d = config.data
    vocab = d.vocab_size or None
    if d.dir and ("://" in d.dir or token_store.is_store(d.dir) or (Path(d.dir) / "train" / "tokens").exists()):
        try:
            meta = token_store.read_store_meta(d.dir)
        except token_store.StoreError as e:
            raise ConfigError("data.dir", d.dir, str(e)) from None
        if meta["tokenizer"]["vocab_size"] > config.model.vocab_size:
            raise ConfigError("model.vocab_size", config.model.vocab_size,
                              f"must be >= the data's vocabulary ({meta['tokenizer']['vocab_size']}, {d.dir})")
        return d.dir, meta
    out = Path(d.dir) if d.dir else data.default_out_dir(d.source, d.tokenizer, vocab)
    try:
        meta = data.ensure_prepared(out, source=d.source, tokenizer=d.tokenizer, vocab_size=vocab)
    except data.DataMismatchError as e:
        raise ConfigError("data.dir", d.dir, f"{e} (or set data.source to what it was made from)") from None
    except data.BadTextFile as e:
        raise ConfigError("data.source", d.source, f"{e}; to read such a folder, run `python -m "
                          f"msar_jax.data.prepare --source={d.source} [--out=DIR] --encoding=... or "
                          "--skip_bad_files` first (training reuses that folder)") from None
    except FileNotFoundError as e:
        raise ConfigError("data.source", d.source, str(e).removeprefix(f"--source={d.source}: ")) from None
    if meta["tokenizer"]["vocab_size"] > config.model.vocab_size:
        raise ConfigError("model.vocab_size", config.model.vocab_size,
                          f"must be >= the data's vocabulary ({meta['tokenizer']['vocab_size']}, {out})")
    return out, meta


def evaluate(eval_step, params, data_dir, config, meta, put: Callable = jax.device_put) -> dict:
    """Mean validation loss over the first ``train.eval_batches`` val batches, and bits per byte.

    ``put`` turns this process's rows of a batch into the step's input (``Layout.global_eval_batch``
    under a mesh); every process reads its share of each global batch."""
    bs = config.train.eval_batch_size or config.train.batch_size
    batches = data.make_eval_batches(data_dir, bs, config.seq_len, max_batches=config.train.eval_batches,
                                     document_mask=config.data.get("document_mask", False))
    losses = [float(eval_step(params, jax.tree.map(put, b))) for b in batches]
    loss = float(np.mean(losses))
    bytes_per_token = meta.get("bytes_per_token", {}).get("val")
    bpb = loss / math.log(2) / bytes_per_token if bytes_per_token else None
    return {"val_loss": loss, "val_bpb": bpb, "val_tokens": len(losses) * bs * config.seq_len}


def _flat(tree, prefix: str) -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{key}").items()}
    return {prefix: tree}


def config_diff(old_model: dict, new_model: dict) -> list[str]:
    """``["model.d_model: 64 -> 128", ...]``: the fields of two JSON model sections that differ."""
    old, new = _flat(old_model, "model"), _flat(new_model, "model")
    return [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}"
            for k in sorted(old.keys() | new.keys()) if k not in old or k not in new or old[k] != new[k]]


def _saved_model_config(ckpt: Checkpointer, step: int, workdir: Path) -> dict | None:
    """The model section a checkpoint was written with: its meta (``model``), else the run's
    ``config.json`` (checkpoints written before the meta held it)."""
    import orbax.checkpoint as ocp

    try:
        meta = ckpt.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if isinstance(meta, dict) and isinstance(meta.get("model"), dict):
            return meta["model"]
    except Exception:  # noqa: BLE001 - a missing or unreadable meta: fall back to config.json
        pass
    try:
        return json.loads((workdir / "config.json").read_text(encoding="utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_checkpoint_shapes(ckpt: Checkpointer, step: int, config, target_state: dict, workdir: Path) -> None:
    """Stop (``CheckpointError``) if checkpoint ``step``'s params have other shapes than
    ``target_state``'s, naming the model fields that differ (or the params, without a saved config).

    Runs before the run writes anything, so the workdir's ``config.json`` still describes its
    checkpoints."""
    try:
        saved = saved_param_shapes(ckpt.step_dir(step))
    except Exception:  # noqa: BLE001 - unreadable metadata: the restore names the fault
        return
    wanted = param_shapes(target_state)
    if saved == wanted:
        return
    old_model = _saved_model_config(ckpt, step, workdir)
    diff = config_diff(old_model, json.loads(config.model.to_json_best_effort())) if old_model else []
    if not diff:  # no saved config, or one that gives these shapes: name the params instead
        names = sorted(saved.keys() | wanted.keys())
        diff = [f"params{k}: {saved.get(k, '(absent)')} -> {wanted.get(k, '(absent)')}"
                for k in names if saved.get(k) != wanted.get(k)]
        if len(diff) > 6:
            diff = diff[:6] + [f"... {len(diff) - 6} more"]
    raise CheckpointError(
        f"the checkpoints in {ckpt.directory} (step {step}) are of another model shape: {', '.join(diff)}; "
        "nothing was written; use a new --workdir for this config")


class _NoLogger:
    """The metrics logger of a process other than 0 (process 0 writes the run's logs)."""

    def write(self, kind, step, values):
        return values

    def close(self):
        pass


class _SignalStop:
    """SIGTERM / SIGINT set a flag that the loop checks after each step."""

    def __init__(self, enabled: bool):
        self.received = None
        self.previous = {}
        if not enabled:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.received = signal.Signals(signum).name

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, max_steps: int | None = None,
          batch_hook: Callable[[int, np.ndarray], np.ndarray] | None = None,
          step_hook: Callable[[int, dict], None] | None = None,
          handle_signals: bool = True, checkpoint_step: int | None = None) -> dict:
    """Train ``config`` in ``workdir`` (resuming from its newest good checkpoint); return a summary.

    Args:
      max_steps: stop (and checkpoint) once this many steps are done; the schedule still
        spans ``train.steps``. ``None`` = ``train.steps``.
      batch_hook: ``(step, batch) -> batch`` applied to each host batch before the step
        (tests use it to inject faults); ``step`` is the 1-based step about to run.
      step_hook: ``(step, record)`` called after each completed step with its metrics.
      handle_signals: install the SIGTERM / SIGINT handlers (main thread only).
      checkpoint_step: resume from this checkpoint step (``--checkpoint``) instead of the
        newest; ``CheckpointError`` if it does not exist or fails verification.

    Returns a dict: ``step`` (steps done), ``stopped`` ("done", "max_steps", "SIGTERM" or
    "SIGINT"), ``losses`` ([step, loss] of the steps run in this call), ``final_loss``,
    ``val_loss``, ``val_bpb``, ``unigram_val_nats``, ``checkpoint_step``, ``resumed_from``,
    ``wall_time_s``, ``tokens_per_s`` (mean after the first step), ``workdir``, ``depth_weights``
    (path prefix or None), ``data_dir``, ``mesh`` (axis -> degree) and ``pipeline`` (the
    ``parallel.pipeline`` settings, or None without a pipeline).
    """
    t_start = time.perf_counter()
    validate(config)
    pcfg = parallel_section(config)
    multihost.maybe_initialize(pcfg.distributed.initialize)  # before anything touches the devices
    layout = make_layout(config)
    primary = jax.process_index() == 0
    if primary:
        print(f"mesh: {layout.describe()}", file=sys.stderr, flush=True)
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    data_dir, meta = prepare_data(config)  # before config.json, which records the data actually used
    t = config.train
    tx, schedule = make_optimizer(config.optim, t.steps)
    ckpt = Checkpointer(workdir, keep=config.checkpoint.keep, async_save=config.checkpoint.async_save)
    # Choose the checkpoint (verified; broken ones moved aside) and check its shapes against this
    # config before anything is written, so a run with another model leaves config.json as it was.
    target = abstract_state(config.model, tx)
    resume_step = None
    try:
        if checkpoint_step is not None or config.checkpoint.resume:
            resume_step = ckpt.select(checkpoint_step)
        if resume_step is not None:
            check_checkpoint_shapes(ckpt, resume_step, config, target, workdir)
    except BaseException:
        ckpt.close()
        raise
    if primary:
        used = (token_store.provenance(data_dir, meta) if meta.get("format") == token_store.FORMAT
                else data.provenance(data_dir, meta))
        record = json.loads(config.to_json_best_effort()) | {"data_used": used}
        (workdir / "config.json").write_text(json.dumps(record, indent=2), encoding="utf-8")
    total = t.steps
    end = total if max_steps is None else min(max_steps, total)

    # This process's rows of every global batch (all of them on a single process).
    iterator = multihost.train_iterator(data_dir, t.batch_size, config.seq_len, t.seed,
                                        document_mask=config.data.get("document_mask", False))
    resume = resume_step is not None
    if layout.single_device:  # the plain path: arrays on the default device
        model_def, params = init_model(config.model, t.seed)
        # Committed to the device, as a restored state is: with uncommitted arrays the first
        # step compiles for unspecified shardings and a resume in the same process (a notebook,
        # a test) compiled the train and eval steps a second time.
        state = init_state(params, tx)
        state = jax.device_put(state, next(iter(jax.tree.leaves(state)[0].devices())))  # the default device
        put_batch, put_eval_batch = jax.device_put, jax.device_put
    else:  # created (or restored) in the layout's shardings, never whole on one device
        if resume:
            model_def, state, _ = layout.restore_target(config.model, tx)
        else:
            model_def, state, _ = layout.init_state(config.model, tx, t.seed)
        put_batch, put_eval_batch = layout.global_batch, layout.global_eval_batch

    resumed_from = None
    if resume:  # into this layout, whatever mesh the checkpoint was written under
        try:
            restored = ckpt.restore(state, iterator, checkpoint_step,
                                    check=lambda s: check_checkpoint_shapes(ckpt, s, config, target, workdir))
        except BaseException:
            ckpt.close()
            raise
        if restored is not None:
            state, _, _ = restored
            resumed_from = int(state["step"])
        else:  # every checkpoint was broken (each one named and moved aside): start afresh
            print(f"warning: no checkpoint in {ckpt.directory} restores; training from step 0",
                  file=sys.stderr, flush=True)
            iterator = multihost.train_iterator(data_dir, t.batch_size, config.seq_len, t.seed,
                                        document_mask=config.data.get("document_mask", False))  # unread
            if not layout.single_device:  # ``state`` is the restore target there, not a state
                model_def, state, _ = layout.init_state(config.model, tx, t.seed)
    start = int(state["step"])

    train_step, eval_step = compiled_steps(config, model_def, tx, schedule, layout)
    try:
        flops_per_token = accounting.account(config)["flops"]["train"]["model_total"]
    except Exception:  # accounting is informative only; never block a run on it
        flops_per_token = None
    peak = accounting.peak_flops(jax.devices()[0])
    if peak is not None:
        peak *= layout.mesh.size  # the whole mesh works on one step
    tokens_per_step = t.batch_size * config.seq_len
    throughput = Throughput(tokens_per_step, flops_per_token, peak)
    logger = MetricsLogger(workdir, tensorboard=t.tensorboard) if primary else _NoLogger()
    stop = _SignalStop(handle_signals)

    from tqdm.auto import tqdm

    # tqdm's own rate and remaining time would count the first step's compile time (5 hours
    # remaining at step 1 of a 30-minute run); ProgressClock starts after that step.
    bar = tqdm(total=end, initial=start, disable=not (t.progress and primary),
               desc=f"train {config.model.residual.name}", unit="step", dynamic_ncols=True, mininterval=0.5,
               file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
    clock = ProgressClock(end)
    evaluated = False  # the first evaluation of this process compiles the eval step
    bar.set_postfix_str(clock.describe(), refresh=False)
    losses, speeds = [], []
    last_eval = None
    stopped = "done" if end == total else "max_steps"
    step = start
    failure = None

    def run_eval():
        return {"step": step, **evaluate(eval_step, state["params"], data_dir, config, meta, put_eval_batch)}

    model_json = json.loads(config.model.to_json_best_effort())  # in each checkpoint's meta: the shape check

    def save(reason):
        return ckpt.save(step, state, iterator, {"step": step, "reason": reason, "time": time.time(),
                                                 "loss": losses[-1][1] if losses else None,
                                                 "model": model_json})

    try:
        throughput.start()
        while step < end:
            batch = next(iterator)
            if batch_hook is not None:
                batch = batch_hook(step + 1, batch)
            state, m = train_step(state, jax.tree.map(put_batch, batch))  # a dict with document_mask
            m = jax.device_get(m)
            speed = throughput.tick()
            if not bool(m["finite"]):
                good = ckpt.latest_step()
                failure = NonFiniteLossError(
                    step + 1,
                    f"non-finite training values at step {step + 1} (loss={float(m['loss'])}, "
                    f"grad_norm={float(m['grad_norm'])}, update_norm={float(m['update_norm'])}); the update "
                    f"was not applied and nothing was saved; "
                    + (f"last good checkpoint: {good} in {ckpt.directory}" if good is not None
                       else f"no checkpoint saved yet in {ckpt.directory}"),
                )
                break
            step += 1
            loss = float(m["loss"])
            losses.append([step, loss])
            if step > start + 1:
                speeds.append(speed["tokens_per_s"])
            record = {k: float(v) for k, v in m.items() if k != "finite"} | speed
            if step % t.log_every == 0 or step == end:
                logger.write("train", step, record)
            clock.tick(step)
            bar.set_postfix_str(f"{clock.describe()}, loss={loss:.3f}, tok_s={speed['tokens_per_s']:,.0f}",
                                refresh=False)
            bar.update(1)
            ckpt.poll()  # hash the manifest of a finished async save in the background
            if step_hook is not None:
                step_hook(step, record)
            if (t.eval_every and step % t.eval_every == 0) or step == total:
                if not evaluated:  # this one compiles the eval step: not in the bar's rate
                    clock.pause()
                last_eval = run_eval()
                if not evaluated:
                    clock.resume()
                    evaluated = True
                logger.write("eval", step, {k: v for k, v in last_eval.items() if k != "step"})
                bar.write(f"step {step}: val loss {last_eval['val_loss']:.4f}"
                          + (f" ({last_eval['val_bpb']:.3f} bits/byte)" if last_eval["val_bpb"] else ""))
                throughput.start()  # do not charge the evaluation to the next step
            if config.checkpoint.every and step % config.checkpoint.every == 0:
                save("periodic")
                throughput.start()
            if stop.received:
                stopped = stop.received
                bar.write(f"{stop.received} received: saving a checkpoint at step {step} and stopping")
                break
        if failure is None:
            if last_eval is None or last_eval["step"] != step:
                last_eval = run_eval()
                logger.write("eval", step, {k: v for k, v in last_eval.items() if k != "step"})
            save(stopped)
    finally:
        bar.close()
        stop.restore()
        ckpt.close()  # waits for in-flight (good) saves
        logger.close()

    if failure is not None:
        raise failure

    depth_path = None
    if t.depth_weights and step > 0 and jax.process_count() > 1:
        print("note: depth-attention introspection is skipped in a multi-process run "
              "(python -m msar_jax.train.introspection reads it from the checkpoint)", file=sys.stderr)
    elif t.depth_weights and step > 0:
        batch = introspection.default_batch(data_dir, config)
        try:
            weights = introspection.depth_weights(model_def, state["params"], batch)
        except Exception as e:  # introspection must never cost a finished run
            print(f"warning: depth-attention introspection failed: {e!r}", file=sys.stderr)
            weights = None
        if weights is not None:
            depth_path = str(workdir / "depth_weights")
            introspection.save(weights, depth_path, config, step)

    return {
        "workdir": str(workdir),
        "data_dir": str(data_dir),
        "step": step,
        "stopped": stopped,
        "resumed_from": resumed_from,
        "losses": losses,
        "final_loss": losses[-1][1] if losses else None,
        "val_loss": last_eval["val_loss"] if last_eval else None,
        "val_bpb": last_eval["val_bpb"] if last_eval else None,
        "unigram_val_nats": meta.get("unigram_entropy", {}).get("val_nats_per_token"),
        "checkpoint_step": step,
        "tokens_per_s": float(np.mean(speeds)) if speeds else None,
        "wall_time_s": time.perf_counter() - t_start,
        "depth_weights": depth_path,
        "mesh": dict(layout.mesh.shape),
        "pipeline": dict(pcfg.pipeline) if layout.pipelined else None,
    }


def main() -> None:
    """``python -m msar_jax.train --config=PATH[:ARGS] --workdir=DIR [--config.a.b=V ...] [--max_steps=N]
    [--checkpoint=STEP]``."""
    from absl import app, flags
    from ml_collections import config_flags

    from msar_jax.config import REPO_ROOT

    from msar_jax.cli import run_absl_cli

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # config files import configs.common
    config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/msar.py:size=tiny (or :smoke=1).",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Run folder: logs, checkpoints (resumed from if present), plots.")
    flags.DEFINE_integer("max_steps", None, "Stop after this many steps (the schedule still spans train.steps).",
                         lower_bound=1)
    flags.DEFINE_integer("checkpoint", None, "Resume from this checkpoint step (default: the newest that verifies).",
                         lower_bound=0)
    flags.mark_flags_as_required(["config", "workdir"])
    FLAGS = flags.FLAGS

    def run(argv):
        from absl import logging

        logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
        if len(argv) > 1:
            raise app.UsageError(f"unexpected arguments: {argv[1:]}")
        try:
            result = train(FLAGS.config, FLAGS.workdir, max_steps=FLAGS.max_steps, checkpoint_step=FLAGS.checkpoint)
        except (ConfigError, NonFiniteLossError) as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        summary = {k: v for k, v in result.items() if k != "losses"}
        print(json.dumps(summary, indent=2))

    run_absl_cli(run)  # config and flag errors: one line, no traceback (msar_jax/cli.py)
