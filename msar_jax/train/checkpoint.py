"""orbax checkpoints of a run: train state, data-iterator position, a JSON record and checksums.

``<workdir>/checkpoints/<step>/`` holds the ``state``, ``data`` and ``meta`` items and
``manifest.sha256.json`` (size and SHA-256 of every file). Saves may be asynchronous (``poll``,
``close``); ``verify`` checks a checkpoint before it is restored, and ``resume`` takes the newest
that verifies, moving a broken one to ``<workdir>/checkpoints_broken/``. Layout, manifest and
fallback rules: docs/training.md §4.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

import jax
import orbax.checkpoint as ocp

from msar_jax import data
from msar_jax.config import ConfigError

MANIFEST_NAME = "manifest.sha256.json"
BROKEN_DIR = "checkpoints_broken"
_HASH_CHUNK = 1 << 22  # 4 MiB reads: hashlib releases the GIL on large buffers, so files hash in parallel


class CheckpointError(ConfigError):
    """A checkpoint this run cannot use: an explicit ``--checkpoint`` step that is missing or
    fails verification, a config whose model shapes differ from the checkpoint's, or a
    checkpoint that matches its checksums and still fails to restore.

    A ``ConfigError`` (message-only form) so that every command line prints it as one line."""

    def __init__(self, message: str):
        super().__init__(message)


class BrokenCheckpoint(Exception):
    """``verify`` failed: ``reason`` is a short slug (the moved folder's suffix), ``detail`` the why."""

    def __init__(self, reason: str, detail: str):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}")


def _warn(message: str) -> None:
    if jax.process_index() == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(step_dir: Path) -> list[str]:
    """Every file under ``step_dir`` but the manifest, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*")
                  if p.is_file() and p.name != MANIFEST_NAME and not p.name.startswith(MANIFEST_NAME + "."))


def _hash_files(step_dir: Path, names: list[str]) -> dict[str, str]:
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return dict(zip(names, pool.map(lambda n: _sha256(step_dir / n), names)))


def write_manifest(step_dir: str | os.PathLike) -> Path:
    """Write ``<step_dir>/manifest.sha256.json`` (size and SHA-256 of every file), atomically."""
    step_dir = Path(step_dir)
    names = _files(step_dir)
    digests = _hash_files(step_dir, names)
    files = {n: {"size": (step_dir / n).stat().st_size, "sha256": digests[n]} for n in names}
    path = step_dir / MANIFEST_NAME
    tmp = step_dir / f"{MANIFEST_NAME}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"format": 1, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a reader sees the whole manifest or none
    return path


def verify_step_dir(step_dir: str | os.PathLike, with_data: bool = True) -> bool:
    """Check a checkpoint folder; ``True`` if it matched a manifest, ``False`` if it has none.

    Raises ``BrokenCheckpoint`` on a missing folder or file, a size or checksum mismatch or an
    unreadable manifest."""
    step_dir = Path(step_dir)
    if not step_dir.is_dir():
        raise BrokenCheckpoint("missing", f"{step_dir} is not a folder")
    required = ["state", "meta"] + (["data"] if with_data else [])
    for item in required:
        if not (step_dir / item).is_dir():
            raise BrokenCheckpoint(f"missing-{item}", f"no {item}/ folder")
    if not (step_dir / "state" / "_METADATA").is_file():
        raise BrokenCheckpoint("missing-file", "state/_METADATA is missing")
    if with_data and not any((step_dir / "data").glob("process_*.json")):
        raise BrokenCheckpoint("missing-file", "data/ holds no data-iterator file (process_*.json)")
    manifest = step_dir / MANIFEST_NAME
    if not manifest.exists():
        return False
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        expected = {str(n): (int(e["size"]), str(e["sha256"])) for n, e in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise BrokenCheckpoint("bad-manifest", f"{MANIFEST_NAME} is unreadable ({_one_line(e)})") from None
    for name, (size, _) in expected.items():
        path = step_dir / name
        if not path.is_file():
            raise BrokenCheckpoint("missing-file", f"{name} is missing")
        actual = path.stat().st_size
        if actual != size:
            raise BrokenCheckpoint("size-mismatch", f"{name} has {actual:,} bytes, the manifest says {size:,}")
    digests = _hash_files(step_dir, sorted(expected))
    for name, (_, sha) in sorted(expected.items()):
        if digests[name] != sha:
            raise BrokenCheckpoint("checksum-mismatch", f"{name} does not match its SHA-256 in {MANIFEST_NAME}")
    return True


def saved_param_shapes(step_dir: str | os.PathLike) -> dict[str, tuple]:
    """``{param path: shape}`` of the params saved in a checkpoint (from orbax's metadata)."""
    meta = ocp.StandardCheckpointHandler().metadata(Path(step_dir) / "state")  # the tree's, no step metadata
    return {jax.tree_util.keystr(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_leaves_with_path(meta["params"])}


def param_shapes(abstract_state: dict) -> dict[str, tuple]:
    """``{param path: shape}`` of a (possibly abstract) train state's params."""
    return {jax.tree_util.keystr(p): tuple(leaf.shape)
            for p, leaf in jax.tree_util.tree_leaves_with_path(abstract_state["params"])}


class Checkpointer:
    def __init__(self, workdir: str | os.PathLike, keep: int = 3, async_save: bool = True):
        self.workdir = Path(workdir).resolve()
        self.directory = self.workdir / "checkpoints"
        self.broken_directory = self.workdir / BROKEN_DIR
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._saved: set[int] = set()
        self._pending: list[int] = []  # saved steps whose manifest is not written yet
        self._manifest_jobs: list[concurrent.futures.Future] = []
        self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-manifest")
        self._verified: dict[tuple[int, bool], bool] = {}
        self._warned_unverified = False

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    # ---------------------------------------------------------------- saving

    def save(self, step: int, state: dict, iterator, meta: dict) -> bool:
        """Save (async if configured); a step that already has a checkpoint is skipped."""
        if step in self._saved or step in self.manager.all_steps():
            return False
        # orbax waits for the previous save here anyway; finishing its manifest first also
        # keeps the hashing thread out of a folder that this save's clean-up may delete.
        self._finish_manifests()
        self._saved.add(step)
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=data.checkpoint_save_args(iterator),
            meta=ocp.args.JsonSave(meta),
        )
        saved = self.manager.save(step, args=args, force=True)
        if saved:
            self._pending.append(step)
            self.poll()  # a synchronous save is finished already
        return saved

    def poll(self) -> None:
        """Start hashing the manifests of saves that have finished (cheap; call every step)."""
        if self._pending and not self.manager.is_saving_in_progress():
            steps, self._pending = self._pending, []
            self._manifest_jobs.append(self._hasher.submit(self._write_manifests, steps))

    def _write_manifests(self, steps: list[int]) -> None:
        if jax.process_index() != 0:
            return
        for step in steps:
            step_dir = self.step_dir(step)
            if not step_dir.is_dir():  # the save failed (orbax logged it) or keep removed it
                continue
            try:
                write_manifest(step_dir)
            except OSError as e:  # the checkpoint stays usable, unverified
                _warn(f"could not write the checksum manifest of checkpoint {step} ({_one_line(e)})")

    def _finish_manifests(self) -> None:
        self.manager.wait_until_finished()
        self.poll()
        jobs, self._manifest_jobs = self._manifest_jobs, []
        for job in jobs:
            job.result()

    def wait(self) -> None:
        self._finish_manifests()

    def close(self) -> None:
        try:
            self._finish_manifests()
        finally:
            self._hasher.shutdown(wait=True)
            self.manager.close()

    # ---------------------------------------------------------------- restoring

    def verify(self, step: int, with_data: bool = True) -> bool:
        """``verify_step_dir`` of ``step``: ``True`` if checked against its manifest, ``False``
        if it has none (warned once); raises ``BrokenCheckpoint``. A result is kept, so a
        checkpoint is hashed once per process however often it is asked about."""
        key = (step, with_data)
        if key not in self._verified:
            self._verified[key] = verify_step_dir(self.step_dir(step), with_data)
            if not self._verified[key] and not self._warned_unverified:
                self._warned_unverified = True
                _warn(f"checkpoint {step} in {self.directory} has no {MANIFEST_NAME} (written by an older "
                      "version, or the run stopped before writing it): it cannot be verified and is "
                      "restored as it is")
        return self._verified[key]

    def set_aside(self, step: int, reason: str, detail: str, next_step: int | None = None) -> Path | None:
        """Move a broken checkpoint to ``<workdir>/checkpoints_broken/<step>-<reason>`` (process 0)."""
        target = None
        if jax.process_index() == 0:
            self.broken_directory.mkdir(parents=True, exist_ok=True)
            target = self.broken_directory / f"{step}-{reason}"
            n = 2
            while target.exists():
                target = self.broken_directory / f"{step}-{reason}-{n}"
                n += 1
            if self.step_dir(step).exists():
                shutil.move(str(self.step_dir(step)), str(target))
            then = f"trying step {next_step}" if next_step is not None else "no older checkpoint left"
            _warn(f"checkpoint {step} in {self.directory} is broken ({detail}); moved to {target}; {then}")
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"msar_checkpoint_set_aside_{step}")
        self._verified = {k: v for k, v in self._verified.items() if k[0] != step}
        self.manager.reload()
        return target

    def _skip(self, step: int, reason: str, detail: str, older: list[int], move_broken: bool) -> None:
        nxt = max(older, default=None)
        if move_broken:
            self.set_aside(step, reason, detail, nxt)
        else:
            _warn(f"checkpoint {step} in {self.directory} is broken ({detail}); "
                  + (f"trying step {nxt}" if nxt is not None else "no older checkpoint left"))

    def select(self, step: int | None = None, *, below: int | None = None, with_data: bool = True,
               move_broken: bool = True) -> int | None:
        """The checkpoint to restore: ``step`` if given (``CheckpointError`` if it is missing or
        fails ``verify``; it is left in place), else the newest one (below ``below``) that
        verifies, or ``None``. Broken ones on the way are warned about and, with
        ``move_broken``, moved aside."""
        self.manager.reload()
        steps = sorted(self.manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                listed = ", ".join(map(str, sorted(steps))) or "none"
                raise CheckpointError(f"checkpoint step {step}: no such checkpoint in {self.directory} "
                                      f"(saved steps: {listed})")
            try:
                self.verify(step, with_data)
            except BrokenCheckpoint as e:
                raise CheckpointError(f"checkpoint step {step} in {self.directory} fails verification "
                                      f"({e.detail}); left in place, pick another step") from None
            return step
        candidates = [s for s in steps if below is None or s < below]
        for i, s in enumerate(candidates):
            try:
                self.verify(s, with_data)
                return s
            except BrokenCheckpoint as e:
                self._skip(s, e.reason, e.detail, candidates[i + 1:], move_broken)
        return None

    def _restore_step(self, step: int, abstract_state: dict, iterator) -> tuple[dict, dict]:
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        items = dict(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        if iterator is not None:
            items["data"] = data.checkpoint_restore_args(iterator)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        return out["state"], out["meta"]

    def restore(self, abstract_state: dict, iterator, step: int | None = None, *, move_broken: bool = True,
                check: Callable[[int], None] | None = None) -> tuple[dict, dict, int] | None:
        """Restore ``(state, meta, step)`` (``iterator`` in place), or ``None`` if none restores.

        ``step=None``: the newest checkpoint that verifies and restores; broken ones are warned
        about and moved aside (``move_broken``) on the way. An explicit ``step`` must verify and
        restore (``CheckpointError`` otherwise). ``check(step)`` runs before each restore (the
        caller's shape check; it raises to stop)."""
        explicit = step is not None
        with_data = iterator is not None
        step = self.select(step, with_data=with_data, move_broken=move_broken)
        while step is not None:
            if check is not None:
                check(step)
            try:
                state, meta = self._restore_step(step, abstract_state, iterator)
                return state, meta, step
            except Exception as e:  # noqa: BLE001 - a checkpoint that fails to load is skipped below
                if explicit or self._verified.get((step, with_data)):
                    # Files that match their checksums are as they were written: the fault is
                    # elsewhere (memory, devices, the target), and moving them aside would hide it.
                    raise CheckpointError(f"checkpoint step {step} in {self.directory} failed to restore "
                                          f"({_one_line(e)})") from e
                older = [s for s in self.manager.all_steps() if s < step]
                self._skip(step, "restore-failed", f"restore failed: {_one_line(e)}", older, move_broken)
                step = self.select(below=step, with_data=with_data, move_broken=move_broken)
        return None


def restore_params(workdir: str | os.PathLike, abstract_state: dict, step: int | None = None) -> tuple[dict, int]:
    """The params of a run's checkpoint (default the newest that verifies) and its step.

    Read-only: a broken checkpoint is warned about and skipped, never moved."""
    ckpt = Checkpointer(workdir, async_save=False)
    try:
        out = ckpt.restore(abstract_state, None, step, move_broken=False)
    finally:
        ckpt.close()
    if out is None:
        raise FileNotFoundError(f"no checkpoint in {ckpt.directory} restores")
    state, _, at = out
    return state["params"], int(at)
