"""grain input pipeline: ``[B, T+1]`` int32 token windows from a prepared folder or a token store.

``make_train_iterator`` shuffles non-overlapping windows every epoch and gives each process its
contiguous slice of the global batch (``make_global_batch`` assembles them); its state is saved in
a checkpoint (``checkpoint_save_args`` / ``checkpoint_restore_args``) for an exact continuation.
Evaluation windows overlap by one token so every val token is a target once. Windows, strides and
the multi-process split, token stores (``msar_jax.data.token_store``, read through tensorstore,
also from a bucket) and ``document_mask``'s segment ids: docs/training.md §6.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import grain
import jax
import numpy as np

from msar_jax.data import token_store

_SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}


# --------------------------------------------------------------------------- #
# token files
# --------------------------------------------------------------------------- #
def _read_dtype(data_dir: Path) -> np.dtype:
    meta_path = data_dir / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{meta_path} not found: {data_dir} is not a prepared data folder. Create it with "
            f"`python -m msar_jax.data.prepare --out={data_dir}` or msar_jax.data.ensure_prepared()."
        )
    try:
        return np.dtype(json.loads(meta_path.read_text(encoding="utf-8"))["dtype"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{meta_path} is not a valid meta.json (no usable 'dtype'): {e}") from e


def open_tokens(data_dir: str | os.PathLike, split: str = "train") -> np.ndarray:
    """Memory-map ``<data_dir>/<split>.bin`` with the dtype from ``meta.json``."""
    if split not in _SPLIT_FILES:
        raise ValueError(f"split must be one of {sorted(_SPLIT_FILES)}, got {split!r}")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data folder {data_dir} does not exist; create it with "
                                f"`python -m msar_jax.data.prepare --out={data_dir}`")
    dtype = _read_dtype(data_dir)
    path = data_dir / _SPLIT_FILES[split]
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} not found (re-run msar_jax.data.prepare)")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"token file {path} is empty")
    if size % dtype.itemsize:
        raise ValueError(f"token file {path} has {size} bytes, not a multiple of "
                         f"{dtype.itemsize} ({dtype.name}); the file is truncated or the dtype is wrong")
    return np.memmap(path, dtype=dtype, mode="r")


def _check_positive(**kw: Any) -> None:
    for k, v in kw.items():
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{k} must be a positive integer, got {v!r}")


def num_windows(num_tokens: int, seq_len: int, stride: int) -> int:
    """How many windows of ``seq_len + 1`` tokens start at multiples of ``stride``."""
    if num_tokens < seq_len + 1:
        return 0
    return (num_tokens - (seq_len + 1)) // stride + 1


def _resolve_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    if process_index is None and process_count is None:
        return jax.process_index(), jax.process_count()
    if process_index is None or process_count is None:
        raise ValueError("pass both process_index and process_count, or neither")
    _check_positive(process_count=process_count)
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
    return int(process_index), int(process_count)


class _BinSource:
    """A prepared folder's ``<split>.bin``, memory-mapped."""

    def __init__(self, data_dir, split: str):
        self.data_dir, self.split = Path(data_dir), split
        self.tokens = open_tokens(data_dir, split)
        self.size = int(self.tokens.size)
        self.name = f"{split}.bin in {data_dir}"
        self._doc_starts: np.ndarray | None = None

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        return self.tokens[starts[:, None] + np.arange(length, dtype=np.int64)]

    @property
    def doc_starts(self) -> np.ndarray:
        """Documents start after each separator that prepare joined them with (meta.json)."""
        if self._doc_starts is None:
            meta_path = self.data_dir / "meta.json"
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if "tokenizer" not in meta:
                raise ValueError(f"{meta_path} records no tokenizer, so its document separator is "
                                 "unknown; document_mask needs a folder made by msar_jax.data.prepare")
            self._doc_starts = token_store.separator_doc_starts(self.tokens, token_store.bin_separator(meta))
        return self._doc_starts


class _StoreSource:
    """A token store's split, read through tensorstore (one read per window, issued together)."""

    def __init__(self, root, split: str, cache_bytes: int):
        self.split_reader = token_store.open_split(root, split, cache_bytes=cache_bytes)
        self.size = self.split_reader.num_tokens
        self.name = f"token store {root}, split {split!r}"

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        return self.split_reader.read_windows(starts, length)

    @property
    def doc_starts(self) -> np.ndarray:
        return self.split_reader.doc_starts


def open_source(data_dir, split: str = "train", cache_bytes: int = token_store.DEFAULT_CACHE_BYTES):
    """The tokens of ``split`` in a prepared ``.bin`` folder or a token store (``is_store``).

    A URL, a complete store or a folder holding store arrays (an incomplete store: its error
    names the missing meta.json) is read as a store; any other path as a ``.bin`` folder."""
    if split not in _SPLIT_FILES:
        raise ValueError(f"split must be one of {sorted(_SPLIT_FILES)}, got {split!r}")
    root = str(data_dir)
    if "://" in root or token_store.is_store(root) or (Path(root) / split / "tokens").exists():
        return _StoreSource(root, split, cache_bytes)
    return _BinSource(data_dir, split)


def segment_ids(doc_starts: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    """``[len(starts), length]`` int32: the document index within each window.

    0 for the piece of the document the window starts in, +1 at every document start inside
    the window (``doc_starts``: ascending first tokens of the documents)."""
    starts = np.asarray(starts, dtype=np.int64)
    positions = starts[:, None] + np.arange(length, dtype=np.int64)
    first = np.searchsorted(doc_starts, starts, side="right")
    return (np.searchsorted(doc_starts, positions, side="right") - first[:, None]).astype(np.int32)


class _GatherWindows:
    """Map a global batch of window indices to this process's ``[B/P, T+1]`` int32 rows
    (a dict of ``tokens`` and ``segment_ids`` with ``document_mask``)."""

    def __init__(self, source, seq_len: int, stride: int, lo: int, hi: int, document_mask: bool):
        self.source, self.length, self.stride, self.lo, self.hi = source, seq_len + 1, stride, lo, hi
        self.doc_starts = source.doc_starts if document_mask else None

    def __call__(self, window_ids: np.ndarray):
        starts = np.asarray(window_ids, dtype=np.int64)[self.lo:self.hi] * self.stride
        tokens = np.asarray(self.source.windows(starts, self.length), dtype=np.int32)
        if self.doc_starts is None:
            return tokens
        return {"tokens": tokens, "segment_ids": segment_ids(self.doc_starts, starts, self.length)}


def _windows_dataset(data_dir, split, batch_size, seq_len, stride, process_index, process_count,
                     document_mask=False, cache_bytes=token_store.DEFAULT_CACHE_BYTES):
    _check_positive(batch_size=batch_size, seq_len=seq_len, stride=stride)
    p, n_proc = _resolve_process(process_index, process_count)
    if batch_size % n_proc:
        raise ValueError(f"global batch_size={batch_size} is not divisible by process_count={n_proc}")
    source = open_source(data_dir, split, cache_bytes)
    n_win = num_windows(source.size, seq_len, stride)
    if n_win == 0:
        raise ValueError(f"{source.name} has {source.size} tokens, fewer than "
                         f"seq_len + 1 = {seq_len + 1}; use a shorter seq_len or more data")
    local = batch_size // n_proc
    return source, n_win, _GatherWindows(source, seq_len, stride, p * local, (p + 1) * local,
                                         bool(document_mask))


# --------------------------------------------------------------------------- #
# train / eval
# --------------------------------------------------------------------------- #
def make_train_dataset(data_dir: str | os.PathLike, split: str = "train", batch_size: int = 8,
                       seq_len: int = 128, seed: int = 0, process_index: int | None = None,
                       process_count: int | None = None, num_epochs: int | None = None,
                       stride: int | None = None, *, document_mask: bool = False,
                       cache_bytes: int = token_store.DEFAULT_CACHE_BYTES) -> grain.MapDataset:
    """The grain ``MapDataset`` behind ``make_train_iterator`` (element = ``[B/P, T+1]`` int32,
    or with ``document_mask`` a dict of ``tokens`` and ``segment_ids``)."""
    stride = seq_len + 1 if stride is None else stride
    _check_positive(num_epochs=num_epochs)
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    _, n_win, gather = _windows_dataset(data_dir, split, batch_size, seq_len, stride,
                                        process_index, process_count, document_mask, cache_bytes)
    if num_epochs is not None and n_win * num_epochs < batch_size:
        raise ValueError(f"{split} has only {n_win} windows of {seq_len + 1} tokens (stride {stride}); "
                         f"{num_epochs} epoch(s) cannot fill one global batch of {batch_size}")
    ds = grain.MapDataset.range(n_win).shuffle(seed=int(seed)).repeat(num_epochs)
    return ds.batch(batch_size, drop_remainder=True).map(gather)


def make_train_iterator(data_dir: str | os.PathLike, split: str = "train", batch_size: int = 8,
                        seq_len: int = 128, seed: int = 0, process_index: int | None = None,
                        process_count: int | None = None, num_epochs: int | None = None, *,
                        stride: int | None = None, num_threads: int = 1,
                        prefetch_buffer_size: int = 2, document_mask: bool = False,
                        cache_bytes: int = token_store.DEFAULT_CACHE_BYTES) -> grain.DatasetIterator:
    """Shuffled, repeated ``[batch_size // process_count, seq_len + 1]`` int32 batches.

    Args:
      data_dir: a prepared folder (``meta.json`` + ``<split>.bin``) or a token store root
        (a path or a kvstore URL such as ``gs://bucket/prefix``; ``msar_jax.data.token_store``).
      split: ``"train"`` or ``"val"``.
      batch_size: GLOBAL batch size B; must be divisible by ``process_count``.
      seq_len: T; each row has T+1 tokens.
      seed: shuffle seed in ``[0, 2**32)``; each epoch gets its own permutation.
      process_index, process_count: default ``jax.process_index()/process_count()``;
        the process gets rows ``[i*B/P, (i+1)*B/P)`` of every global batch.
      num_epochs: ``None`` repeats forever; otherwise the stream is
        ``num_epochs`` concatenated permutations, cut into full batches.
      stride: window start spacing (default ``seq_len + 1``: non-overlapping).
      num_threads, prefetch_buffer_size: grain ``ReadOptions`` (threads only): batches read
        ahead while the caller trains on the current one.
      document_mask: yield ``{"tokens", "segment_ids"}`` (both ``[B/P, T+1]`` int32; segment
        ids count the document starts inside each window, ``segment_ids``).
      cache_bytes: a store's chunk cache bound (tensorstore ``cache_pool``).

    Returns:
      A grain ``DatasetIterator`` (``next()``, ``get_state()``, ``set_state()``).
    """
    ds = make_train_dataset(data_dir, split, batch_size, seq_len, seed, process_index,
                            process_count, num_epochs, stride, document_mask=document_mask,
                            cache_bytes=cache_bytes)
    opts = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch_buffer_size)
    return iter(ds.to_iter_dataset(opts))


def num_eval_batches(data_dir: str | os.PathLike, batch_size: int, seq_len: int, split: str = "val",
                     stride: int | None = None) -> int:
    """Number of full batches ``make_eval_batches`` yields (before ``max_batches``)."""
    stride = seq_len if stride is None else stride
    _check_positive(batch_size=batch_size, seq_len=seq_len, stride=stride)
    return num_windows(open_source(data_dir, split).size, seq_len, stride) // batch_size


def make_eval_batches(data_dir: str | os.PathLike, batch_size: int, seq_len: int,
                      max_batches: int | None = None, *, split: str = "val",
                      stride: int | None = None, process_index: int | None = None,
                      process_count: int | None = None, document_mask: bool = False,
                      cache_bytes: int = token_store.DEFAULT_CACHE_BYTES) -> Iterator[np.ndarray]:
    """One deterministic, in-order pass over ``split``: ``[B/P, T+1]`` int32 batches.

    Windows start at ``0, stride, 2*stride, ...`` (default ``stride = seq_len``,
    so each val token after the first is a target exactly once); only full
    global batches are yielded (the last ``num_windows % B`` windows are
    dropped), at most ``max_batches`` of them. Process sharding, stores and ``document_mask``
    as in training.
    Raises ``ValueError`` if not even one full batch fits.
    """
    stride = seq_len if stride is None else stride
    _check_positive(max_batches=max_batches)
    source, n_win, gather = _windows_dataset(data_dir, split, batch_size, seq_len, stride,
                                             process_index, process_count, document_mask, cache_bytes)
    n_batches = n_win // batch_size
    if n_batches == 0:
        raise ValueError(f"{source.name} has {source.size} tokens = {n_win} windows of "
                         f"{seq_len + 1} (stride {stride}), less than one batch of {batch_size}")
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    ds = grain.MapDataset.range(n_batches * batch_size).batch(batch_size).map(gather)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)))


# --------------------------------------------------------------------------- #
# device arrays and checkpoints
# --------------------------------------------------------------------------- #
def make_global_batch(local_batch: np.ndarray, mesh: jax.sharding.Mesh | None = None,
                      sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """Assemble each process's rows into one global ``jax.Array`` (batch dim sharded).

    * ``sharding`` given: used as is.
    * else ``mesh`` given: ``NamedSharding(mesh, P(axis))`` with ``axis = "data"``
      if the mesh has it, else the mesh's first axis.
    * neither, single process: plain ``jax.device_put(local_batch)``.
    * neither, several processes: a 1-D ``"data"`` mesh over ``jax.devices()``.

    Uses ``jax.make_array_from_process_local_data``; the global batch is
    ``local_batch.shape[0] * jax.process_count()`` rows. A dict batch (``document_mask``) gives
    a dict of such arrays.
    """
    if isinstance(local_batch, dict):  # document_mask batches: tokens and segment ids alike
        return {k: make_global_batch(v, mesh, sharding) for k, v in local_batch.items()}
    local_batch = np.asarray(local_batch)
    if sharding is None:
        if mesh is None:
            if jax.process_count() == 1:
                return jax.device_put(local_batch)
            mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
        axis = "data" if "data" in mesh.axis_names else mesh.axis_names[0]
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    global_shape = (local_batch.shape[0] * jax.process_count(), *local_batch.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local_batch, global_shape)


def checkpoint_save_args(iterator: grain.DatasetIterator):
    """``grain.checkpoint.CheckpointSave(iterator)`` for ``ocp.args.Composite(data=...)``."""
    return _grain_ckpt().CheckpointSave(iterator)


def checkpoint_restore_args(iterator: grain.DatasetIterator):
    """``grain.checkpoint.CheckpointRestore(iterator)``; restores ``iterator`` in place."""
    return _grain_ckpt().CheckpointRestore(iterator)


def _grain_ckpt():
    from grain import checkpoint as gc  # imports orbax when it is installed
    if not hasattr(gc, "CheckpointSave"):
        raise ImportError("grain.checkpoint.CheckpointSave is unavailable: orbax-checkpoint "
                          "is not installed (pip install orbax-checkpoint)")
    return gc


def save_iterator_state(iterator: grain.DatasetIterator, path: str | os.PathLike) -> None:
    """Write ``iterator.get_state()`` as JSON (no orbax needed)."""
    Path(path).write_text(json.dumps(iterator.get_state()), encoding="utf-8")


def restore_iterator_state(iterator: grain.DatasetIterator, path: str | os.PathLike) -> None:
    """``iterator.set_state(...)`` from a file written by ``save_iterator_state``."""
    iterator.set_state(json.loads(Path(path).read_text(encoding="utf-8")))
